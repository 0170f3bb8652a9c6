//! Elementwise kernels.
//!
//! - `add`: `y[i] += x[i]` — `y: f32[n]` (read-write), `x: f32[n]` (read), `n: u32`.
//! - `add_rows`: `y[r, j] += b[j]` — `y: f32[rows, n]` (read-write),
//!   `b: f32[n]` (read), `[rows, n]: [u32; 2]`.
//! - `silu_mul`: `y[i] = silu(g[i]) * u[i]`, `silu(v) = v / (1 + e^-v)` —
//!   `g: f32[n]` (read), `u: f32[n]` (read), `y: f32[n]` (write), `n: u32`.

use encore::KernelDef;

/// CUDA threads per block; every elementwise kernel covers its elements
/// with a grid-stride loop, one element a thread per step.
pub const CUDA_BLOCK: u32 = 256;

/// CUDA `add`: `y[i] += x[i]`, one thread per element.
const ADD_CUDA: &str = r#"
extern "C" __global__ void add(float* __restrict__ y, const float* __restrict__ x, unsigned int n) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] += x[i];
}
"#;

/// CUDA `add_rows`: `y[r, j] += b[j]`, one thread per element of `y`.
const ADD_ROWS_CUDA: &str = r#"
struct RowsCols {
    unsigned int rows;
    unsigned int n;
};

extern "C" __global__ void add_rows(float* __restrict__ y, const float* __restrict__ b, RowsCols s) {
    const unsigned int total = s.rows * s.n;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
        y[i] += b[i % s.n];
}
"#;

/// CUDA `silu_mul`: `y[i] = g[i] / (1 + e^-g[i]) * u[i]`, one thread per element.
const SILU_MUL_CUDA: &str = r#"
extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ y, unsigned int n) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = g[i];
        y[i] = v / (1.0f + expf(-v)) * u[i];
    }
}
"#;

pub fn add_def() -> KernelDef {
    KernelDef::new("add")
        .op("add")
        .cpu("add f32 v1", |a| {
            let n = a.scalar::<u32>(2)? as usize;
            let (y, x) = (a.write::<f32>(0)?, a.read::<f32>(1)?);
            super::need("y", y, n)?;
            super::need("x", x, n)?;
            add_into(&mut y[..n], &x[..n]);
            Ok(())
        })
        .cuda(ADD_CUDA, "add")
}

pub fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// `y[i] += x[i]`.
pub fn add_into(y: &mut [f32], x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += x);
}

/// `y[i] = silu(g[i]) * u[i]`.
pub fn silu_mul_into(g: &[f32], u: &[f32], y: &mut [f32]) {
    for ((y, g), u) in y.iter_mut().zip(g).zip(u) {
        *y = silu(*g) * u;
    }
}

pub fn silu_mul_def() -> KernelDef {
    KernelDef::new("silu_mul")
        .op("silu_mul")
        .cpu("silu_mul f32 v1", |a| {
            let n = a.scalar::<u32>(3)? as usize;
            let (g, u, y) = (a.read::<f32>(0)?, a.read::<f32>(1)?, a.write::<f32>(2)?);
            super::need("g", g, n)?;
            super::need("u", u, n)?;
            super::need("y", y, n)?;
            silu_mul_into(&g[..n], &u[..n], &mut y[..n]);
            Ok(())
        })
        .cuda(SILU_MUL_CUDA, "silu_mul")
}

pub fn add_rows_def() -> KernelDef {
    KernelDef::new("add_rows")
        .op("add_rows")
        .cpu("add_rows f32 v1", |a| {
            let [rows, n] = a.scalar::<[u32; 2]>(2)?.map(|v| v as usize);
            let (y, b) = (a.write::<f32>(0)?, a.read::<f32>(1)?);
            super::need("y", y, rows * n)?;
            super::need("b", b, n)?;
            for row in y[..rows * n].chunks_exact_mut(n.max(1)) {
                row.iter_mut().zip(&b[..n]).for_each(|(y, b)| *y += b);
            }
            Ok(())
        })
        .cuda(ADD_ROWS_CUDA, "add_rows")
}
