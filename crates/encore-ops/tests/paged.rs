//! The paged ops on the CPU against the contiguous ones: a row of a batch
//! over a paged cache gets, bit for bit, what a decode step of its own
//! sequence over a contiguous cache gets; and the row-invariant product
//! gives each row what a one-row product gives it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::Device;
use encore_ops::kernels::attention::AttnShape;
use encore_ops::{AttnRows, DType, KernelSet, Ops, Positions, Weight};

mod common;
use common::{random_weights, upload, PagedCase, Rng};

fn cpu() -> Ops {
    Ops::new(&Device::cpu().unwrap(), KernelSet::Default).unwrap()
}

/// The contiguous attention of one row of `case`: its sequence's cache
/// stored from position 0, the row's query at its position.
fn contiguous_row(ops: &Ops, case: &PagedCase, r: usize) -> Vec<f32> {
    let (s, pos) = case.rows[r];
    let (len, _) = case.seqs[s];
    let kv_dim = case.kv_dim();
    let (k, v) = (
        ops.device().alloc(len * kv_dim * 2).unwrap(),
        ops.device().alloc(len * kv_dim * 2).unwrap(),
    );
    let at0 = upload(ops, &[0u32]);
    let at = upload(ops, &[pos as u32]);
    let (ks, vs) = &case.kv[s];
    let (kb, vb) = (upload(ops, ks), upload(ops, vs));
    let n = case.heads * case.head_dim;
    let q = upload(ops, &case.q[r * n..(r + 1) * n]);
    let out = ops.device().alloc(n * 4).unwrap();
    let mut enc = ops.device().encoder();
    ops.kv_store(
        &mut enc,
        &kb,
        &k,
        Positions::Contiguous(&at0),
        len,
        kv_dim,
        "k",
    )
    .unwrap();
    ops.kv_store(
        &mut enc,
        &vb,
        &v,
        Positions::Contiguous(&at0),
        len,
        kv_dim,
        "v",
    )
    .unwrap();
    let shape = AttnShape {
        rows: 1,
        heads: case.heads as u32,
        kv_heads: case.kv_heads as u32,
        head_dim: case.head_dim as u32,
        max_seq: len as u32,
        scale: 1.0 / (case.head_dim as f32).sqrt(),
        window: case.window as u32,
    };
    ops.attention(
        &mut enc,
        &q,
        &k,
        &v,
        AttnRows::Contiguous { pos: &at, shape },
        &out,
    )
    .unwrap();
    enc.commit_and_wait().unwrap();
    out.download().unwrap()
}

#[test]
fn paged_attention_gives_each_row_its_contiguous_decode_bit_for_bit() {
    let ops = cpu();
    let mut rng = Rng::new();
    for window in [0, 20] {
        // Lengths across block boundaries; the first sequence also has
        // rows before its last position, as a prefill chunk does.
        let case = PagedCase::random(&mut rng, &[37, 1, 16, 70], 5, window);
        let paged = case.run(&ops);
        let n = case.heads * case.head_dim;
        for r in 0..case.rows.len() {
            let want = contiguous_row(&ops, &case, r);
            assert_eq!(
                &paged[r * n..(r + 1) * n],
                &want[..],
                "row {r}, window {window}"
            );
        }
    }
}

#[test]
fn rope_rows_rotates_each_row_at_its_own_position() {
    let ops = cpu();
    let mut rng = Rng::new();
    let (heads, hd) = (3, 64);
    let positions = [5u32, 0, 1234, 77];
    let x = rng.vec(positions.len() * heads * hd);
    let xb = upload(&ops, &x);
    let pb = upload(&ops, &positions);
    let mut enc = ops.device().encoder();
    ops.rope(
        &mut enc,
        &xb,
        Positions::Rows(&pb),
        positions.len(),
        heads,
        hd,
        hd,
        10000.0,
        false,
        None,
        "r",
    )
    .unwrap();
    enc.commit_and_wait().unwrap();
    let got: Vec<f32> = xb.download().unwrap();
    for (r, &p) in positions.iter().enumerate() {
        let n = heads * hd;
        let one = upload(&ops, &x[r * n..(r + 1) * n]);
        let at = upload(&ops, &[p]);
        let mut enc = ops.device().encoder();
        ops.rope(
            &mut enc,
            &one,
            Positions::Contiguous(&at),
            1,
            heads,
            hd,
            hd,
            10000.0,
            false,
            None,
            "r",
        )
        .unwrap();
        enc.commit_and_wait().unwrap();
        assert_eq!(
            &got[r * n..(r + 1) * n],
            &one.download::<f32>().unwrap()[..],
            "row {r}"
        );
        // Position 0 is the identity; every other row moved.
        if p > 0 {
            assert_ne!(
                &got[r * n..(r + 1) * n],
                &x[r * n..(r + 1) * n],
                "row {r} rotated"
            );
        }
    }
}

