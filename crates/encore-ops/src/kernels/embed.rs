//! Embedding lookup: `y[r, :] = dequantize(table[tokens[r], :])`.
//!
//! CPU: [`crate::cpu::kernels::embed`]; CUDA: `cuda/embed.cu`; wgpu:
//! `wgsl/embed.wgsl` (bit for bit the CPU's dequantization).

use encore::Access;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct EmbedShape {
    pub rows: u32,
    pub dim: u32,
    pub vocab: u32,
    /// ggml type id of the table.
    pub dtype: u32,
}

crate::op_args! {
    /// `embed`'s arguments: `table: dtype[vocab, dim]`, `tokens: u32[rows]`,
    /// `y: f32[rows, dim]`.
    pub struct EmbedArgs { table: Access::Read, tokens: Access::Read, y: Access::Write; shape: EmbedShape }
}
