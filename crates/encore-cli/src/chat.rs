//! `encore chat`: a conversation in the terminal through the model's chat
//! template, answers streamed as they are generated.
//!
//! One session holds the conversation's KV cache: each turn renders the
//! whole conversation, keeps the cached positions it shares with what was
//! run before, and prefills only the rest. `/reset` starts over, `/exit`
//! (or end of input) quits, and Ctrl-C stops the answer being generated
//! but not the program. Lines read from a pipe work the same way, one user
//! message a line.

use std::io::{BufRead, IsTerminal};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::Args;
use encore_llm::chat::Message;
use encore_llm::{Engine, Sampler, Session, Stepper};

use crate::{count, load, open, to_stderr, CliResult, ModelArgs, Out, ProfileArgs, SamplingArgs};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Most tokens an answer may have.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512, value_parser = count, allow_negative_numbers = true)]
    n: usize,
    /// A system message that opens the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Positions the conversation may use [default: 4096 or the model's
    /// context, if smaller].
    #[arg(short = 'c', long = "ctx-size", value_parser = count, allow_negative_numbers = true)]
    ctx_size: Option<usize>,
}

/// Sets a flag on every Ctrl-C, for the answer loop to see, instead of
/// ending the process.
fn interrupts() -> Result<Arc<AtomicBool>, String> {
    let flag = Arc::new(AtomicBool::new(false));
    let set = flag.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the signal handler: {e}"))?;
    // Registered before returning, so that no Ctrl-C slips through.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        runtime.block_on(async move {
            let _ = ready_tx.send(());
            while tokio::signal::ctrl_c().await.is_ok() {
                set.store(true, Ordering::Relaxed);
            }
        })
    });
    let _ = ready_rx.recv();
    Ok(flag)
}

pub fn run(a: ChatArgs) -> CliResult {
    let sampler = a.sampling.config()?;
    let device = open(&a.model, &ProfileArgs::default())?;
    let engine = load(&a.model, &device)?;
    let context = engine.model().config.context_length;
    let ctx = a.ctx_size.unwrap_or(4096.min(context));
    crate::in_range("-c/--ctx-size", ctx, 2, context, " (the model's context)")?;
    let mut session = engine.session(ctx).map_err(|e| e.to_string())?;
    let interrupted = interrupts()?;
    let fresh = || {
        a.system
            .iter()
            .map(|s| Message::new("system", s.as_str()))
            .collect::<Vec<_>>()
    };
    let mut messages = fresh();
    let mut run: Vec<u32> = Vec::new();
    let mut out = Out::new();
    let tty = std::io::stdin().is_terminal();
    if tty {
        to_stderr("encore: chat ready; /reset starts over, /exit quits, Ctrl-C stops an answer\n");
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    for turn in 0u64.. {
        if tty {
            out.write("> ")?;
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| format!("reading input: {e}"))?;
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = fresh();
                session.reset();
                run.clear();
                out.line("(conversation cleared)")?;
                continue;
            }
            _ => {}
        }
        messages.push(Message::new("user", line));
        let tokens = engine
            .chat_tokens(&messages, true)
            .map_err(|e| e.to_string())?;
        if tokens.len() + 1 >= ctx {
            messages.pop();
            out.line(&format!(
                "(the conversation would fill the context of {ctx} tokens; /reset starts over)"
            ))?;
            continue;
        }
        interrupted.store(false, Ordering::Relaxed);
        let mut config = sampler.clone();
        config.seed = config.seed.wrapping_add(turn);
        let answer = answer(
            &engine,
            &mut session,
            &mut run,
            &tokens,
            Sampler::new(config),
            a.n,
            &interrupted,
            &mut out,
        )?;
        out.write("\n")?;
        if interrupted.load(Ordering::Relaxed) {
            out.line("(stopped)")?;
        }
        messages.push(Message::new("assistant", answer));
    }
    Ok(())
}

/// Generates the answer to the conversation `tokens`, streaming it to
/// `out`; `run` holds the tokens whose K and V the session has, and is kept
/// up to date.
#[allow(clippy::too_many_arguments)]
fn answer(
    engine: &Engine,
    session: &mut Session,
    run: &mut Vec<u32>,
    tokens: &[u32],
    mut sampler: Sampler,
    max: usize,
    interrupted: &Arc<AtomicBool>,
    out: &mut Out,
) -> Result<String, crate::CliError> {
    // Keep what the session already ran of this conversation, but always
    // run at least the last token, for its logits.
    let shared = run
        .iter()
        .zip(tokens)
        .take_while(|(a, b)| a == b)
        .count()
        .min(tokens.len() - 1);
    session.truncate(shared);
    run.truncate(shared);
    let mut logits = session
        .prefill(&tokens[shared..])
        .map_err(|e| e.to_string())?;
    run.extend_from_slice(&tokens[shared..]);
    // The last token needs no room in the cache: it is never an input.
    let room = session.capacity().saturating_sub(session.position()) + 1;
    let mut stepper =
        Stepper::new(engine.tokenizer(), max.min(room)).with_cancel(interrupted.clone());
    let mut text = String::new();
    loop {
        let next = sampler.sample(&logits, run);
        let step = stepper.push(next).map_err(|e| e.to_string())?;
        out.write(&step.text)?;
        text.push_str(&step.text);
        if step.stop.is_some() {
            break;
        }
        session.step(next).map_err(|e| e.to_string())?;
        run.push(next);
        logits = session.logits().map_err(|e| e.to_string())?;
    }
    let rest = stepper.finish();
    out.write(&rest)?;
    text.push_str(&rest);
    Ok(text)
}
