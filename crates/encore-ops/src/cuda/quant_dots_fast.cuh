// The quantized products of the default version of `matmul` and
// `fused_matmul` (see matmul_dots.cuh for what each version defines): weights
// dequantized in registers and multiplied with f32 activations, the lanes'
// partial sums meeting in a warp reduction; within the activation
// quantization error of the CPU's results, not bit for bit. With `NORM`,
// each activation is multiplied by the norm weight `g` as it is loaded and
// its square joins `sq`, so a caller can scale the finished sums by
// `1 / rms` (RMSNorm folded into the product: the scale is the same for
// every element of a row).
//
// Lane layout: in Q8_0, Q4_0 and Q4_1 four lanes share a 32-weight block,
// each taking 8 weights (Q4: bytes `4s..4s+4` of `qs`, i.e. weights
// `4s..4s+4` and `16+4s..16+4s+4`; Q5_0 in one activation row the same,
// with the fifth bits from `qh`), so a warp step covers 8 consecutive
// blocks; float weights take 8 consecutive elements a lane, 256 a step.
// Every element of a row is touched by exactly one lane. Each lane loads the
// weights of `MM_STEPS` steps into registers before using any, so that many
// loads are in flight (the products are bound by memory latency at decode
// sizes). GGUF blocks are 18, 20 or 34 bytes, so quantized weights are read
// as the widest words their alignment allows (32-bit for Q4_1, 16-bit for
// Q4_0 and Q8_0), coalesced across the warp; float weights and activations
// are read 16 bytes at a time when aligned (float rows also need a length
// that is a multiple of 8), else one element at a time.
//
// Per block: Q8_0 `d Σ q x`; Q4_0 `d (Σ n x - 8 Σ x)`; Q4_1 `d Σ n x + m Σ x`.
//
// The types of quant_codes.cuh (Q5_0, Q5_1, IQ4_NL and the super-blocks)
// go as float weights do: each lane decodes 8 consecutive weights to f32
// (the CPU's dequantized values) and multiplies them with the activations,
// 256 a warp step; several columns take one pass each (dot_cols_coded).
// Q5_0 against one activation row (decode) goes as Q4_0 does instead
// (dot_cols_quant): `d Σ (q - 16) x`, its codes formed from the nibbles
// and the fifth bits; Q4_K and Q6_K as dot_q4_k and dot_q6_k say. In these
// decode paths each code becomes a float through byte_minus (gguf.cuh), a
// byte permute and an add, not a conversion instruction: the same values,
// at four times the rate.
//
// With MM_Q8 (the end of this file), the one-row products of Q4_0, Q4_1,
// Q5_0 and Q8_0 in `fused_matmul` and in output heads take 8-bit
// activations instead, as ggml's CPU and CUDA products do.

#include "matmul_dots.cuh"
#include "quant_codes.cuh"

// Steps of 8 blocks a pass of dot_cols_quant (SmolLM2's longest rows, 1536, take one pass).
#define DOT_STEPS 6
// Several activation rows go through dot_row in tiles.
#define MM_QUANT_BY_COLUMN 0

// Q4_0 (18-byte blocks, HAS_MIN false) and Q4_1 (20-byte blocks, HAS_MIN true).
template <bool HAS_MIN, bool VEC, bool NORM, int TILE>
__device__ void dot_q4(const unsigned char* __restrict__ row, const float* __restrict__ x,
                       const float* __restrict__ g, unsigned int k, unsigned int rows, unsigned int lane,
                       float* acc, float* sq) {
    const unsigned int bytes = HAS_MIN ? 20 : 18;
    const unsigned int nb = k / 32, sub = lane & 3;
    for (unsigned int b0 = lane >> 2; b0 < nb; b0 += 8 * MM_STEPS) {
        // Scale words (d, or d and m) and 8 codes of each step.
        unsigned int head[MM_STEPS], codes[MM_STEPS];
#pragma unroll
        for (int u = 0; u < MM_STEPS; ++u) {
            const unsigned int b = b0 + 8 * u;
            head[u] = 0u;
            codes[u] = 0u;
            if (b < nb) {
                const unsigned char* blk = row + (size_t)b * bytes;
                if (HAS_MIN) {
                    head[u] = *reinterpret_cast<const unsigned int*>(blk);
                    codes[u] = *reinterpret_cast<const unsigned int*>(blk + 4 + 4 * sub);
                } else {
                    const unsigned short* h = reinterpret_cast<const unsigned short*>(blk);
                    head[u] = h[0];
                    codes[u] = (unsigned int)h[1 + 2 * sub] | ((unsigned int)h[2 + 2 * sub] << 16);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < MM_STEPS; ++u) {
            const unsigned int b = b0 + 8 * u;
            if (b >= nb) break;
            const float d = f16_to_f32((f16_bits)(head[u] & 0xffffu));
            const float m = HAS_MIN ? f16_to_f32((f16_bits)(head[u] >> 16)) : 0.f;
            float lo[4], hi[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo[i] = (float)((codes[u] >> (8 * i)) & 15u);
                hi[i] = (float)((codes[u] >> (8 * i + 4)) & 15u);
            }
            const unsigned int e = b * 32 + 4 * sub;
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                if (t < rows) {
                    const float* xb = x + (size_t)t * k + e;
                    float xl[4], xh[4];
                    load_x4<VEC, NORM>(xb, g + e, xl, sq[t]);
                    load_x4<VEC, NORM>(xb + 16, g + e + 16, xh, sq[t]);
                    float nx = 0.f, sx = 0.f;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        nx = fmaf(lo[i], xl[i], nx);
                        nx = fmaf(hi[i], xh[i], nx);
                        sx += xl[i] + xh[i];
                    }
                    acc[t] += HAS_MIN ? fmaf(d, nx, m * sx) : d * fmaf(-8.f, sx, nx);
                }
            }
        }
    }
}

