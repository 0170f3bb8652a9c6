//! CUDA costs of the runtime against bare cudarc, in one process:
//!
//! - `eager`: time per dispatch of a trivial three-argument kernel through
//!   Encore (encode, commit, wait) against a bare loop of `cuLaunchKernel`;
//! - `graph`: time per node replaying a 500-node chain as an Encore graph
//!   against a bare stream-captured CUDA graph;
//! - `retention`: a 500-dispatch step binding the same buffers (two
//!   allocations retained) against one binding a distinct output each (501),
//!   and the bare loop; plus the host cost of encoding alone;
//! - `copy`: a device-to-device copy kernel's bandwidth against
//!   `cuMemcpyDtoDAsync` on 1 GiB, counting bytes read plus written.
//!
//! Device times come from CUDA events, after warm-up; every figure is the
//! median of the repetitions. Each result is one JSON line; a table follows.
//! Run on a GPU machine: `cargo bench --bench cuda` (or the staged binary).
//! The kernels' CUDA sources are the files in `benches/cuda/`.

use std::error::Error;
use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUevent, CUresult, CUstream};
use encore::{Arg, Buffer, Config, CudaKernel, Device, Encoder, Kernel, KernelDef, Launch};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// A CUDA kernel from `benches/cuda/`, launched with blocks of 256 threads
/// over its one value argument, an element count `n`.
fn over_n(source: &str, entry: &str) -> KernelDef {
    KernelDef::new(entry).cuda(CudaKernel::new(source, entry, |n: &u64| {
        Launch::cover(*n as u32, 256)
    }))
}

fn check(code: CUresult, what: &str) -> Result<()> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {code:?}").into())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// A bare cudarc stream with a pair of timing events.
struct Bare {
    stream: CUstream,
    start: CUevent,
    end: CUevent,
}

impl Bare {
    fn new() -> Result<Bare> {
        // The primary context, as cudarc's own `CudaContext` would use it.
        cudarc::driver::result::init()?;
        let dev = cudarc::driver::result::device::get(0)?;
        // SAFETY: retains and binds the primary context of device 0; it is
        // never released (the process ends after the benchmark).
        unsafe {
            let ctx = cudarc::driver::result::primary_ctx::retain(dev)?;
            cudarc::driver::result::ctx::set_current(ctx)?;
        }
        let mut stream: CUstream = std::ptr::null_mut();
        let (mut start, mut end): (CUevent, CUevent) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: creates a stream and two events in the current context.
        unsafe {
            check(sys::cuStreamCreate(&mut stream, 1), "cuStreamCreate")?;
            check(sys::cuEventCreate(&mut start, 0), "cuEventCreate")?;
            check(sys::cuEventCreate(&mut end, 0), "cuEventCreate")?;
        }
        Ok(Bare { stream, start, end })
    }

    /// Runs `enqueue` between the two events; returns (enqueue, wall, device) time.
    fn time(&self, enqueue: impl FnOnce() -> Result<()>) -> Result<(Duration, Duration, Duration)> {
        let t0 = Instant::now();
        // SAFETY: records and waits on this stream's events.
        unsafe { check(sys::cuEventRecord(self.start, self.stream), "cuEventRecord")? };
        enqueue()?;
        let queued = t0.elapsed();
        let mut ms = 0f32;
        // SAFETY: as above.
        unsafe {
            check(sys::cuEventRecord(self.end, self.stream), "cuEventRecord")?;
            check(sys::cuEventSynchronize(self.end), "cuEventSynchronize")?;
            check(
                sys::cuEventElapsedTime(&mut ms, self.start, self.end),
                "cuEventElapsedTime",
            )?;
        }
        Ok((
            queued,
            t0.elapsed(),
            Duration::from_secs_f64(f64::from(ms) / 1e3),
        ))
    }

