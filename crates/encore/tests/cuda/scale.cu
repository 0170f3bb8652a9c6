// scale(x, y, s, n): y[i] = x[i] * s[0] for i < n, with the factor read
// from device memory (a graph parameter).
extern "C" __global__ void scale(const float* x, float* y, const float* s, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s[0];
}
