// `gemm`: matrix products of many activation rows on tensor cores (CUDA
// prefill), the product `matmul` computes, tiled.
//
// Arguments (as `matmul`): `w: dtype[n, k]` (read, raw GGUF blocks),
// `x: f32[rows, k]` (read), `y: f32[rows, n]` (write), `MatmulShape s`
// (value). `y[r, j] = Σ_i w[j, i] x[r, i]`, the weights exact, the
// activations rounded to f16 (F16 and quantized weights) or split into two
// bf16 parts (BF16 and F32 weights); see kernels/gemm.rs for the precision.
// An activation row with a value beyond f16's range (real models have such
// rows) is marked as it is loaded, and its outputs are computed again in
// f32 without tensor cores (`wide_rows_f32`), so the product stays finite
// wherever the f32 product is.
//
// One block (`gemm_launch` in cuda/geometry.rs) per tile of GM_BM activation rows by
// GM_BN outputs, walking `k` in steps of one GGUF block (32 positions) per
// warp group: with G groups (two for all but BF16 and F32 weights, four for
// long rows in a grid too small to fill the GPU twice over: `gemm_warp_groups`
// in cuda/geometry.rs) each multiplies every G-th block into its own
// accumulators, which meet in shared memory at the end, in the groups'
// order; two warps per scheduler then hide each other's latencies.
//
// Each step, every thread loads its share of the next step's activations
// (f32, 16 bytes at a time when aligned) and weights (raw blocks) into
// registers, the warps multiply the current step from shared memory, then
// the threads convert what they loaded into the other shared stage: the
// activations to f16 (or two bf16 parts), the weights to 16-bit values
// (4-bit codes become f16 integers through the `0x6400 | code` exponent
// trick, exact), and the block's scales to f32 per column. Tiles are stored
// row by row (activation rows; weight rows, i.e. output columns), 32
// elements and 8 of padding, so that `ldmatrix` reads them without bank
// conflicts; `ldmatrix.x4` gives the A fragments of `mma.m16n8k16` (row
// major) straight, and on the weight tile the B fragments (column major: a
// weight row is a column of B) of two 8-column tiles.
//
// Warp `w` of a group owns rows `32 (w / 2)..+32` and columns `32 (w % 2)..+32`
// of the tile: 2 x 4 `m16n8` accumulators, 16 `mma` per GGUF block (32 for
// BF16 and 64 for F32, one per pair of parts). For quantized weights the
// step's products land in a second set of accumulators, which is then folded
// in as `acc += d_j p + m_j Σ_block x_r` with the column's scale and (Q4_1,
// Q4_K) minimum and the row's block sum of the f16 activations. Q5_0 enters
// so (codes `q - 16`, five bits from the nibbles and `qh`), and so does
// Q4_K, whose sub-blocks of 32 are the steps: `d_j = d sc`, `m_j = -dmin
// mn` with the sub-block's 6-bit scale and minimum; and Q6_K (codes
// `q - 32`), whose scales change every 16 positions: each `mma` of 16 is
// folded in with its own, `d sc` of the group. Rows, columns and (float
// weights) positions past the matrix are zero in shared memory and never
// stored.
//
// The other types of quant_codes.cuh (Q5_1, IQ4_NL, Q2_K, Q3_K, Q5_K,
// IQ4_XS) enter as F16 weights do: each thread decodes its 16 weights of a
// step to f32 as the CPU dequantizes them and rounds them to f16 (one
// decoder for all of them). The decode needs its loads before the step's
// products, so these types do not overlap the loads with the products as
// the raw types do.

#include "gguf.cuh"
#include "quant_codes.cuh"
#include "mma.cuh"
#include "matmul_shape.cuh"
#include "wide_rows.cuh"

// GM_BM (activation rows a tile), GM_BN (output columns a tile), GM_PITCH
// (16-bit elements a tile row: 32 and 8 of padding), GM_THREADS (threads
// of a warp group) and GM_MAX_GROUPS (warp groups a block at most) come
// from Rust, prepended to this source (cuda/geometry.rs). A step is one GGUF block of positions.
#define GM_BK 32

// x = hi + lo in bf16: `hi` is x's top 16 bits, `lo` the rest rounded to
// nearest; together they hold x to 2^-16 of its magnitude.
__device__ __forceinline__ void split_bf16(float x, unsigned int& hi, unsigned int& lo) {
    const unsigned int b = __float_as_uint(x);
    unsigned short l;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(l) : "f"(x - __uint_as_float(b & 0xffff0000u)));
    hi = b >> 16;
    lo = l;
}

// Four f32 split into bf16 pairs: hi[0] = (v0, v1), hi[1] = (v2, v3), and lo likewise.
__device__ __forceinline__ void split4_bf16(float4 v, unsigned int* hi, unsigned int* lo) {
    unsigned int h[4], l[4];
    split_bf16(v.x, h[0], l[0]);
    split_bf16(v.y, h[1], l[1]);
    split_bf16(v.z, h[2], l[2]);
    split_bf16(v.w, h[3], l[3]);
    hi[0] = h[0] | (h[1] << 16);
    hi[1] = h[2] | (h[3] << 16);
    lo[0] = l[0] | (l[1] << 16);
    lo[1] = l[2] | (l[3] << 16);
}

