//! The kernels an LLM needs, for every Encore backend.

pub mod dtype;
pub use dtype::DType;
