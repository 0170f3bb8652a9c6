// `attention_exact`: the `attention` op with the CPU's results bit for bit
// (kernels/attention_exact.rs explains each rounding step it follows).
//
// Arguments: `q: f32[rows, heads * head_dim]` (read), `k, v: f16[max_seq,
// kv_dim]` (read), `pos: u32[1]` (read), `out: f32[rows, heads * head_dim]`
// (write), `AttnShape s` (value: rows, heads, kv_heads, head_dim, max_seq,
// scale).
//
// For query row `r` (position `pos + r`) and head `h`, with KV head
// `h / (heads / kv_heads)`: `s[t] = scale * q[r, h] · K[t]` for
// `t <= pos + r`, `p = softmax(s)`, `out[r, h] = Σ_t p[t] V[t]`.
//
// One block of EXA_THREADS threads per (head, query row), over the positions
// `t < len = pos + row + 1` in stretches of 256 positions (four tiles of the
// tiled path), a thread per position for the scores and a thread per
// dimension for the accumulator. Below EXA_TILE_Q rows it follows
// llama.cpp's one-pass recurrence in f16, from there its tiled f32 path in
// tiles of EXA_TILE_KV positions. Compiled with `--fmad=false`: every
// `fmaf`/`__fma_rn` stands where the CPU fuses, every plain operation where
// it does not. EXA_THREADS (cuda/geometry.rs), EXA_TILE_Q and EXA_TILE_KV
// (the CPU's tile sizes, kernels/attention.rs) come from Rust, prepended to
// this source; the code assumes tiles of 64.

#include "gguf.cuh"
#include "attention_common.cuh"

#define EXA_WARPS (EXA_THREADS / 32)
#define EXA_MAX_HEAD 256
#define EXA_TILES (EXA_THREADS / EXA_TILE_KV)
// The thread that runs the sum's chain: the last, which holds no dimension
// below a head size of 256.
#define EXA_SUM_THREAD (EXA_THREADS - 1)

// glibc's expf table (`__exp2f_data.tab`): the bits of 2^(i/32), less i << 47.
__device__ const unsigned long long EXA_EXP2F_TABLE[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

// e^x as glibc's expf computes it (what Rust's f32::exp calls), step for
// step: x * 32 / ln 2 split into an integer k and a remainder r, 2^(k/32)
// from the table and the exponent bits, 2^(r/32) from a cubic, all in
// double. glibc's x86-64 build fuses the multiply-adds (kd, r, the cubic);
// the fused r is the one that matters. Mirrored by `glibc_expf` in the Rust
// tests, which check it against f32::exp.
__device__ __forceinline__ float glibc_expf(float x) {
    const double inv_ln2_n = __longlong_as_double(0x40471547652b82fell);  // 0x1.71547652b82fep0 * 32
    const double shift = __longlong_as_double(0x4338000000000000ll);      // 0x1.8p52
    const double c0 = __longlong_as_double(0x3ebc6af84b912394ll);         // 0x1.c6af84b912394p-5 / 32^3
    const double c1 = __longlong_as_double(0x3f2ebfce50fac4f3ll);         // 0x1.ebfce50fac4f3p-3 / 32^2
    const double c2 = __longlong_as_double(0x3f962e42ff0c52d6ll);         // 0x1.62e42ff0c52d6p-1 / 32
    const unsigned int abstop = (__float_as_uint(x) >> 20) & 0x7ffu;
    if (abstop >= 0x42bu) {  // |x| >= 88, or NaN
        if (__float_as_uint(x) == 0xff800000u) return 0.f;  // -inf
        if (abstop >= 0x7f8u) return x + x;                  // +inf, NaN
        if (x > __uint_as_float(0x42b17217u)) return __uint_as_float(0x7f800000u);  // > 0x1.62e42ep6: +inf
        if (x < __uint_as_float(0xc2cff1b4u)) return 0.f;                           // < -0x1.9fe368p6: 0
    }
    const double xd = (double)x;
    double kd = __fma_rn(inv_ln2_n, xd, shift);
    const unsigned long long ki = (unsigned long long)__double_as_longlong(kd);
    kd = kd - shift;
    const double r = __fma_rn(inv_ln2_n, xd, -kd);
    const unsigned long long t = EXA_EXP2F_TABLE[ki & 31u] + (ki << 47);
    const double s = __longlong_as_double((long long)t);
    const double y = __fma_rn(__fma_rn(c0, r, c1), r * r, __fma_rn(c2, r, 1.0));
    return __double2float_rn(y * s);
}

// The running maximum's step, as the CPU's `if s > m { m = s }`: the later
// value `b` replaces `a` only when strictly greater. NaN acts as "no value"
// (the scan's identity and what threads past the end contribute); the
// operation is associative, so a scan gives the sequential result.
__device__ __forceinline__ float exa_later_max(float a, float b) { return (b > a || a != a) ? b : a; }

// Exclusive scan of exa_later_max over the block's threads in order: the
// maximum of the values of the threads before this one (NaN for none);
// `total` gets the maximum of all. `part`: EXA_WARPS floats of shared memory.
__device__ __forceinline__ float exa_exclusive_max(float v, float* part, float& total) {
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const float none = __uint_as_float(0x7fc00000u);
    float incl = v;
#pragma unroll
    for (unsigned int o = 1; o < 32; o <<= 1) {
        const float before = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl = exa_later_max(before, incl);
    }
    float excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = none;
    if (lane == 31u) part[warp] = incl;
    __syncthreads();
    float prefix = none;
    total = none;
#pragma unroll
    for (unsigned int w = 0; w < EXA_WARPS; ++w) {
        if (w < warp) prefix = exa_later_max(prefix, part[w]);
        total = exa_later_max(total, part[w]);
    }
    __syncthreads();
    return exa_later_max(prefix, excl);
}

// 8 halves from `p` widened to f32; with VEC, `p` is 16-byte aligned and
// read at once.
template <bool VEC>
__device__ __forceinline__ void exa_load8(const f16_bits* p, float* f) {
    if (VEC) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = f16_to_f32((f16_bits)(w[i] & 0xffffu));
            f[2 * i + 1] = f16_to_f32((f16_bits)(w[i] >> 16));
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = f16_to_f32(p[i]);
    }
}

