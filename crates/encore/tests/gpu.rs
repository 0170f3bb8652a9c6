//! The CUDA backend on a real GPU, checked against the CPU backend.
//!
//! Every test needs a CUDA device and is ignored by default, so CI (which
//! has none) reports it as ignored rather than passed. `scripts/gpu-suite.sh`
//! builds and stages this binary; `scripts/gpu-run.sh` runs it on the GPU
//! machine with `--ignored --test-threads=1`. The sticky-error test lives in
//! its own binary (`gpu_fault.rs`) because it poisons the CUDA context. The
//! kernels' CUDA sources are the files in `tests/cuda/`.

// Helpers fail a test the way assertions do: by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use encore::{
    Arg, Buffer, Config, CudaKernel, Device, Error, Kernel, KernelDef, Launch, ProfileMode,
};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};

mod common;
use common::{initial, mix, op, record, saxpy, Rng, SAXPY};

/// A kernel cache directory private to this test process.
fn cache_dir() -> PathBuf {
    std::env::temp_dir().join(format!("encore-gpu-tests-{}", std::process::id()))
}

fn config() -> Config {
    Config {
        cache_dir: Some(cache_dir()),
        ..Config::default()
    }
}

fn cuda() -> Device {
    Device::open("cuda", &config()).expect("a CUDA device")
}

fn cpu() -> Device {
    Device::open("cpu", &config()).expect("the CPU device")
}

/// `saxpy`'s CUDA body alone under another name, always launched as `launch`.
fn saxpy_launched_as(name: &str, launch: Launch) -> KernelDef {
    KernelDef::new(name).cuda(CudaKernel::fixed(SAXPY, "saxpy", launch))
}

