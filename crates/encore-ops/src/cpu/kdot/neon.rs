//! The NEON kernels for the super-block types: one weight row against `NX`
//! activation rows, each block's codes unpacked once for all of them.
//!
//! Codes are unpacked to signed bytes with the values the scalar code gives
//! them (Q6_K's `q - 32`, Q3_K's `q - 4` where the high bit is clear,
//! IQ4_XS's levels), 16 at a time, one group of the block's scales. Each
//! group's product with the activations ([`Dot::dot16`]) is multiplied by its
//! scale and summed in 32-bit lanes; the minimums' term comes from the
//! activations' group sums. The block is then finished by [`accumulate`], as
//! in the scalar code, so results match it bit for bit.
#![allow(clippy::needless_range_loop)] // tiles index several arrays by the same row numbers

use std::arch::aarch64::*;

use super::super::kquant::{
    accumulate, iq4xs_scales, q3k_scales, scales_and_mins, BlockIQ4XS, BlockQ8K, IQ4_LEVELS,
};
use super::super::simd::neon::{f16_at, nibbles, Dot};
use crate::DType;

/// Super-block formats, as const parameters.
const Q2_K: u8 = 0;
const Q3_K: u8 = 1;
const Q4_K: u8 = 2;
const Q5_K: u8 = 3;
const Q6_K: u8 = 4;
const IQ4_XS: u8 = 5;

const fn block_bytes(kind: u8) -> usize {
    match kind {
        Q2_K => 84,
        Q3_K => 110,
        Q4_K => 144,
        Q5_K => 176,
        Q6_K => 210,
        _ => 136,
    }
}

/// A block's integer sums with each activation row, `(sumi, summ)`.
type Sums<const NX: usize> = [(i32, i32); NX];

/// `out[j][r] = (row r of w) · x[j]` for `rows` rows of `nb` blocks of
/// `dtype` (other types write nothing).
///
/// # Safety
/// `w` must point at `rows` readable rows of `nb` blocks of `dtype`, each
/// `x[j]` at `nb` activation blocks.
pub(super) unsafe fn super_rows<D: Dot, const NX: usize>(
    dot: D,
    dtype: DType,
    w: *const u8,
    rows: usize,
    x: [*const BlockQ8K; NX],
    nb: usize,
    out: [&mut [f32]; NX],
) {
    // SAFETY: as this function's.
    unsafe {
        match dtype {
            DType::Q2_K => rows_of::<Q2_K, D, NX>(dot, w, rows, x, nb, out),
            DType::Q3_K => rows_of::<Q3_K, D, NX>(dot, w, rows, x, nb, out),
            DType::Q4_K => rows_of::<Q4_K, D, NX>(dot, w, rows, x, nb, out),
            DType::Q5_K => rows_of::<Q5_K, D, NX>(dot, w, rows, x, nb, out),
            DType::Q6_K => rows_of::<Q6_K, D, NX>(dot, w, rows, x, nb, out),
            DType::IQ4_XS => rows_of::<IQ4_XS, D, NX>(dot, w, rows, x, nb, out),
            _ => {}
        }
    }
}

/// [`super_rows`] for format `KIND`.
///
/// # Safety
/// As [`super_rows`].
#[target_feature(enable = "neon")]
unsafe fn rows_of<const KIND: u8, D: Dot, const NX: usize>(
    dot: D,
    w: *const u8,
    rows: usize,
    x: [*const BlockQ8K; NX],
    nb: usize,
    mut out: [&mut [f32]; NX],
) {
    let row_bytes = nb * block_bytes(KIND);
    for r in 0..rows {
        // SAFETY: as this function's, for row r < rows.
        let dots = unsafe { row::<KIND, D, NX>(dot, w.add(r * row_bytes), x, nb) };
        for (o, d) in out.iter_mut().zip(dots) {
            if let Some(y) = o.get_mut(r) {
                *y = d;
            }
        }
    }
}

