//! The handlers.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Request, State as Extract};
use axum::http::{StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use encore_llm::{Event, FinishReason, GenRequest};

use crate::api::{self, Settings};
use crate::error::ApiError;
use crate::{now, Ready, State};

type Shared = Extract<Arc<State>>;

pub fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/health", get(health))
        .route("/metrics", get(crate::metrics::render))
        .fallback(fallback)
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// Counts responses by status class.
async fn count(Extract(state): Shared, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    state.count(response.status().as_u16());
    response
}

async fn fallback(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

fn ready(state: &State) -> Result<&Ready, ApiError> {
    state
        .get()
        .ok_or_else(|| ApiError::unavailable("the model is still loading; see /health"))
}

async fn health(Extract(state): Shared) -> Response {
    if let Some(message) = state.failed.get() {
        let body = json!({"status": "error", "message": message});
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response();
    }
    match state.get() {
        Some(_) => Json(json!({"status": "ok"})).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

async fn models(Extract(state): Shared) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "encore",
        }],
    }))
}

fn check_model(state: &State, model: &str) -> Result<(), ApiError> {
    if model == state.model_id {
        Ok(())
    } else {
        Err(ApiError::unknown_model(model, &state.model_id))
    }
}

/// Sets the cancel flag when dropped: a request whose handler or stream is
/// dropped (the client went away) is cancelled.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Which endpoint a generation answers, for the shape of its responses.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

/// A generation on its way: its events, and the guard that cancels it.
struct Running {
    events: mpsc::UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

fn submit(
    state: &State,
    ready: &Ready,
    prompt: Vec<u32>,
    settings: &Settings,
    kind: Kind,
) -> Result<Running, ApiError> {
    let ctx = ready.scheduler.ctx_size();
    let room = ctx.saturating_sub(prompt.len());
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    ready.scheduler.submit(GenRequest {
        max_tokens: settings.max_tokens.unwrap_or(room).min(room.max(1)),
        prompt,
        sampler: settings.sampler.clone(),
        stop: settings.stop.clone(),
        ignore_eos: settings.ignore_eos,
        cancel: cancel.clone(),
        events: Box::new(move |e| tx.send(e).is_ok()),
    })?;
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    Ok(Running {
        events: rx,
        guard: CancelOnDrop(cancel),
        id: format!("{prefix}-{:016x}", request_id()),
        created: now(),
        model: state.model_id.clone(),
        kind,
    })
}

/// A request id: the time and a counter, unique within the process.
fn request_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    (now() << 20) ^ n
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

async fn chat(Extract(state): Shared, body: Bytes) -> Result<Response, ApiError> {
    let ready = ready(&state)?;
    let request: api::ChatRequest = api::parse(&body)?;
    let settings = request.sampling.settings()?;
    check_model(&state, &request.model)?;
    let messages = request.messages()?;
    let prompt = ready.engine.chat_tokens(&messages, true)?;
    let running = submit(&state, ready, prompt, &settings, Kind::Chat)?;
    respond(running, &settings).await
}

async fn completions(Extract(state): Shared, body: Bytes) -> Result<Response, ApiError> {
    let ready = ready(&state)?;
    let request: api::CompletionRequest = api::parse(&body)?;
    let settings = request.sampling.settings()?;
    check_model(&state, &request.model)?;
    let prompt = ready.engine.prompt_tokens(request.prompt()?, true)?;
    let running = submit(&state, ready, prompt, &settings, Kind::Completion)?;
    respond(running, &settings).await
}

async fn respond(running: Running, settings: &Settings) -> Result<Response, ApiError> {
    if settings.stream {
        Ok(stream(running, settings.include_usage).into_response())
    } else {
        collect(running).await.map(IntoResponse::into_response)
    }
}

/// Waits for the whole answer.
async fn collect(mut r: Running) -> Result<Json<Value>, ApiError> {
    let mut text = String::new();
    while let Some(event) = r.events.recv().await {
        match event {
            Event::Text(t) => text.push_str(&t),
            Event::Error(e) => return Err(ApiError::internal(e)),
            Event::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let choice = match r.kind {
                    Kind::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish_reason(reason),
                        "logprobs": null,
                    }),
                    Kind::Completion => json!({
                        "index": 0,
                        "text": text,
                        "finish_reason": finish_reason(reason),
                        "logprobs": null,
                    }),
                };
                let object = match r.kind {
                    Kind::Chat => "chat.completion",
                    Kind::Completion => "text_completion",
                };
                drop(r.guard);
                return Ok(Json(json!({
                    "id": r.id,
                    "object": object,
                    "created": r.created,
                    "model": r.model,
                    "choices": [choice],
                    "usage": usage(prompt_tokens, completion_tokens),
                })));
            }
        }
    }
    Err(ApiError::internal(
        "the generation ended without a result".into(),
    ))
}

/// The answer as server-sent events: a chunk per piece of text, a last
/// chunk with the finish reason (and, when asked, one with the usage), then
/// `[DONE]`.
fn stream(mut r: Running, include_usage: bool) -> impl IntoResponse {
    let (tx, rx) = mpsc::unbounded_channel::<Result<Sse, Infallible>>();
    tokio::spawn(async move {
        // Held until the stream ends: dropping it cancels the request. (An
        // async block takes only the fields it uses; this takes the guard.)
        let _guard = &r.guard;
        let object = match r.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let chunk = |choice: Value| {
            let mut c = json!({
                "id": r.id,
                "object": object,
                "created": r.created,
                "model": r.model,
                "choices": [choice],
            });
            if include_usage {
                c["usage"] = Value::Null;
            }
            Sse::default().data(c.to_string())
        };
        let piece = |text: &str, finish: Option<&str>| match r.kind {
            Kind::Chat => json!({
                "index": 0,
                "delta": if finish.is_some() { json!({}) } else { json!({"content": text}) },
                "finish_reason": finish,
                "logprobs": null,
            }),
            Kind::Completion => json!({
                "index": 0,
                "text": text,
                "finish_reason": finish,
                "logprobs": null,
            }),
        };
        let send = |e: Sse| tx.send(Ok(e)).is_ok();
        if r.kind == Kind::Chat {
            let first = json!({
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": null,
                "logprobs": null,
            });
            if !send(chunk(first)) {
                return;
            }
        }
        while let Some(event) = r.events.recv().await {
            match event {
                Event::Text(t) => {
                    if !send(chunk(piece(&t, None))) {
                        return; // the client left; dropping `r` cancels
                    }
                }
                Event::Error(e) => {
                    let error = ApiError::internal(e).body();
                    send(Sse::default().data(error.to_string()));
                    break;
                }
                Event::Done {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                } => {
                    send(chunk(piece("", Some(finish_reason(reason)))));
                    if include_usage {
                        let last = json!({
                            "id": r.id,
                            "object": object,
                            "created": r.created,
                            "model": r.model,
                            "choices": [],
                            "usage": usage(prompt_tokens, completion_tokens),
                        });
                        send(Sse::default().data(last.to_string()));
                    }
                    break;
                }
            }
        }
        send(Sse::default().data("[DONE]"));
    });
    axum::response::sse::Sse::new(UnboundedReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}
