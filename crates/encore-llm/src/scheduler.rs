//! [`Scheduler`]: continuous batching of many generation requests over one
//! model.
//!
//! One thread owns the device. At every step it takes new requests, admits
//! waiting ones while there are free sequence slots and KV blocks, and runs
//! one batched forward pass ([`BatchRunner`]) holding a decode row for every
//! sequence that is generating and up to a budget of prompt rows (chunked
//! prefill), so long prompts are prefilled a chunk at a time between the
//! decode steps of running sequences instead of stalling them. Sequences
//! join and leave the batch at every step.
//!
//! KV memory is paged ([`crate::blocks`]): a sequence takes blocks as it
//! grows. When the pool runs out, the most recently admitted sequence is
//! preempted: its blocks are given back and it waits to be recomputed from
//! its tokens (prompt and generated so far; the prefix cache usually still
//! holds most of them), after which it goes on where it stopped. Its text
//! is not sent twice.
//!
//! Results are the same whatever the batch: every row is computed on its
//! own ([`crate::model::Placement::Paged`]), a row's kind comes from its
//! position (prompt, or past it: a decode row), each kind always runs the
//! same kernels ([`BatchRunner::run`]), so recomputed generated tokens go
//! through decode rows again, one a step; and each request samples with its
//! own seeded sampler.
//!
//! With [`SchedulerConfig::speculation`], while few sequences generate,
//! each proposes a draft of its next tokens by prompt lookup
//! ([`crate::speculate`]) and the step verifies it: the draft's rows run as
//! decode rows of the sequence in groups ([`Row::group`]), each computed as
//! a lone decode row is, and the sequence keeps the drafted tokens its
//! sampler agrees with, then one of the target's own. Greedy requests give
//! the same tokens with or without it; requests with a constraint or
//! log-probabilities do not speculate.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::batch::{BatchRunner, Output, Row, RowResult};
use crate::blocks::BlockPool;
use crate::constraint::Constraint;
use crate::engine::Engine;
use crate::error::{LlmError, Result};
use crate::sampler::{Sampler, SamplerConfig, TokenLogprob};
use crate::speculate::{ngram_draft, Speculation};
use crate::stepper::{Stepper, StopReason};

/// How the scheduler batches.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences generating at once.
    pub parallel: usize,
    /// Positions one sequence may use (prompt and generated tokens).
    pub ctx_size: usize,
    /// Positions the KV pool holds, for all sequences together.
    pub kv_positions: usize,
    /// Positions a KV block holds.
    pub block_size: usize,
    /// Prompt tokens prefilled per step, across sequences.
    pub chunk: usize,
    /// Replay recorded decode graphs (else encode every step).
    pub graphs: bool,
    /// Fails the step with this number (counting from 0) as a device error
    /// would: a hook for tests of how a server handles faults.
    pub fault_at_step: Option<u64>,
    /// Speculative decoding by prompt lookup; `None` for none.
    pub speculation: Option<Speculation>,
}

impl SchedulerConfig {
    /// `parallel` sequences of up to `ctx_size` positions, a pool of
    /// `parallel * min(ctx_size, 1024)` positions (at least one full
    /// context): sequences that grow long are served by preempting others.
    pub fn new(parallel: usize, ctx_size: usize) -> SchedulerConfig {
        SchedulerConfig {
            parallel,
            ctx_size,
            kv_positions: (parallel * ctx_size.min(1024)).max(ctx_size),
            block_size: 16,
            chunk: 256,
            graphs: true,
            fault_at_step: None,
            speculation: None,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(LlmError::Request(what));
        if self.parallel == 0 || self.parallel > 1024 {
            return bad(format!("parallel = {}: expected 1 to 1024", self.parallel));
        }
        if self.ctx_size < 2 {
            return bad(format!("ctx_size = {}: expected at least 2", self.ctx_size));
        }
        if self.block_size == 0 || self.chunk == 0 {
            return bad("block_size and chunk must be at least 1".into());
        }
        if let Some(spec) = &self.speculation {
            spec.validate()?;
        }
        if self.kv_positions < self.ctx_size {
            return bad(format!(
                "kv_positions = {} cannot hold one context of {}",
                self.kv_positions, self.ctx_size
            ));
        }
        Ok(())
    }
}

/// Why a request's generation ended, as a server reports it: the
/// [`StopReason`] with its two kinds of stop as one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
    /// The requester cancelled it (a client that went away).
    Cancelled,
    /// The scheduler shut down before the generation ended: the answer is
    /// cut, or, for a request that generated nothing, never started.
    Shutdown,
}

