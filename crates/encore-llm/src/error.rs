//! The engine's error type.

use crate::gguf::GgufError;

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
    /// The file describes a model Encore cannot run, or describes it inconsistently.
    #[error("model: {0}")]
    Model(String),
    /// A generation request that cannot be honoured (prompt too long, empty).
    #[error("{0}")]
    Request(String),
    /// The default model could not be fetched.
    #[error("fetching the default model: {0}")]
    Fetch(String),
}

pub type Result<T, E = LlmError> = std::result::Result<T, E>;
