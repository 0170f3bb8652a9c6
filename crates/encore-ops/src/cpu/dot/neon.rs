//! The NEON tile kernels for weights in blocks of 32 and for float weights.
//!
//! A block's 32 codes are unpacked to signed bytes (nibbles, five-bit values,
//! `q - 16`, or IQ4_NL's levels), multiplied with the activations by
//! [`Dot::dot16`] and summed across lanes: the integer sum the scalar code
//! forms. The block's product then comes from [`block_product`] and is added
//! to the row's sum in block order, so results match the scalar code bit for
//! bit. The loops over `NW` and `NX` have constant bounds, so they unroll and
//! the accumulators live in registers.
//!
//! Float weights keep eight lanes of fused multiply-adds for each weight row
//! and activation row, as two registers of four, and add them up in the
//! AVX2 kernels' order: the same operations, so the same results.
#![allow(clippy::needless_range_loop)] // tiles index several arrays by the same row numbers

use std::arch::aarch64::*;

use super::super::kquant::IQ4_LEVELS;
use super::super::simd::neon::{f16_at, f16x4_to_f32, hsum, nibbles, Dot};
use super::{block_product, store, ActivationBlock, Offset};
use crate::DType;

/// Quantized weight formats, as const parameters.
const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_1: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;
const IQ4_NL: u8 = 5;
/// Float weight formats, as const parameters.
const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

const fn block_bytes(kind: u8) -> usize {
    match kind {
        Q8_0 => 34,
        Q4_0 | IQ4_NL => 18,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 20,
    }
}

const fn offset(kind: u8) -> Offset {
    match kind {
        Q4_0 => Offset::Eight,
        Q4_1 | Q5_1 => Offset::Min,
        _ => Offset::None,
    }
}

/// `out[j][r] = (row r of w) · x[j]` for `rows` rows of `nb` blocks of
/// `dtype` (other types write nothing), `NW` rows per tile.
///
/// # Safety
/// `w` must point at `rows` readable rows of `nb` blocks of `dtype`, each
/// `x[j]` at `nb` activation blocks.
pub(super) unsafe fn quant_rows<D: Dot, const NW: usize, const NX: usize>(
    dot: D,
    dtype: DType,
    w: *const u8,
    rows: usize,
    x: [*const ActivationBlock; NX],
    nb: usize,
    out: [&mut [f32]; NX],
) {
    // SAFETY: as this function's.
    unsafe {
        match dtype {
            DType::Q8_0 => rows_of::<Q8_0, D, NW, NX>(dot, w, rows, x, nb, out),
            DType::Q4_0 => rows_of::<Q4_0, D, NW, NX>(dot, w, rows, x, nb, out),
            DType::Q4_1 => rows_of::<Q4_1, D, NW, NX>(dot, w, rows, x, nb, out),
            DType::Q5_0 => rows_of::<Q5_0, D, NW, NX>(dot, w, rows, x, nb, out),
            DType::Q5_1 => rows_of::<Q5_1, D, NW, NX>(dot, w, rows, x, nb, out),
            DType::IQ4_NL => rows_of::<IQ4_NL, D, NW, NX>(dot, w, rows, x, nb, out),
            _ => {}
        }
    }
}

/// [`quant_rows`] for format `KIND`.
///
/// # Safety
/// As [`quant_rows`].
#[target_feature(enable = "neon")]
unsafe fn rows_of<const KIND: u8, D: Dot, const NW: usize, const NX: usize>(
    dot: D,
    w: *const u8,
    rows: usize,
    x: [*const ActivationBlock; NX],
    nb: usize,
    mut out: [&mut [f32]; NX],
) {
    let row_bytes = nb * block_bytes(KIND);
    let mut r = 0;
    while r + NW <= rows {
        let mut tile = [w; NW];
        for i in 0..NW {
            // SAFETY: row r + i < rows is within `w`.
            tile[i] = unsafe { w.add((r + i) * row_bytes) };
        }
        // SAFETY: as this function's, for the NW rows of `tile`.
        let dots = unsafe { quant_tile::<KIND, D, NW, NX>(dot, tile, x, nb) };
        store(&mut out, r, &dots);
        r += NW;
    }
    while r < rows {
        // SAFETY: as this function's, for row r < rows.
        let dots = unsafe { quant_tile::<KIND, D, 1, NX>(dot, [w.add(r * row_bytes)], x, nb) };
        store(&mut out, r, &dots);
        r += 1;
    }
}

