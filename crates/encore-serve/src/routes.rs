//! The routes, the checks every request passes (its head's size, the API
//! key), and the handlers.
//!
//! A generation request is read (its body bounded in size and time),
//! parsed and checked, refused at once when its prompt's bytes alone
//! cannot fit the context, admitted against the queue bound, tokenized on
//! a blocking thread (a bounded number at once, so no async thread waits
//! on a long prompt), then submitted. Its status is decided by its first
//! event, so a request that never ran (cut by a shutdown, failed by the
//! device, past its deadline) gets an error status, streaming or not;
//! after that a cut stream ends with an error event and no `[DONE]`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State as Extract};
use axum::http::{header, HeaderMap, Method, Uri};
use axum::middleware::Next;
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;

use encore_llm::chat::{ChatTemplate, Message};
use encore_llm::constraint::{Constraint, Grammar};
use encore_llm::tools::{self, ToolChoice, ToolSyntax, Tools};
use encore_llm::{Engine, Event, FinishReason, GenRequest, TokenLogprob};

use crate::api::{self, Kind, Settings};
use crate::error::{ApiError, Outcome};
use crate::logprobs;
use crate::{now, Ready, State};

pub(crate) type Shared = Extract<Arc<State>>;

/// Counts responses by status class and errors by outcome.
pub(crate) async fn count(Extract(state): Shared, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let outcome = response.extensions().get::<Outcome>().copied();
    state.counters.response(response.status().as_u16(), outcome);
    response
}

/// Gives an error from outside the handlers (an extractor's rejection, a
/// layer's refusal) OpenAI's shape.
pub(crate) async fn json_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error())
        || response.extensions().get::<Outcome>().is_some()
    {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let message = match String::from_utf8_lossy(&text).trim() {
        "" => status.canonical_reason().unwrap_or("error").to_string(),
        text => text.to_string(),
    };
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    };
    let mut fixed = ApiError::new(status, kind, message).into_response();
    if let Some(allow) = parts.headers.get(header::ALLOW) {
        fixed.headers_mut().insert(header::ALLOW, allow.clone());
    }
    fixed
}

/// Refuses a request whose head is over the configured bounds with a 431.
pub(crate) async fn check_head(Extract(state): Shared, request: Request, next: Next) -> Response {
    let limits = &state.limits;
    let headers = request.headers();
    if headers.len() > limits.max_headers {
        return ApiError::headers_too_large(format!(
            "{} headers: at most {}",
            headers.len(),
            limits.max_headers
        ))
        .into_response();
    }
    let size = request.method().as_str().len()
        + request.uri().to_string().len()
        + headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>();
    if size > limits.max_header_bytes {
        return ApiError::headers_too_large(format!(
            "the request line and headers hold {size} bytes: at most {}",
            limits.max_header_bytes
        ))
        .into_response();
    }
    next.run(request).await
}

/// Requires the API key, when the server has one, on every route but
/// `/health`: as `Authorization: Bearer KEY` (OpenAI's clients) or
/// `x-api-key: KEY` (Anthropic's); compares it in constant time.
pub(crate) async fn authorize(Extract(state): Shared, request: Request, next: Next) -> Response {
    let Some(key) = &state.limits.api_key else {
        return next.run(request).await;
    };
    if request.uri().path() == "/health" {
        return next.run(request).await;
    }
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
    let given = bearer.or_else(|| {
        headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    });
    match given {
        None => ApiError::unauthorized(
            "this server requires an API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
        )
        .into_response(),
        Some(token) if keys_match(token, key) => next.run(request).await,
        Some(_) => ApiError::unauthorized("the API key is not valid").into_response(),
    }
}

/// Whether `given` is `key`, in a time that tells nothing of either: their
/// SHA-256 digests are compared in constant time, so not even the key's
/// length shows (comparing the texts themselves stops at a length that
/// differs).
fn keys_match(given: &str, key: &str) -> bool {
    let (given, key) = (Sha256::digest(given), Sha256::digest(key));
    bool::from(given.as_slice().ct_eq(key.as_slice()))
}

