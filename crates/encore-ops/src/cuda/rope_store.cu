// `rope_store`: RoPE of `rows` rows of K followed by their store into the
// f16 cache at the position parameter, in one dispatch; `x` itself is left
// as it was. Built by the fusion pass from `rope` then `kv_store`.
//
// Arguments: `x: f32[rows, heads, head_dim]` (read), `pos: u32[1]` (read),
// `cache: f16[max_seq, heads * head_dim]` (write), `RopeStoreShape rs`
// (value: the RopeShape and max_seq).
//
// For head element pair `i` (of `rope_dim / 2`) at position `p`:
// `theta = p * theta_scale^i` with `theta_scale = base^(-2 / rope_dim)`, and
// the pair `(a, b)` becomes `(a cos - b sin, a sin + b cos)`. The pair is
// `(x[2i], x[2i+1])` in the normal layout and `(x[i], x[i + rope_dim/2])` in
// the NeoX layout. Elements past `rope_dim` are left alone.
//
// One thread per element pair `(row, head, e)` of `head_dim / 2` pairs a
// head: pair `e < rope_dim / 2` is rotated as `rope` rotates it, the rest are
// copied; both are rounded to f16 as `kv_store` rounds. Requires an even
// `head_dim` (checked by the fusion rule). A position past the cache writes
// nothing.

#include "gguf.cuh"
#include "rope_common.cuh"

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
