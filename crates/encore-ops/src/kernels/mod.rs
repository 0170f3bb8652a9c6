//! One file per operation, backend-neutral: its math, its shape (the
//! `#[repr(C)]` value every implementation reads), its argument layout
//! (declared with [`op_args!`](crate::op_args)), its shape checks and
//! constants. Nothing here names a backend: each backend's implementation
//! (the CPU body in [`crate::cpu::kernels`], the CUDA source in
//! [`crate::cuda`], the WGSL source in [`crate::wgsl`]) imports its op's
//! description, and the [`registry`](crate::registry) above them all maps
//! each op to its implementations.
//!
//! A kernel that needs the decode position reads it from a 4-byte parameter
//! buffer, so a recorded graph reads the current position on every replay;
//! the kernels over a paged cache read one position a row instead, from the
//! same body ([`positions`]).

pub mod advance;
pub mod argmax;
pub mod attention;
pub mod attention_exact;
pub mod attention_step;
pub mod elementwise;
pub mod embed;
pub mod fused;
pub mod gemm;
pub mod gemm_dense;
pub mod matmul;
pub mod norm;
pub mod paged;
pub mod positions;
pub mod prefill_attention;
pub mod rope;

// The registry's, where callers have always found them.
pub use crate::registry::{load_all, KernelDefs, KernelSet};