pub(crate) async fn fallback(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

pub(crate) async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

pub(crate) fn ready(state: &State) -> Result<&Ready, ApiError> {
    if state.faulted() {
        return Err(ApiError::unavailable(
            "a device error made the server unhealthy; it stops after the running requests",
        ));
    }
    if state.stopping.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    state
        .get()
        .ok_or_else(|| ApiError::unavailable("the model is still loading; see /health"))
}

pub(crate) async fn health(Extract(state): Shared) -> Response {
    let unavailable = axum::http::StatusCode::SERVICE_UNAVAILABLE;
    if let Some(message) = state.failed.get() {
        let body = json!({"status": "error", "message": message});
        return (axum::http::StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response();
    }
    if state.faulted() {
        let body =
            json!({"status": "error", "message": "a device error made the server unhealthy"});
        return (unavailable, Json(body)).into_response();
    }
    if state.stopping.load(Ordering::Relaxed) {
        return (unavailable, Json(json!({"status": "stopping"}))).into_response();
    }
    match state.get() {
        Some(_) => Json(json!({"status": "ok"})).into_response(),
        None => (unavailable, Json(json!({"status": "loading"}))).into_response(),
    }
}

pub(crate) async fn models(Extract(state): Shared) -> Json<Value> {
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

pub(crate) fn check_model(state: &State, model: &str) -> Result<(), ApiError> {
    if model == state.model_id {
        Ok(())
    } else {
        Err(ApiError::unknown_model(model, &state.model_id))
    }
}

/// Reads a request's body: at most the body limit (a 413 past it), within
/// the body timeout (a 408 past it). Past the limit the rest is read and
/// dropped, up to [`DRAIN`] bytes, so the client gets to read the 413
/// rather than a reset connection.
pub(crate) async fn read_body(state: &State, request: Request) -> Result<Bytes, ApiError> {
    let limit = state.limits.max_body_bytes;
    let announced = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let timeout = state.limits.body_timeout;
    let mut body = request.into_body();
    let read = async {
        let mut bytes = Vec::new();
        let mut over = announced.is_some_and(|n| n > limit as u64);
        let mut drained = 0usize;
        while let Some(frame) = body.frame().await {
            let frame =
                frame.map_err(|e| ApiError::bad_request(format!("reading the body: {e}"), None))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if !over && bytes.len() + data.len() > limit {
                over = true;
                bytes = Vec::new();
            }
            if over {
                drained += data.len();
                if drained > DRAIN {
                    break;
                }
            } else {
                bytes.extend_from_slice(&data);
            }
        }
        if over {
            Err(ApiError::body_too_large(limit))
        } else {
            Ok(Bytes::from(bytes))
        }
    };
    match announced {
        // Too large to be worth reading: refused at once.
        Some(n) if n > (limit + DRAIN) as u64 => Err(ApiError::body_too_large(limit)),
        _ => tokio::time::timeout(timeout, read)
            .await
            .map_err(|_| ApiError::body_timeout(timeout.as_secs_f64()))?,
    }
}

/// The most bytes of a body over the limit read and dropped.
const DRAIN: usize = 16 << 20;

/// When the request must end: the server's request timeout, or less when
/// the request asks for less with `X-Request-Timeout` (seconds).
pub(crate) fn deadline(
    state: &State,
    headers: &HeaderMap,
) -> Result<Option<(Instant, f64)>, ApiError> {
    let asked = match headers.get("x-request-timeout") {
        None => None,
        Some(v) => {
            let seconds = v
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "X-Request-Timeout must be a number of seconds above 0".into(),
                        None,
                    )
                })?;
            Some(Duration::from_secs_f64(seconds))
        }
    };
    let limit = match (asked, state.limits.request_timeout) {
        (Some(a), Some(s)) => Some(a.min(s)),
        (a, s) => a.or(s),
    };
    Ok(limit.map(|d| (Instant::now() + d, d.as_secs_f64())))
}

/// Holds places among the sequences the server has admitted (one a
/// choice); gives them back when dropped.
struct Admitted(Arc<State>, u64);

