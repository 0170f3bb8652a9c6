//! Batches of independent sequences over a paged KV cache: the ops of a
//! serving step, where every activation row carries its own position and
//! its own sequence's cache.
//!
//! The paged cache of one layer is a pool of blocks of `block_size`
//! positions, each position `kv_dim` f16 values (K and V in separate pools):
//! position `t` of a sequence lives in block `table[t / block_size]` at
//! offset `t % block_size`, so a slot (pool row) is
//! `table[t / block_size] * block_size + t % block_size`. Sequences share
//! the pool through their block tables; the host allocates blocks as a
//! sequence grows (see the engine's block allocator).
//!
//! - `rope_rows`: RoPE of `rows` rows, in place, row `r` at `positions[r]`:
//!   [`super::rope`]'s body and arguments with each row's own position.
//! - `kv_store_paged`: `cache[slots[r]] = f16(src[r])` for every row:
//!   [`super::attention`]'s `kv_store` with each row's own slot.
//! - `attention_paged`: row `r` (one query position of some sequence) and
//!   head `h` attend over positions `0..=positions[r]` (the last `window`
//!   with a sliding window) of the sequence whose block table is row `r` of
//!   `tables` (`max_blocks` entries a row): [`super::attention`]'s body,
//!   the cache read through the table.
//!
//! Each of these is its contiguous twin's body with the
//! [`PositionSource`](super::positions::PositionSource) `Rows`; `Ops` has
//! one method for both (`rope`, `kv_store`, `attention`).
//! - `matmul_rows`: the product of [`super::matmul`] with each row's
//!   arithmetic independent of how many rows the dispatch has, so that a
//!   sequence's results do not depend on what else is in its batch. On the
//!   CPU that is the `matmul` body itself (its sums never depend on the
//!   tile); on CUDA it is the `matmul` kernel held to its one-row path for
//!   every row, a row per grid row, or for a pass of many prompt rows the
//!   tiled tensor-core `gemm` at any row count (whose sums for a row do not
//!   depend on what shares its tile either). Its fused form,
//!   `fused_matmul_rows`, is what batch graphs' fusion builds from it.
//!
//! - `attention_step_paged`: for decode rows (one a sequence), the RoPE of
//!   the query and the new K row, the stores of the new K and V rows and
//!   the attention in one dispatch, as [`super::attention_step`] folds them
//!   for a single sequence; the fusion rules build it from the three ops
//!   above (each part optional). Each row's positions are split over
//!   several blocks as in `attention_step`, the split depending only on the
//!   row's own position.
//!
//! - `argmax_rows`: the argmax of each row of the logits (as
//!   [`super::argmax`], the first index among equal maxima), so that greedy
//!   rows take one index each off the device instead of their logits;
//!   `u32::MAX` for a row whose largest value is not finite (a model whose
//!   output went bad).
//!
//! Rows are independent in every op here: a row's result depends only on
//! its own inputs and its own sequence's cache, never on the batch around
//! it, which is what makes a request's output the same alone or batched.
//!
//! CPU: the bodies of the contiguous twins ([`crate::cpu::kernels::rope`],
//! [`crate::cpu::kernels::attention`], [`crate::cpu::kernels::attention_step`]),
//! `argmax_rows` in [`crate::cpu::kernels::argmax`]; CUDA: the twins' files
//! (`cuda/rope.cu`, `cuda/kv_store.cu`, `cuda/attention.cu`,
//! `cuda/attention_step.cu`) compiled with `POSITION_ROWS` 1,
//! `cuda/argmax_rows.cu` (the body shared with `argmax.cu` in
//! `cuda/argmax_common.cuh`); wgpu: `rope_rows` and `kv_store_paged` from
//! the twins' files likewise; the paged attention has no WGSL
//! implementation yet and reports `Unsupported` there.

use encore::Access;

