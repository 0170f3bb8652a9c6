//! `advance`: the bookkeeping of one greedy decode step on the device, so
//! that steps can follow each other without the host in between: the step's
//! argmax becomes the next input token, is appended to a history of tokens
//! at the current position, and the position moves on by one. A position at
//! or past the history's capacity appends nothing (the position still moves
//! on).
//!
//! CPU: [`crate::cpu::kernels::advance`]; CUDA: `cuda/advance.cu`; wgpu:
//! `wgsl/advance.wgsl`.

use encore::Access;

crate::op_args! {
    /// `advance`'s arguments: `next: u32[1]` (the argmax), `token: u32[1]`
    /// (the token parameter), `pos: u32[1]` (the position parameter),
    /// `history: u32[cap]`, `cap`.
    pub struct AdvanceArgs {
        next: Access::Read,
        token: Access::Write,
        pos: Access::ReadWrite,
        history: Access::Write;
        cap: u32
    }
}
