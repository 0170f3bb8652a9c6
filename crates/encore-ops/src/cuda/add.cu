// `add`: `y[i] += x[i]`.
//
// Arguments: `y: f32[n]` (read-write), `x: f32[n]` (read), `n: u32` (value).
// One thread per element, in a grid-stride loop.

extern "C" __global__ void add(float* __restrict__ y, const float* __restrict__ x, unsigned int n) {
    encore_grid_wait();
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] += x[i];
}