__device__ __forceinline__ unsigned int byte_perm(unsigned int a, unsigned int b, unsigned int sel) {
    unsigned int r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ unsigned int sub_f16x2(unsigned int a, unsigned int b) {
    unsigned int r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// The four bytes of `q` (each at most 255) as two f16 pairs, bytes (0, 1)
// and (2, 3), each value minus `bias`: `0x6400 | n` is the f16 1024 + n, so
// subtracting the f16 pair `bias2` (1024 + bias) leaves n - bias exactly.
__device__ __forceinline__ void bytes_f16(unsigned int q, unsigned int bias2, unsigned int* out) {
    const unsigned int b01 = byte_perm(q, 0u, 0x4140u), b23 = byte_perm(q, 0u, 0x4342u);
    out[0] = sub_f16x2(b01 | 0x64006400u, bias2);
    out[1] = sub_f16x2(b23 | 0x64006400u, bias2);
}

// The low (HI false) or high nibbles of the four bytes of `q` as two f16
// pairs, each minus `bias` (see bytes_f16).
template <bool HI>
__device__ __forceinline__ void nibbles_f16(unsigned int q, unsigned int bias2, unsigned int* out) {
    bytes_f16(((HI ? q >> 4 : q) & 0x0f0f0f0fu), bias2, out);
}

// The four signed bytes of `q` as two f16 pairs: (q + 128) | 0x6400 is
// 1024 + 128 + q; subtracting 1152 (0x6480) leaves q exactly.
__device__ __forceinline__ void int8_f16(unsigned int q, unsigned int* out) {
    const unsigned int b01 = byte_perm(q, 0u, 0x4140u), b23 = byte_perm(q, 0u, 0x4342u);
    out[0] = sub_f16x2(((b01 ^ 0x00800080u) | 0x64006400u), 0x64806480u);
    out[1] = sub_f16x2(((b23 ^ 0x00800080u) | 0x64006400u), 0x64806480u);
}

// Byte `i` of a Q4_K super-block's 12 bytes of scales and minimums, from
// the head words in w[4..8] (the scales start at word 5).
__device__ __forceinline__ unsigned int scale_byte(const unsigned int* w, unsigned int i) {
    return (w[5 + i / 4] >> (8 * (i % 4))) & 0xffu;
}

// One thread's share of a step, between its global loads and its shared stores.
struct GemmStage {
    float4 x[4];           // activations: rows tid / 8 + 16 i, positions 4 (tid % 8)..+4
    unsigned int w[16];    // weights: raw words (layout per type, see gemm_load_w)
    unsigned int head;     // a GGUF block's d (and m) bits; Q4_K and Q6_K: the sub-block of the step
};

template <unsigned int TYPE>
struct GemmTraits {
    // Integer codes, a scale (and minimum) per column and step.
    static constexpr bool QUANT = TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1 || TYPE == GGML_Q8_0 ||
                                  TYPE == GGML_Q5_0 || TYPE == GGML_Q4_K || TYPE == GGML_Q6_K;
    // Q4_1 and Q4_K: a minimum per column and step, times the activations' block sums.
    static constexpr bool MIN = TYPE == GGML_Q4_1 || TYPE == GGML_Q4_K;
    // Q6_K: a scale per column and half step (16 positions, one `mma`'s
    // k), the first in `d`, the second in `m`.
    static constexpr bool HALVES = TYPE == GGML_Q6_K;
    // Decoded to f16 as they are loaded (quant_codes.cuh).
    static constexpr bool CODED = TYPE == GGML_Q5_1 || TYPE == GGML_IQ4_NL || TYPE == GGML_Q2_K ||
                                  TYPE == GGML_Q3_K || TYPE == GGML_Q5_K || TYPE == GGML_IQ4_XS;
    static constexpr bool BF = TYPE == GGML_BF16 || TYPE == GGML_F32;
    static constexpr int A_PARTS = BF ? 2 : 1;
    static constexpr int B_PARTS = TYPE == GGML_F32 ? 2 : 1;
};

// Shared memory of one block (see `gemm_shared_bytes`), in slots: one per
// stage and warp group (`stage * groups + group`, `groups` the block's warp
// groups). A tiles, B tiles, then per slot d[GM_BN], m[GM_BN] and the
// activation block sums xs[GM_BM]; last, once, `wide[GM_BM + 1]`: whether
// each activation row holds a value beyond f16's range, then whether any
// does.
template <unsigned int TYPE>
struct GemmSmem {
    unsigned short* a;  // [slots][A_PARTS][GM_BM * GM_PITCH]
    unsigned short* b;  // [slots][B_PARTS][GM_BN * GM_PITCH]
    float* d;           // [slots][GM_BN]
    float* m;           // [slots][GM_BN]
    float* xs;          // [slots][GM_BM]
    unsigned int* wide; // [GM_BM + 1]
    __device__ GemmSmem(unsigned char* base, unsigned int groups) {
        typedef GemmTraits<TYPE> T;
        const unsigned int slots = 2 * groups;
        a = reinterpret_cast<unsigned short*>(base);
        b = a + slots * T::A_PARTS * GM_BM * GM_PITCH;
        d = reinterpret_cast<float*>(b + slots * T::B_PARTS * GM_BN * GM_PITCH);
        m = d + slots * GM_BN;
        xs = m + slots * GM_BN;
        wide = reinterpret_cast<unsigned int*>(xs + slots * GM_BM);
    }
    __device__ unsigned short* a_tile(int stage, int part) const {
        return a + (stage * GemmTraits<TYPE>::A_PARTS + part) * GM_BM * GM_PITCH;
    }
    __device__ unsigned short* b_tile(int stage, int part) const {
        return b + (stage * GemmTraits<TYPE>::B_PARTS + part) * GM_BN * GM_PITCH;
    }
};

// Activations of step `k0` (positions k0..k0+32) of rows m0.. into registers.
// VEC: x is 16-byte aligned and k a multiple of 4.
template <bool VEC>
__device__ __forceinline__ void gemm_load_x(const float* __restrict__ x, const MatmulShape& s, unsigned int m0,
                                            unsigned int k0, unsigned int tid, GemmStage& st) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int row = m0 + tid / 8 + 16 * i, col = k0 + 4 * (tid % 8);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (row < s.rows) {
            const float* p = x + (size_t)row * s.k + col;
            if (VEC && col < s.k) {
                v = *reinterpret_cast<const float4*>(p);
            } else {
                if (col < s.k) v.x = p[0];
                if (col + 1 < s.k) v.y = p[1];
                if (col + 2 < s.k) v.z = p[2];
                if (col + 3 < s.k) v.w = p[3];
            }
        }
        st.x[i] = v;
    }
}

