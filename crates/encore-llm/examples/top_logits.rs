//! Prints the prompt's token ids and the top logits after it, for comparing
//! with other engines: `cargo run --release --example top_logits -- MODEL "prompt" [k]`.

use encore::{Config, Device};
use encore_llm::{Engine, EngineOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(model), Some(prompt)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: top_logits MODEL PROMPT [K]");
        std::process::exit(2);
    };
    let k: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
    let device = Device::open("cpu", &Config::from_env()?)?;
    let engine = Engine::load(model, &device, &EngineOptions::from_env()?)?;
    let ids = engine.prompt_tokens(prompt, true)?;
    println!("ids {ids:?}");
    let mut session = engine.session(ids.len() + 1)?;
    let logits = session.prefill(&ids)?;
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    for &i in order.iter().take(k) {
        println!("{i} {:.5}", logits[i]);
    }
    Ok(())
}
