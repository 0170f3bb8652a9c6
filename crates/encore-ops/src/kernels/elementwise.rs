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

use encore::{Access, KernelDef};

use crate::cpu::kernels::elementwise as cpu;
use crate::cuda;

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

pub fn add_def() -> KernelDef {
    KernelDef::new("add")
        .op("add")
        .cpu("add f32 v1", cpu::add)
        .cuda(cuda::add())
        .wgpu(crate::wgsl::add())
        .programmatic()
}

pub fn add_rows_def() -> KernelDef {
    KernelDef::new("add_rows")
        .op("add_rows")
        .cpu("add_rows f32 v1", cpu::add_rows)
        .cuda(cuda::add_rows())
        .wgpu(crate::wgsl::add_rows())
        .programmatic()
}

pub fn silu_mul_def() -> KernelDef {
    KernelDef::new("silu_mul")
        .op("silu_mul")
        .cpu("silu_mul f32 ggml-exp v2", cpu::silu_mul)
        .cuda(cuda::silu_mul())
        .wgpu(crate::wgsl::silu_mul())
        .programmatic()
}

pub fn gelu_mul_def() -> KernelDef {
    KernelDef::new("gelu_mul")
        .op("gelu_mul")
        .cpu("gelu_mul f32 tanh f16-table v2", cpu::gelu_mul)
        .cuda(cuda::gelu_mul())
        .wgpu(crate::wgsl::gelu_mul())
        .programmatic()
}

pub fn scale_def() -> KernelDef {
    KernelDef::new("scale")
        .op("scale")
        .cpu("scale f32 v1", cpu::scale)
        .cuda(cuda::scale())
        .wgpu(crate::wgsl::scale())
        .programmatic()
}
