// `add_rows`: `y[r, j] += b[j]` (a bias added to every row).
//
// Arguments: `y: f32[rows, n]` (read-write), `b: f32[n]` (read),
// `RowsCols s` (value: rows, n). One thread per element of `y`, in a
// grid-stride loop.

struct RowsCols {
    unsigned int rows;
    unsigned int n;
};

extern "C" __global__ void add_rows(float* __restrict__ y, const float* __restrict__ b, RowsCols s) {
    encore_grid_wait();
    const unsigned int total = s.rows * s.n;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
        y[i] += b[i % s.n];
}
