//! NVRTC, the CUDA C compiler that runs inside the process.
//!
//! The library is opened at run time by its own small loader rather than
//! through cudarc's bindings, which insist on every function of one CUDA
//! release (CUDA 13's NVRTC dropped some that 12.x bindings require). Only
//! the nine functions compilation needs are looked up, so any NVRTC from
//! 11.2 on works, and a machine without one gets a typed error.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

type Program = *mut c_void;
type Status = c_int;

type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> Status;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> Status;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> Status;
type CopyFn = unsafe extern "C" fn(Program, *mut c_char) -> Status;
type ErrorStringFn = unsafe extern "C" fn(Status) -> *const c_char;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;

/// The NVRTC functions Encore calls.
pub(super) struct Nvrtc {
    version: (i32, i32),
    create: CreateFn,
    compile: CompileFn,
    destroy: DestroyFn,
    log_size: SizeFn,
    log: CopyFn,
    cubin_size: SizeFn,
    cubin: CopyFn,
    error_string: ErrorStringFn,
}

/// The outcome of one compilation.
pub(super) enum Compiled {
    /// Device code (a cubin) ready for `cuModuleLoadData`.
    Binary(Vec<u8>),
    /// The source did not compile; the compiler's log.
    Rejected(String),
}

/// NVRTC, loaded once per process; the error says why it is unavailable.
pub(super) fn nvrtc() -> Result<&'static Nvrtc, String> {
    static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
    NVRTC.get_or_init(load).as_ref().map_err(Clone::clone)
}

impl Nvrtc {
    /// `nvrtc-MAJOR.MINOR`.
    pub(super) fn version(&self) -> String {
        format!("nvrtc-{}.{}", self.version.0, self.version.1)
    }

