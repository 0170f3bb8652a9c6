// `matmul_wide_rows`: the f32 products of the activation rows `to_f16_rows`
// marked as beyond f16's range (kernels/gemm_dense.rs), over what
// `gemm_f16` stored for them: `y[r, j] = Σ_i w[j, i] x[r, i]` in f32 for
// every `r` with `wide[r]`.
//
// Arguments: `w: dtype[n, k]` (read, raw GGUF blocks), `x: f32[rows, k]`
// (read), `wide: u32[rows]` (read), `y: f32[rows, n]` (read-write),
// `MatmulShape s` (value). A block a slice of WR_COLS columns, each block
// looking at every row's mark; real prompts have none or a few.

#include "wide_rows.cuh"

// WR_COLS comes from Rust (cuda/geometry.rs), prepended to this source.

extern "C" __global__ void matmul_wide_rows(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                            const unsigned int* __restrict__ wide, float* __restrict__ y,
                                            MatmulShape s) {
    encore_grid_wait();
    // Most products have no marked row: the block looks at every mark at
    // once and leaves when none is set.
    bool any = false;
    for (unsigned int r = threadIdx.x; r < s.rows; r += blockDim.x) any |= wide[r] != 0u;
    if (!__syncthreads_or(any)) return;
    const unsigned long long row_bytes = ggml_row_bytes(s.dtype, s.k);
    wide_rows_f32(wide, s.rows, WR_COLS, w, x, y, s, row_bytes, 0, blockIdx.x * WR_COLS);
}
