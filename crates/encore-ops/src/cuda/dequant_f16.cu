// `dequant_f16`: rows n0..n0 + n of a weight matrix decoded to f16 for the
// long prompts' products (kernels/gemm_dense.rs): `w16[j, i] =
// f16(w[n0 + j, i])`, each weight as the CPU dequantizes it to f32, then
// rounded to the nearest f16.
//
// Arguments: `w: dtype[.., k]` (read, raw GGUF blocks), `w16: f16[n, k]`
// (write), `DequantShape s` (value). A thread eight weights at a time,
// in a grid-stride loop. F16 and the quantized types only (BF16 and F32
// weights may lie beyond f16's range); `k` a multiple of 8.

#include "wide_rows.cuh"
#include "mma.cuh"

struct DequantShape {
    unsigned int n0;
    unsigned int n;
    unsigned int k;
    unsigned int dtype;
};

extern "C" __global__ void dequant_f16(const unsigned char* __restrict__ w, uint4* __restrict__ w16,
                                       DequantShape s) {
    encore_grid_wait();
    const unsigned long long row_bytes = ggml_row_bytes(s.dtype, s.k);
    // 32-bit indices: a slice holds far fewer than 2^32 groups of eight.
    const unsigned int per_row = s.k / 8, total = s.n * per_row;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const unsigned int j = i / per_row, e = 8 * (i - j * per_row);
        float v[8];
        weights8(s.dtype, w + (size_t)(s.n0 + j) * row_bytes, e, v);
        unsigned int p[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) p[t] = pack_f16(v[2 * t], v[2 * t + 1]);
        w16[i] = make_uint4(p[0], p[1], p[2], p[3]);
    }
}