// Weights of step `k0` of weight rows n0.. into registers. Coded types:
// thread tid takes weights 16h..16h+16 (h = tid % 2) of row tid / 2,
// decoded and rounded to f16 pairs, in w[0..8]. Quantized: thread
// tid takes half tid % 2 of the block of row tid / 2 (Q4: codes bytes
// 8h..8h+8 as two words; Q8_0: code bytes 16h..16h+16 as four words) and
// its head (Q5_0, Q4_K and Q6_K as the loads below say). F16/BF16: rows (tid + 128 i) / 4, 8 elements at 8 (tid % 4) as a
// uint4, i < 2. F32: rows (tid + 128 i) / 8, 4 elements at 4 (tid % 8), i < 4.
// VEC (float weights): w is 16-byte aligned and k a multiple of 8 (F16,
// BF16) or 4 (F32).
template <unsigned int TYPE, bool VEC>
__device__ __forceinline__ void gemm_load_w(const unsigned char* __restrict__ w, const MatmulShape& s,
                                            unsigned long long row_bytes, unsigned int n0, unsigned int k0,
                                            unsigned int tid, GemmStage& st) {
    if (GemmTraits<TYPE>::CODED) {
        const unsigned int row = n0 + tid / 2, h = tid % 2;
#pragma unroll
        for (int i = 0; i < 8; ++i) st.w[i] = 0u;
        if (row >= s.n || k0 >= s.k) return;
        const unsigned char* r = w + row * row_bytes;
        float f[16];
        dequant8<TYPE>(r, k0 + 16 * h, f);
        dequant8<TYPE>(r, k0 + 16 * h + 8, f + 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) st.w[i] = pack_f16(f[2 * i], f[2 * i + 1]);
    } else if (GemmTraits<TYPE>::QUANT) {
        const unsigned int row = n0 + tid / 2, h = tid % 2;
#pragma unroll
        for (int i = 0; i < 9; ++i) st.w[i] = 0u;
        st.head = 0u;
        if (row >= s.n || k0 >= s.k) return;
        const unsigned char* blk = w + row * row_bytes;
        if (TYPE == GGML_Q4_K) {
            // The super-block's head (d and dmin, then the 12 bytes of
            // scales and minimums) in w[4..8], the step's sub-block in
            // `head`, and its codes 16h..16h+16 (one nibble each) in w[0..4].
            const unsigned int j = (k0 % 256) / 32;
            const unsigned int* sb = reinterpret_cast<const unsigned int*>(blk + (size_t)(k0 / 256) * 144);
            st.head = j;
#pragma unroll
            for (int i = 0; i < 4; ++i) st.w[4 + i] = sb[i];
            const unsigned int* qs = sb + (16 + 32 * (j / 2) + 16 * h) / 4;
#pragma unroll
            for (int i = 0; i < 4; ++i) st.w[i] = qs[i];
        } else if (TYPE == GGML_Q6_K) {
            // Weights 16h..16h+16 of sub-block j = 4 c + s (weight 128 c +
            // 32 s + l): low bits in ql[64 c + 32 (s % 2) + l] (w[0..4]; high
            // nibbles for s >= 2), high bits in qh[32 c + l] from bit 2 s
            // (w[4..8]); the sub-block in `head`, d and the scales of
            // groups 2 j and 2 j + 1 in w[8].
            const unsigned int j = (k0 % 256) / 32, c = j / 4, sub = j % 4;
            const unsigned char* sb = blk + (size_t)(k0 / 256) * 210;
            const unsigned short* ql = reinterpret_cast<const unsigned short*>(sb + 64 * c + 32 * (sub % 2) + 16 * h);
            const unsigned short* qh = reinterpret_cast<const unsigned short*>(sb + 128 + 32 * c + 16 * h);
            st.head = j;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                st.w[i] = (unsigned int)ql[2 * i] | ((unsigned int)ql[2 * i + 1] << 16);
                st.w[4 + i] = (unsigned int)qh[2 * i] | ((unsigned int)qh[2 * i + 1] << 16);
            }
            st.w[8] = (unsigned int)*reinterpret_cast<const unsigned short*>(sb + 208) |
                      ((unsigned int)*reinterpret_cast<const unsigned short*>(sb + 192 + 2 * j) << 16);
        } else if (TYPE == GGML_Q5_0) {
            // d, the fifth bits (w[2]), and code bytes 8h..8h+8 (w[0..2]).
            const unsigned short* p = reinterpret_cast<const unsigned short*>(blk + (size_t)(k0 / 32) * 22);
            st.head = p[0];
            st.w[2] = (unsigned int)p[1] | ((unsigned int)p[2] << 16);
            st.w[0] = (unsigned int)p[3 + 4 * h] | ((unsigned int)p[4 + 4 * h] << 16);
            st.w[1] = (unsigned int)p[5 + 4 * h] | ((unsigned int)p[6 + 4 * h] << 16);
        } else if (TYPE == GGML_Q4_1) {
            blk += (size_t)(k0 / 32) * 20;
            st.head = *reinterpret_cast<const unsigned int*>(blk);
            st.w[0] = *reinterpret_cast<const unsigned int*>(blk + 4 + 8 * h);
            st.w[1] = *reinterpret_cast<const unsigned int*>(blk + 8 + 8 * h);
        } else {
            const unsigned int bytes = TYPE == GGML_Q4_0 ? 18 : 34, words = TYPE == GGML_Q4_0 ? 2 : 4;
            blk += (size_t)(k0 / 32) * bytes;
            const unsigned short* p = reinterpret_cast<const unsigned short*>(blk);
            st.head = p[0];
            const unsigned short* c = p + 1 + 2 * words * h;
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (i < words) st.w[i] = (unsigned int)c[2 * i] | ((unsigned int)c[2 * i + 1] << 16);
        }
    } else {
        const int elems = TYPE == GGML_F32 ? 4 : 8, per_row = GM_BK / elems, count = GM_BN * per_row / GM_THREADS;
        const unsigned int size = TYPE == GGML_F32 ? 4 : 2;
#pragma unroll
        for (int i = 0; i < count; ++i) {
            const unsigned int e = tid + GM_THREADS * i, row = n0 + e / per_row, col = k0 + elems * (e % per_row);
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (row < s.n) {
                const unsigned char* p = w + ((size_t)row * s.k + col) * size;
                if (VEC && col < s.k) {
                    v = *reinterpret_cast<const uint4*>(p);
                } else if (TYPE == GGML_F32) {
                    const unsigned int* f = reinterpret_cast<const unsigned int*>(p);
                    if (col < s.k) v.x = f[0];
                    if (col + 1 < s.k) v.y = f[1];
                    if (col + 2 < s.k) v.z = f[2];
                    if (col + 3 < s.k) v.w = f[3];
                } else {
                    const unsigned short* f = reinterpret_cast<const unsigned short*>(p);
                    unsigned int u[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                    for (int t = 0; t < 8; ++t)
                        if (col + t < s.k) u[t / 2] |= (unsigned int)f[t] << (16 * (t % 2));
                    v = make_uint4(u[0], u[1], u[2], u[3]);
                }
            }
            st.w[4 * i] = v.x;
            st.w[4 * i + 1] = v.y;
            st.w[4 * i + 2] = v.z;
            st.w[4 * i + 3] = v.w;
        }
    }
}

