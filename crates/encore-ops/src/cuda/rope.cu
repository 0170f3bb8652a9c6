// `rope` and `rope_rows`: rotary position embedding, in place, row `r` at
// position `pos[0] + r` (`rope`: consecutive rows of one sequence) or
// `pos[r]` (`rope_rows`: a batch of independent sequences). POSITION_ROWS
// (from Rust, prepended to this source) says which entry point this
// compilation has; the two differ only in that position.
//
// Arguments: `x: f32[rows, heads, head_dim]` (read-write), `pos: u32[1]`
// (read, a graph parameter) or `u32[rows]`, `factors: f32[rope_dim / 2]`
// (read where `s.factors` is 1), `RopeShape s` (value: rows, heads,
// head_dim, rope_dim, base, neox, theta_scale, factors).
//
// For head element pair `i` (of `rope_dim / 2`) at position `p`:
// `theta = p * theta_scale^i` with `theta_scale = base^(-2 / rope_dim)`, and
// the pair `(a, b)` becomes `(a cos - b sin, a sin + b cos)`. The pair is
// `(x[2i], x[2i+1])` in the normal layout and `(x[i], x[i + rope_dim/2])` in
// the NeoX layout. Elements past `rope_dim` are left alone. With factors,
// pair `i`'s angle is divided by `factors[i]` (Llama 3's RoPE scaling).
//
// One thread per rotated pair `(row, head, i)`. The angle follows the CPU's
// recurrence exactly: `theta_scale` comes from the shape, computed on the
// host as the CPU computes it (a `pow` per thread would be slow), then
// `theta = p * theta_scale^i` by `i` f32 multiplications (at most
// `rope_dim / 2 - 1`, cheap next to the memory traffic). Each output is one
// fused multiply-add over the other product rounded alone, as on the CPU
// (and in llama.cpp), and the sine and cosine are glibc's, as the CPU's
// `sin_cos` computes them, so the results are the CPU's bit for bit. A shape
// the CPU rejects changes nothing here; `Ops::rope` rejects it before
// dispatch.

#include "rope_common.cuh"

template <bool ROWS>
__device__ __forceinline__ void rope_body(float* __restrict__ x, const unsigned int* __restrict__ pos,
                                          const float* __restrict__ factors, const RopeShape& s) {
    encore_grid_wait();
    const unsigned int half = s.rope_dim / 2;
    if (half == 0 || s.rope_dim > s.head_dim || (s.rope_dim & 1u)) return;
    const unsigned int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= s.rows * s.heads * half) return;
    const unsigned int i = g % half, row_head = g / half, r = row_head / s.heads;
    float* h = x + (size_t)row_head * s.head_dim;
    const unsigned int p = ROWS ? pos[r] : pos[0] + r;
    unsigned int ia, ib;
    float2 v;
    if (s.factors) {
        float sn, cs;
        glibc_sincosf(__fdiv_rn(rope_theta(s, i, p), factors[i]), sn, cs);
        v = rope_rotate(s, i, sn, cs, h, ia, ib);
    } else {
        v = rope_pair(s, i, p, h, ia, ib);
    }
    h[ia] = v.x;
    h[ib] = v.y;
}

#if POSITION_ROWS
extern "C" __global__ void rope_rows(float* __restrict__ x, const unsigned int* __restrict__ positions,
                                     const float* __restrict__ factors, RopeShape s) {
    rope_body<true>(x, positions, factors, s);
}
#else
extern "C" __global__ void rope(float* __restrict__ x, const unsigned int* __restrict__ pos,
                                const float* __restrict__ factors, RopeShape s) {
    rope_body<false>(x, pos, factors, s);
}
#endif
