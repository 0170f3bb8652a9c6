//! Long decodes do not leak.
//!
//! - A session that fills its 1,024-position window, resets and keeps
//!   stepping runs 10,000 decode steps with the device pool's live bytes
//!   exactly where they were after its first windows, and the process's
//!   resident set within a small slack.
//! - A session with room for 10,001 positions decodes 10,000 steps with the
//!   device pool's live bytes constant. Its resident set is not checked: the
//!   KV cache's pages are first touched as positions fill, and the CPU
//!   attention's per-thread scratch grows with the context, both by design.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{Config, Device};
use encore_llm::gguf::GgufFile;
use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use encore_llm::{Model, Session};
use encore_ops::KernelSet;

const STEPS: usize = 10_000;
const WINDOW: usize = 1024;
/// Resident-set growth allowed for the allocator's own bookkeeping.
const RSS_SLACK_BYTES: u64 = 2 << 20;

/// The process's resident set, from `/proc/self/statm` (in pages).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * page_size()
}

/// The page size, from the kernel's `KernelPageSize` of the first mapping.
fn page_size() -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    smaps
        .lines()
        .find_map(|l| l.strip_prefix("KernelPageSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(4096, |kb| kb * 1024)
}

/// A session of `max_seq` positions on the tiny synthetic model.
fn session(device: &str, max_seq: usize, graphs: bool) -> (Device, Session) {
    let spec = SyntheticSpec {
        context_length: max_seq,
        ..SyntheticSpec::tiny(5)
    };
    let file = GgufFile::from_bytes(synthetic_gguf(&spec)).unwrap();
    let device = Device::open(device, &Config::default()).unwrap();
    let model = Model::load(&file, &device, KernelSet::Default).unwrap();
    let session = Session::new(model, max_seq, graphs).unwrap();
    (device, session)
}

/// One decode step, starting over when the session is full; returns the
/// greedy next token, after reading the logits too when `read_logits`.
fn step(session: &mut Session, token: u32, read_logits: bool) -> u32 {
    if session.position() == session.capacity() {
        assert!(
            session.step(token).is_err(),
            "a full session must refuse a step"
        );
        session.reset();
    }
    session.step(token).unwrap();
    if read_logits {
        assert_eq!(
            session.logits().unwrap().len(),
            session.model().config.vocab
        );
    }
    session.argmax().unwrap()
}

fn windowed_decode(device: &str, graphs: bool) {
    let (device, mut session) = session(device, WINDOW, graphs);
    let mut token = 1;
    // Two full windows: every buffer, graph and scratch exists at full size.
    for i in 0..2 * WINDOW {
        token = step(&mut session, token, i % 7 == 0);
    }
    let live = device.pool_stats().live_bytes;
    let resident = resident_bytes();
    let mut most_live = live;
    for i in 0..STEPS {
        token = step(&mut session, token, i % 97 == 0);
        if i % 250 == 0 {
            most_live = most_live.max(device.pool_stats().live_bytes);
        }
    }
    let end_live = device.pool_stats().live_bytes;
    assert_eq!(
        (most_live, end_live),
        (live, live),
        "device live bytes grew (graphs {graphs})"
    );
    let grown = resident_bytes().saturating_sub(resident);
    assert!(
        grown <= RSS_SLACK_BYTES,
        "resident set grew by {grown} bytes over {STEPS} steps (graphs {graphs})"
    );
}

fn long_context_decode(device: &str) {
    let (device, mut session) = session(device, STEPS + 1, true);
    session.prefill(&[1]).unwrap();
    let mut token = 2;
    for i in 0..16 {
        token = step(&mut session, token, i % 2 == 0);
    }
    let live = device.pool_stats().live_bytes;
    let mut most_live = live;
    for i in 16..STEPS {
        token = step(&mut session, token, i % 97 == 0);
        if i % 250 == 0 {
            most_live = most_live.max(device.pool_stats().live_bytes);
        }
    }
    assert_eq!(session.position(), STEPS + 1);
    let end_live = device.pool_stats().live_bytes;
    assert_eq!(
        (most_live, end_live),
        (live, live),
        "device live bytes grew"
    );
}

#[test]
fn ten_thousand_steps_do_not_grow_memory() {
    // One test, so that no other test allocates in this process meanwhile.
    windowed_decode("cpu", true);
    windowed_decode("cpu", false);
    long_context_decode("cpu");
}

#[test]
#[ignore = "needs a CUDA GPU; run with scripts/gpu-suite.sh"]
fn ten_thousand_steps_on_cuda_do_not_grow_memory() {
    windowed_decode("cuda", true);
    windowed_decode("cuda", false);
    long_context_decode("cuda");
}
