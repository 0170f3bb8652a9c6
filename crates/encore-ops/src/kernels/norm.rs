//! RMSNorm: `y[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * w[i]`,
//! the squares summed in f64 as ggml sums them, so the scale matches
//! llama.cpp's to the last bit.
//!
//! CPU: [`crate::cpu::kernels::norm`]; CUDA: `cuda/rms_norm.cu`; wgpu:
//! `wgsl/rms_norm.wgsl`.

use encore::Access;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct NormShape {
    pub rows: u32,
    pub dim: u32,
    pub eps: f32,
}

crate::op_args! {
    /// `rms_norm`'s arguments: `x: f32[rows, dim]`, `w: f32[dim]`, `y: f32[rows, dim]`.
    pub struct NormArgs { x: Access::Read, w: Access::Read, y: Access::Write; shape: NormShape }
}
