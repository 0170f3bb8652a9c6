// Rotary position embedding, shared by `rope`, `rope_store` and
// `attention_step`: the shape and the rotation of one pair, as the CPU's
// `rope_head` (kernels/rope.rs) computes it.

struct RopeShape {
    unsigned int rows;
    unsigned int heads;
    unsigned int head_dim;
    unsigned int rope_dim;
    float base;
    unsigned int neox;
    float theta_scale;
    unsigned int factors;  // 1: `rope` divides each angle by its factor
};

// glibc's single-precision sine and cosine (the algorithm of Arm's
// optimized routines, which glibc has used since 2.28), which the CPU's
// `f32::sin_cos` calls, so that CUDA rotates by the CPU's very values: the
// angle in double, reduced by pi/2 (one fused multiply-add below 120, the
// 4/pi table's fixed-point product above), then degree-4 (sine) or 5
// (cosine) polynomials. Every `a * b + c` of the C source is one FMA here,
// as GCC contracts it in the FMA build x86-64 machines run. Only the
// non-negative finite angles RoPE makes are handled.
struct GlibcSinCos {
    double c0, c1, c2, c3, c4, s1, s2, s3;
};

// The polynomials; the second computes -cos (the sign of quadrants 2 and 3).
__device__ const GlibcSinCos glibc_sincos_poly[2] = {
    {0x1p0, -0x1.ffffffd0c621cp-2, 0x1.55553e1068f19p-5, -0x1.6c087e89a359dp-10, 0x1.99343027bf8c3p-16,
     -0x1.555545995a603p-3, 0x1.1107605230bc4p-7, -0x1.994eb3774cf24p-13},
    {-0x1p0, 0x1.ffffffd0c621cp-2, -0x1.55553e1068f19p-5, 0x1.6c087e89a359dp-10, -0x1.99343027bf8c3p-16,
     -0x1.555545995a603p-3, 0x1.1107605230bc4p-7, -0x1.994eb3774cf24p-13},
};

// 4/pi to 192 bits, 8 new bits an entry.
__device__ const unsigned int glibc_inv_pio4[24] = {
    0xa2u, 0xa2f9u, 0xa2f983u, 0xa2f9836eu, 0xf9836e4eu, 0x836e4e44u, 0x6e4e4415u, 0x4e441529u,
    0x441529fcu, 0x1529fc27u, 0x29fc2757u, 0xfc2757d1u, 0x2757d1f5u, 0x57d1f534u, 0xd1f534ddu, 0xf534ddc0u,
    0x34ddc0dbu, 0xddc0db62u, 0xc0db6295u, 0xdb629599u, 0x6295993cu, 0x95993c43u, 0x993c4390u, 0x3c439041u,
};

// Sine (even n) or cosine (odd n) of the reduced angle x, x2 = x * x.
__device__ __forceinline__ float glibc_sincos_eval(double x, double x2, const GlibcSinCos& p, int n) {
    if ((n & 1) == 0) {
        const double x3 = __dmul_rn(x, x2);
        const double s1 = __fma_rn(x2, p.s3, p.s2);
        const double x7 = __dmul_rn(x3, x2);
        const double s = __fma_rn(x3, p.s1, x);
        return __double2float_rn(__fma_rn(x7, s1, s));
    }
    const double x4 = __dmul_rn(x2, x2);
    const double c2 = __fma_rn(x2, p.c4, p.c3);
    const double c1 = __fma_rn(x2, p.c1, p.c0);
    const double x6 = __dmul_rn(x4, x2);
    const double c = __fma_rn(x4, p.c2, c1);
    return __double2float_rn(__fma_rn(x6, c2, c));
}

