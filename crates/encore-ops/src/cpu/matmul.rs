//! Threaded matrix products `y = x · Wᵀ`: `W` is `rows x cols` weights, one
//! output per weight row; `x` is `m` rows of `cols` activations; `y` is `m`
//! rows of `rows` outputs.
//!
//! Weight rows are split into chunks that run as tasks, each writing its own
//! slice of every output row. Inside a chunk the weights are taken a few KiB
//! at a time, small enough to stay in L1, and each such block meets every
//! activation row in tiles: 1 weight row x 1 activation row when decoding
//! (`m = 1`), 1 x 4 when `m > 1`. Every weight is read from memory once per
//! call, whatever `m` is.
//!
//! Decoding streams the weights from memory, and one weight row at a time
//! keeps each thread's reads in one sequential stream: with two rows at a
//! time (two streams), products with long rows (FFN down) read memory more
//! slowly (`BENCHMARKS.md`, approaches not kept). Each row's dot product is
//! summed the same way whatever the tile, so results do not depend on it.
//!
//! The split into tasks, and where they run, is `tasks.rs`'s, shared with
//! the tiled products of `gemm/`.

use super::dot::{float_rows, quant_rows};
use super::kdot::super_rows;
use super::kquant::BlockQ8K;
use super::quant::{ActivationBlock, ActivationFormat, QuantizedActivations};
use super::simd::Isa;
use super::tasks::for_each_task;
use super::QuantError;
use crate::DType;

/// Weight bytes multiplied with all activation rows before moving on, to stay in L1.
const L1_WEIGHT_BYTES: usize = 16 * 1024;

/// `y = x · Wᵀ` for `rows x cols` weights of `dtype`, with `x` holding `m`
/// rows of `cols` f32s and `y` `m` rows of `rows` f32s.
///
/// Quantized weights quantize `x` to 8 bits first (into a fresh buffer; use
/// [`matmul_with_scratch`] to reuse one).
///
/// # Errors
/// If the weights are not `rows x cols` whole blocks of `dtype`, `x` is not
/// whole rows of `cols`, or `y` is not `m x rows`.
pub fn matmul(
    dtype: DType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<(), QuantError> {
    let mut scratch = QuantizedActivations::new();
    matmul_with_scratch(dtype, weights, rows, cols, x, y, &mut scratch)
}

/// [`matmul`], quantizing `x` into `scratch` (when `dtype` is quantized, in
/// the [`ActivationFormat`] it takes) so that repeated calls allocate nothing
/// once `scratch` has grown. Afterwards `scratch` holds the quantized `x`,
/// ready for [`matmul_quantized`] with other weights that take the same input
/// in the same format.
///
/// # Errors
/// As [`matmul`].
pub fn matmul_with_scratch(
    dtype: DType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
    scratch: &mut QuantizedActivations,
) -> Result<(), QuantError> {
    matmul_on(Isa::detect(), dtype, weights, rows, cols, x, y, scratch)
}

/// `y = x · Wᵀ` for `rows x x.cols()` quantized weights of `dtype` and
/// activations already quantized (in the format `dtype` takes), for example
/// once for the q, k and v projections of the same input.
///
/// # Errors
/// [`QuantError::ActivationKind`] for float weights or activations in
/// another format, and shape errors as [`matmul`].
pub fn matmul_quantized(
    dtype: DType,
    weights: &[u8],
    rows: usize,
    x: &QuantizedActivations,
    y: &mut [f32],
) -> Result<(), QuantError> {
    matmul_quantized_on(Isa::detect(), dtype, weights, rows, x, y)
}

#[allow(clippy::too_many_arguments)] // matmul_with_scratch's, plus the instruction set
pub(crate) fn matmul_on(
    isa: Isa,
    dtype: DType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
    scratch: &mut QuantizedActivations,
) -> Result<(), QuantError> {
    QuantError::check_weights(dtype, weights.len(), rows, cols)?;
    if let Some(format) = ActivationFormat::of(dtype) {
        scratch.quantize_on(isa, format, x, cols)?;
        return matmul_quantized_on(isa, dtype, weights, rows, scratch, y);
    }
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(QuantError::Ragged {
            what: "activations",
            len: x.len(),
            cols,
        });
    }
    let m = x.len() / cols;
    check_output(y, m, rows)?;
    let kernel = FloatKernel { isa, dtype };
    multiply(&kernel, weights, cols * dtype.block_bytes(), x, cols, m, y);
    Ok(())
}

