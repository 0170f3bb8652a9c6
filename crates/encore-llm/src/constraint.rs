//! Constrained decoding: a generation held to a JSON schema, a Lark grammar
//! or a regular expression by masking, before each draw, the tokens that
//! could not continue a valid output.
//!
//! The masks come from `llguidance` (the library llama.cpp and vLLM use),
//! computed on the host from the tokenizer's vocabulary. A [`Constraints`]
//! holds what is shared across requests (the vocabulary as a token trie and
//! the lexer slices) and is built once per model; [`Constraints::compile`]
//! turns a [`Grammar`] into a [`Constraint`], one request's matcher, and
//! names what the library could not compile.
//!
//! ```
//! use encore_llm::constraint::{Constraints, Grammar};
//! use encore_llm::tokenizer::{Tokenizer, TokenizerSpec};
//!
//! // A vocabulary of the 256 bytes and an end-of-sequence token.
//! let mut tokens: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
//! tokens.push("</s>".into());
//! let mut types = vec![6; 256];
//! types.push(3);
//! let tokenizer = Tokenizer::from_spec(TokenizerSpec {
//!     model: "llama".into(),
//!     tokens,
//!     token_types: Some(types),
//!     eos: Some(256),
//!     ..TokenizerSpec::default()
//! })?;
//! let constraints = Constraints::new(&tokenizer)?;
//! let mut c = constraints.compile(&Grammar::Regex("ab+".into()))?;
//! let mut logits = vec![0.0f32; 257];
//! c.mask(&mut logits)?;
//! assert!(logits[usize::from(b'a')].is_finite());
//! assert_eq!(logits[usize::from(b'b')], f32::NEG_INFINITY);
//! c.accept(u32::from(b'a'))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::tokenizer::Tokenizer;

/// What a generation is held to.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `response_format` `json_object`).
    JsonObject,
    /// A value that validates against this JSON schema.
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
    /// A regular expression (Rust's `regex` syntax) the whole output matches.
    Regex(String),
}

/// Why a grammar could not be used, or a matcher went wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// The grammar or schema does not compile; the message is the library's.
    #[error("the {what} cannot be used: {message}")]
    Compile {
        /// `"JSON schema"`, `"grammar"` or `"regex"`.
        what: &'static str,
        /// What the library said.
        message: String,
    },
    /// The matcher failed while generating (a token it had not allowed).
    #[error("constrained decoding failed: {0}")]
    Matcher(String),
}

/// The tokenizer's vocabulary as llguidance sees it, shared by every
/// request on one model.
pub struct Constraints {
    factory: ParserFactory,
    /// Tokens that end a generation (unmasked where the grammar allows EOS).
    eog: Vec<u32>,
    vocab: usize,
}

impl std::fmt::Debug for Constraints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraints")
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl Constraints {
    /// Builds the token trie of `tokenizer`'s vocabulary: control tokens
    /// are special (a grammar names them, text never spells them), every
    /// other token stands for its bytes.
    pub fn new(tokenizer: &Tokenizer) -> Result<Constraints, ConstraintError> {
        let vocab = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                if tokenizer.is_control(id) || tokenizer.is_eog(id) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_text(id).unwrap_or_default().as_bytes());
                    w
                } else {
                    tokenizer
                        .token_bytes(id)
                        .map(<[u8]>::to_vec)
                        .unwrap_or_default()
                }
            })
            .collect();
        let eog: Vec<u32> = (0..vocab as u32).filter(|&t| tokenizer.is_eog(t)).collect();
        let eos = tokenizer
            .eot()
            .or(tokenizer.eos())
            .or(eog.first().copied())
            .unwrap_or(0);
        let info = TokRxInfo::new(vocab as u32, eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Compile {
                what: "vocabulary",
                message: e.to_string(),
            })?;
        factory.quiet();
        Ok(Constraints {
            factory,
            eog,
            vocab,
        })
    }

    /// Compiles `grammar` into a matcher for one generation.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, ConstraintError> {
        let (what, top) = match grammar {
            Grammar::JsonObject => (
                "JSON schema",
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"}))),
            ),
            Grammar::JsonSchema(schema) => (
                "JSON schema",
                TopLevelGrammar::from_json_schema(compact(schema.clone())),
            ),
            Grammar::Lark(text) => ("grammar", TopLevelGrammar::from_lark(text.clone())),
            Grammar::Regex(rx) => ("regex", TopLevelGrammar::from_regex(rx)),
        };
        let parser = self.factory.create_parser(top);
        let matcher = Matcher::new(parser);
        if let Some(message) = matcher.get_error() {
            return Err(ConstraintError::Compile {
                what,
                message: first_line(&message),
            });
        }
        Ok(Constraint {
            matcher: Box::new(matcher),
            eog: self.eog.clone(),
            vocab: self.vocab,
        })
    }
}

