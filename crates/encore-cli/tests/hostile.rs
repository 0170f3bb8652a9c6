//! Hostile command lines, environments and outputs through the `encore`
//! binary, on the tiny synthetic model: no input may make it panic or
//! abort. A value out of range ends it with status 1 and one `error: ` line
//! naming the flag or variable and its range; an output that cannot be
//! written is an error too, except a closed pipe, which ends it quietly
//! with status 0.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

mod common;

use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};

/// The tiny model, written once per test under a directory of its own.
fn model(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("hostile")
        .join(test);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    std::fs::write(&path, synthetic_gguf(&SyntheticSpec::tiny(1))).unwrap();
    path
}

/// The tiny model's context length.
fn context() -> usize {
    SyntheticSpec::tiny(1).context_length
}

/// `encore ARGS` with every `ENCORE_*` variable cleared, then `env` set.
fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_encore"));
    for (var, _) in std::env::vars() {
        if var.starts_with("ENCORE_") {
            cmd.env_remove(var);
        }
    }
    cmd.envs(env.iter().copied()).args(args);
    cmd
}

/// `command --model MODEL`, then each flag of `defaults` that `extra` does
/// not give, then `extra`.
fn with_defaults<'a>(
    command: &'a str,
    model: &'a Path,
    defaults: [(&'a str, &'a str); 2],
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![command, "--model", model.to_str().unwrap()];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend(extra);
    args
}

/// `encore generate` of 4 tokens on the CPU, with `extra` before the prompt.
fn generate_args<'a>(model: &'a Path, extra: &[&'a str], prompt: &'a str) -> Vec<&'a str> {
    let mut args = with_defaults("generate", model, [("--device", "cpu"), ("-n", "4")], extra);
    args.push(prompt);
    args
}

/// `encore bench` of one repeat on the CPU, with `extra`.
fn bench_args<'a>(model: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    with_defaults(
        "bench",
        model,
        [("--device", "cpu"), ("--repeats", "1")],
        extra,
    )
}

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    command(args, env).output().unwrap()
}