// Q8_0: 34-byte blocks, `d` then 32 signed codes.
template <bool VEC, bool NORM, int TILE>
__device__ void dot_q8_0(const unsigned char* __restrict__ row, const float* __restrict__ x,
                         const float* __restrict__ g, unsigned int k, unsigned int rows, unsigned int lane,
                         float* acc, float* sq) {
    const unsigned int nb = k / 32, sub = lane & 3;
    for (unsigned int b0 = lane >> 2; b0 < nb; b0 += 8 * MM_STEPS) {
        // The scale and 8 codes (four 16-bit words) of each step.
        unsigned short head[MM_STEPS], codes[MM_STEPS][4];
#pragma unroll
        for (int u = 0; u < MM_STEPS; ++u) {
            const unsigned int b = b0 + 8 * u;
            head[u] = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) codes[u][i] = 0;
            if (b < nb) {
                const unsigned short* h = reinterpret_cast<const unsigned short*>(row + (size_t)b * 34);
                head[u] = h[0];
#pragma unroll
                for (int i = 0; i < 4; ++i) codes[u][i] = h[1 + 4 * sub + i];
            }
        }
#pragma unroll
        for (int u = 0; u < MM_STEPS; ++u) {
            const unsigned int b = b0 + 8 * u;
            if (b >= nb) break;
            const float d = f16_to_f32(head[u]);
            float wq[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                wq[2 * i] = (float)(signed char)(codes[u][i] & 0xffu);
                wq[2 * i + 1] = (float)(signed char)(codes[u][i] >> 8);
            }
            const unsigned int e = b * 32 + 8 * sub;
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                if (t < rows) {
                    const float* xb = x + (size_t)t * k + e;
                    float xv[8];
                    load_x4<VEC, NORM>(xb, g + e, xv, sq[t]);
                    load_x4<VEC, NORM>(xb + 4, g + e + 4, xv + 4, sq[t]);
                    float dot = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) dot = fmaf(wq[i], xv[i], dot);
                    acc[t] = fmaf(d, dot, acc[t]);
                }
            }
        }
    }
}

// The types of quant_codes.cuh: 8 consecutive weights a lane, decoded to
// f32, one step of 256 at a time. (Unrolling steps, or a version per
// alignment of the activations, multiplies the code of nine decoders in
// every product of the generic kernels, whose compilation it makes minutes
// long; the warps of other columns hide the latency instead.)
template <unsigned int TYPE, bool NORM, int TILE>
__device__ void dot_coded(const unsigned char* __restrict__ row, const float* __restrict__ x,
                          const float* __restrict__ g, unsigned int k, unsigned int rows, unsigned int lane,
                          float* acc, float* sq) {
#pragma unroll 1
    for (unsigned int i = 8 * lane; i < k; i += 256) {
        float w[8];
        dequant8<TYPE>(row, i, w);
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            if (t < rows) {
                const float* xb = x + (size_t)t * k + i;
                float xv[8];
                load_x4<false, NORM>(xb, g + i, xv, sq[t]);
                load_x4<false, NORM>(xb + 4, g + i + 4, xv + 4, sq[t]);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[t] = fmaf(w[e], xv[e], acc[t]);
            }
        }
    }
}

// A weight row of any type against a tile of activation rows (per-lane
// partial sums; see dot_row_float for `x16` and `vec_float`).
template <bool NORM, int TILE>
__device__ __forceinline__ void dot_row(unsigned int dtype, const unsigned char* __restrict__ row,
                                        const float* __restrict__ x, const float* __restrict__ g,
                                        unsigned int k, unsigned int rows, unsigned int lane, bool x16,
                                        bool vec_float, float* acc, float* sq) {
    switch (dtype) {
        GGML_CASE(GGML_Q4_1)
            if (x16) dot_q4<true, true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_q4<true, false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        GGML_CASE(GGML_Q4_0)
            if (x16) dot_q4<false, true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_q4<false, false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        GGML_CASE(GGML_Q8_0)
            if (x16) dot_q8_0<true, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            else dot_q8_0<false, NORM, TILE>(row, x, g, k, rows, lane, acc, sq);
            break;
        GGML_CASE(GGML_Q5_0) dot_coded<GGML_Q5_0, NORM, TILE>(row, x, g, k, rows, lane, acc, sq); break;
        GGML_CASE(GGML_Q5_1) dot_coded<GGML_Q5_1, NORM, TILE>(row, x, g, k, rows, lane, acc, sq); break;
        GGML_CASE(GGML_IQ4_NL) dot_coded<GGML_IQ4_NL, NORM, TILE>(row, x, g, k, rows, lane, acc, sq); break;
        GGML_CASE(GGML_Q2_K) dot_coded<GGML_Q2_K, NORM, TILE>(row, x, g, k, rows, lane, acc, sq); break;
        GGML_CASE(GGML_Q3_K) dot_coded<GGML_Q3_K, NORM, TILE>(row, x, g, k, rows, lane, acc, sq); break;
        GGML_CASE(GGML_Q4_K) dot_coded<GGML_Q4_K, NORM, TILE>(row, x, g, k, rows, lane, acc, sq); break;
        GGML_CASE(GGML_Q5_K) dot_coded<GGML_Q5_K, NORM, TILE>(row, x, g, k, rows, lane, acc, sq); break;
        GGML_CASE(GGML_Q6_K) dot_coded<GGML_Q6_K, NORM, TILE>(row, x, g, k, rows, lane, acc, sq); break;
        GGML_CASE(GGML_IQ4_XS) dot_coded<GGML_IQ4_XS, NORM, TILE>(row, x, g, k, rows, lane, acc, sq); break;
        default:
            dot_row_float<NORM, TILE>(dtype, row, x, g, k, rows, lane, x16, vec_float, acc, sq);
            break;
    }
}

