//! Byte-level BPE, the `gpt2` vocabulary kind: GPT-2's byte alphabet, which
//! spells every byte as a printable character inside tokens, and the
//! `tokenizers` pipeline (regex splits, the alphabet, rank-ordered merges)
//! that encodes plain text.
//!
//! The merging itself is the `tokenizers` crate's; what lives here is how a
//! GGUF vocabulary and its merges are handed to it so that it agrees with
//! llama.cpp.

use std::collections::HashMap;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use super::pre_tokenizer::PreTokenizerSpec;
use super::TokenizerError;

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

/// Maps GPT-2 byte symbols back to bytes; a character outside the alphabet
/// stands for itself.
pub(super) fn decode_byte_symbols(text: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(text.len());
    for ch in text.chars() {
        match symbol_byte(ch) {
            Some(byte) => bytes.push(byte),
            None => bytes.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    bytes
}

/// Builds the `tokenizers` pipeline for a byte-level vocabulary: the
/// pre-tokenizer's regex splits, the byte alphabet, and BPE.
pub(super) fn byte_level_tokenizer(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{ids_of, tiny_gpt2};

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
    fn merges_apply_by_rank() {
        let t = tiny_gpt2("smollm");
        let ids = t.encode("hello world", false, false).unwrap();
        assert_eq!(ids, ids_of(&t, &["hello", "Ġworld"]));
        assert_eq!(t.decode(&ids).unwrap(), "hello world");
    }
}
