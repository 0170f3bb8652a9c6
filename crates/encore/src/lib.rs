//! Encore: a GPU command runtime for LLM inference.
//!
//! Encore records kernel dispatches into command batches, derives the
//! barriers between them from what each dispatch reads and writes, captures
//! sequences as graphs, optimizes and replays them, and measures every
//! dispatch. It runs on the CPU everywhere and on NVIDIA GPUs through CUDA.
//!
//! ```
//! use encore::{Arg, Config, Device, KernelDef, Launch};
//!
//! let device = Device::open("cpu", &Config::default())?;
//! // A kernel: y[i] = x[i] * 2, with a CPU body (a CUDA body would sit beside it).
//! let double = device.load_kernel(&KernelDef::new("double").cpu("double v1", |a| {
//!     let x = a.read::<f32>(0)?;
//!     let y = a.write::<f32>(1)?;
//!     y.iter_mut().zip(x).for_each(|(y, x)| *y = 2.0 * x);
//!     Ok(())
//! }))?;
//! let x = device.buffer_from(&[1.0f32, 2.0, 3.0])?;
//! let y = device.alloc(12)?;
//! let mut enc = device.encoder();
//! enc.dispatch(&double, &[Arg::read(&x), Arg::write(&y)], Launch::new(1, 1), "double")?;
//! enc.commit()?.wait()?;
//! assert_eq!(y.download::<f32>()?, [2.0, 4.0, 6.0]);
//! # Ok::<(), encore::Error>(())
//! ```
//!
//! The six invariants the runtime keeps are described in the project's
//! `DESIGN.md`: nothing is freed while the device uses it, every dispatch
//! declares its access, kernels are content-addressed, graphs are safe to
//! replay, no failure is silent, and one [`Config`] holds every switch.

pub mod backend;
mod buffer;
pub mod config;
mod counters;
mod device;
mod encoder;
mod error;
pub mod graph;
pub mod hazard;
mod kernel;
pub mod parallel;
mod pool;
mod profile;
mod submission;
pub mod trace;

pub use backend::cpu::CpuArgs;
pub use backend::BackendKind;
pub use buffer::Buffer;
pub use config::{Config, ProfileMode};
pub use counters::Counters;
pub use device::{list_devices, Device, DeviceInfo};
#[doc(hidden)]
pub use encoder::retention_cost;
pub use encoder::{Access, Arg, Encoder, Launch};
pub use error::{Error, Result};
pub use graph::{Graph, GraphCache, GraphExec, GraphShape, GraphStats, Node, NodeArg, Params};
pub use kernel::{CudaSource, Kernel, KernelDef, KernelKey, WeakKernel, CUDA_PRELUDE};
pub use pool::PoolStats;
pub use profile::{Profile, TimeStats};
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
