// What the tensor-core products (`gemm`, and `gemm_f16` through
// `matmul_wide_rows`) share for the activation rows they cannot round to
// f16: eight weights of any f16-range type decoded to f32 as the CPU
// dequantizes them (`weights8`, also what `dequant_f16` rounds to f16),
// and the f32 products of such rows (`wide_rows_f32`).

#include "quant_codes.cuh"
#include "matmul_shape.cuh"

// Eight weights of a row from element `e` on (a multiple of 8), as the CPU
// dequantizes them: F16, the blocks of 32 and every type of quant_codes.cuh.
__device__ __forceinline__ void weights8(unsigned int dtype, const unsigned char* __restrict__ row, unsigned int e,
                                         float* w) {
    if (dtype == GGML_Q4_0 || dtype == GGML_Q4_1 || dtype == GGML_Q8_0) {
        const unsigned int bytes = dtype == GGML_Q4_0 ? 18 : dtype == GGML_Q4_1 ? 20 : 34;
        const unsigned char* blk = row + (size_t)(e / 32) * bytes;
        const float d = f16_at(blk), m = dtype == GGML_Q4_1 ? f16_at(blk + 2) : 0.f;
        const unsigned char* q = blk + (dtype == GGML_Q4_1 ? 4 : 2);
        for (int t = 0; t < 8; ++t) {
            const unsigned int j = e % 32 + t;
            if (dtype == GGML_Q8_0) {
                w[t] = d * (float)(signed char)q[j];
            } else {
                const int code = j < 16 ? q[j] & 15 : q[j - 16] >> 4;
                w[t] = dtype == GGML_Q4_0 ? d * (float)(code - 8) : fmaf(d, (float)code, m);
            }
        }
    } else if (dtype == GGML_F16) {
        const f16_bits* p = reinterpret_cast<const f16_bits*>(row);
        for (int t = 0; t < 8; ++t) w[t] = f16_to_f32(p[e + t]);
    } else {
        dequant8_any(dtype, row, e, w);
    }
}

// The outputs of the activation rows m0 + r (r < `count`) marked in
// `wide[r]`, columns n0..n0 + `cols`, each a plain f32 dot product of the
// dequantized weights with the row, stored over what the tensor cores
// left there: a warp a column at a time, its lanes eight positions each.
// Rare and small, so not on tensor cores. Rows of F16 and quantized
// weights only, which are whole blocks of 32, or for F16 a multiple of 8
// and a tail taken one at a time.
__device__ __forceinline__ void wide_rows_f32(const unsigned int* wide, unsigned int count, unsigned int cols,
                                              const unsigned char* __restrict__ w, const float* __restrict__ x,
                                              float* __restrict__ y, MatmulShape s, unsigned long long row_bytes,
                                              unsigned int m0, unsigned int n0) {
    const unsigned int lane = threadIdx.x & 31u, warps = blockDim.x / 32;
    for (unsigned int r = 0; r < count && m0 + r < s.rows; ++r) {
        if (!wide[r]) continue;
        const float* xr = x + (size_t)(m0 + r) * s.k;
        for (unsigned int c = threadIdx.x / 32; c < cols && n0 + c < s.n; c += warps) {
            const unsigned char* wr = w + (size_t)(n0 + c) * row_bytes;
            float sum = 0.f;
            const unsigned int whole = s.k - s.k % 8;
            for (unsigned int e = 8 * lane; e < whole; e += 256) {
                float wv[8];
                weights8(s.dtype, wr, e, wv);
#pragma unroll
                for (int t = 0; t < 8; ++t) sum = fmaf(wv[t], xr[e + t], sum);
            }
            if (s.dtype == GGML_F16 && whole + lane < s.k)
                sum = fmaf(f16_to_f32(reinterpret_cast<const f16_bits*>(wr)[whole + lane]), xr[whole + lane], sum);
            sum = warp_sum(sum);
            if (lane == 0) y[(size_t)(m0 + r) * s.n + n0 + c] = sum;
        }
    }
}
