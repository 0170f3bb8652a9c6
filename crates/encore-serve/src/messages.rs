//! `POST /v1/messages`: Anthropic's Messages API over the same generation
//! as the chat route (the chat template, tools read out of the answer,
//! stop strings, cancellation, limits), answered in Anthropic's shapes;
//! and `POST /v1/messages/count_tokens`, its prompt's length.
//!
//! A whole answer is a `message` whose content holds a text block and the
//! `tool_use` blocks of the calls the model wrote, with a `stop_reason` of
//! `end_turn`, `max_tokens`, `stop_sequence` (naming the sequence) or
//! `tool_use`. A streamed one is Anthropic's events, each as `event:
//! NAME` and `data: JSON`: `message_start`, then per block
//! `content_block_start`, its deltas (`text_delta`, `input_json_delta`)
//! and `content_block_stop`, then `message_delta` with the stop reason and
//! usage, and `message_stop`; a `ping` follows the first block's start. An
//! answer that offers tools is read for calls at its end, so its blocks
//! come whole then (and the `ping` follows the message's start). A stream
//! cut after its start ends with an `error` event instead of
//! `message_stop`. Every error under `/v1/messages` has Anthropic's shape
//! ([`error_shape`]).

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::Request;
use axum::http::header;
use axum::middleware::Next;
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use encore_llm::tools;

use crate::anthropic::MessagesRequest;
use crate::api;
use crate::error::ApiError;
use crate::routes::{self, Piece, Running, Shared};

/// Answers a Messages API request.
pub(crate) async fn create(
    axum::extract::State(state): Shared,
    request: Request,
) -> Result<Response, ApiError> {
    let ready = routes::ready(&state)?;
    let deadline = routes::deadline(&state, request.headers())?;
    let body = routes::read_body(&state, request).await?;
    let request: MessagesRequest = api::parse(&body)?;
    let mut settings = request.settings()?;
    routes::check_model(&state, request.model()?)?;
    let messages = request.messages()?;
    let offered = request.tools()?;
    let single = offered.as_ref().is_some_and(|o| o.single);
    let tools = offered.map(|o| (o.tools, o.choice));
    let (running, first) =
        routes::converse(&state, ready, &mut settings, messages, tools, deadline).await?;
    let id = format!("msg_{:016x}", routes::request_id());
    if settings.stream {
        Ok(stream(running, first, id, single).into_response())
    } else {
        whole(running, first, id, single).await
    }
}

/// Counts a Messages API request's prompt tokens, as Anthropic's
/// `/v1/messages/count_tokens` does: `{"input_tokens": N}`.
pub(crate) async fn count_tokens(
    axum::extract::State(state): Shared,
    request: Request,
) -> Result<Response, ApiError> {
    let ready = routes::ready(&state)?;
    let body = routes::read_body(&state, request).await?;
    let request: MessagesRequest = api::parse(&body)?;
    routes::check_model(&state, request.model()?)?;
    let messages = request.messages()?;
    let tools = request.tools()?.map(|o| (o.tools, o.choice));
    let mut settings = api::Sampling::default().settings(true)?;
    let tokenize = routes::conversation_prompt(ready, &mut settings, messages, tools)?;
    let (tokens, _) = routes::prepare(&state, ready, None, 1, tokenize).await?;
    Ok(Json(json!({"input_tokens": tokens.len()})).into_response())
}

/// Gives every error answer under `/v1/messages` Anthropic's shape, with
/// its status and headers kept.
pub(crate) async fn error_shape(request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let ours = path == "/v1/messages" || path.starts_with("/v1/messages/");
    let response = next.run(request).await;
    if !ours {
        return response;
    }
    let Some(error) = response.extensions().get::<ApiError>().cloned() else {
        return response;
    };
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(error.anthropic_body().to_string()))
}

/// A content block of the answer.
enum Block {
    Text(String),
    ToolUse { name: String, input: Value },
}

/// The answer's blocks and stop reason: its text, and the calls it wrote
/// when it is read for them (the first only where `single`).
fn blocks(
    r: &Running,
    text: String,
    finish: &str,
    stop_string: Option<String>,
    single: bool,
) -> (Vec<Block>, &'static str, Option<String>) {
    let (text, mut calls) = match &r.tools {
        Some((syntax, offered)) => tools::parse_calls(*syntax, offered, &text),
        None => (text, Vec::new()),
    };
    if single {
        calls.truncate(1);
    }
    let (reason, sequence) = stop_reason(finish, stop_string, !calls.is_empty());
    let mut out = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        out.push(Block::Text(text));
    }
    for call in calls {
        let input = serde_json::from_str::<Value>(&call.arguments)
            .ok()
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({}));
        out.push(Block::ToolUse {
            name: call.name,
            input,
        });
    }
    (out, reason, sequence)
}

