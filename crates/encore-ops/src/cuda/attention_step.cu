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
//
// `attention_step_paged`: the same body for the decode rows of a batch of
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
//
// POSITION_ROWS (from Rust, prepended to this source) says which entry
// point this compilation has. Where a position's K and V rows live and
// where the new rows go is `step_main`'s `Rows` policy: row `t` of a
// contiguous cache (`StepContiguous`) or the slot a block table gives
// (`StepPaged`); the two entry points differ in nothing else.

#include "gguf.cuh"
#include "rope_common.cuh"
#include "attention_common.cuh"

#define STEP_WARPS (STEP_THREADS / 32)
#define STEP_MAX_HEAD 256
#define STEP_PAIRS (STEP_MAX_HEAD / 64)
// Positions a warp loads the V rows of before using any: more hide more
// latency on long contexts, fewer cost less on short ones.
#define STEP_BATCH 8
// 16-byte words of a K row a thread holds in registers (head_dim <= 128).
#define STEP_KROW 16

// A contiguous cache of `limit` positions: position `t` is row `t`, and the
// new row goes to its position.
struct StepContiguous {
    // Whether `row` reads memory (a table), so must not be asked for
    // positions outside the sequence.
    static constexpr bool indirect = false;
    unsigned int limit;
    __device__ __forceinline__ size_t row(unsigned int t) const { return t; }
    // `row` for an address computed from data that may be stale (prefetches
    // and loads made before the data is final), always inside the cache:
    // the callers' positions are below `limit` already.
    __device__ __forceinline__ size_t row_clamped(unsigned int t) const { return t; }
    // Whether position `p` can be attended to and stored: the same answer in
    // every thread of every block of a cluster (a block that left alone
    // would leave the others waiting).
    __device__ __forceinline__ bool covers(unsigned int p) const { return p < limit; }
    __device__ __forceinline__ size_t store_row(unsigned int p) const { return p; }
};

