//! Speculative decoding by prompt lookup: a sequence's next tokens are
//! guessed by finding its last few tokens earlier in the sequence (prompt
//! and generated text) and proposing what followed them there, with no
//! second model. The target model checks a draft of `k` tokens in one pass
//! of `k + 1` rows ([`crate::batch`] runs them as decode rows in groups, so
//! each row is computed exactly as a lone decode step would compute it):
//! row `j` gives the target's choice after the first `j` drafted tokens.
//! The longest prefix of the draft that the target agrees with is kept,
//! followed by the target's own token at the first disagreement (or after
//! the whole draft), so every pass yields at least one token; the cache
//! positions of rejected tokens are simply written again later.
//!
//! Greedy requests keep the argmax at every row, so they give exactly the
//! tokens they give without speculation. Sampled requests keep a drafted
//! token with its probability under the target's distribution and else draw
//! from that distribution without it ([`crate::Sampler::verify`]), which
//! leaves each token distributed as the target's sampler would draw it.
//!
//! ```
//! use encore_llm::speculate::ngram_draft;
//!
//! // "a b c d" appeared before; the sequence ends with "a b" again.
//! let tokens = [1, 2, 3, 4, 9, 1, 2];
//! assert_eq!(ngram_draft(&tokens, 3, 2), [3, 4]);
//! assert!(ngram_draft(&[5, 6, 7], 3, 4).is_empty());
//! ```

use crate::error::{LlmError, Result};

/// How the scheduler speculates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation {
    /// Most drafted tokens checked a step.
    pub draft_tokens: usize,
    /// Longest suffix looked up (then shorter ones, down to one token).
    pub ngram: usize,
    /// Speculate only while at most this many sequences are generating:
    /// past a few, a batch already reads its weights for many tokens.
    pub max_streams: usize,
}

/// The most drafted tokens a step: a decode graph is recorded for each
/// draft length, and its rows are the draft and one more.
pub const MAX_DRAFT_TOKENS: usize = 15;

impl Default for Speculation {
    fn default() -> Speculation {
        Speculation {
            draft_tokens: 5,
            ngram: 3,
            max_streams: 4,
        }
    }
}

impl Speculation {
    /// Checks the settings' ranges.
    pub fn validate(&self) -> Result<()> {
        if self.draft_tokens == 0 || self.draft_tokens > MAX_DRAFT_TOKENS {
            return Err(LlmError::Request(format!(
                "draft tokens = {}: expected 1 to {MAX_DRAFT_TOKENS}",
                self.draft_tokens
            )));
        }
        if self.ngram == 0 || self.max_streams == 0 {
            return Err(LlmError::Request(
                "the n-gram length and the streams that speculate must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// Up to `k` tokens that followed the latest earlier occurrence of the
/// longest suffix of `tokens` (of at most `max_n` tokens) found earlier in
/// `tokens`; empty when no suffix recurs.
pub fn ngram_draft(tokens: &[u32], max_n: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (1..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // The latest start before the suffix itself.
        let found = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix);
        if let Some(i) = found {
            let from = i + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{Sampler, SamplerConfig};

    #[test]
    fn the_longest_recurring_suffix_proposes_what_followed_it_last() {
        // "7 8" occurs twice; its later occurrence is followed by 5.
        let t = [7, 8, 1, 2, 7, 8, 5, 6, 0, 7, 8];
        assert_eq!(ngram_draft(&t, 3, 3), [5, 6, 0]);
        // "0 7 8" would be longer but never occurred before; "8" alone
        // at its latest earlier place is followed by 5 too.
        assert_eq!(ngram_draft(&t, 1, 2), [5, 6]);
        // The draft stops at the end of the sequence.
        let t = [3, 4, 3, 4];
        assert_eq!(ngram_draft(&t, 2, 5), [3, 4]);
        assert!(ngram_draft(&[1], 3, 4).is_empty());
        assert!(ngram_draft(&[1, 2, 3], 3, 0).is_empty());
    }

    #[test]
    fn settings_out_of_range_are_refused() {
        assert!(Speculation::default().validate().is_ok());
        for bad in [
            Speculation {
                draft_tokens: 0,
                ..Speculation::default()
            },
            Speculation {
                draft_tokens: MAX_DRAFT_TOKENS + 1,
                ..Speculation::default()
            },
            Speculation {
                ngram: 0,
                ..Speculation::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    /// Pearson's chi-square of `counts` against the probabilities `p`.
    fn chi_square(counts: &[u64], p: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn verified_drafts_keep_the_target_distribution() {
        // A target distribution over five tokens, and drafts of each of
        // them and of a token it never gives: whatever the draft, the
        // tokens kept follow the target (chi-square with 4 degrees of
        // freedom: 18.5 is its 0.1% tail), and a likely draft is kept as
        // often as the target gives it.
        let dist = [(3u32, 0.4f32), (1, 0.25), (4, 0.2), (0, 0.1), (2, 0.05)];
        let p: Vec<f64> = dist.iter().map(|d| f64::from(d.1)).collect();
        let draws = 100_000u64;
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 1.0,
            seed: 7,
            ..SamplerConfig::default()
        });
        for draft in [3u32, 1, 2, 9] {
            let mut counts = [0u64; 5];
            let mut kept = 0u64;
            for _ in 0..draws {
                let t = sampler.verify(&dist, draft);
                kept += u64::from(t == draft);
                let at = dist.iter().position(|d| d.0 == t);
                counts[at.unwrap_or(usize::MAX).min(4)] += 1;
                assert!(at.is_some(), "{t} is outside the distribution");
            }
            let x2 = chi_square(&counts, &p);
            assert!(
                x2 < 18.5,
                "draft {draft}: chi-square {x2}, counts {counts:?}"
            );
            let want = dist.iter().find(|d| d.0 == draft).map_or(0.0, |d| d.1);
            let rate = kept as f64 / draws as f64;
            assert!(
                (rate - f64::from(want)).abs() < 0.01,
                "draft {draft}: kept {rate}"
            );
        }
        // Plain draws from the same sampler follow it too (the test's
        // bound is not too loose to tell a wrong distribution apart).
        let mut counts = [0u64; 5];
        for _ in 0..draws {
            let t = sampler.draw(&dist);
            counts[dist.iter().position(|d| d.0 == t).unwrap_or(0)] += 1;
        }
        assert!(chi_square(&counts, &p) < 18.5);
        let skewed = [0.2, 0.25, 0.2, 0.3, 0.05];
        assert!(chi_square(&counts, &skewed) > 1000.0);
    }

    #[test]
    fn a_certain_target_keeps_exactly_its_token() {
        let mut sampler = Sampler::new(SamplerConfig::default());
        let dist = [(5u32, 1.0f32)];
        assert_eq!(sampler.verify(&dist, 5), 5);
        assert_eq!(sampler.verify(&dist, 6), 5);
    }
}
