// `attention`: causal grouped-query attention over the f16 KV cache.
//
// Arguments: `q: f32[rows, heads * head_dim]` (read), `k, v: f16[max_seq,
// kv_dim]` (read), `pos: u32[1]` (read), `out: f32[rows, heads * head_dim]`
// (write), `AttnShape s` (value: rows, heads, kv_heads, head_dim, max_seq,
// scale).
//
// For query row `r` (position `pos + r`) and head `h`, with KV head
// `h / (heads / kv_heads)`: `s[t] = scale * q[r, h] · K[t]` for
// `attn_first(pos + r) <= t <= pos + r`, `p = softmax(s)`, `out[r, h] = Σ_t p[t] V[t]`.
//
// One block of ATT_THREADS threads per (head, query row), in three passes
// over the positions `t < len` (`len = pos + row + 1`):
//
// 1. thread per position: `s[t] = scale * q16 · K[t]`, with `q16` (the
//    query rounded to f16, as on the CPU) in shared memory and `K[t]` read
//    16 bytes at a time; block maximum `m`;
// 2. thread per position: `e[t] = exp(s[t] - m)`; block sum `S`;
// 3. in chunks of one position a thread: `p[t] = e[t] / S` into shared
//    memory, then warp per position and lane per pair of dimensions:
//    `out += p[t] V[t]`, each warp loading the V rows of 8 positions before
//    using them (decode runs one block per head, so it is bound by memory
//    latency); the warps' sums meet in shared memory.
//
// Scores live in dynamic shared memory, one f32 per position, as far as the
// launch provides it (`attention_shared_bytes`); past that the kernel
// recomputes `s[t]` in passes 2 and 3 instead, so any length works. This is
// the exact softmax in f32, as the decode step's fused `attention_step`
// computes it. The CPU keeps the weighted sum of V in f16 (llama.cpp's
// recurrence, below 64 rows), so the two agree to about 2^-11 relative.
// ATT_THREADS comes from Rust, prepended to this source (cuda/geometry.rs).
//
// `attention_paged`, the same body over a paged cache: arguments `q`, `k,
// v: f16[blocks * block_size, kv_dim]`, `positions: u32[rows]`, `tables:
// u32[rows, max_blocks]`, `out`, `PagedAttnShape ps` (value). Row `r` is
// one query at position `positions[r]` of the sequence whose block table
// is `tables[r]`; it attends over that sequence's positions up to its own
// (the last `window` with a sliding window), each read through the table
// (`PagedRows`). A row whose table does not cover its position with blocks
// of the pool writes nothing (the CPU reports it; the engine never makes
// one).
//
// POSITION_ROWS (from Rust, prepended to this source) says which entry
// point this compilation has: where the rows' positions and cache rows come
// from is `attend`'s `Rows` argument, the one thing the two differ in.

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

#if POSITION_ROWS
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attention_paged(const float* __restrict__ q, const f16_bits* __restrict__ k, const f16_bits* __restrict__ v,
                const unsigned int* __restrict__ positions, const unsigned int* __restrict__ tables,
                float* __restrict__ out, PagedAttnShape ps) {
    extern __shared__ float scores[];
    __shared__ AttScratch scratch;
    encore_grid_wait();
    if (ps.kv_heads == 0 || ps.heads % ps.kv_heads != 0 || ps.head_dim > ATT_MAX_HEAD || ps.block_size == 0) return;
    const unsigned int h = blockIdx.x, r = blockIdx.y;
    if (h >= ps.heads || r >= ps.rows) return;
    const unsigned int p = positions[r];
    const unsigned int* table = tables + (size_t)r * ps.max_blocks;
    const unsigned int used = p / ps.block_size + 1;
    if (used > ps.max_blocks) return;
    for (unsigned int b = 0; b < used; ++b)
        if (table[b] >= ps.blocks) return;
    AttnShape s;
    s.rows = ps.rows;
    s.heads = ps.heads;
    s.kv_heads = ps.kv_heads;
    s.head_dim = ps.head_dim;
    s.max_seq = ps.blocks * ps.block_size;
    s.scale = ps.scale;
    s.window = ps.window;
    unsigned int cached;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(cached));
    cached /= 4;
    const bool vec = s.head_dim % 8 == 0 && (s.kv_heads * s.head_dim) % 8 == 0
        && ((size_t)k & 15u) == 0 && ((size_t)v & 15u) == 0;
    const unsigned int first = attn_first(s, p);
    const PagedRows rows{table, first, ps.block_size};
    if (vec) attend<true>(q, k, v, out, s, p + 1 - first, scores, cached, scratch, h, r, rows);
    else attend<false>(q, k, v, out, s, p + 1 - first, scores, cached, scratch, h, r, rows);
}
#else
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attention(const float* __restrict__ q, const f16_bits* __restrict__ k, const f16_bits* __restrict__ v,
          const unsigned int* __restrict__ pos, float* __restrict__ out, AttnShape s) {
    extern __shared__ float scores[];
    __shared__ AttScratch scratch;
    encore_grid_wait();
    if (s.kv_heads == 0 || s.heads % s.kv_heads != 0 || s.head_dim > ATT_MAX_HEAD) return;
    const unsigned long long p = pos[0];
    if (p + s.rows > s.max_seq || blockIdx.x >= s.heads || blockIdx.y >= s.rows) return;
    const unsigned int len = (unsigned int)p + blockIdx.y + 1;
    unsigned int cached;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(cached));
    cached /= 4;
    const bool vec = s.head_dim % 8 == 0 && (s.kv_heads * s.head_dim) % 8 == 0
        && ((size_t)k & 15u) == 0 && ((size_t)v & 15u) == 0;
    // A window starts the cache later: the rows before it are not seen.
    const unsigned int first = attn_first(s, p + blockIdx.y);
    const size_t skip = (size_t)first * s.kv_heads * s.head_dim;
    const ContiguousRows rows;
    if (vec) attend<true>(q, k + skip, v + skip, out, s, len - first, scores, cached, scratch, blockIdx.x, blockIdx.y, rows);
    else attend<false>(q, k + skip, v + skip, out, s, len - first, scores, cached, scratch, blockIdx.x, blockIdx.y, rows);
}
#endif
