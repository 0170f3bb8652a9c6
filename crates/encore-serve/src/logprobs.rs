//! Tokens' log-probabilities in OpenAI's two shapes: chat's list of
//! `{token, logprob, bytes, top_logprobs}` and the completions' parallel
//! lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

use serde_json::{json, Map, Value};

use encore_llm::tokenizer::Tokenizer;
use encore_llm::TokenLogprob;

use crate::api::Kind;

/// What OpenAI reports for a token with no probability (JSON has no
/// infinity).
const IMPOSSIBLE: f32 = -9999.0;

fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        IMPOSSIBLE
    }
}

/// A token's bytes as the vocabulary decodes them.
fn bytes(tokenizer: &Tokenizer, id: u32) -> &[u8] {
    tokenizer.token_bytes(id).unwrap_or_default()
}

/// A token's text (bytes that are not UTF-8 on their own as U+FFFD).
fn text(tokenizer: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(bytes(tokenizer, id)).into_owned()
}

/// The bytes the text of `tokens` takes, for the next text offset.
pub fn text_len(tokenizer: &Tokenizer, tokens: &[TokenLogprob]) -> usize {
    tokens.iter().map(|t| text(tokenizer, t.token).len()).sum()
}

/// The `logprobs` object of a choice (or of a streamed chunk) for
/// `tokens`; `offset` is where the first token's text begins in the
/// choice's text (completions).
pub fn json(tokenizer: &Tokenizer, kind: Kind, tokens: &[TokenLogprob], offset: usize) -> Value {
    match kind {
        Kind::Chat => {
            let entry = |id: u32, logprob: f32| {
                json!({
                    "token": text(tokenizer, id),
                    "logprob": finite(logprob),
                    "bytes": bytes(tokenizer, id),
                })
            };
            let content: Vec<Value> = tokens
                .iter()
                .map(|t| {
                    let mut e = entry(t.token, t.logprob);
                    let top: Vec<Value> = t.top.iter().map(|&(id, l)| entry(id, l)).collect();
                    e["top_logprobs"] = Value::Array(top);
                    e
                })
                .collect();
            json!({"content": content, "refusal": null})
        }
        Kind::Completion => {
            let mut at = offset;
            let mut offsets = Vec::with_capacity(tokens.len());
            for t in tokens {
                offsets.push(at);
                at += text(tokenizer, t.token).len();
            }
            let top: Vec<Value> = tokens
                .iter()
                .map(|t| {
                    let mut m = Map::new();
                    for &(id, l) in &t.top {
                        m.insert(text(tokenizer, id), json!(finite(l)));
                    }
                    Value::Object(m)
                })
                .collect();
            json!({
                "tokens": tokens.iter().map(|t| text(tokenizer, t.token)).collect::<Vec<_>>(),
                "token_logprobs": tokens.iter().map(|t| finite(t.logprob)).collect::<Vec<_>>(),
                "top_logprobs": top,
                "text_offset": offsets,
            })
        }
    }
}
