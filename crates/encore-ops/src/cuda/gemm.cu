// `gemm`: matrix products of many activation rows on tensor cores (CUDA
// prefill), the product `matmul` computes, tiled.
//
// Arguments (as `matmul`): `w: dtype[n, k]` (read, raw GGUF blocks),
// `x: f32[rows, k]` (read), `y: f32[rows, n]` (write), `MatmulShape s`
// (value). `y[r, j] = Σ_i w[j, i] x[r, i]`, the weights exact, the
// activations rounded to f16 (F16 and quantized weights) or split into two
// bf16 parts (BF16 and F32 weights); see kernels/gemm.rs for the precision.
//
// One block of `gemm_threads` threads per tile of GM_BM activation rows by
// GM_BN outputs, walking `k` in steps of one GGUF block (32 positions) per
// warp group: with two groups (all but BF16 and F32 weights) each multiplies
// every other block into its own accumulators, which meet in shared memory
// at the end; two warps per scheduler then hide each other's latencies.
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
// in as `acc += d_j p + m_j Σ_block x_r` with the column's scale and (Q4_1)
// minimum and the row's block sum of the f16 activations. Rows, columns and
// (float weights) positions past the matrix are zero in shared memory and
// never stored.
//
// The types of quant_codes.cuh (Q5_0, Q5_1, IQ4_NL, the super-blocks) enter
// as F16 weights do: each thread decodes its 16 weights of a step to f32 as
// the CPU dequantizes them and rounds them to f16 (one decoder for all of
// them; Q2_K, Q3_K and Q6_K change scales every 16 positions, within a
// step, so a block's scale after its products would not do).

#include "gguf.cuh"
#include "quant_codes.cuh"
#include "mma.cuh"
#include "matmul_shape.cuh"

// GM_BM (activation rows a tile), GM_BN (output columns a tile), GM_PITCH
// (16-bit elements a tile row: 32 and 8 of padding) and GM_THREADS (threads
// of a warp group) come from Rust, prepended to this source
// (cuda/geometry.rs). A step is one GGUF block of positions.
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

// The low (HI false) or high nibbles of the four bytes of `q` as two f16
// pairs, bytes (0, 1) and (2, 3), each value minus `bias`: `0x6400 | n` is
// the f16 1024 + n, so subtracting the f16 pair `bias2` (1024 + bias) leaves
// n - bias exactly.
template <bool HI>
__device__ __forceinline__ void nibbles_f16(unsigned int q, unsigned int bias2, unsigned int* out) {
    const unsigned int b01 = byte_perm(q, 0u, 0x4140u), b23 = byte_perm(q, 0u, 0x4342u);
    out[0] = sub_f16x2((((HI ? b01 >> 4 : b01) & 0x000f000fu) | 0x64006400u), bias2);
    out[1] = sub_f16x2((((HI ? b23 >> 4 : b23) & 0x000f000fu) | 0x64006400u), bias2);
}

// The four signed bytes of `q` as two f16 pairs: (q + 128) | 0x6400 is
// 1024 + 128 + q; subtracting 1152 (0x6480) leaves q exactly.
__device__ __forceinline__ void int8_f16(unsigned int q, unsigned int* out) {
    const unsigned int b01 = byte_perm(q, 0u, 0x4140u), b23 = byte_perm(q, 0u, 0x4342u);
    out[0] = sub_f16x2(((b01 ^ 0x00800080u) | 0x64006400u), 0x64806480u);
    out[1] = sub_f16x2(((b23 ^ 0x00800080u) | 0x64006400u), 0x64806480u);
}

// One thread's share of a step, between its global loads and its shared stores.
struct GemmStage {
    float4 x[4];           // activations: rows tid / 8 + 16 i, positions 4 (tid % 8)..+4
    unsigned int w[16];    // weights: raw words (layout per type, see gemm_load_w)
    unsigned int head;     // a GGUF block's d (and m) bits
};