/// The 32 fifth bits at `qh` (a little-endian u32) as bytes of 16 or 0, in
/// weight order.
///
/// # Safety
/// `qh` must point at 4 readable bytes.
#[inline(always)]
unsafe fn fifth_bits(qh: *const u8) -> [uint8x16_t; 2] {
    // SAFETY: the caller guarantees 4 readable bytes; the read is unaligned.
    let word = unsafe { qh.cast::<u32>().read_unaligned() };
    // SAFETY: NEON is part of every aarch64 CPU; the rest touches only registers.
    unsafe {
        let bytes = vcreate_u8(u64::from(word));
        // Byte k takes byte k / 8 of the word, then tests bit k % 8 of it.
        let bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
        let sixteen = vdupq_n_u8(16);
        let spread = |k: u64| {
            let index = vcombine_u8(
                vcreate_u8(k * 0x0101_0101_0101_0101),
                vcreate_u8((k + 1) * 0x0101_0101_0101_0101),
            );
            vandq_u8(
                vtstq_u8(vqtbl1q_u8(vcombine_u8(bytes, bytes), index), bit),
                sixteen,
            )
        };
        [spread(0), spread(2)]
    }
}

/// A block's codes as signed bytes (weights 0..16 and 16..32) and its scale
/// pair `(d_w, m_w)`.
///
/// # Safety
/// `block` must point at a readable block of format `KIND`.
#[inline(always)]
unsafe fn decode<const KIND: u8>(block: *const u8) -> ([int8x16_t; 2], (f32, f32)) {
    // SAFETY: every read is within the block, as the caller guarantees;
    // NEON is part of every aarch64 CPU.
    unsafe {
        let d = f16_at(block);
        match KIND {
            Q8_0 => (
                [
                    vld1q_s8(block.add(2).cast()),
                    vld1q_s8(block.add(18).cast()),
                ],
                (d, 0.0),
            ),
            Q4_0 => (nibbles(block.add(2)), (d, 0.0)),
            Q4_1 => (nibbles(block.add(4)), (d, f16_at(block.add(2)))),
            Q5_0 => {
                // q - 16: the five-bit value less 16.
                let [lo, hi] = nibbles(block.add(6));
                let [h0, h1] = fifth_bits(block.add(2));
                let sixteen = vdupq_n_s8(16);
                let code = |n: int8x16_t, h: uint8x16_t| {
                    vsubq_s8(vorrq_s8(n, vreinterpretq_s8_u8(h)), sixteen)
                };
                ([code(lo, h0), code(hi, h1)], (d, 0.0))
            }
            Q5_1 => {
                let [lo, hi] = nibbles(block.add(8));
                let [h0, h1] = fifth_bits(block.add(4));
                (
                    [
                        vorrq_s8(lo, vreinterpretq_s8_u8(h0)),
                        vorrq_s8(hi, vreinterpretq_s8_u8(h1)),
                    ],
                    (d, f16_at(block.add(2))),
                )
            }
            _ => {
                let levels = vld1q_s8(IQ4_LEVELS.as_ptr());
                let [lo, hi] = nibbles(block.add(2));
                (
                    [
                        vqtbl1q_s8(levels, vreinterpretq_u8_s8(lo)),
                        vqtbl1q_s8(levels, vreinterpretq_u8_s8(hi)),
                    ],
                    (d, 0.0),
                )
            }
        }
    }
}

/// `NW` weight rows of `nb` blocks against `NX` activation rows.
///
/// # Safety
/// Each `w[i]` must point at `nb` readable blocks of format `KIND` and each
/// `x[j]` at `nb` activation blocks.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn quant_tile<const KIND: u8, D: Dot, const NW: usize, const NX: usize>(
    dot: D,
    w: [*const u8; NW],
    x: [*const ActivationBlock; NX],
    nb: usize,
) -> [[f32; NX]; NW] {
    let mut acc = [[0.0f32; NX]; NW];
    let zero = vdupq_n_s32(0);
    for b in 0..nb {
        let mut codes = [[vdupq_n_s8(0); 2]; NW];
        let mut scales = [(0.0, 0.0); NW];
        for i in 0..NW {
            // SAFETY: b < nb and row i holds nb blocks.
            (codes[i], scales[i]) = unsafe { decode::<KIND>(w[i].add(b * block_bytes(KIND))) };
        }
        for j in 0..NX {
            // SAFETY: b < nb and activation row j holds nb blocks.
            let a = unsafe { &*x[j].add(b) };
            // SAFETY: `qs` holds 32 bytes.
            let q = unsafe { [vld1q_s8(a.qs.as_ptr()), vld1q_s8(a.qs.as_ptr().add(16))] };
            for i in 0..NW {
                let sums = dot.dot16(dot.dot16(zero, codes[i][0], q[0]), codes[i][1], q[1]);
                let (d_w, m_w) = scales[i];
                acc[i][j] += block_product(offset(KIND), d_w, m_w, a, vaddvq_s32(sums));
            }
        }
    }
    acc
}