/// JSON without optional whitespace, unless the schema asks otherwise
/// (`x-guidance`): a small model left free to add whitespace may add it
/// forever.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// The first line of a library message (its later lines dump parser state).
fn first_line(message: &str) -> String {
    message.lines().next().unwrap_or(message).trim().to_string()
}

/// One generation's matcher: which tokens may come next.
pub struct Constraint {
    /// Boxed: a matcher is large, and requests travel through channels.
    matcher: Box<Matcher>,
    eog: Vec<u32>,
    vocab: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Sets the logit of every token that cannot come next to minus
    /// infinity. Where the grammar may end, every end-of-generation token
    /// is allowed.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| ConstraintError::Matcher(first_line(&e.to_string())))?;
        let ends = self.eog.iter().any(|&t| allowed.is_allowed(t));
        let kept: Vec<(usize, f32)> = if ends {
            self.eog
                .iter()
                .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
                .collect()
        } else {
            Vec::new()
        };
        for (t, l) in logits.iter_mut().enumerate() {
            if t >= self.vocab || !allowed.is_allowed(t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        for (t, l) in kept {
            logits[t] = l;
        }
        Ok(())
    }

    /// Advances past the sampled `token`. An end-of-generation token ends
    /// the matcher's work and is not given to it.
    pub fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        if self.eog.contains(&token) || self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError::Matcher(first_line(&e.to_string())))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use crate::tokenizer::tests::tiny_vocab;
    use serde_json::{json, Value};

    /// The 256 bytes, a few multi-byte tokens, and `</s>` (the last, 262)
    /// as EOS.
    fn tokenizer() -> Tokenizer {
        let pieces = [
            ("{\"", 1),
            ("\": ", 1),
            ("\", \"", 1),
            ("true", 1),
            ("null", 1),
            ("▁the", 1),
            ("</s>", 3),
        ];
        tiny_vocab(&pieces, 262)
    }

    #[test]
    fn schemas_the_library_cannot_compile_are_named() {
        let t = tokenizer();
        let c = Constraints::new(&t).unwrap();
        for (grammar, says) in [
            (
                Grammar::JsonSchema(json!({"type": "nope"})),
                "Invalid type: nope",
            ),
            (
                Grammar::JsonSchema(json!({"$ref": "#/$defs/gone"})),
                "$defs",
            ),
            (
                Grammar::JsonSchema(json!({"type": "string", "format": "no-such"})),
                "Unknown format",
            ),
            (Grammar::Regex("(unclosed".into()), "regex"),
            (Grammar::Lark("start: missing_rule".into()), "grammar"),
        ] {
            let e = c.compile(&grammar).unwrap_err();
            assert!(e.to_string().contains(says), "{grammar:?}: {e}");
        }
    }

    #[test]
    fn a_regex_and_a_grammar_allow_only_their_language() {
        let t = tokenizer();
        let c = Constraints::new(&t).unwrap();
        let eos = t.eos().unwrap();
        for grammar in [
            Grammar::Regex("(yes|no)!".into()),
            Grammar::Lark("start: (\"yes\" | \"no\") \"!\"".into()),
        ] {
            let mut m = c.compile(&grammar).unwrap();
            let allowed = |m: &mut Constraint| {
                let mut l = vec![0.0; t.vocab_size()];
                m.mask(&mut l).unwrap();
                (0..t.vocab_size() as u32)
                    .filter(|&i| l[i as usize].is_finite())
                    .collect::<Vec<u32>>()
            };
            assert_eq!(allowed(&mut m), [u32::from(b'n'), u32::from(b'y')]);
            for b in *b"no" {
                m.accept(u32::from(b)).unwrap();
            }
            assert_eq!(allowed(&mut m), [u32::from(b'!')]);
            m.accept(u32::from(b'!')).unwrap();
            assert_eq!(allowed(&mut m), [eos]);
            m.accept(eos).unwrap();
        }
    }

    /// A seeded xorshift, for schemas and draws that tests can repeat.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// A random schema of nested objects, arrays, enums, bounded numbers,
    /// strings and optional fields.
    fn schema(rng: &mut Rng, depth: u32) -> Value {
        let kinds = if depth >= 3 { 6 } else { 8 };
        match rng.below(kinds) {
            0 => {
                let min = rng.below(3);
                json!({"type": "string", "minLength": min, "maxLength": min + rng.below(10)})
            }
            1 => {
                let lo = rng.below(200) as i64 - 100;
                json!({"type": "integer", "minimum": lo, "maximum": lo + rng.below(1000) as i64})
            }
            2 => json!({"type": "number", "minimum": -5.5, "maximum": 1e3}),
            3 => json!({"type": "boolean"}),
            4 => {
                let n = 1 + rng.below(4);
                let values: Vec<String> =
                    (0..n).map(|i| format!("v{i}_{}", rng.below(99))).collect();
                json!({"enum": values})
            }
            5 => json!({"type": "null"}),
            6 => {
                let min = rng.below(2);
                json!({
                    "type": "array",
                    "items": schema(rng, depth + 1),
                    "minItems": min,
                    "maxItems": min + 1 + rng.below(3),
                })
            }
            _ => object(rng, depth),
        }
    }