// q16 . K[t] as the CPU's `dot_like_ggml` (ggml's AVX2 `ggml_vec_dot_f16`)
// sums it: element e = i + 8j + l of each step of 32 goes to acc[j][l]; then
// per lane (acc0 + acc2) + (acc1 + acc3), lanes l and l + 4, then
// (t0 + t1) + (t2 + t3); the elements past a multiple of 32 one at a time.
// Both factors are f16 values, so every product is exact in f32 and fusing
// it changes nothing.
template <bool VEC>
__device__ __forceinline__ float exa_dot_like_ggml(const float* qs, const f16_bits* __restrict__ kt,
                                                   unsigned int hd) {
    float acc[4][8];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int l = 0; l < 8; ++l) acc[j][l] = 0.f;
    const unsigned int body = hd - hd % 32u;
    for (unsigned int i = 0; i < body; i += 32) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float kf[8];
            exa_load8<VEC>(kt + i + 8 * j, kf);
#pragma unroll
            for (int l = 0; l < 8; ++l) acc[j][l] = fmaf(qs[i + 8 * j + l], kf[l], acc[j][l]);
        }
    }
    float r[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) r[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    float sum = ((r[0] + r[4]) + (r[1] + r[5])) + ((r[2] + r[6]) + (r[3] + r[7]));
    for (unsigned int e = body; e < hd; ++e) sum = sum + qs[e] * f16_to_f32(kt[e]);
    return sum;
}

// q . K[t] as the tiled CPU path sums it: one chain of fused multiply-adds
// over the dimensions in order, from 0.
template <bool VEC>
__device__ __forceinline__ float exa_tiled_dot(const float* qs, const f16_bits* __restrict__ kt, unsigned int hd) {
    float s = 0.f;
    if (VEC) {
        for (unsigned int d = 0; d < hd; d += 8) {
            float kf[8];
            exa_load8<true>(kt + d, kf);
#pragma unroll
            for (int l = 0; l < 8; ++l) s = fmaf(kf[l], qs[d + l], s);
        }
    } else {
        for (unsigned int d = 0; d < hd; ++d) s = fmaf(f16_to_f32(kt[d]), qs[d], s);
    }
    return s;
}

// Shared memory of one block.
struct ExaScratch {
    float q[EXA_MAX_HEAD];               // the query (rounded to f16 in the recurrence)
    float ms[EXA_THREADS];               // recurrence: rescale factor per position of the stretch
    float vs[EXA_THREADS];               // recurrence: weight per position
    unsigned char rescale[EXA_THREADS];  // recurrence: whether the position set a new maximum
    float w[EXA_THREADS];                // tiled: weight per position of the stretch's tiles
    float part[EXA_WARPS];               // per-warp maxima
    float sum;                           // the finished sum, for every thread
};

