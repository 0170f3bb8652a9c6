//! Matrix products and embedding lookups, every weight type.
//!
//! The WGSL products multiply dequantized weights with f32 activations, so
//! they are checked against that product taken exactly (f64) from the
//! CPU's dequantization, within a few f32 roundings of `Σ|w·x|`, and
//! against the CPU's own kernel more loosely: it quantizes the activations
//! to 8 bits for quantized weights (as ggml does).

use encore::{Buffer, Encoder};
use encore_ops::kernels::fused::{
    FusedArgs, FusedShape, EPILOGUE_ACCUMULATE, EPILOGUE_STORE, EPILOGUE_SWIGLU,
};
use encore_ops::{DType, KernelSet, Ops, Weight};

use super::common::{random_weights, upload, Rng};
use super::{assert_close, both, both_with_and_without_features, run, run_graph};

/// The GPU's sums against the exact product: f32 roundings of sums of up
/// to a few thousand terms, relative to `Σ|w·x|`.
const EXACT_TOL: f64 = 1e-5;
/// The CPU against the exact product for quantized weights: its 8-bit
/// activations (blocks of 32, or Q8_K's 256) carry up to 1/254 of each
/// block's largest value, relative to `Σ|w·x|`.
const CPU_QUANT_TOL: f64 = 5e-3;
/// The tiled product (from 32 rows on) with f16 tiles against the exact
/// product: weights and activations each rounded to f16 (2^-11 of each,
/// relative), their products exact and summed in f32, relative to `Σ|w·x|`.
const F16_TILE_TOL: f64 = 1.5e-3;

/// The weights as f32, row by row, as the CPU dequantizes them.
fn dequantize(dtype: DType, bytes: &[u8], rows: usize, k: usize) -> Vec<f32> {
    let row_bytes = dtype.bytes_for(k).unwrap();
    let mut out = vec![0f32; rows * k];
    for (r, dst) in out.chunks_exact_mut(k).enumerate() {
        encore_ops::cpu::dequantize_row(dtype, &bytes[r * row_bytes..(r + 1) * row_bytes], dst)
            .unwrap();
    }
    out
}

/// The exact product `Σ_i w[j, i] x[r, i]` (in f64) and `Σ|w·x|`, by
/// `[r, j]`.
fn exact_product(w: &[f32], x: &[f32], rows: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut exact = vec![0f64; rows * n];
    let mut scale = vec![0f64; rows * n];
    for r in 0..rows {
        let xr = &x[r * k..(r + 1) * k];
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            let terms = wr
                .iter()
                .zip(xr)
                .map(|(a, b)| f64::from(*a) * f64::from(*b));
            exact[r * n + j] = terms.clone().sum();
            scale[r * n + j] = terms.map(f64::abs).sum();
        }
    }
    (exact, scale)
}

/// Asserts `|got - want| <= tol * scale + 1e-7` elementwise, naming the worst.
fn assert_within(what: &str, got: &[f32], want: &[f64], scale: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, ((g, e), s)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!(
            (f64::from(*g) - e).abs() <= tol * s + 1e-7,
            "{what}: output {i}: {g} vs {e} (Σ|w·x| = {s}, tolerance {tol} of it)"
        );
    }
}

fn weight(ops: &Ops, dtype: DType, bytes: &[u8], n: usize, k: usize) -> Weight {
    Weight {
        buffer: upload(ops, bytes),
        dtype,
        n,
        k,
    }
}

/// Every weight type, for one row (decode), three, more than one tile of
/// rows and the tiled path of many rows; output columns not a whole number of workgroup tiles; x
/// read from an offset. Float weights also with rows that are not a whole
/// number of eight-element groups.
#[test]
fn matmul_matches_cpu_for_every_weight_type() {
    let mut rng = Rng::new();
    for pair in both_with_and_without_features() {
        matmul_matches_cpu_on(&pair, &mut rng);
    }
}

