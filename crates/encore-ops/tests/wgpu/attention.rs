//! Attention: decode and prefill, grouped-query, windowed.

use encore_ops::kernels::attention::AttnShape;
use encore_ops::{AttnRows, Ops};
use half::f16;

use super::common::{upload, Rng};
use super::{assert_close, both, run};

/// Runs `attention` on the CPU and on wgpu over random queries and caches
/// (`|q|, |k|, |v| < 1`) and compares. Below 64 rows the CPU keeps its
/// weighted sum of V in f16 (llama.cpp's recurrence, rounded at every
/// position, 2^-11 relative) where wgpu keeps f32: every output within 2e-3
/// of the CPU's, as `attention_step`'s test says why (that recurrence is off
/// the exact result by up to 8e-4 in the worst of 60 dispatches, lavapipe's
/// exponential adds its own rounding, and 1e-3 failed now and then: 1.08e-3
/// once here). From 64 rows on the CPU stays in f32 (llama.cpp's tiled
/// path) and only the order of the sums differs: within 1e-4.
fn check(pair: &[Ops; 2], rng: &mut Rng, shape: AttnShape, pos: u32) {
    let (rows, heads, hd) = (
        shape.rows as usize,
        shape.heads as usize,
        shape.head_dim as usize,
    );
    let kv_dim = shape.kv_heads as usize * hd;
    let q = rng.vec(rows * heads * hd);
    let cache = |rng: &mut Rng| -> Vec<u16> {
        (0..shape.max_seq as usize * kv_dim)
            .map(|_| f16::from_f32(rng.f32()).to_bits())
            .collect()
    };
    let (k, v) = (cache(rng), cache(rng));
    let out = pair.each_ref().map(|ops| {
        let (qb, kb, vb, p) = (
            upload(ops, &q),
            upload(ops, &k),
            upload(ops, &v),
            upload(ops, &[pos]),
        );
        let out = ops.device().alloc(q.len() * 4).unwrap();
        run(ops, |o, e| {
            o.attention(
                e,
                &qb,
                &kb,
                &vb,
                AttnRows::Contiguous { pos: &p, shape },
                &out,
            )
        });
        out.download::<f32>().unwrap()
    });
    let what = format!(
        "attention rows={rows} heads={heads}/{} head_dim={hd} pos={pos} max_seq={} window={}",
        shape.kv_heads, shape.max_seq, shape.window
    );
    let tol = if rows >= 64 { 1e-4 } else { 2e-3 };
    assert_close(&what, &out[1], &out[0], 0.0, tol);
}

fn shape(rows: usize, heads: usize, kv_heads: usize, head_dim: usize, max_seq: usize) -> AttnShape {
    AttnShape {
        rows: rows as u32,
        heads: heads as u32,
        kv_heads: kv_heads as u32,
        head_dim: head_dim as u32,
        max_seq: max_seq as u32,
        scale: 1.0 / (head_dim as f32).sqrt(),
        window: 0,
    }
}

/// [`check`] of each case `(rows, heads, kv_heads, head_dim, max_seq, pos)`
/// without a window.
fn check_cases(cases: &[(usize, usize, usize, usize, usize, u32)]) {
    let mut rng = Rng::new();
    let pair = both();
    for &(rows, heads, kv_heads, head_dim, max_seq, pos) in cases {
        check(
            &pair,
            &mut rng,
            shape(rows, heads, kv_heads, head_dim, max_seq),
            pos,
        );
    }
}

/// Decode (one row) and prefill (several rows) without a window: the
/// default model's 9 query heads over 3 KV heads of 64, Gemma 3's head of
/// 256, one KV head per query head, a head size that is not a multiple of
/// anything, and contexts shorter and longer than a chunk of positions.
#[test]
fn attention_matches_cpu_for_decode_and_prefill() {
    check_cases(&[
        (1, 9, 3, 64, 256, 0),
        (1, 9, 3, 64, 256, 37),
        (1, 9, 3, 64, 600, 599),
        (1, 4, 1, 256, 300, 280),
        (6, 9, 3, 64, 256, 0),
        (5, 4, 2, 64, 256, 100),
        (3, 8, 8, 128, 64, 20),
        (2, 4, 1, 256, 32, 7),
        (2, 4, 2, 10, 32, 5),
        (70, 9, 3, 64, 400, 300),
    ]);
}

/// Prefill batches that take the tiled kernel (`attention_prefill`: from
/// 16 rows, heads of 16, 32 and 64): a whole tile of rows, rows that end
/// inside a tile, many tiles over a longer history than the batch, and one
/// KV head per query head; beside them a head of 128, which keeps the
/// general kernel.
#[test]
fn tiled_prefill_attention_matches_cpu() {
    check_cases(&[
        (16, 9, 3, 64, 16, 0),
        (33, 4, 2, 32, 100, 5),
        (130, 9, 3, 64, 200, 0),
        (64, 2, 1, 16, 80, 16),
        (100, 8, 8, 64, 700, 555),
        (40, 4, 4, 128, 64, 3),
    ]);
}

/// A sliding window (Gemma 3's local layers) on decode rows and on a
/// prefill batch, with windows of one position, shorter than, across and
/// past the history.
#[test]
fn windowed_attention_matches_cpu() {
    let mut rng = Rng::new();
    let pair = both();
    for (rows, heads, kv_heads, head_dim, pos) in [
        (1usize, 4usize, 1usize, 256usize, 700u32),
        (1, 9, 3, 64, 40),
        (70, 4, 1, 256, 300),
        (20, 8, 2, 64, 30),
    ] {
        for window in [1u32, 33, 512, 5000] {
            let mut s = shape(rows, heads, kv_heads, head_dim, pos as usize + rows + 1);
            s.window = window;
            check(&pair, &mut rng, s, pos);
        }
    }
}
