//! A device error that poisons the CUDA context: an illegal address.
//!
//! After such an error every later call in the context fails, so this test
//! has a binary (a process) of its own. Ignored by default like the rest of
//! the GPU suite; `scripts/gpu-run.sh` runs it.

// Helpers fail a test the way assertions do: by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{Arg, Config, CudaKernel, Device, Error, KernelDef, Launch};

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn an_illegal_address_is_a_typed_error_and_fails_the_device() {
    let config = Config {
        cache_dir: None,
        ..Config::default()
    };
    let d = Device::open("cuda", &config).unwrap();
    let k = d
        .load_kernel(&KernelDef::new("fault").cuda(CudaKernel::fixed(
            include_str!("cuda/fault.cu"),
            "fault",
            Launch::new(1, 1),
        )))
        .unwrap();
    let keep = d.buffer_from(&[7u32; 16]).unwrap();
    let bogus: u64 = 0xdead_0000_0000;
    let submission = {
        let mut enc = d.encoder();
        enc.dispatch(&k, &[Arg::value(&bogus)], "fault").unwrap();
        enc.commit().unwrap()
    };
    match submission.wait() {
        Err(Error::Driver { message, .. }) => {
            assert!(message.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{message}");
        }
        other => panic!("expected a driver error, got {other:?}"),
    }

    // The device reports itself failed and refuses further work.
    assert!(matches!(d.alloc(64), Err(Error::DeviceFailed { .. })));
    assert!(matches!(
        keep.download::<u32>(),
        Err(Error::DeviceFailed { .. })
    ));
    let mut again = d.encoder();
    again.dispatch(&k, &[Arg::value(&bogus)], "again").unwrap();
    match again.commit() {
        Err(Error::DeviceFailed { cause, .. }) => {
            assert!(cause.contains("ILLEGAL_ADDRESS"), "{cause}")
        }
        other => panic!("expected DeviceFailed, got {:?}", other.map(|_| ())),
    }
    assert!(d.synchronize().is_err());

    // The context is shared: another device on the same GPU refuses too.
    match Device::open("cuda", &config) {
        Err(Error::DeviceFailed { .. }) => {}
        other => panic!("expected DeviceFailed, got {other:?}"),
    }

    // The submission remembers its error for later waits.
    let second_wait = submission.wait();

    // A sticky error lasts for the life of the process: even once every
    // handle is gone and the context released, opening the GPU again is a
    // typed error, not a panic.
    drop((submission, again, keep, k, d));
    match Device::open("cuda", &config) {
        Err(Error::DeviceFailed { .. } | Error::DeviceUnavailable { .. }) => {}
        other => panic!("expected a typed error, got {other:?}"),
    }

    assert!(second_wait.is_err(), "a second wait forgot the error");
}
