//! `encore serve`: the OpenAI-compatible server ([`encore_serve`]).
//!
//! The port is bound first, then the model is loaded and warmed behind it:
//! `/health` answers 503 until then, 200 after. Ctrl-C or SIGTERM stops
//! accepting requests, lets running ones finish (cutting them after
//! [`encore_serve::SHUTDOWN_GRACE`]) and exits 0.

use std::path::Path;
use std::sync::Arc;

use clap::Args;
use encore_llm::{Engine, Event, GenRequest, SamplerConfig, Scheduler, SchedulerConfig};

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
    let state = encore_serve::State::new(&model_id(&a.model));
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
    encore_serve::serve(listener, state, encore_serve::shutdown_signal())
        .await
        .map_err(|e| format!("serving: {e}"))?;
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
            cancel: Arc::default(),
            events: Box::new(move |e| tx.send(e).is_ok()),
        })
        .map_err(|e| e.to_string())?;
    loop {
        match rx.recv() {
            Ok(Event::Done { .. }) => break,
            Ok(Event::Error(e)) => return Err(format!("warming up: {e}")),
            Ok(Event::Text(_)) => {}
            Err(_) => return Err("warming up: the scheduler stopped".into()),
        }
    }
    Ok((engine, Arc::new(scheduler)))
}
