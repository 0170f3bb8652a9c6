//! Anthropic's Messages API at `/v1/messages`, on a loopback port over the
//! default model on the CPU: whole and streamed answers, the system prompt,
//! stop sequences, the token limit, a tool-use round trip, the API key as
//! `x-api-key`, a client that disconnects, and errors in Anthropic's shape.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use encore_llm::{Scheduler, SchedulerConfig};
use futures_util::StreamExt;
use serde_json::{json, Value};

mod common;
use common::{client, engine};

/// A ready server on an ephemeral loopback port; its `/v1/messages` URL
/// and its state.
async fn start(ctx: usize, api_key: Option<&str>) -> (String, Arc<encore_serve::State>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/messages", listener.local_addr().unwrap());
    let limits = encore_serve::Limits {
        api_key: api_key.map(str::to_string),
        ..encore_serve::Limits::default()
    };
    let state = encore_serve::State::new("smollm2-135m", limits);
    let scheduler = Scheduler::start(engine(), SchedulerConfig::new(4, ctx)).unwrap();
    state.ready(engine(), Arc::new(scheduler));
    tokio::spawn(encore_serve::serve(
        listener,
        state.clone(),
        std::future::pending(),
    ));
    (url, state)
}

async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// A greedy request of one user turn, with `extra` fields set over it.
fn message(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": "smollm2-135m",
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The text of an answer's text blocks.
fn text(answer: &Value) -> String {
    answer["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap())
        .collect()
}

/// A stream's events as (name, data), in order; each one's name is its
/// data's type.
async fn events(response: reqwest::Response) -> Vec<(String, Value)> {
    assert!(response.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut raw = String::new();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        raw.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    raw.split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            let data: Value = serde_json::from_str(data).unwrap();
            assert_eq!(data["type"], name, "{e}");
            Some((name.to_string(), data))
        })
        .collect()
}

async fn stream(url: &str, body: &Value) -> Vec<(String, Value)> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = client().post(url).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    events(r).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_answers_whole_and_streamed_in_anthropic_shapes() {
    let (url, _state) = start(1024, None).await;
    let question = message("What is the capital of France?", json!({"max_tokens": 24}));
    let (status, answer) = post(&url, &question).await;
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["id"].as_str().unwrap().starts_with("msg_"),
        "{answer}"
    );
    assert_eq!(answer["type"], "message");
    assert_eq!(answer["role"], "assistant");
    assert_eq!(answer["model"], "smollm2-135m");
    assert_eq!(answer["content"][0]["type"], "text");
    let said = text(&answer);
    assert!(!said.is_empty(), "{answer}");
    let reason = answer["stop_reason"].as_str().unwrap();
    assert!(matches!(reason, "end_turn" | "max_tokens"), "{answer}");
    assert_eq!(answer["stop_sequence"], Value::Null);
    let usage = &answer["usage"];
    assert!(usage["input_tokens"].as_u64().unwrap() > 5, "{answer}");
    assert!(usage["output_tokens"].as_u64().unwrap() > 0, "{answer}");
    // count_tokens counts the same prompt, no max_tokens needed.
    let mut count = question.clone();
    count.as_object_mut().unwrap().remove("max_tokens");
    let (status, counted) = post(&format!("{url}/count_tokens"), &count).await;
    assert_eq!(status, 200, "{counted}");
    assert_eq!(counted, json!({"input_tokens": usage["input_tokens"]}));

    // Streamed: Anthropic's events in Anthropic's order, the same text.
    let events = stream(&url, &question).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names.len() - 6;
    let mut expected = vec!["message_start", "content_block_start", "ping"];
    expected.extend(std::iter::repeat_n("content_block_delta", deltas));
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, expected);
    let start = &events[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["usage"]["input_tokens"], usage["input_tokens"]);
    assert_eq!(
        events[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let streamed: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["index"], 0);
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(streamed, said);
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], reason);
    assert_eq!(
        delta["usage"]["output_tokens"], usage["output_tokens"],
        "{delta}"
    );

    // The token limit: stop_reason max_tokens after exactly that many.
    let (status, short) = post(&url, &message("Tell me a story.", json!({"max_tokens": 3}))).await;
    assert_eq!(status, 200, "{short}");
    assert_eq!(short["stop_reason"], "max_tokens", "{short}");
    assert_eq!(short["usage"]["output_tokens"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_system_prompt_and_stop_sequences_are_honoured() {
    let (url, _state) = start(1024, None).await;
    let ask = "Name three colours.";
    let (_, plain) = post(&url, &message(ask, json!({}))).await;
    // A system prompt, as a string or as text blocks, is the conversation's
    // system message, as the OpenAI route renders one.
    let system = "You answer in French.";
    let (status, as_string) = post(&url, &message(ask, json!({"system": system}))).await;
    assert_eq!(status, 200, "{as_string}");
    let blocks = json!({"system": [{"type": "text", "text": system}]});
    let (status, as_blocks) = post(&url, &message(ask, blocks)).await;
    assert_eq!(status, 200, "{as_blocks}");
    let chat = url.replace("/v1/messages", "/v1/chat/completions");
    let openai = json!({
        "model": "smollm2-135m", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": ask}],
    });
    let (status, openai) = post(&chat, &openai).await;
    assert_eq!(status, 200, "{openai}");
    let tokens = |a: &Value| a["usage"]["input_tokens"].as_u64().unwrap();
    assert_ne!(text(&as_string), text(&plain), "{as_string} vs {plain}");
    assert_eq!(tokens(&as_string), tokens(&as_blocks));
    assert_eq!(text(&as_string), text(&as_blocks));
    assert_eq!(
        Some(tokens(&as_string)),
        openai["usage"]["prompt_tokens"].as_u64()
    );
    assert_eq!(
        text(&as_string),
        openai["choices"][0]["message"]["content"].as_str().unwrap()
    );

    // A stop sequence from the middle of the greedy answer ends it just
    // before its first appearance, and is named.
    let long = message("Write a sentence about the sea.", json!({"max_tokens": 32}));
    let (_, full) = post(&url, &long).await;
    let full = text(&full);
    let words: Vec<&str> = full.split_whitespace().collect();
    assert!(words.len() > 3, "{full:?}");
    let stop = words[words.len() / 2];
    let at = full.find(stop).unwrap();
    let mut cut = long.clone();
    cut["stop_sequences"] = json!(["never-appears-here", stop]);
    let (status, answer) = post(&url, &cut).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["stop_reason"], "stop_sequence", "{answer}");
    assert_eq!(answer["stop_sequence"], stop);
    assert_eq!(text(&answer), full[..at]);
    // Streamed, the stop sequence comes in the message delta.
    let events = stream(&url, &cut).await;
    let delta = &events[events.len() - 2].1;
    assert_eq!(
        delta["delta"],
        json!({"stop_reason": "stop_sequence", "stop_sequence": stop})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_use_round_trip() {
    let (url, _state) = start(1024, None).await;
    let tools = json!([{
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                         "required": ["city"]},
    }]);
    let question = json!({"role": "user", "content": "What is the weather in Paris?"});
    let ask = json!({
        "model": "smollm2-135m", "max_tokens": 48, "temperature": 0,
        "messages": [question], "tools": tools, "tool_choice": {"type": "any"},
        "metadata": {"user_id": "someone"},
    });
    let (status, answer) = post(&url, &ask).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["stop_reason"], "tool_use", "{answer}");
    let call = answer["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .cloned()
        .unwrap();
    assert!(call["id"].as_str().unwrap().starts_with("toolu_"), "{call}");
    assert_eq!(call["name"], "get_weather");
    assert!(call["input"]["city"].is_string(), "{call}");
    let (status, counted) = post(&format!("{url}/count_tokens"), &ask).await;
    assert_eq!(status, 200, "{counted}");
    assert_eq!(counted["input_tokens"], answer["usage"]["input_tokens"]);

    // Streamed: a tool_use block whose input arrives as JSON deltas.
    let events = stream(&url, &ask).await;
    assert_eq!(events[0].0, "message_start");
    assert_eq!(events.last().unwrap().0, "message_stop");
    let (index, block) = events
        .iter()
        .find_map(|(_, d)| {
            (d["type"] == "content_block_start" && d["content_block"]["type"] == "tool_use")
                .then(|| (d["index"].clone(), d["content_block"].clone()))
        })
        .unwrap();
    assert_eq!(block["name"], "get_weather");
    assert_eq!(block["input"], json!({}));
    let partial: String = events
        .iter()
        .filter(|(n, d)| n == "content_block_delta" && d["index"] == index)
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "input_json_delta");
            d["delta"]["partial_json"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&partial).unwrap(),
        call["input"]
    );
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");

    // The tool's result continues the conversation to a text answer; the
    // call and its result are part of the prompt.
    let next = json!({
        "model": "smollm2-135m", "max_tokens": 24, "temperature": 0, "tools": tools,
        "messages": [
            question,
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": "Sunny, 21 degrees."},
            ]},
        ],
    });
    let (status, after) = post(&url, &next).await;
    assert_eq!(status, 200, "{after}");
    assert!(
        after["usage"]["input_tokens"].as_u64().unwrap()
            > answer["usage"]["input_tokens"].as_u64().unwrap() + 10,
        "{after}"
    );
    assert!(matches!(
        after["stop_reason"].as_str(),
        Some("end_turn" | "max_tokens" | "tool_use")
    ));
    // A named tool is called by name; `none` offers no tools.
    let mut named = ask.clone();
    named["tool_choice"] = json!({"type": "tool", "name": "get_weather"});
    let (status, answer) = post(&url, &named).await;
    assert_eq!((status, &answer["stop_reason"]), (200, &json!("tool_use")));
    let mut none = ask.clone();
    none["tool_choice"] = json!({"type": "none"});
    let (status, answer) = post(&url, &none).await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer["content"]
        .as_array()
        .unwrap()
        .iter()
        .all(|b| b["type"] == "text"));
}