// A paged cache of `blocks` blocks of `bs` positions: position `t` of the
// sequence is slot `table[t / bs] * bs + t % bs`, and the new row goes to
// `*slot` (the engine's slot of the same position). `limit` is the positions
// the table can map (`max_blocks * bs`).
struct StepPaged {
    static constexpr bool indirect = true;
    const unsigned int* table;
    const unsigned int* slot;
    unsigned int bs;
    unsigned int blocks;
    unsigned int limit;
    __device__ __forceinline__ size_t row(unsigned int t) const { return (size_t)table[t / bs] * bs + t % bs; }
    __device__ __forceinline__ size_t row_clamped(unsigned int t) const {
        const size_t r = row(min(t, limit - 1)), last = (size_t)blocks * bs - 1;
        return r < last ? r : last;
    }
    // Every block of the table up to `p`'s, and the store slot, in the pool.
    // A block-wide vote: every thread must call it.
    __device__ __forceinline__ bool covers(unsigned int p) const {
        bool bad = p >= limit || *slot >= blocks * bs;
        if (!bad)
            for (unsigned int b = threadIdx.x; b <= p / bs; b += blockDim.x) bad |= table[b] >= blocks;
        return !__syncthreads_or(bad);
    }
    __device__ __forceinline__ size_t store_row(unsigned int) const { return *slot; }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define STEP_CLUSTER 1
#else
#define STEP_CLUSTER 0
#endif

struct StepScratch {
    float qs[STEP_MAX_HEAD];
    __align__(16) f16_bits kn[STEP_MAX_HEAD];
    f16_bits vn[STEP_MAX_HEAD];
    float p[STEP_THREADS];
    float partial[STEP_WARPS][STEP_MAX_HEAD];
    float red[STEP_WARPS];
    // Written into the cluster's first block by every block: its share.
    float share_acc[STEP_SPLITS][STEP_MAX_HEAD];
    float share_m[STEP_SPLITS];
    float share_l[STEP_SPLITS];
    // The first block's barrier, completed by the bytes of the other shares.
    unsigned long long shares_in;
};

#if STEP_CLUSTER
// The address of `p`'s place in the shared memory of the cluster's first block.
__device__ __forceinline__ unsigned int first_addr(const void* p) {
    unsigned int r;
    asm("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(r) : "r"(encore_smem_addr(p)));
    return r;
}

// Stores `v` at `remote` in the first block, counted by its barrier `bar`.
__device__ __forceinline__ void send_to_first(unsigned int remote, float v, unsigned int bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 :: "r"(remote), "r"(__float_as_uint(v)), "r"(bar) : "memory");
}
#endif

// The indices of element pair `e` of a head (of head_dim / 2): the rotated
// layout's when `rotate` and the pair is within rope_dim, else 2e, 2e + 1.
__device__ __forceinline__ void step_index(const RopeShape& rs, unsigned int e, bool rotate, unsigned int& ia,
                                           unsigned int& ib) {
    const unsigned int half = rs.rope_dim / 2;
    if (rotate && e < half) {
        rope_index(rs, e, ia, ib);
    } else {
        ia = rotate ? rs.rope_dim + 2 * (e - half) : 2 * e;
        ib = ia + 1;
    }
}

// Pair `e` with values `v`, rotated by the angle (`sn`, `cs`) when `rotate`
// and the pair is within rope_dim.
__device__ __forceinline__ float2 step_rotate(const RopeShape& rs, unsigned int e, float sn, float cs, float2 v,
                                              bool rotate) {
    return rotate && e < rs.rope_dim / 2 ? rope_apply(v.x, v.y, sn, cs) : v;
}

// The V words (pairs of halves) of positions t0 + i0 + u * STEP_WARPS of a
// tile of `n`, lane per pair of dimensions; the new row from shared memory.
template <bool VEC, class Rows>
__device__ __forceinline__ void step_v_batch(const f16_bits* __restrict__ vh, unsigned int kv_dim, unsigned int hd,
                                             unsigned int p, bool new_v, const StepScratch& sh, unsigned int t0,
                                             unsigned int i0, unsigned int n, unsigned int lane, const Rows& rows,
                                             unsigned int (&pair)[STEP_BATCH][STEP_PAIRS]) {
#pragma unroll
    for (int u = 0; u < STEP_BATCH; ++u) {
        const unsigned int i = i0 + u * STEP_WARPS;
        const bool own = (Rows::indirect && i >= n) || (new_v && t0 + i == p);
        const f16_bits* vt = own ? sh.vn : vh + rows.row(t0 + i) * kv_dim;
#pragma unroll
        for (int c = 0; c < STEP_PAIRS; ++c) {
            const unsigned int d = 2 * lane + 64 * c;
            pair[u][c] = 0u;
            if (i < n && d < hd) {
                if (VEC) pair[u][c] = *reinterpret_cast<const unsigned int*>(vt + d);
                else pair[u][c] = (unsigned int)vt[d] | (d + 1 < hd ? (unsigned int)vt[d + 1] << 16 : 0u);
            }
        }
    }
}

// This block's share of the positions, `begin..end`. With `k_first`, this
// thread's K row of the first tile is already in `krow` (VEC layout).
template <bool VEC, class Rows>
__device__ __forceinline__ void step_attend(const f16_bits* __restrict__ kc, const f16_bits* __restrict__ vc,
                                            const AttnShape& a, unsigned int p, unsigned int begin,
                                            unsigned int end, bool new_k, bool new_v, bool k_first,
                                            const uint4 (&krow)[STEP_KROW], const Rows& rows, StepScratch& sh) {
    const unsigned int tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const unsigned int hd = a.head_dim, kv_dim = a.kv_heads * hd;
    const unsigned int kv_off = (blockIdx.x / (a.heads / a.kv_heads)) * hd;
    const f16_bits* kh = kc + kv_off;
    const f16_bits* vh = vc + kv_off;
    float m = __uint_as_float(0xff800000u), l = 0.f;  // -infinity (NVRTC has no math.h)
    float2 acc[STEP_PAIRS];
#pragma unroll
    for (int c = 0; c < STEP_PAIRS; ++c) acc[c] = make_float2(0.f, 0.f);
    for (unsigned int t0 = begin; t0 < end; t0 += STEP_THREADS) {
        const unsigned int t = t0 + tid;
        const unsigned int n = min(end - t0, (unsigned int)STEP_THREADS);
        // The first V rows of this warp, loaded before the barriers of the
        // softmax below so that their latency overlaps them.
        unsigned int pair[STEP_BATCH][STEP_PAIRS];
        step_v_batch<VEC>(vh, kv_dim, hd, p, new_v, sh, t0, warp, n, lane, rows, pair);
        float sc = __uint_as_float(0xff800000u);
        if (t < end) {
            if (new_k && t == p) {
                sc = attn_score<VEC>(sh.qs, sh.kn, hd, a.scale);
            } else if (VEC && k_first && t0 == begin) {
                float dot = 0.f;
#pragma unroll
                for (int j = 0; j < STEP_KROW; ++j)
                    if (8 * j < hd) dot = attn_dot8(sh.qs + 8 * j, krow[j], dot);
                sc = a.scale * dot;
            } else {
                sc = attn_score<VEC>(sh.qs, kh + rows.row(t) * kv_dim, hd, a.scale);
            }
        }
        const float m_new = fmaxf(m, attn_block_reduce<true, STEP_WARPS>(sc, sh.red));
        const float e = t < end ? expf(sc - m_new) : 0.f;
        sh.p[tid] = e;
        const float tile_sum = attn_block_reduce<false, STEP_WARPS>(e, sh.red);  // its barriers publish p
        const float r = expf(m - m_new);
        l = fmaf(l, r, tile_sum);
#pragma unroll
        for (int c = 0; c < STEP_PAIRS; ++c) {
            acc[c].x *= r;
            acc[c].y *= r;
        }
        m = m_new;
        // Warp per position, the V rows of STEP_BATCH positions loaded before any is used.
        for (unsigned int i0 = warp; i0 < n; i0 += STEP_WARPS * STEP_BATCH) {
            if (i0 != warp) step_v_batch<VEC>(vh, kv_dim, hd, p, new_v, sh, t0, i0, n, lane, rows, pair);
#pragma unroll
            for (int u = 0; u < STEP_BATCH; ++u) {
                const unsigned int i = i0 + u * STEP_WARPS;
                const float w = i < n ? sh.p[i] : 0.f;
#pragma unroll
                for (int c = 0; c < STEP_PAIRS; ++c) {
                    acc[c].x = fmaf(w, f16_to_f32((f16_bits)(pair[u][c] & 0xffffu)), acc[c].x);
                    acc[c].y = fmaf(w, f16_to_f32((f16_bits)(pair[u][c] >> 16)), acc[c].y);
                }
            }
        }
        __syncthreads();  // p is rewritten by the next tile
    }
#pragma unroll
    for (int c = 0; c < STEP_PAIRS; ++c) {
        const unsigned int d = 2 * lane + 64 * c;
        if (d < hd) sh.partial[warp][d] = acc[c].x;
        if (d + 1 < hd) sh.partial[warp][d + 1] = acc[c].y;
    }
    __syncthreads();
    // This block's share: the first block's own in its shared memory, every
    // other block's sent there once the cluster barrier says the first
    // block's `shares_in` is initialized.
#if STEP_CLUSTER
    const unsigned int rank = blockIdx.y;
    if (rank != 0) {
        asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
        const unsigned int bar = first_addr(&sh.shares_in);
        for (unsigned int d = tid; d < hd; d += STEP_THREADS) {
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < STEP_WARPS; ++w) o += sh.partial[w][d];
            send_to_first(first_addr(&sh.share_acc[rank][d]), o, bar);
        }
        if (tid == 0) {
            send_to_first(first_addr(&sh.share_m[rank]), m, bar);
            send_to_first(first_addr(&sh.share_l[rank]), l, bar);
        }
        return;
    }
#endif
    for (unsigned int d = tid; d < hd; d += STEP_THREADS) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < STEP_WARPS; ++w) o += sh.partial[w][d];
        sh.share_acc[0][d] = o;
    }
    if (tid == 0) {
        sh.share_m[0] = m;
        sh.share_l[0] = l;
    }
}

