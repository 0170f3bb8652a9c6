// The weight types whose kernels decode eight weights at a time: Q5_0, Q5_1
// and IQ4_NL (blocks of 32) and the super-block types Q2_K, Q3_K, Q4_K,
// Q5_K, Q6_K and IQ4_XS (256 weights a block; dtype.rs and cpu/kquant.rs say
// where each weight's bits lie). ggml_coded() (gguf.cuh) names them.
//
// `decode8` reads the eight consecutive weights of a row from element `e`
// on (a multiple of 8, so one group of a block) as integers: codes `q`, the
// group's scale `sc` and minimum `mn`, and the block's f16 fields `d` and
// `m`. Weight `i` is then, as the CPU dequantizes it (unfused, so the same
// bits): blocks of 32 `d q` (Q5_1: `d q + m`); super-blocks
// `(d sc) q - m mn`, `m` the block's `dmin` (0 without minimums). The
// integers are the CPU's: Q5_0's `q - 16`, Q6_K's `q - 32`, Q3_K's `q - 4`
// where the high bit is clear, the IQ4 levels, and Q3_K's and IQ4_XS's
// scales minus 32. Bytes are read one at a time: GGUF blocks of these types
// are 18 to 210 bytes, most of them only 2-byte aligned.

#include "gguf.cuh"

struct Codes8 {
    int q[8];
    int sc, mn;
    float d, m;
};

__device__ __forceinline__ float f16_at(const unsigned char* p) {
    return f16_to_f32((f16_bits)(p[0] | (p[1] << 8)));
}

// Four bytes from `p` on as a little-endian word.
__device__ __forceinline__ unsigned int bytes4(const unsigned char* p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) | ((unsigned int)p[3] << 24);
}

// The IQ4 levels (-127..113) of the four nibbles in the bytes of `n` (each
// byte 0..15), as four signed bytes: `prmt` picks each byte from the eight
// levels of the nibble's half of the table.
__device__ __forceinline__ unsigned int iq4_levels4(unsigned int n) {
    const unsigned int t = (n & 0x07070707u) | ((n & 0x07070707u) >> 4);
    const unsigned int sel = (t & 0xffu) | ((t >> 8) & 0xff00u);
    unsigned int lo, hi;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(lo) : "r"(0xbfad9881u), "r"(0xf6eaddcfu), "r"(sel));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(hi) : "r"(0x26190d01u), "r"(0x71594535u), "r"(sel));
    const unsigned int upper = ((n >> 3) & 0x01010101u) * 0xffu;
    return (lo & ~upper) | (hi & upper);
}

// Bits `4j..4j+4` of `bits` moved to bit 4 of each of four bytes (the
// multiply puts copies of the four bits 7 apart, which never carry into
// each other: bit i lands on bit 4 + 8i).
__device__ __forceinline__ unsigned int fifth_bits4(unsigned int bits, unsigned int j) {
    return (((bits >> (4 * j)) & 15u) * 0x02040810u) & 0x10101010u;
}

// Bytes of a block of Q5_0, Q5_1 or IQ4_NL.
__device__ __forceinline__ unsigned int coded32_bytes(unsigned int dtype) {
    return dtype == GGML_Q5_0 ? 22 : dtype == GGML_Q5_1 ? 24 : 18;
}

// Blocks of 32 (Q5_0, Q5_1 or IQ4_NL, `dtype`): the integer codes of
// weights `4j..4j+4` (j < 8) of the block at `blk`, as four signed bytes.
__device__ __forceinline__ unsigned int codes4(unsigned int dtype, const unsigned char* blk, unsigned int j) {
    const unsigned int qs = dtype == GGML_Q5_0 ? 6 : dtype == GGML_Q5_1 ? 8 : 2;
    const unsigned int nib = (bytes4(blk + qs + 4 * (j & 3)) >> (j >= 4 ? 4 : 0)) & 0x0f0f0f0fu;
    if (dtype == GGML_IQ4_NL) return iq4_levels4(nib);
    const unsigned int high = fifth_bits4(bytes4(blk + (dtype == GGML_Q5_0 ? 2 : 4)), j);
    // Q5_0: q - 16, i.e. the nibble where the fifth bit is set, else the
    // nibble with its byte's top four bits set.
    if (dtype == GGML_Q5_0) return nib | ((~high & 0x10101010u) * 15u);
    return nib | high;
}

