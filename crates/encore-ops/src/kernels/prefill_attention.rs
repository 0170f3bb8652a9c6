//! Causal grouped-query attention of a prefill batch, tiled
//! flash-attention style: the same operation as [`super::attention`]
//! (same arguments, [`AttnArgs`](super::attention::AttnArgs)) for `rows >=
//! `[`PREFILL_MIN_ROWS`]. `Ops::attention` picks it for such batches on a
//! device that has it (CUDA, wgpu) when there is no sliding window, the
//! caches are 16-byte aligned and the kernel takes the head size: each
//! backend's kernel refuses at launch a head size it has no code for.
//! Decode keeps the kernel of [`super::attention`]. The CPU computes
//! attention one way for every batch: it has no version of this kernel.
//!
//! CUDA: `cuda/prefill_attention.cu`, on tensor cores, for heads of 16,
//! 32, 64 and 128: queries and attention weights are rounded to f16, so
//! against the exact softmax the result differs by those roundings (2^-11
//! relative): with |v| < 1 it is within 1e-3 of the CPU's. wgpu:
//! `wgsl/prefill_attention.wgsl`, for heads of 16, 32 and 64 (its tiles
//! fit the workgroup memory every adapter offers), f32 sums throughout and
//! the CPU's exponential, the queries rounded to f16 where the CPU rounds
//! them (batches below its tiled path's `FA_TILE_Q` rows), within 1e-4 of
//! the CPU's from those rows on; the Metal backend translates the same
//! WGSL (never run on Apple hardware). Each file's opening comment
//! describes its tiling.

/// Query rows from which `Ops::attention` uses this kernel.
pub const PREFILL_MIN_ROWS: usize = 16;

/// Refuses heads of `head_dim` unless a backend's kernel has code for
/// them (`dims`), naming the backend and the sizes it has.
pub(crate) fn check_head_dim(backend: &str, dims: &[u32], head_dim: u32) -> Result<(), String> {
    if dims.contains(&head_dim) {
        Ok(())
    } else {
        Err(format!(
            "attention_prefill on {backend} has no code for heads of {head_dim} (it has for \
             {dims:?})"
        ))
    }
}
