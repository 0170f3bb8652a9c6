//! The engine on CUDA against the engine on the CPU, and CUDA decode speed.
//!
//! A synthetic Llama model (random weights, real architecture) runs a
//! prefill and decode steps replayed from a captured graph on both devices.
//! The tests need a CUDA GPU and are ignored by default;
//! `scripts/gpu-suite.sh` builds and stages this binary and
//! `scripts/gpu-run.sh` runs it on the GPU machine with `--ignored`.

// Helpers fail a test the way assertions do: by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use encore::{Config, Device};
use encore_llm::gguf::GgufFile;
use encore_llm::sampler::greedy;
use encore_llm::synthetic::{synthetic_gguf, synthetic_like, SyntheticSpec};
use encore_llm::{Engine, EngineOptions, Session};
use encore_ops::KernelSet;

#[path = "common/follow.rs"]
mod follow;
use follow::{follow_cpu, greedy_tokens, relative_error};

fn device(name: &str) -> Device {
    device_with(name, true)
}

fn device_with(name: &str, fusion: bool) -> Device {
    open_device(name, |c| c.fusion = fusion)
}

/// An engine's options: the default kernels, decode steps replayed as
/// graphs or encoded eagerly.
fn options(graphs: bool) -> EngineOptions {
    EngineOptions {
        graphs,
        ..EngineOptions::default()
    }
}

/// The options of an engine with the exact kernels ([`KernelSet::Exact`]).
fn exact() -> EngineOptions {
    EngineOptions {
        kernels: KernelSet::Exact,
        ..EngineOptions::default()
    }
}

/// The device `name` with `edit` applied to the test configuration.
fn open_device(name: &str, edit: impl FnOnce(&mut Config)) -> Device {
    if name != "cpu" {
        warm_kernel_cache();
    }
    let mut config = Config {
        cache_dir: Some(cache_dir()),
        ..Config::default()
    };
    edit(&mut config);
    Device::open(name, &config).unwrap_or_else(|e| panic!("device {name}: {e}"))
}

/// The kernel cache directory: `ENCORE_CACHE_DIR` where it names one
/// (`scripts/gpu-run.sh` shares one between the suite's binaries), else one
/// private to this test process.
fn cache_dir() -> PathBuf {
    std::env::var_os("ENCORE_CACHE_DIR")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("encore-cuda-engine-{}", std::process::id()))
        })
}

/// Compiles the generic code of every kernel, default and exact versions,
/// into the kernel cache once per process and all at once (NVRTC compiles
/// on one core), so that each engine's device loads them from the cache
/// instead of compiling them one after another.
fn warm_kernel_cache() {
    static WARM: OnceLock<()> = OnceLock::new();
    WARM.get_or_init(|| {
        let config = Config {
            cache_dir: Some(cache_dir()),
            ..Config::default()
        };
        let device = Device::open("cuda", &config).unwrap_or_else(|e| panic!("device cuda: {e}"));
        encore_ops::kernels::load_all(&device, &[KernelSet::Default, KernelSet::Exact])
            .unwrap_or_else(|e| panic!("warming the kernel cache: {e}"));
    });
}

/// The index of the first element whose bits differ, if any.
/// A session of each engine with room for `prompt` and `steps` more
/// tokens, each prefilled with `prompt`, and the logits each prefill gave.
fn prefilled(engines: &[&Engine], prompt: &[u32], steps: usize) -> (Vec<Session>, Vec<Vec<f32>>) {
    let mut sessions: Vec<Session> = engines
        .iter()
        .map(|e| e.session(prompt.len() + steps + 1).unwrap())
        .collect();
    let logits = sessions
        .iter_mut()
        .map(|s| s.prefill(prompt).unwrap())
        .collect();
    (sessions, logits)
}

fn first_difference(a: &[f32], b: &[f32]) -> Option<usize> {
    assert_eq!(a.len(), b.len());
    (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits())
}

/// Logits relative error allowed between CUDA and the CPU: the CPU quantizes
/// activations to 8 bits before every quantized product (as ggml does), CUDA
/// multiplies in f32 (or, in its one-row products of weights in blocks of
/// 32, quantizes them in its own way: scales in f32, the norm applied
/// after the product), and the difference runs through every layer.
const LOGITS_TOLERANCE: f32 = 0.03;