fn matmul_matches_cpu_on(pair: &[Ops; 2], rng: &mut Rng) {
    let arch = pair[1].device().arch();
    // (rows, n, k, x offset in floats)
    let shapes = [
        (1usize, 70usize, 512usize, 0usize),
        (3, 37, 256, 1),
        // From 32 rows on, tiles of 32 columns by 32 rows: one, and several
        // of each, neither filled.
        (67, 21, 256, 0),
        (40, 70, 64, 1),
        (33, 35, 96, 0),
        (1, 9, 96, 0),
        (9, 13, 64, 3),
        // Float weights only: k not a multiple of 8.
        (5, 11, 100, 0),
        (1, 6, 3, 1),
    ];
    for dtype in DType::ALL {
        for &(rows, n, k, offset) in &shapes {
            if k % dtype.block_len() != 0 {
                continue;
            }
            let w = random_weights(rng, dtype, n, k);
            let x = rng.vec(offset + rows * k);
            let wf = dequantize(dtype, &w, n, k);
            let (exact, scale) = exact_product(&wf, &x[offset..], rows, n, k);
            let [cpu, gpu] = pair.each_ref().map(|ops| {
                let weight = weight(ops, dtype, &w, n, k);
                let xb = upload(ops, &x).view(offset * 4, rows * k * 4).unwrap();
                let y = ops.device().alloc(rows * n * 4).unwrap();
                run(ops, |o, e| o.matmul(e, &weight, &xb, &y, rows, "matmul"));
                y.download::<f32>().unwrap()
            });
            let what = format!("matmul {dtype} rows={rows} n={n} k={k} x+{offset} on {arch}");
            let f16_tiles = arch.contains("+f16") && rows >= 32 && k % 32 == 0;
            let tol = if f16_tiles { F16_TILE_TOL } else { EXACT_TOL };
            assert_within(&format!("{what} (wgpu)"), &gpu, &exact, &scale, tol);
            // The same product in a graph, whose kernel is the variant
            // compiled for this shape.
            let ops = &pair[1];
            let weight = weight(ops, dtype, &w, n, k);
            let xb = upload(ops, &x).view(offset * 4, rows * k * 4).unwrap();
            let y = ops.device().alloc(rows * n * 4).unwrap();
            let specialized = run_graph(ops, &[&y], |o, e| {
                o.matmul(e, &weight, &xb, &y, rows, "matmul")
            });
            assert_eq!(
                specialized, 1,
                "{what}: the graph's kernel is not specialized"
            );
            let graph = y.download::<f32>().unwrap();
            assert_within(
                &format!("{what} (wgpu, specialized)"),
                &graph,
                &exact,
                &scale,
                tol,
            );
            let cpu_tol = if dtype.is_quantized() {
                CPU_QUANT_TOL
            } else {
                EXACT_TOL
            };
            assert_within(&format!("{what} (CPU)"), &cpu, &exact, &scale, cpu_tol);
        }
    }
}

/// Activation rows beyond f16's range (real models' feed-forward outputs
/// reach hundreds of thousands on a few tokens) beside ordinary rows, in the
/// tiled path, with and without f16 tiles: every output finite and within
/// the tiles' tolerance of the exact product (the large rows are computed
/// apart in f32; clamped to f16 they were off by orders of magnitude).
#[test]
fn tiled_matmul_computes_rows_beyond_f16_range() {
    let mut rng = Rng::new();
    for pair in both_with_and_without_features() {
        let ops = &pair[1];
        let arch = ops.device().arch();
        for dtype in [DType::Q4_K, DType::Q6_K, DType::Q8_0, DType::F16] {
            let (rows, n, k) = (40usize, 37usize, 512usize);
            let w = random_weights(&mut rng, dtype, n, k);
            let mut x = rng.vec(rows * k);
            // Row 5: every value up to 4e5; row 33: one value of 3e6.
            x[5 * k..6 * k].iter_mut().for_each(|v| *v *= 4e5);
            x[33 * k + 100] = 3e6;
            let wf = dequantize(dtype, &w, n, k);
            let (exact, scale) = exact_product(&wf, &x, rows, n, k);
            let weight = weight(ops, dtype, &w, n, k);
            let xb = upload(ops, &x);
            let y = ops.device().alloc(rows * n * 4).unwrap();
            run(ops, |o, e| o.matmul(e, &weight, &xb, &y, rows, "matmul"));
            let got = y.download::<f32>().unwrap();
            let what = format!("matmul {dtype} rows={rows} n={n} k={k} with large rows on {arch}");
            assert!(got.iter().all(|v| v.is_finite()), "{what}: not finite");
            let tol = if arch.contains("+f16") {
                F16_TILE_TOL
            } else {
                EXACT_TOL
            };
            assert_within(&what, &got, &exact, &scale, tol);
        }
    }
}

