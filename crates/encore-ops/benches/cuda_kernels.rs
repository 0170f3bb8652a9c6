//! Device time per node of each kernel of a SmolLM2-135M decode step on
//! CUDA, measured the way decode runs them: a chain of identical dependent
//! dispatches (each writes what the next one writes) replayed as one native
//! graph, timed with device events, median of 20 replays after a warm-up.
//! A one-element `add` chain gives the floor of a dependent graph node.
//!
//! The prefill products (128 and 512 rows, on tensor cores) and prefill
//! attention (512 rows from position 0) are timed the same way, and a
//! 1536 x 1536 product in every weight type CUDA has code for (decode and
//! 128 rows).
//!
//! `cargo bench -p encore-ops --bench cuda_kernels` (prints "no CUDA device"
//! and exits 0 without one). Output: one line per kernel with µs per node
//! and the weight bandwidth it reaches (the arithmetic rate for prefill
//! products).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{Buffer, Config, Device, Encoder};
use encore_ops::kernels::attention::AttnShape;
use encore_ops::{AttnRows, DType, Ops, Positions, Weight};

const CHAIN: usize = 200;
const REPLAYS: usize = 20;

/// Finite quantized weights (every f16 scale below 1.0) of `n` rows of `k`.
fn weight(device: &Device, dtype: DType, n: usize, k: usize) -> Weight {
    let bytes: Vec<u8> = (0..dtype.bytes_for(n * k).unwrap())
        .map(|i| (i * 7 % 59) as u8)
        .collect();
    Weight {
        buffer: device.buffer_from(&bytes).unwrap(),
        dtype,
        n,
        k,
    }
}

fn floats(device: &Device, n: usize) -> Buffer {
    let v: Vec<f32> = (0..n).map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0).collect();
    device.buffer_from(&v).unwrap()
}

