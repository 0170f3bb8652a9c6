//! `attention_step`: decode attention with RoPE of the query, RoPE and
//! store of the new K row and the store of the new V row folded in,
//! dispatched directly with every combination of parts the fusion rules
//! build.

use encore::Encoder;
use encore_ops::kernels::attention::AttnShape;
use encore_ops::kernels::attention_step::{
    AttnStepArgs, AttnStepShape, STEP_K_NEW, STEP_ROPE_K, STEP_ROPE_Q, STEP_V_NEW,
};
use encore_ops::kernels::rope::{theta_scale, RopeShape};
use encore_ops::{KernelSet, Ops};
use half::f16;

use super::common::{upload, Rng};
use super::{assert_close, both, run, run_graph};

/// Every combination of parts the rules fold in: the query's rotation or
/// not, the K row stored rotated (`rope_store`), stored as it is
/// (`kv_store`) or not at all, the V row stored or not.
fn flag_sets() -> Vec<u32> {
    let mut sets = Vec::new();
    for q in [0, STEP_ROPE_Q] {
        for k in [0, STEP_K_NEW, STEP_K_NEW | STEP_ROPE_K] {
            for v in [0, STEP_V_NEW] {
                if q | k | v != 0 {
                    sets.push(q | k | v);
                }
            }
        }
    }
    sets
}

/// One f16 step at `v`.
fn f16_step(v: f16) -> f32 {
    (f16::from_bits(v.to_bits() + 1).to_f32() - v.to_f32()).abs()
}

/// Runs `attention_step` on the CPU and on wgpu over random queries, new
/// rows and caches (`|x| < 1`, the cache at `pos` holding an older row
/// that the stores must replace) and compares.
///
/// The caches: the V row and an unrotated K row are rounded to f16 as
/// `kv_store` rounds, bit for bit; a rotated K row is within one f16 step
/// of the CPU's (the rotation agrees to a few ulp, which can tip a
/// rounding, as `rope_store`'s test says); every other half untouched.
///
/// `out`: within 2e-3 of the CPU's. The CPU keeps its weighted sum of V in
/// f16, rounded at every position (llama.cpp's one-row recurrence), where
/// wgpu keeps f32: that recurrence, emulated on inputs like these, is off
/// the exact result by up to 4.5e-4 in a typical dispatch and 8e-4 in the
/// worst of 60, and a dispatch here was seen 1.25e-3 off (lavapipe's
/// exponential adds its own rounding), so 1e-3 failed now and then. A
/// rotation that tips the f16 rounding of a query or new K element moves
/// a score by at most one f16 step of that element times `|x| * scale`, and
/// the output by at most twice that; 5e-4 more covers one tipped element
/// of either row, which the few ulp the rotations differ by make rare.
fn check(pair: &[Ops; 2], rng: &mut Rng, attn: AttnShape, rope: RopeShape, flags: u32, pos: u32) {
    let (heads, kv_heads, hd) = (
        attn.heads as usize,
        attn.kv_heads as usize,
        attn.head_dim as usize,
    );
    let kv_dim = kv_heads * hd;
    let shape = AttnStepShape { attn, rope, flags };
    let q = rng.vec(heads * hd);
    let (k_new, v_new) = (rng.vec(kv_dim), rng.vec(kv_dim));
    let cache = |rng: &mut Rng| -> Vec<f16> {
        (0..attn.max_seq as usize * kv_dim)
            .map(|_| f16::from_f32(rng.f32()))
            .collect()
    };
    let (k0, v0) = (cache(rng), cache(rng));
    // On `ops`, eagerly or with `graph` as a graph (its kernel then the
    // variant specialized for the shape).
    let run_on = |ops: &Ops, graph: bool| {
        let def = KernelSet::Default.defs().attention_step.unwrap();
        let kernel = ops.device().load_kernel(&def).unwrap();
        let qb = upload(ops, &q);
        let args = AttnStepArgs {
            k_new: if flags & STEP_K_NEW != 0 {
                upload(ops, &k_new)
            } else {
                qb.view(0, 0).unwrap()
            },
            v_new: if flags & STEP_V_NEW != 0 {
                upload(ops, &v_new)
            } else {
                qb.view(0, 0).unwrap()
            },
            q: qb,
            k: upload(ops, &k0),
            v: upload(ops, &v0),
            pos: upload(ops, &[pos]),
            out: ops.device().alloc(q.len() * 4).unwrap(),
            shape,
        };
        let dispatch =
            |_: &Ops, e: &mut Encoder| e.dispatch(&kernel, &args.args(), "attention_step");
        if graph {
            let specialized = run_graph(ops, &[&args.out, &args.k, &args.v], dispatch);
            assert_eq!(
                specialized, 1,
                "the graph's attention_step is not specialized"
            );
        } else {
            run(ops, dispatch);
        }
        (
            args.out.download::<f32>().unwrap(),
            args.k.download::<f16>().unwrap(),
            args.v.download::<f16>().unwrap(),
        )
    };
    let (out_cpu, k_cpu, v_cpu) = run_on(&pair[0], false);
    for graph in [false, true] {
        let what = format!(
            "attention_step flags={flags:#x} heads={heads}/{kv_heads} head_dim={hd} rope_dim={} \
             neox={} pos={pos} max_seq={} window={}{}",
            rope.rope_dim,
            rope.neox,
            attn.max_seq,
            attn.window,
            if graph { ", specialized" } else { "" }
        );
        let (out_gpu, k_gpu, v_gpu) = run_on(&pair[1], graph);
        check_against_cpu(
            &what,
            (&out_gpu, &k_gpu, &v_gpu),
            (&out_cpu, &k_cpu, &v_cpu),
            (&k0, &v0),
            flags,
            pos,
            kv_dim,
        );
    }
}

