// `sum_splits`: the partial sums of a split product (`gemm_f16` with
// `splits` > 1) added in split order: `y[r, n0 + j] = Σ_z part[z, r, j]`.
//
// Arguments: `part: f32[splits, rows, n]` (read), `y: f32[rows, ldy]`
// (write, columns n0..n0 + n), `SplitsShape s` (value). A thread an
// output, in a grid-stride loop.

struct SplitsShape {
    unsigned int rows;
    unsigned int n;
    unsigned int splits;
    unsigned int ldy;
    unsigned int n0;
};

extern "C" __global__ void sum_splits(const float* __restrict__ part, float* __restrict__ y, SplitsShape s) {
    encore_grid_wait();
    const unsigned long long total = (unsigned long long)s.rows * s.n;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float sum = part[i];
        for (unsigned int z = 1; z < s.splits; ++z) sum += part[z * total + i];
        const unsigned int r = (unsigned int)(i / s.n), j = (unsigned int)(i % s.n);
        y[(size_t)r * s.ldy + s.n0 + j] = sum;
    }
}
