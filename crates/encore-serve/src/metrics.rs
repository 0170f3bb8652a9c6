//! `GET /metrics`: the scheduler's counters in Prometheus' text format.

use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State as Extract;
use axum::http::header;
use axum::response::IntoResponse;

use encore_llm::scheduler::Histogram;

use crate::State;

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

pub async fn render(Extract(state): Extract<Arc<State>>) -> impl IntoResponse {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP encore_http_responses_total HTTP responses by status class.\n\
         # TYPE encore_http_responses_total counter"
    );
    for (i, n) in state.responses.iter().enumerate() {
        let _ = writeln!(
            out,
            "encore_http_responses_total{{class=\"{}xx\"}} {}",
            i + 1,
            n.load(Ordering::Relaxed)
        );
    }
    scalar(
        &mut out,
        "encore_ready",
        "gauge",
        "1 once the model is loaded and warmed.",
        u64::from(state.get().is_some()),
    );
    if let Some(ready) = state.get() {
        let m = ready.scheduler.metrics();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
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
