//! Arbitrary bytes into the GGUF reader. A file that parses must then be
//! fully readable: every metadata value through every typed getter, every
//! tensor's data (and, for small tensors, its dequantized values), the model
//! configuration and tokenizer it describes, and a rewrite through
//! `GgufWriter` that parses back to the same contents.

#![no_main]

use encore_llm::gguf::{GgufFile, GgufWriter};
use encore_llm::tokenizer::{Tokenizer, TokenizerSpec};
use encore_llm::ModelConfig;
use libfuzzer_sys::fuzz_target;

/// Tensors up to this many elements are also dequantized.
const MAX_DEQUANTIZE: u64 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    read_everything(&file);
    rewrite_round_trip(&file);
});

fn read_everything(file: &GgufFile) {
    for (key, value) in file.metadata() {
        assert!(
            file.get(key).is_some_and(|v| std::ptr::eq(v, value)),
            "key `{key}`"
        );
        let _ = (
            value.type_name(),
            value.as_i128(),
            value.as_f64(),
            value.as_str(),
        );
        if let Some(array) = value.as_array() {
            let _ = (
                array.len(),
                array.type_name(),
                array.as_i128s(),
                array.as_f64s(),
            );
        }
        let _ = file.get_str(key);
        let _ = file.get_u32(key);
        let _ = file.get_u64(key);
        let _ = file.get_f32(key);
        let _ = file.get_bool(key);
        let _ = file.get_str_array(key);
        let _ = file.get_f32_array(key);
        let _ = file.get_i32_array(key);
    }
    for tensor in file.tensors() {
        assert_eq!(file.tensor(&tensor.name).ok(), Some(tensor));
        let bytes = file.tensor_data(tensor);
        assert_eq!(bytes.len(), tensor.n_bytes, "tensor `{}`", tensor.name);
        if tensor.n_elements <= MAX_DEQUANTIZE {
            let mut values = vec![0f32; tensor.n_elements as usize];
            assert!(encore_ops::cpu::dequantize_row(tensor.dtype, bytes, &mut values).is_ok());
        }
    }
    let _ = ModelConfig::from_gguf(file);
    if let Ok(spec) = TokenizerSpec::from_gguf(file) {
        if let Ok(tokenizer) = Tokenizer::from_spec(spec) {
            let ids = tokenizer.encode("Hello, world! <|im_end|>", true, true);
            assert!(ids.is_ok());
        }
    }
}

/// Writing the parsed contents again gives a file with the same metadata,
/// tensor shapes and tensor bytes.
fn rewrite_round_trip(file: &GgufFile) {
    let mut writer = GgufWriter::new();
    for (key, value) in file.metadata() {
        writer.add_metadata(key.clone(), value.clone());
    }
    for t in file.tensors() {
        let added = writer.add_tensor(
            t.name.clone(),
            &t.dims,
            t.dtype,
            file.tensor_data(t).to_vec(),
        );
        assert!(added.is_ok(), "tensor `{}` rejected by the writer", t.name);
    }
    let again = GgufFile::from_bytes(writer.to_bytes());
    let Ok(again) = again else {
        panic!("the rewritten file does not parse: {again:?}");
    };
    // Debug strings compare NaN metadata values as equal.
    assert_eq!(
        format!("{:?}", again.metadata()),
        format!("{:?}", file.metadata())
    );
    assert_eq!(again.tensors().len(), file.tensors().len());
    for (a, b) in again.tensors().iter().zip(file.tensors()) {
        assert_eq!((&a.name, &a.dims, a.dtype), (&b.name, &b.dims, b.dtype));
        assert_eq!(again.tensor_data(a), file.tensor_data(b));
    }
}