/// `out[j][r] = (row r of w) · x[j]` over the first `simd_len` (a multiple
/// of 8) of the `n` elements of each row of float `dtype` weights (other
/// types write nothing), `NW` rows per tile.
///
/// # Safety
/// `w` must point at `rows` readable rows of `n >= simd_len` elements of
/// `dtype`, each `x[j]` at `simd_len` floats.
pub(super) unsafe fn float_rows<const NW: usize, const NX: usize>(
    dtype: DType,
    w: *const u8,
    rows: usize,
    n: usize,
    x: [*const f32; NX],
    simd_len: usize,
    out: [&mut [f32]; NX],
) {
    // SAFETY: as this function's.
    unsafe {
        match dtype {
            DType::F32 => float_rows_of::<F32, NW, NX>(w, rows, n, x, simd_len, out),
            DType::F16 => float_rows_of::<F16, NW, NX>(w, rows, n, x, simd_len, out),
            DType::BF16 => float_rows_of::<BF16, NW, NX>(w, rows, n, x, simd_len, out),
            _ => {}
        }
    }
}

/// [`float_rows`] for format `KIND`.
///
/// # Safety
/// As [`float_rows`].
#[target_feature(enable = "neon")]
unsafe fn float_rows_of<const KIND: u8, const NW: usize, const NX: usize>(
    w: *const u8,
    rows: usize,
    n: usize,
    x: [*const f32; NX],
    simd_len: usize,
    mut out: [&mut [f32]; NX],
) {
    let row_bytes = n * if KIND == F32 { 4 } else { 2 };
    let mut r = 0;
    while r + NW <= rows {
        let mut tile = [w; NW];
        for i in 0..NW {
            // SAFETY: row r + i < rows is within `w`.
            tile[i] = unsafe { w.add((r + i) * row_bytes) };
        }
        // SAFETY: as this function's, for the NW rows of `tile`.
        let dots = unsafe { float_tile::<KIND, NW, NX>(tile, x, simd_len) };
        store(&mut out, r, &dots);
        r += NW;
    }
    while r < rows {
        // SAFETY: as this function's, for row r < rows.
        let dots = unsafe { float_tile::<KIND, 1, NX>([w.add(r * row_bytes)], x, simd_len) };
        store(&mut out, r, &dots);
        r += 1;
    }
}

/// Eight weights of format `KIND` from element `k` on, as f32.
///
/// # Safety
/// `w` must point at at least `k + 8` readable elements of format `KIND`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load8<const KIND: u8>(w: *const u8, k: usize) -> [float32x4_t; 2] {
    // SAFETY: the caller guarantees elements k..k + 8 are readable; the
    // loads need no alignment beyond the element's, and take bytes here.
    unsafe {
        match KIND {
            F32 => {
                let p = w.add(4 * k);
                [
                    vreinterpretq_f32_u8(vld1q_u8(p)),
                    vreinterpretq_f32_u8(vld1q_u8(p.add(16))),
                ]
            }
            F16 => {
                let h = vreinterpretq_u16_u8(vld1q_u8(w.add(2 * k)));
                [
                    f16x4_to_f32(vget_low_u16(h)),
                    f16x4_to_f32(vget_high_u16(h)),
                ]
            }
            _ => {
                // bf16 is the top half of an f32.
                let h = vreinterpretq_u16_u8(vld1q_u8(w.add(2 * k)));
                [
                    vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h))),
                    vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h)),
                ]
            }
        }
    }
}

/// Float weights times f32 activations over the first `n` elements (a
/// multiple of 8).
///
/// # Safety
/// Each `w[i]` must point at `n` readable elements of format `KIND` and each
/// `x[j]` at `n` floats.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn float_tile<const KIND: u8, const NW: usize, const NX: usize>(
    w: [*const u8; NW],
    x: [*const f32; NX],
    n: usize,
) -> [[f32; NX]; NW] {
    let mut acc = [[[vdupq_n_f32(0.0); 2]; NX]; NW];
    for k in (0..n).step_by(8) {
        let mut wv = [[vdupq_n_f32(0.0); 2]; NW];
        for i in 0..NW {
            // SAFETY: k + 8 <= n, and row i holds n elements.
            wv[i] = unsafe { load8::<KIND>(w[i], k) };
        }
        for j in 0..NX {
            // SAFETY: k + 8 <= n, and activation row j holds n floats.
            let xv = unsafe { [vld1q_f32(x[j].add(k)), vld1q_f32(x[j].add(k + 4))] };
            for i in 0..NW {
                acc[i][j] = [
                    vfmaq_f32(acc[i][j][0], wv[i][0], xv[0]),
                    vfmaq_f32(acc[i][j][1], wv[i][1], xv[1]),
                ];
            }
        }
    }
    let mut out = [[0.0; NX]; NW];
    for i in 0..NW {
        for j in 0..NX {
            out[i][j] = hsum(acc[i][j][0], acc[i][j][1]);
        }
    }
    out
}