use super::attention::AttnShape;
use super::attention_step::{STEP_K_NEW, STEP_V_NEW};
use super::rope::RopeShape;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PagedAttnShape {
    pub rows: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    /// Entries of a block table row.
    pub max_blocks: u32,
    /// Blocks the pool holds (a table entry at or past it is refused).
    pub blocks: u32,
    pub scale: f32,
    /// A sliding window: each query sees only the last `window` positions,
    /// its own included. 0 sees every position.
    pub window: u32,
    /// 1 when every row is the newest position of a sequence no other row
    /// of the dispatch belongs to (the decode rows of a step), so that no
    /// row reads a position another row stores in the same step: the
    /// condition under which the fusion rules fold the rows' stores into the
    /// attention (`attention_step_paged`). 0 makes no such promise. The
    /// kernels do not read it.
    pub decode: u32,
}

impl PagedAttnShape {
    /// The attention's parameters as [`AttnShape`] has them, the pool's
    /// slots (`blocks * block_size`) as the cache's rows.
    pub fn attn(&self) -> AttnShape {
        AttnShape {
            rows: self.rows,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            max_seq: self.blocks.saturating_mul(self.block_size),
            scale: self.scale,
            window: self.window,
        }
    }

    /// The first position a query at position `at` sees.
    pub fn first_visible(&self, at: usize) -> usize {
        match self.window as usize {
            0 => 0,
            w => (at + 1).saturating_sub(w),
        }
    }
}

crate::op_args! {
    /// `attention_paged`'s arguments: `q: f32[rows, heads * head_dim]`,
    /// `k, v: f16[blocks * block_size, kv_dim]`, `positions: u32[rows]`,
    /// `tables: u32[rows, max_blocks]`, `out: f32[rows, heads * head_dim]`.
    pub struct PagedAttnArgs {
        q: Access::Read,
        k: Access::Read,
        v: Access::Read,
        positions: Access::Read,
        tables: Access::Read,
        out: Access::Write;
        shape: PagedAttnShape
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttnStepPagedShape {
    /// The attention; its `rows` (the first word) is not compiled into
    /// specialized variants: the kernel takes its row from the grid.
    pub attn: PagedAttnShape,
    /// The rotation of the query and the new K rows, as
    /// [`super::attention_step::AttnStepShape::rope`] (`rows` and `heads`
    /// are not used; the fusion rules leave them 0).
    pub rope: RopeShape,
    /// Which parts are folded in: the `STEP_*` bits of
    /// [`super::attention_step`].
    pub flags: u32,
}

impl AttnStepPagedShape {
    /// How a cache is bound: read-write when the step stores its new rows
    /// (`flag` set), read otherwise.
    pub fn cache_access(&self, flag: u32) -> Access {
        if self.flags & flag != 0 {
            Access::ReadWrite
        } else {
            Access::Read
        }
    }

    /// The step's shape with nothing folded in yet: `attention_paged`'s.
    pub fn unfused(attn: PagedAttnShape) -> AttnStepPagedShape {
        AttnStepPagedShape {
            attn,
            rope: bytemuck::Zeroable::zeroed(),
            flags: 0,
        }
    }
}

crate::op_args! {
    /// `attention_step_paged`'s arguments: those of `attention_paged`, with
    /// `k_new, v_new: f32[rows, kv_dim]` (empty views when not folded) and
    /// `slots: u32[rows]`, where each row's new K and V rows go (bound to
    /// `positions` when no store is folded).
    pub struct AttnStepPagedArgs {
        q: Access::Read,
        k_new: Access::Read,
        v_new: Access::Read,
        k: shape.cache_access(STEP_K_NEW),
        v: shape.cache_access(STEP_V_NEW),
        positions: Access::Read,
        slots: Access::Read,
        tables: Access::Read,
        out: Access::Write;
        shape: AttnStepPagedShape
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ArgmaxRowsShape {
    pub rows: u32,
    /// Values a row.
    pub n: u32,
}

crate::op_args! {
    /// `argmax_rows`' arguments: `x: f32[rows, n]`, `out: u32[rows, 4]`
    /// (each row's index in its first word; the other three the scratch of
    /// [`super::argmax`], zero before and after a dispatch).
    pub struct ArgmaxRowsArgs { x: Access::Read, out: Access::ReadWrite; shape: ArgmaxRowsShape }
}
