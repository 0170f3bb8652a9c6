//! The tokenizer as a GGUF file describes it: [`TokenizerSpec`], plain data
//! read from the `tokenizer.ggml.*` metadata keys with llama.cpp's defaults
//! for what a file leaves out.
//!
//! Reading the file is kept apart from building the tokenizer so that tests
//! and tools can describe a vocabulary by hand, and so that every default
//! and every metadata key lives in one place.

use super::pre_tokenizer::PreTokenizerSpec;
use super::TokenizerError;
use crate::gguf::{GgufError, GgufFile};

/// A tokenizer as a GGUF file describes it, before it is built.
///
/// [`TokenizerSpec::from_gguf`] fills it from `tokenizer.ggml.*` metadata,
/// resolving defaults the way llama.cpp does; tests and tools can fill it by
/// hand.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer for `gpt2` vocabularies
    /// (`"smollm"`, `"llama-bpe"`, `"qwen2"`, `"gpt-2"`, `"default"`, ...);
    /// `None` means `"default"`. Ignored for `llama`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: the text of each token, indexed by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`: SentencePiece merge scores, indexed by id.
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte. `None` means all normal.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs, highest priority first.
    pub merges: Vec<String>,
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// End-of-turn token; when `None` it is looked up by text (`<|im_end|>`, `<|eot_id|>`, ...).
    pub eot: Option<u32>,
    /// Unknown token.
    pub unk: Option<u32>,
    /// Padding token.
    pub pad: Option<u32>,
    /// Whether [`Tokenizer::encode`](super::Tokenizer::encode) with `add_special` prepends `bos`.
    pub add_bos: bool,
    /// Whether [`Tokenizer::encode`](super::Tokenizer::encode) with `add_special` appends `eos`.
    pub add_eos: bool,
    /// `tokenizer.ggml.add_space_prefix`: SentencePiece prefixes a space to
    /// text at the start and after special tokens, and decoding drops the
    /// first token's leading space.
    pub add_space_prefix: bool,
    /// `tokenizer.chat_template`: the Jinja chat template, if the model has one.
    pub chat_template: Option<String>,
}

/// The GGUF keys the tokenizer reads.
mod key {
    pub const MODEL: &str = "tokenizer.ggml.model";
    pub const PRE: &str = "tokenizer.ggml.pre";
    pub const TOKENS: &str = "tokenizer.ggml.tokens";
    pub const SCORES: &str = "tokenizer.ggml.scores";
    pub const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
    pub const MERGES: &str = "tokenizer.ggml.merges";
    pub const BOS: &str = "tokenizer.ggml.bos_token_id";
    pub const EOS: &str = "tokenizer.ggml.eos_token_id";
    pub const EOT: &str = "tokenizer.ggml.eot_token_id";
    pub const UNK: &str = "tokenizer.ggml.unknown_token_id";
    pub const PAD: &str = "tokenizer.ggml.padding_token_id";
    pub const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
    pub const ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
    pub const ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
    pub const CHAT_TEMPLATE: &str = "tokenizer.chat_template";
}

