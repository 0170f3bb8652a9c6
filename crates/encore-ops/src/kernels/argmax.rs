//! Argmax: `out[0] = argmax_i x[i]` (the first index among equal maxima).
//!
//! Arguments: `x: f32[n]` (read), `out: u32[4]` (read-write), `n: u32`
//! (value). `out[1..4]` is the CUDA kernel's scratch for merging its
//! blocks' results: it must be zero before a dispatch and is zero again
//! after it (see [`crate::Ops::argmax_buffer`]).

use encore::KernelDef;

/// The first index of the largest value; a NaN never wins, and a NaN at
/// index 0 makes the answer 0 (what `if x[i] > x[best] { best = i }` gives).
///
/// Found in two passes that vectorize: the largest value, eight running
/// maxima at a time, then the first index that holds it.
pub fn argmax(x: &[f32]) -> u32 {
    let Some(&first) = x.first() else { return 0 };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [first; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = lanes.iter().fold(first, |m, &v| if v > m { v } else { m });
    for &v in chunks.remainder() {
        max = if v > max { v } else { max };
    }
    // `max` is one of the values, so the search finds it; 0.0 and -0.0 are
    // equal here as in the comparison above, which keeps the first of them.
    let chunk = x
        .chunks(64)
        .position(|c| c.iter().fold(false, |hit, &v| hit | (v == max)))
        .unwrap_or(0);
    let within = x[chunk * 64..].iter().position(|&v| v == max).unwrap_or(0);
    (chunk * 64 + within) as u32
}

/// CUDA: blocks of [`CUDA_BLOCK`] threads, each thread taking
/// [`CUDA_PER_THREAD`] values (four at a load when aligned, all its loads
/// in flight at once), so the whole vector takes one memory round trip
/// spread over many multiprocessors. A block reduces its best
/// `(value, index)` pairs with warp shuffles, preferring the larger value
/// and, among equal values, the smaller index, packs the winner into one
/// 64-bit key ordered the same way and merges it into `out[2..4]` with an
/// atomic maximum; the last block to finish (counted in `out[1]`) writes
/// the index to `out[0]` and sets `out[1..4]` back to zero. As on the CPU,
/// a NaN never wins, and a NaN at index 0 makes the answer 0.
const ARGMAX_CUDA: &str = r#"
#define ARGMAX_LOADS 4

__device__ __forceinline__ void argmax_take(float& v, unsigned int& i, float ov, unsigned int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// (value, index) as a key whose unsigned order is argmax_take's: the
// value's bits made monotonic (-0 counted as +0, which compares equal)
// above the complemented index; 0 for no value at all.
__device__ __forceinline__ unsigned long long argmax_key(float v, unsigned int i) {
    if (i == 0xffffffffu) return 0ull;
    const unsigned int b = __float_as_uint(v == 0.f ? 0.f : v);
    const unsigned int ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (unsigned long long)~i;
}

extern "C" __global__ void argmax(const float* __restrict__ x, unsigned int* __restrict__ out, unsigned int n) {
    encore_fix_value(n);
    encore_grid_wait();
    __shared__ unsigned long long best[32];
    __shared__ bool last;
    float v = __uint_as_float(0xff800000u);  // -infinity (NVRTC has no math.h)
    unsigned int i = 0xffffffffu;
    if (((size_t)x & 15u) == 0) {
        // Each block takes ARGMAX_LOADS * 4 * blockDim.x values, loaded
        // from addresses clamped into the vector (the extra ones ignored);
        // block 0 also takes the n % 4 values past the last full load.
        const float4* x4 = reinterpret_cast<const float4*>(x);
        const unsigned int n4 = n / 4;
        const unsigned int q0 = blockIdx.x * ARGMAX_LOADS * blockDim.x + threadIdx.x;
        if (n4 > 0) {
            float4 a[ARGMAX_LOADS];
#pragma unroll
            for (int u = 0; u < ARGMAX_LOADS; ++u) a[u] = x4[min(q0 + u * blockDim.x, n4 - 1)];
#pragma unroll
            for (int u = 0; u < ARGMAX_LOADS; ++u) {
                const unsigned int q = q0 + u * blockDim.x;
                if (q < n4) {
                    argmax_take(v, i, a[u].x, 4 * q);
                    argmax_take(v, i, a[u].y, 4 * q + 1);
                    argmax_take(v, i, a[u].z, 4 * q + 2);
                    argmax_take(v, i, a[u].w, 4 * q + 3);
                }
            }
        }
        if (blockIdx.x == 0)
            for (unsigned int j = 4 * n4 + threadIdx.x; j < n; j += blockDim.x) argmax_take(v, i, x[j], j);
    } else {
        for (unsigned int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
            argmax_take(v, i, x[j], j);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_take(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) best[warp] = argmax_key(v, i);
    __syncthreads();
    unsigned long long* key = reinterpret_cast<unsigned long long*>(out + 2);
    if (threadIdx.x == 0) {
        unsigned long long k = 0ull;
        for (unsigned int w = 0; w < (blockDim.x + 31) / 32; ++w) k = max(k, best[w]);
        if (k != 0ull) atomicMax(key, k);
        __threadfence();
        last = atomicAdd(out + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    // Every block's maximum is in: take the answer and leave the scratch zero.
    __threadfence();
    const unsigned long long k = atomicExch(key, 0ull);
    out[1] = 0u;
    out[0] = (k == 0ull || n == 0 || x[0] != x[0]) ? 0u : ~(unsigned int)(k & 0xffffffffull);
}
"#;

/// CUDA threads a block.
pub const CUDA_BLOCK: u32 = 256;

/// Values a CUDA thread takes (`4 * ARGMAX_LOADS` in the source).
pub const CUDA_PER_THREAD: u32 = 16;

/// Bytes of the `out` buffer: the index, then the kernel's scratch.
pub const OUT_BYTES: usize = 16;

/// The CUDA launch for `n` values.
pub fn cuda_launch(n: u32) -> encore::Launch {
    encore::Launch::new(n.div_ceil(CUDA_BLOCK * CUDA_PER_THREAD).max(1), CUDA_BLOCK)
}

pub fn def() -> KernelDef {
    KernelDef::new("argmax")
        .op("argmax")
        .cpu("argmax f32 v1", |a| {
            let n = a.scalar::<u32>(2)? as usize;
            let x = a.read::<f32>(0)?;
            super::need("x", x, n)?;
            let out = a.write::<u32>(1)?;
            super::need("out", out, OUT_BYTES / 4)?;
            out[0] = argmax(&x[..n]);
            Ok(())
        })
        .cuda(ARGMAX_CUDA, "argmax")
        .programmatic()
        .specializable()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launch covers every value with the loads the kernel makes.
    #[test]
    fn rust_and_cuda_agree_on_the_values_a_thread_takes() {
        let define = format!("#define ARGMAX_LOADS {}\n", CUDA_PER_THREAD / 4);
        assert!(ARGMAX_CUDA.contains(&define));
        for n in [1u32, 4096, 4097, 49152, 100_003] {
            let launch = cuda_launch(n);
            assert!(
                launch.grid[0] * launch.block[0] * CUDA_PER_THREAD >= n,
                "n {n}"
            );
            assert_eq!(launch.block[0], CUDA_BLOCK);
        }
    }

    fn one_pass(x: &[f32]) -> u32 {
        let mut best = 0usize;
        for (i, v) in x.iter().enumerate() {
            if *v > x[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_largest_and_skips_nans() {
        let mut seed = 3u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            seed >> 8
        };
        for n in [0usize, 1, 7, 8, 9, 64, 1000, 49152] {
            for trial in 0..20 {
                // Few distinct values, so that ties are common; some NaNs,
                // infinities and signed zeros.
                let x: Vec<f32> = (0..n)
                    .map(|_| match next() % 16 {
                        0 => f32::NAN,
                        1 => -0.0,
                        2 => 0.0,
                        3 if trial % 4 == 0 => f32::INFINITY,
                        4 => f32::NEG_INFINITY,
                        r => (r as f32 - 10.0) * 0.5,
                    })
                    .collect();
                assert_eq!(argmax(&x), one_pass(&x), "n {n} trial {trial}: {x:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 3.0, 3.0]), 2);
    }
}
