//! Elementwise ops, norms, RoPE, KV stores, argmax and the position advance.

use encore_ops::kernels::rope::{theta_scale, RopeShape, RopeStoreArgs, RopeStoreShape};
use encore_ops::{KernelSet, Positions};
use half::f16;

use super::common::{upload, Rng};
use super::{assert_close, both, run};

/// `add` over lengths that do and do not fill a workgroup: exact (one f32
/// addition per element).
#[test]
fn add_matches_cpu() {
    let mut rng = Rng::new();
    let pair = both();
    for n in [1usize, 255, 256, 1000, 70_000] {
        let (y0, x) = (rng.vec(n), rng.vec(n));
        let out = pair.each_ref().map(|ops| {
            let (y, xb) = (upload(ops, &y0), upload(ops, &x));
            run(ops, |o, e| o.add(e, &y, &xb, n));
            y.download::<f32>().unwrap()
        });
        assert_close(&format!("add n={n}"), &out[1], &out[0], 0.0, 0.0);
    }
}

/// `rms_norm` over rows shorter and longer than a workgroup (one workgroup
/// a row): the sum of squares is f32 here (a tree of partial sums) where
/// the CPU's is f64, so the scale, and every output, agrees to a few ulp
/// (2e-6 relative is 16 of them).
#[test]
fn rms_norm_matches_cpu() {
    let mut rng = Rng::new();
    let pair = both();
    for (rows, dim) in [(1usize, 576usize), (3, 100), (2, 256), (4, 2048)] {
        let (x, w) = (rng.vec(rows * dim), rng.vec(dim));
        let out = pair.each_ref().map(|ops| {
            let (xb, wb) = (upload(ops, &x), upload(ops, &w));
            let y = ops.device().alloc(rows * dim * 4).unwrap();
            run(ops, |o, e| o.rms_norm(e, &xb, &wb, &y, rows, dim, 1e-5));
            y.download::<f32>().unwrap()
        });
        assert_close(
            &format!("rms_norm {rows}x{dim}"),
            &out[1],
            &out[0],
            2e-6,
            0.0,
        );
    }
}

/// `add_rows`, `scale`, `silu_mul` and `gelu_mul` over lengths that do and
/// do not fill a workgroup.
#[test]
fn elementwise_ops_match_cpu() {
    let mut rng = Rng::new();
    let pair = both();
    for n in [1usize, 255, 1000, 1536 * 7 + 3] {
        // Gate values over [-12, 12): both of GELU's clamps and its tails.
        let g: Vec<f32> = (0..n).map(|_| rng.range(-12.0, 12.0)).collect();
        let u = rng.vec(n);
        // silu_mul: ggml's e^x in both, its multiply-adds (fused or not)
        // and the division within a few ulp (2e-6 relative is 16).
        let out = pair.each_ref().map(|ops| {
            let (gb, ub) = (upload(ops, &g), upload(ops, &u));
            let y = ops.device().alloc(n * 4).unwrap();
            run(ops, |o, e| o.silu_mul(e, &gb, &ub, &y, n));
            y.download::<f32>().unwrap()
        });
        assert_close(&format!("silu_mul {n}"), &out[1], &out[0], 2e-6, 0.0);
        // gelu_mul: tanh within a few ulp of the CPU's, which can move a
        // result by one f16 step (2^-11 relative).
        let out = pair.each_ref().map(|ops| {
            let (gb, ub) = (upload(ops, &g), upload(ops, &u));
            let y = ops.device().alloc(n * 4).unwrap();
            run(ops, |o, e| o.gelu_mul(e, &gb, &ub, &y, n));
            y.download::<f32>().unwrap()
        });
        assert_close(&format!("gelu_mul {n}"), &out[1], &out[0], 1e-3, 1e-7);
        // scale: one rounded product, exact.
        let out = pair.each_ref().map(|ops| {
            let y = upload(ops, &u);
            run(ops, |o, e| o.scale(e, &y, 25.298, n));
            y.download::<f32>().unwrap()
        });
        assert_close(&format!("scale {n}"), &out[1], &out[0], 0.0, 0.0);
    }
    // add_rows: one addition per element, exact.
    for (rows, n) in [(1usize, 576usize), (7, 192), (3, 100)] {
        let (y0, bias) = (rng.vec(rows * n), rng.vec(n));
        let out = pair.each_ref().map(|ops| {
            let (y, b) = (upload(ops, &y0), upload(ops, &bias));
            run(ops, |o, e| o.add_rows(e, &y, &b, rows, n));
            y.download::<f32>().unwrap()
        });
        assert_close(&format!("add_rows {rows}x{n}"), &out[1], &out[0], 0.0, 0.0);
    }
}