__device__ __forceinline__ void glibc_sincosf(float y, float& sn, float& cs) {
    const unsigned int top = (__float_as_uint(y) >> 20) & 0x7ffu;
    double x = (double)y;
    if (top < ((__float_as_uint(0x1.921FB6p-1f) >> 20) & 0x7ffu)) {  // below pi/4
        if (top < ((__float_as_uint(0x1p-12f) >> 20) & 0x7ffu)) {
            sn = y;
            cs = 1.0f;
            return;
        }
        const double x2 = __dmul_rn(x, x);
        sn = glibc_sincos_eval(x, x2, glibc_sincos_poly[0], 0);
        cs = glibc_sincos_eval(x, x2, glibc_sincos_poly[0], 1);
        return;
    }
    int n;
    if (top < ((__float_as_uint(120.0f) >> 20) & 0x7ffu)) {
        // 2/pi scaled by 2^24: the quadrant, rounded, in bits 24..31.
        const double r = __dmul_rn(x, 0x1.45F306DC9C883p+23);
        n = ((int)r + 0x800000) >> 24;
        x = __fma_rn(-(double)n, 0x1.921FB54442D18p0, x);
    } else {
        unsigned int xi = __float_as_uint(y);
        const unsigned int* arr = &glibc_inv_pio4[(xi >> 26) & 15u];
        const int shift = (xi >> 23) & 7;
        xi = ((xi & 0xffffffu) | 0x800000u) << shift;
        unsigned long long res0 = (unsigned long long)(xi * arr[0]);
        const unsigned long long res1 = (unsigned long long)xi * arr[4];
        const unsigned long long res2 = (unsigned long long)xi * arr[8];
        res0 = (res2 >> 32) | (res0 << 32);
        res0 += res1;
        const unsigned long long q = (res0 + (1ull << 61)) >> 62;
        res0 -= q << 62;
        n = (int)q;
        x = __dmul_rn((double)(long long)res0, 0x1.921FB54442D18p-62);
    }
    const double sign = (n & 3) == 1 || (n & 3) == 2 ? -1.0 : 1.0;
    const GlibcSinCos& p = glibc_sincos_poly[(n & 2) ? 1 : 0];
    const double xs = __dmul_rn(x, sign), x2 = __dmul_rn(x, x);
    sn = glibc_sincos_eval(xs, x2, p, n);
    cs = glibc_sincos_eval(xs, x2, p, n ^ 1);
}

// The angle of pair `i` at position `p`: `theta = p * theta_scale^i` by
// the CPU's f32 recurrence.
__device__ __forceinline__ float rope_theta(const RopeShape& s, unsigned int i, unsigned int p) {
    float theta = (float)p;
    for (unsigned int t = 0; t < i; ++t) theta = __fmul_rn(theta, s.theta_scale);
    return theta;
}

// The angle's sine and cosine, the CPU's values.
__device__ __forceinline__ void rope_angle(const RopeShape& s, unsigned int i, unsigned int p, float& sn, float& cs) {
    glibc_sincosf(rope_theta(s, i, p), sn, cs);
}

// The angle's sine and cosine from CUDA's `sincosf`, within an ulp or two
// of the CPU's and cheaper: for the decode step's fused `attention_step`,
// whose latency every token waits for (glibc's double-precision reduction
// there lengthens every step) and which the exact kernels do not use.
__device__ __forceinline__ void rope_angle_fast(const RopeShape& s, unsigned int i, unsigned int p, float& sn,
                                                float& cs) {
    sincosf(rope_theta(s, i, p), &sn, &cs);
}

// The element indices of rotated pair `i` of a head.
__device__ __forceinline__ void rope_index(const RopeShape& s, unsigned int i, unsigned int& ia, unsigned int& ib) {
    ia = s.neox ? i : 2 * i;
    ib = s.neox ? i + s.rope_dim / 2 : 2 * i + 1;
}

// The pair (a, b) rotated by the angle with sine `sn` and cosine `cs`.
__device__ __forceinline__ float2 rope_apply(float a, float b, float sn, float cs) {
    return make_float2(fmaf(a, cs, -__fmul_rn(b, sn)), fmaf(a, sn, __fmul_rn(b, cs)));
}

// Pair `i` of a head: its element indices, and the pair rotated by the
// angle with sine `sn` and cosine `cs`.
__device__ __forceinline__ float2 rope_rotate(const RopeShape& s, unsigned int i, float sn, float cs, const float* h,
                                              unsigned int& ia, unsigned int& ib) {
    rope_index(s, i, ia, ib);
    return rope_apply(h[ia], h[ib], sn, cs);
}

// Pair `i` of a head at position `p`: its element indices, and the pair
// rotated as the CPU's `rope_head` rotates it.
__device__ __forceinline__ float2 rope_pair(const RopeShape& s, unsigned int i, unsigned int p, const float* h,
                                            unsigned int& ia, unsigned int& ib) {
    float sn, cs;
    rope_angle(s, i, p, sn, cs);
    return rope_rotate(s, i, sn, cs, h, ia, ib);
}
