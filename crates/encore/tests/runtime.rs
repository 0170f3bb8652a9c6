//! Runtime behaviour on the CPU backend: kernels, encoder, hazards, lifetime, counters.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Condvar, Mutex};

use encore::{Arg, BackendKind, Config, CudaKernel, Device, Error, KernelDef, Launch};
use proptest::prelude::*;

fn device() -> Device {
    Device::cpu().unwrap()
}

fn serial_device() -> Device {
    let config = Config::from_vars(|k| (k == "ENCORE_SERIAL").then(|| "1".to_string())).unwrap();
    Device::open("cpu", &config).unwrap()
}

/// A latch that holds a kernel until the test opens it, keeping work in flight.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    fn wait(&self) {
        let (lock, cv) = &*self.0;
        let mut open = lock.lock().unwrap();
        while !*open {
            open = cv.wait(open).unwrap();
        }
    }
    fn open(&self) {
        let (lock, cv) = &*self.0;
        *lock.lock().unwrap() = true;
        cv.notify_all();
    }
}

fn gate_kernel(device: &Device, gate: &Gate) -> encore::Kernel {
    let gate = gate.clone();
    device
        .load_kernel(&KernelDef::new("gate").cpu("gate", move |_| {
            gate.wait();
            Ok(())
        }))
        .unwrap()
}

fn copy_kernel(device: &Device) -> encore::Kernel {
    device
        .load_kernel(&KernelDef::new("copy").cpu("copy f32 v1", |a| {
            let x = a.read::<f32>(0)?;
            let y = a.write::<f32>(1)?;
            y.copy_from_slice(x.get(..y.len()).ok_or("short input")?);
            Ok(())
        }))
        .unwrap()
}

#[test]
fn same_name_different_source_coexist_and_run_their_own_code() {
    let d = device();
    let plus_one = d
        .load_kernel(&KernelDef::new("k").cpu("k: +1", |a| {
            a.write::<f32>(0)?.iter_mut().for_each(|v| *v += 1.0);
            Ok(())
        }))
        .unwrap();
    let times_ten = d
        .load_kernel(&KernelDef::new("k").cpu("k: *10", |a| {
            a.write::<f32>(0)?.iter_mut().for_each(|v| *v *= 10.0);
            Ok(())
        }))
        .unwrap();
    assert_ne!(plus_one.key(), times_ten.key());
    assert_eq!(d.cached_kernels(), 2);
    let buf = d.buffer_from(&[1.0f32, 2.0]).unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&plus_one, &[Arg::read_write(&buf)], "a")
        .unwrap();
    enc.dispatch(&times_ten, &[Arg::read_write(&buf)], "b")
        .unwrap();
    enc.commit_and_wait().unwrap();
    assert_eq!(buf.download::<f32>().unwrap(), [20.0, 30.0]);
    // Loading the same definition again is a cache hit.
    let before = d.counters();
    let again = d
        .load_kernel(&KernelDef::new("k").cpu("k: +1", |_| Ok(())))
        .unwrap();
    assert!(again.same(&plus_one));
    let after = d.counters().since(&before);
    assert_eq!((after.kernel_cache_hits, after.kernel_compiles), (1, 0));
}

#[test]
fn a_kernel_without_a_cpu_implementation_is_unsupported_on_the_cpu() {
    let d = device();
    let cuda_only = KernelDef::new("saxpy_cuda_only").cuda(CudaKernel::fixed(
        include_str!("cuda/saxpy.cu"),
        "saxpy",
        Launch::new(1, 1),
    ));
    let err = d.load_kernel(&cuda_only).unwrap_err();
    match &err {
        Error::Unsupported {
            op,
            backend: BackendKind::Cpu,
        } => assert_eq!(op, "saxpy_cuda_only"),
        other => panic!("expected Unsupported on the CPU, got {other}"),
    }
    assert!(err.to_string().contains("saxpy_cuda_only"), "{err}");
    // Nothing was cached, and the device goes on loading and running kernels.
    assert_eq!(d.cached_kernels(), 0);
    let k = copy_kernel(&d);
    let x = d.buffer_from(&[5.0f32; 4]).unwrap();
    let y = d.alloc(16).unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&k, &[Arg::read(&x), Arg::write(&y)], "copy")
        .unwrap();
    enc.commit_and_wait().unwrap();
    assert_eq!(y.download::<f32>().unwrap(), [5.0; 4]);
}

