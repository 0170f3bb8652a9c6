//! Text to token ids and back, with the same ids llama.cpp produces for a
//! GGUF model.
//!
//! A GGUF file describes its tokenizer in metadata (`tokenizer.ggml.*`):
//! the vocabulary, per-token types, BPE merges or SentencePiece scores, the
//! special token ids, and a pre-tokenizer name. [`TokenizerSpec`] holds that
//! description as plain data, and [`Tokenizer::from_spec`] builds the
//! tokenizer from it. Two vocabulary kinds are supported:
//!
//! - `gpt2`: byte-level BPE (SmolLM, Llama 3, Qwen 2, GPT-2 ...). The text is
//!   split into words by the regexes llama.cpp uses for the `pre` type, each
//!   word is mapped to GPT-2's printable byte alphabet, and merges are applied
//!   by rank. The `tokenizers` crate does the splitting and the merging.
//! - `llama`: SentencePiece BPE (Llama 2, TinyLlama, Mistral v0.1, Gemma 3 ...).
//!   Spaces become `▁`, a space is prefixed to text that starts the prompt or
//!   follows a special token (where `add_space_prefix` asks for it; Gemma's
//!   vocabulary does not), pairs are merged by the score of the merged
//!   piece (highest first, leftmost on ties), and characters outside the
//!   vocabulary fall back to `<0xXX>` byte tokens. This is a rank-free
//!   algorithm, so it is implemented here directly rather than through the
//!   `tokenizers` crate's rank-based BPE.
//!
//! Special tokens (control, user-defined and unknown token types) are found
//! in the text before either model runs, exactly as llama.cpp does it: the
//! longest special token is split out of the text first, control tokens are
//! recognized only when `parse_special` is set, user-defined tokens always.
//! (The `tokenizers` crate's added tokens would match leftmost-first and
//! always match control tokens, so special tokens are not given to it.)
//! The one known difference from llama.cpp: its splitter makes each
//! unassigned code point (Unicode category Cn) a word of its own, while the
//! regexes here group a run of them with neighbouring punctuation.
//!
//! Loading a model's tokenizer:
//!
//! ```no_run
//! use encore_llm::gguf::GgufFile;
//! use encore_llm::tokenizer::{Tokenizer, TokenizerSpec};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let file = GgufFile::open("SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let tokenizer = Tokenizer::from_spec(TokenizerSpec::from_gguf(&file)?)?;
//! let ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n", true, true)?;
//! # Ok(())
//! # }
//! ```
//!
//! Building one by hand:
//!
//! ```
//! use encore_llm::tokenizer::{byte_symbol, Tokenizer, TokenizerSpec};
//!
//! # fn main() -> Result<(), encore_llm::tokenizer::TokenizerError> {
//! // A byte-level vocabulary: the 256 byte symbols (byte b has id b), one
//! // merged token, one control token.
//! let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_symbol(b).to_string()).collect();
//! tokens.push("hi".into());
//! tokens.push("<|end|>".into());
//! let mut token_types = vec![1; tokens.len()];
//! token_types[257] = 3;
//! let spec = TokenizerSpec {
//!     model: "gpt2".into(),
//!     pre: Some("smollm".into()),
//!     tokens,
//!     token_types: Some(token_types),
//!     merges: vec!["h i".into()],
//!     eos: Some(257),
//!     ..TokenizerSpec::default()
//! };
//! let tokenizer = Tokenizer::from_spec(spec)?;
//! let ids = tokenizer.encode("hi!<|end|>", false, true)?;
//! assert_eq!(ids, [256, u32::from(b'!'), 257]);
//! assert_eq!(tokenizer.decode(&ids)?, "hi!<|end|>");
//! assert!(tokenizer.is_eog(257));
//! # Ok(())
//! # }
//! ```
//!
//! The parts, one a file, so that each vocabulary kind and each llama.cpp
//! rule the ids depend on can be read and tested on its own:
//! [`TokenizerSpec`] and reading it from GGUF metadata (`spec.rs`); special
//! tokens, their attributes and the end-of-generation set (`special.rs`);
//! the pre-tokenizers' regexes (`pre_tokenizer.rs`); byte-level BPE and
//! GPT-2's byte alphabet (`byte_level.rs`); SentencePiece merging
//! (`sentencepiece.rs`); ids back to text, whole or streamed (`decode.rs`);
//! the error type (`error.rs`). This file builds a [`Tokenizer`] from a spec
//! and runs encoding, which ties the parts together: special tokens are
//! split out first, then each run of text goes to the vocabulary kind's
//! model.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;

mod byte_level;
mod decode;
mod error;
mod pre_tokenizer;
mod sentencepiece;
mod spec;
mod special;
#[cfg(test)]
pub(crate) mod tests;

