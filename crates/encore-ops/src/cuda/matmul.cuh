// The `matmul` kernel, over the products of matmul_dots.cuh and one of
// quant_dots_fast.cuh (matmul.cu) or quant_dots_exact.cuh (matmul_exact.cu),
// which the source includes before this file.
//
// `MM_THREADS / 32` warps a block. For one activation row (decode) each warp computes
// one output column (weight row), or in a product of at least `MM_WIDE_N`
// columns `MM_COLS` of them from one load of the activations;
// for more rows, one column, walking the weight row once per tile of up to
// four activation rows (in the exact version, quantized weights go row after
// row instead, each quantized on its own as the CPU does, with the first
// pass of weights kept in registers for all rows). Each warp reads its input
// itself: staging it in shared memory once per block was slower, since the
// barrier puts a second memory round trip on the path of every warp. The
// exception is an output head of quantized weights (MM_Q8; in blocks of 32,
// or Q4_K and Q6_K): there the block quantizes its input to 8 bits once,
// and the `dp4a` products that follow saved more than the barrier cost.

#include "matmul_shape.cuh"

template <int TILE>
__device__ __forceinline__ void matmul_rows(const unsigned char* __restrict__ row, const float* __restrict__ x,
                                            float* __restrict__ y, const MatmulShape& s, unsigned int j,
                                            unsigned int lane, bool x16, bool vec_float) {
    for (unsigned int r0 = 0; r0 < s.rows; r0 += TILE) {
        const unsigned int rows = min((unsigned int)TILE, s.rows - r0);
        float acc[TILE], sq[TILE];
#pragma unroll
        for (int t = 0; t < TILE; ++t) acc[t] = sq[t] = 0.f;
        dot_row<false, TILE>(s.dtype, row, x + (size_t)r0 * s.k, nullptr, s.k, rows, lane, x16, vec_float, acc, sq);
#pragma unroll
        for (int t = 0; t < TILE; ++t) acc[t] = warp_sum(acc[t]);
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < TILE; ++t)
                if (t < rows) y[(size_t)(r0 + t) * s.n + j] = acc[t];
        }
    }
}

// One activation row: the weight rows of the warp's `cols` columns from
// `j0` on (a missing column repeats the last one; its sum is not stored).
template <int N>
__device__ __forceinline__ void matmul_col_rows(const unsigned char* __restrict__ w, const MatmulShape& s,
                                                unsigned int j0, unsigned int cols,
                                                const unsigned char* (&rows)[N]) {
    const unsigned long long row_bytes = ggml_row_bytes(s.dtype, s.k);
#pragma unroll
    for (int c = 0; c < N; ++c) rows[c] = w + (size_t)(j0 + min((unsigned int)c, cols - 1)) * row_bytes;
}

// One activation row at `x`: the warp's `cols` columns, the activations
// loaded once for all of them, the first pass of quantized weights from
// `first`. Lane c stores column j0 + c of `y`.
template <int N>
__device__ __forceinline__ void matmul_cols(const unsigned char* const* rows, const QuantPass<N>& first,
                                            const float* __restrict__ x, float* __restrict__ y,
                                            const MatmulShape& s, unsigned int j0, unsigned int cols,
                                            unsigned int lane, bool x16, bool vec_float) {
    float out[N];
    dot_cols<false, N>(s.dtype, rows, x, nullptr, s.k, 0.f, lane, x16, vec_float, out, &first);
#pragma unroll
    for (int c = 0; c < N; ++c)
        if (lane == (unsigned int)c && (unsigned int)c < cols) y[j0 + c] = out[c];
}

// The kernel's work once the launch is known: `N` columns a warp for one
// activation row, one for more.
template <int N>
__device__ __forceinline__ void matmul_body(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                            float* __restrict__ y, const MatmulShape& s) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const unsigned int per_warp = s.rows == 1 ? N : 1;
    const unsigned int j0 = warp * per_warp;
    const unsigned int cols = j0 < s.n ? min(per_warp, s.n - j0) : 0;
    const unsigned long long row_bytes = ggml_row_bytes(s.dtype, s.k);
    // One activation row goes column by column; so do several, row by row,
    // in the exact version with quantized weights; else tiles of rows.
    const bool by_column = s.rows == 1 || (MM_QUANT_BY_COLUMN && ggml_quantized(s.dtype));
    // The weights are read-only: fetch this warp's rows into L2 while the
    // previous kernel finishes.
    for (unsigned int c = 0; c < cols; ++c) prefetch_row(w + (size_t)(j0 + c) * row_bytes, row_bytes, lane);
    // The first pass of quantized weights (the same for every activation
    // row) goes into registers before the wait as well.
    const unsigned char* rows[N];
    QuantPass<N> first;
    if (by_column && cols > 0) {
        matmul_col_rows<N>(w, s, j0, cols, rows);
        quant_pass_first<N>(s.dtype, rows, nullptr, s.k, lane, first);
    }
    encore_grid_wait();
#if MM_Q8
    // An output head of weights in blocks of 32, or of Q4_K or Q6_K: the
    // block quantizes the activation row once (quant_dots_fast.cuh,
    // quant_dots_k8.cuh).
    if (s.rows == 1 && s.n >= MM_WIDE_N && eight_bit_types(&s.dtype, 1, s.k, true)) {
        x8_require_shared(s.k);
        int* xq = x8_shared;
        float* xd = reinterpret_cast<float*>(x8_shared + s.k / 4);
        if (((size_t)x & 15u) == 0) quantize_x8<false, true>(x, nullptr, s.k, 0.f, xq, xd);
        else quantize_x8<false, false>(x, nullptr, s.k, 0.f, xq, xd);
        if (cols == 0) return;
        float out[N];
        dot_cols_x8_of<N>(s.dtype, rows, xq, xd, s.k, lane, out, &first);
#pragma unroll
        for (int c = 0; c < N; ++c) {
            out[c] = warp_sum(out[c]);
            if (lane == (unsigned int)c && (unsigned int)c < cols) y[j0 + c] = out[c];
        }
        return;
    }
#endif
    if (cols == 0) return;  // the whole warp leaves together
    const bool x16 = ((size_t)x & 15u) == 0;
    const bool vec_float = x16 && ((size_t)w & 15u) == 0 && s.k % 8 == 0;
    if (by_column) {
        for (unsigned int r = 0; r < s.rows; ++r)
            matmul_cols<N>(rows, first, x + (size_t)r * s.k, y + (size_t)r * s.n, s, j0, cols, lane, x16,
                           vec_float);
    } else {
        matmul_rows<4>(w + (size_t)j0 * row_bytes, x, y, s, j0, lane, x16, vec_float);
    }
}

extern "C" __global__ void __launch_bounds__(MM_THREADS, 1)
matmul(const unsigned char* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
       MatmulShape s) {
    encore_fix_value(s);
#if MM_ROW_INVARIANT
    // `matmul_rows`: the grid's y is the activation row, and each row runs
    // the one-row path, so that a row's sums never depend on the rows
    // around it, while the rows still run side by side.
    x += (size_t)blockIdx.y * s.k;
    y += (size_t)blockIdx.y * s.n;
    s.rows = 1;
#endif
    // MM_COLS columns a warp for one activation row of a wide product (an
    // output head), as `matmul_warps` in cuda/geometry.rs launches it.
    if (s.rows == 1 && s.n >= MM_WIDE_N) matmul_body<MM_COLS>(w, x, y, s);
    else matmul_body<1>(w, x, y, s);
}