/// The wgpu results of one `attention_step` (`out`, the K and V caches)
/// against the CPU's, the caches having started as `k0` and `v0`, as
/// [`check`] says.
fn check_against_cpu(
    what: &str,
    (out_gpu, k_gpu, v_gpu): (&[f32], &[f16], &[f16]),
    (out_cpu, k_cpu, v_cpu): (&[f32], &[f16], &[f16]),
    (k0, v0): (&[f16], &[f16]),
    flags: u32,
    pos: u32,
    kv_dim: usize,
) {
    let row = pos as usize * kv_dim..(pos as usize + 1) * kv_dim;
    let rotated_k = flags & STEP_ROPE_K != 0;
    for (i, (g, c)) in k_gpu.iter().zip(k_cpu).enumerate() {
        let same = if rotated_k && row.contains(&i) {
            (g.to_f32() - c.to_f32()).abs() <= f16_step(*c)
        } else {
            g.to_bits() == c.to_bits()
        };
        assert!(same, "{what}: K half {i}: wgpu {g} vs CPU {c}");
    }
    for (i, (g, c)) in v_gpu.iter().zip(v_cpu).enumerate() {
        assert_eq!(
            g.to_bits(),
            c.to_bits(),
            "{what}: V half {i}: wgpu {g} vs CPU {c}"
        );
    }
    if flags & STEP_K_NEW != 0 {
        assert_ne!(
            k_cpu[row.clone()],
            k0[row.clone()],
            "{what}: K row not stored"
        );
    }
    if flags & STEP_V_NEW != 0 {
        assert_ne!(
            v_cpu[row.clone()],
            v0[row.clone()],
            "{what}: V row not stored"
        );
    }
    let rotates = flags & (STEP_ROPE_Q | STEP_ROPE_K) != 0;
    let tol = if rotates { 2.5e-3 } else { 2e-3 };
    assert_close(what, out_gpu, out_cpu, 0.0, tol);
}

fn attn(heads: usize, kv_heads: usize, head_dim: usize, max_seq: usize, window: u32) -> AttnShape {
    AttnShape {
        rows: 1,
        heads: heads as u32,
        kv_heads: kv_heads as u32,
        head_dim: head_dim as u32,
        max_seq: max_seq as u32,
        scale: 1.0 / (head_dim as f32).sqrt(),
        window,
    }
}

fn rope(head_dim: usize, rope_dim: usize, base: f32, neox: bool) -> RopeShape {
    RopeShape {
        rows: 1,
        heads: 0,
        head_dim: head_dim as u32,
        rope_dim: rope_dim as u32,
        base,
        neox: neox as u32,
        theta_scale: theta_scale(base, rope_dim),
        factors: 0,
    }
}

/// The default model's 9 query heads over 3 KV heads of 64, Gemma 3's
/// head of 256 (with a sliding window on one of them, as its local layers
/// have), and a head rotated only in part; at the first position, within
/// the first chunk of positions, at the chunk's last position and the next
/// chunk's first, and at the cache's last position; both RoPE layouts.
#[test]
fn attention_step_matches_cpu_for_every_folded_part() {
    let mut rng = Rng::new();
    let pair = both();
    let cases = [
        // heads, kv_heads, head_dim, rope_dim, base, max_seq, window, positions
        (
            9usize,
            3usize,
            64usize,
            64usize,
            10_000f32,
            300usize,
            0u32,
            &[0u32, 37, 255, 256, 299][..],
        ),
        (4, 1, 256, 256, 1_000_000.0, 270, 0, &[0, 100, 269][..]),
        (4, 1, 256, 256, 10_000.0, 300, 33, &[5, 290][..]),
        (8, 2, 128, 64, 500_000.0, 64, 0, &[0, 13][..]),
    ];
    for (heads, kv_heads, hd, rd, base, max_seq, window, positions) in cases {
        for &pos in positions {
            for neox in [false, true] {
                for flags in flag_sets() {
                    check(
                        &pair,
                        &mut rng,
                        attn(heads, kv_heads, hd, max_seq, window),
                        rope(hd, rd, base, neox),
                        flags,
                        pos,
                    );
                }
            }
        }
    }
}
