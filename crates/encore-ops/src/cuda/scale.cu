// `scale`: `y[i] *= s` over `n` elements.
//
// Arguments: `y: f32[n]` (read-write), `ScaleShape {n, s}` (value). One
// thread per element, in a grid-stride loop.

struct ScaleShape {
    unsigned int n;
    float s;
};

extern "C" __global__ void scale(float* __restrict__ y, ScaleShape shape) {
    encore_grid_wait();
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < shape.n; i += gridDim.x * blockDim.x)
        y[i] *= shape.s;
}
