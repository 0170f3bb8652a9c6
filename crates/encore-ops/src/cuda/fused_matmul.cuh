// The `fused_matmul` kernel, over the products of matmul_dots.cuh and one of
// quant_dots_fast.cuh (fused_matmul.cu) or quant_dots_exact.cuh
// (fused_matmul_exact.cu), which the source includes before this file.
//
// Warps as `matmul`, in blocks whose size cuda/geometry.rs picks for the
// shape (MM_THREADS threads at most); for one activation row each warp computes
// `MM_COLS` output columns from one load of the input, for more rows one
// column. In the store and accumulate epilogues the warps of all weights are
// laid end to end, so one launch covers Q, K and V; in the SwiGLU epilogue a
// warp takes the same columns of the gate and the up weights, loaded in one
// pass. (On SmolLM2's rows of 576 and 1536, two warps a column meeting in
// shared memory were slower: the exchange cost more than the shorter rows
// saved; long rows split, below.) The accumulate epilogue
// loads the residual before the dot product, so its latency overlaps it.
//
// One activation row over long weight rows (at least MM_SPLIT_MIN_K) splits
// each column's row among MM_SPLIT warps of a block, in runs of whole
// 256-element groups: a decode product with few columns and long rows (a
// feed-forward down projection) otherwise has too few warps to keep enough
// loads in flight. The warps meet in shared memory, and the first of them
// adds their sums in order, so the result does not depend on timing.
// EPILOGUE_STORE, EPILOGUE_ACCUMULATE and EPILOGUE_SWIGLU, MM_SPLIT and
// MM_SPLIT_MIN_K come from Rust, prepended to the source (kernels/fused.rs,
// cuda/geometry.rs; the exact version never splits).

static_assert((MM_THREADS / 32) % MM_SPLIT == 0, "the warps of a split column must share a block");

struct FusedShape {
    unsigned int rows;
    unsigned int k;
    unsigned int n[3];
    unsigned int dtype[3];
    unsigned int weights;
    unsigned int epilogue;
    unsigned int norm;
    float eps;
    unsigned int bias;  // bit i: the store epilogue adds b_i
};

struct Column {
    const unsigned char* row;   // weight row
    const unsigned char* row2;  // up-weight row (SwiGLU)
    float* y;
    const float* b;  // the output's bias (store epilogue), or null
    unsigned int j, n, dtype, dtype2;
};

// The stored value of column `j` of a store epilogue: the product, plus the
// bias where the output has one, rounded once as `add_rows` after the
// product rounds it (`__fadd_rn`: never contracted with a multiply before it
// into one fused multiply-add, which the exact kernel's bit-for-bit results
// would not survive).
__device__ __forceinline__ float stored(const Column& c, unsigned int j, float p) {
    return c.b ? __fadd_rn(p, c.b[j]) : p;
}

