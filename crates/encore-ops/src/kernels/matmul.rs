//! Matrix products with (possibly quantized) weights:
//! `y[r, j] = sum_i w[j, i] * x[r, i]` for `rows` activation rows.
//!
//! Arguments: `w: dtype[n, k]` (read, raw GGUF blocks), `x: f32[rows, k]`
//! (read), `y: f32[rows, n]` (write), [`MatmulShape`] (value).
//!
//! The CPU quantizes `x` to 8-bit blocks for quantized weights (as ggml
//! does). CUDA has two versions of the quantized products, chosen by
//! [`encore::Config::exact`]: by default it multiplies dequantized weights
//! with f32 `x` (`cuda_quant_dots_fast`), which agrees with the CPU to the
//! activation quantization error; the exact version
//! (`cuda_quant_dots_exact`) quantizes `x` as the CPU does and gives the
//! CPU's results bit for bit, at some cost in speed. On CUDA, from
//! [`super::gemm::GEMM_MIN_ROWS`] rows on, `Ops::matmul` dispatches the
//! tiled tensor-core kernel of [`super::gemm`] instead of this one (not in
//! exact mode: it is not bit-identical).

use encore::KernelDef;

use crate::DType;

/// CUDA C shared by the kernels that read GGUF data: half and bfloat16
/// conversions and the ggml type ids.
///
/// NVRTC finds no `cuda_fp16.h` without an include path to a CUDA toolkit,
/// so halves are carried as their 16 bits and converted with PTX `cvt`
/// (f16 to f32 exactly; f32 to f16 rounding to nearest even, like the
/// `half` crate). A bfloat16 is the top half of an f32.
macro_rules! cuda_ggml_types {
    () => {
        r#"
typedef unsigned short f16_bits;
typedef unsigned short bf16_bits;

__device__ __forceinline__ float f16_to_f32(f16_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16_bits f32_to_f16(float f) {
    f16_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The value an f32 takes once stored as f16.
__device__ __forceinline__ float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

__device__ __forceinline__ float bf16_to_f32(bf16_bits b) {
    return __uint_as_float((unsigned int)b << 16);
}

#define GGML_F32 0u
#define GGML_F16 1u
#define GGML_Q4_0 2u
#define GGML_Q4_1 3u
#define GGML_Q8_0 8u
#define GGML_BF16 30u

__device__ __forceinline__ bool ggml_quantized(unsigned int dtype) {
    return dtype == GGML_Q4_0 || dtype == GGML_Q4_1 || dtype == GGML_Q8_0;
}

// Bytes of one row of `k` elements of a ggml type (0 for an unknown type).
__device__ __forceinline__ unsigned long long ggml_row_bytes(unsigned int dtype, unsigned int k) {
    switch (dtype) {
        case GGML_F32: return 4ull * k;
        case GGML_F16: case GGML_BF16: return 2ull * k;
        case GGML_Q8_0: return 34ull * (k / 32);
        case GGML_Q4_0: return 18ull * (k / 32);
        case GGML_Q4_1: return 20ull * (k / 32);
        default: return 0;
    }
}

// e^x as ggml's AVX2 `ggml_v_expf` computes it (see the CPU's `ggml_expf`):
// the same fused multiply-adds in the same order, so the same bits.
__device__ __forceinline__ float ggml_expf(float x) {
    const float shift = __uint_as_float(0x4b400000u), log2e = __uint_as_float(0x3fb8aa3bu);
    const float ln2_hi = __uint_as_float(0x3f317200u), ln2_lo = __uint_as_float(0x35bfbe8eu);
    const float c0 = __uint_as_float(0x3c072010u), c1 = __uint_as_float(0x3d2b9f17u);
    const float c2 = __uint_as_float(0x3e2aaf33u), c3 = __uint_as_float(0x3efffedbu);
    const float c4 = __uint_as_float(0x3f7ffff6u);
    const float z = fmaf(x, log2e, shift);
    const float n = __fsub_rn(z, shift);
    const float b = fmaf(-n, ln2_lo, fmaf(-n, ln2_hi, x));
    const unsigned int e = __float_as_uint(z) << 23;
    const float k = __uint_as_float(e + __float_as_uint(1.0f));
    const float u = __fmul_rn(b, b);
    const float j = fmaf(fmaf(fmaf(c0, b, c1), u, fmaf(c2, b, c3)), u, __fmul_rn(c4, b));
    if (fabsf(n) <= 126.0f) return fmaf(k, j, k);
    const unsigned int g = n <= 0.0f ? 0x82000000u : 0u;
    const float s1 = __uint_as_float(g + 0x7f000000u);
    const float s2 = __uint_as_float(e - g);
    if (fabsf(n) > 192.0f) return __fmul_rn(s1, s1);
    return __fmul_rn(fmaf(s2, j, s2), s1);
}

// silu(v) = v / (1 + e^-v), as the CPU computes it.
__device__ __forceinline__ float silu(float v) { return v / __fadd_rn(1.0f, ggml_expf(-v)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
"#
    };
}
pub(crate) use cuda_ggml_types;
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MatmulShape {
    pub rows: u32,
    pub n: u32,
    pub k: u32,
    /// ggml type id of the weights.
    pub dtype: u32,
}

/// CUDA: four warps a block. For one activation row (decode) each warp
/// computes [`CUDA_COLUMNS_PER_WARP`] output columns (weight rows) from one
/// load of the activations; for more rows, one column, walking the weight
/// row once per tile of up to four activation rows (in the exact version,
/// quantized weights go row after row instead, each quantized on its own as
/// the CPU does, with the first pass of weights kept in registers for all
/// rows). Each warp reads its input itself: staging it in shared memory
/// once per block measured slower (the barrier puts a second
/// memory round trip on the path of every warp, H200: SmolLM2's head 20.7 →
/// 24.9 µs).
/// The per-type dot products live in [`cuda_matmul_dots`] and one of
/// [`cuda_quant_dots_fast`] or [`cuda_quant_dots_exact`], shared with the
/// fused kernels.
macro_rules! cuda_matmul_kernel {
    () => {
        r#"
struct MatmulShape {
    unsigned int rows;
    unsigned int n;
    unsigned int k;
    unsigned int dtype;
};

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
__device__ __forceinline__ void matmul_col_rows(const unsigned char* __restrict__ w, const MatmulShape& s,
                                                unsigned int j0, unsigned int cols,
                                                const unsigned char* (&rows)[MM_COLS]) {
    const unsigned long long row_bytes = ggml_row_bytes(s.dtype, s.k);
#pragma unroll
    for (int c = 0; c < MM_COLS; ++c) rows[c] = w + (size_t)(j0 + min((unsigned int)c, cols - 1)) * row_bytes;
}

// One activation row at `x`: the warp's `cols` columns, the activations
// loaded once for all of them, the first pass of quantized weights from
// `first`. Lane c stores column j0 + c of `y`.
__device__ __forceinline__ void matmul_cols(const unsigned char* const* rows, const QuantPass<MM_COLS>& first,
                                            const float* __restrict__ x, float* __restrict__ y,
                                            const MatmulShape& s, unsigned int j0, unsigned int cols,
                                            unsigned int lane, bool x16, bool vec_float) {
    float out[MM_COLS];
    dot_cols<false, MM_COLS>(s.dtype, rows, x, nullptr, s.k, 0.f, lane, x16, vec_float, out, &first);
#pragma unroll
    for (int c = 0; c < MM_COLS; ++c)
        if (lane == (unsigned int)c && (unsigned int)c < cols) y[j0 + c] = out[c];
}

extern "C" __global__ void __launch_bounds__(MM_THREADS, 1)
matmul(const unsigned char* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
       MatmulShape s) {
    encore_fix_value(s);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const unsigned int per_warp = s.rows == 1 ? MM_COLS : 1;
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
    const unsigned char* rows[MM_COLS];
    QuantPass<MM_COLS> first;
    if (by_column && cols > 0) {
        matmul_col_rows(w, s, j0, cols, rows);
        quant_pass_first<MM_COLS>(s.dtype, rows, nullptr, s.k, lane, first);
    }
    encore_grid_wait();
    if (cols == 0) return;  // the whole warp leaves together
    const bool x16 = ((size_t)x & 15u) == 0;
    const bool vec_float = x16 && ((size_t)w & 15u) == 0 && s.k % 8 == 0;
    if (by_column) {
        for (unsigned int r = 0; r < s.rows; ++r)
            matmul_cols(rows, first, x + (size_t)r * s.k, y + (size_t)r * s.n, s, j0, cols, lane, x16, vec_float);
    } else {
        matmul_rows<4>(w + (size_t)j0 * row_bytes, x, y, s, j0, lane, x16, vec_float);
    }
}
"#
    };
}

const MATMUL_CUDA: &str = concat!(
    cuda_ggml_types!(),
    cuda_matmul_dots!(),
    cuda_quant_dots_fast!(),
    cuda_matmul_kernel!()
);

const MATMUL_CUDA_EXACT: &str = concat!(
    cuda_ggml_types!(),
    cuda_matmul_dots!(),
    cuda_quant_dots_exact!(),
    cuda_matmul_kernel!()
);

/// CUDA C shared by both versions of the products (`matmul` and the fused
/// kernels): the launch constants, loads, and the float weights' dot
/// products. Float weights multiply f32 activations, as the CPU does, but
/// in another order (8 consecutive elements a lane, 256 a warp step,
/// `MM_STEPS` steps loaded before any is used); with a norm folded in, each
/// activation is multiplied by the norm weight `g` as it is loaded and its
/// square joins `sq`, and the finished sums are scaled by `1 / rms`. Each
/// version of the quantized products ([`cuda_quant_dots_fast`],
/// [`cuda_quant_dots_exact`]) defines on top of it `dot_row` (a weight row
/// against a tile of activation rows, per-lane partial sums), `QuantPass`
/// and `quant_pass_first` (the first pass of weights, loaded before the
/// kernel waits for its inputs), `dot_cols` (N weight rows against one
/// activation row, finished sums on every lane) and `MM_QUANT_BY_COLUMN`
/// (whether several activation rows of quantized weights go row by row
/// through `dot_cols`).
macro_rules! cuda_matmul_dots {
    () => {
        r#"
#define MM_STEPS 4
// Threads a block (32 * CUDA_WARPS_PER_BLOCK). The kernels declare at least
// one block an SM (`__launch_bounds__(MM_THREADS, 1)`): aiming at more,
// the compiler keeps registers low by issuing a pass's loads in groups,
// each behind the arithmetic on the one before, which puts several memory
// round trips on every warp's path instead of one.
#define MM_THREADS 128
#define MM_COLS 1

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
        case GGML_F32:
            if (vec_float) dot_float<GGML_F32, true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_float<GGML_F32, false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        case GGML_F16:
            if (vec_float) dot_float<GGML_F16, true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_float<GGML_F16, false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        case GGML_BF16:
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

// Float weights against one activation row, N rows one at a time: the
// finished dot products in `out` on every lane (with NORM, the norm folded
// into a scale of the finished sums).
template <bool NORM, int N>
__device__ __forceinline__ void dot_cols_float(unsigned int dtype, const unsigned char* const* rows,
                                               const float* __restrict__ x, const float* __restrict__ g,
                                               unsigned int k, float eps, unsigned int lane, bool x16,
                                               bool vec_float, float* out) {
    float sq = 0.f;
#pragma unroll
    for (int c = 0; c < N; ++c) {
        float other = 0.f;
        out[c] = 0.f;
        dot_row_float<NORM, 1>(dtype, rows[c], x, g, k, 1, lane, x16, vec_float, out + c, c == 0 ? &sq : &other);
    }
    dot_cols_finish<NORM, N>(out, sq, k, eps);
}

// The warps of a product over `n` columns: MM_COLS columns a warp for one
// activation row, one column a warp (with tiles of rows) for more.
__device__ __forceinline__ unsigned int product_warps(unsigned int rows, unsigned int n) {
    return rows == 1 ? (n + MM_COLS - 1) / MM_COLS : n;
}
"#
    };
}
pub(crate) use cuda_matmul_dots;

/// CUDA C: the quantized products of the default version (see
/// [`cuda_matmul_dots`] for what each version defines): weights dequantized
/// in registers and multiplied with f32 activations, the lanes' partial sums
/// meeting in a warp reduction; within the activation quantization error of
/// the CPU's results, not bit for bit. With `NORM`, each activation is multiplied by
/// the norm weight `g` as it is loaded and its square joins `sq`, so a
/// caller can scale the finished sums by `1 / rms` (RMSNorm folded into the
/// product: the scale is the same for every element of a row).
///
/// Lane layout: in Q8_0, Q4_0 and Q4_1 four lanes share a 32-weight block,
/// each taking 8 weights (Q4: bytes `4s..4s+4` of `qs`, i.e. weights
/// `4s..4s+4` and `16+4s..16+4s+4`), so a warp step covers 8 consecutive
/// blocks; float weights take 8 consecutive elements a lane, 256 a step.
/// Every element of a row is touched by exactly one lane. Each lane loads
/// the weights of `MM_STEPS` steps into registers before using any, so that
/// many loads are in flight (the products are bound by memory latency at
/// decode sizes). GGUF blocks are 18, 20 or 34 bytes, so quantized weights
/// are read as the widest words their alignment allows (32-bit for Q4_1,
/// 16-bit for Q4_0 and Q8_0), coalesced across the warp; float weights and
/// activations are read 16 bytes at a time when aligned (float rows also
/// need a length that is a multiple of 8), else one element at a time.
///
/// Per block: Q8_0 `d Σ q x`; Q4_0 `d (Σ n x - 8 Σ x)`; Q4_1 `d Σ n x + m Σ x`.
macro_rules! cuda_quant_dots_fast {
    () => {
        r#"
// Steps of 8 blocks a pass of dot_cols_quant (SmolLM2's longest rows, 1536, take one pass).
#define DOT_STEPS 6
// Several activation rows go through dot_row in tiles.
#define MM_QUANT_BY_COLUMN 0

// Q4_0 (18-byte blocks, HAS_MIN false) and Q4_1 (20-byte blocks, HAS_MIN true).
template <bool HAS_MIN, bool VEC, bool NORM, int TILE>
__device__ void dot_q4(const unsigned char* __restrict__ row, const float* __restrict__ x,
                       const float* __restrict__ g, unsigned int k, unsigned int rows, unsigned int lane,
                       float* acc, float* sq) {
    const unsigned int bytes = HAS_MIN ? 20 : 18;
    const unsigned int nb = k / 32, sub = lane & 3;
    for (unsigned int b0 = lane >> 2; b0 < nb; b0 += 8 * MM_STEPS) {
        // Scale words (d, or d and m) and 8 codes of each step.
        unsigned int head[MM_STEPS], codes[MM_STEPS];
#pragma unroll
        for (int u = 0; u < MM_STEPS; ++u) {
            const unsigned int b = b0 + 8 * u;
            head[u] = 0u;
            codes[u] = 0u;
            if (b < nb) {
                const unsigned char* blk = row + (size_t)b * bytes;
                if (HAS_MIN) {
                    head[u] = *reinterpret_cast<const unsigned int*>(blk);
                    codes[u] = *reinterpret_cast<const unsigned int*>(blk + 4 + 4 * sub);
                } else {
                    const unsigned short* h = reinterpret_cast<const unsigned short*>(blk);
                    head[u] = h[0];
                    codes[u] = (unsigned int)h[1 + 2 * sub] | ((unsigned int)h[2 + 2 * sub] << 16);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < MM_STEPS; ++u) {
            const unsigned int b = b0 + 8 * u;
            if (b >= nb) break;
            const float d = f16_to_f32((f16_bits)(head[u] & 0xffffu));
            const float m = HAS_MIN ? f16_to_f32((f16_bits)(head[u] >> 16)) : 0.f;
            float lo[4], hi[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo[i] = (float)((codes[u] >> (8 * i)) & 15u);
                hi[i] = (float)((codes[u] >> (8 * i + 4)) & 15u);
            }
            const unsigned int e = b * 32 + 4 * sub;
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                if (t < rows) {
                    const float* xb = x + (size_t)t * k + e;
                    float xl[4], xh[4];
                    load_x4<VEC, NORM>(xb, g + e, xl, sq[t]);
                    load_x4<VEC, NORM>(xb + 16, g + e + 16, xh, sq[t]);
                    float nx = 0.f, sx = 0.f;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        nx = fmaf(lo[i], xl[i], nx);
                        nx = fmaf(hi[i], xh[i], nx);
                        sx += xl[i] + xh[i];
                    }
                    acc[t] += HAS_MIN ? fmaf(d, nx, m * sx) : d * fmaf(-8.f, sx, nx);
                }
            }
        }
    }
}

// Q8_0: 34-byte blocks, `d` then 32 signed codes.
template <bool VEC, bool NORM, int TILE>
__device__ void dot_q8_0(const unsigned char* __restrict__ row, const float* __restrict__ x,
                         const float* __restrict__ g, unsigned int k, unsigned int rows, unsigned int lane,
                         float* acc, float* sq) {
    const unsigned int nb = k / 32, sub = lane & 3;
    for (unsigned int b0 = lane >> 2; b0 < nb; b0 += 8 * MM_STEPS) {
        // The scale and 8 codes (four 16-bit words) of each step.
        unsigned short head[MM_STEPS], codes[MM_STEPS][4];
#pragma unroll
        for (int u = 0; u < MM_STEPS; ++u) {
            const unsigned int b = b0 + 8 * u;
            head[u] = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) codes[u][i] = 0;
            if (b < nb) {
                const unsigned short* h = reinterpret_cast<const unsigned short*>(row + (size_t)b * 34);
                head[u] = h[0];
#pragma unroll
                for (int i = 0; i < 4; ++i) codes[u][i] = h[1 + 4 * sub + i];
            }
        }
#pragma unroll
        for (int u = 0; u < MM_STEPS; ++u) {
            const unsigned int b = b0 + 8 * u;
            if (b >= nb) break;
            const float d = f16_to_f32(head[u]);
            float wq[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                wq[2 * i] = (float)(signed char)(codes[u][i] & 0xffu);
                wq[2 * i + 1] = (float)(signed char)(codes[u][i] >> 8);
            }
            const unsigned int e = b * 32 + 8 * sub;
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                if (t < rows) {
                    const float* xb = x + (size_t)t * k + e;
                    float xv[8];
                    load_x4<VEC, NORM>(xb, g + e, xv, sq[t]);
                    load_x4<VEC, NORM>(xb + 4, g + e + 4, xv + 4, sq[t]);
                    float dot = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) dot = fmaf(wq[i], xv[i], dot);
                    acc[t] = fmaf(d, dot, acc[t]);
                }
            }
        }
    }
}

// A weight row of any type against a tile of activation rows (per-lane
// partial sums; see dot_row_float for `x16` and `vec_float`).
template <bool NORM, int TILE>
__device__ __forceinline__ void dot_row(unsigned int dtype, const unsigned char* __restrict__ row,
                                        const float* __restrict__ x, const float* __restrict__ g,
                                        unsigned int k, unsigned int rows, unsigned int lane, bool x16,
                                        bool vec_float, float* acc, float* sq) {
    switch (dtype) {
        case GGML_Q4_1:
            if (x16) dot_q4<true, true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_q4<true, false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        case GGML_Q4_0:
            if (x16) dot_q4<false, true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_q4<false, false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        case GGML_Q8_0:
            if (x16) dot_q8_0<true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_q8_0<false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        default:
            dot_row_float<NORM, TILE>(dtype, row, x, g, k, rows, lane, x16, vec_float, acc, sq);
            break;
    }
}

// The weight words of one pass of dot_cols_quant over N rows: each row's
// scale word and codes for every step (Q8_0: 8 codes in lo and hi; Q4: 8
// nibbles in lo), and with a norm folded in, the lane's norm weights of
// each step.
template <int N>
struct QuantPass {
    unsigned int head[N][DOT_STEPS], lo[N][DOT_STEPS], hi[N][DOT_STEPS];
    float g[DOT_STEPS][8];
};

// The first and the fifth of the 8 activations a lane takes in block `b`
// (Q8_0: 8 consecutive; Q4: 4 and the 4 that sit 16 further).
template <unsigned int TYPE>
__device__ __forceinline__ void quant_lane_elements(unsigned int b, unsigned int lane, unsigned int& e,
                                                    unsigned int& e2) {
    e = b * 32 + (TYPE == GGML_Q8_0 ? 8 * (lane & 3) : 4 * (lane & 3));
    e2 = e + (TYPE == GGML_Q8_0 ? 4 : 16);
}

// Loads the norm weights of the pass from block `base` on (the elements
// the lane's activations multiply).
template <unsigned int TYPE, bool VEC, int N>
__device__ __forceinline__ void norm_pass_load(const float* __restrict__ g, unsigned int nb, unsigned int base,
                                               unsigned int lane, QuantPass<N>& w) {
#pragma unroll
    for (int u = 0; u < DOT_STEPS; ++u) {
        if (base + 8 * u >= nb) break;
        const unsigned int b = base + 8 * u + (lane >> 2);
        unsigned int e, e2;
        quant_lane_elements<TYPE>(b < nb ? b : nb - 1, lane, e, e2);
        load4<VEC>(g + e, w.g[u]);
        load4<VEC>(g + e2, w.g[u] + 4);
    }
}

// Loads the weight words of the pass from block `base` on, from addresses
// clamped into the row (a lane past the row end reads its last block).
template <unsigned int TYPE, int N>
__device__ __forceinline__ void quant_pass_load(const unsigned char* const* rows, unsigned int nb, unsigned int base,
                                                unsigned int lane, QuantPass<N>& w) {
    const unsigned int bytes = TYPE == GGML_Q4_1 ? 20u : TYPE == GGML_Q4_0 ? 18u : 34u;
    const unsigned int sub = lane & 3;
#pragma unroll
    for (int u = 0; u < DOT_STEPS; ++u) {
        if (base + 8 * u >= nb) break;
        const unsigned int b = base + 8 * u + (lane >> 2);
        const unsigned int bc = b < nb ? b : nb - 1;
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const unsigned char* blk = rows[c] + (size_t)bc * bytes;
            const unsigned short* h = reinterpret_cast<const unsigned short*>(blk);
            w.hi[c][u] = 0u;
            if (TYPE == GGML_Q4_1) {
                w.head[c][u] = *reinterpret_cast<const unsigned int*>(blk);
                w.lo[c][u] = *reinterpret_cast<const unsigned int*>(blk + 4 + 4 * sub);
            } else if (TYPE == GGML_Q4_0) {
                w.head[c][u] = h[0];
                w.lo[c][u] = (unsigned int)h[1 + 2 * sub] | ((unsigned int)h[2 + 2 * sub] << 16);
            } else {
                w.head[c][u] = h[0];
                w.lo[c][u] = (unsigned int)h[1 + 4 * sub] | ((unsigned int)h[2 + 4 * sub] << 16);
                w.hi[c][u] = (unsigned int)h[3 + 4 * sub] | ((unsigned int)h[4 + 4 * sub] << 16);
            }
        }
    }
}

// The first pass's weight words of N rows of type `dtype`, and with a norm
// weight `g` (not null) its elements for that pass (nothing for float
// weights, which dot_cols reads itself). Weights are read-only, so a kernel
// calls this before encore_grid_wait(): the loads then overlap the previous
// kernel instead of following the wait.
template <unsigned int TYPE, int N>
__device__ __forceinline__ void quant_pass_first_of(const unsigned char* const* rows, const float* __restrict__ g,
                                                    unsigned int k, unsigned int lane, QuantPass<N>& w) {
    quant_pass_load<TYPE, N>(rows, k / 32, 0, lane, w);
    if (g == nullptr) return;
    if (((size_t)g & 15u) == 0) norm_pass_load<TYPE, true, N>(g, k / 32, 0, lane, w);
    else norm_pass_load<TYPE, false, N>(g, k / 32, 0, lane, w);
}

template <int N>
__device__ __forceinline__ void quant_pass_first(unsigned int dtype, const unsigned char* const* rows,
                                                 const float* __restrict__ g, unsigned int k, unsigned int lane,
                                                 QuantPass<N>& w) {
    switch (dtype) {
        case GGML_Q4_1: quant_pass_first_of<GGML_Q4_1, N>(rows, g, k, lane, w); return;
        case GGML_Q4_0: quant_pass_first_of<GGML_Q4_0, N>(rows, g, k, lane, w); return;
        case GGML_Q8_0: quant_pass_first_of<GGML_Q8_0, N>(rows, g, k, lane, w); return;
        default: return;
    }
}

// Q4_0, Q4_1 and Q8_0: per-lane partial dot products of N weight rows
// (`rows[c]`) with one activation row, whose elements each lane loads once
// for all N rows (and, with NORM, multiplies by `g` and squares into `sq`).
// Lane layout and arithmetic as in dot_q4 and dot_q8_0.
//
// A pass covers DOT_STEPS steps of 8 blocks. Every load of a pass (weights,
// activations, norm weights) is issued before any of them is used, from
// addresses clamped into the row, so that one memory round trip serves the
// whole pass: a load behind a branch, or behind arithmetic on an earlier
// load, would wait for that load first. A lane whose block lies past the
// row end (the last step of a row whose blocks are not a multiple of 8)
// loads the last block again and adds nothing. Whether a step exists at all
// is the same for every lane, and a constant once the kernel is specialized
// for its shape, so the loops unroll to exactly the steps a row has. The
// first pass's weights come from `first` when the caller loaded them
// already (quant_pass_first), else from memory here.
template <unsigned int TYPE, bool VEC, bool NORM, int N>
__device__ __forceinline__ void dot_cols_quant(const unsigned char* const* rows, const float* __restrict__ x,
                                               const float* __restrict__ g, unsigned int k, unsigned int lane,
                                               float* acc, float& sq, const QuantPass<N>* first) {
    const unsigned int nb = k / 32;
    for (unsigned int base = 0; base < nb; base += 8 * DOT_STEPS) {
        QuantPass<N> w;
        if (first != nullptr && base == 0) {
            w = *first;
        } else {
            quant_pass_load<TYPE, N>(rows, nb, base, lane, w);
            if (NORM) norm_pass_load<TYPE, VEC, N>(g, nb, base, lane, w);
        }
        // The lane's 8 activations of each step.
        float xv[DOT_STEPS][8];
        bool live[DOT_STEPS];
#pragma unroll
        for (int u = 0; u < DOT_STEPS; ++u) {
            if (base + 8 * u >= nb) break;
            const unsigned int b = base + 8 * u + (lane >> 2);
            live[u] = b < nb;
            unsigned int e, e2;
            quant_lane_elements<TYPE>(live[u] ? b : nb - 1, lane, e, e2);
            load4<VEC>(x + e, xv[u]);
            load4<VEC>(x + e2, xv[u] + 4);
        }
#pragma unroll
        for (int u = 0; u < DOT_STEPS; ++u) {
            if (base + 8 * u >= nb) break;
            // A block past the row end adds nothing (a select, not a branch:
            // the compiler would move this step's loads behind a branch).
#pragma unroll
            for (int i = 0; i < 8; ++i) xv[u][i] = live[u] ? xv[u][i] : 0.f;
            if (NORM) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    sq = fmaf(xv[u][i], xv[u][i], sq);
                    xv[u][i] *= w.g[u][i];
                }
            }
            float sx = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) sx += xv[u][i] + xv[u][4 + i];
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const float d = f16_to_f32((f16_bits)(w.head[c][u] & 0xffffu));
                if (TYPE == GGML_Q8_0) {
                    float dot = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const unsigned int word = i < 4 ? w.lo[c][u] : w.hi[c][u];
                        dot = fmaf((float)(signed char)((word >> (8 * (i & 3))) & 0xffu), xv[u][i], dot);
                    }
                    acc[c] = live[u] ? fmaf(d, dot, acc[c]) : acc[c];
                } else {
                    float nx = 0.f;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        nx = fmaf((float)((w.lo[c][u] >> (8 * i)) & 15u), xv[u][i], nx);
                        nx = fmaf((float)((w.lo[c][u] >> (8 * i + 4)) & 15u), xv[u][4 + i], nx);
                    }
                    const float part = TYPE == GGML_Q4_1 ? fmaf(d, nx, f16_to_f32((f16_bits)(w.head[c][u] >> 16)) * sx)
                                                         : d * fmaf(-8.f, sx, nx);
                    acc[c] = live[u] ? acc[c] + part : acc[c];
                }
            }
        }
    }
}