pub use byte_level::byte_symbol;
pub use decode::StreamDecoder;
pub use error::TokenizerError;
pub use spec::TokenizerSpec;

use byte_level::byte_level_tokenizer;
use decode::token_piece;
use pre_tokenizer::PreTokenizerSpec;
use special::{attr, EndOfGeneration, Fragment};

/// The part of the tokenizer that turns plain text (no special tokens) into ids.
enum TextModel {
    /// Byte-level BPE: regex splits, byte alphabet, rank-ordered merges.
    ByteLevel(Box<tokenizers::Tokenizer>),
    /// SentencePiece BPE: `▁` for spaces, score-ordered merges, byte fallback.
    SentencePiece { scores: Vec<f32> },
}

/// A tokenizer built from a [`TokenizerSpec`].
pub struct Tokenizer {
    text_model: TextModel,
    tokens: Vec<String>,
    token_ids: HashMap<String, u32>,
    /// llama.cpp's attribute bits per token ([`attr`]).
    attrs: Vec<u8>,
    /// The bytes each token decodes to.
    pieces: Vec<Vec<u8>>,
    /// Tokens split out of text before the text model runs, longest first.
    special_tokens: Vec<u32>,
    /// End-of-generation tokens, sorted.
    eog: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let model = match self.text_model {
            TextModel::ByteLevel(_) => "byte-level BPE",
            TextModel::SentencePiece { .. } => "SentencePiece BPE",
        };
        f.debug_struct("Tokenizer")
            .field("model", &model)
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .finish_non_exhaustive()
    }
}

/// A piece of text for [`Tokenizer::encode_segments`], and whether control
/// tokens written in it are recognized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment<'a> {
    pub text: &'a str,
    /// Recognize control tokens (`<|im_start|>`) written in `text`; without
    /// it they are plain text. User-defined tokens are always recognized.
    pub parse_special: bool,
}

impl<'a> Segment<'a> {
    /// Text whose control tokens are recognized: a chat template's markup.
    pub fn markup(text: &'a str) -> Segment<'a> {
        Segment {
            text,
            parse_special: true,
        }
    }

    /// Text whose control tokens are plain text: a message's content.
    pub fn plain(text: &'a str) -> Segment<'a> {
        Segment {
            text,
            parse_special: false,
        }
    }
}

impl Tokenizer {
    /// Builds a tokenizer, checking the spec: known model and pre-tokenizer,
    /// unique tokens, well-formed merges, special ids inside the vocabulary.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        let TokenizerSpec {
            model,
            pre,
            mut tokens,
            scores,
            token_types,
            merges,
            bos,
            eos,
            eot,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            chat_template,
        } = spec;

        let n_vocab = tokens.len();
        if n_vocab == 0 {
            return Err(TokenizerError::EmptyVocabulary);
        }
        // An empty token could match anywhere; llama.cpp renames it.
        for (i, token) in tokens.iter_mut().enumerate() {
            if token.is_empty() {
                *token = format!("[EMPTY_{i}]");
            }
        }
        let mut token_ids = HashMap::with_capacity(n_vocab);
        for (id, token) in (0u32..).zip(&tokens) {
            if let Some(first) = token_ids.insert(token.clone(), id) {
                return Err(TokenizerError::DuplicateToken {
                    text: token.clone(),
                    first,
                    second: id,
                });
            }
        }

        let mut attrs = match &token_types {
            Some(types) if types.len() < n_vocab => {
                return Err(TokenizerError::TooShort {
                    what: "tokenizer.ggml.token_type",
                    expected: n_vocab,
                    found: types.len(),
                })
            }
            Some(types) => types[..n_vocab]
                .iter()
                .map(|&t| attr::from_token_type(t))
                .collect(),
            None => vec![attr::NORMAL; n_vocab],
        };

        for (which, id) in [
            ("bos", bos),
            ("eos", eos),
            ("eot", eot),
            ("unk", unk),
            ("pad", pad),
        ] {
            if let Some(id) = id.filter(|&id| id as usize >= n_vocab) {
                return Err(TokenizerError::SpecialOutOfRange {
                    which,
                    id,
                    vocab_size: n_vocab,
                });
            }
        }
        if add_bos && bos.is_none() {
            return Err(TokenizerError::MissingSpecial { which: "bos" });
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::MissingSpecial { which: "eos" });
        }

        let (text_model, clean_spaces) = match model.as_str() {
            "gpt2" => {
                let pre = PreTokenizerSpec::named(pre.as_deref())?;
                let tokenizer = byte_level_tokenizer(&token_ids, &merges, &pre)?;
                (TextModel::ByteLevel(Box::new(tokenizer)), pre.clean_spaces)
            }
            "llama" => {
                let scores = match scores {
                    Some(s) if s.len() < n_vocab => {
                        return Err(TokenizerError::TooShort {
                            what: "tokenizer.ggml.scores",
                            expected: n_vocab,
                            found: s.len(),
                        })
                    }
                    Some(mut s) => {
                        s.truncate(n_vocab);
                        s
                    }
                    None => vec![0.0; n_vocab],
                };
                (TextModel::SentencePiece { scores }, false)
            }
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };

