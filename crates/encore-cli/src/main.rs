//! `encore`: generate text, benchmark and list devices.

mod report;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use encore::{Config, Device, ProfileMode};
use encore_llm::fetch::{self, Progress};
use encore_llm::{Engine, EngineOptions, GenerateOptions, SamplerConfig};
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
    /// Measure prefill and decode speed.
    Bench(BenchArgs),
    /// List the devices Encore can use.
    Devices,
}

#[derive(Args)]
struct ModelArgs {
    /// GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Device: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Compute exactly what the CPU backend computes, bit for bit, so that
    /// greedy text on a GPU is the CPU's (and llama.cpp's); slower on a GPU.
    /// Same as ENCORE_EXACT=1.
    #[arg(long)]
    exact: bool,
}

#[derive(Args)]
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
    /// Most tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Keep the K most likely tokens (0 disables).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Keep the most likely tokens up to this cumulative probability (1 disables).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens less likely than this fraction of the best one (0 disables).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Penalty for recently generated tokens (1 disables).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Random seed.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Use the prompt as is, without the model's chat template.
    #[arg(long)]
    raw: bool,
    /// The prompt.
    prompt: String,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    profile: ProfileArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens generated for the decode measurement.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Repeats; the median is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => generate(a),
        Command::Bench(a) => bench(a),
        Command::Devices => {
            for d in encore::list_devices() {
                println!("{:<8} {}", d.name, d.description);
            }
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stdout().flush();
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn one_line(e: &str) -> String {
    e.split_whitespace().collect::<Vec<_>>().join(" ")
}

type CliResult = Result<(), String>;

fn model_path(arg: &Option<PathBuf>) -> Result<PathBuf, String> {
    if let Some(p) = arg {
        return Ok(p.clone());
    }
    let mut bar: Option<indicatif::ProgressBar> = None;
    let path = fetch::default_model(|p| match p {
        Progress::Step(s) => eprintln!("encore: {s}"),
        Progress::Bytes { done, total } => {
            let b = bar.get_or_insert_with(|| {
                let b = indicatif::ProgressBar::new(total);
                b.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{bar:40} {bytes}/{total_bytes} {bytes_per_sec}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
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

/// Opens the device (tracing from the start when asked) and loads the model.
fn open(args: &ModelArgs, profile: &ProfileArgs) -> Result<Device, String> {
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

fn load(args: &ModelArgs, device: &Device) -> Result<Engine, String> {
    let path = model_path(&args.model)?;
    let mut options = EngineOptions::from_env().map_err(|e| e.to_string())?;
    if args.exact {
        options.kernels = KernelSet::Exact;
    }
    Engine::load(&path, device, &options).map_err(|e| {
        // Name the file once: I/O errors already carry its path.
        let message = e.to_string();
        let shown = path.display().to_string();
        if message.contains(&shown) {
            message
        } else {
            format!("{shown}: {message}")
        }
    })
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
    let _ = std::io::stdout().flush();
    let _ = device.synchronize();
    let mode = device.config().profile;
    if mode > ProfileMode::Off {
        eprint!("{}", report::profile(&device, mode));
    }
    let saved = match (&profile.trace, device.trace()) {
        (Some(path), Some(trace)) => trace
            .save(path)
            .map_err(|e| format!("trace not written: {e}")),
        _ => Ok(()),
    };
    result.and(saved)
}

fn generate(a: GenerateArgs) -> CliResult {
    with_device(&a.model, &a.profile, |device| generate_on(&a, device))
}

fn generate_on(a: &GenerateArgs, device: &Device) -> CliResult {
    let engine = load(&a.model, device)?;
    let options = GenerateOptions {
        max_tokens: a.n,
        sampler: SamplerConfig {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repeat_penalty: a.repeat_penalty,
            seed: a.seed,
            ..SamplerConfig::default()
        },
        raw: a.raw,
    };
    let mut stdout = std::io::stdout().lock();
    let generation = engine
        .generate(&a.prompt, &options, |piece| {
            stdout.write_all(piece.as_bytes()).is_ok() && stdout.flush().is_ok()
        })
        .map_err(|e| e.to_string())?;
    let _ = writeln!(stdout);
    eprintln!(
        "encore: prefill {} tokens at {:.1} tok/s, decode {} tokens at {:.1} tok/s",
        generation.prompt_tokens,
        generation.prefill_tokens_per_second(),
        generation.tokens.len(),
        generation.decode_tokens_per_second(),
    );
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn bench(a: BenchArgs) -> CliResult {
    with_device(&a.model, &a.profile, |device| bench_on(&a, device))
}

fn bench_on(a: &BenchArgs, device: &Device) -> CliResult {
    let engine = load(&a.model, device)?;
    let e = |e: encore_llm::LlmError| e.to_string();
    let vocab = engine.model().config.vocab as u32;
    // A deterministic prompt of ordinary token ids.
    let prompt: Vec<u32> = (0..a.prompt_tokens as u32)
        .map(|i| i.wrapping_mul(7919) % vocab.max(1))
        .collect();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut step_device = Vec::new();
    let mut graph = None;
    for _ in 0..a.repeats.max(1) + 1 {
        let mut s = engine
            .session(a.prompt_tokens + a.gen_tokens + 1)
            .map_err(e)?;
        let t = Instant::now();
        s.prefill(&prompt).map_err(e)?;
        prefill.push(a.prompt_tokens as f64 / t.elapsed().as_secs_f64());
        // Greedy decoding as `encore generate` runs it: steps fed by the
        // device-side argmax, queued a batch at a time.
        let token = prompt.last().copied().unwrap_or(0);
        // The graph is recorded before the clock starts (as llama-bench's
        // warm runs capture theirs).
        s.prepare_greedy().map_err(e)?;
        let t = Instant::now();
        s.decode_greedy(token, a.gen_tokens, encore_llm::GREEDY_BATCH, |_| Ok(true))
            .map_err(e)?;
        decode.push(a.gen_tokens as f64 / t.elapsed().as_secs_f64());
        step_device.extend(s.step_times().iter().map(|t| t.as_secs_f64() * 1e6));
        graph = s.graph_stats();
    }
    // The first repeat warms caches and records the decode graph.
    prefill.remove(0);
    decode.remove(0);
    let (p, d) = (median(prefill), median(decode));
    // Device time of one step against the wall time of one token: the
    // difference is what the host adds (launch, readback, sampling).
    let step_us = (!step_device.is_empty()).then(|| median(step_device));
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": a.model.model.as_ref().map_or("default".to_string(), |m| m.display().to_string()),
                "device": device.name(),
                "threads": device.config().cpu_threads(),
                "prompt_tokens": a.prompt_tokens,
                "gen_tokens": a.gen_tokens,
                "repeats": a.repeats,
                "prefill_tok_s": p,
                "decode_tok_s": d,
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
        );
    } else {
        println!(
            "device {}  prefill pp{} {:.1} tok/s  decode tg{} {:.1} tok/s (median of {})",
            device.name(),
            a.prompt_tokens,
            p,
            a.gen_tokens,
            d,
            a.repeats
        );
        if let Some(us) = step_us {
            println!(
                "decode step: {us:.1} µs on the device of {:.1} µs per token (median)",
                1e6 / d
            );
        }
        if let Some(g) = &graph {
            println!(
                "decode graph per token: recorded {}; after passes {} ({} fused, {} specialized)",
                shape_text(&g.before),
                shape_text(&g.after),
                g.fused,
                g.specialized
            );
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
