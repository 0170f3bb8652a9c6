// `embed`: `y[r, :] = dequantize(table[tokens[r], :])`.
//
// Arguments: `table: dtype[vocab, dim]` (read, GGUF blocks), `tokens:
// u32[rows]` (read), `y: f32[rows, dim]` (write), `EmbedShape s` (value:
// rows, dim, vocab, the table's ggml type id).
//
// One block per token, threads over the row's elements; element `i` of a
// quantized row lives in block `i / 32` at index `i % 32` (Q4: low nibble of
// byte `i % 16` for the first 16, high nibble for the rest); the types of
// quant_codes.cuh go eight elements a thread. Values are
// formed as on the CPU, without fused multiply-adds, so they match to the
// bit. An out-of-range token id writes zeros (the CPU reports it; the
// session checks ids before they reach the device).

#include "gguf.cuh"
#include "quant_codes.cuh"

struct EmbedShape {
    unsigned int rows;
    unsigned int dim;
    unsigned int vocab;
    unsigned int dtype;
};

__device__ __forceinline__ float embed_element(const unsigned char* __restrict__ row, unsigned int dtype,
                                               unsigned int i) {
    const unsigned int j = i % 32;
    switch (dtype) {
        case GGML_F32: return reinterpret_cast<const float*>(row)[i];
        case GGML_F16: return f16_to_f32(reinterpret_cast<const f16_bits*>(row)[i]);
        case GGML_BF16: return bf16_to_f32(reinterpret_cast<const bf16_bits*>(row)[i]);
        case GGML_Q8_0: {
            const unsigned char* b = row + (size_t)(i / 32) * 34;
            const float d = f16_to_f32((f16_bits)(b[0] | (b[1] << 8)));
            return __fmul_rn(d, (float)(signed char)b[2 + j]);
        }
        case GGML_Q4_0: {
            const unsigned char* b = row + (size_t)(i / 32) * 18;
            const float d = f16_to_f32((f16_bits)(b[0] | (b[1] << 8)));
            const unsigned int q = b[2 + (j & 15u)];
            return __fmul_rn(d, (float)(j < 16 ? q & 15u : q >> 4) - 8.0f);
        }
        case GGML_Q4_1: {
            const unsigned char* b = row + (size_t)(i / 32) * 20;
            const float d = f16_to_f32((f16_bits)(b[0] | (b[1] << 8)));
            const float m = f16_to_f32((f16_bits)(b[2] | (b[3] << 8)));
            const unsigned int q = b[4 + (j & 15u)];
            return __fadd_rn(__fmul_rn(d, (float)(j < 16 ? q & 15u : q >> 4)), m);
        }
        default: return 0.f;
    }
}

extern "C" __global__ void embed(const unsigned char* __restrict__ table, const unsigned int* __restrict__ tokens,
                                 float* __restrict__ y, EmbedShape s) {
    encore_fix_value(s);
    encore_grid_wait();
    const unsigned int r = blockIdx.x;
    if (r >= s.rows) return;
    const unsigned int t = tokens[r];
    float* out = y + (size_t)r * s.dim;
    if (t >= s.vocab) {
        for (unsigned int i = threadIdx.x; i < s.dim; i += blockDim.x) out[i] = 0.f;
        return;
    }
    const unsigned char* row = table + (size_t)t * ggml_row_bytes(s.dtype, s.dim);
    if (ggml_coded(s.dtype)) {
        for (unsigned int i = 8 * threadIdx.x; i < s.dim; i += 8 * blockDim.x) {
            float w[8];
            dequant8_any(s.dtype, row, i, w);
#pragma unroll
            for (int e = 0; e < 8; ++e) out[i + e] = w[e];
        }
        return;
    }
    for (unsigned int i = threadIdx.x; i < s.dim; i += blockDim.x) out[i] = embed_element(row, s.dtype, i);
}
