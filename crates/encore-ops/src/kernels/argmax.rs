//! Argmax: `out[0] = argmax_i x[i]` (the first index among equal maxima; a
//! NaN never wins, except at index 0).
//!
//! `out[1..4]` is scratch for an implementation that merges partial results
//! of many blocks (CUDA's): it must be zero before a dispatch and is zero
//! again after it (see [`crate::Ops::argmax_buffer`]).
//!
//! CPU: [`crate::cpu::kernels::argmax`]; CUDA: `cuda/argmax.cu`; wgpu:
//! `wgsl/argmax.wgsl`.

use encore::Access;

/// Bytes of the `out` buffer: the index, then the kernel's scratch.
pub const OUT_BYTES: usize = 16;

crate::op_args! {
    /// `argmax`'s arguments: `x: f32[n]`, `out: u32[4]`, `n`.
    pub struct ArgmaxArgs { x: Access::Read, out: Access::ReadWrite; n: u32 }
}