// The largest f16: an activation beyond it would round to infinity.
#define GM_F16_MAX 65504.f

// Converts the registers of a step into shared stage `stage`. An
// activation row with a value beyond f16's range is marked in `sm.wide`.
template <unsigned int TYPE>
__device__ __forceinline__ void gemm_store(const GemmSmem<TYPE>& sm, int stage, unsigned int tid, const GemmStage& st) {
    typedef GemmTraits<TYPE> T;
    // Activations.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int row = tid / 8 + 16 * i, at = row * GM_PITCH + 4 * (tid % 8);
        if (T::BF) {
            uint2 hi, lo;
            unsigned int h[2], l[2];
            split4_bf16(st.x[i], h, l);
            hi = make_uint2(h[0], h[1]);
            lo = make_uint2(l[0], l[1]);
            *reinterpret_cast<uint2*>(sm.a_tile(stage, 0) + at) = hi;
            *reinterpret_cast<uint2*>(sm.a_tile(stage, 1) + at) = lo;
        } else {
            const float4 v = st.x[i];
            if (fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))) > GM_F16_MAX) {
                sm.wide[row] = 1u;
                sm.wide[GM_BM] = 1u;
            }
            const unsigned int p0 = pack_f16(v.x, v.y), p1 = pack_f16(v.z, v.w);
            *reinterpret_cast<uint2*>(sm.a_tile(stage, 0) + at) = make_uint2(p0, p1);
            if (T::MIN) {
                // The row's block sum of the f16 activations: eight threads share a row.
                float sum = (f16_to_f32((f16_bits)(p0 & 0xffffu)) + f16_to_f32((f16_bits)(p0 >> 16)))
                    + (f16_to_f32((f16_bits)(p1 & 0xffffu)) + f16_to_f32((f16_bits)(p1 >> 16)));
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                sum += __shfl_xor_sync(0xffffffffu, sum, 4);
                if (tid % 8 == 0) sm.xs[stage * GM_BM + row] = sum;
            }
        }
    }
    // Weights.
    if (T::QUANT) {
        const unsigned int row = tid / 2, h = tid % 2;
        unsigned short* dst = sm.b_tile(stage, 0) + row * GM_PITCH;
        unsigned int v[8];
        if (TYPE == GGML_Q8_0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) int8_f16(st.w[i], v + 2 * i);
            *reinterpret_cast<uint4*>(dst + 16 * h) = make_uint4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<uint4*>(dst + 16 * h + 8) = make_uint4(v[4], v[5], v[6], v[7]);
        } else if (TYPE == GGML_Q4_K) {
            // Weights 16h..16h+16 of the sub-block, one nibble a byte.
            const unsigned int shift = 4 * (st.head % 2);
#pragma unroll
            for (int i = 0; i < 4; ++i) bytes_f16((st.w[i] >> shift) & 0x0f0f0f0fu, 0x64006400u, v + 2 * i);
            *reinterpret_cast<uint4*>(dst + 16 * h) = make_uint4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<uint4*>(dst + 16 * h + 8) = make_uint4(v[4], v[5], v[6], v[7]);
        } else if (TYPE == GGML_Q6_K) {
            // Weights 16h..16h+16 of the sub-block, six bits each; q - 32.
            const unsigned int sub = st.head % 4, shift = sub >= 2 ? 4 : 0;
#pragma unroll
            for (int i = 0; i < 4; ++i)
                bytes_f16(((st.w[i] >> shift) & 0x0f0f0f0fu) | (((st.w[4 + i] >> (2 * sub)) & 0x03030303u) << 4),
                          0x64206420u, v + 2 * i);
            *reinterpret_cast<uint4*>(dst + 16 * h) = make_uint4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<uint4*>(dst + 16 * h + 8) = make_uint4(v[4], v[5], v[6], v[7]);
        } else if (TYPE == GGML_Q5_0) {
            // Byte j of the codes holds weight j (low nibble) and j + 16
            // (high), their fifth bits bits j and j + 16 of qh: codes
            // 8h..8h+8 and 16+8h..; q - 16.
            const unsigned int qh = st.w[2], bias = 0x64106410u;
            bytes_f16((st.w[0] & 0x0f0f0f0fu) | fifth_bits4(qh, 2 * h), bias, v);
            bytes_f16((st.w[1] & 0x0f0f0f0fu) | fifth_bits4(qh, 2 * h + 1), bias, v + 2);
            bytes_f16(((st.w[0] >> 4) & 0x0f0f0f0fu) | fifth_bits4(qh, 4 + 2 * h), bias, v + 4);
            bytes_f16(((st.w[1] >> 4) & 0x0f0f0f0fu) | fifth_bits4(qh, 5 + 2 * h), bias, v + 6);
            *reinterpret_cast<uint4*>(dst + 8 * h) = make_uint4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<uint4*>(dst + 16 + 8 * h) = make_uint4(v[4], v[5], v[6], v[7]);
        } else {
            // Byte j of the codes holds weight j (low nibble) and j + 16 (high).
            const unsigned int bias = TYPE == GGML_Q4_0 ? 0x64086408u : 0x64006400u;
            nibbles_f16<false>(st.w[0], bias, v);
            nibbles_f16<false>(st.w[1], bias, v + 2);
            nibbles_f16<true>(st.w[0], bias, v + 4);
            nibbles_f16<true>(st.w[1], bias, v + 6);
            *reinterpret_cast<uint4*>(dst + 8 * h) = make_uint4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<uint4*>(dst + 16 + 8 * h) = make_uint4(v[4], v[5], v[6], v[7]);
        }
        if (TYPE == GGML_Q6_K) {
            // The scale of the thread's 16 weights (group 2 j + h): d sc.
            const float d = f16_to_f32((f16_bits)(st.w[8] & 0xffffu));
            const float sc = (float)(signed char)((st.w[8] >> (16 + 8 * h)) & 0xffu);
            (h == 0 ? sm.d : sm.m)[stage * GM_BN + row] = __fmul_rn(d, sc);
        } else if (h == 0) {
            if (TYPE == GGML_Q4_K) {
                // Sub-block j's 6-bit scale and minimum (as decode8 takes
                // them) times d and dmin: weight d sc q - dmin mn.
                const unsigned int j = st.head;
                const unsigned int a = scale_byte(st.w, j % 4), b = scale_byte(st.w, j % 4 + 4);
                const unsigned int c = scale_byte(st.w, j % 4 + 8);
                const unsigned int sc = j < 4 ? a & 63u : (c & 15u) | ((a >> 6) << 4);
                const unsigned int mn = j < 4 ? b & 63u : (c >> 4) | ((b >> 6) << 4);
                sm.d[stage * GM_BN + row] = __fmul_rn(f16_to_f32((f16_bits)(st.w[4] & 0xffffu)), (float)sc);
                sm.m[stage * GM_BN + row] = -__fmul_rn(f16_to_f32((f16_bits)(st.w[4] >> 16)), (float)mn);
            } else {
                sm.d[stage * GM_BN + row] = f16_to_f32((f16_bits)(st.head & 0xffffu));
                sm.m[stage * GM_BN + row] = TYPE == GGML_Q4_1 ? f16_to_f32((f16_bits)(st.head >> 16)) : 0.f;
            }
        }
    } else if (T::CODED) {
        unsigned short* dst = sm.b_tile(stage, 0) + (tid / 2) * GM_PITCH + 16 * (tid % 2);
        *reinterpret_cast<uint4*>(dst) = make_uint4(st.w[0], st.w[1], st.w[2], st.w[3]);
        *reinterpret_cast<uint4*>(dst + 8) = make_uint4(st.w[4], st.w[5], st.w[6], st.w[7]);
    } else if (TYPE == GGML_F32) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int e = tid + GM_THREADS * i, at = (e / 8) * GM_PITCH + 4 * (e % 8);
            const float4 f = make_float4(__uint_as_float(st.w[4 * i]), __uint_as_float(st.w[4 * i + 1]),
                                         __uint_as_float(st.w[4 * i + 2]), __uint_as_float(st.w[4 * i + 3]));
            unsigned int h[2], l[2];
            split4_bf16(f, h, l);
            *reinterpret_cast<uint2*>(sm.b_tile(stage, 0) + at) = make_uint2(h[0], h[1]);
            *reinterpret_cast<uint2*>(sm.b_tile(stage, 1) + at) = make_uint2(l[0], l[1]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const unsigned int e = tid + GM_THREADS * i, at = (e / 4) * GM_PITCH + 8 * (e % 4);
            *reinterpret_cast<uint4*>(sm.b_tile(stage, 0) + at) =
                make_uint4(st.w[4 * i], st.w[4 * i + 1], st.w[4 * i + 2], st.w[4 * i + 3]);
        }
    }
}

