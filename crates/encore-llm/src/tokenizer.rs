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

use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::ops::Range;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

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
    /// Whether [`Tokenizer::encode`] with `add_special` prepends `bos`.
    pub add_bos: bool,
    /// Whether [`Tokenizer::encode`] with `add_special` appends `eos`.
    pub add_eos: bool,
    /// `tokenizer.ggml.add_space_prefix`: SentencePiece prefixes a space to
    /// text at the start and after special tokens, and decoding drops the
    /// first token's leading space.
    pub add_space_prefix: bool,
    /// `tokenizer.chat_template`: the Jinja chat template, if the model has one.
    pub chat_template: Option<String>,
}

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

/// The GPT-2 byte-level alphabet: the printable character that stands for
/// `byte` inside byte-level BPE tokens (`Ġ` for a space, `Ċ` for a newline).
pub fn byte_symbol(byte: u8) -> char {
    let code = u32::from(BYTE_SYMBOLS[usize::from(byte)]);
    // Every symbol is below U+0144, so always a valid `char`.
    char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The byte a GPT-2 byte-level symbol stands for.
fn symbol_byte(symbol: char) -> Option<u8> {
    let byte = *SYMBOL_BYTES.get(symbol as usize)?;
    u8::try_from(byte).ok()
}

/// Printable Latin-1 bytes stand for themselves; the other 68 bytes are
/// numbered from U+0100 upward in byte order.
const BYTE_SYMBOLS: [u16; 256] = {
    let mut symbols = [0u16; 256];
    let mut next_unprintable = 256u16;
    let mut byte = 0;
    while byte < 256 {
        let printable = matches!(byte, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
        symbols[byte] = if printable {
            byte as u16
        } else {
            next_unprintable += 1;
            next_unprintable - 1
        };
        byte += 1;
    }
    symbols
};

/// The inverse of [`BYTE_SYMBOLS`], indexed by code point; `u16::MAX` where
/// a code point is not a symbol.
const SYMBOL_BYTES: [u16; 256 + 68] = {
    let mut bytes = [u16::MAX; 256 + 68];
    let mut byte = 0;
    while byte < 256 {
        bytes[BYTE_SYMBOLS[byte] as usize] = byte as u16;
        byte += 1;
    }
    bytes
};

/// llama.cpp's token attributes (`LLAMA_TOKEN_ATTR_*`), as bit flags: a
/// control-looking token can be both user-defined and control.
mod attr {
    pub const UNDEFINED: u8 = 0;
    pub const UNKNOWN: u8 = 1 << 0;
    pub const UNUSED: u8 = 1 << 1;
    pub const NORMAL: u8 = 1 << 2;
    pub const CONTROL: u8 = 1 << 3;
    pub const USER_DEFINED: u8 = 1 << 4;
    pub const BYTE: u8 = 1 << 5;

    /// The attribute for a GGUF token type.
    pub fn from_token_type(token_type: i32) -> u8 {
        match token_type {
            1 => NORMAL,
            2 => UNKNOWN,
            3 => CONTROL,
            4 => USER_DEFINED,
            5 => UNUSED,
            6 => BYTE,
            _ => UNDEFINED,
        }
    }
}

/// Texts that end generation (llama.cpp's list, matched by token text).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Texts that mark the end of a turn, for finding the EOT token when the
/// model does not name it, most specific first: the first one in the
/// vocabulary is the EOT token (`<|im_end|>` rather than `<|endoftext|>`).
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle padding, repository and file-separator tokens, which
/// llama.cpp also treats as end of generation.
const FIM_EOG_TEXTS: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

/// Fill-in-the-middle prefix, suffix and middle tokens: control tokens
/// whatever the file's token type says, but not the end of generation.
const FIM_CONTROL_TEXTS: &[&[&str]] = &[
    &[
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ],
    &[
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ],
    &[
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ],
];

const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `gpt2` vocabulary splits text into words, and the flags llama.cpp
/// ties to the pre-tokenizer name.
struct PreTokenizerSpec {
    /// Applied in order; matches and the text between them both become words.
    regexes: &'static [&'static str],
    /// A word that is itself a token is emitted whole, without merging.
    ignore_merges: bool,
    /// `add_bos` when the GGUF file does not say.
    add_bos: bool,
    /// Decoding removes spaces before punctuation (`clean_up_tokenization_spaces`).
    clean_spaces: bool,
}

impl PreTokenizerSpec {
    fn named(pre: Option<&str>) -> Result<PreTokenizerSpec, TokenizerError> {
        let spec = |regexes, ignore_merges, add_bos, clean_spaces| PreTokenizerSpec {
            regexes,
            ignore_merges,
            add_bos,
            clean_spaces,
        };
        let name = pre.unwrap_or("default");
        Ok(match name {
            "default" => spec(
                &[
                    r"[\p{P}\$\+<=>\^~\|]+",
                    GPT2_REGEX,
                    r"\p{N}+",
                    "[0-9][0-9][0-9]",
                ],
                false,
                false,
                true,
            ),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" | "jina-v5-nano" => spec(&[LLAMA3_REGEX], true, true, true),
            "dbrx" | "smaug-bpe" => spec(&[LLAMA3_REGEX], false, false, true),
            "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jais" | "exaone4" | "gigachat"
            | "mellum" | "a.x-4.0" => spec(&[GPT2_REGEX], false, false, true),
            "trillion" | "granite-docling" => spec(&[GPT2_REGEX], false, false, false),
            "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
                spec(&[r"\p{N}", GPT2_REGEX], false, false, true)
            }
            "smollm" | "command-r" => spec(&[r"\p{N}", GPT2_REGEX], false, false, false),
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "solar-open" => {
                spec(&[QWEN2_REGEX], false, false, false)
            }
            "stablelm2" | "megrez" => spec(&[QWEN2_REGEX], false, false, true),
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_owned())),
        })
    }
}

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

