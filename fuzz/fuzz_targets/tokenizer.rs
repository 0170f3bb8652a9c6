//! Arbitrary text and token ids through the tokenizer.
//!
//! The tokenizer is built once: from the model file named by
//! `ENCORE_FUZZ_MODEL` when set, else from the tiny synthetic model's
//! byte-level vocabulary. Each input is used twice:
//!
//! - as text (invalid UTF-8 replaced by U+FFFD): encoded with and without
//!   special-token parsing and BOS/EOS, every id inside the vocabulary, and
//!   decoded back; for a byte-level vocabulary whose decoding is lossless,
//!   `decode(encode(text)) == text` when the text names no control token and
//!   has no byte that the vocabulary lacks (such bytes are dropped, as
//!   llama.cpp drops them);
//! - as little-endian `u32` token ids (some outside the vocabulary): decoding
//!   succeeds exactly when all are inside, and the streaming decoder agrees.

#![no_main]

use std::sync::OnceLock;

use encore_llm::gguf::GgufFile;
use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use encore_llm::tokenizer::{byte_symbol, Tokenizer, TokenizerSpec};
use libfuzzer_sys::fuzz_target;

struct Target {
    tokenizer: Tokenizer,
    /// The texts of the control tokens, which `parse_special` turns into
    /// single tokens.
    control_texts: Vec<String>,
    /// Whether decoding gives back exactly the encoded text.
    lossless: bool,
    /// Bytes whose byte-level symbol is not a token, which encoding drops.
    dropped_bytes: Vec<u8>,
}

fn target() -> &'static Target {
    static TARGET: OnceLock<Target> = OnceLock::new();
    TARGET.get_or_init(|| {
        let file = match std::env::var_os("ENCORE_FUZZ_MODEL") {
            Some(path) => GgufFile::open(path),
            None => GgufFile::from_bytes(synthetic_gguf(&SyntheticSpec::tiny(1))),
        };
        let file = file.unwrap_or_else(|e| panic!("cannot read the fuzzing model: {e}"));
        let spec = TokenizerSpec::from_gguf(&file)
            .unwrap_or_else(|e| panic!("cannot read the fuzzing model's tokenizer: {e}"));
        let byte_level = spec.model == "gpt2";
        let tokenizer = Tokenizer::from_spec(spec)
            .unwrap_or_else(|e| panic!("cannot build the fuzzing model's tokenizer: {e}"));
        let control_texts = (0..tokenizer.vocab_size() as u32)
            .filter(|&id| tokenizer.is_control(id))
            .filter_map(|id| tokenizer.token_text(id).map(str::to_owned))
            .collect();
        // Some pre-tokenizers clean up spaces before punctuation when decoding.
        let probe = " . 's ,";
        let lossless = byte_level
            && tokenizer
                .encode(probe, false, false)
                .and_then(|ids| tokenizer.decode(&ids))
                .is_ok_and(|text| text == probe);
        let dropped_bytes = (0..=255u8)
            .filter(|&b| tokenizer.token_id(&byte_symbol(b).to_string()).is_none())
            .collect();
        Target {
            tokenizer,
            control_texts,
            lossless,
            dropped_bytes,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let target = target();
    encode_text(target, &String::from_utf8_lossy(data));
    decode_ids(&target.tokenizer, data);
});

fn encode_text(target: &Target, text: &str) {
    let tokenizer = &target.tokenizer;
    let vocab = tokenizer.vocab_size();
    let names_control = target
        .control_texts
        .iter()
        .any(|t| text.contains(t.as_str()));
    let complete = text.bytes().all(|b| !target.dropped_bytes.contains(&b));
    for parse_special in [false, true] {
        for add_special in [false, true] {
            let ids = tokenizer.encode(text, add_special, parse_special);
            let Ok(ids) = ids else {
                panic!("encode({text:?}, {add_special}, {parse_special}) failed: {ids:?}");
            };
            assert!(ids.iter().all(|&id| (id as usize) < vocab), "{ids:?}");
            let decoded = tokenizer.decode(&ids);
            let Ok(decoded) = decoded else {
                panic!("decoding the ids of {text:?} failed: {decoded:?}");
            };
            let plain = !add_special && (!parse_special || !names_control);
            if target.lossless && complete && plain {
                assert_eq!(decoded, text, "ids {ids:?}");
            }
        }
    }
}

fn decode_ids(tokenizer: &Tokenizer, data: &[u8]) {
    let vocab = tokenizer.vocab_size() as u32;
    // Ids spread over the vocabulary plus a few past its end.
    let ids: Vec<u32> = data
        .chunks_exact(4)
        .flat_map(<[u8; 4]>::try_from)
        .map(|b| u32::from_le_bytes(b) % (vocab + 8))
        .collect();
    let all_inside = ids.iter().all(|&id| id < vocab);
    assert_eq!(tokenizer.decode(&ids).is_ok(), all_inside, "{ids:?}");
    let mut stream = tokenizer.stream_decoder();
    let mut streamed = String::new();
    for &id in &ids {
        match stream.push(id) {
            Ok(piece) => streamed.push_str(&piece),
            Err(_) => assert!(id >= vocab),
        }
    }
    streamed.push_str(&stream.finish());
    if all_inside {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| tokenizer.token_bytes(id).unwrap_or_default().to_vec())
            .collect();
        assert_eq!(streamed, String::from_utf8_lossy(&bytes), "{ids:?}");
    }
}
