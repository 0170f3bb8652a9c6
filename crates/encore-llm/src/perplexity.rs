//! Perplexity of a model on a text, computed as llama.cpp's
//! `llama-perplexity` computes it, so the two can be compared figure for
//! figure:
//!
//! 1. the whole text is tokenized once, with the model's BOS where its
//!    metadata asks for one, control-token text left as text;
//! 2. the tokens are cut into `n = len / ctx` chunks of `ctx` tokens (the
//!    remainder is dropped); each chunk runs from an empty cache, its first
//!    token replaced by BOS where the model adds one;
//! 3. in each chunk the logits at rows `ctx/2 .. ctx-1` predict the next
//!    token, and each contributes `-log softmax(logits)[next]`;
//! 4. `PPL = exp(mean)`, with the error `PPL * sqrt(var / (count - 1))`
//!    over all scored tokens.

use crate::engine::Engine;
use crate::error::{LlmError, Result};

/// The result after some or all chunks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perplexity {
    /// `exp` of the mean negative log-likelihood.
    pub value: f64,
    /// The estimate's standard error (0 until two tokens are scored).
    pub error: f64,
    /// Chunks done and in all.
    pub chunks: usize,
    pub total_chunks: usize,
    /// Tokens scored so far.
    pub scored: usize,
}

/// The running sums of the negative log-likelihood.
#[derive(Default)]
struct Sums {
    nll: f64,
    nll2: f64,
    count: usize,
}

impl Sums {
    fn add(&mut self, logits: &[f32], next: u32) {
        let nll = -log_softmax(logits, next as usize);
        self.nll += nll;
        self.nll2 += nll * nll;
        self.count += 1;
    }

    fn result(&self, chunks: usize, total_chunks: usize) -> Perplexity {
        let n = self.count.max(1) as f64;
        let mean = self.nll / n;
        let value = mean.exp();
        let var = self.nll2 / n - mean * mean;
        let error = if self.count > 1 && var > 0.0 {
            (var / (n - 1.0)).sqrt() * value
        } else {
            0.0
        };
        Perplexity {
            value,
            error,
            chunks,
            total_chunks,
            scored: self.count,
        }
    }
}

/// `log softmax(logits)[tok]`: the maximum subtracted, `e^x` summed in f64.
fn log_softmax(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    f64::from(logits[tok] - max) - sum.ln()
}

/// The perplexity of `engine`'s model on `text` with chunks of `ctx`
/// tokens; `progress` sees the running result after each chunk.
pub fn perplexity(
    engine: &Engine,
    text: &str,
    ctx: usize,
    mut progress: impl FnMut(&Perplexity),
) -> Result<Perplexity> {
    let context = engine.model().config.context_length;
    if ctx < 4 || ctx > context {
        return Err(LlmError::Request(format!(
            "the chunk size must lie in 4..={context} (the model's context); got {ctx}"
        )));
    }
    let tokenizer = engine.tokenizer();
    let mut tokens = tokenizer.encode(text, true, false)?;
    if tokens.len() < 2 * ctx {
        return Err(LlmError::Request(format!(
            "the text tokenizes to {} tokens; a chunk size of {ctx} needs at least {}",
            tokens.len(),
            2 * ctx
        )));
    }
    let bos = tokenizer.bos().filter(|_| tokenizer.add_bos());
    let total = tokens.len() / ctx;
    let first = ctx / 2;
    let mut session = engine.session(ctx)?;
    let mut sums = Sums::default();
    for (i, chunk) in tokens.chunks_exact_mut(ctx).take(total).enumerate() {
        if let Some(bos) = bos {
            chunk[0] = bos;
        }
        session.reset();
        let chunk = &*chunk;
        session.logits_from(chunk, first, |row, logits| {
            if let Some(&next) = chunk.get(row + 1) {
                sums.add(logits, next);
            }
            Ok(())
        })?;
        progress(&sums.result(i + 1, total));
    }
    Ok(sums.result(total, total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_the_definition() {
        let logits = [1.5f32, -0.25, 3.0, 0.75];
        let denom: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for tok in 0..logits.len() {
            let want = f64::from(logits[tok]).exp() / denom;
            let got = log_softmax(&logits, tok).exp();
            assert!((got - want).abs() < 1e-6, "token {tok}: {got} vs {want}");
        }
    }

    #[test]
    fn sums_give_exp_of_the_mean_and_its_error() {
        let mut s = Sums::default();
        // Two tokens with probabilities 1/2 and 1/4.
        s.add(&[0.0, 0.0], 0);
        s.add(&[0.0, 0.0, 0.0, 0.0], 3);
        let r = s.result(1, 1);
        let (a, b) = (2f64.ln(), 4f64.ln());
        let mean = (a + b) / 2.0;
        assert!((r.value - mean.exp()).abs() < 1e-9);
        let var = (a * a + b * b) / 2.0 - mean * mean;
        assert!((r.error - (var / 1.0).sqrt() * r.value).abs() < 1e-9);
        assert_eq!(r.scored, 2);
    }
}
