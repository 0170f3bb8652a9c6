// Shared by the attention kernels: the shape, the score of one position and
// a block-wide reduction.

#include "gguf.cuh"

struct AttnShape {
    unsigned int rows;
    unsigned int heads;
    unsigned int kv_heads;
    unsigned int head_dim;
    unsigned int max_seq;
    float scale;
    unsigned int window;  // sliding window (0: every position)
};

// The shape of the paged attention kernels (kernels/paged.rs): a batch of
// rows, each of its own sequence, over a pool of `blocks` blocks of
// `block_size` positions.
struct PagedAttnShape {
    unsigned int rows;
    unsigned int heads;
    unsigned int kv_heads;
    unsigned int head_dim;
    unsigned int block_size;
    unsigned int max_blocks;
    unsigned int blocks;
    float scale;
    unsigned int window;
    unsigned int decode;
};

// The first position a query at position `at` sees: its sliding window's
// start, or 0 without a window.
__device__ __forceinline__ unsigned int attn_first(const AttnShape& s, unsigned long long at) {
    return s.window == 0 || at + 1 <= s.window ? 0u : (unsigned int)(at + 1 - s.window);
}

// `acc` plus `qs[0..8]` times the 8 halves packed in `v`, in order.
__device__ __forceinline__ float attn_dot8(const float* qs, uint4 v, float acc) {
    const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = fmaf(qs[2 * i], f16_to_f32((f16_bits)(u[i] & 0xffffu)), acc);
        acc = fmaf(qs[2 * i + 1], f16_to_f32((f16_bits)(u[i] >> 16)), acc);
    }
    return acc;
}

// scale * q16 . K[t] for one position, by one thread; with VEC the K row is
// 16-byte aligned and read 16 bytes at a time.
template <bool VEC>
__device__ __forceinline__ float attn_score(const float* qs, const f16_bits* __restrict__ kt, unsigned int hd,
                                            float scale) {
    float acc = 0.f;
    if (VEC) {
        for (unsigned int d = 0; d < hd; d += 8) acc = attn_dot8(qs + d, *reinterpret_cast<const uint4*>(kt + d), acc);
    } else {
        for (unsigned int d = 0; d < hd; ++d) acc = fmaf(qs[d], f16_to_f32(kt[d]), acc);
    }
    return scale * acc;
}

// Block-wide maximum or sum of one value per thread over WARPS warps, with
// `red` (WARPS floats of shared memory) as scratch; every thread gets it.
template <bool MAX, int WARPS>
__device__ __forceinline__ float attn_block_reduce(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, other) : v + other;
    }
    __syncthreads();
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) v = MAX ? fmaxf(v, red[w]) : v + red[w];
    return v;
}