/// The default model, when `ENCORE_TEST_MODEL` names its file (the GPU
/// machine cannot fetch it; `scripts/gpu-run.sh real` sets it). Raw prompts,
/// CUDA fed the CPU's greedy tokens: logits within the tolerance at every
/// step, the same token wherever the CPU's choice is not a near-tie.
///
/// Free-running greedy text is a weaker check across backends than it
/// looks: the CPU quantizes every product's input to 8 bits, so a one-ulp
/// difference anywhere (a different summation order, a different `expf`)
/// flips some quantization steps and grows into different text within a
/// few tokens; on the CPU alone, one-ulp noise in the products' outputs
/// changes most 32-token continuations (BENCHMARKS.md, "Greedy agreement").
/// [`LOGITS_TOLERANCE`] for the default model: its 30 layers carry the
/// 8-bit activation error further than the synthetic model's (the first
/// prompt's prefill logits differed by 4.95e-2 on an H200).
const REAL_LOGITS_TOLERANCE: f32 = 0.1;

/// The default model's file, named by `ENCORE_TEST_MODEL` (the GPU machine
/// cannot fetch it; `scripts/gpu-run.sh real` sets it).
fn real_model_path() -> PathBuf {
    std::env::var_os("ENCORE_TEST_MODEL")
        .map(PathBuf::from)
        .expect("ENCORE_TEST_MODEL names the default model's GGUF file")
}

/// The raw prompts the default model's tests continue (the same as
/// `scripts/gpu-run.sh`'s).
const REAL_PROMPTS: [&str; 8] = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox",
    "In 1969, the first",
    "Water boils at",
    "My favorite food is",
    "The meaning of life is",
];

#[test]
#[ignore = "needs a CUDA GPU and ENCORE_TEST_MODEL; run with scripts/gpu-run.sh real"]
fn real_model_on_cuda_follows_the_cpu() {
    let path = real_model_path();
    let cpu = Engine::load(&path, &device("cpu"), &options(true)).unwrap();
    let gpu = Engine::load(&path, &device("cuda"), &options(true)).unwrap();
    let prompts = REAL_PROMPTS;
    let steps = 32;
    let (mut agreed, mut close_calls, mut worst) = (0, 0, 0f32);
    for prompt in prompts {
        let tokens = cpu.prompt_tokens(prompt, true).unwrap();
        let mut sessions = vec![
            cpu.session(tokens.len() + steps + 1).unwrap(),
            gpu.session(tokens.len() + steps + 1).unwrap(),
        ];
        let logits: Vec<Vec<f32>> = sessions
            .iter_mut()
            .map(|s| s.prefill(&tokens).unwrap())
            .collect();
        let err = relative_error(&logits[1], &logits[0]);
        assert!(
            err <= REAL_LOGITS_TOLERANCE,
            "{prompt:?}: prefill logits differ by {err:.2e}"
        );
        let first = greedy(&logits[0]);
        let f = follow_cpu(
            &mut sessions,
            first,
            steps,
            REAL_LOGITS_TOLERANCE,
            |_, _| {},
        );
        eprintln!(
            "{prompt:?}: {}/{steps} tokens equal ({} near-ties), worst logits relative error {:.2e}",
            f.agreed, f.close_calls, f.worst.max(err)
        );
        agreed += f.agreed;
        close_calls += f.close_calls;
        worst = worst.max(f.worst).max(err);
    }
    let total = prompts.len() * steps;
    println!(
        "real model, CUDA fed the CPU's tokens: {agreed}/{total} greedy tokens equal \
         ({close_calls} near-ties), worst logits relative error {worst:.2e}"
    );
    assert!(
        agreed * 10 >= total * 9,
        "only {agreed}/{total} greedy tokens equal"
    );
}

