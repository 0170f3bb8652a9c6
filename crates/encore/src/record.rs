//! The records every other part of the runtime shares: how a dispatch
//! accesses a buffer, launch geometry, backend identities and capabilities,
//! and arguments resolved to device memory.
//!
//! This module imports nothing from the rest of the runtime; the encoder,
//! graphs and backends all build on it, so none of them needs another's
//! types to describe a dispatch.

use std::sync::Arc;

/// How a dispatch uses a buffer argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    Write,
    ReadWrite,
}

impl Access {
    pub fn reads(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }
    pub fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }
}

/// Launch geometry: a grid of blocks of threads, and dynamic shared memory.
///
/// A backend that launches kernels on a grid computes it from the kernel's
/// implementation for that backend (see [`crate::CudaKernel`]); the CPU
/// computes none and leaves [`Launch::NONE`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
}

impl Launch {
    /// No geometry: what dispatches on backends without a grid carry.
    pub const NONE: Launch = Launch {
        grid: [0; 3],
        block: [0; 3],
        shared_bytes: 0,
    };

    /// `grid` blocks of `block` threads in one dimension.
    pub fn new(grid: u32, block: u32) -> Launch {
        Launch {
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            shared_bytes: 0,
        }
    }

    /// Enough blocks of `block` threads to cover `threads` threads.
    pub fn cover(threads: u32, block: u32) -> Launch {
        Launch::new(threads.div_ceil(block.max(1)).max(1), block)
    }

    /// A 3-D grid.
    pub fn grid3(grid: [u32; 3], block: [u32; 3]) -> Launch {
        Launch {
            grid,
            block,
            shared_bytes: 0,
        }
    }

    /// The same launch with `bytes` of dynamic shared memory.
    pub fn with_shared(mut self, bytes: u32) -> Launch {
        self.shared_bytes = bytes;
        self
    }
}

/// Computes a dispatch's launch geometry from its inline bytes (its value
/// arguments, concatenated in order), or says why it cannot.
pub type Geometry = Arc<dyn Fn(&[u8]) -> std::result::Result<Launch, String> + Send + Sync>;

/// A geometry function over raw value bytes from one over a typed value.
pub(crate) fn typed_geometry<T: bytemuck::Pod>(
    geometry: impl Fn(&T) -> std::result::Result<Launch, String> + Send + Sync + 'static,
) -> Geometry {
    Arc::new(move |value: &[u8]| {
        let v: T = bytemuck::try_pod_read_unaligned(value).map_err(|_| {
            format!(
                "launch geometry needs a value of {} bytes, got {}",
                std::mem::size_of::<T>(),
                value.len()
            )
        })?;
        geometry(&v)
    })
}

/// Which device API a device runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    /// Host threads; the reference every other backend is tested against.
    Cpu,
    /// NVIDIA GPUs through the CUDA driver API and NVRTC.
    Cuda,
    /// Any GPU through the `wgpu` crate (Vulkan, Metal, DirectX 12), with
    /// WGSL kernels.
    Wgpu,
    /// Apple GPUs through Metal, with Metal Shading Language that naga
    /// generates from the WGSL kernels (or hand-written MSL).
    Metal,
}

impl BackendKind {
    /// Lower-case name, as used in device names and kernel keys.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Metal => "metal",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a backend can do. Ops and graphs ask these questions instead of
/// testing which backend they run on, so a new backend changes behaviour
/// above it only through what it declares here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Kernels are compiled from source, so a graph node may get a variant
    /// compiled for its shape ([`crate::KernelDef::specialized_for`]).
    pub specialization: bool,
    /// A kernel may start while the ones it depends on finish
    /// ([`crate::KernelDef::programmatic`]).
    pub early_launch: bool,
    /// Runs of a self-feeding graph (a greedy decode step) worth putting
    /// into one replay: more where the boundary between two replays costs
    /// the device time, 1 or 2 where it costs nothing.
    pub steps_per_replay: usize,
    /// Whether fusing dispatches into one kernel pays off: true where each
    /// dispatch costs a launch, false where dispatches of one concurrent
    /// group already run side by side for free.
    pub fusion_pays: bool,
    /// Whether this backend's kernels compute the reference results (the
    /// CPU's) bit for bit by default, so exact kernels change nothing here.
    pub exact_by_default: bool,
}

/// A backend's opaque handle to one allocation (a host address on CPU, a
/// device pointer on CUDA).
pub(crate) type RawMem = u64;

/// One dispatch argument, resolved to device memory.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ArgRec {
    /// A byte range of an allocation.
    Buffer {
        mem: RawMem,
        offset: usize,
        len: usize,
        access: Access,
    },
    /// Inline bytes at `start..start + len` of the program's byte arena.
    Bytes { start: u32, len: u32 },
}

/// Bytes written into device memory before a program runs (graph parameters).
#[derive(Clone, Debug)]
pub(crate) struct Upload {
    pub mem: RawMem,
    pub offset: usize,
    pub bytes: Vec<u8>,
}

/// A device Encore can use, as listed by [`crate::list_devices`].
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// The name to open it with (`cpu`, `cuda:0`).
    pub name: String,
    /// What it is, in words.
    pub description: String,
}

/// A device's memory, in bytes, as its driver or operating system reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes that can be allocated now.
    pub free: u64,
    /// Bytes the device has in all.
    pub total: u64,
}

/// Which graph replay a submission is, and whether the one-shot capture
/// records it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Replay {
    /// 1-based, counted per device.
    pub(crate) number: u64,
    pub(crate) captured: bool,
}