template <unsigned int TYPE>
struct GemmTraits {
    static constexpr bool QUANT = TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1 || TYPE == GGML_Q8_0;
    // Decoded to f16 as they are loaded (quant_codes.cuh).
    static constexpr bool CODED = TYPE == GGML_Q5_0 || TYPE == GGML_Q5_1 || TYPE == GGML_IQ4_NL ||
                                  TYPE == GGML_Q2_K || TYPE == GGML_Q3_K || TYPE == GGML_Q4_K ||
                                  TYPE == GGML_Q5_K || TYPE == GGML_Q6_K || TYPE == GGML_IQ4_XS;
    static constexpr bool BF = TYPE == GGML_BF16 || TYPE == GGML_F32;
    static constexpr int A_PARTS = BF ? 2 : 1;
    static constexpr int B_PARTS = TYPE == GGML_F32 ? 2 : 1;
    // Warp groups of GM_THREADS threads, each taking one GGUF block of a step.
    static constexpr int GROUPS = BF ? 1 : 2;
};

// Shared memory of one block (see `gemm_shared_bytes`), in slots: one per
// stage and warp group (`stage * GROUPS + group`). A tiles, B tiles, then per slot d[GM_BN], m[GM_BN] and the
// activation block sums xs[GM_BM].
template <unsigned int TYPE>
struct GemmSmem {
    static constexpr int SLOTS = 2 * GemmTraits<TYPE>::GROUPS;
    unsigned short* a;  // [SLOTS][A_PARTS][GM_BM * GM_PITCH]
    unsigned short* b;  // [SLOTS][B_PARTS][GM_BN * GM_PITCH]
    float* d;           // [SLOTS][GM_BN]
    float* m;           // [SLOTS][GM_BN]
    float* xs;          // [SLOTS][GM_BM]
    __device__ explicit GemmSmem(unsigned char* base) {
        typedef GemmTraits<TYPE> T;
        a = reinterpret_cast<unsigned short*>(base);
        b = a + SLOTS * T::A_PARTS * GM_BM * GM_PITCH;
        d = reinterpret_cast<float*>(b + SLOTS * T::B_PARTS * GM_BN * GM_PITCH);
        m = d + SLOTS * GM_BN;
        xs = m + SLOTS * GM_BN;
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
// its head. F16/BF16: rows (tid + 128 i) / 4, 8 elements at 8 (tid % 4) as a
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
        for (int i = 0; i < 4; ++i) st.w[i] = 0u;
        st.head = 0u;
        if (row >= s.n || k0 >= s.k) return;
        const unsigned char* blk = w + row * row_bytes;
        if (TYPE == GGML_Q4_1) {
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

// Converts the registers of a step into shared stage `stage`.
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
            const unsigned int p0 = pack_f16(st.x[i].x, st.x[i].y), p1 = pack_f16(st.x[i].z, st.x[i].w);
            *reinterpret_cast<uint2*>(sm.a_tile(stage, 0) + at) = make_uint2(p0, p1);
            if (TYPE == GGML_Q4_1) {
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
        if (h == 0) {
            sm.d[stage * GM_BN + row] = f16_to_f32((f16_bits)(st.head & 0xffffu));
            sm.m[stage * GM_BN + row] = TYPE == GGML_Q4_1 ? f16_to_f32((f16_bits)(st.head >> 16)) : 0.f;
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
    }
    if (T::QUANT) {
        // Thread (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 and
        // columns 2t and 2t + 1 of each m16n8 tile.
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const unsigned int col = wn * 32 + nt * 8 + 2 * (lane % 4);
            const float d0 = sm.d[stage * GM_BN + col], d1 = sm.d[stage * GM_BN + col + 1];
            const float m0 = sm.m[stage * GM_BN + col], m1 = sm.m[stage * GM_BN + col + 1];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const unsigned int row = wm * 32 + mt * 16 + lane / 4;
                float s0 = 0.f, s1 = 0.f;
                if (TYPE == GGML_Q4_1) {
                    s0 = sm.xs[stage * GM_BM + row];
                    s1 = sm.xs[stage * GM_BM + row + 8];
                }
                float* c = acc[mt][nt];
                const float* p = part[mt][nt];
                if (TYPE == GGML_Q4_1) {
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
            }
        }
    }
}

template <unsigned int TYPE, bool VEC>
__device__ void gemm_tiles(const unsigned char* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                           const MatmulShape& s, unsigned char* smem) {
    typedef GemmTraits<TYPE> T;
    const GemmSmem<TYPE> sm(smem);
    // Warp group `group` takes positions 32 group..+32 of each step of
    // 32 GROUPS; `tid` is the thread's index within its group.
    const unsigned int group = threadIdx.x / GM_THREADS, tid = threadIdx.x % GM_THREADS;
    const unsigned int lane = tid & 31u, warp = tid >> 5;
    const unsigned int wm = warp / 2, wn = warp % 2;
    const unsigned int m0 = blockIdx.y * GM_BM, n0 = blockIdx.x * GM_BN;
    const unsigned long long row_bytes = ggml_row_bytes(s.dtype, s.k);
    const unsigned int step_k = GM_BK * T::GROUPS, steps = (s.k + step_k - 1) / step_k;
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    GemmStage st;
    gemm_load_x<VEC>(x, s, m0, GM_BK * group, tid, st);
    gemm_load_w<TYPE, VEC>(w, s, row_bytes, n0, GM_BK * group, tid, st);
    gemm_store<TYPE>(sm, group, tid, st);
    __syncthreads();
    for (unsigned int step = 0; step < steps; ++step) {
        const int slot = (step & 1) * T::GROUPS + group, next = ((step + 1) & 1) * T::GROUPS + group;
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
    if (T::GROUPS == 2) {
        // The second group's sums join the first's through shared memory
        // (free now: the loop ended on a barrier), fragment by fragment.
        float* red = reinterpret_cast<float*>(smem);
        if (group == 1) {
#pragma unroll
            for (int i = 0; i < 32; ++i) red[i * GM_THREADS + tid] = acc[i / 16][(i / 4) % 4][i % 4];
        }
        __syncthreads();
        if (group == 1) return;
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i / 16][(i / 4) % 4][i % 4] += red[i * GM_THREADS + tid];
    }

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

template <unsigned int TYPE>
__device__ __forceinline__ void gemm_typed(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                           float* __restrict__ y, const MatmulShape& s, unsigned char* smem) {
    bool vec = ((size_t)x & 15u) == 0 && s.k % 4 == 0;
    if (TYPE == GGML_F16 || TYPE == GGML_BF16) vec = vec && ((size_t)w & 15u) == 0 && s.k % 8 == 0;
    if (TYPE == GGML_F32) vec = vec && ((size_t)w & 15u) == 0;
    if (vec) gemm_tiles<TYPE, true>(w, x, y, s, smem);
    else gemm_tiles<TYPE, false>(w, x, y, s, smem);
}

extern "C" __global__ void __launch_bounds__(2 * GM_THREADS, 2)
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
    switch (s.dtype) {
        GGML_CASE(GGML_Q4_1) gemm_typed<GGML_Q4_1>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q4_0) gemm_typed<GGML_Q4_0>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q8_0) gemm_typed<GGML_Q8_0>(w, x, y, s, smem); break;
        GGML_CASE(GGML_F16) gemm_typed<GGML_F16>(w, x, y, s, smem); break;
        GGML_CASE(GGML_BF16) gemm_typed<GGML_BF16>(w, x, y, s, smem); break;
        GGML_CASE(GGML_F32) gemm_typed<GGML_F32>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q5_0) gemm_typed<GGML_Q5_0>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q5_1) gemm_typed<GGML_Q5_1>(w, x, y, s, smem); break;
        GGML_CASE(GGML_IQ4_NL) gemm_typed<GGML_IQ4_NL>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q2_K) gemm_typed<GGML_Q2_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q3_K) gemm_typed<GGML_Q3_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q4_K) gemm_typed<GGML_Q4_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q5_K) gemm_typed<GGML_Q5_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_Q6_K) gemm_typed<GGML_Q6_K>(w, x, y, s, smem); break;
        GGML_CASE(GGML_IQ4_XS) gemm_typed<GGML_IQ4_XS>(w, x, y, s, smem); break;
        default: break;
    }
}
