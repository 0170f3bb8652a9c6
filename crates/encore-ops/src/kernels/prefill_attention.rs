//! Causal grouped-query attention of a prefill batch, tiled
//! flash-attention style: the same operation as [`super::attention`]
//! (same arguments, [`AttnArgs`](super::attention::AttnArgs)) for `rows >=
//! `[`PREFILL_MIN_ROWS`]. `Ops::attention` picks it for such batches on a
//! device that has it (CUDA, wgpu) when the head size is one of the
//! backend's [`head_dims`], there is no sliding window and the caches are
//! 16-byte aligned; decode keeps the kernel of [`super::attention`]. The
//! CPU computes attention one way for every batch: it has no version of
//! this kernel.
//!
//! CUDA: `cuda/prefill_attention.cu`, on tensor cores: queries and
//! attention weights are rounded to f16, so against the exact softmax the
//! result differs by those roundings (2^-11 relative): with |v| < 1 it is
//! within 1e-3 of the CPU's. wgpu: `wgsl/prefill_attention.wgsl`, f32
//! sums throughout and the CPU's exponential, the queries rounded to f16
//! where the CPU rounds them (batches below its tiled path's
//! `FA_TILE_Q` rows), within 1e-4 of the CPU's from those rows on; the Metal backend translates the same WGSL (never run on
//! Apple hardware). Each file's opening comment describes its tiling.

use encore::KernelDef;

/// Query rows from which `Ops::attention` uses this kernel.
pub const PREFILL_MIN_ROWS: usize = 16;

/// Head sizes the CUDA kernel is compiled for.
pub const HEAD_DIMS: [u32; 4] = [16, 32, 64, 128];

/// Head sizes the WGSL kernel takes: its tiles of queries and of K and V
/// rows, in f32, fit the 16 KiB of workgroup memory every adapter offers
/// for heads of at most 64.
pub const WGSL_HEAD_DIMS: [u32; 3] = [16, 32, 64];

/// The head sizes the kernel takes on `backend` (none where it has no
/// version of it).
pub fn head_dims(backend: encore::BackendKind) -> &'static [u32] {
    match backend {
        encore::BackendKind::Cuda => &HEAD_DIMS,
        encore::BackendKind::Wgpu | encore::BackendKind::Metal => &WGSL_HEAD_DIMS,
        _ => &[],
    }
}

pub fn def() -> KernelDef {
    KernelDef::new("attention_prefill")
        .op("attention_prefill")
        .cuda(crate::cuda::prefill_attention())
        .wgpu(crate::wgsl::prefill_attention())
        .programmatic()
}
