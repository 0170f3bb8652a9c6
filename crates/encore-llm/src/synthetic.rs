//! Synthetic models: the architecture and tensor types of a real model
//! with deterministic random weights, written as GGUF. [`synthetic_gguf`]
//! writes a Llama model from a [`SyntheticSpec`]; [`synthetic_like`] copies
//! any model's metadata and tensor list (its header is enough: the data
//! may be absent, as in a sparse file) and fills every tensor with random
//! values of its type.
//!
//! Speed on random weights equals speed on real ones, so benchmarks on a
//! machine that cannot receive the real file use these; small ones back the
//! reference tests. Quantized blocks are filled with random scales and codes
//! directly, so every stored value is exactly representable.

use encore_ops::DType;

use crate::gguf::{GgufWriter, Value};

/// Shape and types of a synthetic model.
#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub rope_base: f32,
    /// Type of the projection and feed-forward weights.
    pub weight_type: DType,
    /// Type of the (tied) embedding table.
    pub embed_type: DType,
    pub seed: u64,
}

impl SyntheticSpec {
    /// SmolLM2-135M's architecture, shapes and tensor types.
    pub fn smollm2_135m(seed: u64) -> SyntheticSpec {
        SyntheticSpec {
            n_layer: 30,
            n_embd: 576,
            n_ff: 1536,
            n_head: 9,
            n_head_kv: 3,
            vocab: 49152,
            context_length: 8192,
            rope_base: 100_000.0,
            weight_type: DType::Q4_1,
            embed_type: DType::Q8_0,
            seed,
        }
    }

    /// A small model for reference tests.
    pub fn tiny(seed: u64) -> SyntheticSpec {
        SyntheticSpec {
            n_layer: 2,
            n_embd: 64,
            n_ff: 128,
            n_head: 4,
            n_head_kv: 2,
            vocab: 288,
            context_length: 256,
            rope_base: 10_000.0,
            weight_type: DType::Q4_1,
            embed_type: DType::Q8_0,
            seed,
        }
    }
}

/// splitmix64: a small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `[lo, hi)`.
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}

/// Random weights of `n` elements in `dtype`, with values around `±scale`.
fn random_tensor(rng: &mut Rng, dtype: DType, n: usize, scale: f32) -> Vec<u8> {
    let blocks = n / dtype.block_len();
    let mut out = Vec::with_capacity(dtype.bytes_for(n).unwrap_or(0));
    match dtype {
        DType::F32 => (0..n).for_each(|_| out.extend(rng.uniform(-scale, scale).to_le_bytes())),
        DType::F16 => (0..n).for_each(|_| out.extend(f16_bytes(rng.uniform(-scale, scale)))),
        DType::BF16 => (0..n).for_each(|_| {
            out.extend(half::bf16::from_f32(rng.uniform(-scale, scale)).to_le_bytes())
        }),
        DType::Q8_0 => (0..blocks).for_each(|_| {
            out.extend(f16_bytes(rng.uniform(0.5, 1.0) * scale / 127.0));
            (0..32).for_each(|_| out.push(rng.next() as u8));
        }),
        DType::Q4_0 => (0..blocks).for_each(|_| {
            out.extend(f16_bytes(rng.uniform(0.5, 1.0) * scale / 8.0));
            (0..16).for_each(|_| out.push(rng.next() as u8));
        }),
        DType::Q4_1 => (0..blocks).for_each(|_| {
            let d = rng.uniform(0.5, 1.0) * scale / 8.0;
            out.extend(f16_bytes(d));
            out.extend(f16_bytes(-7.5 * d + rng.uniform(-0.1, 0.1) * scale));
            (0..16).for_each(|_| out.push(rng.next() as u8));
        }),
        // Every other type: random codes, and each block's scales (f16)
        // drawn so that values land around `±scale`.
        _ => {
            let bytes = dtype.block_bytes();
            let magnitude = match dtype {
                DType::Q5_0 | DType::Q5_1 => 16.0,
                DType::IQ4_NL => 127.0,
                DType::Q2_K => 45.0,
                DType::Q3_K => 128.0,
                DType::Q4_K | DType::Q5_K => 500.0,
                _ => 4000.0, // Q6_K, IQ4_XS: 8-bit scales times wide codes
            };
            for _ in 0..blocks {
                let start = out.len();
                (0..bytes).for_each(|_| out.push(rng.next() as u8));
                for (j, &at) in dtype.scale_offsets().iter().enumerate() {
                    // The first scale multiplies; a second one (a minimum)
                    // is smaller, as quantizers make it.
                    let d = rng.uniform(0.5, 1.0) * scale / magnitude / (1 + 3 * j) as f32;
                    out[start + at..start + at + 2].copy_from_slice(&f16_bytes(d));
                }
            }
        }
    }
    out
}

