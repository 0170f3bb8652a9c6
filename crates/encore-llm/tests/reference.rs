//! The runtime's forward pass against a float64 reference written out in
//! plain Rust, on small synthetic models: prefill logits, eager decode steps
//! and graph-replayed decode steps.
//!
//! Tolerance: the runtime rounds activations to 8 bits before quantized dot
//! products and keeps the KV cache in f16, as llama.cpp does, so logits may
//! differ from the float64 reference by up to 2% of the largest reference
//! logit magnitude; the greedy token must agree wherever the reference's top
//! two logits are further apart than that.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{Config, Device};
use encore_llm::gguf::GgufFile;
use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use encore_llm::{Model, Session};
use encore_ops::{DType, KernelSet};

const TOLERANCE: f64 = 0.02;

struct RefLayer {
    attn_norm: Vec<f64>,
    wq: Vec<f64>,
    wk: Vec<f64>,
    wv: Vec<f64>,
    wo: Vec<f64>,
    ffn_norm: Vec<f64>,
    gate: Vec<f64>,
    up: Vec<f64>,
    down: Vec<f64>,
}

struct Reference {
    d: usize,
    ff: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
    base: f64,
    eps: f64,
    embed: Vec<f64>,
    layers: Vec<RefLayer>,
    out_norm: Vec<f64>,
}

fn tensor(f: &GgufFile, name: &str) -> Vec<f64> {
    let t = f.tensor(name).unwrap();
    let mut v = vec![0f32; t.n_elements as usize];
    encore_ops::cpu::dequantize_row(t.dtype, f.tensor_data(t), &mut v).unwrap();
    v.into_iter().map(f64::from).collect()
}

impl Reference {
    fn new(f: &GgufFile, spec: &SyntheticSpec) -> Reference {
        let layers = (0..spec.n_layer)
            .map(|i| {
                let t = |s: &str| tensor(f, &format!("blk.{i}.{s}"));
                RefLayer {
                    attn_norm: t("attn_norm.weight"),
                    wq: t("attn_q.weight"),
                    wk: t("attn_k.weight"),
                    wv: t("attn_v.weight"),
                    wo: t("attn_output.weight"),
                    ffn_norm: t("ffn_norm.weight"),
                    gate: t("ffn_gate.weight"),
                    up: t("ffn_up.weight"),
                    down: t("ffn_down.weight"),
                }
            })
            .collect();
        Reference {
            d: spec.n_embd,
            ff: spec.n_ff,
            heads: spec.n_head,
            kv_heads: spec.n_head_kv,
            vocab: spec.vocab,
            base: spec.rope_base as f64,
            eps: 1e-5,
            embed: tensor(f, "token_embd.weight"),
            layers,
            out_norm: tensor(f, "output_norm.weight"),
        }
    }

    fn matvec(w: &[f64], x: &[f64], n: usize) -> Vec<f64> {
        let k = x.len();
        (0..n)
            .map(|j| (0..k).map(|i| w[j * k + i] * x[i]).sum())
            .collect()
    }

    fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(x, w)| x * s * w).collect()
    }

    fn rope(&self, v: &mut [f64], pos: usize) {
        let hd = self.d / self.heads;
        for head in v.chunks_exact_mut(hd) {
            for i in 0..hd / 2 {
                let theta = pos as f64 * self.base.powf(-2.0 * i as f64 / hd as f64);
                let (s, c) = theta.sin_cos();
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c - b * s;
                head[2 * i + 1] = a * s + b * c;
            }
        }
    }

    /// Logits after the last of `tokens`, recomputing everything.
    fn logits(&self, tokens: &[u32]) -> Vec<f64> {
        let (d, hd) = (self.d, self.d / self.heads);
        let kvd = self.kv_heads * hd;
        let mut xs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| self.embed[t as usize * d..(t as usize + 1) * d].to_vec())
            .collect();
        for l in &self.layers {
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for (p, x) in xs.iter().enumerate() {
                let xn = Self::rms_norm(x, &l.attn_norm, self.eps);
                let mut q = Self::matvec(&l.wq, &xn, d);
                let mut k = Self::matvec(&l.wk, &xn, kvd);
                self.rope(&mut q, p);
                self.rope(&mut k, p);
                qs.push(q);
                ks.push(k);
                vs.push(Self::matvec(&l.wv, &xn, kvd));
            }
            for (p, x) in xs.iter_mut().enumerate() {
                let mut attn = vec![0.0; d];
                for h in 0..self.heads {
                    let kh = h / (self.heads / self.kv_heads);
                    let q = &qs[p][h * hd..(h + 1) * hd];
                    let scores: Vec<f64> = (0..=p)
                        .map(|t| {
                            let k = &ks[t][kh * hd..(kh + 1) * hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for (t, w) in e.iter().enumerate() {
                        let v = &vs[t][kh * hd..(kh + 1) * hd];
                        for i in 0..hd {
                            attn[h * hd + i] += w / sum * v[i];
                        }
                    }
                }
                let o = Self::matvec(&l.wo, &attn, d);
                x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
                let xn = Self::rms_norm(x, &l.ffn_norm, self.eps);
                let g = Self::matvec(&l.gate, &xn, self.ff);
                let u = Self::matvec(&l.up, &xn, self.ff);
                let h: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                let down = Self::matvec(&l.down, &h, d);
                x.iter_mut().zip(&down).for_each(|(x, o)| *x += o);
            }
        }
        let last = Self::rms_norm(xs.last().unwrap(), &self.out_norm, self.eps);
        Self::matvec(&self.embed, &last, self.vocab)
    }
}

fn compare(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
    let err = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, f64::max);
    assert!(
        err <= TOLERANCE * scale,
        "{what}: max error {err:.5} vs scale {scale:.3} (ratio {:.4})",
        err / scale
    );
    let mut sorted: Vec<f64> = want.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    if sorted[0] - sorted[1] > 2.0 * TOLERANCE * scale {
        let argmax = |v: &[f64]| {
            v.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        };
        let got64: Vec<f64> = got.iter().map(|&v| v as f64).collect();
        assert_eq!(argmax(&got64), argmax(want), "{what}: greedy token differs");
    }
}

fn check(spec: SyntheticSpec, graphs: bool) {
    let file = GgufFile::from_bytes(synthetic_gguf(&spec)).unwrap();
    let reference = Reference::new(&file, &spec);
    let device = Device::open("cpu", &Config::default()).unwrap();
    let model = Model::load(&file, &device, KernelSet::Default).unwrap();
    let mut session = Session::new(model, 32, graphs).unwrap();
    let mut tokens: Vec<u32> = vec![5, 77, 200, 13, 99, 250, 31];
    let logits = session.prefill(&tokens).unwrap();
    compare(&logits, &reference.logits(&tokens), "prefill");
    for (step, next) in [17u32, 101, 3, 280, 64].into_iter().enumerate() {
        session.step(next).unwrap();
        tokens.push(next);
        let logits = session.logits().unwrap();
        let want = reference.logits(&tokens);
        compare(&logits, &want, &format!("decode step {step}"));
        let argmax = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0;
        assert_eq!(session.argmax().unwrap() as usize, argmax, "device argmax");
    }
}

#[test]
fn forward_matches_float64_reference_with_graph_replay() {
    check(SyntheticSpec::tiny(1), true);
}

#[test]
fn forward_matches_float64_reference_eagerly() {
    check(SyntheticSpec::tiny(2), false);
}

#[test]
fn forward_matches_reference_for_every_weight_type() {
    for (i, dtype) in [
        DType::Q4_0,
        DType::Q8_0,
        DType::F16,
        DType::BF16,
        DType::F32,
    ]
    .into_iter()
    .enumerate()
    {
        let spec = SyntheticSpec {
            weight_type: dtype,
            embed_type: if i % 2 == 0 { DType::F16 } else { DType::Q8_0 },
            ..SyntheticSpec::tiny(10 + i as u64)
        };
        check(spec, true);
    }
}
