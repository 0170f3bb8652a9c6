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
}
