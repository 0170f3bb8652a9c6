//! The OpenAI API's request bodies, as far as Encore serves them, and
//! their translation into scheduler requests.
//!
//! Fields Encore does not know are ignored, as OpenAI's own server ignores
//! unknown ones; OpenAI's fields whose values Encore cannot honour
//! (`best_of` above 1, `logit_bias`, audio, ...) are refused with a 400
//! that names them, so a client never takes an answer for one it did not
//! ask for.

use std::sync::Arc;

use serde::Deserialize;

use encore_llm::chat::Message;
use encore_llm::constraint::Grammar;
use encore_llm::tools::{ToolCall, ToolChoice, ToolSyntax, Tools};
use encore_llm::SamplerConfig;

use crate::error::ApiError;

/// Which endpoint a generation answers, for the shape of its responses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Chat,
    Completion,
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A message's content: a string, or a list of parts of which Encore
/// takes the text ones.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    /// The calls an assistant's turn made: `{"id", "type": "function",
    /// "function": {"name", "arguments"}}`.
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// Which call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and length fields both endpoints share.
#[derive(Debug, Default, Deserialize)]
pub struct Sampling {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub n: Option<i64>,
    /// Chat: `true` for the sampled tokens' log-probabilities; completions:
    /// how many alternatives to list with each.
    pub logprobs: Option<serde_json::Value>,
    /// Chat: how many alternatives to list with each token's log-probability.
    pub top_logprobs: Option<i64>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<serde_json::Value>,
    /// A grammar in llguidance's Lark syntax that the output follows.
    pub grammar: Option<String>,
    /// A regular expression that the whole output matches.
    pub regex: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// llama.cpp's extension: generate past end-of-generation tokens.
    pub ignore_eos: Option<bool>,
    /// OpenAI's fields Encore does not implement: refused unless absent or
    /// set to what Encore does anyway ([`Unimplemented::check`]).
    #[serde(flatten)]
    pub unimplemented: Unimplemented,
}

/// OpenAI's request fields that Encore does not implement.
#[derive(Debug, Default, Deserialize)]
pub struct Unimplemented {
    pub best_of: Option<serde_json::Value>,
    pub logit_bias: Option<serde_json::Value>,
    pub functions: Option<serde_json::Value>,
    pub function_call: Option<serde_json::Value>,
    pub modalities: Option<serde_json::Value>,
    pub audio: Option<serde_json::Value>,
    pub prediction: Option<serde_json::Value>,
}

/// Whether a value of an unimplemented field asks for what Encore does
/// anyway.
type Honoured = fn(&serde_json::Value) -> bool;

