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

// The angle of pair `i` at position `p`: `theta = p * theta_scale^i` by
// the CPU's f32 recurrence, as its sine and cosine.
__device__ __forceinline__ void rope_angle(const RopeShape& s, unsigned int i, unsigned int p, float& sn, float& cs) {
    float theta = (float)p;
    for (unsigned int t = 0; t < i; ++t) theta = __fmul_rn(theta, s.theta_scale);
    sincosf(theta, &sn, &cs);
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
/// other product rounded alone, as on the CPU (and in llama.cpp); only
/// `sincosf` may differ from the CPU's `sin_cos` by an ulp. A shape the CPU
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
