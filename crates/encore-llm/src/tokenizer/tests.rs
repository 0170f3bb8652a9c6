//! Tests of the tokenizer as a whole (building it, encoding with special
//! tokens, a real model's ids as llama.cpp produces them, round trips), and
//! the small vocabularies the other files' tests build on (in this module
//! and, for [`tiny_vocab`], the crate).

use super::*;
use crate::gguf::GgufFile;

/// The 256 byte symbols in byte order, so byte `b` has id `b`.
pub(super) fn byte_vocab() -> Vec<String> {
    (0..=255u8).map(|b| byte_symbol(b).to_string()).collect()
}

/// A small byte-level vocabulary: bytes (ids 0..256), merged tokens, and
/// ChatML control tokens.
pub(super) fn tiny_gpt2(pre: &str) -> Tokenizer {
    let mut tokens = byte_vocab();
    let merged = [
        "he", "ll", "hell", "hello", "Ġw", "Ġwo", "Ġwor", "Ġworl", "Ġworld", "12",
    ];
    tokens.extend(merged.iter().map(|s| s.to_string()));
    tokens.extend(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool>"].map(String::from));
    let mut types = vec![1; tokens.len()];
    let n = types.len();
    types[n - 4..n - 1].fill(3);
    types[n - 1] = 4;
    let merges = [
        "h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "Ġwo r", "Ġwor l", "Ġworl d", "1 2",
    ];
    Tokenizer::from_spec(TokenizerSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types: Some(types),
        merges: merges.map(String::from).to_vec(),
        bos: Some(266),
        eos: Some(267),
        ..TokenizerSpec::default()
    })
    .unwrap()
}

pub(super) fn ids_of(tokenizer: &Tokenizer, texts: &[&str]) -> Vec<u32> {
    texts
        .iter()
        .map(|t| {
            tokenizer
                .token_id(t)
                .unwrap_or_else(|| panic!("no token {t:?}"))
        })
        .collect()
}

/// A SentencePiece tokenizer over byte tokens (ids 0..256) and the given
/// `(text, token type)` pieces, which take ids from 256 on.
pub(crate) fn tiny_vocab(pieces: &[(&str, i32)], eos: u32) -> Tokenizer {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
    let mut types = vec![6; tokens.len()];
    for &(text, token_type) in pieces {
        tokens.push(text.into());
        types.push(token_type);
    }
    Tokenizer::from_spec(TokenizerSpec {
        model: "llama".into(),
        tokens,
        token_types: Some(types),
        eos: Some(eos),
        ..TokenizerSpec::default()
    })
    .unwrap()
}

/// A SentencePiece vocabulary: unk, bos, eos, the 256 byte tokens, then
/// pieces whose scores make the merge order unambiguous.
pub(super) fn tiny_llama(add_space_prefix: bool) -> Tokenizer {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces = [
        ("▁", -1.0),
        ("h", -2.0),
        ("e", -2.0),
        ("l", -2.0),
        ("o", -2.0),
        ("w", -2.0),
        ("▁h", -3.0),
        ("ll", -4.0),
        ("llo", -5.0),
        ("▁he", -6.0),
        ("▁hello", -7.0),
        ("ello", -8.0),
        ("▁w", -9.0),
    ];
    for (piece, score) in pieces {
        tokens.push(piece.into());
        types.push(1);
        scores.push(score);
    }
    Tokenizer::from_spec(TokenizerSpec {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        bos: Some(1),
        eos: Some(2),
        unk: Some(0),
        add_bos: true,
        add_space_prefix,
        ..TokenizerSpec::default()
    })
    .unwrap()
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Tokenizer>();
    shareable::<crate::chat::ChatTemplate>();
}

#[test]
fn add_special_follows_flags() {
    let mut t = tiny_gpt2("smollm");
    assert_eq!(
        t.encode("hello", true, false).unwrap(),
        ids_of(&t, &["hello"])
    );
    t.add_bos = true;
    t.add_eos = true;
    assert_eq!(t.encode("hello", true, false).unwrap(), [266, 259, 267]);
    assert_eq!(t.encode("", true, false).unwrap(), [266, 267]);
    assert_eq!(t.encode("", false, false).unwrap(), [] as [u32; 0]);
}

