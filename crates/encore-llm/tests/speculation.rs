//! Prompt-lookup speculative decoding in the scheduler, on the default
//! model: a greedy request gives exactly the tokens it gives without
//! speculation (alone, beside others that speculate, and beside sampled
//! ones), a repetitive prompt has drafts accepted, and sampled requests
//! that speculate run to their limits. That sampled speculation keeps the
//! target's distribution is tested on fixed distributions in
//! `encore_llm::speculate`.
//!
//! Runs on the CPU; `ENCORE_TEST_DEVICE=cuda` runs it on a GPU.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use encore::{Config, Device};
use encore_llm::{
    Engine, EngineOptions, Event, GenRequest, SamplerConfig, Scheduler, SchedulerConfig,
    Speculation,
};

fn engine() -> Arc<Engine> {
    static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let path = match std::env::var_os("ENCORE_TEST_MODEL") {
                Some(p) => PathBuf::from(p),
                None => encore_llm::fetch::default_model(|p| eprintln!("{p:?}"))
                    .expect("fetch the default model"),
            };
            let name = std::env::var("ENCORE_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
            let device = Device::open(&name, &Config::default()).unwrap();
            Arc::new(Engine::load(path, &device, &EngineOptions::default()).unwrap())
        })
        .clone()
}

/// The answer repeats much of the prompt: a function to copy with one
/// change.
const EDIT: &str = "Here is a Python function:\n\n\
def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        \
subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n    \
return subtotal + tax\n\n\
Rewrite it exactly, but rename the function to compute_total. Reply with the code only.";

/// A request's tokens and text.
#[derive(Debug, PartialEq)]
struct Outcome {
    text: String,
    tokens: usize,
}

fn submit(
    s: &Scheduler,
    prompt: &str,
    max_tokens: usize,
    temperature: f32,
    seed: u64,
) -> mpsc::Receiver<Outcome> {
    let prompt = engine().prompt_tokens(prompt, false).unwrap();
    let (tx, rx) = mpsc::channel();
    let mut text = String::new();
    s.submit(GenRequest {
        prompt,
        max_tokens,
        sampler: SamplerConfig {
            temperature,
            seed,
            ..SamplerConfig::default()
        },
        stop: Vec::new(),
        ignore_eos: true,
        logprobs: None,
        constraint: None,
        cancel: Arc::default(),
        events: Box::new(move |event| {
            match event {
                Event::Text(t) => text.push_str(&t),
                Event::Done {
                    completion_tokens, ..
                } => {
                    let _ = tx.send(Outcome {
                        text: std::mem::take(&mut text),
                        tokens: completion_tokens,
                    });
                }
                Event::Error(e) => panic!("generation failed: {e}"),
                _ => {}
            }
            true
        }),
    })
    .unwrap();
    rx
}

fn wait(rx: mpsc::Receiver<Outcome>) -> Outcome {
    rx.recv_timeout(Duration::from_secs(600))
        .expect("an outcome")
}

fn scheduler(parallel: usize, speculation: Option<Speculation>) -> Scheduler {
    let config = SchedulerConfig {
        speculation,
        ..SchedulerConfig::new(parallel, 512)
    };
    Scheduler::start(engine(), config).unwrap()
}

#[test]
fn greedy_requests_give_the_same_tokens_with_and_without_speculation() {
    let plain = wait(submit(&scheduler(1, None), EDIT, 96, 0.0, 0));
    assert_eq!(plain.tokens, 96);
    assert!(plain.text.contains("compute_total"), "{plain:?}");

    let spec = Speculation::default();
    let s = scheduler(1, Some(spec));
    let alone = wait(submit(&s, EDIT, 96, 0.0, 0));
    assert_eq!(alone, plain);
    let m = s.metrics();
    let drafted = m.draft_tokens.load(Ordering::Relaxed);
    let accepted = m.accepted_draft_tokens.load(Ordering::Relaxed);
    assert!(
        accepted > 0 && accepted <= drafted,
        "{accepted} of {drafted}"
    );
    // Fewer steps than tokens: accepted drafts came several a step.
    let steps = m.steps.load(Ordering::Relaxed) as usize;
    assert!(steps < 96, "{steps} steps for 96 tokens");

    // Beside two others that speculate (one greedy, one sampled), with
    // drafts of several lengths in one step.
    let long = Speculation {
        draft_tokens: 8,
        ..spec
    };
    let s = scheduler(3, Some(long));
    let other = submit(
        &s,
        "Count from one to twenty in words, separated by commas.",
        48,
        0.0,
        0,
    );
    let sampled = submit(&s, EDIT, 48, 0.8, 3);
    let probe = submit(&s, EDIT, 96, 0.0, 0);
    assert_eq!(wait(probe), plain);
    assert_eq!(wait(other).tokens, 48);
    assert_eq!(wait(sampled).tokens, 48);
    assert!(s.metrics().accepted_draft_tokens.load(Ordering::Relaxed) > 0);
}

#[test]
fn sampled_speculation_is_reproducible_and_reaches_its_limit() {
    let spec = Some(Speculation::default());
    let a = wait(submit(&scheduler(1, spec), EDIT, 40, 0.7, 11));
    let b = wait(submit(&scheduler(1, spec), EDIT, 40, 0.7, 11));
    assert_eq!(a, b);
    assert_eq!(a.tokens, 40);
}

#[test]
fn bad_speculation_settings_are_refused() {
    let config = SchedulerConfig {
        speculation: Some(Speculation {
            draft_tokens: 0,
            ..Speculation::default()
        }),
        ..SchedulerConfig::new(1, 64)
    };
    let err = Scheduler::start(engine(), config).err().unwrap();
    assert!(err.to_string().contains("draft tokens"), "{err}");
}
