//! `encore`: generate text, chat, serve, benchmark, and list models and devices.
//!
//! Every input is checked before it is used: counts against the model's
//! context and sane bounds, sampling settings by
//! [`SamplerConfig::validate`], each failure one `error:` line naming the
//! flag and its range. Output goes through [`Out`], which checks every
//! write: a closed pipe ends the command quietly with status 0 (as `head`
//! expects of what it reads, and as ripgrep does), any other failure to
//! write is an error.

mod bench_parallel;
mod chat;
mod report;
mod serve;
mod speculate;

use std::ffi::OsString;
use std::fmt;
use std::io::{self, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use encore::{Config, Device, ProfileMode};
use encore_llm::catalog::{self, Choice};
use encore_llm::fetch::{self, CacheState, Progress};
use encore_llm::gguf::GgufFile;
use encore_llm::sampler::{SamplerError, SamplerField};
use encore_llm::{Engine, EngineOptions, GenerateOptions, LoadProgress, SamplerConfig};
use encore_ops::KernelSet;

#[derive(Parser)]
#[command(
    name = "encore",
    version,
    about = "LLM inference on the Encore GPU command runtime"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt, streamed to stdout.
    Generate(GenerateArgs),
    /// Chat with the model in the terminal: streaming answers, history,
    /// `/reset` and `/exit`; Ctrl-C stops the current answer.
    Chat(chat::ChatArgs),
    /// Serve an OpenAI-compatible HTTP API with continuous batching.
    Serve(serve::ServeArgs),
    /// Measure prefill and decode speed.
    Bench(BenchArgs),
    /// Perplexity of the model on a text file, computed as llama.cpp's
    /// llama-perplexity computes it; `PPL = <value> +/- <error>` is the last
    /// line of stdout.
    Perplexity(PerplexityArgs),
    /// List the models `--model` can name, and whether each is cached.
    Models(ModelsArgs),
    /// List the devices Encore can use.
    Devices,
}

#[derive(Args)]
struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens per chunk; the second half of each chunk is scored.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512, value_parser = count)]
    ctx_size: usize,
    /// Also print the result as one JSON object (before the PPL line).
    #[arg(long)]
    json: bool,
    /// The text file (UTF-8).
    file: PathBuf,
    #[command(flatten)]
    profile: ProfileArgs,
}

#[derive(Args)]
struct ModelArgs {
    /// Model: a GGUF file's path, or a catalog name (see `encore models`),
    /// fetched on first use [default: smollm2-135m].
    #[arg(long, value_name = "PATH|NAME")]
    model: Option<OsString>,
    /// Device: auto, cpu, cuda, cuda:N, metal, wgpu (the first hardware adapter)
    /// or wgpu:N (see `encore devices`).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Compute exactly what the CPU backend computes, bit for bit, so that
    /// greedy text on a GPU is the CPU's (and llama.cpp's); slower on a GPU.
    /// Same as ENCORE_EXACT=1.
    #[arg(long)]
    exact: bool,
}

#[derive(Args, Default)]
struct ProfileArgs {
    /// Print a profile to stderr at exit: counters, submissions, or
    /// dispatches (the default when no value is given). Overrides ENCORE_PROFILE.
    #[arg(long, value_name = "WHAT", num_args = 0..=1, default_missing_value = "dispatches", value_parser = parse_profile)]
    profile: Option<ProfileMode>,
    /// Write a Chrome trace of the run (host phases, submissions, every
    /// dispatch) to FILE; open it in Perfetto.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
}

fn parse_profile(s: &str) -> Result<ProfileMode, String> {
    ProfileMode::parse(s)
        .ok_or_else(|| format!("`{s}`: expected off, counters, submissions or dispatches"))
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    profile: ProfileArgs,
    /// Most tokens to generate, at most the model's context length.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128, value_parser = count, allow_negative_numbers = true)]
    n: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Use the prompt as is, without the model's chat template.
    #[arg(long)]
    raw: bool,
    #[command(flatten)]
    speculate: speculate::SpeculateArgs,
    /// The prompt.
    prompt: String,
}