// N weight rows of type `dtype` against one activation row (decode), with
// NORM the norm folded in: the finished dot products in `out` on every
// lane. The quantized types load the activations once for all rows.
template <bool NORM, int N>
__device__ __forceinline__ void dot_cols(unsigned int dtype, const unsigned char* const* rows,
                                         const float* __restrict__ x, const float* __restrict__ g, unsigned int k,
                                         float eps, unsigned int lane, bool x16, bool vec_float, float* out,
                                         const QuantPass<N>* first) {
    float sq = 0.f;
#pragma unroll
    for (int c = 0; c < N; ++c) out[c] = 0.f;
    switch (dtype) {
        case GGML_Q4_1:
            if (x16) dot_cols_quant<GGML_Q4_1, true, NORM, N>(rows, x, g, k, lane, out, sq, first);
            else dot_cols_quant<GGML_Q4_1, false, NORM, N>(rows, x, g, k, lane, out, sq, first);
            break;
        case GGML_Q4_0:
            if (x16) dot_cols_quant<GGML_Q4_0, true, NORM, N>(rows, x, g, k, lane, out, sq, first);
            else dot_cols_quant<GGML_Q4_0, false, NORM, N>(rows, x, g, k, lane, out, sq, first);
            break;
        case GGML_Q8_0:
            if (x16) dot_cols_quant<GGML_Q8_0, true, NORM, N>(rows, x, g, k, lane, out, sq, first);
            else dot_cols_quant<GGML_Q8_0, false, NORM, N>(rows, x, g, k, lane, out, sq, first);
            break;
        default:
            dot_cols_float<NORM, N>(dtype, rows, x, g, k, eps, lane, x16, vec_float, out);
            return;
    }
    dot_cols_finish<NORM, N>(out, sq, k, eps);
}
"#
    };
}
pub(crate) use cuda_quant_dots_fast;

