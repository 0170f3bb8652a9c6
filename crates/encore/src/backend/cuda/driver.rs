//! The CUDA driver: loading it, naming its errors, and one context per GPU.
//!
//! The driver library is loaded at run time (cudarc's `dynamic-loading`), so
//! a binary built without CUDA runs anywhere. cudarc panics when the library
//! or one of its functions is missing; everything here checks presence first
//! and catches that panic, so a machine without a driver gets a typed error.

use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::sys::{self, CUcontext, CUdevice, CUresult};

use crate::error::{Error, Result};

/// Loads libcuda and initializes it, once per process. The error says why
/// CUDA cannot be used.
pub(super) fn driver() -> std::result::Result<(), String> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries to open candidate library
            // files; it returns false when none exists and panics (caught)
            // when one exists but lacks a function the bindings name.
            match catch_unwind(|| unsafe { sys::is_culib_present() }) {
                Ok(true) => {}
                Ok(false) => {
                    return Err("the CUDA driver library (libcuda.so) was not found".into())
                }
                Err(_) => {
                    return Err(
                        "libcuda was found but lacks functions of CUDA 12.8; the driver is too old"
                            .into(),
                    )
                }
            }
            // SAFETY: the library is present; `culib` loads it once for the
            // process. A panic (a missing symbol) is caught.
            if catch_unwind(|| unsafe { sys::culib() }).is_err() {
                return Err("libcuda could not be loaded".into());
            }
            // SAFETY: plain driver call; flags must be 0.
            let code = unsafe { sys::cuInit(0) };
            if code != CUresult::CUDA_SUCCESS {
                return Err(format!("cuInit failed: {}", describe(code)));
            }
            Ok(())
        })
        .clone()
}

/// Runs a driver call that may panic inside cudarc (never expected once the
/// library is loaded, but a panic must not cross into the runtime).
pub(super) fn guarded<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|_| "the CUDA bindings panicked".to_string())
}