/// Whether `body` is an Anthropic error of `kind` whose message says `says`.
fn anthropic_error(body: &Value, kind: &str, says: &str) -> bool {
    body["type"] == "error"
        && body["error"]["type"] == kind
        && body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(says))
        && body.get("param").is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_anthropic_shaped_errors() {
    let (url, _state) = start(256, None).await;
    let turn = |m: Value| json!({"model": "smollm2-135m", "max_tokens": 8, "messages": [m]});
    let cases = [
        (
            json!({"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}),
            400,
            "invalid_request_error",
            "max_tokens: Field required",
        ),
        (
            turn(json!({"role": "wizard", "content": "hi"})),
            400,
            "invalid_request_error",
            "messages.0.role",
        ),
        (
            turn(json!({"role": "user", "content": [{"type": "image", "source": {}}]})),
            400,
            "invalid_request_error",
            "messages.0.content.0.type = \"image\"",
        ),
        (
            turn(json!({"role": "user", "content": [{"text": "no type"}]})),
            400,
            "invalid_request_error",
            "messages.0.content.0.type: Field required",
        ),
        (
            message("hi", json!({"max_tokens": 0})),
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            message("hi", json!({"max_tokens": "many"})),
            400,
            "invalid_request_error",
            "invalid type: string \"many\"",
        ),
        (
            message("hi", json!({"messages": []})),
            400,
            "invalid_request_error",
            "at least one message",
        ),
        (
            message("hi", json!({"stop_sequences": vec!["x"; 17]})),
            400,
            "invalid_request_error",
            "stop_sequences",
        ),
        (
            message("hi", json!({"tool_choice": {"type": "any"}})),
            400,
            "invalid_request_error",
            "no tools",
        ),
        (
            message(
                "hi",
                json!({"tools": [{"name": "bad name!", "input_schema": {}}]}),
            ),
            400,
            "invalid_request_error",
            "tools.0.name",
        ),
        (
            message("hi", json!({"model": "claude-opus"})),
            404,
            "not_found_error",
            "claude-opus",
        ),
        (
            message(&"many words ".repeat(200), json!({})),
            400,
            "invalid_request_error",
            "context",
        ),
    ];
    for (body, status, kind, says) in cases {
        let (got, answer) = post(&url, &body).await;
        assert_eq!(got, status, "{body} -> {answer}");
        assert!(anthropic_error(&answer, kind, says), "{body} -> {answer}");
    }
    let raw = client()
        .post(&url)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400);
    let body: Value = raw.json().await.unwrap();
    assert!(
        anthropic_error(&body, "invalid_request_error", "not valid JSON"),
        "{body}"
    );
    // Errors from outside the handler take Anthropic's shape too.
    let get = client().get(&url).send().await.unwrap();
    assert_eq!(get.status().as_u16(), 405);
    let body: Value = get.json().await.unwrap();
    assert!(
        anthropic_error(&body, "invalid_request_error", "GET"),
        "{body}"
    );
    // The OpenAI routes keep OpenAI's shape.
    let chat = url.replace("/v1/messages", "/v1/chat/completions");
    let (status, body) = post(&chat, &json!({"model": "smollm2-135m", "messages": []})).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(body.get("type").is_none(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_taken_from_x_api_key() {
    let (url, _state) = start(256, Some("s3cret")).await;
    let body = message("hi", json!({"max_tokens": 2}));
    let send = |key: Option<(&'static str, &'static str)>| {
        let mut r = client().post(&url).json(&body);
        if let Some((name, value)) = key {
            r = r.header(name, value);
        }
        r.send()
    };
    let ok = send(Some(("x-api-key", "s3cret"))).await.unwrap();
    assert_eq!(ok.status().as_u16(), 200);
    let ok = send(Some(("authorization", "Bearer s3cret")))
        .await
        .unwrap();
    assert_eq!(ok.status().as_u16(), 200);
    for key in [None, Some(("x-api-key", "wrong"))] {
        let refused = send(key).await.unwrap();
        assert_eq!(refused.status().as_u16(), 401);
        let body: Value = refused.json().await.unwrap();
        assert!(
            anthropic_error(&body, "authentication_error", "API key"),
            "{body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_a_stream_frees_its_sequence() {
    let (url, state) = start(2048, None).await;
    let body = message(
        "Write a very long story.",
        json!({"max_tokens": 1500, "stream": true}),
    );
    let r = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut body = r.bytes_stream();
    for _ in 0..3 {
        body.next().await.unwrap().unwrap();
    }
    drop(body);
    let m = state.get().unwrap().scheduler.metrics();
    let gone = async {
        while m.running.load(Ordering::Relaxed) != 0
            || m.kv_blocks_used.load(Ordering::Relaxed) != 0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), gone)
        .await
        .expect("the sequence was not cancelled");
    assert!(m.generated_tokens.load(Ordering::Relaxed) < 1500);
}
