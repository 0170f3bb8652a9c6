// The argmax of a vector by a grid of blocks, shared by `argmax` and
// `argmax_rows`; `argmax.cu` describes the method. ARGMAX_LOADS comes from
// Rust, prepended to the source (cuda/geometry.rs).

__device__ __forceinline__ void argmax_take(float& v, unsigned int& i, float ov, unsigned int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// (value, index) as a key whose unsigned order is argmax_take's: the
// value's bits made monotonic (-0 counted as +0, which compares equal)
// above the complemented index; 0 for no value at all.
__device__ __forceinline__ unsigned long long argmax_key(float v, unsigned int i) {
    if (i == 0xffffffffu) return 0ull;
    const unsigned int b = __float_as_uint(v == 0.f ? 0.f : v);
    const unsigned int ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (unsigned long long)~i;
}

// The argmax of `x[..n]` by the grid's x blocks into `out[0]`, with
// `out[1..4]` the merge's scratch. With `flag`, a largest value that is not
// finite (or a NaN at index 0, or no value at all) gives 0xffffffff.
__device__ __forceinline__ void argmax_vector(const float* __restrict__ x, unsigned int* __restrict__ out,
                                              unsigned int n, bool flag) {
    __shared__ unsigned long long best[32];
    __shared__ bool last;
    float v = __uint_as_float(0xff800000u);  // -infinity (NVRTC has no math.h)
    unsigned int i = 0xffffffffu;
    if (((size_t)x & 15u) == 0) {
        // Each block takes ARGMAX_LOADS * 4 * blockDim.x values, loaded
        // from addresses clamped into the vector (the extra ones ignored);
        // block 0 also takes the n % 4 values past the last full load.
        const float4* x4 = reinterpret_cast<const float4*>(x);
        const unsigned int n4 = n / 4;
        const unsigned int q0 = blockIdx.x * ARGMAX_LOADS * blockDim.x + threadIdx.x;
        if (n4 > 0) {
            float4 a[ARGMAX_LOADS];
#pragma unroll
            for (int u = 0; u < ARGMAX_LOADS; ++u) a[u] = x4[min(q0 + u * blockDim.x, n4 - 1)];
#pragma unroll
            for (int u = 0; u < ARGMAX_LOADS; ++u) {
                const unsigned int q = q0 + u * blockDim.x;
                if (q < n4) {
                    argmax_take(v, i, a[u].x, 4 * q);
                    argmax_take(v, i, a[u].y, 4 * q + 1);
                    argmax_take(v, i, a[u].z, 4 * q + 2);
                    argmax_take(v, i, a[u].w, 4 * q + 3);
                }
            }
        }
        if (blockIdx.x == 0)
            for (unsigned int j = 4 * n4 + threadIdx.x; j < n; j += blockDim.x) argmax_take(v, i, x[j], j);
    } else {
        for (unsigned int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
            argmax_take(v, i, x[j], j);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_take(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) best[warp] = argmax_key(v, i);
    __syncthreads();
    unsigned long long* key = reinterpret_cast<unsigned long long*>(out + 2);
    if (threadIdx.x == 0) {
        unsigned long long k = 0ull;
        for (unsigned int w = 0; w < (blockDim.x + 31) / 32; ++w) k = max(k, best[w]);
        if (k != 0ull) atomicMax(key, k);
        __threadfence();
        last = atomicAdd(out + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    // Every block's maximum is in: take the answer and leave the scratch zero.
    __threadfence();
    const unsigned long long k = atomicExch(key, 0ull);
    out[1] = 0u;
    const bool none = k == 0ull || n == 0 || x[0] != x[0];
    // The winner's bits, back from argmax_key's order.
    const unsigned int ordered = (unsigned int)(k >> 32);
    const unsigned int bits = (ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered;
    const bool finite = (bits & 0x7f800000u) != 0x7f800000u;
    if (flag && (none || !finite))
        out[0] = 0xffffffffu;
    else
        out[0] = none ? 0u : ~(unsigned int)(k & 0xffffffffull);
}
