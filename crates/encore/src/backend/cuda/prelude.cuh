// Encore runtime prelude: CUDA C put before every kernel's source.
//
// encore_grid_wait() waits until every dispatch this one depends on has
// finished and its writes are visible, then lets the dispatches that depend
// on this one start their blocks (PTX griddepcontrol; nothing on GPUs before
// sm_90 or when the kernel was launched the ordinary way). A kernel declared
// programmatic calls it in every thread before its first access to memory
// another dispatch writes. Calling it only after that wait keeps the early
// start one kernel deep: the next kernel's blocks arrive while this one
// computes, never further ahead.
//
// encore_prefetch_l2(p) asks for the 128-byte line at p in L2; it may run
// before the wait (it reads nothing into registers).
//
// encore_smem_addr(p) is the 32-bit shared-memory address of the shared
// variable at p, as PTX instructions on shared memory take it (ldmatrix,
// mbarrier, mapa).
//
// encore_fix_value(v) does nothing in a kernel compiled from its plain
// source. In a variant specialized for one value argument it overwrites v
// with the words that variant was compiled for (ENCORE_VALUE_WORDS, a
// compile option), so the compiler sees every field as a constant: loops
// over a known length unroll, branches on the data type fold away and only
// the code of that one shape is left.
__device__ __forceinline__ void encore_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void encore_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}
__device__ __forceinline__ unsigned int encore_smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
#ifdef ENCORE_VALUE_WORDS
template <typename T> __device__ __forceinline__ void encore_fix_value(T& v) {
    const unsigned int words[] = ENCORE_VALUE_WORDS;
    static_assert(sizeof(words) == sizeof(T), "specialized for a value of another size");
#pragma unroll
    for (unsigned int i = 0; i < sizeof(T) / 4; ++i) reinterpret_cast<unsigned int*>(&v)[i] = words[i];
}
#else
template <typename T> __device__ __forceinline__ void encore_fix_value(T&) {}
#endif
// End of the Encore runtime prelude.
