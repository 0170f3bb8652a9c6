// fault(p): *p = 1, through whatever address it is given (an illegal one
// in the sticky-error test).
extern "C" __global__ void fault(unsigned int* p) { *p = 1u; }
