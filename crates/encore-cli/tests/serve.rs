//! `encore serve` as a user runs it: on an ephemeral loopback port, driven
//! by the official `openai` and `anthropic` Python clients (each installed
//! into a virtual environment by `scripts/openai-client.sh` and
//! `scripts/anthropic-client.sh`), then stopped with SIGTERM, on which it
//! exits 0. Also `encore chat` fed from a pipe.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn encore() -> Command {
    Command::new(env!("CARGO_BIN_EXE_encore"))
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .parent()
        .unwrap()
}

#[test]
fn the_openai_and_anthropic_clients_drive_the_server_and_sigterm_stops_it_cleanly() {
    let mut server = encore()
        .args([
            "serve",
            "--device",
            "cpu",
            "--port",
            "0",
            "--parallel",
            "8",
            "-c",
            "1024",
        ])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // The first stderr line names the bound address.
    let mut stderr = BufReader::new(server.stderr.take().unwrap());
    let started = Instant::now();
    let url = loop {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "the server exited early"
        );
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
        assert!(started.elapsed() < Duration::from_secs(600), "no address");
    };
    let log = std::thread::spawn(move || {
        let mut rest = String::new();
        for line in stderr.lines() {
            rest.push_str(&line.unwrap());
            rest.push('\n');
        }
        rest
    });
    let run = |script: &str| {
        let out = Command::new(root().join("scripts").join(script))
            .arg(&url)
            .current_dir(root())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (
            out.status.success() && stdout.trim_end().ends_with("ok"),
            stdout,
            stderr,
        )
    };
    let openai = run("openai-client.sh");
    let anthropic = run("anthropic-client.sh");
    let term = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = server.wait().unwrap();
    let log = log.join().unwrap();
    for (name, (ok, stdout, stderr)) in [("openai", openai), ("anthropic", anthropic)] {
        assert!(
            ok,
            "{name} client failed:\n{stdout}\n{stderr}\nserver log:\n{log}"
        );
    }
    assert!(
        status.success(),
        "exit status {status} after SIGTERM:\n{log}"
    );
    assert!(log.contains("stopped"), "{log}");
}

#[test]
fn chat_reads_turns_from_a_pipe_with_reset_and_exit() {
    let mut chat = encore()
        .args(["chat", "--device", "cpu", "-n", "12", "--temperature", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    chat.stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France?\n/reset\nWhat is the capital of France?\n/exit\nnever read\n")
        .unwrap();
    let out = chat.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parts: Vec<&str> = stdout.split("(conversation cleared)\n").collect();
    assert_eq!(parts.len(), 2, "{stdout}");
    // After /reset the same question gets the same greedy answer.
    assert_eq!(parts[0].trim(), parts[1].trim(), "{stdout}");
    assert!(!parts[0].trim().is_empty());
}
