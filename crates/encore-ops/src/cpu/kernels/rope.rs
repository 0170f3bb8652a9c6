//! The CPU bodies of `rope` (with either [`PositionSource`], so `rope_rows`
//! too) and `rope_store` ([`crate::kernels::rope`]).

use encore::CpuArgs;
use half::slice::HalfFloatSliceExt;

use super::Positions;
use crate::kernels::positions::PositionSource;
use crate::kernels::rope::{theta_scale, RopeArgs, RopeStoreArgs};

/// Rotates one head vector at position `pos`. Angles advance by repeated
/// multiplication in f32, as ggml computes them, and each rotated value is a
/// fused multiply-add over the other, rounded product (`fma(a, c, -(b s))`,
/// `fma(a, s, b c)`), as GCC compiles ggml's rope, so results match llama.cpp.
pub fn rope_head(x: &mut [f32], pos: u32, rope_dim: usize, base: f32, neox: bool) {
    rope_head_scaled(x, pos, rope_dim, base, neox, None);
}

/// [`rope_head`] with each pair's angle divided by its frequency factor.
pub fn rope_head_scaled(
    x: &mut [f32],
    pos: u32,
    rope_dim: usize,
    base: f32,
    neox: bool,
    factors: Option<&[f32]>,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU feature was just detected.
        unsafe { rope_head_fma(x, pos, rope_dim, base, neox, factors) };
        return;
    }
    rope_head_with(x, pos, rope_dim, base, neox, factors);
}

/// [`rope_head`] compiled with FMA, so `mul_add` is one instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn rope_head_fma(
    x: &mut [f32],
    pos: u32,
    rope_dim: usize,
    base: f32,
    neox: bool,
    factors: Option<&[f32]>,
) {
    rope_head_with(x, pos, rope_dim, base, neox, factors);
}

#[inline(always)]
fn rope_head_with(
    x: &mut [f32],
    pos: u32,
    rope_dim: usize,
    base: f32,
    neox: bool,
    factors: Option<&[f32]>,
) {
    let half = rope_dim / 2;
    for (i, sc) in pair_angles(pos, rope_dim, base, factors).enumerate() {
        rotate_pair(x, i, half, neox, sc);
    }
}

/// The sines and cosines of one position's `rope_dim / 2` pair angles,
/// the angles advancing by repeated multiplication in f32 (as ggml's).
#[inline(always)]
fn pair_angles(
    pos: u32,
    rope_dim: usize,
    base: f32,
    factors: Option<&[f32]>,
) -> impl Iterator<Item = (f32, f32)> + '_ {
    let theta_scale = theta_scale(base, rope_dim);
    let mut theta = pos as f32;
    (0..rope_dim / 2).map(move |i| {
        let angle = match factors {
            Some(f) => theta / f[i],
            None => theta,
        };
        theta *= theta_scale;
        angle.sin_cos()
    })
}

/// Rotates pair `i` of a head (of `half` pairs) by the angle whose sine
/// and cosine are `(s, c)`.
#[inline(always)]
fn rotate_pair(x: &mut [f32], i: usize, half: usize, neox: bool, (s, c): (f32, f32)) {
    let (ia, ib) = if neox {
        (i, i + half)
    } else {
        (2 * i, 2 * i + 1)
    };
    let (a, b) = (x[ia], x[ib]);
    x[ia] = a.mul_add(c, -(b * s));
    x[ib] = a.mul_add(s, b * c);
}

/// [`pair_angles`] into `out` (`rope_dim / 2` pairs), once for a row's heads.
fn angles(out: &mut [(f32, f32)], pos: u32, rope_dim: usize, base: f32, factors: Option<&[f32]>) {
    for (o, sc) in out
        .iter_mut()
        .zip(pair_angles(pos, rope_dim, base, factors))
    {
        *o = sc;
    }
}

/// Rotates every head of `row` (heads of `head_dim`) by the pair angles
/// `cs`: [`rope_head_scaled`] of each, its angles computed once.
fn rotate_row(row: &mut [f32], head_dim: usize, cs: &[(f32, f32)], neox: bool) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU feature was just detected.
        unsafe { rotate_row_fma(row, head_dim, cs, neox) };
        return;
    }
    rotate_row_with(row, head_dim, cs, neox);
}

/// [`rotate_row`] compiled with FMA, so `mul_add` is one instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn rotate_row_fma(row: &mut [f32], head_dim: usize, cs: &[(f32, f32)], neox: bool) {
    rotate_row_with(row, head_dim, cs, neox);
}

#[inline(always)]
fn rotate_row_with(row: &mut [f32], head_dim: usize, cs: &[(f32, f32)], neox: bool) {
    let half = cs.len();
    for head in row.chunks_exact_mut(head_dim) {
        for (i, &sc) in cs.iter().enumerate() {
            rotate_pair(head, i, half, neox, sc);
        }
    }
}

/// Checks a rotation's sizes: `rope_dim` even and within the head.
fn check_dims(head_dim: usize, rope_dim: usize) -> Result<(), String> {
    if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
        return Err(format!(
            "rope_dim {rope_dim} must be even and at most head_dim {head_dim}"
        ));
    }
    Ok(())
}