#[test]
#[ignore = "needs a CUDA GPU and ENCORE_TEST_MODEL; run with scripts/gpu-run.sh real"]
fn real_model_on_cuda_exact_generates_the_cpus_text() {
    // With the exact kernels, free-running greedy text on CUDA is the
    // CPU's: 32 tokens of each prompt, raw and through the chat template.
    let path = real_model_path();
    let cpu = Engine::load(&path, &device("cpu"), &options(true)).unwrap();
    let gpu = Engine::load(&path, &device("cuda"), &exact()).unwrap();
    let prompts = REAL_PROMPTS;
    let steps = 32;
    let mut equal = 0;
    for prompt in prompts {
        for raw in [true, false] {
            let tokens = cpu.prompt_tokens(prompt, raw).unwrap();
            let mut sessions = [
                cpu.session(tokens.len() + steps + 1).unwrap(),
                gpu.session(tokens.len() + steps + 1).unwrap(),
            ];
            let logits: Vec<Vec<f32>> = sessions
                .iter_mut()
                .map(|s| s.prefill(&tokens).unwrap())
                .collect();
            let first = greedy(&logits[0]);
            let text: Vec<Vec<u32>> = sessions
                .iter_mut()
                .map(|s| greedy_tokens(s, first, steps))
                .collect();
            let same = text[1] == text[0] && greedy(&logits[1]) == first;
            eprintln!(
                "{prompt:?} (raw {raw}, {} prompt tokens): {}",
                tokens.len(),
                if same { "same text" } else { "TEXT DIFFERS" }
            );
            equal += same as usize;
        }
    }
    let total = prompts.len() * 2;
    println!("real model, exact kernels: {equal}/{total} greedy continuations of 32 tokens equal the CPU's");
    assert_eq!(equal, total, "exact CUDA text differs from the CPU's");
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn synthetic_model_on_cuda_matches_cpu_with_graph_replay() {
    let file = GgufFile::from_bytes(synthetic_gguf(&SyntheticSpec::tiny(7))).unwrap();
    let cpu = Engine::from_gguf(&file, &device("cpu"), &options(true)).unwrap();
    let gpu = Engine::from_gguf(&file, &device("cuda"), &options(true)).unwrap();
    let eager = Engine::from_gguf(&file, &device("cuda"), &options(false)).unwrap();
    let unfused = Engine::from_gguf(&file, &device_with("cuda", false), &options(true)).unwrap();
    let vocab = cpu.model().config.vocab as u32;
    let prompt: Vec<u32> = (0..13u32).map(|i| (i * 37 + 5) % vocab).collect();
    let steps = 24;

    let (mut sessions, logits) = prefilled(&[&cpu, &gpu, &eager, &unfused], &prompt, steps);
    let err = relative_error(&logits[1], &logits[0]);
    eprintln!("prefill: CUDA vs CPU logits relative error {err:.2e}");
    assert!(
        err <= LOGITS_TOLERANCE,
        "prefill logits differ by {err:.2e}"
    );
    assert_eq!(logits[1], logits[2], "graph and eager CUDA prefill differ");

    // Greedy decoding, every session fed the CPU's choice so that one close
    // call cannot send the devices down different paths.
    let first = greedy(&logits[0]);
    let follow = follow_cpu(&mut sessions, first, steps, LOGITS_TOLERANCE, |step, l| {
        // Replaying the unfused graph changes nothing. The fused decode
        // products of this model's Q4_1 weights quantize their input to 8
        // bits where the unfused ones multiply f32 activations: the
        // CPU comparison's tolerance.
        assert_eq!(
            l[3], l[2],
            "step {step}: unfused graph replay and eager CUDA differ"
        );
        let fused_err = relative_error(&l[1], &l[2]);
        assert!(
            fused_err <= LOGITS_TOLERANCE,
            "step {step}: fused and unfused CUDA differ by {fused_err:.2e}"
        );
    });
    let (agreed, close_calls, worst) = (follow.agreed, follow.close_calls, follow.worst);
    eprintln!(
        "decode: {agreed}/{steps} greedy tokens equal ({close_calls} near-ties), \
         worst logits relative error {worst:.2e}"
    );
    assert!(gpu.model().device.counters().dispatches > 0);
    assert!(
        sessions[1].graph_stats().is_some(),
        "CUDA decode did not use a graph"
    );
    assert!(
        agreed * 10 >= steps * 9,
        "only {agreed}/{steps} greedy tokens equal"
    );
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn synthetic_model_long_prefill_on_cuda_matches_cpu() {
    // Prompts long enough for CUDA's tiled tensor-core products (which
    // round activations to f16): a first chunk, then a second one after it
    // in the cache, then decode steps; CUDA's logits stay within the CPU
    // comparison's tolerance throughout.
    let file = GgufFile::from_bytes(synthetic_gguf(&SyntheticSpec::tiny(11))).unwrap();
    let cpu = Engine::from_gguf(&file, &device("cpu"), &options(true)).unwrap();
    let gpu = Engine::from_gguf(&file, &device("cuda"), &options(true)).unwrap();
    let vocab = cpu.model().config.vocab as u32;
    let first: Vec<u32> = (0..100u32).map(|i| (i * 53 + 3) % vocab).collect();
    let second: Vec<u32> = (0..40u32).map(|i| (i * 29 + 1) % vocab).collect();
    let mut sessions: Vec<Session> = [&cpu, &gpu]
        .iter()
        .map(|e| e.session(first.len() + second.len() + 9).unwrap())
        .collect();
    for (chunk, what) in [(&first, "first prefill"), (&second, "second prefill")] {
        let l: Vec<Vec<f32>> = sessions
            .iter_mut()
            .map(|s| s.prefill(chunk).unwrap())
            .collect();
        let err = relative_error(&l[1], &l[0]);
        eprintln!("{what}: CUDA vs CPU logits relative error {err:.2e}");
        assert!(
            err <= LOGITS_TOLERANCE,
            "{what}: logits differ by {err:.2e}"
        );
    }
    for step in 0..8u32 {
        for s in sessions.iter_mut() {
            s.step((step * 31 + 7) % vocab).unwrap();
        }
        let l: Vec<Vec<f32>> = sessions.iter().map(|s| s.logits().unwrap()).collect();
        let err = relative_error(&l[1], &l[0]);
        assert!(
            err <= LOGITS_TOLERANCE,
            "step {step} after the long prefill: logits differ by {err:.2e}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn synthetic_model_exact_on_cuda_equals_the_cpu_bit_for_bit() {
    // With the exact kernels CUDA computes what the CPU computes: the
    // prefill's logits bit for bit (a short prompt, and one long enough for
    // the tiled attention path), then free-running greedy text, and the
    // logits after it.
    let file = GgufFile::from_bytes(synthetic_gguf(&SyntheticSpec::tiny(7))).unwrap();
    let cpu = Engine::from_gguf(&file, &device("cpu"), &options(true)).unwrap();
    let gpu = Engine::from_gguf(&file, &device("cuda"), &exact()).unwrap();
    let vocab = cpu.model().config.vocab as u32;
    let steps = 32;
    for len in [13u32, 100] {
        let prompt: Vec<u32> = (0..len).map(|i| (i * 37 + 5) % vocab).collect();
        let (mut sessions, logits) = prefilled(&[&cpu, &gpu], &prompt, steps);
        if let Some(i) = first_difference(&logits[1], &logits[0]) {
            panic!(
                "{len}-token prefill: logit {i}: CUDA {} vs CPU {} (relative error {:.2e} overall)",
                logits[1][i],
                logits[0][i],
                relative_error(&logits[1], &logits[0])
            );
        }
        let first = greedy(&logits[0]);
        let tokens: Vec<Vec<u32>> = sessions
            .iter_mut()
            .map(|s| greedy_tokens(s, first, steps))
            .collect();
        assert_eq!(tokens[1], tokens[0], "{len}-token prompt: greedy tokens");
        for s in sessions.iter_mut() {
            s.step(tokens[0][steps - 1]).unwrap();
        }
        assert!(
            sessions[1].graph_stats().is_some(),
            "CUDA decode did not use a graph"
        );
        let after: Vec<Vec<f32>> = sessions.iter().map(|s| s.logits().unwrap()).collect();
        assert_eq!(
            first_difference(&after[1], &after[0]),
            None,
            "{len}-token prompt: logits after {steps} tokens"
        );
    }
}

/// The catalog models' headers (their tensor data need not be there: a
/// sparse file does), in the folder `ENCORE_MODEL_TEMPLATES` names;
/// `scripts/gpu-suite.sh` stages them and `scripts/gpu-run.sh` sets it.
fn model_templates() -> Vec<PathBuf> {
    gguf_files_in("ENCORE_MODEL_TEMPLATES", "a folder of model headers")
}

/// The `.gguf` files of the folder the environment variable `var` names
/// (`what` says what it holds), in name order; at least one.
fn gguf_files_in(var: &str, what: &str) -> Vec<PathBuf> {
    let dir = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("{var} names {what}"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .gguf in {}", dir.display());
    files
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn catalog_shaped_models_on_cuda_match_cpu() {
    // Random weights in the catalog models' architectures and tensor types
    // (Qwen2.5-Coder's and Gemma 3's Q4_K_M mixes): the prefill (through
    // the tiled products) and graph-replayed decode steps (through the
    // fused ones) on CUDA against the CPU, fed the CPU's tokens, with the
    // default kernels (fused and not) and the exact ones. With
    // `ENCORE_SYNTHETIC_DIR` set, each model is also written there for
    // `encore bench` and llama.cpp's `llama-bench`.
    let mut exact_steps = Vec::new();
    for template in model_templates() {
        let name = template.file_name().unwrap().to_string_lossy().to_string();
        let bytes = synthetic_like(&GgufFile::open(&template).unwrap(), 3);
        if let Some(dir) = std::env::var_os("ENCORE_SYNTHETIC_DIR") {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(PathBuf::from(dir).join(&name), &bytes).unwrap();
        }
        let file = GgufFile::from_bytes(bytes).unwrap();
        let cpu = Engine::from_gguf(&file, &device("cpu"), &options(true)).unwrap();
        let gpu = Engine::from_gguf(&file, &device("cuda"), &options(true)).unwrap();
        let unfused =
            Engine::from_gguf(&file, &device_with("cuda", false), &options(true)).unwrap();
        let exact_gpu = Engine::from_gguf(&file, &device("cuda"), &exact()).unwrap();
        let vocab = cpu.model().config.vocab as u32;
        let prompt: Vec<u32> = (0..80u32).map(|i| (i * 7919 + 11) % vocab).collect();
        let steps = 16;
        let (mut sessions, logits) = prefilled(&[&cpu, &gpu, &unfused, &exact_gpu], &prompt, steps);
        let err = relative_error(&logits[1], &logits[0]);
        eprintln!(
            "{name}: prefill logits relative error {err:.2e} (unfused {:.2e}, exact {:.2e})",
            relative_error(&logits[2], &logits[0]),
            relative_error(&logits[3], &logits[0])
        );
        let first = greedy(&logits[0]);
        let mut exact_equal = 0;
        let f = follow_cpu(&mut sessions, first, steps, f32::INFINITY, |step, l| {
            eprintln!(
                "{name}: step {step}: relative error {:.2e}, unfused {:.2e}, exact {:.2e}",
                relative_error(&l[1], &l[0]),
                relative_error(&l[2], &l[0]),
                relative_error(&l[3], &l[0])
            );
            exact_equal += usize::from(l[3] == l[0]);
        });
        eprintln!(
            "{name}: decode {}/{steps} greedy tokens equal ({} near-ties), worst {:.2e}; \
             exact kernels bit-identical at {exact_equal}/{steps} steps",
            f.agreed, f.close_calls, f.worst
        );
        // The exact kernels compute what the CPU computes, bit for bit, at
        // every step: the whole pipeline (biases, QK-norm, windows, every
        // weight type, graph replay) is the CPU's. The default kernels keep
        // activations in f32 (or round them to 8 bits in their own way)
        // where the CPU rounds them to 8 bits; on random
        // weights a few steps' logits are ill-conditioned (on an H100 the
        // Qwen-shaped model's steps ran at 3e-3 to 1e-2 with three steps at
        // 5e-2 to 0.17, exact at 0 throughout), so they are held to greedy
        // agreement, not to a per-step bound.
        // The default kernels' checks first, for every model: the exact
        // kernels' are held to the end, so that a host where they cannot
        // match (an AVX-512 CPU: README) still checks the rest.
        assert!(
            err <= REAL_LOGITS_TOLERANCE,
            "{name}: prefill logits differ by {err:.2e}"
        );
        assert!(
            f.agreed * 10 >= steps * 9,
            "{name}: only {}/{steps} greedy tokens equal",
            f.agreed
        );
        exact_steps.push((name, exact_equal));
    }
    for (name, exact_equal) in exact_steps {
        assert_eq!(exact_equal, 16, "{name}: exact kernels differ from the CPU");
    }
}

/// Where the synthetic SmolLM2 is also written for `encore bench`, if set.
fn bench_model_path() -> Option<PathBuf> {
    std::env::var_os("ENCORE_SYNTHETIC_GGUF").map(PathBuf::from)
}

/// Decodes `tokens` tokens greedily after a short prompt; tokens per second.
fn decode_speed(engine: &Engine, tokens: usize) -> f64 {
    let mut session = engine.session(16 + tokens + 8).unwrap();
    let prompt: Vec<u32> = (0..16u32).map(|i| i * 7919 % 49152).collect();
    session.prefill(&prompt).unwrap();
    let mut token = prompt[prompt.len() - 1];
    // Warm-up: records and instantiates the decode graph.
    for _ in 0..4 {
        session.step(token).unwrap();
        token = session.argmax().unwrap();
    }
    let start = Instant::now();
    for _ in 0..tokens {
        session.step(token).unwrap();
        token = session.argmax().unwrap();
    }
    tokens as f64 / start.elapsed().as_secs_f64()
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn synthetic_smollm2_decode_speed_on_cuda() {
    let bytes = synthetic_gguf(&SyntheticSpec::smollm2_135m(1));
    if let Some(path) = bench_model_path() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(&path, &bytes).unwrap();
        eprintln!("wrote {} ({} MB)", path.display(), bytes.len() >> 20);
    }
    let file = GgufFile::from_bytes(bytes).unwrap();
    for graphs in [true, false] {
        let engine = Engine::from_gguf(&file, &device("cuda"), &options(graphs)).unwrap();
        let weights = engine.model().weight_bytes() as f64;
        let tok_s = decode_speed(&engine, 128);
        println!(
            "synthetic SmolLM2-135M Q4_1 on {}: decode {tok_s:.1} tok/s ({}), {:.0} GB/s of weights",
            engine.model().device.name(),
            if graphs { "graph replay" } else { "eager" },
            tok_s * weights / 1e9
        );
        assert!(tok_s > 0.0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn decode_greedy_on_cuda_equals_one_step_at_a_time() {
    // The same kernels either way, so the same tokens, bit for bit; the
    // self-feeding graph only moves the argmax and position on the device.
    let file = GgufFile::from_bytes(synthetic_gguf(&SyntheticSpec::tiny(9))).unwrap();
    let gpu = Engine::from_gguf(&file, &device("cuda"), &options(true)).unwrap();
    let prompt: Vec<u32> = (0..11u32).map(|i| (i * 29 + 3) % 64).collect();
    let steps = 40;
    let mut a = gpu.session(prompt.len() + steps + 1).unwrap();
    let mut b = gpu.session(prompt.len() + steps + 1).unwrap();
    let first = greedy(&a.prefill(&prompt).unwrap());
    assert_eq!(greedy(&b.prefill(&prompt).unwrap()), first);
    let mut token = first;
    let want: Vec<u32> = (0..steps)
        .map(|_| {
            a.step(token).unwrap();
            token = a.argmax().unwrap();
            token
        })
        .collect();
    let mut got = Vec::new();
    b.decode_greedy(first, steps, 8, |t| {
        got.push(t);
        Ok(true)
    })
    .unwrap();
    assert_eq!(got, want);
    assert_eq!(b.position(), a.position());
    assert_eq!(b.step_times().len(), steps, "device time of every step");
}

/// The full-size model files named by `ENCORE_FULL_SIZE_MODELS` (a folder of
/// `.gguf` files; `scripts/gpu-full-size.sh` writes the 7B shape there with
/// `encore_llm::synthetic`).
fn full_size_models() -> Vec<PathBuf> {
    gguf_files_in(
        "ENCORE_FULL_SIZE_MODELS",
        "a folder of full-size model files",
    )
}

#[test]
#[ignore = "needs a CUDA GPU and ENCORE_FULL_SIZE_MODELS; run with scripts/gpu-full-size.sh"]
fn full_size_models_on_cuda_match_cpu() {
    // Full-size shapes (7B and up, realistic weights): the default CUDA
    // kernels against the CPU on the three paths a user runs: a 320-token
    // prefill (the products of long prompts, on dequantized f16 tiles),
    // 64 graph-replayed decode steps fed the CPU's tokens, and the paged
    // batch of the server (two sequences' prompts as prompt rows, then
    // decode rows, logits of every row compared). Logits within
    // REAL_LOGITS_TOLERANCE of the CPU's (relative to their largest
    // magnitude) everywhere, and finite.
    use encore_llm::batch::{BatchRunner, Output, Row, RowResult};
    for path in full_size_models() {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let cpu = Engine::load(&path, &device("cpu"), &options(true)).unwrap();
        let gpu = Engine::load(&path, &device("cuda"), &options(true)).unwrap();
        let vocab = cpu.model().config.vocab as u32;
        let prompt: Vec<u32> = (0..320u32).map(|i| (i * 7919 + 11) % vocab).collect();
        assert!(prompt.len() >= encore_ops::kernels::gemm_dense::DENSE_MIN_ROWS);
        let steps = 64;
        let (mut sessions, logits) = prefilled(&[&cpu, &gpu], &prompt, steps);
        let err = relative_error(&logits[1], &logits[0]);
        eprintln!("{name}: prefill logits relative error {err:.2e}");
        assert!(
            err <= REAL_LOGITS_TOLERANCE,
            "{name}: prefill logits differ by {err:.2e}"
        );
        let f = follow_cpu(
            &mut sessions,
            greedy(&logits[0]),
            steps,
            REAL_LOGITS_TOLERANCE,
            |_, _| {},
        );
        eprintln!(
            "{name}: decode {}/{steps} greedy tokens equal ({} near-ties), worst {:.2e}",
            f.agreed, f.close_calls, f.worst
        );

        // The server's path: blocks of 16, sequence a at blocks 1..=7, b at 8..=14.
        let (a, b): (Vec<u32>, Vec<u32>) = ((1..=7).collect(), (8..=14).collect());
        let mut runners: Vec<BatchRunner> = [&cpu, &gpu]
            .iter()
            .map(|e| BatchRunner::new(e.model().clone(), 16, 16, 7, true).unwrap())
            .collect();
        fn row(table: &[u32], position: usize, token: u32, decode: bool) -> Row<'_> {
            Row {
                token,
                position,
                table,
                decode,
                group: 0,
            }
        }
        let logits_of = |results: Vec<RowResult>| -> Vec<Vec<f32>> {
            results
                .into_iter()
                .map(|r| match r {
                    RowResult::Logits(l) => l,
                    other => panic!("asked for logits, got {other:?}"),
                })
                .collect()
        };
        let (len_a, len_b) = (40usize, 23usize);
        let mut rows: Vec<Row<'_>> = (0..len_a).map(|p| row(&a, p, prompt[p], false)).collect();
        rows.extend((0..len_b).map(|p| row(&b, p, prompt[50 + p], false)));
        let outputs = [len_a - 1, len_a + len_b - 1].map(|row| Output { row, greedy: false });
        let mut worst = 0f32;
        let mut step_logits: Vec<Vec<Vec<f32>>> = runners
            .iter_mut()
            .map(|r| logits_of(r.run(&rows, &outputs).unwrap()))
            .collect();
        for step in 0..8 {
            for (i, (want, got)) in step_logits[0].iter().zip(&step_logits[1]).enumerate() {
                let err = relative_error(got, want);
                worst = worst.max(err);
                assert!(
                    err <= REAL_LOGITS_TOLERANCE,
                    "{name}: paged step {step}, sequence {i}: logits differ by {err:.2e}"
                );
            }
            // Both devices continue with the CPU's greedy tokens.
            let (ta, tb) = (greedy(&step_logits[0][0]), greedy(&step_logits[0][1]));
            let rows = [
                row(&a, len_a + step, ta, true),
                row(&b, len_b + step, tb, true),
            ];
            let outputs = [0, 1].map(|row| Output { row, greedy: false });
            step_logits = runners
                .iter_mut()
                .map(|r| logits_of(r.run(&rows, &outputs).unwrap()))
                .collect();
        }
        eprintln!(
            "{name}: paged batch, 8 steps of 2 sequences: worst logits relative error {worst:.2e}"
        );
    }
}
