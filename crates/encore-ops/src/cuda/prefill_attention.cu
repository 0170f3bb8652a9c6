// `attention_prefill`: causal grouped-query attention of a prefill batch on
// tensor cores, tiled flash-attention style: the `attention` op (same
// arguments, same CPU body) for batches of many rows and head sizes of 16,
// 32, 64 or 128.
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
// One block of FA_THREADS threads (four warps) takes FA_ROWS query rows of
// one head, each warp 16 of them. The queries, rounded to f16 (as the decode
// kernel rounds them), are loaded once as `mma` A fragments. Then, per tile
// of FA_KV cache positions up to the block's last row, K and V come into
// shared memory (f16 as cached; rows padded by 16 bytes so that `ldmatrix`
// reads them without bank conflicts) and each warp:
//
// 1. `S = scale * Q Kᵀ` for its 16 rows by the tile's 64 positions
//    (`mma.m16n8k16`, f32 accumulators; K rows are B's columns);
// 2. masks positions past each row's own (`t > pos + r`), and moves each
//    row's running maximum `m` to the tile's, rescaling the row's sum `l`
//    and its accumulator `O` by `e^(m_old - m)` (online softmax);
// 3. `p = e^(S - m)`, added to `l` in f32, rounded to f16 as the A operand
//    of `O += P V` (V through `ldmatrix.trans`, as B).
//
// At the end `out = O / l`. A score's S fragment is exactly the layout of
// P's A fragment, so the weights never leave registers. Against the exact
// softmax the result differs by the f16 rounding of the queries (as in the
// decode kernel) and of the weights (2^-11 relative). FA_ROWS, FA_KV and
// FA_THREADS come from Rust, prepended to this source (cuda/geometry.rs).

#include "gguf.cuh"
#include "attention_common.cuh"
#include "mma.cuh"

template <bool TRANS>
__device__ __forceinline__ void fa_ldmatrix_x4(const unsigned short* p, unsigned int* r) {
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(encore_smem_addr(p)) : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(encore_smem_addr(p)) : "memory");
}

template <int D>
__device__ void flash_rows(const float* __restrict__ q, const f16_bits* __restrict__ k,
                           const f16_bits* __restrict__ v, float* __restrict__ out, const AttnShape& s,
                           unsigned int pos, unsigned short* sm) {
    const int PITCH = D + 8;
    unsigned short* ks = sm;                   // the query tile, then each K tile
    unsigned short* vs = sm + FA_KV * PITCH;   // each V tile
    const unsigned int tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const unsigned int h = blockIdx.x, m0 = blockIdx.y * FA_ROWS;
    const unsigned int kv_dim = s.kv_heads * D, kv_off = (h / (s.heads / s.kv_heads)) * D;
    const float neg_inf = __uint_as_float(0xff800000u);

    // The block's queries, rounded to f16, into the K buffer for their fragments.
    for (unsigned int e = tid; e < FA_ROWS * D / 2; e += FA_THREADS) {
        const unsigned int row = e / (D / 2), c = 2 * (e % (D / 2)), r = m0 + row;
        float a = 0.f, b = 0.f;
        if (r < s.rows) {
            const float* qr = q + ((size_t)r * s.heads + h) * D + c;
            a = qr[0];
            b = qr[1];
        }
        *reinterpret_cast<unsigned int*>(ks + row * PITCH + c) = pack_f16(a, b);
    }
    __syncthreads();
    unsigned int qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        fa_ldmatrix_x4<false>(ks + (warp * 16 + (lane % 16)) * PITCH + kk * 16 + 8 * (lane / 16), qa[kk]);

    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float mx[2] = {neg_inf, neg_inf}, l[2] = {0.f, 0.f};
    // This thread's rows g and g + 8 see positions up to pos + row.
    const unsigned int ra = m0 + warp * 16 + lane / 4;
    const unsigned int lim[2] = {pos + ra, pos + ra + 8};
    const unsigned int kv_end = pos + min(s.rows, m0 + FA_ROWS);

    for (unsigned int t0 = 0; t0 < kv_end; t0 += FA_KV) {
        __syncthreads();  // the previous tile (or the queries) fully read
        for (unsigned int e = tid; e < FA_KV * D / 8; e += FA_THREADS) {
            const unsigned int p = e / (D / 8), c = 8 * (e % (D / 8)), t = t0 + p;
            uint4 kx = make_uint4(0u, 0u, 0u, 0u), vx = kx;
            if (t < kv_end) {
                kx = *reinterpret_cast<const uint4*>(k + (size_t)t * kv_dim + kv_off + c);
                vx = *reinterpret_cast<const uint4*>(v + (size_t)t * kv_dim + kv_off + c);
            }
            *reinterpret_cast<uint4*>(ks + p * PITCH + c) = kx;
            *reinterpret_cast<uint4*>(vs + p * PITCH + c) = vx;
        }
        __syncthreads();

        // Scores of the warp's 16 rows against the tile's 64 positions.
        float sc[FA_KV / 8][4];
#pragma unroll
        for (int j = 0; j < FA_KV / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
            for (int np = 0; np < FA_KV / 16; ++np) {
                unsigned int r[4];
                fa_ldmatrix_x4<false>(ks + (np * 16 + (lane % 8) + 8 * (lane / 16)) * PITCH + kk * 16 + 8 * ((lane / 8) % 2), r);
                mma16816<false>(sc[2 * np], qa[kk], r[0], r[1]);
                mma16816<false>(sc[2 * np + 1], qa[kk], r[2], r[3]);
            }
        // Causal mask, scale, and the running maximum of each row (a row's
        // 64 scores are spread over the four threads of a quad).
        float tmax[2] = {neg_inf, neg_inf};
#pragma unroll
        for (int j = 0; j < FA_KV / 8; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const unsigned int t = t0 + 8 * j + 2 * (lane % 4) + (c & 1);
                sc[j][c] = t <= lim[c / 2] ? sc[j][c] * s.scale : neg_inf;
                tmax[c / 2] = fmaxf(tmax[c / 2], sc[j][c]);
            }
        float alpha[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 1));
            tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 2));
            const float m_new = fmaxf(mx[i], tmax[i]);
            alpha[i] = expf(mx[i] - m_new);
            mx[i] = m_new;
            l[i] *= alpha[i];
        }
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[j][0] *= alpha[0];
            o[j][1] *= alpha[0];
            o[j][2] *= alpha[1];
            o[j][3] *= alpha[1];
        }
        // Weights p = e^(s - max), summed per thread, rounded to f16 as the A operand of P V.