/// A run of input text, or a special token found in it.
#[derive(Clone, Debug, PartialEq)]
enum Fragment {
    Text(Range<usize>),
    Token(u32),
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

    /// Decodes token ids into text, as llama.cpp's `llama_detokenize` does
    /// with special tokens rendered: every token contributes its bytes
    /// ([`Tokenizer::token_bytes`]), a SentencePiece model drops the first
    /// token's leading space, and the pre-tokenizers that ask for it remove
    /// spaces before punctuation (`" ."` becomes `"."`). Invalid UTF-8 becomes
    /// U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_bytes(id)?;
            let piece = match piece {
                [b' ', rest @ ..] if i == 0 && self.add_space_prefix => rest,
                _ => piece,
            };
            bytes.extend_from_slice(piece);
        }
        if self.clean_spaces {
            bytes = clean_up_spaces(bytes);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The bytes one token stands for. A token can hold part of a UTF-8
    /// character, so use [`StreamDecoder`] to turn a stream of tokens into
    /// text. Control and user-defined tokens give their own text.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        self.pieces
            .get(id as usize)
            .map(Vec::as_slice)
            .ok_or(TokenizerError::TokenOutOfRange {
                id,
                vocab_size: self.tokens.len(),
            })
    }

    /// A decoder for tokens that arrive one at a time.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            pending: Vec::new(),
        }
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

    /// Whether `text` spells a control (or unknown) token, which encoding
    /// it with `parse_special` would recognize.
    pub fn has_control_text(&self, text: &str) -> bool {
        let control = |id: u32| self.attrs[id as usize] & (attr::CONTROL | attr::UNKNOWN) != 0;
        let whole = Range {
            start: 0,
            end: text.len(),
        };
        self.split_special(text, &[whole])
            .iter()
            .any(|f| matches!(f, Fragment::Token(id) if control(*id)))
    }

    /// Splits special tokens out of `text`, longest token first, each token
    /// at every non-overlapping occurrence, left to right. Control and
    /// unknown tokens are recognized only inside one of the `parsed` ranges.
    fn split_special(&self, text: &str, parsed: &[Range<usize>]) -> Vec<Fragment> {
        let mut fragments = Vec::new();
        if text.is_empty() {
            return fragments;
        }
        fragments.push(Fragment::Text(0..text.len()));
        let whole = parsed
            .first()
            .is_some_and(|r| r.start == 0 && r.end == text.len());
        for &id in &self.special_tokens {
            let a = self.attrs[id as usize];
            let restricted = a & (attr::CONTROL | attr::UNKNOWN) != 0 && !whole;
            if restricted && parsed.is_empty() {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            // One search of the whole text rules out most tokens, where
            // searching each of many short fragments would cost far more.
            if !text.contains(needle) {
                continue;
            }
            let found = fragments.iter().any(|f| match f {
                Fragment::Text(range) => text[range.clone()].contains(needle),
                Fragment::Token(_) => false,
            });
            if !found {
                continue;
            }
            let mut split = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(range) = fragment else {
                    split.push(fragment);
                    continue;
                };
                // `start`: where the text not yet split off begins; `from`:
                // where the search goes on (past a refused occurrence).
                let (mut start, mut from) = (range.start, range.start);
                while let Some(offset) = text[from..range.end].find(needle) {
                    let at = from + offset;
                    let end = at + needle.len();
                    if restricted && !parsed.iter().any(|r| r.start <= at && end <= r.end) {
                        from = at + text[at..].chars().next().map_or(1, char::len_utf8);
                        continue;
                    }
                    if at > start {
                        split.push(Fragment::Text(start..at));
                    }
                    split.push(Fragment::Token(id));
                    start = end;
                    from = end;
                }
                if start < range.end {
                    split.push(Fragment::Text(start..range.end));
                }
            }
            fragments = split;
        }
        fragments
    }

    /// SentencePiece BPE over one run of text (spaces already `▁`): start
    /// from characters, repeatedly merge the adjacent pair whose
    /// concatenation is the highest-scoring token (leftmost on ties), then
    /// emit each piece, or its bytes as `<0xXX>` tokens if it is not a token.
    fn encode_sentencepiece(&self, text: &str, scores: &[f32], ids: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, ch) in text.char_indices() {
            let index = symbols.len();
            symbols.push(Symbol {
                start,
                len: ch.len_utf8(),
                prev: index.checked_sub(1),
                next: None,
            });
            if let Some(prev) = index.checked_sub(1) {
                symbols[prev].next = Some(index);
            }
        }

        let mut queue = BinaryHeap::new();
        let candidate = |symbols: &[Symbol], left: Option<usize>, right: Option<usize>| {
            let (left, right) = (left?, right?);
            let (l, r) = (symbols[left], symbols[right]);
            let merged = &text[l.start..r.start + r.len];
            let id = *self.token_ids.get(merged)?;
            Some(Bigram {
                score: scores[id as usize],
                left,
                right,
                len: merged.len(),
            })
        };
        for right in 1..symbols.len() {
            queue.extend(candidate(&symbols, Some(right - 1), Some(right)));
        }
        while let Some(bigram) = queue.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            // A pair is stale once either side has merged with something else.
            if l.len == 0 || r.len == 0 || l.len + r.len != bigram.len {
                continue;
            }
            symbols[bigram.left].len += r.len;
            symbols[bigram.left].next = r.next;
            symbols[bigram.right].len = 0;
            if let Some(next) = r.next {
                symbols[next].prev = Some(bigram.left);
            }
            queue.extend(candidate(&symbols, l.prev, Some(bigram.left)));
            queue.extend(candidate(&symbols, Some(bigram.left), r.next));
        }

        let mut index = (!symbols.is_empty()).then_some(0);
        while let Some(i) = index {
            let symbol = symbols[i];
            let piece = &text[symbol.start..symbol.start + symbol.len];
            match self.token_ids.get(piece) {
                Some(&id) => ids.push(id),
                None => {
                    for byte in piece.bytes() {
                        let byte_token = self
                            .token_ids
                            .get(&format!("<0x{byte:02X}>"))
                            .or_else(|| {
                                let single = [byte];
                                std::str::from_utf8(&single)
                                    .ok()
                                    .and_then(|s| self.token_ids.get(s))
                            })
                            .copied()
                            .or(self.unk);
                        ids.extend(byte_token);
                    }
                }
            }
            index = symbol.next;
        }
    }
}

