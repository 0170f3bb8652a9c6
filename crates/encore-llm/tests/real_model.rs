//! The default model (SmolLM2-135M-Instruct Q4_1), fetched on first use like
//! `encore generate` does (or taken from `ENCORE_TEST_MODEL`): greedy
//! continuations of raw prompts are deterministic, identical with and
//! without graph replay, and sensible.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::OnceLock;

use encore::{Config, Device};
use encore_llm::{Engine, EngineOptions, GenerateOptions};

fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| match std::env::var_os("ENCORE_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => encore_llm::fetch::default_model(|p| eprintln!("{p:?}"))
            .expect("fetch the default model"),
    })
    .clone()
}

fn engine(graphs: bool) -> Engine {
    let options = EngineOptions {
        graphs,
        ..EngineOptions::default()
    };
    let device = Device::open("cpu", &Config::default()).unwrap();
    Engine::load(model_path(), &device, &options).unwrap()
}

fn greedy(engine: &Engine, prompt: &str, n: usize) -> String {
    engine
        .generate(prompt, &GenerateOptions::greedy(n), |_| true)
        .unwrap()
        .text
}

#[test]
fn greedy_continuations_are_sensible() {
    let e = engine(true);
    let paris = greedy(&e, "The capital of France is", 8);
    assert!(paris.contains("Paris"), "{paris:?}");
    let code = greedy(&e, "def fibonacci(n):", 24);
    assert!(code.contains("return"), "{code:?}");
    let story = greedy(&e, "Once upon a time", 24);
    assert!(story.split_whitespace().count() >= 10, "{story:?}");
}

#[test]
fn greedy_decoding_is_deterministic_and_graphs_change_nothing() {
    let prompts = [
        "The quick brown fox",
        "In 1969, the first",
        "Water boils at",
    ];
    let replayed = engine(true);
    let eager = engine(false);
    for p in prompts {
        let a = greedy(&replayed, p, 32);
        let b = greedy(&replayed, p, 32);
        let c = greedy(&eager, p, 32);
        assert_eq!(a, b, "replay is deterministic for {p:?}");
        assert_eq!(a, c, "graph replay equals eager decoding for {p:?}");
        assert!(!a.is_empty());
    }
}

#[test]
fn chat_prompt_gets_an_answer_and_stops() {
    let e = engine(true);
    let options = GenerateOptions {
        raw: false,
        ..GenerateOptions::greedy(96)
    };
    let g = e.generate("What is 2 + 2?", &options, |_| true).unwrap();
    assert!(g.prompt_tokens > 5);
    assert!(!g.text.trim().is_empty(), "{:?}", g.text);
    assert!(!g.text.contains("<|im_start|>"), "{:?}", g.text);
}

#[test]
fn decode_graph_is_scheduled_into_concurrent_groups() {
    let e = engine(true);
    let mut s = e.session(16).unwrap();
    s.prefill(&[1, 504, 3458]).unwrap();
    s.step(314).unwrap();
    let stats = s.graph_stats().unwrap();
    // q, k and v projections (and gate and up) share their input: they run together.
    assert!(stats.after.mean_group > 1.2, "{stats:?}");
    assert!(stats.after.groups <= stats.before.groups, "{stats:?}");
    // The CPU applies no fusion rules (see `Ops::fusion_patterns`).
    assert_eq!(stats.fused, 0, "{stats:?}");
    assert_eq!(stats.removed, 0, "{stats:?}");
}