// Several activation rows (not by column): the tiles of rows for the
// warp's column: the dot products (with NORM, each warp sums the squares of
// the input it reads and scales by 1 / rms), then the epilogue. In the
// SwiGLU epilogue the warp multiplies both the gate and the up row of its
// column.
template <bool NORM, int TILE>
__device__ __forceinline__ void fused_rows(const Column& c, const float* __restrict__ x, const float* __restrict__ g,
                           const FusedShape& s, unsigned int lane, bool x16, bool vec_float, bool vec_float2) {
    for (unsigned int r0 = 0; r0 < s.rows; r0 += TILE) {
        const unsigned int rows = min((unsigned int)TILE, s.rows - r0);
        const float* xt = x + (size_t)r0 * s.k;
        float acc[TILE], sq[TILE], acc2[TILE], sq2[TILE], old[TILE];
#pragma unroll
        for (int t = 0; t < TILE; ++t) acc[t] = sq[t] = acc2[t] = sq2[t] = old[t] = 0.f;
        // The residual an accumulating product adds to, loaded before the
        // dot product so that its latency overlaps it.
        if (s.epilogue == EPILOGUE_ACCUMULATE && lane == 0) {
#pragma unroll
            for (int t = 0; t < TILE; ++t)
                if (t < rows) old[t] = c.y[(size_t)(r0 + t) * c.n + c.j];
        }
        dot_row<NORM, TILE>(c.dtype, c.row, xt, g, s.k, rows, lane, x16, vec_float, acc, sq);
        if (s.epilogue == EPILOGUE_SWIGLU)
            dot_row<NORM, TILE>(c.dtype2, c.row2, xt, g, s.k, rows, lane, x16, vec_float2, acc2, sq2);
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            acc[t] = warp_sum(acc[t]);
            if (s.epilogue == EPILOGUE_SWIGLU) acc2[t] = warp_sum(acc2[t]);
            if (NORM) {
                const float inv = 1.0f / sqrtf(warp_sum(sq[t]) / (float)s.k + s.eps);
                acc[t] *= inv;
                acc2[t] *= inv;
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                if (t >= rows) break;
                float* out = c.y + (size_t)(r0 + t) * c.n + c.j;
                if (s.epilogue == EPILOGUE_SWIGLU) *out = __fmul_rn(silu(acc[t]), acc2[t]);
                else if (s.epilogue == EPILOGUE_ACCUMULATE) *out = old[t] + acc[t];
                else *out = stored(c, c.j, acc[t]);
            }
        }
    }
}

// The weight rows of the warp's `cols` columns (column by column): the
// gate's, or the only weight's, then the up weight's. A missing column
// repeats the last one; its sum is not stored.
__device__ __forceinline__ void fused_col_rows(const Column& c, unsigned int cols, unsigned long long row_bytes,
                                               unsigned long long row_bytes2,
                                               const unsigned char* (&rows)[2 * MM_COLS]) {
#pragma unroll
    for (int i = 0; i < MM_COLS; ++i) {
        const unsigned int j = min((unsigned int)i, cols - 1);
        rows[i] = c.row + j * row_bytes;
        rows[MM_COLS + i] = c.row2 + j * row_bytes2;
    }
}

// Gate rows then up rows when both have one type, so one pass loads both.
__device__ __forceinline__ bool fused_together(const FusedShape& s, const Column& c) {
    return s.epilogue == EPILOGUE_SWIGLU && c.dtype2 == c.dtype;
}

// Whether a decode product of `s` quantizes its input to 8 bits once a
// block (`fused_eight_bit` in cuda/geometry.rs): every weight's type (and
// the up weight's in SwiGLU) takes 8-bit activations, in blocks of 32 over
// rows too short to split or in products of MM_Q8_MIN_COLUMNS columns, or
// super-blocks over any row.
__device__ __forceinline__ bool fused_eight_bit(const FusedShape& s) {
#if MM_Q8
    unsigned int types[4];
    unsigned int count = 0;
    for (unsigned int t = 0; t < min(s.weights, 3u); ++t) types[count++] = s.dtype[t];
    if (s.epilogue == EPILOGUE_SWIGLU) types[count++] = s.dtype[1];
    const unsigned int columns = s.epilogue == EPILOGUE_SWIGLU
                                     ? s.n[0]
                                     : s.n[0] + (s.weights > 1 ? s.n[1] : 0u) + (s.weights > 2 ? s.n[2] : 0u);
    return s.rows == 1 &&
           eight_bit_types(types, count, s.k, s.k < MM_SPLIT_MIN_K || columns >= MM_Q8_MIN_COLUMNS);
#else
    return false;
#endif
}

// Warps a column's row is split among (see the top of this file): the same
// for every weight of a launch (they share k), as `fused_split` in
// cuda/geometry.rs computes it for the launch. A product on 8-bit
// activations never splits: the block's warps share its activations.
__device__ __forceinline__ unsigned int fused_split(const FusedShape& s) {
    return s.rows == 1 && s.k >= MM_SPLIT_MIN_K && !fused_eight_bit(s) ? MM_SPLIT : 1u;
}

