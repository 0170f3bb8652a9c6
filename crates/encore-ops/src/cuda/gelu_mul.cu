// `gelu_mul`: `y[i] = gelu(g[i]) * u[i]` with GELU's tanh approximation,
// `gelu(v) = v/2 (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))` (GeGLU).
//
// Arguments: `g: f32[n]` (read), `u: f32[n]` (read), `y: f32[n]` (write),
// `n: u32` (value). One thread per element, in a grid-stride loop.

extern "C" __global__ void gelu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ y, unsigned int n) {
    encore_grid_wait();
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = g[i];
        const float inner = 0.7978845608f * v * fmaf(0.044715f, v * v, 1.0f);
        y[i] = 0.5f * v * (1.0f + tanhf(inner)) * u[i];
    }
}