impl From<StopReason> for FinishReason {
    fn from(reason: StopReason) -> FinishReason {
        match reason {
            StopReason::StopToken | StopReason::StopString => FinishReason::Stop,
            StopReason::Length => FinishReason::Length,
            StopReason::Cancelled => FinishReason::Cancelled,
        }
    }
}

/// What a request hears about its generation.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// Generated text (complete UTF-8; stop strings held back until it is
    /// clear they are not one).
    Text(String),
    /// A generated token's log-probability, for a request that asked for
    /// them ([`GenRequest::logprobs`]); it comes before the text that the
    /// token completes.
    Logprob(TokenLogprob),
    /// The end, with token counts.
    Done {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// The stop string that ended the text, when one did.
        stop_string: Option<String>,
    },
    /// The generation failed (a device error); nothing follows.
    Error(String),
}

/// A generation request.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Strings that end the generation where they appear; they are not sent.
    pub stop: Vec<String>,
    /// Go on past end-of-generation tokens (for benchmarks that want a
    /// fixed number of tokens).
    pub ignore_eos: bool,
    /// Report each generated token's log-probability with this many of the
    /// most likely alternatives ([`Event::Logprob`]).
    pub logprobs: Option<usize>,
    /// Hold the output to a grammar: tokens it does not allow are masked
    /// before every draw.
    pub constraint: Option<Constraint>,
    /// Set by the requester to cancel (a client that went away).
    pub cancel: Arc<AtomicBool>,
    /// Receives the events; returns false when nobody listens any more,
    /// which cancels the request.
    pub events: Box<dyn FnMut(Event) -> bool + Send>,
}

/// A histogram of durations in seconds, with fixed bucket bounds.
#[derive(Debug)]
pub struct Histogram {
    pub bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if s <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Cumulative counts per bound, the sum in seconds, and the count.
    pub fn snapshot(&self) -> (Vec<u64>, f64, u64) {
        (
            self.counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
            self.count.load(Ordering::Relaxed),
        )
    }
}

const LATENCY_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Counters and gauges of the scheduler, read by the server's metrics.
#[derive(Debug)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Prompt tokens served from the prefix cache instead of computed.
    pub cached_prompt_tokens: AtomicU64,
    pub preemptions: AtomicU64,
    /// Tokens drafted for speculative decoding, and those of them kept.
    pub draft_tokens: AtomicU64,
    pub accepted_draft_tokens: AtomicU64,
    pub steps: AtomicU64,
    /// Steps that failed with a device error (each fails its sequences).
    pub device_errors: AtomicU64,
    /// Requests waiting to be admitted.
    pub queue_depth: AtomicU64,
    /// Sequences in the running batch.
    pub running: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub time_to_first_token: Histogram,
    pub time_per_output_token: Histogram,
}

impl Metrics {
    fn new() -> Metrics {
        let z = || AtomicU64::new(0);
        Metrics {
            requests: z(),
            prompt_tokens: z(),
            generated_tokens: z(),
            cached_prompt_tokens: z(),
            preemptions: z(),
            draft_tokens: z(),
            accepted_draft_tokens: z(),
            steps: z(),
            device_errors: z(),
            queue_depth: z(),
            running: z(),
            kv_blocks_used: z(),
            kv_blocks_total: z(),
            time_to_first_token: Histogram::new(LATENCY_BOUNDS),
            time_per_output_token: Histogram::new(LATENCY_BOUNDS),
        }
    }
}

enum Msg {
    Request(GenRequest),
    Shutdown(Duration),
}

/// The batching loop on its own thread, and the way in.
pub struct Scheduler {
    tx: Mutex<Option<mpsc::Sender<Msg>>>,
    metrics: Arc<Metrics>,
    thread: Mutex<Option<JoinHandle<()>>>,
    ctx_size: usize,
    parallel: usize,
    vocab: usize,
}