impl TokenizerSpec {
    /// Reads the tokenizer from GGUF metadata, filling in what the file
    /// leaves out as llama.cpp does: a `llama` vocabulary defaults to BOS 1,
    /// EOS 2, UNK 0, `add_bos` and `add_space_prefix`; a `gpt2` vocabulary to
    /// BOS = EOS = 11 and `add_bos` only for Llama 3 style pre-tokenizers.
    /// Special ids outside the vocabulary are ignored, as llama.cpp does.
    pub fn from_gguf(f: &GgufFile) -> Result<TokenizerSpec, TokenizerError> {
        let model = read(f, key::MODEL, GgufFile::get_str)?
            .ok_or(TokenizerError::MissingKey(key::MODEL))?
            .to_owned();
        let pre = read(f, key::PRE, GgufFile::get_str)?.map(str::to_owned);
        let tokens: Vec<String> = read(f, key::TOKENS, GgufFile::get_str_array)?
            .ok_or(TokenizerError::MissingKey(key::TOKENS))?
            .into_iter()
            .map(str::to_owned)
            .collect();
        let scores = read(f, key::SCORES, GgufFile::get_f32_array)?;
        let token_types = read(f, key::TOKEN_TYPE, GgufFile::get_i32_array)?;
        let merges: Vec<String> = match read(f, key::MERGES, GgufFile::get_str_array)? {
            Some(merges) => merges.into_iter().map(str::to_owned).collect(),
            None if model == "gpt2" => return Err(TokenizerError::MissingKey(key::MERGES)),
            None => Vec::new(),
        };

        let (default_bos, default_eos, default_unk, default_add_bos, default_space) =
            match model.as_str() {
                "llama" => (Some(1), Some(2), Some(0), true, true),
                "gpt2" => {
                    let pre = PreTokenizerSpec::named(pre.as_deref())?;
                    (Some(11), Some(11), None, pre.add_bos, false)
                }
                other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
            };
        let n_vocab = tokens.len();
        let special =
            |k: &'static str, default: Option<u32>| -> Result<Option<u32>, TokenizerError> {
                let in_vocab = |id: u32| (id as usize) < n_vocab;
                let given = read(f, k, GgufFile::get_u32)?.filter(|&id| in_vocab(id));
                Ok(given.or(default.filter(|&id| in_vocab(id))))
            };
        let flag = |k: &'static str, default: bool| -> Result<bool, TokenizerError> {
            Ok(read(f, k, GgufFile::get_bool)?.unwrap_or(default))
        };

        Ok(TokenizerSpec {
            bos: special(key::BOS, default_bos)?,
            eos: special(key::EOS, default_eos)?,
            eot: special(key::EOT, None)?,
            unk: special(key::UNK, default_unk)?,
            pad: special(key::PAD, None)?,
            add_bos: flag(key::ADD_BOS, default_add_bos)?,
            add_eos: flag(key::ADD_EOS, false)?,
            add_space_prefix: flag(key::ADD_SPACE_PREFIX, default_space)?,
            chat_template: read(f, key::CHAT_TEMPLATE, GgufFile::get_str)?.map(str::to_owned),
            model,
            pre,
            tokens,
            scores,
            token_types,
            merges,
        })
    }
}

/// Reads an optional metadata key: `None` when absent, an error naming the
/// key when present with the wrong type.
fn read<'f, T>(
    f: &'f GgufFile,
    key: &'static str,
    get: impl FnOnce(&'f GgufFile, &str) -> Result<T, GgufError>,
) -> Result<Option<T>, TokenizerError> {
    if f.get(key).is_none() {
        return Ok(None);
    }
    get(f, key)
        .map(Some)
        .map_err(|source| TokenizerError::Metadata { key, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufWriter;
    use crate::tokenizer::tests::byte_vocab;
    use crate::tokenizer::Tokenizer;

    #[test]
    fn spec_from_gguf_metadata() {
        let mut w = GgufWriter::new();
        w.add_metadata(key::MODEL, "gpt2");
        w.add_metadata(key::PRE, "smollm");
        w.add_metadata(key::TOKENS, crate::gguf::Array::String(byte_vocab()));
        w.add_metadata(key::MERGES, crate::gguf::Array::String(vec![]));
        w.add_metadata(key::EOS, 7u32);
        w.add_metadata(key::BOS, 100_000u32);
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        let spec = TokenizerSpec::from_gguf(&f).unwrap();
        assert_eq!(spec.eos, Some(7));
        // Out-of-vocabulary BOS falls back to the gpt2 default.
        assert_eq!(spec.bos, Some(11));
        assert!(!spec.add_bos);
        assert!(Tokenizer::from_spec(spec).is_ok());

        let mut w = GgufWriter::new();
        w.add_metadata(key::MODEL, "gpt2");
        w.add_metadata(key::TOKENS, crate::gguf::Array::String(byte_vocab()));
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert!(matches!(
            TokenizerSpec::from_gguf(&f).unwrap_err(),
            TokenizerError::MissingKey(key::MERGES)
        ));

        let mut w = GgufWriter::new();
        w.add_metadata(key::MODEL, 3u32);
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert!(matches!(
            TokenizerSpec::from_gguf(&f).unwrap_err(),
            TokenizerError::Metadata {
                key: key::MODEL,
                ..
            }
        ));
    }
}
