//! `attention_step`: decode attention (one query row) with the step's own
//! work on the new position folded in: RoPE of the query, RoPE of the new K
//! row and its store into the cache, the store of the new V row. The fusion
//! rules build it from `rope`, `rope_store`, `kv_store` and `attention`
//! nodes (see [`crate::fusion`]); each part is optional, so a rule can fold
//! one part at a time.
//!
//! The new rows go to position `pos`; the attention runs over positions
//! `0..=pos` exactly as `attention` does.
//!
//! The CPU body ([`crate::cpu::kernels::attention_step`]) runs the unfused
//! operations' own code in their order, so a fused CPU graph equals the
//! unfused one bit for bit.
//!
//! Over a paged cache, `attention_step_paged` ([`super::paged`]) is the
//! same body (CPU and CUDA) with each row's position, slot and cache rows
//! its own.
//!
//! CUDA: `cuda/attention_step.cu`; wgpu: `wgsl/attention_step.wgsl`.

use encore::Access;

use super::attention::AttnShape;
use super::rope::RopeShape;

/// Rotate the query (`rope` folded in).
pub const STEP_ROPE_Q: u32 = 1;
/// Store `k_new` at the position (`kv_store` or `rope_store` folded in).
pub const STEP_K_NEW: u32 = 2;
/// Rotate `k_new` before storing it (`rope_store` folded in).
pub const STEP_ROPE_K: u32 = 4;
/// Store `v_new` at the position (`kv_store` folded in).
pub const STEP_V_NEW: u32 = 8;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttnStepShape {
    /// The attention; `rows` is 1.
    pub attn: AttnShape,
    /// The rotation of the query and the new K row (`rows` and `heads` are
    /// not used: the counts come from `attn`).
    pub rope: RopeShape,
    /// Which parts are folded in: `STEP_*` bits.
    pub flags: u32,
}

impl AttnStepShape {
    /// How a cache is bound: read-write when the step stores its new row
    /// (`flag` set), read otherwise.
    pub fn cache_access(&self, flag: u32) -> Access {
        if self.flags & flag != 0 {
            Access::ReadWrite
        } else {
            Access::Read
        }
    }
}

crate::op_args! {
    /// `attention_step`'s arguments: `q: f32[heads * head_dim]`, `k_new,
    /// v_new: f32[kv_dim]` (empty views when not folded), `k, v:
    /// f16[max_seq, kv_dim]`, `pos: u32[1]`, `out: f32[heads * head_dim]`.
    pub struct AttnStepArgs {
        q: Access::Read,
        k_new: Access::Read,
        v_new: Access::Read,
        k: shape.cache_access(STEP_K_NEW),
        v: shape.cache_access(STEP_V_NEW),
        pos: Access::Read,
        out: Access::Write;
        shape: AttnStepShape
    }
}