/// `rope` in both layouts, with and without frequency factors, at angles
/// small and large. The angles follow the CPU's f32 recurrence bit for bit;
/// the sine and cosine are within a few ulp of the CPU's, and a driver may
/// fuse the rotation's multiply-adds (NVIDIA's does, lavapipe's does not),
/// so with |x| < 1 every output is within 2e-6 (16 ulp of the largest
/// outputs). With factors, each angle is also divided, which Vulkan allows
/// to be 2.5 ulp off (NVIDIA's is; lavapipe's division is exact): the angle
/// (at most the position) may then be off by 2.5 of its ulp, and each
/// output by that times |x0| + |x1|.
#[test]
fn rope_matches_cpu_in_both_layouts() {
    let mut rng = Rng::new();
    let pair = both();
    for neox in [false, true] {
        for (rows, heads, head_dim, rope_dim, base, pos) in [
            (1usize, 9usize, 64usize, 64usize, 100_000f32, 0u32),
            (1, 3, 64, 64, 10_000.0, 77),
            (5, 4, 64, 32, 10_000.0, 300),
            (3, 2, 128, 128, 1_000_000.0, 1000),
            (300, 1, 64, 64, 100_000.0, 6000),
        ] {
            let x0 = rng.vec(rows * heads * head_dim);
            // Frequency factors as Llama 3's scaling makes them, 1 to 8.
            let f0: Vec<f32> = (0..rope_dim / 2).map(|_| 4.5 + 3.5 * rng.f32()).collect();
            for scaled in [false, true] {
                let out = pair.each_ref().map(|ops| {
                    let (x, p, f) = (upload(ops, &x0), upload(ops, &[pos]), upload(ops, &f0));
                    let f = scaled.then_some(&f);
                    run(ops, |o, e| {
                        o.rope(
                            e,
                            &x,
                            Positions::Contiguous(&p),
                            rows,
                            heads,
                            head_dim,
                            rope_dim,
                            base,
                            neox,
                            f,
                            "rope",
                        )
                    });
                    x.download::<f32>().unwrap()
                });
                let what = format!(
                    "rope neox={neox} scaled={scaled} rows={rows} heads={heads} dims={head_dim}/{rope_dim} pos={pos}"
                );
                let ulp = |v: f32| f32::from_bits(v.to_bits() + 1) - v;
                let division = if scaled {
                    2.5 * ulp(pos.max(1) as f32) * 2.0
                } else {
                    0.0
                };
                assert_close(&what, &out[1], &out[0], 0.0, 2e-6 + division);
            }
        }
    }
}

/// One f16 step at `v`: the rounding `kv_store` applies there.
fn f16_step(v: f32) -> f32 {
    let h = f16::from_f32(v);
    (f16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()).abs()
}

