//! Encore's OpenAI-compatible HTTP server, on axum, hyper and tokio, over
//! the continuous-batching [`Scheduler`].
//!
//! Routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST
//! /v1/completions` (both streaming as server-sent events when asked; with
//! `n` choices, log-probabilities, tool calls, and output held to a JSON
//! schema, a Lark grammar or a regex), `POST /v1/messages` (Anthropic's
//! Messages API, with tool use, streaming as Anthropic streams),
//! `GET /health` (200 once the model is loaded and warmed, 503 before,
//! while stopping and after a device error) and `GET /metrics`
//! (Prometheus text).
//!
//! The server binds first and loads the model behind it ([`State::ready`]),
//! so a load balancer sees it come up and waits for `/health`. It keeps no
//! state outside the process but its caches, so replicas scale out behind
//! any HTTP load balancer. A client that disconnects cancels its request,
//! which frees its KV blocks at the scheduler's next step.
//!
//! Every resource a client can hold is bounded ([`Limits`]): connections,
//! the time to send headers, to send a body and to read an answer, idle
//! keep-alive time, body and header sizes, waiting requests, concurrent
//! tokenization, and (when asked) a request's time to answer. Every
//! answer is honest: a cut answer ends with an error, never with a
//! `finish_reason`, and every error is in OpenAI's JSON shape
//! ([`ApiError`]), or Anthropic's under `/v1/messages`.
//!
//! ```no_run
//! # async fn run(engine: std::sync::Arc<encore_llm::Engine>) -> std::io::Result<()> {
//! use std::sync::Arc;
//! use encore_llm::{Scheduler, SchedulerConfig};
//!
//! let state = encore_serve::State::new("smollm2-135m", encore_serve::Limits::default());
//! let scheduler = Scheduler::start(engine.clone(), SchedulerConfig::new(8, 4096)).expect("start");
//! state.ready(engine, Arc::new(scheduler));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! encore_serve::serve(listener, state, encore_serve::shutdown_signal()).await
//! # }
//! ```

pub mod anthropic;
pub mod api;
mod conn;
pub mod error;
mod logprobs;
mod messages;
mod metrics;
mod routes;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use encore_llm::chat::ChatTemplate;
use encore_llm::constraint::{ConstraintError, Constraints};
use encore_llm::{Engine, Scheduler};

pub use error::ApiError;

/// The bounds the server holds every client to.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest request body, in bytes; a larger one gets a 413.
    pub max_body_bytes: usize,
    /// Largest request head (the request line and headers), in bytes; a
    /// larger one gets a 431.
    pub max_header_bytes: usize,
    /// Most headers a request may carry; more get a 431.
    pub max_headers: usize,
    /// Time a connection has to send a request's headers, from its opening
    /// or the end of its previous answer.
    pub header_timeout: Duration,
    /// A keep-alive connection that is silent this long with no request
    /// running is closed.
    pub idle_timeout: Duration,
    /// Time a request's body has to arrive (else a 408), and the longest a
    /// client may leave an answer unread before its connection is dropped.
    pub body_timeout: Duration,
    /// Connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Requests waiting for a free sequence slot; more get a 503 with
    /// `Retry-After`.
    pub max_queue: usize,
    /// The longest a request may take from its arrival to its last token;
    /// a request may ask for less with the `X-Request-Timeout` header (in
    /// seconds). Past it the request is cancelled and answered 504.
    pub request_timeout: Option<Duration>,
    /// Prompts tokenized at once (on blocking threads).
    pub tokenizer_threads: usize,
    /// The key every route but `/health` requires, as `Authorization:
    /// Bearer KEY` or `x-api-key: KEY`.
    pub api_key: Option<String>,
    /// How long running requests may go on after a shutdown signal before
    /// they are cut.
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_body_bytes: 4 << 20,
            max_header_bytes: 32 << 10,
            max_headers: 100,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(30),
            max_connections: 512,
            max_queue: 256,
            request_timeout: None,
            tokenizer_threads: std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .min(4),
            api_key: None,
            shutdown_grace: SHUTDOWN_GRACE,
        }
    }
}

/// How long running requests may go on after a shutdown signal before
/// they are cut, unless [`Limits::shutdown_grace`] says otherwise.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The loaded model and its scheduler.
pub struct Ready {
    /// The model, its tokenizer and chat template.
    pub engine: Arc<Engine>,
    /// The batching loop that runs every request.
    pub scheduler: Arc<Scheduler>,
    /// The most bytes one token of the vocabulary stands for: a prompt of
    /// more than `ctx_size` times this many bytes cannot fit the context,
    /// whatever its tokens.
    longest_token: usize,
    /// The vocabulary as constrained decoding sees it, built at the first
    /// request that asks for a grammar.
    constraints: OnceLock<Result<Arc<Constraints>, ConstraintError>>,
    /// The model's chat template, for conversations that offer tools.
    template: OnceLock<Result<Arc<ChatTemplate>, String>>,
}

