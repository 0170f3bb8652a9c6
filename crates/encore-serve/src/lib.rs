//! Encore's OpenAI-compatible HTTP server, on axum and tokio, over the
//! continuous-batching [`Scheduler`].
//!
//! Routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST
//! /v1/completions` (both streaming as server-sent events when asked),
//! `GET /health` (200 once the model is loaded and warmed, 503 before) and
//! `GET /metrics` (Prometheus text).
//!
//! The server binds first and loads the model behind it ([`State::ready`]),
//! so a load balancer sees it come up and waits for `/health`. It keeps no
//! state outside the process but its caches, so replicas scale out behind
//! any HTTP load balancer. A client that disconnects cancels its request,
//! which frees its KV blocks at the scheduler's next step.
//!
//! ```no_run
//! # async fn run(engine: std::sync::Arc<encore_llm::Engine>) -> std::io::Result<()> {
//! use std::sync::Arc;
//! use encore_llm::{Scheduler, SchedulerConfig};
//!
//! let state = encore_serve::State::new("smollm2-135m");
//! let scheduler = Scheduler::start(engine.clone(), SchedulerConfig::new(8, 4096)).expect("start");
//! state.ready(engine, Arc::new(scheduler));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! encore_serve::serve(listener, state, encore_serve::shutdown_signal()).await
//! # }
//! ```

pub mod api;
pub mod error;
mod metrics;
mod routes;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use encore_llm::{Engine, Scheduler};

pub use error::ApiError;

/// How long running requests may go on after a shutdown signal before
/// they are cut.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The loaded model and its scheduler.
pub struct Ready {
    pub engine: Arc<Engine>,
    pub scheduler: Arc<Scheduler>,
}

/// Everything the handlers share.
pub struct State {
    /// The id `/v1/models` lists and requests name.
    pub model_id: String,
    ready: OnceLock<Ready>,
    /// When the server started (Unix seconds), for `/v1/models`.
    created: u64,
    /// Responses by status class, for `/metrics`.
    responses: [AtomicU64; 5],
    /// A load that failed: `/health` reports it.
    failed: OnceLock<String>,
}

impl State {
    pub fn new(model_id: &str) -> Arc<State> {
        Arc::new(State {
            model_id: model_id.to_string(),
            ready: OnceLock::new(),
            created: now(),
            responses: Default::default(),
            failed: OnceLock::new(),
        })
    }

    /// Marks the server ready with the loaded model: requests are served
    /// from here on.
    pub fn ready(&self, engine: Arc<Engine>, scheduler: Arc<Scheduler>) {
        let _ = self.ready.set(Ready { engine, scheduler });
    }

    /// Records that loading failed: `/health` answers 500 with `message`.
    pub fn fail(&self, message: String) {
        let _ = self.failed.set(message);
    }

    /// The model and scheduler, once ready.
    pub fn get(&self) -> Option<&Ready> {
        self.ready.get()
    }

    fn count(&self, status: u16) {
        let class = (status / 100).clamp(1, 5) as usize - 1;
        self.responses[class].fetch_add(1, Ordering::Relaxed);
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
    routes::router(state)
}

/// Serves `state` on `listener` until `shutdown` completes; then stops
/// accepting connections, lets running requests finish for up to
/// [`SHUTDOWN_GRACE`] (cancelling what is left, so every stream ends with
/// its final chunk), and returns once every connection has closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(state.clone());
    let on_signal = {
        let state = state.clone();
        async move {
            shutdown.await;
            tracing::info!("shutting down: no new requests; finishing running ones");
            if let Some(ready) = state.get() {
                let scheduler = ready.scheduler.clone();
                // Blocking: waits for the scheduler's loop to end.
                tokio::task::spawn_blocking(move || scheduler.shutdown(SHUTDOWN_GRACE));
            }
        }
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(on_signal)
        .await
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
