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
            for (d, s) in cache[pos * kv_dim..(pos + rows) * kv_dim]
                .iter_mut()
                .zip(&src[..rows * kv_dim])
            {
                *d = f16::from_f32(*s);
            }
            Ok(())
        })
}

fn dot_f16(a: &[f16], b: &[f16]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x.to_f32() * y.to_f32()).sum()
}

/// Attention of one query head over positions `0..len`.
#[allow(clippy::too_many_arguments)]
pub fn attend_head(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    len: usize,
    kv_dim: usize,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = q.len();
    let q16: Vec<f16> = q.iter().map(|&x| f16::from_f32(x)).collect();
    let mut scores: Vec<f32> = (0..len)
        .map(|t| scale * dot_f16(&q16, &k[t * kv_dim + kv_off..t * kv_dim + kv_off + hd]))
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for s in &mut scores {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (t, s) in scores.iter().enumerate() {
        let p = f16::from_f32(s / sum).to_f32();
        let vt = &v[t * kv_dim + kv_off..t * kv_dim + kv_off + hd];
        for (o, x) in out.iter_mut().zip(vt) {
            *o += p * x.to_f32();
        }
    }
}

pub fn attention_def() -> KernelDef {
    KernelDef::new("attention")
        .op("attention")
        .cpu("attention f16-cache v1", |a| {
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
            super::need("q", q, rows * heads * hd)?;
            super::need("k", k, (pos + rows) * kv_dim)?;
            super::need("v", v, (pos + rows) * kv_dim)?;
            super::need("out", out, rows * heads * hd)?;
            let group = heads / kvh;
            out[..rows * heads * hd]
                .par_chunks_mut(hd)
                .enumerate()
                .for_each(|(i, o)| {
                    let (r, h) = (i / heads, i % heads);
                    let qh = &q[i * hd..(i + 1) * hd];
                    attend_head(qh, k, v, pos + r + 1, kv_dim, (h / group) * hd, s.scale, o);
                });
            Ok(())
        })
}