#if MM_SPLIT > 1
// The finished sums of the N values of a column split among `split` warps
// (`part` this warp's place among them), from each warp's per-lane partial
// sums in `v` and `sq`: every warp reduces its own, the first warp of the
// column adds them in order and applies the norm's scale over the whole
// row. Returns whether this warp is that first one (the others hold
// nothing useful).
template <bool NORM, int N>
__device__ __forceinline__ bool fused_split_sums(float* v, float sq, unsigned int split, unsigned int part,
                                                 const FusedShape& s, unsigned int lane) {
    __shared__ float sums[MM_THREADS / 32][N + 1];
    const unsigned int warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
    if (NORM) sq = warp_sum(sq);
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) sums[warp][i] = v[i];
        sums[warp][N] = sq;
    }
    // The column's warps alone (barrier 0 is __syncthreads').
    asm volatile("bar.sync %0, %1;" ::"r"(1 + warp / MM_SPLIT), "r"(32 * MM_SPLIT) : "memory");
    if (part != 0) return false;
#pragma unroll
    for (int i = 0; i <= N; ++i) {
        float total = 0.f;
        for (unsigned int p = 0; p < split; ++p) total += sums[warp + p][i];
        if (i < N) v[i] = total;
        else sq = total;
    }
    if (NORM) {
        const float inv = 1.0f / sqrtf(sq / (float)s.k + s.eps);
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] *= inv;
    }
    return true;
}

// The finished sums of the warp's N values (`v`, `sq` per-lane partial
// sums): its own, or those of its split column (see fused_split_sums).
template <bool NORM, int N>
__device__ __forceinline__ bool fused_sums(float* v, float sq, unsigned int split, unsigned int part,
                                           const FusedShape& s, unsigned int lane) {
    if (split > 1) return fused_split_sums<NORM, N>(v, sq, split, part, s, lane);
    dot_cols_finish<NORM, N>(v, sq, s.k, s.eps);
    return true;
}
#endif

// The epilogue of the warp's `cols` finished columns `v` (the up
// products after the gate's in SwiGLU) into the activation row at `y`;
// `old` is lane i's residual for column c.j + i (accumulate). Lane i
// stores column c.j + i.
__device__ __forceinline__ void fused_store(const Column& c, unsigned int cols, const float* v, float old,
                                            const FusedShape& s, float* y, unsigned int lane) {
#pragma unroll
    for (int i = 0; i < MM_COLS; ++i) {
        if (lane == (unsigned int)i && (unsigned int)i < cols) {
            float* out = y + c.j + i;
            if (s.epilogue == EPILOGUE_SWIGLU) *out = __fmul_rn(silu(v[i]), v[MM_COLS + i]);
            else if (s.epilogue == EPILOGUE_ACCUMULATE) *out = old + v[i];
            else *out = stored(c, c.j + i, v[i]);
        }
    }
}

