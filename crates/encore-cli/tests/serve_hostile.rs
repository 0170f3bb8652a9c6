//! `encore serve` under careless and hostile clients, overload and faults,
//! on a loopback port over the default model on the CPU: every resource a
//! client can hold is bounded, every gauge is true when idle, every error
//! is in OpenAI's shape, and a cut answer never reads as a complete one.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod serve_common;

use std::io::{Read, Write};
use std::time::Duration;

use serde_json::{json, Value};
use serve_common::*;

const CHAT: &str = "/v1/chat/completions";

/// Checks every gauge of an idle server is 0.
fn assert_idle(server: &Server) {
    // A request's end reaches the gauges at the scheduler's next publish;
    // give it a moment before reading.
    let mut text = String::new();
    for _ in 0..100 {
        text = get(&server.addr, "/metrics").body;
        if metric(&text, "encore_running_sequences") == 0.0
            && metric(&text, "encore_requests_in_flight") == 0.0
            && metric(&text, "encore_open_connections") <= 1.0
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for gauge in [
        "encore_running_sequences",
        "encore_queue_depth",
        "encore_kv_blocks_used",
        "encore_requests_in_flight",
        "encore_prompts_tokenizing",
    ] {
        assert_eq!(
            metric(&text, gauge),
            0.0,
            "{gauge} on an idle server:\n{text}"
        );
    }
    // The connection that asks is the only one open.
    assert_eq!(metric(&text, "encore_open_connections"), 1.0, "{text}");
}

#[test]
fn gauges_are_true_when_idle_and_rejections_are_counted() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    assert_idle(&server);
    let answer = post(
        addr,
        CHAT,
        &chat("What is the capital of France?", json!({})),
    );
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["choices"][0]["finish_reason"], "length");
    assert_idle(&server);
    let streamed = post(addr, CHAT, &chat("Say hello.", json!({"stream": true})));
    assert_eq!(streamed.events().last().map(String::as_str), Some("[DONE]"));
    assert_idle(&server);
    // A client that hangs up mid-stream.
    let (stream, _) = start_stream(
        addr,
        &chat(
            "Write a long story.",
            json!({"stream": true, "max_tokens": 500}),
        ),
    );
    drop(stream);
    assert_idle(&server);

    // Refusals, each counted by its reason.
    let bad = send(addr, "POST", CHAT, &[], b"{not json");
    assert_eq!(bad.status, 400);
    let long = post(addr, CHAT, &chat(&"many words ".repeat(2000), json!({})));
    assert_eq!(long.status, 400);
    assert_eq!(long.error()["code"], "context_length_exceeded");
    let text = get(addr, "/metrics").body;
    assert_eq!(
        metric(
            &text,
            "encore_requests_rejected_total{reason=\"invalid_request\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "encore_requests_rejected_total{reason=\"context_length\"}"
        ),
        1.0
    );
    for name in [
        "encore_requests_cut_total{reason=\"shutdown\"}",
        "encore_requests_cut_total{reason=\"deadline\"}",
        "encore_requests_cut_total{reason=\"device_error\"}",
        "encore_device_errors_total",
    ] {
        assert_eq!(metric(&text, name), 0.0, "{name}\n{text}");
    }
    assert_eq!(metric(&text, "encore_healthy"), 1.0);
    assert_idle(&server);
}

#[test]
fn every_error_is_in_openai_shape() {
    let server = Server::start(&["--max-body-bytes", "100000"]);
    let addr = &server.addr;
    let missing = get(addr, "/v2/nothing");
    assert_eq!(missing.status, 404);
    missing.error();
    let wrong_method = get(addr, CHAT);
    assert_eq!(wrong_method.status, 405);
    assert!(wrong_method.error()["message"]
        .as_str()
        .unwrap()
        .contains("GET"));
    assert!(wrong_method.header("allow").is_some(), "{wrong_method:?}");
    let wrong_method = send(addr, "DELETE", "/health", &[], b"");
    assert_eq!(wrong_method.status, 405);
    wrong_method.error();
    // Over the body limit, announced by Content-Length...
    let big = chat(&"x".repeat(200_000), json!({}));
    let too_large = post(addr, CHAT, &big);
    assert_eq!(too_large.status, 413, "{too_large:?}");
    too_large.error();
    // ...and sent chunked, with no length announced.
    let mut stream = connect(addr);
    let body = big.to_string();
    let mut bytes = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .into_bytes();
    for piece in body.as_bytes().chunks(8192) {
        bytes.extend(format!("{:x}\r\n", piece.len()).as_bytes());
        bytes.extend(piece);
        bytes.extend(b"\r\n");
    }
    bytes.extend(b"0\r\n\r\n");
    let _ = stream.write_all(&bytes);
    let chunked = read_reply(&mut stream);
    assert_eq!(chunked.status, 413, "{chunked:?}");
    chunked.error();
    // Headers over the limit.
    let huge = "y".repeat(40_000);
    let headers = send(addr, "GET", "/v1/models", &[("X-Big", &huge)], b"");
    assert_eq!(headers.status, 431, "{headers:?}");
    headers.error();
    let many: Vec<(String, String)> = (0..150).map(|i| (format!("X-H{i}"), "v".into())).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let headers = send(addr, "GET", "/v1/models", &many, b"");
    assert_eq!(headers.status, 431, "{headers:?}");
    headers.error();
    // The server still serves.
    assert_eq!(get(addr, "/v1/models").status, 200);
}

