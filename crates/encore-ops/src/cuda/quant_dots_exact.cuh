// The quantized products of the exact version of `matmul` and `fused_matmul`
// (see matmul_dots.cuh for what each version defines), which give the CPU's
// results bit for bit: `dot_cols_quant` quantizes the activations to 8-bit
// blocks exactly as `cpu::quantize_row_q8` does and adds the blocks' integer
// products in the order of the CPU's AVX2 code (see there).
//
// Greedy decoding on a small quantized model is chaotic: one ulp of
// difference in any product flips some 8-bit quantization step downstream
// and, within a few tokens, the text; bit-identical products are part of
// what keeps CUDA's text the CPU's (and so llama.cpp's). They cost time
// (every row is quantized and summed in the CPU's order): the default
// version is faster (BENCHMARKS.md, "Bit-identical quantized products on
// CUDA").
//
// Q5_0, Q5_1 and IQ4_NL go through dot_cols_quant as Q4_0 and Q4_1 do (the
// CPU multiplies all types in blocks of 32 alike), as one instance,
// GGML_CODED32: their codes are decoded to signed bytes as they are loaded,
// the type told apart at run time, and the offset term `m s_x` is zero
// without a minimum. The super-block types go through dot_cols_super,
// which quantizes the activations to Q8_K as `cpu::quantize_row_q8_k` does
// and adds each super-block's integer sums as `kquant::accumulate` does.

#include "matmul_dots.cuh"
#include "quant_codes.cuh"

// Blocks in each of the four chunks of a pass of dot_cols_quant
// (SmolLM2's longest rows, 1536 values or 48 blocks, take one pass). The
// generic code, compiled for no shape in particular, takes shorter passes:
// its loops unroll for every chunk length up to QCHUNK, several times over.
#ifdef ENCORE_VALUE_WORDS
#define QCHUNK 12
#else
#define QCHUNK 4
#endif
// Several activation rows of quantized weights go row by row through dot_cols.
#define MM_QUANT_BY_COLUMN 1
// The instance of dot_cols_quant for Q5_0, Q5_1 and IQ4_NL (not a ggml id),
// and whether the kernel carries code for any of them (see GGML_CASE).
#define GGML_CODED32 0x10000u
#define GGML_USES_CODED32 (GGML_USES(GGML_Q5_0) || GGML_USES(GGML_Q5_1) || GGML_USES(GGML_IQ4_NL))

// Only float weights come here (quantized weights go through dot_cols).
template <bool NORM, int TILE>
__device__ __forceinline__ void dot_row(unsigned int dtype, const unsigned char* __restrict__ row,
                                        const float* __restrict__ x, const float* __restrict__ g,
                                        unsigned int k, unsigned int rows, unsigned int lane, bool x16,
                                        bool vec_float, float* acc, float* sq) {
    dot_row_float<NORM, TILE>(dtype, row, x, g, k, rows, lane, x16, vec_float, acc, sq);
}

// The signed 4-byte dot product a · b + c.
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// RMSNorm's scale from the row's sum of squares (in f64), as the CPU's
// `rms_norm_row` computes it: `1 / sqrt(f32(sum / k) + eps)`.
__device__ __forceinline__ float rms_scale(double sum, unsigned int k, float eps) {
    const float mean = (float)(sum / (double)(k > 0 ? k : 1));
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
}

// Quantizes the lane's four activations of a 32-value block as the CPU's
// `quantize_row_q8` does (the block's eight lanes, `lane & 7`, share its
// values): `q` the four codes as signed bytes, `dx` the scale and `sx` the
// scaled code sum, both rounded through f16 (where f16 holds them).
__device__ __forceinline__ void quantize4(const float* v, int& q, float& dx, float& sx) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float id = amax != 0.f ? __fdiv_rn(127.f, amax) : 0.f;
    int sum = 0;
    q = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = __float2int_rn(__fmul_rn(v[i], id));
        sum += c;
        q |= (c & 0xff) << (8 * i);
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float d = __fdiv_rn(amax, 127.f);
    // As the CPU's `block_scales`: both through f16, or where f16 cannot
    // hold one (and no code came from a NaN), the scale as f16 holds it
    // (else f32) and the sum that times Σq.
    dx = round_f16(d);
    sx = round_f16(__fmul_rn(d, (float)sum));
    if ((isinf(dx) || isinf(sx)) && !isinf(d) && sum >= -127 * 32 && sum <= 127 * 32) {
        dx = isinf(dx) ? d : dx;
        sx = __fmul_rn(dx, (float)sum);
    }
}

