//! RMSNorm: `y[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * w[i]`.
//!
//! Arguments: `x: f32[rows, dim]` (read), `w: f32[dim]` (read),
//! `y: f32[rows, dim]` (write), [`NormShape`] (value).

use encore::KernelDef;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct NormShape {
    pub rows: u32,
    pub dim: u32,
    pub eps: f32,
}

/// One row. Squares are summed in f64, as ggml does, so the scale matches
/// llama.cpp's to the last bit.
pub fn rms_norm_row(x: &[f32], w: &[f32], y: &mut [f32], eps: f32) {
    let sum: f64 = x.iter().map(|v| f64::from(v * v)).sum();
    let mean_sq = (sum / x.len().max(1) as f64) as f32;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
        *y = x * scale * w;
    }
}

/// CUDA: one block per row. Each thread sums the squares of a strided part
/// of the row in f64 (like the CPU), the block reduces them with warp
/// shuffles and one shared-memory exchange between warps, then every thread
/// scales its part: `y = x * (1 / sqrt(mean + eps)) * w`, multiplied in the
/// CPU's order without fused multiply-adds. A thread keeps its first few
/// elements of `x` and `w` in registers, the weights loaded before the
/// wait for the previous kernel.
const RMS_NORM_CUDA: &str = r#"
struct NormShape {
    unsigned int rows;
    unsigned int dim;
    float eps;
};

// Elements of a row each thread keeps in registers (the rest of a longer
// row is read again for the output).
#define NORM_HELD 4

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ y, NormShape s) {
    encore_fix_value(s);
    // The weights are read-only: load the thread's share while the kernel
    // before this one finishes.
    float wv[NORM_HELD];
#pragma unroll
    for (int k = 0; k < NORM_HELD; ++k) {
        const unsigned int i = threadIdx.x + k * blockDim.x;
        wv[k] = i < s.dim ? w[i] : 0.f;
    }
    encore_grid_wait();
    __shared__ double partial[32];
    __shared__ float scale_shared;
    const unsigned int r = blockIdx.x;
    if (r >= s.rows) return;
    const float* xr = x + (size_t)r * s.dim;
    float* yr = y + (size_t)r * s.dim;
    float xv[NORM_HELD];
#pragma unroll
    for (int k = 0; k < NORM_HELD; ++k) {
        const unsigned int i = threadIdx.x + k * blockDim.x;
        xv[k] = i < s.dim ? xr[i] : 0.f;
    }
    double sum = 0.0;
#pragma unroll
    for (int k = 0; k < NORM_HELD; ++k) sum += (double)__fmul_rn(xv[k], xv[k]);
    for (unsigned int i = threadIdx.x + NORM_HELD * blockDim.x; i < s.dim; i += blockDim.x) {
        const float v = xr[i];
        sum += (double)__fmul_rn(v, v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        const unsigned int warps = (blockDim.x + 31) / 32;
        double total = lane < warps ? partial[lane] : 0.0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        if (lane == 0) {
            const float mean_sq = (float)(total / (double)(s.dim > 0 ? s.dim : 1));
            scale_shared = 1.0f / sqrtf(mean_sq + s.eps);
        }
    }
    __syncthreads();
    const float scale = scale_shared;
#pragma unroll
    for (int k = 0; k < NORM_HELD; ++k) {
        const unsigned int i = threadIdx.x + k * blockDim.x;
        if (i < s.dim) yr[i] = __fmul_rn(__fmul_rn(xv[k], scale), wv[k]);
    }
    for (unsigned int i = threadIdx.x + NORM_HELD * blockDim.x; i < s.dim; i += blockDim.x)
        yr[i] = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
}
"#;

/// CUDA threads per block (one block per row).
pub const CUDA_BLOCK: u32 = 256;

pub fn def() -> KernelDef {
    KernelDef::new("rms_norm")
        .op("rms_norm")
        .cpu("rms_norm f32 v1", |a| {
            let s: NormShape = a.scalar(3)?;
            let dim = s.dim as usize;
            let n = s.rows as usize * dim;
            let (x, w, y) = (a.read::<f32>(0)?, a.read::<f32>(1)?, a.write::<f32>(2)?);
            super::need("x", x, n)?;
            super::need("w", w, dim)?;
            super::need("y", y, n)?;
            for (xr, yr) in x[..n].chunks_exact(dim).zip(y[..n].chunks_exact_mut(dim)) {
                rms_norm_row(xr, &w[..dim], yr, s.eps);
            }
            Ok(())
        })
        .cuda(RMS_NORM_CUDA, "rms_norm")
        .programmatic()
        .specializable()
}