/// `rope_store` (the fusion of `rope` and `kv_store`), dispatched directly:
/// the stored rows within one f16 step of the CPU's (the rotation agrees to
/// a few ulp, which can tip a rounding), every other half of the cache and
/// the input untouched.
#[test]
fn rope_store_matches_cpu() {
    let mut rng = Rng::new();
    let pair = both();
    for neox in [false, true] {
        for (rows, heads, head_dim, rope_dim, pos, max_seq) in [
            (1usize, 3usize, 64usize, 64usize, 37u32, 64usize),
            (4, 2, 64, 32, 5, 16),
            (3, 1, 256, 256, 1000, 1003),
            // An odd row length: rows start inside words.
            (3, 1, 10, 6, 3, 8),
        ] {
            let dim = heads * head_dim;
            let x0 = rng.vec(rows * dim);
            let cache0: Vec<f16> = (0..max_seq * dim)
                .map(|_| f16::from_f32(rng.f32()))
                .collect();
            let shape = RopeStoreShape {
                rope: RopeShape {
                    rows: rows as u32,
                    heads: heads as u32,
                    head_dim: head_dim as u32,
                    rope_dim: rope_dim as u32,
                    base: 10_000.0,
                    neox: neox as u32,
                    theta_scale: theta_scale(10_000.0, rope_dim),
                    factors: 0,
                },
                max_seq: max_seq as u32,
            };
            let out = pair.each_ref().map(|ops| {
                let def = KernelSet::Default.defs().rope_store;
                let kernel = ops.device().load_kernel(&def).unwrap();
                let args = RopeStoreArgs {
                    x: upload(ops, &x0),
                    pos: upload(ops, &[pos]),
                    cache: upload(ops, &cache0),
                    shape,
                };
                run(ops, |_, e| e.dispatch(&kernel, &args.args(), "rope_store"));
                let cache: Vec<f32> = args
                    .cache
                    .download::<f16>()
                    .unwrap()
                    .iter()
                    .map(|h| h.to_f32())
                    .collect();
                (cache, args.x.download::<f32>().unwrap())
            });
            let what = format!("rope_store neox={neox} rows={rows} heads={heads} dims={head_dim}/{rope_dim} pos={pos}");
            assert_eq!(out[1].1, x0, "{what}: x changed");
            let stored = pos as usize * dim..(pos as usize + rows) * dim;
            for (i, (g, c)) in out[1].0.iter().zip(&out[0].0).enumerate() {
                let tol = if stored.contains(&i) {
                    f16_step(*c)
                } else {
                    0.0
                };
                assert!(
                    (g - c).abs() <= tol,
                    "{what}: half {i}: wgpu {g} vs CPU {c}"
                );
            }
        }
    }
}

/// `kv_store`: f32 to f16 rounds to nearest even on both sides, bit for
/// bit, through overflow to infinity and subnormals; the rest of the cache
/// is untouched, also where the rows start or end inside a word.
#[test]
fn kv_store_matches_cpu_bit_for_bit() {
    let mut rng = Rng::new();
    let pair = both();
    for (kv_dim, max_seq, cases) in [
        (192usize, 40usize, &[(1usize, 0u32), (1, 39), (7, 12)][..]),
        (5, 20, &[(1, 0), (1, 3), (4, 7), (3, 17)][..]),
    ] {
        let cache0: Vec<u16> = (0..kv_dim * max_seq)
            .map(|_| f16::from_f32(rng.f32()).to_bits())
            .collect();
        for &(rows, pos) in cases {
            // Values past f16's range, and some in its subnormal range.
            let src: Vec<f32> = (0..rows * kv_dim)
                .map(|i| match i % 4 {
                    0 => rng.f32() * 70_000.0,
                    1 => rng.f32() * 1e-4,
                    _ => rng.f32(),
                })
                .collect();
            let out = pair.each_ref().map(|ops| {
                let (s, c, p) = (upload(ops, &src), upload(ops, &cache0), upload(ops, &[pos]));
                run(ops, |o, e| {
                    o.kv_store(e, &s, &c, Positions::Contiguous(&p), rows, kv_dim, "kv")
                });
                c.download::<u16>().unwrap()
            });
            let differ = out[0].iter().zip(&out[1]).filter(|(a, b)| a != b).count();
            assert_eq!(
                differ, 0,
                "kv_store kv_dim={kv_dim} rows={rows} pos={pos}: {differ} halves differ"
            );
        }
    }
}

/// `rope` of rows each at its own position (`Positions::Rows`, the
/// `rope_rows` kernel): the rotation of consecutive rows at those positions,
/// to the same tolerance.
#[test]
fn rope_of_rows_at_their_own_positions_matches_cpu() {
    let mut rng = Rng::new();
    let pair = both();
    let (heads, head_dim, base) = (3usize, 64usize, 100_000f32);
    let positions = [5u32, 0, 4095, 77, 77, 1000];
    let rows = positions.len();
    let x0 = rng.vec(rows * heads * head_dim);
    for neox in [false, true] {
        let out = pair.each_ref().map(|ops| {
            let (x, p) = (upload(ops, &x0), upload(ops, &positions));
            run(ops, |o, e| {
                let at = Positions::Rows(&p);
                o.rope(
                    e, &x, at, rows, heads, head_dim, head_dim, base, neox, None, "rope",
                )
            });
            x.download::<f32>().unwrap()
        });
        assert_close(
            &format!("rope_rows neox={neox}"),
            &out[1],
            &out[0],
            0.0,
            2e-6,
        );
    }
}

