//! The wgpu backend, checked against the CPU backend.
//!
//! The tests run on `ENCORE_TEST_WGPU` (default `wgpu:0`, the first
//! adapter): Mesa's lavapipe (a Vulkan driver on the CPU, which `.ci/run`
//! installs) where no GPU exists, NVIDIA's Vulkan driver on the GPU
//! machine. Without any adapter they fail, saying how to get one. The
//! kernels' WGSL sources are the files in `tests/wgsl/`.

// Helpers fail a test the way assertions do: by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{
    Arg, Buffer, Config, Device, Error, Kernel, KernelDef, Launch, ProfileMode, WgpuKernel,
};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};

mod common;
use common::{initial, mix, op, record, saxpy, Rng};

fn wgpu_name() -> String {
    std::env::var("ENCORE_TEST_WGPU")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "wgpu:0".into())
}

fn open(config: &Config) -> Device {
    let name = wgpu_name();
    Device::open(&name, config).unwrap_or_else(|e| {
        panic!(
            "device {name}: {e} (these tests need a Vulkan, Metal or DirectX 12 adapter; \
             on Debian `apt-get install mesa-vulkan-drivers` gives lavapipe)"
        )
    })
}

fn gpu() -> Device {
    open(&Config::default())
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

/// Random inputs, lengths around a workgroup. The CPU rounds the
/// multiply-add once; Vulkan's `Fma` may round twice (lavapipe does), so
/// elements may differ by an ulp of the product and of the sum.
#[test]
fn cpu_and_wgpu_bodies_of_one_kernel_agree_on_random_inputs() {
    let (gpu, cpu) = (gpu(), Device::cpu().unwrap());
    let mut rng = Rng::new();
    for n in [1usize, 255, 256, 257, 10_000] {
        let (x, y, a) = (rng.vec(n), rng.vec(n), rng.f32());
        let (got, want) = (run_saxpy(&gpu, &x, &y, a), run_saxpy(&cpu, &x, &y, a));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let ulps = f32::EPSILON * (w.abs() + (a * x[i]).abs());
            assert!((g - w).abs() <= ulps, "n = {n}, element {i}: {g} vs {w}");
        }
    }
}

/// A kernel that adds `k` in place, under one name, its source differing in `k`.
fn in_place(k: f32) -> KernelDef {
    let source = format!(
        "struct Args {{ off: array<u32, 16>, n: u32 }}\n\
         @group(0) @binding(0) var<storage, read_write> y: array<f32>;\n\
         @group(1) @binding(0) var<storage, read> args: Args;\n\
         @compute @workgroup_size(64)\n\
         fn bump(@builtin(global_invocation_id) gid: vec3<u32>) {{\n\
             if gid.x < args.n {{ y[args.off[0] + gid.x] += {k:?}; }}\n\
         }}\n"
    );
    KernelDef::new("bump").wgpu(WgpuKernel::new(source, "bump", |n: &u32| {
        Launch::cover(*n, 64)
    }))
}

fn bump(d: &Device, k: &Kernel, y: &Buffer, n: u32) {
    let mut enc = d.encoder();
    enc.dispatch(k, &[Arg::read_write(y), Arg::value(&n)], "bump")
        .unwrap();
    enc.commit_and_wait().unwrap();
}

#[test]
fn same_name_kernels_with_different_source_coexist_and_run_their_own_code() {
    let d = gpu();
    let (one, ten) = (
        d.load_kernel(&in_place(1.0)).unwrap(),
        d.load_kernel(&in_place(10.0)).unwrap(),
    );
    assert_ne!(one.key(), ten.key());
    let y = d.buffer_from(&[0.5f32; 100]).unwrap();
    bump(&d, &one, &y, 100);
    bump(&d, &ten, &y, 100);
    bump(&d, &one, &y, 100);
    assert_eq!(y.download::<f32>().unwrap(), vec![12.5f32; 100]);
    assert_eq!(d.cached_kernels(), 2);
}

