//! The boundary between the runtime and a device API.
//!
//! A backend does only allocation, copies, compilation and launch. Hazards,
//! lifetimes, pooling, graphs and profiling live once, in the runtime above,
//! and reach a backend as a `Program`: dispatches already split into
//! concurrent groups, with resolved arguments.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::encoder::{Access, Launch};
use crate::error::Result;
use crate::kernel::{Kernel, KernelDef};
use crate::Label;

/// Which device API a device runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Host threads; the reference every other backend is tested against.
    Cpu,
    /// NVIDIA GPUs through the CUDA driver API and NVRTC.
    Cuda,
}

impl BackendKind {
    /// Lower-case name, as used in device names and kernel keys.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// A backend's opaque handle to one allocation (a host address on CPU, a
/// device pointer on CUDA).
pub(crate) type RawMem = u64;

/// One resolved dispatch argument.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ArgRec {
    /// A byte range of an allocation.
    Buffer {
        mem: RawMem,
        alloc: u64,
        offset: usize,
        len: usize,
        access: Access,
    },
    /// Inline bytes at `start..start + len` of the program's byte arena.
    Bytes { start: u32, len: u32 },
}

/// One dispatch of a program.
#[derive(Clone, Debug)]
pub(crate) struct DispatchRec {
    pub kernel: Kernel,
    pub args: std::ops::Range<u32>,
    pub launch: Launch,
    pub label: Label,
}

/// Dispatches in concurrent groups, ready for a backend to run or instantiate.
/// Dispatches of one group may run in any order or at the same time; a group
/// starts after the previous one has finished.
#[derive(Debug, Default)]
pub(crate) struct Program {
    pub dispatches: Vec<DispatchRec>,
    pub args: Vec<ArgRec>,
    pub bytes: Vec<u8>,
    /// End index (exclusive) of each group in `dispatches`.
    pub group_ends: Vec<u32>,
    /// Dependency edges (from, to) between dispatches, used by backends that
    /// build native graphs; empty for eager programs.
    pub edges: Vec<(u32, u32)>,
}

impl Program {
    pub(crate) fn groups(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let mut start = 0usize;
        self.group_ends.iter().map(move |&end| {
            let r = start..end as usize;
            start = end as usize;
            r
        })
    }

    pub(crate) fn args_of(&self, d: &DispatchRec) -> &[ArgRec] {
        self.args
            .get(d.args.start as usize..d.args.end as usize)
            .unwrap_or(&[])
    }

    /// The program run `times` times in a row: copy `i + 1` starts after
    /// all of copy `i` (its first groups follow the last group before them;
    /// with edges, every dispatch nothing in its copy waits for precedes
    /// every dispatch that waits for nothing in the next copy). The copies
    /// share the inline-byte arena.
    pub(crate) fn repeated(&self, times: usize) -> Program {
        let n = self.dispatches.len() as u32;
        let arg_count = self.args.len() as u32;
        let (mut has_out, mut has_in) = (vec![false; n as usize], vec![false; n as usize]);
        for &(a, b) in &self.edges {
            has_out[a as usize] = true;
            has_in[b as usize] = true;
        }
        let mut out = Program {
            bytes: self.bytes.clone(),
            ..Program::default()
        };
        for copy in 0..times as u32 {
            let (first, args_at) = (copy * n, copy * arg_count);
            out.args.extend_from_slice(&self.args);
            out.dispatches
                .extend(self.dispatches.iter().map(|d| DispatchRec {
                    args: d.args.start + args_at..d.args.end + args_at,
                    ..d.clone()
                }));
            out.group_ends
                .extend(self.group_ends.iter().map(|&e| e + first));
            out.edges
                .extend(self.edges.iter().map(|&(a, b)| (a + first, b + first)));
            if copy > 0 && !self.edges.is_empty() {
                let prev = first - n;
                for sink in (0..n).filter(|&i| !has_out[i as usize]) {
                    for source in (0..n).filter(|&i| !has_in[i as usize]) {
                        out.edges.push((prev + sink, first + source));
                    }
                }
            }
        }
        out
    }
}

/// Bytes written into device memory before a program runs (graph parameters).
#[derive(Clone, Debug)]
pub(crate) struct Upload {
    pub mem: RawMem,
    pub offset: usize,
    pub bytes: Vec<u8>,
}

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
    /// The device's name, such as `cpu` or `cuda:0`.
    fn name(&self) -> &str;
    /// Target architecture for kernel keys (`x86_64`, `sm_90`).
    fn arch(&self) -> String;
    /// Versions of the compiler and driver, part of kernel keys.
    fn toolchain(&self) -> String;
    /// Allocates `bytes` (a pool size class) of device memory.
    fn alloc(&self, bytes: usize) -> Result<RawMem>;
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
}
