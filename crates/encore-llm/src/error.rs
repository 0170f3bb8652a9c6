//! The engine's error type, and the [`Pass`] it names when logits are not
//! finite: kept here, below every module that returns them, so that the
//! error depends on no part of the engine.

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
    /// A sampling parameter out of its range (see [`crate::SamplerConfig`]).
    #[error(transparent)]
    Sampler(#[from] crate::sampler::SamplerError),
    /// The file describes a model Encore cannot run, or describes it inconsistently.
    #[error("model: {0}")]
    Model(String),
    /// The model's weights do not fit in the device's free memory with
    /// `margin` bytes to spare ([`crate::load::LOAD_MARGIN_BYTES`]):
    /// found before anything was allocated.
    #[error(
        "the model's weights need {} on {device} (and {} more for activations and the KV \
         cache), which has {} free of {}",
        gb(*.weights), gb(*.margin), gb(*.free), gb(*.total)
    )]
    WeightsDoNotFit {
        device: String,
        /// Bytes the weights take on the device (allocation sizes).
        weights: u64,
        margin: u64,
        free: u64,
        total: u64,
    },
    /// A generation request that cannot be honoured (prompt too long, empty).
    #[error("{0}")]
    Request(String),
    /// A text that a chat template renders as markup (a role, a tool
    /// call's name, arguments or id, a tool's spec) spells a control token,
    /// which would reach the model as that token: `what` names the text.
    #[error("{what} spells a control token, which only the chat template may write")]
    ControlText { what: String },
    /// The model's output holds a NaN or an infinity: a weight, scale or
    /// norm of the file is not finite, or the arithmetic overflowed.
    /// `position` is the position whose logits were read: the prompt's last
    /// for the prefill, the step's input for a decode step.
    #[error(
        "the model's output is not finite (NaN or infinite logits) in the {pass} at position \
         {position}; the model file may be corrupt"
    )]
    NonFinite { pass: Pass, position: usize },
    /// A model could not be fetched into the cache.
    #[error("fetching the model: {0}")]
    Fetch(String),
    /// A `--model` argument that is neither a file nor a catalog name;
    /// `known` lists the catalog's names.
    #[error("`{name}` is neither a model file nor a catalog model (the catalog has {known})")]
    UnknownModel { name: String, known: String },
    /// A fetched model is not the file the catalog lists (the download was
    /// damaged, or the package changed); it was removed, not cached.
    /// `found_sha256` is `None` when the download ran past the expected
    /// size and was stopped there.
    #[error(
        "the fetched {model} is not the catalog's file: {}, expected sha256 {expected_sha256} \
         and {expected_size} bytes; it was not kept",
        found(.found_sha256.as_deref(), *.found_size, *.expected_size)
    )]
    Mismatch {
        model: String,
        expected_sha256: String,
        expected_size: u64,
        found_sha256: Option<String>,
        found_size: u64,
    },
}

impl LlmError {
    /// Whether the error is the device's ([`LlmError::Runtime`]): one that
    /// may leave it unusable for every request, where other errors concern
    /// one request (its prompt, its output) or the engine's code.
    pub fn is_device_error(&self) -> bool {
        matches!(self, LlmError::Runtime(_))
    }
}

/// Bytes in gigabytes (10^9), one decimal.
fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// What a fetch found, for [`LlmError::Mismatch`].
fn found(sha256: Option<&str>, size: u64, expected_size: u64) -> String {
    match sha256 {
        Some(sha256) => format!("sha256 {sha256} and {size} bytes"),
        None => format!("more than {expected_size} bytes"),
    }
}

/// Which forward pass produced logits that were not finite
/// ([`LlmError::NonFinite`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The prompt's batched pass ([`Session::prefill`](crate::Session::prefill)).
    Prefill,
    /// One decode step ([`Session::step`](crate::Session::step),
    /// [`Session::decode_greedy`](crate::Session::decode_greedy)).
    Decode,
}

impl std::fmt::Display for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Pass::Prefill => "prefill",
            Pass::Decode => "decode step",
        })
    }
}

pub type Result<T, E = LlmError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_devices_errors_are_device_errors() {
        let device = LlmError::Runtime(encore::Error::DeviceFailed {
            device: "cpu".into(),
            cause: "lost".into(),
        });
        assert!(device.is_device_error());
        // One prompt's logits that are not finite fail that request alone.
        let row = LlmError::NonFinite {
            pass: Pass::Decode,
            position: 7,
        };
        assert!(!row.is_device_error());
        assert!(!LlmError::Request("empty prompt".into()).is_device_error());
    }
}
