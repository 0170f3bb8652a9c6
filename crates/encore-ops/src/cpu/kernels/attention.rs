//! The CPU bodies of `kv_store` and `attention`
//! ([`crate::kernels::attention`]), each with its [`PositionSource`] a
//! parameter: with [`PositionSource::Rows`] they are `kv_store_paged` and
//! `attention_paged` ([`crate::kernels::paged`]).
//!
//! The attention follows llama.cpp's CPU flash attention step by step: below
//! [`FA_TILE_Q`] rows, Q and the weighted sum of V are rounded to f16; from
//! [`FA_TILE_Q`] rows on, everything stays f32, in tiles of [`FA_TILE_KV`]
//! positions. Rows of a paged cache belong to independent sequences: each
//! takes the one-row recurrence whatever the batch, on its KV head's
//! visible positions gathered out of its blocks, so that a sequence's
//! result does not depend on what shares its batch.

use encore::{parallel, CpuArgs};
use half::f16;
use half::slice::HalfFloatSliceExt;

#[cfg(target_arch = "x86_64")]
use super::elementwise::avx512;
#[cfg(not(target_arch = "x86_64"))]
use super::elementwise::ggml_expf_avx512;
use super::elementwise::{ggml_expf, GgmlVector};
use super::Positions;
use crate::kernels::attention::{AttnArgs, AttnShape, KvArgs, MAX_HEAD_DIM};
use crate::kernels::paged::{PagedAttnArgs, PagedAttnShape};
use crate::kernels::positions::PositionSource;

/// The CPU body of `kv_store` and, with [`PositionSource::Rows`],
/// `kv_store_paged`: row `r` into cache row `pos + r`, or into slot
/// `slots[r]`. Every row is checked before any is written.
pub(crate) fn kv_store(a: &CpuArgs<'_>, source: PositionSource) -> Result<(), String> {
    let args = KvArgs::from_cpu(a)?;
    let s = args.shape;
    let (rows, kv_dim, cap) = (s.rows as usize, s.kv_dim as usize, s.max_seq as usize);
    let at = Positions::read(&args.pos, source, rows)?;
    if let Positions::Start(pos) = at {
        if pos as usize + rows > cap {
            return Err(format!(
                "position {} past the cache of {cap}",
                pos as usize + rows
            ));
        }
    }
    if let Some(slot) = (0..rows).map(|r| at.at(r)).find(|&t| t as usize >= cap) {
        return Err(format!("slot {slot} past the pool of {cap} slots"));
    }
    let src = args.src.read::<f32>()?;
    let cache = args.cache.write::<f16>()?;
    super::need("src", src, rows * kv_dim)?;
    let last = (0..rows).map(|r| at.at(r) as usize + 1).max().unwrap_or(0);
    super::need("cache", cache, last * kv_dim)?;
    for (r, row) in src[..rows * kv_dim].chunks_exact(kv_dim.max(1)).enumerate() {
        let slot = at.at(r) as usize;
        cache[slot * kv_dim..(slot + 1) * kv_dim].convert_from_f32_slice(row);
    }
    Ok(())
}

/// Whether the CPU has the AVX2, FMA and F16C the fast attention paths use.
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// `q · k` summed as ggml's AVX2 `ggml_vec_dot_f16` sums it: four 8-lane
/// accumulators over steps of 32, folded pairwise, then across lanes. The
/// inputs are f16 values, so every product is exact and only the order of the
/// additions matters; following ggml's order keeps scores bit-identical.
#[inline(always)]
fn dot_like_ggml(q: &[f32], k: &[f16]) -> f32 {
    let n = q.len().min(k.len());
    let body = n - n % 32;
    let mut acc = [[0.0f32; 8]; 4];
    for i in (0..body).step_by(32) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, a) in lanes.iter_mut().enumerate() {
                let e = i + 8 * j + l;
                *a += q[e] * k[e].to_f32();
            }
        }
    }
    let mut r = [0.0f32; 8];
    for (l, r) in r.iter_mut().enumerate() {
        *r = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let t0 = [r[0] + r[4], r[1] + r[5], r[2] + r[6], r[3] + r[7]];
    let mut sum = (t0[0] + t0[1]) + (t0[2] + t0[3]);
    for e in body..n {
        sum += q[e] * k[e].to_f32();
    }
    sum
}

/// Positions whose weights [`attend_head`] works out before it adds their
/// share of V, so that the exponentials of a stretch run back to back
/// instead of waiting on the f16 accumulator.
const ATTEND_STRETCH: usize = 256;

/// The online-softmax steps of a stretch of positions: position `t` rescales
/// the accumulator by `ms[t]` when `rescale[t]` (a new maximum), then adds
/// `vs[t]` times its V row.
struct Steps {
    ms: [f32; ATTEND_STRETCH],
    vs: [f32; ATTEND_STRETCH],
    rescale: [bool; ATTEND_STRETCH],
}

/// Attention of one query head over positions `0..len` of the f16 cache
/// (`k`, `v`: `[len, kv_dim]`), reading the head's slice at `kv_off`.
///
/// This is llama.cpp's CPU flash-attention recurrence, which its tools use by
/// default: Q rounded to f16, one pass with a running maximum `m` and sum,
/// and the weighted sum of V kept in f16. Following it step by step makes
/// greedy decoding agree with llama.cpp: in small models attention is
/// sensitive enough that other exact formulas pick other tokens.
///
/// The recurrence runs in stretches of `ATTEND_STRETCH` (256) positions: first
/// every score, then the running maximum, the rescale factor or weight of
/// each position and the running sum, then the accumulator update, which is
/// elementwise and so runs one block of dimensions at a time over all the
/// stretch's positions. Every value is computed by the same operations in the
/// same order as the one-position-at-a-time recurrence.
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
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU features were just detected.
        unsafe { attend_head_avx2(q, k, v, len, kv_dim, kv_off, scale, out) };
        return;
    }
    attend_head_with(
        q,
        k,
        v,
        len,
        kv_dim,
        kv_off,
        scale,
        out,
        dot_like_ggml,
        accumulate,
    );
}

