// `attention_step_paged`: `attention_step` for the decode rows of a batch of
// independent sequences over a paged f16 KV cache; the fused form of
// `rope_rows`, `kv_store_paged` and `attention_paged` for one row per
// sequence.
//
// Arguments: `q: f32[rows, heads * head_dim]` (read), `k_new, v_new:
// f32[rows, kv_dim]` (read; empty views when not folded), `k, v: f16[blocks
// * block_size, kv_dim]` (read-write when the new rows are stored, else
// read), `positions: u32[rows]`, `slots: u32[rows]`, `tables: u32[rows,
// max_blocks]` (read), `out: f32[rows, heads * head_dim]` (write),
// `AttnStepPagedShape s` (value: the PagedAttnShape, the RopeShape, flags).
//
// Row `r` (grid z) is one query at position `positions[r]` of the sequence
// whose block table is `tables[r]`; its new K and V rows go to slot
// `slots[r]` (the slot the table gives that position), and it attends as
// `attention_step` does over its sequence's positions, each read through
// the table. Each row has its own cluster of STEP_SPLITS blocks a head
// (blocks of STEP_THREADS, STEP_MIN_BLOCKS resident a multiprocessor, from
// cuda/geometry.rs: many small blocks for a batch of many rows), and
// its arithmetic does not depend on the other rows, so a sequence's result
// is the same in a batch of any size. The row count is not read (it is the
// grid's): one specialized variant serves every batch size. A row whose
// table does not cover its position with blocks of the pool, or whose slot
// is past the pool, writes nothing (the CPU reports it; the engine never
// makes one).

#include "attention_step_body.cuh"

struct AttnStepPagedShape {
    PagedAttnShape attn;
    RopeShape rope;
    unsigned int flags;
};

extern "C" __global__ void __launch_bounds__(STEP_THREADS, STEP_MIN_BLOCKS)
#if STEP_CLUSTER
__cluster_dims__(1, STEP_SPLITS, 1)
#endif
attention_step_paged(const float* __restrict__ q, const float* __restrict__ k_new,
                     const float* __restrict__ v_new, f16_bits* __restrict__ kc, f16_bits* __restrict__ vc,
                     const unsigned int* __restrict__ positions, const unsigned int* __restrict__ slots,
                     const unsigned int* __restrict__ tables, float* __restrict__ out, AttnStepPagedShape s) {
    encore_fix_value(s);
    __shared__ StepScratch sh;
    const PagedAttnShape& ps = s.attn;
    if (ps.block_size == 0 || ps.blocks == 0 || ps.max_blocks == 0) return;
    const unsigned int r = blockIdx.z;
    AttnShape a;
    a.rows = 1;
    a.heads = ps.heads;
    a.kv_heads = ps.kv_heads;
    a.head_dim = ps.head_dim;
    a.max_seq = ps.max_blocks * ps.block_size;
    a.scale = ps.scale;
    a.window = ps.window;
    const size_t q_dim = (size_t)ps.heads * ps.head_dim, kv_dim = (size_t)ps.kv_heads * ps.head_dim;
    const StepPaged rows{tables + (size_t)r * ps.max_blocks, slots + r, ps.block_size, ps.blocks, a.max_seq};
    step_main(q + r * q_dim, k_new + r * kv_dim, v_new + r * kv_dim, kc, vc, positions + r, out + r * q_dim, a,
              s.rope, s.flags, rows, sh);
}