// The weight words of one pass of dot_cols_quant over N rows: for each
// block of the lane's chunk, each row's scale word (Q4_1: d and m) and the
// lane's four code bytes (Q4: the bytes whose low or high nibbles are its
// weights), and with a norm folded in, the lane's norm weights.
template <int N>
struct QuantPass {
    unsigned int head[N][QCHUNK], code[N][QCHUNK];
    float g[QCHUNK][4];
};

// Blocks in each of the four chunks of the pass that starts at block `base`.
__device__ __forceinline__ unsigned int quant_chunk(unsigned int nb, unsigned int base) {
    return min((unsigned int)QCHUNK, (nb - base + 3) / 4);
}

// Block `i` of the lane's chunk, clamped into the row; `live` says whether it lies in it.
__device__ __forceinline__ unsigned int quant_block(unsigned int nb, unsigned int base, unsigned int chunk,
                                                    unsigned int lane, int i, bool& live) {
    const unsigned int b = base + (lane >> 3) * chunk + i;
    live = b < nb;
    return live ? b : nb - 1;
}

// Loads the weight words of the pass from block `base` on (`dtype` tells
// the types of GGML_CODED32 apart).
template <unsigned int TYPE, int N>
__device__ __forceinline__ void quant_pass_load(const unsigned char* const* rows, unsigned int nb, unsigned int base,
                                                unsigned int lane, QuantPass<N>& w, unsigned int dtype) {
    const unsigned int chunk = quant_chunk(nb, base), l = lane & 7u;
#pragma unroll
    for (int i = 0; i < QCHUNK; ++i) {
        if ((unsigned int)i >= chunk) break;
        bool live;
        const unsigned int b = quant_block(nb, base, chunk, lane, i, live);
#pragma unroll
        for (int c = 0; c < N; ++c) {
            if (TYPE == GGML_Q4_1) {
                const unsigned char* blk = rows[c] + (size_t)b * 20;
                w.head[c][i] = *reinterpret_cast<const unsigned int*>(blk);
                w.code[c][i] = *reinterpret_cast<const unsigned int*>(blk + 4 + 4 * (l & 3));
            } else if (TYPE == GGML_Q4_0) {
                const unsigned short* h = reinterpret_cast<const unsigned short*>(rows[c] + (size_t)b * 18);
                w.head[c][i] = h[0];
                w.code[c][i] = (unsigned int)h[1 + 2 * (l & 3)] | ((unsigned int)h[2 + 2 * (l & 3)] << 16);
            } else if (TYPE == GGML_CODED32) {
                // The codes of the lane's group, decoded to signed bytes here.
                const unsigned char* blk = rows[c] + (size_t)b * coded32_bytes(dtype);
                const unsigned short* h = reinterpret_cast<const unsigned short*>(blk);
                w.head[c][i] = dtype == GGML_Q5_1 ? (unsigned int)h[0] | ((unsigned int)h[1] << 16) : h[0];
                w.code[c][i] = codes4(dtype, blk, l);
            } else {
                const unsigned short* h = reinterpret_cast<const unsigned short*>(rows[c] + (size_t)b * 34);
                w.head[c][i] = h[0];
                w.code[c][i] = (unsigned int)h[1 + 2 * l] | ((unsigned int)h[2 + 2 * l] << 16);
            }
        }
    }
}