impl Admitted {
    /// Places for `choices` sequences, unless fewer are left than that
    /// while `parallel` sequences run and `max_queue` more wait.
    fn take(state: &Arc<State>, ready: &Ready, choices: usize) -> Result<Admitted, ApiError> {
        let queue = state.limits.max_queue;
        let most = (ready.scheduler.parallel() + queue) as u64;
        let k = choices as u64;
        let taken =
            state
                .counters
                .in_flight
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    (n + k <= most).then_some(n + k)
                });
        match taken {
            Ok(_) => Ok(Admitted(state.clone(), k)),
            Err(_) => Err(ApiError::queue_full(queue)),
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0
            .counters
            .in_flight
            .fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// Refuses a prompt whose bytes alone cannot fit the context: no token
/// stands for more than [`Ready::longest_token`] bytes.
pub(crate) fn check_prompt_bytes(ready: &Ready, bytes: usize) -> Result<(), ApiError> {
    let ctx = ready.scheduler.ctx_size();
    if bytes > ctx.saturating_mul(ready.longest_token) {
        return Err(ApiError::context_length(format!(
            "the prompt has {bytes} bytes, more than the {ctx} tokens the context holds \
             (prompt and answer together) can stand for"
        )));
    }
    Ok(())
}

/// Runs `tokenize` on a blocking thread, at most the configured number at
/// once (a permit is held until the work ends, even when the client has
/// gone), and compiles `grammar` there for each of `n` choices.
pub(crate) async fn prepare<F>(
    state: &Arc<State>,
    ready: &Ready,
    grammar: Option<Grammar>,
    n: usize,
    tokenize: F,
) -> Result<(Vec<u32>, Vec<Option<Constraint>>), ApiError>
where
    F: FnOnce(&Engine) -> encore_llm::Result<Vec<u32>> + Send + 'static,
{
    let permit = state
        .tokenizers
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    let engine = ready.engine.clone();
    let shared = state.clone();
    let work = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        shared.counters.tokenizing.fetch_add(1, Ordering::Relaxed);
        let tokens = tokenize(&engine);
        shared.counters.tokenizing.fetch_sub(1, Ordering::Relaxed);
        let tokens = tokens?;
        let constraints = match grammar {
            None => (0..n).map(|_| None).collect(),
            Some(grammar) => {
                let param = match grammar {
                    Grammar::Lark(_) => "grammar",
                    Grammar::Regex(_) => "regex",
                    _ => "response_format",
                };
                let constraints = shared
                    .get()
                    .ok_or_else(|| ApiError::unavailable("the model is still loading"))?
                    .constraints()
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                (0..n)
                    .map(|_| {
                        constraints
                            .compile(&grammar)
                            .map(Some)
                            .map_err(|e| ApiError::bad_request(e.to_string(), Some(param)))
                    })
                    .collect::<Result<Vec<_>, ApiError>>()?
            }
        };
        Ok::<_, ApiError>((tokens, constraints))
    });
    match work.await {
        Ok(prepared) => prepared,
        Err(e) => Err(ApiError::internal(format!("tokenizing the prompt: {e}"))),
    }
}

/// Sets the cancel flag when dropped: a request whose handler or stream is
/// dropped (the client went away, or its deadline passed) is cancelled.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What a generation gives its handler, for one of its choices: text, a
/// token's log-probability, or its end (only the two endings that complete
/// an answer; every other ending is an error).
pub(crate) enum Piece {
    Text(usize, String),
    Logprob(usize, TokenLogprob),
    Done {
        choice: usize,
        finish: &'static str,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// The stop string that ended the text, when one did.
        stop_string: Option<String>,
    },
}

/// A generation on its way: the events of its choices, and the guards
/// that cancel it and hold its place.
pub(crate) struct Running {
    events: mpsc::UnboundedReceiver<(usize, Event)>,
    guard: CancelOnDrop,
    _admitted: Admitted,
    pub(crate) state: Arc<State>,
    engine: Arc<Engine>,
    deadline: Option<(Instant, f64)>,
    /// Whether text has been given out.
    started: bool,
    /// Choices generated.
    n: usize,
    /// The prompt's length in tokens.
    pub(crate) prompt_tokens: usize,
    /// How tool calls are written, when the answer is read for them.
    pub(crate) tools: Option<(ToolSyntax, Arc<Tools>)>,
    id: String,
    created: u64,
    pub(crate) model: String,
    kind: Kind,
}

