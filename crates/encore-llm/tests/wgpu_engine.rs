//! The engine on a wgpu device against the engine on the CPU.
//!
//! The device is `ENCORE_TEST_WGPU` (default `wgpu:0`: Mesa's lavapipe in
//! CI, NVIDIA's Vulkan driver on the GPU machine). The default model is
//! fetched on first use like `encore generate` does, or taken from
//! `ENCORE_TEST_MODEL`.

// Helpers fail a test the way assertions do: by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::OnceLock;

use encore::{Config, Device};
use encore_llm::sampler::greedy;
use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use encore_llm::{Engine, EngineOptions};

#[path = "common/follow.rs"]
mod follow;
use follow::{follow_cpu, greedy_tokens, relative_error};

fn wgpu_name() -> String {
    std::env::var("ENCORE_TEST_WGPU")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "wgpu:0".into())
}

fn device(name: &str) -> Device {
    Device::open(name, &Config::default()).unwrap_or_else(|e| {
        panic!(
            "device {name}: {e} (the wgpu tests need a Vulkan, Metal or DirectX 12 adapter; \
             on Debian `apt-get install mesa-vulkan-drivers` gives lavapipe)"
        )
    })
}

fn options(graphs: bool) -> EngineOptions {
    EngineOptions {
        graphs,
        ..EngineOptions::default()
    }
}

fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| match std::env::var_os("ENCORE_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => encore_llm::fetch::default_model(|p| eprintln!("{p:?}"))
            .expect("fetch the default model"),
    })
    .clone()
}

/// Logits relative error allowed between the wgpu device and the CPU on the
/// default model: the CPU quantizes activations to 8 bits before every
/// quantized product (as ggml does), the WGSL products multiply in f32, and
/// the difference runs through 30 layers (as on CUDA, whose kernels
/// multiply the same way).
const LOGITS_TOLERANCE: f32 = 0.1;

/// The default model's raw prompts.
const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):",
    "In 1969, the first",
    "Water boils at",
];

/// Several prompts, 16 decode steps each through the replayed decode graph,
/// the wgpu session fed the CPU's greedy tokens: logits within the
/// tolerance at every step, the same token wherever the CPU's choice is not
/// a near-tie; then free-running greedy text, which must equal the CPU's
/// up to the first step where the CPU's choice was a near-tie.
#[test]
fn default_model_on_wgpu_follows_the_cpu() {
    let path = model_path();
    let cpu = Engine::load(&path, &device("cpu"), &options(true)).unwrap();
    let gpu = Engine::load(&path, &device(&wgpu_name()), &options(true)).unwrap();
    let steps = 16;
    let (mut agreed, mut close_calls, mut worst) = (0, 0, 0f32);
    for prompt in PROMPTS {
        let tokens = cpu.prompt_tokens(prompt, true).unwrap();
        let mut sessions = vec![
            cpu.session(tokens.len() + 2 * steps + 2).unwrap(),
            gpu.session(tokens.len() + 2 * steps + 2).unwrap(),
        ];
        let logits: Vec<Vec<f32>> = sessions
            .iter_mut()
            .map(|s| s.prefill(&tokens).unwrap())
            .collect();
        let err = relative_error(&logits[1], &logits[0]);
        assert!(
            err <= LOGITS_TOLERANCE,
            "{prompt:?}: prefill logits differ by {err:.2e}"
        );
        let first = greedy(&logits[0]);
        let f = follow_cpu(&mut sessions, first, steps, LOGITS_TOLERANCE, |_, _| {});
        eprintln!(
            "{prompt:?}: {}/{steps} tokens equal ({} near-ties), worst logits relative error {:.2e}",
            f.agreed,
            f.close_calls,
            f.worst.max(err)
        );
        agreed += f.agreed;
        close_calls += f.close_calls;
        worst = worst.max(f.worst).max(err);
    }
    let total = PROMPTS.len() * steps;
    println!(
        "default model on {}: {agreed}/{total} greedy tokens equal to the CPU's ({close_calls} \
         near-ties), worst logits relative error {worst:.2e}",
        wgpu_name()
    );
    assert_eq!(agreed + close_calls, total);
}

/// Free-running greedy text through the self-feeding graph equals the
/// text of the eager steps on the same device: the replayed graph and its
/// parameters change nothing.
#[test]
fn greedy_text_on_wgpu_is_the_same_replayed_or_eager() {
    let path = model_path();
    let gpu = device(&wgpu_name());
    let replayed = Engine::load(&path, &gpu, &options(true)).unwrap();
    let eager = Engine::load(&path, &gpu, &options(false)).unwrap();
    let steps = 12;
    for prompt in &PROMPTS[..2] {
        let texts: Vec<Vec<u32>> = [&replayed, &eager]
            .iter()
            .map(|e| {
                let tokens = e.prompt_tokens(prompt, true).unwrap();
                let mut s = e.session(tokens.len() + steps + 2).unwrap();
                let first = greedy(&s.prefill(&tokens).unwrap());
                greedy_tokens(&mut s, first, steps)
            })
            .collect();
        assert_eq!(texts[0], texts[1], "{prompt:?}");
    }
}

/// A synthetic SmolLM2 (the default model's shapes and types, random
/// weights) written to `ENCORE_SYNTHETIC_GGUF` when that names a file that
/// does not exist yet, for `encore bench` on machines that cannot fetch the
/// model (`scripts/gpu-run.sh wgpu`).
#[test]
#[ignore = "writes a benchmark model; run by scripts/gpu-run.sh wgpu"]
fn write_the_synthetic_default_model() {
    let Some(path) = std::env::var_os("ENCORE_SYNTHETIC_GGUF").map(PathBuf::from) else {
        panic!("set ENCORE_SYNTHETIC_GGUF to the file to write");
    };
    if !path.exists() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(&path, synthetic_gguf(&SyntheticSpec::smollm2_135m(7))).unwrap();
    }
}