    /// Compiles `source` for `arch` (`sm_90`) with extra `options`.
    pub(super) fn compile(
        &self,
        name: &str,
        source: &str,
        arch: &str,
        options: &[String],
    ) -> Result<Compiled, String> {
        let source =
            CString::new(source).map_err(|_| "the source contains a NUL byte".to_string())?;
        let file = CString::new(format!("{name}.cu")).unwrap_or_default();
        let mut opts = vec![CString::new(format!("--gpu-architecture={arch}")).unwrap_or_default()];
        for o in options {
            opts.push(
                CString::new(o.as_str())
                    .map_err(|_| format!("option {o:?} contains a NUL byte"))?,
            );
        }
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

        let mut program: Program = std::ptr::null_mut();
        // SAFETY: `source` and `file` are NUL-terminated and outlive the
        // call; no headers are passed (count 0, null arrays).
        let status = unsafe {
            (self.create)(
                &mut program,
                source.as_ptr(),
                file.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        self.ok(status, "nvrtcCreateProgram")?;
        let outcome = self.compile_program(program, &opt_ptrs);
        // SAFETY: `program` was created above and is destroyed once.
        unsafe { (self.destroy)(&mut program) };
        outcome
    }

    fn compile_program(
        &self,
        program: Program,
        options: &[*const c_char],
    ) -> Result<Compiled, String> {
        // SAFETY: `program` is live; `options` holds pointers to
        // NUL-terminated strings that outlive the call.
        let status = unsafe { (self.compile)(program, options.len() as c_int, options.as_ptr()) };
        if status != 0 {
            let mut log = self.program_log(program);
            if log.trim().is_empty() {
                log = self.error_name(status);
            }
            return Ok(Compiled::Rejected(log));
        }
        let mut size = 0usize;
        // SAFETY: writes one size.
        self.ok(
            unsafe { (self.cubin_size)(program, &mut size) },
            "nvrtcGetCUBINSize",
        )?;
        let mut cubin = vec![0u8; size];
        // SAFETY: the buffer holds exactly the size NVRTC reported.
        self.ok(
            unsafe { (self.cubin)(program, cubin.as_mut_ptr().cast()) },
            "nvrtcGetCUBIN",
        )?;
        if cubin.is_empty() {
            return Err("NVRTC produced no device code".into());
        }
        Ok(Compiled::Binary(cubin))
    }

    fn program_log(&self, program: Program) -> String {
        let mut size = 0usize;
        // SAFETY: writes one size.
        if unsafe { (self.log_size)(program, &mut size) } != 0 || size == 0 {
            return String::new();
        }
        let mut log = vec![0u8; size];
        // SAFETY: the buffer holds the size NVRTC reported, NUL included.
        if unsafe { (self.log)(program, log.as_mut_ptr().cast()) } != 0 {
            return String::new();
        }
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        String::from_utf8_lossy(&log[..end]).into_owned()
    }

    fn error_name(&self, status: Status) -> String {
        // SAFETY: returns a pointer to a static string (or null).
        let p = unsafe { (self.error_string)(status) };
        if p.is_null() {
            format!("NVRTC error {status}")
        } else {
            // SAFETY: non-null, static and NUL-terminated.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    fn ok(&self, status: Status, what: &str) -> Result<(), String> {
        if status == 0 {
            Ok(())
        } else {
            Err(format!("{what}: {}", self.error_name(status)))
        }
    }
}

/// Library names tried in order: the unversioned development link, each
/// release's soname, then the toolkit's default location.
const CANDIDATES: &[&str] = &[
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11.2",
    "libnvrtc.so.11",
    "/usr/local/cuda/lib64/libnvrtc.so",
    "/usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so",
];

#[cfg(unix)]
mod dl {
    use std::ffi::{c_char, c_int, c_void};
    pub(super) const RTLD_NOW: c_int = 2;
    extern "C" {
        pub(super) fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        pub(super) fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    }
}

#[cfg(unix)]
fn load() -> Result<Nvrtc, String> {
    let handle = CANDIDATES
        .iter()
        .filter_map(|name| CString::new(*name).ok())
        // SAFETY: dlopen with a NUL-terminated name; the handle is kept for
        // the life of the process (never closed), so symbols stay valid.
        .map(|name| unsafe { dl::dlopen(name.as_ptr(), dl::RTLD_NOW) })
        .find(|h| !h.is_null())
        .ok_or_else(|| {
            format!(
                "the NVRTC library (libnvrtc) was not found; tried {}",
                CANDIDATES.join(", ")
            )
        })?;
    // SAFETY (each call below): the name is the NVRTC function whose C
    // signature (nvrtc.h) the requested function type matches.
    let nvrtc = unsafe {
        Nvrtc {
            version: (0, 0),
            create: function::<CreateFn>(handle, "nvrtcCreateProgram")?,
            compile: function::<CompileFn>(handle, "nvrtcCompileProgram")?,
            destroy: function::<DestroyFn>(handle, "nvrtcDestroyProgram")?,
            log_size: function::<SizeFn>(handle, "nvrtcGetProgramLogSize")?,
            log: function::<CopyFn>(handle, "nvrtcGetProgramLog")?,
            cubin_size: function::<SizeFn>(handle, "nvrtcGetCUBINSize")?,
            cubin: function::<CopyFn>(handle, "nvrtcGetCUBIN")?,
            error_string: function::<ErrorStringFn>(handle, "nvrtcGetErrorString")?,
        }
    };
    // SAFETY: as above, for `nvrtcResult nvrtcVersion(int*, int*)`.
    let version = unsafe { function::<VersionFn>(handle, "nvrtcVersion")? };
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two integers.
    let status = unsafe { version(&mut major, &mut minor) };
    if status != 0 {
        return Err(format!("nvrtcVersion failed: {}", nvrtc.error_name(status)));
    }
    Ok(Nvrtc {
        version: (major, minor),
        ..nvrtc
    })
}

/// Looks up `name` in the library as a function pointer of type `F`.
///
/// # Safety
/// `F` must be an `extern "C"` function pointer type matching the C
/// signature of `name`.
#[cfg(unix)]
unsafe fn function<F: Copy>(handle: *mut c_void, name: &str) -> Result<F, String> {
    if std::mem::size_of::<F>() != std::mem::size_of::<*mut c_void>() {
        return Err(format!("{name}: not a function pointer type"));
    }
    let c = CString::new(name).map_err(|_| name.to_string())?;
    // SAFETY: `handle` is a live library handle; the name is NUL-terminated.
    let p = unsafe { dl::dlsym(handle, c.as_ptr()) };
    if p.is_null() {
        return Err(format!("libnvrtc lacks {name}"));
    }
    // SAFETY: `p` is the address of `name`, `F` is a function pointer of the
    // same size with its signature (the caller's promise).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

#[cfg(not(unix))]
fn load() -> Result<Nvrtc, String> {
    Err("loading NVRTC is supported on Linux only".into())
}
