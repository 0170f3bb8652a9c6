// `kv_store_paged`: writes `rows` f32 rows into a paged f16 KV cache, row
// `r` into slot `slots[r]` of the pool.
//
// Arguments: `src: f32[rows, kv_dim]` (read), `cache: f16[slots, kv_dim]`
// (write), `slots: u32[rows]` (read), `PagedKvShape s` (value: rows,
// kv_dim, slots).
//
// One thread per element, rounding to nearest even like the CPU. A slot
// past the pool writes nothing (the CPU reports it; the engine never
// makes one).

#include "gguf.cuh"

struct PagedKvShape {
    unsigned int rows;
    unsigned int kv_dim;
    unsigned int slots;
};

extern "C" __global__ void kv_store_paged(const float* __restrict__ src, f16_bits* __restrict__ cache,
                                          const unsigned int* __restrict__ slots, PagedKvShape s) {
    encore_grid_wait();
    const unsigned int n = s.rows * s.kv_dim;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const unsigned int r = i / s.kv_dim, slot = slots[r];
        if (slot < s.slots) cache[(size_t)slot * s.kv_dim + i % s.kv_dim] = f32_to_f16(src[i]);
    }
}
