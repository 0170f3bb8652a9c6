//! Helpers shared by the op test suites: random inputs and a
//! transformer-block-shaped graph.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{SystemTime, UNIX_EPOCH};

use encore::{Buffer, Graph, GraphExec, GraphStats};
use encore_ops::{AttnRows, DType, Ops, Positions, Weight};
use half::{bf16, f16};

pub fn upload<T: bytemuck::Pod>(ops: &Ops, data: &[T]) -> Buffer {
    ops.device().buffer_from(data).unwrap()
}

/// `f` of every item, each on a thread of its own, in the items' order. A
/// test's cases run at once this way where each compiles kernels of its own
/// (NVRTC compiles on one core); a case's panic is re-raised as it was.
pub fn in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let cases: Vec<_> = items.iter().map(|item| s.spawn(|| f(item))).collect();
        cases
            .into_iter()
            .map(|case| case.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Asserts `|gpu - cpu| <= rel * |cpu| + abs` elementwise, naming the worst element.
pub fn assert_close(what: &str, gpu: &[f32], cpu: &[f32], rel: f32, abs: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let mut worst = (0usize, 0f32);
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert!(
            g.is_finite(),
            "{what}: element {i} is {g} on the GPU (CPU {c})"
        );
        let excess = (g - c).abs() - (rel * c.abs() + abs);
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    let i = worst.0;
    assert!(
        worst.1 <= 0.0,
        "{what}: element {i}: GPU {} vs CPU {} (tolerance {rel} relative + {abs})",
        gpu[i],
        cpu[i]
    );
}

/// A small xorshift generator: fresh inputs per run, reproducible from the
/// printed seed (`ENCORE_TEST_SEED=0x...` runs a test on that seed again).
pub struct Rng(pub u64);

impl Rng {
    pub fn new() -> Rng {
        let given = std::env::var("ENCORE_TEST_SEED").ok().map(|v| {
            let v = v.trim();
            match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            }
            .unwrap_or_else(|e| panic!("ENCORE_TEST_SEED={v:?}: {e}"))
        });
        let seed = given.unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        }) | 1;
        eprintln!("random seed {seed:#x}");
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1), never exactly zero.
    pub fn f32(&mut self) -> f32 {
        let v = (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        if v == 0.0 {
            0.5
        } else {
            v
        }
    }
    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Random weights: `rows` rows of `k` elements of `dtype` in GGUF block layout,
/// with finite scales and every code used.
pub fn random_weights(rng: &mut Rng, dtype: DType, rows: usize, k: usize) -> Vec<u8> {
    let n = rows * k;
    let mut out = Vec::with_capacity(dtype.bytes_for(n).unwrap());
    let scale = |rng: &mut Rng, amax: f32| f16::from_f32(rng.range(0.25, 1.0) * amax).to_le_bytes();
    match dtype {
        DType::F32 => (0..n).for_each(|_| out.extend(rng.f32().to_le_bytes())),
        DType::F16 => (0..n).for_each(|_| out.extend(f16::from_f32(rng.f32()).to_le_bytes())),
        DType::BF16 => (0..n).for_each(|_| out.extend(bf16::from_f32(rng.f32()).to_le_bytes())),
        DType::Q8_0 => (0..n / 32).for_each(|_| {
            out.extend(scale(rng, 1.0 / 127.0));
            (0..32).for_each(|_| out.push(rng.next() as u8));
        }),
        DType::Q4_0 => (0..n / 32).for_each(|_| {
            out.extend(scale(rng, 1.0 / 8.0));
            (0..16).for_each(|_| out.push(rng.next() as u8));
        }),
        DType::Q4_1 => (0..n / 32).for_each(|_| {
            let d = rng.range(0.25, 1.0) / 8.0;
            out.extend(f16::from_f32(d).to_le_bytes());
            out.extend(f16::from_f32(-7.5 * d + rng.range(-0.1, 0.1)).to_le_bytes());
            (0..16).for_each(|_| out.push(rng.next() as u8));
        }),
        // Random bytes, then each f16 scale sized so that weights stay
        // within about ±1 (`amax` is the largest |scale * code|).
        _ => {
            let (fields, amax): (&[usize], f32) = match dtype {
                DType::Q5_0 => (&[0], 16.0),
                DType::Q5_1 => (&[0, 2], 31.0),
                DType::IQ4_NL => (&[0], 127.0),
                DType::Q2_K => (&[80, 82], 45.0),
                DType::Q3_K => (&[108], 128.0),
                DType::Q4_K => (&[0, 2], 945.0),
                DType::Q5_K => (&[0, 2], 1953.0),
                DType::Q6_K => (&[208], 4096.0),
                DType::IQ4_XS => (&[0], 4064.0),
                other => panic!("no random weights for {other}"),
            };
            let bytes = dtype.block_bytes();
            for _ in 0..n / dtype.block_len() {
                let start = out.len();
                (0..bytes).for_each(|_| out.push(rng.next() as u8));
                for &at in fields {
                    out[start + at..start + at + 2].copy_from_slice(&scale(rng, 1.0 / amax));
                }
            }
        }
    }
    out
}

/// A transformer block's random weights (Q, K, V and O, gate, up and down,
/// `nq` and `nkv` outputs of `k` inputs, FFN width `ff`), `rows` input rows
/// and two norm weights, uploaded to `ops`' device; the same draws for the
/// same seed on every device.
pub struct BlockInputs {
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    pub wg: Weight,
    pub wu: Weight,
    pub wd: Weight,
    /// Biases of Q, K and V (as Qwen2's), for the graphs that add them.
    pub bq: Buffer,
    pub bk: Buffer,
    pub bv: Buffer,
    pub x: Buffer,
    pub g1: Buffer,
    pub g2: Buffer,
}

impl BlockInputs {
    #[allow(clippy::too_many_arguments)]
    pub fn random(
        ops: &Ops,
        seed: u64,
        dtype: DType,
        rows: usize,
        k: usize,
        nq: usize,
        nkv: usize,
        ff: usize,
    ) -> BlockInputs {
        let mut rng = Rng(seed);
        let mut weight = |n: usize, kk: usize| Weight {
            buffer: upload(ops, &random_weights(&mut rng, dtype, n, kk)),
            dtype,
            n,
            k: kk,
        };
        // Struct fields are evaluated in order, which is the order of the draws.
        BlockInputs {
            wq: weight(nq, k),
            wk: weight(nkv, k),
            wv: weight(nkv, k),
            wo: weight(k, nq),
            wg: weight(ff, k),
            wu: weight(ff, k),
            wd: weight(k, ff),
            // Drawn before `x`, whose length depends on `rows`, so that a
            // graph of one row gets a batch's biases.
            bq: upload(ops, &rng.vec(nq)),
            bk: upload(ops, &rng.vec(nkv)),
            bv: upload(ops, &rng.vec(nkv)),
            x: upload(ops, &rng.vec(rows * k)),
            g1: upload(ops, &rng.vec(k)),
            g2: upload(ops, &rng.vec(k)),
        }
    }
}

/// One transformer-block-shaped graph over `ops`' device, recorded unfused
/// (with `bias`, Q, K and V each get a bias added, as Qwen2's) and
/// instantiated with the device's fusion rules (or none). Returns the
/// residual, the attention output, the K and V caches (as f32) and the stats.
pub fn block_graph(
    ops: &Ops,
    rng_seed: u64,
    dtype: DType,
    rows: usize,
    bias: bool,
    fusion: bool,
) -> (Vec<Vec<f32>>, GraphStats) {
    // The FFN's width is the down projection's row length: a whole number
    // of the weights' blocks.
    let ff = 96usize.next_multiple_of(dtype.block_len());
    block_graph_sized(ops, rng_seed, dtype, rows, bias, fusion, 256, ff)
}

/// [`block_graph`] of width `k` (the Q, K, V, gate and up rows' length)
/// and FFN width `ff` (the down rows'), both whole numbers of the weights' blocks.
#[allow(clippy::too_many_arguments)]
pub fn block_graph_sized(
    ops: &Ops,
    rng_seed: u64,
    dtype: DType,
    rows: usize,
    bias: bool,
    fusion: bool,
    k: usize,
    ff: usize,
) -> (Vec<Vec<f32>>, GraphStats) {
    let (heads, kv_heads, head_dim, max_seq, pos) = (4, 2, 64, 16, 5u32);
    let (nq, nkv) = (heads * head_dim, kv_heads * head_dim);
    let d = ops.device();
    let b = BlockInputs::random(ops, rng_seed, dtype, rows, k, nq, nkv, ff);
    let p = upload(ops, &[pos]);
    let f = |n: usize| d.alloc(n * 4).unwrap();
    let (xn, q, kk, v, proj) = (
        f(rows * k),
        f(rows * nq),
        f(rows * nkv),
        f(rows * nkv),
        f(rows * k),
    );
    let (gate, up, act, att) = (f(rows * ff), f(rows * ff), f(rows * ff), f(rows * nq));
    let kc = upload(ops, &vec![f16::ZERO; max_seq * nkv]);
    let vc = upload(ops, &vec![f16::ZERO; max_seq * nkv]);
    let mut e = d.capture();
    let eps = 1e-5;
    ops.rms_norm(&mut e, &b.x, &b.g1, &xn, rows, k, eps)
        .unwrap();
    ops.matmul(&mut e, &b.wq, &xn, &q, rows, "q").unwrap();
    ops.matmul(&mut e, &b.wk, &xn, &kk, rows, "k").unwrap();
    ops.matmul(&mut e, &b.wv, &xn, &v, rows, "v").unwrap();
    if bias {
        for (y, b, n) in [(&q, &b.bq, nq), (&kk, &b.bk, nkv), (&v, &b.bv, nkv)] {
            ops.add_rows(&mut e, y, b, rows, n).unwrap();
        }
    }
    ops.rope(
        &mut e,
        &q,
        Positions::Contiguous(&p),
        rows,
        heads,
        head_dim,
        head_dim,
        1e4,
        false,
        None,
        "rope_q",
    )
    .unwrap();
    ops.rope(
        &mut e,
        &kk,
        Positions::Contiguous(&p),
        rows,
        kv_heads,
        head_dim,
        head_dim,
        1e4,
        false,
        None,
        "rope_k",
    )
    .unwrap();
    ops.kv_store(
        &mut e,
        &kk,
        &kc,
        Positions::Contiguous(&p),
        rows,
        nkv,
        "k_store",
    )
    .unwrap();
    ops.kv_store(
        &mut e,
        &v,
        &vc,
        Positions::Contiguous(&p),
        rows,
        nkv,
        "v_store",
    )
    .unwrap();
    let shape = encore_ops::kernels::attention::AttnShape {
        rows: rows as u32,
        heads: heads as u32,
        kv_heads: kv_heads as u32,
        head_dim: head_dim as u32,
        max_seq: max_seq as u32,
        scale: 0.125,
        window: 0,
    };
    ops.attention(
        &mut e,
        &q,
        &kc,
        &vc,
        AttnRows::Contiguous { pos: &p, shape },
        &att,
    )
    .unwrap();
    ops.matmul(&mut e, &b.wo, &att, &proj, rows, "o").unwrap();
    ops.add(&mut e, &b.x, &proj, rows * k).unwrap();
    ops.rms_norm(&mut e, &b.x, &b.g2, &xn, rows, k, eps)
        .unwrap();
    ops.matmul(&mut e, &b.wg, &xn, &gate, rows, "gate").unwrap();
    ops.matmul(&mut e, &b.wu, &xn, &up, rows, "up").unwrap();
    ops.silu_mul(&mut e, &gate, &up, &act, rows * ff).unwrap();
    ops.matmul(&mut e, &b.wd, &act, &proj, rows, "down")
        .unwrap();
    ops.add(&mut e, &b.x, &proj, rows * k).unwrap();
    let mut graph = e.finish_graph().unwrap();
    for out in [&b.x, &att, &kc, &vc] {
        graph.mark_output(out);
    }
    let exec = replay_once(ops, &graph, fusion);
    let cache = |b: &Buffer| -> Vec<f32> {
        b.download::<f16>()
            .unwrap()
            .iter()
            .map(|h| h.to_f32())
            .collect()
    };
    let out = vec![
        b.x.download::<f32>().unwrap(),
        att.download::<f32>().unwrap(),
        cache(&kc),
        cache(&vc),
    ];
    (out, exec.stats().clone())
}

/// Instantiates `graph` with every fusion rule `ops` has (or none) and
/// replays it once.
pub fn replay_once(ops: &Ops, graph: &Graph, fusion: bool) -> GraphExec {
    let patterns = if fusion {
        ops.all_fusion_patterns()
    } else {
        Vec::new()
    };
    let exec = graph.instantiate(&patterns).unwrap();
    exec.replay(&[]).unwrap().wait().unwrap();
    exec
}

/// Dispatches of [`block_graph`] after fusion (with or without biases, which
/// fold into the Q, K and V products): norm+QKV, then for one row
/// the attention with RoPE and the cache stores folded in, for several rows
/// RoPE of q, RoPE+store of K, store of V and attention apart; then O+add,
/// norm+gate/up+SwiGLU, down+add.
pub fn fused_nodes(rows: usize) -> usize {
    if rows == 1 {
        5
    } else {
        8
    }
}

/// A batch of independent sequences over a paged cache, with random
/// contents: `seqs` sequences of the given lengths, their blocks taken from
/// a shuffled pool, one query row per sequence at its last position (and,
/// with `prefill_rows`, that many more rows of the first sequence at the
/// positions before it), K and V of every position random.
pub struct PagedCase {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub blocks: usize,
    pub max_blocks: usize,
    /// Each sequence's length and block table.
    pub seqs: Vec<(usize, Vec<u32>)>,
    /// Per row: (sequence, position).
    pub rows: Vec<(usize, usize)>,
    /// Per sequence: K and V, `len * kv_dim` each.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
    pub q: Vec<f32>,
    pub window: usize,
}

impl PagedCase {
    pub fn random(rng: &mut Rng, lens: &[usize], prefill_rows: usize, window: usize) -> PagedCase {
        let (heads, kv_heads, head_dim, block_size) = (6, 2, 64, 16);
        let kv_dim = kv_heads * head_dim;
        let max_blocks = lens
            .iter()
            .map(|l| l.div_ceil(block_size))
            .max()
            .unwrap_or(1);
        let needed: usize = lens.iter().map(|l| l.div_ceil(block_size)).sum();
        let blocks = needed + 3;
        // A shuffled pool, so tables are neither contiguous nor ordered.
        let mut pool: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.below(i + 1));
        }
        let mut seqs = Vec::new();
        for &len in lens {
            let table: Vec<u32> = (0..len.div_ceil(block_size))
                .map(|_| pool.pop().unwrap())
                .collect();
            seqs.push((len, table));
        }
        let mut rows: Vec<(usize, usize)> = (0..lens.len()).map(|s| (s, lens[s] - 1)).collect();
        for i in 0..prefill_rows.min(lens[0] - 1) {
            rows.push((0, lens[0] - 2 - i));
        }
        let kv = lens
            .iter()
            .map(|&len| (rng.vec(len * kv_dim), rng.vec(len * kv_dim)))
            .collect();
        let q = rng.vec(rows.len() * heads * head_dim);
        PagedCase {
            heads,
            kv_heads,
            head_dim,
            block_size,
            blocks,
            max_blocks,
            seqs,
            rows,
            kv,
            q,
            window,
        }
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub fn shape(&self) -> encore_ops::kernels::paged::PagedAttnShape {
        encore_ops::kernels::paged::PagedAttnShape {
            rows: self.rows.len() as u32,
            heads: self.heads as u32,
            kv_heads: self.kv_heads as u32,
            head_dim: self.head_dim as u32,
            block_size: self.block_size as u32,
            max_blocks: self.max_blocks as u32,
            blocks: self.blocks as u32,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            window: self.window as u32,
            decode: 0,
        }
    }

    /// `self` with only sequence `s` and its last-position row (the same
    /// table and pool size), for comparing a row alone with it in a batch.
    pub fn only(&self, s: usize) -> PagedCase {
        let n = self.heads * self.head_dim;
        let r = self.rows.iter().position(|&(q, _)| q == s).unwrap();
        PagedCase {
            seqs: vec![self.seqs[s].clone()],
            rows: vec![(0, self.rows[r].1)],
            kv: vec![self.kv[s].clone()],
            q: self.q[r * n..(r + 1) * n].to_vec(),
            ..*self
        }
    }

    /// One decode step over the rows (one a sequence, each at its
    /// sequence's last position), recorded as a graph: `rope_rows` (NeoX,
    /// `rope_dim`) of the queries and of the new K rows, `kv_store_paged` of
    /// the new K and V rows (each sequence's last), `attention_paged` with
    /// the decode promise; instantiated with the row fusion rules when
    /// `fused`. The pools start random, with each sequence's earlier
    /// positions in its blocks. Returns the attention output, the K and V
    /// pools widened to f32, and the graph's node count.
    pub fn decode_step(
        &self,
        ops: &Ops,
        rope_dim: usize,
        fused: bool,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, usize) {
        assert_eq!(self.rows.len(), self.seqs.len(), "one row a sequence");
        let (kv_dim, bs) = (self.kv_dim(), self.block_size);
        let slot = |table: &[u32], t: usize| table[t / bs] as usize * bs + t % bs;
        let mut rng = Rng(0x5eed ^ self.blocks as u64);
        let mut pools = [0, 1].map(|_| {
            (0..self.blocks * bs * kv_dim)
                .map(|_| f16::from_f32(rng.f32()))
                .collect::<Vec<f16>>()
        });
        let (mut k_new, mut v_new, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for &(s, pos) in &self.rows {
            let (_, table) = &self.seqs[s];
            for (pool, data) in pools.iter_mut().zip([&self.kv[s].0, &self.kv[s].1]) {
                for t in 0..pos {
                    let at = slot(table, t) * kv_dim;
                    for (d, x) in pool[at..at + kv_dim].iter_mut().zip(&data[t * kv_dim..]) {
                        *d = f16::from_f32(*x);
                    }
                }
            }
            k_new.extend_from_slice(&self.kv[s].0[pos * kv_dim..(pos + 1) * kv_dim]);
            v_new.extend_from_slice(&self.kv[s].1[pos * kv_dim..(pos + 1) * kv_dim]);
            slots.push(slot(table, pos) as u32);
        }
        let [k, v] = pools.map(|p| upload(ops, &p));
        let positions: Vec<u32> = self.rows.iter().map(|&(_, p)| p as u32).collect();
        let mut tables = vec![0u32; self.rows.len() * self.max_blocks];
        for (r, &(s, _)) in self.rows.iter().enumerate() {
            let t = &self.seqs[s].1;
            tables[r * self.max_blocks..r * self.max_blocks + t.len()].copy_from_slice(t);
        }
        let [positions, slots, tables] = [&positions, &slots, &tables].map(|d| upload(ops, d));
        let [q, k_new, v_new] = [&self.q, &k_new, &v_new].map(|d| upload(ops, d));
        let out = ops.device().alloc(self.q.len() * 4).unwrap();
        let m = self.rows.len();
        let (hd, base) = (self.head_dim, 1e4);
        let mut e = ops.device().capture();
        for (x, heads, label) in [
            (&q, self.heads, "rope_q"),
            (&k_new, self.kv_heads, "rope_k"),
        ] {
            ops.rope(
                &mut e,
                x,
                Positions::Rows(&positions),
                m,
                heads,
                hd,
                rope_dim,
                base,
                true,
                None,
                label,
            )
            .unwrap();
        }
        ops.kv_store(
            &mut e,
            &k_new,
            &k,
            Positions::Rows(&slots),
            m,
            kv_dim,
            "k_store",
        )
        .unwrap();
        ops.kv_store(
            &mut e,
            &v_new,
            &v,
            Positions::Rows(&slots),
            m,
            kv_dim,
            "v_store",
        )
        .unwrap();
        let shape = encore_ops::kernels::paged::PagedAttnShape {
            decode: 1,
            ..self.shape()
        };
        ops.attention(
            &mut e,
            &q,
            &k,
            &v,
            AttnRows::Paged {
                positions: &positions,
                tables: &tables,
                shape,
            },
            &out,
        )
        .unwrap();
        let patterns = if fused {
            ops.all_row_fusion_patterns()
        } else {
            Vec::new()
        };
        replay_attention(e, &patterns, &out, &k, &v)
    }

    /// Stores every sequence's K and V into pools on `ops`' device with
    /// `kv_store_paged` (one dispatch per sequence), then runs
    /// `attention_paged` over the rows; returns the attention output.
    pub fn run(&self, ops: &Ops) -> Vec<f32> {
        let kv_dim = self.kv_dim();
        let pool_bytes = self.blocks * self.block_size * kv_dim * 2;
        let k = ops.device().alloc(pool_bytes).unwrap();
        let v = ops.device().alloc(pool_bytes).unwrap();
        let mut enc = ops.device().encoder();
        let mut keep = Vec::new();
        for ((len, table), (ks, vs)) in self.seqs.iter().zip(&self.kv) {
            let slots: Vec<u32> = (0..*len)
                .map(|t| {
                    table[t / self.block_size] * self.block_size as u32
                        + (t % self.block_size) as u32
                })
                .collect();
            let slots = upload(ops, &slots);
            let (kb, vb) = (upload(ops, ks), upload(ops, vs));
            ops.kv_store(
                &mut enc,
                &kb,
                &k,
                Positions::Rows(&slots),
                *len,
                kv_dim,
                "k",
            )
            .unwrap();
            ops.kv_store(
                &mut enc,
                &vb,
                &v,
                Positions::Rows(&slots),
                *len,
                kv_dim,
                "v",
            )
            .unwrap();
            keep.extend([slots, kb, vb]);
        }
        let positions: Vec<u32> = self.rows.iter().map(|&(_, p)| p as u32).collect();
        let mut tables = vec![0u32; self.rows.len() * self.max_blocks];
        for (r, &(s, _)) in self.rows.iter().enumerate() {
            let t = &self.seqs[s].1;
            tables[r * self.max_blocks..r * self.max_blocks + t.len()].copy_from_slice(t);
        }
        let (positions, tables) = (upload(ops, &positions), upload(ops, &tables));
        let q = upload(ops, &self.q);
        let out = ops.device().alloc(self.q.len() * 4).unwrap();
        ops.attention(
            &mut enc,
            &q,
            &k,
            &v,
            AttnRows::Paged {
                positions: &positions,
                tables: &tables,
                shape: self.shape(),
            },
            &out,
        )
        .unwrap();
        enc.commit_and_wait().unwrap();
        out.download().unwrap()
    }
}

/// Finishes the capture `e` of an attention step, instantiates it with
/// `patterns` and replays it once; returns the output `out`, the f16
/// caches `k` and `v` widened to f32, and the instantiated node count.
pub fn replay_attention(
    mut e: encore::Encoder,
    patterns: &[encore::graph::passes::FusionPattern],
    out: &Buffer,
    k: &Buffer,
    v: &Buffer,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, usize) {
    let mut graph = e.finish_graph().unwrap();
    for b in [out, k, v] {
        graph.mark_output(b);
    }
    let exec = graph.instantiate(patterns).unwrap();
    exec.replay(&[]).unwrap().wait().unwrap();
    let widen = |b: &Buffer| -> Vec<f32> {
        b.download::<f16>()
            .unwrap()
            .iter()
            .map(|h| h.to_f32())
            .collect()
    };
    (
        out.download::<f32>().unwrap(),
        widen(k),
        widen(v),
        exec.nodes().len(),
    )
}