// Activation row `r` at `x`: the warp's `cols` columns from `c.j` on
// (MM_COLS at most), the input loaded once for all of them, and in the
// SwiGLU epilogue for the gate and the up rows together, over `k` elements
// of the row (all of it, or this warp's part of a split column: `x`, `g`
// and the rows then start at the part). Lane i stores column c.j + i.
template <bool NORM>
__device__ __forceinline__ void fused_cols(const Column& c, unsigned int cols, const unsigned char* const* rows,
                           const QuantPass<MM_COLS>& first, const QuantPass<2 * MM_COLS>& first_both,
                           const float* __restrict__ x, const float* __restrict__ g, unsigned int k,
                           unsigned int split, unsigned int part, const FusedShape& s, unsigned int r,
                           unsigned int lane, bool x16, bool vec_float, bool vec_float2) {
    const bool swiglu = s.epilogue == EPILOGUE_SWIGLU;
    float v[2 * MM_COLS];
    float* y = c.y + (size_t)r * c.n;
    // The residual an accumulating product adds to, loaded before the dot
    // product so that its latency overlaps it.
    float old = 0.f;
    if (s.epilogue == EPILOGUE_ACCUMULATE && lane < cols) old = y[c.j + lane];
#if MM_SPLIT > 1
    // Per-lane partial sums first, finished alone or with the column's other warps.
    float sq, sq2;
    if (fused_together(s, c)) {
        dot_cols_lanes<NORM, 2 * MM_COLS>(c.dtype, rows, x, g, k, lane, x16, vec_float, v, sq, &first_both);
    } else {
        dot_cols_lanes<NORM, MM_COLS>(c.dtype, rows, x, g, k, lane, x16, vec_float, v, sq, &first);
        if (swiglu)
            dot_cols_lanes<NORM, MM_COLS>(c.dtype2, rows + MM_COLS, x, g, k, lane, x16, vec_float2, v + MM_COLS,
                                          sq2, (const QuantPass<MM_COLS>*)nullptr);
    }
    const bool finished = swiglu ? fused_sums<NORM, 2 * MM_COLS>(v, sq, split, part, s, lane)
                                 : fused_sums<NORM, MM_COLS>(v, sq, split, part, s, lane);
    if (!finished) return;
#else
    if (fused_together(s, c)) {
        dot_cols<NORM, 2 * MM_COLS>(c.dtype, rows, x, g, k, s.eps, lane, x16, vec_float, v, &first_both);
    } else {
        dot_cols<NORM, MM_COLS>(c.dtype, rows, x, g, k, s.eps, lane, x16, vec_float, v, &first);
        if (swiglu)
            dot_cols<NORM, MM_COLS>(c.dtype2, rows + MM_COLS, x, g, k, s.eps, lane, x16, vec_float2, v + MM_COLS,
                                    (const QuantPass<MM_COLS>*)nullptr);
    }
#endif
    fused_store(c, cols, v, old, s, y, lane);
}

#if MM_Q8
// fused_cols for one activation row of the types of q8_activations, the
// row quantized by the block (`xq`, `xd`; `inv` the norm's 1 / rms, else
// 1): see quant_dots_fast.cuh.
__device__ __forceinline__ void fused_cols_x8(const Column& c, unsigned int cols, const unsigned char* const* rows,
                                              const QuantPass<MM_COLS>& first,
                                              const QuantPass<2 * MM_COLS>& first_both, const int* xq,
                                              const float* xd, float inv, const FusedShape& s, unsigned int lane) {
    const bool swiglu = s.epilogue == EPILOGUE_SWIGLU;
    float v[2 * MM_COLS];
    float old = 0.f;
    if (s.epilogue == EPILOGUE_ACCUMULATE && lane < cols) old = c.y[c.j + lane];
    if (fused_together(s, c)) {
        dot_cols_x8_of<2 * MM_COLS>(c.dtype, rows, xq, xd, s.k, lane, v, &first_both);
    } else {
        dot_cols_x8_of<MM_COLS>(c.dtype, rows, xq, xd, s.k, lane, v, &first);
        if (swiglu)
            dot_cols_x8_of<MM_COLS>(c.dtype2, rows + MM_COLS, xq, xd, s.k, lane, v + MM_COLS,
                                    (const QuantPass<MM_COLS>*)nullptr);
    }
#pragma unroll
    for (int i = 0; i < 2 * MM_COLS; ++i)
        if (i < MM_COLS || swiglu) v[i] = warp_sum(v[i]) * inv;
    fused_store(c, cols, v, old, s, c.y, lane);
}
#endif

// One of three values by a run-time index, without an array (an array
// indexed at run time lives in local memory). Where the three are equal
// constants, such as one weight type in a variant specialized for its
// shape, the choice folds to that constant.
template <typename T>
__device__ __forceinline__ T pick(unsigned int i, T a, T b, T c) {
    return i == 0 ? a : i == 1 ? b : c;
}

