//! The fusion rules on the CPU: a transformer-block-shaped graph fuses into
//! the expected dispatches, and since each fused CPU body runs the unfused
//! operations' own code, the fused graph's results equal the unfused
//! graph's bit for bit, for every weight type, for one row and several.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{Config, Device};
use encore_ops::{DType, KernelSet, Ops};

mod common;
use common::{block_graph, fused_nodes, Rng};

#[test]
fn fused_block_graph_equals_unfused_bit_for_bit_on_cpu() {
    let ops = Ops::new(
        &Device::open("cpu", &Config::default()).unwrap(),
        KernelSet::Default,
    )
    .unwrap();
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
    let ops = Ops::new(
        &Device::open("cpu", &Config::default()).unwrap(),
        KernelSet::Default,
    )
    .unwrap();
    assert!(ops.fusion_patterns().is_empty());
    assert!(ops.all_fusion_patterns().len() >= 6);
}