// The weight words of one pass of dot_cols_quant over N rows: each row's
// scale word and codes for every step (Q8_0: 8 codes in lo and hi; Q4: 8
// nibbles in lo; Q5_0: 8 nibbles in lo and the block's fifth bits `qh` in
// hi), and with a norm folded in, the lane's norm weights of each step.
template <int N>
struct QuantPass {
    unsigned int head[N][DOT_STEPS], lo[N][DOT_STEPS], hi[N][DOT_STEPS];
    float g[DOT_STEPS][8];
};

// The first and the fifth of the 8 activations a lane takes in block `b`
// (Q8_0: 8 consecutive; Q4 and Q5_0: 4 and the 4 that sit 16 further).
template <unsigned int TYPE>
__device__ __forceinline__ void quant_lane_elements(unsigned int b, unsigned int lane, unsigned int& e,
                                                    unsigned int& e2) {
    e = b * 32 + (TYPE == GGML_Q8_0 ? 8 * (lane & 3) : 4 * (lane & 3));
    e2 = e + (TYPE == GGML_Q8_0 ? 4 : 16);
}

// Loads the norm weights of the pass from block `base` on (the elements
// the lane's activations multiply).
template <unsigned int TYPE, bool VEC, int N>
__device__ __forceinline__ void norm_pass_load(const float* __restrict__ g, unsigned int nb, unsigned int base,
                                               unsigned int lane, QuantPass<N>& w) {
#pragma unroll
    for (int u = 0; u < DOT_STEPS; ++u) {
        if (base + 8 * u >= nb) break;
        const unsigned int b = base + 8 * u + (lane >> 2);
        unsigned int e, e2;
        quant_lane_elements<TYPE>(b < nb ? b : nb - 1, lane, e, e2);
        load4<VEC>(g + e, w.g[u]);
        load4<VEC>(g + e2, w.g[u] + 4);
    }
}

// Loads the weight words of the pass from block `base` on, from addresses
// clamped into the row (a lane past the row end reads its last block).
template <unsigned int TYPE, int N>
__device__ __forceinline__ void quant_pass_load(const unsigned char* const* rows, unsigned int nb, unsigned int base,
                                                unsigned int lane, QuantPass<N>& w) {
    const unsigned int bytes = TYPE == GGML_Q4_1 ? 20u : TYPE == GGML_Q4_0 ? 18u : TYPE == GGML_Q5_0 ? 22u : 34u;
    const unsigned int sub = lane & 3;
#pragma unroll
    for (int u = 0; u < DOT_STEPS; ++u) {
        if (base + 8 * u >= nb) break;
        const unsigned int b = base + 8 * u + (lane >> 2);
        const unsigned int bc = b < nb ? b : nb - 1;
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const unsigned char* blk = rows[c] + (size_t)bc * bytes;
            const unsigned short* h = reinterpret_cast<const unsigned short*>(blk);
            w.hi[c][u] = 0u;
            if (TYPE == GGML_Q4_1) {
                w.head[c][u] = *reinterpret_cast<const unsigned int*>(blk);
                w.lo[c][u] = *reinterpret_cast<const unsigned int*>(blk + 4 + 4 * sub);
            } else if (TYPE == GGML_Q4_0) {
                w.head[c][u] = h[0];
                w.lo[c][u] = (unsigned int)h[1 + 2 * sub] | ((unsigned int)h[2 + 2 * sub] << 16);
            } else if (TYPE == GGML_Q5_0) {
                // d, qh (2 bytes on), qs (6 bytes on).
                w.head[c][u] = h[0];
                w.hi[c][u] = (unsigned int)h[1] | ((unsigned int)h[2] << 16);
                w.lo[c][u] = (unsigned int)h[3 + 2 * sub] | ((unsigned int)h[4 + 2 * sub] << 16);
            } else {
                w.head[c][u] = h[0];
                w.lo[c][u] = (unsigned int)h[1 + 4 * sub] | ((unsigned int)h[2 + 4 * sub] << 16);
                w.hi[c][u] = (unsigned int)h[3 + 4 * sub] | ((unsigned int)h[4 + 4 * sub] << 16);
            }
        }
    }
}

// The first pass's weight words of N rows of type `dtype`, and with a norm
// weight `g` (not null) its elements for that pass (nothing for float
// weights, which dot_cols reads itself). Weights are read-only, so a kernel
// calls this before encore_grid_wait(): the loads then overlap the previous
// kernel instead of following the wait.
template <unsigned int TYPE, int N>
__device__ __forceinline__ void quant_pass_first_of(const unsigned char* const* rows, const float* __restrict__ g,
                                                    unsigned int k, unsigned int lane, QuantPass<N>& w) {
    quant_pass_load<TYPE, N>(rows, k / 32, 0, lane, w);
    if (g == nullptr) return;
    if (((size_t)g & 15u) == 0) norm_pass_load<TYPE, true, N>(g, k / 32, 0, lane, w);
    else norm_pass_load<TYPE, false, N>(g, k / 32, 0, lane, w);
}

template <int N>
__device__ __forceinline__ void quant_pass_first(unsigned int dtype, const unsigned char* const* rows,
                                                 const float* __restrict__ g, unsigned int k, unsigned int lane,
                                                 QuantPass<N>& w) {
    switch (dtype) {
        GGML_CASE(GGML_Q4_1) quant_pass_first_of<GGML_Q4_1, N>(rows, g, k, lane, w); return;
        GGML_CASE(GGML_Q4_0) quant_pass_first_of<GGML_Q4_0, N>(rows, g, k, lane, w); return;
        GGML_CASE(GGML_Q8_0) quant_pass_first_of<GGML_Q8_0, N>(rows, g, k, lane, w); return;
        GGML_CASE(GGML_Q5_0) quant_pass_first_of<GGML_Q5_0, N>(rows, g, k, lane, w); return;
        default: return;
    }
}