/// A run of text during SentencePiece merging: merged symbols grow, absorbed
/// ones get length 0 and leave the linked list.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of two adjacent symbols.
#[derive(Debug)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Ord for Bigram {
    /// Higher score first; on equal scores, the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

/// Builds the `tokenizers` pipeline for a byte-level vocabulary: the
/// pre-tokenizer's regex splits, the byte alphabet, and BPE.
fn byte_level_tokenizer(
    token_ids: &HashMap<String, u32>,
    merges: &[String],
    pre: &PreTokenizerSpec,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let vocab: Vocab = token_ids.iter().map(|(t, &id)| (t.clone(), id)).collect();
    // llama.cpp keeps the first rank of a repeated pair; the `tokenizers`
    // crate would keep the last. Merges whose parts or result are not
    // tokens cannot produce a token, so they are left out.
    let mut seen = std::collections::HashSet::with_capacity(merges.len());
    let mut pairs = Vec::with_capacity(merges.len());
    for (index, merge) in merges.iter().enumerate() {
        // Like llama.cpp, split at the first space after the first byte, so
        // a merge may start with a space token.
        let split = merge
            .bytes()
            .skip(1)
            .position(|b| b == b' ')
            .map(|at| at + 1);
        let Some(at) = split else {
            return Err(TokenizerError::BadMerge {
                index,
                merge: merge.clone(),
            });
        };
        let (left, right) = (&merge[..at], &merge[at + 1..]);
        let known = token_ids.contains_key(left)
            && token_ids.contains_key(right)
            && token_ids.contains_key(&format!("{left}{right}"));
        if known && seen.insert((left, right)) {
            pairs.push((left.to_owned(), right.to_owned()));
        }
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Backend {
            what: "building the BPE model",
            message: e.to_string(),
        })?;

    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
    for regex in pre.regexes {
        let split = Split::new(
            SplitPattern::Regex((*regex).to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Backend {
            what: "compiling a pre-tokenizer regex",
            message: e.to_string(),
        })?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());

    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(Sequence::new(steps)));
    Ok(tokenizer)
}

/// The bytes a token decodes to, as llama.cpp's `token_to_piece` with
/// special tokens rendered: control, unknown and user-defined tokens give
/// their text, normal tokens their decoded text, byte tokens their byte,
/// unused and undefined tokens nothing.
fn token_piece(text: &str, a: u8, model: &TextModel) -> Vec<u8> {
    if a & (attr::CONTROL | attr::UNKNOWN | attr::USER_DEFINED) != 0 {
        return text.as_bytes().to_vec();
    }
    if a & attr::NORMAL != 0 {
        return match model {
            TextModel::ByteLevel(_) => decode_byte_symbols(text),
            TextModel::SentencePiece { .. } => text.replace('▁', " ").into_bytes(),
        };
    }
    if a & attr::BYTE != 0 {
        let hex = text
            .strip_prefix("<0x")
            .and_then(|rest| rest.strip_suffix('>'));
        if let Some(byte) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            return vec![byte];
        }
    }
    Vec::new()
}

/// Maps GPT-2 byte symbols back to bytes; a character outside the alphabet
/// stands for itself.
fn decode_byte_symbols(text: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(text.len());
    for ch in text.chars() {
        match symbol_byte(ch) {
            Some(byte) => bytes.push(byte),
            None => bytes.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    bytes
}

/// llama.cpp's `clean_up_tokenization_spaces`: drops the space before
/// `? ! . ,`, collapses `" ' "` to `"'"`, and attaches `'s 'm 're 've` to
/// the previous word.
fn clean_up_spaces(text: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for (i, &b) in text.iter().enumerate() {
        let before_punct = b == b' ' && matches!(text.get(i + 1), Some(b'?' | b'!' | b'.' | b','));
        if !before_punct {
            out.push(b);
        }
    }

    let text = out;
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        let b = text[i];
        let lone_quote =
            b == b'\'' && i > 0 && text[i - 1] == b' ' && text.get(i + 1) == Some(&b' ');
        if lone_quote {
            out.pop();
            out.push(b);
            // The space after the quote goes too, and does not count as the
            // space before whatever follows.
            i += 2;
            if let Some(&next) = text.get(i) {
                out.push(next);
                i += 1;
            }
            continue;
        }
        out.push(b);
        i += 1;
    }

    let text = out;
    let mut out = Vec::with_capacity(text.len());
    for (i, &b) in text.iter().enumerate() {
        if i > 0 && b == b'\'' && text[i - 1] == b' ' {
            let contraction = matches!(
                (text.get(i + 1), text.get(i + 2)),
                (Some(b's' | b'm'), _) | (Some(b'r' | b'v'), Some(b'e'))
            );
            if contraction {
                out.pop();
            }
        }
        out.push(b);
    }
    out
}

/// The end-of-generation set and the end-of-turn token, found the way
/// llama.cpp finds them.
struct EndOfGeneration {
    eog: Vec<u32>,
    eot: Option<u32>,
}

impl EndOfGeneration {
    /// Marks end-of-generation and fill-in-the-middle tokens as control
    /// tokens (so that text can only name them when special tokens are
    /// parsed) and collects the end-of-generation set: EOS, EOT (looked up
    /// by text when not given), the fill-in-the-middle
    /// padding/repository/separator tokens, and every token whose text is in
    /// [`EOG_TEXTS`]. Where several tokens match a fill-in-the-middle role,
    /// the lowest id wins.
    fn find(
        tokens: &[String],
        token_ids: &HashMap<String, u32>,
        attrs: &mut [u8],
        eos: Option<u32>,
        eot: Option<u32>,
    ) -> EndOfGeneration {
        let first_of = |texts: &[&str]| {
            texts
                .iter()
                .filter_map(|t| token_ids.get(*t))
                .min()
                .copied()
        };
        let mut eog = Vec::new();

        let eot = eot.or_else(|| EOT_TEXTS.iter().find_map(|t| token_ids.get(*t).copied()));
        eog.extend(eot);
        eog.extend(first_of(&["<|eom_id|>"]));
        for texts in FIM_EOG_TEXTS {
            eog.extend(first_of(texts));
        }
        eog.extend(EOG_TEXTS.iter().filter_map(|t| token_ids.get(*t)));
        let fim = FIM_CONTROL_TEXTS.iter().filter_map(|texts| first_of(texts));
        for id in eog.iter().copied().chain(fim) {
            attrs[id as usize] |= attr::CONTROL;
        }

        // gpt-oss's message-structure tokens are always rendered as text.
        for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = token_ids.get(text) {
                attrs[id as usize] = attr::USER_DEFINED;
            }
        }

        eog.extend(eos);
        eog.sort_unstable();
        eog.dedup();

        let has = |eog: &[u32], text: &str| eog.iter().any(|&id| tokens[id as usize] == text);
        // In the harmony and Solar Open formats `<|end|>` ends a message,
        // not the response.
        let call = has(&eog, "<|call|>") || has(&eog, "<|calls|>");
        if call && (has(&eog, "<|return|>") || has(&eog, "<|flush|>")) {
            if let Some(&end) = token_ids.get("<|end|>") {
                eog.retain(|&id| id != end);
                attrs[end as usize] = attr::USER_DEFINED;
            }
        }
        // Where a model has its own end markers, `</s>` is ordinary text.
        if has(&eog, "<|tool_response>") || has(&eog, "<|plamo:eos|>") {
            if let Some(&s) = token_ids.get("</s>") {
                eog.retain(|&id| id != s);
                attrs[s as usize] = attr::NORMAL;
            }
        }
        EndOfGeneration { eog, eot }
    }
}

