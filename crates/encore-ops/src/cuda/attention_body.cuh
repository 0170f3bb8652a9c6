// The body of `attention` and `attention_paged`: one block of ATT_THREADS
// threads computes one (head, query row) in the three passes `attention.cu`
// describes. Where a position's K and V rows live is the `Rows` argument's
// business: `rows(t)` is the cache row of the `t`-th visible position
// (contiguous for `attention`, through a block table for
// `attention_paged`). ATT_THREADS comes from Rust, prepended to the source.

#include "gguf.cuh"
#include "attention_common.cuh"

// The cache rows of a contiguous cache: position `t` (counted from the
// first visible one, where the caller's pointers start) is row `t`.
struct ContiguousRows {
    __device__ __forceinline__ size_t operator()(unsigned int t) const { return t; }
};

// The cache rows of a paged cache: visible position `t` is position
// `first + t` of the sequence, in block `table[p / bs]` at `p % bs`.
struct PagedRows {
    const unsigned int* table;
    unsigned int first;
    unsigned int bs;
    __device__ __forceinline__ size_t operator()(unsigned int t) const {
        const unsigned int p = first + t;
        return (size_t)table[p / bs] * bs + p % bs;
    }
};

#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_MAX_HEAD 256
#define ATT_PAIRS (ATT_MAX_HEAD / 64)
#define ATT_BATCH 8

// Fixed shared memory of one block (declared once in the entry point, so
// that the two instantiations of `attend` do not each reserve their own).
struct AttScratch {
    float qs[ATT_MAX_HEAD];
    float probs[ATT_THREADS];
    float partial[ATT_WARPS][ATT_MAX_HEAD];
    float red[ATT_WARPS];
};

template <bool VEC, class Rows>
__device__ void attend(const float* __restrict__ q, const f16_bits* __restrict__ k,
                       const f16_bits* __restrict__ v, float* __restrict__ out, const AttnShape& s,
                       unsigned int len, float* scores, unsigned int cached, AttScratch& sh, unsigned int h,
                       unsigned int r, const Rows& rows) {
    float* qs = sh.qs;
    float* probs = sh.probs;
    float* red = sh.red;
    const unsigned int tid = threadIdx.x;
    const unsigned int lane = tid & 31u, warp = tid >> 5;
    const unsigned int hd = s.head_dim, kv_dim = s.kv_heads * hd;
    const unsigned int kv_off = (h / (s.heads / s.kv_heads)) * hd;
    const float* qh = q + ((size_t)r * s.heads + h) * hd;
    for (unsigned int d = tid; d < hd; d += ATT_THREADS) qs[d] = round_f16(qh[d]);
    __syncthreads();
    const f16_bits* kh = k + kv_off;
    const f16_bits* vh = v + kv_off;

    float m = __uint_as_float(0xff800000u);  // -infinity (NVRTC has no math.h)
    for (unsigned int t = tid; t < len; t += ATT_THREADS) {
        const float sc = attn_score<VEC>(qs, kh + rows(t) * kv_dim, hd, s.scale);
        if (t < cached) scores[t] = sc;
        m = fmaxf(m, sc);
    }
    m = attn_block_reduce<true, ATT_WARPS>(m, red);

    float sum = 0.f;
    for (unsigned int t = tid; t < len; t += ATT_THREADS) {
        const float sc = t < cached ? scores[t] : attn_score<VEC>(qs, kh + rows(t) * kv_dim, hd, s.scale);
        const float e = expf(sc - m);
        if (t < cached) scores[t] = e;
        sum += e;
    }
    sum = attn_block_reduce<false, ATT_WARPS>(sum, red);

    float2 acc[ATT_PAIRS];
#pragma unroll
    for (int c = 0; c < ATT_PAIRS; ++c) acc[c] = make_float2(0.f, 0.f);
    for (unsigned int t0 = 0; t0 < len; t0 += ATT_THREADS) {
        const unsigned int t = t0 + tid;
        if (t < len) {
            const float e = t < cached
                ? scores[t]
                : expf(attn_score<VEC>(qs, kh + rows(t) * kv_dim, hd, s.scale) - m);
            probs[tid] = e / sum;
        }
        __syncthreads();
        const unsigned int end = min(len - t0, (unsigned int)ATT_THREADS);
        // Warp per position, ATT_BATCH positions' V rows loaded before any is used.
        for (unsigned int i0 = warp; i0 < end; i0 += ATT_WARPS * ATT_BATCH) {
            unsigned int pair[ATT_BATCH][ATT_PAIRS];
#pragma unroll
            for (int u = 0; u < ATT_BATCH; ++u) {
                const unsigned int i = i0 + u * ATT_WARPS;
                const f16_bits* vt = vh + (i < end ? rows(t0 + i) : 0) * kv_dim;
#pragma unroll
                for (int c = 0; c < ATT_PAIRS; ++c) {
                    const unsigned int d = 2 * lane + 64 * c;
                    pair[u][c] = 0u;
                    if (i < end && d < hd) {
                        if (VEC) {
                            pair[u][c] = *reinterpret_cast<const unsigned int*>(vt + d);
                        } else {
                            pair[u][c] = (unsigned int)vt[d] | (d + 1 < hd ? (unsigned int)vt[d + 1] << 16 : 0u);
                        }
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < ATT_BATCH; ++u) {
                const unsigned int i = i0 + u * ATT_WARPS;
                const float p = i < end ? probs[i] : 0.f;
#pragma unroll
                for (int c = 0; c < ATT_PAIRS; ++c) {
                    acc[c].x = fmaf(p, f16_to_f32((f16_bits)(pair[u][c] & 0xffffu)), acc[c].x);
                    acc[c].y = fmaf(p, f16_to_f32((f16_bits)(pair[u][c] >> 16)), acc[c].y);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int c = 0; c < ATT_PAIRS; ++c) {
        const unsigned int d = 2 * lane + 64 * c;
        if (d < hd) sh.partial[warp][d] = acc[c].x;
        if (d + 1 < hd) sh.partial[warp][d + 1] = acc[c].y;
    }
    __syncthreads();
    float* oh = out + ((size_t)r * s.heads + h) * hd;
    for (unsigned int d = tid; d < hd; d += ATT_THREADS) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) o += sh.partial[w][d];
        oh[d] = o;
    }
}

