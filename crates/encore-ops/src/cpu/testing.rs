//! Random operands and an f64 reference for the kernels' tests.

use half::{bf16, f16};
use rand::{rngs::StdRng, Rng};

use super::{dequantize_row, ActivationFormat};
use crate::DType;

/// `rows x cols` random weights of `dtype`, no scale zero.
pub(crate) fn random_weights(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let scale = |rng: &mut StdRng| {
        let v = rng.gen_range(0.001f32..0.05);
        f16::from_f32(if rng.gen() { v } else { -v }).to_le_bytes()
    };
    let mut bytes = Vec::new();
    for _ in 0..rows * cols / dtype.block_len() {
        match dtype {
            DType::F32 => bytes.extend(rng.gen_range(-1.0f32..1.0).to_le_bytes()),
            DType::F16 => bytes.extend(f16::from_f32(rng.gen_range(-1.0..1.0)).to_le_bytes()),
            DType::BF16 => bytes.extend(bf16::from_f32(rng.gen_range(-1.0..1.0)).to_le_bytes()),
            DType::Q8_0 => {
                bytes.extend(scale(rng));
                bytes.extend((0..32).map(|_| rng.gen::<u8>()));
            }
            DType::Q4_0 => {
                bytes.extend(scale(rng));
                bytes.extend((0..16).map(|_| rng.gen::<u8>()));
            }
            DType::Q4_1 => {
                bytes.extend(scale(rng));
                bytes.extend(scale(rng));
                bytes.extend((0..16).map(|_| rng.gen::<u8>()));
            }
            // Random bytes, then each f16 field a random scale.
            _ => {
                let start = bytes.len();
                bytes.extend((0..dtype.block_bytes()).map(|_| rng.gen::<u8>()));
                for at in f16_fields(dtype) {
                    bytes[start + at..start + at + 2].copy_from_slice(&scale(rng));
                }
            }
        }
    }
    bytes
}

/// Where the f16 fields of a `dtype` block lie.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    }
}

/// `n` random activations in ±[0.01, 3), never zero.
pub(crate) fn random_activations(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v = rng.gen_range(0.01f32..3.0);
            if rng.gen() {
                v
            } else {
                -v
            }
        })
        .collect()
}

/// The exact product `x · Wᵀ` in f64, and for each output the error the
/// kernels may make: f32 rounding (1e-5 of `Σ |w x|`) plus, for quantized
/// weights, the 8-bit activation rounding, times each block's `Σ |w|`: at
/// most `d_x / 2 = amax / 254` per activation of a block of 32, and for Q8_K
/// (blocks of 256) `d_x = amax / 128`, a whole step since values opposite
/// the largest one clamp at 127.
pub(crate) fn reference(
    dtype: DType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
) -> (Vec<f64>, Vec<f64>) {
    let row_bytes = dtype.bytes_for(cols).unwrap();
    let mut w = vec![0.0f32; cols];
    let (mut exact, mut tolerance) = (Vec::new(), Vec::new());
    for xr in x.chunks(cols) {
        for wr in weights.chunks(row_bytes).take(rows) {
            dequantize_row(dtype, wr, &mut w).unwrap();
            let dot: f64 = w
                .iter()
                .zip(xr)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            let abs: f64 = w
                .iter()
                .zip(xr)
                .map(|(&a, &b)| f64::from(a * b).abs())
                .sum();
            let mut tol = 1e-5 * abs;
            if let Some(format) = ActivationFormat::of(dtype) {
                let (len, steps) = match format {
                    ActivationFormat::Q8 => (32, 254.0),
                    ActivationFormat::Q8K => (256, 128.0),
                };
                for (wb, xb) in w.chunks(len).zip(xr.chunks(len)) {
                    let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let wsum: f64 = wb.iter().map(|v| f64::from(v.abs())).sum();
                    tol += f64::from(amax) / steps * 1.0001 * wsum;
                }
            }
            exact.push(dot);
            tolerance.push(tol);
        }
    }
    (exact, tolerance)
}