// Q4_0, Q4_1, Q5_0 and Q8_0: per-lane partial dot products of N weight rows
// (`rows[c]`) with one activation row, whose elements each lane loads once
// for all N rows (and, with NORM, multiplies by `g` and squares into `sq`).
// Lane layout and arithmetic as in dot_q4 and dot_q8_0; Q5_0 as Q4_0 with
// signed codes `q - 16` (so `d Σ (q - 16) x`).
//
// A pass covers DOT_STEPS steps of 8 blocks. Every load of a pass (weights,
// activations, norm weights) is issued before any of them is used, from
// addresses clamped into the row, so that one memory round trip serves the
// whole pass: a load behind a branch, or behind arithmetic on an earlier
// load, would wait for that load first. A lane whose block lies past the
// row end (the last step of a row whose blocks are not a multiple of 8)
// loads the last block again and adds nothing. Whether a step exists at all
// is the same for every lane, and a constant once the kernel is specialized
// for its shape, so the loops unroll to exactly the steps a row has. The
// first pass's weights come from `first` when the caller loaded them
// already (quant_pass_first), else from memory here.
template <unsigned int TYPE, bool VEC, bool NORM, int N>
__device__ __forceinline__ void dot_cols_quant(const unsigned char* const* rows, const float* __restrict__ x,
                                               const float* __restrict__ g, unsigned int k, unsigned int lane,
                                               float* acc, float& sq, const QuantPass<N>* first) {
    const unsigned int nb = k / 32;
    for (unsigned int base = 0; base < nb; base += 8 * DOT_STEPS) {
        QuantPass<N> w;
        if (first != nullptr && base == 0) {
            w = *first;
        } else {
            quant_pass_load<TYPE, N>(rows, nb, base, lane, w);
            if (NORM) norm_pass_load<TYPE, VEC, N>(g, nb, base, lane, w);
        }
        // The lane's 8 activations of each step.
        float xv[DOT_STEPS][8];
        bool live[DOT_STEPS];
#pragma unroll
        for (int u = 0; u < DOT_STEPS; ++u) {
            if (base + 8 * u >= nb) break;
            const unsigned int b = base + 8 * u + (lane >> 2);
            live[u] = b < nb;
            unsigned int e, e2;
            quant_lane_elements<TYPE>(live[u] ? b : nb - 1, lane, e, e2);
            load4<VEC>(x + e, xv[u]);
            load4<VEC>(x + e2, xv[u] + 4);
        }
#pragma unroll
        for (int u = 0; u < DOT_STEPS; ++u) {
            if (base + 8 * u >= nb) break;
            // A block past the row end adds nothing (a select, not a branch:
            // the compiler would move this step's loads behind a branch).
#pragma unroll
            for (int i = 0; i < 8; ++i) xv[u][i] = live[u] ? xv[u][i] : 0.f;
            if (NORM) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    sq = fmaf(xv[u][i], xv[u][i], sq);
                    xv[u][i] *= w.g[u][i];
                }
            }
            float sx = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) sx += xv[u][i] + xv[u][4 + i];
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const float d = f16_to_f32((f16_bits)(w.head[c][u] & 0xffffu));
                if (TYPE == GGML_Q8_0) {
                    // Signed codes with their sign bits flipped: the code plus 128.
                    float dot = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const unsigned int word = (i < 4 ? w.lo[c][u] : w.hi[c][u]) ^ 0x80808080u;
                        dot = fmaf(byte_minus(word, i & 3, 128.f), xv[u][i], dot);
                    }
                    acc[c] = live[u] ? fmaf(d, dot, acc[c]) : acc[c];
                } else if (TYPE == GGML_Q5_0) {
                    // Weights 4s..4s+4 take the low nibbles and bits 4s..4s+4
                    // of qh, weights 16+4s.. the high nibbles and bits 16+4s..
                    const unsigned int sub = lane & 3;
                    const unsigned int qh = w.hi[c][u];
                    // The codes q (0..31): nibbles and fifth bits; q - 16 multiplies.
                    const unsigned int ql = (w.lo[c][u] & 0x0f0f0f0fu) | fifth_bits4(qh, sub);
                    const unsigned int qu = ((w.lo[c][u] >> 4) & 0x0f0f0f0fu) | fifth_bits4(qh, 4 + sub);
                    float dot = 0.f;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        dot = fmaf(byte_minus(ql, i, 16.f), xv[u][i], dot);
                        dot = fmaf(byte_minus(qu, i, 16.f), xv[u][4 + i], dot);
                    }
                    acc[c] = live[u] ? fmaf(d, dot, acc[c]) : acc[c];
                } else {
                    const unsigned int nl = w.lo[c][u] & 0x0f0f0f0fu, nh = (w.lo[c][u] >> 4) & 0x0f0f0f0fu;
                    float nx = 0.f;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        nx = fmaf(byte_minus(nl, i, 0.f), xv[u][i], nx);
                        nx = fmaf(byte_minus(nh, i, 0.f), xv[u][4 + i], nx);
                    }
                    const float part = TYPE == GGML_Q4_1 ? fmaf(d, nx, f16_to_f32((f16_bits)(w.head[c][u] >> 16)) * sx)
                                                         : d * fmaf(-8.f, sx, nx);
                    acc[c] = live[u] ? acc[c] + part : acc[c];
                }
            }
        }
    }
}

// A lane's 8 activations of a super-block step from element `e` (and, with
// NORM, the norm weights beside them), for dot_q4_k and dot_q6_k.
template <bool VEC, bool NORM>
__device__ __forceinline__ void lane_x8_load(const float* __restrict__ x, const float* __restrict__ g,
                                             unsigned int e, float* xv, float* gv) {
    load4<VEC>(x + e, xv);
    load4<VEC>(x + e + 4, xv + 4);
    if (NORM) {
        load4<VEC>(g + e, gv);
        load4<VEC>(g + e + 4, gv + 4);
    }
}

// With NORM: the squares of the 8 activations join `sq`, then each is
// multiplied by its norm weight.
template <bool NORM>
__device__ __forceinline__ void lane_x8_norm(float* xv, const float* gv, float& sq) {
    if (!NORM) return;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        sq = fmaf(xv[i], xv[i], sq);
        xv[i] *= gv[i];
    }
}

