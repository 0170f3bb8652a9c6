//! [`Stepper`]: the rules that end a generation and turn its tokens into
//! text, written once for every way of generating ([`crate::Engine::generate`],
//! `encore chat` and the [`crate::Scheduler`]).
//!
//! The caller runs the model and samples; it hands each sampled token to
//! [`Stepper::push`], passes on the text that comes back, and stops when the
//! [`Step`] says why. Text comes back only once it is final: the bytes of a
//! UTF-8 character wait for the rest of the character, and text that may
//! still turn out to begin a stop string waits until it is clear either way,
//! so nothing sent ever has to be taken back.
//!
//! ```
//! use encore_llm::stepper::{Stepper, StopReason};
//! use encore_llm::tokenizer::{Tokenizer, TokenizerSpec};
//!
//! // A vocabulary of the 256 bytes, `<0x00>` to `<0xFF>`: token id = byte.
//! let tokenizer = Tokenizer::from_spec(TokenizerSpec {
//!     model: "llama".into(),
//!     tokens: (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect(),
//!     token_types: Some(vec![6; 256]),
//!     ..TokenizerSpec::default()
//! })?;
//! let mut stepper = Stepper::new(&tokenizer, 16).with_stop_strings(["!!".to_string()]);
//! let mut text = String::new();
//! for &byte in b"Hi! Bye!!" {
//!     let step = stepper.push(u32::from(byte))?;
//!     text.push_str(&step.text);
//!     if let Some(reason) = step.stop {
//!         assert_eq!(reason, StopReason::StopString);
//!         break;
//!     }
//! }
//! text.push_str(&stepper.finish());
//! assert_eq!(text, "Hi! Bye");
//! # Ok::<(), encore_llm::LlmError>(())
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The most tokens allowed were generated (the token limit, or the room
    /// left in the context).
    Length,
    /// The model produced an end-of-generation token.
    StopToken,
    /// The text reached one of the stop strings.
    StopString,
    /// The generation was cancelled.
    Cancelled,
}

/// What one sampled token did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Whether the token is part of the generation. It is not when the
    /// generation had ended before it: an end-of-generation token, a
    /// cancellation, the token limit.
    pub taken: bool,
    /// Text that is now final, to pass on (often empty: part of a
    /// character, or the possible start of a stop string).
    pub text: String,
    /// Why the generation ended, when it ended with this token.
    pub stop: Option<StopReason>,
}

/// Takes the sampled tokens of one generation one at a time: it counts them
/// against the token limit, ends the generation at an end-of-generation
/// token, a stop string or a cancellation, and turns the tokens into text.
#[derive(Debug)]
pub struct Stepper<'t> {
    tokenizer: &'t Tokenizer,
    decoder: StreamDecoder<'t>,
    max_tokens: usize,
    /// The non-empty stop strings.
    stop_strings: Vec<String>,
    stop_at_eog: bool,
    cancel: Arc<AtomicBool>,
    /// Decoded text not yet given out: a possible start of a stop string.
    held: String,
    taken: usize,
    stopped: Option<StopReason>,
    /// The stop string that ended the text, once one has.
    matched: Option<String>,
}

impl<'t> Stepper<'t> {
    /// A stepper for up to `max_tokens` tokens that ends at the tokenizer's
    /// end-of-generation tokens, with no stop strings and a cancellation
    /// flag of its own.
    pub fn new(tokenizer: &'t Tokenizer, max_tokens: usize) -> Stepper<'t> {
        Stepper {
            tokenizer,
            decoder: tokenizer.stream_decoder(),
            max_tokens,
            stop_strings: Vec::new(),
            stop_at_eog: true,
            cancel: Arc::default(),
            held: String::new(),
            taken: 0,
            stopped: None,
            matched: None,
        }
    }

    /// Ends the generation where one of `stop` appears in its text; the
    /// stop string and what follows it are not given out. Empty strings are
    /// ignored.
    pub fn with_stop_strings(mut self, stop: impl IntoIterator<Item = String>) -> Stepper<'t> {
        self.stop_strings = stop.into_iter().filter(|s| !s.is_empty()).collect();
        self
    }

