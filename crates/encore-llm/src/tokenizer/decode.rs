//! Token ids back to bytes and text: the bytes each token stands for,
//! whole-sequence decoding as llama.cpp's `llama_detokenize` does it, and
//! [`StreamDecoder`] for tokens that arrive one at a time.
//!
//! A token can hold part of a UTF-8 character, so text is only ever made
//! from bytes here, in one place for both vocabulary kinds.

use super::byte_level::decode_byte_symbols;
use super::special::attr;
use super::{TextModel, Tokenizer, TokenizerError};

impl Tokenizer {
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
}

/// The bytes a token decodes to, as llama.cpp's `token_to_piece` with
/// special tokens rendered: control, unknown and user-defined tokens give
/// their text, normal tokens their decoded text, byte tokens their byte,
/// unused and undefined tokens nothing.
pub(super) fn token_piece(text: &str, a: u8, model: &TextModel) -> Vec<u8> {
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

#[cfg(test)]
mod tests {
    use crate::tokenizer::tests::tiny_gpt2;
    use crate::tokenizer::TokenizerError;

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
}