// Super-blocks of Q6_K a pass of dot_q6_k: five, so that each warp's part
// of a split row of Qwen2.5's down products (19 super-blocks between two
// warps, 9 and 10) takes two passes, two memory round trips, where four
// would take three. (Chosen when the split was four warps: five made each
// part one pass.)
#define Q6_STEPS 5

// Q6_K against one activation row: per-lane partial sums of one weight row
// (`acc`; with NORM, the squares of the activations in `sq`). Lane `l` takes
// weights `8l..8l+8` of each super-block (within one 16-weight scale
// group), so a warp step is one super-block and every lane of a step is
// live; Q6_STEPS steps' weights and activations are loaded before any is
// used. Per lane and super-block: `(d sc) Σ (q - 32) x`. Blocks are 210
// bytes, so their fields are read as 16-bit words.
template <bool VEC, bool NORM>
__device__ __forceinline__ void dot_q6_k(const unsigned char* __restrict__ row, const float* __restrict__ x,
                                         const float* __restrict__ g, unsigned int k, unsigned int lane,
                                         float& acc, float& sq) {
    const unsigned int nb = k / 256;
    // Weight 8 lane = 128 h + 32 s + l: low bits in ql[64 h + 32 (s % 2) + l]
    // (high nibbles for s >= 2), high bits in qh[32 h + l] from bit 2 s.
    const unsigned int h = lane / 16, s = (lane % 16) / 4, l = 8 * (lane % 4);
    const unsigned int ql_at = 64 * h + 32 * (s % 2) + l, qh_at = 128 + 32 * h + l;
    const unsigned int low_shift = s >= 2 ? 4 : 0;
    for (unsigned int b0 = 0; b0 < nb; b0 += Q6_STEPS) {
        unsigned int lo[Q6_STEPS][2], hi[Q6_STEPS][2], head[Q6_STEPS];
        float xv[Q6_STEPS][8], gv[Q6_STEPS][8];
#pragma unroll
        for (int u = 0; u < Q6_STEPS; ++u) {
            if (b0 + u >= nb) break;
            const unsigned char* blk = row + (size_t)(b0 + u) * 210;
            const unsigned short* ql = reinterpret_cast<const unsigned short*>(blk + ql_at);
            const unsigned short* qh = reinterpret_cast<const unsigned short*>(blk + qh_at);
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                lo[u][w] = (unsigned int)ql[2 * w] | ((unsigned int)ql[2 * w + 1] << 16);
                hi[u][w] = (unsigned int)qh[2 * w] | ((unsigned int)qh[2 * w + 1] << 16);
            }
            // d, and the lane's scale (byte 192 + lane / 2) in the top half.
            head[u] = (unsigned int)*reinterpret_cast<const unsigned short*>(blk + 208) |
                      ((unsigned int)blk[192 + lane / 2] << 16);
            lane_x8_load<VEC, NORM>(x, g, (b0 + u) * 256 + 8 * lane, xv[u], gv[u]);
        }
#pragma unroll
        for (int u = 0; u < Q6_STEPS; ++u) {
            if (b0 + u >= nb) break;
            lane_x8_norm<NORM>(xv[u], gv[u], sq);
            float dot = 0.f;
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                const unsigned int q =
                    ((lo[u][w] >> low_shift) & 0x0f0f0f0fu) | (((hi[u][w] >> (2 * s)) & 0x03030303u) << 4);
#pragma unroll
                for (int i = 0; i < 4; ++i) dot = fmaf(byte_minus(q, i, 32.f), xv[u][4 * w + i], dot);
            }
            const float d = f16_to_f32((f16_bits)(head[u] & 0xffffu));
            const float sc = (float)(signed char)(head[u] >> 16);
            acc = fmaf(__fmul_rn(d, sc), dot, acc);
        }
    }
}

// Super-blocks of Q4_K a pass of dot_q4_k (five, as Q6_STEPS).
#define Q4K_STEPS 5

// Q4_K against one activation row: per-lane partial sums of one weight row
// (`acc`; with NORM, the squares of the activations in `sq`). Lane `l` takes
// weights `8l..8l+8` of each super-block, all of them in sub-block `l / 4`
// of 32 weights (one 6-bit scale and minimum), so a warp step is one
// super-block and every lane of a step is live; Q4K_STEPS steps' weights and
// activations are loaded before any is used. Per lane and super-block:
// `d sc Σ q x - dmin m Σ x`. Blocks are 144 bytes, so their fields are read
// as 32-bit words: the 16-byte head (d, dmin, the 12 bytes of scales and
// minimums; the same words for every lane) and the lane's 8 codes.
template <bool VEC, bool NORM>
__device__ __forceinline__ void dot_q4_k(const unsigned char* __restrict__ row, const float* __restrict__ x,
                                         const float* __restrict__ g, unsigned int k, unsigned int lane,
                                         float& acc, float& sq) {
    const unsigned int nb = k / 256;
    // Weight 8 lane = 64 c + 32 hi + o (o = 8 (lane % 4)): its code in
    // qs[32 c + o] (qs at byte 16 of the block), the high nibble when hi;
    // sub-block j = 2 c + hi.
    const unsigned int j = lane / 4, hi = j % 2, qs_at = 16 + 32 * (j / 2) + 8 * (lane % 4);
    // Sub-block j's scale and minimum come from bytes j % 4, j % 4 + 4 and
    // j % 4 + 8 of the scales (head words 1, 2 and 3), as ggml's
    // get_scale_min_k4 takes them.
    const unsigned int shift = 8 * (j % 4);
    for (unsigned int b0 = 0; b0 < nb; b0 += Q4K_STEPS) {
        unsigned int head[Q4K_STEPS][4], codes[Q4K_STEPS][2];
        float xv[Q4K_STEPS][8], gv[Q4K_STEPS][8];
#pragma unroll
        for (int u = 0; u < Q4K_STEPS; ++u) {
            if (b0 + u >= nb) break;
            const unsigned int* blk = reinterpret_cast<const unsigned int*>(row + (size_t)(b0 + u) * 144);
#pragma unroll
            for (int w = 0; w < 4; ++w) head[u][w] = blk[w];
            codes[u][0] = blk[qs_at / 4];
            codes[u][1] = blk[qs_at / 4 + 1];
            lane_x8_load<VEC, NORM>(x, g, (b0 + u) * 256 + 8 * lane, xv[u], gv[u]);
        }
#pragma unroll
        for (int u = 0; u < Q4K_STEPS; ++u) {
            if (b0 + u >= nb) break;
            lane_x8_norm<NORM>(xv[u], gv[u], sq);
            float dot = 0.f, sx = 0.f;
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                const unsigned int q = (codes[u][w] >> (4 * hi)) & 0x0f0f0f0fu;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    dot = fmaf(byte_minus(q, i, 0.f), xv[u][4 * w + i], dot);
                    sx += xv[u][4 * w + i];
                }
            }
            const unsigned int a = (head[u][1] >> shift) & 0xffu, b = (head[u][2] >> shift) & 0xffu;
            const unsigned int c = (head[u][3] >> shift) & 0xffu;
            const unsigned int sc = j < 4 ? a & 63u : (c & 15u) | ((a >> 6) << 4);
            const unsigned int mn = j < 4 ? b & 63u : (c >> 4) | ((b >> 6) << 4);
            const float d = f16_to_f32((f16_bits)(head[u][0] & 0xffffu));
            const float dmin = f16_to_f32((f16_bits)(head[u][0] >> 16));
            acc = fmaf(d * (float)sc, dot, fmaf(-dmin * (float)mn, sx, acc));
        }
    }
}

