//! Argmax: `out[0] = argmax_i x[i]` (the first index among equal maxima).
//!
//! Arguments: `x: f32[n]` (read), `out: u32[1]` (write), `n: u32` (value).

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

/// CUDA: one block of [`CUDA_BLOCK`] threads. Each thread keeps the best
/// `(value, index)` of a strided part (read 16 bytes at a time when aligned); the block reduces pairs with warp
/// shuffles, preferring the larger value and, among equal values, the
/// smaller index. As on the CPU, a NaN never wins, and a NaN at index 0
/// makes the answer 0.
const ARGMAX_CUDA: &str = r#"
__device__ __forceinline__ void argmax_take(float& v, unsigned int& i, float ov, unsigned int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

extern "C" __global__ void argmax(const float* __restrict__ x, unsigned int* __restrict__ out, unsigned int n) {
    encore_fix_value(n);
    encore_grid_wait();
    __shared__ float best_v[32];
    __shared__ unsigned int best_i[32];
    float v = __uint_as_float(0xff800000u);  // -infinity (NVRTC has no math.h)
    unsigned int i = 0xffffffffu;
    unsigned int tail = 0;
    if (((size_t)x & 15u) == 0) {
        // Four values a load, several loads in flight per thread.
        const float4* x4 = reinterpret_cast<const float4*>(x);
        const unsigned int n4 = n / 4;
#pragma unroll 4
        for (unsigned int q = threadIdx.x; q < n4; q += blockDim.x) {
            const float4 a = x4[q];
            argmax_take(v, i, a.x, 4 * q);
            argmax_take(v, i, a.y, 4 * q + 1);
            argmax_take(v, i, a.z, 4 * q + 2);
            argmax_take(v, i, a.w, 4 * q + 3);
        }
        tail = 4 * n4;
    }
    for (unsigned int j = tail + threadIdx.x; j < n; j += blockDim.x) argmax_take(v, i, x[j], j);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_take(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) { best_v[warp] = v; best_i[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        const unsigned int warps = (blockDim.x + 31) / 32;
        v = lane < warps ? best_v[lane] : __uint_as_float(0xff800000u);
        i = lane < warps ? best_i[lane] : 0xffffffffu;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            argmax_take(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
        if (lane == 0) out[0] = (i == 0xffffffffu || n == 0 || x[0] != x[0]) ? 0u : i;
    }
}
"#;

/// CUDA threads in the one block.
pub const CUDA_BLOCK: u32 = 1024;

pub fn def() -> KernelDef {
    KernelDef::new("argmax")
        .op("argmax")
        .cpu("argmax f32 v1", |a| {
            let n = a.scalar::<u32>(2)? as usize;
            let x = a.read::<f32>(0)?;
            super::need("x", x, n)?;
            let out = a.write::<u32>(1)?;
            super::need("out", out, 1)?;
            out[0] = argmax(&x[..n]);
            Ok(())
        })
        .cuda(ARGMAX_CUDA, "argmax")
        .programmatic()
        .specializable()
}

#[cfg(test)]
mod tests {
    use super::argmax;

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