/// The sampling flags of `generate` and `chat`.
#[derive(Args)]
struct SamplingArgs {
    /// Sampling temperature, finite and >= 0; 0 is greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep the K most likely tokens (0 disables).
    #[arg(long, default_value_t = 40, value_parser = count, allow_negative_numbers = true)]
    top_k: usize,
    /// Keep the most likely tokens up to this cumulative probability, in (0, 1] (1 disables).
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    top_p: f32,
    /// Drop tokens less likely than this fraction of the best one, in [0, 1] (0 disables).
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    min_p: f32,
    /// Penalty for recently generated tokens, finite and > 0 (1 disables).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repeat_penalty: f32,
    /// Random seed.
    #[arg(long, default_value_t = 0x5eed, allow_negative_numbers = true)]
    seed: u64,
}

impl SamplingArgs {
    /// The sampler these flags describe, checked.
    fn config(&self) -> Result<SamplerConfig, CliError> {
        let config = SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            ..SamplerConfig::default()
        };
        config.validate().map_err(sampler_error)?;
        Ok(config)
    }
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    profile: ProfileArgs,
    /// Prompt length for the prefill measurement, at least 1; with
    /// --gen-tokens at most the model's context length.
    #[arg(long, default_value_t = 128, value_parser = count, allow_negative_numbers = true)]
    prompt_tokens: usize,
    /// Tokens generated for the decode measurement, at least 1.
    #[arg(long, default_value_t = 64, value_parser = count, allow_negative_numbers = true)]
    gen_tokens: usize,
    /// Repeats, 1 to 1000; the median is reported.
    #[arg(long, default_value_t = 5, value_parser = count, allow_negative_numbers = true)]
    repeats: usize,
    /// Measure continuous batching instead: for each count N in the list
    /// (1 to 1024 each), N requests of --prompt-tokens prompt tokens and
    /// --gen-tokens generated tokens at once through the serving scheduler,
    /// without HTTP. Reports generated tokens per second.
    #[arg(long, value_delimiter = ',', value_parser = count, allow_negative_numbers = true)]
    parallel: Vec<usize>,
    /// Print one JSON object instead of text (one line a level with
    /// --parallel).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ModelsArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Most repeats `bench` runs: a median of more tells nothing new.
const MAX_REPEATS: usize = 1000;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_exit(&e),
    };
    exit(match cli.command {
        Command::Generate(a) => generate(a),
        Command::Chat(a) => chat::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Bench(a) => bench(a),
        Command::Perplexity(a) => perplexity(a),
        Command::Models(a) => models(a),
        Command::Devices => devices(),
    })
}

/// The exit status of a command's result, after reporting its error.
fn exit(result: CliResult) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Stdout(e)) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            to_stderr(&format!("error: {}\n", one_line(&e.to_string())));
            ExitCode::FAILURE
        }
    }
}

/// Prints clap's help, version or usage error; help and version go to
/// stdout and are checked like any other output.
fn clap_exit(e: &clap::Error) -> ExitCode {
    match e.print() {
        Err(err) if !e.use_stderr() => exit(Err(CliError::Stdout(err))),
        _ => ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2)),
    }
}

fn one_line(e: &str) -> String {
    e.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Why a command failed.
#[derive(Debug)]
enum CliError {
    /// Anything but writing the output, said in one line.
    Message(String),
    /// Writing to stdout failed; a closed pipe ends the command quietly.
    Stdout(io::Error),
}

impl From<String> for CliError {
    fn from(message: String) -> CliError {
        CliError::Message(message)
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Message(m) => f.write_str(m),
            CliError::Stdout(e) => write!(f, "writing to stdout: {e}"),
        }
    }
}

type CliResult = Result<(), CliError>;

