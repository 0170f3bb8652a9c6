//! Anthropic's Messages API request body, as far as Encore serves it, and
//! its translation into the engine's conversation, tools and settings.
//!
//! The conversation is read block by block, so a refusal names the field
//! at fault as Anthropic's server does (`messages.1.content.0.type`): a
//! user's `text` and `tool_result` blocks, an assistant's `text` and
//! `tool_use` blocks. A tool's result becomes a `tool` message answering
//! its call, so the chat template renders it as it renders OpenAI's. Other
//! blocks (images, documents, thinking) are refused, as is a conversation
//! that ends with the assistant's turn (Anthropic's prefill, which the
//! templates cannot continue). `metadata` and fields Encore does not know
//! are ignored.

use serde::Deserialize;
use serde_json::{json, Value};

use encore_llm::chat::Message;
use encore_llm::tools::{ToolCall, ToolChoice, Tools};

use crate::api::{Sampling, Settings};
use crate::error::ApiError;

/// Most stop sequences a request may give.
pub const MAX_STOP_SEQUENCES: usize = 16;

/// `POST /v1/messages`'s body.
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    /// Required, as Anthropic requires it.
    pub max_tokens: Option<i64>,
    pub messages: Option<Vec<Value>>,
    /// A string, or a list of text blocks.
    pub system: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    /// `{"name", "description"?, "input_schema"}` each.
    pub tools: Option<Vec<Value>>,
    /// `{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name"}`.
    pub tool_choice: Option<Value>,
    pub stream: Option<bool>,
}

fn bad(message: String) -> ApiError {
    ApiError::bad_request(message, None)
}

fn required(field: &str) -> ApiError {
    bad(format!("{field}: Field required"))
}

/// What `tool_choice` asks, with whether the answer may hold more than
/// one call.
pub struct Offered {
    pub tools: Tools,
    pub choice: ToolChoice,
    /// `disable_parallel_tool_use`: keep the answer's first call only.
    pub single: bool,
}

impl MessagesRequest {
    /// The model asked for (required).
    pub fn model(&self) -> Result<&str, ApiError> {
        self.model.as_deref().ok_or_else(|| required("model"))
    }

    /// Checks the sampling and length fields (Anthropic's defaults where
    /// one is absent: temperature 1, no top-p or top-k cut).
    pub fn settings(&self) -> Result<Settings, ApiError> {
        let max_tokens = self.max_tokens.ok_or_else(|| required("max_tokens"))?;
        let sampling = Sampling {
            max_tokens: Some(max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stream: self.stream,
            ..Sampling::default()
        };
        let mut settings = sampling.settings(true)?;
        let stop = self.stop_sequences.clone().unwrap_or_default();
        if stop.len() > MAX_STOP_SEQUENCES {
            return Err(bad(format!(
                "stop_sequences: {} given, at most {MAX_STOP_SEQUENCES}",
                stop.len()
            )));
        }
        if stop.iter().any(String::is_empty) {
            return Err(bad("stop_sequences: a stop sequence is empty".into()));
        }
        settings.stop = stop;
        Ok(settings)
    }

    /// The conversation as the engine's messages: the system prompt, then
    /// each turn's text, the assistant's calls and the tools' results.
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        let turns = self.messages.as_ref().ok_or_else(|| required("messages"))?;
        let mut out = Vec::new();
        if let Some(system) = self.system()? {
            out.push(Message::new("system", system));
        }
        if turns.is_empty() {
            return Err(bad("messages: at least one message is required".into()));
        }
        for (i, turn) in turns.iter().enumerate() {
            let at = format!("messages.{i}");
            if !turn.is_object() {
                return Err(bad(format!(
                    "{at}: expected an object with role and content"
                )));
            }
            let role = match turn.get("role") {
                None => return Err(required(&format!("{at}.role"))),
                Some(Value::String(r)) if r == "user" || r == "assistant" => r.as_str(),
                Some(r) => {
                    return Err(bad(format!(
                        "{at}.role = {r}: expected \"user\" or \"assistant\""
                    )))
                }
            };
            let blocks = blocks(turn.get("content"), &format!("{at}.content"))?;
            if role == "user" {
                user_turn(&mut out, &blocks, &at)?;
            } else {
                out.push(assistant_turn(&blocks, &at)?);
            }
        }
        if turns
            .last()
            .and_then(|t| t.get("role"))
            .and_then(Value::as_str)
            == Some("assistant")
        {
            return Err(bad(
                "messages: the last message is the assistant's; continuing a partial \
                 assistant turn (prefill) is not supported"
                    .into(),
            ));
        }
        Ok(out)
    }