impl Scheduler {
    /// Starts the loop over `engine`'s model with a fresh paged cache.
    pub fn start(engine: Arc<Engine>, config: SchedulerConfig) -> Result<Scheduler> {
        config.validate()?;
        let bs = config.block_size;
        let blocks = config.kv_positions.div_ceil(bs) + 1;
        let max_blocks = config.ctx_size.div_ceil(bs);
        let mut runner = BatchRunner::new(
            engine.model().clone(),
            blocks,
            bs,
            max_blocks,
            config.graphs,
        )?;
        runner.prepare(config.parallel)?;
        let metrics = Arc::new(Metrics::new());
        metrics
            .kv_blocks_total
            .store(blocks as u64 - 1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let vocab = engine.model().config.vocab;
        let m = metrics.clone();
        let ctx_size = config.ctx_size;
        let parallel = config.parallel;
        let thread = std::thread::Builder::new()
            .name("encore-scheduler".into())
            .spawn(move || {
                let pool = BlockPool::new(blocks, bs);
                Loop::new(&engine, runner, pool, config, m).run(rx);
            })
            .map_err(|e| LlmError::Request(format!("starting the scheduler thread: {e}")))?;
        Ok(Scheduler {
            tx: Mutex::new(Some(tx)),
            metrics,
            thread: Mutex::new(Some(thread)),
            ctx_size,
            parallel,
            vocab,
        })
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Positions one sequence may use.
    pub fn ctx_size(&self) -> usize {
        self.ctx_size
    }

    /// Sequences generating at once; more wait in the queue.
    pub fn parallel(&self) -> usize {
        self.parallel
    }

    /// Queues a request. A prompt that is empty, holds a token outside the
    /// vocabulary or leaves no room in the context, bad sampling settings,
    /// and a scheduler that has shut down are errors here; later failures
    /// arrive as [`Event::Error`].
    pub fn submit(&self, request: GenRequest) -> Result<()> {
        request.sampler.validate()?;
        if request.prompt.is_empty() {
            return Err(LlmError::Request("empty prompt".into()));
        }
        if request.max_tokens == 0 {
            return Err(LlmError::Request("max_tokens must be at least 1".into()));
        }
        if request.prompt.len() >= self.ctx_size {
            return Err(LlmError::Request(format!(
                "the prompt has {} tokens; the context holds {} (prompt and answer together)",
                request.prompt.len(),
                self.ctx_size
            )));
        }
        if let Some(t) = request.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(LlmError::Request(format!(
                "token id {t} is outside the vocabulary of {}",
                self.vocab
            )));
        }
        let tx = self
            .tx
            .lock()
            .map_err(|_| LlmError::Request("the scheduler failed".into()))?;
        let sent = tx.as_ref().map(|tx| tx.send(Msg::Request(request)).is_ok());
        if sent != Some(true) {
            return Err(LlmError::Request("the server is shutting down".into()));
        }
        self.metrics.requests.fetch_add(1, Ordering::Relaxed);
        self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Stops taking requests, lets the running ones finish for up to
    /// `grace` (then cancels them), and waits for the loop to end.
    pub fn shutdown(&self, grace: Duration) {
        if let Ok(mut tx) = self.tx.lock() {
            if let Some(tx) = tx.take() {
                let _ = tx.send(Msg::Shutdown(grace));
            }
        }
        if let Ok(mut thread) = self.thread.lock() {
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shutdown(Duration::ZERO);
    }
}

/// One request on its way through the loop.
struct Seq<'t> {
    req: GenRequest,
    sampler: Sampler,
    /// Prompt and generated tokens; the last generated one has no K and V yet.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Positions whose K and V are in the cache.
    computed: usize,
    /// Tokens drafted to follow the last one, verified in this step.
    draft: Vec<u32>,
    table: Vec<u32>,
    /// The request's stop rules and the text of its tokens.
    stepper: Stepper<'t>,
    arrived: Instant,
    last_token: Option<Instant>,
}

impl Seq<'_> {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn cancelled(&self) -> bool {
        self.stepper.is_cancelled()
    }