    /// Goes on past end-of-generation tokens, taking them like any other
    /// (for benchmarks that want a fixed number of tokens).
    pub fn ignoring_eog(mut self, ignore: bool) -> Stepper<'t> {
        self.stop_at_eog = !ignore;
        self
    }

    /// Cancels the generation when `flag` is set (by anyone, at any time):
    /// the next token pushed is refused with [`StopReason::Cancelled`].
    pub fn with_cancel(mut self, flag: Arc<AtomicBool>) -> Stepper<'t> {
        self.cancel = flag;
        self
    }

    /// Takes the next sampled token: whether it ends the generation, and
    /// the text that is now final. A token that comes after the end is
    /// refused with the same reason and no text. An id outside the
    /// vocabulary is an error, and the stepper is as it was.
    pub fn push(&mut self, token: u32) -> Result<Step, TokenizerError> {
        if let Some(reason) = self.stopped {
            return Ok(Step::refused(reason));
        }
        let refused = if self.taken >= self.max_tokens {
            Some(StopReason::Length)
        } else if self.cancel.load(Ordering::Relaxed) {
            Some(StopReason::Cancelled)
        } else if self.stop_at_eog && self.tokenizer.is_eog(token) {
            Some(StopReason::StopToken)
        } else {
            None
        };
        if let Some(reason) = refused {
            self.stopped = Some(reason);
            return Ok(Step::refused(reason));
        }
        let piece = self.decoder.push(token)?;
        self.taken += 1;
        let (text, stop_string) = self.release(&piece);
        let stop = if stop_string {
            Some(StopReason::StopString)
        } else if self.taken >= self.max_tokens {
            Some(StopReason::Length)
        } else {
            None
        };
        self.stopped = stop;
        Ok(Step {
            taken: true,
            text,
            stop,
        })
    }

    /// Ends the generation now, as cancelled unless it had already ended,
    /// and sets the cancellation flag. Returns why it ended.
    pub fn cancel(&mut self) -> StopReason {
        self.cancel.store(true, Ordering::Relaxed);
        *self.stopped.get_or_insert(StopReason::Cancelled)
    }

    /// Whether the cancellation flag is set.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    /// Tokens taken so far.
    pub fn tokens(&self) -> usize {
        self.taken
    }

    /// Tokens that may still be taken before the limit.
    pub fn remaining(&self) -> usize {
        self.max_tokens.saturating_sub(self.taken)
    }

    /// Why the generation ended, once it has.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stopped
    }

    /// The stop string that ended the generation, when one did (the one
    /// that appeared first in the text).
    pub fn stop_string(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// The text still held back, for the end of the generation: what might
    /// have begun a stop string, then the bytes of an unfinished character
    /// as U+FFFD. Nothing after a stop string.
    pub fn finish(self) -> String {
        if self.stopped == Some(StopReason::StopString) {
            return String::new();
        }
        let mut rest = self.held;
        rest.push_str(&self.decoder.finish());
        rest
    }

    /// Adds `piece` to the held text and gives out what can no longer be
    /// part of a stop string; says whether a stop string appeared (then the
    /// text before it is given out and the rest dropped).
    fn release(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        let held = &self.held;
        if let Some((at, stop)) = self
            .stop_strings
            .iter()
            .filter_map(|s| held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at)
        {
            self.matched = Some(stop.clone());
            self.held.truncate(at);
            return (std::mem::take(&mut self.held), true);
        }
        // Hold back the longest tail that begins some stop string.
        let cut = held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stop_strings.iter().any(|s| s.starts_with(&held[i..])))
            .unwrap_or(held.len());
        (self.held.drain(..cut).collect(), false)
    }
}