/// Anthropic's stop reason for a generation's finish, and the stop
/// sequence that ended it: a call ends the turn as `tool_use`, unless the
/// token limit cut the answer.
fn stop_reason(
    finish: &str,
    stop_string: Option<String>,
    called: bool,
) -> (&'static str, Option<String>) {
    match (finish, stop_string) {
        ("length", _) => ("max_tokens", None),
        _ if called => ("tool_use", None),
        (_, Some(s)) => ("stop_sequence", Some(s)),
        _ => ("end_turn", None),
    }
}

fn tool_use_id() -> String {
    format!("toolu_{:016x}", routes::request_id())
}

fn usage(input: usize, output: usize) -> Value {
    json!({"input_tokens": input, "output_tokens": output})
}

/// Waits for the whole answer.
async fn whole(
    mut r: Running,
    first: Piece,
    id: String,
    single: bool,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut piece = first;
    let (finish, stop_string, prompt, completion) = loop {
        match piece {
            Piece::Text(_, t) => text.push_str(&t),
            Piece::Logprob(..) => {}
            Piece::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                stop_string,
                ..
            } => break (finish, stop_string, prompt_tokens, completion_tokens),
        }
        piece = r.next().await?;
    };
    let (blocks, reason, sequence) = blocks(&r, text, finish, stop_string, single);
    let content: Vec<Value> = blocks
        .into_iter()
        .map(|b| match b {
            Block::Text(text) => json!({"type": "text", "text": text}),
            Block::ToolUse { name, input } => {
                json!({"type": "tool_use", "id": tool_use_id(), "name": name, "input": input})
            }
        })
        .collect();
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": r.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(prompt, completion),
    }))
    .into_response())
}

/// One server-sent event, named as its `type`.
fn event(data: Value) -> Sse {
    let name = data["type"].as_str().unwrap_or("error").to_string();
    Sse::default().event(name).data(data.to_string())
}

/// The answer as Anthropic's events. Text streams as it comes, in one
/// text block; an answer read for tool calls sends its blocks whole at
/// its end.
fn stream(mut r: Running, first: Piece, id: String, single: bool) -> impl IntoResponse {
    let (tx, rx) = mpsc::unbounded_channel::<Result<Sse, Infallible>>();
    let prompt = r.prompt_tokens;
    tokio::spawn(async move {
        let send = |e: Sse| tx.send(Ok(e)).is_ok();
        let start = json!({
            "type": "message_start",
            "message": {
                "id": id,
                "type": "message",
                "role": "assistant",
                "model": r.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": usage(prompt, 0),
            },
        });
        if !send(event(start)) {
            return;
        }
        let held = r.tools.is_some();
        if !held {
            let open = json!({
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            });
            if !send(event(open)) {
                return;
            }
        }
        if !send(event(json!({"type": "ping"}))) {
            return;
        }
        let mut text = String::new();
        let mut next: Result<Piece, ApiError> = Ok(first);
        loop {
            match next {
                Ok(Piece::Text(_, t)) if held => text.push_str(&t),
                Ok(Piece::Text(_, t)) => {
                    if !t.is_empty() {
                        let delta = json!({
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": t},
                        });
                        if !send(event(delta)) {
                            return; // the client left; dropping `r` cancels
                        }
                    }
                }
                Ok(Piece::Logprob(..)) => {}
                Ok(Piece::Done {
                    finish,
                    completion_tokens,
                    stop_string,
                    ..
                }) => {
                    let (reason, sequence) = if held {
                        let (blocks, reason, sequence) =
                            blocks(&r, std::mem::take(&mut text), finish, stop_string, single);
                        for (index, block) in blocks.into_iter().enumerate() {
                            for e in block_events(index, block) {
                                send(event(e));
                            }
                        }
                        (reason, sequence)
                    } else {
                        send(event(json!({"type": "content_block_stop", "index": 0})));
                        stop_reason(finish, stop_string, false)
                    };
                    send(event(json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage(prompt, completion_tokens),
                    })));
                    send(event(json!({"type": "message_stop"})));
                    return;
                }
                Err(error) => {
                    // Counted here: the response's status went out long ago.
                    r.state.counters.outcome(error.outcome());
                    send(event(error.anthropic_body()));
                    return;
                }
            }
            // A client that leaves is noticed here too, not only when a
            // send fails: an answer read for tool calls sends nothing
            // until its end. Returning drops `r`, which cancels.
            next = tokio::select! {
                piece = r.next() => piece,
                () = tx.closed() => return,
            };
        }
    });
    axum::response::sse::Sse::new(UnboundedReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}

/// A whole block's events: its start, its content as one delta, its stop.
fn block_events(index: usize, block: Block) -> Vec<Value> {
    let (start, delta) = match block {
        Block::Text(text) => (
            json!({"type": "text", "text": ""}),
            json!({"type": "text_delta", "text": text}),
        ),
        Block::ToolUse { name, input } => (
            json!({"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}}),
            json!({"type": "input_json_delta", "partial_json": input.to_string()}),
        ),
    };
    vec![
        json!({"type": "content_block_start", "index": index, "content_block": start}),
        json!({"type": "content_block_delta", "index": index, "delta": delta}),
        json!({"type": "content_block_stop", "index": index}),
    ]
}
