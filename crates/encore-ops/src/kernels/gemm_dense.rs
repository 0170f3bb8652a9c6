//! The products of long prompts on dequantized tiles (CUDA prefill):
//! `y[r, j] = sum_i w[j, i] * x[r, i]`, the product [`super::matmul`]
//! computes, for `rows >= `[`DENSE_MIN_ROWS`], as five kernels:
//!
//! - `to_f16_rows` rounds the activations to f16 once and marks the rows
//!   holding a value beyond f16's range ([`ToF16Args`]);
//! - `dequant_f16` decodes a slice of the weight matrix's rows to f16, each
//!   weight as the CPU dequantizes it, rounded to nearest ([`DequantArgs`]);
//! - `gemm_f16` multiplies the two on tensor cores, f32 sums, into that
//!   slice's columns of `y` ([`GemmF16Args`]); the slices (at most
//!   [`DENSE_SLICE_WEIGHTS`] weights each) follow one another through one
//!   buffer. A product whose tiles would leave most of the GPU idle (few
//!   output columns: a K or V projection) splits `k` into runs
//!   ([`splits`]) whose sums `sum_splits` adds in order ([`SumSplitsArgs`]);
//! - `matmul_wide_rows` computes the marked rows' outputs again as f32 dot
//!   products of the dequantized weights ([`WideRowsArgs`]), so the
//!   product stays finite wherever the f32 product is.
//!
//! Why a separate path: the tiled [`super::gemm`] reads the quantized
//! blocks and folds each block's scales in after its products, which
//! keeps the weights exact and suits a few dozen rows; over hundreds of
//! rows the tensor cores wait on that folding and on the f32 activations
//! each tile converts again. Decoding each weight once per product and
//! streaming plain f16 tiles costs a pass over the weights (about 4.5 bytes
//! a weight of traffic, the f16 copy written and read once) and wins from
//! a few hundred rows on.
//!
//! Precision: weights and activations each within `2^-11` of their f32
//! values (relative; f16's subnormals below `2^-14`), products summed in
//! f32 on tensor cores, 16 positions at a time in order: within about
//! `2^-10 Σ|w x|` of the f32 product. A row's sums depend on that row and
//! the split count alone, not on the rows sharing its tile nor on the
//! slices; the split count follows the product's shape and row count, so
//! a prompt of another length may round a row differently (as the choice
//! of this path over [`super::gemm`] does). F16 and the quantized types
//! only; BF16 and F32 weights, whose range f16 lacks, stay on
//! [`super::gemm`].
//!
//! CUDA: `cuda/to_f16_rows.cu`, `cuda/dequant_f16.cu`, `cuda/gemm_f16.cu`,
//! `cuda/sum_splits.cu`, `cuda/matmul_wide_rows.cu` (sharing
//! `cuda/wide_rows.cuh` with `gemm`).

use encore::Access;

use crate::DType;

/// Activation rows from which `Ops::matmul` takes this path where the
/// device has it.
pub const DENSE_MIN_ROWS: usize = 256;

/// Rows of activations and of weights a `gemm_f16` tile takes.
pub const DENSE_TILE: usize = 128;

/// Tiles a GPU runs at once, as [`splits`] counts them: an H100's or
/// H200's 132 multiprocessors, two tiles each. On other GPUs the splits
/// are chosen as for these, which costs speed, never correctness.
pub const DENSE_TILE_SLOTS: usize = 264;

/// Runs of `k` a product takes at most ([`splits`]).
pub const DENSE_MAX_SPLITS: usize = 8;

/// Groups of 32 positions a run of `k` takes at least.
const DENSE_MIN_SPLIT_STEPS: usize = 16;

/// Runs of `k` a product of `rows` activation rows by `n` weight rows of
/// `k` is split into: one where its tiles fill the GPU; else the count
/// (up to [`DENSE_MAX_SPLITS`], runs of at least 512 positions) that
/// finishes soonest in waves of [`DENSE_TILE_SLOTS`] tiles, each run
/// costing a fiftieth of a tile's time more (its sums written, read and
/// added), the smaller of two that tie.
pub fn splits(rows: usize, n: usize, k: usize) -> usize {
    let tiles = rows.div_ceil(DENSE_TILE) * n.div_ceil(DENSE_TILE);
    if tiles >= DENSE_TILE_SLOTS {
        return 1;
    }
    let most = (k.div_ceil(32) / DENSE_MIN_SPLIT_STEPS).clamp(1, DENSE_MAX_SPLITS);
    // Time in units of one unsplit tile: waves times a split tile's share,
    // and the runs' sums.
    let time = |s: usize| {
        let waves = (tiles * s).div_ceil(DENSE_TILE_SLOTS) as f64;
        waves / s as f64 + 0.02 * s as f64
    };
    (1..=most).fold(1, |best, s| if time(s) < time(best) { s } else { best })
}

/// Weights a slice of `dequant_f16` holds at most (160 MiB of f16): a 7B
/// model's widest product in one slice, a few percent of the weights of
/// the larger models that take several.
pub const DENSE_SLICE_WEIGHTS: usize = 80 << 20;