    /// A random object schema with one to four fields, some of them
    /// optional.
    fn object(rng: &mut Rng, depth: u32) -> Value {
        let n = 1 + rng.below(4);
        let mut props = serde_json::Map::new();
        let mut required = Vec::new();
        for i in 0..n {
            let name = format!("f{i}");
            props.insert(name.clone(), schema(rng, depth + 1));
            if rng.below(2) == 0 {
                required.push(name);
            }
        }
        json!({
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": false,
        })
    }

    /// Whether `v` validates against a schema made by [`schema`].
    fn valid(v: &Value, s: &Value) -> bool {
        if let Some(values) = s.get("enum").and_then(Value::as_array) {
            return values.contains(v);
        }
        let num = |k: &str| s.get(k).and_then(Value::as_f64);
        let int = |k: &str| s.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
        match s["type"].as_str() {
            Some("string") => v.as_str().is_some_and(|t| {
                (int("minLength")..=int("maxLength")).contains(&t.chars().count())
            }),
            Some("integer") => v.as_i64().is_some_and(|x| {
                num("minimum").is_none_or(|m| x as f64 >= m)
                    && num("maximum").is_none_or(|m| x as f64 <= m)
            }),
            Some("number") => v.as_f64().is_some_and(|x| {
                num("minimum").is_none_or(|m| x >= m) && num("maximum").is_none_or(|m| x <= m)
            }),
            Some("boolean") => v.is_boolean(),
            Some("null") => v.is_null(),
            Some("array") => v.as_array().is_some_and(|a| {
                (int("minItems")..=int("maxItems")).contains(&a.len())
                    && a.iter().all(|x| valid(x, &s["items"]))
            }),
            Some("object") => v.as_object().is_some_and(|o| {
                let props = s["properties"].as_object();
                let required = s["required"].as_array();
                o.iter()
                    .all(|(k, x)| props.and_then(|p| p.get(k)).is_some_and(|p| valid(x, p)))
                    && required.is_none_or(|r| {
                        r.iter()
                            .all(|k| k.as_str().is_some_and(|k| o.contains_key(k)))
                    })
            }),
            _ => false,
        }
    }

    #[test]
    fn outputs_held_to_a_hundred_generated_schemas_parse_and_validate() {
        let t = tokenizer();
        let c = Constraints::new(&t).unwrap();
        let eos = t.eos().unwrap();
        // Tokens that close things are favoured, like a model that wants to
        // finish; the rest is noise, so every branch the mask leaves open
        // gets taken somewhere.
        let closing: Vec<u32> = [b'"', b'}', b']', b',']
            .iter()
            .map(|&b| u32::from(b))
            .chain([eos])
            .collect();
        let mut rng = Rng(0x5eed_cafe);
        let (mut nested, mut arrays) = (0, 0);
        for k in 0..120 {
            let s = object(&mut rng, 0);
            let mut m = c.compile(&Grammar::JsonSchema(s.clone())).unwrap();
            let mut out = Vec::new();
            let mut ended = false;
            for _ in 0..4000 {
                let mut logits: Vec<f32> = (0..t.vocab_size() as u32)
                    .map(|id| {
                        let noise = (rng.below(1000) as f32) / 1000.0;
                        noise + if closing.contains(&id) { 2.0 } else { 0.0 }
                    })
                    .collect();
                m.mask(&mut logits).unwrap();
                let token = crate::sampler::greedy(&logits);
                assert!(
                    logits[token as usize].is_finite(),
                    "schema {k}: nothing allowed"
                );
                m.accept(token).unwrap();
                if token == eos {
                    ended = true;
                    break;
                }
                out.extend_from_slice(t.token_bytes(token).unwrap());
            }
            assert!(ended, "schema {k} {s}: no end");
            let text = String::from_utf8(out).unwrap();
            let value: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("schema {k} {s}: {text:?} does not parse: {e}"));
            assert!(
                valid(&value, &s),
                "schema {k} {s}: {text} does not validate"
            );
            nested += usize::from(text.matches('{').count() > 1);
            arrays += usize::from(text.contains('[') && !text.contains("[]"));
        }
        // The schemas and outputs are not all trivial.
        assert!(
            nested >= 10 && arrays >= 10,
            "{nested} nested, {arrays} arrays"
        );
    }
}