impl Running {
    /// The next piece, or the error that ends the request.
    pub(crate) async fn next(&mut self) -> Result<Piece, ApiError> {
        let event = match self.deadline {
            None => self.events.recv().await,
            Some((at, seconds)) => match tokio::time::timeout_at(at, self.events.recv()).await {
                Ok(event) => event,
                Err(_) => {
                    self.guard.0.store(true, Ordering::Relaxed);
                    return Err(ApiError::deadline(seconds));
                }
            },
        };
        match event {
            Some((i, Event::Text(t))) => {
                self.started = true;
                Ok(Piece::Text(i, t))
            }
            Some((i, Event::Logprob(l))) => Ok(Piece::Logprob(i, l)),
            Some((
                choice,
                Event::Done {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    stop_string,
                },
            )) => {
                let finish = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::Shutdown => {
                        return Err(ApiError::shut_down(self.started || completion_tokens > 0))
                    }
                    FinishReason::Cancelled => {
                        return Err(ApiError::internal("the request was cancelled".into()))
                    }
                };
                Ok(Piece::Done {
                    choice,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    stop_string,
                })
            }
            Some((_, Event::Error(message))) => {
                if self.state.faulted() {
                    self.state.fault();
                    Err(ApiError::device(&message))
                } else {
                    Err(ApiError::internal(message))
                }
            }
            Some((_, _)) => Err(ApiError::internal(
                "the generation sent an event this server does not know".into(),
            )),
            None => Err(ApiError::internal(
                "the generation ended without a result".into(),
            )),
        }
    }
}

/// Submits one sequence a choice, each with its own seed (the request's
/// plus the choice's index) and constraint.
#[allow(clippy::too_many_arguments)]
fn submit(
    state: &Arc<State>,
    ready: &Ready,
    admitted: Admitted,
    prompt: Vec<u32>,
    constraints: Vec<Option<Constraint>>,
    settings: &Settings,
    kind: Kind,
    deadline: Option<(Instant, f64)>,
) -> Result<Running, ApiError> {
    let ctx = ready.scheduler.ctx_size();
    let room = ctx.saturating_sub(prompt.len());
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    // Made before the first choice is queued: where a later one is refused,
    // dropping it cancels those queued before.
    let guard = CancelOnDrop(cancel.clone());
    let n = constraints.len();
    for (i, constraint) in constraints.into_iter().enumerate() {
        let tx = tx.clone();
        let mut sampler = settings.sampler.clone();
        sampler.seed = sampler.seed.wrapping_add(i as u64);
        ready.scheduler.submit(GenRequest {
            max_tokens: settings.max_tokens.unwrap_or(room).min(room.max(1)),
            prompt: prompt.clone(),
            sampler,
            stop: settings.stop.clone(),
            ignore_eos: settings.ignore_eos,
            logprobs: settings.logprobs,
            constraint,
            cancel: cancel.clone(),
            events: Box::new(move |e| tx.send((i, e)).is_ok()),
        })?;
    }
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    Ok(Running {
        events: rx,
        guard,
        _admitted: admitted,
        state: state.clone(),
        engine: ready.engine.clone(),
        deadline,
        started: false,
        n,
        prompt_tokens: prompt.len(),
        tools: settings.tools.clone(),
        id: format!("{prefix}-{:016x}", request_id()),
        created: now(),
        model: state.model_id.clone(),
        kind,
    })
}

/// A request id: the time and a counter, unique within the process.
pub(crate) fn request_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    (now() << 20) ^ n
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

pub(crate) async fn chat(Extract(state): Shared, request: Request) -> Result<Response, ApiError> {
    let ready = ready(&state)?;
    let deadline = deadline(&state, request.headers())?;
    let body = read_body(&state, request).await?;
    let request: api::ChatRequest = api::parse(&body)?;
    let mut settings = request.sampling.settings(true)?;
    check_model(&state, &request.model)?;
    let messages = request.messages()?;
    let tools = request.tools()?;
    let (running, first) =
        converse(&state, ready, &mut settings, messages, tools, deadline).await?;
    respond(running, first, &settings).await
}

/// Starts a conversation's answer ([`conversation_prompt`]), submitted.
/// Returns the generation and its first piece.
pub(crate) async fn converse(
    state: &Arc<State>,
    ready: &Ready,
    settings: &mut Settings,
    messages: Vec<Message>,
    tools: Option<(Tools, ToolChoice)>,
    deadline: Option<(Instant, f64)>,
) -> Result<(Running, Piece), ApiError> {
    let tokenize = conversation_prompt(ready, settings, messages, tools)?;
    start(state, ready, settings, Kind::Chat, deadline, tokenize).await
}

