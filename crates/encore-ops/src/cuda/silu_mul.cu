// `silu_mul`: `y[i] = silu(g[i]) * u[i]`, `silu(v) = v / (1 + e^-v)` with
// ggml's exponential (gguf.cuh), as the CPU and llama.cpp's SwiGLU compute it.
//
// Arguments: `g: f32[n]` (read), `u: f32[n]` (read), `y: f32[n]` (write),
// `n: u32` (value). One thread per element, in a grid-stride loop.

#include "gguf.cuh"

extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ y, unsigned int n) {
    encore_grid_wait();
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = __fmul_rn(silu(g[i]), u[i]);
}
