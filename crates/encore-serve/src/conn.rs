//! Connections: the accept loop, each connection's HTTP/1 service under
//! the [`Limits`](crate::Limits), and the drain at shutdown.
//!
//! hyper bounds the time to send a request head (which also runs while a
//! keep-alive connection waits for its next request) and the head's size.
//! Each connection's socket is watched ([`Watched`]): a connection silent
//! for the idle timeout with no request running is closed, and one whose
//! client leaves an answer unread for the body timeout is dropped, which
//! cancels its request. Connections over the cap are answered 503 and
//! closed without being served.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

use crate::error::ApiError;
use crate::State;

/// What a connection's socket and requests have been doing.
struct Activity {
    opened: Instant,
    /// Milliseconds after `opened` of the last byte read or written.
    last: AtomicU64,
    /// Milliseconds after `opened` since which a write has waited for the
    /// client to read; 0 when no write waits.
    write_blocked: AtomicU64,
    /// Requests on this connection whose answers have not ended.
    requests: AtomicUsize,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            opened: Instant::now(),
            last: AtomicU64::new(0),
            write_blocked: AtomicU64::new(0),
            requests: AtomicUsize::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    fn touch(&self) {
        self.last.store(self.now(), Ordering::Relaxed);
    }

    /// How long the connection has been silent with no request running, if
    /// it has.
    fn idle(&self) -> Option<Duration> {
        (self.requests.load(Ordering::Relaxed) == 0).then(|| {
            Duration::from_millis(self.now().saturating_sub(self.last.load(Ordering::Relaxed)))
        })
    }

    /// How long a write has waited for the client to read, if one waits.
    fn stalled(&self) -> Option<Duration> {
        match self.write_blocked.load(Ordering::Relaxed) {
            0 => None,
            since => Some(Duration::from_millis(self.now().saturating_sub(since))),
        }
    }
}

/// A socket that records its activity.
struct Watched {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.touch();
        }
        poll
    }
}

impl Watched {
    fn wrote<T>(&self, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        let a = &self.activity;
        match &poll {
            Poll::Pending => {
                let _ = a.write_blocked.compare_exchange(
                    0,
                    a.now().max(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            Poll::Ready(_) => {
                a.write_blocked.store(0, Ordering::Relaxed);
                a.touch();
            }
        }
        poll
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.wrote(poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.wrote(poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_flush(cx);
        this.wrote(poll)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Counts a request as running on its connection until its answer's body
/// has been sent or dropped.
struct Running(Arc<Activity>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.requests.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

/// A response body that holds its request's [`Running`] mark.
struct MarkedBody {
    body: Body,
    _running: Running,
}

impl http_body::Body for MarkedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Resolves once a device error has made the server unhealthy: when a
/// handler saw one, or when the scheduler counted one, which no handler
/// may see (every sequence of the failed step had lost its client).
async fn faulted(state: &State) {
    loop {
        if state.faulted() {
            state.fault();
            return;
        }
        tokio::select! {
            () = state.fault.notified() => return,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

/// The accept loop; see [`crate::serve`].
pub(crate) async fn serve(
    listener: TcpListener,
    state: Arc<State>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let limits = state.limits.clone();
    let app = crate::router(state.clone());
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let (stop, stopped) = watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    // hyper answers an empty 431 past its own bounds; the router answers a
    // JSON 431 past the (smaller) configured ones, so hyper's are wider.
    let head = limits.max_header_bytes.saturating_mul(4).max(8192);
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_headers(limits.max_headers.saturating_mul(4).max(16))
        .max_header_size(head)
        .max_buf_size(head.saturating_add(16 << 10));
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
            () = faulted(&state) => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, most likely: wait for some to
                // close rather than spin.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            state.counters.reject("too_many_connections");
            tokio::spawn(refuse(stream, limits.max_connections));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity::new());
        let io = TokioIo::new(Watched {
            stream,
            activity: activity.clone(),
        });
        let service = {
            let activity = activity.clone();
            let app = app.clone();
            tower::service_fn(move |request: Request<hyper::body::Incoming>| {
                activity.requests.fetch_add(1, Ordering::Relaxed);
                let running = Running(activity.clone());
                let app = app.clone();
                async move {
                    let response: Response = app.oneshot(request.map(Body::new)).await?;
                    Ok::<_, std::convert::Infallible>(response.map(|body| {
                        Body::new(MarkedBody {
                            body,
                            _running: running,
                        })
                    }))
                }
            })
        };
        let connection = http.serve_connection(io, TowerToHyperService::new(service));
        let state = state.clone();
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            state.counters.connections.fetch_add(1, Ordering::Relaxed);
            tokio::pin!(connection);
            let mut closing = false;
            let tick =
                (limits.idle_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = connection.as_mut() => break,
                    _ = stopped.changed(), if !closing => {
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    () = tokio::time::sleep(tick) => {
                        if activity.stalled().is_some_and(|d| d >= limits.body_timeout) {
                            tracing::debug!("dropping a connection whose client stopped reading");
                            break;
                        }
                        if !closing && activity.idle().is_some_and(|d| d >= limits.idle_timeout) {
                            connection.as_mut().graceful_shutdown();
                            closing = true;
                        }
                    }
                }
            }
            state.counters.connections.fetch_sub(1, Ordering::Relaxed);
            drop(slot);
        });
    }
    drop(listener);
    state.stopping.store(true, Ordering::Relaxed);
    tracing::info!("shutting down: no new requests; finishing running ones");
    // Idle connections close now, busy ones after their answers.
    let _ = stop.send(true);
    let scheduler = state.get().map(|ready| ready.scheduler.clone());
    let grace = limits.shutdown_grace;
    let drained = tokio::task::spawn_blocking(move || {
        if let Some(scheduler) = scheduler {
            // Waits for the scheduler's loop to end.
            scheduler.shutdown(grace);
        }
    });
    let _ = drained.await;
    // Connections end once their answers are sent; a client that does not
    // read its answer is dropped at the body timeout. The wait is bounded
    // all the same.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let wait = limits.body_timeout + Duration::from_secs(1);
    let _ = tokio::time::timeout(wait, slots.acquire_many(all)).await;
    Ok(())
}

/// Answers a connection over the cap with a 503 and closes it.
async fn refuse(mut stream: TcpStream, cap: usize) {
    let error = ApiError {
        retry_after: Some(1),
        code: Some("too_many_connections"),
        ..ApiError::unavailable(&format!(
            "the server holds {cap} connections, its most; retry later"
        ))
    };
    let body = error.body().to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let write = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}
