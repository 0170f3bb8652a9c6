//! The fusion rules on the CPU: a transformer-block-shaped graph fuses into
//! the expected dispatches, and since each fused CPU body runs the unfused
//! operations' own code, the fused graph's results equal the unfused
//! graph's bit for bit, for every weight type, for one row and several.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{Buffer, Config, Device};
use encore_ops::{DType, KernelSet, Ops, Weight};

mod common;
use common::{block_graph, fused_nodes, random_weights, replay_once, upload, Rng};

fn cpu_ops() -> Ops {
    Ops::new(
        &Device::open("cpu", &Config::default()).unwrap(),
        KernelSet::Default,
    )
    .unwrap()
}

#[test]
fn fused_block_graph_equals_unfused_bit_for_bit_on_cpu() {
    let ops = cpu_ops();
    let seed = Rng::new().next();
    for dtype in DType::ALL {
        for (rows, bias) in [(1usize, false), (3, false), (1, true), (3, true)] {
            let (fused, stats) = block_graph(&ops, seed, dtype, rows, bias, true);
            let (plain, plain_stats) = block_graph(&ops, seed, dtype, rows, bias, false);
            let biases = if bias { 3 } else { 0 };
            assert_eq!(plain_stats.after.nodes, 17 + biases);
            assert_eq!(plain_stats.fused, 0);
            assert_eq!(
                stats.after.nodes,
                fused_nodes(rows),
                "{dtype} rows={rows} bias={bias}: {stats:?}"
            );
            for (name, (f, p)) in ["residual", "attention", "k cache", "v cache"]
                .iter()
                .zip(fused.iter().zip(&plain))
            {
                let f: Vec<u32> = f.iter().map(|v| v.to_bits()).collect();
                let p: Vec<u32> = p.iter().map(|v| v.to_bits()).collect();
                assert!(
                    f == p,
                    "{dtype} rows={rows} bias={bias}: fused {name} differs"
                );
            }
        }
    }
}

#[test]
fn the_cpu_applies_no_fusion_rules_by_default() {
    let ops = cpu_ops();
    assert!(ops.fusion_patterns().is_empty());
    assert!(ops.all_fusion_patterns().len() >= 6);
}

/// A norm, then gate and up products whose widths together exceed the
/// widest product a norm folds into (Qwen2.5's feed-forward: 2 x 4864), then
/// SwiGLU, on `ops`' device, fused (or not); the output and the dispatches.
fn wide_swiglu(ops: &Ops, seed: u64, fusion: bool) -> (Vec<u32>, usize) {
    let (rows, k, ff) = (1usize, 64usize, 4200usize);
    let mut rng = Rng(seed);
    let mut weight = |n: usize| Weight {
        buffer: upload(ops, &random_weights(&mut rng, DType::Q8_0, n, k)),
        dtype: DType::Q8_0,
        n,
        k,
    };
    let (gate_w, up_w) = (weight(ff), weight(ff));
    let x = upload(ops, &rng.vec(rows * k));
    let g = upload(ops, &rng.vec(k));
    let d = ops.device();
    let f = |n: usize| -> Buffer { d.alloc(n * 4).unwrap() };
    let (xn, gate, up, act) = (f(rows * k), f(rows * ff), f(rows * ff), f(rows * ff));
    let mut e = d.capture();
    ops.rms_norm(&mut e, &x, &g, &xn, rows, k, 1e-6).unwrap();
    ops.matmul(&mut e, &gate_w, &xn, &gate, rows, "gate")
        .unwrap();
    ops.matmul(&mut e, &up_w, &xn, &up, rows, "up").unwrap();
    ops.silu_mul(&mut e, &gate, &up, &act, rows * ff).unwrap();
    let mut graph = e.finish_graph().unwrap();
    graph.mark_output(&act);
    let exec = replay_once(ops, &graph, fusion);
    let out = act.download::<f32>().unwrap();
    (
        out.iter().map(|v| v.to_bits()).collect(),
        exec.stats().after.nodes,
    )
}

#[test]
fn the_norm_folds_into_a_swiglu_product_as_wide_as_its_output() {
    let ops = cpu_ops();
    let seed = Rng::new().next();
    let (fused, nodes) = wide_swiglu(&ops, seed, true);
    let (plain, plain_nodes) = wide_swiglu(&ops, seed, false);
    assert_eq!(plain_nodes, 4);
    assert_eq!(nodes, 1, "norm, gate, up and SwiGLU as one dispatch");
    assert!(fused == plain, "the fused output differs");
}
