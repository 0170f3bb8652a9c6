//! The continuous-batching scheduler on the default model: a request's
//! greedy output is the same alone, in a batch of 32 others, after being
//! preempted, and when its prompt prefix comes from the prefix cache; stop
//! strings, token limits and cancellation end it as asked.
//!
//! Runs on the CPU; `ENCORE_TEST_DEVICE=cuda` runs it on a GPU (the GPU
//! suite does).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use encore::{Config, Device};
use encore_llm::{
    Engine, EngineOptions, Event, FinishReason, GenRequest, SamplerConfig, Scheduler,
    SchedulerConfig,
};

fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| match std::env::var_os("ENCORE_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => encore_llm::fetch::default_model(|p| eprintln!("{p:?}"))
            .expect("fetch the default model"),
    })
    .clone()
}

fn engine() -> Arc<Engine> {
    static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let name = std::env::var("ENCORE_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
            let device = Device::open(&name, &Config::default()).unwrap();
            Arc::new(Engine::load(model_path(), &device, &EngineOptions::default()).unwrap())
        })
        .clone()
}

/// What one request produced.
#[derive(Debug, PartialEq)]
struct Outcome {
    text: String,
    reason: FinishReason,
    completion_tokens: usize,
}

/// Submits a request and returns a receiver of its outcome.
fn submit(
    s: &Scheduler,
    prompt: &str,
    max_tokens: usize,
    stop: &[&str],
    cancel: Arc<AtomicBool>,
) -> mpsc::Receiver<Outcome> {
    submit_with(s, prompt, max_tokens, stop, cancel, false)
}