template <unsigned int TYPE>
__device__ __forceinline__ void decode8(const unsigned char* __restrict__ row, unsigned int e, Codes8& c) {
    c.sc = 1;
    c.mn = 0;
    c.m = 0.f;
    if (TYPE == GGML_Q5_0 || TYPE == GGML_Q5_1 || TYPE == GGML_IQ4_NL) {
        const unsigned char* blk = row + (size_t)(e / 32) * coded32_bytes(TYPE);
        const unsigned int j = (e % 32) / 4;
        const unsigned int a = codes4(TYPE, blk, j), b = codes4(TYPE, blk, j + 1);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            c.q[t] = (int)(signed char)(a >> (8 * t));
            c.q[4 + t] = (int)(signed char)(b >> (8 * t));
        }
        c.d = f16_at(blk);
        if (TYPE == GGML_Q5_1) c.m = f16_at(blk + 2);
        return;
    }
    const unsigned int bytes = TYPE == GGML_Q2_K   ? 84
                             : TYPE == GGML_Q3_K   ? 110
                             : TYPE == GGML_Q4_K   ? 144
                             : TYPE == GGML_Q5_K   ? 176
                             : TYPE == GGML_Q6_K   ? 210
                                                   : 136;
    const unsigned char* blk = row + (size_t)(e / 256) * bytes;
    const unsigned int i = e % 256;
    // For the types laid out in halves of 128: weight 128h + 32s + l.
    const unsigned int h = i / 128, s = (i % 128) / 32, l = i % 32, g = i / 16;
    if (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
        const unsigned int c64 = i / 64, hi = (i % 64) / 32, j = i / 32;
        const unsigned char* sc = blk + 4;
        if (j < 4) {
            c.sc = sc[j] & 63;
            c.mn = sc[j + 4] & 63;
        } else {
            c.sc = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
            c.mn = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        const unsigned char* qs = blk + (TYPE == GGML_Q5_K ? 48 : 16) + 32 * c64 + l;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            int q = hi ? qs[t] >> 4 : qs[t] & 15;
            if (TYPE == GGML_Q5_K) q |= ((blk[16 + l + t] >> (2 * c64 + hi)) & 1) << 4;
            c.q[t] = q;
        }
        c.d = f16_at(blk);
        c.m = f16_at(blk + 2);
    } else if (TYPE == GGML_Q6_K) {
        const unsigned char* ql = blk + 64 * h + 32 * (s % 2) + l;
        const unsigned char* qh = blk + 128 + 32 * h + l;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const int low = (ql[t] >> (s >= 2 ? 4 : 0)) & 15;
            c.q[t] = (low | (((qh[t] >> (2 * s)) & 3) << 4)) - 32;
        }
        c.sc = (signed char)blk[192 + g];
        c.d = f16_at(blk + 208);
    } else if (TYPE == GGML_Q2_K) {
        const unsigned char* qs = blk + 16 + 32 * h + l;
#pragma unroll
        for (int t = 0; t < 8; ++t) c.q[t] = (qs[t] >> (2 * s)) & 3;
        c.sc = blk[g] & 15;
        c.mn = blk[g] >> 4;
        c.d = f16_at(blk + 80);
        c.m = f16_at(blk + 82);
    } else if (TYPE == GGML_Q3_K) {
        const unsigned char* qs = blk + 32 + 32 * h + l;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const int low = (qs[t] >> (2 * s)) & 3;
            c.q[t] = ((blk[l + t] >> (4 * h + s)) & 1) ? low : low - 4;
        }
        const unsigned char* sc = blk + 96;
        const int low = g < 8 ? sc[g] & 15 : sc[g - 8] >> 4;
        const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
        c.sc = (low | (high << 4)) - 32;
        c.d = f16_at(blk + 108);
    } else {
        // IQ4_XS: sub-block b of 32 is IQ4_NL's layout in qs[16b..16b + 16].
        const unsigned int b = i / 32, j = i % 32;
        const unsigned char* qs = blk + 8 + 16 * b + (j & 15);
        const unsigned int shift = j >= 16 ? 4 : 0;
        const unsigned int a = iq4_levels4((bytes4(qs) >> shift) & 0x0f0f0f0fu);
        const unsigned int z = iq4_levels4((bytes4(qs + 4) >> shift) & 0x0f0f0f0fu);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            c.q[t] = (int)(signed char)(a >> (8 * t));
            c.q[4 + t] = (int)(signed char)(z >> (8 * t));
        }
        const int low = (blk[4 + b / 2] >> (4 * (b % 2))) & 15;
        const int high = (((unsigned int)blk[2] | ((unsigned int)blk[3] << 8)) >> (2 * b)) & 3;
        c.sc = (low | (high << 4)) - 32;
        c.d = f16_at(blk);
    }
}

// Weight `t` of a decoded group as f32, formed as the CPU forms it.
template <unsigned int TYPE>
__device__ __forceinline__ float coded_weight(const Codes8& c, int t) {
    if (TYPE == GGML_Q5_1) return __fadd_rn(__fmul_rn(c.d, (float)c.q[t]), c.m);
    if (TYPE == GGML_Q5_0 || TYPE == GGML_IQ4_NL) return __fmul_rn(c.d, (float)c.q[t]);
    return __fsub_rn(__fmul_rn(__fmul_rn(c.d, (float)c.sc), (float)c.q[t]), __fmul_rn(c.m, (float)c.mn));
}

// The eight weights from element `e` on as f32.
template <unsigned int TYPE>
__device__ __forceinline__ void dequant8(const unsigned char* __restrict__ row, unsigned int e, float* w) {
    Codes8 c;
    decode8<TYPE>(row, e, c);
#pragma unroll
    for (int t = 0; t < 8; ++t) w[t] = coded_weight<TYPE>(c, t);
}

// dequant8 for a type known at run time (one of ggml_coded's).
__device__ __forceinline__ void dequant8_any(unsigned int dtype, const unsigned char* __restrict__ row,
                                             unsigned int e, float* w) {
    switch (dtype) {
        GGML_CASE(GGML_Q5_0) dequant8<GGML_Q5_0>(row, e, w); break;
        GGML_CASE(GGML_Q5_1) dequant8<GGML_Q5_1>(row, e, w); break;
        GGML_CASE(GGML_IQ4_NL) dequant8<GGML_IQ4_NL>(row, e, w); break;
        GGML_CASE(GGML_Q2_K) dequant8<GGML_Q2_K>(row, e, w); break;
        GGML_CASE(GGML_Q3_K) dequant8<GGML_Q3_K>(row, e, w); break;
        GGML_CASE(GGML_Q4_K) dequant8<GGML_Q4_K>(row, e, w); break;
        GGML_CASE(GGML_Q5_K) dequant8<GGML_Q5_K>(row, e, w); break;
        GGML_CASE(GGML_Q6_K) dequant8<GGML_Q6_K>(row, e, w); break;
        GGML_CASE(GGML_IQ4_XS) dequant8<GGML_IQ4_XS>(row, e, w); break;
        default:
#pragma unroll
            for (int t = 0; t < 8; ++t) w[t] = 0.f;
            break;
    }
}
