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

#include "attention_body.cuh"

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
