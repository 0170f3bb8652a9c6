// The products shared by both versions of `matmul` and `fused_matmul`: the
// launch constants, loads, and the float weights' dot products. Float weights
// multiply f32 activations, as the CPU does, but in another order (8
// consecutive elements a lane, 256 a warp step, `MM_STEPS` steps loaded
// before any is used); with a norm folded in, each activation is multiplied
// by the norm weight `g` as it is loaded and its square joins `sq`, and the
// finished sums are scaled by `1 / rms`.
//
// Each version of the quantized products (quant_dots_fast.cuh,
// quant_dots_exact.cuh), included after this header, defines on top of it
// `dot_row` (a weight row against a tile of activation rows, per-lane partial
// sums), `QuantPass` and `quant_pass_first` (the first pass of weights,
// loaded before the kernel waits for its inputs), `dot_cols` (N weight rows
// against one activation row, finished sums on every lane) and
// `MM_QUANT_BY_COLUMN` (whether several activation rows of quantized weights
// go row by row through `dot_cols`).

#include "gguf.cuh"

#define MM_STEPS 4
// MM_THREADS (threads a block; `fused_matmul`'s largest) and MM_COLS
// (output columns a warp computes for one activation row) come from Rust,
// prepended to the source (cuda/geometry.rs). The kernels declare at least
// one block an SM (`__launch_bounds__(MM_THREADS, 1)`): aiming at more, the
// compiler keeps registers low by issuing a pass's loads in groups, each
// behind the arithmetic on the one before, which puts several memory round
// trips on every warp's path instead of one.

// Asks for the 128-byte lines of `bytes` bytes at `row` in L2, spread over the warp's lanes.
__device__ __forceinline__ void prefetch_row(const unsigned char* row, unsigned long long bytes, unsigned int lane) {
    const unsigned long long end = (unsigned long long)row + bytes;
    for (unsigned long long a = ((unsigned long long)row & ~127ull) + 128ull * lane; a < end; a += 32ull * 128ull)
        encore_prefetch_l2((const void*)a);
}

template <bool VEC>
__device__ __forceinline__ void load4(const float* __restrict__ p, float* v) {
    if (VEC) {
        const float4 a = *reinterpret_cast<const float4*>(p);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    } else {
        v[0] = p[0]; v[1] = p[1]; v[2] = p[2]; v[3] = p[3];
    }
}

// Four activations at `x`, times the norm weights at `g` when NORM; their
// squares (before the norm weights) join `sq`.
template <bool VEC, bool NORM>
__device__ __forceinline__ void load_x4(const float* __restrict__ x, const float* __restrict__ g, float* v,
                                        float& sq) {
    load4<VEC>(x, v);
    if (NORM) {
        float gv[4];
        load4<VEC>(g, gv);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            sq = fmaf(v[i], v[i], sq);
            v[i] *= gv[i];
        }
    }
}

// Eight consecutive float weights (16 bytes of f16/bf16 or 32 of f32) as raw words.
template <unsigned int TYPE>
__device__ __forceinline__ void load8_raw(const unsigned char* __restrict__ p, uint4* raw) {
    raw[0] = reinterpret_cast<const uint4*>(p)[0];
    if (TYPE == GGML_F32) raw[1] = reinterpret_cast<const uint4*>(p)[1];
}

template <unsigned int TYPE>
__device__ __forceinline__ void widen8(const uint4* raw, float* w) {
    if (TYPE == GGML_F32) {
        const unsigned int u[8] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w, raw[1].x, raw[1].y, raw[1].z, raw[1].w};
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = __uint_as_float(u[i]);
    } else {
        const unsigned int u[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (TYPE == GGML_F16) {
                w[2 * i] = f16_to_f32((f16_bits)(u[i] & 0xffffu));
                w[2 * i + 1] = f16_to_f32((f16_bits)(u[i] >> 16));
            } else {
                w[2 * i] = __uint_as_float(u[i] << 16);
                w[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
            }
        }
    }
}

template <unsigned int TYPE>
__device__ __forceinline__ float load1_weight(const unsigned char* __restrict__ row, unsigned int i) {
    if (TYPE == GGML_F32) return reinterpret_cast<const float*>(row)[i];
    if (TYPE == GGML_F16) return f16_to_f32(reinterpret_cast<const f16_bits*>(row)[i]);
    return bf16_to_f32(reinterpret_cast<const bf16_bits*>(row)[i]);
}