/// More output columns than one grid dimension holds workgroups: the
/// launch folds into two dimensions and every column is computed.
#[test]
fn matmul_with_more_workgroups_than_a_grid_dimension_matches_the_exact_product() {
    let mut rng = Rng::new();
    let [_, ops] = both();
    let (dtype, rows, n, k) = (DType::Q4_0, 1usize, 270_000usize, 32usize);
    let w = random_weights(&mut rng, dtype, n, k);
    let x = rng.vec(rows * k);
    let wf = dequantize(dtype, &w, n, k);
    let (exact, scale) = exact_product(&wf, &x, rows, n, k);
    let weight = weight(&ops, dtype, &w, n, k);
    let xb = upload(&ops, &x);
    let y = ops.device().alloc(rows * n * 4).unwrap();
    run(&ops, |o, e| o.matmul(e, &weight, &xb, &y, rows, "matmul"));
    let got = y.download::<f32>().unwrap();
    assert_within("matmul n=270000", &got, &exact, &scale, EXACT_TOL);
}

/// An output head's shape in a graph: few rows and at least 16,384
/// columns, whose variant takes 8 columns of 16 lanes a workgroup instead
/// of 2 of 64 (`WIDE_COLS` in `wgsl/mod.rs`); columns not a whole number
/// of workgroups, rows of several weight blocks a lane.
#[test]
fn wide_matmul_variant_matches_the_exact_product() {
    let mut rng = Rng::new();
    let [_, ops] = both();
    for (dtype, rows, n, k) in [
        (DType::Q8_0, 1usize, 16_389usize, 576usize),
        (DType::Q4_K, 3, 16_387, 512),
        (DType::F16, 2, 20_000, 72),
    ] {
        let w = random_weights(&mut rng, dtype, n, k);
        let x = rng.vec(rows * k);
        let wf = dequantize(dtype, &w, n, k);
        let (exact, scale) = exact_product(&wf, &x, rows, n, k);
        let weight = weight(&ops, dtype, &w, n, k);
        let xb = upload(&ops, &x);
        let y = ops.device().alloc(rows * n * 4).unwrap();
        let specialized = run_graph(&ops, &[&y], |o, e| {
            o.matmul(e, &weight, &xb, &y, rows, "matmul")
        });
        let what = format!("matmul {dtype} rows={rows} n={n} k={k} (wgpu, specialized)");
        assert_eq!(
            specialized, 1,
            "{what}: the graph's kernel is not specialized"
        );
        let got = y.download::<f32>().unwrap();
        assert_within(&what, &got, &exact, &scale, EXACT_TOL);
    }
}

/// `rms_norm(x) * g` as the CPU's `rms_norm` forms it (sum of squares in f64).
fn rms_norm(x: &[f32], g: &[f32], rows: usize, k: usize, eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; rows * k];
    for (xr, yr) in x.chunks_exact(k).zip(out.chunks_exact_mut(k)) {
        let sum: f64 = xr.iter().map(|v| f64::from(v * v)).sum();
        let scale = 1.0 / ((sum / k as f64) as f32 + eps).sqrt();
        for ((y, x), w) in yr.iter_mut().zip(xr).zip(g) {
            *y = x * scale * w;
        }
    }
    out
}

/// One `fused_matmul` dispatch on `ops`: inputs `x` (`rows` of `k`), `g`
/// (`None`: no norm), weights, the outputs' initial values, each output's
/// bias (the store epilogue; `None`: none); the outputs after it. With
/// `graph`, the dispatch runs as a graph, with the kernel's variant
/// specialized for its shape.
#[allow(clippy::too_many_arguments)]
fn fused_on(
    graph: bool,
    ops: &Ops,
    x: &[f32],
    g: Option<&[f32]>,
    weights: &[(DType, &[u8], usize)],
    outputs: &[Vec<f32>],
    biases: &[Option<Vec<f32>>],
    rows: usize,
    k: usize,
    epilogue: u32,
) -> Vec<Vec<f32>> {
    let kernel = ops
        .device()
        .load_kernel(&KernelSet::Default.defs().fused_matmul)
        .unwrap();
    let xb = upload(ops, x);
    let empty = xb.view(0, 0).unwrap();
    let gb = g.map_or(empty.clone(), |g| upload(ops, g));
    let wb: Vec<Buffer> = weights.iter().map(|(_, w, _)| upload(ops, w)).collect();
    let yb: Vec<Buffer> = outputs.iter().map(|y| upload(ops, y)).collect();
    let bb: Vec<Buffer> = biases
        .iter()
        .map(|b| b.as_ref().map_or(empty.clone(), |b| upload(ops, b)))
        .collect();
    let pick = |v: &[Buffer], i: usize| v.get(i).cloned().unwrap_or_else(|| empty.clone());
    let mut shape = FusedShape {
        rows: rows as u32,
        k: k as u32,
        n: [0; 3],
        dtype: [0; 3],
        weights: weights.len() as u32,
        epilogue,
        norm: u32::from(g.is_some()),
        eps: 1e-5,
        bias: 0,
    };
    for (i, b) in biases.iter().enumerate() {
        shape.bias |= u32::from(b.is_some()) << i;
    }
    for (i, (dtype, _, n)) in weights.iter().enumerate() {
        shape.n[i] = *n as u32;
        shape.dtype[i] = dtype.ggml_id();
    }
    let args = FusedArgs {
        x: xb.clone(),
        g: gb,
        w0: pick(&wb, 0),
        w1: pick(&wb, 1),
        w2: pick(&wb, 2),
        y0: pick(&yb, 0),
        y1: pick(&yb, 1),
        y2: pick(&yb, 2),
        b0: pick(&bb, 0),
        b1: pick(&bb, 1),
        b2: pick(&bb, 2),
        shape,
    };
    let dispatch = |_: &Ops, e: &mut Encoder| e.dispatch(&kernel, &args.args(), "fused");
    if graph {
        let outs: Vec<&Buffer> = yb.iter().collect();
        let specialized = run_graph(ops, &outs, dispatch);
        assert_eq!(
            specialized, 1,
            "the graph's fused_matmul is not specialized"
        );
    } else {
        run(ops, dispatch);
    }
    yb.iter().map(|y| y.download::<f32>().unwrap()).collect()
}