fn describe(args: &[&str], env: &[(&str, &str)], out: &Output) -> String {
    format!(
        "encore {args:?} with {env:?}: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Checks the process ended by itself, without a panic.
fn assert_no_panic(out: &Output, context: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code().is_some(), "killed by a signal\n{context}");
    assert_ne!(out.status.code(), Some(101), "panic status\n{context}");
    assert!(!stderr.contains("panicked"), "panic\n{context}");
    assert!(!stderr.contains("memory allocation"), "abort\n{context}");
}

/// Checks `out` failed with status 1, nothing on stdout and one error line
/// that contains every string of `expected`.
fn assert_error(out: &Output, expected: &[&str], context: &str) {
    assert_no_panic(out, context);
    assert_eq!(out.status.code(), Some(1), "want status 1\n{context}");
    assert!(out.stdout.is_empty(), "output on stdout\n{context}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    common::assert_one_error_line(&stderr, expected, context);
}

fn rejected(args: &[&str], env: &[(&str, &str)], expected: &[&str]) {
    let out = run(args, env);
    assert_error(&out, expected, &describe(args, env, &out));
}

fn accepted(args: &[&str], env: &[(&str, &str)]) -> Output {
    let out = run(args, env);
    let context = describe(args, env, &out);
    assert_no_panic(&out, &context);
    assert!(out.status.success(), "failed\n{context}");
    out
}

/// `encore ARGS` with /dev/full as stdout: every write fails with ENOSPC.
#[cfg(target_os = "linux")]
fn into_full_disk(args: &[&str]) {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let out = command(args, &[])
        .stdout(full)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_error(
        &out,
        &["error: writing to stdout: ", "No space left on device"],
        &describe(args, &[], &out),
    );
}

/// `encore ARGS` writing into a pipe whose read end is closed before it
/// writes: it must end quietly with status 0.
fn into_closed_pipe(args: &[&str]) {
    let mut child: Child = command(args, &[])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let context = describe(args, &[], &out);
    assert_no_panic(&out, &context);
    assert!(out.status.success(), "want status 0\n{context}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("error"), "not quiet\n{context}");
}

#[cfg(target_os = "linux")]
#[test]
fn stdout_on_a_full_disk_is_an_error() {
    let model = model("full_disk");
    into_full_disk(&generate_args(
        &model,
        &["--temperature", "0", "--raw"],
        "hi",
    ));
    into_full_disk(&["devices"]);
    into_full_disk(&bench_args(&model, &[]));
    into_full_disk(&bench_args(&model, &["--json"]));
    into_full_disk(&["--help"]);
    into_full_disk(&["--version"]);
}

#[test]
fn stdout_into_a_closed_pipe_ends_quietly() {
    let model = model("closed_pipe");
    into_closed_pipe(&generate_args(
        &model,
        &["--temperature", "0", "--raw", "-n", "64"],
        "hi",
    ));
    into_closed_pipe(&["devices"]);
    into_closed_pipe(&bench_args(&model, &[]));
    into_closed_pipe(&bench_args(&model, &["--json"]));
    into_closed_pipe(&["--help"]);
}

#[test]
fn sampling_settings_out_of_range_are_rejected() {
    let model = model("sampling");
    let cases: [(&str, &[&str], &str); 4] = [
        (
            "--temperature",
            &["nan", "NaN", "inf", "-1e9", "-0.5", "-1"],
            "finite number >= 0",
        ),
        (
            "--top-p",
            &["nan", "-1", "-0.1", "0", "1.5", "inf"],
            "(0, 1]",
        ),
        ("--min-p", &["nan", "-1", "-0.1", "1.01", "inf"], "[0, 1]"),
        (
            "--repeat-penalty",
            &["nan", "inf", "0", "-1", "-0.5"],
            "finite number > 0",
        ),
    ];
    for (flag, values, range) in cases {
        for value in values {
            let args = generate_args(&model, &[flag, value, "--raw"], "hi");
            rejected(&args, &[], &[flag, range]);
        }
        // A value clap would take for a flag, given with `=`.
        let joined = format!("{flag}=-inf");
        rejected(
            &generate_args(&model, &[&joined], "hi"),
            &[],
            &[flag, range],
        );
    }
}

#[test]
fn sampling_settings_at_their_range_ends_are_accepted() {
    let model = model("sampling_ends");
    for extra in [
        &["--temperature", "0", "--top-p", "1", "--min-p", "0"][..],
        &["--temperature", "1e30", "--top-p", "1e-30", "--min-p", "1"],
        &[
            "--repeat-penalty",
            "1e-30",
            "--top-k",
            "18446744073709551615",
        ],
        &[
            "--repeat-penalty",
            "3e38",
            "--top-k",
            "0",
            "--seed",
            "18446744073709551615",
        ],
    ] {
        accepted(&generate_args(&model, extra, "hi"), &[]);
    }
}

#[test]
fn token_counts_are_checked_against_the_context() {
    let model = model("counts");
    let ctx = context();
    let (over, ctx_text) = ((ctx + 1).to_string(), ctx.to_string());
    for n in [over.as_str(), "100000", "18446744073709551615"] {
        let args = generate_args(&model, &["-n", n, "--temperature", "0"], "hi");
        rejected(&args, &[], &["--n-predict", n, &format!("0 to {ctx}")]);
    }
    for n in ["0", ctx_text.as_str()] {
        accepted(
            &generate_args(&model, &["-n", n, "--temperature", "0"], "hi"),
            &[],
        );
    }

    let most_prompt = (ctx - 1).to_string();
    for p in ["0", ctx_text.as_str(), "100000", "18446744073709551615"] {
        let args = bench_args(&model, &["--prompt-tokens", p, "--gen-tokens", "1"]);
        rejected(
            &args,
            &[],
            &["--prompt-tokens", p, &format!("1 to {most_prompt}")],
        );
    }
    for g in ["0", "129", "18446744073709551615", "18446744073709551488"] {
        let args = bench_args(&model, &["--prompt-tokens", "128", "--gen-tokens", g]);
        rejected(&args, &[], &["--gen-tokens", g, "1 to 128"]);
    }
    let out = accepted(
        &bench_args(
            &model,
            &[
                "--prompt-tokens",
                &most_prompt,
                "--gen-tokens",
                "1",
                "--json",
            ],
        ),
        &[],
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(json["decode_tok_s"].as_f64().unwrap() < 1e9, "{json}");
}

#[test]
fn parallel_bench_levels_are_checked_and_measured() {
    let model = model("parallel");
    for n in ["0", "1025"] {
        rejected(
            &bench_args(&model, &["--parallel", n]),
            &[],
            &["--parallel", n, "1 to 1024"],
        );
    }
    let huge = "18446744073709551615";
    rejected(
        &bench_args(&model, &["--parallel", "2", "--prompt-tokens", huge]),
        &[],
        &["--prompt-tokens + --gen-tokens"],
    );
    // Two levels, one JSON line each, with every request's tokens counted.
    let args = bench_args(
        &model,
        &[
            "--parallel",
            "1,3",
            "--prompt-tokens",
            "5",
            "--gen-tokens",
            "4",
            "--json",
        ],
    );
    let out = accepted(&args, &[]);
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    for (line, n) in lines.iter().zip([1, 3]) {
        assert_eq!(line["parallel"], n);
        assert!(line["tok_s"].as_f64().unwrap() > 0.0, "{line}");
        // Prompt steps, then one step a generated token after the first.
        assert!(line["steps"].as_f64().unwrap() >= 3.0, "{line}");
    }
}

#[test]
fn repeats_are_bounded() {
    let model = model("repeats");
    for r in ["0", "1001", "18446744073709551615"] {
        rejected(
            &bench_args(&model, &["--repeats", r]),
            &[],
            &["--repeats", r, "1 to 1000"],
        );
    }
}

#[test]
fn environment_counts_are_range_checked() {
    let model = model("environment");
    let args = generate_args(&model, &["--temperature", "0"], "hi");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let max = (cores * 8).to_string();
    let over = (cores * 8 + 1).to_string();
    for v in ["100000", over.as_str(), "18446744073709551616", "-1", "x"] {
        let env = [("ENCORE_THREADS", v)];
        rejected(
            &args,
            &env,
            &["ENCORE_THREADS", &format!("from 0 to {max}")],
        );
    }
    accepted(&args, &[("ENCORE_THREADS", &max)]);
    for v in ["0", "18446744073709551616", "-1", "99999999999999999999999"] {
        let env = [("ENCORE_CAPTURE_AT", v)];
        rejected(&args, &env, &["ENCORE_CAPTURE_AT", "from 1 to"]);
    }
    for (var, v) in [
        ("ENCORE_PROFILE", "\u{1b}[2Jgarbage"),
        ("ENCORE_PROFILE", "dispatches,counters"),
        ("ENCORE_SERIAL", "2"),
        ("ENCORE_EXACT", "yes please"),
    ] {
        rejected(&args, &[(var, v)], &[]);
    }
}

#[test]
fn malformed_flags_are_usage_errors() {
    let model = model("usage");
    for extra in [
        &["-n", "-5"][..],
        &["-n", "1e3"],
        &["-n", "18446744073709551616"],
        &["--top-k", "-1"],
        &["--seed", "-1"],
        &["--temperature", "warm"],
        &["--temperature", ""],
        &["--profile", "everything"],
    ] {
        let args = generate_args(&model, extra, "hi");
        let out = run(&args, &[]);
        let context = describe(&args, &[], &out);
        assert_no_panic(&out, &context);
        assert_eq!(out.status.code(), Some(2), "want a usage error\n{context}");
    }
    for extra in [&["--repeats", "-1"][..], &["--gen-tokens", "-1"]] {
        let args = bench_args(&model, extra);
        let out = run(&args, &[]);
        assert_eq!(out.status.code(), Some(2), "{}", describe(&args, &[], &out));
    }
}

#[test]
fn odd_prompts_and_devices_do_not_panic() {
    let model = model("prompts");
    let long = "hi ".repeat(4 * context());
    rejected(
        &generate_args(&model, &["--raw"], ""),
        &[],
        &["empty prompt"],
    );
    rejected(&generate_args(&model, &["--raw"], &long), &[], &["context"]);
    accepted(&generate_args(&model, &[], ""), &[]);
    accepted(
        &generate_args(&model, &["--raw"], "\u{1}\u{feff}\u{10ffff}"),
        &[],
    );
    for device in ["cuda:18446744073709551616", "cuda:-1", "", "cpu:0", "auto"] {
        let args = generate_args(&model, &["--device", device], "hi");
        let env = [("ENCORE_DEVICE", "cuda:99999999999999999999")];
        let out = run(&args, &env);
        assert_no_panic(&out, &describe(&args, &env, &out));
    }
}

#[test]
fn serve_limits_out_of_range_are_refused_before_serving() {
    let model = model("serve_limits");
    let path = model.to_str().unwrap();
    let serve = |extra: &[&'static str]| {
        let mut args = vec!["serve", "--model", path, "--device", "cpu", "--port", "0"];
        args.extend(extra);
        args
    };
    for extra in [
        &["--header-timeout", "0"][..],
        &["--idle-timeout", "-1"],
        &["--body-timeout", "nan"],
        &["--request-timeout", "inf"],
        &["--max-queue", "-1"],
        &["--api-key", "k", "--api-key-file", "f"],
    ] {
        let args = serve(extra);
        let out = run(&args, &[]);
        let context = describe(&args, &[], &out);
        assert_no_panic(&out, &context);
        assert_eq!(out.status.code(), Some(2), "want a usage error\n{context}");
    }
    rejected(
        &serve(&["--max-connections", "0"]),
        &[],
        &["--max-connections 0", "expected 1"],
    );
    rejected(
        &serve(&["--max-body-bytes", "0"]),
        &[],
        &["--max-body-bytes 0", "expected 1"],
    );
    rejected(&serve(&["--api-key", ""]), &[], &["--api-key", "empty"]);
    rejected(
        &serve(&["--api-key-file", "/nonexistent/key"]),
        &[],
        &["--api-key-file /nonexistent/key"],
    );
}