#[test]
fn unimplemented_parameters_are_refused_by_name() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    for (extra, param) in [
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tools": [{"type": "function"}]}), "tools"),
        (json!({"best_of": 3}), "best_of"),
        (json!({"logit_bias": {"42": 5}}), "logit_bias"),
        (json!({"functions": [{"name": "f"}]}), "functions"),
    ] {
        let reply = post(addr, CHAT, &chat("hi", extra.clone()));
        assert_eq!(reply.status, 400, "{extra} -> {reply:?}");
        assert_eq!(reply.error()["param"], param, "{extra} -> {reply:?}");
    }
    // What Encore does is accepted.
    for extra in [
        json!({"response_format": {"type": "text"}}),
        json!({"response_format": {"type": "json_object"}}),
        json!({"logprobs": true, "top_logprobs": 2}),
        json!({"n": 2}),
        json!({"tool_choice": "none"}),
        json!({"tool_choice": "auto"}),
        json!({"best_of": 1}),
        json!({"logit_bias": {}}),
    ] {
        let reply = post(addr, CHAT, &chat("hi", extra.clone()));
        assert_eq!(reply.status, 200, "{extra} -> {reply:?}");
    }
    let reply = post(
        addr,
        "/v1/completions",
        &json!({"model": "smollm2-135m", "prompt": "Hi", "best_of": 2}),
    );
    assert_eq!(reply.status, 400);
    assert_eq!(reply.error()["param"], "best_of");
}

#[test]
fn oversized_prompts_are_refused_before_tokenizing_and_memory_comes_back() {
    let server = Server::start(&[]);
    let addr = server.addr.clone();
    // Warm the paths an oversized request takes, then measure.
    let words = "lorem ipsum dolor sit amet ".repeat(75_000);
    let body = chat(&words, json!({}));
    let first = post(&addr, CHAT, &body);
    assert_eq!(first.status, 400, "{first:?}");
    let error = first.error();
    assert_eq!(error["code"], "context_length_exceeded");
    // Told from its bytes: the message counts bytes, not tokens.
    assert!(
        error["message"].as_str().unwrap().contains("bytes"),
        "{error}"
    );
    let before = server.rss_kib();
    for _ in 0..4 {
        let clients: Vec<_> = (0..4)
            .map(|_| {
                let addr = addr.clone();
                let body = body.clone();
                std::thread::spawn(move || post(&addr, CHAT, &body).status)
            })
            .collect();
        // /health answers while they are refused.
        assert_eq!(get(&addr, "/health").status, 200);
        for c in clients {
            assert_eq!(c.join().unwrap(), 400);
        }
    }
    let after = server.rss_kib();
    assert!(
        after <= before + before / 10,
        "resident memory rose from {before} KiB to {after} KiB"
    );
    // A completion prompt too.
    let reply = post(
        &addr,
        "/v1/completions",
        &json!({"model": "smollm2-135m", "prompt": words}),
    );
    assert_eq!(reply.status, 400);
    assert_eq!(reply.error()["code"], "context_length_exceeded");
    assert_idle(&server);
}