// Loads the lane's activations of the pass from block `base` on, all of
// them before any is used (one branch on the alignment around the whole
// pass: a branch around each load would make each wait for the one before).
template <bool VEC>
__device__ __forceinline__ void quant_pass_x(const float* __restrict__ x, unsigned int nb, unsigned int base,
                                             unsigned int lane, float (*xv)[4], bool* live) {
    const unsigned int chunk = quant_chunk(nb, base);
#pragma unroll
    for (int i = 0; i < QCHUNK; ++i) {
        if ((unsigned int)i >= chunk) break;
        const unsigned int b = quant_block(nb, base, chunk, lane, i, live[i]);
        load4<VEC>(x + (size_t)b * 32 + 4 * (lane & 7u), xv[i]);
    }
}

// Loads the lane's norm weights of the pass from block `base` on.
template <bool VEC, int N>
__device__ __forceinline__ void norm_pass_load(const float* __restrict__ g, unsigned int nb, unsigned int base,
                                               unsigned int lane, QuantPass<N>& w) {
    const unsigned int chunk = quant_chunk(nb, base);
#pragma unroll
    for (int i = 0; i < QCHUNK; ++i) {
        if ((unsigned int)i >= chunk) break;
        bool live;
        const unsigned int b = quant_block(nb, base, chunk, lane, i, live);
        load4<VEC>(g + (size_t)b * 32 + 4 * (lane & 7u), w.g[i]);
    }
}

// The first pass's weight words of N rows of type `dtype`, and with a norm
// weight `g` (not null) its elements for that pass (nothing for float
// weights, which dot_cols reads itself). Weights are read-only, so a kernel
// calls this before encore_grid_wait(): the loads then overlap the previous
// kernel instead of following the wait.
template <unsigned int TYPE, int N>
__device__ __forceinline__ void quant_pass_first_of(const unsigned char* const* rows, const float* __restrict__ g,
                                                    unsigned int k, unsigned int lane, QuantPass<N>& w,
                                                    unsigned int dtype) {
    quant_pass_load<TYPE, N>(rows, k / 32, 0, lane, w, dtype);
    if (g == nullptr) return;
    if (((size_t)g & 15u) == 0) norm_pass_load<true, N>(g, k / 32, 0, lane, w);
    else norm_pass_load<false, N>(g, k / 32, 0, lane, w);
}

template <int N>
__device__ __forceinline__ void quant_pass_first(unsigned int dtype, const unsigned char* const* rows,
                                                 const float* __restrict__ g, unsigned int k, unsigned int lane,
                                                 QuantPass<N>& w) {
    switch (dtype) {
        GGML_CASE(GGML_Q4_1) quant_pass_first_of<GGML_Q4_1, N>(rows, g, k, lane, w, dtype); return;
        GGML_CASE(GGML_Q4_0) quant_pass_first_of<GGML_Q4_0, N>(rows, g, k, lane, w, dtype); return;
        GGML_CASE(GGML_Q8_0) quant_pass_first_of<GGML_Q8_0, N>(rows, g, k, lane, w, dtype); return;
        case GGML_Q5_0: case GGML_Q5_1: case GGML_IQ4_NL:
            if (!GGML_USES_CODED32) __trap();
            quant_pass_first_of<GGML_CODED32, N>(rows, g, k, lane, w, dtype);
            return;
        default: return;
    }
}

