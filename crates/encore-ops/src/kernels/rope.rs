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
    /// `base^(-2 / rope_dim)` as the CPU computes it ([`theta_scale`]), so
    /// that CUDA kernels need no `pow` of their own.
    pub theta_scale: f32,
}

/// The angle step of [`rope_head`]: `base^(-2 / rope_dim)` in f32.
pub fn theta_scale(base: f32, rope_dim: usize) -> f32 {
    base.powf(-2.0 / rope_dim as f32)
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
    let theta_scale = theta_scale(base, rope_dim);
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

/// CUDA C shared by `rope` and `rope_store`: the shape and the rotation of
/// one pair, as the CPU's [`rope_head`] computes it.
macro_rules! cuda_rope_common {
    () => {
        r#"
struct RopeShape {
    unsigned int rows;
    unsigned int heads;
    unsigned int head_dim;
    unsigned int rope_dim;
    float base;
    unsigned int neox;
    float theta_scale;
};

// glibc's single-precision sine and cosine (the algorithm of Arm's
// optimized routines, which glibc has used since 2.28), which the CPU's
// `f32::sin_cos` calls, so that CUDA rotates by the CPU's very values: the
// angle in double, reduced by pi/2 (one fused multiply-add below 120, the
// 4/pi table's fixed-point product above), then degree-4 (sine) or 5
// (cosine) polynomials. Every `a * b + c` of the C source is one FMA here,
// as GCC contracts it in the FMA build x86-64 machines run. Only the
// non-negative finite angles RoPE makes are handled.
struct GlibcSinCos {
    double c0, c1, c2, c3, c4, s1, s2, s3;
};

// The polynomials; the second computes -cos (the sign of quadrants 2 and 3).
__device__ const GlibcSinCos glibc_sincos_poly[2] = {
    {0x1p0, -0x1.ffffffd0c621cp-2, 0x1.55553e1068f19p-5, -0x1.6c087e89a359dp-10, 0x1.99343027bf8c3p-16,
     -0x1.555545995a603p-3, 0x1.1107605230bc4p-7, -0x1.994eb3774cf24p-13},
    {-0x1p0, 0x1.ffffffd0c621cp-2, -0x1.55553e1068f19p-5, 0x1.6c087e89a359dp-10, -0x1.99343027bf8c3p-16,
     -0x1.555545995a603p-3, 0x1.1107605230bc4p-7, -0x1.994eb3774cf24p-13},
};

// 4/pi to 192 bits, 8 new bits an entry.
__device__ const unsigned int glibc_inv_pio4[24] = {
    0xa2u, 0xa2f9u, 0xa2f983u, 0xa2f9836eu, 0xf9836e4eu, 0x836e4e44u, 0x6e4e4415u, 0x4e441529u,
    0x441529fcu, 0x1529fc27u, 0x29fc2757u, 0xfc2757d1u, 0x2757d1f5u, 0x57d1f534u, 0xd1f534ddu, 0xf534ddc0u,
    0x34ddc0dbu, 0xddc0db62u, 0xc0db6295u, 0xdb629599u, 0x6295993cu, 0x95993c43u, 0x993c4390u, 0x3c439041u,
};

// Sine (even n) or cosine (odd n) of the reduced angle x, x2 = x * x.
__device__ __forceinline__ float glibc_sincos_eval(double x, double x2, const GlibcSinCos& p, int n) {
    if ((n & 1) == 0) {
        const double x3 = __dmul_rn(x, x2);
        const double s1 = __fma_rn(x2, p.s3, p.s2);
        const double x7 = __dmul_rn(x3, x2);
        const double s = __fma_rn(x3, p.s1, x);
        return __double2float_rn(__fma_rn(x7, s1, s));
    }
    const double x4 = __dmul_rn(x2, x2);
    const double c2 = __fma_rn(x2, p.c4, p.c3);
    const double c1 = __fma_rn(x2, p.c1, p.c0);
    const double x6 = __dmul_rn(x4, x2);
    const double c = __fma_rn(x4, p.c2, c1);
    return __double2float_rn(__fma_rn(x6, c2, c));
}

__device__ __forceinline__ void glibc_sincosf(float y, float& sn, float& cs) {
    const unsigned int top = (__float_as_uint(y) >> 20) & 0x7ffu;
    double x = (double)y;
    if (top < ((__float_as_uint(0x1.921FB6p-1f) >> 20) & 0x7ffu)) {  // below pi/4
        if (top < ((__float_as_uint(0x1p-12f) >> 20) & 0x7ffu)) {
            sn = y;
            cs = 1.0f;
            return;
        }
        const double x2 = __dmul_rn(x, x);
        sn = glibc_sincos_eval(x, x2, glibc_sincos_poly[0], 0);
        cs = glibc_sincos_eval(x, x2, glibc_sincos_poly[0], 1);
        return;
    }
    int n;
    if (top < ((__float_as_uint(120.0f) >> 20) & 0x7ffu)) {
        // 2/pi scaled by 2^24: the quadrant, rounded, in bits 24..31.
        const double r = __dmul_rn(x, 0x1.45F306DC9C883p+23);
        n = ((int)r + 0x800000) >> 24;
        x = __fma_rn(-(double)n, 0x1.921FB54442D18p0, x);
    } else {
        unsigned int xi = __float_as_uint(y);
        const unsigned int* arr = &glibc_inv_pio4[(xi >> 26) & 15u];
        const int shift = (xi >> 23) & 7;
        xi = ((xi & 0xffffffu) | 0x800000u) << shift;
        unsigned long long res0 = (unsigned long long)(xi * arr[0]);
        const unsigned long long res1 = (unsigned long long)xi * arr[4];
        const unsigned long long res2 = (unsigned long long)xi * arr[8];
        res0 = (res2 >> 32) | (res0 << 32);
        res0 += res1;
        const unsigned long long q = (res0 + (1ull << 61)) >> 62;
        res0 -= q << 62;
        n = (int)q;
        x = __dmul_rn((double)(long long)res0, 0x1.921FB54442D18p-62);
    }
    const double sign = (n & 3) == 1 || (n & 3) == 2 ? -1.0 : 1.0;
    const GlibcSinCos& p = glibc_sincos_poly[(n & 2) ? 1 : 0];
    const double xs = __dmul_rn(x, sign), x2 = __dmul_rn(x, x);
    sn = glibc_sincos_eval(xs, x2, p, n);
    cs = glibc_sincos_eval(xs, x2, p, n ^ 1);
}

// The angle of pair `i` at position `p`: `theta = p * theta_scale^i` by
// the CPU's f32 recurrence.
__device__ __forceinline__ float rope_theta(const RopeShape& s, unsigned int i, unsigned int p) {
    float theta = (float)p;
    for (unsigned int t = 0; t < i; ++t) theta = __fmul_rn(theta, s.theta_scale);
    return theta;
}

// The angle's sine and cosine, the CPU's values.
__device__ __forceinline__ void rope_angle(const RopeShape& s, unsigned int i, unsigned int p, float& sn, float& cs) {
    glibc_sincosf(rope_theta(s, i, p), sn, cs);
}

// The angle's sine and cosine from CUDA's `sincosf`, within an ulp or two
// of the CPU's and cheaper: for the decode step's fused `attention_step`,
// whose latency every token waits for (glibc's version there cost about
// 10 µs a token on SmolLM2, H200) and which the exact kernels do not use.
__device__ __forceinline__ void rope_angle_fast(const RopeShape& s, unsigned int i, unsigned int p, float& sn,
                                                float& cs) {
    sincosf(rope_theta(s, i, p), &sn, &cs);
}

// The element indices of rotated pair `i` of a head.
__device__ __forceinline__ void rope_index(const RopeShape& s, unsigned int i, unsigned int& ia, unsigned int& ib) {
    ia = s.neox ? i : 2 * i;
    ib = s.neox ? i + s.rope_dim / 2 : 2 * i + 1;
}

// The pair (a, b) rotated by the angle with sine `sn` and cosine `cs`.
__device__ __forceinline__ float2 rope_apply(float a, float b, float sn, float cs) {
    return make_float2(fmaf(a, cs, -__fmul_rn(b, sn)), fmaf(a, sn, __fmul_rn(b, cs)));
}

// Pair `i` of a head: its element indices, and the pair rotated by the
// angle with sine `sn` and cosine `cs`.
__device__ __forceinline__ float2 rope_rotate(const RopeShape& s, unsigned int i, float sn, float cs, const float* h,
                                              unsigned int& ia, unsigned int& ib) {
    rope_index(s, i, ia, ib);
    return rope_apply(h[ia], h[ib], sn, cs);
}

// Pair `i` of a head at position `p`: its element indices, and the pair
// rotated as the CPU's `rope_head` rotates it.
__device__ __forceinline__ float2 rope_pair(const RopeShape& s, unsigned int i, unsigned int p, const float* h,
                                            unsigned int& ia, unsigned int& ib) {
    float sn, cs;
    rope_angle(s, i, p, sn, cs);
    return rope_rotate(s, i, sn, cs, h, ia, ib);
}
"#
    };
}
pub(crate) use cuda_rope_common;

/// CUDA: one thread per rotated pair `(row, head, i)`. The angle follows
/// the CPU's recurrence exactly: `theta_scale = base^(-2 / rope_dim)` (from
/// the shape, computed on the host as the CPU computes it; a `pow` per
/// thread cost about a microsecond), then `theta = (pos + row) * theta_scale^i`
/// by `i` f32 multiplications (at most `rope_dim / 2 - 1`, cheap next to
/// the memory traffic). Each output is one fused multiply-add over the
/// other product rounded alone, as on the CPU (and in llama.cpp), and the
/// sine and cosine are glibc's, as the CPU's `sin_cos` computes them, so
/// the results are the CPU's bit for bit. A shape the CPU
/// rejects changes nothing here; [`crate::Ops::rope`] rejects it before
/// dispatch.
const ROPE_CUDA: &str = concat!(
    cuda_rope_common!(),
    r#"
extern "C" __global__ void rope(float* __restrict__ x, const unsigned int* __restrict__ pos, RopeShape s) {
    encore_grid_wait();
    const unsigned int half = s.rope_dim / 2;
    if (half == 0 || s.rope_dim > s.head_dim || (s.rope_dim & 1u)) return;
    const unsigned int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= s.rows * s.heads * half) return;
    const unsigned int i = g % half, row_head = g / half, r = row_head / s.heads;
    float* h = x + (size_t)row_head * s.head_dim;
    unsigned int ia, ib;
    const float2 v = rope_pair(s, i, pos[0] + r, h, ia, ib);
    h[ia] = v.x;
    h[ib] = v.y;
}
"#
);

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
        .programmatic()
}