/// [`attend_head`] with its scores and accumulator update in AVX2.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_head_avx2(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    len: usize,
    kv_dim: usize,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
) {
    attend_head_with(
        q,
        k,
        v,
        len,
        kv_dim,
        kv_off,
        scale,
        out,
        // SAFETY: this function only runs where the features were detected.
        |q, k| unsafe { avx2::dot_like_ggml(q, k) },
        // SAFETY: as above.
        |acc, v, rows, steps, n| unsafe { avx2::accumulate(acc, v, rows, steps, n) },
    );
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_head_with(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    len: usize,
    kv_dim: usize,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
    score: impl Fn(&[f32], &[f16]) -> f32,
    accumulate: impl Fn(&mut [f32], &[f16], (usize, usize), &Steps, usize),
) {
    let hd = q.len().min(MAX_HEAD_DIM).min(out.len());
    let mut q16 = [0.0f32; MAX_HEAD_DIM];
    let q16 = &mut q16[..hd];
    for (d, s) in q16.iter_mut().zip(q) {
        *d = f16::from_f32(*s).to_f32();
    }
    let acc = &mut out[..hd];
    acc.fill(0.0);
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    let mut steps = Steps {
        ms: [1.0; ATTEND_STRETCH],
        vs: [1.0; ATTEND_STRETCH],
        rescale: [false; ATTEND_STRETCH],
    };
    let mut scores = [0.0f32; ATTEND_STRETCH];
    for t0 in (0..len).step_by(ATTEND_STRETCH) {
        let n = (len - t0).min(ATTEND_STRETCH);
        for (j, s) in scores[..n].iter_mut().enumerate() {
            let base = (t0 + j) * kv_dim + kv_off;
            *s = score(q16, &k[base..base + hd]) * scale;
        }
        for (j, &s) in scores[..n].iter().enumerate() {
            let (mut ms, mut vs) = (1.0f32, 1.0f32);
            let rescale = s > m;
            if rescale {
                let old = m;
                m = s;
                ms = (old - m).exp();
            } else {
                vs = (s - m).exp();
            }
            steps.ms[j] = ms;
            steps.vs[j] = vs;
            steps.rescale[j] = rescale;
            // Fused: GCC contracts ggml's `S = S*ms + vs` into one FMA.
            sum = sum.mul_add(ms, vs);
        }
        accumulate(acc, v, (t0 * kv_dim + kv_off, kv_dim), &steps, n);
    }
    let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    acc.iter_mut().for_each(|a| *a *= inv);
}

/// Applies a stretch of `n` [`Steps`] to the accumulator: for each position
/// `t` (its V row at `v[rows.0 + t * rows.1..]`), `acc = f16(acc * ms[t])`
/// when rescaling, then `acc = f16(v * vs[t] + acc)` fused, as ggml's AVX2
/// `ggml_vec_scale_f16` and `ggml_vec_mad_f16` round them.
fn accumulate(acc: &mut [f32], v: &[f16], rows: (usize, usize), steps: &Steps, n: usize) {
    let hd = acc.len();
    for t in 0..n {
        let base = rows.0 + t * rows.1;
        if steps.rescale[t] {
            for a in acc.iter_mut() {
                *a = f16::from_f32(*a * steps.ms[t]).to_f32();
            }
        }
        let vs = steps.vs[t];
        for (a, x) in acc.iter_mut().zip(&v[base..base + hd]) {
            *a = f16::from_f32(x.to_f32().mul_add(vs, *a)).to_f32();
        }
    }
}

/// AVX2 versions of [`dot_like_ggml`] and [`accumulate`].
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Steps;
    use half::f16;
    use std::arch::x86_64::*;

    /// [`dot_like_ggml`](super::dot_like_ggml), converting `k` with F16C.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_like_ggml(q: &[f32], k: &[f16]) -> f32 {
        let n = q.len().min(k.len());
        let body = n - n % 32;
        let kp = k.as_ptr().cast::<u16>();
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in (0..body).step_by(32) {
            for (j, a) in acc.iter_mut().enumerate() {
                let e = i + 8 * j;
                // SAFETY: e + 8 <= body <= n elements of both slices; the
                // loads are unaligned. The products of f16 values are exact,
                // so fusing them changes nothing.
                unsafe {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(e));
                    let kv = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(e).cast()));
                    *a = _mm256_fmadd_ps(qv, kv, *a);
                }
            }
        }
        let r = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
        let t0 = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps::<1>(r));
        let t1 = _mm_hadd_ps(t0, t0);
        let mut sum = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
        for e in body..n {
            sum += q[e] * k[e].to_f32();
        }
        sum
    }

    /// [`accumulate`](super::accumulate) in blocks of eight-lane vectors
    /// held in registers across all the stretch's positions.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn accumulate(
        acc: &mut [f32],
        v: &[f16],
        rows: (usize, usize),
        steps: &Steps,
        n: usize,
    ) {
        let hd = acc.len();
        let last = rows.0 + n.saturating_sub(1) * rows.1 + hd;
        if n == 0 || v.len() < last {
            super::accumulate(acc, v, rows, steps, n);
            return;
        }
        let mut d = 0;
        while d + 64 <= hd {
            // SAFETY: dimensions d..d + 64 lie in `acc`, and in every row of
            // `v` read (`last` is in bounds, checked above).
            unsafe { block::<8>(acc, v, rows, steps, n, d) };
            d += 64;
        }
        while d + 8 <= hd {
            // SAFETY: as above, for d..d + 8.
            unsafe { block::<1>(acc, v, rows, steps, n, d) };
            d += 8;
        }
        for d in d..hd {
            for t in 0..n {
                let x = v[rows.0 + t * rows.1 + d].to_f32();
                let a = &mut acc[d];
                if steps.rescale[t] {
                    *a = f16::from_f32(*a * steps.ms[t]).to_f32();
                }
                *a = f16::from_f32(x.mul_add(steps.vs[t], *a)).to_f32();
            }
        }
    }

    /// Dimensions `d..d + 8 * N` over the stretch's `n` positions.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `d + 8 * N <= acc.len()`,
    /// and `v` must hold `rows.0 + (n - 1) * rows.1 + d + 8 * N` elements.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block<const N: usize>(
        acc: &mut [f32],
        v: &[f16],
        rows: (usize, usize),
        steps: &Steps,
        n: usize,
        d: usize,
    ) {
        let round = |x: __m256| _mm256_cvtph_ps(_mm256_cvtps_ph::<0>(x));
        let mut regs = [_mm256_setzero_ps(); N];
        for (i, r) in regs.iter_mut().enumerate() {
            // SAFETY: d + 8 * i + 8 <= acc.len(); the load is unaligned.
            *r = unsafe { _mm256_loadu_ps(acc.as_ptr().add(d + 8 * i)) };
        }
        let vp = v.as_ptr().cast::<u16>();
        for t in 0..n {
            if steps.rescale[t] {
                let ms = _mm256_set1_ps(steps.ms[t]);
                for r in regs.iter_mut() {
                    *r = round(_mm256_mul_ps(*r, ms));
                }
            }
            let vs = _mm256_set1_ps(steps.vs[t]);
            let row = rows.0 + t * rows.1 + d;
            for (i, r) in regs.iter_mut().enumerate() {
                // SAFETY: row + 8 * i + 8 <= v.len() (the caller's bound);
                // the load is unaligned.
                let x = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(vp.add(row + 8 * i).cast())) };
                *r = round(_mm256_fmadd_ps(x, vs, *r));
            }
        }
        for (i, r) in regs.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(acc.as_mut_ptr().add(d + 8 * i), *r) };
        }
    }
}