    /// The system prompt: a string, or text blocks joined by newlines.
    fn system(&self) -> Result<Option<String>, ApiError> {
        match &self.system {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Array(parts)) => {
                let texts = parts
                    .iter()
                    .enumerate()
                    .map(|(k, p)| text_block(p, &format!("system.{k}")))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Some(texts.join("\n")))
            }
            Some(other) => Err(bad(format!(
                "system = {other}: expected a string or a list of text blocks"
            ))),
        }
    }

    /// The tools offered and what the model may do with them; `None` when
    /// none are offered (or `tool_choice` is `none`).
    pub fn tools(&self) -> Result<Option<Offered>, ApiError> {
        let (choice, single) = match &self.tool_choice {
            None | Some(Value::Null) => (ToolChoice::Auto, false),
            Some(c) => {
                let single = c
                    .get("disable_parallel_tool_use")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let choice = match c.get("type").and_then(Value::as_str) {
                    Some("auto") => ToolChoice::Auto,
                    Some("any") => ToolChoice::Required,
                    Some("none") => ToolChoice::None,
                    Some("tool") => match c.get("name").and_then(Value::as_str) {
                        Some(name) => ToolChoice::Function(name.to_string()),
                        None => return Err(required("tool_choice.name")),
                    },
                    _ => {
                        return Err(bad(format!(
                            "tool_choice = {c}: expected a type of \"auto\", \"any\", \"tool\" or \"none\""
                        )))
                    }
                };
                (choice, single)
            }
        };
        let given = self.tools.as_deref().unwrap_or_default();
        if given.is_empty() {
            return match choice {
                ToolChoice::Auto | ToolChoice::None => Ok(None),
                _ => Err(bad(
                    "tool_choice: a tool call is required, and no tools are given".into(),
                )),
            };
        }
        let specs = given
            .iter()
            .enumerate()
            .map(|(i, t)| tool_spec(t, i))
            .collect::<Result<Vec<_>, _>>()?;
        let tools = Tools::new(specs).map_err(bad)?;
        if let ToolChoice::Function(name) = &choice {
            if !tools.has(name) {
                return Err(bad(format!(
                    "tool_choice.name = {name:?}: no tool of that name is given"
                )));
            }
        }
        Ok((choice != ToolChoice::None).then_some(Offered {
            tools,
            choice,
            single,
        }))
    }
}

/// An Anthropic tool as the OpenAI tool object the engine's templates
/// render.
fn tool_spec(tool: &Value, i: usize) -> Result<Value, ApiError> {
    let at = format!("tools.{i}");
    match tool.get("type").and_then(Value::as_str) {
        None | Some("custom") => {}
        Some(kind) => {
            return Err(bad(format!(
                "{at}.type = {kind:?}: only custom tools (name, description, input_schema) are supported"
            )))
        }
    }
    let name = match tool.get("name") {
        None => return Err(required(&format!("{at}.name"))),
        Some(Value::String(n))
            if !n.is_empty()
                && n.len() <= 64
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
        {
            n
        }
        Some(n) => {
            return Err(bad(format!(
                "{at}.name = {n}: expected 1 to 64 letters, digits, '_' or '-'"
            )))
        }
    };
    let schema = match tool.get("input_schema") {
        None => return Err(required(&format!("{at}.input_schema"))),
        Some(s) if s.is_object() => s,
        Some(_) => {
            return Err(bad(format!(
                "{at}.input_schema must be a JSON schema object"
            )))
        }
    };
    let mut function = json!({"name": name, "parameters": schema});
    match tool.get("description") {
        None | Some(Value::Null) => {}
        Some(Value::String(d)) => function["description"] = json!(d),
        Some(_) => return Err(bad(format!("{at}.description must be a string"))),
    }
    Ok(json!({"type": "function", "function": function}))
}

/// A turn's content as blocks: a string is one text block.
fn blocks(content: Option<&Value>, at: &str) -> Result<Vec<Value>, ApiError> {
    match content {
        None => Err(required(at)),
        Some(Value::String(s)) => Ok(vec![json!({"type": "text", "text": s})]),
        Some(Value::Array(b)) => Ok(b.clone()),
        Some(other) => Err(bad(format!(
            "{at} = {other}: expected a string or a list of content blocks"
        ))),
    }
}

/// The type of the block at `at`.
fn block_type<'b>(block: &'b Value, at: &str) -> Result<&'b str, ApiError> {
    match block.get("type") {
        Some(Value::String(t)) => Ok(t),
        None => Err(required(&format!("{at}.type"))),
        Some(t) => Err(bad(format!("{at}.type = {t}: expected a string"))),
    }
}

fn unsupported_block(kind: &str, at: &str, allowed: &str) -> ApiError {
    bad(format!(
        "{at}.type = {kind:?}: expected {allowed} (other blocks are not supported)"
    ))
}

/// The text of a `text` block.
fn text_block(block: &Value, at: &str) -> Result<String, ApiError> {
    match block_type(block, at)? {
        "text" => match block.get("text") {
            Some(Value::String(t)) => Ok(t.clone()),
            None => Err(required(&format!("{at}.text"))),
            Some(_) => Err(bad(format!("{at}.text must be a string"))),
        },
        kind => Err(unsupported_block(kind, at, "\"text\"")),
    }
}