/// `rope_store`: RoPE of `rows` rows of K followed by their store into the
/// f16 cache at the position parameter, in one dispatch; `x` itself is left
/// as it was. Built by the fusion pass from `rope` then `kv_store`.
///
/// Arguments: `x: f32[rows, heads, head_dim]` (read), `pos: u32[1]` (read),
/// `cache: f16[max_seq, heads * head_dim]` (write), [`RopeStoreShape`] (value).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RopeStoreShape {
    pub rope: RopeShape,
    pub max_seq: u32,
}

/// CUDA `rope_store`: one thread per element pair `(row, head, e)` of
/// `head_dim / 2` pairs a head: pair `e < rope_dim / 2` is rotated as
/// `rope` rotates it, the rest are copied; both are rounded to f16 as
/// `kv_store` rounds. Requires an even `head_dim` (checked by the fusion
/// rule). A position past the cache writes nothing.
const ROPE_STORE_CUDA: &str = concat!(
    super::matmul::cuda_ggml_types!(),
    cuda_rope_common!(),
    r#"
struct RopeStoreShape {
    RopeShape rope;
    unsigned int max_seq;
};

extern "C" __global__ void rope_store(const float* __restrict__ x, const unsigned int* __restrict__ pos,
                                      f16_bits* __restrict__ cache, RopeStoreShape rs) {
    encore_grid_wait();
    const RopeShape s = rs.rope;
    const unsigned int half = s.rope_dim / 2, pairs = s.head_dim / 2;
    if (s.rope_dim > s.head_dim || (s.rope_dim & 1u) || (s.head_dim & 1u)) return;
    if ((unsigned long long)pos[0] + s.rows > rs.max_seq) return;
    const unsigned int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= s.rows * s.heads * pairs) return;
    const unsigned int e = g % pairs, row_head = g / pairs, r = row_head / s.heads;
    const float* h = x + (size_t)row_head * s.head_dim;
    f16_bits* out = cache + (size_t)pos[0] * s.heads * s.head_dim + (size_t)row_head * s.head_dim;
    if (e >= half) {
        const unsigned int i = s.rope_dim + 2 * (e - half);
        out[i] = f32_to_f16(h[i]);
        out[i + 1] = f32_to_f16(h[i + 1]);
        return;
    }
    unsigned int ia, ib;
    const float2 v = rope_pair(s, e, pos[0] + r, h, ia, ib);
    out[ia] = f32_to_f16(v.x);
    out[ib] = f32_to_f16(v.y);
}
"#
);

