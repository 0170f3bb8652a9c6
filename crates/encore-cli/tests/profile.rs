//! Profiles, traces and the one-shot capture through the `encore` binary, on
//! the tiny synthetic model.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use serde_json::Value;

/// A directory of its own for each test's files, holding the tiny model.
fn scratch(test: &str) -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("profile")
        .join(test);
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    std::fs::write(&model, synthetic_gguf(&SyntheticSpec::tiny(1))).unwrap();
    (dir, model)
}

/// `encore generate` greedily for 8 tokens of "hi", with `env` set and the
/// profile and capture variables otherwise cleared.
fn generate(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_encore"));
    for var in ["ENCORE_PROFILE", "ENCORE_CAPTURE", "ENCORE_CAPTURE_AT"] {
        cmd.env_remove(var);
    }
    let out = cmd
        .envs(env.iter().copied())
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--device", "cpu", "--temperature", "0", "--raw", "-n", "8"])
        .args(extra)
        .arg("hi")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "encore generate {extra:?} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn complete<'a>(json: &'a Value, cat: &str) -> Vec<&'a Value> {
    json["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == cat)
        .collect()
}

/// The table rows under the heading that contains `title`.
fn section<'a>(stderr: &'a str, title: &str) -> Vec<&'a str> {
    stderr
        .lines()
        .skip_while(|l| !(l.starts_with("encore profile:") && l.contains(title)))
        .skip(2)
        .take_while(|l| l.starts_with("  "))
        .collect()
}

#[test]
fn profile_dispatches_lists_counters_submissions_kernels_and_labels() {
    let (_, model) = scratch("dispatches");
    let out = generate(&model, &["--profile", "dispatches"], &[]);
    let err = stderr(&out);
    assert!(
        section(&err, "counters")
            .iter()
            .any(|l| l.contains("graph_replays")),
        "{err}"
    );
    let submissions = section(&err, "submissions by label");
    assert!(
        submissions.iter().any(|l| l.contains("graph replay")),
        "{err}"
    );
    assert!(submissions.iter().any(|l| l.contains("prefill")), "{err}");
    let kernels = section(&err, "dispatches by kernel");
    for kernel in ["matmul", "rms_norm", "attention", "rope", "argmax"] {
        assert!(
            kernels
                .iter()
                .any(|l| l.split_whitespace().next() == Some(kernel)),
            "no {kernel} row\n{err}"
        );
    }
    // Sorted by total time: the share column never increases down the table.
    let shares: Vec<f64> = kernels
        .iter()
        .filter_map(|l| l.split_whitespace().find(|w| w.ends_with('%')))
        .filter_map(|w| w.trim_end_matches('%').parse().ok())
        .collect();
    assert!(shares.len() >= 5, "{err}");
    assert!(shares.windows(2).all(|w| w[0] >= w[1]), "{err}");
    let labels = section(&err, "dispatches by label");
    for label in ["attn_q", "ffn_down", "output"] {
        assert!(
            labels
                .iter()
                .any(|l| l.split_whitespace().next() == Some(label)),
            "{err}"
        );
    }
}

#[test]
fn profile_flag_overrides_the_environment_and_defaults_to_dispatches() {
    let (_, model) = scratch("override");
    let out = generate(
        &model,
        &["--profile", "counters"],
        &[("ENCORE_PROFILE", "dispatches")],
    );
    let err = stderr(&out);
    assert!(err.contains("counters"), "{err}");
    assert!(!err.contains("dispatches by kernel"), "{err}");

    let out = generate(&model, &[], &[("ENCORE_PROFILE", "submissions")]);
    let err = stderr(&out);
    assert!(err.contains("submissions by label"), "{err}");
    assert!(!err.contains("dispatches by kernel"), "{err}");

    // A bare `--profile` before another option means dispatches.
    let out = generate(&model, &["--profile", "--seed", "1"], &[]);
    assert!(stderr(&out).contains("dispatches by kernel"));

    let out = generate(&model, &[], &[]);
    assert!(!stderr(&out).contains("encore profile"));
}

#[test]
fn trace_holds_host_phases_replays_and_every_dispatch() {
    let (dir, model) = scratch("trace");
    let path = dir.join("trace.json");
    generate(&model, &["--trace", path.to_str().unwrap()], &[]);
    let json = read_json(&path);
    let host: Vec<&str> = complete(&json, "host")
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for phase in [
        "load",
        "generate",
        "tokenize",
        "prefill",
        "sampling",
        "greedy decode",
    ] {
        assert!(host.contains(&phase), "no {phase} span in {host:?}");
    }
    // 8 tokens: the prefill yields the first, 7 greedy steps on the device
    // the rest, queued in one batch (one host span), in replays of several
    // steps while they fit and single steps after.
    let batches = host.iter().filter(|&&n| n == "greedy decode").count();
    let replays = complete(&json, "graph replay");
    assert_eq!(batches, 1);
    let per_replay = encore::Device::cpu()
        .unwrap()
        .capabilities()
        .steps_per_replay;
    assert_eq!(replays.len(), 7 / per_replay + 7 % per_replay);
    let submissions = complete(&json, "submission");
    assert!(submissions.iter().any(|e| e["name"] == "prefill"));
    let declared: u64 = replays
        .iter()
        .chain(&submissions)
        .map(|e| e["args"]["dispatches"].as_u64().unwrap())
        .sum();
    let dispatches = complete(&json, "dispatch");
    assert_eq!(dispatches.len() as u64, declared);
    for e in &dispatches {
        for arg in ["label", "op", "bytes"] {
            assert!(!e["args"][arg].is_null(), "{arg} missing in {e}");
        }
        // The CPU launches on no grid: its dispatches carry no geometry.
        for arg in ["grid", "block"] {
            assert!(e["args"][arg].is_null(), "{arg} on a CPU dispatch: {e}");
        }
    }
}

#[test]
fn capture_writes_one_decode_step_and_changes_nothing_else() {
    let (dir, model) = scratch("capture");
    let plain = generate(&model, &[], &[]);

    let path = dir.join("step3.json");
    let _ = std::fs::remove_file(&path);
    let captured = generate(
        &model,
        &[],
        &[
            ("ENCORE_CAPTURE", path.to_str().unwrap()),
            ("ENCORE_CAPTURE_AT", "3"),
        ],
    );
    assert_eq!(captured.stdout, plain.stdout);
    let json = read_json(&path);
    let replays = complete(&json, "graph replay");
    assert_eq!(replays.len(), 1);
    assert_eq!(replays[0]["args"]["replay"], 3);
    let nodes = replays[0]["args"]["dispatches"].as_u64().unwrap();
    assert_eq!(complete(&json, "dispatch").len() as u64, nodes);
    assert!(complete(&json, "submission").is_empty());
    assert!(complete(&json, "host").is_empty());

    let unwritable = generate(&model, &[], &[("ENCORE_CAPTURE", "/proc/nonexistent/x")]);
    assert_eq!(unwritable.stdout, plain.stdout);
    let err = stderr(&unwritable);
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(warnings[0].contains("/proc/nonexistent/x"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
