//! Matrix products of many activation rows on tensor cores (CUDA prefill):
//! `y[r, j] = sum_i w[j, i] * x[r, i]`, the product [`super::matmul`]
//! computes, tiled for `rows >= `[`GEMM_MIN_ROWS`]. `Ops::matmul` picks this
//! kernel for such row counts on a device that has it (CUDA), up to the
//! long prompts that [`super::gemm_dense`] takes, and `Ops::matmul_rows` for
//! a pass's prompt rows at any count; decode and short batches keep the
//! matrix-vector kernel, which streams weights faster for a row or a few.
//! The CPU has no tiled version: it is not loaded there.
//!
//! Arguments (as `matmul`): `w: dtype[n, k]` (read, raw GGUF blocks),
//! `x: f32[rows, k]` (read), `y: f32[rows, n]` (write),
//! [`MatmulShape`](super::matmul::MatmulShape) (value):
//! [`MatmulArgs`](super::matmul::MatmulArgs).
//!
//! Precision. The weights enter the products exactly: F16 weights as they
//! are, quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) as their
//! integer codes (`q`, `q - 8` for Q4_0, `q - 16` for Q5_0, `q - 32` for
//! Q6_K), each GGUF block's scale `d` (and Q4_1's minimum `m`) applied per
//! output in f32 after the block's products: `sum_block = d Σ q x + m Σ x`;
//! Q4_K's sub-blocks of 32 take `d sc` and `-dmin mn` there, Q6_K's groups
//! of 16 `d sc`. With F16
//! and quantized weights the activations are rounded to f16 (nearest even):
//! the result is the exact product of the weights with `f16(x)`, summed in
//! f32, so it is within about `2^-11 Σ|w x|` of the f32 product. Most
//! activation rows lie inside f16's range (|x| <= 65504), but not all: the
//! SwiGLU outputs of a real model's feed-forward reach far beyond it on a
//! few tokens, and rounded to f16 they would become infinite. The kernel
//! marks such a row as it loads it and computes that row's outputs again
//! as plain f32 dot products of the dequantized weights (f32 rounding
//! only); the other rows' results do not change, so a row's result never
//! depends on its neighbours. BF16 and F32 weights, whose range f16
//! lacks, use bf16 products instead: `x = x_hi + x_lo` as two bf16 parts (the top 16 bits,
//! then the rest rounded to nearest, together within `2^-16 |x|` of x),
//! BF16 weights exact, F32 weights split the same way and multiplied part
//! by part (four products): within about `2^-15 Σ|w x|` of the f32
//! product, over f32's whole range.
//!
//! Q5_1, IQ4_NL and the other super-block types (Q2_K, Q3_K, Q5_K,
//! IQ4_XS) are decoded to f32 as the CPU dequantizes them and rounded to
//! f16 as they are loaded (one decoder for all of them), then multiplied as F16
//! weights are: weights and activations
//! each within `2^-12` of their values, so the result is within about
//! `2^-11 Σ|w x|` of the f32 product. Model weights lie far inside f16's
//! range; one beyond it would become infinite.
//!
//! CUDA: `cuda/gemm.cu`, with the tensor-core helpers it shares with the
//! prefill attention in `cuda/mma.cuh`.

/// Activation rows from which `Ops::matmul` uses this kernel.
pub const GEMM_MIN_ROWS: usize = 16;
