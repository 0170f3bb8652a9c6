// `rope_rows`: rotary position embedding, in place, row `r` at its own
// position `positions[r]` (a batch of independent sequences).
//
// Arguments: `x: f32[rows, heads, head_dim]` (read-write), `positions:
// u32[rows]` (read), `factors: f32[rope_dim / 2]` (read where `s.factors` is
// 1), `RopeShape s` (value, as `rope`).
//
// The rotation of `rope.cu`, pair for pair, with the row's position in
// place of `pos + row`: the CPU's results bit for bit.

#include "rope_common.cuh"

extern "C" __global__ void rope_rows(float* __restrict__ x, const unsigned int* __restrict__ positions,
                                     const float* __restrict__ factors, RopeShape s) {
    encore_grid_wait();
    const unsigned int half = s.rope_dim / 2;
    if (half == 0 || s.rope_dim > s.head_dim || (s.rope_dim & 1u)) return;
    const unsigned int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= s.rows * s.heads * half) return;
    const unsigned int i = g % half, row_head = g / half, r = row_head / s.heads;
    float* h = x + (size_t)row_head * s.head_dim;
    const unsigned int p = positions[r];
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