    /// Whether the sequence may speculate: its tokens come from its
    /// sampler alone.
    fn may_speculate(&self) -> bool {
        self.req.constraint.is_none() && self.req.logprobs.is_none()
    }
}

impl GenRequest {
    /// Sends `event` to the requester; one that no longer listens cancels
    /// the request.
    fn send(&mut self, event: Event) {
        if !(self.events)(event) {
            self.cancel.store(true, Ordering::Relaxed);
        }
    }
}

struct Loop<'e> {
    engine: &'e Engine,
    runner: BatchRunner,
    pool: BlockPool,
    config: SchedulerConfig,
    metrics: Arc<Metrics>,
    waiting: VecDeque<Seq<'e>>,
    running: Vec<Seq<'e>>,
    /// When a shutdown asked the running requests to end by.
    deadline: Option<Instant>,
}

impl<'e> Loop<'e> {
    fn new(
        engine: &'e Engine,
        runner: BatchRunner,
        pool: BlockPool,
        config: SchedulerConfig,
        metrics: Arc<Metrics>,
    ) -> Loop<'e> {
        Loop {
            engine,
            runner,
            pool,
            config,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            deadline: None,
        }
    }

    fn accept(&mut self, req: GenRequest) {
        let tokens = req.prompt.clone();
        // The context ends the generation where it is full.
        let room = self.config.ctx_size.saturating_sub(tokens.len());
        let stepper = Stepper::new(self.engine.tokenizer(), req.max_tokens.min(room))
            .with_stop_strings(req.stop.iter().cloned())
            .ignoring_eog(req.ignore_eos)
            .with_cancel(req.cancel.clone());
        self.metrics
            .prompt_tokens
            .fetch_add(tokens.len() as u64, Ordering::Relaxed);
        self.waiting.push_back(Seq {
            sampler: Sampler::new(req.sampler.clone()),
            prompt_len: tokens.len(),
            tokens,
            computed: 0,
            draft: Vec::new(),
            table: Vec::new(),
            stepper,
            arrived: Instant::now(),
            last_token: None,
            req,
        });
    }

    fn run(mut self, rx: mpsc::Receiver<Msg>) {
        let mut open = true;
        loop {
            if open && self.waiting.is_empty() && self.running.is_empty() {
                match rx.recv() {
                    Ok(Msg::Request(r)) => self.accept(r),
                    Ok(Msg::Shutdown(_)) | Err(_) => break,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(Msg::Request(r)) => self.accept(r),
                    Ok(Msg::Shutdown(grace)) => {
                        open = false;
                        self.deadline = Some(Instant::now() + grace);
                        self.end_unstarted();
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        self.deadline = Some(Instant::now());
                    }
                }
            }
            self.drop_cancelled();
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                let cut: Vec<_> = self
                    .waiting
                    .drain(..)
                    .chain(self.running.drain(..))
                    .collect();
                for s in cut {
                    self.finish(s, FinishReason::Shutdown);
                }
            }
            self.admit();
            self.publish();
            if self.running.is_empty() {
                if !open && self.waiting.is_empty() {
                    break;
                }
                if self.waiting.is_empty() {
                    continue;
                }
            }
            let fault =
                self.config.fault_at_step == Some(self.metrics.steps.load(Ordering::Relaxed));
            let result = if fault {
                Err(LlmError::Runtime(encore::Error::DeviceFailed {
                    device: self.engine.model().device.name().to_string(),
                    cause: "a fault injected for a test".into(),
                }))
            } else {
                self.step()
            };
            if let Err(e) = result {
                // A failed step fails every running sequence. Only a device
                // error counts as one: the device may be unusable, which
                // the next requests will hear.
                let message = if e.is_device_error() {
                    self.metrics.device_errors.fetch_add(1, Ordering::Relaxed);
                    format!("device error: {e}")
                } else {
                    format!("the step failed: {e}")
                };
                for s in std::mem::take(&mut self.running) {
                    self.fail(s, message.clone());
                }
            }
            self.metrics.steps.fetch_add(1, Ordering::Relaxed);
            // Sequences that ended in the step are gone from the gauges
            // before the loop waits for new requests.
            self.publish();
        }
        self.publish();
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.queue_depth
            .store(self.waiting.len() as u64, Ordering::Relaxed);
        m.running
            .store(self.running.len() as u64, Ordering::Relaxed);
        m.kv_blocks_used
            .store(self.pool.in_use() as u64, Ordering::Relaxed);
    }

    fn finish(&mut self, mut s: Seq<'e>, reason: FinishReason) {
        let completion_tokens = s.generated();
        let stop_string = s.stepper.stop_string().map(str::to_string);
        let rest = s.stepper.finish();
        let cut = matches!(reason, FinishReason::Cancelled | FinishReason::Shutdown);
        if !cut && !rest.is_empty() {
            s.req.send(Event::Text(rest));
        }
        self.pool.release(&s.table);
        let done = Event::Done {
            reason,
            prompt_tokens: s.prompt_len,
            completion_tokens,
            stop_string,
        };
        s.req.send(done);
    }

    /// Ends `s` with an error; nothing follows it.
    fn fail(&mut self, mut s: Seq<'e>, message: String) {
        s.req.send(Event::Error(message));
        self.pool.release(&s.table);
    }

    /// Ends the waiting sequences that have generated nothing yet: at a
    /// shutdown they are refused rather than started.
    fn end_unstarted(&mut self) {
        let (gone, kept): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|s| s.generated() == 0);
        self.waiting = kept;
        for s in gone {
            self.finish(s, FinishReason::Shutdown);
        }
    }

    fn drop_cancelled(&mut self) {
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s| s.cancelled());
        self.running = kept;
        for s in gone {
            self.finish(s, FinishReason::Cancelled);
        }
        let (gone, kept): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|s| s.cancelled());
        self.waiting = kept;
        for s in gone {
            self.finish(s, FinishReason::Cancelled);
        }
    }

    /// Admits waiting sequences while there are slots and blocks for their
    /// tokens (less what the prefix cache holds). A sequence whose prompt
    /// another running one is still prefilling waits for it (with those
    /// behind it), so that it shares the prompt's blocks instead of
    /// computing them again: the choices of one request (`n` above 1)
    /// prefill their prompt once.
    fn admit(&mut self) {
        let bs = self.config.block_size;
        while self.running.len() < self.config.parallel {
            let Some(s) = self.waiting.front_mut() else {
                break;
            };
            let len = s.tokens.len();
            let prompt = &s.req.prompt;
            let prefilling_same = self.running.iter().any(|r| {
                r.computed < r.req.prompt.len() && prompt.len() >= bs && r.req.prompt == *prompt
            });
            if prefilling_same && s.generated() == 0 {
                break;
            }
            // At least the last token is computed, for its logits.
            let shared = self.pool.take_prefix(&s.tokens, len - 1);
            let need = (len + 1).div_ceil(bs).saturating_sub(shared.len());
            if self.pool.available() < need {
                self.pool.release(&shared);
                break;
            }
            self.metrics
                .cached_prompt_tokens
                .fetch_add((shared.len() * bs) as u64, Ordering::Relaxed);
            s.computed = shared.len() * bs;
            s.table = shared;
            if let Some(s) = self.waiting.pop_front() {
                self.running.push(s);
            }
        }
    }

    /// Gives sequence `i` a block for position `pos`, preempting the most
    /// recently admitted other sequence while the pool is empty. Returns
    /// false when `i` itself had to be preempted (nothing else to take).
    fn block_for(&mut self, i: usize, pos: usize) -> bool {
        let bs = self.config.block_size;
        while self.running[i].table.len() <= pos / bs {
            match self.pool.take() {
                Some(b) => self.running[i].table.push(b),
                None => {
                    let victim = self.running.len() - 1;
                    self.preempt(victim);
                    if victim == i {
                        return false;
                    }
                }
            }
        }
        true
    }

    fn preempt(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        self.pool.release(&s.table);
        s.table.clear();
        s.draft.clear();
        s.computed = 0;
        self.metrics.preemptions.fetch_add(1, Ordering::Relaxed);
        self.waiting.push_front(s);
    }

    /// One batched pass: a decode row for every sequence past its prompt
    /// (generating, or recomputing its generated tokens after a
    /// preemption, one a step as they were made), then prompt rows up to
    /// the chunk budget; then sampling.
    fn step(&mut self) -> Result<()> {
        // (sequence index, first position, rows) of each sequence in the step.
        let mut plan: Vec<(usize, usize, usize)> = Vec::new();
        let generating = self
            .running
            .iter()
            .filter(|s| s.computed >= s.req.prompt.len())
            .count();
        let speculation = self
            .config
            .speculation
            .filter(|s| generating <= s.max_streams);
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if s.computed >= s.req.prompt.len() && s.computed < s.tokens.len() {
                let pos = s.computed;
                if !self.block_for(i, pos) {
                    continue;
                }
                if let Some(spec) = speculation {
                    self.draft(i, &spec);
                }
                plan.push((i, pos, 1));
            }
            i += 1;
        }
        let mut budget = self.config.chunk.saturating_sub(plan.len()).max(1);
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let left = s.req.prompt.len().saturating_sub(s.computed);
            if left > 0 {
                let n = left.min(budget);
                let first = s.computed;
                if !self.block_for(i, first + n - 1) {
                    continue;
                }
                // A preemption may have removed planned sequences.
                plan.retain(|&(j, _, _)| j < self.running.len());
                plan.push((i, first, n));
                budget -= n;
            }
            i += 1;
        }
        if plan.is_empty() {
            return Ok(());
        }
        let mut rows = Vec::new();
        let mut outputs = Vec::new();
        for &(i, first, n) in &plan {
            let s = &self.running[i];
            for p in first..first + n {
                rows.push(Row {
                    token: s.tokens[p],
                    position: p,
                    table: &s.table,
                    decode: p >= s.req.prompt.len(),
                    group: 0,
                });
            }
            let greedy =
                s.sampler.is_greedy() && s.req.constraint.is_none() && s.req.logprobs.is_none();
            if first + n == s.tokens.len() {
                outputs.push(Output {
                    row: rows.len() - 1,
                    greedy,
                });
            }
            // The drafted tokens, each at the position after the one before.
            for (j, &token) in s.draft.iter().enumerate() {
                rows.push(Row {
                    token,
                    position: first + n + j,
                    table: &s.table,
                    decode: true,
                    group: j + 1,
                });
                outputs.push(Output {
                    row: rows.len() - 1,
                    greedy,
                });
            }
        }
        let mut results = self.runner.run(&rows, &outputs)?.into_iter();
        drop(rows);
        let mut done = Vec::new();
        for &(i, first, n) in &plan {
            let bs = self.config.block_size;
            let s = &mut self.running[i];
            s.computed = first + n;
            if !s.draft.is_empty() {
                let draft = std::mem::take(&mut s.draft);
                let found: Vec<RowResult> = results.by_ref().take(draft.len() + 1).collect();
                let end = self.verify(i, &draft, found);
                let s = &self.running[i];
                for b in first / bs..s.computed / bs {
                    self.pool.name(s.table[b], &s.tokens, b);
                }
                if let Some(end) = end {
                    done.push((i, end));
                }
                continue;
            }
            for b in first / bs..s.computed / bs {
                self.pool.name(s.table[b], &s.tokens, b);
            }
            if s.computed < s.tokens.len() {
                continue;
            }
            let (token, logprob) = match results.next() {
                Some(RowResult::Token(t)) => (t, None),
                Some(RowResult::Logits(mut l)) => {
                    if let Some(c) = &mut s.req.constraint {
                        if let Err(e) = c.mask(&mut l) {
                            done.push((i, Err(e.to_string())));
                            continue;
                        }
                    }
                    let token = s.sampler.sample(&l, &s.tokens);
                    let logprob = s.req.logprobs.map(|k| TokenLogprob::of(&l, token, k));
                    (token, logprob)
                }
                Some(RowResult::NonFinite { pass, position }) => {
                    done.push((i, Err(LlmError::NonFinite { pass, position }.to_string())));
                    continue;
                }
                None => return Err(LlmError::Request("a step lost an output row".into())),
            };
            if let Some(end) = self.accept_token(i, token, logprob) {
                done.push((i, end));
            }
        }
        // Remove finished sequences, highest index first.
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (i, end) in done {
            let s = self.running.remove(i);
            match end {
                Ok(reason) => self.finish(s, reason),
                Err(message) => self.fail(s, message),
            }
        }
        Ok(())
    }

    /// Drafts sequence `i`'s next tokens by prompt lookup, as many as fit
    /// its token limit, its context and the blocks it has or that are free
    /// (a draft never preempts anyone), into its `draft`.
    fn draft(&mut self, i: usize, spec: &Speculation) {
        let bs = self.config.block_size;
        let s = &self.running[i];
        if !s.may_speculate() || s.computed + 1 != s.tokens.len() {
            return;
        }
        // The draft's positions follow the last token's, `pos`; the token
        // after the draft comes from the target, so a draft of `d` makes
        // `d + 1` tokens.
        let pos = s.computed;
        let room = (s.stepper.remaining().saturating_sub(1))
            .min(self.config.ctx_size.saturating_sub(pos + 1))
            .min(spec.draft_tokens);
        if room == 0 {
            return;
        }
        let mut draft = ngram_draft(&s.tokens, spec.ngram, room);
        if draft.is_empty() {
            return;
        }
        let s = &mut self.running[i];
        while s.table.len() <= (pos + draft.len()) / bs {
            match self.pool.take() {
                Some(b) => s.table.push(b),
                None => break,
            }
        }
        draft.truncate((s.table.len() * bs).saturating_sub(pos + 1));
        s.draft = draft;
    }

    /// Verifies sequence `i`'s `draft` with the results of its rows (the
    /// last token's, then each drafted token's): takes the drafted tokens
    /// its sampler agrees with and then the sampler's own token, moving the
    /// sequence's computed positions past the kept ones. Returns how the
    /// sequence ended, if it did.
    fn verify(
        &mut self,
        i: usize,
        draft: &[u32],
        found: Vec<RowResult>,
    ) -> Option<Result<FinishReason, String>> {
        let mut kept = 0;
        let mut end = None;
        for (j, result) in found.into_iter().enumerate() {
            let s = &mut self.running[i];
            let token = match result {
                RowResult::Token(t) => t,
                RowResult::Logits(l) => {
                    let dist = s.sampler.distribution(&l, &s.tokens);
                    match draft.get(j) {
                        Some(&d) => s.sampler.verify(&dist, d),
                        None => s.sampler.draw(&dist),
                    }
                }
                RowResult::NonFinite { pass, position } => {
                    end = Some(Err(LlmError::NonFinite { pass, position }.to_string()));
                    break;
                }
            };
            end = self.accept_token(i, token, None);
            if end.is_some() || draft.get(j) != Some(&token) {
                break;
            }
            kept += 1;
        }
        let m = &self.metrics;
        m.draft_tokens
            .fetch_add(draft.len() as u64, Ordering::Relaxed);
        m.accepted_draft_tokens
            .fetch_add(kept as u64, Ordering::Relaxed);
        self.running[i].computed += kept;
        end
    }

    /// Takes sequence `i`'s next token and sends its log-probability (when
    /// asked) and text; returns how the sequence ended, if it did (an error
    /// for a token that the tokenizer cannot decode or the constraint did
    /// not allow).
    fn accept_token(
        &mut self,
        i: usize,
        token: u32,
        logprob: Option<TokenLogprob>,
    ) -> Option<Result<FinishReason, String>> {
        let now = Instant::now();
        let m = self.metrics.clone();
        let s = &mut self.running[i];
        match s.last_token {
            None => m.time_to_first_token.observe(now - s.arrived),
            Some(t) => m.time_per_output_token.observe(now - t),
        }
        s.last_token = Some(now);
        let step = match s.stepper.push(token) {
            Ok(step) => step,
            Err(e) => return Some(Err(format!("decoding token {token}: {e}"))),
        };
        if step.taken {
            s.tokens.push(token);
            m.generated_tokens.fetch_add(1, Ordering::Relaxed);
            if let Some(c) = &mut s.req.constraint {
                if let Err(e) = c.accept(token) {
                    return Some(Err(e.to_string()));
                }
            }
            if let Some(logprob) = logprob {
                s.req.send(Event::Logprob(logprob));
            }
        }
        if !step.text.is_empty() {
            s.req.send(Event::Text(step.text));
        }
        step.stop.map(|reason| Ok(reason.into()))
    }
}