// Q4_0, Q4_1 and Q8_0: the dot products of N weight rows (`rows[c]`) with
// one activation row, bit for bit as the CPU's AVX2 code computes them
// (`cpu::dot`): with NORM the row is first normalized as `rms_norm_row`
// does (`x * scale * g`); it is quantized to 8-bit blocks as
// `quantize_row_q8` does; per block of 32 the codes' products are summed in
// integers in eight groups of four consecutive values (the CPU's eight
// vector lanes), each group's sum goes into its own f32 accumulator as
// `acc = fma(d_w * d_x, sum, acc)`, block after block in order, and the
// offset terms (`m_w * s_x`, or `-8 d_w * s_x` for Q4_0) into one more
// running sum; the result is the eight accumulators added pairwise as the
// CPU's horizontal sum adds them, plus the offsets. Every lane of the warp
// gets the results in `out`.
//
// Lane layout: lane `l + 8 p` holds the values of group `l` of every block
// of chunk `p`, four chunks of up to QCHUNK consecutive blocks a pass (a
// pass covers SmolLM2's longest rows, 1536 values, at once). All loads of a
// pass are issued before any is used, from addresses clamped into the row
// (a block past the row end repeats the last one and adds nothing), and the
// arithmetic that needs no order (quantization, integer sums, scales) runs
// on every lane at once; only the accumulation is sequential: chunk after
// chunk, each continuing from the sums the one before handed it. The first
// pass's weights come from `first` when the caller loaded them already
// (quant_pass_first), else from memory here.
template <unsigned int TYPE, bool NORM, int N>
__device__ __forceinline__ void dot_cols_quant(const unsigned char* const* rows, const float* __restrict__ x,
                                               const float* __restrict__ g, unsigned int k, float eps,
                                               unsigned int lane, bool x16, float* out, const QuantPass<N>* first,
                                               unsigned int dtype) {
    const unsigned int nb = k / 32, l = lane & 7u, part = lane >> 3;
    float scale = 1.f;
    if (NORM && nb > 4 * QCHUNK) {
        // The norm needs the whole row before the first pass: sum it apart.
        double sq = 0.0;
        for (unsigned int i = lane; i < k; i += 32) sq += (double)__fmul_rn(x[i], x[i]);
        scale = rms_scale(warp_sum_f64(sq), k, eps);
    }
    float acc[N], off[N];
#pragma unroll
    for (int c = 0; c < N; ++c) acc[c] = off[c] = 0.f;
    for (unsigned int base = 0; base < nb; base += 4 * QCHUNK) {
        const unsigned int chunk = quant_chunk(nb, base);
        QuantPass<N> w;
        if (first != nullptr && base == 0) {
            w = *first;
        } else {
            quant_pass_load<TYPE, N>(rows, nb, base, lane, w, dtype);
            if (NORM && ((size_t)g & 15u) == 0) norm_pass_load<true, N>(g, nb, base, lane, w);
            else if (NORM) norm_pass_load<false, N>(g, nb, base, lane, w);
        }
        float xv[QCHUNK][4];
        bool live[QCHUNK];
        if (x16) quant_pass_x<true>(x, nb, base, lane, xv, live);
        else quant_pass_x<false>(x, nb, base, lane, xv, live);
        if (NORM && nb <= 4 * QCHUNK) {
            double sq = 0.0;
#pragma unroll
            for (int i = 0; i < QCHUNK; ++i) {
                if ((unsigned int)i >= chunk) break;
#pragma unroll
                for (int e = 0; e < 4; ++e) sq += live[i] ? (double)__fmul_rn(xv[i][e], xv[i][e]) : 0.0;
            }
            scale = rms_scale(warp_sum_f64(sq), k, eps);
        }
        // Each block's integer sums, scales and offset terms, for every row.
        float sums[N][QCHUNK], dd[N][QCHUNK], om[N][QCHUNK];
#pragma unroll
        for (int i = 0; i < QCHUNK; ++i) {
            if ((unsigned int)i >= chunk) break;
            if (NORM) {
#pragma unroll
                for (int e = 0; e < 4; ++e) xv[i][e] = __fmul_rn(__fmul_rn(xv[i][e], scale), w.g[i][e]);
            }
            int q;
            float dx, sx;
            quantize4(xv[i], q, dx, sx);
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const float d = f16_to_f32((f16_bits)(w.head[c][i] & 0xffffu));
                unsigned int code = w.code[c][i];
                if (TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1) code = (l >= 4 ? code >> 4 : code) & 0x0f0f0f0fu;
                sums[c][i] = (float)dp4a((int)code, q, 0);
                dd[c][i] = __fmul_rn(d, dx);
                om[c][i] = TYPE == GGML_Q4_1 || TYPE == GGML_CODED32
                             ? __fmul_rn(f16_to_f32((f16_bits)(w.head[c][i] >> 16)), sx)
                         : TYPE == GGML_Q4_0 ? __fmul_rn(__fmul_rn(-8.f, d), sx)
                                             : 0.f;
            }
        }
        // The accumulation, chunk after chunk; after the last, every lane
        // takes the pass's sums of its group.
#pragma unroll 1
        for (unsigned int p = 0; p < 4; ++p) {
            if (part == p) {
#pragma unroll
                for (int i = 0; i < QCHUNK; ++i) {
                    if ((unsigned int)i >= chunk) break;
#pragma unroll
                    for (int c = 0; c < N; ++c) {
                        acc[c] = live[i] ? fmaf(dd[c][i], sums[c][i], acc[c]) : acc[c];
                        off[c] = live[i] ? __fadd_rn(off[c], om[c][i]) : off[c];
                    }
                }
            }
            const unsigned int from = p < 3 ? (lane + 24) & 31u : 24 + l;
            const bool take = p < 3 ? part == p + 1 : true;
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const float a = __shfl_sync(0xffffffffu, acc[c], from), o = __shfl_sync(0xffffffffu, off[c], from);
                acc[c] = take ? a : acc[c];
                off[c] = take ? o : off[c];
            }
        }
    }
    // The groups' sums added as the CPU's horizontal sum adds its lanes:
    // ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)), then the offsets.
