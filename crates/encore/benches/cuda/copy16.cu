// copy16(x, y, n): y[i] = x[i] for i < n, 16 bytes per thread.
extern "C" __global__ void copy16(const uint4* __restrict__ x, uint4* __restrict__ y,
                                  unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
