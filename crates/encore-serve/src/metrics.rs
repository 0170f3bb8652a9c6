//! `GET /metrics`: the server's and the scheduler's counters in
//! Prometheus' text format, and the server's own counters.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State as Extract;
use axum::http::header;
use axum::response::IntoResponse;

use encore_llm::scheduler::Histogram;

use crate::error::Outcome;
use crate::State;

/// Why requests are refused before they run, as `/metrics` labels them.
const REJECTED: [&str; 10] = [
    "invalid_request",
    "context_length",
    "unauthorized",
    "method_not_allowed",
    "body_timeout",
    "body_too_large",
    "headers_too_large",
    "queue_full",
    "unavailable",
    "too_many_connections",
];

/// Why running or waiting requests are cut, as `/metrics` labels them.
const CUT: [&str; 3] = ["shutdown", "deadline", "device_error"];

/// The server's own counters and gauges.
#[derive(Default)]
pub(crate) struct Counters {
    /// Responses by status class.
    responses: [AtomicU64; 5],
    rejected: [AtomicU64; REJECTED.len()],
    cut: [AtomicU64; CUT.len()],
    /// Connections open now.
    pub connections: AtomicU64,
    /// Generation requests between their admission and their end.
    pub in_flight: AtomicU64,
    /// Prompts being tokenized now.
    pub tokenizing: AtomicU64,
}

impl Counters {
    /// Counts a response by its status class and, for an error, its
    /// outcome.
    pub fn response(&self, status: u16, outcome: Option<Outcome>) {
        let class = (status / 100).clamp(1, 5) as usize - 1;
        self.responses[class].fetch_add(1, Ordering::Relaxed);
        if let Some(outcome) = outcome {
            self.outcome(outcome);
        }
    }

    /// Counts a request that ended without its answer.
    pub fn outcome(&self, outcome: Outcome) {
        match outcome {
            Outcome::Rejected(label) => self.reject(label),
            Outcome::Cut(label) => {
                if let Some(i) = CUT.iter().position(|&c| c == label) {
                    self.cut[i].fetch_add(1, Ordering::Relaxed);
                }
            }
            Outcome::Failed => {}
        }
    }

    /// Counts a request refused for `reason`, one of [`REJECTED`].
    pub fn reject(&self, reason: &str) {
        if let Some(i) = REJECTED.iter().position(|&r| r == reason) {
            self.rejected[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn scalar(out: &mut String, name: &str, kind: &str, help: &str, value: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

fn histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    let (counts, sum, count) = h.snapshot();
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (bound, c) in h.bounds.iter().zip(counts) {
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {c}");
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{le=\"+Inf\"}} {count}\n{name}_sum {sum}\n{name}_count {count}"
    );
}

fn labelled(out: &mut String, name: &str, help: &str, labels: &[&str], values: &[AtomicU64]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for (label, value) in labels.iter().zip(values) {
        let _ = writeln!(
            out,
            "{name}{{reason=\"{label}\"}} {}",
            value.load(Ordering::Relaxed)
        );
    }
}

/// The `/metrics` handler.
pub async fn render(Extract(state): Extract<Arc<State>>) -> impl IntoResponse {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP encore_http_responses_total HTTP responses by status class.\n\
         # TYPE encore_http_responses_total counter"
    );
    let c = &state.counters;
    for (i, n) in c.responses.iter().enumerate() {
        let _ = writeln!(
            out,
            "encore_http_responses_total{{class=\"{}xx\"}} {}",
            i + 1,
            n.load(Ordering::Relaxed)
        );
    }
    labelled(
        &mut out,
        "encore_requests_rejected_total",
        "Requests refused before they ran, by reason.",
        &REJECTED,
        &c.rejected,
    );
    labelled(
        &mut out,
        "encore_requests_cut_total",
        "Requests cut while they waited or ran, by cause.",
        &CUT,
        &c.cut,
    );
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    scalar(
        &mut out,
        "encore_open_connections",
        "gauge",
        "Client connections open.",
        load(&c.connections),
    );
    scalar(
        &mut out,
        "encore_requests_in_flight",
        "gauge",
        "Generation requests admitted and not yet ended.",
        load(&c.in_flight),
    );
    scalar(
        &mut out,
        "encore_prompts_tokenizing",
        "gauge",
        "Prompts being tokenized.",
        load(&c.tokenizing),
    );
    scalar(
        &mut out,
        "encore_healthy",
        "gauge",
        "0 once a device error has made the server unhealthy.",
        u64::from(!state.faulted()),
    );
    scalar(
        &mut out,
        "encore_ready",
        "gauge",
        "1 once the model is loaded and warmed.",
        u64::from(state.get().is_some()),
    );
    if let Some(ready) = state.get() {
        let m = ready.scheduler.metrics();
        for (name, kind, help, value) in [
            (
                "encore_requests_total",
                "counter",
                "Generation requests accepted.",
                load(&m.requests),
            ),
            (
                "encore_prompt_tokens_total",
                "counter",
                "Prompt tokens of accepted requests.",
                load(&m.prompt_tokens),
            ),
            (
                "encore_prompt_tokens_cached_total",
                "counter",
                "Prompt tokens taken from the prefix cache.",
                load(&m.cached_prompt_tokens),
            ),
            (
                "encore_generated_tokens_total",
                "counter",
                "Tokens generated.",
                load(&m.generated_tokens),
            ),
            (
                "encore_preemptions_total",
                "counter",
                "Sequences preempted for KV memory.",
                load(&m.preemptions),
            ),
            (
                "encore_steps_total",
                "counter",
                "Batched forward passes.",
                load(&m.steps),
            ),
            (
                "encore_device_errors_total",
                "counter",
                "Batched steps that failed with a device error.",
                load(&m.device_errors),
            ),
            (
                "encore_queue_depth",
                "gauge",
                "Requests waiting to be admitted.",
                load(&m.queue_depth),
            ),
            (
                "encore_running_sequences",
                "gauge",
                "Sequences in the running batch.",
                load(&m.running),
            ),
            (
                "encore_kv_blocks_used",
                "gauge",
                "KV blocks held by sequences.",
                load(&m.kv_blocks_used),
            ),
            (
                "encore_kv_blocks_total",
                "gauge",
                "KV blocks in the pool.",
                load(&m.kv_blocks_total),
            ),
        ] {
            scalar(&mut out, name, kind, help, value);
        }
        histogram(
            &mut out,
            "encore_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            &m.time_to_first_token,
        );
        histogram(
            &mut out,
            "encore_time_per_output_token_seconds",
            "Between a request's successive tokens.",
            &m.time_per_output_token,
        );
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}
