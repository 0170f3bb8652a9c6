//! `encore serve`: the OpenAI-compatible server ([`encore_serve`]).
//!
//! The port is bound first, then the model is loaded and warmed behind it:
//! `/health` answers 503 until then, 200 after. Ctrl-C or SIGTERM stops
//! accepting requests, answers waiting ones 503, lets running ones finish
//! (cutting them after `--shutdown-grace`) and exits 0; a device error
//! does the same but exits 1, so a supervisor replaces the process.

use std::path::Path;
use std::sync::Arc;

use clap::Args;
use encore_llm::{Engine, Event, GenRequest, SamplerConfig, Scheduler, SchedulerConfig};

use crate::speculate::SpeculateArgs;
use crate::{
    count, in_range, load, model_label, open, to_stderr, CliResult, ModelArgs, ProfileArgs,
};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests generating at once (more wait in a queue), 1 to 1024.
    #[arg(long, default_value_t = 8, value_parser = count, allow_negative_numbers = true)]
    parallel: usize,
    /// Positions (prompt and answer) one request may use; at most the
    /// model's context [default: 4096 or the model's context, if smaller].
    #[arg(short = 'c', long = "ctx-size", value_parser = count, allow_negative_numbers = true)]
    ctx_size: Option<usize>,
    /// Positions the KV cache holds for all requests together; requests
    /// that outgrow it are paused and resumed [default: parallel x
    /// min(ctx-size, 1024), at least ctx-size].
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    kv_size: Option<usize>,
    /// Requests that may wait for a free slot; more are answered 503 with
    /// Retry-After.
    #[arg(long, default_value_t = 256, value_parser = count, allow_negative_numbers = true)]
    max_queue: usize,
    /// Client connections open at once; more are answered 503 and closed.
    #[arg(long, default_value_t = 512, value_parser = count, allow_negative_numbers = true)]
    max_connections: usize,
    /// Largest request body in bytes; larger ones are answered 413.
    #[arg(long, default_value_t = 4 << 20, value_parser = count, allow_negative_numbers = true)]
    max_body_bytes: usize,
    /// Seconds a connection has to send a request's headers (from its
    /// opening or its previous answer's end).
    #[arg(long, default_value_t = 10.0, value_parser = seconds, allow_negative_numbers = true)]
    header_timeout: f64,
    /// Seconds a silent keep-alive connection with no request running stays
    /// open.
    #[arg(long, default_value_t = 5.0, value_parser = seconds, allow_negative_numbers = true)]
    idle_timeout: f64,
    /// Seconds a request body has to arrive (else 408), and that a client
    /// may leave an answer unread before its connection is dropped.
    #[arg(long, default_value_t = 30.0, value_parser = seconds, allow_negative_numbers = true)]
    body_timeout: f64,
    /// Seconds a request may take to its last token; past it the request is
    /// cancelled and answered 504. A request may ask for less with the
    /// X-Request-Timeout header [default: no limit].
    #[arg(long, value_parser = seconds, allow_negative_numbers = true)]
    request_timeout: Option<f64>,
    /// Seconds running requests may go on after SIGTERM or Ctrl-C before
    /// they are cut.
    #[arg(long, default_value_t = 10.0, value_parser = seconds, allow_negative_numbers = true)]
    shutdown_grace: f64,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but /health.
    #[arg(long, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// Read the key --api-key would give from a file (its first line).
    #[arg(long)]
    api_key_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    speculate: SpeculateArgs,
    /// Fail the scheduler's step with this number (counting from 0; the
    /// warm-up request runs the first few) as a device error would, for
    /// tests of fault handling.
    #[arg(long, hide = true)]
    inject_fault_at_step: Option<u64>,
}

/// Parses a duration flag in seconds: a finite number above 0.
fn seconds(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0 && *v <= 1e9)
        .ok_or_else(|| "expected a number of seconds above 0".to_string())
}

/// The server's limits from the flags.
fn limits(a: &ServeArgs) -> Result<encore_serve::Limits, String> {
    let key = match (&a.api_key, &a.api_key_file) {
        (Some(key), _) => Some(key.clone()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--api-key-file {}: {e}", path.display()))?;
            Some(text.lines().next().unwrap_or_default().trim().to_string())
        }
        (None, None) => None,
    };
    if key.as_ref().is_some_and(String::is_empty) {
        return Err("--api-key: the key is empty".into());
    }
    let secs = std::time::Duration::from_secs_f64;
    Ok(encore_serve::Limits {
        max_body_bytes: a.max_body_bytes,
        header_timeout: secs(a.header_timeout),
        idle_timeout: secs(a.idle_timeout),
        body_timeout: secs(a.body_timeout),
        max_connections: a.max_connections,
        max_queue: a.max_queue,
        request_timeout: a.request_timeout.map(secs),
        api_key: key,
        shutdown_grace: secs(a.shutdown_grace),
        ..encore_serve::Limits::default()
    })
}

