//! The NEON quantization of activations to [`ActivationBlock`]s.

use std::arch::aarch64::*;

use super::{block_scales, ActivationBlock};

/// The same arithmetic as `quantize_block_scalar`, four lanes at a time, so
/// both give bit-identical blocks: `FMAXNM` ignores NaNs as `f32::max` does,
/// `FCVTNS` rounds ties to even, and the saturating narrows saturate as `as`
/// does.
///
/// # Safety
/// `x` must point at 32 readable floats.
#[target_feature(enable = "neon")]
pub(super) unsafe fn quantize_block(x: *const f32, out: &mut ActivationBlock) {
    // SAFETY: the caller guarantees 32 readable floats.
    let v: [float32x4_t; 8] = std::array::from_fn(|k| unsafe { vld1q_f32(x.add(4 * k)) });
    let mut max = vdupq_n_f32(0.0);
    for lane in v {
        max = vmaxnmq_f32(max, vabsq_f32(lane));
    }
    let amax = vmaxnmvq_f32(max);

    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let q = v.map(|lane| vcvtnq_s32_f32(vmulq_n_f32(lane, id)));
    let narrow = |a: int32x4_t, b: int32x4_t, c: int32x4_t, e: int32x4_t| {
        vcombine_s8(
            vqmovn_s16(vcombine_s16(vqmovn_s32(a), vqmovn_s32(b))),
            vqmovn_s16(vcombine_s16(vqmovn_s32(c), vqmovn_s32(e))),
        )
    };
    let bytes = [
        narrow(q[0], q[1], q[2], q[3]),
        narrow(q[4], q[5], q[6], q[7]),
    ];
    let sum = i32::from(vaddlvq_s8(bytes[0])) + i32::from(vaddlvq_s8(bytes[1]));
    // SAFETY: `qs` is 32 writable bytes.
    unsafe {
        vst1q_s8(out.qs.as_mut_ptr(), bytes[0]);
        vst1q_s8(out.qs.as_mut_ptr().add(16), bytes[1]);
    }
    (out.d, out.s) = block_scales(d, sum);
}