// F32, F16 and BF16 weights.
template <unsigned int TYPE, bool VEC, bool NORM, int TILE>
__device__ void dot_float(const unsigned char* __restrict__ row, const float* __restrict__ x,
                          const float* __restrict__ g, unsigned int k, unsigned int rows, unsigned int lane,
                          float* acc, float* sq) {
    const unsigned int size = TYPE == GGML_F32 ? 4 : 2;
    const int words = TYPE == GGML_F32 ? 2 : 1;
    if (VEC) {
        for (unsigned int i0 = 8 * lane; i0 < k; i0 += 256 * MM_STEPS) {
            uint4 raw[MM_STEPS][2];
#pragma unroll
            for (int u = 0; u < MM_STEPS; ++u) {
                const unsigned int i = i0 + 256 * u;
#pragma unroll
                for (int h = 0; h < words; ++h) raw[u][h] = make_uint4(0u, 0u, 0u, 0u);
                if (i < k) load8_raw<TYPE>(row + (size_t)i * size, raw[u]);
            }
#pragma unroll
            for (int u = 0; u < MM_STEPS; ++u) {
                const unsigned int i = i0 + 256 * u;
                if (i >= k) break;
                float w[8];
                widen8<TYPE>(raw[u], w);
#pragma unroll
                for (int t = 0; t < TILE; ++t) {
                    if (t < rows) {
                        const float* xb = x + (size_t)t * k + i;
                        float xv[8];
                        load_x4<true, NORM>(xb, g + i, xv, sq[t]);
                        load_x4<true, NORM>(xb + 4, g + i + 4, xv + 4, sq[t]);
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[t] = fmaf(w[e], xv[e], acc[t]);
                    }
                }
            }
        }
    } else {
        for (unsigned int i = lane; i < k; i += 32) {
            const float w = load1_weight<TYPE>(row, i);
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                if (t < rows) {
                    float xv = x[(size_t)t * k + i];
                    if (NORM) {
                        sq[t] = fmaf(xv, xv, sq[t]);
                        xv *= g[i];
                    }
                    acc[t] = fmaf(w, xv, acc[t]);
                }
            }
        }
    }
}

// Float weights: dispatches on the type and on whether 16-byte loads are
// aligned (`x16`: activations, and norm weights when NORM; `vec_float`:
// also the weights, with rows a multiple of 8 long).
template <bool NORM, int TILE>
__device__ __forceinline__ void dot_row_float(unsigned int dtype, const unsigned char* __restrict__ row,
                                              const float* __restrict__ x, const float* __restrict__ g,
                                              unsigned int k, unsigned int rows, unsigned int lane, bool x16,
                                              bool vec_float, float* acc, float* sq) {
    switch (dtype) {
        GGML_CASE(GGML_F32)
            if (vec_float) dot_float<GGML_F32, true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_float<GGML_F32, false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        GGML_CASE(GGML_F16)
            if (vec_float) dot_float<GGML_F16, true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_float<GGML_F16, false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        GGML_CASE(GGML_BF16)
            if (vec_float) dot_float<GGML_BF16, true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_float<GGML_BF16, false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        default:
            break;
    }
}

// The finished sums of N columns from the lanes' partial sums `out`, with
// NORM scaled by 1 / rms from the lanes' partial sums of squares `sq`.
template <bool NORM, int N>
__device__ __forceinline__ void dot_cols_finish(float* out, float sq, unsigned int k, float eps) {
#pragma unroll
    for (int c = 0; c < N; ++c) out[c] = warp_sum(out[c]);
    if (NORM) {
        const float inv = 1.0f / sqrtf(warp_sum(sq) / (float)k + eps);
#pragma unroll
        for (int c = 0; c < N; ++c) out[c] *= inv;
    }
}

// Float weights against one activation row, N rows one at a time: per-lane
// partial sums in `out` (with NORM, the squares of the activations join
// `sq`, once).
template <bool NORM, int N>
__device__ __forceinline__ void dot_cols_float_lanes(unsigned int dtype, const unsigned char* const* rows,
                                                     const float* __restrict__ x, const float* __restrict__ g,
                                                     unsigned int k, unsigned int lane, bool x16, bool vec_float,
                                                     float* out, float& sq) {
#pragma unroll
    for (int c = 0; c < N; ++c) {
        float other = 0.f;
        out[c] = 0.f;
        dot_row_float<NORM, 1>(dtype, rows[c], x, g, k, 1, lane, x16, vec_float, out + c, c == 0 ? &sq : &other);
    }
}

// Float weights against one activation row, N rows one at a time: the
// finished dot products in `out` on every lane (with NORM, the norm folded
// into a scale of the finished sums).
template <bool NORM, int N>
__device__ __forceinline__ void dot_cols_float(unsigned int dtype, const unsigned char* const* rows,
                                               const float* __restrict__ x, const float* __restrict__ g,
                                               unsigned int k, float eps, unsigned int lane, bool x16,
                                               bool vec_float, float* out) {
    float sq = 0.f;
    dot_cols_float_lanes<NORM, N>(dtype, rows, x, g, k, lane, x16, vec_float, out, sq);
    dot_cols_finish<NORM, N>(out, sq, k, eps);
}

// The warps of a product over `n` columns: MM_COLS columns a warp for one
// activation row, one column a warp (with tiles of rows) for more (as
// `product_warps` in cuda/geometry.rs computes them for the launch).
__device__ __forceinline__ unsigned int product_warps(unsigned int rows, unsigned int n) {
    return rows == 1 ? (n + MM_COLS - 1) / MM_COLS : n;
}
