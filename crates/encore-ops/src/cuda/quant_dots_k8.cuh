// Decode products of super-block weights (Q4_K, Q6_K) with 8-bit
// activations: one activation row, quantized by the block into shared
// memory as quantize_x8 (quant_dots_fast.cuh) does for the types in blocks
// of 32, multiplied with `dp4a`. These are most of a Q4_K_M file's bytes,
// and a full-size model's decode step is bound by how fast they stream.
//
// Lane layout: 16 lanes a super-block, so a warp step covers two (lanes
// 0-15 the first, 16-31 the second); each lane takes 16 weights of its
// super-block. A pass loads the weights of K8_STEPS steps of every row of
// the warp before it uses any, from addresses clamped into the row (the
// second half of a warp past the row end, where a row has an odd number of
// super-blocks, reloads the last one and adds nothing); then the
// activations come from shared memory step by step. The activation sums
// (for the minimums of Q4_K and the offset 32 of Q6_K) are computed once a
// step for all rows.
//
// Q4_K (144-byte blocks, 16-byte aligned: rows are whole blocks and each
// tensor has an allocation of its own, whose start the device aligns far
// more; a misaligned start would be a device error): lane i takes the 8
// code bytes at 32 (i / 4) + 8 (i % 4) of `qs`, one 8-byte load: their low
// nibbles are weights 8 (i % 4).. of sub-block 2 (i / 4), their high
// nibbles the same weights of sub-block 2 (i / 4) + 1; the 16-byte head (d,
// dmin, the 12 bytes of scales and minimums) is one load that the 16 lanes
// share. Per lane: `d (sc0 dx0 Σ q a + sc1 dx1 Σ q a) - dmin (m0 dx0 Σ a +
// m1 dx1 Σ a)` over its two runs of 8.
//
// Q6_K (210-byte blocks, only 2-byte aligned, so read as 16-bit words):
// lane i takes weights 128 h + 32 s + l for h = i / 8, the four l from
// 4 (i % 8) and every s: their low bits are bytes 64 h + l of `ql` (low
// nibbles for s = 0, high for s = 2) and 64 h + 32 + l (s = 1 and 3), their
// high bits bytes 32 h + l of `qh` (bits 2 s). Per lane: `d Σ_s sc_s dx_s
// Σ (q - 32) a`, each s four weights in one 16-weight scale group.

// Steps of two super-blocks a pass of the K8 products loads.
#define K8_STEPS 4

// Whether the decode products of `dtype` take this file's 8-bit path.
__device__ __forceinline__ bool k8_activations(unsigned int dtype) {
    return dtype == GGML_Q4_K || dtype == GGML_Q6_K;
}

// Whether a block can quantize an activation row of `k` elements for them.
__device__ __forceinline__ bool k8_row_fits(unsigned int k) { return k % 256 == 0 && k <= Q8X_MAX_K; }

// Whether one-row products over rows of `k` of weights of all the `count`
// types `types` take 8-bit activations (`eight_bit_types` in
// cuda/geometry.rs): in blocks of 32 where `blocks` allows, or as
// super-blocks.
__device__ __forceinline__ bool eight_bit_types(const unsigned int* types, unsigned int count, unsigned int k,
                                                bool blocks) {
    bool q8 = blocks && q8_row_fits(k), k8 = k8_row_fits(k);
    for (unsigned int t = 0; t < count; ++t) {
        q8 = q8 && q8_activations(types[t]);
        k8 = k8 && k8_activations(types[t]);
    }
    return q8 || k8;
}

// Sum of the four signed bytes of `a`, plus `c`.
__device__ __forceinline__ int byte_sum(int a, int c) { return dp4a_ss(0x01010101, a, c); }