// Q4_K or Q6_K against one activation row, N weight rows one at a time:
// per-lane partial sums in `out` (the squares of the activations in `sq`,
// once).
template <unsigned int TYPE, bool VEC, bool NORM, int N>
__device__ __forceinline__ void dot_cols_k(const unsigned char* const* rows, const float* __restrict__ x,
                                           const float* __restrict__ g, unsigned int k, unsigned int lane,
                                           float* out, float& sq) {
#pragma unroll
    for (int c = 0; c < N; ++c) {
        float other = 0.f;
        if (TYPE == GGML_Q4_K) dot_q4_k<VEC, NORM>(rows[c], x, g, k, lane, out[c], c == 0 ? sq : other);
        else dot_q6_k<VEC, NORM>(rows[c], x, g, k, lane, out[c], c == 0 ? sq : other);
    }
}

// The types of quant_codes.cuh against one activation row, N weight rows
// one at a time (as dot_cols_float): per-lane partial sums in `out` (the
// squares of the activations in `sq`, once).
template <unsigned int TYPE, bool NORM, int N>
__device__ __forceinline__ void dot_cols_coded(const unsigned char* const* rows, const float* __restrict__ x,
                                               const float* __restrict__ g, unsigned int k, unsigned int lane,
                                               float* out, float& sq) {
#pragma unroll
    for (int c = 0; c < N; ++c) {
        float other = 0.f;
        dot_coded<TYPE, NORM, 1>(rows[c], x, g, k, 1, lane, out + c, c == 0 ? &sq : &other);
    }
}

// N weight rows of type `dtype` against one activation row (decode), with
// NORM the norm weights applied as the activations load: per-lane partial
// sums in `out` and of the squares of the activations in `sq` (zeroed
// here), which dot_cols_finish, or a caller meeting other warps' sums first,
// completes. The quantized types load the activations once for all rows.
template <bool NORM, int N>
__device__ __forceinline__ void dot_cols_lanes(unsigned int dtype, const unsigned char* const* rows,
                                               const float* __restrict__ x, const float* __restrict__ g,
                                               unsigned int k, unsigned int lane, bool x16, bool vec_float,
                                               float* out, float& sq, const QuantPass<N>* first) {
    sq = 0.f;
#pragma unroll
    for (int c = 0; c < N; ++c) out[c] = 0.f;
    switch (dtype) {
        GGML_CASE(GGML_Q4_1)
            if (x16) dot_cols_quant<GGML_Q4_1, true, NORM, N>(rows, x, g, k, lane, out, sq, first);
            else dot_cols_quant<GGML_Q4_1, false, NORM, N>(rows, x, g, k, lane, out, sq, first);
            break;
        GGML_CASE(GGML_Q4_0)
            if (x16) dot_cols_quant<GGML_Q4_0, true, NORM, N>(rows, x, g, k, lane, out, sq, first);
            else dot_cols_quant<GGML_Q4_0, false, NORM, N>(rows, x, g, k, lane, out, sq, first);
            break;
        GGML_CASE(GGML_Q8_0)
            if (x16) dot_cols_quant<GGML_Q8_0, true, NORM, N>(rows, x, g, k, lane, out, sq, first);
            else dot_cols_quant<GGML_Q8_0, false, NORM, N>(rows, x, g, k, lane, out, sq, first);
            break;
        GGML_CASE(GGML_Q5_0)
            if (x16) dot_cols_quant<GGML_Q5_0, true, NORM, N>(rows, x, g, k, lane, out, sq, first);
            else dot_cols_quant<GGML_Q5_0, false, NORM, N>(rows, x, g, k, lane, out, sq, first);
            break;
        GGML_CASE(GGML_Q5_1) dot_cols_coded<GGML_Q5_1, NORM, N>(rows, x, g, k, lane, out, sq); return;
        GGML_CASE(GGML_IQ4_NL) dot_cols_coded<GGML_IQ4_NL, NORM, N>(rows, x, g, k, lane, out, sq); return;
        GGML_CASE(GGML_Q2_K) dot_cols_coded<GGML_Q2_K, NORM, N>(rows, x, g, k, lane, out, sq); return;
        GGML_CASE(GGML_Q3_K) dot_cols_coded<GGML_Q3_K, NORM, N>(rows, x, g, k, lane, out, sq); return;
        GGML_CASE(GGML_Q4_K)
            if (x16) dot_cols_k<GGML_Q4_K, true, NORM, N>(rows, x, g, k, lane, out, sq);
            else dot_cols_k<GGML_Q4_K, false, NORM, N>(rows, x, g, k, lane, out, sq);
            return;
        GGML_CASE(GGML_Q5_K) dot_cols_coded<GGML_Q5_K, NORM, N>(rows, x, g, k, lane, out, sq); return;
        GGML_CASE(GGML_Q6_K)
            if (x16) dot_cols_k<GGML_Q6_K, true, NORM, N>(rows, x, g, k, lane, out, sq);
            else dot_cols_k<GGML_Q6_K, false, NORM, N>(rows, x, g, k, lane, out, sq);
            return;
        GGML_CASE(GGML_IQ4_XS) dot_cols_coded<GGML_IQ4_XS, NORM, N>(rows, x, g, k, lane, out, sq); return;
        default: dot_cols_float_lanes<NORM, N>(dtype, rows, x, g, k, lane, x16, vec_float, out, sq); return;
    }
}

