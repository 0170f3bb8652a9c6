// saxpy(x, y, a, n): y[i] = a * x[i] + y[i] for i < n, as one fused
// multiply-add (like Rust's f32::mul_add), so it matches the CPU bit for bit.
extern "C" __global__ void saxpy(const float* x, float* y, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fmaf_rn(a, x[i], y[i]);
}