/// `kv_store` of rows each at its own slot of a pool (`Positions::Rows`,
/// the `kv_store_paged` kernel): the CPU's halves bit for bit, the other
/// slots untouched.
#[test]
fn kv_store_at_slots_matches_cpu_bit_for_bit() {
    let mut rng = Rng::new();
    let pair = both();
    let (kv_dim, pool) = (6usize, 24usize);
    let cache0: Vec<u16> = (0..kv_dim * pool)
        .map(|_| f16::from_f32(rng.f32()).to_bits())
        .collect();
    let slots = [3u32, 23, 0, 9, 10];
    let rows = slots.len();
    let src: Vec<f32> = (0..rows * kv_dim).map(|_| rng.f32() * 100.0).collect();
    let out = pair.each_ref().map(|ops| {
        let (s, c, p) = (upload(ops, &src), upload(ops, &cache0), upload(ops, &slots));
        run(ops, |o, e| {
            o.kv_store(e, &s, &c, Positions::Rows(&p), rows, kv_dim, "kv")
        });
        c.download::<u16>().unwrap()
    });
    let differ = out[0].iter().zip(&out[1]).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "kv_store_paged: {differ} halves differ");
    assert_ne!(out[0], cache0, "the rows were stored");
}

/// `argmax` over vocabularies up to Qwen's, with ties (the first wins),
/// NaNs (never win, except first), signed zeros and infinities; the output
/// buffer's scratch words must be zero again after every dispatch, so one
/// buffer per device serves every case and all four words are compared.
#[test]
fn argmax_matches_cpu_including_ties() {
    let mut rng = Rng::new();
    let pair = both();
    let outs = [0, 1].map(|i| pair[i].argmax_buffer().unwrap());
    for n in [1usize, 5, 1000, 4099, 49_152, 151_936] {
        for case in 0..4 {
            let mut x = rng.vec(n);
            if n > 10 {
                // Two equal maxima: the first wins.
                let (a, b) = (rng.below(n / 2), n / 2 + rng.below(n / 2));
                let top = if case == 3 { f32::INFINITY } else { 2.0 };
                x[a] = top;
                x[b] = top;
                match case {
                    // NaNs, one above where the maxima sit: a NaN never wins.
                    1 => {
                        for _ in 0..8 {
                            x[rng.below(n)] = f32::NAN;
                        }
                        x[(a + 1) % n] = f32::NAN;
                    }
                    // All values non-positive, the largest a -0.0 before a 0.0.
                    2 => {
                        for v in x.iter_mut() {
                            *v = -v.abs();
                        }
                        x[a] = -0.0;
                        x[b] = 0.0;
                    }
                    _ => {}
                }
            }
            if case == 1 && n > 1 {
                // A NaN first makes the answer 0, as the CPU's comparison gives.
                x[0] = f32::NAN;
            }
            let got = [0, 1].map(|i| {
                let xb = upload(&pair[i], &x);
                run(&pair[i], |o, e| o.argmax(e, &xb, &outs[i], n));
                outs[i].download::<u32>().unwrap()
            });
            assert_eq!(got[1], got[0], "argmax of {n}, case {case}");
            assert_eq!(&got[0][1..], &[0, 0, 0], "scratch left zero");
        }
    }
}

/// `advance`: the token and the history take the argmax, the position moves
/// on; at or past the history's capacity nothing is appended.
#[test]
fn advance_matches_cpu() {
    let mut rng = Rng::new();
    let pair = both();
    for pos in [0u32, 3, 7, 8, 20] {
        let next = rng.below(49_152) as u32;
        let history0: Vec<u32> = (0..8).map(|_| rng.below(1000) as u32).collect();
        let out = pair.each_ref().map(|ops| {
            let (n, t, p, h) = (
                upload(ops, &[next]),
                upload(ops, &[0u32]),
                upload(ops, &[pos]),
                upload(ops, &history0),
            );
            run(ops, |o, e| o.advance(e, &n, &t, &p, &h));
            [&t, &p, &h].map(|b| b.download::<u32>().unwrap())
        });
        assert_eq!(out[1], out[0], "advance at {pos}");
    }
}
