// present(y): y[0] = 1. A test loads it under the entry point `absent`,
// which this source does not define.
extern "C" __global__ void present(float* y) { y[0] = 1.0f; }
