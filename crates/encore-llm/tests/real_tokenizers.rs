//! The tokenizers of Qwen2.5-Coder-0.5B-Instruct and Gemma 3 270M against
//! llama.cpp: token ids of varied text (recorded from `llama-tokenize` in
//! `fixtures/tokens-*.json` by `fixtures/llama_tokenize.py`), special tokens,
//! end of generation, and chat prompts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::OnceLock;

use encore_llm::gguf::GgufFile;
use encore_llm::tokenizer::{Tokenizer, TokenizerSpec};

/// The GGUF file of a catalog model (`qwen2.5-coder-0.5b`, `gemma-3-270m`),
/// looked up in `$ENCORE_TEST_MODELS` (default `/tmp/models`).
fn model_file(name: &str) -> PathBuf {
    let file = match name {
        "qwen2.5-coder-0.5b" => "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "gemma-3-270m" => "gemma-3-270m-q4_k_m.gguf",
        other => panic!("no model file is known for {other:?}"),
    };
    let dir = std::env::var_os("ENCORE_TEST_MODELS").unwrap_or_else(|| "/tmp/models".into());
    let path = PathBuf::from(dir).join(file);
    assert!(
        path.is_file(),
        "model file not found: {} (set ENCORE_TEST_MODELS to the folder holding {file})",
        path.display()
    );
    path
}

/// One model's tokenizer, read once and shared by the tests.
fn tokenizer(name: &'static str) -> &'static Tokenizer {
    static QWEN: OnceLock<Tokenizer> = OnceLock::new();
    static GEMMA: OnceLock<Tokenizer> = OnceLock::new();
    let cell = match name {
        "qwen2.5-coder-0.5b" => &QWEN,
        "gemma-3-270m" => &GEMMA,
        other => panic!("no tokenizer is kept for {other:?}"),
    };
    cell.get_or_init(|| {
        let file = GgufFile::open(model_file(name)).unwrap();
        Tokenizer::from_spec(TokenizerSpec::from_gguf(&file).unwrap()).unwrap()
    })
}

/// A text and the ids llama.cpp gives it.
struct Case {
    text: String,
    parse_special: bool,
    add_special: bool,
    ids: Vec<u32>,
}

fn cases(fixture: &str) -> Vec<Case> {
    let cases: Vec<serde_json::Value> = serde_json::from_str(fixture).unwrap();
    cases
        .into_iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().to_owned(),
            parse_special: c["parse_special"].as_bool().unwrap(),
            add_special: c["add_special"].as_bool().unwrap(),
            ids: c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|id| u32::try_from(id.as_u64().unwrap()).unwrap())
                .collect(),
        })
        .collect()
}

/// Encodes every case and lists the ones that differ from llama.cpp.
fn check_ids(t: &Tokenizer, fixture: &str) {
    let mut failures = Vec::new();
    for case in cases(fixture) {
        let ids = t
            .encode(&case.text, case.add_special, case.parse_special)
            .unwrap();
        if ids != case.ids {
            failures.push(format!(
                "{:?} (parse_special {}, add_special {}):\n  encore    {ids:?}\n  llama.cpp {:?}",
                case.text, case.parse_special, case.add_special, case.ids
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn qwen_ids_match_llama_cpp() {
    check_ids(
        tokenizer("qwen2.5-coder-0.5b"),
        include_str!("fixtures/tokens-qwen2.5-coder-0.5b.json"),
    );
}

#[test]
fn gemma_ids_match_llama_cpp() {
    check_ids(
        tokenizer("gemma-3-270m"),
        include_str!("fixtures/tokens-gemma-3-270m.json"),
    );
}
