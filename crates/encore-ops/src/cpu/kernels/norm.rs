//! The CPU body of `rms_norm` ([`crate::kernels::norm`]).

use encore::CpuArgs;

use crate::kernels::norm::NormArgs;

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

pub(crate) fn rms_norm(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = NormArgs::from_cpu(a)?;
    let s = args.shape;
    let dim = s.dim as usize;
    let n = s.rows as usize * dim;
    let (x, w, y) = (
        args.x.read::<f32>()?,
        args.w.read::<f32>()?,
        args.y.write::<f32>()?,
    );
    super::need("x", x, n)?;
    super::need("w", w, dim)?;
    super::need("y", y, n)?;
    for (xr, yr) in x[..n].chunks_exact(dim).zip(y[..n].chunks_exact_mut(dim)) {
        rms_norm_row(xr, &w[..dim], yr, s.eps);
    }
    Ok(())
}
