// `kv_store`: writes `rows` f32 rows into an f16 KV cache at the position
// parameter.
//
// Arguments: `src: f32[rows, kv_dim]` (read), `cache: f16[max_seq, kv_dim]`
// (write), `pos: u32[1]` (read), `KvShape s` (value: rows, kv_dim, max_seq).
//
// One thread per element, `cache[pos * kv_dim + i] = f16(src[i])` rounding
// to nearest even, like the CPU. A position past the cache writes nothing
// (the CPU reports it; the session checks before).

#include "gguf.cuh"

struct KvShape {
    unsigned int rows;
    unsigned int kv_dim;
    unsigned int max_seq;
};

extern "C" __global__ void kv_store(const float* __restrict__ src, f16_bits* __restrict__ cache,
                                    const unsigned int* __restrict__ pos, KvShape s) {
    encore_grid_wait();
    const unsigned long long p = pos[0];
    if (p + s.rows > s.max_seq) return;
    const unsigned int n = s.rows * s.kv_dim;
    f16_bits* dst = cache + p * s.kv_dim;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        dst[i] = f32_to_f16(src[i]);
}