impl Unimplemented {
    /// Refuses the first field set to something Encore would not do.
    pub fn check(&self) -> Result<(), ApiError> {
        use serde_json::Value;
        fn given(v: &Option<Value>) -> Option<&Value> {
            v.as_ref().filter(|v| !v.is_null())
        }
        let fields: [(&str, &Option<Value>, Honoured, &str); 7] = [
            (
                "best_of",
                &self.best_of,
                |v| v.as_i64() == Some(1),
                "only 1",
            ),
            (
                "logit_bias",
                &self.logit_bias,
                |v| v.as_object().is_some_and(|o| o.is_empty()),
                "only an empty map",
            ),
            (
                "functions",
                &self.functions,
                |_| false,
                "the deprecated functions are not supported: use tools",
            ),
            (
                "function_call",
                &self.function_call,
                |v| v.as_str() == Some("none"),
                "the deprecated function_call is not supported: use tool_choice",
            ),
            (
                "modalities",
                &self.modalities,
                |v| v == &serde_json::json!(["text"]),
                "only [\"text\"]",
            ),
            (
                "audio",
                &self.audio,
                |_| false,
                "audio output is not supported",
            ),
            (
                "prediction",
                &self.prediction,
                |_| false,
                "predicted outputs are not supported",
            ),
        ];
        for (name, value, honoured, what) in fields {
            if let Some(v) = given(value) {
                if !honoured(v) {
                    return Err(ApiError::bad_request(
                        format!("{name} = {v} is not supported: {what}"),
                        Some(name),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Vec<serde_json::Value>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function",
    /// "function": {"name"}}`.
    pub tool_choice: Option<serde_json::Value>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: serde_json::Value,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// Parses a JSON body, turning serde's complaint into a 400.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "the body is not valid JSON"
        } else {
            "the body does not fit the request"
        };
        ApiError::bad_request(format!("{what}: {e}"), None)
    })
}

/// Most stop strings a request may give (OpenAI's limit).
const MAX_STOP: usize = 4;

/// Most choices a request may ask for (`n`).
pub const MAX_CHOICES: usize = 8;

/// Most alternatives listed with a token's log-probability.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What a request asks of the scheduler, checked.
#[derive(Debug)]
pub struct Settings {
    pub max_tokens: Option<usize>,
    /// The sampler of the first choice; choice `i` draws with seed + `i`.
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices to generate, each sampled on its own.
    pub n: usize,
    /// Report log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
    /// What the output is held to.
    pub grammar: Option<Grammar>,
    /// How the model writes tool calls, and the tools offered, when there
    /// are some: its answer is read for calls to them.
    pub tools: Option<(ToolSyntax, Arc<Tools>)>,
}

fn unsupported(param: &str, what: &str) -> ApiError {
    ApiError::bad_request(format!("{what} is not supported"), Some(param))
}

/// A count in `0..=most`, or a 400 naming `param`.
fn count(param: &str, value: i64, least: i64, most: usize) -> Result<usize, ApiError> {
    usize::try_from(value)
        .ok()
        .filter(|&v| value >= least && v <= most)
        .ok_or_else(|| {
            ApiError::bad_request(
                format!("{param} = {value}: expected {least} to {most}"),
                Some(param),
            )
        })
}

impl Sampling {
    /// Checks the fields and fills a sampler (OpenAI's defaults where a
    /// field is absent: temperature 1, no top-p cut). `chat` says which
    /// endpoint's `logprobs` this is: a boolean with `top_logprobs` for
    /// chat, a count for completions.
    pub fn settings(&self, chat: bool) -> Result<Settings, ApiError> {
        self.unimplemented.check()?;
        let n = match self.n {
            Some(n) => count("n", n, 1, MAX_CHOICES)?,
            None => 1,
        };
        let logprobs = self.logprobs(chat)?;
        let grammar = self.grammar()?;
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(n), _) | (None, Some(n)) => {
                if n < 1 {
                    return Err(ApiError::bad_request(
                        format!("max_tokens = {n}: expected at least 1"),
                        Some("max_tokens"),
                    ));
                }
                Some(usize::try_from(n).unwrap_or(usize::MAX))
            }
            (None, None) => None,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP {
            return Err(ApiError::bad_request(
                format!("{} stop strings: at most {MAX_STOP}", stop.len()),
                Some("stop"),
            ));
        }
        let top_k = match self.top_k {
            Some(k) if k < 0 => {
                return Err(ApiError::bad_request(
                    format!("top_k = {k}: expected 0 (off) or more"),
                    Some("top_k"),
                ))
            }
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
            None => 0,
        };
        let seed = match self.seed {
            Some(s) => s as u64,
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        };
        let sampler = SamplerConfig {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repeat_penalty: self.repeat_penalty.unwrap_or(1.0),
            repeat_last_n: 64,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed,
        };
        if let Err(e) = sampler.validate() {
            return Err(ApiError::bad_request(e.to_string(), Some(e.field.name())));
        }
        let stream = self.stream.unwrap_or(false);
        Ok(Settings {
            max_tokens,
            sampler,
            stop,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            stream,
            include_usage: stream
                && self
                    .stream_options
                    .as_ref()
                    .is_some_and(|o| o.include_usage),
            n,
            logprobs,
            grammar,
            tools: None,
        })
    }

    /// How many alternatives to report with each token's log-probability,
    /// if any are asked for.
    fn logprobs(&self, chat: bool) -> Result<Option<usize>, ApiError> {
        use serde_json::Value;
        let given = self.logprobs.as_ref().filter(|v| !v.is_null());
        if chat {
            let on = match given {
                None | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(v) => {
                    return Err(ApiError::bad_request(
                        format!("logprobs = {v}: expected true or false"),
                        Some("logprobs"),
                    ))
                }
            };
            let top = match self.top_logprobs {
                Some(k) => count("top_logprobs", k, 0, MAX_TOP_LOGPROBS)?,
                None => 0,
            };
            if !on && self.top_logprobs.is_some_and(|k| k > 0) {
                return Err(ApiError::bad_request(
                    "top_logprobs needs logprobs = true".into(),
                    Some("top_logprobs"),
                ));
            }
            Ok(on.then_some(top))
        } else {
            match given {
                None | Some(Value::Bool(false)) => Ok(None),
                Some(v) => match v.as_i64() {
                    Some(k) => Ok(Some(count("logprobs", k, 0, MAX_TOP_LOGPROBS)?)),
                    None => Err(ApiError::bad_request(
                        format!("logprobs = {v}: expected a count of 0 to {MAX_TOP_LOGPROBS}"),
                        Some("logprobs"),
                    )),
                },
            }
        }
    }

    /// The grammar that `response_format`, `grammar` or `regex` asks for
    /// (at most one of them).
    fn grammar(&self) -> Result<Option<Grammar>, ApiError> {
        use serde_json::Value;
        let format = match &self.response_format {
            None | Some(Value::Null) => None,
            Some(f) => {
                let bad = |what: String| ApiError::bad_request(what, Some("response_format"));
                match f.get("type").and_then(Value::as_str) {
                    Some("text") => None,
                    // llama.cpp's form: a schema beside the type.
                    Some("json_object") => Some(match f.get("schema") {
                        Some(schema) => Grammar::JsonSchema(schema.clone()),
                        None => Grammar::JsonObject,
                    }),
                    Some("json_schema") => {
                        let schema = f
                            .get("json_schema")
                            .and_then(|j| j.get("schema"))
                            .ok_or_else(|| {
                                bad("response_format.json_schema.schema is missing".into())
                            })?;
                        if !schema.is_object() && !schema.is_boolean() {
                            return Err(bad(
                                "response_format.json_schema.schema must be a JSON schema object"
                                    .into(),
                            ));
                        }
                        Some(Grammar::JsonSchema(schema.clone()))
                    }
                    _ => {
                        return Err(bad(format!(
                            "response_format = {f}: expected a type of \"text\", \"json_object\" or \"json_schema\""
                        )))
                    }
                }
            }
        };
        let grammar = self.grammar.clone().map(Grammar::Lark);
        let regex = self.regex.clone().map(Grammar::Regex);
        let mut asked = [
            ("response_format", format),
            ("grammar", grammar),
            ("regex", regex),
        ]
        .into_iter()
        .filter(|(_, g)| g.is_some());
        let first = asked.next();
        if let Some((second, _)) = asked.next() {
            return Err(ApiError::bad_request(
                format!(
                    "{} and {second} both constrain the output: give one",
                    first.map_or("", |f| f.0)
                ),
                Some(second),
            ));
        }
        Ok(first.and_then(|f| f.1))
    }
}

impl ChatRequest {
    /// The tools offered and what the model may do with them; `None` when
    /// none are offered (or `tool_choice` is `"none"`).
    pub fn tools(&self) -> Result<Option<(Tools, ToolChoice)>, ApiError> {
        use serde_json::Value;
        let bad = |what: String| ApiError::bad_request(what, Some("tool_choice"));
        let choice = match &self.tool_choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                other => {
                    return Err(bad(format!(
                        "tool_choice = {other:?}: expected \"auto\", \"none\", \"required\" or a function"
                    )))
                }
            },
            Some(v) => match v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
            {
                Some(name) => ToolChoice::Function(name.to_string()),
                None => return Err(bad(format!("tool_choice = {v}: names no function"))),
            },
        };
        let specs = self.tools.clone().unwrap_or_default();
        if specs.is_empty() {
            return match choice {
                ToolChoice::Auto | ToolChoice::None => Ok(None),
                _ => Err(bad(
                    "tool_choice asks for a call, and no tools are given".into()
                )),
            };
        }
        let tools = Tools::new(specs).map_err(|e| ApiError::bad_request(e, Some("tools")))?;
        if let ToolChoice::Function(name) = &choice {
            if !tools.has(name) {
                return Err(bad(format!(
                    "tool_choice names {name:?}, which is not in tools"
                )));
            }
        }
        Ok((choice != ToolChoice::None).then_some((tools, choice)))
    }