#[test]
fn spec_errors_name_the_problem() {
    let mut tokens = byte_vocab();
    tokens.push("a".into());
    let spec = TokenizerSpec {
        model: "gpt2".into(),
        tokens,
        ..TokenizerSpec::default()
    };
    assert!(matches!(
        Tokenizer::from_spec(spec).unwrap_err(),
        TokenizerError::DuplicateToken {
            first: 97,
            second: 256,
            ..
        }
    ));

    let spec = TokenizerSpec {
        model: "gpt2".into(),
        tokens: byte_vocab(),
        add_bos: true,
        ..TokenizerSpec::default()
    };
    assert!(matches!(
        Tokenizer::from_spec(spec).unwrap_err(),
        TokenizerError::MissingSpecial { which: "bos" }
    ));

    let spec = TokenizerSpec {
        model: "gpt2".into(),
        tokens: byte_vocab(),
        eos: Some(999),
        ..TokenizerSpec::default()
    };
    assert!(matches!(
        Tokenizer::from_spec(spec).unwrap_err(),
        TokenizerError::SpecialOutOfRange {
            which: "eos",
            id: 999,
            ..
        }
    ));

    let spec = TokenizerSpec {
        model: "gpt2".into(),
        tokens: byte_vocab(),
        merges: vec!["nospace".into()],
        ..TokenizerSpec::default()
    };
    assert!(matches!(
        Tokenizer::from_spec(spec).unwrap_err(),
        TokenizerError::BadMerge { index: 0, .. }
    ));

    let spec = TokenizerSpec {
        model: "bert".into(),
        tokens: byte_vocab(),
        ..TokenizerSpec::default()
    };
    assert!(matches!(
        Tokenizer::from_spec(spec).unwrap_err(),
        TokenizerError::UnsupportedModel(_)
    ));
}

/// Token ids for SmolLM2-135M-Instruct (`gpt2` vocabulary, `smollm`
/// pre-tokenizer), as llama.cpp itself produces them: taken from
/// `llama_tokenize(add_special = false)` in llama-cpp-python 0.3.36 with
/// the model loaded vocab-only, and matched independently by a pure-Python
/// port of llama.cpp's splitter and BPE and by the `tokenizers` Python
/// package configured as SmolLM2's Hugging Face tokenizer.
const SMOLLM2_IDS: &[(&str, bool, &[u32])] = &[
    ("Hello world", false, &[19556, 905]),
    (
        "Hello, world! How are you today?",
        false,
        &[19556, 28, 905, 17, 1073, 359, 346, 1834, 47],
    ),
    ("12345", false, &[33, 34, 35, 36, 37]),
    (
        "3.14159 and 1,000,000",
        false,
        &[
            35, 30, 33, 36, 33, 37, 41, 284, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32,
        ],
    ),
    (
        "don't I'm we'll they're it's DON'T You'VE",
        false,
        &[
            12420, 982, 339, 5248, 392, 3060, 502, 2316, 357, 506, 422, 2154, 23, 68, 1206, 23,
            18525,
        ],
    ),
    (
        "héllo 世界 🎉",
        false,
        &[
            88, 2756, 31394, 216, 7906, 240, 178, 239, 230, 15107, 232, 227,
        ],
    ),
    ("multiple   spaces", false, &[30404, 256, 5600]),
    ("   leading spaces", false, &[256, 2899, 5600]),
    ("trailing spaces   ", false, &[4861, 4966, 5600, 333]),
    (
        "\n\n\ndouble newline",
        false,
        &[1116, 198, 21414, 725, 1311],
    ),
    (
        "def f(x):\n    return x**2  # square\n",
        false,
        &[
            1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5222, 198,
        ],
    ),
    (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        true,
        &[1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198],
    ),
    (
        "<|im_start|>user\nHi<|im_end|>",
        false,
        &[
            44, 108, 306, 79, 3738, 108, 46, 4093, 198, 26843, 44, 108, 306, 79, 486, 108, 46,
        ],
    ),
    (
        "<reponame>x<file_sep>y<|endoftext|>",
        true,
        &[4, 104, 5, 105, 0],
    ),
    (
        "Привет мир",
        false,
        &[155, 249, 46879, 16464, 32547, 41337, 7872, 9175],
    ),
    (
        "abc123def x1y22z333",
        false,
        &[
            25276, 33, 34, 35, 1604, 1792, 33, 105, 34, 34, 106, 35, 35, 35,
        ],
    ),
    (
        "ideographic\u{3000}space and em\u{2003}space",
        false,
        &[489, 4551, 12109, 218, 11602, 284, 649, 321, 221, 11602],
    ),
    ("", false, &[]),
];

