// `to_f16_rows`: the activations of a long prompt's product rounded to f16
// once (kernels/gemm_dense.rs), `x16[r, i] = f16(x[r, i])` (nearest even),
// and `wide[r]` set to whether row `r` holds a value beyond f16's range
// (`matmul_wide_rows` computes that row's products again in f32).
//
// Arguments: `x: f32[rows, k]` (read), `x16: f16[rows, k]` (write),
// `wide: u32[rows]` (write), `RowsK s` (value). A block a row, its threads
// four elements at a time (16-byte loads where the row is aligned so).

#include "mma.cuh"

#define TF_F16_MAX 65504.f

struct RowsK {
    unsigned int rows;
    unsigned int k;
};

extern "C" __global__ void to_f16_rows(const float* __restrict__ x, unsigned short* __restrict__ x16,
                                       unsigned int* __restrict__ wide, RowsK s) {
    encore_grid_wait();
    const unsigned int row = blockIdx.x;
    if (row >= s.rows) return;
    const float* xr = x + (size_t)row * s.k;
    unsigned short* out = x16 + (size_t)row * s.k;
    bool beyond = false;
    if (s.k % 4 == 0 && ((size_t)xr & 15u) == 0) {
        for (unsigned int i = 4 * threadIdx.x; i < s.k; i += 4 * blockDim.x) {
            const float4 v = *reinterpret_cast<const float4*>(xr + i);
            beyond |= fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))) > TF_F16_MAX;
            *reinterpret_cast<uint2*>(out + i) = make_uint2(pack_f16(v.x, v.y), pack_f16(v.z, v.w));
        }
    } else {
        for (unsigned int i = threadIdx.x; i < s.k; i += blockDim.x) {
            const float v = xr[i];
            beyond |= fabsf(v) > TF_F16_MAX;
            out[i] = (unsigned short)(pack_f16(v, 0.f) & 0xffffu);
        }
    }
    // NaN compares false: a NaN row stays NaN on tensor cores, as in f32.
    beyond = __syncthreads_or(beyond);
    if (threadIdx.x == 0) wide[row] = beyond ? 1u : 0u;
}