    /// The conversation as the engine's messages: text content, the calls
    /// assistants made and the tools' results.
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad_request(
                "messages is empty".into(),
                Some("messages"),
            ));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = m.role.as_str();
                if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
                    return Err(ApiError::bad_request(
                        format!(
                            "messages[{i}].role = {role:?}: expected system, user, assistant or tool"
                        ),
                        Some("messages"),
                    ));
                }
                let role = if role == "developer" { "system" } else { role };
                let text = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut text = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => text.push_str(t),
                                (kind, _) => {
                                    return Err(ApiError::bad_request(
                                        format!(
                                            "messages[{i}]: content of type {kind:?} is not supported (text only)"
                                        ),
                                        Some("messages"),
                                    ))
                                }
                            }
                        }
                        text
                    }
                };
                let mut message = Message::new(role, text);
                message.tool_call_id = m.tool_call_id.clone();
                for (k, call) in m.tool_calls.iter().flatten().enumerate() {
                    let f = call.get("function");
                    let name = f.and_then(|f| f.get("name")).and_then(serde_json::Value::as_str);
                    let Some(name) = name else {
                        return Err(ApiError::bad_request(
                            format!("messages[{i}].tool_calls[{k}].function.name is missing"),
                            Some("messages"),
                        ));
                    };
                    let arguments = match f.and_then(|f| f.get("arguments")) {
                        Some(serde_json::Value::String(a)) => a.clone(),
                        Some(a) => a.to_string(),
                        None => "{}".into(),
                    };
                    message.tool_calls.push(ToolCall {
                        id: call
                            .get("id")
                            .and_then(serde_json::Value::as_str)
                            .unwrap_or_default()
                            .to_string(),
                        name: name.to_string(),
                        arguments,
                    });
                }
                Ok(message)
            })
            .collect()
    }
}

impl CompletionRequest {
    /// The prompt: one string (a list of one string is taken too).
    pub fn prompt(&self) -> Result<&str, ApiError> {
        if self.echo == Some(true) {
            return Err(unsupported("echo", "echo"));
        }
        if self.suffix.is_some() {
            return Err(unsupported("suffix", "suffix"));
        }
        match &self.prompt {
            serde_json::Value::String(s) => Ok(s),
            serde_json::Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                Ok(a[0].as_str().unwrap_or_default())
            }
            _ => Err(ApiError::bad_request(
                "prompt must be a string (token arrays and batches of prompts are not supported)"
                    .into(),
                Some("prompt"),
            )),
        }
    }
}