// Q4_K: per-lane partial sums of N weight rows against the block's 8-bit
// activations (`xq`, `xd`) in `acc` (zeroed here).
template <int N>
__device__ __forceinline__ void dot_cols_q4_k_x8(const unsigned char* const* rows, const int* __restrict__ xq,
                                                 const float* __restrict__ xd, unsigned int k, unsigned int lane,
                                                 float* acc) {
    const unsigned int nb = k / 256, half = lane >> 4, i = lane & 15u;
    const unsigned int c4 = i >> 2, o = 8u * (i & 3u);
    // Sub-blocks j0 = 2 c4 and j1 = j0 + 1: scale bytes j % 4 of head words
    // 1, 2 and 3 (ggml's get_scale_min_k4).
    const unsigned int j0 = 2u * c4, j1 = j0 + 1u;
    const unsigned int shift0 = 8u * (j0 & 3u), shift1 = 8u * (j1 & 3u);
#pragma unroll
    for (int c = 0; c < N; ++c) acc[c] = 0.f;
    for (unsigned int sb0 = 0; sb0 < nb; sb0 += 2 * K8_STEPS) {
        uint4 head[N][K8_STEPS];
        uint2 codes[N][K8_STEPS];
#pragma unroll
        for (int u = 0; u < K8_STEPS; ++u) {
            if (sb0 + 2 * u >= nb) break;
            const unsigned int sb = min(sb0 + 2 * u + half, nb - 1);
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const unsigned char* blk = rows[c] + (size_t)sb * 144;
                head[c][u] = *reinterpret_cast<const uint4*>(blk);
                codes[c][u] = *reinterpret_cast<const uint2*>(blk + 16 + 32 * c4 + o);
            }
        }
#pragma unroll
        for (int u = 0; u < K8_STEPS; ++u) {
            if (sb0 + 2 * u >= nb) break;
            const unsigned int sb = sb0 + 2 * u + half;
            const bool live = sb < nb;
            const unsigned int sbc = live ? sb : nb - 1;
            // The activations of the lane's two runs of 8, and their sums.
            const int2 a0 = reinterpret_cast<const int2*>(xq)[(sbc * 256 + 64 * c4 + o) / 8];
            const int2 a1 = reinterpret_cast<const int2*>(xq)[(sbc * 256 + 64 * c4 + 32 + o) / 8];
            const float dx0 = xd[sbc * 8 + j0], dx1 = xd[sbc * 8 + j1];
            const float sa0 = (float)byte_sum(a0.x, byte_sum(a0.y, 0)) * dx0;
            const float sa1 = (float)byte_sum(a1.x, byte_sum(a1.y, 0)) * dx1;
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const uint4 h = head[c][u];
                const unsigned int lo_x = codes[c][u].x & 0x0f0f0f0fu, lo_y = codes[c][u].y & 0x0f0f0f0fu;
                const unsigned int hi_x = (codes[c][u].x >> 4) & 0x0f0f0f0fu, hi_y = (codes[c][u].y >> 4) & 0x0f0f0f0fu;
                const int s0 = dp4a_us(lo_x, a0.x, dp4a_us(lo_y, a0.y, 0));
                const int s1 = dp4a_us(hi_x, a1.x, dp4a_us(hi_y, a1.y, 0));
                // Scales and minimums of sub-blocks j0 (< 4 when c4 < 2) and j1.
                const unsigned int a_0 = (h.y >> shift0) & 0xffu, b_0 = (h.z >> shift0) & 0xffu;
                const unsigned int e_0 = (h.w >> shift0) & 0xffu;
                const unsigned int a_1 = (h.y >> shift1) & 0xffu, b_1 = (h.z >> shift1) & 0xffu;
                const unsigned int e_1 = (h.w >> shift1) & 0xffu;
                const unsigned int sc0 = j0 < 4 ? a_0 & 63u : (e_0 & 15u) | ((a_0 >> 6) << 4);
                const unsigned int m0 = j0 < 4 ? b_0 & 63u : (e_0 >> 4) | ((b_0 >> 6) << 4);
                const unsigned int sc1 = j1 < 4 ? a_1 & 63u : (e_1 & 15u) | ((a_1 >> 6) << 4);
                const unsigned int m1 = j1 < 4 ? b_1 & 63u : (e_1 >> 4) | ((b_1 >> 6) << 4);
                const float d = f16_to_f32((f16_bits)(h.x & 0xffffu));
                const float dmin = f16_to_f32((f16_bits)(h.x >> 16));
                const float dots = fmaf((float)sc0 * dx0, (float)s0, (float)sc1 * dx1 * (float)s1);
                const float mins = fmaf((float)m0, sa0, (float)m1 * sa1);
                const float part = fmaf(d, dots, -dmin * mins);
                acc[c] = live ? acc[c] + part : acc[c];
            }
        }
    }
}

