//! How a `gpt2` vocabulary splits text into words before merging: the
//! regexes llama.cpp uses for each pre-tokenizer name (`tokenizer.ggml.pre`)
//! and the flags it ties to that name.
//!
//! A model's pre-tokenizer decides where no merge may cross (SmolLM2 splits
//! every digit, Llama 3 groups digits by three), so it is kept as a table
//! of its own, one row a family of names, that a new model extends.

use super::TokenizerError;

const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `gpt2` vocabulary splits text into words, and the flags llama.cpp
/// ties to the pre-tokenizer name.
pub(super) struct PreTokenizerSpec {
    /// Applied in order; matches and the text between them both become words.
    pub(super) regexes: &'static [&'static str],
    /// A word that is itself a token is emitted whole, without merging.
    pub(super) ignore_merges: bool,
    /// `add_bos` when the GGUF file does not say.
    pub(super) add_bos: bool,
    /// Decoding removes spaces before punctuation (`clean_up_tokenization_spaces`).
    pub(super) clean_spaces: bool,
}

impl PreTokenizerSpec {
    pub(super) fn named(pre: Option<&str>) -> Result<PreTokenizerSpec, TokenizerError> {
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::tokenizer::byte_level::{byte_level_tokenizer, decode_byte_symbols};
    use crate::tokenizer::tests::{byte_vocab, ids_of, tiny_gpt2};
    use crate::tokenizer::{Tokenizer, TokenizerSpec};

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
}
