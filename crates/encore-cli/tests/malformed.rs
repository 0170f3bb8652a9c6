//! Malformed model files through the `encore` binary: each must end the
//! process with a non-zero status and exactly one `error: ` line on stderr
//! that names what is wrong (the key, tensor or field), with no panic and
//! nothing on stdout.
//!
//! Every broken file starts from the tiny synthetic model and breaks one
//! thing, either by rewriting it through [`GgufWriter`] or by patching bytes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use encore_llm::gguf::{GgufFile, GgufWriter, Value};
mod common;

use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use encore_ops::DType;

fn tiny() -> Vec<u8> {
    synthetic_gguf(&SyntheticSpec::tiny(1))
}

/// A directory of its own for each test's files.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("malformed")
        .join(test);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(test: &str, name: &str, bytes: &[u8]) -> PathBuf {
    let path = scratch(test).join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn run_generate(model: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_encore"))
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--device", "cpu", "-n", "4"])
        .args(extra)
        .arg("hi")
        .output()
        .unwrap()
}

/// Runs `generate` on `model` and checks it fails cleanly with one error
/// line containing every string of `expected`.
fn assert_rejected(model: &Path, expected: &[&str]) {
    let out = run_generate(model, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = format!(
        "model {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        model.display()
    );
    assert!(!out.status.success(), "exit status 0\n{context}");
    assert!(out.status.code().is_some(), "killed by a signal\n{context}");
    assert!(!stderr.contains("panicked"), "panic\n{context}");
    assert!(stdout.is_empty(), "output on stdout\n{context}");
    common::assert_one_error_line(&stderr, expected, &context);
}

/// A tensor as read from a file, ready to be written again.
struct Tensor {
    name: String,
    dims: Vec<u64>,
    dtype: DType,
    data: Vec<u8>,
}

/// The tiny model rewritten after `edit` changes its metadata or tensors.
fn rewrite(edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<Tensor>)) -> Vec<u8> {
    let file = GgufFile::from_bytes(tiny()).unwrap();
    let mut metadata = file.metadata().to_vec();
    let mut tensors: Vec<Tensor> = file
        .tensors()
        .iter()
        .map(|t| Tensor {
            name: t.name.clone(),
            dims: t.dims.clone(),
            dtype: t.dtype,
            data: file.tensor_data(t).to_vec(),
        })
        .collect();
    edit(&mut metadata, &mut tensors);
    let mut w = GgufWriter::new();
    for (key, value) in metadata {
        w.add_metadata(key, value);
    }
    for t in tensors {
        w.add_tensor(t.name, &t.dims, t.dtype, t.data).unwrap();
    }
    w.to_bytes()
}

fn without_key(key: &str) -> Vec<u8> {
    rewrite(|metadata, _| {
        let before = metadata.len();
        metadata.retain(|(k, _)| k != key);
        assert_eq!(metadata.len(), before - 1, "no key {key}");
    })
}

fn with_value(key: &str, value: Value) -> Vec<u8> {
    rewrite(|metadata, _| {
        let entry = metadata.iter_mut().find(|(k, _)| k == key).unwrap();
        entry.1 = value;
    })
}

fn find(bytes: &[u8], needle: &[u8]) -> usize {
    bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{:?} not found", String::from_utf8_lossy(needle)))
}

/// Where the fields of a tensor description start in the file.
struct InfoFields {
    n_dims: usize,
    dims: usize,
    dtype: usize,
    offset: usize,
}

fn tensor_info(bytes: &[u8], name: &str) -> InfoFields {
    let n_dims = find(bytes, name.as_bytes()) + name.len();
    let count = u32::from_le_bytes(bytes[n_dims..n_dims + 4].try_into().unwrap()) as usize;
    let dtype = n_dims + 4 + 8 * count;
    InfoFields {
        n_dims,
        dims: n_dims + 4,
        dtype,
        offset: dtype + 4,
    }
}

fn put_u32(bytes: &mut [u8], at: usize, value: u32) {
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], at: usize, value: u64) {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

#[test]
fn valid_tiny_model_generates() {
    let path = write("valid", "tiny.gguf", &tiny());
    let out = run_generate(&path, &["--temperature", "0", "--raw"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "stderr:\n{stderr}");
    assert!(
        !stderr.lines().any(|l| l.starts_with("error: ")),
        "stderr:\n{stderr}"
    );
}

#[test]
fn wrong_magic() {
    let mut bytes = tiny();
    bytes[..4].copy_from_slice(b"GGML");
    assert_rejected(
        &write("magic", "m.gguf", &bytes),
        &["not a GGUF file", "GGML"],
    );
}

#[test]
fn wrong_version() {
    let mut bytes = tiny();
    put_u32(&mut bytes, 4, 7);
    assert_rejected(&write("version", "m.gguf", &bytes), &["version 7"]);
}

#[test]
fn empty_file() {
    assert_rejected(&write("empty", "m.gguf", &[]), &["magic"]);
}

#[test]
fn truncated_in_header() {
    let bytes = tiny();
    let path = write("trunc_header", "m.gguf", &bytes[..12]);
    assert_rejected(&path, &["tensor_count"]);
    let path = write("trunc_header", "m2.gguf", &bytes[..6]);
    assert_rejected(&path, &["version"]);
}

#[test]
fn truncated_in_metadata() {
    let bytes = tiny();
    // Early cuts leave too few bytes for the tensor descriptions the header
    // announces; later ones end inside a key or a value.
    let path = write("trunc_meta", "early.gguf", &bytes[..100]);
    assert_rejected(&path, &["tensor_count", "at most"]);
    let at = find(&bytes, b"tokenizer.ggml.tokens") + 200;
    let path = write("trunc_meta", "array.gguf", &bytes[..at]);
    assert_rejected(&path, &["tokenizer.ggml.tokens", "array length"]);
    let merges = find(&bytes, b"tokenizer.ggml.merges");
    let path = write("trunc_meta", "element.gguf", &bytes[..merges - 8 - 3]);
    assert_rejected(&path, &["tokenizer.ggml.tokens", "element 287"]);
    let path = write("trunc_meta", "key.gguf", &bytes[..merges + 5]);
    assert_rejected(&path, &["metadata entry", "key"]);
}

#[test]
fn truncated_in_tensor_infos() {
    let bytes = tiny();
    let info = tensor_info(&bytes, "blk.0.attn_q.weight");
    let path = write("trunc_info", "m.gguf", &bytes[..info.dims + 3]);
    assert_rejected(&path, &["blk.0.attn_q.weight", "dimension"]);
}

#[test]
fn truncated_in_tensor_data() {
    let bytes = tiny();
    let path = write("trunc_data", "m.gguf", &bytes[..bytes.len() - 100]);
    assert_rejected(&path, &["output_norm.weight", "past the end"]);
    let info = tensor_info(&bytes, "output_norm.weight");
    let data_start = (info.offset + 8).next_multiple_of(32);
    let path = write("trunc_data", "no_data.gguf", &bytes[..data_start]);
    assert_rejected(&path, &["token_embd.weight", "past the end"]);
}

#[test]
fn tensor_data_past_the_end() {
    let mut bytes = tiny();
    let info = tensor_info(&bytes, "blk.1.ffn_down.weight");
    put_u64(&mut bytes, info.offset, 1 << 40);
    let path = write("past_end", "m.gguf", &bytes);
    assert_rejected(&path, &["blk.1.ffn_down.weight", "past the end"]);
}

#[test]
fn misaligned_tensor_offset() {
    let mut bytes = tiny();
    let info = tensor_info(&bytes, "blk.0.attn_norm.weight");
    let offset = u64::from_le_bytes(bytes[info.offset..info.offset + 8].try_into().unwrap());
    put_u64(&mut bytes, info.offset, offset + 4);
    let path = write("misaligned", "m.gguf", &bytes);
    assert_rejected(&path, &["blk.0.attn_norm.weight", "alignment"]);
}

#[test]
fn absurd_counts() {
    let mut bytes = tiny();
    put_u64(&mut bytes, 8, u64::MAX);
    assert_rejected(&write("counts", "tensors.gguf", &bytes), &["tensor_count"]);

    let mut bytes = tiny();
    put_u64(&mut bytes, 16, 1 << 40);
    assert_rejected(&write("counts", "kv.gguf", &bytes), &["metadata_kv_count"]);

    // The first key's length.
    let mut bytes = tiny();
    put_u64(&mut bytes, 24, u64::MAX - 3);
    let path = write("counts", "key_len.gguf", &bytes);
    assert_rejected(&path, &["metadata entry 0", "string length"]);

    // The token array's length.
    let mut bytes = tiny();
    let at = find(&bytes, b"tokenizer.ggml.tokens") + "tokenizer.ggml.tokens".len() + 4 + 4;
    put_u64(&mut bytes, at, 1 << 60);
    let path = write("counts", "array_len.gguf", &bytes);
    assert_rejected(&path, &["tokenizer.ggml.tokens", "array length"]);
}

#[test]
fn absurd_dims() {
    let mut bytes = tiny();
    let info = tensor_info(&bytes, "token_embd.weight");
    put_u64(&mut bytes, info.dims + 8, 1 << 40);
    let path = write("dims", "huge.gguf", &bytes);
    assert_rejected(&path, &["token_embd.weight"]);

    let mut bytes = tiny();
    let info = tensor_info(&bytes, "token_embd.weight");
    put_u64(&mut bytes, info.dims, u64::MAX);
    put_u64(&mut bytes, info.dims + 8, u64::MAX);
    let path = write("dims", "overflow.gguf", &bytes);
    assert_rejected(&path, &["token_embd.weight", "overflows"]);

    let mut bytes = tiny();
    let info = tensor_info(&bytes, "blk.0.attn_norm.weight");
    put_u32(&mut bytes, info.n_dims, 1000);
    let path = write("dims", "n_dims.gguf", &bytes);
    assert_rejected(&path, &["blk.0.attn_norm.weight", "n_dims"]);

    let mut bytes = tiny();
    let info = tensor_info(&bytes, "blk.0.attn_norm.weight");
    put_u64(&mut bytes, info.dims, 0);
    let path = write("dims", "zero.gguf", &bytes);
    assert_rejected(&path, &["blk.0.attn_norm.weight", "zero"]);
}

#[test]
fn absurd_hyperparameters() {
    let path = write(
        "hyper",
        "layers.gguf",
        &with_value("llama.block_count", Value::U32(4_000_000_000)),
    );
    assert_rejected(&path, &["llama.block_count", "exceeds"]);
    let path = write(
        "hyper",
        "embd.gguf",
        &with_value("llama.embedding_length", Value::U32(0)),
    );
    assert_rejected(&path, &["llama.embedding_length", "zero"]);
    let path = write(
        "hyper",
        "heads.gguf",
        &with_value("llama.attention.head_count", Value::U32(3)),
    );
    assert_rejected(&path, &["llama.attention.head_count", "must divide"]);
    let path = write(
        "hyper",
        "kv_heads.gguf",
        &with_value("llama.attention.head_count_kv", Value::U32(8)),
    );
    assert_rejected(&path, &["llama.attention.head_count_kv", "exceeds"]);
    let path = write(
        "hyper",
        "negative.gguf",
        &with_value("llama.feed_forward_length", Value::I32(-128)),
    );
    assert_rejected(&path, &["llama.feed_forward_length"]);
}

#[test]
fn unsupported_tensor_type() {
    let mut bytes = tiny();
    let info = tensor_info(&bytes, "blk.0.attn_q.weight");
    put_u32(&mut bytes, info.dtype, 12);
    let path = write("dtype", "q4_k.gguf", &bytes);
    assert_rejected(&path, &["blk.0.attn_q.weight", "Q4_K"]);
    put_u32(&mut bytes, info.dtype, 9999);
    let path = write("dtype", "unknown.gguf", &bytes);
    assert_rejected(&path, &["blk.0.attn_q.weight", "9999"]);
}

#[test]
fn required_key_of_wrong_type() {
    let bytes = with_value("llama.block_count", Value::String("two".into()));
    let path = write("wrong_type", "block_count.gguf", &bytes);
    assert_rejected(&path, &["llama.block_count", "string"]);
    let bytes = with_value("general.architecture", Value::U32(1));
    let path = write("wrong_type", "arch.gguf", &bytes);
    assert_rejected(&path, &["general.architecture"]);
    let bytes = with_value("tokenizer.ggml.tokens", Value::U32(1));
    let path = write("wrong_type", "tokens.gguf", &bytes);
    assert_rejected(&path, &["tokenizer.ggml.tokens"]);
}

#[test]
fn missing_required_key() {
    for key in [
        "general.architecture",
        "llama.embedding_length",
        "llama.block_count",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
    ] {
        let path = write("missing_key", &format!("{key}.gguf"), &without_key(key));
        assert_rejected(&path, &[key, "missing"]);
    }
}

#[test]
fn unsupported_architecture() {
    let bytes = with_value("general.architecture", Value::String("mamba".into()));
    let path = write("arch", "m.gguf", &bytes);
    assert_rejected(&path, &["mamba"]);
}

#[test]
fn bad_tokenizer() {
    let bytes = with_value(
        "tokenizer.ggml.merges",
        Value::Array(encore_llm::gguf::Array::String(vec!["nospace".into()])),
    );
    let path = write("tokenizer", "merge.gguf", &bytes);
    assert_rejected(&path, &["merge 0", "nospace"]);
    let bytes = with_value("tokenizer.ggml.model", Value::String("wordpiece".into()));
    let path = write("tokenizer", "model.gguf", &bytes);
    assert_rejected(&path, &["wordpiece"]);
}

#[test]
fn missing_tensor() {
    for name in [
        "blk.1.ffn_down.weight",
        "token_embd.weight",
        "output_norm.weight",
    ] {
        let bytes = rewrite(|_, tensors| tensors.retain(|t| t.name != name));
        let path = write("missing_tensor", &format!("{name}.gguf"), &bytes);
        assert_rejected(&path, &[name, "missing"]);
    }
}

#[test]
fn tensor_of_wrong_shape() {
    let bytes = rewrite(|_, tensors| {
        let t = tensors
            .iter_mut()
            .find(|t| t.name == "blk.0.attn_k.weight")
            .unwrap();
        t.dims = vec![64, 64];
        t.data = vec![0; DType::Q4_1.bytes_for(64 * 64).unwrap()];
    });
    let path = write("shape", "attn_k.gguf", &bytes);
    assert_rejected(&path, &["blk.0.attn_k.weight", "[64, 64]"]);
    let bytes = rewrite(|_, tensors| {
        let t = tensors
            .iter_mut()
            .find(|t| t.name == "blk.1.ffn_norm.weight")
            .unwrap();
        t.dims = vec![32];
        t.data.truncate(32 * 4);
    });
    let path = write("shape", "ffn_norm.gguf", &bytes);
    assert_rejected(&path, &["blk.1.ffn_norm.weight", "[32]"]);
}

#[test]
fn missing_file() {
    let path = scratch("missing_file").join("does-not-exist.gguf");
    assert_rejected(&path, &["does-not-exist.gguf", "No such file"]);
}

#[test]
fn directory_instead_of_file() {
    let path = scratch("dir").join("model.gguf");
    std::fs::create_dir_all(&path).unwrap();
    assert_rejected(&path, &["model.gguf", "is a directory"]);
}

/// A model file that cannot be used is refused before any device is
/// probed: run as on a fresh headless machine (no `XDG_RUNTIME_DIR`) with
/// the default device (`auto`, which probes CUDA and then the wgpu
/// adapters) and the Vulkan loader reporting everything it does
/// (`VK_LOADER_DEBUG=all`), stderr is the one error line and nothing else.
#[test]
fn an_unusable_file_is_refused_before_a_device_is_probed() {
    let dir = scratch("before_probe");
    std::fs::create_dir_all(dir.join("folder.gguf")).unwrap();
    let cases = [
        (dir.join("does-not-exist.gguf"), "No such file"),
        (dir.join("folder.gguf"), "is a directory"),
        (write("before_probe", "empty.gguf", b""), "empty.gguf"),
    ];
    for (model, expected) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_encore"))
            .arg("generate")
            .arg("--model")
            .arg(&model)
            .arg("hi")
            .env_remove("XDG_RUNTIME_DIR")
            .env("VK_LOADER_DEBUG", "all")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let context = format!("model {}\nstderr:\n{stderr}", model.display());
        assert!(!out.status.success(), "exit status 0\n{context}");
        assert!(out.stdout.is_empty(), "output on stdout\n{context}");
        assert_eq!(stderr.lines().count(), 1, "more than the error\n{context}");
        common::assert_one_error_line(&stderr, &[expected], &context);
    }
}
