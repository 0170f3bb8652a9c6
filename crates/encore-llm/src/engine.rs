//! [`Engine`]: a loaded model with its tokenizer and chat template, and the
//! generation loop.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use encore::Device;

use crate::chat::{ChatPart, ChatTemplate, Message};
use crate::error::{LlmError, Result};
use crate::gguf::GgufFile;
use crate::load::LoadProgress;
use crate::model::Model;
use crate::sampler::{Sampler, SamplerConfig};
use crate::session::Session;
use crate::stepper::{Stepper, StopReason};
use crate::tokenizer::{Segment, Tokenizer, TokenizerSpec};
use encore_ops::KernelSet;

/// Greedy steps queued on the device before their tokens are read back (and
/// streamed): a token's text arrives at most this many steps late, a few
/// milliseconds, and the host's round trip is paid once per batch.
pub const GREEDY_BATCH: usize = 8;

/// How the engine runs a model: the op layer's kernel set and whether
/// sessions replay their decode steps as graphs. [`EngineOptions::from_env`]
/// reads `ENCORE_EXACT` and `ENCORE_GRAPHS` (listed with every other switch
/// in [`encore::config`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// Which kernels to load: [`KernelSet::Exact`] gives the CPU backend's
    /// results bit for bit on every backend (the same arithmetic in the same
    /// order), at some cost in speed. Greedy text from a quantized model is
    /// chaotic: with the default kernels a GPU's text parts from the CPU's
    /// within a few dozen tokens.
    pub kernels: KernelSet,
    /// Replay each session's decode step as a recorded graph (else encode
    /// every step eagerly).
    pub graphs: bool,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        EngineOptions {
            kernels: KernelSet::Default,
            graphs: true,
        }
    }
}

impl EngineOptions {
    /// The defaults with `ENCORE_EXACT` and `ENCORE_GRAPHS` applied.
    pub fn from_env() -> Result<EngineOptions> {
        EngineOptions::from_vars(|name| std::env::var(name).ok())
    }

    /// Like [`EngineOptions::from_env`], reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<EngineOptions> {
        let mut options = EngineOptions::default();
        if encore::config::flag(&get, "ENCORE_EXACT")? == Some(true) {
            options.kernels = KernelSet::Exact;
        }
        if let Some(graphs) = encore::config::flag(&get, "ENCORE_GRAPHS")? {
            options.graphs = graphs;
        }
        Ok(options)
    }
}

/// How to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Use the prompt as is instead of wrapping it in the chat template.
    pub raw: bool,
}

impl GenerateOptions {
    /// Greedy decoding of up to `max_tokens` tokens from a raw prompt.
    pub fn greedy(max_tokens: usize) -> GenerateOptions {
        GenerateOptions {
            max_tokens,
            sampler: SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            raw: true,
        }
    }
}

/// The result of a generation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub prefill_time: Duration,
    /// Time of the decode steps (every generated token after the first).
    pub decode_time: Duration,
    pub stop: StopReason,
}

