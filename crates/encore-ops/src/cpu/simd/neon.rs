//! NEON building blocks shared by the aarch64 kernels.
//!
//! NEON is part of every aarch64 CPU, so the kernels are compiled in
//! whenever the target is aarch64. The dot-product extension (`SDOT`, four
//! byte products summed into each 32-bit lane in one instruction) is not, so
//! the kernels take the byte product as a [`Dot`] type: [`Widening`] (two
//! widening multiplies and a pairwise add, on every CPU) or the
//! [`DotprodProof`] that [`Isa::detect`](super::Isa::detect) makes where
//! `is_aarch64_feature_detected!("dotprod")` holds. Both sum the same
//! integers exactly, so the choice changes speed, never results.
//!
//! Rust's `vdotq_s32` is not stable yet, so `SDOT` is written as inline
//! assembly (with `.arch_extension dotprod` so that it assembles in functions
//! compiled for plain NEON); f16 to f32 conversion, whose intrinsics need the
//! unstable `f16` type, is the base-ISA `FCVTL` the same way.

use std::arch::aarch64::*;
use std::arch::asm;

pub(crate) use super::DotprodProof;

/// How a kernel sums the products of 16 signed bytes: a zero-sized value,
/// passed down so that each kernel is compiled once per method.
pub(crate) trait Dot: Copy {
    /// `acc` plus the products `a[i] * b[i]`, spread over the four lanes
    /// (only the sum of the lanes is meaningful). Each product must be at
    /// most 16256 in magnitude (one operand within ±127), so that two of them
    /// sum in 16 bits.
    fn dot16(self, acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t;
}

/// Byte products by widening multiplies, on every aarch64 CPU.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Widening;

impl Dot for Widening {
    #[inline(always)]
    fn dot16(self, acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        // SAFETY: NEON is part of every aarch64 CPU; these touch only registers.
        unsafe {
            let low = vmull_s8(vget_low_s8(a), vget_low_s8(b));
            // Two products of at most 16256 each fit in an i16.
            vpadalq_s16(acc, vmlal_high_s8(low, a, b))
        }
    }
}

impl Dot for DotprodProof {
    #[inline(always)]
    fn dot16(self, acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        // SAFETY: the proof says the CPU has the dot-product extension; SDOT
        // touches only the registers named.
        unsafe {
            asm!(
                ".arch_extension dotprod",
                "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
                acc = inout(vreg) acc,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        acc
    }
}

/// The sum of the eight lanes of `lo` and `hi` (lanes 0..4 and 4..8), added
/// in the order of the AVX2 kernels' `hsum`: the halves, then lanes two
/// apart, then the last pair.
#[inline]
#[target_feature(enable = "neon")]
pub(crate) fn hsum(lo: float32x4_t, hi: float32x4_t) -> f32 {
    let quad = vaddq_f32(lo, hi);
    let pair = vadd_f32(vget_low_f32(quad), vget_high_f32(quad));
    vpadds_f32(pair)
}

/// Four f16s (as bits) converted to f32, exactly.
#[inline]
#[target_feature(enable = "neon")]
pub(crate) fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: FCVTL is in the base aarch64 instruction set and touches only
    // the registers named.
    unsafe {
        asm!(
            "fcvtl {out:v}.4s, {h:v}.4h",
            out = lateout(vreg) out,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    out
}

/// The little-endian f16 at `p`, as f32 (by `FCVTL`, which costs less in a
/// block loop than `half`'s conversion, which checks the CPU each call).
///
/// # Safety
/// `p` must point at 2 readable bytes.
#[inline(always)]
pub(crate) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes; the read is unaligned.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    // SAFETY: NEON is part of every aarch64 CPU; these touch only registers.
    unsafe { vgetq_lane_f32::<0>(f16x4_to_f32(vcreate_u16(u64::from(bits)))) }
}

/// The 16 bytes at `qs` split into their low nibbles and their high nibbles
/// (ggml's Q4 order: weights 0..16, then 16..32), as signed bytes.
///
/// # Safety
/// `qs` must point at 16 readable bytes.
#[inline(always)]
pub(crate) unsafe fn nibbles(qs: *const u8) -> [int8x16_t; 2] {
    // SAFETY: the caller guarantees 16 readable bytes; NEON is part of
    // every aarch64 CPU.
    unsafe {
        let q = vld1q_u8(qs);
        [
            vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F))),
            vreinterpretq_s8_u8(vshrq_n_u8::<4>(q)),
        ]
    }
}
