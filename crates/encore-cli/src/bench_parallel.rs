//! `encore bench --parallel N,...`: continuous batching measured without
//! HTTP, as llama.cpp's `llama-batched-bench` measures its batched decode.
//!
//! For each level, N requests (distinct prompts of `--prompt-tokens`
//! ordinary token ids, `--gen-tokens` greedy tokens each, end-of-generation
//! ignored) go to one [`Scheduler`] at once. A first round warms it
//! (kernels, the decode graph of each batch size it reaches) and is not
//! counted; the median of the counted rounds is reported. Every round is
//! bounded in time.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use encore_llm::{Engine, Event, GenRequest, SamplerConfig, Scheduler, SchedulerConfig};

use crate::median;

/// Longest a round may take before the benchmark gives up.
const ROUND_LIMIT: Duration = Duration::from_secs(600);

/// The figures of one level (medians over the counted rounds).
pub struct Level {
    pub parallel: usize,
    /// Generated tokens over the round's wall time, prefill included.
    pub tok_s: f64,
    /// The sum over requests of each one's rate after its first token: in
    /// steady state, the rate of the batched decode steps.
    pub decode_tok_s: f64,
    /// Median time from submission to a request's first token.
    pub ttft_ms: f64,
    /// Decode steps the scheduler ran in the round.
    pub steps: f64,
}

/// What a request reports back: its index, and whether this is its first
/// text or its end.
enum Mark {
    First(usize, Instant),
    Done(usize, Instant, usize),
    Failed(String),
}

/// Runs every level of `parallel` on `engine`.
pub fn run(
    engine: &Arc<Engine>,
    parallel: &[usize],
    prompt_tokens: usize,
    gen_tokens: usize,
    repeats: usize,
) -> Result<Vec<Level>, String> {
    let mut levels = Vec::new();
    for &n in parallel {
        let ctx = prompt_tokens.saturating_add(gen_tokens).saturating_add(1);
        let scheduler = Scheduler::start(engine.clone(), SchedulerConfig::new(n, ctx))
            .map_err(|e| e.to_string())?;
        let mut rounds = Vec::new();
        for round in 0..=repeats {
            let first_id = round * n;
            rounds.push(self::round(
                engine,
                &scheduler,
                n,
                first_id,
                prompt_tokens,
                gen_tokens,
            )?);
        }
        // The first round warms the scheduler.
        rounds.remove(0);
        let pick = |f: fn(&Round) -> f64| median(rounds.iter().map(f).collect());
        levels.push(Level {
            parallel: n,
            tok_s: pick(|r| r.tok_s),
            decode_tok_s: pick(|r| r.decode_tok_s),
            ttft_ms: pick(|r| r.ttft_ms),
            steps: pick(|r| r.steps),
        });
    }
    Ok(levels)
}

struct Round {
    tok_s: f64,
    decode_tok_s: f64,
    ttft_ms: f64,
    steps: f64,
}

/// A prompt of `len` ordinary token ids, distinct for each `id` from its
/// first token on (so that no request reuses another's prefix).
fn prompt(id: usize, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            (i.wrapping_mul(7919))
                .wrapping_add((id as u32).wrapping_mul(104_729))
                .wrapping_add(1)
                % vocab.max(1)
        })
        .collect()
}

fn round(
    engine: &Arc<Engine>,
    scheduler: &Scheduler,
    n: usize,
    first_id: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
) -> Result<Round, String> {
    let vocab = engine.model().config.vocab as u32;
    let (tx, rx) = mpsc::channel();
    let steps_before = scheduler.metrics().steps.load(Ordering::Relaxed);
    let start = Instant::now();
    for i in 0..n {
        let tx = tx.clone();
        let mut seen_first = false;
        scheduler
            .submit(GenRequest {
                prompt: prompt(first_id + i, prompt_tokens, vocab),
                max_tokens: gen_tokens,
                sampler: SamplerConfig {
                    temperature: 0.0,
                    ..SamplerConfig::default()
                },
                stop: Vec::new(),
                ignore_eos: true,
                logprobs: None,
                constraint: None,
                cancel: Arc::default(),
                events: Box::new(move |e| {
                    let now = Instant::now();
                    let mark = match e {
                        Event::Text(_) if seen_first => return true,
                        Event::Text(_) => {
                            seen_first = true;
                            Mark::First(i, now)
                        }
                        Event::Done {
                            completion_tokens, ..
                        } => Mark::Done(i, now, completion_tokens),
                        Event::Error(e) => Mark::Failed(e),
                        _ => return true,
                    };
                    tx.send(mark).is_ok()
                }),
            })
            .map_err(|e| e.to_string())?;
    }
    drop(tx);
    let mut first = vec![None; n];
    // (first token, end, tokens) of each finished request.
    let mut marks = Vec::with_capacity(n);
    let (mut end, mut generated) = (start, 0);
    while marks.len() < n {
        let left = ROUND_LIMIT.saturating_sub(start.elapsed());
        match rx.recv_timeout(left) {
            Ok(Mark::First(i, t)) => first[i] = Some(t),
            Ok(Mark::Done(i, t, tokens)) => {
                // A request whose text was all held back has its first
                // token no later than its end.
                marks.push((*first[i].get_or_insert(t), t, tokens));
                end = end.max(t);
                generated += tokens;
            }
            Ok(Mark::Failed(e)) => return Err(format!("a request failed: {e}")),
            Err(_) => {
                return Err(format!(
                    "{n} parallel requests did not finish in {} s",
                    ROUND_LIMIT.as_secs()
                ))
            }
        }
    }
    let ttft = median(
        marks
            .iter()
            .map(|m| (m.0 - start).as_secs_f64() * 1e3)
            .collect(),
    );
    let decode_tok_s = marks
        .iter()
        .map(|&(first, end, tokens)| {
            tokens.saturating_sub(1) as f64 / (end - first).as_secs_f64().max(1e-9)
        })
        .sum();
    let wall = (end - start).as_secs_f64().max(1e-9);
    Ok(Round {
        tok_s: generated as f64 / wall,
        decode_tok_s,
        ttft_ms: ttft,
        steps: (scheduler.metrics().steps.load(Ordering::Relaxed) - steps_before) as f64,
    })
}