/// What tokenizes a conversation's prompt: refuses markup that spells
/// control tokens and prompts too long for the context, offers `tools`
/// (which sets how `settings` reads and holds the answer), and renders the
/// conversation through the chat template.
pub(crate) fn conversation_prompt(
    ready: &Ready,
    settings: &mut Settings,
    mut messages: Vec<Message>,
    tools: Option<(Tools, ToolChoice)>,
) -> Result<impl FnOnce(&Engine) -> encore_llm::Result<Vec<u32>> + Send + 'static, ApiError> {
    if let Some((t, _)) = &tools {
        // Refused whether the template renders them or a system message holds them.
        tools::refuse_control_markup(ready.engine.tokenizer(), &[], &t.specs)?;
    }
    let offered = tools.as_ref().map_or(0, |(t, _)| t.system_prompt().len());
    check_prompt_bytes(
        ready,
        messages.iter().map(|m| m.content.len()).sum::<usize>() + offered,
    )?;
    let rendered = match tools {
        None => None,
        Some((tools, choice)) => Some(offer_tools(ready, settings, &mut messages, tools, choice)?),
    };
    Ok(move |e: &Engine| match rendered {
        None => {
            tools::refuse_control_markup(e.tokenizer(), &messages, &[])?;
            e.chat_tokens(&messages, true)
        }
        Some((template, specs)) => tools::chat_tokens(&template, e.tokenizer(), &messages, &specs),
    })
}

/// Offers `tools` to the model: through the template where it renders
/// tools, else in a system message; holds the output to a call where
/// `choice` requires one; and marks the answer to be read for calls.
/// Returns the template and the tool specs it renders.
fn offer_tools(
    ready: &Ready,
    settings: &mut Settings,
    messages: &mut Vec<Message>,
    tools: Tools,
    choice: ToolChoice,
) -> Result<(Arc<ChatTemplate>, Vec<Value>), ApiError> {
    let template = ready.template().map_err(ApiError::internal)?;
    let (syntax, specs) = if tools::template_renders_tools(&template) {
        (tools::syntax_of(&template), tools.specs.clone())
    } else {
        let prompt = tools.system_prompt();
        match messages.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{prompt}", first.content);
            }
            _ => messages.insert(0, Message::new("system", prompt)),
        }
        (ToolSyntax::Tagged, Vec::new())
    };
    let only = match &choice {
        ToolChoice::Required => Some(None),
        ToolChoice::Function(name) => Some(Some(name.as_str())),
        ToolChoice::Auto | ToolChoice::None => None,
    };
    if let Some(only) = only {
        if settings.grammar.is_some() {
            return Err(ApiError::bad_request(
                "a required tool call and response_format both constrain the output: give one"
                    .into(),
                Some("tool_choice"),
            ));
        }
        settings.grammar = Some(tools.call_grammar(syntax, only));
    }
    settings.tools = Some((syntax, Arc::new(tools)));
    Ok((template, specs))
}

pub(crate) async fn completions(
    Extract(state): Shared,
    request: Request,
) -> Result<Response, ApiError> {
    let ready = ready(&state)?;
    let deadline = deadline(&state, request.headers())?;
    let body = read_body(&state, request).await?;
    let request: api::CompletionRequest = api::parse(&body)?;
    let settings = request.sampling.settings(false)?;
    check_model(&state, &request.model)?;
    let prompt = request.prompt()?.to_string();
    check_prompt_bytes(ready, prompt.len())?;
    let (running, first) = start(
        &state,
        ready,
        &settings,
        Kind::Completion,
        deadline,
        move |e| e.prompt_tokens(&prompt, true),
    )
    .await?;
    respond(running, first, &settings).await
}

/// Starts a request whose prompt `tokenize` makes: takes its place,
/// prepares the prompt and constraints and submits its choices. Returns
/// the generation and its first piece, which decides the answer's status.
async fn start<F>(
    state: &Arc<State>,
    ready: &Ready,
    settings: &Settings,
    kind: Kind,
    deadline: Option<(Instant, f64)>,
    tokenize: F,
) -> Result<(Running, Piece), ApiError>
where
    F: FnOnce(&Engine) -> encore_llm::Result<Vec<u32>> + Send + 'static,
{
    let admitted = Admitted::take(state, ready, settings.n)?;
    let (prompt, constraints) =
        prepare(state, ready, settings.grammar.clone(), settings.n, tokenize).await?;
    let mut running = submit(
        state,
        ready,
        admitted,
        prompt,
        constraints,
        settings,
        kind,
        deadline,
    )?;
    let first = running.next().await?;
    Ok((running, first))
}

