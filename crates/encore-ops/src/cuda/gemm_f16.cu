// `gemm_f16`: a plain f16 matrix product on tensor cores, the inner loop of
// the long prompts' products (kernels/gemm_dense.rs): `y[r, n0 + j] =
// Σ_i b[j, i] a[r, i]` for `a: f16[rows, k]` (the activations, rounded by
// `to_f16_rows`), `b: f16[n, k]` (a slice of a weight matrix, decoded by
// `dequant_f16`), `y: f32[rows, ldy]` (write, columns n0..n0 + n), every
// sum in f32.
//
// Arguments: `a` (read), `b` (read), `y` (write), `GemmF16Shape s` (value).
//
// One block of GF_THREADS threads a tile of GF_BM rows by GF_BN columns,
// blocks along the rows first so that the blocks sharing a slice of `b`
// run together and read it from L2. The block walks `k` in steps of GF_BK,
// GF_STAGES steps in flight: `cp.async` copies a step's tiles into shared
// memory while the warps multiply an earlier one. A tile row of GF_BK
// 16-bit values is GF_BK / 8 16-byte chunks, chunk `c` of row `r` stored
// at chunk `c ^ (r % 8)` (64 positions: a row is all 32 banks) or `c ^
// ((r / 2) % 4)` (32: two rows are), so that the eight rows an `ldmatrix`
// phase reads lie in distinct banks. The warps, GF_WARPS_M along the rows by
// GF_WARPS_N along the columns, each own 64 x 64 of the tile: 4 x 8
// `mma.m16n8k16` accumulators, 8 `ldmatrix.x4` for 32 `mma` a step of 16.
//
// Products whose tiles would leave most of the GPU idle split `k` into
// `splits` equal runs of steps (grid z), each storing its sums in its own
// `rows` rows of `y`, which `sum_splits` then adds in order. Each output's
// sum runs over its run of `k` in order, 16 positions an `mma`, in one
// accumulator: it depends on its row of `a`, its row of `b` and the split
// count alone, never on the tile's other rows or the slice. `k` must be a
// multiple of 8 (16-byte rows of chunks); rows, columns and positions past
// the matrices are zero in shared memory and never stored.

#include "mma.cuh"

// GF_WARPS_M, GF_WARPS_N, GF_BK and GF_STAGES come from Rust
// (cuda/geometry.rs), prepended to this source.
#define GF_BM (64 * GF_WARPS_M)
#define GF_BN (64 * GF_WARPS_N)
#define GF_THREADS (32 * GF_WARPS_M * GF_WARPS_N)

struct GemmF16Shape {
    unsigned int rows;
    unsigned int n;
    unsigned int k;
    unsigned int ldy;
    unsigned int n0;
    unsigned int splits;
};

#define GF_A_BYTES (GF_BM * GF_BK * 2)
#define GF_STAGE_BYTES ((GF_BM + GF_BN) * GF_BK * 2)

__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Byte offset in a tile of the 16-byte chunk `c` of row `r` (swizzled).
__device__ __forceinline__ unsigned int gf_chunk(unsigned int r, unsigned int c) {
#if GF_BK == 64
    return r * (GF_BK * 2) + ((c ^ (r & 7u)) << 4);
#else
    return r * (GF_BK * 2) + ((c ^ ((r >> 1) & 3u)) << 4);
#endif
}

// Copies step `k0` of the ROWS rows r0.. of `src` (`count` rows of `k`)
// into the tile at `tile`.
template <unsigned int ROWS>
__device__ __forceinline__ void gf_load(unsigned int tile, const unsigned short* __restrict__ src,
                                        unsigned int r0, unsigned int count, unsigned int k, unsigned int k0) {
    constexpr unsigned int chunks = ROWS * GF_BK / 8;
#pragma unroll
    for (unsigned int i = threadIdx.x; i < chunks; i += GF_THREADS) {
        const unsigned int r = i / (GF_BK / 8), c = i % (GF_BK / 8), col = k0 + 8 * c;
        const bool valid = r0 + r < count && col < k;
        const unsigned short* p = valid ? src + (size_t)(r0 + r) * k + col : src;
        cp_async16(tile + gf_chunk(r, c), p, valid);
    }
}

