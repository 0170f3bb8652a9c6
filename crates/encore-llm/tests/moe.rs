//! Qwen3-MoE (`qwen3moe`) on the CPU: the small synthetic shape loads and
//! generates, its logits match a plain float64 forward pass written here
//! from the file's dequantized weights, and expert layouts Encore does not
//! know are refused, naming the tensor.
//!
//! The reference runs the router as llama.cpp does for this architecture
//! (softmax over every expert, the top `expert_used_count`, their
//! probabilities renormalized to sum 1), so the comparison checks the
//! router, the choice, the renormalization and the weighted expert sums.
//!
//! Tolerance: as in `reference.rs`, the runtime rounds activations to 8
//! bits before quantized products and keeps the KV cache in f16, so logits
//! may differ from the reference by up to 2% of the largest reference
//! logit magnitude. Those small differences could flip the choice between
//! two experts whose probabilities tie; the reference asserts that every
//! choice it makes is clear (a gap of at least `MIN_ROUTER_GAP` between
//! the last chosen and the first left out), so a flip cannot pass unseen.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{Config, Device};
use encore_llm::gguf::{GgufFile, GgufWriter, Value};
use encore_llm::synthetic::{FileType, ModelShape, SyntheticModel};
use encore_llm::{Engine, EngineOptions, GenerateOptions, LlmError, Model, Session};
use encore_ops::{DType, KernelSet};

const TOLERANCE: f64 = 0.02;
/// The least gap between the probabilities of the last expert the reference
/// chooses and the first it leaves out.
const MIN_ROUTER_GAP: f64 = 1e-3;

fn tiny(ftype: FileType, seed: u64) -> GgufFile {
    let shape = ModelShape::named("qwen3-moe-tiny").unwrap();
    let model = SyntheticModel::from_shape(shape, ftype).unwrap();
    GgufFile::from_bytes(model.to_bytes(seed)).unwrap()
}

fn tensor(f: &GgufFile, name: &str) -> Vec<f64> {
    let t = f.tensor(name).unwrap();
    let mut v = vec![0f32; t.n_elements as usize];
    encore_ops::cpu::dequantize_row(t.dtype, f.tensor_data(t), &mut v).unwrap();
    v.into_iter().map(f64::from).collect()
}

struct Layer {
    attn_norm: Vec<f64>,
    wq: Vec<f64>,
    wk: Vec<f64>,
    wv: Vec<f64>,
    wo: Vec<f64>,
    q_norm: Vec<f64>,
    k_norm: Vec<f64>,
    ffn_norm: Vec<f64>,
    router: Vec<f64>,
    /// Stacked experts, expert `e`'s matrix from `e * rows * cols` on.
    gate: Vec<f64>,
    up: Vec<f64>,
    down: Vec<f64>,
}

/// A plain float64 Qwen3-MoE forward pass.
struct Reference {
    d: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    vocab: usize,
    experts: usize,
    used: usize,
    ff: usize,
    base: f64,
    eps: f64,
    embed: Vec<f64>,
    layers: Vec<Layer>,
    out_norm: Vec<f64>,
    output: Vec<f64>,
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

impl Reference {
    fn new(f: &GgufFile) -> Reference {
        let u = |k: &str| f.get_u32(&format!("qwen3moe.{k}")).unwrap() as usize;
        let layers = (0..u("block_count"))
            .map(|i| {
                let t = |s: &str| tensor(f, &format!("blk.{i}.{s}.weight"));
                Layer {
                    attn_norm: t("attn_norm"),
                    wq: t("attn_q"),
                    wk: t("attn_k"),
                    wv: t("attn_v"),
                    wo: t("attn_output"),
                    q_norm: t("attn_q_norm"),
                    k_norm: t("attn_k_norm"),
                    ffn_norm: t("ffn_norm"),
                    router: t("ffn_gate_inp"),
                    gate: t("ffn_gate_exps"),
                    up: t("ffn_up_exps"),
                    down: t("ffn_down_exps"),
                }
            })
            .collect();
        let embed = tensor(f, "token_embd.weight");
        let d = u("embedding_length");
        Reference {
            d,
            heads: u("attention.head_count"),
            kv_heads: u("attention.head_count_kv"),
            hd: u("attention.key_length"),
            vocab: embed.len() / d,
            experts: u("expert_count"),
            used: u("expert_used_count"),
            ff: u("expert_feed_forward_length"),
            base: f64::from(f.get_f32("qwen3moe.rope.freq_base").unwrap()),
            eps: f64::from(
                f.get_f32("qwen3moe.attention.layer_norm_rms_epsilon")
                    .unwrap(),
            ),
            embed,
            layers,
            out_norm: tensor(f, "output_norm.weight"),
            output: tensor(f, "output.weight"),
        }
    }

