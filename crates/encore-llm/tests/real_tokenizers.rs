//! The tokenizers of Qwen2.5-Coder-0.5B-Instruct and Gemma 3 270M against
//! llama.cpp: token ids of varied text (recorded from `llama-tokenize` in
//! `fixtures/tokens-*.json` by `fixtures/llama_tokenize.py`), special tokens,
//! end of generation, and chat prompts. The chat templates' expected
//! renderings are Python jinja2's with Hugging Face's settings.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use encore_llm::chat::{ChatPart, ChatTemplate, Message};
use encore_llm::gguf::GgufFile;
use encore_llm::tokenizer::{Segment, Tokenizer, TokenizerSpec};

/// The GGUF file of a catalog model (`qwen2.5-coder-0.5b`, `gemma-3-270m`),
/// fetched on first use.
fn model_file(name: &str) -> PathBuf {
    common::catalog_model(name)
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

/// The ids of every token that ends generation.
fn eog_set(t: &Tokenizer) -> Vec<u32> {
    (0..t.vocab_size() as u32)
        .filter(|&id| t.is_eog(id))
        .collect()
}

#[test]
fn qwen_special_tokens_match_llama_cpp() {
    let t = tokenizer("qwen2.5-coder-0.5b");
    assert_eq!(t.vocab_size(), 151_936);
    assert_eq!(
        (t.bos(), t.eos(), t.eot()),
        (Some(151_643), Some(151_645), Some(151_645))
    );
    assert_eq!((t.unk(), t.pad()), (None, Some(151_643)));
    assert!(!t.add_bos() && !t.add_eos());
    // <|im_end|>, <|endoftext|>, the fill-in-the-middle padding, repository
    // and file-separator tokens, and `</s>`, which is on llama.cpp's list.
    assert_eq!(
        eog_set(t),
        [128_247, 151_643, 151_645, 151_662, 151_663, 151_664]
    );
    assert_eq!(t.token_text(128_247), Some("</s>"));
}

#[test]
fn gemma_special_tokens_match_llama_cpp() {
    let t = tokenizer("gemma-3-270m");
    assert_eq!(t.vocab_size(), 262_144);
    assert_eq!((t.bos(), t.eos(), t.eot()), (Some(2), Some(1), Some(106)));
    assert_eq!((t.unk(), t.pad()), (Some(3), Some(0)));
    assert!(t.add_bos() && !t.add_eos());
    // <eos>, <end_of_turn>, and `</s>` (an HTML tag here, but on llama.cpp's list).
    assert_eq!(eog_set(t), [1, 106, 212]);
    assert_eq!(t.token_text(106), Some("<end_of_turn>"));
    assert_eq!(t.token_text(212), Some("</s>"));
    assert_eq!(t.encode("", true, false).unwrap(), [2]);
}

/// Decoding gives back the text for every fixture (but `▁`, which a
/// SentencePiece vocabulary reads as a space).
#[test]
fn decoding_round_trips() {
    for (name, fixture) in [
        (
            "qwen2.5-coder-0.5b",
            include_str!("fixtures/tokens-qwen2.5-coder-0.5b.json"),
        ),
        (
            "gemma-3-270m",
            include_str!("fixtures/tokens-gemma-3-270m.json"),
        ),
    ] {
        let t = tokenizer(name);
        for case in cases(fixture) {
            if case.text.contains('▁') || case.add_special {
                continue;
            }
            assert_eq!(t.decode(&case.ids).unwrap(), case.text, "{name}");
            let mut stream = t.stream_decoder();
            let streamed: String = case
                .ids
                .iter()
                .map(|&id| stream.push(id).unwrap())
                .collect();
            assert_eq!(streamed + &stream.finish(), case.text, "{name}");
        }
    }
}

const QWEN_TEMPLATE: &str = include_str!("fixtures/qwen2.5-coder-0.5b.chat_template.jinja");
const QWEN_SYSTEM: &str =
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n";

fn multi_turn() -> [Message; 3] {
    [
        Message::new("user", "Hi"),
        Message::new("assistant", "Hello! How can I help?"),
        Message::new("user", "  Tell me a joke.  \n"),
    ]
}

/// Qwen2.5's template (copied out of the model file) adds its own system
/// prompt when the conversation has none.
#[test]
fn qwen_template_renders_like_jinja2() {
    let t = ChatTemplate::new(QWEN_TEMPLATE).unwrap();
    let render = |messages: &[Message], add_generation_prompt| {
        t.render(messages, add_generation_prompt, "", "<|im_end|>")
            .unwrap()
    };
    let user = [Message::new("user", "What is 2+2?")];
    let question = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n";
    assert_eq!(
        render(&user, true),
        format!("{QWEN_SYSTEM}{question}<|im_start|>assistant\n")
    );
    assert_eq!(render(&user, false), format!("{QWEN_SYSTEM}{question}"));
    let system = [
        Message::new("system", "You are a terse coder."),
        Message::new("user", "Write hello world in Rust."),
    ];
    assert_eq!(
        render(&system, true),
        "<|im_start|>system\nYou are a terse coder.<|im_end|>\n\
         <|im_start|>user\nWrite hello world in Rust.<|im_end|>\n<|im_start|>assistant\n"
    );
    // Contents go in as given.
    assert_eq!(
        render(&multi_turn(), false),
        format!(
            "{QWEN_SYSTEM}<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello! How can I help?<|im_end|>\n\
             <|im_start|>user\n  Tell me a joke.  \n<|im_end|>\n"
        )
    );
}

/// The ids llama.cpp gives `text` encoded with special tokens parsed and added.
fn llama_cpp_prompt_ids(fixture: &str, text: &str) -> Vec<u32> {
    cases(fixture)
        .into_iter()
        .find(|c| c.text == text && c.parse_special && c.add_special)
        .unwrap_or_else(|| panic!("no fixture case for {text:?}"))
        .ids
}

/// The model's template renders the prompt, and the prompt's ids are
/// llama.cpp's, whether encoded whole or as markup and contents apart.
fn check_prompt(name: &'static str, fixture: &str, messages: &[Message], expected: &str) {
    let t = tokenizer(name);
    let template = ChatTemplate::for_tokenizer(t).unwrap();
    let text_of = |id: Option<u32>| id.and_then(|id| t.token_text(id)).unwrap_or("");
    let (bos, eos) = (text_of(t.bos()), text_of(t.eos()));
    let prompt = template.render(messages, true, bos, eos).unwrap();
    assert_eq!(prompt, expected);
    let ids = llama_cpp_prompt_ids(fixture, &prompt);
    assert_eq!(t.encode(&prompt, true, true).unwrap(), ids);
    let parts = template
        .render_parts(messages, true, bos, eos)
        .unwrap()
        .unwrap();
    let segments: Vec<Segment<'_>> = parts
        .iter()
        .map(|p| match p {
            ChatPart::Markup(text) => Segment::markup(text),
            ChatPart::Content(text) => Segment::plain(text),
        })
        .collect();
    assert_eq!(parts.iter().map(ChatPart::text).collect::<String>(), prompt);
    assert_eq!(t.encode_segments(&segments, true).unwrap(), ids);
}

#[test]
fn qwen_chat_prompt_matches_llama_cpp() {
    let file = GgufFile::open(model_file("qwen2.5-coder-0.5b")).unwrap();
    let spec = TokenizerSpec::from_gguf(&file).unwrap();
    assert_eq!(spec.chat_template.as_deref(), Some(QWEN_TEMPLATE));
    check_prompt(
        "qwen2.5-coder-0.5b",
        include_str!("fixtures/tokens-qwen2.5-coder-0.5b.json"),
        &multi_turn(),
        &format!(
            "{QWEN_SYSTEM}<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello! How can I help?<|im_end|>\n\
             <|im_start|>user\n  Tell me a joke.  \n<|im_end|>\n<|im_start|>assistant\n"
        ),
    );
}

/// The Gemma 3 file carries no template; its vocabulary selects Gemma's,
/// and the prompt leaves BOS to the tokenizer.
#[test]
fn gemma_chat_prompt_matches_llama_cpp() {
    assert_eq!(tokenizer("gemma-3-270m").chat_template(), None);
    check_prompt(
        "gemma-3-270m",
        include_str!("fixtures/tokens-gemma-3-270m.json"),
        &[
            Message::new("system", "You are a terse coder."),
            Message::new("user", "Write hello world in Rust."),
        ],
        "<start_of_turn>user\nYou are a terse coder.\n\nWrite hello world in Rust.<end_of_turn>\n\
         <start_of_turn>model\n",
    );
}