/// CUDA C: the quantized products of the exact version (see
/// [`cuda_matmul_dots`] for what each version defines), which give the
/// CPU's results bit for bit: `dot_cols_quant` quantizes the activations to
/// 8-bit blocks exactly as `cpu::quantize_row_q8` does and adds the blocks'
/// integer products in the order of the CPU's AVX2 code (see there).
/// Greedy decoding on a small quantized model is chaotic: one ulp of
/// difference in any product flips some 8-bit quantization step downstream
/// and, within a few tokens, the text; bit-identical products are part of
/// what keeps CUDA's text the CPU's (and so llama.cpp's). They cost time:
/// SmolLM2's decode step on an H200 took 512 µs against the default's 324
/// (BENCHMARKS.md, "Bit-identical quantized products on CUDA").
macro_rules! cuda_quant_dots_exact {
    () => {
        r#"
// Blocks in each of the four chunks of a pass of dot_cols_quant
// (SmolLM2's longest rows, 1536 values or 48 blocks, take one pass). The
// generic code, compiled for no shape in particular, takes shorter passes:
// its loops unroll for every chunk length up to QCHUNK, several times over.
#ifdef ENCORE_VALUE_WORDS
#define QCHUNK 12
#else
#define QCHUNK 4
#endif
// Several activation rows of quantized weights go row by row through dot_cols.
#define MM_QUANT_BY_COLUMN 1

// Only float weights come here (quantized weights go through dot_cols).
template <bool NORM, int TILE>
__device__ __forceinline__ void dot_row(unsigned int dtype, const unsigned char* __restrict__ row,
                                        const float* __restrict__ x, const float* __restrict__ g,
                                        unsigned int k, unsigned int rows, unsigned int lane, bool x16,
                                        bool vec_float, float* acc, float* sq) {
    dot_row_float<NORM, TILE>(dtype, row, x, g, k, rows, lane, x16, vec_float, acc, sq);
}

// The signed 4-byte dot product a · b + c.
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// RMSNorm's scale from the row's sum of squares (in f64), as the CPU's
// `rms_norm_row` computes it: `1 / sqrt(f32(sum / k) + eps)`.
__device__ __forceinline__ float rms_scale(double sum, unsigned int k, float eps) {
    const float mean = (float)(sum / (double)(k > 0 ? k : 1));
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
}

// Quantizes the lane's four activations of a 32-value block as the CPU's
// `quantize_row_q8` does (the block's eight lanes, `lane & 7`, share its
// values): `q` the four codes as signed bytes, `dx` the scale and `sx` the
// scaled code sum, both rounded through f16.
__device__ __forceinline__ void quantize4(const float* v, int& q, float& dx, float& sx) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float id = amax != 0.f ? __fdiv_rn(127.f, amax) : 0.f;
    int sum = 0;
    q = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = __float2int_rn(__fmul_rn(v[i], id));
        sum += c;
        q |= (c & 0xff) << (8 * i);
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float d = __fdiv_rn(amax, 127.f);
    dx = round_f16(d);
    sx = round_f16(__fmul_rn(d, (float)sum));
}

// The weight words of one pass of dot_cols_quant over N rows: for each
// block of the lane's chunk, each row's scale word (Q4_1: d and m) and the
// lane's four code bytes (Q4: the bytes whose low or high nibbles are its
// weights), and with a norm folded in, the lane's norm weights.
template <int N>
struct QuantPass {
    unsigned int head[N][QCHUNK], code[N][QCHUNK];
    float g[QCHUNK][4];
};

// Blocks in each of the four chunks of the pass that starts at block `base`.
__device__ __forceinline__ unsigned int quant_chunk(unsigned int nb, unsigned int base) {
    return min((unsigned int)QCHUNK, (nb - base + 3) / 4);
}

// Block `i` of the lane's chunk, clamped into the row; `live` says whether it lies in it.
__device__ __forceinline__ unsigned int quant_block(unsigned int nb, unsigned int base, unsigned int chunk,
                                                    unsigned int lane, int i, bool& live) {
    const unsigned int b = base + (lane >> 3) * chunk + i;
    live = b < nb;
    return live ? b : nb - 1;
}

// Loads the weight words of the pass from block `base` on.
template <unsigned int TYPE, int N>
__device__ __forceinline__ void quant_pass_load(const unsigned char* const* rows, unsigned int nb, unsigned int base,
                                                unsigned int lane, QuantPass<N>& w) {
    const unsigned int chunk = quant_chunk(nb, base), l = lane & 7u;
#pragma unroll
    for (int i = 0; i < QCHUNK; ++i) {
        if ((unsigned int)i >= chunk) break;
        bool live;
        const unsigned int b = quant_block(nb, base, chunk, lane, i, live);
#pragma unroll
        for (int c = 0; c < N; ++c) {
            if (TYPE == GGML_Q4_1) {
                const unsigned char* blk = rows[c] + (size_t)b * 20;
                w.head[c][i] = *reinterpret_cast<const unsigned int*>(blk);
                w.code[c][i] = *reinterpret_cast<const unsigned int*>(blk + 4 + 4 * (l & 3));
            } else if (TYPE == GGML_Q4_0) {
                const unsigned short* h = reinterpret_cast<const unsigned short*>(rows[c] + (size_t)b * 18);
                w.head[c][i] = h[0];
                w.code[c][i] = (unsigned int)h[1 + 2 * (l & 3)] | ((unsigned int)h[2 + 2 * (l & 3)] << 16);
            } else {
                const unsigned short* h = reinterpret_cast<const unsigned short*>(rows[c] + (size_t)b * 34);
                w.head[c][i] = h[0];
                w.code[c][i] = (unsigned int)h[1 + 2 * l] | ((unsigned int)h[2 + 2 * l] << 16);
            }
        }
    }
}

// Loads the lane's activations of the pass from block `base` on, all of
// them before any is used (one branch on the alignment around the whole
// pass: a branch around each load would make each wait for the one before).
template <bool VEC>
__device__ __forceinline__ void quant_pass_x(const float* __restrict__ x, unsigned int nb, unsigned int base,
                                             unsigned int lane, float (*xv)[4], bool* live) {
    const unsigned int chunk = quant_chunk(nb, base);
#pragma unroll
    for (int i = 0; i < QCHUNK; ++i) {
        if ((unsigned int)i >= chunk) break;
        const unsigned int b = quant_block(nb, base, chunk, lane, i, live[i]);
        load4<VEC>(x + (size_t)b * 32 + 4 * (lane & 7u), xv[i]);
    }
}

// Loads the lane's norm weights of the pass from block `base` on.
template <bool VEC, int N>
__device__ __forceinline__ void norm_pass_load(const float* __restrict__ g, unsigned int nb, unsigned int base,
                                               unsigned int lane, QuantPass<N>& w) {
    const unsigned int chunk = quant_chunk(nb, base);
#pragma unroll
    for (int i = 0; i < QCHUNK; ++i) {
        if ((unsigned int)i >= chunk) break;
        bool live;
        const unsigned int b = quant_block(nb, base, chunk, lane, i, live);
        load4<VEC>(g + (size_t)b * 32 + 4 * (lane & 7u), w.g[i]);
    }
}

// The first pass's weight words of N rows of type `dtype`, and with a norm
// weight `g` (not null) its elements for that pass (nothing for float
// weights, which dot_cols reads itself). Weights are read-only, so a kernel
// calls this before encore_grid_wait(): the loads then overlap the previous
// kernel instead of following the wait.
template <unsigned int TYPE, int N>
__device__ __forceinline__ void quant_pass_first_of(const unsigned char* const* rows, const float* __restrict__ g,
                                                    unsigned int k, unsigned int lane, QuantPass<N>& w) {
    quant_pass_load<TYPE, N>(rows, k / 32, 0, lane, w);
    if (g == nullptr) return;
    if (((size_t)g & 15u) == 0) norm_pass_load<true, N>(g, k / 32, 0, lane, w);
    else norm_pass_load<false, N>(g, k / 32, 0, lane, w);
}

template <int N>
__device__ __forceinline__ void quant_pass_first(unsigned int dtype, const unsigned char* const* rows,
                                                 const float* __restrict__ g, unsigned int k, unsigned int lane,
                                                 QuantPass<N>& w) {
    switch (dtype) {
        case GGML_Q4_1: quant_pass_first_of<GGML_Q4_1, N>(rows, g, k, lane, w); return;
        case GGML_Q4_0: quant_pass_first_of<GGML_Q4_0, N>(rows, g, k, lane, w); return;
        case GGML_Q8_0: quant_pass_first_of<GGML_Q8_0, N>(rows, g, k, lane, w); return;
        default: return;
    }
}

// Q4_0, Q4_1 and Q8_0: the dot products of N weight rows (`rows[c]`) with
// one activation row, bit for bit as the CPU's AVX2 code computes them
// (`cpu::dot`): with NORM the row is first normalized as `rms_norm_row`
// does (`x * scale * g`); it is quantized to 8-bit blocks as
// `quantize_row_q8` does; per block of 32 the codes' products are summed in
// integers in eight groups of four consecutive values (the CPU's eight
// vector lanes), each group's sum goes into its own f32 accumulator as
// `acc = fma(d_w * d_x, sum, acc)`, block after block in order, and the
// offset terms (`m_w * s_x`, or `-8 d_w * s_x` for Q4_0) into one more
// running sum; the result is the eight accumulators added pairwise as the
// CPU's horizontal sum adds them, plus the offsets. Every lane of the warp
// gets the results in `out`.
//
// Lane layout: lane `l + 8 p` holds the values of group `l` of every block
// of chunk `p`, four chunks of up to QCHUNK consecutive blocks a pass (a
// pass covers SmolLM2's longest rows, 1536 values, at once). All loads of a
// pass are issued before any is used, from addresses clamped into the row
// (a block past the row end repeats the last one and adds nothing), and the
// arithmetic that needs no order (quantization, integer sums, scales) runs
// on every lane at once; only the accumulation is sequential: chunk after
// chunk, each continuing from the sums the one before handed it. The first
// pass's weights come from `first` when the caller loaded them already
// (quant_pass_first), else from memory here.
template <unsigned int TYPE, bool NORM, int N>
__device__ __forceinline__ void dot_cols_quant(const unsigned char* const* rows, const float* __restrict__ x,
                                               const float* __restrict__ g, unsigned int k, float eps,
                                               unsigned int lane, bool x16, float* out, const QuantPass<N>* first) {
    const unsigned int nb = k / 32, l = lane & 7u, part = lane >> 3;
    float scale = 1.f;
    if (NORM && nb > 4 * QCHUNK) {
        // The norm needs the whole row before the first pass: sum it apart.
        double sq = 0.0;
        for (unsigned int i = lane; i < k; i += 32) sq += (double)__fmul_rn(x[i], x[i]);
        scale = rms_scale(warp_sum_f64(sq), k, eps);
    }
    float acc[N], off[N];
#pragma unroll
    for (int c = 0; c < N; ++c) acc[c] = off[c] = 0.f;
    for (unsigned int base = 0; base < nb; base += 4 * QCHUNK) {
        const unsigned int chunk = quant_chunk(nb, base);
        QuantPass<N> w;
        if (first != nullptr && base == 0) {
            w = *first;
        } else {
            quant_pass_load<TYPE, N>(rows, nb, base, lane, w);
            if (NORM && ((size_t)g & 15u) == 0) norm_pass_load<true, N>(g, nb, base, lane, w);
            else if (NORM) norm_pass_load<false, N>(g, nb, base, lane, w);
        }
        float xv[QCHUNK][4];
        bool live[QCHUNK];
        if (x16) quant_pass_x<true>(x, nb, base, lane, xv, live);
        else quant_pass_x<false>(x, nb, base, lane, xv, live);
        if (NORM && nb <= 4 * QCHUNK) {
            double sq = 0.0;
#pragma unroll
            for (int i = 0; i < QCHUNK; ++i) {
                if ((unsigned int)i >= chunk) break;
#pragma unroll
                for (int e = 0; e < 4; ++e) sq += live[i] ? (double)__fmul_rn(xv[i][e], xv[i][e]) : 0.0;
            }
            scale = rms_scale(warp_sum_f64(sq), k, eps);
        }
        // Each block's integer sums, scales and offset terms, for every row.
        float sums[N][QCHUNK], dd[N][QCHUNK], om[N][QCHUNK];
#pragma unroll
        for (int i = 0; i < QCHUNK; ++i) {
            if ((unsigned int)i >= chunk) break;
            if (NORM) {
#pragma unroll
                for (int e = 0; e < 4; ++e) xv[i][e] = __fmul_rn(__fmul_rn(xv[i][e], scale), w.g[i][e]);
            }
            int q;
            float dx, sx;
            quantize4(xv[i], q, dx, sx);
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const float d = f16_to_f32((f16_bits)(w.head[c][i] & 0xffffu));
                unsigned int code = w.code[c][i];
                if (TYPE != GGML_Q8_0) code = (l >= 4 ? code >> 4 : code) & 0x0f0f0f0fu;
                sums[c][i] = (float)dp4a((int)code, q, 0);
                dd[c][i] = __fmul_rn(d, dx);
                om[c][i] = TYPE == GGML_Q4_1 ? __fmul_rn(f16_to_f32((f16_bits)(w.head[c][i] >> 16)), sx)
                         : TYPE == GGML_Q4_0 ? __fmul_rn(__fmul_rn(-8.f, d), sx)
                                             : 0.f;
            }
        }
        // The accumulation, chunk after chunk; after the last, every lane
        // takes the pass's sums of its group.
#pragma unroll 1
        for (unsigned int p = 0; p < 4; ++p) {
            if (part == p) {
#pragma unroll
                for (int i = 0; i < QCHUNK; ++i) {
                    if ((unsigned int)i >= chunk) break;
#pragma unroll
                    for (int c = 0; c < N; ++c) {
                        acc[c] = live[i] ? fmaf(dd[c][i], sums[c][i], acc[c]) : acc[c];
                        off[c] = live[i] ? __fadd_rn(off[c], om[c][i]) : off[c];
                    }
                }
            }
            const unsigned int from = p < 3 ? (lane + 24) & 31u : 24 + l;
            const bool take = p < 3 ? part == p + 1 : true;
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const float a = __shfl_sync(0xffffffffu, acc[c], from), o = __shfl_sync(0xffffffffu, off[c], from);
                acc[c] = take ? a : acc[c];
                off[c] = take ? o : off[c];
            }
        }
    }
    // The groups' sums added as the CPU's horizontal sum adds its lanes:
    // ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)), then the offsets.
