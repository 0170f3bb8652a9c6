//! One loaded [`Engine`] shared by many threads: each generates greedily
//! from its own prompt in its own session, all at once, and must produce
//! exactly what a single-threaded run produces.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Barrier;

use encore::{Config, Device};
use encore_llm::gguf::GgufFile;
use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use encore_llm::{Engine, EngineOptions, GenerateOptions};

const THREADS: usize = 16;
const ROUNDS: usize = 3;
const MAX_TOKENS: usize = 24;

/// `Engine` can be shared between threads (`&Engine` is `Send`).
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Engine>();
};

fn engine(graphs: bool) -> Engine {
    engine_on("cpu", graphs)
}

fn engine_on(device: &str, graphs: bool) -> Engine {
    let spec = SyntheticSpec {
        n_layer: 6,
        ..SyntheticSpec::tiny(11)
    };
    let file = GgufFile::from_bytes(synthetic_gguf(&spec)).unwrap();
    let options = EngineOptions {
        graphs,
        ..EngineOptions::default()
    };
    let device = Device::open(device, &Config::default()).unwrap();
    Engine::from_gguf(&file, &device, &options).unwrap()
}

fn prompts() -> Vec<String> {
    (0..THREADS)
        .map(|i| format!("prompt {i}: {}", "the quick brown fox ".repeat(i % 5 + 1)))
        .collect()
}

fn generate(engine: &Engine, prompt: &str) -> (Vec<u32>, String) {
    let out = engine
        .generate(prompt, &GenerateOptions::greedy(MAX_TOKENS), |_| true)
        .unwrap();
    (out.tokens, out.text)
}

fn shared_engine_matches_single_threaded(graphs: bool) {
    shared_engine_on_matches_single_threaded("cpu", graphs);
}

fn shared_engine_on_matches_single_threaded(device: &str, graphs: bool) {
    let engine = engine_on(device, graphs);
    let prompts = prompts();
    let expected: Vec<_> = prompts.iter().map(|p| generate(&engine, p)).collect();
    assert!(
        expected.iter().all(|(tokens, _)| !tokens.is_empty()),
        "every prompt must generate something"
    );

    let start = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for (i, prompt) in prompts.iter().enumerate() {
            let (engine, start, expected) = (&engine, &start, &expected[i]);
            scope.spawn(move || {
                start.wait();
                for round in 0..ROUNDS {
                    let got = generate(engine, prompt);
                    assert_eq!(&got, expected, "thread {i}, round {round}, graphs {graphs}");
                }
            });
        }
    });
}

#[test]
fn sixteen_threads_with_graph_replay() {
    shared_engine_matches_single_threaded(true);
}

#[test]
fn sixteen_threads_eager() {
    shared_engine_matches_single_threaded(false);
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn sixteen_threads_on_cuda() {
    shared_engine_on_matches_single_threaded("cuda", true);
    shared_engine_on_matches_single_threaded("cuda", false);
}

/// Sessions driven step by step from several threads, interleaving their
/// prefills and decode steps on the same model.
#[test]
fn sessions_step_independently() {
    let engine = engine(true);
    let prompts = prompts();
    let run = |prompt: &str| -> Vec<u32> {
        let ids = engine.prompt_tokens(prompt, true).unwrap();
        let mut session = engine.session(ids.len() + MAX_TOKENS).unwrap();
        let logits = session.prefill(&ids).unwrap();
        let mut next = argmax(&logits);
        let mut out = vec![next];
        for _ in 1..MAX_TOKENS {
            session.step(next).unwrap();
            next = session.argmax().unwrap();
            out.push(next);
        }
        out
    };
    let expected: Vec<Vec<u32>> = prompts.iter().map(|p| run(p)).collect();
    let start = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for (i, prompt) in prompts.iter().enumerate() {
            let (run, start, expected) = (&run, &start, &expected[i]);
            scope.spawn(move || {
                start.wait();
                assert_eq!(&run(prompt), expected, "thread {i}");
            });
        }
    });
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}