#[test]
fn matmul_rows_gives_each_row_its_one_row_product() {
    let ops = cpu();
    let mut rng = Rng::new();
    for dtype in [DType::Q4_1, DType::Q8_0, DType::F32] {
        let (n, k, rows) = (48, 256, 9);
        let w = Weight {
            buffer: upload(&ops, &random_weights(&mut rng, dtype, n, k)),
            dtype,
            n,
            k,
        };
        let x = rng.vec(rows * k);
        let y = ops.device().alloc(rows * n * 4).unwrap();
        let mut enc = ops.device().encoder();
        ops.matmul_rows(&mut enc, &w, &upload(&ops, &x), &y, rows, false, "m")
            .unwrap();
        enc.commit_and_wait().unwrap();
        let all: Vec<f32> = y.download().unwrap();
        for r in 0..rows {
            let one = ops.device().alloc(n * 4).unwrap();
            let mut enc = ops.device().encoder();
            ops.matmul_rows(
                &mut enc,
                &w,
                &upload(&ops, &x[r * k..(r + 1) * k]),
                &one,
                1,
                false,
                "m",
            )
            .unwrap();
            enc.commit_and_wait().unwrap();
            assert_eq!(
                &all[r * n..(r + 1) * n],
                &one.download::<f32>().unwrap()[..],
                "{dtype} row {r}"
            );
        }
    }
}

#[test]
fn argmax_rows_gives_each_rows_first_largest_and_flags_non_finite_rows() {
    let ops = cpu();
    let mut rng = Rng::new();
    let (rows, n) = (7, 1000);
    let mut x = rng.vec(rows * n);
    // Row 1: two equal maxima (the first wins); row 2: a NaN and an
    // infinity at its top; row 3: all NaN; row 4: a NaN first.
    x[n + 10] = 5.0;
    x[n + 900] = 5.0;
    x[2 * n + 3] = f32::NAN;
    x[2 * n + 4] = f32::INFINITY;
    x[3 * n..4 * n].fill(f32::NAN);
    x[4 * n] = f32::NAN;
    let out = ops.argmax_rows_buffer(rows).unwrap();
    let mut enc = ops.device().encoder();
    ops.argmax_rows(&mut enc, &upload(&ops, &x), &out, rows, n)
        .unwrap();
    enc.commit_and_wait().unwrap();
    let got: Vec<u32> = out.download().unwrap();
    for r in 0..rows {
        let row = &x[r * n..(r + 1) * n];
        // The reference: the first index of the largest value, by a plain
        // scan; a row whose winner is not finite, or that starts with a
        // NaN, is flagged.
        let mut best = 0;
        for (i, v) in row.iter().enumerate() {
            if *v > row[best] {
                best = i;
            }
        }
        let want = if row[best].is_finite() {
            best as u32
        } else {
            u32::MAX
        };
        assert_eq!(got[4 * r], want, "row {r}");
        assert_eq!(&got[4 * r + 1..4 * r + 4], &[0, 0, 0], "row {r} scratch");
    }
    assert_eq!(got[4], 10, "the first of two maxima");
    assert_eq!(got[8], u32::MAX, "an infinite maximum is flagged");
}

#[test]
fn a_paged_decode_step_fuses_into_one_dispatch_with_the_unfused_results_bit_for_bit() {
    // RoPE of the queries and new K rows, the K and V stores and the
    // attention of decode rows become one `attention_step_paged`, whose CPU
    // body runs the unfused code: the same output and pools, bit for bit.
    let ops = cpu();
    let mut rng = Rng::new();
    for (window, rope_dim) in [(0, 64), (20, 32)] {
        let case = PagedCase::random(&mut rng, &[37, 1, 16, 70, 300], 0, window);
        let fused = case.decode_step(&ops, rope_dim, true);
        let plain = case.decode_step(&ops, rope_dim, false);
        assert_eq!(plain.3, 5, "unfused nodes");
        assert_eq!(
            fused.3, 1,
            "window {window}: the step did not fuse into one dispatch"
        );
        assert_eq!(fused.0, plain.0, "window {window}: attention output");
        assert_eq!(fused.1, plain.1, "window {window}: K pool");
        assert_eq!(fused.2, plain.2, "window {window}: V pool");
    }
}

#[test]
fn paged_stores_fold_into_the_attention_only_for_decode_rows() {
    // Without the decode promise (rows of one sequence may read what
    // another row stores in the same dispatch) nothing folds.
    let ops = cpu();
    let mut rng = Rng::new();
    let case = PagedCase::random(&mut rng, &[5, 40], 0, 0);
    let (q, k, v) = (
        upload(&ops, &case.q),
        ops.device()
            .alloc(case.blocks * 16 * case.kv_dim() * 2)
            .unwrap(),
        ops.device()
            .alloc(case.blocks * 16 * case.kv_dim() * 2)
            .unwrap(),
    );
    let rows = case.rows.len();
    let positions = upload(
        &ops,
        &case.rows.iter().map(|r| r.1 as u32).collect::<Vec<_>>(),
    );
    let tables = upload(&ops, &vec![0u32; rows * case.max_blocks]);
    let new = upload(&ops, &rng.vec(rows * case.kv_dim()));
    let out = ops.device().alloc(case.q.len() * 4).unwrap();
    let mut e = ops.device().capture();
    ops.kv_store(
        &mut e,
        &new,
        &k,
        Positions::Rows(&positions),
        rows,
        case.kv_dim(),
        "k",
    )
    .unwrap();
    ops.attention(
        &mut e,
        &q,
        &k,
        &v,
        AttnRows::Paged {
            positions: &positions,
            tables: &tables,
            shape: case.shape(),
        },
        &out,
    )
    .unwrap();
    let mut graph = e.finish_graph().unwrap();
    graph.mark_output(&out);
    let exec = graph.instantiate(&ops.all_row_fusion_patterns()).unwrap();
    assert_eq!(exec.nodes().len(), 2);
}