pub(crate) fn matmul_quantized_on(
    isa: Isa,
    dtype: DType,
    weights: &[u8],
    rows: usize,
    x: &QuantizedActivations,
    y: &mut [f32],
) -> Result<(), QuantError> {
    let format = ActivationFormat::of(dtype);
    if format != Some(x.format()) {
        return Err(QuantError::ActivationKind {
            dtype,
            expected: format.map_or("f32", ActivationFormat::name),
        });
    }
    let cols = x.cols();
    QuantError::check_weights(dtype, weights.len(), rows, cols)?;
    check_output(y, x.rows(), rows)?;
    #[cfg(target_arch = "x86_64")]
    if let Some(proof) = isa.avx512_vnni() {
        if x.rows() > 1 && super::gemm::supports(dtype) {
            super::gemm::multiply(proof, dtype, weights, rows, x, y);
            return Ok(());
        }
        if x.rows() > 1 && super::gemm::blocks::supports(dtype) {
            super::gemm::blocks::multiply(proof, dtype, weights, rows, x, y);
            return Ok(());
        }
    }
    let row_blocks = cols / x.format().block_len();
    let row_bytes = row_blocks * dtype.block_bytes();
    match x.format() {
        ActivationFormat::Q8 => multiply(
            &QuantKernel { isa, dtype },
            weights,
            row_bytes,
            x.blocks(),
            row_blocks,
            x.rows(),
            y,
        ),
        ActivationFormat::Q8K => multiply(
            &SuperKernel { isa, dtype },
            weights,
            row_bytes,
            x.super_blocks(),
            row_blocks,
            x.rows(),
            y,
        ),
    }
    Ok(())
}

fn check_output(y: &[f32], m: usize, rows: usize) -> Result<(), QuantError> {
    let expected = m.saturating_mul(rows);
    if y.len() != expected {
        return Err(QuantError::Length {
            what: "output",
            expected,
            actual: y.len(),
        });
    }
    Ok(())
}

/// The dot-product kernels for one kind of activations.
trait Kernel: Sync {
    type Act: Sync;

    /// `out[j][r] = (row r of w) · x[j]`, `NW` weight rows per tile.
    fn rows<const NW: usize, const NX: usize>(
        &self,
        w: &[u8],
        x: [&[Self::Act]; NX],
        out: [&mut [f32]; NX],
    );
}

struct QuantKernel {
    isa: Isa,
    dtype: DType,
}

impl Kernel for QuantKernel {
    type Act = ActivationBlock;

    fn rows<const NW: usize, const NX: usize>(
        &self,
        w: &[u8],
        x: [&[ActivationBlock]; NX],
        out: [&mut [f32]; NX],
    ) {
        quant_rows::<NW, NX>(self.isa, self.dtype, w, x, out);
    }
}

struct SuperKernel {
    isa: Isa,
    dtype: DType,
}

impl Kernel for SuperKernel {
    type Act = BlockQ8K;

    fn rows<const NW: usize, const NX: usize>(
        &self,
        w: &[u8],
        x: [&[BlockQ8K]; NX],
        out: [&mut [f32]; NX],
    ) {
        super_rows::<NW, NX>(self.isa, self.dtype, w, x, out);
    }
}

struct FloatKernel {
    isa: Isa,
    dtype: DType,
}

impl Kernel for FloatKernel {
    type Act = f32;

    fn rows<const NW: usize, const NX: usize>(
        &self,
        w: &[u8],
        x: [&[f32]; NX],
        out: [&mut [f32]; NX],
    ) {
        float_rows::<NW, NX>(self.isa, self.dtype, w, x, out);
    }
}