// Folds a step's products `part` into `acc` with the columns' scales
// `scale` (and, with minimums, `sm.m` times the rows' block sums), then
// clears `part`. Thread (g, t) = (lane / 4, lane % 4) holds rows g and g + 8
// and columns 2t and 2t + 1 of each m16n8 tile.
template <unsigned int TYPE>
__device__ __forceinline__ void gemm_fold(const GemmSmem<TYPE>& sm, int stage, const float* scale, unsigned int lane,
                                          unsigned int wm, unsigned int wn, float (*part)[4][4],
                                          float (*acc)[4][4]) {
    typedef GemmTraits<TYPE> T;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const unsigned int col = wn * 32 + nt * 8 + 2 * (lane % 4);
        const float d0 = scale[stage * GM_BN + col], d1 = scale[stage * GM_BN + col + 1];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            float* c = acc[mt][nt];
            float* p = part[mt][nt];
            if (T::MIN) {
                const unsigned int row = wm * 32 + mt * 16 + lane / 4;
                const float m0 = sm.m[stage * GM_BN + col], m1 = sm.m[stage * GM_BN + col + 1];
                const float s0 = sm.xs[stage * GM_BM + row], s1 = sm.xs[stage * GM_BM + row + 8];
                c[0] += fmaf(d0, p[0], m0 * s0);
                c[1] += fmaf(d1, p[1], m1 * s0);
                c[2] += fmaf(d0, p[2], m0 * s1);
                c[3] += fmaf(d1, p[3], m1 * s1);
            } else {
                c[0] = fmaf(d0, p[0], c[0]);
                c[1] = fmaf(d1, p[1], c[1]);
                c[2] = fmaf(d0, p[2], c[2]);
                c[3] = fmaf(d1, p[3], c[3]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) p[i] = 0.f;
        }
    }
}