// llama.cpp's one-row recurrence (the CPU's `attend_head`) for query head h
// and row r over `len` positions.
template <bool VEC>
__device__ void exa_recurrence(const float* __restrict__ q, const f16_bits* __restrict__ k,
                               const f16_bits* __restrict__ v, float* __restrict__ out, const AttnShape& s,
                               unsigned int len, ExaScratch& sh) {
    const unsigned int h = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
    const unsigned int hd = s.head_dim, kv_dim = s.kv_heads * hd;
    const unsigned int kv_off = (h / (s.heads / s.kv_heads)) * hd;
    const float* qh = q + ((size_t)r * s.heads + h) * hd;
    for (unsigned int d = tid; d < hd; d += EXA_THREADS) sh.q[d] = round_f16(qh[d]);
    __syncthreads();
    const f16_bits* kh = k + kv_off;
    const f16_bits* vh = v + kv_off;

    float m = __uint_as_float(0xff800000u);  // the running maximum before the stretch (every thread)
    float sum = 0.f;                         // EXA_SUM_THREAD's
    float acc = 0.f;                         // dimension tid's
    // No barrier closes a stretch: the next one writes shared memory only
    // after its scan's barriers, which every thread reaches after reading.
    for (unsigned int t0 = 0; t0 < len; t0 += EXA_THREADS) {
        const unsigned int n = min(len - t0, (unsigned int)EXA_THREADS);
        float sc = __uint_as_float(0x7fc00000u);  // no value past the end
        if (tid < n) sc = exa_dot_like_ggml<VEC>(sh.q, kh + (size_t)(t0 + tid) * kv_dim, hd) * s.scale;
        float total;
        const float before = exa_later_max(m, exa_exclusive_max(sc, sh.part, total));
        m = exa_later_max(m, total);
        if (tid < n) {
            const bool rescale = sc > before;
            sh.ms[tid] = rescale ? glibc_expf(before - sc) : 1.f;
            sh.vs[tid] = rescale ? 1.f : glibc_expf(sc - before);
            sh.rescale[tid] = rescale;
        }
        __syncthreads();
        if (tid == EXA_SUM_THREAD) {
            for (unsigned int j = 0; j < n; ++j) sum = fmaf(sum, sh.ms[j], sh.vs[j]);
        }
        if (tid < hd) {
            const f16_bits* vt = vh + (size_t)t0 * kv_dim + tid;
#pragma unroll 8
            for (unsigned int j = 0; j < n; ++j) {
                const float x = f16_to_f32(vt[(size_t)j * kv_dim]);
                if (sh.rescale[j]) acc = round_f16(acc * sh.ms[j]);
                acc = round_f16(fmaf(x, sh.vs[j], acc));
            }
        }
    }
    if (tid == EXA_SUM_THREAD) sh.sum = sum;
    __syncthreads();
    if (tid < hd) {
        const float total = sh.sum;
        const float inv = total > 0.f ? 1.f / total : 0.f;
        out[((size_t)r * s.heads + h) * hd + tid] = acc * inv;
    }
}

