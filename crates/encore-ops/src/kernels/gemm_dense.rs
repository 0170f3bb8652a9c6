//! The products of long prompts on dequantized tiles (CUDA prefill):
//! `y[r, j] = sum_i w[j, i] * x[r, i]`, the product [`super::matmul`]
//! computes, for `rows >= `[`DENSE_MIN_ROWS`], as four kernels:
//!
//! - `to_f16_rows` rounds the activations to f16 once and marks the rows
//!   holding a value beyond f16's range ([`ToF16Args`]);
//! - `dequant_f16` decodes a slice of the weight matrix's rows to f16, each
//!   weight as the CPU dequantizes it, rounded to nearest ([`DequantArgs`]);
//! - `gemm_f16` multiplies the two on tensor cores, f32 sums, into that
//!   slice's columns of `y` ([`GemmF16Args`]); the slices (at most
//!   [`DENSE_SLICE_WEIGHTS`] weights each) follow one another through one
//!   buffer;
//! - `matmul_wide_rows` computes the marked rows' outputs again as f32 dot
//!   products of the dequantized weights ([`WideRowsArgs`]), so the product stays finite wherever the f32
//!   product is.
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
//! `2^-10 Σ|w x|` of the f32 product. A row's sums depend on that row
//! alone: not on the rows sharing its tile, nor on the slices. F16 and the
//! quantized types only; BF16 and F32 weights, whose range f16 lacks, stay
//! on [`super::gemm`].
//!
//! CUDA: `cuda/to_f16_rows.cu`, `cuda/dequant_f16.cu`, `cuda/gemm_f16.cu`,
//! `cuda/matmul_wide_rows.cu` (sharing `cuda/wide_rows.cuh` with `gemm`).

use encore::Access;

use crate::DType;

/// Activation rows from which `Ops::matmul` takes this path where the
/// device has it.
pub const DENSE_MIN_ROWS: usize = 256;

/// Weights a slice of `dequant_f16` holds at most (128 MiB of f16): enough
/// columns for a few waves of `gemm_f16` tiles over a 7B model's widest
/// product, little beside its weights.
pub const DENSE_SLICE_WEIGHTS: usize = 64 << 20;

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
/// `k`, into columns `n0..n0 + n` of `y`'s rows of `ldy`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GemmF16Shape {
    pub rows: u32,
    pub n: u32,
    pub k: u32,
    pub ldy: u32,
    pub n0: u32,
}

crate::op_args! {
    /// `gemm_f16`'s arguments: `a: f16[rows, k]`, `b: f16[n, k]`,
    /// `y: f32[rows, ldy]`.
    pub struct GemmF16Args { a: Access::Read, b: Access::Read, y: Access::Write; shape: GemmF16Shape }
}

crate::op_args! {
    /// `matmul_wide_rows`'s arguments: those of `matmul` and the marks of
    /// `to_f16_rows`; `y` is read too (rows left unmarked keep their values).
    pub struct WideRowsArgs {
        w: Access::Read, x: Access::Read, wide: Access::Read, y: Access::ReadWrite;
        shape: crate::kernels::matmul::MatmulShape
    }
}