// The warp's products of shared stage `stage` into `acc` (see the kernel's doc).
template <unsigned int TYPE>
__device__ __forceinline__ void gemm_multiply(const GemmSmem<TYPE>& sm, int stage, unsigned int lane,
                                              unsigned int wm, unsigned int wn, float (*acc)[4][4]) {
    typedef GemmTraits<TYPE> T;
    float part[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) part[i][j][c] = 0.f;
#pragma unroll
    for (int kk = 0; kk < GM_BK; kk += 16) {
        unsigned int a[T::A_PARTS][2][4], b[T::B_PARTS][4][2];
#pragma unroll
        for (int p = 0; p < T::A_PARTS; ++p)
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const unsigned int row = wm * 32 + mt * 16 + (lane % 16), col = kk + 8 * (lane / 16);
                ldmatrix_x4(encore_smem_addr(sm.a_tile(stage, p) + row * GM_PITCH + col), a[p][mt]);
            }
#pragma unroll
        for (int p = 0; p < T::B_PARTS; ++p)
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                const unsigned int row = wn * 32 + np * 16 + (lane % 8) + 8 * (lane / 16);
                const unsigned int col = kk + 8 * ((lane / 8) % 2);
                unsigned int r[4];
                ldmatrix_x4(encore_smem_addr(sm.b_tile(stage, p) + row * GM_PITCH + col), r);
                b[p][2 * np][0] = r[0];
                b[p][2 * np][1] = r[1];
                b[p][2 * np + 1][0] = r[2];
                b[p][2 * np + 1][1] = r[3];
            }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                // Quantized weights: the step's products apart, scaled below.
                float* c = T::QUANT ? part[mt][nt] : acc[mt][nt];
                mma16816<T::BF>(c, a[0][mt], b[0][nt][0], b[0][nt][1]);
                if (T::A_PARTS == 2) mma16816<T::BF>(c, a[T::A_PARTS - 1][mt], b[0][nt][0], b[0][nt][1]);
                if (T::B_PARTS == 2) {
                    mma16816<T::BF>(c, a[0][mt], b[T::B_PARTS - 1][nt][0], b[T::B_PARTS - 1][nt][1]);
                    mma16816<T::BF>(c, a[T::A_PARTS - 1][mt], b[T::B_PARTS - 1][nt][0], b[T::B_PARTS - 1][nt][1]);
                }
            }
        // Q6_K: each half step has its own scales.
        if (T::HALVES) gemm_fold<TYPE>(sm, stage, kk == 0 ? sm.d : sm.m, lane, wm, wn, part, acc);
    }
    if (T::QUANT && !T::HALVES) gemm_fold<TYPE>(sm, stage, sm.d, lane, wm, wn, part, acc);
}

