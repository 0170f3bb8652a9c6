// empty3(x, y, n): does nothing observable unless n is all ones; a
// launch-cost probe with three arguments.
extern "C" __global__ void empty3(const float* x, float* y, unsigned int n) {
    if (n == 0xffffffffu && threadIdx.x == 0) y[0] = x[0];
}
