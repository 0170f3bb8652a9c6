//! The CPU body of `attention_step` ([`crate::kernels::attention_step`]):
//! the unfused operations' own code in their order.

use encore::CpuArgs;
use half::f16;
use half::slice::HalfFloatSliceExt;

use super::attention::attend_rows;
use super::rope::rope_head;
use crate::kernels::attention_step::{
    AttnStepArgs, STEP_K_NEW, STEP_ROPE_K, STEP_ROPE_Q, STEP_V_NEW,
};

pub(crate) fn attention_step(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = AttnStepArgs::from_cpu(a)?;
    let s = args.shape;
    let pos = args.pos.param()? as usize;
    let at = s.attn;
    let (heads, kvh, hd) = (
        at.heads as usize,
        at.kv_heads as usize,
        at.head_dim as usize,
    );
    let rd = s.rope.rope_dim as usize;
    if s.rope.factors != 0 {
        return Err("attention_step takes no frequency factors".into());
    }
    if at.rows != 1 {
        return Err(format!("{} query rows; attention_step takes one", at.rows));
    }
    if kvh == 0 || heads % kvh != 0 {
        return Err(format!("{heads} heads do not divide into {kvh} KV heads"));
    }
    if s.flags & (STEP_ROPE_Q | STEP_ROPE_K) != 0 && (rd > hd || !rd.is_multiple_of(2)) {
        return Err(format!(
            "rope_dim {rd} must be even and at most head_dim {hd}"
        ));
    }
    if pos >= at.max_seq as usize {
        return Err(format!(
            "position {} past the cache of {}",
            pos + 1,
            at.max_seq
        ));
    }
    let kv_dim = kvh * hd;
    let (base, neox) = (s.rope.base, s.rope.neox != 0);
    // The query, rotated as `rope` rotates it in place.
    let mut q = args.q.read::<f32>()?.to_vec();
    super::need("q", &q, heads * hd)?;
    if s.flags & STEP_ROPE_Q != 0 {
        for head in q[..heads * hd].chunks_exact_mut(hd.max(1)) {
            rope_head(head, pos as u32, rd, base, neox);
        }
    }
    // The new rows, stored as `rope_store` and `kv_store` store them.
    let mut row = vec![0f32; kv_dim];
    let k: &[f16] = if s.flags & STEP_K_NEW != 0 {
        let src = args.k_new.read::<f32>()?;
        super::need("k_new", src, kv_dim)?;
        row.copy_from_slice(&src[..kv_dim]);
        if s.flags & STEP_ROPE_K != 0 {
            for head in row.chunks_exact_mut(hd.max(1)) {
                rope_head(head, pos as u32, rd, base, neox);
            }
        }
        let cache = args.k.write::<f16>()?;
        super::need("k", cache, (pos + 1) * kv_dim)?;
        cache[pos * kv_dim..(pos + 1) * kv_dim].convert_from_f32_slice(&row);
        cache
    } else {
        args.k.read::<f16>()?
    };
    let v: &[f16] = if s.flags & STEP_V_NEW != 0 {
        let src = args.v_new.read::<f32>()?;
        super::need("v_new", src, kv_dim)?;
        let cache = args.v.write::<f16>()?;
        super::need("v", cache, (pos + 1) * kv_dim)?;
        cache[pos * kv_dim..(pos + 1) * kv_dim].convert_from_f32_slice(&src[..kv_dim]);
        cache
    } else {
        args.v.read::<f16>()?
    };
    let out = args.out.write::<f32>()?;
    attend_rows(&q, k, v, pos, at, out)
}