// The kernel for one query row whose position is `*pos`, its cache rows
// given by `rows`; `q`, `k_new`, `v_new` and `out` are that row's. Grid:
// (query heads, STEP_SPLITS) blocks of STEP_THREADS, a cluster a head.
template <class Rows>
__device__ __forceinline__ void step_main(const float* __restrict__ q, const float* __restrict__ k_new,
                                          const float* __restrict__ v_new, f16_bits* __restrict__ kc,
                                          f16_bits* __restrict__ vc, const unsigned int* __restrict__ pos,
                                          float* __restrict__ out, const AttnShape& a, const RopeShape& rope,
                                          unsigned int flags, const Rows& rows, StepScratch& sh) {
    const unsigned int tid = threadIdx.x, h = blockIdx.x;
#if STEP_CLUSTER
    // The first block's barrier for the other blocks' shares: one arrival
    // (its own, with the bytes it expects), made visible to the cluster
    // before the other blocks send (they wait at the cluster barrier).
    if (blockIdx.y == 0 && tid == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(encore_smem_addr(&sh.shares_in)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
    const bool valid = a.rows == 1 && a.kv_heads != 0 && a.heads % a.kv_heads == 0 && a.head_dim <= STEP_MAX_HEAD
        && (a.head_dim & 1u) == 0 && rows.limit != 0 && h < a.heads && (!STEP_CLUSTER || gridDim.y == STEP_SPLITS)
        && (!(flags & (STEP_ROPE_Q | STEP_ROPE_K)) || (rope.rope_dim <= a.head_dim && (rope.rope_dim & 1u) == 0));
    const unsigned int hd = a.head_dim, kv_dim = a.kv_heads * hd;
    const unsigned int splits = STEP_CLUSTER ? gridDim.y : 1;
    const unsigned int split = STEP_CLUSTER ? blockIdx.y : 0;
    // Before the wait: the position as it stands (the host sets it before
    // the graph runs, so it is almost always final), used for addresses to
    // prefetch and for this thread's rotation angle, both checked below.
    const unsigned int guess = *(volatile const unsigned int*)pos;
    const bool rotates = (flags & (STEP_ROPE_Q | STEP_ROPE_K)) && tid < rope.rope_dim / 2;
    float sn = 0.f, cs = 1.f;
    if (valid && (STEP_CLUSTER || blockIdx.y == 0)) {
        // Prefetch this block's share of K and V; see the doc comment.
        const unsigned int kv_off = (h / (a.heads / a.kv_heads)) * hd;
        const unsigned int len = min(guess, rows.limit - 1) + 1, first = attn_first(a, len - 1);
        const unsigned int chunk = (len - first + splits - 1) / splits;
        const unsigned int t = first + split * chunk + tid;
        if (tid < chunk && t < len) {
            for (unsigned int b = 0; b < hd * 2; b += 128) {
                encore_prefetch_l2(reinterpret_cast<const unsigned char*>(kc + rows.row_clamped(t) * kv_dim + kv_off) + b);
                encore_prefetch_l2(reinterpret_cast<const unsigned char*>(vc + rows.row_clamped(t) * kv_dim + kv_off) + b);
            }
        }
        if (rotates) rope_angle_fast(rope, tid, guess, sn, cs);
    }
    encore_grid_wait();
    if (!valid || (!STEP_CLUSTER && blockIdx.y != 0)) return;
    const unsigned int group = a.heads / a.kv_heads, kv_off = (h / group) * hd;
    // This thread's pair of the query and of the new K and V rows (one pair
    // a thread, head_dim <= 2 * STEP_THREADS), loaded before the position so
    // that all of them are in flight together.
    const bool pair = tid < hd / 2;
    const bool rope_q = flags & STEP_ROPE_Q, rope_k = flags & STEP_ROPE_K;
    unsigned int qa = 0, qb = 0, ka = 0, kb = 0;
    float2 qv = make_float2(0.f, 0.f), kv = qv, vv = qv;
    if (pair) {
        step_index(rope, tid, rope_q, qa, qb);
        qv = make_float2(q[(size_t)h * hd + qa], q[(size_t)h * hd + qb]);
        if (flags & STEP_K_NEW) {
            step_index(rope, tid, rope_k, ka, kb);
            kv = make_float2(k_new[kv_off + ka], k_new[kv_off + kb]);
        }
        if (flags & STEP_V_NEW) vv = make_float2(v_new[kv_off + 2 * tid], v_new[kv_off + 2 * tid + 1]);
    }
    // The K row this thread scores first, for the position read before the
    // wait (used only if the position is that one), so that it too loads
    // alongside the position. Not the new row, which this kernel writes.
    const bool vec = hd % 8 == 0 && kv_dim % 8 == 0 && ((size_t)kc & 15u) == 0 && ((size_t)vc & 15u) == 0;
    uint4 krow[STEP_KROW];
    const unsigned int g_len = min(guess, rows.limit - 1) + 1, g_first = attn_first(a, g_len - 1);
    const unsigned int g_chunk = (g_len - g_first + splits - 1) / splits;
    const unsigned int g_begin = min(g_first + split * g_chunk, g_len), g_end = min(g_begin + g_chunk, g_len);
    const unsigned int kt = g_begin + tid;
    const bool k_first = vec && hd <= 8 * STEP_KROW && guess < rows.limit;
    if (k_first && kt < g_end && !((flags & STEP_K_NEW) && kt == guess)) {
        const uint4* kr = reinterpret_cast<const uint4*>(kc + rows.row_clamped(kt) * kv_dim + kv_off);
#pragma unroll
        for (int j = 0; j < STEP_KROW; ++j)
            if (8 * j < hd) krow[j] = kr[j];
    }
    const unsigned int p = pos[0];
    // The same decision in every block of a cluster, so none waits alone at a barrier.
    if (!rows.covers(p)) return;
    if (rotates && p != guess) rope_angle_fast(rope, tid, p, sn, cs);
    const unsigned int len = p + 1, first = attn_first(a, p), chunk = (len - first + splits - 1) / splits;
    const unsigned int begin = min(first + split * chunk, len), end = min(begin + chunk, len);
    const bool holds_p = begin <= p && p < end;
    const bool new_k = holds_p && (flags & STEP_K_NEW), new_v = holds_p && (flags & STEP_V_NEW);
    const bool store = h % group == 0;
    if (pair) {
        const unsigned int e = tid;
        qv = step_rotate(rope, e, sn, cs, qv, rope_q);
        sh.qs[qa] = round_f16(qv.x);
        sh.qs[qb] = round_f16(qv.y);
        if (new_k) {
            kv = step_rotate(rope, e, sn, cs, kv, rope_k);
            const f16_bits x = f32_to_f16(kv.x), y = f32_to_f16(kv.y);
            sh.kn[ka] = x;
            sh.kn[kb] = y;
            if (store) {
                kc[rows.store_row(p) * kv_dim + kv_off + ka] = x;
                kc[rows.store_row(p) * kv_dim + kv_off + kb] = y;
            }
        }
        if (new_v) {
            const f16_bits x = f32_to_f16(vv.x), y = f32_to_f16(vv.y);
            sh.vn[2 * e] = x;
            sh.vn[2 * e + 1] = y;
            if (store) {
                vc[rows.store_row(p) * kv_dim + kv_off + 2 * e] = x;
                vc[rows.store_row(p) * kv_dim + kv_off + 2 * e + 1] = y;
            }
        }
    }
    __syncthreads();
    if (vec) step_attend<true>(kc, vc, a, p, begin, end, new_k, new_v, k_first && p == guess, krow, rows, sh);
    else step_attend<false>(kc, vc, a, p, begin, end, new_k, new_v, false, krow, rows, sh);
    if (split != 0) return;
#if STEP_CLUSTER
    {
        const unsigned int bar = encore_smem_addr(&sh.shares_in);
        if (tid == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                         :: "r"(bar), "r"((splits - 1) * (hd + 2) * 4) : "memory");
        unsigned int done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0; "
                         "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar) : "memory");
    }
#endif
    __syncthreads();  // this block's own share
    // The first block: Σ_b e^(m_b - M) acc_b / Σ_b e^(m_b - M) l_b.
    float w[STEP_SPLITS], big = __uint_as_float(0xff800000u), den = 0.f;
#pragma unroll
    for (int b = 0; b < STEP_SPLITS; ++b)
        if (b < splits) big = fmaxf(big, sh.share_m[b]);
#pragma unroll
    for (int b = 0; b < STEP_SPLITS; ++b) {
        w[b] = b < splits ? expf(sh.share_m[b] - big) : 0.f;
        if (b < splits) den = fmaf(w[b], sh.share_l[b], den);
    }
    float* oh = out + (size_t)h * hd;
    for (unsigned int d = tid; d < hd; d += STEP_THREADS) {
        float num = 0.f;
#pragma unroll
        for (int b = 0; b < STEP_SPLITS; ++b)
            if (b < splits) num = fmaf(w[b], sh.share_acc[b][d], num);
        oh[d] = num / den;
    }
}

// The entry point of this compilation (one, so that a specialized variant
// fixes one value type): its name, its position arguments and its shape,
// and `step_rows`, which places its rows for `step_main`.
#if POSITION_ROWS
#define STEP_KERNEL attention_step_paged
#define STEP_POSITION_ARGS \
    const unsigned int* __restrict__ positions, const unsigned int* __restrict__ slots, \
        const unsigned int* __restrict__ tables
#define STEP_POSITIONS positions, slots, tables

struct StepShape {
    PagedAttnShape attn;
    RopeShape rope;
    unsigned int flags;
};

// Row `r` (grid z) of a batch over a paged cache.
__device__ __forceinline__ void step_rows(const float* __restrict__ q, const float* __restrict__ k_new,
                                          const float* __restrict__ v_new, f16_bits* __restrict__ kc,
                                          f16_bits* __restrict__ vc, const unsigned int* __restrict__ positions,
                                          const unsigned int* __restrict__ slots,
                                          const unsigned int* __restrict__ tables, float* __restrict__ out,
                                          const StepShape& s, StepScratch& sh) {
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
#else
#define STEP_KERNEL attention_step
#define STEP_POSITION_ARGS const unsigned int* __restrict__ pos
#define STEP_POSITIONS pos

struct StepShape {
    AttnShape attn;
    RopeShape rope;
    unsigned int flags;
};

// The one row of one sequence, at `pos`.
__device__ __forceinline__ void step_rows(const float* __restrict__ q, const float* __restrict__ k_new,
                                          const float* __restrict__ v_new, f16_bits* __restrict__ kc,
                                          f16_bits* __restrict__ vc, const unsigned int* __restrict__ pos,
                                          float* __restrict__ out, const StepShape& s, StepScratch& sh) {
    const StepContiguous rows{s.attn.max_seq};
    step_main(q, k_new, v_new, kc, vc, pos, out, s.attn, s.rope, s.flags, rows, sh);
}
#endif

extern "C" __global__ void __launch_bounds__(STEP_THREADS, STEP_MIN_BLOCKS)
#if STEP_CLUSTER
__cluster_dims__(1, STEP_SPLITS, 1)
#endif
STEP_KERNEL(const float* __restrict__ q, const float* __restrict__ k_new, const float* __restrict__ v_new,
            f16_bits* __restrict__ kc, f16_bits* __restrict__ vc, STEP_POSITION_ARGS, float* __restrict__ out,
            StepShape s) {
    encore_fix_value(s);
    __shared__ StepScratch sh;
    step_rows(q, k_new, v_new, kc, vc, STEP_POSITIONS, out, s, sh);
}