fn run_saxpy(device: &Device, x: &[f32], y: &[f32], a: f32) -> Vec<f32> {
    let k = device.load_kernel(&saxpy()).unwrap();
    let xb = device.buffer_from(x).unwrap();
    let yb = device.buffer_from(y).unwrap();
    let n = x.len() as u32;
    let mut enc = device.encoder();
    enc.dispatch(
        &k,
        &[
            Arg::read(&xb),
            Arg::read_write(&yb),
            Arg::value(&a),
            Arg::value(&n),
        ],
        "saxpy",
    )
    .unwrap();
    enc.commit_and_wait().unwrap();
    yb.download().unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn cpu_and_cuda_bodies_of_one_kernel_agree_on_random_inputs() {
    let (gpu, host) = (cuda(), cpu());
    assert_eq!(gpu.kind(), encore::BackendKind::Cuda);
    let mut rng = Rng::new();
    for n in [1usize, 255, 256, 4097, (1 << 20) + 3] {
        let (x, y, a) = (rng.vec(n), rng.vec(n), rng.f32());
        let on_gpu = run_saxpy(&gpu, &x, &y, a);
        let on_cpu = run_saxpy(&host, &x, &y, a);
        assert_eq!(on_gpu.len(), n);
        let differ = on_gpu
            .iter()
            .zip(&on_cpu)
            .filter(|(g, c)| g.to_bits() != c.to_bits())
            .count();
        assert_eq!(differ, 0, "n = {n}: {differ} elements differ");
    }
}

/// A kernel `k(y, n)` that updates `y` in place, from `source`.
fn in_place(source: &str) -> KernelDef {
    KernelDef::new("k").cuda(CudaKernel::new(source, "k", |n: &u32| {
        Launch::cover(*n, 32)
    }))
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn same_name_kernels_with_different_source_coexist_and_run_their_own_code() {
    let d = cuda();
    let plus_one = d
        .load_kernel(&in_place(include_str!("cuda/in_place_plus_one.cu")))
        .unwrap();
    let times_ten = d
        .load_kernel(&in_place(include_str!("cuda/in_place_times_ten.cu")))
        .unwrap();
    assert_ne!(plus_one.key(), times_ten.key());
    assert_eq!(d.cached_kernels(), 2);
    let buf = d.buffer_from(&[1.0f32, 2.0]).unwrap();
    let mut enc = d.encoder();
    for k in [&plus_one, &times_ten] {
        enc.dispatch(k, &[Arg::read_write(&buf), Arg::value(&2u32)], "k")
            .unwrap();
    }
    enc.commit_and_wait().unwrap();
    assert_eq!(buf.download::<f32>().unwrap(), [20.0, 30.0]);
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn compile_errors_carry_the_nvrtc_log() {
    let d = cuda();
    let broken = KernelDef::new("broken").cuda(CudaKernel::fixed(
        include_str!("cuda/broken.cu"),
        "broken",
        Launch::new(1, 1),
    ));
    match d.load_kernel(&broken) {
        Err(Error::Compile { kernel, log }) => {
            assert_eq!(kernel, "broken");
            assert!(log.contains("undeclared_thing"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    let wrong_entry = KernelDef::new("entry").cuda(CudaKernel::fixed(
        include_str!("cuda/present.cu"),
        "absent",
        Launch::new(1, 1),
    ));
    match d.load_kernel(&wrong_entry) {
        Err(Error::Compile { log, .. }) => assert!(log.contains("absent"), "log: {log}"),
        other => panic!("expected a compile error, got {other:?}"),
    }
    // The device is unharmed.
    assert!(d.load_kernel(&saxpy()).is_ok());
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn compiled_kernels_persist_on_disk_by_content_key() {
    let dir = cache_dir().join("persist");
    let _ = std::fs::remove_dir_all(&dir);
    let config = Config {
        cache_dir: Some(dir.clone()),
        ..Config::default()
    };
    let first = Device::open("cuda", &config).unwrap();
    let k = first.load_kernel(&saxpy()).unwrap();
    let file = dir
        .join("kernels")
        .join(format!("{}.cubin", k.key().digest()));
    assert!(file.is_file(), "{} was not written", file.display());
    assert!(k.key().toolchain.contains("nvrtc-"), "{:?}", k.key());
    assert!(k.key().arch.starts_with("sm_"), "{:?}", k.key());
    let written = std::fs::metadata(&file).unwrap().modified().unwrap();

    // A second device has an empty in-memory cache: it loads the file.
    let second = Device::open("cuda", &config).unwrap();
    let x = [1.0f32, 2.0, 3.0];
    assert_eq!(run_saxpy(&second, &x, &x, 2.0), [3.0, 6.0, 9.0]);
    assert_eq!(
        std::fs::metadata(&file).unwrap().modified().unwrap(),
        written
    );
    assert_eq!(second.counters().kernel_compiles, 1);
}

/// `slow_copy(x, y, n, cycles)`, launched over `n` (its first value argument).
fn slow_copy_kernel() -> CudaKernel {
    CudaKernel::new(
        include_str!("cuda/slow_copy.cu"),
        "slow_copy",
        |&[n, _cycles]: &[u32; 2]| Launch::cover(n, 256),
    )
}

fn slow_copy(d: &Device, src: &Buffer, dst: &Buffer, n: u32) -> encore::Submission {
    let k = d
        .load_kernel(&KernelDef::new("slow_copy").cuda(slow_copy_kernel()))
        .unwrap();
    // About 100 ms at 2 GHz.
    let cycles: u32 = 200_000_000;
    let mut enc = d.encoder();
    enc.dispatch(
        &k,
        &[
            Arg::read(src),
            Arg::write(dst),
            Arg::value(&n),
            Arg::value(&cycles),
        ],
        "slow copy",
    )
    .unwrap();
    enc.commit().unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn a_buffer_dropped_right_after_dispatch_stays_alive_until_completion() {
    let d = cuda();
    let n = 1u32 << 16;
    let data = Rng::new().vec(n as usize);
    let src = d.buffer_from(&data).unwrap();
    let dst = d.alloc(n as usize * 4).unwrap();
    let before = d.pool_stats();
    let submission = slow_copy(&d, &src, &dst, n);
    drop(src);
    d.trim_pool();
    // Same size class: it must not be the memory the running kernel reads.
    let probe = d.alloc(n as usize * 4).unwrap();
    assert!(
        !submission.is_complete(),
        "the slow kernel finished too early to test anything"
    );
    let during = d.pool_stats();
    assert_eq!(during.reuses, before.reuses, "in-flight memory was reused");
    assert_eq!(during.fresh, before.fresh + 1);
    submission.wait().unwrap();
    assert_eq!(dst.download::<f32>().unwrap(), data);
    drop(probe);
    // Completion observed: the source's memory is back in the pool.
    let reused = d.alloc(n as usize * 4).unwrap();
    assert!(d.pool_stats().reuses > before.reuses);
    drop(reused);

    // Dropping the unfinished submission too hands it to the device.
    let src = d.buffer_from(&data).unwrap();
    let dst = d.alloc(n as usize * 4).unwrap();
    let submission = slow_copy(&d, &src, &dst, n);
    drop(src);
    drop(submission);
    d.synchronize().unwrap();
    assert_eq!(dst.download::<f32>().unwrap(), data);
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn random_overlapping_views_on_cuda_equal_serial_cpu_execution() {
    let gpu = cuda();
    let serial = Device::open(
        "cpu",
        &Config {
            serial: true,
            ..config()
        },
    )
    .unwrap();
    let k_gpu = gpu.load_kernel(&mix()).unwrap();
    let k_cpu = serial.load_kernel(&mix()).unwrap();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 24,
        ..ProptestConfig::default()
    });
    runner
        .run(&prop::collection::vec(op(), 1..40), |ops| {
            let start = initial();
            let run_eager = |d: &Device, k: &encore::Kernel| {
                let bufs: Vec<Buffer> = start.iter().map(|v| d.buffer_from(v).unwrap()).collect();
                let mut enc = d.encoder();
                let accepted = record(&mut enc, k, &bufs, &ops);
                enc.commit_and_wait().unwrap();
                let out: Vec<Vec<f32>> = bufs.iter().map(|b| b.download().unwrap()).collect();
                (accepted, out)
            };
            let (accepted_cpu, expected) = run_eager(&serial, &k_cpu);
            let (accepted_gpu, eager) = run_eager(&gpu, &k_gpu);
            prop_assert_eq!(&accepted_cpu, &accepted_gpu);
            prop_assert_eq!(&eager, &expected);

            // The same dispatches as a native graph, where independent
            // dispatches run concurrently along the derived edges.
            let bufs: Vec<Buffer> = start.iter().map(|v| gpu.buffer_from(v).unwrap()).collect();
            let mut enc = gpu.capture();
            record(&mut enc, &k_gpu, &bufs, &ops);
            let mut graph = enc.finish_graph().unwrap();
            for b in &bufs {
                graph.mark_output(b);
            }
            let exec = graph.instantiate(&[]).unwrap();
            exec.replay(&[]).unwrap().wait().unwrap();
            let replayed: Vec<Vec<f32>> = bufs.iter().map(|b| b.download().unwrap()).collect();
            prop_assert_eq!(&replayed, &expected);
            Ok(())
        })
        .unwrap();
}

/// The `scale` and `add` kernels, loaded on `d`; both take `n` as their one
/// value argument and launch blocks of 128 threads over it.
fn scale_and_add(d: &Device) -> (Kernel, Kernel) {
    let load = |name: &str, source: &str| {
        let cuda = CudaKernel::new(source, name, |n: &u32| Launch::cover(*n, 128));
        d.load_kernel(&KernelDef::new(name).cuda(cuda)).unwrap()
    };
    (
        load("scale", include_str!("cuda/scale.cu")),
        load("add", include_str!("cuda/add.cu")),
    )
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn a_native_graph_with_real_edges_equals_eager_execution() {
    let d = cuda();
    let (scale, add) = scale_and_add(&d);
    let n = 5000u32;
    let mut rng = Rng::new();
    let x = d.buffer_from(&rng.vec(n as usize)).unwrap();
    let bytes = n as usize * 4;
    let [a, b, c, e, out] = [(); 5].map(|_| d.alloc(bytes).unwrap());
    let params = encore::Params::new(&d, &["s"]).unwrap();
    let s = params.slot("s").unwrap();
    let two = d.buffer_from(&[2.0f32]).unwrap();
    // A diamond and a tail:
    //   a = x*s   b = x*2   (independent)
    //   c = a+b             (after both)
    //   e = x*2  (independent of all above)
    //   out = c+e
    let record = |enc: &mut encore::Encoder, s: &Buffer| {
        let nv = Arg::value(&n);
        enc.dispatch(
            &scale,
            &[Arg::read(&x), Arg::write(&a), Arg::read(s), nv],
            "a",
        )
        .unwrap();
        enc.dispatch(
            &scale,
            &[Arg::read(&x), Arg::write(&b), Arg::read(&two), nv],
            "b",
        )
        .unwrap();
        enc.dispatch(
            &add,
            &[Arg::read(&a), Arg::read(&b), Arg::write(&c), nv],
            "c",
        )
        .unwrap();
        enc.dispatch(
            &scale,
            &[Arg::read(&x), Arg::write(&e), Arg::read(&two), nv],
            "e",
        )
        .unwrap();
        enc.dispatch(
            &add,
            &[Arg::read(&c), Arg::read(&e), Arg::write(&out), nv],
            "out",
        )
        .unwrap();
    };
    let mut enc = d.capture();
    record(&mut enc, &s);
    let mut graph = enc.finish_graph().unwrap();
    graph.set_params(&params);
    graph.mark_output(&out);
    let exec = graph.instantiate(&[]).unwrap();
    assert!(exec.stats().after.edges >= 4, "{:?}", exec.stats());
    assert!(exec.stats().after.max_group >= 2, "{:?}", exec.stats());

    for value in [3.0f32, -0.5, 7.25] {
        exec.replay(&[("s", value.to_bits())])
            .unwrap()
            .wait()
            .unwrap();
        let replayed: Vec<f32> = out.download().unwrap();

        let scalar = d.buffer_from(&[value]).unwrap();
        let mut enc = d.encoder();
        record(&mut enc, &scalar);
        enc.commit_and_wait().unwrap();
        let eager: Vec<f32> = out.download().unwrap();
        assert_eq!(replayed, eager, "s = {value}");
        let host: Vec<f32> = x.download().unwrap();
        let expected: Vec<f32> = host
            .iter()
            .map(|v| (v * value + v * 2.0) + v * 2.0)
            .collect();
        assert_eq!(eager, expected, "s = {value}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn a_native_graph_of_several_runs_a_replay_equals_running_them_in_turn() {
    // a = x*s and b = x*2 run side by side, then x = a+b: each run reads
    // the x the run before wrote, so the runs of one replay must follow
    // each other through the graph's edges.
    let d = cuda();
    let (scale, add) = scale_and_add(&d);
    let n = 5000u32;
    let start = Rng::new().vec(n as usize);
    let bytes = n as usize * 4;
    let (x, a, b) = (
        d.buffer_from(&start).unwrap(),
        d.alloc(bytes).unwrap(),
        d.alloc(bytes).unwrap(),
    );
    let params = encore::Params::new(&d, &["s"]).unwrap();
    let two = d.buffer_from(&[2.0f32]).unwrap();
    let record = |enc: &mut encore::Encoder, s: &Buffer| {
        let nv = Arg::value(&n);
        for (y, factor, label) in [(&a, s, "a"), (&b, &two, "b")] {
            enc.dispatch(
                &scale,
                &[Arg::read(&x), Arg::write(y), Arg::read(factor), nv],
                label,
            )
            .unwrap();
        }
        enc.dispatch(
            &add,
            &[Arg::read(&a), Arg::read(&b), Arg::write(&x), nv],
            "x",
        )
        .unwrap();
    };
    let runs = 3;
    let mut enc = d.capture();
    record(&mut enc, &params.slot("s").unwrap());
    let mut graph = enc.finish_graph().unwrap();
    graph.set_params(&params);
    graph.set_runs_per_replay(runs);
    graph.mark_output(&x);
    let exec = graph.instantiate(&[]).unwrap();
    assert!(exec.stats().after.edges >= 2, "{:?}", exec.stats());
    let value = 0.75f32;
    exec.replay(&[("s", value.to_bits())])
        .unwrap()
        .wait()
        .unwrap();
    let replayed: Vec<f32> = x.download().unwrap();

    x.upload(&start).unwrap();
    let scalar = d.buffer_from(&[value]).unwrap();
    for _ in 0..runs {
        let mut enc = d.encoder();
        record(&mut enc, &scalar);
        enc.commit_and_wait().unwrap();
    }
    let eager: Vec<f32> = x.download().unwrap();
    assert_eq!(replayed, eager);
    let once: Vec<f32> = start.iter().map(|v| v * value + v * 2.0).collect();
    assert_ne!(replayed, once, "the runs fed each other");
}

/// The value of an `early` dispatch: its four value arguments in order.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct EarlyValue {
    a: f32,
    b: f32,
    n: u32,
    cycles: u32,
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn early_launched_graph_kernels_see_every_write_before_them() {
    // A kernel declared programmatic that never waits is refused.
    let d = cuda();
    let careless = KernelDef::new("careless")
        .cuda(slow_copy_kernel())
        .programmatic();
    match d.load_kernel(&careless) {
        Err(Error::Compile { log, .. }) => assert!(log.contains("encore_grid_wait"), "{log}"),
        other => panic!("expected a compile error, got {:?}", other.map(|_| ())),
    }

    let n = 1u32 << 14;
    let host = Rng::new().vec(n as usize);
    let bytes = n as usize * 4;
    for early in [true, false] {
        let d = Device::open(
            "cuda",
            &Config {
                early_launch: early,
                ..config()
            },
        )
        .unwrap();
        let early_kernel =
            CudaKernel::new(include_str!("cuda/early.cu"), "early", |v: &EarlyValue| {
                Launch::cover(v.n, 128)
            });
        let k = d
            .load_kernel(&KernelDef::new("early").cuda(early_kernel).programmatic())
            .unwrap();
        let x = d.buffer_from(&host).unwrap();
        let [a, b, c] = [(); 3].map(|_| d.alloc(bytes).unwrap());
        // A chain where each step would read stale data if it ran early:
        // a = 2x+1 (slow), b = 3a-1 (slow), c = b+0.5, then x = c/2, which
        // overwrites what the first step read (ordered only through the chain).
        let step = |enc: &mut encore::Encoder,
                    src: &Buffer,
                    dst: &Buffer,
                    mul: f32,
                    add: f32,
                    cycles: u32,
                    label: &'static str| {
            enc.dispatch(
                &k,
                &[
                    Arg::read(src),
                    Arg::write(dst),
                    Arg::value(&mul),
                    Arg::value(&add),
                    Arg::value(&n),
                    Arg::value(&cycles),
                ],
                label,
            )
            .unwrap();
        };
        let mut enc = d.capture();
        step(&mut enc, &x, &a, 2.0, 1.0, 2_000_000, "a");
        step(&mut enc, &a, &b, 3.0, -1.0, 200_000, "b");
        step(&mut enc, &b, &c, 1.0, 0.5, 0, "c");
        step(&mut enc, &c, &x, 0.5, 0.0, 0, "x");
        let mut graph = enc.finish_graph().unwrap();
        graph.mark_output(&x);
        graph.mark_output(&c);
        let exec = graph.instantiate(&[]).unwrap();
        let mut expected = host.clone();
        for replay in 0..3 {
            exec.replay(&[]).unwrap().wait().unwrap();
            let mut want_c = Vec::with_capacity(expected.len());
            for v in &mut expected {
                let a = *v * 2.0 + 1.0;
                let b = a * 3.0 - 1.0;
                let c = b + 0.5;
                want_c.push(c);
                *v = c * 0.5;
            }
            assert_eq!(
                c.download::<f32>().unwrap(),
                want_c,
                "early {early}, replay {replay}"
            );
            assert_eq!(
                x.download::<f32>().unwrap(),
                expected,
                "early {early}, replay {replay}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn device_time_is_reported_per_submission_and_per_dispatch() {
    let d = Device::open(
        "cuda",
        &Config {
            profile: ProfileMode::Dispatches,
            ..config()
        },
    )
    .unwrap();
    let k = d.load_kernel(&saxpy()).unwrap();
    let n = 1u32 << 22;
    let x = d.alloc(n as usize * 4).unwrap();
    let y = d.alloc(n as usize * 4).unwrap();
    let record = |enc: &mut encore::Encoder| {
        for _ in 0..4 {
            enc.dispatch(
                &k,
                &[
                    Arg::read(&x),
                    Arg::read_write(&y),
                    Arg::value(&1.0f32),
                    Arg::value(&n),
                ],
                "saxpy",
            )
            .unwrap();
        }
    };
    let mut enc = d.encoder();
    record(&mut enc);
    let sub = enc.commit_and_wait().unwrap();
    let elapsed = sub.elapsed().unwrap();
    let times = sub.dispatch_times().unwrap();
    assert_eq!(times.len(), 4);
    assert!(times.iter().all(|t| !t.time.is_zero()), "{times:?}");
    let sum: std::time::Duration = times.iter().map(|t| t.time).sum();
    assert!(sum <= elapsed, "{sum:?} > {elapsed:?}");

    // A graph replay with timing runs eagerly with an event pair per dispatch.
    let mut enc = d.capture();
    record(&mut enc);
    let mut graph = enc.finish_graph().unwrap();
    graph.mark_output(&y);
    let sub = graph.instantiate(&[]).unwrap().replay(&[]).unwrap();
    sub.wait().unwrap();
    assert_eq!(sub.dispatch_times().unwrap().len(), 4);
    assert!(!d.profile().dispatches().is_empty());
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn launch_and_argument_errors_are_typed_and_leave_the_device_usable() {
    let d = cuda();
    let k = d.load_kernel(&saxpy()).unwrap();
    let x = d.buffer_from(&[1.0f32; 64]).unwrap();
    let y = d.buffer_from(&[1.0f32; 64]).unwrap();
    let n = 64u32;

    let (two, wide) = (2.0f32, 2.0f64);
    let good = [
        Arg::read(&x),
        Arg::read_write(&y),
        Arg::value(&two),
        Arg::value(&n),
    ];
    let short = [Arg::read(&x), Arg::read_write(&y)];
    let f64_scalar = [
        Arg::read(&x),
        Arg::read_write(&y),
        Arg::value(&wide),
        Arg::value(&n),
    ];

    // Too many threads per block: the driver refuses the launch.
    let too_wide = d
        .load_kernel(&saxpy_launched_as("saxpy_4096", Launch::new(1, 4096)))
        .unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&too_wide, &good, "too wide").unwrap();
    match enc.commit() {
        Err(Error::Driver {
            operation, message, ..
        }) => {
            assert!(operation.contains("too wide"), "{operation}");
            assert!(message.contains("CUDA_ERROR"), "{message}");
        }
        other => panic!("expected a driver error, got {:?}", other.map(|_| ())),
    }

    // A value the launch geometry cannot read (missing, or of another
    // size) is refused when it is dispatched.
    let mut enc = d.encoder();
    for (args, label) in [(&short[..], "short"), (&f64_scalar[..], "f64 scalar")] {
        match enc.dispatch(&k, args, label) {
            Err(Error::InvalidDispatch { label: l, .. }) => assert_eq!(l, label),
            other => panic!("expected an invalid dispatch, got {other:?}"),
        }
    }
    assert!(enc.is_empty());

    // Wrong argument count and wrong inline size are caught before launch
    // where the geometry reads no value.
    let fixed = d
        .load_kernel(&saxpy_launched_as("saxpy_64", Launch::new(1, 64)))
        .unwrap();
    for (args, label) in [(&short[..], "short"), (&f64_scalar[..], "f64 scalar")] {
        let mut enc = d.encoder();
        enc.dispatch(&fixed, args, label).unwrap();
        match enc.commit() {
            Err(Error::InvalidDispatch { label: l, .. }) => assert_eq!(l, label),
            other => panic!("expected an invalid dispatch, got {:?}", other.map(|_| ())),
        }
    }

    // Out of memory is its own error and not a device failure.
    assert!(matches!(d.alloc(1 << 50), Err(Error::OutOfMemory { .. })));

    // None of this harmed the device.
    let out = run_saxpy(&d, &[1.0, 2.0], &[1.0, 1.0], 3.0);
    assert_eq!(out, [4.0, 7.0]);
    d.synchronize().unwrap();
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Affine {
    scale: f32,
    shift: f32,
    n: u32,
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn structs_pass_by_value_and_large_shared_memory_is_allowed() {
    let d = cuda();
    // 256 threads x 64 floats = 64 KiB, above the 48 KiB default.
    let affine = CudaKernel::new(include_str!("cuda/affine.cu"), "affine", |p: &Affine| {
        Launch::cover(p.n, 256).with_shared(256 * 64 * 4)
    });
    let k = d
        .load_kernel(&KernelDef::new("affine").cuda(affine))
        .unwrap();
    let n = 1000u32;
    let data = Rng::new().vec(n as usize);
    let x = d.buffer_from(&data).unwrap();
    let y = d.alloc(n as usize * 4).unwrap();
    let p = Affine {
        scale: 3.0,
        shift: -1.5,
        n,
    };
    let mut enc = d.encoder();
    enc.dispatch(
        &k,
        &[Arg::read(&x), Arg::write(&y), Arg::value(&p)],
        "affine",
    )
    .unwrap();
    enc.commit_and_wait().unwrap();
    let expected: Vec<f32> = data.iter().map(|v| v * 3.0 + -1.5).collect();
    assert_eq!(y.download::<f32>().unwrap(), expected);
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn each_dispatch_is_launched_and_traced_with_the_geometry_its_kernel_computes() {
    let d = cuda();
    let trace = d.start_trace();
    let x = [1.0f32; 1000];
    assert_eq!(run_saxpy(&d, &x, &x, 2.0), [3.0; 1000]);
    let mut json = Vec::new();
    trace.write_to(&mut json).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&json).unwrap();
    let dispatches: Vec<&serde_json::Value> = json["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "dispatch")
        .collect();
    assert_eq!(dispatches.len(), 1, "{dispatches:#?}");
    // Launch::cover(1000, 256), from the dispatch's value.
    let args = &dispatches[0]["args"];
    assert_eq!(args["grid"], serde_json::json!([4, 1, 1]), "{args}");
    assert_eq!(args["block"], serde_json::json!([256, 1, 1]), "{args}");
    assert_eq!(args["shared_bytes"], 0, "{args}");
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn auto_picks_cuda_and_devices_are_listed() {
    let d = Device::open("auto", &config()).unwrap();
    assert_eq!(d.kind(), encore::BackendKind::Cuda);
    assert_eq!(d.name(), "cuda:0");
    let list = encore::list_devices();
    let gpu = list.iter().find(|i| i.name == "cuda:0").unwrap();
    assert!(gpu.description.contains("sm_"), "{}", gpu.description);
    eprintln!("{}: {}", gpu.name, gpu.description);
    assert!(d.arch().starts_with("sm_"));
}