#[test]
fn kernel_referenced_by_in_flight_work_is_never_released() {
    let d = device();
    let gate = Gate::default();
    let blocker = gate_kernel(&d, &gate);
    let k = copy_kernel(&d);
    let weak = k.downgrade();
    let x = d.buffer_from(&[7.0f32; 4]).unwrap();
    let y = d.alloc(16).unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&blocker, &[], "hold").unwrap();
    enc.dispatch(&k, &[Arg::read(&x), Arg::write(&y)], "copy")
        .unwrap();
    let sub = enc.commit().unwrap();
    drop(k);
    drop(blocker);
    // Nothing outside the submission holds the kernels now; eviction must skip them.
    assert_eq!(d.evict_unused_kernels(), 0);
    assert!(weak.is_alive());
    gate.open();
    sub.wait().unwrap();
    assert_eq!(y.download::<f32>().unwrap(), [7.0; 4]);
    drop(sub);
    assert_eq!(d.evict_unused_kernels(), 2);
    assert!(!weak.is_alive(), "released once the work completed");
}

#[test]
fn failure_inside_a_dispatch_comes_back_from_wait() {
    let d = device();
    let bad = d
        .load_kernel(&KernelDef::new("bad").cpu("bad", |_| Err("boom".into())))
        .unwrap();
    let panicky = d
        .load_kernel(&KernelDef::new("panicky").cpu("panicky", |a| {
            // Reads past the end of its argument list: a kernel bug.
            let _ = a.read::<f32>(5)?;
            Ok(())
        }))
        .unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&bad, &[], "the bad one").unwrap();
    let err = enc.commit().unwrap().wait().unwrap_err();
    match &err {
        Error::KernelFailed {
            kernel,
            label,
            message,
        } => {
            assert_eq!(kernel, "bad");
            assert_eq!(label, "the bad one");
            assert_eq!(message, "boom");
        }
        other => panic!("unexpected error {other}"),
    }
    enc.dispatch(&panicky, &[], "p").unwrap();
    let err = enc.commit_and_wait().err().unwrap();
    assert!(err.to_string().contains("argument 5 missing"), "{err}");
}

#[test]
fn wrong_access_use_is_a_kernel_error_not_ub() {
    let d = device();
    let sneaky = d
        .load_kernel(&KernelDef::new("sneaky").cpu("sneaky", |a| {
            a.write::<f32>(0)?.fill(1.0);
            Ok(())
        }))
        .unwrap();
    let buf = d.alloc(16).unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&sneaky, &[Arg::read(&buf)], "s").unwrap();
    let err = enc.commit_and_wait().err().unwrap();
    assert!(err.to_string().contains("read-only"), "{err}");
}

#[test]
fn out_of_range_views_are_typed_errors() {
    let d = device();
    let buf = d.alloc(100).unwrap();
    assert!(matches!(buf.view(90, 11), Err(Error::OutOfRange { .. })));
    assert!(matches!(
        buf.view(usize::MAX, 2),
        Err(Error::OutOfRange { .. })
    ));
    let v = buf.view(10, 50).unwrap();
    assert!(matches!(v.view(40, 11), Err(Error::OutOfRange { .. })));
    assert_eq!(v.view(40, 10).unwrap().offset(), 50);
    assert!(matches!(
        v.upload(&[0u8; 51]),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        v.view_elems::<f32>(usize::MAX / 2, 2),
        Err(Error::OutOfRange { .. })
    ));
}

#[test]
fn overlapping_arguments_of_one_dispatch_are_rejected() {
    let d = device();
    let k = copy_kernel(&d);
    let buf = d.alloc(64).unwrap();
    let (a, b) = (buf.view(0, 32).unwrap(), buf.view(16, 32).unwrap());
    let mut enc = d.encoder();
    let err = enc
        .dispatch(&k, &[Arg::read(&a), Arg::write(&b)], "alias")
        .unwrap_err();
    assert!(matches!(err, Error::InvalidDispatch { .. }));
    assert!(enc.is_empty());
}

fn barriers_between(
    d: &Device,
    first: (&encore::Buffer, bool),
    second: (&encore::Buffer, bool),
) -> u64 {
    let k = d
        .load_kernel(&KernelDef::new("touch").cpu("touch", |_| Ok(())))
        .unwrap();
    fn arg<'a>((b, w): (&'a encore::Buffer, bool)) -> Arg<'a> {
        if w {
            Arg::write(b)
        } else {
            Arg::read(b)
        }
    }
    let before = d.counters();
    let mut enc = d.encoder();
    enc.dispatch(&k, &[arg(first)], "1").unwrap();
    enc.dispatch(&k, &[arg(second)], "2").unwrap();
    enc.commit_and_wait().unwrap();
    let c = d.counters().since(&before);
    assert_eq!(c.auto_barriers + c.concurrent_dispatches, 1);
    c.auto_barriers
}

