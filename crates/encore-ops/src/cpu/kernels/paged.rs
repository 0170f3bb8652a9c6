//! The CPU bodies of `rope_rows`, `kv_store_paged`, `attention_paged` and
//! `attention_step_paged` ([`crate::kernels::paged`]).
//!
//! `attention_paged` gathers one KV head of a sequence's visible positions
//! out of its blocks into a contiguous scratch, then runs the one-row
//! recurrence of [`super::attention::attend_head`] on it for each query
//! head of that KV head: every row gets exactly the arithmetic a decode
//! step of the contiguous cache gives it, whatever the batch.

use std::cell::RefCell;

use encore::{parallel, CpuArgs};
use half::f16;
use half::slice::HalfFloatSliceExt;

use super::attention::attend_head;
use super::rope::rope_head_scaled;
use crate::kernels::attention::MAX_HEAD_DIM;
use crate::kernels::attention_step::{STEP_K_NEW, STEP_ROPE_K, STEP_ROPE_Q, STEP_V_NEW};
use crate::kernels::paged::{
    AttnStepPagedArgs, PagedAttnArgs, PagedAttnShape, PagedKvArgs, RopeRowsArgs,
};

/// The CPU body of `rope_rows`.
pub(crate) fn rope_rows(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = RopeRowsArgs::from_cpu(a)?;
    let s = args.shape;
    let (rows, hd, rd) = (s.rows as usize, s.head_dim as usize, s.rope_dim as usize);
    if rd > hd || !rd.is_multiple_of(2) {
        return Err(format!(
            "rope_dim {rd} must be even and at most head_dim {hd}"
        ));
    }
    let positions = args.positions.read::<u32>()?;
    super::need("positions", positions, rows)?;
    let x = args.x.write::<f32>()?;
    let dim = s.heads as usize * hd;
    super::need("x", x, rows * dim)?;
    let factors = match s.factors {
        0 => None,
        _ => {
            let f = args.factors.read::<f32>()?;
            super::need("factors", f, rd / 2)?;
            Some(&f[..rd / 2])
        }
    };
    for (row, &pos) in x[..rows * dim].chunks_exact_mut(dim.max(1)).zip(positions) {
        for head in row.chunks_exact_mut(hd.max(1)) {
            rope_head_scaled(head, pos, rd, s.base, s.neox != 0, factors);
        }
    }
    Ok(())
}

/// The CPU body of `kv_store_paged`.
pub(crate) fn kv_store_paged(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = PagedKvArgs::from_cpu(a)?;
    let s = args.shape;
    let (rows, kv_dim) = (s.rows as usize, s.kv_dim as usize);
    let src = args.src.read::<f32>()?;
    let slots = args.slots.read::<u32>()?;
    let cache = args.cache.write::<f16>()?;
    super::need("src", src, rows * kv_dim)?;
    super::need("slots", slots, rows)?;
    super::need("cache", cache, s.slots as usize * kv_dim)?;
    for (r, &slot) in slots[..rows].iter().enumerate() {
        if slot >= s.slots {
            return Err(format!("slot {slot} past the pool of {} slots", s.slots));
        }
        let at = slot as usize * kv_dim;
        cache[at..at + kv_dim].convert_from_f32_slice(&src[r * kv_dim..(r + 1) * kv_dim]);
    }
    Ok(())
}