/// Turns tokens that arrive one at a time into text, holding back the bytes
/// of a UTF-8 character until all of them have arrived. Bytes that can never
/// form a character come out as U+FFFD.
///
/// Unlike [`Tokenizer::decode`], it passes every token's bytes through
/// unchanged: a continuation keeps its leading space.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Adds one token and returns the text it completes (often empty for a
    /// partial character).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        self.pending
            .extend_from_slice(self.tokenizer.token_bytes(id)?);
        let mut text = String::new();
        let mut consumed = 0;
        loop {
            let rest = &self.pending[consumed..];
            match std::str::from_utf8(rest) {
                Ok(valid) => {
                    text.push_str(valid);
                    consumed = self.pending.len();
                    break;
                }
                Err(error) => {
                    let valid_len = error.valid_up_to();
                    text.push_str(&String::from_utf8_lossy(&rest[..valid_len]));
                    consumed += valid_len;
                    match error.error_len() {
                        Some(bad) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            consumed += bad;
                        }
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        Ok(text)
    }

    /// Ends the stream, returning any held-back bytes as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
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

    /// The 256 byte symbols in byte order, so byte `b` has id `b`.
    fn byte_vocab() -> Vec<String> {
        (0..=255u8).map(|b| byte_symbol(b).to_string()).collect()
    }

    /// A small byte-level vocabulary: bytes (ids 0..256), merged tokens, and
    /// ChatML control tokens.
    fn tiny_gpt2(pre: &str) -> Tokenizer {
        let mut tokens = byte_vocab();
        let merged = [
            "he", "ll", "hell", "hello", "Ġw", "Ġwo", "Ġwor", "Ġworl", "Ġworld", "12",
        ];
        tokens.extend(merged.iter().map(|s| s.to_string()));
        tokens.extend(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool>"].map(String::from));
        let mut types = vec![1; tokens.len()];
        let n = types.len();
        types[n - 4..n - 1].fill(3);
        types[n - 1] = 4;
        let merges = [
            "h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "Ġwo r", "Ġwor l", "Ġworl d", "1 2",
        ];
        Tokenizer::from_spec(TokenizerSpec {
            model: "gpt2".into(),
            pre: Some(pre.into()),
            tokens,
            token_types: Some(types),
            merges: merges.map(String::from).to_vec(),
            bos: Some(266),
            eos: Some(267),
            ..TokenizerSpec::default()
        })
        .unwrap()
    }

    fn ids_of(tokenizer: &Tokenizer, texts: &[&str]) -> Vec<u32> {
        texts
            .iter()
            .map(|t| {
                tokenizer
                    .token_id(t)
                    .unwrap_or_else(|| panic!("no token {t:?}"))
            })
            .collect()
    }

    #[test]
    fn byte_alphabet_matches_gpt2() {
        assert_eq!(byte_symbol(b' '), 'Ġ');
        assert_eq!(byte_symbol(b'\n'), 'Ċ');
        assert_eq!(byte_symbol(b'a'), 'a');
        assert_eq!(byte_symbol(0), 'Ā');
        assert_eq!(byte_symbol(0xad), 'Ń');
        let distinct: std::collections::HashSet<char> = (0..=255u8).map(byte_symbol).collect();
        assert_eq!(distinct.len(), 256);
        for b in 0..=255u8 {
            assert_eq!(symbol_byte(byte_symbol(b)), Some(b));
        }
        assert_eq!(symbol_byte('€'), None);
    }

    #[test]
    fn tokenizer_is_shareable_across_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<Tokenizer>();
        shareable::<crate::chat::ChatTemplate>();
    }

    #[test]
    fn merges_apply_by_rank() {
        let t = tiny_gpt2("smollm");
        let ids = t.encode("hello world", false, false).unwrap();
        assert_eq!(ids, ids_of(&t, &["hello", "Ġworld"]));
        assert_eq!(t.decode(&ids).unwrap(), "hello world");
    }

    #[test]
    fn smollm_splits_every_digit() {
        let t = tiny_gpt2("smollm");
        // "12" is a token, but smollm isolates each digit before merging.
        let ids = t.encode("a 12", false, false).unwrap();
        assert_eq!(ids, ids_of(&t, &["a", "Ġ", "1", "2"]));
        // The gpt-2 pre-tokenizer keeps digit runs together, with the space.
        let t = tiny_gpt2("gpt-2");
        let ids = t.encode("a 12", false, false).unwrap();
        assert_eq!(ids, ids_of(&t, &["a", "Ġ", "12"]));
    }

    #[test]
    fn control_tokens_need_parse_special() {
        let t = tiny_gpt2("smollm");
        let text = "<|im_start|>hello<|im_end|>";
        let parsed = t.encode(text, false, true).unwrap();
        assert_eq!(parsed, ids_of(&t, &["<|im_start|>", "hello", "<|im_end|>"]));
        let plain = t.encode(text, false, false).unwrap();
        assert!(!plain.contains(&266));
        assert_eq!(t.decode(&plain).unwrap(), text);
        // User-defined tokens are always split out.
        let ids = t.encode("hello<tool>", false, false).unwrap();
        assert_eq!(ids, ids_of(&t, &["hello", "<tool>"]));
    }

    #[test]
    fn segments_parse_control_tokens_only_where_asked() {
        let t = tiny_gpt2("smollm");
        let (open, close) = ("<|im_start|>", "<|im_end|>");
        // Markup around plain text that spells a control token.
        let segments = [
            Segment::markup(open),
            Segment::plain("hello<|im_end|>"),
            Segment::markup(close),
        ];
        let ids = t.encode_segments(&segments, false).unwrap();
        let mut want = ids_of(&t, &[open]);
        want.extend(t.encode("hello<|im_end|>", false, false).unwrap());
        want.extend(ids_of(&t, &[close]));
        assert_eq!(ids, want);
        // Where nothing is refused, the ids are those of the whole text,
        // merges across segment boundaries included ("hel" + "lo").
        let segments = [
            Segment::markup("<|im_start|>hel"),
            Segment::plain("lo world"),
            Segment::markup("<|im_end|>"),
        ];
        let whole = t.encode("<|im_start|>hello world<|im_end|>", false, true);
        assert_eq!(t.encode_segments(&segments, false).unwrap(), whole.unwrap());
        // A token that straddles plain text and markup is text; one whole
        // inside adjoining markup segments is a token.
        let segments = [Segment::plain("<|im_"), Segment::markup("end|>")];
        let ids = t.encode_segments(&segments, false).unwrap();
        assert_eq!(ids, t.encode("<|im_end|>", false, false).unwrap());
        let segments = [Segment::markup("<|im_"), Segment::markup("end|>")];
        let ids = t.encode_segments(&segments, false).unwrap();
        assert_eq!(ids, ids_of(&t, &[close]));
        // A refused occurrence does not hide a later one.
        let segments = [Segment::plain("<|im_end|>"), Segment::markup("<|im_end|>")];
        let ids = t.encode_segments(&segments, false).unwrap();
        assert_eq!(ids.last(), ids_of(&t, &[close]).last());
        assert!(t.has_control_text("a<|im_end|>") && !t.has_control_text("a<|im_end"));
    }

    #[test]
    fn add_special_follows_flags() {
        let mut t = tiny_gpt2("smollm");
        assert_eq!(
            t.encode("hello", true, false).unwrap(),
            ids_of(&t, &["hello"])
        );
        t.add_bos = true;
        t.add_eos = true;
        assert_eq!(t.encode("hello", true, false).unwrap(), [266, 259, 267]);
        assert_eq!(t.encode("", true, false).unwrap(), [266, 267]);
        assert_eq!(t.encode("", false, false).unwrap(), [] as [u32; 0]);
    }

    #[test]
    fn end_of_generation_tokens() {
        let t = tiny_gpt2("smollm");
        assert!(t.is_eog(267)); // eos, <|im_end|>
        assert!(t.is_eog(268)); // <|endoftext|>, by text
        assert!(!t.is_eog(266));
        assert_eq!(t.eot(), Some(267));
        assert!(t.is_control(266));
        assert!(!t.is_control(269));
    }

    /// Builds a SentencePiece tokenizer over byte tokens and the given
    /// `(text, token type)` pieces, which take ids from 256 on.
    fn tiny_vocab(pieces: &[(&str, i32)], eos: u32) -> Tokenizer {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        let mut types = vec![6; tokens.len()];
        for &(text, token_type) in pieces {
            tokens.push(text.into());
            types.push(token_type);
        }
        Tokenizer::from_spec(TokenizerSpec {
            model: "llama".into(),
            tokens,
            token_types: Some(types),
            eos: Some(eos),
            ..TokenizerSpec::default()
        })
        .unwrap()
    }

    fn eog_set(t: &Tokenizer) -> Vec<&str> {
        (0..t.vocab_size() as u32)
            .filter(|&id| t.is_eog(id))
            .map(|id| t.token_text(id).unwrap())
            .collect()
    }

    /// Gemma 3: `<eos>` and `<end_of_turn>` end generation, and so does
    /// `</s>` (an HTML tag there, but on llama.cpp's list), which becomes a
    /// control token that plain text cannot name.
    #[test]
    fn end_of_generation_gemma_style() {
        let t = tiny_vocab(
            &[
                ("<pad>", 3),
                ("<eos>", 3),
                ("<bos>", 3),
                ("<start_of_turn>", 3),
                ("<end_of_turn>", 3),
                ("<s>", 4),
                ("</s>", 4),
            ],
            257,
        );
        assert_eq!(eog_set(&t), ["<eos>", "<end_of_turn>", "</s>"]);
        assert_eq!(t.eot(), t.token_id("<end_of_turn>"));
        let s = t.token_id("<s>").unwrap();
        let end_s = t.token_id("</s>").unwrap();
        assert!(t.is_control(end_s) && !t.is_control(s));
        assert_eq!(t.encode("<s></s>", false, true).unwrap(), [s, end_s]);
        assert_eq!(t.encode("<s></s>", false, false).unwrap()[0], s);
        assert_eq!(t.encode("<s></s>", false, false).unwrap().len(), 5);
    }

    /// Qwen2.5: `<|im_end|>` (EOS and EOT), `<|endoftext|>`, the
    /// fill-in-the-middle padding, repository and separator tokens, and a
    /// normal `</s>`; the other fill-in-the-middle tokens become control
    /// tokens without ending generation.
    #[test]
    fn end_of_generation_qwen_style() {
        let t = tiny_vocab(
            &[
                ("</s>", 1),
                ("<|endoftext|>", 3),
                ("<|im_start|>", 3),
                ("<|im_end|>", 3),
                ("<|fim_prefix|>", 1),
                ("<|fim_pad|>", 3),
                ("<|repo_name|>", 3),
                ("<|file_sep|>", 3),
                ("<tool_call>", 4),
            ],
            259,
        );
        assert_eq!(
            eog_set(&t),
            [
                "</s>",
                "<|endoftext|>",
                "<|im_end|>",
                "<|fim_pad|>",
                "<|repo_name|>",
                "<|file_sep|>"
            ]
        );
        // The most specific end-of-turn text wins over a lower id.
        assert_eq!(t.eot(), t.token_id("<|im_end|>"));
        assert!(t.is_control(t.token_id("<|fim_prefix|>").unwrap()));
        assert!(!t.is_control(t.token_id("<tool_call>").unwrap()));
    }

    /// Models with their own end markers keep `</s>` as text; in the
    /// harmony format `<|end|>` ends a message, not the response.
    #[test]
    fn end_of_generation_exceptions() {
        let t = tiny_vocab(&[("<eos>", 3), ("<|tool_response>", 3), ("</s>", 1)], 256);
        assert_eq!(eog_set(&t), ["<eos>", "<|tool_response>"]);
        assert!(!t.is_control(t.token_id("</s>").unwrap()));

        let t = tiny_vocab(&[("<|return|>", 3), ("<|call|>", 3), ("<|end|>", 3)], 256);
        assert_eq!(eog_set(&t), ["<|return|>", "<|call|>"]);
        assert!(!t.is_control(t.token_id("<|end|>").unwrap()));
    }

    #[test]
    fn unknown_pre_tokenizer_is_an_error() {
        let spec = TokenizerSpec {
            model: "gpt2".into(),
            pre: Some("martian".into()),
            tokens: byte_vocab(),
            ..TokenizerSpec::default()
        };
        let err = Tokenizer::from_spec(spec).unwrap_err();
        assert!(matches!(err, TokenizerError::UnsupportedPreTokenizer(p) if p == "martian"));
    }

    #[test]
    fn spec_errors_name_the_problem() {
        let mut tokens = byte_vocab();
        tokens.push("a".into());
        let spec = TokenizerSpec {
            model: "gpt2".into(),
            tokens,
            ..TokenizerSpec::default()
        };
        assert!(matches!(
            Tokenizer::from_spec(spec).unwrap_err(),
            TokenizerError::DuplicateToken {
                first: 97,
                second: 256,
                ..
            }
        ));

        let spec = TokenizerSpec {
            model: "gpt2".into(),
            tokens: byte_vocab(),
            add_bos: true,
            ..TokenizerSpec::default()
        };
        assert!(matches!(
            Tokenizer::from_spec(spec).unwrap_err(),
            TokenizerError::MissingSpecial { which: "bos" }
        ));

        let spec = TokenizerSpec {
            model: "gpt2".into(),
            tokens: byte_vocab(),
            eos: Some(999),
            ..TokenizerSpec::default()
        };
        assert!(matches!(
            Tokenizer::from_spec(spec).unwrap_err(),
            TokenizerError::SpecialOutOfRange {
                which: "eos",
                id: 999,
                ..
            }
        ));

        let spec = TokenizerSpec {
            model: "gpt2".into(),
            tokens: byte_vocab(),
            merges: vec!["nospace".into()],
            ..TokenizerSpec::default()
        };
        assert!(matches!(
            Tokenizer::from_spec(spec).unwrap_err(),
            TokenizerError::BadMerge { index: 0, .. }
        ));

        let spec = TokenizerSpec {
            model: "bert".into(),
            tokens: byte_vocab(),
            ..TokenizerSpec::default()
        };
        assert!(matches!(
            Tokenizer::from_spec(spec).unwrap_err(),
            TokenizerError::UnsupportedModel(_)
        ));
    }

    #[test]
    fn gpt2_decoding_cleans_spaces_before_punctuation() {
        let t = tiny_gpt2("gpt-2");
        let ids = t
            .encode("Hi , there . It 's ok ' he said", false, false)
            .unwrap();
        assert_eq!(t.decode(&ids).unwrap(), "Hi, there. It's ok'he said");
        // smollm does not clean up.
        let t = tiny_gpt2("smollm");
        let ids = t.encode("Hi , there .", false, false).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), "Hi , there .");
    }

    #[test]
    fn stream_decoder_holds_back_partial_characters() {
        let t = tiny_gpt2("smollm");
        let ids = t.encode("é🎉!", false, false).unwrap();
        // Byte vocabulary: one token per byte.
        assert_eq!(ids.len(), 2 + 4 + 1);
        let mut stream = t.stream_decoder();
        let pieces: Vec<String> = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
        assert_eq!(pieces, ["", "é", "", "", "", "🎉", "!"]);
        assert_eq!(stream.finish(), "");

        let mut stream = t.stream_decoder();
        assert_eq!(stream.push(0xff).unwrap(), "\u{fffd}");
        assert_eq!(stream.push(0xe4).unwrap(), "");
        assert_eq!(stream.finish(), "\u{fffd}");
    }

    #[test]
    fn out_of_range_ids_are_errors() {
        let t = tiny_gpt2("smollm");
        assert!(matches!(
            t.decode(&[5, 100_000]).unwrap_err(),
            TokenizerError::TokenOutOfRange { id: 100_000, .. }
        ));
        assert!(t.token_bytes(100_000).is_err());
    }

    /// Pre-tokenizers split as llama.cpp's regexes do.
    #[test]
    fn pre_tokenizer_variants() {
        // With only bytes in the vocabulary, each pre-token becomes its bytes,
        // so split points show up as a missing merge: use merges to observe.
        let split = |pre: &str, text: &str| -> Vec<String> {
            let spec = PreTokenizerSpec::named(Some(pre)).unwrap();
            let token_ids: HashMap<String, u32> =
                (0u32..).zip(byte_vocab()).map(|(i, t)| (t, i)).collect();
            let tokenizer = byte_level_tokenizer(&token_ids, &[], &spec).unwrap();
            let mut pre_tokenized = tokenizers::PreTokenizedString::from(text);
            use tokenizers::PreTokenizer;
            tokenizer
                .get_pre_tokenizer()
                .unwrap()
                .pre_tokenize(&mut pre_tokenized)
                .unwrap();
            pre_tokenized
                .get_splits(
                    tokenizers::OffsetReferential::Original,
                    tokenizers::OffsetType::Byte,
                )
                .into_iter()
                .map(|(s, _, _)| String::from_utf8(decode_byte_symbols(s)).unwrap())
                .collect()
        };
        let text = "Hello world's 12345 don't\n\n  x  ";
        assert_eq!(
            split("smollm", text),
            [
                "Hello", " world", "'s", " ", "1", "2", "3", "4", "5", " don", "'t", "\n\n ", " x",
                "  "
            ]
        );
        assert_eq!(
            split("gpt-2", text),
            ["Hello", " world", "'s", " 12345", " don", "'t", "\n\n ", " x", "  "]
        );
        assert_eq!(
            split("llama-bpe", "Hello WORLD'S 12345\n\n  x"),
            ["Hello", " WORLD", "'S", " ", "123", "45", "\n\n", " ", " x"]
        );
        assert_eq!(
            split("qwen2", "Hello 12345 ?!\n"),
            ["Hello", " ", "1", "2", "3", "4", "5", " ?!\n"]
        );
        assert_eq!(
            split("default", "a+b 1234"),
            ["a", "+", "b", " ", "123", "4"]
        );
    }

    /// A SentencePiece vocabulary: unk, bos, eos, the 256 byte tokens, then
    /// pieces whose scores make the merge order unambiguous.
    fn tiny_llama(add_space_prefix: bool) -> Tokenizer {
        let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
        let mut types = vec![2, 3, 3];
        let mut scores = vec![0.0, 0.0, 0.0];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        let pieces = [
            ("▁", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("w", -2.0),
            ("▁h", -3.0),
            ("ll", -4.0),
            ("llo", -5.0),
            ("▁he", -6.0),
            ("▁hello", -7.0),
            ("ello", -8.0),
            ("▁w", -9.0),
        ];
        for (piece, score) in pieces {
            tokens.push(piece.into());
            types.push(1);
            scores.push(score);
        }
        Tokenizer::from_spec(TokenizerSpec {
            model: "llama".into(),
            tokens,
            scores: Some(scores),
            token_types: Some(types),
            bos: Some(1),
            eos: Some(2),
            unk: Some(0),
            add_bos: true,
            add_space_prefix,
            ..TokenizerSpec::default()
        })
        .unwrap()
    }

    #[test]
    fn sentencepiece_merges_by_score() {
        let t = tiny_llama(true);
        // ▁ h e l l o: best merges are ▁h (-3), then ll (-4), llo (-5),
        // ▁he (-6), ▁hello (-7).
        let ids = t.encode("hello", true, false).unwrap();
        assert_eq!(ids, [1, t.token_id("▁hello").unwrap()]);
        assert_eq!(t.decode(&ids).unwrap(), "<s> hello");
        assert_eq!(t.decode(&ids[1..]).unwrap(), "hello");
    }

    #[test]
    fn sentencepiece_byte_fallback_and_spaces() {
        let t = tiny_llama(true);
        let ids = t.encode("hello w€", false, false).unwrap();
        let byte = |b: u8| 3 + u32::from(b);
        assert_eq!(
            ids,
            [
                t.token_id("▁hello").unwrap(),
                t.token_id("▁w").unwrap(),
                byte(0xe2),
                byte(0x82),
                byte(0xac)
            ]
        );
        assert_eq!(t.decode(&ids).unwrap(), "hello w€");

        // Text after a special token gets its own space prefix.
        let ids = t.encode("<s>hello", false, true).unwrap();
        assert_eq!(ids, [1, t.token_id("▁hello").unwrap()]);
        // Without the prefix, "hello" starts with a bare h.
        let t = tiny_llama(false);
        let ids = t.encode("hello", false, false).unwrap();
        assert_eq!(ids, ids_of(&t, &["h", "ello"]));
    }

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

    /// Token ids for SmolLM2-135M-Instruct (`gpt2` vocabulary, `smollm`
    /// pre-tokenizer), as llama.cpp itself produces them: taken from
    /// `llama_tokenize(add_special = false)` in llama-cpp-python 0.3.36 with
    /// the model loaded vocab-only, and matched independently by a pure-Python
    /// port of llama.cpp's splitter and BPE and by the `tokenizers` Python
    /// package configured as SmolLM2's Hugging Face tokenizer.
    const SMOLLM2_IDS: &[(&str, bool, &[u32])] = &[
        ("Hello world", false, &[19556, 905]),
        (
            "Hello, world! How are you today?",
            false,
            &[19556, 28, 905, 17, 1073, 359, 346, 1834, 47],
        ),
        ("12345", false, &[33, 34, 35, 36, 37]),
        (
            "3.14159 and 1,000,000",
            false,
            &[
                35, 30, 33, 36, 33, 37, 41, 284, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32,
            ],
        ),
        (
            "don't I'm we'll they're it's DON'T You'VE",
            false,
            &[
                12420, 982, 339, 5248, 392, 3060, 502, 2316, 357, 506, 422, 2154, 23, 68, 1206, 23,
                18525,
            ],
        ),
        (
            "héllo 世界 🎉",
            false,
            &[
                88, 2756, 31394, 216, 7906, 240, 178, 239, 230, 15107, 232, 227,
            ],
        ),
        ("multiple   spaces", false, &[30404, 256, 5600]),
        ("   leading spaces", false, &[256, 2899, 5600]),
        ("trailing spaces   ", false, &[4861, 4966, 5600, 333]),
        (
            "\n\n\ndouble newline",
            false,
            &[1116, 198, 21414, 725, 1311],
        ),
        (
            "def f(x):\n    return x**2  # square\n",
            false,
            &[
                1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5222, 198,
            ],
        ),
        (
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
            true,
            &[1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198],
        ),
        (
            "<|im_start|>user\nHi<|im_end|>",
            false,
            &[
                44, 108, 306, 79, 3738, 108, 46, 4093, 198, 26843, 44, 108, 306, 79, 486, 108, 46,
            ],
        ),
        (
            "<reponame>x<file_sep>y<|endoftext|>",
            true,
            &[4, 104, 5, 105, 0],
        ),
        (
            "Привет мир",
            false,
            &[155, 249, 46879, 16464, 32547, 41337, 7872, 9175],
        ),
        (
            "abc123def x1y22z333",
            false,
            &[
                25276, 33, 34, 35, 1604, 1792, 33, 105, 34, 34, 106, 35, 35, 35,
            ],
        ),
        (
            "ideographic\u{3000}space and em\u{2003}space",
            false,
            &[489, 4551, 12109, 218, 11602, 284, 649, 321, 221, 11602],
        ),
        ("", false, &[]),
    ];

    /// Checks the tokenizer and chat template of SmolLM2-135M-Instruct when
    /// `ENCORE_TEST_MODEL` names its GGUF file.
    #[test]
    fn real_model_smollm2() {
        let Some(path) = std::env::var_os("ENCORE_TEST_MODEL") else {
            eprintln!("skipped: set ENCORE_TEST_MODEL to SmolLM2-135M-Instruct.Q4_1.gguf to run");
            return;
        };
        let file = GgufFile::open(&path).unwrap();
        let spec = TokenizerSpec::from_gguf(&file).unwrap();
        assert_eq!(spec.model, "gpt2");
        assert_eq!(spec.pre.as_deref(), Some("smollm"));
        assert!(!spec.add_bos && !spec.add_eos && !spec.add_space_prefix);
        let t = Tokenizer::from_spec(spec).unwrap();
        assert_eq!(t.vocab_size(), 49152);
        assert_eq!(
            (t.bos(), t.eos(), t.unk(), t.pad()),
            (Some(1), Some(2), Some(0), Some(2))
        );
        // llama.cpp's end-of-generation set for this model: <|endoftext|>,
        // <|im_end|>, and <reponame> (a fill-in-the-middle repository token).
        let eog: Vec<u32> = (0..49152).filter(|&id| t.is_eog(id)).collect();
        assert_eq!(eog, [0, 2, 4]);

        for &(text, parse_special, expected) in SMOLLM2_IDS {
            let ids = t.encode(text, false, parse_special).unwrap();
            assert_eq!(ids, expected, "encoding {text:?}");
            assert_eq!(t.decode(&ids).unwrap(), text);
            // add_bos and add_eos are off for SmolLM2.
            assert_eq!(t.encode(text, true, parse_special).unwrap(), expected);
        }

        let round_trips = [
            "tab\tseparated\tvalues",
            " \n \n ",
            "fn main() { println!(\"hi {}\", 1 + 2); }",
            "Ünïcödé naïve café 日本語のテキスト مرحبا بالعالم",
            "👍🏽👨\u{200d}👩\u{200d}👧 emoji, non\u{a0}breaking, zero\u{200b}width",
            "!!!???... --- a--b (parens) [brackets] {braces} ’curly’ “quotes”",
            "https://example.com/path?q=1&r=2#frag ÿþý \r\n windows\r\nline",
            "∑∫√∞≠≈ math ± symbols \u{1}\u{7f}",
        ];
        for text in round_trips {
            let ids = t.encode(text, false, false).unwrap();
            assert_eq!(t.decode(&ids).unwrap(), text);
            let mut stream = t.stream_decoder();
            let streamed: String = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
            assert_eq!(streamed + &stream.finish(), text);
        }

        // The model's own chat template, rendered and encoded as a prompt;
        // ids from llama.cpp tokenizing the same text with special tokens parsed.
        let template = crate::chat::ChatTemplate::for_model(t.chat_template()).unwrap();
        let messages = [crate::chat::Message::new("user", "What is 2+2?")];
        let prompt = template
            .render(&messages, true, "<|im_start|>", "<|im_end|>")
            .unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.encode(&prompt, true, true).unwrap(),
            [
                1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
                411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2,
                198, 1, 520, 9531, 198
            ]
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn byte_level_round_trips(text in "\\PC{0,40}|[ \\n\\t0-9a-z'.,!?]{0,40}") {
                let t = tiny_gpt2("smollm");
                let ids = t.encode(&text, false, false).unwrap();
                prop_assert_eq!(t.decode(&ids).unwrap(), text);
            }

            #[test]
            fn sentencepiece_round_trips(text in "\\PC{0,40}") {
                // `▁` in the input is the space symbol, so it decodes to a space.
                prop_assume!(!text.contains('▁'));
                let t = tiny_llama(true);
                let ids = t.encode(&text, false, false).unwrap();
                prop_assert_eq!(t.decode(&ids).unwrap(), text);
            }
        }
    }
}