    /// Per-head RMSNorm, then NeoX RoPE (halves paired) at `pos`.
    fn norm_rope(&self, v: &mut [f64], norm: &[f64], pos: usize) {
        let hd = self.hd;
        for head in v.chunks_exact_mut(hd) {
            let normed = rms_norm(head, norm, self.eps);
            head.copy_from_slice(&normed);
            for i in 0..hd / 2 {
                let theta = pos as f64 * self.base.powf(-2.0 * i as f64 / hd as f64);
                let (s, c) = theta.sin_cos();
                let (a, b) = (head[i], head[i + hd / 2]);
                head[i] = a * c - b * s;
                head[i + hd / 2] = a * s + b * c;
            }
        }
    }

    /// The routed feed-forward of `xn`.
    fn experts(&self, l: &Layer, xn: &[f64]) -> Vec<f64> {
        let (d, ff) = (self.d, self.ff);
        let logits = matvec(&l.router, xn, self.experts);
        let max = logits.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = logits.iter().map(|v| (v - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|v| v / sum).collect();
        let mut order: Vec<usize> = (0..self.experts).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let gap = p[order[self.used - 1]] - p[order[self.used]];
        assert!(
            gap >= MIN_ROUTER_GAP,
            "the reference's expert choice is nearly a tie ({gap:.2e}); choose another seed"
        );
        let chosen = &order[..self.used];
        let total: f64 = chosen.iter().map(|&e| p[e]).sum();
        let mut out = vec![0.0; d];
        for &e in chosen {
            let w = p[e] / total;
            let gate = matvec(&l.gate[e * ff * d..(e + 1) * ff * d], xn, ff);
            let up = matvec(&l.up[e * ff * d..(e + 1) * ff * d], xn, ff);
            let h: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = matvec(&l.down[e * d * ff..(e + 1) * d * ff], &h, d);
            out.iter_mut().zip(&down).for_each(|(o, v)| *o += w * v);
        }
        out
    }

    /// Logits after the last of `tokens`, recomputing everything.
    fn logits(&self, tokens: &[u32]) -> Vec<f64> {
        let (d, hd) = (self.d, self.hd);
        let (qd, kvd) = (self.heads * hd, self.kv_heads * hd);
        let mut xs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| self.embed[t as usize * d..(t as usize + 1) * d].to_vec())
            .collect();
        for l in &self.layers {
            let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
            for (p, x) in xs.iter().enumerate() {
                let xn = rms_norm(x, &l.attn_norm, self.eps);
                let mut q = matvec(&l.wq, &xn, qd);
                let mut k = matvec(&l.wk, &xn, kvd);
                self.norm_rope(&mut q, &l.q_norm, p);
                self.norm_rope(&mut k, &l.k_norm, p);
                qs.push(q);
                ks.push(k);
                vs.push(matvec(&l.wv, &xn, kvd));
            }
            for (p, x) in xs.iter_mut().enumerate() {
                let mut attn = vec![0.0; qd];
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
                let o = matvec(&l.wo, &attn, d);
                x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
                let xn = rms_norm(x, &l.ffn_norm, self.eps);
                let ffn = self.experts(l, &xn);
                x.iter_mut().zip(&ffn).for_each(|(x, o)| *x += o);
            }
        }
        let last = rms_norm(xs.last().unwrap(), &self.out_norm, self.eps);
        matvec(&self.output, &last, self.vocab)
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
}

fn cpu() -> Device {
    Device::open("cpu", &Config::default()).unwrap()
}

#[test]
fn the_small_shape_matches_a_float64_reference() {
    // BF16 weights: the products take f32 activations, so only the f16 KV
    // cache separates the runtime from the reference and no routing
    // choice is near the noise.
    let file = tiny(FileType::BF16, 7);
    let reference = Reference::new(&file);
    let model = Model::load(&file, &cpu(), KernelSet::Default).unwrap();
    let c = model.config.experts.unwrap();
    assert_eq!((c.count, c.used, c.ff, c.norm_weights), (8, 2, 128, true));
    assert!(!model.can_record_graphs());
    // Graphs asked for: the session runs eagerly.
    let mut session = Session::new(model, 32, true).unwrap();
    let mut tokens: Vec<u32> = vec![5, 77, 200, 1300, 99];
    let logits = session.prefill(&tokens).unwrap();
    compare(&logits, &reference.logits(&tokens), "prefill");
    for (step, next) in [17u32, 3001, 64].into_iter().enumerate() {
        session.step(next).unwrap();
        tokens.push(next);
        let logits = session.logits().unwrap();
        compare(&logits, &reference.logits(&tokens), &format!("step {step}"));
    }
}

#[test]
fn the_small_q4_k_m_shape_loads_and_generates() {
    let file = tiny(FileType::Q4_K_M, 3);
    let types: Vec<DType> = ["blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_exps.weight"]
        .iter()
        .map(|n| file.tensor(n).unwrap().dtype)
        .collect();
    assert_eq!(types, [DType::F32, DType::Q4_K]);
    let engine = Engine::from_gguf(&file, &cpu(), &EngineOptions::default()).unwrap();
    let out = engine
        .generate("hello", &GenerateOptions::greedy(6), |_| true)
        .unwrap();
    assert!(out.prompt_tokens > 0);
    assert!(!out.tokens.is_empty() && out.tokens.len() <= 6);
    // Greedy decoding on the session's eager path agrees with itself.
    let mut session = engine.session(64).unwrap();
    let prompt = engine.prompt_tokens("hello", true).unwrap();
    let first = session.prefill(&prompt).unwrap();
    let argmax = first
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0 as u32;
    let mut greedy = Vec::new();
    session
        .decode_greedy(argmax, 4, 2, |t| {
            greedy.push(t);
            Ok(true)
        })
        .unwrap();
    assert_eq!(greedy.len(), 4);
}

/// `base` rewritten: metadata keys renamed by `rename`, the architecture
/// set to `arch`, and `extra` tensors (f32 zeros) added.
fn rewritten(base: &GgufFile, arch: &str, extra: &[(&str, &[u64])]) -> GgufFile {
    let mut w = GgufWriter::new();
    for (key, value) in base.metadata() {
        let key = match key.strip_prefix("qwen3moe.") {
            Some(rest) => format!("{arch}.{rest}"),
            None => key.clone(),
        };
        w.add_metadata(key, value.clone());
    }
    w.add_metadata("general.architecture", Value::String(arch.into()));
    for t in base.tensors() {
        w.add_tensor(&t.name, &t.dims, t.dtype, base.tensor_data(t).to_vec())
            .unwrap();
    }
    for (name, dims) in extra {
        let n: u64 = dims.iter().product();
        w.add_tensor(*name, dims, DType::F32, vec![0u8; n as usize * 4])
            .unwrap();
    }
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

#[test]
fn an_unknown_expert_layout_is_refused_naming_it() {
    let base = tiny(FileType::Q8_0, 1);
    // Experts in an architecture without them (a Mixtral-style `llama`).
    let llama = rewritten(&base, "llama", &[]);
    // A shared expert, which Qwen3-MoE does not have.
    let shared = rewritten(
        &base,
        "qwen3moe",
        &[("blk.1.ffn_gate_shexp.weight", &[256, 64])],
    );
    for (file, arch, tensor) in [
        (llama, "llama", "blk.0.ffn_gate_inp.weight"),
        (shared, "qwen3moe", "blk.1.ffn_gate_shexp.weight"),
    ] {
        let e = match Model::load(&file, &cpu(), KernelSet::Default) {
            Ok(_) => panic!("{tensor} was accepted"),
            Err(e) => e,
        };
        assert!(matches!(e, LlmError::Model(_)), "{e:?}");
        let message = e.to_string();
        assert!(
            message.contains(tensor) && message.contains(arch),
            "{message}"
        );
    }
}
