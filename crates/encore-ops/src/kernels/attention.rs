//! The KV cache and grouped-query attention over it.
//!
//! The cache of one layer holds `max_seq` positions of `kv_heads * head_dim`
//! f16 values for K and for V (f16 like llama.cpp's default cache).
//!
//! `kv_store`: writes `rows` f32 rows into the cache at the position
//! parameter. Arguments: `src: f32[rows, kv_dim]` (read), `cache:
//! f16[max_seq, kv_dim]` (write), `pos: u32[1]` (read), [`KvShape`] (value).
//!
//! `attention`: for query row `r` (position `pos + r`) and head `h`, with KV
//! head `h / (heads / kv_heads)`: `s[t] = scale * q[r, h] · K[t]` for
//! `t <= pos + r`, `p = softmax(s)`, `out[r, h] = sum_t p[t] V[t]`. Q and the
//! probabilities are rounded to f16 before their products, as llama.cpp does
//! with an f16 cache. Arguments: `q: f32[rows, heads * head_dim]` (read),
//! `k, v: f16[max_seq, kv_dim]` (read), `pos: u32[1]` (read),
//! `out: f32[rows, heads * head_dim]` (write), [`AttnShape`] (value).

use encore::KernelDef;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct KvShape {
    pub rows: u32,
    pub kv_dim: u32,
    pub max_seq: u32,
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
}

pub fn kv_store_def() -> KernelDef {
    KernelDef::new("kv_store")
        .op("kv_store")
        .cpu("kv_store f16 v1", |a| {
            let s: KvShape = a.scalar(3)?;
            let pos = super::param(a, 2)? as usize;
            let (rows, kv_dim) = (s.rows as usize, s.kv_dim as usize);
            if pos + rows > s.max_seq as usize {
                return Err(format!(
                    "position {} past the cache of {}",
                    pos + rows,
                    s.max_seq
                ));
            }
            let src = a.read::<f32>(0)?;
            let cache = a.write::<f16>(1)?;
            super::need("src", src, rows * kv_dim)?;
            super::need("cache", cache, (pos + rows) * kv_dim)?;
            cache[pos * kv_dim..(pos + rows) * kv_dim]
                .convert_from_f32_slice(&src[..rows * kv_dim]);
            Ok(())
        })
}

/// Dot product with eight independent accumulators, so it vectorizes.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Attention of one query head over positions `0..len` of a cache already
/// widened to f32 (`k`, `v`: `[len, kv_dim]`), reading the head's slice at
/// `kv_off`; `scores` is scratch space.
#[allow(clippy::too_many_arguments)]
pub fn attend_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    kv_dim: usize,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let hd = q.len().min(MAX_HEAD_DIM);
    let mut q16 = [0.0f32; MAX_HEAD_DIM];
    let q16 = &mut q16[..hd];
    for (d, s) in q16.iter_mut().zip(q) {
        *d = f16::from_f32(*s).to_f32();
    }
    scores.clear();
    scores.extend((0..len).map(|t| {
        let base = t * kv_dim + kv_off;
        scale * dot(q16, &k[base..base + hd])
    }));
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (t, s) in scores.iter().enumerate() {
        let p = f16::from_f32(s / sum).to_f32();
        let base = t * kv_dim + kv_off;
        for (o, x) in out.iter_mut().zip(&v[base..base + hd]) {
            *o += p * x;
        }
    }
}

/// The largest head size the CPU attention supports.
pub const MAX_HEAD_DIM: usize = 256;

thread_local! {
    /// Per-thread scratch: the cache widened to f32.
    static WIDE: std::cell::Cell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::Cell::new((Vec::new(), Vec::new())) };
    /// Per-thread scratch: one head's attention scores.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

pub fn attention_def() -> KernelDef {
    KernelDef::new("attention")
        .op("attention")
        .cpu("attention f16-cache v2", |a| {
            let s: AttnShape = a.scalar(5)?;
            let pos = super::param(a, 3)? as usize;
            let (rows, heads, kvh, hd) = (
                s.rows as usize,
                s.heads as usize,
                s.kv_heads as usize,
                s.head_dim as usize,
            );
            if kvh == 0 || heads % kvh != 0 {
                return Err(format!("{heads} heads do not divide into {kvh} KV heads"));
            }
            if hd > MAX_HEAD_DIM {
                return Err(format!("head size {hd} above {MAX_HEAD_DIM}"));
            }
            if pos + rows > s.max_seq as usize {
                return Err(format!(
                    "position {} past the cache of {}",
                    pos + rows,
                    s.max_seq
                ));
            }
            let kv_dim = kvh * hd;
            let (q, k, v) = (a.read::<f32>(0)?, a.read::<f16>(1)?, a.read::<f16>(2)?);
            let out = a.write::<f32>(4)?;
            let len = pos + rows;
            super::need("q", q, rows * heads * hd)?;
            super::need("k", k, len * kv_dim)?;
            super::need("v", v, len * kv_dim)?;
            super::need("out", out, rows * heads * hd)?;
            let group = heads / kvh;
            // The widened cache is taken out of its per-thread slot while rayon
            // runs the heads, so a task stolen by this thread cannot find it borrowed.
            let (mut kf, mut vf) = WIDE.with(|w| w.take());
            {
                kf.resize(len * kv_dim, 0.0);
                vf.resize(len * kv_dim, 0.0);
                k[..len * kv_dim].convert_to_f32_slice(&mut kf);
                v[..len * kv_dim].convert_to_f32_slice(&mut vf);
                let (kf, vf) = (&*kf, &*vf);
                out[..rows * heads * hd]
                    .par_chunks_mut(hd)
                    .enumerate()
                    .for_each(|(i, o)| {
                        let (r, h) = (i / heads, i % heads);
                        let qh = &q[i * hd..(i + 1) * hd];
                        let off = (h / group) * hd;
                        SCORES.with(|sc| {
                            let scores = &mut sc.borrow_mut();
                            attend_head(qh, kf, vf, pos + r + 1, kv_dim, off, s.scale, o, scores);
                        });
                    });
            }
            WIDE.with(|w| w.replace((kf, vf)));
            Ok(())
        })
}
