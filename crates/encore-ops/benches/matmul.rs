//! CPU matrix products at SmolLM2-135M's shapes (hidden 576, FFN 1536, k/v
//! 192, 30 layers, vocabulary 49152; Q4_1 layers, Q8_0 output head).
//!
//! `matvec/*`, `batch8/*` and `prefill128/*` time one product, with the weight bytes read
//! per call as throughput (GB/s). Their weights stay in cache between
//! iterations, so they show the kernels' speed rather than memory's. Every
//! quantized type has the FFN-down product (1536 inputs, a whole number of
//! the super-block types' 256), one row and 128; `matvec4096/*` is a product
//! too large for the caches (4096 x 4096), bound by memory.
//!
//! `smollm2/*` runs every matrix product of one token (decode) or of 128
//! tokens (prefill, with the head on the last token only), each layer with its
//! own weights so that they stream from memory as in a real model. `pool`
//! variants run the token with a worker pool installed (as the CPU backend
//! does), the others on the calling thread alone. A JSON line per variant
//! summarizes ms per token, tokens per second and GB/s.

use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use encore_ops::cpu::{
    matmul_quantized, matmul_with_scratch, ActivationFormat, QuantizedActivations,
};
use encore_ops::DType;
use rand::{rngs::StdRng, Rng, SeedableRng};

const HIDDEN: usize = 576;
const FFN: usize = 1536;
const KV: usize = 192;
const LAYERS: usize = 30;
const VOCAB: usize = 49152;
const PREFILL: usize = 128;
/// Activation rows of a batched decode step of 8 sequences.
const BATCH: usize = 8;

/// The quantized types, in the order their products are listed.
const QUANTIZED: [DType; 12] = [
    DType::Q4_1,
    DType::Q4_0,
    DType::Q8_0,
    DType::Q5_0,
    DType::Q5_1,
    DType::IQ4_NL,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::Q2_K,
    DType::Q3_K,
    DType::IQ4_XS,
];

/// Where a block of `dtype` keeps its f16 scales.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    }
}