#pragma unroll
    for (int c = 0; c < N; ++c) {
        float v = __fadd_rn(acc[c], __shfl_xor_sync(0xffffffffu, acc[c], 4));
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
        out[c] = __fadd_rn(__shfl_sync(0xffffffffu, v, 0), off[c]);
    }
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The super-block types: the dot products of N weight rows with one
// activation row, bit for bit as the CPU computes them (`cpu::kdot`): with
// NORM the row is first normalized as `rms_norm_row` does; each 256 values
// are quantized to Q8_K as `quantize_row_q8_k` does (the first value of
// largest magnitude maps to -128, `q = min(127, rint(x * -128 / max))`,
// `d_x = 1 / (-128 / max)`); per super-block the integer sums
// `sumi = Σ_g sc_g Σ q_w q_x` and `summ = Σ_g mn_g Σ q_x` (integers, so in
// any order) are added to the row's sum as `kquant::accumulate` does,
// `(acc + (d_w d_x) sumi) - (dmin_w d_x) summ`, super-block after
// super-block. Lane `l` takes values `8l..8l+8` of each super-block (half a
// group of 16); every lane gets the results in `out`. (Loads are scalar and
// the super-blocks go one at a time: a version per alignment, or unrolled
// super-blocks, multiply the code of six decoders in the generic kernels.)
template <unsigned int TYPE, bool NORM, int N>
__device__ __forceinline__ void dot_cols_super(const unsigned char* const* rows, const float* __restrict__ x,
                                               const float* __restrict__ g, unsigned int k, float eps,
                                               unsigned int lane, float* out) {
    float scale = 1.f;
    if (NORM) {
        double sq = 0.0;
        for (unsigned int i = lane; i < k; i += 32) sq += (double)__fmul_rn(x[i], x[i]);
        scale = rms_scale(warp_sum_f64(sq), k, eps);
    }
    float acc[N];
#pragma unroll
    for (int c = 0; c < N; ++c) acc[c] = 0.f;
#pragma unroll 1
    for (unsigned int e = 8 * lane; e < k; e += 256) {
        float v[8];
        load4<false>(x + e, v);
        load4<false>(x + e + 4, v + 4);
        if (NORM) {
            float gv[8];
            load4<false>(g + e, gv);
            load4<false>(g + e + 4, gv + 4);
#pragma unroll
            for (int t = 0; t < 8; ++t) v[t] = __fmul_rn(__fmul_rn(v[t], scale), gv[t]);
        }
        // The first value of largest magnitude: the lane's, then the warp's
        // (on equal magnitudes the lower lane, whose values come first).
        float amax = 0.f, top = 0.f;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            if (fabsf(v[t]) > amax) {
                amax = fabsf(v[t]);
                top = v[t];
            }
        }
        unsigned int owner = lane;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float a2 = __shfl_xor_sync(0xffffffffu, amax, o), t2 = __shfl_xor_sync(0xffffffffu, top, o);
            const unsigned int w2 = __shfl_xor_sync(0xffffffffu, owner, o);
            if (a2 > amax || (a2 == amax && w2 < owner)) {
                amax = a2;
                top = t2;
                owner = w2;
            }
        }
        int q[8], qsum = 0;
        float dx = 0.f;
        if (amax != 0.f) {
            const float iscale = __fdiv_rn(-128.f, top);
#pragma unroll
            for (int t = 0; t < 8; ++t) q[t] = max(-128, min(127, __float2int_rn(__fmul_rn(iscale, v[t]))));
            dx = __fdiv_rn(1.f, iscale);
        } else {
#pragma unroll
            for (int t = 0; t < 8; ++t) q[t] = 0;
        }
