// fill(x, n): x[i] = a hash of i for i < n, so a copy can be checked.
extern "C" __global__ void fill(unsigned int* x, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] = (unsigned int)(i * 2654435761ull) ^ 0x5bd1e995u;
}