/// A model with `template`'s metadata and tensors (names, shapes, types),
/// every tensor filled with deterministic random values of its type: norm
/// weights near 1, biases and other vectors small, matrices around
/// ±0.2 (the embedding table ±1). Speed on it equals speed on the real
/// weights; only its template's header is read.
pub fn synthetic_like(template: &crate::gguf::GgufFile, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let mut w = GgufWriter::new();
    for (key, value) in template.metadata() {
        w.add_metadata(key.clone(), value.clone());
    }
    for t in template.tensors() {
        let n = t.n_elements as usize;
        let data = match (t.dims.len() == 1, t.dtype) {
            (true, DType::F32) if t.name.ends_with("norm.weight") => (0..n)
                .flat_map(|_| rng.uniform(0.8, 1.2).to_le_bytes())
                .collect(),
            (true, DType::F32) => random_tensor(&mut rng, DType::F32, n, 0.05),
            (true, dtype) => random_tensor(&mut rng, dtype, n, 1.0),
            _ if t.name == "token_embd.weight" => random_tensor(&mut rng, t.dtype, n, 1.0),
            _ => random_tensor(&mut rng, t.dtype, n, 0.2),
        };
        // The writer fails only on duplicate names or size mismatches, which
        // a template read by the reader cannot produce.
        let _ = w.add_tensor(t.name.clone(), &t.dims, t.dtype, data);
    }
    w.to_bytes()
}

