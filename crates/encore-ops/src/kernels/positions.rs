//! Where the rows of a dispatch sit in their sequences: the one thing in
//! which the ops over one sequence's contiguous cache and the ops over a
//! paged cache of many sequences differ.
//!
//! Each of `rope`, `kv_store`, the attention and the attention step has one
//! body per backend that takes the source of its rows' positions (or cache
//! slots) as a parameter: a generic argument of the CPU body, a `#define`
//! that selects a template argument in CUDA, a constant prepended to the
//! WGSL source. Each source is compiled on its own, so a kernel reads its
//! positions without a branch per element, and the [`registry`] holds one
//! kernel per op and source (`rope` and `rope_rows`, ...).
//!
//! [`registry`]: crate::registry

/// Where row `r` of a dispatch sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionSource {
    /// Consecutive rows of one sequence: row `r` at `pos[0] + r`, where
    /// `pos` is a one-element parameter buffer (a graph parameter), and
    /// position `t` in row `t` of the sequence's own cache.
    Start,
    /// Rows of independent sequences: row `r` at `positions[r]` (or, for a
    /// store, at slot `slots[r]` of a paged pool), one `u32` a row.
    Rows,
}

impl PositionSource {
    /// The value of the `POSITION_ROWS` define (CUDA) and constant (WGSL)
    /// that selects this source: 1 for [`PositionSource::Rows`], else 0.
    pub fn rows_flag(self) -> u32 {
        match self {
            PositionSource::Start => 0,
            PositionSource::Rows => 1,
        }
    }
}