/// The id requests use for the model: the catalog name, or a file's stem.
fn model_id(args: &ModelArgs) -> String {
    let label = model_label(args);
    match args.model {
        Some(_) if Path::new(label.as_ref()).exists() => Path::new(label.as_ref())
            .file_stem()
            .map_or(label.to_string(), |s| s.to_string_lossy().into_owned()),
        _ => label.into_owned(),
    }
}

pub fn run(a: ServeArgs) -> CliResult {
    in_range("--parallel", a.parallel, 1, 1024, "")?;
    in_range("--max-connections", a.max_connections, 1, 1 << 20, "")?;
    in_range("--max-body-bytes", a.max_body_bytes, 1, 1 << 30, "")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the async runtime: {e}"))?;
    runtime.block_on(serve(a))
}

async fn serve(a: ServeArgs) -> CliResult {
    let address = format!("{}:{}", a.host, a.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|e| format!("listening on {address}: {e}"))?;
    let bound = listener
        .local_addr()
        .map_err(|e| format!("listening on {address}: {e}"))?;
    let limits = limits(&a)?;
    if limits.api_key.is_none() && !bound.ip().is_loopback() {
        to_stderr(&format!(
            "warning: listening on {} without an API key: anyone who can reach it may use it \
             (give --api-key or --api-key-file)\n",
            bound.ip()
        ));
    }
    let state = encore_serve::State::new(&model_id(&a.model), limits);
    to_stderr(&format!(
        "encore: listening on http://{bound} (model `{}`; /health is ready once it is loaded)\n",
        state.model_id
    ));
    let loading = state.clone();
    std::thread::spawn(move || match start(&a) {
        Ok((engine, scheduler)) => {
            loading.ready(engine, scheduler);
            to_stderr("encore: ready\n");
        }
        Err(e) => {
            to_stderr(&format!("error: {e}\n"));
            loading.fail(e);
        }
    });
    encore_serve::serve(listener, state.clone(), encore_serve::shutdown_signal())
        .await
        .map_err(|e| format!("serving: {e}"))?;
    if state.faulted() {
        let message = "a device error made the server unhealthy; it stopped after draining";
        return Err(message.to_string().into());
    }
    to_stderr("encore: stopped\n");
    Ok(())
}

/// Loads the model, starts the scheduler and warms it with one short
/// request (compiling kernels and recording the first decode graph).
fn start(a: &ServeArgs) -> Result<(Arc<Engine>, Arc<Scheduler>), String> {
    let device = open(&a.model, &ProfileArgs::default())?;
    to_stderr(&format!(
        "encore: loading the model on {} and recording its decode graphs \
         (a first start on a GPU compiles its kernels, which can take minutes; \
         later starts take them from the disk cache)\n",
        device.name()
    ));
    let engine = Arc::new(load(&a.model, &device)?);
    let context = engine.model().config.context_length;
    let ctx_size = a.ctx_size.unwrap_or(4096.min(context));
    if !(2..=context).contains(&ctx_size) {
        return Err(format!(
            "--ctx-size {ctx_size}: expected 2 to {context} (the model's context)"
        ));
    }
    let mut config = SchedulerConfig::new(a.parallel, ctx_size);
    if let Some(kv) = a.kv_size {
        config.kv_positions = kv;
    }
    config.fault_at_step = a.inject_fault_at_step;
    config.speculation = a.speculate.speculation().map_err(|e| e.to_string())?;
    let scheduler = Scheduler::start(engine.clone(), config).map_err(|e| e.to_string())?;
    let warm = engine
        .prompt_tokens("Hello", true)
        .map_err(|e| e.to_string())?;
    let (tx, rx) = std::sync::mpsc::channel();
    scheduler
        .submit(GenRequest {
            prompt: warm,
            max_tokens: 4,
            sampler: SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            constraint: None,
            cancel: Arc::default(),
            events: Box::new(move |e| tx.send(e).is_ok()),
        })
        .map_err(|e| e.to_string())?;
    loop {
        match rx.recv() {
            Ok(Event::Done { .. }) => break,
            Ok(Event::Error(e)) => return Err(format!("warming up: {e}")),
            Ok(_) => {}
            Err(_) => return Err("warming up: the scheduler stopped".into()),
        }
    }
    Ok((engine, Arc::new(scheduler)))
}