impl Step {
    fn refused(reason: StopReason) -> Step {
        Step {
            taken: false,
            text: String::new(),
            stop: Some(reason),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::tokenizer::TokenizerSpec;

    /// Token ids 0 to 255 are the bytes; then `▁hello`, a user-defined
    /// `<tool>`, and the control token `<|im_end|>` (id 258), the
    /// end-of-sequence token.
    fn tokenizer() -> Tokenizer {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        let mut types = vec![6; tokens.len()];
        for (text, kind) in [("▁hello", 1), ("<tool>", 4), ("<|im_end|>", 3)] {
            tokens.push(text.into());
            types.push(kind);
        }
        Tokenizer::from_spec(TokenizerSpec {
            model: "llama".into(),
            tokens,
            token_types: Some(types),
            eos: Some(EOS),
            ..TokenizerSpec::default()
        })
        .unwrap()
    }

    const HELLO: u32 = 256;
    const EOS: u32 = 258;

    fn bytes(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Pushes `tokens` until the stepper says stop: the text of each token
    /// pushed, and the reason.
    fn run(stepper: &mut Stepper<'_>, tokens: &[u32]) -> (Vec<String>, Option<StopReason>) {
        let mut texts = Vec::new();
        for &t in tokens {
            let step = stepper.push(t).unwrap();
            texts.push(step.text);
            if step.stop.is_some() {
                return (texts, step.stop);
            }
        }
        (texts, None)
    }

    #[test]
    fn a_stop_string_split_across_tokens_is_held_back_and_cut() {
        let t = tokenizer();
        let mut s = Stepper::new(&t, 100).with_stop_strings(["END".into(), String::new()]);
        let (texts, stop) = run(&mut s, &bytes("aEN!xENDzz"));
        // "EN" waits; "!" shows it was not "END"; the second "EN" waits and
        // "D" completes the stop string, which is never given out.
        assert_eq!(texts, ["a", "", "", "EN!", "x", "", "", ""]);
        assert_eq!(stop, Some(StopReason::StopString));
        assert_eq!(s.stop_string(), Some("END"));
        assert_eq!(s.tokens(), 8);
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn a_stop_string_inside_one_token_cuts_that_token() {
        let t = tokenizer();
        let mut s = Stepper::new(&t, 100).with_stop_strings(["llo".into(), "lo w".into()]);
        let step = s.push(HELLO).unwrap();
        assert_eq!(step.text, " he");
        assert_eq!(step.stop, Some(StopReason::StopString));
        assert_eq!(s.stop_string(), Some("llo"));
        assert!(step.taken);
        // Nothing is taken after the end.
        let after = s.push(u32::from(b'a')).unwrap();
        assert_eq!((after.taken, after.text.as_str()), (false, ""));
        assert_eq!(after.stop, Some(StopReason::StopString));
        // Of two stop strings in the text, the first to appear ends it.
        let mut s = Stepper::new(&t, 100).with_stop_strings(["lo".into(), "ell".into()]);
        assert_eq!(s.push(HELLO).unwrap().text, " h");
        assert_eq!(s.stop_string(), Some("ell"));
    }

    #[test]
    fn a_possible_stop_string_is_given_out_at_the_end() {
        let t = tokenizer();
        let mut s = Stepper::new(&t, 3).with_stop_strings(["abc!".into()]);
        let (texts, stop) = run(&mut s, &bytes("xab"));
        assert_eq!(texts, ["x", "", ""]);
        assert_eq!(stop, Some(StopReason::Length));
        assert_eq!(s.finish(), "ab");
    }

    #[test]
    fn multi_byte_characters_split_across_tokens_come_out_whole() {
        let t = tokenizer();
        let mut s = Stepper::new(&t, 100).with_stop_strings(["é!".into()]);
        // "é" is C3 A9 and "🎉" F0 9F 8E 89, a token a byte.
        let (texts, stop) = run(&mut s, &bytes("é🎉é?é!"));
        assert_eq!(texts, ["", "", "", "", "", "é🎉", "", "", "é?", "", "", ""]);
        assert_eq!(stop, Some(StopReason::StopString));
        // An unfinished character at the end comes out as U+FFFD.
        let mut s = Stepper::new(&t, 2);
        let (texts, stop) = run(&mut s, &[u32::from(b'a'), 0xE2]);
        assert_eq!(
            (texts, stop),
            (vec!["a".into(), String::new()], Some(StopReason::Length))
        );
        assert_eq!(s.finish(), "\u{fffd}");
    }

    #[test]
    fn an_end_of_generation_token_is_refused_unless_ignored() {
        let t = tokenizer();
        let mut s = Stepper::new(&t, 100);
        assert!(s.push(HELLO).unwrap().stop.is_none());
        let step = s.push(EOS).unwrap();
        assert_eq!(step, Step::refused(StopReason::StopToken));
        assert_eq!(s.tokens(), 1);
        assert_eq!(s.stop_reason(), Some(StopReason::StopToken));
        assert_eq!(s.finish(), "");

        let mut s = Stepper::new(&t, 100).ignoring_eog(true);
        let step = s.push(EOS).unwrap();
        assert!(step.taken && step.stop.is_none());
        assert_eq!(step.text, "<|im_end|>");
    }

    #[test]
    fn the_limit_ends_with_the_last_allowed_token() {
        let t = tokenizer();
        let mut s = Stepper::new(&t, 3);
        let (texts, stop) = run(&mut s, &bytes("abcdef"));
        assert_eq!(texts, ["a", "b", "c"]);
        assert_eq!(stop, Some(StopReason::Length));
        assert_eq!((s.tokens(), s.remaining()), (3, 0));
        // No room at all: the first token is refused, even one that would
        // end the generation otherwise.
        let mut s = Stepper::new(&t, 0);
        assert_eq!(s.push(EOS).unwrap(), Step::refused(StopReason::Length));
        assert_eq!(s.tokens(), 0);
    }

    #[test]
    fn cancellation_refuses_the_next_token() {
        let t = tokenizer();
        let flag = Arc::new(AtomicBool::new(false));
        let mut s = Stepper::new(&t, 100)
            .with_stop_strings(["zz".into()])
            .with_cancel(flag.clone());
        assert_eq!(s.push(u32::from(b'z')).unwrap().text, "");
        flag.store(true, Ordering::Relaxed);
        assert!(s.is_cancelled());
        assert_eq!(s.push(EOS).unwrap(), Step::refused(StopReason::Cancelled));
        assert_eq!(s.tokens(), 1);
        // The held text is still there for a caller that wants it.
        assert_eq!(s.finish(), "z");

        // `cancel` ends it at once and sets the flag; it does not change
        // the reason of a generation that had already ended.
        let flag = Arc::new(AtomicBool::new(false));
        let mut s = Stepper::new(&t, 100).with_cancel(flag.clone());
        assert_eq!(s.cancel(), StopReason::Cancelled);
        assert!(flag.load(Ordering::Relaxed));
        assert_eq!(
            s.push(u32::from(b'a')).unwrap(),
            Step::refused(StopReason::Cancelled)
        );
        let mut s = Stepper::new(&t, 1);
        assert_eq!(
            s.push(u32::from(b'a')).unwrap().stop,
            Some(StopReason::Length)
        );
        assert_eq!(s.cancel(), StopReason::Length);
    }

    #[test]
    fn a_token_outside_the_vocabulary_is_an_error_and_changes_nothing() {
        let t = tokenizer();
        let mut s = Stepper::new(&t, 2);
        assert_eq!(s.push(0xC3).unwrap().text, "");
        assert!(s.push(9999).is_err());
        assert_eq!((s.tokens(), s.stop_reason()), (1, None));
        assert_eq!(s.push(0xA9).unwrap().text, "é");
    }
}