// N weight rows of type `dtype` against one activation row (decode), with
// NORM the norm folded in: the finished dot products in `out` on every
// lane.
template <bool NORM, int N>
__device__ __forceinline__ void dot_cols(unsigned int dtype, const unsigned char* const* rows,
                                         const float* __restrict__ x, const float* __restrict__ g, unsigned int k,
                                         float eps, unsigned int lane, bool x16, bool vec_float, float* out,
                                         const QuantPass<N>* first) {
    float sq;
    dot_cols_lanes<NORM, N>(dtype, rows, x, g, k, lane, x16, vec_float, out, sq, first);
    dot_cols_finish<NORM, N>(out, sq, k, eps);
}

// ---- Decode products with 8-bit activations (`fused_matmul`, MM_Q8) ----
//
// For one activation row and weights in blocks of 32 (Q4_0, Q4_1, Q5_0,
// Q8_0), a block first quantizes its input once into shared memory as
// ggml's Q8_0 does (per 32 elements `d = max|v| / 127`, `q = round(v / d)`;
// the scale kept in f32), with a norm the input times its weights (the
// 1 / rms scale, the same for the whole row, applies to the finished sums).
// Each lane then multiplies 8 weight codes with 8 activation bytes in two
// `dp4a`, where the f32 products spent a permute, an add and a multiply-add
// on every weight: the decode products were bound by those instructions.
// The lanes take the weights of dot_cols_quant, whose first pass the kernel
// loads before its wait. The results are within the activations'
// quantization error of the f32 products, as the CPU's, which quantizes
// its activations the same way.

// The block's 8-bit activations live in dynamic shared memory, `k` bytes
// of codes then a scale per 32, which the launch provides exactly where the
// shape takes this path (cuda/geometry.rs, `eight_bit_shared_bytes`; the
// kernels decide from the shape as Rust does, so that a variant
// specialized for its shape carries one path). Q8X_MAX_K, the longest row
// a block quantizes, comes from Rust.
extern __shared__ __align__(16) int x8_shared[];