/// Writes a synthetic Llama model as GGUF bytes, with a byte-level GPT-2
/// vocabulary (first 256 tokens are the bytes, the rest are filler).
pub fn synthetic_gguf(spec: &SyntheticSpec) -> Vec<u8> {
    let mut rng = Rng(spec.seed);
    let mut w = GgufWriter::new();
    let (d, ff) = (spec.n_embd, spec.n_ff);
    let head_dim = d / spec.n_head;
    let kv = spec.n_head_kv * head_dim;
    w.add_metadata("general.architecture", Value::String("llama".into()));
    w.add_metadata("general.name", Value::String("synthetic".into()));
    w.add_metadata("llama.block_count", Value::U32(spec.n_layer as u32));
    w.add_metadata("llama.embedding_length", Value::U32(d as u32));
    w.add_metadata("llama.feed_forward_length", Value::U32(ff as u32));
    w.add_metadata("llama.attention.head_count", Value::U32(spec.n_head as u32));
    w.add_metadata(
        "llama.attention.head_count_kv",
        Value::U32(spec.n_head_kv as u32),
    );
    w.add_metadata(
        "llama.context_length",
        Value::U32(spec.context_length as u32),
    );
    w.add_metadata("llama.rope.freq_base", Value::F32(spec.rope_base));
    w.add_metadata("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    let tokens: Vec<String> = (0..spec.vocab)
        .map(|i| match i {
            0..=255 => crate::tokenizer::byte_symbol(i as u8).to_string(),
            _ => format!("<filler{i}>"),
        })
        .collect();
    w.add_metadata("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.add_metadata("tokenizer.ggml.pre", Value::String("smollm".into()));
    w.add_metadata(
        "tokenizer.ggml.tokens",
        Value::Array(crate::gguf::Array::String(tokens)),
    );
    w.add_metadata(
        "tokenizer.ggml.merges",
        Value::Array(crate::gguf::Array::String(Vec::new())),
    );
    w.add_metadata(
        "tokenizer.ggml.bos_token_id",
        Value::U32(spec.vocab as u32 - 1),
    );
    w.add_metadata(
        "tokenizer.ggml.eos_token_id",
        Value::U32(spec.vocab as u32 - 2),
    );
    let mut add = |name: String, dims: &[usize], dtype: DType, scale: f32, rng: &mut Rng| {
        let n: usize = dims.iter().product();
        let dims: Vec<u64> = dims.iter().map(|&x| x as u64).collect();
        let data = random_tensor(rng, dtype, n, scale);
        // The writer only fails on duplicate names or size mismatches, which
        // this generator never produces.
        let _ = w.add_tensor(name, &dims, dtype, data);
    };
    add(
        "token_embd.weight".into(),
        &[d, spec.vocab],
        spec.embed_type,
        1.0,
        &mut rng,
    );
    let wt = spec.weight_type;
    for i in 0..spec.n_layer {
        let name = |s: &str| format!("blk.{i}.{s}");
        add(name("attn_norm.weight"), &[d], DType::F32, 1.0, &mut rng);
        add(name("attn_q.weight"), &[d, d], wt, 0.2, &mut rng);
        add(name("attn_k.weight"), &[d, kv], wt, 0.2, &mut rng);
        add(name("attn_v.weight"), &[d, kv], wt, 0.2, &mut rng);
        add(name("attn_output.weight"), &[d, d], wt, 0.2, &mut rng);
        add(name("ffn_norm.weight"), &[d], DType::F32, 1.0, &mut rng);
        add(name("ffn_gate.weight"), &[d, ff], wt, 0.2, &mut rng);
        add(name("ffn_up.weight"), &[d, ff], wt, 0.2, &mut rng);
        add(name("ffn_down.weight"), &[ff, d], wt, 0.2, &mut rng);
    }
    add("output_norm.weight".into(), &[d], DType::F32, 1.0, &mut rng);
    w.to_bytes()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::gguf::GgufFile;

    #[test]
    fn random_tensors_of_every_type_are_finite_and_bounded() {
        let mut rng = Rng(5);
        for dtype in DType::ALL {
            let n = 256 * 8;
            let data = random_tensor(&mut rng, dtype, n, 0.2);
            assert_eq!(Some(data.len()), dtype.bytes_for(n), "{dtype}");
            assert_eq!(dtype.first_non_finite(&data), None, "{dtype}");
            let mut values = vec![0f32; n];
            encore_ops::cpu::dequantize_row(dtype, &data, &mut values).unwrap();
            let max = values.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert!(max > 0.01 && max < 2.0, "{dtype}: largest |value| {max}");
        }
    }

    #[test]
    fn a_model_like_a_template_has_its_metadata_and_tensors() {
        let template = GgufFile::from_bytes(synthetic_gguf(&SyntheticSpec::tiny(1))).unwrap();
        let like = GgufFile::from_bytes(synthetic_like(&template, 2)).unwrap();
        assert_eq!(like.metadata(), template.metadata());
        let shape = |f: &GgufFile| -> Vec<_> {
            f.tensors()
                .iter()
                .map(|t| (t.name.clone(), t.dims.clone(), t.dtype))
                .collect()
        };
        assert_eq!(shape(&like), shape(&template));
        let differs = like
            .tensors()
            .iter()
            .zip(template.tensors())
            .all(|(a, b)| like.tensor_data(a) != template.tensor_data(b));
        assert!(differs, "every tensor holds new random data");
    }
}