#pragma unroll
        for (int kk = 0; kk < FA_KV / 16; ++kk) {
            float p[2][4];
#pragma unroll
            for (int u = 0; u < 2; ++u)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    p[u][c] = expf(sc[2 * kk + u][c] - mx[c / 2]);
                    l[c / 2] += p[u][c];
                }
            const unsigned int pa[4] = {pack_f16(p[0][0], p[0][1]), pack_f16(p[0][2], p[0][3]),
                                        pack_f16(p[1][0], p[1][1]), pack_f16(p[1][2], p[1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned int r[4];
                fa_ldmatrix_x4<true>(vs + (kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2)) * PITCH + dp * 16 + 8 * (lane / 16), r);
                mma16816<false>(o[2 * dp], pa, r[0], r[1]);
                mma16816<false>(o[2 * dp + 1], pa, r[2], r[3]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned int r = ra + 8 * i;
        if (r >= s.rows) continue;
        const float inv = 1.f / l[i];
        float* orow = out + ((size_t)r * s.heads + h) * D + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            orow[8 * j] = o[j][2 * i] * inv;
            orow[8 * j + 1] = o[j][2 * i + 1] * inv;
        }
    }
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
attention_prefill(const float* __restrict__ q, const f16_bits* __restrict__ k, const f16_bits* __restrict__ v,
                  const unsigned int* __restrict__ pos, float* __restrict__ out, AttnShape s) {
    extern __shared__ uint4 fa_smem[];
    encore_grid_wait();
    if (s.kv_heads == 0 || s.heads % s.kv_heads != 0) return;
    const unsigned long long p = pos[0];
    if (p + s.rows > s.max_seq || blockIdx.x >= s.heads) return;
    unsigned short* sm = reinterpret_cast<unsigned short*>(fa_smem);
    switch (s.head_dim) {
        case 16: flash_rows<16>(q, k, v, out, s, (unsigned int)p, sm); break;
        case 32: flash_rows<32>(q, k, v, out, s, (unsigned int)p, sm); break;
        case 64: flash_rows<64>(q, k, v, out, s, (unsigned int)p, sm); break;
        case 128: flash_rows<128>(q, k, v, out, s, (unsigned int)p, sm); break;
        default: break;
    }
}
