// `argmax_rows`: the argmax of each row of `x: f32[rows, n]` into
// `out[4 * r]` (the rest of each row's four words the scratch, as in
// `argmax.cu`), 0xffffffff where the row's largest value is not finite.
// Arguments: `x` (read), `out: u32[rows, 4]` (read-write), `ArgmaxRowsShape
// s` (value: rows, n). The grid's y is the row.

#include "argmax_common.cuh"

struct ArgmaxRowsShape {
    unsigned int rows, n;
};

extern "C" __global__ void argmax_rows(const float* __restrict__ x, unsigned int* __restrict__ out,
                                       ArgmaxRowsShape s) {
    encore_fix_value(s);
    encore_grid_wait();
    argmax_vector(x + (size_t)blockIdx.y * s.n, out + 4 * (size_t)blockIdx.y, s.n, true);
}