/// Query rows from which llama.cpp's CPU flash attention takes its tiled
/// path (ggml's `GGML_FA_TILE_Q`), which rounds differently: a batch of this
/// many rows or more is attended as [`attend_head_tiled`] does.
pub const FA_TILE_Q: usize = 64;

/// Positions per tile of the tiled path (ggml's `GGML_FA_TILE_KV`).
pub const FA_TILE_KV: usize = 64;

/// Transposes K, the cache widened to f32 (`[len, kv_heads * hd]`), into
/// tiles of [`FA_TILE_KV`] positions: `kt[((g * tiles + t) * hd + d) * FA_TILE_KV + j]`
/// is element `d` of KV head `g` at position `t * FA_TILE_KV + j`, zero past
/// `len`. [`attend_head_tiled`] reads one KV head's tiles.
pub fn transpose_k_tiles(k: &[f32], len: usize, kv_heads: usize, hd: usize, kt: &mut Vec<f32>) {
    let tiles = len.div_ceil(FA_TILE_KV);
    let kv_dim = kv_heads * hd;
    kt.clear();
    kt.resize(kv_heads * tiles * hd * FA_TILE_KV, 0.0);
    for g in 0..kv_heads {
        for pos in 0..len {
            let (t, j) = (pos / FA_TILE_KV, pos % FA_TILE_KV);
            let base = (g * tiles + t) * hd * FA_TILE_KV + j;
            let row = &k[pos * kv_dim + g * hd..pos * kv_dim + (g + 1) * hd];
            for (d, x) in row.iter().enumerate() {
                kt[base + d * FA_TILE_KV] = *x;
            }
        }
    }
}

/// Attention of one query head over the positions `head.span` ([`TiledHead`]),
/// as llama.cpp's tiled CPU flash attention computes it for batches of
/// [`FA_TILE_Q`] rows or more, into `out`. Tiles wholly before
/// `span.start` are skipped, and the positions before it in the first tile
/// weigh nothing.
///
/// Per tile of [`FA_TILE_KV`] positions: f32 scores, each a chain of fused
/// multiply-adds over the dimensions, times `scale`; the running maximum
/// moves to the tile's, rescaling the sum and the f32 accumulator by `exp`;
/// the weights are `e^x` of the score minus the maximum, in this CPU's
/// [`GgmlVector`] form, summed a vector at a time into an f64 total; each
/// output element adds the tile's `weight * V` in position order, fused.
pub fn attend_head_tiled(head: &TiledHead<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU features were just detected.
            unsafe { tiled_avx512::attend(head, out) };
        } else {
            // SAFETY: as above.
            unsafe { attend_head_tiled_avx2(head, out) };
        }
        return;
    }
    attend_head_tiled_with(head, out, tile_scores, tile_weigh);
}

/// What [`attend_head_tiled`] attends with: one query head `q`, its KV
/// head's K in tiles `kt` ([`transpose_k_tiles`]), the cache's V widened to
/// f32 (`[span.end, kv_dim]`, the head's slice at `kv_off`), the positions
/// `span` it sees, and the scores' `scale`.
pub struct TiledHead<'a> {
    pub q: &'a [f32],
    pub kt: &'a [f32],
    pub v: &'a [f32],
    pub span: std::ops::Range<usize>,
    pub kv_dim: usize,
    pub kv_off: usize,
    pub scale: f32,
}