/// One row of `nb` blocks against each `x[j]`.
///
/// # Safety
/// As [`super_rows`], for one row.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn row<const KIND: u8, D: Dot, const NX: usize>(
    dot: D,
    w: *const u8,
    x: [*const BlockQ8K; NX],
    nb: usize,
) -> [f32; NX] {
    let mut acc = [0.0f32; NX];
    for b in 0..nb {
        // SAFETY: b < nb, so the block and each activation block are in bounds.
        unsafe {
            let block = w.add(b * block_bytes(KIND));
            let a = x.map(|p| &*p.add(b));
            let sums = match KIND {
                Q2_K => q2k(dot, block, a),
                Q3_K => q3k(dot, block, a),
                Q4_K => q4k::<D, NX, false>(dot, block, a),
                Q5_K => q4k::<D, NX, true>(dot, block, a),
                Q6_K => q6k(dot, block, a),
                _ => iq4xs(dot, block, a),
            };
            let (d, dmin) = match KIND {
                Q2_K => (f16_at(block.add(80)), f16_at(block.add(82))),
                Q3_K => (f16_at(block.add(108)), 0.0),
                Q4_K | Q5_K => (f16_at(block), f16_at(block.add(2))),
                Q6_K => (f16_at(block.add(208)), 0.0),
                _ => (f16_at(block), 0.0),
            };
            for j in 0..NX {
                acc[j] = accumulate(acc[j], d, dmin, a[j].d, sums[j].0, sums[j].1);
            }
        }
    }
    acc
}

/// The 16 activations of `a` from `at` on.
///
/// # Safety
/// `at + 16 <= 256`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn act(a: &BlockQ8K, at: usize) -> int8x16_t {
    // SAFETY: the caller keeps the 16 bytes within `qs`.
    unsafe { vld1q_s8(a.qs.as_ptr().add(at)) }
}

/// `acc + scale * Σ codes[i] a[i]` for one group of 16.
#[inline]
#[target_feature(enable = "neon")]
fn group<D: Dot>(dot: D, acc: int32x4_t, codes: int8x16_t, a: int8x16_t, scale: i32) -> int32x4_t {
    vmlaq_n_s32(acc, dot.dot16(vdupq_n_s32(0), codes, a), scale)
}

/// `Σ m[g] s[g]` over eight pairs of 16-bit values.
#[inline]
#[target_feature(enable = "neon")]
fn dot_i16(m: int16x8_t, s: int16x8_t) -> int32x4_t {
    vmlal_high_s16(vmull_s16(vget_low_s16(m), vget_low_s16(s)), m, s)
}

/// The 16 group sums of `a`, as two halves.
#[inline]
#[target_feature(enable = "neon")]
fn bsums(a: &BlockQ8K) -> [int16x8_t; 2] {
    // SAFETY: `bsums` holds 16 values.
    unsafe {
        [
            vld1q_s16(a.bsums.as_ptr()),
            vld1q_s16(a.bsums.as_ptr().add(8)),
        ]
    }
}

/// Bytes shifted right by `bits` (a constant once the loops unroll).
#[inline]
#[target_feature(enable = "neon")]
fn shr(v: uint8x16_t, bits: usize) -> uint8x16_t {
    vshlq_u8(v, vdupq_n_s8(-(bits as i8)))
}