    /// Launches `f` `count` times with three parameters, like Encore's dispatches.
    fn launches(&self, f: sys::CUfunction, x: u64, y: u64, n: u32, count: usize) -> Result<()> {
        let (mut x, mut y, mut n) = (x, y, n);
        let mut params: [*mut c_void; 3] = [
            (&mut x as *mut u64).cast(),
            (&mut y as *mut u64).cast(),
            (&mut n as *mut u32).cast(),
        ];
        for _ in 0..count {
            // SAFETY: `f` takes (const float*, float*, unsigned int); the
            // parameter values live across the call.
            let code = unsafe {
                sys::cuLaunchKernel(
                    f,
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    self.stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            check(code, "cuLaunchKernel")?;
        }
        Ok(())
    }
}

fn alloc_raw(bytes: usize) -> Result<u64> {
    let mut p = 0u64;
    // SAFETY: allocates device memory in the current context.
    unsafe { check(sys::cuMemAlloc_v2(&mut p, bytes), "cuMemAlloc")? };
    Ok(p)
}

fn json(fields: &[(&str, String)]) {
    let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    println!("{{{}}}", body.join(","));
}

fn text(v: &str) -> String {
    format!("\"{v}\"")
}

fn num(v: f64) -> String {
    format!("{v:.4}")
}

struct Summary(Vec<String>);

fn dispatch_empty(enc: &mut Encoder, k: &Kernel, x: &Buffer, y: &Buffer, n: u32) -> Result<()> {
    enc.dispatch(
        k,
        &[Arg::read(x), Arg::read_write(y), Arg::value(&n)],
        "empty3",
    )?;
    Ok(())
}

fn eager(d: &Device, k: &Kernel, bare: &Bare, summary: &mut Summary) -> Result<()> {
    const NODES: usize = 1000;
    let x = d.alloc(256)?;
    let y = d.alloc(256)?;
    let n = 1u32;
    let f = encore::backend::cuda::raw_function(k).ok_or("not a CUDA kernel")?;
    let (rx, ry) = (alloc_raw(256)?, alloc_raw(256)?);
    let mut enc = d.encoder();
    let (mut enq, mut wall, mut dev) = (Vec::new(), Vec::new(), Vec::new());
    let (mut benq, mut bwall, mut bdev) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..40 {
        let t0 = Instant::now();
        for _ in 0..NODES {
            dispatch_empty(&mut enc, k, &x, &y, n)?;
        }
        let sub = enc.commit()?;
        let queued = t0.elapsed();
        sub.wait()?;
        let total = t0.elapsed();
        let device = sub.elapsed().ok_or("no device time")?;
        let (bq, bw, bd) = bare.time(|| bare.launches(f, rx, ry, n, NODES))?;
        if rep >= 5 {
            enq.push(us(queued) / NODES as f64);
            wall.push(us(total) / NODES as f64);
            dev.push(us(device) / NODES as f64);
            benq.push(us(bq) / NODES as f64);
            bwall.push(us(bw) / NODES as f64);
            bdev.push(us(bd) / NODES as f64);
        }
    }
    let rows = [
        ("encore", enq, wall, dev),
        ("bare_cudarc", benq, bwall, bdev),
    ];
    let mut medians = Vec::new();
    for (name, e, w, dv) in rows {
        let (e, w, dv) = (median(e), median(w), median(dv));
        json(&[
            ("bench", text("eager")),
            ("impl", text(name)),
            ("nodes", NODES.to_string()),
            ("enqueue_us_per_node", num(e)),
            ("wall_us_per_node", num(w)),
            ("device_us_per_node", num(dv)),
        ]);
        medians.push((name, e, w, dv));
    }
    if let [(_, e0, w0, d0), (_, e1, w1, d1)] = medians[..] {
        summary.0.push(format!(
            "eager   per node: encore wall {w0:.3} us (enqueue {e0:.3}, device {d0:.3}) | bare wall {w1:.3} us (enqueue {e1:.3}, device {d1:.3}) | ratio wall {:.3}",
            w0 / w1
        ));
    }
    Ok(())
}

fn graph(d: &Device, k: &Kernel, bare: &Bare, summary: &mut Summary) -> Result<()> {
    const NODES: usize = 500;
    let x = d.alloc(256)?;
    let y = d.alloc(256)?;
    let n = 1u32;
    let mut enc = d.capture();
    for _ in 0..NODES {
        dispatch_empty(&mut enc, k, &x, &y, n)?;
    }
    let mut g = enc.finish_graph()?;
    g.mark_output(&y);
    let t0 = Instant::now();
    let exec = g.instantiate(&[])?;
    let instantiate = t0.elapsed();

    // The same chain whose first node reads a graph parameter, replayed
    // with a new value each time (one upload before each launch).
    let params = encore::Params::new(d, &["pos"])?;
    let slot = params.slot("pos")?;
    let mut enc = d.capture();
    dispatch_empty(&mut enc, k, &slot, &y, n)?;
    for _ in 1..NODES {
        dispatch_empty(&mut enc, k, &x, &y, n)?;
    }
    let mut g = enc.finish_graph()?;
    g.set_params(&params);
    g.mark_output(&y);
    let with_param = g.instantiate(&[])?;
    let mut param_wall = Vec::new();
    for rep in 0..60u32 {
        let t0 = Instant::now();
        with_param.replay(&[("pos", rep)])?.wait()?;
        if rep >= 10 {
            param_wall.push(us(t0.elapsed()) / NODES as f64);
        }
    }
    let wp = median(param_wall);

    // The bare graph: the same launches captured from a stream.
    let f = encore::backend::cuda::raw_function(k).ok_or("not a CUDA kernel")?;
    let (rx, ry) = (alloc_raw(256)?, alloc_raw(256)?);
    let mut cu_graph: sys::CUgraph = std::ptr::null_mut();
    let mut cu_exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: captures launches on the bare stream into a graph, then instantiates it.
    unsafe {
        check(
            sys::cuStreamBeginCapture_v2(
                bare.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            ),
            "cuStreamBeginCapture",
        )?;
        bare.launches(f, rx, ry, n, NODES)?;
        check(
            sys::cuStreamEndCapture(bare.stream, &mut cu_graph),
            "cuStreamEndCapture",
        )?;
        check(
            sys::cuGraphInstantiateWithFlags(&mut cu_exec, cu_graph, 0),
            "cuGraphInstantiate",
        )?;
    }
    let (mut wall, mut dev, mut bwall, mut bdev) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for rep in 0..60 {
        let t0 = Instant::now();
        let sub = exec.replay(&[])?;
        sub.wait()?;
        let total = t0.elapsed();
        let device = sub.elapsed().ok_or("no device time")?;
        // SAFETY: launches the instantiated bare graph on its stream.
        let (_, bw, bd) = bare
            .time(|| unsafe { check(sys::cuGraphLaunch(cu_exec, bare.stream), "cuGraphLaunch") })?;
        if rep >= 10 {
            wall.push(us(total) / NODES as f64);
            dev.push(us(device) / NODES as f64);
            bwall.push(us(bw) / NODES as f64);
            bdev.push(us(bd) / NODES as f64);
        }
    }
    let (w0, d0, w1, d1) = (median(wall), median(dev), median(bwall), median(bdev));
    json(&[
        ("bench", text("graph")),
        ("impl", text("encore")),
        ("nodes", NODES.to_string()),
        ("edges", exec.stats().after.edges.to_string()),
        ("instantiate_ms", num(instantiate.as_secs_f64() * 1e3)),
        ("wall_us_per_node", num(w0)),
        ("device_us_per_node", num(d0)),
    ]);
    json(&[
        ("bench", text("graph")),
        ("impl", text("encore_with_parameter_upload")),
        ("nodes", NODES.to_string()),
        ("wall_us_per_node", num(wp)),
    ]);
    json(&[
        ("bench", text("graph")),
        ("impl", text("bare_cudarc_captured")),
        ("nodes", NODES.to_string()),
        ("wall_us_per_node", num(w1)),
        ("device_us_per_node", num(d1)),
    ]);
    summary.0.push(format!(
        "graph   per node: encore device {d0:.3} us (wall {w0:.3}, with a parameter upload {wp:.3}) | bare captured device {d1:.3} us (wall {w1:.3}) | ratio device {:.3}",
        d0 / d1
    ));
    // SAFETY: destroys the bare graph objects once, after their last launch completed.
    unsafe {
        sys::cuGraphExecDestroy(cu_exec);
        sys::cuGraphDestroy(cu_graph);
    }
    Ok(())
}

fn retention(d: &Device, k: &Kernel, bare: &Bare, summary: &mut Summary) -> Result<()> {
    const NODES: usize = 500;
    let x = d.alloc(256)?;
    let y = d.alloc(256)?;
    let outputs: Vec<Buffer> = (0..NODES)
        .map(|_| d.alloc(256))
        .collect::<encore::Result<_>>()?;
    let n = 1u32;
    let f = encore::backend::cuda::raw_function(k).ok_or("not a CUDA kernel")?;
    let (rx, ry) = (alloc_raw(256)?, alloc_raw(256)?);
    let mut enc = d.encoder();
    let record = |enc: &mut Encoder, distinct: bool| -> Result<()> {
        for out in &outputs {
            dispatch_empty(enc, k, &x, if distinct { out } else { &y }, n)?;
        }
        Ok(())
    };
    let mut results = Vec::new();
    for distinct in [false, true] {
        let (mut step, mut encode) = (Vec::new(), Vec::new());
        for rep in 0..60 {
            let t0 = Instant::now();
            record(&mut enc, distinct)?;
            enc.commit()?.wait()?;
            let total = t0.elapsed();
            let t1 = Instant::now();
            record(&mut enc, distinct)?;
            enc.reset();
            let host = t1.elapsed();
            if rep >= 10 {
                step.push(us(total));
                encode.push(us(host));
            }
        }
        let name = if distinct {
            "encore_501_allocations"
        } else {
            "encore_2_allocations"
        };
        // The retention bookkeeping alone, on the same bindings.
        let bindings: Vec<[Buffer; 2]> = outputs
            .iter()
            .map(|out| [x.clone(), if distinct { out.clone() } else { y.clone() }])
            .collect();
        let step_bindings: Vec<(&Kernel, &[Buffer])> =
            bindings.iter().map(|b| (k, &b[..])).collect();
        let retain: Vec<f64> = (0..60)
            .map(|_| us(encore::retention_cost(&step_bindings)))
            .skip(10)
            .collect();
        let (st, en, re) = (median(step), median(encode), median(retain));
        json(&[
            ("bench", text("retention")),
            ("impl", text(name)),
            ("dispatches", NODES.to_string()),
            ("step_us", num(st)),
            ("encode_and_release_us", num(en)),
            ("retention_us", num(re)),
            ("retention_share_of_step", num(re / st)),
        ]);
        results.push((name, st, re));
    }
    let mut bare_step = Vec::new();
    for rep in 0..60 {
        let (_, w, _) = bare.time(|| bare.launches(f, rx, ry, n, NODES))?;
        if rep >= 10 {
            bare_step.push(us(w));
        }
    }
    let b = median(bare_step);
    json(&[
        ("bench", text("retention")),
        ("impl", text("bare_cudarc")),
        ("dispatches", NODES.to_string()),
        ("step_us", num(b)),
    ]);
    if let [(_, s2, r2), (_, s501, r501)] = results[..] {
        summary.0.push(format!(
            "retain  500-dispatch step: 2 allocs {s2:.1} us, retention {r2:.2} us ({:.3}%) | 501 allocs {s501:.1} us, retention {r501:.2} us ({:.3}%) | bare {b:.1} us",
            100.0 * r2 / s2,
            100.0 * r501 / s501
        ));
    }
    Ok(())
}

fn copy(d: &Device, bare: &Bare, summary: &mut Summary) -> Result<()> {
    const BYTES: usize = 1 << 30;
    let words = (BYTES / 4) as u64;
    let vec4 = (BYTES / 16) as u64;
    let fill = d.load_kernel(&over_n(include_str!("cuda/fill.cu"), "fill"))?;
    let copy = d.load_kernel(&over_n(include_str!("cuda/copy16.cu"), "copy16"))?;
    let src = d.alloc(BYTES)?;
    let dst = d.alloc(BYTES)?;
    let mut enc = d.encoder();
    enc.dispatch(&fill, &[Arg::write(&src), Arg::value(&words)], "fill")?;
    enc.commit_and_wait()?;
    let mut times = Vec::new();
    for rep in 0..13 {
        let mut enc = d.encoder();
        enc.dispatch(
            &copy,
            &[Arg::read(&src), Arg::write(&dst), Arg::value(&vec4)],
            "copy",
        )?;
        let sub = enc.commit_and_wait()?;
        if rep >= 3 {
            times.push(sub.elapsed().ok_or("no device time")?.as_secs_f64());
        }
    }
    // Spot-check the copy at a few places.
    for at in [0usize, BYTES / 3, BYTES - (1 << 20)] {
        let at = at / 4 * 4;
        let a: Vec<u32> = src.view(at, 1 << 20)?.download()?;
        let b: Vec<u32> = dst.view(at, 1 << 20)?.download()?;
        if a != b {
            return Err(format!("the copy kernel copied wrong data near byte {at}").into());
        }
    }
    let (rs, rd) = (alloc_raw(BYTES)?, alloc_raw(BYTES)?);
    let mut bare_times = Vec::new();
    for rep in 0..13 {
        // SAFETY: copies between two live 1 GiB device allocations.
        let (_, _, t) = bare.time(|| unsafe {
            check(
                sys::cuMemcpyDtoDAsync_v2(rd, rs, BYTES, bare.stream),
                "cuMemcpyDtoDAsync",
            )
        })?;
        if rep >= 3 {
            bare_times.push(t.as_secs_f64());
        }
    }
    let moved = 2.0 * BYTES as f64;
    let (k, m) = (
        moved / median(times) / 1e9,
        moved / median(bare_times) / 1e9,
    );
    json(&[
        ("bench", text("copy")),
        ("impl", text("encore_kernel")),
        ("bytes", BYTES.to_string()),
        ("gb_per_s_read_plus_write", num(k)),
    ]);
    json(&[
        ("bench", text("copy")),
        ("impl", text("cuMemcpyDtoDAsync")),
        ("bytes", BYTES.to_string()),
        ("gb_per_s_read_plus_write", num(m)),
    ]);
    summary.0.push(format!(
        "copy    1 GiB: encore kernel {k:.0} GB/s | cuMemcpyDtoD {m:.0} GB/s (read + write) | ratio {:.3}",
        k / m
    ));
    // SAFETY: frees the two bare allocations; their copies completed.
    unsafe {
        sys::cuMemFree_v2(rs);
        sys::cuMemFree_v2(rd);
    }
    Ok(())
}

fn main() -> Result<()> {
    let config = Config::from_env()?;
    let d = match Device::open("cuda", &config) {
        Ok(d) => d,
        Err(e) => {
            println!("{{\"bench\":\"skipped\",\"reason\":{:?}}}", e.to_string());
            return Ok(());
        }
    };
    let info = encore::list_devices()
        .into_iter()
        .find(|i| i.name == d.name());
    json(&[
        ("device", text(d.name())),
        (
            "description",
            format!("{:?}", info.map(|i| i.description).unwrap_or_default()),
        ),
    ]);
    // One block of 32 threads, like the bare launches it is compared with.
    let k = d.load_kernel(&KernelDef::new("empty3").cuda(CudaKernel::fixed(
        include_str!("cuda/empty3.cu"),
        "empty3",
        Launch::new(1, 32),
    )))?;
    let bare = Bare::new()?;
    let mut summary = Summary(Vec::new());
    eager(&d, &k, &bare, &mut summary)?;
    graph(&d, &k, &bare, &mut summary)?;
    retention(&d, &k, &bare, &mut summary)?;
    copy(&d, &bare, &mut summary)?;
    println!();
    for line in &summary.0 {
        println!("{line}");
    }
    Ok(())
}