// Q6_K: as dot_cols_q4_k_x8.
template <int N>
__device__ __forceinline__ void dot_cols_q6_k_x8(const unsigned char* const* rows, const int* __restrict__ xq,
                                                 const float* __restrict__ xd, unsigned int k, unsigned int lane,
                                                 float* acc) {
    const unsigned int nb = k / 256, half = lane >> 4, i = lane & 15u;
    const unsigned int h = i >> 3, l0 = 4u * (i & 7u);
    // Byte offsets in the block: the two `ql` runs, the `qh` run, the
    // 16-bit words holding the four scales (the low byte when l0 < 16).
    const unsigned int ql_at = 64 * h + l0, qh_at = 128 + 32 * h + l0, sc_at = 192 + 8 * h;
    const unsigned int sc_shift = l0 < 16 ? 0u : 8u;
#pragma unroll
    for (int c = 0; c < N; ++c) acc[c] = 0.f;
    for (unsigned int sb0 = 0; sb0 < nb; sb0 += 2 * K8_STEPS) {
        // Per row and step: ql words (s = 0/2, s = 1/3), the qh word, the
        // four scales (bytes), d.
        unsigned int ql[N][K8_STEPS][2], qh[N][K8_STEPS], sc[N][K8_STEPS];
        unsigned short dw[N][K8_STEPS];
#pragma unroll
        for (int u = 0; u < K8_STEPS; ++u) {
            if (sb0 + 2 * u >= nb) break;
            const unsigned int sb = min(sb0 + 2 * u + half, nb - 1);
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const unsigned char* blk = rows[c] + (size_t)sb * 210;
                const unsigned short* w = reinterpret_cast<const unsigned short*>(blk);
                ql[c][u][0] = (unsigned int)w[ql_at / 2] | ((unsigned int)w[ql_at / 2 + 1] << 16);
                ql[c][u][1] = (unsigned int)w[ql_at / 2 + 16] | ((unsigned int)w[ql_at / 2 + 17] << 16);
                qh[c][u] = (unsigned int)w[qh_at / 2] | ((unsigned int)w[qh_at / 2 + 1] << 16);
                unsigned int s = 0;
#pragma unroll
                for (int t = 0; t < 4; ++t) s |= (((unsigned int)w[sc_at / 2 + t] >> sc_shift) & 0xffu) << (8 * t);
                sc[c][u] = s;
                dw[c][u] = w[104];
            }
        }
#pragma unroll
        for (int u = 0; u < K8_STEPS; ++u) {
            if (sb0 + 2 * u >= nb) break;
            const unsigned int sb = sb0 + 2 * u + half;
            const bool live = sb < nb;
            const unsigned int sbc = live ? sb : nb - 1;
            int a[4], sa[4];
            float dx[4];
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                a[s] = xq[(sbc * 256 + 128 * h + 32 * s + l0) / 4];
                sa[s] = -32 * byte_sum(a[s], 0);
                dx[s] = xd[sbc * 8 + 4 * h + s];
            }
#pragma unroll
            for (int c = 0; c < N; ++c) {
                float dot = 0.f;
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const unsigned int q = ((ql[c][u][s & 1] >> (4 * (s >> 1))) & 0x0f0f0f0fu) |
                                           (((qh[c][u] >> (2 * s)) & 0x03030303u) << 4);
                    const int scale = (int)(signed char)((sc[c][u] >> (8 * s)) & 0xffu);
                    dot = fmaf((float)(scale * dp4a_us(q, a[s], sa[s])), dx[s], dot);
                }
                const float part = f16_to_f32((f16_bits)dw[c][u]) * dot;
                acc[c] = live ? acc[c] + part : acc[c];
            }
        }
    }
}