#pragma unroll
    for (int c = 0; c < N; ++c) {
        float v = __fadd_rn(acc[c], __shfl_xor_sync(0xffffffffu, acc[c], 4));
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
        out[c] = __fadd_rn(__shfl_sync(0xffffffffu, v, 0), off[c]);
    }
}

// N weight rows of type `dtype` against one activation row (decode), with
// NORM the row normalized by the norm weights `g` first: the finished dot
// products in `out` on every lane. The quantized types load the activations
// once for all rows.
template <bool NORM, int N>
__device__ __forceinline__ void dot_cols(unsigned int dtype, const unsigned char* const* rows,
                                         const float* __restrict__ x, const float* __restrict__ g, unsigned int k,
                                         float eps, unsigned int lane, bool x16, bool vec_float, float* out,
                                         const QuantPass<N>* first) {
    switch (dtype) {
        case GGML_Q4_1: dot_cols_quant<GGML_Q4_1, NORM, N>(rows, x, g, k, eps, lane, x16, out, first); return;
        case GGML_Q4_0: dot_cols_quant<GGML_Q4_0, NORM, N>(rows, x, g, k, eps, lane, x16, out, first); return;
        case GGML_Q8_0: dot_cols_quant<GGML_Q8_0, NORM, N>(rows, x, g, k, eps, lane, x16, out, first); return;
        default: dot_cols_float<NORM, N>(dtype, rows, x, g, k, eps, lane, x16, vec_float, out); return;
    }
}
"#
    };
}
pub(crate) use cuda_quant_dots_exact;