pub fn rope_store_def() -> KernelDef {
    KernelDef::new("rope_store")
        .op("rope_store")
        .cpu("rope_store f16 v1", |a| {
            use half::slice::HalfFloatSliceExt;
            let rs: RopeStoreShape = a.scalar(3)?;
            let s = rs.rope;
            let pos = super::param(a, 1)? as usize;
            let (hd, rd) = (s.head_dim as usize, s.rope_dim as usize);
            if rd > hd || rd % 2 != 0 {
                return Err(format!(
                    "rope_dim {rd} must be even and at most head_dim {hd}"
                ));
            }
            let (rows, dim) = (s.rows as usize, s.heads as usize * hd);
            if pos + rows > rs.max_seq as usize {
                return Err(format!(
                    "position {} past the cache of {}",
                    pos + rows,
                    rs.max_seq
                ));
            }
            let x = a.read::<f32>(0)?;
            let cache = a.write::<half::f16>(2)?;
            super::need("x", x, rows * dim)?;
            super::need("cache", cache, (pos + rows) * dim)?;
            let mut row = vec![0f32; dim];
            for r in 0..rows {
                row.copy_from_slice(&x[r * dim..(r + 1) * dim]);
                for head in row.chunks_exact_mut(hd.max(1)) {
                    rope_head(head, (pos + r) as u32, rd, s.base, s.neox != 0);
                }
                cache[(pos + r) * dim..(pos + r + 1) * dim].convert_from_f32_slice(&row);
            }
            Ok(())
        })
        .cuda(ROPE_STORE_CUDA, "rope_store")
        .programmatic()
}