/// Standard output with every write checked and flushed at once, so that a
/// command stops at the first write that fails (a closed pipe, a full disk)
/// and says so, where `println!` would panic or a buffered write would fail
/// unseen at exit.
struct Out(io::StdoutLock<'static>);

impl Out {
    fn new() -> Out {
        Out(io::stdout().lock())
    }

    fn write(&mut self, text: &str) -> CliResult {
        self.0
            .write_all(text.as_bytes())
            .and_then(|()| self.0.flush())
            .map_err(CliError::Stdout)
    }

    fn line(&mut self, text: &str) -> CliResult {
        self.write(&format!("{text}\n"))
    }
}

/// Writes diagnostics to stderr. A failure is ignored: there is nowhere
/// left to report it, and the exit status still tells whether the command
/// worked.
fn to_stderr(text: &str) {
    let _ = io::stderr().write_all(text.as_bytes());
}

/// An error unless `value`, given to `flag`, lies in `min..=max`; `why`
/// says where a bound comes from.
fn in_range(flag: &str, value: usize, min: usize, max: usize, why: &str) -> CliResult {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(format!("{flag} {value}: expected {min} to {max}{why}").into())
}

/// Parses a count flag, saying what a count is (clap's own message for
/// `-5` reads "invalid digit found in string").
fn count(s: &str) -> Result<usize, String> {
    s.parse()
        .map_err(|_| format!("expected a whole number from 0 to {}", usize::MAX))
}

/// The flag that sets a sampling field.
fn sampler_flag(field: SamplerField) -> &'static str {
    match field {
        SamplerField::Temperature => "--temperature",
        SamplerField::TopP => "--top-p",
        SamplerField::MinP => "--min-p",
        SamplerField::RepeatPenalty => "--repeat-penalty",
        SamplerField::PresencePenalty => "--presence-penalty",
        SamplerField::FrequencyPenalty => "--frequency-penalty",
    }
}

fn sampler_error(e: SamplerError) -> CliError {
    let flag = sampler_flag(e.field);
    CliError::Message(format!("{flag} {}: expected {}", e.value, e.field.range()))
}

fn devices() -> CliResult {
    let mut out = Out::new();
    for d in encore::list_devices() {
        out.line(&format!("{:<8} {}", d.name, d.description))?;
    }
    Ok(())
}

/// The catalog, with each model's size, description and place in the
/// cache: intact (by its marker, or by hashing it when the marker is stale),
/// missing, or damaged.
fn models(a: ModelsArgs) -> CliResult {
    let dir = fetch::cache_dir();
    let mut rows = Vec::new();
    for entry in catalog::MODELS {
        let state = match &dir {
            Ok(_) => Some(fetch::cache_state(entry, show_step).map_err(|e| e.to_string())?),
            Err(_) => None,
        };
        rows.push((entry, state));
    }
    let mut out = Out::new();
    if a.json {
        let models: Vec<_> = rows
            .iter()
            .map(|(entry, state)| {
                let (state, why) = match state {
                    Some(CacheState::Cached) => ("cached", None),
                    Some(CacheState::Missing) => ("missing", None),
                    Some(CacheState::Damaged(why)) => ("damaged", Some(why)),
                    None => ("unknown", None),
                };
                serde_json::json!({
                    "name": entry.name,
                    "description": entry.description,
                    "default": entry.name == catalog::DEFAULT,
                    "size": entry.size,
                    "sha256": entry.sha256,
                    "parts": entry.parts.iter().map(|p| p.package).collect::<Vec<_>>(),
                    "state": state,
                    "damage": why,
                    "path": dir.as_ref().ok().map(|d| d.join(entry.file_name).display().to_string()),
                })
            })
            .collect();
        let dir = dir.as_ref().ok().map(|d| d.display().to_string());
        return out.line(&serde_json::json!({ "cache": dir, "models": models }).to_string());
    }
    out.line(&format!(
        "{:<20} {:>9}  {:<10} description",
        "name", "size", "cache"
    ))?;
    for (entry, state) in &rows {
        let state = match state {
            Some(CacheState::Cached) => "cached",
            Some(CacheState::Missing) => "missing",
            Some(CacheState::Damaged(why)) => {
                to_stderr(&format!(
                    "encore: the cached {} is damaged ({why}); it is fetched again on first use\n",
                    entry.name
                ));
                "damaged"
            }
            None => "-",
        };
        let default = if entry.name == catalog::DEFAULT {
            " [default]"
        } else {
            ""
        };
        out.line(&format!(
            "{:<20} {:>6.1} MB  {:<10} {}{default}",
            entry.name,
            entry.size as f64 / 1e6,
            state,
            entry.description
        ))?;
    }
    match &dir {
        Ok(dir) => out.line(&format!("cache: {}", dir.display())),
        Err(e) => out.line(&format!("cache: none ({e})")),
    }
}