impl Generation {
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    pub fn decode_tokens_per_second(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        steps as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Whether `parts`, joined, are exactly `text`.
fn joins_into(parts: &[ChatPart], text: &str) -> bool {
    let mut rest = text;
    for part in parts {
        match rest.strip_prefix(part.text()) {
            Some(r) => rest = r,
            None => return false,
        }
    }
    rest.is_empty()
}

/// A model ready to generate: weights on a device, tokenizer, chat template.
pub struct Engine {
    model: Arc<Model>,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    /// Whether sessions replay graphs ([`EngineOptions::graphs`]).
    graphs: bool,
}

impl Engine {
    /// Loads a GGUF model file onto `device`.
    pub fn load(
        path: impl AsRef<Path>,
        device: &Device,
        options: &EngineOptions,
    ) -> Result<Engine> {
        Engine::load_with_progress(path, device, options, |_| {})
    }

    /// [`Engine::load`], telling `on_progress` how much of the weights has
    /// been copied to the device as [`Model::load_with_progress`] does.
    pub fn load_with_progress(
        path: impl AsRef<Path>,
        device: &Device,
        options: &EngineOptions,
        on_progress: impl FnMut(LoadProgress),
    ) -> Result<Engine> {
        let _span = device.trace_span("load");
        let file = GgufFile::open(path)?;
        Engine::build(&file, device, options, on_progress)
    }

    /// Builds an engine from an opened GGUF file (weights are copied to the
    /// device; the file may be closed afterwards).
    pub fn from_gguf(file: &GgufFile, device: &Device, options: &EngineOptions) -> Result<Engine> {
        Engine::build(file, device, options, |_| {})
    }

    fn build(
        file: &GgufFile,
        device: &Device,
        options: &EngineOptions,
        on_progress: impl FnMut(LoadProgress),
    ) -> Result<Engine> {
        let spec = TokenizerSpec::from_gguf(file)?;
        let tokenizer = Tokenizer::from_spec(spec)?;
        let template = ChatTemplate::for_tokenizer(&tokenizer)?;
        let model = Model::load_with_progress(file, device, options.kernels, on_progress)?;
        if tokenizer.vocab_size() > model.config.vocab {
            return Err(LlmError::Model(format!(
                "the tokenizer has {} tokens but the embedding table only {}",
                tokenizer.vocab_size(),
                model.config.vocab
            )));
        }
        Ok(Engine {
            model,
            tokenizer,
            template,
            graphs: options.graphs,
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The token ids of a prompt: as is when `raw` (control tokens written
    /// in it, such as `<|im_start|>`, are recognized, so a raw prompt can
    /// spell out a chat by hand), else as the single user message of the
    /// chat template with the assistant's turn opened ([`Engine::chat_tokens`]:
    /// the prompt is plain text).
    pub fn prompt_tokens(&self, prompt: &str, raw: bool) -> Result<Vec<u32>> {
        if raw {
            Ok(self.tokenizer.encode(prompt, true, true)?)
        } else {
            self.chat_tokens(&[Message::new("user", prompt)], true)
        }
    }

    /// The token ids of a conversation in the model's chat template, with
    /// the assistant's turn opened when `add_generation_prompt`.
    ///
    /// Only the template's markup becomes control tokens: a message's
    /// content is plain text, so one that spells `<|im_start|>system` gets
    /// the tokens of that text, not a turn of its own. Otherwise the ids are
    /// those of the rendered prompt encoded whole: the tokenizer encodes the
    /// text between control tokens as one run, across the boundaries of
    /// contents ([`Tokenizer::encode_segments`]). A role is markup (templates
    /// compare and print it), so a role that spells a control token is
    /// refused.
    ///
    /// A template that changes contents (trims them, say) is followed
    /// exactly where no content spells a control token; where one does, that
    /// content is kept as given, and where the template cuts contents
    /// ([`ChatTemplate::render_parts`] gives `None`), the conversation is
    /// refused.
    pub fn chat_tokens(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        if let Some(m) = messages
            .iter()
            .find(|m| self.tokenizer.has_control_text(&m.role))
        {
            return Err(LlmError::Request(format!(
                "the message role {:?} spells a control token",
                m.role
            )));
        }
        let bos = self.token_text(self.tokenizer.bos());
        let eos = self.token_text(self.tokenizer.eos());
        let t = &self.template;
        let text = t.render(messages, add_generation_prompt, &bos, &eos)?;
        let parts = t.render_parts(messages, add_generation_prompt, &bos, &eos)?;
        let encode_parts = |parts: &[ChatPart]| {
            let segments: Vec<Segment<'_>> = parts
                .iter()
                .map(|p| match p {
                    ChatPart::Markup(t) => Segment::markup(t),
                    ChatPart::Content(t) => Segment::plain(t),
                })
                .collect();
            self.tokenizer.encode_segments(&segments, true)
        };
        Ok(match parts {
            Some(parts) if joins_into(&parts, &text) => encode_parts(&parts)?,
            _ if !messages
                .iter()
                .any(|m| self.tokenizer.has_control_text(&m.content)) =>
            {
                self.tokenizer.encode(&text, true, true)?
            }
            Some(parts) => encode_parts(&parts)?,
            None => {
                return Err(LlmError::Request(
                    "a message spells a control token, and the chat template rewrites \
                     message contents too much to keep them apart from its markup"
                        .into(),
                ))
            }
        })
    }

    fn token_text(&self, id: Option<u32>) -> String {
        id.and_then(|t| self.tokenizer.token_text(t))
            .unwrap_or_default()
            .to_string()
    }

    /// A new session with room for `max_seq` positions.
    pub fn session(&self, max_seq: usize) -> Result<Session> {
        Session::new(self.model.clone(), max_seq, self.graphs)
    }

    /// Generates a continuation of `prompt`, calling `on_text` with each
    /// piece of text as soon as it is complete UTF-8; `on_text` returns false
    /// to stop early.
    pub fn generate(
        &self,
        prompt: &str,
        options: &GenerateOptions,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        options.sampler.validate()?;
        let device = &self.model.device;
        let _span = device.trace_span("generate");
        let prompt_ids = {
            let _span = device.trace_span("tokenize");
            self.prompt_tokens(prompt, options.raw)?
        };
        let limit = self.model.config.context_length;
        if prompt_ids.len() >= limit {
            return Err(LlmError::Request(format!(
                "the prompt has {} tokens; the model's context holds {limit}",
                prompt_ids.len()
            )));
        }
        let max_seq = prompt_ids
            .len()
            .saturating_add(options.max_tokens)
            .min(limit);
        let mut session = self.session(max_seq)?;
        let mut sampler = Sampler::new(options.sampler.clone());
        let greedy_on_device = options.sampler.is_plain_greedy();

        let t0 = Instant::now();
        let logits = session.prefill(&prompt_ids)?;
        let prefill_time = t0.elapsed();

        // The prompt, then each generated token: the sampler's history.
        let mut tokens = prompt_ids.clone();
        let mut text = String::new();
        // The last token needs no room in the cache: it is never an input.
        let room = max_seq - prompt_ids.len() + 1;
        let mut stepper = Stepper::new(&self.tokenizer, options.max_tokens.min(room));
        let mut next = {
            let _span = device.trace_span("sampling");
            sampler.sample(&logits, &tokens)
        };
        let t1 = Instant::now();
        while take_token(&mut stepper, next, &mut tokens, &mut text, &mut on_text)? {
            if greedy_on_device {
                // The rest on the device, a batch of steps at a time.
                let steps = stepper.remaining();
                session.decode_greedy(next, steps, GREEDY_BATCH, |token| {
                    take_token(&mut stepper, token, &mut tokens, &mut text, &mut on_text)
                })?;
                break;
            }
            session.step(next)?;
            let _span = device.trace_span("sampling");
            next = sampler.sample(&session.logits()?, &tokens);
        }
        let decode_time = t1.elapsed();
        let stop = stepper.stop_reason().unwrap_or(StopReason::Length);
        let rest = stepper.finish();
        if !rest.is_empty() {
            text.push_str(&rest);
            on_text(&rest);
        }
        let generated = tokens.split_off(prompt_ids.len());
        Ok(Generation {
            text,
            tokens: generated,
            prompt_tokens: prompt_ids.len(),
            prefill_time,
            decode_time,
            stop,
        })
    }
}

/// Hands a sampled token to `stepper`; a token it takes goes on `tokens`
/// and its text on `text` and to `on_text`, which returns false to cancel.
/// Returns whether the generation goes on.
fn take_token(
    stepper: &mut Stepper<'_>,
    token: u32,
    tokens: &mut Vec<u32>,
    text: &mut String,
    on_text: &mut impl FnMut(&str) -> bool,
) -> Result<bool> {
    let step = stepper.push(token)?;
    if step.taken {
        tokens.push(token);
    }
    text.push_str(&step.text);
    if !step.text.is_empty() && !on_text(&step.text) {
        stepper.cancel();
        return Ok(false);
    }
    Ok(step.stop.is_none())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_read_the_kernel_set_and_graphs_from_the_environment() -> Result<()> {
        let default = EngineOptions::from_vars(|_| None)?;
        assert_eq!(default, EngineOptions::default());
        assert!(default.graphs && default.kernels == KernelSet::Default);
        let set = EngineOptions::from_vars(|name| match name {
            "ENCORE_EXACT" => Some("1".into()),
            "ENCORE_GRAPHS" => Some("off".into()),
            _ => None,
        })?;
        assert_eq!(set.kernels, KernelSet::Exact);
        assert!(!set.graphs);
        let bad = EngineOptions::from_vars(|name| (name == "ENCORE_EXACT").then(|| "maybe".into()));
        assert!(bad.is_err_and(|e| e.to_string().contains("ENCORE_EXACT")));
        Ok(())
    }
}
