//! `encore`: generate text, benchmark and list devices.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use encore::{Config, Device};
use encore_llm::fetch::{self, Progress};
use encore_llm::{Engine, GenerateOptions, SamplerConfig};

#[derive(Parser)]
#[command(name = "encore", version, about = "LLM inference on the Encore GPU command runtime")]
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
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
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
                    indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec}")
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

fn load(args: &ModelArgs) -> Result<(Engine, Device), String> {
    let config = Config::from_env().map_err(|e| e.to_string())?;
    let device = Device::open(&args.device, &config).map_err(|e| e.to_string())?;
    let path = model_path(&args.model)?;
    let engine = Engine::load(&path, &device).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((engine, device))
}

fn generate(a: GenerateArgs) -> CliResult {
    let (engine, _device) = load(&a.model)?;
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
    let (engine, device) = load(&a.model)?;
    let e = |e: encore_llm::LlmError| e.to_string();
    let vocab = engine.model().config.vocab as u32;
    // A deterministic prompt of ordinary token ids.
    let prompt: Vec<u32> = (0..a.prompt_tokens as u32).map(|i| 1000 + (i * 7919) % (vocab - 2000)).collect();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for _ in 0..a.repeats.max(1) + 1 {
        let mut s = engine.session(a.prompt_tokens + a.gen_tokens + 1).map_err(e)?;
        let t = Instant::now();
        s.prefill(&prompt).map_err(e)?;
        prefill.push(a.prompt_tokens as f64 / t.elapsed().as_secs_f64());
        let mut token = 1000u32;
        let t = Instant::now();
        for _ in 0..a.gen_tokens {
            s.step(token).map_err(e)?;
            token = s.argmax().map_err(e)?;
        }
        decode.push(a.gen_tokens as f64 / t.elapsed().as_secs_f64());
    }
    // The first repeat warms caches and records the decode graph.
    prefill.remove(0);
    decode.remove(0);
    let (p, d) = (median(prefill), median(decode));
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
            })
        );
    } else {
        println!("device {}  prefill pp{} {:.1} tok/s  decode tg{} {:.1} tok/s (median of {})", device.name(), a.prompt_tokens, p, a.gen_tokens, d, a.repeats);
    }
    Ok(())
}