/// Shows a fetch's step on stderr.
fn show_step(p: Progress) {
    if let Progress::Step(s) = p {
        to_stderr(&format!("encore: {s}\n"));
    }
}

/// The model file `--model` names, fetching a catalog model on first use
/// with its progress on stderr.
fn model_path(arg: &Option<OsString>) -> Result<PathBuf, String> {
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut part_of = String::new();
    let path = fetch::resolve(arg.as_deref(), |p| match p {
        Progress::Step(s) => {
            let line = format!("encore: {s}\n");
            match &bar {
                Some(b) => b.suspend(|| to_stderr(&line)),
                None => to_stderr(&line),
            }
        }
        Progress::Part { part, parts, .. } => {
            part_of = if parts > 1 {
                format!("part {part}/{parts}")
            } else {
                String::new()
            };
            if let Some(b) = &bar {
                b.set_message(part_of.clone());
            }
        }
        Progress::Bytes { done, total } => {
            let b = bar.get_or_insert_with(|| {
                let b = indicatif::ProgressBar::new(total);
                b.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{msg} {bar:40} {bytes}/{total_bytes} {bytes_per_sec}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                b.set_message(part_of.clone());
                b
            });
            b.set_position(done);
        }
    })
    .map_err(|e| e.to_string())?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(path)
}

/// The model as `--model` named it, or the default catalog name.
fn model_label(args: &ModelArgs) -> std::borrow::Cow<'_, str> {
    args.model
        .as_ref()
        .map_or(catalog::DEFAULT.into(), |m| m.to_string_lossy())
}

/// Opens the device, tracing from the start when asked. A `--model` that
/// names nothing, or a file that is not a readable GGUF file, is refused
/// first: such a request needs no device, and a probe can be slow and wakes
/// drivers that print to stderr.
fn open(args: &ModelArgs, profile: &ProfileArgs) -> Result<Device, String> {
    if let Choice::Path(path) = catalog::choose(args.model.as_deref()).map_err(|e| e.to_string())? {
        GgufFile::open(&path).map_err(|e| naming_file(&path, e.to_string()))?;
    }
    let mut config = Config::from_env().map_err(|e| e.to_string())?;
    if let Some(mode) = profile.profile {
        config.profile = mode;
    }
    let device = Device::open(&args.device, &config).map_err(|e| e.to_string())?;
    if profile.trace.is_some() {
        device.start_trace();
    }
    Ok(device)
}

/// Loads the model onto the device, showing a progress bar on stderr while
/// a large model's weights are copied (when stderr is a terminal), then one
/// line saying how much was copied, how fast, and what the process holds
/// resident.
fn load(args: &ModelArgs, device: &Device) -> Result<Engine, String> {
    let path = model_path(&args.model)?;
    let mut options = EngineOptions::from_env().map_err(|e| e.to_string())?;
    if args.exact {
        options.kernels = KernelSet::Exact;
    }
    let mut shown = LoadShown::new();
    let engine = Engine::load_with_progress(&path, device, &options, |p| shown.update(p));
    let copied = shown.finish();
    let engine = engine.map_err(|e| naming_file(&path, e.to_string()))?;
    if let Some(copied) = copied {
        to_stderr(&loaded_line(&copied, encore::host::resident_bytes()));
    }
    Ok(engine)
}

