//! The kernels an LLM needs, for every Encore backend.
//!
//! [`Ops`] loads every kernel on a device and encodes each operation with
//! the exact byte ranges it reads and writes; [`kernels`] holds one file per
//! operation with its math and its implementations; [`cpu`] holds the fast
//! CPU math (quantized dot products) the CPU implementations call;
//! [`cuda`] holds the CUDA kernels' sources and how each is launched;
//! [`fusion`] holds the rules that fuse recorded dispatches of a graph.

pub mod args;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod fusion;
pub mod kernels;
mod ops;

pub use args::CpuArg;
pub use dtype::DType;
pub use kernels::KernelSet;
pub use ops::{Ops, Weight};