#pragma unroll
        for (int t = 0; t < 8; ++t) qsum += q[t];
#pragma unroll
        for (int c = 0; c < N; ++c) {
            Codes8 w;
            decode8<TYPE>(rows[c], e, w);
            int dot = 0;
#pragma unroll
            for (int t = 0; t < 8; ++t) dot += w.q[t] * q[t];
            const int sumi = warp_sum_int(w.sc * dot), summ = warp_sum_int(w.mn * qsum);
            acc[c] = __fsub_rn(__fadd_rn(acc[c], __fmul_rn(__fmul_rn(w.d, dx), (float)sumi)),
                               __fmul_rn(__fmul_rn(w.m, dx), (float)summ));
        }
    }
#pragma unroll
    for (int c = 0; c < N; ++c) out[c] = acc[c];
}

// N weight rows of type `dtype` against one activation row (decode), with
// NORM the row normalized by the norm weights `g` first: the finished dot
// products in `out` on every lane. The quantized types load the activations
// once for all rows.
template <bool NORM, int N>
__device__ __forceinline__ void dot_cols(unsigned int dtype, const unsigned char* const* rows,
                                         const float* __restrict__ x, const float* __restrict__ g, unsigned int k,
                                         float eps, unsigned int lane, bool x16, bool vec_float, float* out,
                                         const QuantPass<N>* first) {
    switch (dtype) {
        GGML_CASE(GGML_Q4_1) dot_cols_quant<GGML_Q4_1, NORM, N>(rows, x, g, k, eps, lane, x16, out, first, dtype); return;
        GGML_CASE(GGML_Q4_0) dot_cols_quant<GGML_Q4_0, NORM, N>(rows, x, g, k, eps, lane, x16, out, first, dtype); return;
        GGML_CASE(GGML_Q8_0) dot_cols_quant<GGML_Q8_0, NORM, N>(rows, x, g, k, eps, lane, x16, out, first, dtype); return;
        case GGML_Q5_0: case GGML_Q5_1: case GGML_IQ4_NL:
            if (!GGML_USES_CODED32) __trap();
            dot_cols_quant<GGML_CODED32, NORM, N>(rows, x, g, k, eps, lane, x16, out, first, dtype);
            return;
        GGML_CASE(GGML_Q2_K) dot_cols_super<GGML_Q2_K, NORM, N>(rows, x, g, k, eps, lane, out); return;
        GGML_CASE(GGML_Q3_K) dot_cols_super<GGML_Q3_K, NORM, N>(rows, x, g, k, eps, lane, out); return;
        GGML_CASE(GGML_Q4_K) dot_cols_super<GGML_Q4_K, NORM, N>(rows, x, g, k, eps, lane, out); return;
        GGML_CASE(GGML_Q5_K) dot_cols_super<GGML_Q5_K, NORM, N>(rows, x, g, k, eps, lane, out); return;
        GGML_CASE(GGML_Q6_K) dot_cols_super<GGML_Q6_K, NORM, N>(rows, x, g, k, eps, lane, out); return;
        GGML_CASE(GGML_IQ4_XS) dot_cols_super<GGML_IQ4_XS, NORM, N>(rows, x, g, k, eps, lane, out); return;
        default: dot_cols_float<NORM, N>(dtype, rows, x, g, k, eps, lane, x16, vec_float, out); return;
    }
}
