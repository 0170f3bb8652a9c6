// GGUF data on the device, shared by every kernel that reads GGUF blocks or
// converts halves: half and bfloat16 conversions, the ggml type ids and row
// sizes, and ggml's exponential, SiLU and a warp sum.
//
// NVRTC finds no `cuda_fp16.h` without an include path to a CUDA toolkit,
// so halves are carried as their 16 bits and converted with PTX `cvt`
// (f16 to f32 exactly; f32 to f16 rounding to nearest even, like the
// `half` crate). A bfloat16 is the top half of an f32.

typedef unsigned short f16_bits;
typedef unsigned short bf16_bits;

__device__ __forceinline__ float f16_to_f32(f16_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16_bits f32_to_f16(float f) {
    f16_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The value an f32 takes once stored as f16.
__device__ __forceinline__ float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }



__device__ __forceinline__ float bf16_to_f32(bf16_bits b) {
    return __uint_as_float((unsigned int)b << 16);
}

#define GGML_F32 0u
#define GGML_F16 1u
#define GGML_Q4_0 2u
#define GGML_Q4_1 3u
#define GGML_Q5_0 6u
#define GGML_Q5_1 7u
#define GGML_Q8_0 8u
#define GGML_Q2_K 10u
#define GGML_Q3_K 11u
#define GGML_Q4_K 12u
#define GGML_Q5_K 13u
#define GGML_Q6_K 14u
#define GGML_IQ4_NL 20u
#define GGML_IQ4_XS 23u
#define GGML_BF16 30u

// Which ggml types a kernel carries code for: every type, unless compiled
// with ENCORE_TYPE_MASK (bit t for type t), as a variant specialized for a
// shape is, with its weights' types, and a generic kernel built for one
// model's types. A dispatch on the type writes each case as
// `GGML_CASE(GGML_Q4_K) statement`: for a type left out, the case traps
// instead of running the statement (a device error, never a silent zero:
// the launch side refuses such a type first), and the compiler drops that
// type's code. Without the mask, NVRTC optimizes the code of every type
// before the shape's constants fold the dispatch away, which costs most of
// a specialized variant's compile time.
#ifndef ENCORE_TYPE_MASK
#define ENCORE_TYPE_MASK 0xffffffffu
#endif
#define GGML_USES(t) ((ENCORE_TYPE_MASK >> (t)) & 1u)
#define GGML_CASE(t) case t: if (!GGML_USES(t)) __trap(); else

// Q5_0, Q5_1, IQ4_NL and the super-block types (quant_codes.cuh).
__device__ __forceinline__ bool ggml_coded(unsigned int dtype) {
    return dtype == GGML_Q5_0 || dtype == GGML_Q5_1 || dtype == GGML_IQ4_NL || dtype == GGML_Q2_K ||
           dtype == GGML_Q3_K || dtype == GGML_Q4_K || dtype == GGML_Q5_K || dtype == GGML_Q6_K ||
           dtype == GGML_IQ4_XS;
}

__device__ __forceinline__ bool ggml_quantized(unsigned int dtype) {
    return dtype == GGML_Q4_0 || dtype == GGML_Q4_1 || dtype == GGML_Q8_0 || ggml_coded(dtype);
}

// Bytes of one row of `k` elements of a ggml type (0 for an unknown type).
__device__ __forceinline__ unsigned long long ggml_row_bytes(unsigned int dtype, unsigned int k) {
    switch (dtype) {
        case GGML_F32: return 4ull * k;
        case GGML_F16: case GGML_BF16: return 2ull * k;
        case GGML_Q8_0: return 34ull * (k / 32);
        case GGML_Q4_0: return 18ull * (k / 32);
        case GGML_Q4_1: return 20ull * (k / 32);
        case GGML_Q5_0: return 22ull * (k / 32);
        case GGML_Q5_1: return 24ull * (k / 32);
        case GGML_IQ4_NL: return 18ull * (k / 32);
        case GGML_Q2_K: return 84ull * (k / 256);
        case GGML_Q3_K: return 110ull * (k / 256);
        case GGML_Q4_K: return 144ull * (k / 256);
        case GGML_Q5_K: return 176ull * (k / 256);
        case GGML_Q6_K: return 210ull * (k / 256);
        case GGML_IQ4_XS: return 136ull * (k / 256);
        default: return 0;
    }
}

// e^x as ggml's AVX2 `ggml_v_expf` computes it (see the CPU's `ggml_expf`):
// the same fused multiply-adds in the same order, so the same bits.
__device__ __forceinline__ float ggml_expf(float x) {
    const float shift = __uint_as_float(0x4b400000u), log2e = __uint_as_float(0x3fb8aa3bu);
    const float ln2_hi = __uint_as_float(0x3f317200u), ln2_lo = __uint_as_float(0x35bfbe8eu);
    const float c0 = __uint_as_float(0x3c072010u), c1 = __uint_as_float(0x3d2b9f17u);
    const float c2 = __uint_as_float(0x3e2aaf33u), c3 = __uint_as_float(0x3efffedbu);
    const float c4 = __uint_as_float(0x3f7ffff6u);
    const float z = fmaf(x, log2e, shift);
    const float n = __fsub_rn(z, shift);
    const float b = fmaf(-n, ln2_lo, fmaf(-n, ln2_hi, x));
    const unsigned int e = __float_as_uint(z) << 23;
    const float k = __uint_as_float(e + __float_as_uint(1.0f));
    const float u = __fmul_rn(b, b);
    const float j = fmaf(fmaf(fmaf(c0, b, c1), u, fmaf(c2, b, c3)), u, __fmul_rn(c4, b));
    if (fabsf(n) <= 126.0f) return fmaf(k, j, k);
    const unsigned int g = n <= 0.0f ? 0x82000000u : 0u;
    const float s1 = __uint_as_float(g + 0x7f000000u);
    const float s2 = __uint_as_float(e - g);
    if (fabsf(n) > 192.0f) return __fmul_rn(s1, s1);
    return __fmul_rn(fmaf(s2, j, s2), s1);
}

// silu(v) = v / (1 + e^-v), as the CPU computes it.
__device__ __forceinline__ float silu(float v) { return v / __fadd_rn(1.0f, ggml_expf(-v)); }

// Byte `i` (0..3) of `word`, an integer from 0 to 255, minus `bias` (an
// integer), as a float, exactly: the byte becomes the low mantissa bits of
// 2^23 (one byte permute) and 2^23 + bias is subtracted. The decode
// products convert every weight code this way: Hopper's conversion
// instructions (I2F) issue at a quarter of the rate of the permute and the
// add, and were the busiest unit of the products.
__device__ __forceinline__ float byte_minus(unsigned int word, unsigned int i, float bias) {
    return __int_as_float(__byte_perm(word, 0x4b000000u, 0x7440u | i)) - (8388608.0f + bias);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