extern "C" __global__ void __launch_bounds__(GF_THREADS, 2)
gemm_f16(const unsigned short* __restrict__ a, const unsigned short* __restrict__ b, float* __restrict__ y,
         GemmF16Shape s) {
    extern __shared__ uint4 gf_smem[];
    const unsigned int base = encore_smem_addr(gf_smem);
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned int wm = warp / GF_WARPS_N, wn = warp % GF_WARPS_N;
    const unsigned int m0 = blockIdx.x * GF_BM, c0 = blockIdx.y * GF_BN;
    // Split `blockIdx.z` of `s.splits` takes its share of the steps and
    // stores its sums in its own rows of `y` (see the file's doc).
    const unsigned int all_steps = (s.k + GF_BK - 1) / GF_BK, share = (all_steps + s.splits - 1) / s.splits;
    const unsigned int first = blockIdx.z * share;
    const unsigned int steps = first >= all_steps ? 0 : min(share, all_steps - first);
    const unsigned int kbase = first * GF_BK;
    y += (size_t)blockIdx.z * s.rows * s.ldy;
    encore_grid_wait();

    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    // Stage `st` holds the A tile at base + st STAGE and the B tile after it.
#pragma unroll
    for (unsigned int st = 0; st < GF_STAGES - 1; ++st) {
        if (st < steps) {
            gf_load<GF_BM>(base + st * GF_STAGE_BYTES, a, m0, s.rows, s.k, kbase + st * GF_BK);
            gf_load<GF_BN>(base + st * GF_STAGE_BYTES + GF_A_BYTES, b, c0, s.n, s.k, kbase + st * GF_BK);
        }
        cp_async_commit();
    }

    for (unsigned int step = 0; step < steps; ++step) {
        cp_async_wait<GF_STAGES - 2>();
        __syncthreads();
        // The stage the previous step multiplied is free now: fill it with
        // the step GF_STAGES - 1 ahead.
        const unsigned int ahead = step + GF_STAGES - 1;
        if (ahead < steps) {
            const unsigned int st = ahead % GF_STAGES;
            gf_load<GF_BM>(base + st * GF_STAGE_BYTES, a, m0, s.rows, s.k, kbase + ahead * GF_BK);
            gf_load<GF_BN>(base + st * GF_STAGE_BYTES + GF_A_BYTES, b, c0, s.n, s.k, kbase + ahead * GF_BK);
        }
        cp_async_commit();

        const unsigned int st = step % GF_STAGES;
        const unsigned int ta = base + st * GF_STAGE_BYTES, tb = ta + GF_A_BYTES;
#pragma unroll
        for (unsigned int kk = 0; kk < GF_BK / 8; kk += 2) {
            unsigned int af[4][4], bf[8][2];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                const unsigned int r = wm * 64 + mt * 16 + (lane % 16);
                ldmatrix_x4(ta + gf_chunk(r, kk + lane / 16), af[mt]);
            }
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                const unsigned int r = wn * 64 + np * 16 + (lane % 8) + 8 * (lane / 16);
                unsigned int q[4];
                ldmatrix_x4(tb + gf_chunk(r, kk + (lane / 8) % 2), q);
                bf[2 * np][0] = q[0];
                bf[2 * np][1] = q[1];
                bf[2 * np + 1][0] = q[2];
                bf[2 * np + 1][1] = q[3];
            }
#pragma unroll
            for (int mt = 0; mt < 4; ++mt)
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) mma16816<false>(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
        }
    }
    cp_async_wait<0>();

    // Thread (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 and
    // columns 2t and 2t + 1 of each m16n8 tile.
    const bool pairs = ((s.ldy | s.n0) & 1u) == 0;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const unsigned int col = c0 + wn * 64 + nt * 8 + 2 * (lane % 4);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned int row = m0 + wm * 64 + mt * 16 + lane / 4 + 8 * h;
                if (row >= s.rows) continue;
                float* out = y + (size_t)row * s.ldy + s.n0 + col;
                if (pairs && col + 1 < s.n) {
                    *reinterpret_cast<float2*>(out) = make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
                } else {
                    if (col < s.n) out[0] = acc[mt][nt][2 * h];
                    if (col + 1 < s.n) out[1] = acc[mt][nt][2 * h + 1];
                }
            }
        }
}