/// [`submit`], going on past end-of-generation tokens with `ignore_eos`.
fn submit_with(
    s: &Scheduler,
    prompt: &str,
    max_tokens: usize,
    stop: &[&str],
    cancel: Arc<AtomicBool>,
    ignore_eos: bool,
) -> mpsc::Receiver<Outcome> {
    let e = engine();
    let prompt = e.prompt_tokens(prompt, false).unwrap();
    let (tx, rx) = mpsc::channel();
    let mut text = String::new();
    s.submit(GenRequest {
        prompt,
        max_tokens,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        stop: stop.iter().map(|s| s.to_string()).collect(),
        ignore_eos,
        logprobs: None,
        constraint: None,
        cancel,
        events: Box::new(move |event| {
            match event {
                Event::Text(t) => text.push_str(&t),
                Event::Done {
                    reason,
                    completion_tokens,
                    ..
                } => {
                    let _ = tx.send(Outcome {
                        text: std::mem::take(&mut text),
                        reason,
                        completion_tokens,
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

fn scheduler(config: SchedulerConfig) -> Scheduler {
    Scheduler::start(engine(), config).unwrap()
}

const PROBE: &str = "Name three colors of the rainbow.";

fn others(n: usize) -> Vec<String> {
    let topics = [
        "the sea", "a cat", "winter", "coffee", "the moon", "trains", "bread", "music",
    ];
    (0..n)
        .map(|i| {
            format!(
                "Write a sentence about {} (number {i}).",
                topics[i % topics.len()]
            )
        })
        .collect()
}

#[test]
fn a_request_gives_the_same_tokens_alone_and_in_a_batch_of_32_others() {
    let alone = {
        let s = scheduler(SchedulerConfig::new(1, 512));
        wait(submit(&s, PROBE, 32, &[], Arc::default()))
    };
    assert!(alone.completion_tokens > 4, "{alone:?}");
    let colors = [
        "red", "orange", "yellow", "green", "blue", "indigo", "violet",
    ];
    let lower = alone.text.to_lowercase();
    assert!(colors.iter().any(|c| lower.contains(c)), "{alone:?}");
    let s = scheduler(SchedulerConfig::new(33, 512));
    // Half the others first, so the probe joins a running batch and is
    // prefilled between their decode steps; then the rest join it.
    let others = others(32);
    let first: Vec<_> = others[..16]
        .iter()
        .map(|p| submit(&s, p, 40, &[], Arc::default()))
        .collect();
    let probe = submit(&s, PROBE, 32, &[], Arc::default());
    let rest: Vec<_> = others[16..]
        .iter()
        .map(|p| submit(&s, p, 40, &[], Arc::default()))
        .collect();
    let batched = wait(probe);
    assert_eq!(batched, alone);
    for rx in first.into_iter().chain(rest) {
        assert!(wait(rx).completion_tokens > 0);
    }
    let m = s.metrics();
    assert!(m.steps.load(Ordering::Relaxed) > 0);
    assert_eq!(m.requests.load(Ordering::Relaxed), 33);
}

#[test]
fn preemption_and_the_prefix_cache_change_no_token() {
    let alone = {
        let s = scheduler(SchedulerConfig::new(1, 256));
        wait(submit(&s, PROBE, 48, &[], Arc::default()))
    };
    // A pool of 20 blocks of 16 for 6 sequences that each need 4 or more:
    // sequences are preempted and recomputed as others grow.
    let config = SchedulerConfig {
        kv_positions: 20 * 16,
        ..SchedulerConfig::new(6, 256)
    };
    let s = scheduler(config);
    // The others go on past their end, so that they surely grow.
    let mut rxs: Vec<_> = others(5)
        .iter()
        .map(|p| submit_with(&s, p, 48, &[], Arc::default(), true))
        .collect();
    rxs.insert(2, submit(&s, PROBE, 48, &[], Arc::default()));
    let outcomes: Vec<_> = rxs.into_iter().map(wait).collect();
    assert_eq!(outcomes[2], alone);
    assert!(
        s.metrics().preemptions.load(Ordering::Relaxed) > 0,
        "the pool was meant to be too small"
    );
    // The same prompt again: its whole blocks come from the prefix cache.
    let before = s.metrics().cached_prompt_tokens.load(Ordering::Relaxed);
    let again = wait(submit(&s, PROBE, 48, &[], Arc::default()));
    assert_eq!(again, alone);
    assert!(s.metrics().cached_prompt_tokens.load(Ordering::Relaxed) > before);
}

#[test]
fn stop_strings_limits_and_cancellation_end_a_request() {
    let s = scheduler(SchedulerConfig::new(4, 512));
    let full = wait(submit(&s, PROBE, 32, &[], Arc::default()));
    // A stop string cut from the full answer ends it just before.
    let words: Vec<&str> = full.text.split_whitespace().collect();
    let stop = words[words.len() / 2];
    let cut = wait(submit(&s, PROBE, 32, &[stop], Arc::default()));
    assert_eq!(cut.reason, FinishReason::Stop);
    assert!(full.text.starts_with(&cut.text), "{cut:?} vs {full:?}");
    assert!(!cut.text.contains(stop));
    let short = wait(submit(&s, PROBE, 3, &[], Arc::default()));
    assert_eq!(
        (short.reason, short.completion_tokens),
        (FinishReason::Length, 3)
    );
    // Cancelled before it starts: it ends at once, with no text.
    let cancel = Arc::new(AtomicBool::new(true));
    let gone = wait(submit(&s, PROBE, 32, &[], cancel));
    assert_eq!(gone.reason, FinishReason::Cancelled);
    // The blocks of finished requests are back in the pool.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(s.metrics().running.load(Ordering::Relaxed), 0);
}

#[test]
fn bad_requests_are_refused_at_submission() {
    let s = scheduler(SchedulerConfig::new(2, 64));
    let request = |prompt: Vec<u32>, max_tokens| GenRequest {
        prompt,
        max_tokens,
        sampler: SamplerConfig::default(),
        stop: Vec::new(),
        ignore_eos: false,
        logprobs: None,
        constraint: None,
        cancel: Arc::default(),
        events: Box::new(|_| true),
    };
    for (prompt, max, want) in [
        (vec![], 4, "empty prompt"),
        (vec![1; 64], 4, "context holds 64"),
        (vec![u32::MAX], 4, "outside the vocabulary"),
        (vec![1], 0, "max_tokens"),
    ] {
        let e = s.submit(request(prompt, max)).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
}

#[test]
fn a_step_refuses_two_decode_rows_of_one_sequence() {
    // Decode rows run in graphs whose attention stores each row's K and V
    // and reads the cache in one dispatch: two rows of one sequence there
    // would race, so a step refuses them. As prompt rows they run.
    use encore_llm::batch::{BatchRunner, Output, Row, RowResult};
    let model = engine().model().clone();
    let mut runner = BatchRunner::new(model, 8, 16, 4, true).unwrap();
    let (a, b): (&'static [u32], &'static [u32]) = (&[1, 2], &[3]);
    let row = |table: &'static [u32], position: usize, decode| Row {
        token: 5 + position as u32,
        position,
        table,
        decode,
        group: 0,
    };
    let last = |row| Output { row, greedy: true };
    // Sequence a's positions 0..17 and b's 0..5, as prompt rows.
    let mut prompt: Vec<Row<'_>> = (0..17).map(|p| row(a, p, false)).collect();
    prompt.extend((0..5).map(|p| row(b, p, false)));
    let got = runner.run(&prompt, &[last(16), last(21)]).unwrap();
    assert!(got.iter().all(|r| matches!(r, RowResult::Token(_))));
    let err = runner
        .run(&[row(a, 17, true), row(a, 18, true)], &[last(1)])
        .unwrap_err();
    assert!(
        err.to_string().contains("one decode row a sequence"),
        "{err}"
    );
    // One decode row of each sequence runs, and so do two rows of one
    // sequence as prompt rows.
    let got = runner
        .run(&[row(a, 17, true), row(b, 5, true)], &[last(0), last(1)])
        .unwrap();
    assert_eq!(got.len(), 2);
    let got = runner
        .run(&[row(a, 17, false), row(a, 18, false)], &[last(1)])
        .unwrap();
    assert_eq!(got.len(), 1);
}