#[test]
fn views_of_one_parent_conflict_by_byte_range() {
    let d = device();
    let parent = d.alloc(256).unwrap();
    let lo = parent.view(0, 128).unwrap();
    let hi = parent.view(128, 128).unwrap();
    let mid = parent.view(64, 128).unwrap();
    let other = d.alloc(256).unwrap();
    // read-after-write, write-after-read, write-after-write on overlapping views
    assert_eq!(barriers_between(&d, (&lo, true), (&mid, false)), 1);
    assert_eq!(barriers_between(&d, (&mid, false), (&hi, true)), 1);
    assert_eq!(barriers_between(&d, (&hi, true), (&mid, true)), 1);
    // read-read, touching, different allocations
    assert_eq!(barriers_between(&d, (&lo, false), (&mid, false)), 0);
    assert_eq!(barriers_between(&d, (&lo, true), (&hi, true)), 0);
    assert_eq!(barriers_between(&d, (&parent, true), (&other, true)), 0);
}

#[test]
fn serial_mode_places_a_barrier_after_every_dispatch() {
    let d = serial_device();
    let k = d
        .load_kernel(&KernelDef::new("touch").cpu("touch", |_| Ok(())))
        .unwrap();
    let bufs: Vec<_> = (0..5).map(|_| d.alloc(64).unwrap()).collect();
    let mut enc = d.encoder();
    for b in &bufs {
        enc.dispatch(&k, &[Arg::write(b)], "w").unwrap();
    }
    enc.commit_and_wait().unwrap();
    let c = d.counters();
    assert_eq!(c.auto_barriers, 4);
    assert_eq!(c.concurrent_dispatches, 0);
}

#[test]
fn dropped_buffer_is_still_read_correctly_and_its_memory_is_not_reused_early() {
    let d = device();
    let gate = Gate::default();
    let blocker = gate_kernel(&d, &gate);
    let k = copy_kernel(&d);
    let data: Vec<f32> = (0..1024).map(|i| i as f32 * 0.5 + 1.0).collect();
    let src = d.buffer_from(&data).unwrap();
    let dst = d.alloc(4096).unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&blocker, &[], "hold").unwrap();
    enc.barrier();
    enc.dispatch(&k, &[Arg::read(&src), Arg::write(&dst)], "copy")
        .unwrap();
    let sub = enc.commit().unwrap();
    let stats_before = d.pool_stats();
    drop(src);
    // The submission still holds the source: it is neither pooled nor reusable.
    assert_eq!(d.pool_stats().pooled_bytes, stats_before.pooled_bytes);
    let fresh = d.alloc(4096).unwrap();
    assert_eq!(d.pool_stats().reuses, stats_before.reuses, "no early reuse");
    drop(fresh);
    gate.open();
    sub.wait().unwrap();
    assert_eq!(dst.download::<f32>().unwrap(), data);
    // Completion observed: the memory is back in the pool and gets reused.
    let reuses = d.pool_stats().reuses;
    let again = d.alloc(4096).unwrap();
    let again2 = d.alloc(4096).unwrap();
    assert!(d.pool_stats().reuses >= reuses + 2);
    drop((again, again2));
}

#[test]
fn dropping_an_unfinished_submission_keeps_its_buffers_alive() {
    let d = device();
    let gate = Gate::default();
    let blocker = gate_kernel(&d, &gate);
    let k = copy_kernel(&d);
    let src = d.buffer_from(&[3.0f32; 256]).unwrap();
    let dst = d.alloc(1024).unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&blocker, &[], "hold").unwrap();
    enc.barrier();
    enc.dispatch(&k, &[Arg::read(&src), Arg::write(&dst)], "copy")
        .unwrap();
    let live_before = d.pool_stats().live_bytes;
    drop(enc.commit().unwrap());
    drop(src);
    assert_eq!(
        d.pool_stats().live_bytes,
        live_before,
        "the device adopted it"
    );
    gate.open();
    d.synchronize().unwrap();
    assert_eq!(dst.download::<f32>().unwrap(), [3.0; 256]);
    assert!(d.pool_stats().live_bytes < live_before);
}

#[test]
fn errors_of_dropped_submissions_surface_at_the_next_sync() {
    let d = device();
    let bad = d
        .load_kernel(&KernelDef::new("bad").cpu("bad", |_| Err("late boom".into())))
        .unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&bad, &[], "x").unwrap();
    drop(enc.commit().unwrap());
    let err = d.synchronize().unwrap_err();
    assert!(err.to_string().contains("late boom"));
    d.synchronize().unwrap();
}