/// Warps per CUDA block of the decode-shaped products (SmolLM2 on an
/// H200, device µs per token with 2, 4 and 8 warps a block: 475.7, 455.1,
/// 459.6).
pub const CUDA_WARPS_PER_BLOCK: u32 = 4;

/// Output columns a warp computes for one activation row (`MM_COLS` in
/// the CUDA source). More columns a warp load the activations fewer times
/// and make each product faster in a chain of identical products, but the
/// decode step slower: SmolLM2 on an H200, device µs per token with 1, 2
/// and 4 columns a warp: 454.8, 569.8, 730.8 (fewer, longer warps).
pub const CUDA_COLUMNS_PER_WARP: u32 = 1;

/// The warps of a product of `rows` activation rows and `n` output columns
/// (`product_warps` in the CUDA source).
pub fn cuda_warps(rows: u32, n: u32) -> u32 {
    if rows == 1 {
        n.div_ceil(CUDA_COLUMNS_PER_WARP)
    } else {
        n
    }
}

/// The CUDA launch of a product run by `warps` warps.
pub fn cuda_launch(warps: u32) -> encore::Launch {
    encore::Launch::new(
        warps.div_ceil(CUDA_WARPS_PER_BLOCK).max(1),
        32 * CUDA_WARPS_PER_BLOCK,
    )
}

