// mix(x, y, c, n): y[i] = (y[i] * 0.5 + x[i]) + c for i < n, each step
// rounded like the CPU body.
extern "C" __global__ void mix(const float* x, float* y, float c, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(__fadd_rn(__fmul_rn(y[i], 0.5f), x[i]), c);
}