/// Random `rows x cols` weights of a quantized `dtype` with finite scales.
fn weights(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let blocks = rows * cols / dtype.block_len();
    let mut bytes = vec![0u8; blocks * dtype.block_bytes()];
    rng.fill(bytes.as_mut_slice());
    for block in bytes.chunks_mut(dtype.block_bytes()) {
        for &at in f16_fields(dtype) {
            let v = half::f16::from_f32(rng.gen_range(-0.05..0.05));
            block[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    bytes
}

fn activations(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect()
}

/// One product: `rows x cols` weights against `m` activation rows.
struct Product {
    name: String,
    dtype: DType,
    rows: usize,
    cols: usize,
    m: usize,
}

fn single_products(c: &mut Criterion) {
    let mut products = vec![
        (DType::Q4_1, FFN, HIDDEN, 1),
        (DType::Q4_1, HIDDEN, HIDDEN, 1),
        (DType::Q4_1, KV, HIDDEN, 1),
        (DType::Q8_0, VOCAB, HIDDEN, 1),
        (DType::Q4_1, FFN, HIDDEN, PREFILL),
        (DType::Q4_1, FFN, HIDDEN, BATCH),
    ];
    for dtype in QUANTIZED {
        products.extend([(dtype, HIDDEN, FFN, 1), (dtype, HIDDEN, FFN, PREFILL)]);
    }
    for dtype in QUANTIZED {
        products.push((dtype, 4096, 4096, 1));
    }
    let products = products.into_iter().map(|(dtype, rows, cols, m)| Product {
        name: format!(
            "{}/{dtype}_{cols}x{rows}",
            match (m, rows) {
                (1, 4096) => "matvec4096",
                (1, _) => "matvec",
                (BATCH, _) => "batch8",
                _ => "prefill128",
            }
        ),
        dtype,
        rows,
        cols,
        m,
    });
    let mut rng = StdRng::seed_from_u64(1);
    for p in products {
        let w = weights(&mut rng, p.dtype, p.rows, p.cols);
        let x = activations(&mut rng, p.m * p.cols);
        let mut y = vec![0.0f32; p.m * p.rows];
        let mut scratch = QuantizedActivations::new();
        let mut group = c.benchmark_group(&p.name);
        group.throughput(Throughput::BytesDecimal(w.len() as u64));
        group.bench_function(BenchmarkId::from_parameter(p.m), |b| {
            b.iter(|| {
                let r = matmul_with_scratch(p.dtype, &w, p.rows, p.cols, &x, &mut y, &mut scratch);
                assert!(r.is_ok(), "{r:?}");
            })
        });
        group.finish();
    }
}

struct Layer {
    q: Vec<u8>,
    k: Vec<u8>,
    v: Vec<u8>,
    o: Vec<u8>,
    gate: Vec<u8>,
    up: Vec<u8>,
    down: Vec<u8>,
}

struct Model {
    layers: Vec<Layer>,
    head: Vec<u8>,
}

impl Model {
    fn new() -> Model {
        let mut rng = StdRng::seed_from_u64(2);
        let q4 = DType::Q4_1;
        let layers = (0..LAYERS)
            .map(|_| Layer {
                q: weights(&mut rng, q4, HIDDEN, HIDDEN),
                k: weights(&mut rng, q4, KV, HIDDEN),
                v: weights(&mut rng, q4, KV, HIDDEN),
                o: weights(&mut rng, q4, HIDDEN, HIDDEN),
                gate: weights(&mut rng, q4, FFN, HIDDEN),
                up: weights(&mut rng, q4, FFN, HIDDEN),
                down: weights(&mut rng, q4, HIDDEN, FFN),
            })
            .collect();
        let head = weights(&mut rng, DType::Q8_0, VOCAB, HIDDEN);
        Model { layers, head }
    }

    fn bytes(&self) -> usize {
        let layer = |l: &Layer| {
            [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                .iter()
                .map(|w| w.len())
                .sum::<usize>()
        };
        self.layers.iter().map(layer).sum::<usize>() + self.head.len()
    }
}

/// Buffers for `m` tokens.
struct Work {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    logits: Vec<f32>,
    xq: QuantizedActivations,
}

impl Work {
    fn new(m: usize) -> Work {
        let mut rng = StdRng::seed_from_u64(3);
        Work {
            x: activations(&mut rng, m * HIDDEN),
            h: activations(&mut rng, m * FFN),
            q: vec![0.0; m * HIDDEN],
            k: vec![0.0; m * KV],
            v: vec![0.0; m * KV],
            o: vec![0.0; m * HIDDEN],
            gate: vec![0.0; m * FFN],
            up: vec![0.0; m * FFN],
            logits: vec![0.0; VOCAB],
            xq: QuantizedActivations::new(),
        }
    }
}

/// Every matrix product of the model for the tokens in `work`, with the head
/// on the last one. Inputs that feed several products (q/k/v, gate/up) are
/// quantized once. The activations are not updated between products: only
/// the products are timed.
fn forward(model: &Model, work: &mut Work) {
    let q4 = DType::Q4_1;
    let Work {
        x,
        h,
        q,
        k,
        v,
        o,
        gate,
        up,
        logits,
        xq,
    } = work;
    let run = |r: Result<(), encore_ops::cpu::QuantError>| assert!(r.is_ok(), "{r:?}");
    for l in &model.layers {
        run(xq.quantize(ActivationFormat::Q8, x, HIDDEN));
        run(matmul_quantized(q4, &l.q, HIDDEN, xq, q));
        run(matmul_quantized(q4, &l.k, KV, xq, k));
        run(matmul_quantized(q4, &l.v, KV, xq, v));
        run(matmul_with_scratch(q4, &l.o, HIDDEN, HIDDEN, q, o, xq));
        run(xq.quantize(ActivationFormat::Q8, x, HIDDEN));
        run(matmul_quantized(q4, &l.gate, FFN, xq, gate));
        run(matmul_quantized(q4, &l.up, FFN, xq, up));
        run(matmul_with_scratch(q4, &l.down, HIDDEN, FFN, h, o, xq));
    }
    let last = &x[x.len() - HIDDEN..];
    run(matmul_with_scratch(
        DType::Q8_0,
        &model.head,
        VOCAB,
        HIDDEN,
        last,
        logits,
        xq,
    ));
}

fn whole_model(c: &mut Criterion) {
    let model = Model::new();
    let bytes = model.bytes();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Ok(pool) = encore::parallel::WorkerPool::new(threads) else {
        return;
    };
    let mut group = c.benchmark_group("smollm2");
    group.sample_size(30);
    let mut summary = Vec::new();
    for (name, m) in [("decode", 1), ("prefill128", PREFILL)] {
        for in_pool in [false, true] {
            let id = if in_pool {
                format!("{name}_pool")
            } else {
                name.to_string()
            };
            let mut work = Work::new(m);
            let mut step = || {
                if in_pool {
                    pool.install(|| forward(&model, &mut work));
                } else {
                    forward(&model, &mut work);
                }
            };
            group.throughput(Throughput::BytesDecimal(bytes as u64));
            group.bench_function(&id, |b| b.iter(&mut step));

            // The summary: the median of 15 timed runs after 3 warm-ups.
            let mut times: Vec<f64> = (0..18)
                .map(|_| {
                    let start = Instant::now();
                    step();
                    start.elapsed().as_secs_f64()
                })
                .skip(3)
                .collect();
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            summary.push(format!(
                "{{\"bench\":\"smollm2/{id}\",\"threads\":{},\"tokens\":{m},\"ms_per_token\":{:.3},\"tokens_per_s\":{:.1},\"weight_gb_per_s\":{:.1}}}",
                if in_pool { pool.threads() } else { 1 },
                median * 1e3 / m as f64,
                m as f64 / median,
                bytes as f64 / median / 1e9,
            ));
        }
    }
    group.finish();
    println!(
        "weights per token: {:.1} MiB",
        bytes as f64 / (1 << 20) as f64
    );
    for line in summary {
        println!("{line}");
    }
}

criterion_group!(benches, single_products, whole_model);
criterion_main!(benches);