/// The CPU body of `rope` and, with [`PositionSource::Rows`], `rope_rows`.
pub(crate) fn rope(a: &CpuArgs<'_>, source: PositionSource) -> Result<(), String> {
    let args = RopeArgs::from_cpu(a)?;
    let s = args.shape;
    let (rows, hd, rd) = (s.rows as usize, s.head_dim as usize, s.rope_dim as usize);
    check_dims(hd, rd)?;
    let positions = Positions::read(&args.pos, source, rows)?;
    let x = args.x.write::<f32>()?;
    let n = rows * s.heads as usize * hd;
    super::need("x", x, n)?;
    let factors = match s.factors {
        0 => None,
        _ => {
            let f = args.factors.read::<f32>()?;
            super::need("factors", f, rd / 2)?;
            Some(&f[..rd / 2])
        }
    };
    // Rows across the worker threads; each row's angles once for its heads.
    let dim = s.heads as usize * hd;
    if dim == 0 {
        return Ok(());
    }
    const ROWS: usize = 8;
    encore::parallel::for_each_chunk_mut(&mut x[..n], ROWS * dim, |c, chunk| {
        let mut cs = vec![(0f32, 0f32); rd / 2];
        for (r, row) in chunk.chunks_exact_mut(dim).enumerate() {
            let pos = positions.at(c * ROWS + r);
            angles(&mut cs, pos, rd, s.base, factors);
            rotate_row(row, hd, &cs, s.neox != 0);
        }
    });
    Ok(())
}

/// The CPU body of `rope_store`.
pub(crate) fn rope_store(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = RopeStoreArgs::from_cpu(a)?;
    let rs = args.shape;
    let s = rs.rope;
    if s.factors != 0 {
        return Err("rope_store takes no frequency factors".into());
    }
    let pos = args.pos.param()? as usize;
    let (hd, rd) = (s.head_dim as usize, s.rope_dim as usize);
    check_dims(hd, rd)?;
    let (rows, dim) = (s.rows as usize, s.heads as usize * hd);
    if pos + rows > rs.max_seq as usize {
        return Err(format!(
            "position {} past the cache of {}",
            pos + rows,
            rs.max_seq
        ));
    }
    let x = args.x.read::<f32>()?;
    let cache = args.cache.write::<half::f16>()?;
    super::need("x", x, rows * dim)?;
    super::need("cache", cache, (pos + rows) * dim)?;
    let mut row = vec![0f32; dim];
    for r in 0..rows {
        row.copy_from_slice(&x[r * dim..(r + 1) * dim]);
        for head in row.chunks_exact_mut(hd.max(1)) {
            rope_head(head, (pos + r) as u32, rd, s.base, s.neox != 0);
        }
        cache[(pos + r) * dim..(pos + r + 1) * dim].convert_from_f32_slice(&row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rows_angles_once_rotate_each_head_as_alone() {
        // `rope` computes a row's angles once for all its heads: the same
        // bits as rotating each head on its own, in both layouts, with and
        // without frequency factors, with a partial rotation.
        let (heads, hd, rd, base) = (3usize, 64usize, 48usize, 10_000f32);
        let factors: Vec<f32> = (0..rd / 2).map(|i| 1.0 + (i % 5) as f32 * 0.5).collect();
        let row0: Vec<f32> = (0..heads * hd)
            .map(|i| ((i * 53 % 29) as f32 - 14.0) / 7.0)
            .collect();
        for (neox, f) in [(false, None), (true, None), (true, Some(&factors[..]))] {
            for pos in [0u32, 1, 77, 4095] {
                let mut want = row0.clone();
                for head in want.chunks_exact_mut(hd) {
                    rope_head_scaled(head, pos, rd, base, neox, f);
                }
                let mut cs = vec![(0f32, 0f32); rd / 2];
                angles(&mut cs, pos, rd, base, f);
                let mut got = row0.clone();
                rotate_row(&mut got, hd, &cs, neox);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "neox={neox} pos={pos} factors={}",
                    f.is_some()
                );
            }
        }
    }

    #[test]
    fn frequency_factors_divide_each_pairs_angle() {
        // Against the rotation computed in f64 from its definition: pair i
        // at position p turns by p * base^(-2i/d) / factor[i].
        let (d, base, pos) = (64usize, 500_000f32, 3000u32);
        let factors: Vec<f32> = (0..d / 2).map(|i| 1.0 + (i % 9) as f32 * 0.875).collect();
        let x0: Vec<f32> = (0..d).map(|i| ((i * 37 % 17) as f32 - 8.0) / 5.0).collect();
        for neox in [false, true] {
            let mut x = x0.clone();
            rope_head_scaled(&mut x, pos, d, base, neox, Some(&factors));
            for (i, &factor) in factors.iter().enumerate() {
                let (ia, ib) = if neox {
                    (i, i + d / 2)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let theta = f64::from(pos) * f64::from(base).powf(-2.0 * i as f64 / d as f64)
                    / f64::from(factor);
                let (s, c) = theta.sin_cos();
                let (a, b) = (f64::from(x0[ia]), f64::from(x0[ib]));
                // The f32 angle recurrence drifts by ~1e-6 relative over the
                // pairs: at angles near 3000 that is a few 1e-3.
                for (got, want) in [(x[ia], a * c - b * s), (x[ib], a * s + b * c)] {
                    assert!(
                        (f64::from(got) - want).abs() < 1e-2,
                        "pair {i}: {got} vs {want}"
                    );
                }
            }
            // Without factors the rotation differs: the test sees them.
            let mut plain = x0.clone();
            rope_head(&mut plain, pos, d, base, neox);
            assert_ne!(plain, x);
        }
    }
}