// Blocks a multiprocessor must hold at once: 1, or where the variant is
// specialized for a decode product on 8-bit activations, 3 (cuda/mod.rs,
// `fused_variant_options`), which holds that path to 85 registers (Q4_K
// and Q6_K fit in 80 without spilling): three blocks of eight warps keep
// more loads in flight than two. The generic code would spill there, so
// only these variants ask.
#ifndef MM_MIN_BLOCKS
#define MM_MIN_BLOCKS 1
#endif

extern "C" __global__ void __launch_bounds__(MM_THREADS, MM_MIN_BLOCKS)
fused_matmul(const float* __restrict__ x, const float* __restrict__ g, const unsigned char* __restrict__ w0,
             const unsigned char* __restrict__ w1, const unsigned char* __restrict__ w2, float* y0, float* y1,
             float* y2, const float* __restrict__ b0, const float* __restrict__ b1,
             const float* __restrict__ b2, FusedShape s) {
    encore_fix_value(s);
#if MM_ROW_INVARIANT
    // `fused_matmul_rows`: the grid's y is the activation row, each on the
    // one-row path (as `matmul_rows`).
    x += (size_t)blockIdx.y * s.k;
    y0 += (size_t)blockIdx.y * s.n[0];
    y1 += (size_t)blockIdx.y * s.n[1];
    y2 += (size_t)blockIdx.y * s.n[2];
    s.rows = 1;
#endif
    const unsigned int lane = threadIdx.x & 31u;
    // The warps of a split column are neighbours; `warp` counts columns' warps.
    const unsigned int split = fused_split(s);
    const unsigned int warp_index = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const unsigned int part = warp_index % split;
    unsigned int warp = warp_index / split;
    const unsigned int per_warp = s.rows == 1 ? MM_COLS : 1;
    unsigned int i = 0;
    bool live;
    if (s.epilogue != EPILOGUE_SWIGLU) {
        // Find the weight whose warps hold this one.
        const unsigned int weights = min(s.weights, 3u);
#pragma unroll
        for (unsigned int t = 0; t < 3; ++t) {
            const unsigned int warps = product_warps(s.rows, s.n[t]);
            if (i == t && t < weights && warp >= warps) {
                warp -= warps;
                i = t + 1;
            }
        }
        live = i < weights;
    } else {
        live = warp < product_warps(s.rows, s.n[0]);
    }
    if (!live) i = 0;  // an index in bounds; the warp has no columns
    const unsigned char* const w = pick(i, w0, w1, w2);
    const unsigned int n = pick(i, s.n[0], s.n[1], s.n[2]);
    const unsigned int dtype = pick(i, s.dtype[0], s.dtype[1], s.dtype[2]);
    const unsigned int j0 = warp * per_warp;
    const unsigned int cols = live ? min(per_warp, n - j0) : 0;
    const unsigned long long row_bytes = ggml_row_bytes(dtype, s.k), row_bytes2 = ggml_row_bytes(s.dtype[1], s.k);
    // This warp's part of the rows: all of them, or a run of whole
    // 256-element groups of a split column (the last part ends at the row's end).
    unsigned int k0 = 0, k = s.k;
    if (split > 1) {
        const unsigned int groups = (s.k + 255u) / 256u;
        k0 = part * groups / split * 256u;
        k = min((part + 1u) * groups / split * 256u, s.k) - k0;
    }
    const unsigned long long skip = ggml_row_bytes(dtype, k0), skip2 = ggml_row_bytes(s.dtype[1], k0);
    // The weights are read-only: fetch this warp's rows into L2 while the
    // previous kernel finishes.
    for (unsigned int c = 0; c < cols; ++c) {
        prefetch_row(w + (size_t)(j0 + c) * row_bytes + skip, ggml_row_bytes(dtype, k), lane);
        if (s.epilogue == EPILOGUE_SWIGLU)
            prefetch_row(w1 + (size_t)(j0 + c) * row_bytes2 + skip2, ggml_row_bytes(s.dtype[1], k), lane);
    }
    x += k0;
    if (s.norm) g += k0;
    Column c;
    c.j = j0;
    c.n = n;
    c.dtype = dtype;
    c.dtype2 = s.dtype[1];
    c.y = pick(i, y0, y1, y2);
    c.b = s.epilogue == EPILOGUE_STORE && (s.bias >> i & 1u) ? pick(i, b0, b1, b2) : nullptr;
    c.row = w + (size_t)j0 * row_bytes + skip;
    c.row2 = w1 + (size_t)j0 * row_bytes2 + skip2;
    // One activation row goes column by column; so do several, row by row,
    // in the exact version with quantized weights; else tiles of rows.
    const bool by_column = s.rows == 1 || (MM_QUANT_BY_COLUMN && (ggml_quantized(dtype) ||
                           (s.epilogue == EPILOGUE_SWIGLU && ggml_quantized(c.dtype2))));
    // The first pass of quantized weights (the same for every activation
    // row) goes into registers before the wait as well.
    const unsigned char* rows[2 * MM_COLS];
    QuantPass<MM_COLS> first;
    QuantPass<2 * MM_COLS> first_both;
#if MM_Q8
    // One activation row against weights of blocks of 32 only, or of Q4_K
    // and Q6_K only: the block quantizes the row once (the same test in
    // every warp of the block).
    int* xq = x8_shared;
    float* xd = reinterpret_cast<float*>(x8_shared + s.k / 4);
    const bool x8 = fused_eight_bit(s);
#else
    const bool x8 = false;
#endif
    if (live && by_column) {
        fused_col_rows(c, cols, row_bytes, row_bytes2, rows);
        const float* gn = s.norm && !x8 ? g : nullptr;
        if (fused_together(s, c)) quant_pass_first<2 * MM_COLS>(dtype, rows, gn, k, lane, first_both);
        else quant_pass_first<MM_COLS>(dtype, rows, gn, k, lane, first);
    }
    encore_grid_wait();
    const bool x16 = ((size_t)x & 15u) == 0 && (!s.norm || ((size_t)g & 15u) == 0);
#if MM_Q8
    if (x8) {
        x8_require_shared(s.k);
        float inv;
        if (s.norm) inv = x16 ? quantize_x8<true, true>(x, g, s.k, s.eps, xq, xd)
                              : quantize_x8<true, false>(x, g, s.k, s.eps, xq, xd);
        else inv = x16 ? quantize_x8<false, true>(x, g, s.k, s.eps, xq, xd)
                       : quantize_x8<false, false>(x, g, s.k, s.eps, xq, xd);
        if (live) fused_cols_x8(c, cols, rows, first, first_both, xq, xd, inv, s, lane);
        return;
    }
#endif
    if (!live) return;  // the whole warp leaves together
    const bool vec_float = x16 && ((size_t)w & 15u) == 0 && s.k % 8 == 0;
    const bool vec_float2 = x16 && ((size_t)w1 & 15u) == 0 && s.k % 8 == 0;
    if (by_column) {
        for (unsigned int r = 0; r < s.rows; ++r) {
            const float* xr = x + (size_t)r * s.k;
            if (s.norm)
                fused_cols<true>(c, cols, rows, first, first_both, xr, g, k, split, part, s, r, lane, x16, vec_float,
                                 vec_float2);
            else
                fused_cols<false>(c, cols, rows, first, first_both, xr, g, k, split, part, s, r, lane, x16, vec_float,
                                  vec_float2);
        }
    } else if (s.norm) {
        fused_rows<true, 4>(c, x, g, s, lane, x16, vec_float, vec_float2);
    } else {
        fused_rows<false, 4>(c, x, g, s, lane, x16, vec_float, vec_float2);
    }
}