/// An error about the model file, naming the file once: I/O errors
/// already carry its path.
fn naming_file(path: &Path, message: String) -> String {
    let shown = path.display().to_string();
    if message.contains(&shown) {
        message
    } else {
        format!("{shown}: {message}")
    }
}

/// Weights above which loading shows a progress bar.
const LOAD_BAR_MIN_BYTES: u64 = 1_000_000_000;

/// A load's progress as the terminal sees it: the clock from the start and
/// from the first copy (the kernels are ready then), and a bar for a large
/// model when stderr is a terminal.
struct LoadShown {
    begun: Instant,
    started: Option<Instant>,
    bar: Option<indicatif::ProgressBar>,
    last: Option<LoadProgress>,
}

/// What a finished load took: the bytes copied, the seconds until the
/// kernels were ready (compiled, or read from the cache) and the seconds
/// of copying.
struct Copied {
    bytes: u64,
    kernel_seconds: f64,
    seconds: f64,
}

impl LoadShown {
    fn new() -> LoadShown {
        LoadShown {
            begun: Instant::now(),
            started: None,
            bar: None,
            last: None,
        }
    }

    fn update(&mut self, p: LoadProgress) {
        self.started.get_or_insert_with(Instant::now);
        let large = p.bytes_total > LOAD_BAR_MIN_BYTES;
        if self.bar.is_none() && large && io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(p.bytes_total);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "encore: loading {wide_bar} {decimal_bytes}/{decimal_total_bytes} \
                     {decimal_bytes_per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            self.bar = Some(bar);
        }
        if let Some(bar) = &self.bar {
            bar.set_position(p.bytes_done);
        }
        self.last = Some(p);
    }

    /// Clears the bar; what the load took, once it copied every byte.
    fn finish(self) -> Option<Copied> {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
        let last = self.last.filter(|p| p.bytes_done == p.bytes_total)?;
        let started = self.started?;
        Some(Copied {
            bytes: last.bytes_done,
            kernel_seconds: started.duration_since(self.begun).as_secs_f64(),
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// Seconds of kernel set-up from which the load's line names them.
const KERNEL_SECONDS_SHOWN: f64 = 0.5;

/// The line that ends a load: `encore: loaded 4.68 GB of weights in 3.2 s
/// (1.46 GB/s); host memory 312 MB resident`, with `, kernels ready after
/// 4.1 s` before the memory where compiling them took a noticeable time.
fn loaded_line(copied: &Copied, resident: Option<u64>) -> String {
    let rate = copied.bytes as f64 / copied.seconds.max(1e-9);
    let kernels = if copied.kernel_seconds >= KERNEL_SECONDS_SHOWN {
        format!(", kernels ready after {:.1} s", copied.kernel_seconds)
    } else {
        String::new()
    };
    let resident = resident.map_or(String::new(), |r| {
        format!("; host memory {} resident", decimal_size(r as f64))
    });
    format!(
        "encore: loaded {} of weights in {:.1} s ({}/s){kernels}{resident}\n",
        decimal_size(copied.bytes as f64),
        copied.seconds,
        decimal_size(rate)
    )
}

/// Bytes in decimal units: `4.68 GB`, `312 MB`, `84 kB`.
fn decimal_size(bytes: f64) -> String {
    if bytes >= 1e9 {
        format!("{:.2} GB", bytes / 1e9)
    } else if bytes >= 1e6 {
        format!("{:.0} MB", bytes / 1e6)
    } else {
        format!("{:.0} kB", bytes / 1e3)
    }
}

/// Runs a command on a freshly opened device, then prints the profile and
/// writes the trace, also when the command failed.
fn with_device(
    model: &ModelArgs,
    profile: &ProfileArgs,
    command: impl FnOnce(&Device) -> CliResult,
) -> CliResult {
    let device = open(model, profile)?;
    let result = command(&device);
    let _ = device.synchronize();
    let mode = device.config().profile;
    if mode > ProfileMode::Off {
        to_stderr(&report::profile(&device, mode));
    }
    let saved = match (&profile.trace, device.trace()) {
        (Some(path), Some(trace)) => trace
            .save(path)
            .map_err(|e| CliError::Message(format!("trace not written: {e}"))),
        _ => Ok(()),
    };
    result.and(saved)
}

fn generate(a: GenerateArgs) -> CliResult {
    let options = GenerateOptions {
        max_tokens: a.n,
        sampler: a.sampling.config()?,
        raw: a.raw,
    };
    with_device(&a.model, &a.profile, |device| {
        generate_on(&a, &options, device)
    })
}

fn generate_on(a: &GenerateArgs, options: &GenerateOptions, device: &Device) -> CliResult {
    let speculation = a.speculate.speculation()?;
    let engine = load(&a.model, device)?;
    let context = engine.model().config.context_length;
    in_range("-n/--n-predict", a.n, 0, context, " (the model's context)")?;
    if let Some(speculation) = speculation {
        let prompt = engine
            .prompt_tokens(&a.prompt, a.raw)
            .map_err(|e| e.to_string())?;
        if prompt.len() + a.n > context {
            return Err(format!(
                "the prompt's {} tokens and -n {} exceed the model's context of {context}",
                prompt.len(),
                a.n
            )
            .into());
        }
        let sampler = options.sampler.clone();
        return speculate::generate(
            std::sync::Arc::new(engine),
            prompt,
            a.n,
            sampler,
            speculation,
        );
    }
    let mut out = Out::new();
    // The first failed write stops the generation and is reported.
    let mut failed = None;
    let generation = engine.generate(&a.prompt, options, |piece| {
        if failed.is_none() {
            failed = out.write(piece).err();
        }
        failed.is_none()
    });
    if let Some(e) = failed {
        return Err(e);
    }
    let generation = generation.map_err(|e| e.to_string())?;
    out.write("\n")?;
    to_stderr(&format!(
        "encore: prefill {} tokens at {:.1} tok/s, decode {} tokens at {:.1} tok/s\n",
        generation.prompt_tokens,
        generation.prefill_tokens_per_second(),
        generation.tokens.len(),
        generation.decode_tokens_per_second(),
    ));
    Ok(())
}

fn perplexity(a: PerplexityArgs) -> CliResult {
    let text = std::fs::read_to_string(&a.file)
        .map_err(|e| CliError::Message(format!("{}: {e}", a.file.display())))?;
    with_device(&a.model, &a.profile, |device| {
        perplexity_on(&a, &text, device)
    })
}

fn perplexity_on(a: &PerplexityArgs, text: &str, device: &Device) -> CliResult {
    let engine = load(&a.model, device)?;
    let start = std::time::Instant::now();
    let result = encore_llm::perplexity::perplexity(&engine, text, a.ctx_size, |p| {
        let rate = p.scored as f64 / start.elapsed().as_secs_f64().max(1e-9);
        to_stderr(&format!(
            "encore: chunk {}/{}: PPL = {:.4} ({} tokens scored, {rate:.0} tok/s)\n",
            p.chunks, p.total_chunks, p.value, p.scored
        ));
    })
    .map_err(|e| CliError::Message(e.to_string()))?;
    let mut out = Out::new();
    if a.json {
        let json = serde_json::json!({
            "model": model_label(&a.model),
            "device": device.name(),
            "ctx_size": a.ctx_size,
            "chunks": result.total_chunks,
            "tokens_scored": result.scored,
            "ppl": result.value,
            "error": result.error,
            "seconds": start.elapsed().as_secs_f64(),
        });
        out.line(&json.to_string())?;
    }
    out.line(&format!(
        "PPL = {:.4} +/- {:.5}",
        result.value, result.error
    ))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn bench(a: BenchArgs) -> CliResult {
    in_range("--repeats", a.repeats, 1, MAX_REPEATS, "")?;
    with_device(&a.model, &a.profile, |device| bench_on(&a, device))
}

fn bench_on(a: &BenchArgs, device: &Device) -> CliResult {
    let engine = load(&a.model, device)?;
    // What the process holds once the weights are on the device (on the
    // CPU, the weights themselves).
    let host_rss = encore::host::resident_bytes();
    if !a.parallel.is_empty() {
        return bench_parallel(a, device, engine, host_rss);
    }
    let e = |e: encore_llm::LlmError| e.to_string();
    // The prompt and the generated tokens share the model's context, and
    // each measurement needs a token (so the sum below cannot overflow).
    let context = engine.model().config.context_length;
    in_range(
        "--prompt-tokens",
        a.prompt_tokens,
        1,
        context.saturating_sub(1),
        " (the model's context less one generated token)",
    )?;
    in_range(
        "--gen-tokens",
        a.gen_tokens,
        1,
        context - a.prompt_tokens,
        &format!(
            " (the model's context of {context} less --prompt-tokens {})",
            a.prompt_tokens
        ),
    )?;
    let positions = (a.prompt_tokens + a.gen_tokens + 1).min(context);
    let vocab = engine.model().config.vocab as u32;
    // A deterministic prompt of ordinary token ids.
    let prompt: Vec<u32> = (0..a.prompt_tokens as u32)
        .map(|i| i.wrapping_mul(7919) % vocab.max(1))
        .collect();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut step_device = Vec::new();
    let mut graph = None;
    for _ in 0..=a.repeats {
        let mut s = engine.session(positions).map_err(e)?;
        let t = Instant::now();
        s.prefill(&prompt).map_err(e)?;
        prefill.push(a.prompt_tokens as f64 / t.elapsed().as_secs_f64().max(1e-9));
        // Greedy decoding as `encore generate` runs it: steps fed by the
        // device-side argmax, queued a batch at a time.
        let token = prompt.last().copied().unwrap_or(0);
        // The graph is recorded before the clock starts (as llama-bench's
        // warm runs capture theirs).
        s.prepare_greedy().map_err(e)?;
        let t = Instant::now();
        let decoded = s
            .decode_greedy(token, a.gen_tokens, encore_llm::GREEDY_BATCH, |_| Ok(true))
            .map_err(e)?;
        decode.push(decoded as f64 / t.elapsed().as_secs_f64().max(1e-9));
        step_device.extend(s.step_times().iter().map(|t| t.as_secs_f64() * 1e6));
        graph = s.graph_stats();
    }
    // The first run warms caches and records the decode graph.
    let measured = |v: Vec<f64>| median(v.into_iter().skip(1).collect());
    let (p, d) = (measured(prefill), measured(decode));
    // Device time of one step against the wall time of one token: the
    // difference is what the host adds (launch, readback, sampling).
    let step_us = (!step_device.is_empty()).then(|| median(step_device));
    let mut out = Out::new();
    if a.json {
        out.line(
            &serde_json::json!({
                "model": model_label(&a.model),
                "device": device.name(),
                "threads": device.config().cpu_threads(),
                "prompt_tokens": a.prompt_tokens,
                "gen_tokens": a.gen_tokens,
                "repeats": a.repeats,
                "prefill_tok_s": p,
                "decode_tok_s": d,
                "host_rss_bytes": host_rss,
                "decode_step_device_us": step_us,
                "decode_token_wall_us": 1e6 / d,
                "decode_graph": graph.as_ref().map(|g| serde_json::json!({
                    "before": shape_json(&g.before),
                    "after": shape_json(&g.after),
                    "fused": g.fused,
                    "removed": g.removed,
                    "specialized": g.specialized,
                })),
            })
            .to_string(),
        )?;
    } else {
        out.line(&format!(
            "device {}  prefill pp{} {:.1} tok/s  decode tg{} {:.1} tok/s (median of {})",
            device.name(),
            a.prompt_tokens,
            p,
            a.gen_tokens,
            d,
            a.repeats
        ))?;
        if let Some(us) = step_us {
            out.line(&format!(
                "decode step: {us:.1} µs on the device of {:.1} µs per token (median)",
                1e6 / d
            ))?;
        }
        if let Some(g) = &graph {
            out.line(&format!(
                "decode graph per token: recorded {}; after passes {} ({} fused, {} specialized)",
                shape_text(&g.before),
                shape_text(&g.after),
                g.fused,
                g.specialized
            ))?;
        }
    }
    Ok(())
}

fn bench_parallel(
    a: &BenchArgs,
    device: &Device,
    engine: Engine,
    host_rss: Option<u64>,
) -> CliResult {
    for &n in &a.parallel {
        in_range("--parallel", n, 1, 1024, "")?;
    }
    let context = engine.model().config.context_length;
    in_range(
        "--prompt-tokens + --gen-tokens",
        a.prompt_tokens.saturating_add(a.gen_tokens),
        2,
        context.saturating_sub(1),
        " (the model's context less one)",
    )?;
    let engine = std::sync::Arc::new(engine);
    let levels = bench_parallel::run(
        &engine,
        &a.parallel,
        a.prompt_tokens,
        a.gen_tokens,
        a.repeats,
    )?;
    let mut out = Out::new();
    for l in levels {
        if a.json {
            out.line(
                &serde_json::json!({
                    "model": model_label(&a.model),
                    "device": device.name(),
                    "parallel": l.parallel,
                    "prompt_tokens": a.prompt_tokens,
                    "gen_tokens": a.gen_tokens,
                    "repeats": a.repeats,
                    "tok_s": l.tok_s,
                    "host_rss_bytes": host_rss,
                    "decode_tok_s": l.decode_tok_s,
                    "ttft_ms": l.ttft_ms,
                    "steps": l.steps,
                })
                .to_string(),
            )?;
        } else {
            out.line(&format!(
                "device {}  parallel {:>4}  {:.1} generated tok/s (decode {:.1})  first token {:.1} ms  {} steps (median of {})",
                device.name(),
                l.parallel,
                l.tok_s,
                l.decode_tok_s,
                l.ttft_ms,
                l.steps,
                a.repeats
            ))?;
        }
    }
    Ok(())
}

fn shape_json(s: &encore::GraphShape) -> serde_json::Value {
    serde_json::json!({
        "dispatches": s.nodes,
        "edges": s.edges,
        "groups": s.groups,
        "mean_group": s.mean_group,
        "max_group": s.max_group,
    })
}

fn shape_text(s: &encore::GraphShape) -> String {
    format!(
        "{} dispatches, {} edges, {} groups (mean {:.2}, max {})",
        s.nodes, s.edges, s.groups, s.mean_group, s.max_group
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_line_names_bytes_time_rate_and_resident_memory() {
        let copied = |bytes, kernel_seconds, seconds| Copied {
            bytes,
            kernel_seconds,
            seconds,
        };
        assert_eq!(
            loaded_line(&copied(4_680_000_000, 0.2, 3.2), Some(312_000_000)),
            "encore: loaded 4.68 GB of weights in 3.2 s (1.46 GB/s); \
             host memory 312 MB resident\n"
        );
        assert_eq!(
            loaded_line(&copied(84_000, 0.0, 0.5), None),
            "encore: loaded 84 kB of weights in 0.5 s (168 kB/s)\n"
        );
        assert_eq!(
            loaded_line(&copied(4_680_000_000, 4.1, 3.2), None),
            "encore: loaded 4.68 GB of weights in 3.2 s (1.46 GB/s), \
             kernels ready after 4.1 s\n"
        );
    }
}
