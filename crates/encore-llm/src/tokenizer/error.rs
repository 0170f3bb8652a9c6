//! Why a tokenizer could not be built, or text could not be encoded or
//! decoded: one error type for the whole module, each variant naming what
//! was wrong.

use crate::gguf::GgufError;

/// Why a tokenizer could not be built, or text could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("GGUF metadata key `{0}` is missing, and the tokenizer needs it")]
    MissingKey(&'static str),

    #[error("GGUF metadata key `{key}` is unusable: {source}")]
    Metadata {
        key: &'static str,
        #[source]
        source: GgufError,
    },

    #[error("tokenizer model `{0}` is not supported (supported: gpt2, llama)")]
    UnsupportedModel(String),

    #[error("pre-tokenizer `{0}` is not supported")]
    UnsupportedPreTokenizer(String),

    #[error("the vocabulary is empty")]
    EmptyVocabulary,

    #[error("token {text:?} appears twice in the vocabulary, as ids {first} and {second}")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },

    #[error("{what} has {found} entries, fewer than the {expected} tokens")]
    TooShort {
        what: &'static str,
        expected: usize,
        found: usize,
    },

    #[error("merge {index} ({merge:?}) is not two tokens separated by a space")]
    BadMerge { index: usize, merge: String },

    #[error("{which} token id {id} is outside the vocabulary of {vocab_size} tokens")]
    SpecialOutOfRange {
        which: &'static str,
        id: u32,
        vocab_size: usize,
    },

    #[error("add_{which} is set, but the tokenizer has no {which} token")]
    MissingSpecial { which: &'static str },

    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfRange { id: u32, vocab_size: usize },

    #[error("the tokenizers library failed while {what}: {message}")]
    Backend { what: &'static str, message: String },
}