/// Every epilogue, with and without the norm, for every weight type (float
/// rows not a whole number of eight-element groups; blocks of 32 in rows
/// of 96) and three different types in one dispatch, for one row, a tile
/// of fewer rows than a workgroup takes (whose graph variant takes just
/// those) and more than one tile of rows, against the exact products of
/// the (normalized) input and, more loosely, the CPU.
#[test]
fn fused_matmul_matches_cpu_for_every_epilogue() {
    let mut rng = Rng::new();
    for pair in both_with_and_without_features() {
        fused_matmul_matches_cpu_on(&pair, &mut rng);
    }
}

fn fused_matmul_matches_cpu_on(pair: &[Ops; 2], rng: &mut Rng) {
    let arch = pair[1].device().arch();
    // (weight types, k)
    let k_for = |t: DType| match t.block_len() {
        1 => 100usize,
        32 => 96,
        _ => 256,
    };
    let cases = DType::ALL
        .map(|t| ([t; 3], k_for(t)))
        .into_iter()
        .chain([([DType::Q4_K, DType::Q6_K, DType::Q8_0], 256)]);
    for (dtypes, k) in cases {
        for rows in [1usize, 3, 19] {
            for norm in [false, true] {
                for epilogue in [EPILOGUE_STORE, EPILOGUE_ACCUMULATE, EPILOGUE_SWIGLU] {
                    let ns: &[usize] = match epilogue {
                        EPILOGUE_STORE => &[13, 6, 22],
                        EPILOGUE_ACCUMULATE => &[30],
                        _ => &[27, 27],
                    };
                    let w: Vec<Vec<u8>> = ns
                        .iter()
                        .zip(dtypes)
                        .map(|(&n, t)| random_weights(rng, t, n, k))
                        .collect();
                    let weights: Vec<(DType, &[u8], usize)> = w
                        .iter()
                        .zip(ns)
                        .zip(dtypes)
                        .map(|((w, &n), t)| (t, &w[..], n))
                        .collect();
                    let x = rng.vec(rows * k);
                    let g: Vec<f32> = (0..k).map(|_| rng.range(0.5, 1.5)).collect();
                    let g = norm.then_some(&g[..]);
                    let outputs: Vec<Vec<f32>> = match epilogue {
                        EPILOGUE_SWIGLU => vec![rng.vec(rows * ns[0])],
                        _ => ns.iter().map(|&n| rng.vec(rows * n)).collect(),
                    };
                    // Biases on the first and last outputs of the store
                    // epilogue (Qwen2's Q, K and V have one each).
                    let biases: Vec<Option<Vec<f32>>> = match epilogue {
                        EPILOGUE_STORE => (0..ns.len())
                            .map(|i| (i != 1).then(|| rng.vec(ns[i])))
                            .collect(),
                        _ => Vec::new(),
                    };
                    let run = |graph: bool, ops: &Ops| {
                        let ws = &weights;
                        fused_on(graph, ops, &x, g, ws, &outputs, &biases, rows, k, epilogue)
                    };
                    let [cpu, gpu] = pair.each_ref().map(|ops| run(false, ops));
                    let specialized = run(true, &pair[1]);

                    let xn = g.map_or(x.clone(), |g| rms_norm(&x, g, rows, k, 1e-5));
                    let products: Vec<_> = w
                        .iter()
                        .zip(ns)
                        .zip(dtypes)
                        .map(|((w, &n), t)| exact_product(&dequantize(t, w, n, k), &xn, rows, n, k))
                        .collect();
                    let cpu_tol = if dtypes[0].is_quantized() {
                        CPU_QUANT_TOL
                    } else {
                        EXACT_TOL
                    };
                    // The norm's scale and the SwiGLU's activation add a few
                    // roundings more.
                    let tol = 4.0 * EXACT_TOL;
                    for (gpu, form) in [(&gpu, ""), (&specialized, ", specialized")] {
                        let what = format!(
                            "fused {dtypes:?} k={k} rows={rows} norm={norm} epilogue={epilogue} \
                             on {arch}{}",
                            form
                        );
                        match epilogue {
                            EPILOGUE_STORE => {
                                for (i, (exact, scale)) in products.iter().enumerate() {
                                    // The bias's own rounding: within 1e-7 of it.
                                    let (exact, scale): (Vec<f64>, Vec<f64>) = match &biases[i] {
                                        Some(b) => {
                                            let b = |j: usize| f64::from(b[j % ns[i]]);
                                            let e = exact.iter().enumerate().map(|(j, p)| p + b(j));
                                            let s = scale.iter().enumerate();
                                            (e.collect(), s.map(|(j, s)| s + b(j).abs()).collect())
                                        }
                                        None => (exact.clone(), scale.clone()),
                                    };
                                    assert_within(
                                        &format!("{what} y{i}"),
                                        &gpu[i],
                                        &exact,
                                        &scale,
                                        tol,
                                    );
                                    let (c, s) = (&cpu[i], &scale);
                                    assert_within(
                                        &format!("{what} y{i} (CPU)"),
                                        c,
                                        &exact,
                                        s,
                                        cpu_tol,
                                    );
                                }
                            }
                            _ => {
                                let (want, scale): (Vec<f64>, Vec<f64>) = if epilogue
                                    == EPILOGUE_ACCUMULATE
                                {
                                    let (exact, scale) = &products[0];
                                    let y = &outputs[0];
                                    let want = exact.iter().zip(y).map(|(p, y)| p + f64::from(*y));
                                    // The residual's own rounding: within 1e-7 of it.
                                    let scale =
                                        scale.iter().zip(y).map(|(s, y)| s + f64::from(y.abs()));
                                    (want.collect(), scale.collect())
                                } else {
                                    // silu(a) b: its error from a's and b's, by the
                                    // derivatives' bounds (|silu'| < 1.1, |silu(a)| <= |a|).
                                    let (a, sa) = &products[0];
                                    let (b, sb) = &products[1];
                                    let silu = |v: f64| v / (1.0 + (-v).exp());
                                    let want = a.iter().zip(b).map(|(a, b)| silu(*a) * b);
                                    let scale = (0..a.len()).map(|i| {
                                        1.1 * sa[i] * b[i].abs()
                                            + (a[i].abs() + 1.1 * sa[i]) * sb[i]
                                    });
                                    (want.collect(), scale.collect())
                                };
                                assert_within(&what, &gpu[0], &want, &scale, tol);
                                let cpu_what = format!("{what} (CPU)");
                                assert_within(&cpu_what, &cpu[0], &want, &scale, cpu_tol);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `embed` gives the CPU's dequantized rows bit for bit, for every table
/// type, repeated tokens and the last row of the table included.
#[test]
fn embed_matches_cpu_bit_for_bit_for_every_table_type() {
    let mut rng = Rng::new();
    let pair = both();
    let (vocab, rows) = (50usize, 9usize);
    for dtype in DType::ALL {
        // Float rows also not a whole number of eight-element groups.
        let dims: &[usize] = if dtype.is_quantized() {
            &[96]
        } else {
            &[96, 101]
        };
        for &dim in dims {
            let dim = dim.next_multiple_of(dtype.block_len());
            let table = random_weights(&mut rng, dtype, vocab, dim);
            let mut tokens: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
            tokens[rows - 1] = tokens[0];
            tokens[1] = vocab as u32 - 1;
            let [cpu, gpu] = pair.each_ref().map(|ops| {
                let w = weight(ops, dtype, &table, vocab, dim);
                let t = upload(ops, &tokens);
                let y = ops.device().alloc(rows * dim * 4).unwrap();
                run(ops, |o, e| o.embed(e, &w, &t, &y, rows));
                y.download::<f32>().unwrap()
            });
            assert_close(&format!("embed {dtype} dim={dim}"), &gpu, &cpu, 0.0, 0.0);
        }
    }
}
