// slow_copy(x, y, n, cycles): spins for `cycles` clock cycles, then copies
// y[i] = x[i] for i < n; keeps work in flight for lifetime tests.
extern "C" __global__ void slow_copy(const float* x, float* y, unsigned int n, unsigned int cycles) {
    long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) { }
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