template <unsigned int TYPE, bool VEC>
__device__ void gemm_tiles(const unsigned char* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                           const MatmulShape& s, unsigned char* smem) {
    typedef GemmTraits<TYPE> T;
    // Warp group `group` takes positions 32 group..+32 of each step of
    // 32 groups; `tid` is the thread's index within its group.
    const unsigned int groups = blockDim.x / GM_THREADS;
    const GemmSmem<TYPE> sm(smem, groups);
    const unsigned int group = threadIdx.x / GM_THREADS, tid = threadIdx.x % GM_THREADS;
    const unsigned int lane = tid & 31u, warp = tid >> 5;
    const unsigned int wm = warp / 2, wn = warp % 2;
    const unsigned int m0 = blockIdx.y * GM_BM, n0 = blockIdx.x * GM_BN;
    const unsigned long long row_bytes = ggml_row_bytes(s.dtype, s.k);
    const unsigned int step_k = GM_BK * groups, steps = (s.k + step_k - 1) / step_k;
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    // No row is wide until a step finds it so (published by the barrier).
    if (!T::BF && threadIdx.x <= GM_BM) sm.wide[threadIdx.x] = 0u;
    if (!T::BF) __syncthreads();

    GemmStage st;
    gemm_load_x<VEC>(x, s, m0, GM_BK * group, tid, st);
    gemm_load_w<TYPE, VEC>(w, s, row_bytes, n0, GM_BK * group, tid, st);
    gemm_store<TYPE>(sm, group, tid, st);
    __syncthreads();
    for (unsigned int step = 0; step < steps; ++step) {
        const int slot = (step & 1) * groups + group, next = ((step + 1) & 1) * groups + group;
        const bool more = step + 1 < steps;
        if (more) {
            const unsigned int k0 = (step + 1) * step_k + GM_BK * group;
            gemm_load_x<VEC>(x, s, m0, k0, tid, st);
            gemm_load_w<TYPE, VEC>(w, s, row_bytes, n0, k0, tid, st);
        }
        gemm_multiply<TYPE>(sm, slot, lane, wm, wn, acc);
        if (more) gemm_store<TYPE>(sm, next, tid, st);
        __syncthreads();
    }
    if (groups > 1) {
        // The other groups' sums join the first's through shared memory
        // (free now: the loop ended on a barrier), fragment by fragment, in
        // the groups' order.
        float* red = reinterpret_cast<float*>(smem);
        if (group > 0) {
            float* mine = red + (group - 1) * 32 * GM_THREADS;
#pragma unroll
            for (int i = 0; i < 32; ++i) mine[i * GM_THREADS + tid] = acc[i / 16][(i / 4) % 4][i % 4];
        }
        __syncthreads();
        if (group == 0)
            for (unsigned int g = 1; g < groups; ++g) {
                const float* theirs = red + (g - 1) * 32 * GM_THREADS;
#pragma unroll
                for (int i = 0; i < 32; ++i) acc[i / 16][(i / 4) % 4][i % 4] += theirs[i * GM_THREADS + tid];
            }
    }
    // The first group stores the tile; the others go on to gemm()'s barrier.
    if (group > 0) return;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const unsigned int row = m0 + wm * 32 + mt * 16 + lane / 4;
            const unsigned int col = n0 + wn * 32 + nt * 8 + 2 * (lane % 4);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned int r = row + 8 * h;
                if (r < s.rows) {
                    if (col < s.n) y[(size_t)r * s.n + col] = acc[mt][nt][2 * h];
                    if (col + 1 < s.n) y[(size_t)r * s.n + col + 1] = acc[mt][nt][2 * h + 1];
                }
            }
        }
}

