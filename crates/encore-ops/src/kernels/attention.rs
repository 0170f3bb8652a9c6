//! The KV cache and grouped-query attention over it.
//!
//! The cache of one layer holds `max_seq` positions of `kv_heads * head_dim`
//! f16 values for K and for V (f16 like llama.cpp's default cache).
//!
//! `kv_store`: writes `rows` f32 rows into the cache, row `r` into cache
//! row `pos + r` (consecutive positions of one sequence, `kv_store`) or into
//! slot `slots[r]` of a paged pool (`kv_store_paged`, see [`super::paged`]),
//! one body with the [`PositionSource`](super::positions::PositionSource)
//! as its parameter.
//!
//! `attention`: for query row `r` (position `pos + r`) and head `h`, with KV
//! head `h / (heads / kv_heads)`: `s[t] = scale * q[r, h] · K[t]` for
//! `t <= pos + r` (and, with a sliding window `w > 0`, `t > pos + r - w`),
//! `p = softmax(s)`, `out[r, h] = sum_t p[t] V[t]`.
//!
//! Over a paged cache, `attention_paged` ([`super::paged`]) is the same
//! body with each row's position and cache rows read through its block
//! table.
//!
//! CPU: [`crate::cpu::kernels::attention`], which follows llama.cpp's CPU
//! flash attention step by step; CUDA: `cuda/kv_store.cu` and
//! `cuda/attention.cu` (both entry points of each, the contiguous and the
//! paged), the parts the attention kernels share in
//! `cuda/attention_common.cuh`; wgpu: `wgsl/kv_store.wgsl` and
//! `wgsl/attention.wgsl`. The `attention` op has three more kernels:
//! [`super::prefill_attention`], [`super::attention_exact`] and
//! [`super::attention_step`].

use encore::Access;

/// The largest head size the attention kernels support.
pub const MAX_HEAD_DIM: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct KvShape {
    pub rows: u32,
    pub kv_dim: u32,
    /// Rows the cache holds: positions of one sequence, or slots of a pool.
    pub max_seq: u32,
}

crate::op_args! {
    /// The arguments of `kv_store` and `kv_store_paged`: `src: f32[rows,
    /// kv_dim]`, `cache: f16[max_seq, kv_dim]`, `pos`: `u32[1]`, the first
    /// row's position (a graph parameter), or `u32[rows]`, each row's slot.
    pub struct KvArgs { src: Access::Read, cache: Access::Write, pos: Access::Read; shape: KvShape }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttnShape {
    pub rows: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub max_seq: u32,
    pub scale: f32,
    /// A sliding window: each query sees only the last `window` positions,
    /// its own included (Gemma 3's local layers). 0 sees every position.
    pub window: u32,
}

impl AttnShape {
    /// The first position query row `r` sees (`pos` is the first row's).
    pub fn first_visible(&self, pos: usize, r: usize) -> usize {
        match self.window as usize {
            0 => 0,
            w => (pos + r + 1).saturating_sub(w),
        }
    }
}

crate::op_args! {
    /// The `attention` op's arguments, whichever kernel computes it: `q:
    /// f32[rows, heads * head_dim]`, `k, v: f16[max_seq, kv_dim]`, `pos:
    /// u32[1]`, `out: f32[rows, heads * head_dim]`.
    pub struct AttnArgs {
        q: Access::Read,
        k: Access::Read,
        v: Access::Read,
        pos: Access::Read,
        out: Access::Write;
        shape: AttnShape
    }
}
