//! A bounded soak of `encore serve` on the CPU: 32 streaming clients that
//! disconnect at random, with oversized, malformed and half-sent requests
//! mixed in. Afterwards every gauge is 0, open file descriptors and
//! resident memory are back within 10% of their values after a warm-up
//! round, and every completed answer equals the same request's answer
//! alone (temperature 0).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod serve_common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serve_common::*;

const CLIENTS: usize = 32;
const CHAT: &str = "/v1/chat/completions";
const PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea.",
    "Count from one to ten.",
];

fn request(prompt: usize) -> Value {
    chat(
        PROMPTS[prompt],
        json!({"stream": true, "max_tokens": 24, "temperature": 0}),
    )
}

/// The text of a completed stream, or why it is not one.
fn streamed_text(reply: &Reply) -> Result<String, String> {
    let events = reply.events();
    if reply.status != 200 || events.last().map(String::as_str) != Some("[DONE]") {
        return Err(format!("{reply:?}"));
    }
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(e).map_err(|e| e.to_string())?;
        if let Some(t) = chunk["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    Ok(text)
}

/// A tiny deterministic generator for each client's choices.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// One client's rounds; returns the completed answers as (prompt, text).
fn client(addr: &str, id: usize, rounds: usize) -> Vec<(usize, String)> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((id as u64 + 1) * 0x1000_0001));
    let mut answers = Vec::new();
    let mut half_open = Vec::new();
    for _ in 0..rounds {
        let prompt = rng.below(PROMPTS.len() as u64) as usize;
        match rng.below(20) {
            // A complete stream.
            0..=11 => {
                let reply = post(addr, CHAT, &request(prompt));
                let text = streamed_text(&reply).unwrap_or_else(|e| panic!("client {id}: {e}"));
                answers.push((prompt, text));
            }
            // A client that hangs up after the first event.
            12..=14 => {
                let (stream, _) = start_stream(addr, &request(prompt));
                drop(stream);
            }
            // Over the body limit.
            15 => {
                let reply = post(addr, CHAT, &chat(&"z".repeat(300_000), json!({})));
                assert_eq!(reply.status, 413, "client {id}: {reply:?}");
            }
            // Far over the context.
            16 => {
                let reply = post(addr, CHAT, &chat(&"word ".repeat(30_000), json!({})));
                assert_eq!(reply.status, 400, "client {id}: {reply:?}");
            }
            // Malformed.
            17 => {
                let reply = send(addr, "POST", CHAT, &[], b"{\"model\": [1, 2");
                assert_eq!(reply.status, 400, "client {id}: {reply:?}");
            }
            // Half a request, left hanging until the end of the client's
            // rounds.
            _ => {
                let mut s = connect(addr);
                let _ = s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"mo");
                half_open.push(s);
            }
        }
    }
    // The server has closed the half-open ones by now, or will shortly.
    for mut s in half_open {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    answers
}

/// Runs every client for `rounds` rounds at once.
fn round(addr: &str, rounds: usize, salt: usize) -> Vec<(usize, String)> {
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let addr = addr.to_string();
            std::thread::spawn(move || client(&addr, i + salt * CLIENTS, rounds))
        })
        .collect();
    clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect()
}

/// Waits until the server is idle, then returns its /metrics text.
fn idle(server: &Server) -> String {
    let started = Instant::now();
    loop {
        let text = get(&server.addr, "/metrics").body;
        let busy: f64 = [
            "encore_running_sequences",
            "encore_queue_depth",
            "encore_kv_blocks_used",
            "encore_requests_in_flight",
            "encore_prompts_tokenizing",
        ]
        .iter()
        .map(|g| metric(&text, g))
        .sum();
        if busy == 0.0 && metric(&text, "encore_open_connections") == 1.0 {
            return text;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not idle after the soak:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn thirty_two_hostile_streaming_clients_leave_nothing_behind() {
    let server = Server::start(&[
        "--parallel",
        "8",
        "-c",
        "512",
        "--max-body-bytes",
        "200000",
        "--header-timeout",
        "2",
        "--idle-timeout",
        "1",
        "--body-timeout",
        "2",
    ]);
    let addr = server.addr.clone();
    let alone: Vec<String> = (0..PROMPTS.len())
        .map(|p| streamed_text(&post(&addr, CHAT, &request(p))).unwrap())
        .collect();
    // Warm-up: a round of the same traffic.
    round(&addr, 3, 0);
    idle(&server);
    let (fds, rss) = (server.fds(), server.rss_kib());
    let started = Instant::now();
    let mut answers = Vec::new();
    let mut salt = 1;
    while started.elapsed() < Duration::from_secs(60) && salt <= 4 {
        answers.extend(round(&addr, 3, salt));
        salt += 1;
    }
    assert!(!answers.is_empty());
    for (prompt, text) in &answers {
        assert_eq!(text, &alone[*prompt], "prompt {prompt} in the crowd");
    }
    let text = idle(&server);
    let (fds_after, rss_after) = (server.fds(), server.rss_kib());
    assert!(
        fds_after <= fds + fds / 10,
        "open file descriptors: {fds} after warm-up, {fds_after} after the soak"
    );
    assert!(
        rss_after <= rss + rss / 10,
        "resident memory: {rss} KiB after warm-up, {rss_after} KiB after the soak"
    );
    assert_eq!(metric(&text, "encore_healthy"), 1.0);
    assert!(
        metric(
            &text,
            "encore_requests_rejected_total{reason=\"body_too_large\"}"
        ) > 0.0
    );
}