/// A user's turn: its text as a user message, each tool result as a `tool`
/// message answering its call, in their order.
fn user_turn(out: &mut Vec<Message>, blocks: &[Value], at: &str) -> Result<(), ApiError> {
    let mut text: Option<String> = None;
    for (k, block) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{k}");
        match block_type(block, &at)? {
            "text" => text
                .get_or_insert_with(String::new)
                .push_str(&text_block(block, &at)?),
            "tool_result" => {
                if let Some(t) = text.take() {
                    out.push(Message::new("user", t));
                }
                out.push(tool_result(block, &at)?);
            }
            kind => return Err(unsupported_block(kind, &at, "\"text\" or \"tool_result\"")),
        }
    }
    if text.is_some() || blocks.is_empty() {
        out.push(Message::new("user", text.unwrap_or_default()));
    }
    Ok(())
}

/// A `tool_result` block as a `tool` message: its content (a string or
/// text blocks), marked as an error where `is_error` says so.
fn tool_result(block: &Value, at: &str) -> Result<Message, ApiError> {
    let id = match block.get("tool_use_id") {
        Some(Value::String(id)) => id.clone(),
        None => return Err(required(&format!("{at}.tool_use_id"))),
        Some(_) => return Err(bad(format!("{at}.tool_use_id must be a string"))),
    };
    let content = match block.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| text_block(p, &format!("{at}.content.{j}")))
            .collect::<Result<Vec<_>, _>>()?
            .join("\n"),
        Some(other) => {
            return Err(bad(format!(
                "{at}.content = {other}: expected a string or a list of text blocks"
            )))
        }
    };
    let content = match block.get("is_error") {
        Some(Value::Bool(true)) => format!("Error: {content}"),
        _ => content,
    };
    let mut message = Message::new("tool", content);
    message.tool_call_id = Some(id);
    Ok(message)
}

/// An assistant's turn: its text, and its `tool_use` blocks as calls.
fn assistant_turn(blocks: &[Value], at: &str) -> Result<Message, ApiError> {
    let mut message = Message::new("assistant", String::new());
    for (k, block) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{k}");
        match block_type(block, &at)? {
            "text" => message.content.push_str(&text_block(block, &at)?),
            "tool_use" => {
                let field = |name: &str| match block.get(name) {
                    Some(Value::String(v)) => Ok(v.clone()),
                    None => Err(required(&format!("{at}.{name}"))),
                    Some(_) => Err(bad(format!("{at}.{name} must be a string"))),
                };
                let (id, name) = (field("id")?, field("name")?);
                let arguments = match block.get("input") {
                    Some(input) if input.is_object() => input.to_string(),
                    None => return Err(required(&format!("{at}.input"))),
                    Some(_) => return Err(bad(format!("{at}.input must be an object"))),
                };
                message.tool_calls.push(ToolCall {
                    id,
                    name,
                    arguments,
                });
            }
            kind => return Err(unsupported_block(kind, &at, "\"text\" or \"tool_use\"")),
        }
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn request(body: Value) -> MessagesRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn tool_use_and_tool_result_blocks_become_calls_and_tool_messages() {
        let r = request(json!({
            "model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ]},
            ],
        }));
        let m = r.messages().unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(m[0].content, "Be brief.\nBe kind.");
        assert_eq!(m[2].content, "Looking.");
        assert_eq!(m[2].tool_calls[0].name, "weather");
        assert_eq!(m[2].tool_calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[3].content, "sunny");
        assert_eq!(m[4].content, "And tomorrow?");
    }

    #[test]
    fn bad_conversations_and_tools_are_refused_by_field() {
        let turn = |content: Value| json!({"model": "m", "max_tokens": 8, "messages": [content]});
        for (body, says) in [
            (
                json!({"model": "m", "messages": []}),
                "max_tokens: Field required",
            ),
            (
                turn(json!({"role": "system", "content": "x"})),
                "messages.0.role",
            ),
            (
                turn(json!({"role": "user", "content": [{"type": "image", "source": {}}]})),
                "messages.0.content.0.type = \"image\"",
            ),
            (
                turn(
                    json!({"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}),
                ),
                "messages.0.content.0.type = \"tool_use\"",
            ),
            (
                turn(json!({"role": "assistant", "content": "hi"})),
                "prefill",
            ),
            (
                turn(json!({"role": "user"})),
                "messages.0.content: Field required",
            ),
        ] {
            let r = request(body.clone());
            let e = r.settings().and_then(|_| r.messages()).err().unwrap();
            assert!(e.message.contains(says), "{body} -> {}", e.message);
        }
        let tools = |tools: Value, choice: Value| {
            request(json!({"model": "m", "max_tokens": 8, "messages": [], "tools": tools, "tool_choice": choice}))
                .tools()
                .err()
                .unwrap()
                .message
        };
        let weather = json!([{"name": "weather", "input_schema": {"type": "object"}}]);
        assert!(tools(json!([{"input_schema": {}}]), Value::Null).contains("tools.0.name"));
        assert!(tools(json!([{"name": "w"}]), Value::Null).contains("input_schema"));
        assert!(tools(
            json!([{"type": "bash_20250124", "name": "bash"}]),
            Value::Null
        )
        .contains("only custom tools"));
        assert!(tools(weather.clone(), json!({"type": "tool", "name": "nope"})).contains("nope"));
        assert!(tools(weather, json!({"type": "sometimes"})).contains("tool_choice"));
        assert!(tools(json!([]), json!({"type": "any"})).contains("no tools"));
    }
}
