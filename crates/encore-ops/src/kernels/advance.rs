//! `advance`: the bookkeeping of one greedy decode step on the device, so
//! that steps can follow each other without the host in between: the step's
//! argmax becomes the next input token, is appended to a history of tokens
//! at the current position, and the position moves on by one.
//!
//! Arguments: `next: u32[1]` (read, the argmax), `token: u32[1]` (write, the
//! token parameter), `pos: u32[1]` (read-write, the position parameter),
//! `history: u32[cap]` (write), `cap: u32` (value). A position at or past
//! `cap` appends nothing (the position still moves on).

use encore::KernelDef;

const ADVANCE_CUDA: &str = r#"
extern "C" __global__ void advance(const unsigned int* __restrict__ next, unsigned int* __restrict__ token,
                                   unsigned int* __restrict__ pos, unsigned int* __restrict__ history,
                                   unsigned int cap) {
    encore_grid_wait();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const unsigned int t = next[0], p = pos[0];
    if (p < cap) history[p] = t;
    token[0] = t;
    pos[0] = p + 1;
}
"#;

pub fn def() -> KernelDef {
    KernelDef::new("advance")
        .op("advance")
        .cpu("advance v1", |a| {
            let cap = a.scalar::<u32>(4)? as usize;
            let t = super::param(a, 0)?;
            let pos = a.write::<u32>(2)?;
            super::need("pos", pos, 1)?;
            let p = pos[0];
            pos[0] = p.wrapping_add(1);
            if (p as usize) < cap {
                let history = a.write::<u32>(3)?;
                super::need("history", history, cap)?;
                history[p as usize] = t;
            }
            let token = a.write::<u32>(1)?;
            super::need("token", token, 1)?;
            token[0] = t;
            Ok(())
        })
        .cuda(ADVANCE_CUDA, "advance")
        .programmatic()
}
