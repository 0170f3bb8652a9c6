// `attention_paged`: grouped-query attention of a batch of independent
// sequences over a paged f16 KV cache.
//
// Arguments: `q: f32[rows, heads * head_dim]` (read), `k, v: f16[blocks *
// block_size, kv_dim]` (read), `positions: u32[rows]` (read), `tables:
// u32[rows, max_blocks]` (read), `out: f32[rows, heads * head_dim]`
// (write), `PagedAttnShape s` (value).
//
// Row `r` is one query at position `positions[r]` of the sequence whose
// block table is `tables[r]`; it attends over that sequence's positions up
// to its own (the last `window` with a sliding window), each read through
// the table. The math and the block's passes are `attention.cu`'s
// (attention_body.cuh), one block per (head, row). A row whose table does
// not cover its position with blocks of the pool writes nothing (the CPU
// reports it; the engine never makes one).

#include "attention_body.cuh"

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
