//! The speculative decoding flags of `generate` and `serve`, and
//! `generate --speculate`, which runs its one request through the
//! scheduler (where speculation lives) and reports how many drafted tokens
//! the model kept.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use clap::{Args, ValueEnum};
use encore_llm::speculate::MAX_DRAFT_TOKENS;
use encore_llm::{
    Engine, Event, GenRequest, SamplerConfig, Scheduler, SchedulerConfig, Speculation,
};

use crate::{count, in_range, to_stderr, CliResult, Out};

/// How to draft tokens for speculative decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Drafter {
    /// No speculation.
    None,
    /// Prompt lookup: propose what followed the sequence's last tokens
    /// where they appeared before (no second model).
    Ngram,
}

/// The speculative decoding flags.
#[derive(Args)]
pub struct SpeculateArgs {
    /// Speculative decoding: `ngram` drafts tokens by prompt lookup, which
    /// the model verifies several at a time; greedy output is unchanged.
    /// The server speculates while at most 4 requests generate, for those
    /// without a grammar or log-probabilities.
    #[arg(long, value_enum, default_value_t = Drafter::None)]
    speculate: Drafter,
    /// Most tokens drafted a step, 1 to 15.
    #[arg(long, default_value_t = Speculation::default().draft_tokens, value_parser = count, allow_negative_numbers = true)]
    draft_tokens: usize,
}

impl SpeculateArgs {
    /// The speculation these flags ask for, checked; `None` for none.
    pub fn speculation(&self) -> Result<Option<Speculation>, crate::CliError> {
        in_range("--draft-tokens", self.draft_tokens, 1, MAX_DRAFT_TOKENS, "")?;
        Ok(match self.speculate {
            Drafter::None => None,
            Drafter::Ngram => Some(Speculation {
                draft_tokens: self.draft_tokens,
                ..Speculation::default()
            }),
        })
    }
}

/// Generates up to `max_tokens` tokens after `prompt` with `speculation`,
/// streaming the text to stdout, then a statistics line on stderr with the
/// drafted and accepted tokens.
pub fn generate(
    engine: Arc<Engine>,
    prompt: Vec<u32>,
    max_tokens: usize,
    sampler: SamplerConfig,
    speculation: Speculation,
) -> CliResult {
    in_range(
        "-n/--n-predict",
        max_tokens,
        1,
        usize::MAX,
        " with --speculate",
    )?;
    let prompt_tokens = prompt.len();
    let ctx_size = prompt_tokens + max_tokens + 1;
    let config = SchedulerConfig {
        speculation: Some(speculation),
        ..SchedulerConfig::new(1, ctx_size)
    };
    let scheduler = Scheduler::start(engine, config).map_err(|e| e.to_string())?;
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    scheduler
        .submit(GenRequest {
            prompt,
            max_tokens,
            sampler,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            constraint: None,
            cancel: Arc::default(),
            events: Box::new(move |e| tx.send(e).is_ok()),
        })
        .map_err(|e| e.to_string())?;
    let mut out = Out::new();
    let mut first = None;
    let generated = loop {
        match rx.recv() {
            Ok(Event::Text(t)) => {
                first.get_or_insert_with(Instant::now);
                out.write(&t)?;
            }
            Ok(Event::Done {
                completion_tokens, ..
            }) => break completion_tokens,
            Ok(Event::Error(e)) => return Err(e.into()),
            Ok(_) => {}
            Err(_) => return Err(String::from("the scheduler stopped").into()),
        }
    };
    let end = Instant::now();
    out.write("\n")?;
    let m = scheduler.metrics();
    let drafted = m.draft_tokens.load(Ordering::Relaxed);
    let accepted = m.accepted_draft_tokens.load(Ordering::Relaxed);
    let steps = m.steps.load(Ordering::Relaxed);
    let first = first.unwrap_or(end);
    let decode = (end - first).as_secs_f64().max(1e-9);
    to_stderr(&format!(
        "encore: prefill {prompt_tokens} tokens and first token in {:.1} ms, decode {generated} tokens at {:.1} tok/s in {steps} steps; drafted {drafted}, accepted {accepted} ({:.0}%)\n",
        (first - start).as_secs_f64() * 1e3,
        generated.saturating_sub(1) as f64 / decode,
        100.0 * accepted as f64 / drafted.max(1) as f64,
    ));
    Ok(())
}
