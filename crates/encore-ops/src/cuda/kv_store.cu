// `kv_store` and `kv_store_paged`: write `rows` f32 rows into an f16 KV
// cache, row `r` into cache row `pos[0] + r` (`kv_store`: consecutive
// positions of one sequence) or into slot `pos[r]` (`kv_store_paged`: a
// paged pool). POSITION_ROWS (from Rust, prepended to this source) says
// which entry point this compilation has; the two differ only in where a
// row goes.
//
// Arguments: `src: f32[rows, kv_dim]` (read), `cache: f16[max_seq, kv_dim]`
// (write), `pos: u32[1]` (read) or `u32[rows]`, `KvShape s` (value: rows,
// kv_dim, max_seq: the cache's rows).
//
// One thread per element, rounding to nearest even like the CPU. A
// position past the cache writes nothing, and neither does a slot past the
// pool (the CPU reports them; the engine never makes one).

#include "gguf.cuh"

struct KvShape {
    unsigned int rows;
    unsigned int kv_dim;
    unsigned int max_seq;
};

template <bool ROWS>
__device__ __forceinline__ void kv_store_body(const float* __restrict__ src, f16_bits* __restrict__ cache,
                                              const unsigned int* __restrict__ pos, const KvShape& s) {
    encore_grid_wait();
    const unsigned long long p = ROWS ? 0 : pos[0];
    if (!ROWS && p + s.rows > s.max_seq) return;
    const unsigned int n = s.rows * s.kv_dim;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        if (ROWS) {
            const unsigned int slot = pos[i / s.kv_dim];
            if (slot < s.max_seq) cache[(size_t)slot * s.kv_dim + i % s.kv_dim] = f32_to_f16(src[i]);
        } else {
            cache[p * s.kv_dim + i] = f32_to_f16(src[i]);
        }
    }
}

#if POSITION_ROWS
extern "C" __global__ void kv_store_paged(const float* __restrict__ src, f16_bits* __restrict__ cache,
                                          const unsigned int* __restrict__ slots, KvShape s) {
    kv_store_body<true>(src, cache, slots, s);
}
#else
extern "C" __global__ void kv_store(const float* __restrict__ src, f16_bits* __restrict__ cache,
                                    const unsigned int* __restrict__ pos, KvShape s) {
    kv_store_body<false>(src, cache, pos, s);
}
#endif