/// A tile's scores before the scale: `p[j] = Σ_d kt[d][j] q[d]`, each a
/// chain of fused multiply-adds over the dimensions in order.
#[inline(always)]
fn tile_scores(p: &mut [f32; FA_TILE_KV], tile: &[f32], q: &[f32]) {
    for (kd, &qd) in tile.chunks_exact(FA_TILE_KV).zip(q) {
        for (s, k) in p.iter_mut().zip(kd) {
            *s = k.mul_add(qd, *s);
        }
    }
}

/// Adds a tile's weighted V rows to the accumulator, position after
/// position, each element fused: `acc = v[t] p[t] + acc`. Row `t` of V
/// starts at `v[rows.0 + t * rows.1]`; `n` positions.
#[inline(always)]
fn tile_weigh(acc: &mut [f32], v: &[f32], rows: (usize, usize), p: &[f32; FA_TILE_KV], n: usize) {
    let hd = acc.len();
    for (t, &pt) in p[..n].iter().enumerate() {
        let base = rows.0 + t * rows.1;
        for (a, x) in acc.iter_mut().zip(&v[base..base + hd]) {
            *a = x.mul_add(pt, *a);
        }
    }
}

/// The tiled attention's two loops over a tile held in AVX-512 registers:
/// the 64 scores in four vectors across all dimensions, and the
/// accumulator in blocks of 128 dimensions across all the tile's positions,
/// instead of reading and writing them at every step. Each element sees the
/// same fused operations in the same order as [`tile_scores`] and
/// [`tile_weigh`], so the results are theirs bit for bit.
#[cfg(target_arch = "x86_64")]
mod tiled_avx512 {
    use super::{attend_head_tiled_with, tile_weigh, TiledHead, FA_TILE_KV};
    use std::arch::x86_64::*;

    /// [`attend_head_tiled`](super::attend_head_tiled) with these loops.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn attend(head: &TiledHead<'_>, out: &mut [f32]) {
        attend_head_tiled_with(
            head,
            out,
            // SAFETY: this function only runs where the features were detected.
            |p, tile, q| unsafe { scores(p, tile, q) },
            // SAFETY: as above.
            |acc, v, rows, p, n| unsafe { weigh(acc, v, rows, p, n) },
        );
    }

    /// [`tile_scores`](super::tile_scores).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scores(p: &mut [f32; FA_TILE_KV], tile: &[f32], q: &[f32]) {
        let dims = q.len().min(tile.len() / FA_TILE_KV);
        // SAFETY: `p` holds 64 floats; the loads are unaligned.
        let mut s: [__m512; 4] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_ps(p.as_ptr().add(16 * i)) });
        let kp = tile.as_ptr();
        for (d, &qd) in q[..dims].iter().enumerate() {
            let qv = _mm512_set1_ps(qd);
            for (i, r) in s.iter_mut().enumerate() {
                // SAFETY: row d of the tile, 64 floats, lies within `tile`
                // (d < dims); the load is unaligned.
                let k = unsafe { _mm512_loadu_ps(kp.add(d * FA_TILE_KV + 16 * i)) };
                *r = _mm512_fmadd_ps(k, qv, *r);
            }
        }
        for (i, r) in s.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(p.as_mut_ptr().add(16 * i), *r) };
        }
    }

    /// [`tile_weigh`](super::tile_weigh).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn weigh(
        acc: &mut [f32],
        v: &[f32],
        rows: (usize, usize),
        p: &[f32; FA_TILE_KV],
        n: usize,
    ) {
        let hd = acc.len();
        let n = n.min(FA_TILE_KV);
        if n == 0 || v.len() < rows.0 + (n - 1) * rows.1 + hd {
            tile_weigh(acc, v, rows, p, n);
            return;
        }
        let mut d = 0;
        while d + 128 <= hd {
            // SAFETY: dimensions d..d + 128 lie in `acc` and in every row
            // read (the bound checked above).
            unsafe { block::<8>(acc, v, rows, p, n, d) };
            d += 128;
        }
        while d + 16 <= hd {
            // SAFETY: as above, for d..d + 16.
            unsafe { block::<1>(acc, v, rows, p, n, d) };
            d += 16;
        }
        for d in d..hd {
            for (t, &pt) in p[..n].iter().enumerate() {
                acc[d] = v[rows.0 + t * rows.1 + d].mul_add(pt, acc[d]);
            }
        }
    }

    /// Dimensions `d..d + 16 * N` over the tile's `n` positions.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; `d + 16 * N <= acc.len()` and `v`
    /// must hold `rows.0 + (n - 1) * rows.1 + d + 16 * N` elements.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const N: usize>(
        acc: &mut [f32],
        v: &[f32],
        rows: (usize, usize),
        p: &[f32; FA_TILE_KV],
        n: usize,
        d: usize,
    ) {
        // SAFETY: d + 16 * i + 16 <= acc.len(); the loads are unaligned.
        let mut regs: [__m512; N] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_ps(acc.as_ptr().add(d + 16 * i)) });
        let vp = v.as_ptr();
        for (t, &pt) in p[..n].iter().enumerate() {
            let w = _mm512_set1_ps(pt);
            let row = rows.0 + t * rows.1 + d;
            for (i, r) in regs.iter_mut().enumerate() {
                // SAFETY: row + 16 * i + 16 <= v.len() (the caller's bound);
                // the load is unaligned.
                let x = unsafe { _mm512_loadu_ps(vp.add(row + 16 * i)) };
                *r = _mm512_fmadd_ps(x, w, *r);
            }
        }
        for (i, r) in regs.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add(d + 16 * i), *r) };
        }
    }
}