/// Checks the tokenizer and chat template of SmolLM2-135M-Instruct when
/// `ENCORE_TEST_MODEL` names its GGUF file.
#[test]
fn real_model_smollm2() {
    let Some(path) = std::env::var_os("ENCORE_TEST_MODEL") else {
        eprintln!("skipped: set ENCORE_TEST_MODEL to SmolLM2-135M-Instruct.Q4_1.gguf to run");
        return;
    };
    let file = GgufFile::open(&path).unwrap();
    let spec = TokenizerSpec::from_gguf(&file).unwrap();
    assert_eq!(spec.model, "gpt2");
    assert_eq!(spec.pre.as_deref(), Some("smollm"));
    assert!(!spec.add_bos && !spec.add_eos && !spec.add_space_prefix);
    let t = Tokenizer::from_spec(spec).unwrap();
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(
        (t.bos(), t.eos(), t.unk(), t.pad()),
        (Some(1), Some(2), Some(0), Some(2))
    );
    // llama.cpp's end-of-generation set for this model: <|endoftext|>,
    // <|im_end|>, and <reponame> (a fill-in-the-middle repository token).
    let eog: Vec<u32> = (0..49152).filter(|&id| t.is_eog(id)).collect();
    assert_eq!(eog, [0, 2, 4]);

    for &(text, parse_special, expected) in SMOLLM2_IDS {
        let ids = t.encode(text, false, parse_special).unwrap();
        assert_eq!(ids, expected, "encoding {text:?}");
        assert_eq!(t.decode(&ids).unwrap(), text);
        // add_bos and add_eos are off for SmolLM2.
        assert_eq!(t.encode(text, true, parse_special).unwrap(), expected);
    }

    let round_trips = [
        "tab\tseparated\tvalues",
        " \n \n ",
        "fn main() { println!(\"hi {}\", 1 + 2); }",
        "Ünïcödé naïve café 日本語のテキスト مرحبا بالعالم",
        "👍🏽👨\u{200d}👩\u{200d}👧 emoji, non\u{a0}breaking, zero\u{200b}width",
        "!!!???... --- a--b (parens) [brackets] {braces} ’curly’ “quotes”",
        "https://example.com/path?q=1&r=2#frag ÿþý \r\n windows\r\nline",
        "∑∫√∞≠≈ math ± symbols \u{1}\u{7f}",
    ];
    for text in round_trips {
        let ids = t.encode(text, false, false).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text);
        let mut stream = t.stream_decoder();
        let streamed: String = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
        assert_eq!(streamed + &stream.finish(), text);
    }

    // The model's own chat template, rendered and encoded as a prompt;
    // ids from llama.cpp tokenizing the same text with special tokens parsed.
    let template = crate::chat::ChatTemplate::for_model(t.chat_template()).unwrap();
    let messages = [crate::chat::Message::new("user", "What is 2+2?")];
    let prompt = template
        .render(&messages, true, "<|im_start|>", "<|im_end|>")
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        t.encode(&prompt, true, true).unwrap(),
        [
            1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
            407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520,
            9531, 198
        ]
    );
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn byte_level_round_trips(text in "\\PC{0,40}|[ \\n\\t0-9a-z'.,!?]{0,40}") {
            let t = tiny_gpt2("smollm");
            let ids = t.encode(&text, false, false).unwrap();
            prop_assert_eq!(t.decode(&ids).unwrap(), text);
        }

        #[test]
        fn sentencepiece_round_trips(text in "\\PC{0,40}") {
            // `▁` in the input is the space symbol, so it decodes to a space.
            prop_assume!(!text.contains('▁'));
            let t = tiny_llama(true);
            let ids = t.encode(&text, false, false).unwrap();
            prop_assert_eq!(t.decode(&ids).unwrap(), text);
        }
    }
}
