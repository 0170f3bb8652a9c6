//! The engine's error type.

use crate::gguf::GgufError;
use crate::session::Pass;

/// Anything that can go wrong loading a model or generating text.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Runtime(#[from] encore::Error),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    /// A sampling parameter out of its range (see [`crate::SamplerConfig`]).
    #[error(transparent)]
    Sampler(#[from] crate::sampler::SamplerError),
    /// The file describes a model Encore cannot run, or describes it inconsistently.
    #[error("model: {0}")]
    Model(String),
    /// A generation request that cannot be honoured (prompt too long, empty).
    #[error("{0}")]
    Request(String),
    /// The model's output holds a NaN or an infinity: a weight, scale or
    /// norm of the file is not finite, or the arithmetic overflowed.
    /// `position` is the position whose logits were read: the prompt's last
    /// for the prefill, the step's input for a decode step.
    #[error(
        "the model's output is not finite (NaN or infinite logits) in the {pass} at position \
         {position}; the model file may be corrupt"
    )]
    NonFinite { pass: Pass, position: usize },
    /// The default model could not be fetched.
    #[error("fetching the default model: {0}")]
    Fetch(String),
}

pub type Result<T, E = LlmError> = std::result::Result<T, E>;