/// The threaded product over checked shapes: `weights` is whole rows of
/// `row_bytes`, `x` is `m` rows of `x_row` activations, `y` is `m` rows of
/// `weights.len() / row_bytes` outputs.
fn multiply<K: Kernel>(
    kernel: &K,
    weights: &[u8],
    row_bytes: usize,
    x: &[K::Act],
    x_row: usize,
    m: usize,
    y: &mut [f32],
) {
    if m == 0 || y.is_empty() {
        return;
    }
    if row_bytes == 0 {
        y.fill(0.0); // empty dot products
        return;
    }
    let chunk =
        |w: &[u8], out: &mut [&mut [f32]]| multiply_chunk(kernel, w, row_bytes, x, x_row, out);
    for_each_task(weights, row_bytes, m, y, chunk);
}

/// One task: the weight rows in `w` against all `out.len()` activation rows;
/// `out[j]` receives activation row `j`'s outputs for these weight rows.
fn multiply_chunk<K: Kernel>(
    kernel: &K,
    w: &[u8],
    row_bytes: usize,
    x: &[K::Act],
    x_row: usize,
    out: &mut [&mut [f32]],
) {
    let m = out.len();
    // Activation rows taken four at a time; the rest (all of them when m = 1) one at a time.
    let grouped = if m > 1 { m - m % 4 } else { 0 };
    let (x_grouped, x_single) = x.split_at(grouped * x_row);
    let block_rows = (L1_WEIGHT_BYTES / row_bytes).next_multiple_of(4).max(4);
    for (b, w_block) in w.chunks(block_rows * row_bytes).enumerate() {
        let rows = b * block_rows..b * block_rows + w_block.len() / row_bytes;
        let (out_grouped, out_single) = out.split_at_mut(grouped);
        for (group, xs) in out_grouped
            .chunks_exact_mut(4)
            .zip(x_grouped.chunks_exact(4 * x_row))
        {
            let [o0, o1, o2, o3] = group else { continue };
            let xs = std::array::from_fn(|t| &xs[t * x_row..(t + 1) * x_row]);
            let out = [
                &mut o0[rows.clone()],
                &mut o1[rows.clone()],
                &mut o2[rows.clone()],
                &mut o3[rows.clone()],
            ];
            kernel.rows::<1, 4>(w_block, xs, out);
        }
        for (o, xj) in out_single.iter_mut().zip(x_single.chunks_exact(x_row)) {
            kernel.rows::<1, 1>(w_block, [xj], [&mut o[rows.clone()]]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{random_activations, random_weights, reference};
    use rand::{rngs::StdRng, SeedableRng};

    /// Shapes (rows, cols, m): rows off the 2-row tile, the L1 block and the
    /// task size, m off the 4-row activation tile, and products big enough to
    /// be threaded.
    fn shapes(dtype: DType) -> Vec<(usize, usize, usize)> {
        if dtype.block_len() == 256 {
            return vec![
                (1, 256, 1),
                (7, 512, 3),
                (67, 256, 17),
                (301, 768, 1),
                (301, 768, 3),
                (1029, 256, 1),
                (1029, 256, 17),
            ];
        }
        let mut shapes = vec![
            (1, 32, 1),
            (7, 64, 3),
            (67, 96, 17),
            (301, 576, 1),
            (301, 576, 3),
            (1029, 256, 1),
            (1029, 256, 17),
        ];
        if !dtype.is_quantized() {
            shapes.extend([(5, 1, 1), (13, 37, 3), (70, 37, 17)]);
        }
        shapes
    }

    /// The product on a pool of three threads, so that the larger shapes
    /// are split into tasks.
    fn run(isa: Isa, dtype: DType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        let mut y = vec![f32::NAN; x.len() / cols * rows];
        let mut scratch = QuantizedActivations::new();
        let pool = encore::parallel::WorkerPool::new(3).unwrap();
        pool.install(|| matmul_on(isa, dtype, w, rows, cols, x, &mut y, &mut scratch))
            .unwrap();
        y
    }

    #[test]
    fn threaded_and_serial_products_are_bit_identical() {
        let mut rng = StdRng::seed_from_u64(23);
        for dtype in [
            DType::Q4_1,
            DType::Q8_0,
            DType::F16,
            DType::Q4_K,
            DType::Q6_K,
        ] {
            for (rows, cols, m) in [(1029, 256, 1), (1029, 256, 17), (2000, 768, 1)] {
                let w = random_weights(&mut rng, dtype, rows, cols);
                let x = random_activations(&mut rng, m * cols);
                let threaded = run(Isa::detect(), dtype, &w, rows, cols, &x);
                let mut serial = vec![0.0; m * rows];
                matmul(dtype, &w, rows, cols, &x, &mut serial).unwrap();
                assert_eq!(encore::parallel::threads(), 1);
                let bits = |y: &[f32]| y.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&threaded),
                    bits(&serial),
                    "{dtype} {rows}x{cols} m={m}"
                );
            }
        }
    }

    #[test]
    fn activations_beyond_f16_range_give_finite_products() {
        // Real models' feed-forward outputs reach hundreds of thousands on
        // a few tokens: a block's scale then still fits f16, but its scaled
        // code sum (ggml's Q8_1 `s`) does not, and ggml's products are NaN.
        // Every weight type, every ISA, rows up to 4e5 and one value of 3e7.
        let mut rng = StdRng::seed_from_u64(29);
        for dtype in DType::ALL {
            let (rows, cols, m) = (7, 512, 3);
            let w = random_weights(&mut rng, dtype, rows, cols);
            let mut x = random_activations(&mut rng, m * cols);
            x[cols..2 * cols].iter_mut().for_each(|v| *v *= 1.5e5);
            x[2 * cols + 77] = 3e7;
            let (exact, tol) = reference(dtype, &w, rows, cols, &x);
            for isa in Isa::available() {
                let y = run(isa, dtype, &w, rows, cols, &x);
                for (k, ((&got, &e), &t)) in y.iter().zip(&exact).zip(&tol).enumerate() {
                    assert!(
                        (f64::from(got) - e).abs() <= t,
                        "{dtype} {isa:?} output {k}: {got} vs {e} (tolerance {t})"
                    );
                }
            }
        }
    }

    #[test]
    fn matmul_matches_f64_reference() {
        let mut rng = StdRng::seed_from_u64(20);
        for dtype in DType::ALL {
            for (rows, cols, m) in shapes(dtype) {
                let w = random_weights(&mut rng, dtype, rows, cols);
                let x = random_activations(&mut rng, m * cols);
                let (exact, tol) = reference(dtype, &w, rows, cols, &x);
                for isa in Isa::available() {
                    let y = run(isa, dtype, &w, rows, cols, &x);
                    for (k, ((&got, &e), &t)) in y.iter().zip(&exact).zip(&tol).enumerate() {
                        let err = (f64::from(got) - e).abs();
                        assert!(
                            err <= t,
                            "{dtype} {rows}x{cols} m={m} {isa:?} output {k}: {got} vs {e} (error {err} > {t})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn scalar_and_simd_matmuls_agree() {
        let mut rng = StdRng::seed_from_u64(21);
        for dtype in DType::ALL {
            let (rows, cols, m) = (259, 768, 5);
            let w = random_weights(&mut rng, dtype, rows, cols);
            let x = random_activations(&mut rng, m * cols);
            let (_, tol) = reference(dtype, &w, rows, cols, &x);
            let scalar = run(Isa::Scalar, dtype, &w, rows, cols, &x);
            for isa in Isa::available() {
                let simd = run(isa, dtype, &w, rows, cols, &x);
                // Same (quantized) inputs; only the float summation order
                // differs, so types in blocks of 32 agree far closer than
                // their tolerance (bit for bit where the kernels add blocks
                // in order), and super-block types (whose kernels finish
                // each block with the same float operations) bit for bit,
                // except in the AVX-512 products of several rows, which
                // sum in lanes (`gemm/mod.rs`).
                let exact = match ActivationFormat::of(dtype) {
                    Some(ActivationFormat::Q8K) => !isa.has_avx512_vnni(),
                    Some(ActivationFormat::Q8) => isa.sums_blocks_in_order(),
                    None => false,
                };
                if exact {
                    assert_eq!(simd, scalar, "{dtype} {isa:?}");
                    continue;
                }
                let share = if dtype.is_quantized() { 0.01 } else { 1.0 };
                for ((a, b), t) in simd.iter().zip(&scalar).zip(&tol) {
                    assert!(
                        f64::from((a - b).abs()) <= t * share,
                        "{dtype} {isa:?}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn prequantized_activations_give_the_same_result() {
        let mut rng = StdRng::seed_from_u64(22);
        let (rows, cols, m) = (200, 128, 3);
        let w = random_weights(&mut rng, DType::Q4_1, rows, cols);
        let x = random_activations(&mut rng, m * cols);
        let mut y = vec![0.0; m * rows];
        matmul(DType::Q4_1, &w, rows, cols, &x, &mut y).unwrap();

        let mut q = QuantizedActivations::new();
        q.quantize(ActivationFormat::Q8, &x, cols).unwrap();
        let mut y2 = vec![0.0; m * rows];
        matmul_quantized(DType::Q4_1, &w, rows, &q, &mut y2).unwrap();
        assert_eq!(y, y2);
        // Q8 activations do not fit super-block weights.
        let wk = random_weights(&mut rng, DType::Q4_K, rows, 256);
        let (xk, mut yk) = (random_activations(&mut rng, 256), vec![0.0; rows]);
        q.quantize(ActivationFormat::Q8, &xk, 256).unwrap();
        assert!(matches!(
            matmul_quantized(DType::Q4_K, &wk, rows, &q, &mut yk),
            Err(QuantError::ActivationKind { .. })
        ));
        q.quantize(ActivationFormat::Q8K, &xk, 256).unwrap();
        matmul_quantized(DType::Q4_K, &wk, rows, &q, &mut yk).unwrap();
        let mut yk2 = vec![0.0; rows];
        matmul(DType::Q4_K, &wk, rows, 256, &xk, &mut yk2).unwrap();
        assert_eq!(yk, yk2);

        // The same scratch reused for a different shape.
        let w8 = random_weights(&mut rng, DType::Q8_0, 40, 64);
        let x8 = random_activations(&mut rng, 64);
        let mut y3 = vec![0.0; 40];
        matmul_with_scratch(DType::Q8_0, &w8, 40, 64, &x8, &mut y3, &mut q).unwrap();
        let mut y4 = vec![0.0; 40];
        matmul(DType::Q8_0, &w8, 40, 64, &x8, &mut y4).unwrap();
        assert_eq!(y3, y4);
        assert_eq!((q.rows(), q.cols()), (1, 64));
    }

    #[test]
    fn matmul_rejects_bad_shapes() {
        let w = vec![0u8; 4 * 20];
        let mut y = vec![0.0; 4];
        let x = vec![1.0; 32];
        assert!(matmul(DType::Q4_1, &w, 4, 32, &x, &mut y).is_ok());
        assert!(matches!(
            matmul(DType::Q4_1, &w, 5, 32, &x, &mut y),
            Err(QuantError::WeightBytes {
                expected: 100,
                actual: 80,
                ..
            })
        ));
        assert!(matches!(
            matmul(DType::Q4_1, &w, 4, 32, &x[..31], &mut y),
            Err(QuantError::Ragged { .. })
        ));
        assert!(matches!(
            matmul(DType::Q4_1, &w, 4, 32, &x, &mut y[..3]),
            Err(QuantError::Length {
                what: "output",
                expected: 4,
                actual: 3
            })
        ));
        assert!(matches!(
            matmul(DType::Q4_0, &[0; 18], 1, 16, &x[..16], &mut y[..1]),
            Err(QuantError::PartialBlock { .. })
        ));
        assert!(matches!(
            matmul(DType::F32, &[0; 16], 2, 2, &x[..3], &mut y[..2]),
            Err(QuantError::Ragged { .. })
        ));
        let mut q = QuantizedActivations::new();
        q.quantize(ActivationFormat::Q8, &x, 32).unwrap();
        assert!(matches!(
            matmul_quantized(DType::F16, &[0; 64], 1, &q, &mut y[..1]),
            Err(QuantError::ActivationKind { .. })
        ));
    }
}