thread_local! {
    /// One KV head of one sequence's visible positions, gathered: K, then V.
    static GATHERED: RefCell<(Vec<f16>, Vec<f16>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The CPU body of `attention_paged`.
pub(crate) fn attention_paged(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = PagedAttnArgs::from_cpu(a)?;
    let s = args.shape;
    let positions = args.positions.read::<u32>()?;
    let tables = args.tables.read::<u32>()?;
    check_tables(&s, positions, tables)?;
    let (q, k, v) = (
        args.q.read::<f32>()?,
        args.k.read::<f16>()?,
        args.v.read::<f16>()?,
    );
    let out = args.out.write::<f32>()?;
    attend_paged(&s, q, k, v, positions, tables, out)
}

/// The CPU body of `attention_step_paged`: the unfused ops' own code in
/// their order (`rope_rows` of the query and of the new K rows,
/// `kv_store_paged` of the new K and V rows, `attention_paged`), so a fused
/// CPU graph equals the unfused one bit for bit.
pub(crate) fn attention_step_paged(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = AttnStepPagedArgs::from_cpu(a)?;
    let (s, rope, flags) = (args.shape.attn, args.shape.rope, args.shape.flags);
    let (rows, heads, hd) = (s.rows as usize, s.heads as usize, s.head_dim as usize);
    let kv_dim = s.kv_heads as usize * hd;
    let rd = rope.rope_dim as usize;
    if rope.factors != 0 {
        return Err("attention_step_paged takes no frequency factors".into());
    }
    if flags & (STEP_ROPE_Q | STEP_ROPE_K) != 0 && (rd > hd || !rd.is_multiple_of(2)) {
        return Err(format!(
            "rope_dim {rd} must be even and at most head_dim {hd}"
        ));
    }
    let positions = args.positions.read::<u32>()?;
    let tables = args.tables.read::<u32>()?;
    check_tables(&s, positions, tables)?;
    let (base, neox) = (rope.base, rope.neox != 0);
    let rotate = |x: &mut [f32], dim: usize| {
        for (row, &pos) in x.chunks_exact_mut(dim.max(1)).zip(positions) {
            for head in row.chunks_exact_mut(hd.max(1)) {
                rope_head_scaled(head, pos, rd, base, neox, None);
            }
        }
    };
    let mut q = args.q.read::<f32>()?.to_vec();
    super::need("q", &q, rows * heads * hd)?;
    q.truncate(rows * heads * hd);
    if flags & STEP_ROPE_Q != 0 {
        rotate(&mut q, heads * hd);
    }
    // The new rows, stored where `kv_store_paged` stores them.
    let pool = s.blocks as usize * s.block_size as usize;
    let store = |cache: &mut [f16], src: &[f32]| -> Result<(), String> {
        let slots = args.slots.read::<u32>()?;
        super::need("slots", slots, rows)?;
        super::need("cache", cache, pool * kv_dim)?;
        for (r, &slot) in slots[..rows].iter().enumerate() {
            if slot as usize >= pool {
                return Err(format!("slot {slot} past the pool of {pool} slots"));
            }
            let at = slot as usize * kv_dim;
            cache[at..at + kv_dim].convert_from_f32_slice(&src[r * kv_dim..(r + 1) * kv_dim]);
        }
        Ok(())
    };
    let new_rows = |src: &crate::args::CpuArg<'_, '_>, name: &str| -> Result<Vec<f32>, String> {
        let src = src.read::<f32>()?;
        super::need(name, src, rows * kv_dim)?;
        Ok(src[..rows * kv_dim].to_vec())
    };
    let k: &[f16] = if flags & STEP_K_NEW != 0 {
        let mut row = new_rows(&args.k_new, "k_new")?;
        if flags & STEP_ROPE_K != 0 {
            rotate(&mut row, kv_dim);
        }
        let cache = args.k.write::<f16>()?;
        store(cache, &row)?;
        cache
    } else {
        args.k.read::<f16>()?
    };
    let v: &[f16] = if flags & STEP_V_NEW != 0 {
        let row = new_rows(&args.v_new, "v_new")?;
        let cache = args.v.write::<f16>()?;
        store(cache, &row)?;
        cache
    } else {
        args.v.read::<f16>()?
    };
    let out = args.out.write::<f32>()?;
    attend_paged(&s, &q, k, v, positions, tables, out)
}

/// Checks `s` and that every row's table covers its position with blocks
/// of the pool.
fn check_tables(s: &PagedAttnShape, positions: &[u32], tables: &[u32]) -> Result<(), String> {
    let (rows, heads, kvh, hd) = (
        s.rows as usize,
        s.heads as usize,
        s.kv_heads as usize,
        s.head_dim as usize,
    );
    if kvh == 0 || heads % kvh != 0 {
        return Err(format!("{heads} heads do not divide into {kvh} KV heads"));
    }
    if hd > MAX_HEAD_DIM || hd == 0 {
        return Err(format!("head size {hd} outside 1..={MAX_HEAD_DIM}"));
    }
    let (bs, max_blocks) = (s.block_size as usize, s.max_blocks as usize);
    if bs == 0 {
        return Err("block size 0".into());
    }
    super::need("positions", positions, rows)?;
    super::need("tables", tables, rows * max_blocks)?;
    for (r, &p) in positions[..rows].iter().enumerate() {
        let p = p as usize;
        let table = &tables[r * max_blocks..(r + 1) * max_blocks];
        let used = p / bs + 1;
        if used > max_blocks {
            return Err(format!(
                "row {r}: position {p} needs {used} blocks, tables hold {max_blocks}"
            ));
        }
        if let Some(b) = table[..used].iter().find(|&&b| b >= s.blocks) {
            return Err(format!("row {r}: block {b} past the pool of {}", s.blocks));
        }
    }
    Ok(())
}

/// The attention of [`attention_paged`] over checked tables
/// ([`check_tables`]).
fn attend_paged(
    s: &PagedAttnShape,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    positions: &[u32],
    tables: &[u32],
    out: &mut [f32],
) -> Result<(), String> {
    let (rows, heads, kvh, hd) = (
        s.rows as usize,
        s.heads as usize,
        s.kv_heads as usize,
        s.head_dim as usize,
    );
    let (bs, max_blocks) = (s.block_size as usize, s.max_blocks as usize);
    let kv_dim = kvh * hd;
    let slots = s.blocks as usize * bs;
    super::need("q", q, rows * heads * hd)?;
    super::need("k", k, slots * kv_dim)?;
    super::need("v", v, slots * kv_dim)?;
    super::need("out", out, rows * heads * hd)?;
    let group = heads / kvh;
    // One task per (row, KV head): its query heads are adjacent in `out`.
    parallel::for_each_chunk_mut(&mut out[..rows * heads * hd], group * hd, |i, o| {
        let (r, g) = (i / kvh, i % kvh);
        let pos = positions[r] as usize;
        let table = &tables[r * max_blocks..(r + 1) * max_blocks];
        let first = s.first_visible(pos);
        let len = pos + 1 - first;
        GATHERED.with(|cell| {
            let mut scratch = cell.borrow_mut();
            let (gk, gv) = &mut *scratch;
            gk.resize(len * hd, f16::ZERO);
            gv.resize(len * hd, f16::ZERO);
            for (j, t) in (first..=pos).enumerate() {
                let slot = table[t / bs] as usize * bs + t % bs;
                let at = slot * kv_dim + g * hd;
                gk[j * hd..(j + 1) * hd].copy_from_slice(&k[at..at + hd]);
                gv[j * hd..(j + 1) * hd].copy_from_slice(&v[at..at + hd]);
            }
            for (j, oh) in o.chunks_exact_mut(hd).enumerate() {
                let h = g * group + j;
                let qh = &q[(r * heads + h) * hd..(r * heads + h + 1) * hd];
                attend_head(qh, gk, gv, len, hd, 0, s.scale, oh);
            }
        });
    });
    Ok(())
}