/// [`attend_head_tiled`] compiled with FMA, so the fused steps are single
/// instructions and the loops over a tile vectorize.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_head_tiled_avx2(head: &TiledHead<'_>, out: &mut [f32]) {
    attend_head_tiled_with(head, out, tile_scores, tile_weigh);
}

#[inline(always)]
fn attend_head_tiled_with(
    head: &TiledHead<'_>,
    out: &mut [f32],
    scores: impl Fn(&mut [f32; FA_TILE_KV], &[f32], &[f32]),
    weigh: impl Fn(&mut [f32], &[f32], (usize, usize), &[f32; FA_TILE_KV], usize),
) {
    const T: usize = FA_TILE_KV;
    let TiledHead {
        q,
        kt,
        v,
        ref span,
        kv_dim,
        kv_off,
        scale,
    } = *head;
    let hd = q.len().min(out.len());
    let acc = &mut out[..hd];
    acc.fill(0.0);
    let form = GgmlVector::detect();
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    let mut p = [0.0f32; T];
    let (first, len) = (span.start, span.end);
    let skip = first / T;
    for (t, tile) in kt
        .chunks_exact(hd * T)
        .take(len.div_ceil(T))
        .enumerate()
        .skip(skip)
    {
        let t0 = t * T;
        let n = (len - t0).min(T);
        p.fill(0.0);
        scores(&mut p, tile, &q[..hd]);
        p.iter_mut().for_each(|s| *s *= scale);
        p[n..].fill(f32::NEG_INFINITY);
        if t0 < first {
            p[..first - t0].fill(f32::NEG_INFINITY);
        }
        let tile_max = p.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let m_new = m.max(tile_max);
        if m_new > m {
            let ms = (m - m_new).exp();
            acc.iter_mut().for_each(|a| *a *= ms);
            sum *= ms;
        }
        m = m_new;
        let total = softmax_weights(form, &mut p, m);
        sum = (f64::from(sum) + total) as f32;
        weigh(acc, v, (t0 * kv_dim + kv_off, kv_dim), &p, n);
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    acc.iter_mut().for_each(|a| *a *= inv);
}

/// Replaces each score `x` of a tile with its weight `e^(x - m)` and returns
/// their sum, as ggml's `ggml_vec_soft_max_f32` computes them in `form`: the
/// lanes of each vector summed across (8 lanes: halves, then pairs; 16: as
/// GCC's `_mm512_reduce_add_ps`), each vector's sum added to an f64 total.
#[inline(always)]
fn softmax_weights(form: GgmlVector, p: &mut [f32; FA_TILE_KV], m: f32) -> f64 {
    let mut total = 0.0f64;
    match form {
        GgmlVector::Avx2 => {
            for lanes in p.chunks_exact_mut(8) {
                for x in lanes.iter_mut() {
                    *x = ggml_expf(*x - m);
                }
                let w: [f32; 4] = std::array::from_fn(|i| lanes[i] + lanes[i + 4]);
                total += f64::from((w[0] + w[2]) + (w[1] + w[3]));
            }
        }
        GgmlVector::Avx512 => {
            for lanes in p.chunks_exact_mut(16) {
                #[cfg(target_arch = "x86_64")]
                {
                    use std::arch::x86_64::*;
                    // SAFETY: `detect` returns Avx512 only where the CPU has
                    // AVX-512 F and DQ; `lanes` holds 16 floats.
                    unsafe {
                        let x = _mm512_sub_ps(_mm512_loadu_ps(lanes.as_ptr()), _mm512_set1_ps(m));
                        _mm512_storeu_ps(lanes.as_mut_ptr(), avx512::expf(x));
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                for x in lanes.iter_mut() {
                    *x = ggml_expf_avx512(*x - m);
                }
                let h: [f32; 8] = std::array::from_fn(|i| lanes[i + 8] + lanes[i]);
                let q: [f32; 4] = std::array::from_fn(|i| h[i + 4] + h[i]);
                total += f64::from((q[0] + q[2]) + (q[1] + q[3]));
            }
        }
    }
    total
}

/// Per-thread scratch of the tiled CPU attention: the cache's K and V widened to
/// f32, and K in tiles for the tiled path.
#[derive(Default)]
struct Wide {
    k: Vec<f32>,
    v: Vec<f32>,
    k_tiles: Vec<f32>,
}

thread_local! {
    static WIDE: std::cell::Cell<Wide> = const {
        std::cell::Cell::new(Wide {
            k: Vec::new(),
            v: Vec::new(),
            k_tiles: Vec::new(),
        })
    };
}

thread_local! {
    /// One KV head of one sequence's visible positions, gathered out of the
    /// blocks of a paged cache: K, then V.
    static GATHERED: std::cell::RefCell<(Vec<f16>, Vec<f16>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Where the query rows of an attention sit and where their sequences'
/// positions lie in the cache.
pub(crate) enum Layout<'a> {
    /// One sequence: row `r` at position `pos + r`, position `t` in cache
    /// row `t`.
    Contiguous { pos: usize },
    /// Rows of independent sequences: row `r` at `positions[r]`, position
    /// `t` of its sequence in slot `table[t / block_size] * block_size + t %
    /// block_size`, its `table` row `r` of `tables` (`max_blocks` entries a
    /// row), checked by [`check_tables`].
    Paged {
        positions: &'a [u32],
        tables: &'a [u32],
        block_size: usize,
        max_blocks: usize,
    },
}

impl Layout<'_> {
    /// Row `r`'s position.
    fn position(&self, r: usize) -> usize {
        match self {
            Layout::Contiguous { pos } => pos + r,
            Layout::Paged { positions, .. } => positions[r] as usize,
        }
    }

    /// The cache rows the attention reads: `pos + rows` of one sequence,
    /// or every slot of the pool (`s.max_seq` for a paged cache).
    fn cache_rows(&self, s: &AttnShape) -> usize {
        match self {
            Layout::Contiguous { pos } => pos + s.rows as usize,
            Layout::Paged { .. } => s.max_seq as usize,
        }
    }
}

/// The CPU attention of `s.rows` query rows placed as `layout` says, over
/// the cache (`k`, `v`: `[layout.cache_rows(s), kv_dim]` at least): the
/// single-row recurrence below [`FA_TILE_Q`] rows and for every row of a
/// paged cache, the tiled one for [`FA_TILE_Q`] rows or more of one
/// sequence.
pub(crate) fn attend_rows(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    layout: &Layout<'_>,
    s: AttnShape,
    out: &mut [f32],
) -> Result<(), String> {
    let (rows, heads, kvh, hd) = (
        s.rows as usize,
        s.heads as usize,
        s.kv_heads as usize,
        s.head_dim as usize,
    );
    if kvh == 0 || heads % kvh != 0 {
        return Err(format!("{heads} heads do not divide into {kvh} KV heads"));
    }
    let kv_dim = kvh * hd;
    let len = layout.cache_rows(&s);
    super::need("q", q, rows * heads * hd)?;
    super::need("k", k, len * kv_dim)?;
    super::need("v", v, len * kv_dim)?;
    super::need("out", out, rows * heads * hd)?;
    let group = heads / kvh;
    let out = &mut out[..rows * heads * hd];
    if let Layout::Contiguous { pos } = *layout {
        if rows >= FA_TILE_Q {
            attend_tiled(q, k, v, pos, s, out);
            return Ok(());
        }
    }
    // A task per (row, head) of one sequence, reading the cache in place;
    // a task per (row, KV head) of a paged cache, whose query heads share
    // the gathered positions (adjacent in `out`).
    let chunk = match layout {
        Layout::Contiguous { .. } => hd,
        Layout::Paged { .. } => group * hd,
    };
    parallel::for_each_chunk_mut(out, chunk, |i, o| {
        let first_head = i * chunk / hd;
        let (r, h0) = (first_head / heads, first_head % heads);
        let g = h0 / group;
        let at = layout.position(r);
        // A window starts the cache later: the rows before it are not seen.
        let first = s.first_visible(at, 0);
        let len = at + 1 - first;
        let mut attend = |k: &[f16], v: &[f16], stride: usize, off: usize| {
            for (j, oh) in o.chunks_exact_mut(hd).enumerate() {
                let qh = &q[(first_head + j) * hd..(first_head + j + 1) * hd];
                attend_head(qh, k, v, len, stride, off, s.scale, oh);
            }
        };
        match *layout {
            Layout::Contiguous { .. } => {
                let skip = first * kv_dim;
                attend(&k[skip..], &v[skip..], kv_dim, g * hd);
            }
            Layout::Paged {
                tables,
                block_size: bs,
                max_blocks,
                ..
            } => GATHERED.with(|cell| {
                let table = &tables[r * max_blocks..(r + 1) * max_blocks];
                let mut scratch = cell.borrow_mut();
                let (gk, gv) = &mut *scratch;
                gk.resize(len * hd, f16::ZERO);
                gv.resize(len * hd, f16::ZERO);
                for (j, t) in (first..=at).enumerate() {
                    let slot = table[t / bs] as usize * bs + t % bs;
                    let from = slot * kv_dim + g * hd;
                    gk[j * hd..(j + 1) * hd].copy_from_slice(&k[from..from + hd]);
                    gv[j * hd..(j + 1) * hd].copy_from_slice(&v[from..from + hd]);
                }
                attend(gk, gv, hd, 0);
            }),
        }
    });
    Ok(())
}

/// The tiled attention of [`FA_TILE_Q`] rows or more of one sequence at
/// positions `pos..`, on the cache widened to f32 from a per-thread slot
/// that is taken out for the call.
fn attend_tiled(q: &[f32], k: &[f16], v: &[f16], pos: usize, s: AttnShape, out: &mut [f32]) {
    let (rows, heads, kvh, hd) = (
        s.rows as usize,
        s.heads as usize,
        s.kv_heads as usize,
        s.head_dim as usize,
    );
    let (kv_dim, len, group) = (kvh * hd, pos + rows, heads / kvh);
    let mut w = WIDE.with(|w| w.take());
    {
        w.k.resize(len * kv_dim, 0.0);
        w.v.resize(len * kv_dim, 0.0);
        k[..len * kv_dim].convert_to_f32_slice(&mut w.k);
        v[..len * kv_dim].convert_to_f32_slice(&mut w.v);
        transpose_k_tiles(&w.k, len, kvh, hd, &mut w.k_tiles);
        let head_tiles = len.div_ceil(FA_TILE_KV) * hd * FA_TILE_KV;
        let (vf, kt) = (&*w.v, &*w.k_tiles);
        parallel::for_each_chunk_mut(out, hd, |i, o| {
            let (r, h) = (i / heads, i % heads);
            let qh = &q[i * hd..(i + 1) * hd];
            let g = h / group;
            let kt = &kt[g * head_tiles..(g + 1) * head_tiles];
            let head = TiledHead {
                q: qh,
                kt,
                v: vf,
                span: s.first_visible(pos, r)..pos + r + 1,
                kv_dim,
                kv_off: g * hd,
                scale: s.scale,
            };
            attend_head_tiled(&head, o);
        });
    }
    WIDE.with(|c| c.replace(w));
}

/// The CPU body of the `attention` op (shared by its kernels) and, with
/// [`PositionSource::Rows`], of `attention_paged`: checks the shape
/// against the cache (and the block tables) and runs [`attend_rows`].
pub(crate) fn attention(a: &CpuArgs<'_>, source: PositionSource) -> Result<(), String> {
    match source {
        PositionSource::Start => {
            let args = AttnArgs::from_cpu(a)?;
            let s = args.shape;
            let pos = args.pos.param()? as usize;
            let (rows, hd) = (s.rows as usize, s.head_dim as usize);
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
            let (q, k, v) = (
                args.q.read::<f32>()?,
                args.k.read::<f16>()?,
                args.v.read::<f16>()?,
            );
            let layout = Layout::Contiguous { pos };
            attend_rows(q, k, v, &layout, s, args.out.write::<f32>()?)
        }
        PositionSource::Rows => {
            let args = PagedAttnArgs::from_cpu(a)?;
            let s = args.shape;
            let layout = check_tables(&s, args.positions.read()?, args.tables.read()?)?;
            let (q, k, v) = (
                args.q.read::<f32>()?,
                args.k.read::<f16>()?,
                args.v.read::<f16>()?,
            );
            attend_rows(q, k, v, &layout, s.attn(), args.out.write::<f32>()?)
        }
    }
}

/// Checks a paged attention's shape `s` and that every row's table covers
/// its position with blocks of the pool; the rows' [`Layout`].
pub(crate) fn check_tables<'a>(
    s: &PagedAttnShape,
    positions: &'a [u32],
    tables: &'a [u32],
) -> Result<Layout<'a>, String> {
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
    Ok(Layout::Paged {
        positions,
        tables,
        block_size: bs,
        max_blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's one-row flash attention one position at a time, on the
    /// cache widened to f32: the recurrence [`attend_head`] must reproduce.
    fn one_step_reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        len: usize,
        kv_dim: usize,
        kv_off: usize,
    ) -> Vec<f32> {
        let hd = q.len();
        let q16: Vec<f32> = q.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        let round = |x: f32| f16::from_f32(x).to_f32();
        let mut acc = vec![0.0f32; hd];
        let (mut m, mut sum) = (f32::NEG_INFINITY, 0.0f32);
        for t in 0..len {
            let row = t * kv_dim + kv_off;
            let kr: Vec<f16> = k[row..row + hd].iter().map(|&x| f16::from_f32(x)).collect();
            let s = dot_like_ggml(&q16, &kr) * 0.125;
            let (mut ms, mut vs) = (1.0f32, 1.0f32);
            if s > m {
                let old = m;
                m = s;
                ms = (old - m).exp();
                acc.iter_mut().for_each(|a| *a = round(*a * ms));
            } else {
                vs = (s - m).exp();
            }
            for (a, x) in acc.iter_mut().zip(&v[row..row + hd]) {
                *a = round(x.mul_add(vs, *a));
            }
            sum = sum.mul_add(ms, vs);
        }
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        acc.iter().map(|a| a * inv).collect()
    }

    #[test]
    fn single_row_attention_equals_the_one_step_recurrence_bit_for_bit() {
        let mut seed = 7u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            half::f16::from_f32((seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0).to_f32()
        };
        // Head sizes on and off the 64-wide register block and the 8-wide
        // vector; lengths around the stretch of positions.
        for (hd, kv_heads) in [(64usize, 3usize), (72, 2), (128, 1), (20, 2)] {
            let kv_dim = kv_heads * hd;
            for len in [1usize, 7, 255, 256, 257, 600] {
                // Keys that grow with the position, so that the running
                // maximum moves (and the accumulator is rescaled) often.
                let k: Vec<f32> = (0..len * kv_dim)
                    .map(|i| {
                        half::f16::from_f32(rnd() * (1.0 + (i / kv_dim) as f32 / 64.0)).to_f32()
                    })
                    .collect();
                let v: Vec<f32> = (0..len * kv_dim).map(|_| rnd()).collect();
                let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
                let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                for g in 0..kv_heads {
                    let q: Vec<f32> = (0..hd).map(|_| rnd() * 3.0).collect();
                    let expected = one_step_reference(&q, &k, &v, len, kv_dim, g * hd);
                    let mut got = vec![0.0; hd];
                    attend_head(&q, &k16, &v16, len, kv_dim, g * hd, 0.125, &mut got);
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&expected),
                        "head size {hd}, length {len}, KV head {g}"
                    );
                    let mut portable = vec![0.0; hd];
                    attend_head_with(
                        &q,
                        &k16,
                        &v16,
                        len,
                        kv_dim,
                        g * hd,
                        0.125,
                        &mut portable,
                        dot_like_ggml,
                        accumulate,
                    );
                    assert_eq!(
                        bits(&portable),
                        bits(&expected),
                        "portable, head size {hd}, length {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn tiled_and_single_row_paths_agree_closely() {
        // The two paths round differently (f16 against f32 accumulation), but
        // compute the same attention.
        let (hd, kv_heads, len) = (64usize, 2usize, 150usize);
        let kv_dim = kv_heads * hd;
        let mut seed = 1u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            half::f16::from_f32((seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0).to_f32()
        };
        let k: Vec<f32> = (0..len * kv_dim).map(|_| rnd() * 2.0).collect();
        let v: Vec<f32> = (0..len * kv_dim).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..hd).map(|_| rnd() * 2.0).collect();
        let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let mut kt = Vec::new();
        transpose_k_tiles(&k, len, kv_heads, hd, &mut kt);
        let head_tiles = len.div_ceil(FA_TILE_KV) * hd * FA_TILE_KV;
        for g in 0..kv_heads {
            for n in [1, 63, 64, 65, 150] {
                let (mut a, mut b) = (vec![0.0; hd], vec![0.0; hd]);
                attend_head(&q, &k16, &v16, n, kv_dim, g * hd, 0.125, &mut a);
                let kt = &kt[g * head_tiles..(g + 1) * head_tiles];
                let head = TiledHead {
                    q: &q,
                    kt,
                    v: &v,
                    span: 0..n,
                    kv_dim,
                    kv_off: g * hd,
                    scale: 0.125,
                };
                attend_head_tiled(&head, &mut b);
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() < 2e-3, "len {n} head {g}: {x} vs {y}");
                }
            }
        }
    }

    #[test]
    fn tiled_attention_equals_its_portable_loops_bit_for_bit() {
        // Whatever vector loops this CPU takes (AVX-512 registers across a
        // tile, or AVX2), every element must come out as the portable
        // loops make it. Head sizes on and off the 128- and 16-wide blocks;
        // spans that start inside a tile and end on either side of one.
        let mut seed = 5u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        };
        for (hd, kv_heads) in [(64usize, 2usize), (72, 1), (136, 1), (256, 1)] {
            let kv_dim = kv_heads * hd;
            let len = 150;
            let k: Vec<f32> = (0..len * kv_dim).map(|_| rnd() * 2.0).collect();
            let v: Vec<f32> = (0..len * kv_dim).map(|_| rnd()).collect();
            let q: Vec<f32> = (0..hd).map(|_| rnd() * 2.0).collect();
            let mut kt = Vec::new();
            transpose_k_tiles(&k, len, kv_heads, hd, &mut kt);
            let head_tiles = len.div_ceil(FA_TILE_KV) * hd * FA_TILE_KV;
            for g in 0..kv_heads {
                let kt = &kt[g * head_tiles..(g + 1) * head_tiles];
                for span in [0..1, 0..64, 0..65, 10..150, 70..128] {
                    let (mut fast, mut plain) = (vec![0.0; hd], vec![0.0; hd]);
                    let head = TiledHead {
                        q: &q,
                        kt,
                        v: &v,
                        span: span.clone(),
                        kv_dim,
                        kv_off: g * hd,
                        scale: 0.1,
                    };
                    attend_head_tiled(&head, &mut fast);
                    attend_head_tiled_with(&head, &mut plain, tile_scores, tile_weigh);
                    let fast: Vec<u32> = fast.iter().map(|x| x.to_bits()).collect();
                    let plain: Vec<u32> = plain.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(fast, plain, "head size {hd}, KV head {g}, span {span:?}");
                }
            }
        }
    }

    /// Attention in f64 of query row `r` (at position `pos + r`) and head `h`
    /// over the positions its window lets it see.
    #[allow(clippy::too_many_arguments)]
    fn windowed_reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        s: AttnShape,
        pos: usize,
        r: usize,
        h: usize,
    ) -> Vec<f64> {
        let (heads, kvh, hd) = (s.heads as usize, s.kv_heads as usize, s.head_dim as usize);
        let kv_dim = kvh * hd;
        let off = (h / (heads / kvh)) * hd;
        let qh = &q[(r * heads + h) * hd..][..hd];
        let visible = s.first_visible(pos, r)..pos + r + 1;
        let scores: Vec<f64> = visible
            .clone()
            .map(|t| {
                let kr = &k[t * kv_dim + off..][..hd];
                qh.iter()
                    .zip(kr)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum::<f64>()
                    * f64::from(s.scale)
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = w.iter().sum();
        (0..hd)
            .map(|d| {
                visible
                    .clone()
                    .zip(&w)
                    .map(|(t, w)| w * f64::from(v[t * kv_dim + off + d]))
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    #[test]
    fn a_sliding_window_hides_older_positions_on_both_paths() {
        let mut seed = 11u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            half::f16::from_f32((seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0).to_f32()
        };
        let (heads, kvh, hd) = (4usize, 2usize, 32usize);
        let kv_dim = kvh * hd;
        // One row (the recurrence) and a batch (the tiled path), with
        // windows shorter than, across and longer than the history.
        for (pos, rows) in [(150usize, 1usize), (90, FA_TILE_Q + 5)] {
            let len = pos + rows;
            let k: Vec<f32> = (0..len * kv_dim).map(|_| rnd() * 2.0).collect();
            let v: Vec<f32> = (0..len * kv_dim).map(|_| rnd()).collect();
            let q: Vec<f32> = (0..rows * heads * hd).map(|_| rnd()).collect();
            let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
            let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            for window in [1u32, 7, 64, 100, 1000] {
                let s = AttnShape {
                    rows: rows as u32,
                    heads: heads as u32,
                    kv_heads: kvh as u32,
                    head_dim: hd as u32,
                    max_seq: len as u32,
                    scale: 0.125,
                    window,
                };
                let mut out = vec![0.0f32; rows * heads * hd];
                attend_rows(&q, &k16, &v16, &Layout::Contiguous { pos }, s, &mut out).unwrap();
                for r in 0..rows {
                    for h in 0..heads {
                        let want = windowed_reference(&q, &k, &v, s, pos, r, h);
                        let got = &out[(r * heads + h) * hd..][..hd];
                        for (g, w) in got.iter().zip(&want) {
                            // f16 queries and accumulators: about 1e-2 at most here.
                            assert!(
                                (f64::from(*g) - w).abs() < 1e-2,
                                "window {window}, row {r}, head {h}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}
