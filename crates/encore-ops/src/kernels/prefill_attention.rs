//! Causal grouped-query attention of a prefill batch on tensor cores:
//! the same operation as [`super::attention`] (same arguments,
//! [`AttnArgs`](super::attention::AttnArgs)), tiled flash-attention style
//! for `rows >= `[`PREFILL_MIN_ROWS`]. `Ops::attention` picks it for such
//! batches on a device that has it (CUDA) when the head size is one of
//! [`HEAD_DIMS`] and the caches are 16-byte aligned; decode keeps the
//! kernel of [`super::attention`]. The CPU computes attention one way for
//! every batch: it has no version of this kernel.
//!
//! Queries and attention weights are rounded to f16 for the tensor cores,
//! so against the exact softmax the result differs by those roundings
//! (2^-11 relative): with |v| < 1 it is within 1e-3 of the CPU's.
//!
//! CUDA: `cuda/prefill_attention.cu`, whose opening comment describes the
//! tiling.

use encore::KernelDef;

/// Query rows from which `Ops::attention` uses this kernel.
pub const PREFILL_MIN_ROWS: usize = 16;

/// Head sizes this kernel is compiled for.
pub const HEAD_DIMS: [u32; 4] = [16, 32, 64, 128];

pub fn def() -> KernelDef {
    KernelDef::new("attention_prefill")
        .op("attention_prefill")
        .cuda(crate::cuda::prefill_attention())
        .programmatic()
}