thread_local! {
    static SCRATCH: std::cell::Cell<crate::cpu::QuantizedActivations> =
        std::cell::Cell::new(crate::cpu::QuantizedActivations::new());
}

/// The CPU body of a matrix product (shared with [`super::gemm`], which
/// computes the same product on CUDA with another tiling). Inlined into each
/// kernel's closure: passed as a plain function pointer it measured 10–15%
/// slower on the 2-core CI machine kind (prefill 405–455 against 487–492
/// tok/s, same commit otherwise).
#[inline(always)]
pub(crate) fn cpu_matmul(a: &encore::CpuArgs<'_>) -> Result<(), String> {
    let s: MatmulShape = a.scalar(3)?;
    let dtype = DType::from_ggml_id(s.dtype).ok_or("unsupported weight type")?;
    let (rows, n, k) = (s.rows as usize, s.n as usize, s.k as usize);
    let w_bytes = dtype
        .bytes_for(k)
        .and_then(|b| b.checked_mul(n))
        .ok_or("row length not a whole number of blocks")?;
    let (w, x, y) = (a.read::<u8>(0)?, a.read::<f32>(1)?, a.write::<f32>(2)?);
    super::need("w", w, w_bytes)?;
    super::need("x", x, rows * k)?;
    super::need("y", y, rows * n)?;
    // Quantized activations are staged in a per-thread buffer that grows
    // once and is reused by later products on that thread.
    let mut scratch = SCRATCH.with(|s| s.take());
    let result = crate::cpu::matmul_with_scratch(
        dtype,
        &w[..w_bytes],
        n,
        k,
        &x[..rows * k],
        &mut y[..rows * n],
        &mut scratch,
    );
    SCRATCH.with(|s| s.replace(scratch));
    result.map_err(|e| e.to_string())
}

