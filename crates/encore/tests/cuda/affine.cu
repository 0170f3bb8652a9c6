// affine(x, y, p): y[i] = x[i] * p.scale + p.shift for i < p.n, staged
// through dynamic shared memory (64 floats per thread) to need more than
// the 48 KiB a kernel gets without opting in. `Affine` is passed by value.
struct Affine { float scale; float shift; unsigned int n; };

extern "C" __global__ void affine(const float* x, float* y, Affine p) {
    extern __shared__ float stage[];
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    stage[threadIdx.x * 64] = i < p.n ? x[i] : 0.0f;
    __syncthreads();
    if (i < p.n) y[i] = __fadd_rn(__fmul_rn(stage[threadIdx.x * 64], p.scale), p.shift);
}