// Whether the activations went to f16 (F16 and quantized weights), so that
// gemm() looks for rows beyond f16's range.
template <unsigned int TYPE>
__device__ __forceinline__ bool gemm_typed(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                           float* __restrict__ y, const MatmulShape& s, unsigned char* smem) {
    bool vec = ((size_t)x & 15u) == 0 && s.k % 4 == 0;
    if (TYPE == GGML_F16 || TYPE == GGML_BF16) vec = vec && ((size_t)w & 15u) == 0 && s.k % 8 == 0;
    if (TYPE == GGML_F32) vec = vec && ((size_t)w & 15u) == 0;
    if (vec) gemm_tiles<TYPE, true>(w, x, y, s, smem);
    else gemm_tiles<TYPE, false>(w, x, y, s, smem);
    return !GemmTraits<TYPE>::BF;
}

extern "C" __global__ void __launch_bounds__(GM_MAX_GROUPS * GM_THREADS, 1)
gemm(const unsigned char* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, MatmulShape s) {
    extern __shared__ uint4 gm_smem[];
    // The weights are read-only: ask for this block's rows in L2 while the
    // previous kernel finishes.
    const unsigned long long row_bytes = ggml_row_bytes(s.dtype, s.k);
    const unsigned int n0 = blockIdx.x * GM_BN;
    if (n0 < s.n) {
        const unsigned long long begin = (unsigned long long)w + n0 * row_bytes;
        const unsigned long long end = (unsigned long long)w + min(s.n, n0 + GM_BN) * row_bytes;
        for (unsigned long long a = (begin & ~127ull) + 128ull * threadIdx.x; a < end; a += 128ull * blockDim.x)
            encore_prefetch_l2((const void*)a);
    }
    encore_grid_wait();
    unsigned char* smem = reinterpret_cast<unsigned char*>(gm_smem);
    bool f16 = false;
    switch (s.dtype) {
        GGML_CASE(GGML_Q4_1) f16 = gemm_typed<GGML_Q4_1>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q4_0) f16 = gemm_typed<GGML_Q4_0>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q8_0) f16 = gemm_typed<GGML_Q8_0>(w, x, y, s, smem); break;
        GGML_CASE(GGML_F16) f16 = gemm_typed<GGML_F16>(w, x, y, s, smem); break;
        GGML_CASE(GGML_BF16) f16 = gemm_typed<GGML_BF16>(w, x, y, s, smem); break;
        GGML_CASE(GGML_F32) f16 = gemm_typed<GGML_F32>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q5_0) f16 = gemm_typed<GGML_Q5_0>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q5_1) f16 = gemm_typed<GGML_Q5_1>(w, x, y, s, smem); break;
        GGML_CASE(GGML_IQ4_NL) f16 = gemm_typed<GGML_IQ4_NL>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q2_K) f16 = gemm_typed<GGML_Q2_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q3_K) f16 = gemm_typed<GGML_Q3_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q4_K) f16 = gemm_typed<GGML_Q4_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q5_K) f16 = gemm_typed<GGML_Q5_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q6_K) f16 = gemm_typed<GGML_Q6_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_IQ4_XS) f16 = gemm_typed<GGML_IQ4_XS>(w, x, y, s, smem); break;
        default: break;
    }
    if (f16) {
        // Rows with an activation beyond f16's range, marked as the tiles
        // were loaded (the layout of the marks is every f16 type's), get
        // their outputs again in f32, over what the tile stored.
        __syncthreads();
        const unsigned int* wide = GemmSmem<GGML_Q4_0>(smem, blockDim.x / GM_THREADS).wide;
        if (wide[GM_BM]) wide_rows_f32(wide, GM_BM, GM_BN, w, x, y, s, row_bytes, blockIdx.y * GM_BM, n0);
    }
}
