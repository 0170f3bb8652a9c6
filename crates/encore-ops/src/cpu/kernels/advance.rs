//! The CPU body of `advance` ([`crate::kernels::advance`]).

use encore::CpuArgs;

use crate::kernels::advance::AdvanceArgs;

pub(crate) fn advance(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = AdvanceArgs::from_cpu(a)?;
    let cap = args.cap as usize;
    let t = args.next.param()?;
    let pos = args.pos.write::<u32>()?;
    super::need("pos", pos, 1)?;
    let p = pos[0];
    pos[0] = p.wrapping_add(1);
    if (p as usize) < cap {
        let history = args.history.write::<u32>()?;
        super::need("history", history, cap)?;
        history[p as usize] = t;
    }
    let token = args.token.write::<u32>()?;
    super::need("token", token, 1)?;
    token[0] = t;
    Ok(())
}