#[test]
fn stalled_connections_are_closed() {
    let server = Server::start(&[
        "--header-timeout",
        "1",
        "--idle-timeout",
        "1",
        "--body-timeout",
        "1",
    ]);
    let addr = &server.addr;
    let limit = Duration::from_secs(15);
    // Nothing sent.
    let mut silent = connect(addr);
    // Half a header, then nothing.
    let mut half = connect(addr);
    half.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        .unwrap();
    // A header that trickles in, a byte at a time, never ending.
    let mut trickle = connect(addr);
    let trickler = {
        let mut t = trickle.try_clone().unwrap();
        std::thread::spawn(move || {
            let _ = t.write_all(b"GET /health HTTP/1.1\r\n");
            for _ in 0..40 {
                if t.write_all(b"X").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // A body shorter than announced.
    let mut short = connect(addr);
    short
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\
              Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":",
        )
        .unwrap();
    // A keep-alive connection left idle after its answer.
    let mut idle = connect(addr);
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    for (name, stream) in [
        ("silent", &mut silent),
        ("half header", &mut half),
        ("trickling header", &mut trickle),
        ("short body", &mut short),
        ("idle keep-alive", &mut idle),
    ] {
        let (closed, said) = closed_within(stream, limit);
        assert!(closed, "{name}: still open after {limit:?}; said {said:?}");
        if name == "short body" {
            let reply = parse(said.as_bytes());
            assert_eq!(reply.status, 408, "{said}");
            reply.error();
        }
        if name == "idle keep-alive" {
            assert!(said.starts_with("HTTP/1.1 200"), "{said}");
        }
    }
    trickler.join().unwrap();
    let text = get(addr, "/metrics").body;
    assert_eq!(metric(&text, "encore_open_connections"), 1.0, "{text}");
    assert_eq!(
        metric(
            &text,
            "encore_requests_rejected_total{reason=\"body_timeout\"}"
        ),
        1.0
    );
}

#[test]
fn connections_and_the_queue_are_bounded() {
    let server = Server::start(&[
        "--parallel",
        "1",
        "--max-queue",
        "1",
        "--max-connections",
        "4",
        "--idle-timeout",
        "60",
        "--header-timeout",
        "60",
    ]);
    let addr = &server.addr;
    let long = chat(
        "Write a long story.",
        json!({"stream": true, "max_tokens": 400, "ignore_eos": true}),
    );
    // One runs, one waits, the third finds the queue full.
    let (running, running_raw) = start_stream(addr, &long);
    let waiting = {
        let addr = addr.clone();
        let long = long.clone();
        std::thread::spawn(move || post(&addr, CHAT, &long))
    };
    let mut waited = false;
    for _ in 0..200 {
        if server.metric("encore_requests_in_flight") == 2.0 {
            waited = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(waited, "the second request never queued");
    let full = post(addr, CHAT, &long);
    assert_eq!(full.status, 503, "{full:?}");
    assert_eq!(full.error()["code"], "queue_full");
    assert!(full.header("retry-after").is_some(), "{full:?}");
    // Connections over the cap are answered 503 and closed: two are in
    // use, two more fill the cap.
    let _a = connect(addr);
    let _b = connect(addr);
    std::thread::sleep(Duration::from_millis(200));
    let mut over = connect(addr);
    let (closed, said) = closed_within(&mut over, Duration::from_secs(10));
    assert!(closed, "{said}");
    let reply = parse(said.as_bytes());
    assert_eq!(reply.status, 503, "{said}");
    assert!(reply.header("retry-after").is_some());
    reply.error();
    drop((_a, _b));
    let done = finish_stream(running, running_raw);
    assert_eq!(done.events().last().map(String::as_str), Some("[DONE]"));
    let queued = waiting.join().unwrap();
    assert_eq!(queued.events().last().map(String::as_str), Some("[DONE]"));
    let text = get(addr, "/metrics").body;
    assert_eq!(
        metric(
            &text,
            "encore_requests_rejected_total{reason=\"queue_full\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "encore_requests_rejected_total{reason=\"too_many_connections\"}"
        ),
        1.0
    );
}

#[test]
fn a_deadline_cancels_the_request_and_frees_its_blocks() {
    let server = Server::start(&["--request-timeout", "600"]);
    let addr = &server.addr;
    let long = chat(
        "Write a long story.",
        json!({"max_tokens": 900, "ignore_eos": true}),
    );
    let body = long.to_string();
    let timeout = [("X-Request-Timeout", "0.5")];
    let reply = send(addr, "POST", CHAT, &timeout, body.as_bytes());
    assert_eq!(reply.status, 504, "{reply:?}");
    assert_eq!(reply.error()["code"], "deadline_exceeded");
    // Streaming: the stream ends with an error event, no finish reason, no
    // [DONE].
    let mut streaming = long.clone();
    streaming["stream"] = json!(true);
    let reply = send(
        addr,
        "POST",
        CHAT,
        &[("X-Request-Timeout", "1.5")],
        streaming.to_string().as_bytes(),
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    let events = reply.events();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "deadline_exceeded", "{events:?}");
    assert!(!reply.body.contains("\"finish_reason\":\"stop\""));
    assert!(!reply.body.contains("[DONE]"));
    let bad = send(
        addr,
        "POST",
        CHAT,
        &[("X-Request-Timeout", "soon")],
        body.as_bytes(),
    );
    assert_eq!(bad.status, 400);
    assert_idle(&server);
    assert_eq!(
        server.metric("encore_requests_cut_total{reason=\"deadline\"}"),
        2.0
    );
}

#[test]
fn shutdown_cuts_answers_honestly_and_refuses_queued_requests() {
    let mut server = Server::start(&["--parallel", "1", "--shutdown-grace", "1"]);
    let addr = server.addr.clone();
    let long = chat(
        "Write a long story.",
        json!({"stream": true, "max_tokens": 1000, "ignore_eos": true}),
    );
    let (running, raw) = start_stream(&addr, &long);
    let queued = {
        let addr = addr.clone();
        let mut body = long.clone();
        body["stream"] = json!(false);
        std::thread::spawn(move || post(&addr, CHAT, &body))
    };
    for _ in 0..200 {
        if server.metric("encore_requests_in_flight") == 2.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    server.terminate();
    let queued = queued.join().unwrap();
    assert_eq!(queued.status, 503, "{queued:?}");
    assert_eq!(queued.error()["code"], "shutting_down");
    let cut = finish_stream(running, raw);
    let events = cut.events();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "shutting_down", "{events:?}");
    assert!(
        !cut.body.contains("\"finish_reason\":\"stop\""),
        "{events:?}"
    );
    assert!(!cut.body.contains("[DONE]"));
    let status = server.wait(Duration::from_secs(60));
    assert!(status.success(), "{status}: {}", server.log());
}

#[test]
fn the_api_key_guards_every_route_but_health() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve_hostile");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("key");
    std::fs::write(&file, "s3cret-key\n").unwrap();
    let server = Server::start(&["--api-key-file", file.to_str().unwrap()]);
    let addr = &server.addr;
    assert_eq!(get(addr, "/health").status, 200);
    for path in ["/v1/models", "/metrics", "/nowhere"] {
        let reply = get(addr, path);
        assert_eq!(reply.status, 401, "{path}: {reply:?}");
        assert_eq!(reply.error()["code"], "invalid_api_key");
    }
    let wrong = send(
        addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer s3cret-kez")],
        b"",
    );
    assert_eq!(wrong.status, 401);
    wrong.error();
    let body = chat("hi", json!({})).to_string();
    let unauthorized = send(addr, "POST", CHAT, &[], body.as_bytes());
    assert_eq!(unauthorized.status, 401);
    let right = [("Authorization", "Bearer s3cret-key")];
    assert_eq!(send(addr, "GET", "/v1/models", &right, b"").status, 200);
    let answer = send(addr, "POST", CHAT, &right, body.as_bytes());
    assert_eq!(answer.status, 200, "{answer:?}");
    let metrics = send(addr, "GET", "/metrics", &right, b"").body;
    assert_eq!(
        metric(
            &metrics,
            "encore_requests_rejected_total{reason=\"unauthorized\"}"
        ),
        5.0
    );
}

#[test]
fn binding_beyond_loopback_without_a_key_warns() {
    let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_encore"))
        .args([
            "serve", "--device", "cpu", "--port", "0", "--host", "0.0.0.0",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(server.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() == 0 {
            break;
        }
        seen.push_str(&line);
        if line.contains("listening on") {
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        seen.contains("warning: listening on 0.0.0.0 without an API key"),
        "{seen}"
    );
}

#[test]
fn a_device_error_fails_its_requests_and_the_server_exits_unhealthy() {
    let mut server = Server::start(&["--inject-fault-at-step", "24"]);
    let addr = server.addr.clone();
    let reply = post(
        &addr,
        CHAT,
        &chat(
            "Write a long story.",
            json!({"stream": true, "max_tokens": 200, "ignore_eos": true}),
        ),
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    let events = reply.events();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "device_error", "{events:?}");
    assert!(last["error"]["message"]
        .as_str()
        .unwrap()
        .contains("device error"));
    assert!(!reply.body.contains("[DONE]"));
    // The server drains and exits with a failure; until it is gone,
    // /health says it is unhealthy.
    let health = std::net::TcpStream::connect(&addr).ok().and_then(|mut s| {
        let _ = s.write_all(&request_bytes("GET", "/health", &[], b""));
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        // A server already on its way out may close without a reply.
        (!raw.is_empty()).then(|| parse(&raw))
    });
    if let Some(health) = health.filter(|h| !h.body.is_empty()) {
        assert_eq!(health.status, 503, "{health:?}");
    }
    let status = server.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(1), "{}", server.log());
    assert!(server.log().contains("device error"), "{}", server.log());
}