/// Q4_K (or with `FIVE`, Q5_K): 32 codes a sub-block, one scale each.
///
/// # Safety
/// `w` must point at a readable block.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn q4k<D: Dot, const NX: usize, const FIVE: bool>(
    dot: D,
    w: *const u8,
    x: [&BlockQ8K; NX],
) -> Sums<NX> {
    // SAFETY: every read is within the block (144 or 176 bytes).
    unsafe {
        let [s0, s1, m0, m1] = scales_and_mins(&w.add(4).cast::<[u8; 12]>().read_unaligned());
        let sc = (u64::from(s0) | u64::from(s1) << 32).to_le_bytes();
        let mins = vreinterpretq_s16_u16(vmovl_u8(vcreate_u8(u64::from(m0) | u64::from(m1) << 32)));
        let qs = w.add(if FIVE { 48 } else { 16 });
        let qh = if FIVE {
            [vld1q_u8(w.add(16)), vld1q_u8(w.add(32))]
        } else {
            [vdupq_n_u8(0); 2]
        };
        let low = vdupq_n_u8(15);
        let mut acc = [vdupq_n_s32(0); NX];
        for c in 0..4 {
            let q = [vld1q_u8(qs.add(32 * c)), vld1q_u8(qs.add(32 * c + 16))];
            // Sub-block 2c from the low nibbles, 2c + 1 from the high ones,
            // with fifth bits 2c and 2c + 1 of qh.
            for (half, sub) in [(false, 2 * c), (true, 2 * c + 1)] {
                let codes = [0, 1].map(|k| {
                    let n = if half {
                        vshrq_n_u8::<4>(q[k])
                    } else {
                        vandq_u8(q[k], low)
                    };
                    let n = if FIVE {
                        let bit = vtstq_u8(qh[k], vdupq_n_u8(1 << sub));
                        vorrq_u8(n, vandq_u8(bit, vdupq_n_u8(16)))
                    } else {
                        n
                    };
                    vreinterpretq_s8_u8(n)
                });
                for j in 0..NX {
                    let p = dot.dot16(vdupq_n_s32(0), codes[0], act(x[j], 32 * sub));
                    let p = dot.dot16(p, codes[1], act(x[j], 32 * sub + 16));
                    acc[j] = vmlaq_n_s32(acc[j], p, i32::from(sc[sub]));
                }
            }
        }
        std::array::from_fn(|j| {
            // Each minimum covers two groups.
            let [b0, b1] = bsums(x[j]);
            (
                vaddvq_s32(acc[j]),
                vaddvq_s32(dot_i16(mins, vpaddq_s16(b0, b1))),
            )
        })
    }
}

/// Q6_K: six-bit codes less 32, a signed scale per group of 16.
///
/// # Safety
/// As [`q4k`].
#[inline]
#[target_feature(enable = "neon")]
unsafe fn q6k<D: Dot, const NX: usize>(dot: D, w: *const u8, x: [&BlockQ8K; NX]) -> Sums<NX> {
    // SAFETY: every read is within the block (210 bytes).
    unsafe {
        let scales = w.add(192).cast::<[i8; 16]>().read_unaligned();
        let (low, high, offset) = (vdupq_n_u8(15), vdupq_n_u8(0x30), vdupq_n_s8(32));
        let mut acc = [vdupq_n_s32(0); NX];
        for h in 0..2 {
            let ql = [0, 16, 32, 48].map(|at| vld1q_u8(w.add(64 * h + at)));
            let qh = [vld1q_u8(w.add(128 + 32 * h)), vld1q_u8(w.add(144 + 32 * h))];
            for s in 0..4 {
                // Weights 128h + 32s + l: the low nibble (s < 2) or high one
                // of ql[64h + 32(s % 2) + l], and bits 2s..2s+2 of qh[32h + l]
                // moved to bits 4..6.
                let codes = [0, 1].map(|k| {
                    let l = ql[2 * (s % 2) + k];
                    let l = if s < 2 {
                        vandq_u8(l, low)
                    } else {
                        vshrq_n_u8::<4>(l)
                    };
                    let hb = vandq_u8(vshlq_u8(qh[k], vdupq_n_s8(4 - 2 * s as i8)), high);
                    vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(l, hb)), offset)
                });
                let g = 8 * h + 2 * s;
                for j in 0..NX {
                    let at = 128 * h + 32 * s;
                    acc[j] = group(dot, acc[j], codes[0], act(x[j], at), i32::from(scales[g]));
                    acc[j] = group(
                        dot,
                        acc[j],
                        codes[1],
                        act(x[j], at + 16),
                        i32::from(scales[g + 1]),
                    );
                }
            }
        }
        std::array::from_fn(|j| (vaddvq_s32(acc[j]), 0))
    }
}

