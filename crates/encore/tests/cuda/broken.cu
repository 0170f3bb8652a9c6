// broken(y): deliberately does not compile (`undeclared_thing` is never
// declared), so a test can check that the NVRTC log names it.
extern "C" __global__ void broken(float* y) { y[0] = undeclared_thing; }
