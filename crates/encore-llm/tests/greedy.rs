//! Greedy decoding on the device (`Session::decode_greedy`, steps fed by the
//! device-side argmax, tokens read back once per batch) against one step at
//! a time with the argmax read back after each, on a synthetic model.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{Config, Device};
use encore_llm::gguf::GgufFile;
use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use encore_llm::{Engine, EngineOptions, Session};

fn engine(graphs: bool) -> Engine {
    let file = GgufFile::from_bytes(synthetic_gguf(&SyntheticSpec::tiny(21))).unwrap();
    let options = EngineOptions {
        graphs,
        ..EngineOptions::default()
    };
    let device = Device::open("cpu", &Config::default()).unwrap();
    Engine::from_gguf(&file, &device, &options).unwrap()
}

const PROMPT: [u32; 5] = [3, 17, 4, 9, 30];

/// A session with the prompt prefilled, and the prompt's greedy next token.
fn prefilled(e: &Engine, room: usize) -> (Session, u32) {
    let mut s = e.session(PROMPT.len() + room).unwrap();
    let logits = s.prefill(&PROMPT).unwrap();
    (s, encore_llm::sampler::greedy(&logits))
}

/// `n` greedy tokens after `token`, one step and one readback at a time.
fn one_at_a_time(s: &mut Session, mut token: u32, n: usize) -> Vec<u32> {
    (0..n)
        .map(|_| {
            s.step(token).unwrap();
            token = s.argmax().unwrap();
            token
        })
        .collect()
}

fn check(graphs: bool) {
    let e = engine(graphs);
    let steps = 20;
    let (mut a, first) = prefilled(&e, steps + 4);
    let want = one_at_a_time(&mut a, first, steps);

    // Batches of 3 (the last one short): the same tokens, the same position.
    let (mut b, _) = prefilled(&e, steps + 4);
    let mut got = Vec::new();
    let n = b
        .decode_greedy(first, steps, 3, |t| {
            got.push(t);
            Ok(true)
        })
        .unwrap();
    assert_eq!((n, &got), (steps, &want), "graphs {graphs}");
    assert_eq!(b.position(), PROMPT.len() + steps);
    // The last step saw the same cache and input on both sessions (logits
    // depend on every position, so this checks more than the tokens).
    assert_eq!(a.logits().unwrap(), b.logits().unwrap(), "graphs {graphs}");
    // The device left the cache as the step-by-step session did.
    let (x, y) = (
        one_at_a_time(&mut a, want[steps - 1], 3),
        one_at_a_time(&mut b, want[steps - 1], 3),
    );
    assert_eq!(x, y, "graphs {graphs}: steps after decode_greedy");
    assert_eq!(a.logits().unwrap(), b.logits().unwrap());

    // Stopping early inside a batch: the position counts delivered tokens,
    // and decoding goes on correctly from there (the queued steps past the
    // stop are overwritten).
    let (mut c, _) = prefilled(&e, steps + 4);
    let mut seen = Vec::new();
    let n = c
        .decode_greedy(first, steps, 8, |t| {
            seen.push(t);
            Ok(seen.len() < 5)
        })
        .unwrap();
    assert_eq!((n, &seen[..]), (5, &want[..5]), "graphs {graphs}");
    assert_eq!(c.position(), PROMPT.len() + 5);
    let rest = one_at_a_time(&mut c, want[4], steps - 5);
    assert_eq!(rest, want[5..], "graphs {graphs}: after an early stop");
    let (mut r, _) = prefilled(&e, steps + 4);
    one_at_a_time(&mut r, first, steps);
    assert_eq!(c.logits().unwrap(), r.logits().unwrap());

    // The context bounds the steps.
    let (mut d, _) = prefilled(&e, 4);
    let n = d.decode_greedy(first, 100, 8, |_| Ok(true)).unwrap();
    assert_eq!(n, 4);
    assert_eq!(d.position(), d.capacity());
    assert_eq!(d.decode_greedy(first, 100, 8, |_| Ok(true)).unwrap(), 0);
}

#[test]
fn decode_greedy_equals_one_step_at_a_time_with_graph_replay() {
    check(true);
}

#[test]
fn decode_greedy_equals_one_step_at_a_time_eagerly() {
    check(false);
}

#[test]
fn a_callback_error_stops_decoding_and_is_returned() {
    let e = engine(true);
    let (mut s, first) = prefilled(&e, 10);
    let err = s
        .decode_greedy(first, 10, 4, |_| {
            Err(encore_llm::LlmError::Request("stop here".into()))
        })
        .unwrap_err();
    assert!(err.to_string().contains("stop here"), "{err}");
    assert_eq!(s.position(), PROMPT.len() + 1);
}
