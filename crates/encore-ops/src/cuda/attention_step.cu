// `attention_step`: decode attention (one query row) with the step's own
// work on the new position folded in: RoPE of the query, RoPE of the new K
// row and its store into the cache, the store of the new V row. Each part
// is optional (the STEP_* bits of `flags`).
//
// Arguments: `q: f32[heads * head_dim]` (read), `k_new, v_new: f32[kv_dim]`
// (read; empty views when not folded), `k, v: f16[max_seq, kv_dim]`
// (read-write when the new row is stored, else read), `pos: u32[1]` (read),
// `out: f32[heads * head_dim]` (write), `AttnStepShape s` (value: the
// AttnShape, the RopeShape, flags). The new rows go to position `pos`; the
// attention runs over positions `0..=pos` as `attention` computes it.
//
// A cluster of STEP_SPLITS blocks per query head (sm_90 thread-block
// clusters), each block taking an equal share of the positions `0..=pos`
// (split-K, as flash decoding does, so that a single decode row keeps many
// SMs busy instead of one block a head).
//
// Before waiting for the previous dispatch, every block asks L2 for the K and
// V rows of its share; the position it reads for that may be stale, so
// addresses are clamped into the cache and the prefetch changes no memory.
// Right after the wait, each thread loads its pair of the query and of the
// new K and V rows, and the K row it scores first for that guessed position
// (kept in registers, used only if the position is the guess), before the
// position itself, so that one memory round trip serves them all; each
// warp's first V rows of a tile load before the softmax's barriers. (The
// kernel declares one block an SM, `STEP_MIN_BLOCKS` 1, so that the
// compiler keeps those loads together.) Then each block:
//
// 1. rotates the query (when folded) and rounds it to f16 in shared memory,
//    as `attention` does; the block holding position `pos` also rotates and
//    rounds the new K row and rounds the new V row, uses them for that
//    position, and (for the first query head of its KV group) stores them in
//    the cache, where no other block of this dispatch reads;
// 2. in tiles of one position a thread: scores `scale * q16 · K[t]`, the
//    tile's maximum and a running maximum `m`, weights `e = exp(s - m)`, a
//    running sum `l` and accumulator `acc = Σ e V[t]` (warp per position,
//    lane per pair of dimensions), both rescaled when `m` grows;
// 3. sends `m`, `l` and `acc` into the shared memory of the cluster's first
//    block (distributed shared memory) with asynchronous stores that count
//    their bytes on a barrier of the first block (`st.async` with
//    `mbarrier::complete_tx`). The first block keeps its own share, waits on
//    that barrier for the others' bytes and writes
//    `Σ_b e^(m_b - M) acc_b / Σ_b e^(m_b - M) l_b` (`M` the largest `m_b`, an
//    empty share has `m = -inf`, `l = 0`). The barrier is initialized before
//    the wait for the previous dispatch and made visible by a cluster
//    barrier that every block arrives at then and waits at only before it
//    sends, so nothing on the path to the result waits for the whole
//    cluster.
//
// Without clusters (before sm_90) the first block of each head takes every
// position, with the same code, and the others return. Results agree with
// `attention` to f32 rounding (exact softmax, probabilities not rounded to
// f16). STEP_THREADS and STEP_SPLITS (cuda/geometry.rs) and the STEP_* flag
// bits (kernels/attention_step.rs) come from Rust, prepended to this source.
// The body is in attention_step_body.cuh, shared with `attention_step_paged`.

#include "attention_step_body.cuh"

struct AttnStepShape {
    AttnShape attn;
    RopeShape rope;
    unsigned int flags;
};

extern "C" __global__ void __launch_bounds__(STEP_THREADS, STEP_MIN_BLOCKS)
#if STEP_CLUSTER
__cluster_dims__(1, STEP_SPLITS, 1)
#endif
attention_step(const float* __restrict__ q, const float* __restrict__ k_new, const float* __restrict__ v_new,
               f16_bits* __restrict__ kc, f16_bits* __restrict__ vc, const unsigned int* __restrict__ pos,
               float* __restrict__ out, AttnStepShape s) {
    encore_fix_value(s);
    __shared__ StepScratch sh;
    const StepContiguous rows{s.attn.max_seq};
    step_main(q, k_new, v_new, kc, vc, pos, out, s.attn, s.rope, s.flags, rows, sh);
}
