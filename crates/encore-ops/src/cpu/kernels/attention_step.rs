//! The CPU body of `attention_step` ([`crate::kernels::attention_step`])
//! and, with [`PositionSource::Rows`], of `attention_step_paged`
//! ([`crate::kernels::paged`]): the unfused operations' own code in their
//! order (the RoPE of the query rows and of the new K rows, the stores of
//! the new K and V rows, the attention), so a fused CPU graph equals the
//! unfused one bit for bit.

use encore::CpuArgs;
use half::f16;
use half::slice::HalfFloatSliceExt;

use super::attention::{attend_rows, check_tables, Layout};
use super::rope::rope_head;
use super::Positions;
use crate::args::CpuArg;
use crate::kernels::attention::AttnShape;
use crate::kernels::attention_step::{
    AttnStepArgs, STEP_K_NEW, STEP_ROPE_K, STEP_ROPE_Q, STEP_V_NEW,
};
use crate::kernels::paged::AttnStepPagedArgs;
use crate::kernels::positions::PositionSource;
use crate::kernels::rope::RopeShape;

/// The buffers of a step, whichever layout they came in.
struct Step<'r, 'a> {
    q: CpuArg<'r, 'a>,
    k_new: CpuArg<'r, 'a>,
    v_new: CpuArg<'r, 'a>,
    k: CpuArg<'r, 'a>,
    v: CpuArg<'r, 'a>,
    out: CpuArg<'r, 'a>,
}

pub(crate) fn attention_step(a: &CpuArgs<'_>, source: PositionSource) -> Result<(), String> {
    let name = match source {
        PositionSource::Start => "attention_step",
        PositionSource::Rows => "attention_step_paged",
    };
    match source {
        PositionSource::Start => {
            let args = AttnStepArgs::from_cpu(a)?;
            let s = args.shape;
            let pos = args.pos.param()?;
            let at = s.attn;
            if at.rows != 1 {
                return Err(format!("{} query rows; {name} takes one", at.rows));
            }
            if pos as usize >= at.max_seq as usize {
                return Err(format!(
                    "position {} past the cache of {}",
                    pos as usize + 1,
                    at.max_seq
                ));
            }
            let step = Step {
                q: args.q,
                k_new: args.k_new,
                v_new: args.v_new,
                k: args.k,
                v: args.v,
                out: args.out,
            };
            let place = Positions::Start(pos);
            let layout = Layout::Contiguous { pos: pos as usize };
            run(name, &step, at, s.rope, s.flags, place, place, &layout)
        }
        PositionSource::Rows => {
            let args = AttnStepPagedArgs::from_cpu(a)?;
            let s = args.shape;
            let rows = s.attn.rows as usize;
            let positions = args.positions.read::<u32>()?;
            let layout = check_tables(&s.attn, positions, args.tables.read()?)?;
            let slots = Positions::read(&args.slots, PositionSource::Rows, rows)?;
            let step = Step {
                q: args.q,
                k_new: args.k_new,
                v_new: args.v_new,
                k: args.k,
                v: args.v,
                out: args.out,
            };
            let place = Positions::Rows(positions);
            run(
                name,
                &step,
                s.attn.attn(),
                s.rope,
                s.flags,
                place,
                slots,
                &layout,
            )
        }
    }
}

/// The step of `at.rows` rows: row `r` at position `positions.at(r)`, its
/// new K and V rows stored in cache row `slots.at(r)`, the attention over
/// `layout`.
#[allow(clippy::too_many_arguments)]
fn run(
    name: &str,
    b: &Step<'_, '_>,
    at: AttnShape,
    rope: RopeShape,
    flags: u32,
    positions: Positions<'_>,
    slots: Positions<'_>,
    layout: &Layout<'_>,
) -> Result<(), String> {
    let (rows, heads, kvh, hd) = (
        at.rows as usize,
        at.heads as usize,
        at.kv_heads as usize,
        at.head_dim as usize,
    );
    let rd = rope.rope_dim as usize;
    if rope.factors != 0 {
        return Err(format!("{name} takes no frequency factors"));
    }
    if kvh == 0 || heads % kvh != 0 {
        return Err(format!("{heads} heads do not divide into {kvh} KV heads"));
    }
    if flags & (STEP_ROPE_Q | STEP_ROPE_K) != 0 && (rd > hd || !rd.is_multiple_of(2)) {
        return Err(format!(
            "rope_dim {rd} must be even and at most head_dim {hd}"
        ));
    }
    let kv_dim = kvh * hd;
    let (base, neox) = (rope.base, rope.neox != 0);
    // Rows rotated as `rope` rotates them in place.
    let rotate = |x: &mut [f32], dim: usize| {
        for (r, row) in x.chunks_exact_mut(dim.max(1)).enumerate() {
            for head in row.chunks_exact_mut(hd.max(1)) {
                rope_head(head, positions.at(r), rd, base, neox);
            }
        }
    };
    let mut q = b.q.read::<f32>()?.to_vec();
    super::need("q", &q, rows * heads * hd)?;
    q.truncate(rows * heads * hd);
    if flags & STEP_ROPE_Q != 0 {
        rotate(&mut q, heads * hd);
    }
    // The new rows, stored as `kv_store` stores them.
    let cap = at.max_seq as usize;
    let store = |cache: &mut [f16], src: &[f32]| -> Result<(), String> {
        if let Some(slot) = (0..rows).map(|r| slots.at(r)).find(|&t| t as usize >= cap) {
            return Err(format!("slot {slot} past the cache of {cap}"));
        }
        let last = (0..rows)
            .map(|r| slots.at(r) as usize + 1)
            .max()
            .unwrap_or(0);
        super::need("cache", cache, last * kv_dim)?;
        for (r, row) in src.chunks_exact(kv_dim.max(1)).enumerate() {
            let slot = slots.at(r) as usize;
            cache[slot * kv_dim..(slot + 1) * kv_dim].convert_from_f32_slice(row);
        }
        Ok(())
    };
    let new_rows = |src: &CpuArg<'_, '_>, what: &str| -> Result<Vec<f32>, String> {
        let src = src.read::<f32>()?;
        super::need(what, src, rows * kv_dim)?;
        Ok(src[..rows * kv_dim].to_vec())
    };
    let k: &[f16] = if flags & STEP_K_NEW != 0 {
        let mut new = new_rows(&b.k_new, "k_new")?;
        if flags & STEP_ROPE_K != 0 {
            rotate(&mut new, kv_dim);
        }
        let cache = b.k.write::<f16>()?;
        store(cache, &new)?;
        cache
    } else {
        b.k.read::<f16>()?
    };
    let v: &[f16] = if flags & STEP_V_NEW != 0 {
        let new = new_rows(&b.v_new, "v_new")?;
        let cache = b.v.write::<f16>()?;
        store(cache, &new)?;
        cache
    } else {
        b.v.read::<f16>()?
    };
    let out = b.out.write::<f32>()?;
    attend_rows(&q, k, v, layout, at, out)
}