/// Rows of weights each slice of a product of `n` rows of `k` takes: as
/// few slices as [`DENSE_SLICE_WEIGHTS`] allows, of equal size rounded up
/// to a multiple of 128 (the product's tile; so a slice may pass the limit
/// by less than a tile), so that no slice is a sliver that leaves the GPU
/// idle.
pub fn slice_rows(n: usize, k: usize) -> usize {
    let slices = (n * k).div_ceil(DENSE_SLICE_WEIGHTS).max(1);
    n.div_ceil(slices).next_multiple_of(DENSE_TILE).min(n)
}

/// Whether this path takes weights of `dtype` over rows of `k`: types
/// within f16's range, rows of whole 16-byte chunks.
pub fn takes(dtype: DType, k: usize) -> bool {
    !matches!(dtype, DType::BF16 | DType::F32) && k.is_multiple_of(8)
}

crate::op_args! {
    /// `to_f16_rows`'s arguments: `x: f32[rows, k]`, `x16: f16[rows, k]`,
    /// `wide: u32[rows]`, `[rows, k]`.
    pub struct ToF16Args { x: Access::Read, x16: Access::Write, wide: Access::Write; shape: [u32; 2] }
}

/// `dequant_f16`'s value: weight rows `n0..n0 + n` of rows of `k`, of
/// ggml type `dtype`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct DequantShape {
    pub n0: u32,
    pub n: u32,
    pub k: u32,
    pub dtype: u32,
}

crate::op_args! {
    /// `dequant_f16`'s arguments: `w: dtype[.., k]` (raw GGUF blocks),
    /// `w16: f16[n, k]`.
    pub struct DequantArgs { w: Access::Read, w16: Access::Write; shape: DequantShape }
}

/// `gemm_f16`'s value: `rows` activation rows by `n` weight rows over
/// `k`, into columns `n0..n0 + n` of `y`'s rows of `ldy`; with `splits`
/// runs of `k`, run `z` into rows `z rows..` of `y` (then `n0` is 0 and
/// `ldy` is `n`).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GemmF16Shape {
    pub rows: u32,
    pub n: u32,
    pub k: u32,
    pub ldy: u32,
    pub n0: u32,
    pub splits: u32,
}

crate::op_args! {
    /// `gemm_f16`'s arguments: `a: f16[rows, k]`, `b: f16[n, k]`,
    /// `y: f32[splits, rows, ldy]`.
    pub struct GemmF16Args { a: Access::Read, b: Access::Read, y: Access::Write; shape: GemmF16Shape }
}

/// `sum_splits`'s value: `splits` runs' sums of `rows` by `n` outputs into
/// columns `n0..n0 + n` of `y`'s rows of `ldy`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SplitsShape {
    pub rows: u32,
    pub n: u32,
    pub splits: u32,
    pub ldy: u32,
    pub n0: u32,
}

crate::op_args! {
    /// `sum_splits`'s arguments: `part: f32[splits, rows, n]`,
    /// `y: f32[rows, ldy]`.
    pub struct SumSplitsArgs { part: Access::Read, y: Access::Write; shape: SplitsShape }
}

crate::op_args! {
    /// `matmul_wide_rows`'s arguments: those of `matmul` and the marks of
    /// `to_f16_rows`; `y` is read too (rows left unmarked keep their values).
    pub struct WideRowsArgs {
        w: Access::Read, x: Access::Read, wide: Access::Read, y: Access::ReadWrite;
        shape: crate::kernels::matmul::MatmulShape
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slices cover the product in as few equal parts as the limit allows,
    /// each a whole number of tiles but the last, none over the limit by
    /// a tile or more.
    #[test]
    fn slices_are_few_equal_and_within_the_limit() {
        // (n, k, slices): small models, a 7B's widest product in one, a
        // 32B's in two, a 70B's in three.
        for (n, k, slices) in [
            (896, 4864, 1),
            (18944, 3584, 1),
            (27648, 5120, 2),
            (28672, 8192, 3),
            (152064, 3584, 7),
        ] {
            let rows = slice_rows(n, k);
            assert_eq!(n.div_ceil(rows), slices, "n={n} k={k}: {rows} rows a slice");
            assert!(rows * k < DENSE_SLICE_WEIGHTS + 128 * k || rows == n);
            assert!(rows == n || rows.is_multiple_of(128), "n={n} k={k}: {rows}");
        }
    }

    /// Products that fill the GPU are not split; narrow ones are, into
    /// runs of at least 512 positions, as many as make the fewest waves.
    #[test]
    fn narrow_products_split_k_and_wide_ones_do_not() {
        // (rows, n, k, splits) on a 7B model's shapes.
        for (rows, n, k, expected) in [
            (512, 18944, 3584, 1),
            (4096, 3584, 3584, 1),
            (512, 3584, 3584, 2),
            (512, 3584, 18944, 2),
            (256, 3584, 3584, 4),
            (512, 512, 3584, 7),
            (512, 512, 512, 1),
        ] {
            assert_eq!(splits(rows, n, k), expected, "rows={rows} n={n} k={k}");
        }
    }
}
