//! Special tokens: which tokens they are, which of them end generation,
//! and finding them in text before the text model runs.
//!
//! llama.cpp decides all three from token types and a list of token texts,
//! whatever the vocabulary kind, and splits special tokens out of the text
//! itself (longest first; control tokens only where special tokens are
//! parsed) rather than leaving them to the BPE or SentencePiece model. That
//! shared behaviour lives here once, for both kinds.

use std::collections::HashMap;
use std::ops::Range;

use super::Tokenizer;

/// llama.cpp's token attributes (`LLAMA_TOKEN_ATTR_*`), as bit flags: a
/// control-looking token can be both user-defined and control.
pub(super) mod attr {
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

/// The end-of-generation set and the end-of-turn token, found the way
/// llama.cpp finds them.
pub(super) struct EndOfGeneration {
    pub(super) eog: Vec<u32>,
    pub(super) eot: Option<u32>,
}

impl EndOfGeneration {
    /// Marks end-of-generation and fill-in-the-middle tokens as control
    /// tokens (so that text can only name them when special tokens are
    /// parsed) and collects the end-of-generation set: EOS, EOT (looked up
    /// by text when not given), the fill-in-the-middle
    /// padding/repository/separator tokens, and every token whose text is in
    /// [`EOG_TEXTS`]. Where several tokens match a fill-in-the-middle role,
    /// the lowest id wins.
    pub(super) fn find(
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

/// A run of input text, or a special token found in it.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

impl Tokenizer {
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
    pub(super) fn split_special(&self, text: &str, parsed: &[Range<usize>]) -> Vec<Fragment> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{ids_of, tiny_gpt2, tiny_vocab};
    use crate::tokenizer::Segment;

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
    fn end_of_generation_tokens() {
        let t = tiny_gpt2("smollm");
        assert!(t.is_eog(267)); // eos, <|im_end|>
        assert!(t.is_eog(268)); // <|endoftext|>, by text
        assert!(!t.is_eog(266));
        assert_eq!(t.eot(), Some(267));
        assert!(t.is_control(266));
        assert!(!t.is_control(269));
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
}
