//! Writes the starting corpus of both fuzz targets into `corpus/<target>/`:
//!
//! ```text
//! cargo run --example seeds -- [path/to/model.gguf]
//! ```
//!
//! `gguf` gets small valid files from `GgufWriter` (every value type, nested
//! arrays, every tensor type, a whole micro model) and, when a model file is
//! given, its first 4 KiB. `tokenizer` gets texts in several scripts, with
//! special tokens, whitespace runs, digits and invalid UTF-8.

use std::path::Path;

use encore_llm::gguf::{Array, GgufWriter, Value};
use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use encore_ops::DType;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let gguf = root.join("gguf");
    let text = root.join("tokenizer");
    std::fs::create_dir_all(&gguf)?;
    std::fs::create_dir_all(&text)?;

    if let Some(model) = std::env::args_os().nth(1) {
        let bytes = std::fs::read(model)?;
        std::fs::write(
            gguf.join("seed-model-head"),
            &bytes[..bytes.len().min(4096)],
        )?;
    }
    std::fs::write(gguf.join("seed-values"), every_value_type().to_bytes())?;
    std::fs::write(gguf.join("seed-tensors"), every_tensor_type()?.to_bytes())?;
    std::fs::write(
        gguf.join("seed-micro-model"),
        synthetic_gguf(&micro_model()),
    )?;

    let texts: [&[u8]; 10] = [
        b"Hello, world! The capital of France is Paris.",
        b"<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
        "caf\u{e9} na\u{ef}ve \u{65e5}\u{672c}\u{8a9e} \u{1f600}\u{1f44d}\u{1f3fd} \u{0627}\u{0644}\u{0639}".as_bytes(),
        b"  leading\t\ttabs\r\n\r\n\n   trailing   ",
        b"12345 3.14159 1,000,000 0x1F",
        b"it's we're they've I'm you'll he'd",
        b"<s></s><unk><|endoftext|><|eot_id|>",
        b"fn main() { println!(\"{}\", 1 + 2); }",
        b"\xff\xfe bad \xc3\x28 utf8 \xe2\x82",
        b"",
    ];
    for (i, t) in texts.iter().enumerate() {
        std::fs::write(text.join(format!("seed-text-{i}")), t)?;
    }
    Ok(())
}

/// One metadata entry of each of GGUF's value types, and nested arrays.
fn every_value_type() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama")
        .add_metadata("u8", Value::U8(7))
        .add_metadata("i8", Value::I8(-7))
        .add_metadata("u16", Value::U16(700))
        .add_metadata("i16", Value::I16(-700))
        .add_metadata("u32", Value::U32(70_000))
        .add_metadata("i32", Value::I32(-70_000))
        .add_metadata("f32", Value::F32(0.5))
        .add_metadata("bool", Value::Bool(true))
        .add_metadata("string", Value::String("text".into()))
        .add_metadata("u64", Value::U64(1 << 40))
        .add_metadata("i64", Value::I64(-(1 << 40)))
        .add_metadata("f64", Value::F64(-0.25))
        .add_metadata("array.i32", Value::Array(Array::I32(vec![1, -2, 3])))
        .add_metadata("array.f32", Value::Array(Array::F32(vec![0.5, 1.5])))
        .add_metadata("array.bool", Value::Array(Array::Bool(vec![true, false])))
        .add_metadata(
            "array.string",
            Value::Array(Array::String(vec!["a b".into(), String::new()])),
        )
        .add_metadata(
            "array.nested",
            Value::Array(Array::Array(vec![
                Array::U8(vec![1, 2]),
                Array::Array(vec![Array::U64(vec![9])]),
            ])),
        );
    w
}

/// One small tensor of each supported type, with `general.alignment` 64.
fn every_tensor_type() -> Result<GgufWriter, Box<dyn std::error::Error>> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.alignment", 64u32);
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let dims = [dtype.block_len() as u64, 2];
        let n_bytes = dtype.bytes_for(dtype.block_len() * 2).ok_or("size")?;
        let data = (0..n_bytes).map(|b| (b * 7 + i) as u8 % 61).collect();
        w.add_tensor(format!("tensor.{i}"), &dims, dtype, data)?;
    }
    Ok(w)
}

/// The smallest model the synthetic writer makes: one layer, width 32.
fn micro_model() -> SyntheticSpec {
    SyntheticSpec {
        n_layer: 1,
        n_embd: 32,
        n_ff: 32,
        n_head: 1,
        n_head_kv: 1,
        vocab: 256,
        context_length: 64,
        weight_type: DType::Q4_0,
        embed_type: DType::Q4_0,
        ..SyntheticSpec::tiny(7)
    }
}
