//! The runtime's error type: every failure a caller can observe, with context.

use std::path::PathBuf;

use crate::record::BackendKind;

/// Anything the runtime reports. Device errors carry the operation, kernel or
/// label that observed them, so a failure can be traced to its dispatch.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device name was not understood (`cpu`, `cuda`, `cuda:N`, `metal`, `wgpu`, `wgpu:N`, `auto`).
    #[error("unknown device `{0}` (expected cpu, cuda, cuda:N, metal, wgpu, wgpu:N or auto)")]
    UnknownDevice(String),
    /// The backend or device asked for does not exist on this machine.
    #[error("device `{name}` is not available: {reason}")]
    DeviceUnavailable { name: String, reason: String },
    /// An earlier device error left the device unusable.
    #[error("device {device} failed earlier and refuses further work: {cause}")]
    DeviceFailed { device: String, cause: String },
    /// A view or copy fell outside its buffer.
    #[error("{what}: range {offset}..{end} is outside a buffer of {len} bytes")]
    OutOfRange {
        what: &'static str,
        offset: usize,
        end: usize,
        len: usize,
    },
    /// A buffer from another device was bound or copied.
    #[error("{0}: buffer belongs to another device")]
    WrongDevice(&'static str),
    /// A dispatch's arguments were malformed.
    #[error("dispatch `{label}` (kernel {kernel}): {reason}")]
    InvalidDispatch {
        kernel: String,
        label: String,
        reason: String,
    },
    /// An op (a kernel) has no implementation for this backend. Reported
    /// when it is loaded or dispatched, so a backend can be brought up one
    /// op at a time.
    #[error("`{op}` is not supported on the {backend} backend (no implementation)")]
    Unsupported { op: String, backend: BackendKind },
    /// Compiling a kernel failed; `log` holds the compiler's output.
    #[error("compiling kernel {kernel} failed:\n{log}")]
    Compile { kernel: String, log: String },
    /// A kernel reported failure while running.
    #[error("kernel {kernel} failed in dispatch `{label}`: {message}")]
    KernelFailed {
        kernel: String,
        label: String,
        message: String,
    },
    /// Device memory could not be allocated.
    #[error("out of device memory allocating {bytes} bytes on {device}")]
    OutOfMemory { device: String, bytes: usize },
    /// The backend's driver reported an error.
    #[error("{device}: {operation} failed: {message}")]
    Driver {
        device: String,
        operation: String,
        message: String,
    },
    /// A graph could not be built, instantiated or replayed.
    #[error("graph: {0}")]
    Graph(String),
    /// A configuration value from the environment could not be parsed.
    #[error("configuration: {var}={value:?}: {reason}")]
    Config {
        var: &'static str,
        value: String,
        reason: String,
    },
    /// A file the runtime writes (trace, kernel cache) could not be written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The runtime's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