/// Records `CHAIN` instances of `one` as a graph with the fusion rules, and
/// returns (µs per node, nodes after fusion).
fn time_chain(ops: &Ops, outputs: &[&Buffer], one: &dyn Fn(&mut Encoder)) -> (f64, usize) {
    let mut enc = ops.device().capture();
    for _ in 0..CHAIN {
        one(&mut enc);
    }
    let mut graph = enc.finish_graph().unwrap();
    for b in outputs {
        graph.mark_output(b);
    }
    let exec = graph.instantiate(&ops.all_fusion_patterns()).unwrap();
    for _ in 0..3 {
        exec.replay(&[]).unwrap().wait().unwrap();
    }
    let mut times: Vec<f64> = (0..REPLAYS)
        .map(|_| {
            let s = exec.replay(&[]).unwrap();
            s.wait().unwrap();
            s.elapsed().unwrap().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let nodes = exec.stats().after.nodes;
    (times[REPLAYS / 2] / nodes as f64 * 1e6, nodes)
}

fn main() {
    let device = match Device::open("cuda", &Config::default()) {
        Ok(d) => d,
        Err(e) => {
            println!("no CUDA device ({e}); nothing to measure");
            return;
        }
    };
    let ops = Ops::new(&device, encore_ops::KernelSet::Default).unwrap();
    let (d, kv, ff, vocab, heads, kv_heads, hd) = (576, 192, 1536, 49152, 9, 3, 64);
    let q41 = DType::Q4_1;
    let (wq, wk, wv, wo) = (
        weight(&device, q41, d, d),
        weight(&device, q41, kv, d),
        weight(&device, q41, kv, d),
        weight(&device, q41, d, d),
    );
    let (wg, wu, wd) = (
        weight(&device, q41, ff, d),
        weight(&device, q41, ff, d),
        weight(&device, q41, d, ff),
    );
    let head = weight(&device, DType::Q8_0, vocab, d);
    let (x, xn, g) = (floats(&device, d), floats(&device, d), floats(&device, d));
    let (q, k, v, attn) = (
        floats(&device, d),
        floats(&device, kv),
        floats(&device, kv),
        floats(&device, d),
    );
    let (gate, up, act) = (
        floats(&device, ff),
        floats(&device, ff),
        floats(&device, ff),
    );
    let logits = floats(&device, vocab);
    let token = device.buffer_from(&[42u32]).unwrap();
    let max_seq = 2048;
    let kc = device.alloc(max_seq * kv * 2).unwrap();
    let vc = device.alloc(max_seq * kv * 2).unwrap();
    let out = ops.argmax_buffer().unwrap();
    let bytes = |w: &[&Weight]| w.iter().map(|w| w.buffer.len()).sum::<usize>();

    println!("kernel                         us/node  nodes  weight GB/s");
    let report = |name: &str, weight_bytes: usize, (us, nodes): (f64, usize)| {
        let gbs = weight_bytes as f64 / (us * 1e-6) / 1e9;
        println!("{name:<30} {us:>8.2} {nodes:>6}  {gbs:>10.0}");
    };
    report(
        "add n=1 (node floor)",
        0,
        time_chain(&ops, &[&x], &|e| ops.add(e, &x, &q, 1).unwrap()),
    );
    for (name, w) in [
        ("matmul q 576x576", &wq),
        ("matmul k 192x576", &wk),
        ("matmul gate 1536x576", &wg),
        ("matmul down 576x1536", &wd),
        ("matmul head 49152x576 q8_0", &head),
    ] {
        let (input, output) = if w.k == ff {
            (&act, &x)
        } else if w.n == vocab {
            (&xn, &logits)
        } else if w.n == ff {
            (&xn, &gate)
        } else {
            (&xn, &q)
        };
        report(
            name,
            bytes(&[w]),
            time_chain(&ops, &[output], &|e| {
                ops.matmul(e, w, input, output, 1, "m").unwrap()
            }),
        );
    }
    for rows in [128usize, 512] {
        let (input, output) = (floats(&device, rows * ff), floats(&device, rows * ff));
        for (name, w) in [
            ("q 576x576", &wq),
            ("k 192x576", &wk),
            ("gate 1536x576", &wg),
            ("down 576x1536", &wd),
        ] {
            let (us, nodes) = time_chain(&ops, &[&output], &|e| {
                ops.matmul(e, w, &input, &output, rows, "gemm").unwrap()
            });
            let tflops = 2.0 * (rows * w.n * w.k) as f64 / (us * 1e-6) / 1e12;
            let name = format!("gemm {name} rows={rows}");
            println!("{name:<30} {us:>8.2} {nodes:>6}  {tflops:>6.1} TFLOP/s");
        }
    }
    // Every weight type CUDA has code for, on a product whose rows hold
    // whole super-blocks (gate-sized, 1536 x 1536): decode and a prefill tile.
    {
        let rows = 128;
        let (input, output) = (floats(&device, rows * ff), floats(&device, rows * ff));
        for dtype in encore_ops::cuda::WEIGHT_TYPES {
            let w = weight(&device, dtype, ff, ff);
            report(
                &format!("matmul {} 1536x1536", dtype.name()),
                bytes(&[&w]),
                time_chain(&ops, &[&output], &|e| {
                    ops.matmul(e, &w, &input, &output, 1, "m").unwrap()
                }),
            );
            let (us, nodes) = time_chain(&ops, &[&output], &|e| {
                ops.matmul(e, &w, &input, &output, rows, "gemm").unwrap()
            });
            let tflops = 2.0 * (rows * w.n * w.k) as f64 / (us * 1e-6) / 1e12;
            let name = format!("gemm {} 1536x1536 rows={rows}", dtype.name());
            println!("{name:<30} {us:>8.2} {nodes:>6}  {tflops:>6.1} TFLOP/s");
        }
    }
    {
        let rows = 512;
        let (q, out) = (floats(&device, rows * d), floats(&device, rows * d));
        let p = device.buffer_from(&[0u32]).unwrap();
        let shape = AttnShape {
            rows: rows as u32,
            heads: heads as u32,
            kv_heads: kv_heads as u32,
            head_dim: hd as u32,
            max_seq: max_seq as u32,
            scale: 0.125,
            window: 0,
        };
        report(
            "attention prefill rows=512",
            0,
            time_chain(&ops, &[&out], &|e| {
                ops.attention(
                    e,
                    &q,
                    &kc,
                    &vc,
                    AttnRows::Contiguous { pos: &p, shape },
                    &out,
                )
                .unwrap()
            }),
        );
    }
    report(
        "fused norm+qkv",
        bytes(&[&wq, &wk, &wv]),
        time_chain(&ops, &[&q, &k, &v], &|e| {
            ops.rms_norm(e, &x, &g, &xn, 1, d, 1e-5).unwrap();
            ops.matmul(e, &wq, &xn, &q, 1, "q").unwrap();
            ops.matmul(e, &wk, &xn, &k, 1, "k").unwrap();
            ops.matmul(e, &wv, &xn, &v, 1, "v").unwrap();
        }),
    );
    report(
        "fused norm+gate/up+swiglu",
        bytes(&[&wg, &wu]),
        time_chain(&ops, &[&act], &|e| {
            ops.rms_norm(e, &x, &g, &xn, 1, d, 1e-5).unwrap();
            ops.matmul(e, &wg, &xn, &gate, 1, "gate").unwrap();
            ops.matmul(e, &wu, &xn, &up, 1, "up").unwrap();
            ops.silu_mul(e, &gate, &up, &act, ff).unwrap();
        }),
    );
    report(
        "fused o+residual",
        bytes(&[&wo]),
        time_chain(&ops, &[&x], &|e| {
            ops.matmul(e, &wo, &attn, &q, 1, "o").unwrap();
            ops.add(e, &x, &q, d).unwrap();
        }),
    );
    report(
        "fused norm+head",
        bytes(&[&head]),
        time_chain(&ops, &[&logits], &|e| {
            ops.rms_norm(e, &x, &g, &xn, 1, d, 1e-5).unwrap();
            ops.matmul(e, &head, &xn, &logits, 1, "head").unwrap();
        }),
    );
    // The same products with distinct weights in every link, as the layers
    // of a model have: 120 MB of gate and up weights and 62 MB of Q, K and V
    // do not stay in L2 between replays, so these read from device memory.
    let sets = |n: usize, k: usize| -> Vec<Weight> {
        (0..CHAIN).map(|_| weight(&device, q41, n, k)).collect()
    };
    let (wqs, wks, wvs) = (sets(d, d), sets(kv, d), sets(kv, d));
    let link = std::cell::Cell::new(0usize);
    report(
        "fused norm+qkv, from DRAM",
        bytes(&[&wq, &wk, &wv]),
        time_chain(&ops, &[&q, &k, &v], &|e| {
            let i = link.replace(link.get() + 1) % CHAIN;
            ops.rms_norm(e, &x, &g, &xn, 1, d, 1e-5).unwrap();
            ops.matmul(e, &wqs[i], &xn, &q, 1, "q").unwrap();
            ops.matmul(e, &wks[i], &xn, &k, 1, "k").unwrap();
            ops.matmul(e, &wvs[i], &xn, &v, 1, "v").unwrap();
        }),
    );
    drop((wqs, wks, wvs));
    let (wgs, wus) = (sets(ff, d), sets(ff, d));
    report(
        "fused norm+gate/up, from DRAM",
        bytes(&[&wg, &wu]),
        time_chain(&ops, &[&act], &|e| {
            let i = link.replace(link.get() + 1) % CHAIN;
            ops.rms_norm(e, &x, &g, &xn, 1, d, 1e-5).unwrap();
            ops.matmul(e, &wgs[i], &xn, &gate, 1, "gate").unwrap();
            ops.matmul(e, &wus[i], &xn, &up, 1, "up").unwrap();
            ops.silu_mul(e, &gate, &up, &act, ff).unwrap();
        }),
    );
    drop((wgs, wus));
    for pos in [100u32, 1000] {
        let p = device.buffer_from(&[pos]).unwrap();
        let shape = AttnShape {
            rows: 1,
            heads: heads as u32,
            kv_heads: kv_heads as u32,
            head_dim: hd as u32,
            max_seq: max_seq as u32,
            scale: 0.125,
            window: 0,
        };
        report(
            &format!("attention pos={pos}"),
            0,
            time_chain(&ops, &[&attn], &|e| {
                ops.attention(
                    e,
                    &q,
                    &kc,
                    &vc,
                    AttnRows::Contiguous { pos: &p, shape },
                    &attn,
                )
                .unwrap()
            }),
        );
        // Each link rotates its own q and K rows (as each layer's products
        // write fresh ones), so the rules may fold them into the attention.
        let fresh = |n: usize| (0..CHAIN).map(|_| floats(&device, n)).collect::<Vec<_>>();
        let (qs, ks) = (fresh(d), fresh(kv));
        let link = std::cell::Cell::new(0usize);
        report(
            &format!("attention_step (fused) pos={pos}"),
            0,
            time_chain(&ops, &[&attn, &kc, &vc], &|e| {
                let i = link.replace(link.get() + 1) % CHAIN;
                let (q, k) = (&qs[i], &ks[i]);
                ops.rope(
                    e,
                    q,
                    Positions::Contiguous(&p),
                    1,
                    heads,
                    hd,
                    hd,
                    1e5,
                    false,
                    None,
                    "rope_q",
                )
                .unwrap();
                ops.rope(
                    e,
                    k,
                    Positions::Contiguous(&p),
                    1,
                    kv_heads,
                    hd,
                    hd,
                    1e5,
                    false,
                    None,
                    "rope_k",
                )
                .unwrap();
                ops.kv_store(e, k, &kc, Positions::Contiguous(&p), 1, kv, "k_store")
                    .unwrap();
                ops.kv_store(e, &v, &vc, Positions::Contiguous(&p), 1, kv, "v_store")
                    .unwrap();
                ops.attention(
                    e,
                    q,
                    &kc,
                    &vc,
                    AttnRows::Contiguous { pos: &p, shape },
                    &attn,
                )
                .unwrap()
            }),
        );
        report(
            &format!("rope q pos={pos}"),
            0,
            time_chain(&ops, &[&q], &|e| {
                ops.rope(
                    e,
                    &q,
                    Positions::Contiguous(&p),
                    1,
                    heads,
                    hd,
                    hd,
                    1e5,
                    false,
                    None,
                    "rope_q",
                )
                .unwrap()
            }),
        );
        report(
            &format!("kv_store v pos={pos}"),
            0,
            time_chain(&ops, &[&vc], &|e| {
                ops.kv_store(e, &v, &vc, Positions::Contiguous(&p), 1, kv, "v_store")
                    .unwrap()
            }),
        );
    }
    report(
        "argmax 49152",
        0,
        time_chain(&ops, &[&out], &|e| {
            ops.argmax(e, &logits, &out, vocab).unwrap()
        }),
    );
    report(
        "embed q8_0",
        0,
        time_chain(&ops, &[&x], &|e| {
            ops.embed(e, &head, &token, &x, 1).unwrap()
        }),
    );
}