#[test]
fn counters_count_and_reset() {
    let d = device();
    let k = copy_kernel(&d);
    let a = d.buffer_from(&[1.0f32; 8]).unwrap();
    let b = d.alloc(32).unwrap();
    let c = d.alloc(32).unwrap();
    let mut enc = d.encoder();
    enc.dispatch(&k, &[Arg::read(&a), Arg::write(&b)], "1")
        .unwrap();
    enc.dispatch(&k, &[Arg::read(&a), Arg::write(&c)], "2")
        .unwrap(); // joins
    enc.dispatch(&k, &[Arg::read(&b), Arg::write(&c)], "3")
        .unwrap(); // RAW + WAW
    enc.barrier();
    enc.dispatch(&k, &[Arg::read(&c), Arg::write(&b)], "4")
        .unwrap();
    enc.commit_and_wait().unwrap();
    let n = d.counters();
    assert_eq!(n.dispatches, 4);
    assert_eq!(n.submissions, 1);
    assert_eq!(n.waits, 1);
    assert_eq!(n.auto_barriers, 1);
    assert_eq!(n.barriers, 2);
    assert_eq!(n.concurrent_dispatches, 1);
    assert_eq!(n.kernel_compiles, 1);
    d.reset_counters();
    assert_eq!(d.counters(), encore::Counters::default());
}

#[test]
fn unknown_and_unavailable_devices_are_typed_errors() {
    let config = Config::default();
    assert!(matches!(
        Device::open("tpu", &config),
        Err(Error::UnknownDevice(_))
    ));
    assert!(matches!(
        Device::open("cuda:x", &config),
        Err(Error::UnknownDevice(_))
    ));
    // On a machine without CUDA this is DeviceUnavailable; with one it opens.
    match Device::open("cuda:0", &config) {
        Ok(d) => assert_eq!(d.name(), "cuda:0"),
        Err(e) => assert!(matches!(e, Error::DeviceUnavailable { .. }), "{e}"),
    }
    assert!(Device::open("auto", &config).is_ok());
}

/// Adds `delta` to every element, in chunks on the worker pool, so one
/// dispatch's work interleaves with its neighbours' when they share a group.
fn axpy_kernel(d: &Device) -> encore::Kernel {
    d.load_kernel(&KernelDef::new("mix").cpu("mix v1", |a| {
        let scale: f32 = a.scalar(2)?;
        let x = a.read::<f32>(0)?;
        let y = a.write::<f32>(1)?;
        encore::parallel::for_each_chunk_mut(y, 7, |c, chunk| {
            for (i, v) in chunk.iter_mut().enumerate() {
                let xi = x[(c * 7 + i) % x.len()];
                *v = *v * 0.5 + xi * scale;
            }
        });
        Ok(())
    }))
    .unwrap()
}

#[derive(Clone, Debug)]
struct Op {
    src: (usize, usize), // element offset, length
    dst: (usize, usize),
    scale: f32,
}

fn op_strategy(len: usize) -> impl Strategy<Value = Op> {
    let range = move || (0..len - 1).prop_flat_map(move |s| (Just(s), 1..=(len - s).min(64)));
    (range(), range(), -2.0f32..2.0).prop_map(|(src, dst, scale)| Op { src, dst, scale })
}

fn run_ops(d: &Device, ops: &[Op], init: &[f32]) -> Vec<f32> {
    let k = axpy_kernel(d);
    let buf = d.buffer_from(init).unwrap();
    let mut enc = d.encoder();
    for op in ops {
        let src = buf.view_elems::<f32>(op.src.0, op.src.1).unwrap();
        let dst = buf.view_elems::<f32>(op.dst.0, op.dst.1).unwrap();
        let overlaps = op.src.0 < op.dst.0 + op.dst.1 && op.dst.0 < op.src.0 + op.src.1;
        if overlaps {
            // One dispatch may not alias its own arguments; read a copy instead.
            continue;
        }
        enc.dispatch(
            &k,
            &[Arg::read(&src), Arg::write(&dst), Arg::value(&op.scale)],
            "op",
        )
        .unwrap();
    }
    enc.commit_and_wait().unwrap();
    buf.download().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random dispatches over random overlapping views, run with hazard
    /// tracking and parallel groups, are bit-identical to serial execution.
    #[test]
    fn hazard_tracked_execution_equals_serial(ops in prop::collection::vec(op_strategy(256), 1..40), seed in 0u32..1000) {
        let init: Vec<f32> = (0..256).map(|i| (((i as u32).wrapping_mul(2654435761u32) ^ seed) % 1000) as f32 / 100.0 + 0.01).collect();
        let tracked = run_ops(&device(), &ops, &init);
        let serial = run_ops(&serial_device(), &ops, &init);
        prop_assert_eq!(tracked.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        serial.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
}

#[test]
fn auto_opens_the_configured_device() {
    let config = Config {
        device: "cpu".into(),
        ..Config::default()
    };
    assert_eq!(Device::open("auto", &config).unwrap().name(), "cpu");
    let config = Config {
        device: "nonsense".into(),
        ..Config::default()
    };
    assert!(matches!(
        Device::open("auto", &config),
        Err(Error::UnknownDevice(name)) if name == "nonsense"
    ));
    // A device named explicitly is opened whatever `auto` would resolve to.
    assert_eq!(Device::open("cpu", &config).unwrap().name(), "cpu");
}