/// Answers in OpenAI's shape, as a stream or a whole.
async fn respond(
    running: Running,
    first: Piece,
    settings: &Settings,
) -> Result<Response, ApiError> {
    if settings.stream {
        Ok(stream(running, first, settings).into_response())
    } else {
        collect(running, first, settings.logprobs.is_some())
            .await
            .map(IntoResponse::into_response)
    }
}

/// A chat answer's message and finish reason: with the tool calls it
/// wrote, when the answer is read for them (then it finishes with
/// `tool_calls`, and its content is the text around them, or null).
fn assistant(
    offered: Option<&(ToolSyntax, Arc<Tools>)>,
    text: String,
    finish: Option<&'static str>,
) -> (Value, Option<&'static str>) {
    let Some((syntax, offered)) = offered else {
        return (json!({"role": "assistant", "content": text}), finish);
    };
    let (content, calls) = tools::parse_calls(*syntax, offered, &text);
    if calls.is_empty() {
        return (json!({"role": "assistant", "content": text}), finish);
    }
    let calls: Vec<Value> = calls
        .into_iter()
        .map(|c| {
            json!({
                "id": format!("call_{:016x}", request_id()),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect();
    let content = (!content.is_empty()).then_some(content);
    let finish = match finish {
        Some("stop") => Some("tool_calls"),
        other => other,
    };
    (
        json!({"role": "assistant", "content": content, "tool_calls": calls}),
        finish,
    )
}

/// One choice's answer as it is gathered.
#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<&'static str>,
}

/// Waits for the whole answer: every choice's end.
async fn collect(
    mut r: Running,
    first: Piece,
    with_logprobs: bool,
) -> Result<Json<Value>, ApiError> {
    let mut choices: Vec<Choice> = (0..r.n).map(|_| Choice::default()).collect();
    let (mut completion, mut left) = (0, r.n);
    let mut piece = first;
    let prompt = loop {
        match piece {
            Piece::Text(i, t) => choices[i].text.push_str(&t),
            Piece::Logprob(i, l) => choices[i].logprobs.push(l),
            Piece::Done {
                choice,
                finish,
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                choices[choice].finish = Some(finish);
                completion += completion_tokens;
                left -= 1;
                if left == 0 {
                    break prompt_tokens;
                }
            }
        }
        piece = r.next().await?;
    };
    let tokenizer = r.engine.tokenizer();
    let choices: Vec<Value> = choices
        .into_iter()
        .enumerate()
        .map(|(index, c)| {
            let lp = with_logprobs.then(|| logprobs::json(tokenizer, r.kind, &c.logprobs, 0));
            match r.kind {
                Kind::Chat => {
                    let (message, finish) = assistant(r.tools.as_ref(), c.text, c.finish);
                    json!({
                        "index": index,
                        "message": message,
                        "finish_reason": finish,
                        "logprobs": lp,
                    })
                }
                Kind::Completion => json!({
                    "index": index,
                    "text": c.text,
                    "finish_reason": c.finish,
                    "logprobs": lp,
                }),
            }
        })
        .collect();
    let object = match r.kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    Ok(Json(json!({
        "id": r.id,
        "object": object,
        "created": r.created,
        "model": r.model,
        "choices": choices,
        "usage": usage(prompt, completion),
    })))
}

/// The answer as server-sent events: a chunk per piece of text of each
/// choice (with the log-probabilities of the tokens since that choice's
/// last chunk, when asked), a last chunk per choice with its finish reason
/// (and, when asked, one with the usage), then `[DONE]`. A generation cut
/// after its first piece ends with an error event instead, and no
/// `[DONE]`.
fn stream(mut r: Running, first: Piece, settings: &Settings) -> impl IntoResponse {
    let include_usage = settings.include_usage;
    let with_logprobs = settings.logprobs.is_some();
    let (tx, rx) = mpsc::unbounded_channel::<Result<Sse, Infallible>>();
    tokio::spawn(async move {
        let object = match r.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let (id, created, model, kind) = (r.id.clone(), r.created, r.model.clone(), r.kind);
        let engine = r.engine.clone();
        let chunk = |choice: Value| {
            let mut c = json!({
                "id": id,
                "object": object,
                "created": created,
                "model": model,
                "choices": [choice],
            });
            if include_usage {
                c["usage"] = Value::Null;
            }
            Sse::default().data(c.to_string())
        };
        // The tokens of each choice not yet sent, and the text offset
        // (completions) of the first of them.
        let mut pending: Vec<Vec<TokenLogprob>> = (0..r.n).map(|_| Vec::new()).collect();
        let mut offsets = vec![0usize; r.n];
        let mut held: Vec<String> = vec![String::new(); r.n];
        let piece = |index: usize,
                     text: &str,
                     finish: Option<&str>,
                     pending: &mut Vec<TokenLogprob>,
                     offset: &mut usize| {
            let lp = with_logprobs.then(|| {
                let lp = logprobs::json(engine.tokenizer(), kind, pending, *offset);
                *offset += logprobs::text_len(engine.tokenizer(), pending);
                pending.clear();
                lp
            });
            match kind {
                Kind::Chat => json!({
                    "index": index,
                    "delta": if finish.is_some() { json!({}) } else { json!({"content": text}) },
                    "finish_reason": finish,
                    "logprobs": lp,
                }),
                Kind::Completion => json!({
                    "index": index,
                    "text": text,
                    "finish_reason": finish,
                    "logprobs": lp,
                }),
            }
        };
        let send = |e: Sse| tx.send(Ok(e)).is_ok();
        if kind == Kind::Chat {
            for index in 0..r.n {
                let first = json!({
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": null,
                    "logprobs": null,
                });
                if !send(chunk(first)) {
                    return;
                }
            }
        }
        let (mut completion, mut left) = (0, r.n);
        let mut next: Result<Piece, ApiError> = Ok(first);
        loop {
            match next {
                // An answer read for tool calls is sent whole at its end.
                Ok(Piece::Text(i, t)) if r.tools.is_some() => held[i].push_str(&t),
                Ok(Piece::Text(i, t)) => {
                    let c = piece(i, &t, None, &mut pending[i], &mut offsets[i]);
                    if !send(chunk(c)) {
                        return; // the client left; dropping `r` cancels
                    }
                }
                Ok(Piece::Logprob(i, l)) => pending[i].push(l),
                Ok(Piece::Done {
                    choice,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    ..
                }) => {
                    let mut finish = Some(finish);
                    if r.tools.is_some() {
                        let text = std::mem::take(&mut held[choice]);
                        let (message, f) = assistant(r.tools.as_ref(), text, finish);
                        finish = f;
                        let mut delta = json!({});
                        if let Some(content) = message["content"].as_str() {
                            delta["content"] = json!(content);
                        }
                        if let Some(calls) = message["tool_calls"].as_array() {
                            let calls: Vec<Value> = calls
                                .iter()
                                .enumerate()
                                .map(|(k, c)| {
                                    let mut c = c.clone();
                                    c["index"] = json!(k);
                                    c
                                })
                                .collect();
                            delta["tool_calls"] = json!(calls);
                        }
                        let lp = with_logprobs
                            .then(|| logprobs::json(engine.tokenizer(), kind, &pending[choice], 0));
                        pending[choice].clear();
                        let c = json!({
                            "index": choice,
                            "delta": delta,
                            "finish_reason": null,
                            "logprobs": lp,
                        });
                        send(chunk(c));
                    }
                    let c = piece(
                        choice,
                        "",
                        finish,
                        &mut pending[choice],
                        &mut offsets[choice],
                    );
                    send(chunk(c));
                    completion += completion_tokens;
                    left -= 1;
                    if left > 0 {
                        next = tokio::select! {
                            piece = r.next() => piece,
                            () = tx.closed() => return,
                        };
                        continue;
                    }
                    if include_usage {
                        let last = json!({
                            "id": id,
                            "object": object,
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage(prompt_tokens, completion),
                        });
                        send(Sse::default().data(last.to_string()));
                    }
                    send(Sse::default().data("[DONE]"));
                    return;
                }
                Err(error) => {
                    // Counted here: the response's status went out long ago.
                    r.state.counters.outcome(error.outcome());
                    send(Sse::default().data(error.body().to_string()));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_key_matches_the_key() {
        assert!(keys_match("s3cret-key", "s3cret-key"));
        for other in ["", "s3cret", "s3cret-key ", "s3cret-kez", "S3CRET-KEY"] {
            assert!(!keys_match(other, "s3cret-key"), "{other:?}");
        }
    }
}
