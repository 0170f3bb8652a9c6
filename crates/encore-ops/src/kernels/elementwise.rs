//! Elementwise operations:
//!
//! - `add`: `y[i] += x[i]` over `n` elements;
//! - `add_rows`: `y[r, j] += b[j]` over `rows` rows of `n` (a bias);
//! - `silu_mul`: `y[i] = silu(g[i]) * u[i]`, `silu(v) = v / (1 + e^-v)`,
//!   with ggml's `e^x` (llama.cpp's SwiGLU);
//! - `gelu_mul`: `y[i] = gelu(g[i]) * u[i]` with the tanh approximation
//!   `gelu(v) = v/2 (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))` (GeGLU, as
//!   Gemma uses it), as llama.cpp's CPU backend evaluates it: 0 below -10,
//!   `v` above 10, else of `v` rounded to f16, rounded to f16 (its table);
//! - `scale`: `y[i] *= s` over `n` elements (Gemma scales its embeddings).
//!
//! CPU: [`crate::cpu::kernels::elementwise`]; CUDA: `cuda/add.cu`,
//! `cuda/add_rows.cu`, `cuda/silu_mul.cu`, `cuda/gelu_mul.cu`, `cuda/scale.cu`;
//! wgpu: the `.wgsl` files of the same names in `wgsl/`.

use encore::Access;

crate::op_args! {
    /// `add`'s arguments: `y: f32[n]`, `x: f32[n]`, `n`.
    pub struct AddArgs { y: Access::ReadWrite, x: Access::Read; n: u32 }
}

crate::op_args! {
    /// `add_rows`'s arguments: `y: f32[rows, n]`, `b: f32[n]`, `[rows, n]`.
    pub struct AddRowsArgs { y: Access::ReadWrite, b: Access::Read; shape: [u32; 2] }
}

crate::op_args! {
    /// `silu_mul`'s arguments: `g, u, y: f32[n]`, `n`.
    pub struct SiluMulArgs { g: Access::Read, u: Access::Read, y: Access::Write; n: u32 }
}

crate::op_args! {
    /// `gelu_mul`'s arguments: `g, u, y: f32[n]`, `n`.
    pub struct GeluMulArgs { g: Access::Read, u: Access::Read, y: Access::Write; n: u32 }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ScaleShape {
    pub n: u32,
    pub s: f32,
}

crate::op_args! {
    /// `scale`'s arguments: `y: f32[n]`, `{n, s}`.
    pub struct ScaleArgs { y: Access::ReadWrite; shape: ScaleShape }
}
