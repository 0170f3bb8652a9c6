//! `encore perplexity` as a user runs it: progress on stderr, `PPL = value
//! +/- error` as the last line of stdout (with `--json`, a JSON object before
//! it holding the same figure), and one clear error for input it cannot use.
//! The default model is fetched on first use, as `encore` fetches it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Command, Output};

fn encore(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_encore"))
        .args(args)
        .env("ENCORE_DEVICE", "cpu")
        .output()
        .unwrap()
}

fn text_file() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../encore-llm/tests/data/perplexity.txt"
    )
    .to_string()
}

#[test]
fn perplexity_prints_progress_and_the_figure_last() {
    let file = text_file();
    let out = encore(&[
        "perplexity",
        "--device",
        "cpu",
        "--json",
        "-c",
        "256",
        &file,
    ]);
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    );
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    let last = lines.last().unwrap();
    let figures: Vec<f64> = last
        .strip_prefix("PPL = ")
        .unwrap_or_else(|| panic!("last line {last:?}"))
        .split(" +/- ")
        .map(|x| x.parse().unwrap())
        .collect();
    let (ppl, error) = (figures[0], figures[1]);
    // SmolLM2 on English prose: well above 1, well below the vocabulary.
    assert!(
        ppl > 2.0 && ppl < 200.0 && error > 0.0 && error < ppl,
        "{last}"
    );
    let json: serde_json::Value = serde_json::from_str(lines[lines.len() - 2]).unwrap();
    assert!((json["ppl"].as_f64().unwrap() - ppl).abs() < 1e-3, "{json}");
    assert_eq!(json["ctx_size"], 256);
    let chunks = json["chunks"].as_u64().unwrap();
    assert!(chunks >= 2, "{json}");
    assert_eq!(
        stderr.matches("encore: chunk ").count() as u64,
        chunks,
        "one progress line a chunk\n{stderr}"
    );
}

#[test]
fn perplexity_refuses_what_it_cannot_score() {
    let dir = std::env::temp_dir().join(format!("encore-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "Too short to score.").unwrap();
    let short = short.to_str().unwrap();
    let missing = dir.join("missing.txt");
    let missing = missing.to_str().unwrap();
    for (args, expected) in [
        (vec!["perplexity", short], vec!["tokens", "needs at least"]),
        (vec!["perplexity", "-c", "2", short], vec!["chunk size"]),
        (vec!["perplexity", missing], vec!["missing.txt"]),
    ] {
        let out = encore(&args);
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(out.stdout.is_empty(), "{args:?} wrote to stdout");
        common::assert_one_error_line(&stderr, &expected, &format!("{args:?}\n{stderr}"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
