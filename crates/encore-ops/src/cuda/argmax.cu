// `argmax`: `out[0] = argmax_i x[i]`, the first index among equal maxima
// (`argmax_rows.cu` the same for each row of a matrix).
//
// Arguments: `x: f32[n]` (read), `out: u32[4]` (read-write), `n: u32`
// (value). `out[1..4]` is scratch for merging the blocks' results: zero
// before a dispatch and zero again after it.
//
// Each thread takes `4 * ARGMAX_LOADS` values (four at a load when aligned,
// all its loads in flight at once), so the whole vector takes one memory
// round trip spread over many multiprocessors. A block reduces its best
// `(value, index)` pairs with warp shuffles, preferring the larger value
// and, among equal values, the smaller index, packs the winner into one
// 64-bit key ordered the same way and merges it into `out[2..4]` with an
// atomic maximum; the last block to finish (counted in `out[1]`) writes the
// index to `out[0]` and sets `out[1..4]` back to zero. As on the CPU, a NaN
// never wins, and a NaN at index 0 makes the answer 0. The body is in
// argmax_common.cuh.

#include "argmax_common.cuh"

extern "C" __global__ void argmax(const float* __restrict__ x, unsigned int* __restrict__ out, unsigned int n) {
    encore_fix_value(n);
    encore_grid_wait();
    argmax_vector(x, out, n, false);
}