// ggml's tiled path (the CPU's `attend_head_tiled`) for query head h and
// row r over `len` positions, EXA_TILES tiles of EXA_TILE_KV positions per
// stretch.
template <bool VEC>
__device__ void exa_tiled(const float* __restrict__ q, const f16_bits* __restrict__ k,
                          const f16_bits* __restrict__ v, float* __restrict__ out, const AttnShape& s,
                          unsigned int len, ExaScratch& sh) {
    const unsigned int h = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
    const unsigned int lane = tid & 31u, warp = tid >> 5;
    const unsigned int hd = s.head_dim, kv_dim = s.kv_heads * hd;
    const unsigned int kv_off = (h / (s.heads / s.kv_heads)) * hd;
    const float* qh = q + ((size_t)r * s.heads + h) * hd;
    for (unsigned int d = tid; d < hd; d += EXA_THREADS) sh.q[d] = qh[d];
    __syncthreads();
    const f16_bits* kh = k + kv_off;
    const f16_bits* vh = v + kv_off;
    const float neg_inf = __uint_as_float(0xff800000u);

    float m = neg_inf;  // the running maximum (every thread)
    float sum = 0.f;    // EXA_SUM_THREAD's
    float acc = 0.f;    // dimension tid's
    // No barrier closes a stretch: the next one writes `part` and `w` only
    // after barriers every thread reaches after reading them.
    for (unsigned int t0 = 0; t0 < len; t0 += EXA_THREADS) {
        // Scores; -inf past the end, as the CPU masks its last tile.
        const unsigned int t = t0 + tid;
        float p = neg_inf;
        if (t < len) p = exa_tiled_dot<VEC>(sh.q, kh + (size_t)t * kv_dim, hd) * s.scale;
        // Tile maxima from the warps' (the order of a maximum does not
        // change it; fmaxf skips NaN like the CPU's f32::max).
        float wmax = p;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) wmax = fmaxf(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
        if (lane == 0) sh.part[warp] = wmax;
        __syncthreads();
        // Every thread follows the maximum through the stretch's tiles (only
        // those holding a position: the CPU has no empty tiles).
        const unsigned int tiles = min((len - t0 + EXA_TILE_KV - 1) / EXA_TILE_KV, (unsigned int)EXA_TILES);
        float tile_m[EXA_TILES], tile_ms[EXA_TILES];
        bool tile_rescale[EXA_TILES];
#pragma unroll
        for (unsigned int i = 0; i < EXA_TILES; ++i) {
            tile_rescale[i] = false;
            tile_ms[i] = 1.f;
            if (i < tiles) {
                const float tile_max = fmaxf(sh.part[2 * i], sh.part[2 * i + 1]);
                const float m_new = fmaxf(m, tile_max);
                if (m_new > m) {
                    tile_rescale[i] = true;
                    tile_ms[i] = glibc_expf(m - m_new);
                }
                m = m_new;
            }
            tile_m[i] = m;
        }
        const unsigned int mine = tid / EXA_TILE_KV;
        if (mine < tiles) sh.w[tid] = ggml_expf(p - tile_m[mine]);
        __syncthreads();
        // The tile loops unroll (with `i < tiles` inside) so that the
        // per-tile values stay in registers.
        if (tid == EXA_SUM_THREAD) {
#pragma unroll
            for (unsigned int i = 0; i < EXA_TILES; ++i) {
                if (i >= tiles) break;
                if (tile_rescale[i]) sum = sum * tile_ms[i];
                // ggml's horizontal sum of each 8 lanes, into an f64 total.
                double total = 0.0;
                for (unsigned int c = 0; c < EXA_TILE_KV / 8; ++c) {
                    const float* l = sh.w + i * EXA_TILE_KV + 8 * c;
                    const float w0 = l[0] + l[4], w1 = l[1] + l[5], w2 = l[2] + l[6], w3 = l[3] + l[7];
                    total = total + (double)((w0 + w2) + (w1 + w3));
                }
                sum = (float)((double)sum + total);
            }
        }
        if (tid < hd) {
#pragma unroll
            for (unsigned int i = 0; i < EXA_TILES; ++i) {
                if (i >= tiles) break;
                if (tile_rescale[i]) acc = acc * tile_ms[i];
                const unsigned int first = t0 + i * EXA_TILE_KV;
                const unsigned int n = min(len - first, (unsigned int)EXA_TILE_KV);
                const f16_bits* vt = vh + (size_t)first * kv_dim + tid;
                const float* w = sh.w + i * EXA_TILE_KV;
#pragma unroll 8
                for (unsigned int j = 0; j < n; ++j) acc = fmaf(f16_to_f32(vt[(size_t)j * kv_dim]), w[j], acc);
            }
        }
    }
    if (tid == EXA_SUM_THREAD) sh.sum = sum;
    __syncthreads();
    if (tid < hd) {
        const float total = sh.sum;
        const float inv = total == 0.f ? 0.f : 1.f / total;
        out[((size_t)r * s.heads + h) * hd + tid] = acc * inv;
    }
}

extern "C" __global__ void __launch_bounds__(EXA_THREADS)
attention_exact(const float* __restrict__ q, const f16_bits* __restrict__ k, const f16_bits* __restrict__ v,
                const unsigned int* __restrict__ pos, float* __restrict__ out, AttnShape s) {
    __shared__ ExaScratch sh;
    encore_grid_wait();
    if (s.kv_heads == 0 || s.heads % s.kv_heads != 0 || s.head_dim > EXA_MAX_HEAD) return;
    const unsigned long long p = pos[0];
    if (p + s.rows > s.max_seq || blockIdx.x >= s.heads || blockIdx.y >= s.rows) return;
    const unsigned int len = (unsigned int)p + blockIdx.y + 1;
    // K rows 16-byte aligned, so 8 halves load at once.
    const bool vec = s.head_dim % 8 == 0 && (s.kv_heads * s.head_dim) % 8 == 0 && ((size_t)k & 15u) == 0;
    // A window starts the cache later: the rows before it are not seen.
    // (The CPU's tiled path masks them inside tiles aligned at 0 instead,
    // so with a window the tiled results are close to it, not identical.)
    const unsigned int first = attn_first(s, p + blockIdx.y);
    const size_t skip = (size_t)first * s.kv_heads * s.head_dim;
    k += skip;
    v += skip;
    if (s.rows < EXA_TILE_Q) {
        if (vec) exa_recurrence<true>(q, k, v, out, s, len - first, sh);
        else exa_recurrence<false>(q, k, v, out, s, len - first, sh);
    } else {
        if (vec) exa_tiled<true>(q, k, v, out, s, len - first, sh);
        else exa_tiled<false>(q, k, v, out, s, len - first, sh);
    }
}