/// The `matmul` kernel; with `exact`, its CUDA code gives the CPU's results
/// bit for bit (see the module docs).
// The closure inlines `cpu_matmul` (see there for why).
#[allow(clippy::redundant_closure)]
pub fn def(exact: bool) -> KernelDef {
    KernelDef::new("matmul")
        .op("matmul")
        .cpu("matmul v1", |a| cpu_matmul(a))
        .cuda(
            if exact {
                MATMUL_CUDA_EXACT
            } else {
                MATMUL_CUDA
            },
            "matmul",
        )
        .programmatic()
        .specializable()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launch geometry and the kernels agree on the columns a warp and the threads a block.
    #[test]
    fn rust_and_cuda_agree_on_the_launch_shape() {
        let define = format!("#define MM_COLS {CUDA_COLUMNS_PER_WARP}\n");
        let threads = format!("#define MM_THREADS {}\n", 32 * CUDA_WARPS_PER_BLOCK);
        for source in [MATMUL_CUDA, MATMUL_CUDA_EXACT] {
            assert!(source.contains(&define));
            assert!(source.contains(&threads));
        }
        assert_eq!(cuda_launch(9).block[0], 32 * CUDA_WARPS_PER_BLOCK);
        assert_eq!(cuda_warps(1, 9), 9u32.div_ceil(CUDA_COLUMNS_PER_WARP));
        assert_eq!(cuda_warps(3, 9), 9);
        assert_eq!(cuda_launch(9).grid[0], 9u32.div_ceil(CUDA_WARPS_PER_BLOCK));
    }
}
