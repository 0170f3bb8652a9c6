//! SentencePiece BPE, the `llama` vocabulary kind (Llama 2, Mistral v0.1,
//! Gemma 3): pairs of symbols merge by the score of the merged piece,
//! highest first, and pieces outside the vocabulary fall back to `<0xXX>`
//! byte tokens.
//!
//! The merge order comes from scores, not ranks, which the `tokenizers`
//! crate's BPE cannot express, so the algorithm is written here directly,
//! as llama.cpp's `llm_tokenizer_spm` does it.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::Tokenizer;

impl Tokenizer {
    /// SentencePiece BPE over one run of text (spaces already `▁`): start
    /// from characters, repeatedly merge the adjacent pair whose
    /// concatenation is the highest-scoring token (leftmost on ties), then
    /// emit each piece, or its bytes as `<0xXX>` tokens if it is not a token.
    pub(super) fn encode_sentencepiece(&self, text: &str, scores: &[f32], ids: &mut Vec<u32>) {
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

#[cfg(test)]
mod tests {
    use crate::tokenizer::tests::{ids_of, tiny_llama};

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
}
