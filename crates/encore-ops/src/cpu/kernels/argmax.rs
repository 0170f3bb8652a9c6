//! The CPU body of `argmax` ([`crate::kernels::argmax`]) and the host's
//! argmax of a logits row, which the sampler uses too.

use encore::CpuArgs;

use crate::kernels::argmax::{ArgmaxArgs, OUT_BYTES};
use crate::kernels::paged::ArgmaxRowsArgs;

/// The first index of the largest value; a NaN never wins, and a NaN at
/// index 0 makes the answer 0 (what `if x[i] > x[best] { best = i }` gives).
///
/// Found in two passes that vectorize: the largest value, eight running
/// maxima at a time, then the first index that holds it.
pub fn argmax(x: &[f32]) -> u32 {
    let Some(&first) = x.first() else { return 0 };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [first; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = lanes.iter().fold(first, |m, &v| if v > m { v } else { m });
    for &v in chunks.remainder() {
        max = if v > max { v } else { max };
    }
    // `max` is one of the values, so the search finds it; 0.0 and -0.0 are
    // equal here as in the comparison above, which keeps the first of them.
    let chunk = x
        .chunks(64)
        .position(|c| c.iter().fold(false, |hit, &v| hit | (v == max)))
        .unwrap_or(0);
    let within = x[chunk * 64..].iter().position(|&v| v == max).unwrap_or(0);
    (chunk * 64 + within) as u32
}

/// The CPU body of `argmax`.
pub(crate) fn argmax_op(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = ArgmaxArgs::from_cpu(a)?;
    let n = args.n as usize;
    let x = args.x.read::<f32>()?;
    super::need("x", x, n)?;
    let out = args.out.write::<u32>()?;
    super::need("out", out, OUT_BYTES / 4)?;
    out[0] = argmax(&x[..n]);
    Ok(())
}

/// The CPU body of `argmax_rows`: [`argmax`] of each row, `u32::MAX` where
/// the row's largest value is not finite (or its first value is a NaN).
pub(crate) fn argmax_rows_op(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = ArgmaxRowsArgs::from_cpu(a)?;
    let (rows, n) = (args.shape.rows as usize, args.shape.n as usize);
    let x = args.x.read::<f32>()?;
    super::need("x", x, rows * n)?;
    let out = args.out.write::<u32>()?;
    super::need("out", out, rows * OUT_BYTES / 4)?;
    for (r, row) in x.chunks_exact(n.max(1)).take(rows).enumerate() {
        let i = argmax(&row[..n.min(row.len())]);
        let finite = row.get(i as usize).is_some_and(|v| v.is_finite());
        out[r * OUT_BYTES / 4] = if finite && n > 0 { i } else { u32::MAX };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_pass(x: &[f32]) -> u32 {
        let mut best = 0usize;
        for (i, v) in x.iter().enumerate() {
            if *v > x[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_largest_and_skips_nans() {
        let mut seed = 3u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            seed >> 8
        };
        for n in [0usize, 1, 7, 8, 9, 64, 1000, 49152] {
            for trial in 0..20 {
                // Few distinct values, so that ties are common; some NaNs,
                // infinities and signed zeros.
                let x: Vec<f32> = (0..n)
                    .map(|_| match next() % 16 {
                        0 => f32::NAN,
                        1 => -0.0,
                        2 => 0.0,
                        3 if trial % 4 == 0 => f32::INFINITY,
                        4 => f32::NEG_INFINITY,
                        r => (r as f32 - 10.0) * 0.5,
                    })
                    .collect();
                assert_eq!(argmax(&x), one_pass(&x), "n {n} trial {trial}: {x:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 3.0, 3.0]), 2);
    }
}