// The dynamic shared memory of this launch, in bytes.
__device__ __forceinline__ unsigned int dynamic_shared_bytes() {
    unsigned int bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// Stops the kernel with a device error (an illegal instruction, which the
// runtime reports) if the launch gave no room for `k` 8-bit activations:
// Rust's geometry and the kernel disagree, a bug, never a wrong result.
__device__ __forceinline__ void x8_require_shared(unsigned int k) {
    if (dynamic_shared_bytes() < k + k / 32 * 4) __trap();
}

// dot(a, b) + c over four byte lanes: signed by signed, unsigned by signed.
__device__ __forceinline__ int dp4a_ss(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ int dp4a_us(unsigned int a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Whether the decode products of `dtype` take 8-bit activations.
__device__ __forceinline__ bool q8_activations(unsigned int dtype) {
    return dtype == GGML_Q4_0 || dtype == GGML_Q4_1 || dtype == GGML_Q5_0 || dtype == GGML_Q8_0;
}

// Whether a block can quantize an activation row of `k` elements (whole
// blocks of 32, at most Q8X_MAX_K).
__device__ __forceinline__ bool q8_row_fits(unsigned int k) { return k % 32 == 0 && k <= Q8X_MAX_K; }

// The block's activation row `x` of `k` elements (a multiple of 32, at
// most Q8X_MAX_K), times `g` with NORM, quantized into `xq` (k signed
// bytes) and `xd` (a scale per 32): every thread of the block calls this.
// Thread t takes elements 8t..8t+8 of each run of 8 blockDim.x (at most
// MM_THREADS, which sizes the block's sums), so the four threads of a
// 32-element block are neighbours in one warp. Returns
// 1 / rms of `x` with NORM (for every thread), else 1.
template <bool NORM, bool VEC>
__device__ __forceinline__ float quantize_x8(const float* __restrict__ x, const float* __restrict__ g, unsigned int k,
                                             float eps, int* xq, float* xd) {
    __shared__ float squares[MM_THREADS / 32];
    float sq = 0.f;
    for (unsigned int base = 0; base < k / 8; base += blockDim.x) {
        const unsigned int e8 = base + threadIdx.x;
        const bool in = e8 < k / 8;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.f;
        if (in) {
            load4<VEC>(x + 8 * e8, v);
            load4<VEC>(x + 8 * e8 + 4, v + 4);
            if (NORM) {
                float gv[8];
                load4<VEC>(g + 8 * e8, gv);
                load4<VEC>(g + 8 * e8 + 4, gv + 4);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    sq = fmaf(v[i], v[i], sq);
                    v[i] *= gv[i];
                }
            }
        }
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        // Rounded to the nearest integer by adding 1.5 * 2^23, whose low
        // mantissa byte is then the code (two's complement for |q| <= 127):
        // one multiply-add, where the converter issues at a quarter rate.
        int q[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = __float_as_int(fmaf(v[i], id, 12582912.0f));
        if (in) {
            // The low bytes of four codes into one word.
            unsigned int word[2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
                word[h] = __byte_perm(__byte_perm(q[4 * h], q[4 * h + 1], 0x0040u),
                                      __byte_perm(q[4 * h + 2], q[4 * h + 3], 0x0040u), 0x5410u);
            reinterpret_cast<int2*>(xq)[e8] = make_int2((int)word[0], (int)word[1]);
            if ((threadIdx.x & 3u) == 0) xd[e8 / 4] = amax / 127.f;
        }
    }
    if (NORM) {
        sq = warp_sum(sq);
        if ((threadIdx.x & 31u) == 0) squares[threadIdx.x >> 5] = sq;
    }
    __syncthreads();
    if (!NORM) return 1.f;
    float total = 0.f;
#pragma unroll
    for (unsigned int w = 0; w < blockDim.x / 32; ++w) total += squares[w];
    return 1.0f / sqrtf(total / (float)k + eps);
}

// Q4_0, Q4_1, Q5_0 and Q8_0 against the block's 8-bit activations (`xq`,
// `xd`): per-lane partial sums of N weight rows in `acc` (zeroed here), in
// the lane layout and passes of dot_cols_quant. Per block and lane,
// with the lane's 8 activation codes `a` (sum `Σa`) and the weight codes
// `q`: Q8_0 `d dx Σ q a`; Q4_0 `d dx (Σ q a - 8 Σa)`; Q5_0 the same with 16;
// Q4_1 `dx (d Σ q a + m Σa)`.
template <unsigned int TYPE, int N>
__device__ __forceinline__ void dot_cols_x8(const unsigned char* const* rows, const int* __restrict__ xq,
                                            const float* __restrict__ xd, unsigned int k, unsigned int lane,
                                            float* acc, const QuantPass<N>* first) {
    const unsigned int nb = k / 32, sub = lane & 3;
#pragma unroll
    for (int c = 0; c < N; ++c) acc[c] = 0.f;
    for (unsigned int base = 0; base < nb; base += 8 * DOT_STEPS) {
        QuantPass<N> w;
        if (first != nullptr && base == 0) w = *first;
        else quant_pass_load<TYPE, N>(rows, nb, base, lane, w);
#pragma unroll
        for (int u = 0; u < DOT_STEPS; ++u) {
            if (base + 8 * u >= nb) break;
            const unsigned int b = base + 8 * u + (lane >> 2);
            const bool live = b < nb;
            const unsigned int bc = live ? b : nb - 1;
            // The activations of the lane's weights: 8 consecutive (Q8_0),
            // or 4 and the 4 that sit 16 further.
            int xa, xb;
            if (TYPE == GGML_Q8_0) {
                const int2 t = reinterpret_cast<const int2*>(xq)[4 * bc + sub];
                xa = t.x;
                xb = t.y;
            } else {
                xa = xq[8 * bc + sub];
                xb = xq[8 * bc + 4 + sub];
            }
            const float dx = xd[bc];
            const int sa = TYPE == GGML_Q8_0 ? 0 : dp4a_ss(0x01010101, xa, dp4a_ss(0x01010101, xb, 0));
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const float d = f16_to_f32((f16_bits)(w.head[c][u] & 0xffffu));
                float part;
                if (TYPE == GGML_Q8_0) {
                    part = d * dx * (float)dp4a_ss((int)w.lo[c][u], xa, dp4a_ss((int)w.hi[c][u], xb, 0));
                } else {
                    unsigned int ql = w.lo[c][u] & 0x0f0f0f0fu, qu = (w.lo[c][u] >> 4) & 0x0f0f0f0fu;
                    if (TYPE == GGML_Q5_0) {
                        ql |= fifth_bits4(w.hi[c][u], sub);
                        qu |= fifth_bits4(w.hi[c][u], 4 + sub);
                    }
                    const int offset = TYPE == GGML_Q5_0 ? -16 * sa : TYPE == GGML_Q4_0 ? -8 * sa : 0;
                    const int s = dp4a_us(ql, xa, dp4a_us(qu, xb, offset));
                    part = TYPE == GGML_Q4_1
                               ? dx * fmaf(d, (float)s, f16_to_f32((f16_bits)(w.head[c][u] >> 16)) * (float)sa)
                               : d * dx * (float)s;
                }
                acc[c] = live ? acc[c] + part : acc[c];
            }
        }
    }
}

#include "quant_dots_k8.cuh"

// N weight rows of type `dtype` (q8_activations or k8_activations) against
// the block's 8-bit activations: per-lane partial sums in `out`.
template <int N>
__device__ __forceinline__ void dot_cols_x8_of(unsigned int dtype, const unsigned char* const* rows,
                                               const int* __restrict__ xq, const float* __restrict__ xd,
                                               unsigned int k, unsigned int lane, float* out,
                                               const QuantPass<N>* first) {
    switch (dtype) {
        GGML_CASE(GGML_Q4_1) dot_cols_x8<GGML_Q4_1, N>(rows, xq, xd, k, lane, out, first); return;
        GGML_CASE(GGML_Q4_0) dot_cols_x8<GGML_Q4_0, N>(rows, xq, xd, k, lane, out, first); return;
        GGML_CASE(GGML_Q8_0) dot_cols_x8<GGML_Q8_0, N>(rows, xq, xd, k, lane, out, first); return;
        GGML_CASE(GGML_Q5_0) dot_cols_x8<GGML_Q5_0, N>(rows, xq, xd, k, lane, out, first); return;
        GGML_CASE(GGML_Q4_K) dot_cols_q4_k_x8<N>(rows, xq, xd, k, lane, out); return;
        GGML_CASE(GGML_Q6_K) dot_cols_q6_k_x8<N>(rows, xq, xd, k, lane, out); return;
        default: return;
    }
}