#[test]
fn compile_errors_carry_the_shader_log_and_leave_the_device_usable() {
    let d = gpu();
    let broken = KernelDef::new("broken").wgpu(WgpuKernel::new(
        "@compute @workgroup_size(1) fn broken() { let x: u32 = undefined_name; }",
        "broken",
        |_: &u32| Launch::new(1, 1),
    ));
    match d.load_kernel(&broken) {
        Err(Error::Compile { kernel, log }) => {
            assert_eq!(kernel, "broken");
            assert!(log.contains("undefined_name"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    // No argument block: outside the binding convention.
    let unconventional = KernelDef::new("plain").wgpu(WgpuKernel::new(
        "@group(0) @binding(0) var<storage, read_write> y: array<f32>;\n\
         @compute @workgroup_size(1) fn plain() { y[0] = 1.0; }",
        "plain",
        |_: &u32| Launch::new(1, 1),
    ));
    match d.load_kernel(&unconventional) {
        Err(Error::Compile { log, .. }) => assert!(log.contains("argument block"), "{log}"),
        other => panic!("expected a compile error, got {other:?}"),
    }
    let x = vec![1.0f32; 8];
    assert_eq!(run_saxpy(&d, &x, &x, 2.0), vec![3.0f32; 8]);
}

/// A dispatch the shader cannot bind (too few buffers, an unaligned view)
/// is a typed error, and the device goes on working.
#[test]
fn argument_errors_are_typed_and_leave_the_device_usable() {
    let d = gpu();
    let k = d.load_kernel(&saxpy()).unwrap();
    let x = d.buffer_from(&[1.0f32; 64]).unwrap();
    let mut enc = d.encoder();
    enc.dispatch(
        &k,
        &[Arg::read(&x), Arg::value(&2.0f32), Arg::value(&64u32)],
        "short",
    )
    .unwrap();
    match enc.commit_and_wait() {
        Err(Error::InvalidDispatch { reason, .. }) => {
            assert!(reason.contains("binds buffer 1"), "{reason}")
        }
        other => panic!("expected an invalid dispatch, got {:?}", other.err()),
    }
    let other = d.buffer_from(&[1.0f32; 64]).unwrap();
    let odd = other.view(2, 16).unwrap();
    let mut enc = d.encoder();
    enc.dispatch(
        &k,
        &[
            Arg::read(&odd),
            Arg::read_write(&x),
            Arg::value(&2.0f32),
            Arg::value(&4u32),
        ],
        "unaligned",
    )
    .unwrap();
    match enc.commit_and_wait() {
        Err(Error::InvalidDispatch { reason, .. }) => {
            assert!(reason.contains("multiple of 4"), "{reason}")
        }
        other => panic!("expected an invalid dispatch, got {:?}", other.err()),
    }
    assert!(d.synchronize().is_ok());
    let y = vec![1.0f32; 64];
    assert_eq!(run_saxpy(&d, &y, &y, 2.0), vec![3.0f32; 64]);
}

fn slow_copy(d: &Device, src: &Buffer, dst: &Buffer, n: u32, rounds: u32) -> encore::Submission {
    let kernel = WgpuKernel::new(
        include_str!("wgsl/slow_copy.wgsl"),
        "slow_copy",
        |&[n, _rounds]: &[u32; 2]| Launch::cover(n, 64),
    );
    let k = d
        .load_kernel(&KernelDef::new("slow_copy").wgpu(kernel))
        .unwrap();
    let mut enc = d.encoder();
    enc.dispatch(
        &k,
        &[
            Arg::read(src),
            Arg::write(dst),
            Arg::value(&n),
            Arg::value(&rounds),
        ],
        "slow copy",
    )
    .unwrap();
    enc.commit().unwrap()
}

/// Rounds of `slow_copy` that keep the device busy for a while.
fn slow_rounds(d: &Device) -> u32 {
    let n = 1u32 << 14;
    let (src, dst) = (
        d.alloc(n as usize * 4).unwrap(),
        d.alloc(n as usize * 4).unwrap(),
    );
    let mut rounds = 1u32 << 10;
    loop {
        let start = std::time::Instant::now();
        slow_copy(d, &src, &dst, n, rounds).wait().unwrap();
        if start.elapsed() > std::time::Duration::from_millis(200) || rounds >= 1 << 30 {
            return rounds;
        }
        rounds *= 4;
    }
}

#[test]
fn a_buffer_dropped_right_after_dispatch_stays_alive_until_completion() {
    let d = gpu();
    let rounds = slow_rounds(&d);
    let n = 1u32 << 14;
    let data = Rng::new().vec(n as usize);
    let src = d.buffer_from(&data).unwrap();
    let dst = d.alloc(n as usize * 4).unwrap();
    let before = d.pool_stats();
    let submission = slow_copy(&d, &src, &dst, n, rounds);
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
    submission.wait().unwrap();
    assert_eq!(dst.download::<f32>().unwrap(), data);
    drop(probe);
    let reused = d.alloc(n as usize * 4).unwrap();
    assert!(d.pool_stats().reuses > before.reuses);
    drop(reused);

    // Dropping the unfinished submission too hands it to the device.
    let src = d.buffer_from(&data).unwrap();
    let dst = d.alloc(n as usize * 4).unwrap();
    let submission = slow_copy(&d, &src, &dst, n, rounds);
    drop(src);
    drop(submission);
    d.synchronize().unwrap();
    assert_eq!(dst.download::<f32>().unwrap(), data);
}

/// Views at any offset of one or two allocations, read and written by one
/// dispatch (the aliasing variant), in concurrent groups the hazard tracker
/// forms, eagerly and as a replayed graph: the results equal serial CPU
/// execution.
#[test]
fn random_overlapping_views_on_wgpu_equal_serial_cpu_execution() {
    let gpu = gpu();
    let serial = Device::open(
        "cpu",
        &Config {
            serial: true,
            ..Config::default()
        },
    )
    .unwrap();
    let k_gpu = gpu.load_kernel(&mix()).unwrap();
    let k_cpu = serial.load_kernel(&mix()).unwrap();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 16,
        ..ProptestConfig::default()
    });
    runner
        .run(&prop::collection::vec(op(), 1..40), |ops| {
            let start = initial();
            let run_eager = |d: &Device, k: &Kernel| {
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

/// The `scale` and `add` kernels, loaded on `d`.
fn scale_and_add(d: &Device) -> (Kernel, Kernel) {
    let load = |name: &str, source: &str| {
        let wgsl = WgpuKernel::new(source, name, |n: &u32| Launch::cover(*n, 128));
        d.load_kernel(&KernelDef::new(name).wgpu(wgsl)).unwrap()
    };
    (
        load("scale", include_str!("wgsl/scale.wgsl")),
        load("add", include_str!("wgsl/add.wgsl")),
    )
}

/// A graph with a parameter replays with each new value and equals eager
/// execution.
#[test]
fn a_replayed_graph_reads_its_parameters_and_equals_eager_execution() {
    let d = gpu();
    let (scale, add) = scale_and_add(&d);
    let n = 5000u32;
    let mut rng = Rng::new();
    let x = d.buffer_from(&rng.vec(n as usize)).unwrap();
    let bytes = n as usize * 4;
    let [a, b, c, e, out] = [(); 5].map(|_| d.alloc(bytes).unwrap());
    let params = encore::Params::new(&d, &["s"]).unwrap();
    let s = params.slot("s").unwrap();
    let two = d.buffer_from(&[2.0f32]).unwrap();
    let record = |enc: &mut encore::Encoder, s: &Buffer| {
        let nv = Arg::value(&n);
        let dispatches = [
            (
                &scale,
                [Arg::read(&x), Arg::write(&a), Arg::read(s), nv],
                "a",
            ),
            (
                &scale,
                [Arg::read(&x), Arg::write(&b), Arg::read(&two), nv],
                "b",
            ),
            (
                &add,
                [Arg::read(&a), Arg::read(&b), Arg::write(&c), nv],
                "c",
            ),
            (
                &scale,
                [Arg::read(&x), Arg::write(&e), Arg::read(&two), nv],
                "e",
            ),
            (
                &add,
                [Arg::read(&c), Arg::read(&e), Arg::write(&out), nv],
                "out",
            ),
        ];
        for (k, args, label) in dispatches {
            enc.dispatch(k, &args, label).unwrap();
        }
    };
    let mut enc = d.capture();
    record(&mut enc, &s);
    let mut graph = enc.finish_graph().unwrap();
    graph.set_params(&params);
    graph.mark_output(&out);
    let exec = graph.instantiate(&[]).unwrap();
    assert!(exec.stats().after.max_group >= 2, "{:?}", exec.stats());

    for value in [3.0f32, -0.5, 7.25] {
        exec.replay(&[("s", value.to_bits())])
            .unwrap()
            .wait()
            .unwrap();
        let replayed: Vec<f32> = out.download().unwrap();
        let host: Vec<f32> = x.download().unwrap();
        let expected: Vec<f32> = host
            .iter()
            .map(|v| (v * value + v * 2.0) + v * 2.0)
            .collect();
        assert_eq!(replayed, expected, "s = {value}");
    }
}

/// Timestamps give the submission's device time and each dispatch's,
/// eagerly and in a graph replay, and reach the profile.
#[test]
fn device_time_is_reported_per_submission_and_per_dispatch() {
    let d = open(&Config {
        profile: ProfileMode::Dispatches,
        ..Config::default()
    });
    let k = d.load_kernel(&saxpy()).unwrap();
    let n = 1u32 << 18;
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

    let mut enc = d.capture();
    record(&mut enc);
    let mut graph = enc.finish_graph().unwrap();
    graph.mark_output(&y);
    let sub = graph.instantiate(&[]).unwrap().replay(&[]).unwrap();
    sub.wait().unwrap();
    assert_eq!(sub.dispatch_times().unwrap().len(), 4);
    assert!(!d.profile().dispatches().is_empty());
}

/// The adapter is listed; `auto` never opens a software adapter, and
/// neither does `wgpu`, which names only hardware.
#[test]
fn adapters_are_listed_and_software_ones_are_opened_only_by_index() {
    let d = gpu();
    assert_eq!(d.kind(), encore::BackendKind::Wgpu);
    let listed = encore::list_devices();
    assert!(listed.iter().any(|i| i.name == d.name()), "{listed:?}");
    let software = listed
        .iter()
        .find(|i| i.name == d.name())
        .is_some_and(|i| i.description.contains("software"));
    if software {
        let auto = Device::open(
            "auto",
            &Config {
                device: "auto".into(),
                ..Config::default()
            },
        );
        assert_ne!(auto.unwrap().kind(), encore::BackendKind::Wgpu);
    }
    assert!(matches!(
        Device::open("wgpu:999", &Config::default()),
        Err(Error::DeviceUnavailable { .. })
    ));
    assert!(matches!(
        Device::open("wgpu:x", &Config::default()),
        Err(Error::UnknownDevice(_))
    ));
}

/// A graph replay is held back until the next operation on the queue; the
/// operations after it still see it in order: a write made after the
/// replay does not reach it, an ordered read sees its result, and a read
/// of what an earlier replay wrote (`download_all_after`) goes ahead of
/// it.
#[test]
fn held_replays_keep_queue_order() {
    let d = gpu();
    let (scale, _) = scale_and_add(&d);
    let n = 1000u32;
    let x = d.buffer_from(&vec![1.5f32; n as usize]).unwrap();
    let (y, z) = (
        d.alloc(n as usize * 4).unwrap(),
        d.alloc(n as usize * 4).unwrap(),
    );
    let params = encore::Params::new(&d, &["s"]).unwrap();
    let s = params.slot("s").unwrap();
    let mut enc = d.capture();
    enc.dispatch(
        &scale,
        &[Arg::read(&x), Arg::write(&y), Arg::read(&s), Arg::value(&n)],
        "y",
    )
    .unwrap();
    let mut graph = enc.finish_graph().unwrap();
    graph.set_params(&params);
    graph.mark_output(&y);
    let exec = graph.instantiate(&[]).unwrap();

    let first = exec.replay(&[("s", 2.0f32.to_bits())]).unwrap();
    first.wait().unwrap();
    let second = exec.replay(&[("s", 3.0f32.to_bits())]).unwrap();
    // Ahead of the second replay (which then starts): the first one's
    // result, and with it its input, in one read.
    let mut early = vec![0f32; n as usize];
    let mut input = vec![0f32; n as usize];
    encore::Buffer::download_all_after(
        &first,
        &mut [
            (&y, bytemuck::cast_slice_mut(&mut early)),
            (&x, bytemuck::cast_slice_mut(&mut input)),
        ],
    )
    .unwrap();
    assert_eq!(early, vec![3.0f32; n as usize]);
    assert_eq!(input, vec![1.5f32; n as usize]);
    // An upload after the second replay does not change what it reads.
    let third = exec.replay(&[("s", 4.0f32.to_bits())]).unwrap();
    x.upload(&vec![10.0f32; n as usize]).unwrap();
    assert_eq!(y.download::<f32>().unwrap(), vec![6.0f32; n as usize]);
    second.wait().unwrap();
    third.wait().unwrap();
    // Eager work after a held replay runs after it.
    let mut enc = d.encoder();
    enc.dispatch(
        &scale,
        &[Arg::read(&y), Arg::write(&z), Arg::read(&s), Arg::value(&n)],
        "z",
    )
    .unwrap();
    let fourth = exec.replay(&[("s", 0.5f32.to_bits())]).unwrap();
    drop(fourth);
    enc.commit_and_wait().unwrap();
    assert_eq!(z.download::<f32>().unwrap(), vec![2.5f32; n as usize]);
}