/// `CUDA_ERROR_NAME: description` for a result code.
pub(super) fn describe(code: CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls write a pointer to a static string (or leave it null
    // for an unknown code); they read nothing else.
    unsafe {
        sys::cuGetErrorName(code, &mut name);
        sys::cuGetErrorString(code, &mut text);
    }
    let read = |p: *const std::ffi::c_char| {
        if p.is_null() {
            None
        } else {
            // SAFETY: non-null pointers from the driver point to static,
            // NUL-terminated strings.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    };
    match (read(name), read(text)) {
        (Some(n), Some(t)) => format!("{n}: {t}"),
        (Some(n), None) => n,
        _ => format!("CUDA error {}", code as u32),
    }
}

/// Errors after which the context is unusable: every later call fails.
fn is_sticky(code: CUresult) -> bool {
    use CUresult::*;
    matches!(
        code,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
            | CUDA_ERROR_UNKNOWN
    )
}

/// The primary context of one GPU, shared by every device opened on it in
/// this process. A sticky error poisons the whole context, so the failure
/// it records is seen by all of them.
pub(super) struct Context {
    pub(super) ctx: CUcontext,
    pub(super) device: CUdevice,
    pub(super) name: String,
    failure: OnceLock<String>,
}

// SAFETY: a CUcontext is a process-wide handle that the driver lets any
// thread make current; `Context` mutates nothing but the `OnceLock`.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// The shared context of GPU `ordinal`, retaining the primary context on first use.
    pub(super) fn get(ordinal: usize) -> Result<Arc<Context>> {
        static CONTEXTS: Mutex<Vec<(usize, Weak<Context>)>> = Mutex::new(Vec::new());
        let name = format!("cuda:{ordinal}");
        let unavailable = |reason: String| Error::DeviceUnavailable {
            name: name.clone(),
            reason,
        };
        driver().map_err(unavailable)?;
        let mut contexts = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
        contexts.retain(|(_, w)| w.strong_count() > 0);
        if let Some(ctx) = contexts
            .iter()
            .find(|(o, _)| *o == ordinal)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(ctx);
        }
        let count = device_count();
        if ordinal >= count {
            return Err(unavailable(format!(
                "this machine has {count} CUDA device(s)"
            )));
        }
        let mut device: CUdevice = 0;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is initialized and `ordinal` is below the device
        // count; both calls write their out-parameter only.
        let code = guarded(|| unsafe {
            let code = sys::cuDeviceGet(&mut device, ordinal as i32);
            if code != CUresult::CUDA_SUCCESS {
                return code;
            }
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })
        .map_err(unavailable)?;
        if code != CUresult::CUDA_SUCCESS {
            return Err(unavailable(format!(
                "cannot create a context: {}",
                describe(code)
            )));
        }
        let context = Arc::new(Context {
            ctx,
            device,
            name: name.clone(),
            failure: OnceLock::new(),
        });
        contexts.push((ordinal, Arc::downgrade(&context)));
        Ok(context)
    }

    /// Makes this context current on the calling thread (a cheap check when it already is).
    pub(super) fn bind(&self) -> Result<()> {
        let mut current: CUcontext = std::ptr::null_mut();
        // SAFETY: reads the calling thread's current context.
        let code = unsafe { sys::cuCtxGetCurrent(&mut current) };
        if code == CUresult::CUDA_SUCCESS && current == self.ctx {
            return Ok(());
        }
        // SAFETY: `self.ctx` is a retained primary context, valid until drop.
        let code = unsafe { sys::cuCtxSetCurrent(self.ctx) };
        self.check(code, || "make the context current".into())
    }

    /// Turns a result code into a typed error naming `operation`, and
    /// records a sticky error as the context's failure.
    pub(super) fn check(&self, code: CUresult, operation: impl FnOnce() -> String) -> Result<()> {
        if code == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error(code, operation()))
        }
    }

    pub(super) fn error(&self, code: CUresult, operation: String) -> Error {
        let message = self.fault(code, &operation);
        Error::Driver {
            device: self.name.clone(),
            operation,
            message,
        }
    }

    /// Describes a failed call, recording a sticky error as the context's failure.
    pub(super) fn fault(&self, code: CUresult, operation: &str) -> String {
        let message = describe(code);
        if is_sticky(code) {
            let _ = self.failure.set(format!("{operation}: {message}"));
        }
        message
    }

    /// The sticky error that poisoned the context, if any.
    pub(super) fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    /// Refuses work on a poisoned context.
    pub(super) fn usable(&self) -> Result<()> {
        match self.failure() {
            Some(cause) => Err(Error::DeviceFailed {
                device: self.name.clone(),
                cause: cause.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// An integer device attribute (0 if the query fails).
    pub(super) fn attribute(&self, attribute: sys::CUdevice_attribute) -> i32 {
        attribute_of(self.device, attribute)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `get`; everything that used
        // the context (streams, modules, graphs) holds an `Arc` to it and is gone.
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

fn attribute_of(device: CUdevice, attribute: sys::CUdevice_attribute) -> i32 {
    let mut value = 0;
    // SAFETY: writes one integer; `device` came from cuDeviceGet.
    let code = unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, device) };
    if code == CUresult::CUDA_SUCCESS {
        value
    } else {
        0
    }
}

/// GPUs the driver reports (0 without a driver).
pub(super) fn device_count() -> usize {
    if driver().is_err() {
        return 0;
    }
    let mut count = 0;
    // SAFETY: the driver is initialized; writes one integer.
    match guarded(|| unsafe { sys::cuDeviceGetCount(&mut count) }) {
        Ok(CUresult::CUDA_SUCCESS) => count.max(0) as usize,
        _ => 0,
    }
}

/// The driver's CUDA version as `major.minor` (`13.0`).
pub(super) fn driver_version() -> String {
    match driver_version_number() {
        Some(v) => format!("{}.{}", v / 1000, (v % 1000) / 10),
        None => "unknown".into(),
    }
}

/// The CUDA version the driver supports, as `1000 * major + 10 * minor`.
pub(super) fn driver_version_number() -> Option<i32> {
    let mut v = 0;
    // SAFETY: writes one integer; callable before and after cuInit.
    let code = unsafe { sys::cuDriverGetVersion(&mut v) };
    (code == CUresult::CUDA_SUCCESS).then_some(v)
}

/// What a GPU is, in words: name, architecture, memory.
pub(super) fn describe_device(ordinal: usize) -> Option<String> {
    driver().ok()?;
    let mut device: CUdevice = 0;
    let mut name = [0 as std::ffi::c_char; 256];
    let mut bytes = 0usize;
    // SAFETY: the driver is initialized; each call writes its out-parameter
    // (the name buffer up to its given length, NUL-terminated).
    let ok = guarded(|| unsafe {
        sys::cuDeviceGet(&mut device, ordinal as i32) == CUresult::CUDA_SUCCESS
            && sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, device)
                == CUresult::CUDA_SUCCESS
            && sys::cuDeviceTotalMem_v2(&mut bytes, device) == CUresult::CUDA_SUCCESS
    })
    .ok()?;
    if !ok {
        return None;
    }
    // SAFETY: the driver NUL-terminated the name inside the buffer.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy();
    use sys::CUdevice_attribute::*;
    let major = attribute_of(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    let minor = attribute_of(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    let sms = attribute_of(device, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    Some(format!(
        "{name}, sm_{major}{minor}, {sms} SMs, {:.0} GiB, CUDA driver {}",
        bytes as f64 / (1u64 << 30) as f64,
        driver_version()
    ))
}
