//! Fast CPU math for quantized LLM inference, as pure functions over slices:
//! dequantizing weights, quantizing activations to 8 bits, dot products of a
//! weight row with activations, and threaded matrix products.
//!
//! ```
//! use encore_ops::{cpu, DType};
//!
//! // A 2 x 32 Q8_0 weight matrix: one block per row, scale 0.5, all weights q = 2 (so w = 1).
//! let mut row = vec![0u8; 34];
//! row[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
//! row[2..].fill(2);
//! let weights = [row.clone(), row].concat();
//!
//! let x = vec![0.25f32; 32];
//! let mut y = vec![0.0f32; 2];
//! cpu::matmul(DType::Q8_0, &weights, 2, 32, &x, &mut y)?;
//! assert!((y[0] - 8.0).abs() < 0.05 && (y[1] - 8.0).abs() < 0.05);
//! # Ok::<(), cpu::QuantError>(())
//! ```
//!
//! # Why hand-written SIMD
//!
//! Decoding one token reads every weight once, so a matrix-vector product must
//! run near memory bandwidth, and a 4-bit weight costs half a byte of traffic
//! but several instructions to unpack. The compiler does not find the integer
//! formulation on its own: like ggml, we quantize the activations to 8 bits
//! once per row ([`ActivationBlock`]), then multiply 32 unsigned weight bytes
//! by 32 signed activation bytes with one `_mm256_maddubs_epi16`, widen with
//! `_mm256_madd_epi16`, and apply the two block scales in float once per
//! block. Auto-vectorized float code would dequantize every weight to f32 first
//! and be several times slower.
//!
//! The super-block types (the K-quants and IQ4_XS, in blocks of 256) work the
//! same way with ggml's Q8_K activations ([`BlockQ8K`]): each super-block's
//! products, with their small integer scales, are summed in integers and
//! scaled in float once per block, so the AVX2 and scalar versions agree bit
//! for bit. Which activations a weight type takes is its [`ActivationFormat`].
//!
//! Products of several activation rows (prompts, batched decoding) are
//! arithmetic-bound rather than memory-bound. Where the CPU has AVX-512 with
//! VNNI, those of the super-block types take another path (`gemm.rs`): the
//! weights are unpacked once per product into one form (bytes with a scale
//! and an offset per 16 weights), and 4 x 4 tiles of weight and activation
//! rows multiply it with `vpdpbusd`, 64 bytes an instruction. Its sums differ
//! from the dot products' only in the order of the float additions; the types
//! in blocks of 32 keep the dot products, whose order is llama.cpp's.
//!
//! The AVX2 + FMA + F16C kernels are chosen at run time with
//! `is_x86_feature_detected!`. On aarch64 the NEON kernels always run (NEON
//! is part of the architecture), multiplying bytes with `SDOT` where
//! `is_aarch64_feature_detected!("dotprod")` holds and with widening
//! multiplies elsewhere; they sum every block as the scalar code does, so
//! their quantized products match it bit for bit. A portable scalar version
//! of every kernel runs elsewhere (and is the reference the SIMD kernels are
//! tested against, on every instruction set the CPU has).
//!
//! # Layouts
//!
//! Weights are row-major: `rows` output rows of `cols` inputs, each row a whole
//! number of [`DType`] blocks. Activations and outputs are
//! row-major f32: `m` rows of `cols`, and `m` rows of `rows`.

#![warn(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod dot;
#[cfg(target_arch = "x86_64")]
mod gemm;
mod kdot;
pub mod kernels;
mod kquant;
mod matmul;
mod quant;
mod simd;
mod tasks;

pub use dot::{dot_f32, dot_q8, dot_q8_k};
pub use kquant::{quantize_row_q8_k, BlockQ8K, IQ4_LEVELS};
pub use matmul::{matmul, matmul_quantized, matmul_with_scratch};
pub use quant::{
    dequantize_row, quantize_row_q8, ActivationBlock, ActivationFormat, BlockQ4_0, BlockQ4_1,
    BlockQ8_0, QuantizedActivations,
};

use crate::DType;

/// Why a CPU kernel refused its arguments. Nothing is written when one is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// A row length that is not a whole number of the type's blocks.
    #[error("{len} elements do not fill whole {dtype} blocks of {block_len}")]
    PartialBlock {
        dtype: DType,
        len: usize,
        block_len: usize,
    },
    /// Weight bytes that do not match the stated shape.
    #[error("{dtype} weights of {rows} x {cols} take {expected} bytes, got {actual}")]
    WeightBytes {
        dtype: DType,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    /// A buffer with the wrong number of elements.
    #[error("{what} holds {actual} elements, expected {expected}")]
    Length {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// Activations that are not a whole number of rows.
    #[error("{what} holds {len} elements, not a whole number of rows of {cols}")]
    Ragged {
        what: &'static str,
        len: usize,
        cols: usize,
    },
    /// Quantized activations given to weights that take f32 ones, or the reverse.
    #[error("{dtype} weights take {expected} activations")]
    ActivationKind {
        dtype: DType,
        expected: &'static str,
    },
}

impl QuantError {
    fn partial_block(dtype: DType, len: usize) -> QuantError {
        QuantError::PartialBlock {
            dtype,
            len,
            block_len: dtype.block_len(),
        }
    }

    /// Checks that `bytes` holds a `rows x cols` matrix of `dtype`.
    fn check_weights(dtype: DType, bytes: usize, rows: usize, cols: usize) -> Result<(), Self> {
        let row_bytes = dtype
            .bytes_for(cols)
            .ok_or_else(|| QuantError::partial_block(dtype, cols))?;
        let expected = row_bytes.checked_mul(rows);
        if expected != Some(bytes) {
            return Err(QuantError::WeightBytes {
                dtype,
                rows,
                cols,
                expected: expected.unwrap_or(usize::MAX),
                actual: bytes,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod testing;