        let eog_tokens = EndOfGeneration::find(&tokens, &token_ids, &mut attrs, eos, eot);
        let pieces = tokens
            .iter()
            .zip(&attrs)
            .map(|(text, &a)| token_piece(text, a, &text_model))
            .collect();

        let mut special_tokens: Vec<u32> = (0u32..)
            .zip(&attrs)
            .filter(|(_, &a)| a & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0)
            .map(|(id, _)| id)
            .collect();
        special_tokens.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].len()));

        Ok(Tokenizer {
            text_model,
            tokens,
            token_ids,
            attrs,
            pieces,
            special_tokens,
            eog: eog_tokens.eog,
            bos,
            eos,
            eot: eog_tokens.eot,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            chat_template,
        })
    }

    /// Encodes text into token ids.
    ///
    /// `add_special` adds BOS and EOS as the model's `add_bos`/`add_eos`
    /// flags ask. `parse_special` recognizes control tokens written in the
    /// text (`<|im_start|>`); without it they are tokenized as plain text.
    /// User-defined tokens are always recognized.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_segments(
            &[Segment {
                text,
                parse_special,
            }],
            add_special,
        )
    }

    /// Encodes the concatenation of `segments`, recognizing a control token
    /// only where it lies whole inside a segment that parses them.
    ///
    /// The text between special tokens is encoded as one run whatever
    /// segments it spans, so where no control token is refused, the ids are
    /// those of encoding the concatenated text with control tokens parsed:
    /// a boundary between segments does not split a word, and byte-pair
    /// merges across it are made as they would be in the whole text. A chat
    /// prompt passes the template's markup with control tokens parsed and
    /// each message's content without, so that a message cannot open a turn
    /// of its own by spelling `<|im_start|>`.
    pub fn encode_segments(
        &self,
        segments: &[Segment<'_>],
        add_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let (text, parsed) = match segments {
            [one] => (
                Cow::Borrowed(one.text),
                if one.parse_special {
                    vec![Range {
                        start: 0,
                        end: one.text.len(),
                    }]
                } else {
                    Vec::new()
                },
            ),
            _ => {
                let mut text = String::new();
                let mut parsed: Vec<Range<usize>> = Vec::new();
                for segment in segments {
                    let range = text.len()..text.len() + segment.text.len();
                    text.push_str(segment.text);
                    if !segment.parse_special || range.is_empty() {
                        continue;
                    }
                    match parsed.last_mut() {
                        Some(last) if last.end == range.start => last.end = range.end,
                        _ => parsed.push(range),
                    }
                }
                (Cow::Owned(text), parsed)
            }
        };
        let text = text.as_ref();
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            ids.extend(self.bos);
        }
        let fragments = self.split_special(text, &parsed);
        match &self.text_model {
            TextModel::ByteLevel(tokenizer) => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => ids.push(id),
                        Fragment::Text(range) => {
                            let encoding =
                                tokenizer.encode_fast(&text[range], false).map_err(|e| {
                                    TokenizerError::Backend {
                                        what: "encoding text",
                                        message: e.to_string(),
                                    }
                                })?;
                            ids.extend_from_slice(encoding.get_ids());
                        }
                    }
                }
            }
            TextModel::SentencePiece { scores } => {
                let mut after_special = true;
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => {
                            ids.push(id);
                            after_special = true;
                        }
                        Fragment::Text(range) => {
                            let mut piece = String::with_capacity(range.len() + 4);
                            if self.add_space_prefix && after_special {
                                piece.push('▁');
                            }
                            piece.push_str(&text[range].replace(' ', "▁"));
                            self.encode_sentencepiece(&piece, scores, &mut ids);
                            after_special = false;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            ids.extend(self.eos);
        }
        Ok(ids)
    }

    /// The token's text as the vocabulary stores it (`Ġthe`, `▁the`, `<|im_end|>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of the token whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_ids.get(text).copied()
    }

    /// The number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token, given by the model or found by its text.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// Unknown token.
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }

    /// Padding token.
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether generating `id` ends the response: EOS, EOT, and the tokens
    /// llama.cpp treats as end of generation by their text (`<|im_end|>`,
    /// `<|endoftext|>`, `<|eot_id|>`, `<end_of_turn>`, ...).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Whether `id` is a control token (`<|im_start|>`, `<s>`): one that
    /// structures the prompt rather than standing for text.
    pub fn is_control(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a & attr::CONTROL != 0)
    }

    /// The chat template from the model file, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
}
