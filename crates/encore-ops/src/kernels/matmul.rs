//! Matrix products with (possibly quantized) weights:
//! `y[r, j] = sum_i w[j, i] * x[r, i]` for `rows` activation rows.
//!
//! //! The CPU quantizes `x` to 8-bit blocks for quantized weights (as ggml
//! does; [`crate::cpu::kernels::matmul`]). CUDA has two versions of the
//! quantized products, one per [`KernelSet`](super::KernelSet): by default it multiplies dequantized weights
//! with f32 `x` (`cuda/matmul.cu`), which agrees with the CPU to the
//! activation quantization error; the exact version (`cuda/matmul_exact.cu`)
//! quantizes `x` as the CPU does and gives the CPU's results bit for bit,
//! at some cost in speed. Both share the kernel (`cuda/matmul.cuh`) and
//! the float products (`cuda/matmul_dots.cuh`) and differ in the quantized
//! products (`cuda/quant_dots_fast.cuh`, `cuda/quant_dots_exact.cuh`),
//! which the fused products use as well. On CUDA, from
//! [`super::gemm::GEMM_MIN_ROWS`] rows on, `Ops::matmul` dispatches the
//! tiled tensor-core kernel of [`super::gemm`] instead of this one where the
//! device has it (not in the exact set: it is not bit-identical). wgpu
//! (default set only) multiplies dequantized weights with f32 `x` as well
//! (`wgsl/matmul.wgsl`), in tiles of activation rows per weight read.

use encore::Access;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MatmulShape {
    pub rows: u32,
    pub n: u32,
    pub k: u32,
    /// ggml type id of the weights.
    pub dtype: u32,
}

crate::op_args! {
    /// `matmul`'s (and `gemm`'s) arguments: `w: dtype[n, k]` (raw GGUF
    /// blocks), `x: f32[rows, k]`, `y: f32[rows, n]`.
    pub struct MatmulArgs { w: Access::Read, x: Access::Read, y: Access::Write; shape: MatmulShape }
}
