//! Encore: a GPU command runtime for LLM inference.
//!
//! Encore records kernel dispatches into command batches, derives the
//! barriers between them from what each dispatch reads and writes, captures
//! sequences as graphs, optimizes and replays them, and measures every
//! dispatch. It runs on the CPU everywhere and on NVIDIA GPUs through CUDA.
//!
//! ```
//! use encore::{Arg, Config, Device, KernelDef};
//!
//! let device = Device::open("cpu", &Config::default())?;
//! // A kernel, y[i] = x[i] * 2, with an implementation per backend: here a
//! // CPU body. A CUDA one would sit beside it, with its launch geometry
//! // computed from the value argument `n`:
//! // `.cuda(CudaKernel::new(include_str!("double.cu"), "double", |n: &u32| Launch::cover(*n, 256)))`.
//! let double = KernelDef::new("double").cpu("double v1", |a| {
//!     let x = a.read::<f32>(0)?;
//!     let y = a.write::<f32>(1)?;
//!     y.iter_mut().zip(x).for_each(|(y, x)| *y = 2.0 * x);
//!     Ok(())
//! });
//! let double = device.load_kernel(&double)?;
//! let x = device.buffer_from(&[1.0f32, 2.0, 3.0])?;
//! let y = device.alloc(12)?;
//! let mut enc = device.encoder();
//! enc.dispatch(&double, &[Arg::read(&x), Arg::write(&y), Arg::value(&3u32)], "double")?;
//! enc.commit()?.wait()?;
//! assert_eq!(y.download::<f32>()?, [2.0, 4.0, 6.0]);
//! # Ok::<(), encore::Error>(())
//! ```
//!
//! The six invariants the runtime keeps are described in the project's
//! `DESIGN.md`: nothing is freed while the device uses it, every dispatch
//! declares its access, kernels are content-addressed, graphs are safe to
//! replay, no failure is silent, and one [`Config`] holds every switch.
//!
//! # Layout
//!
//! The shared records (access, launch, backend kinds and capabilities,
//! resolved arguments) sit at the bottom, in a module that imports nothing
//! else; each backend's kernel type (`backend/<name>/kernel.rs`, compiled
//! whatever the features) builds on them; kernel definitions, the kernel
//! cache and programs on those; the backends' devices on those; the pool,
//! retention, the device, buffers, submissions, the encoder and graphs come
//! after, each importing only what lies below it.
//!
//! # Adding a backend
//!
//! A backend does allocation, copies, compilation and launch; hazards,
//! lifetimes, pooling, graphs and profiling stay in the runtime above it.
//! To add one (say `wgpu`):
//!
//! 1. Add a variant to [`BackendKind`] and an [`Implementation`] variant
//!    holding what a kernel needs there (WGSL source and entry point, and a
//!    [`Geometry`] for its workgroup counts), a type defined in the
//!    backend's folder (`src/backend/<name>/kernel.rs`, built without the
//!    backend's feature), with a builder on [`KernelDef`] beside
//!    [`KernelDef::cpu`] and [`KernelDef::cuda`].
//! 2. Add a folder `src/backend/<name>/` implementing the crate-private
//!    `Backend` trait (see `src/backend/mod.rs`): `alloc`/`free`,
//!    `read`/`write`, `compile` (turn the kernel's implementation into an
//!    artifact; fail with [`Error::Unsupported`] when it has none), `launch`
//!    (the geometry of a dispatch, from the kernel's implementation),
//!    `submit` (run a program's concurrent groups in order, retaining
//!    nothing: the runtime does) and `instantiate` (prepare a program for
//!    replays), `synchronize`, `failure`; and `capabilities`, which is all
//!    the layers above learn about the backend (whether specialization,
//!    early launch and fusion pay, how many steps a replay).
//! 3. Let [`Device::open`] and [`list_devices`] know its device names.
//! 4. Kernels come from the op layer (`encore-ops`): each op gains the new
//!    implementation in its backend folder; an op without one fails with
//!    [`Error::Unsupported`] when dispatched, so a backend is brought up one
//!    op at a time.
//! 5. Tests: the runtime's tests run on the CPU; a backend's own suite opens
//!    its device by name and compares every op with the CPU on random inputs
//!    (`crates/encore-ops/tests`).

pub mod backend;
mod buffer;
pub mod config;
mod counters;
mod cpu_args;
mod device;
mod encoder;
mod error;
pub mod graph;
pub mod hazard;
pub mod host;
mod kernel;
pub mod parallel;
mod pool;
mod profile;
mod program;
mod record;
mod retain;
mod submission;
pub mod trace;

pub use backend::cuda::{CudaKernel, CUDA_PRELUDE};
pub use backend::metal::MetalKernel;
pub use backend::wgpu::{WgpuKernel, WgslFeatures};
pub use backend::wgsl::WGSL_MAX_BUFFERS;
pub use buffer::Buffer;
pub use config::{Config, ProfileMode};
pub use counters::Counters;
pub use cpu_args::CpuArgs;
pub use device::{list_devices, Device};
#[doc(hidden)]
pub use encoder::retention_cost;
pub use encoder::{Arg, Encoder};
pub use error::{Error, Result};
pub use graph::{Graph, GraphCache, GraphExec, GraphShape, GraphStats, Node, NodeArg, Params};
pub use kernel::{
    CpuFn, CpuKernel, Implementation, Kernel, KernelDef, KernelKey, VariantOptions, WeakKernel,
    WgpuVariant,
};
pub use pool::PoolStats;
pub use profile::{Profile, TimeStats};
pub use record::{Access, BackendKind, Capabilities, DeviceInfo, Geometry, Launch, MemoryInfo};
pub use submission::{DispatchTime, Submission};
pub use trace::{Span, Trace};

use std::borrow::Cow;

/// A name for a dispatch or submission: free for string literals, owned otherwise.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Label(Cow<'static, str>);

impl From<&'static str> for Label {
    fn from(s: &'static str) -> Label {
        Label(Cow::Borrowed(s))
    }
}

impl From<String> for Label {
    fn from(s: String) -> Label {
        Label(Cow::Owned(s))
    }
}

impl AsRef<str> for Label {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Label {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
