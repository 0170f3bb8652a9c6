//! Rotary position embedding, in place, for `rows` consecutive positions
//! starting at the position parameter.
//!
//! For head element pair `i` (of `rope_dim / 2`), at position `p`:
//! `theta = p * base^(-2i / rope_dim)`, and the pair `(a, b)` becomes
//! `(a cos - b sin, a sin + b cos)`. The pair is `(x[2i], x[2i+1])` in the
//! normal layout (Llama as stored in GGUF) and `(x[i], x[i + rope_dim/2])` in
//! the NeoX layout (Qwen2). Elements past `rope_dim` are left alone.
//!
//! Arguments: `x: f32[rows, heads, head_dim]` (read-write), `pos: u32[1]`
//! (read, a graph parameter), [`RopeShape`] (value).

use encore::KernelDef;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RopeShape {
    pub rows: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub rope_dim: u32,
    pub base: f32,
    /// 1 for the NeoX layout, 0 for the normal one.
    pub neox: u32,
}

/// Rotates one head vector at position `pos`. Angles advance by repeated
/// multiplication in f32, as ggml computes them, and each rotated value is a
/// fused multiply-add over the other, rounded product (`fma(a, c, -(b s))`,
/// `fma(a, s, b c)`), as GCC compiles ggml's rope, so results match llama.cpp.
pub fn rope_head(x: &mut [f32], pos: u32, rope_dim: usize, base: f32, neox: bool) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU feature was just detected.
        unsafe { rope_head_fma(x, pos, rope_dim, base, neox) };
        return;
    }
    rope_head_with(x, pos, rope_dim, base, neox);
}

/// [`rope_head`] compiled with FMA, so `mul_add` is one instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn rope_head_fma(x: &mut [f32], pos: u32, rope_dim: usize, base: f32, neox: bool) {
    rope_head_with(x, pos, rope_dim, base, neox);
}

#[inline(always)]
fn rope_head_with(x: &mut [f32], pos: u32, rope_dim: usize, base: f32, neox: bool) {
    let theta_scale = base.powf(-2.0 / rope_dim as f32);
    let mut theta = pos as f32;
    let half = rope_dim / 2;
    for i in 0..half {
        let (s, c) = theta.sin_cos();
        let (ia, ib) = if neox {
            (i, i + half)
        } else {
            (2 * i, 2 * i + 1)
        };
        let (a, b) = (x[ia], x[ib]);
        x[ia] = a.mul_add(c, -(b * s));
        x[ib] = a.mul_add(s, b * c);
        theta *= theta_scale;
    }
}

/// CUDA: one thread per rotated pair `(row, head, i)`. The angle follows
/// the CPU's recurrence exactly: `theta_scale = base^(-2 / rope_dim)` (`pow`
/// in f64, rounded to f32: the correctly rounded value the CPU's `powf`
/// gives in all but rare cases), then `theta = (pos + row) * theta_scale^i`
/// by `i` f32 multiplications (at most `rope_dim / 2 - 1`, cheap next to
/// the memory traffic). Products are rounded separately, without fused
/// multiply-adds (the CPU fuses one product into each sum, so results may
/// differ from it by an ulp). A shape the CPU rejects changes nothing
/// here; [`crate::Ops::rope`] rejects it before dispatch.
const ROPE_CUDA: &str = r#"
struct RopeShape {
    unsigned int rows;
    unsigned int heads;
    unsigned int head_dim;
    unsigned int rope_dim;
    float base;
    unsigned int neox;
};

extern "C" __global__ void rope(float* __restrict__ x, const unsigned int* __restrict__ pos, RopeShape s) {
    const unsigned int half = s.rope_dim / 2;
    if (half == 0 || s.rope_dim > s.head_dim || (s.rope_dim & 1u)) return;
    const unsigned int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= s.rows * s.heads * half) return;
    const unsigned int i = g % half, row_head = g / half, r = row_head / s.heads;
    const float theta_scale = (float)pow((double)s.base, (double)(-2.0f / (float)s.rope_dim));
    float theta = (float)(pos[0] + r);
    for (unsigned int t = 0; t < i; ++t) theta = __fmul_rn(theta, theta_scale);
    float sn, cs;
    sincosf(theta, &sn, &cs);
    float* h = x + (size_t)row_head * s.head_dim;
    const unsigned int ia = s.neox ? i : 2 * i, ib = s.neox ? i + half : 2 * i + 1;
    const float a = h[ia], b = h[ib];
    h[ia] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
    h[ib] = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
}
"#;

/// CUDA threads per block.
pub const CUDA_BLOCK: u32 = 128;

pub fn def() -> KernelDef {
    KernelDef::new("rope")
        .op("rope")
        .cpu("rope f32 fma v2", |a| {
            let s: RopeShape = a.scalar(2)?;
            let pos = super::param(a, 1)?;
            let (hd, rd) = (s.head_dim as usize, s.rope_dim as usize);
            if rd > hd || rd % 2 != 0 {
                return Err(format!(
                    "rope_dim {rd} must be even and at most head_dim {hd}"
                ));
            }
            let x = a.write::<f32>(0)?;
            let n = s.rows as usize * s.heads as usize * hd;
            super::need("x", x, n)?;
            for (r, row) in x[..n].chunks_exact_mut(s.heads as usize * hd).enumerate() {
                for head in row.chunks_exact_mut(hd) {
                    rope_head(head, pos + r as u32, rd, s.base, s.neox != 0);
                }
            }
            Ok(())
        })
        .cuda(ROPE_CUDA, "rope")
}