/// Q2_K: two-bit codes, a scale and a minimum per group of 16.
///
/// # Safety
/// As [`q4k`].
#[inline]
#[target_feature(enable = "neon")]
unsafe fn q2k<D: Dot, const NX: usize>(dot: D, w: *const u8, x: [&BlockQ8K; NX]) -> Sums<NX> {
    // SAFETY: every read is within the block (84 bytes).
    unsafe {
        let packed = vld1q_u8(w);
        let sc = w
            .cast::<[u8; 16]>()
            .read_unaligned()
            .map(|v| i32::from(v & 15));
        let m = vshrq_n_u8::<4>(packed);
        let mins = [
            vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(m))),
            vreinterpretq_s16_u16(vmovl_high_u8(m)),
        ];
        let three = vdupq_n_u8(3);
        let mut acc = [vdupq_n_s32(0); NX];
        for h in 0..2 {
            let q = [vld1q_u8(w.add(16 + 32 * h)), vld1q_u8(w.add(32 + 32 * h))];
            for s in 0..4 {
                let codes = q.map(|v| vreinterpretq_s8_u8(vandq_u8(shr(v, 2 * s), three)));
                let g = 8 * h + 2 * s;
                for j in 0..NX {
                    let at = 128 * h + 32 * s;
                    acc[j] = group(dot, acc[j], codes[0], act(x[j], at), sc[g]);
                    acc[j] = group(dot, acc[j], codes[1], act(x[j], at + 16), sc[g + 1]);
                }
            }
        }
        std::array::from_fn(|j| {
            let [b0, b1] = bsums(x[j]);
            let summ = vaddq_s32(dot_i16(mins[0], b0), dot_i16(mins[1], b1));
            (vaddvq_s32(acc[j]), vaddvq_s32(summ))
        })
    }
}

/// Q3_K: Q2_K's two low bits, less 4 where the high bit is clear; a signed
/// scale per group of 16.
///
/// # Safety
/// As [`q4k`].
#[inline]
#[target_feature(enable = "neon")]
unsafe fn q3k<D: Dot, const NX: usize>(dot: D, w: *const u8, x: [&BlockQ8K; NX]) -> Sums<NX> {
    // SAFETY: every read is within the block (110 bytes).
    unsafe {
        let sc = q3k_scales(&w.add(96).cast::<[u8; 12]>().read_unaligned()).map(i32::from);
        let hm = [vld1q_u8(w), vld1q_u8(w.add(16))];
        let (three, four) = (vdupq_n_u8(3), vdupq_n_u8(4));
        let mut acc = [vdupq_n_s32(0); NX];
        for h in 0..2 {
            let q = [vld1q_u8(w.add(32 + 32 * h)), vld1q_u8(w.add(48 + 32 * h))];
            for s in 0..4 {
                let codes = [0, 1].map(|k| {
                    let low = vandq_u8(shr(q[k], 2 * s), three);
                    // 4 where bit 4h + s of hmask is clear.
                    let set = vtstq_u8(hm[k], vdupq_n_u8(1 << (4 * h + s)));
                    vreinterpretq_s8_u8(vsubq_u8(low, vbicq_u8(four, set)))
                });
                let g = 8 * h + 2 * s;
                for j in 0..NX {
                    let at = 128 * h + 32 * s;
                    acc[j] = group(dot, acc[j], codes[0], act(x[j], at), sc[g]);
                    acc[j] = group(dot, acc[j], codes[1], act(x[j], at + 16), sc[g + 1]);
                }
            }
        }
        std::array::from_fn(|j| (vaddvq_s32(acc[j]), 0))
    }
}

/// IQ4_XS: levels looked up by nibble, a signed scale per sub-block of 32.
///
/// # Safety
/// As [`q4k`].
#[inline]
#[target_feature(enable = "neon")]
unsafe fn iq4xs<D: Dot, const NX: usize>(dot: D, w: *const u8, x: [&BlockQ8K; NX]) -> Sums<NX> {
    // SAFETY: every read is within the block (136 bytes, alignment 1).
    unsafe {
        let sc = iq4xs_scales(&*w.cast::<BlockIQ4XS>());
        let levels = vld1q_s8(IQ4_LEVELS.as_ptr());
        let mut acc = [vdupq_n_s32(0); NX];
        for k in 0..8 {
            let codes =
                nibbles(w.add(8 + 16 * k)).map(|n| vqtbl1q_s8(levels, vreinterpretq_u8_s8(n)));
            for j in 0..NX {
                let p = dot.dot16(vdupq_n_s32(0), codes[0], act(x[j], 32 * k));
                let p = dot.dot16(p, codes[1], act(x[j], 32 * k + 16));
                acc[j] = vmlaq_n_s32(acc[j], p, i32::from(sc[k]));
            }
        }
        std::array::from_fn(|j| (vaddvq_s32(acc[j]), 0))
    }
}
