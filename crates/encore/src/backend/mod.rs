//! The boundary between the runtime and a device API.
//!
//! A backend does only allocation, copies, compilation and launch. Hazards,
//! lifetimes, pooling, graphs and profiling live once, in the runtime above,
//! and reach a backend as a `Program`: dispatches already split into
//! concurrent groups, with resolved arguments.

pub mod cpu;
pub mod cuda;
#[cfg_attr(not(any(feature = "wgpu", target_vendor = "apple")), allow(dead_code))]
pub(crate) mod failure;
pub mod metal;
pub(crate) mod wgpu;
#[cfg_attr(not(any(feature = "wgpu", target_vendor = "apple")), allow(dead_code))]
pub(crate) mod wgsl;

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::kernel::{Kernel, KernelDef};
use crate::program::Program;
use crate::record::{BackendKind, Capabilities, Launch, MemoryInfo, RawMem, Upload};

/// What the backend measured for a completed submission.
#[derive(Clone, Debug, Default)]
pub(crate) struct Timing {
    /// Device time from the first dispatch's start to the last one's end.
    pub elapsed: Duration,
    /// Per-dispatch device time, when asked for.
    pub dispatches: Vec<Duration>,
    /// The host instant at which the submission started on the device, when
    /// the backend can tell; traces place device times on the host clock
    /// with it.
    pub started: Option<Instant>,
    /// When timing dispatches: each dispatch's start, relative to `started`.
    /// May be empty (traces then lay dispatches out group after group).
    pub dispatch_starts: Vec<Duration>,
}

/// An in-flight submission as the backend sees it.
pub(crate) trait BackendSubmission: Send + Sync {
    /// `None` while running; the outcome once complete.
    fn poll(&self) -> Option<Result<Timing>>;
    /// Blocks until complete.
    fn wait(&self) -> Result<Timing>;
}

/// A program prepared once for repeated launches (a native graph on CUDA).
pub(crate) trait Executable: Send + Sync {
    fn launch(&self, uploads: &[Upload], timing: bool) -> Result<Box<dyn BackendSubmission>>;
}

/// A device API.
pub(crate) trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// What this backend can do, for the ops and graphs above it.
    fn capabilities(&self) -> Capabilities;
    /// The device's name, such as `cpu` or `cuda:0`.
    fn name(&self) -> &str;
    /// Target architecture for kernel keys (`x86_64`, `sm_90`).
    fn arch(&self) -> String;
    /// Versions of the compiler and driver, part of kernel keys.
    fn toolchain(&self) -> String;
    /// Allocates `bytes` (a pool size class) of device memory.
    fn alloc(&self, bytes: usize) -> Result<RawMem>;
    /// The device's free and total memory, or `None` when the backend
    /// cannot tell.
    fn memory(&self) -> Result<Option<MemoryInfo>> {
        Ok(None)
    }
    /// Frees memory from [`Backend::alloc`]; the runtime guarantees no work uses it.
    fn free(&self, mem: RawMem, bytes: usize);
    /// Copies host bytes in, ordered after all submitted work; complete on return.
    fn write(&self, mem: RawMem, offset: usize, data: &[u8]) -> Result<()>;
    /// Copies device bytes out, ordered after all submitted work.
    fn read(&self, mem: RawMem, offset: usize, out: &mut [u8]) -> Result<()>;
    /// Copies device bytes out without waiting for submitted work, which
    /// goes on running: the caller has seen the work that wrote them
    /// complete. Backends that cannot copy beside running work read as
    /// [`Backend::read`] does.
    fn read_settled(&self, mem: RawMem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.read(mem, offset, out)
    }
    /// [`Backend::read_settled`] of several ranges `(mem, offset, out)` at
    /// once, which a backend that submits its copies (wgpu) makes one
    /// submission.
    fn read_settled_many(&self, reads: &mut [(RawMem, usize, &mut [u8])]) -> Result<()> {
        for (mem, offset, out) in reads.iter_mut() {
            self.read_settled(*mem, *offset, out)?;
        }
        Ok(())
    }
    /// The launch geometry of a dispatch of `kernel` whose inline bytes
    /// (its value arguments, concatenated in order) are `value`: computed by
    /// the kernel's implementation for this backend. Backends without a
    /// launch grid compute none.
    fn launch(&self, _kernel: &Kernel, _value: &[u8]) -> std::result::Result<Launch, String> {
        Ok(Launch::NONE)
    }
    /// Compiles a kernel's implementation for this backend.
    fn compile(&self, def: &KernelDef) -> Result<Arc<dyn Any + Send + Sync>>;
    /// Runs a program once.
    fn submit(
        &self,
        program: Arc<Program>,
        uploads: Vec<Upload>,
        timing: bool,
    ) -> Result<Box<dyn BackendSubmission>>;
    /// Prepares a program for repeated launches.
    fn instantiate(&self, program: Arc<Program>) -> Result<Box<dyn Executable>>;
    /// Waits for all submitted work.
    fn synchronize(&self) -> Result<()>;
    /// The error that made the device unusable, if any.
    fn failure(&self) -> Option<String>;
    /// Kernels [`Backend::compile`] loaded from the on-disk cache instead of
    /// compiling, since the last call (each is counted once).
    fn take_disk_hits(&self) -> u64 {
        0
    }
    /// Called just before the launch that a one-shot capture records
    /// (`ENCORE_CAPTURE`); `name` says which (`graph replay 3`), on the
    /// thread that then launches it. A backend may open a profiler range
    /// here and mark the launch for tools (CUDA: NVTX ranges for the step
    /// and each dispatch). The launch that follows asks for dispatch timing.
    fn capture_begin(&self, _name: &str) {}
    /// Called once the captured launch's completion (or failure) has been
    /// observed, exactly once per [`Backend::capture_begin`].
    fn capture_end(&self) {}
    /// Where the runtime writes its Chrome trace of the captured launch
    /// when the configured destination is `path`: there, unless the
    /// backend writes a trace of its own there (Metal's GPU trace
    /// documents).
    fn capture_trace_path(&self, path: &std::path::Path) -> std::path::PathBuf {
        path.to_path_buf()
    }
}
