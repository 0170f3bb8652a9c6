// k(y, n): y[i] *= 10 for i < n. Shares its name and entry point with
// in_place_plus_one.cu; only the source differs.
extern "C" __global__ void k(float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= 10.0f;
}
