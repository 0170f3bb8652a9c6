//! Rotary position embedding, in place, of `rows` rows, each at its
//! position: `pos + r` for consecutive rows of one sequence (`rope`), or
//! `positions[r]` for rows of independent sequences (`rope_rows`), one body
//! with the [`PositionSource`] as its parameter.
//!
//! For head element pair `i` (of `rope_dim / 2`), at position `p`:
//! `theta = p * base^(-2i / rope_dim)`, and the pair `(a, b)` becomes
//! `(a cos - b sin, a sin + b cos)`. The pair is `(x[2i], x[2i+1])` in the
//! normal layout (Llama as stored in GGUF) and `(x[i], x[i + rope_dim/2])` in
//! the NeoX layout (Qwen2). Elements past `rope_dim` are left alone. Angles
//! advance by repeated multiplication in f32, as ggml computes them. With
//! frequency factors (Llama 3's RoPE scaling, linear scaling) pair `i`'s
//! angle is divided by `factors[i]`; only `rope` takes them, so the fusion
//! rules leave a scaled `rope` unfused.
//!
//! `rope_store`: RoPE of `rows` rows of K followed by their store into the
//! f16 cache at the position parameter, in one dispatch; `x` itself is left
//! as it was. Built by the fusion pass from `rope` then `kv_store`.
//!
//! CPU: [`crate::cpu::kernels::rope`]; CUDA: `cuda/rope.cu` and
//! `cuda/rope_store.cu`, the rotation shared in `cuda/rope_common.cuh`;
//! wgpu: `wgsl/rope.wgsl` and `wgsl/rope_store.wgsl`, likewise sharing
//! `wgsl/rope_common.wgsl`.
//!
//! [`PositionSource`]: super::positions::PositionSource

use encore::Access;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RopeShape {
    pub rows: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub rope_dim: u32,
    pub base: f32,
    /// 1 for the NeoX layout, 0 for the normal one.
    pub neox: u32,
    /// `base^(-2 / rope_dim)` as the CPU computes it ([`theta_scale`]), so
    /// that GPU kernels need no `pow` of their own.
    pub theta_scale: f32,
    /// 1 when `rope`'s `factors` argument holds a divisor per pair; 0 when
    /// it is unused (it is then bound to `pos`). The fused kernels take 0 only.
    pub factors: u32,
}

/// The angle step: `base^(-2 / rope_dim)` in f32.
pub fn theta_scale(base: f32, rope_dim: usize) -> f32 {
    base.powf(-2.0 / rope_dim as f32)
}

crate::op_args! {
    /// The arguments of `rope` and `rope_rows`: `x: f32[rows, heads,
    /// head_dim]` (rotated in place), `pos`: `u32[1]`, the first row's
    /// position (a graph parameter), or `u32[rows]`, each row's (see
    /// [`super::positions`]), `factors: f32[rope_dim / 2]` (read where
    /// `shape.factors` is 1; else bound to `pos`).
    pub struct RopeArgs { x: Access::ReadWrite, pos: Access::Read, factors: Access::Read; shape: RopeShape }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RopeStoreShape {
    pub rope: RopeShape,
    pub max_seq: u32,
}

crate::op_args! {
    /// `rope_store`'s arguments: `x: f32[rows, heads, head_dim]`, `pos:
    /// u32[1]`, `cache: f16[max_seq, heads * head_dim]`.
    pub struct RopeStoreArgs {
        x: Access::Read,
        pos: Access::Read,
        cache: Access::Write;
        shape: RopeStoreShape
    }
}
