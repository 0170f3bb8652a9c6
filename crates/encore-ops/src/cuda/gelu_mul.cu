// `gelu_mul`: `y[i] = gelu(g[i]) * u[i]` with GELU's tanh approximation,
// `gelu(v) = v/2 (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))` (GeGLU), as the
// CPU (and llama.cpp's CPU backend) evaluates it: 0 below -10, `v` above
// 10, else of `v` rounded to f16, rounded to f16.
//
// Arguments: `g: f32[n]` (read), `u: f32[n]` (read), `y: f32[n]` (write),
// `n: u32` (value). One thread per element, in a grid-stride loop.

#include "gguf.cuh"

extern "C" __global__ void gelu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ y, unsigned int n) {
    encore_grid_wait();
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float x = g[i];
        float a;
        if (x <= -10.0f) {
            a = 0.0f;
        } else if (x >= 10.0f) {
            a = x;
        } else {
            const float v = f16_to_f32(f32_to_f16(x));
            const float inner = __fmul_rn(__fmul_rn(0.7978845608f, v), 1.0f + __fmul_rn(__fmul_rn(0.044715f, v), v));
            a = f16_to_f32(f32_to_f16(__fmul_rn(__fmul_rn(0.5f, v), 1.0f + tanhf(inner))));
        }
        y[i] = __fmul_rn(a, u[i]);
    }
}