impl Ready {
    /// What compiles grammars for this model (built on first use, which
    /// takes a moment: call it off the async threads).
    pub fn constraints(&self) -> Result<Arc<Constraints>, ConstraintError> {
        self.constraints
            .get_or_init(|| Constraints::new(self.engine.tokenizer()).map(Arc::new))
            .clone()
    }

    /// The model's chat template, as the engine renders it.
    pub fn template(&self) -> Result<Arc<ChatTemplate>, String> {
        self.template
            .get_or_init(|| {
                ChatTemplate::for_tokenizer(self.engine.tokenizer())
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
    }
}

/// Everything the handlers share.
pub struct State {
    /// The id `/v1/models` lists and requests name.
    pub model_id: String,
    /// The bounds clients are held to.
    pub limits: Limits,
    ready: OnceLock<Ready>,
    /// When the server started (Unix seconds), for `/v1/models`.
    created: u64,
    counters: metrics::Counters,
    /// A load that failed: `/health` reports it.
    failed: OnceLock<String>,
    /// Set on a device error: `/health` answers 503, and the server drains
    /// and stops.
    faulted: AtomicBool,
    /// Set once the server stops taking requests.
    stopping: AtomicBool,
    /// Wakes the accept loop on a fault.
    fault: tokio::sync::Notify,
    /// Bounds the prompts tokenized at once.
    tokenizers: Arc<tokio::sync::Semaphore>,
}

impl State {
    /// A server for `model_id`, not ready until [`State::ready`].
    pub fn new(model_id: &str, limits: Limits) -> Arc<State> {
        let tokenizers = Arc::new(tokio::sync::Semaphore::new(limits.tokenizer_threads.max(1)));
        Arc::new(State {
            model_id: model_id.to_string(),
            limits,
            ready: OnceLock::new(),
            created: now(),
            counters: metrics::Counters::default(),
            failed: OnceLock::new(),
            faulted: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            fault: tokio::sync::Notify::new(),
            tokenizers,
        })
    }

    /// Marks the server ready with the loaded model: requests are served
    /// from here on.
    pub fn ready(&self, engine: Arc<Engine>, scheduler: Arc<Scheduler>) {
        let tokenizer = engine.tokenizer();
        let longest_token = (0..tokenizer.vocab_size() as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id).map_or(0, <[u8]>::len);
                let text = tokenizer.token_text(id).map_or(0, str::len);
                bytes.max(text)
            })
            .max()
            .unwrap_or(0)
            .max(1);
        let _ = self.ready.set(Ready {
            engine,
            scheduler,
            longest_token,
            constraints: OnceLock::new(),
            template: OnceLock::new(),
        });
    }

    /// Records that loading failed: `/health` answers 500 with `message`.
    pub fn fail(&self, message: String) {
        let _ = self.failed.set(message);
    }

    /// The model and scheduler, once ready.
    pub fn get(&self) -> Option<&Ready> {
        self.ready.get()
    }

    /// Whether a device error has made the server unhealthy: it drains and
    /// stops, and its process should exit with a failure.
    pub fn faulted(&self) -> bool {
        self.faulted.load(Ordering::Relaxed)
            || self
                .get()
                .is_some_and(|r| r.scheduler.metrics().device_errors.load(Ordering::Relaxed) > 0)
    }

    /// Marks the server unhealthy and starts its drain.
    fn fault(&self) {
        if !self.faulted.swap(true, Ordering::Relaxed) {
            tracing::error!("a device error: the server is unhealthy and stops");
        }
        self.fault.notify_one();
    }
}

/// Unix time in seconds.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The router of every route over `state`.
pub fn router(state: Arc<State>) -> axum::Router {
    use axum::middleware;
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1/models", get(routes::models))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/messages", post(messages::create))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/health", get(routes::health))
        .route("/metrics", get(metrics::render))
        .fallback(routes::fallback)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            routes::authorize,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            routes::check_head,
        ))
        .layer(middleware::from_fn(routes::json_errors))
        .layer(middleware::from_fn(messages::error_shape))
        .layer(middleware::from_fn_with_state(state.clone(), routes::count))
        .with_state(state)
}

/// Serves `state` on `listener` until `shutdown` completes or a device
/// error makes the server unhealthy; then stops accepting connections,
/// answers waiting requests 503, lets running ones finish for up to
/// [`Limits::shutdown_grace`] (ending what is left with an error), and
/// returns once every connection has closed. After a device error
/// [`State::faulted`] is true.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    conn::serve(listener, state, shutdown).await
}

/// Completes on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
