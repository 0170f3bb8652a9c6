//! Synthetic models: the architecture, tensor names, shapes and types of a
//! real model with deterministic random weights, written as GGUF.
//!
//! Speed on random weights equals speed on real ones, so benchmarks on a
//! machine that cannot receive a real file (a 70B model is tens of
//! gigabytes) write one of these there instead; small ones back the
//! reference tests. Three sources describe a model ([`SyntheticModel`]):
//!
//! - [`ModelShape`]: a full-size Qwen2.5, Llama 3 or Qwen3-MoE model from
//!   [`ModelShape::ALL`], in a [`FileType`] whose tensor types follow
//!   llama-quantize's choices, so the file matches the real one byte count
//!   for byte count;
//! - [`SyntheticSpec`]: a small Llama model of chosen types, for tests
//!   ([`synthetic_gguf`]);
//! - any GGUF file's header ([`synthetic_like`]): its metadata and tensor
//!   list, the data left absent.
//!
//! The weights have the magnitudes of trained ones, so activations stay in
//! the range a real model's do (a generator with a biased mean drives a
//! 7B-sized model's feed-forward outputs past f16's range on every token,
//! where a real model's pass it only on a few):
//! every matrix is zero-mean with a standard deviation of `1/sqrt(fan_in)`,
//! the embedding table 0.02, norm weights lie in `[0.8, 1.2]`, biases are
//! small. Quantized blocks are written directly, not quantized from floats:
//! random codes under a scale of random sign (so each block is centred),
//! sub-block minimums set to centre the unsigned codes, and the scale
//! calibrated per type against the CPU's dequantization, so every stored
//! value is exactly representable and finite.
//!
//! Files are streamed ([`SyntheticModel::write`]): each tensor is generated
//! in chunks in parallel and written in order, never held whole. Each chunk
//! draws from its own generator, seeded by the model's seed, the tensor's
//! index and the chunk's, so the bytes do not depend on the thread count.

use std::io::{self, Write};

use encore_ops::DType;
use rayon::prelude::*;

use crate::error::{LlmError, Result};
use crate::gguf::{Array, GgufFile, GgufWriter, Value};

/// Shape and types of a small synthetic Llama model ([`synthetic_gguf`]).
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

/// A model family: its architecture and the conventions of its files
/// (biases, RoPE, tokenizer, special tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Qwen2.5 (`qwen2`): Q, K and V biases, RoPE base 1e6, ChatML tokens.
    Qwen2,
    /// Llama 3.1 and 3.3 (`llama`): no biases, RoPE base 500 000 with
    /// Llama 3.1's frequency factors in `rope_freqs.weight`.
    Llama3,
    /// Qwen3's mixtures of experts (`qwen3moe`): QK-norm, no biases,
    /// routed experts ([`ModelShape::experts`]), Qwen's tokens.
    Qwen3Moe,
}

impl Family {
    /// `general.architecture`.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Qwen2 => "qwen2",
            Family::Llama3 => "llama",
            Family::Qwen3Moe => "qwen3moe",
        }
    }

    fn rope_base(self) -> f32 {
        match self {
            Family::Qwen2 | Family::Qwen3Moe => 1_000_000.0,
            Family::Llama3 => 500_000.0,
        }
    }

    fn norm_eps(self) -> f32 {
        match self {
            Family::Qwen2 | Family::Qwen3Moe => 1e-6,
            Family::Llama3 => 1e-5,
        }
    }

    fn tokenizer_pre(self) -> &'static str {
        match self {
            Family::Qwen2 | Family::Qwen3Moe => "qwen2",
            Family::Llama3 => "llama-bpe",
        }
    }

    /// The special tokens from [`ModelShape::first_special`] on, with their
    /// token types.
    fn special_tokens(self) -> Vec<(String, i32)> {
        match self {
            Family::Qwen2 | Family::Qwen3Moe => QWEN2_SPECIALS
                .iter()
                .map(|&t| {
                    // The tool-call tags are added tokens, not control ones.
                    let kind = if t.starts_with("<|") { CONTROL } else { 4 };
                    (t.to_owned(), kind)
                })
                .collect(),
            Family::Llama3 => (0..256)
                .map(|i| {
                    let name = match LLAMA3_SPECIALS.get(i) {
                        Some(&name) if !name.is_empty() => name.to_owned(),
                        _ => format!("<|reserved_special_token_{}|>", llama3_reserved(i)),
                    };
                    (name, CONTROL)
                })
                .collect(),
        }
    }

    /// BOS and EOS as offsets from [`ModelShape::first_special`].
    fn bos_eos(self) -> (usize, usize) {
        match self {
            Family::Qwen2 | Family::Qwen3Moe => (0, 2),
            Family::Llama3 => (0, 9),
        }
    }

    fn chat_template(self) -> &'static str {
        match self {
            Family::Qwen2 | Family::Qwen3Moe => QWEN2_TEMPLATE,
            Family::Llama3 => LLAMA3_TEMPLATE,
        }
    }
}

/// `tokenizer.ggml.token_type` values.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const UNUSED: i32 = 5;

/// Qwen2.5's special tokens, from id 151643 on.
const QWEN2_SPECIALS: [&str; 22] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
];

/// Llama 3's named special tokens, the first of its 256 (from id
/// 128000); an empty name is a reserved token, as are all after these.
const LLAMA3_SPECIALS: [&str; 11] = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "",
    "",
    "<|finetune_right_pad_id|>",
    "",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
];

/// The number Llama 3 gives the reserved special token at offset `i`.
fn llama3_reserved(i: usize) -> usize {
    match i {
        2 | 3 => i - 2,
        5 => 2,
        _ => i.saturating_sub(8),
    }
}

/// ChatML, as Qwen2.5's template renders a conversation without tools.
const QWEN2_TEMPLATE: &str = concat!(
    "{%- for message in messages %}",
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
);

/// Llama 3's turn format, without its tool and date handling.
const LLAMA3_TEMPLATE: &str = concat!(
    "{{- bos_token }}{%- for message in messages %}",
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'",
    " + message['content'] | trim + '<|eot_id|>' }}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}",
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}",
    "{%- endif %}",
);

/// A few BPE merges of common English pairs, each part a byte symbol or an
/// earlier merge's result, so that the vocabulary has merges to apply (as
/// every real `gpt2` vocabulary does); `Ġ` is the space.
const MERGES: [(&str, &str); 32] = [
    ("Ġ", "t"),
    ("Ġ", "a"),
    ("h", "e"),
    ("i", "n"),
    ("r", "e"),
    ("o", "n"),
    ("Ġt", "he"),
    ("e", "r"),
    ("Ġ", "s"),
    ("a", "t"),
    ("Ġ", "w"),
    ("Ġ", "o"),
    ("e", "n"),
    ("Ġ", "c"),
    ("i", "t"),
    ("i", "s"),
    ("a", "n"),
    ("o", "r"),
    ("e", "s"),
    ("Ġ", "b"),
    ("e", "d"),
    ("Ġ", "f"),
    ("in", "g"),
    ("Ġ", "p"),
    ("o", "u"),
    ("Ġa", "n"),
    ("a", "l"),
    ("a", "r"),
    ("Ġt", "o"),
    ("Ġ", "m"),
    ("Ġo", "f"),
    ("Ġan", "d"),
];

/// The hyperparameters of a model, as its GGUF file states them.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    /// The name the table and the `synthetic_model` example know it by.
    pub name: &'static str,
    pub family: Family,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Elements of one attention head: `n_embd / n_head` but where the
    /// model says otherwise (Qwen3's heads are wider).
    pub head_dim: usize,
    /// The routed experts that replace every layer's feed-forward, for a
    /// mixture of experts.
    pub experts: Option<ExpertShape>,
    /// Rows of the embedding table (and of the output head): the tokens.
    pub vocab: usize,
    pub context_length: usize,
    /// Whether the output head is the embedding table (no `output.weight`).
    pub tied_embeddings: bool,
    /// The id of the family's first special token (Qwen2.5's
    /// `<|endoftext|>`, Llama 3's `<|begin_of_text|>`); the others follow.
    pub first_special: usize,
}

/// The experts of a mixture-of-experts [`ModelShape`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    /// Experts in a layer.
    pub count: usize,
    /// Experts each position runs.
    pub used: usize,
    /// The width of one expert's feed-forward.
    pub ff: usize,
}

impl ModelShape {
    /// Real models' shapes, two of one layer with the real row sizes and
    /// vocabularies (for tests on a machine without room for a whole
    /// model), and a small mixture of experts for tests.
    pub const ALL: [ModelShape; 11] = [
        ModelShape::qwen25("qwen2.5-0.5b", 24, 896, 4864, 14, 2, 151_936, true),
        ModelShape::qwen25("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152_064, false),
        ModelShape::qwen25("qwen2.5-14b", 48, 5120, 13824, 40, 8, 152_064, false),
        ModelShape::qwen25("qwen2.5-32b", 64, 5120, 27648, 40, 8, 152_064, false),
        ModelShape::qwen25("qwen2.5-72b", 80, 8192, 29568, 64, 8, 152_064, false),
        ModelShape::llama3("llama-3.1-8b", 32, 4096, 14336, 32, 8),
        ModelShape::llama3("llama-3.3-70b", 80, 8192, 28672, 64, 8),
        ModelShape::qwen25("qwen2.5-7b-1layer", 1, 3584, 18944, 28, 4, 152_064, false),
        ModelShape::llama3("llama-3.1-8b-1layer", 1, 4096, 14336, 32, 8),
        ModelShape::qwen3moe(
            "qwen3-30b-a3b",
            [48, 2048, 6144, 32, 4, 128],
            ExpertShape {
                count: 128,
                used: 8,
                ff: 768,
            },
            151_936,
        ),
        ModelShape::qwen3moe(
            "qwen3-moe-tiny",
            [2, 256, 512, 4, 2, 64],
            ExpertShape {
                count: 8,
                used: 2,
                ff: 128,
            },
            4096,
        ),
    ];

    /// The shape named `name` in [`ModelShape::ALL`].
    pub fn named(name: &str) -> Option<&'static ModelShape> {
        ModelShape::ALL.iter().find(|s| s.name == name)
    }

    #[allow(clippy::too_many_arguments)]
    const fn qwen25(
        name: &'static str,
        n_layer: usize,
        n_embd: usize,
        n_ff: usize,
        n_head: usize,
        n_head_kv: usize,
        vocab: usize,
        tied_embeddings: bool,
    ) -> ModelShape {
        ModelShape {
            name,
            family: Family::Qwen2,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim: n_embd / n_head,
            experts: None,
            vocab,
            context_length: 32_768,
            tied_embeddings,
            first_special: 151_643,
        }
    }

    const fn llama3(
        name: &'static str,
        n_layer: usize,
        n_embd: usize,
        n_ff: usize,
        n_head: usize,
        n_head_kv: usize,
    ) -> ModelShape {
        ModelShape {
            name,
            family: Family::Llama3,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim: n_embd / n_head,
            experts: None,
            vocab: 128_256,
            context_length: 131_072,
            tied_embeddings: false,
            first_special: 128_000,
        }
    }

    /// A Qwen3-MoE shape: `[layers, width, dense feed-forward width (the
    /// file states it, the model does not use it), heads, KV heads, head
    /// size]`, its experts and vocabulary (Qwen's special tokens at its
    /// end, the real ids in the real vocabulary of 151,936). Untied.
    const fn qwen3moe(
        name: &'static str,
        [n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim]: [usize; 6],
        experts: ExpertShape,
        vocab: usize,
    ) -> ModelShape {
        ModelShape {
            name,
            family: Family::Qwen3Moe,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            experts: Some(experts),
            vocab,
            context_length: 40_960,
            tied_embeddings: false,
            first_special: if vocab == 151_936 {
                151_643
            } else {
                vocab - 32
            },
        }
    }

    /// Elements of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Whether llama.cpp counts the model as 70B-class (80 layers with
    /// grouped-query attention, Llama's and Qwen2's rule), which
    /// llama-quantize gives wider `attn_v` types.
    fn is_70b_class(&self) -> bool {
        self.n_layer == 80 && self.n_head_kv < self.n_head
    }

    /// Checks that the shape describes a model the file can hold.
    fn check(&self) -> Result<()> {
        let bad = |why: String| Err(LlmError::Model(format!("shape `{}`: {why}", self.name)));
        if self.n_layer == 0 || self.n_embd == 0 || self.n_ff == 0 || self.n_head == 0 {
            return bad("layers, widths and heads must be nonzero".into());
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("the head size {} must be even", self.head_dim));
        }
        if let Some(e) = self.experts {
            if e.count == 0 || e.used == 0 || e.used > e.count || e.ff == 0 {
                return bad(format!(
                    "{} experts of width {}, {} used: need at least one, and no more used than there are",
                    e.count, e.ff, e.used
                ));
            }
        }
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!(
                "{} KV heads must divide the {} heads",
                self.n_head_kv, self.n_head
            ));
        }
        let specials = self.family.special_tokens().len();
        if self.first_special < 256 || self.first_special + specials > self.vocab {
            return bad(format!(
                "{specials} special tokens from id {} do not fit after the 256 byte tokens \
                 in a vocabulary of {}",
                self.first_special, self.vocab
            ));
        }
        Ok(())
    }
}

/// How a model file's weight matrices are stored, by llama.cpp's name.
// llama.cpp's names: `Q4_K_M` reads better here than `Q4KM`.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileType {
    /// llama-quantize's Q4_K_M mix: Q4_K, with Q6_K for the output head and
    /// for some layers' `attn_v` and `ffn_down`.
    Q4_K_M,
    /// Every matrix Q8_0.
    Q8_0,
    /// Every matrix BF16, as converted from the original weights.
    BF16,
}

impl FileType {
    /// Every file type.
    pub const ALL: [FileType; 3] = [FileType::Q4_K_M, FileType::Q8_0, FileType::BF16];

    /// llama.cpp's name (`Q4_K_M`).
    pub fn name(self) -> &'static str {
        match self {
            FileType::Q4_K_M => "Q4_K_M",
            FileType::Q8_0 => "Q8_0",
            FileType::BF16 => "BF16",
        }
    }

    /// The file type named `name`, in any case.
    pub fn from_name(name: &str) -> Option<FileType> {
        FileType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// `general.file_type`: llama.cpp's `llama_ftype` number.
    pub fn ggml_file_type(self) -> u32 {
        match self {
            FileType::Q4_K_M => 15,
            FileType::Q8_0 => 7,
            FileType::BF16 => 32,
        }
    }

    /// The type of a matrix that no rule singles out.
    fn default_type(self) -> DType {
        match self {
            FileType::Q4_K_M => DType::Q4_K,
            FileType::Q8_0 => DType::Q8_0,
            FileType::BF16 => DType::BF16,
        }
    }
}

/// What a weight matrix does: llama-quantize picks types by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Embedding,
    Output,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    FfnGate,
    FfnUp,
    FfnDown,
    /// A mixture of experts' router, kept F32 by llama-quantize.
    FfnGateInp,
}

/// llama-quantize's layers that get more bits: the first and last eighth,
/// and every third layer between.
fn use_more_bits(layer: usize, n_layer: usize) -> bool {
    layer < n_layer / 8
        || layer >= 7 * n_layer / 8
        || (layer as isize - (n_layer / 8) as isize).rem_euclid(3) == 2
}

/// The type llama-quantize gives the matrix of `role` in `layer`, whose
/// rows (GGUF dimension 0) hold `row_len` weights.
fn weight_type(
    shape: &ModelShape,
    ftype: FileType,
    role: Role,
    layer: usize,
    row_len: usize,
) -> DType {
    let default = ftype.default_type();
    if !default.is_quantized() {
        return default;
    }
    let more_bits = use_more_bits(layer, shape.n_layer);
    let q4_k_m = ftype == FileType::Q4_K_M;
    let chosen = match role {
        // A tied embedding table is the output head, and typed as one.
        Role::Output | Role::Embedding if role == Role::Output || shape.tied_embeddings => {
            if !row_len.is_multiple_of(default.block_len()) {
                DType::Q8_0
            } else if default != DType::Q8_0 {
                DType::Q6_K
            } else {
                default
            }
        }
        Role::AttnV => {
            let t = if q4_k_m && more_bits {
                DType::Q6_K
            } else {
                default
            };
            match t {
                DType::Q3_K | DType::Q4_K if shape.is_70b_class() => DType::Q5_K,
                t => t,
            }
        }
        Role::FfnDown if q4_k_m && more_bits => DType::Q6_K,
        Role::FfnGateInp => DType::F32,
        _ => default,
    };
    fallback(chosen, row_len)
}

/// llama-quantize's replacement for a type whose blocks do not divide the
/// rows: a type of 32-weight blocks, else F16.
fn fallback(dtype: DType, row_len: usize) -> DType {
    if row_len.is_multiple_of(dtype.block_len()) {
        return dtype;
    }
    let replacement = match dtype {
        DType::IQ4_XS => DType::IQ4_NL,
        DType::Q2_K | DType::Q3_K => DType::Q4_0,
        DType::Q4_K => DType::Q5_0,
        DType::Q5_K => DType::Q5_1,
        DType::Q6_K => DType::Q8_0,
        _ => DType::F16,
    };
    if row_len.is_multiple_of(replacement.block_len()) {
        replacement
    } else {
        DType::F16
    }
}

/// Llama 3.1's RoPE frequency factors for heads of `head_dim` (factor 8,
/// low- and high-frequency factors 1 and 4, original context 8192): 1 for
/// short wavelengths, 8 for long ones, a smooth blend between.
fn llama3_rope_factors(head_dim: usize, base: f32) -> Vec<f32> {
    let (factor, low, high, original) = (8.0f64, 1.0f64, 4.0f64, 8192.0f64);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / f64::from(base).powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < original / high {
                1.0
            } else if wavelen > original / low {
                factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

/// The values a tensor holds.
#[derive(Clone, Debug, PartialEq)]
enum Values {
    /// Zero-mean, with this standard deviation.
    Normal(f32),
    /// Uniform in `[lo, hi)`: norm weights.
    Uniform(f32, f32),
    /// Exactly these: RoPE frequency factors.
    Exact(Vec<f32>),
}

impl Values {
    /// A weight matrix's values: zero-mean, `1/sqrt(fan_in)`.
    fn matrix(fan_in: usize) -> Values {
        Values::Normal(1.0 / (fan_in.max(1) as f32).sqrt())
    }

    /// The root mean square, which quantized types keep (zero-mean) where
    /// they cannot hold the values themselves.
    fn rms(&self) -> f32 {
        match self {
            Values::Normal(std) => *std,
            Values::Uniform(lo, hi) => ((lo * lo + lo * hi + hi * hi) / 3.0).sqrt(),
            Values::Exact(v) => {
                (v.iter().map(|x| x * x).sum::<f32>() / v.len().max(1) as f32).sqrt()
            }
        }
    }
}

/// Tensors to add: name, dimensions (GGUF order), type and values.
#[derive(Default)]
struct Plan(Vec<(String, Vec<u64>, DType, Values)>);

impl Plan {
    fn add(&mut self, name: impl Into<String>, dims: &[usize], dtype: DType, values: Values) {
        let dims = dims.iter().map(|&d| d as u64).collect();
        self.0.push((name.into(), dims, dtype, values));
    }
}

/// The standard deviation of the embedding table.
const EMBED_STD: f32 = 0.02;
/// The standard deviation of biases.
const BIAS_STD: f32 = 0.02;
/// [`SyntheticSpec`] models' matrices are `SPEC_GAIN / sqrt(fan_in)`, a
/// little smaller than a trained model's, and their embedding table larger
/// ([`SPEC_EMBED_STD`]): their attention stays soft and their residual
/// stream led by the embedding, which the reference tests' tolerance for
/// 8-bit activations through their few narrow layers assumes.
const SPEC_GAIN: f32 = 0.7;
/// The standard deviation of [`SyntheticSpec`] models' embedding tables.
const SPEC_EMBED_STD: f32 = 0.5;
/// The range of norm weights.
const NORM_RANGE: (f32, f32) = (0.8, 1.2);

/// A model to write: its GGUF header (metadata, and each tensor's name,
/// shape and type) and how each tensor's values are drawn. Building one
/// generates nothing; [`SyntheticModel::write`] does, as it writes.
#[derive(Clone, Debug)]
pub struct SyntheticModel {
    header: GgufWriter,
    values: Vec<Values>,
}

/// Where [`SyntheticModel::write`] has got to, after a tensor.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    /// The tensor just written.
    pub tensor: &'a str,
    /// Its index, counting from 0, and the number of tensors.
    pub index: usize,
    pub tensors: usize,
    /// Bytes of the file written so far, and the file's length.
    pub written: u64,
    pub total: u64,
}

impl SyntheticModel {
    /// A full-size model of `shape` stored as `ftype`: llama.cpp's metadata,
    /// tensor names and shapes, llama-quantize's tensor types, and a
    /// vocabulary of the real size with the family's special tokens at
    /// their real ids.
    pub fn from_shape(shape: &ModelShape, ftype: FileType) -> Result<SyntheticModel> {
        shape.check()?;
        let family = shape.family;
        let arch = family.architecture();
        let key = |k: &str| format!("{arch}.{k}");
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", arch);
        w.add_metadata("general.name", shape.name);
        w.add_metadata("general.file_type", ftype.ggml_file_type());
        if ftype != FileType::BF16 {
            w.add_metadata("general.quantization_version", 2u32);
        }
        let u32_of = |v: usize| Value::U32(u32::try_from(v).unwrap_or(u32::MAX));
        w.add_metadata(key("block_count"), u32_of(shape.n_layer));
        w.add_metadata(key("context_length"), u32_of(shape.context_length));
        w.add_metadata(key("embedding_length"), u32_of(shape.n_embd));
        w.add_metadata(key("feed_forward_length"), u32_of(shape.n_ff));
        w.add_metadata(key("attention.head_count"), u32_of(shape.n_head));
        w.add_metadata(key("attention.head_count_kv"), u32_of(shape.n_head_kv));
        w.add_metadata(key("rope.freq_base"), Value::F32(family.rope_base()));
        w.add_metadata(
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(family.norm_eps()),
        );
        if family == Family::Llama3 {
            w.add_metadata(key("vocab_size"), u32_of(shape.vocab));
            w.add_metadata(key("rope.dimension_count"), u32_of(shape.head_dim()));
        }
        if let Some(e) = shape.experts {
            w.add_metadata(key("attention.key_length"), u32_of(shape.head_dim));
            w.add_metadata(key("attention.value_length"), u32_of(shape.head_dim));
            w.add_metadata(key("expert_count"), u32_of(e.count));
            w.add_metadata(key("expert_used_count"), u32_of(e.used));
            w.add_metadata(key("expert_feed_forward_length"), u32_of(e.ff));
        }
        add_vocabulary(&mut w, shape);

        let (d, ff, hd) = (shape.n_embd, shape.n_ff, shape.head_dim());
        let (q, kv) = (shape.n_head * hd, shape.n_head_kv * hd);
        let typed = |role, layer, row_len| weight_type(shape, ftype, role, layer, row_len);
        let norm = || Values::Uniform(NORM_RANGE.0, NORM_RANGE.1);
        let mut plan = Plan::default();
        if family == Family::Llama3 {
            let factors = llama3_rope_factors(hd, family.rope_base());
            plan.add(
                "rope_freqs.weight",
                &[hd / 2],
                DType::F32,
                Values::Exact(factors),
            );
        }
        let embed_type = typed(Role::Embedding, 0, d);
        plan.add(
            "token_embd.weight",
            &[d, shape.vocab],
            embed_type,
            Values::Normal(EMBED_STD),
        );
        for i in 0..shape.n_layer {
            let name = |s: &str| format!("blk.{i}.{s}");
            // `dims` in GGUF order: the row length first, then the rows
            // (then the experts).
            let matrix = |plan: &mut Plan, s: &str, role, dims: &[usize]| {
                let rows = dims[0];
                plan.add(name(s), dims, typed(role, i, rows), Values::matrix(rows));
            };
            plan.add(name("attn_norm.weight"), &[d], DType::F32, norm());
            matrix(&mut plan, "attn_q.weight", Role::AttnQ, &[d, q]);
            matrix(&mut plan, "attn_k.weight", Role::AttnK, &[d, kv]);
            matrix(&mut plan, "attn_v.weight", Role::AttnV, &[d, kv]);
            if family == Family::Qwen2 {
                for (s, n) in [("attn_q.bias", d), ("attn_k.bias", kv), ("attn_v.bias", kv)] {
                    plan.add(name(s), &[n], DType::F32, Values::Normal(BIAS_STD));
                }
            }
            matrix(&mut plan, "attn_output.weight", Role::AttnOutput, &[q, d]);
            if family == Family::Qwen3Moe {
                plan.add(name("attn_q_norm.weight"), &[hd], DType::F32, norm());
                plan.add(name("attn_k_norm.weight"), &[hd], DType::F32, norm());
            }
            plan.add(name("ffn_norm.weight"), &[d], DType::F32, norm());
            match shape.experts {
                Some(e) => {
                    let (n, f) = (e.count, e.ff);
                    matrix(&mut plan, "ffn_gate_inp.weight", Role::FfnGateInp, &[d, n]);
                    matrix(&mut plan, "ffn_gate_exps.weight", Role::FfnGate, &[d, f, n]);
                    matrix(&mut plan, "ffn_up_exps.weight", Role::FfnUp, &[d, f, n]);
                    matrix(&mut plan, "ffn_down_exps.weight", Role::FfnDown, &[f, d, n]);
                }
                None => {
                    matrix(&mut plan, "ffn_gate.weight", Role::FfnGate, &[d, ff]);
                    matrix(&mut plan, "ffn_up.weight", Role::FfnUp, &[d, ff]);
                    matrix(&mut plan, "ffn_down.weight", Role::FfnDown, &[ff, d]);
                }
            }
        }
        plan.add("output_norm.weight", &[d], DType::F32, norm());
        if !shape.tied_embeddings {
            let dtype = typed(Role::Output, 0, d);
            plan.add("output.weight", &[d, shape.vocab], dtype, Values::matrix(d));
        }
        let mut values = Vec::new();
        for (name, dims, dtype, v) in plan.0 {
            w.add_tensor_info(name, &dims, dtype)?;
            values.push(v);
        }
        Ok(SyntheticModel { header: w, values })
    }

    /// A small Llama model of `spec`'s shape and types, with a byte-level
    /// GPT-2 vocabulary (the first 256 tokens are the bytes, the rest
    /// filler; BOS and EOS the last two) and a tied embedding table. Its
    /// magnitudes suit the reference tests (`SPEC_GAIN`).
    pub fn from_spec(spec: &SyntheticSpec) -> SyntheticModel {
        let mut w = GgufWriter::new();
        let (d, ff) = (spec.n_embd, spec.n_ff);
        let head_dim = d / spec.n_head.max(1);
        let kv = spec.n_head_kv * head_dim;
        let u32_of = |v: usize| Value::U32(u32::try_from(v).unwrap_or(u32::MAX));
        w.add_metadata("general.architecture", "llama");
        w.add_metadata("general.name", "synthetic");
        w.add_metadata("llama.block_count", u32_of(spec.n_layer));
        w.add_metadata("llama.embedding_length", u32_of(d));
        w.add_metadata("llama.feed_forward_length", u32_of(ff));
        w.add_metadata("llama.attention.head_count", u32_of(spec.n_head));
        w.add_metadata("llama.attention.head_count_kv", u32_of(spec.n_head_kv));
        w.add_metadata("llama.context_length", u32_of(spec.context_length));
        w.add_metadata("llama.rope.freq_base", Value::F32(spec.rope_base));
        w.add_metadata("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
        let tokens: Vec<String> = (0..spec.vocab)
            .map(|i| match i {
                0..=255 => crate::tokenizer::byte_symbol(i as u8).to_string(),
                _ => format!("<filler{i}>"),
            })
            .collect();
        w.add_metadata("tokenizer.ggml.model", "gpt2");
        w.add_metadata("tokenizer.ggml.pre", "smollm");
        w.add_metadata("tokenizer.ggml.tokens", Array::String(tokens));
        w.add_metadata("tokenizer.ggml.merges", Array::String(Vec::new()));
        w.add_metadata(
            "tokenizer.ggml.bos_token_id",
            u32_of(spec.vocab.saturating_sub(1)),
        );
        w.add_metadata(
            "tokenizer.ggml.eos_token_id",
            u32_of(spec.vocab.saturating_sub(2)),
        );

        let norm = || Values::Uniform(NORM_RANGE.0, NORM_RANGE.1);
        let spec_matrix = |fan_in: usize| Values::Normal(SPEC_GAIN / (fan_in.max(1) as f32).sqrt());
        let mut plan = Plan::default();
        plan.add(
            "token_embd.weight",
            &[d, spec.vocab],
            spec.embed_type,
            Values::Normal(SPEC_EMBED_STD),
        );
        let wt = spec.weight_type;
        for i in 0..spec.n_layer {
            let name = |s: &str| format!("blk.{i}.{s}");
            plan.add(name("attn_norm.weight"), &[d], DType::F32, norm());
            plan.add(name("attn_q.weight"), &[d, d], wt, spec_matrix(d));
            plan.add(name("attn_k.weight"), &[d, kv], wt, spec_matrix(d));
            plan.add(name("attn_v.weight"), &[d, kv], wt, spec_matrix(d));
            plan.add(name("attn_output.weight"), &[d, d], wt, spec_matrix(d));
            plan.add(name("ffn_norm.weight"), &[d], DType::F32, norm());
            plan.add(name("ffn_gate.weight"), &[d, ff], wt, spec_matrix(d));
            plan.add(name("ffn_up.weight"), &[d, ff], wt, spec_matrix(d));
            plan.add(name("ffn_down.weight"), &[ff, d], wt, spec_matrix(ff));
        }
        plan.add("output_norm.weight", &[d], DType::F32, norm());
        let mut values = Vec::new();
        for (name, dims, dtype, v) in plan.0 {
            // The writer refuses only shapes the types cannot hold (rows
            // that are not whole blocks); such a spec's file lacks the
            // tensor, and loading it says which.
            if w.add_tensor_info(name, &dims, dtype).is_ok() {
                values.push(v);
            }
        }
        SyntheticModel { header: w, values }
    }

    /// A model with `template`'s metadata and tensors (names, shapes,
    /// types); only its header is read, so its data may be absent. Values
    /// follow the tensor's name and shape: norm weights in `[0.8, 1.2]`,
    /// Llama 3.1's factors for `rope_freqs.weight`, other vectors (biases)
    /// small, the embedding table 0.02, every other matrix `1/sqrt(fan_in)`.
    pub fn like(template: &GgufFile) -> SyntheticModel {
        let mut w = GgufWriter::new();
        for (key, value) in template.metadata() {
            w.add_metadata(key.clone(), value.clone());
        }
        let arch = template.get_str("general.architecture").unwrap_or("llama");
        let rope_base = template
            .get_f32(&format!("{arch}.rope.freq_base"))
            .unwrap_or(10_000.0);
        let mut values = Vec::new();
        for t in template.tensors() {
            let v = match t.dims.as_slice() {
                [n] if t.name == "rope_freqs.weight" => {
                    Values::Exact(llama3_rope_factors(2 * *n as usize, rope_base))
                }
                [_] if t.name.ends_with("norm.weight") => {
                    Values::Uniform(NORM_RANGE.0, NORM_RANGE.1)
                }
                [_] => Values::Normal(BIAS_STD),
                _ if t.name == "token_embd.weight" => Values::Normal(EMBED_STD),
                [fan_in, ..] => Values::matrix(*fan_in as usize),
                [] => Values::Normal(BIAS_STD),
            };
            // The template's tensors passed the reader's checks, which are
            // the writer's.
            if w.add_tensor_info(t.name.clone(), &t.dims, t.dtype).is_ok() {
                values.push(v);
            }
        }
        SyntheticModel { header: w, values }
    }

    /// The metadata the file holds.
    pub fn metadata(&self) -> &[(String, Value)] {
        self.header.metadata()
    }

    /// Each tensor's name, dimensions (GGUF order: row length first) and type.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = (&str, &[u64], DType)> + '_ {
        self.header.tensors()
    }

    /// The file's length in bytes.
    pub fn file_len(&self) -> u64 {
        self.header.file_len()
    }

    /// The file's header alone, padded to where the data begins (for a
    /// caller that wants the metadata without the weights).
    pub fn write_header(&self, out: &mut dyn Write) -> io::Result<u64> {
        self.header.write_header(out)
    }

    /// Writes the file to `out`, generating each tensor as its turn comes
    /// (in chunks, on every core), and returns the bytes written.
    /// `progress` hears of each tensor once it is written. The same `seed`
    /// gives the same bytes.
    pub fn write(
        &self,
        seed: u64,
        out: &mut dyn Write,
        mut progress: impl FnMut(&Progress<'_>),
    ) -> io::Result<u64> {
        let mut units = Vec::new();
        for (_, _, dtype) in self.tensors() {
            if dtype.is_quantized() && !units.iter().any(|&(t, _)| t == dtype) {
                units.push((dtype, unit_std(dtype)?));
            }
        }
        let total = self.file_len();
        let header_len = self.header.write_header(&mut io::sink())?;
        let names: Vec<(&str, DType, u64)> = self
            .tensors()
            .map(|(name, dims, dtype)| (name, dtype, dims.iter().product()))
            .collect();
        let mut written_data = 0u64;
        let count = names.len();
        let alignment = u64::from(self.header.alignment());
        let mut buffers = [Vec::new(), Vec::new()];
        self.header.write_to(out, |index, out| {
            let (Some(&(name, dtype, n)), Some(values)) =
                (names.get(index), self.values.get(index))
            else {
                return Err(io::Error::other(format!("no values for tensor {index}")));
            };
            let unit = units
                .iter()
                .find(|&&(t, _)| t == dtype)
                .map_or(1.0, |&(_, u)| u);
            let tensor = TensorFill {
                dtype,
                values,
                unit,
                seed: mix(mix(seed) ^ index as u64),
            };
            tensor.stream(n as usize, out, &mut buffers)?;
            written_data = written_data.next_multiple_of(alignment)
                + dtype.bytes_for(n as usize).unwrap_or(0) as u64;
            progress(&Progress {
                tensor: name,
                index,
                tensors: count,
                written: header_len + written_data,
                total,
            });
            Ok(())
        })
    }

    /// The file's bytes, for models small enough to hold.
    pub fn to_bytes(&self, seed: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(usize::try_from(self.file_len()).unwrap_or(0));
        // Writing to memory fails only where calibrating a type does, which
        // dequantizing blocks of the right size never does; the generator
        // writes each tensor's exact size.
        let _ = self.write(seed, &mut out, |_| {});
        out
    }
}

/// Adds a `gpt2` vocabulary of the shape's size: the 256 byte symbols, a
/// few merged tokens, filler, the family's special tokens from
/// `first_special` and unused padding after them, as converted Qwen2.5
/// files have.
fn add_vocabulary(w: &mut GgufWriter, shape: &ModelShape) {
    let family = shape.family;
    let specials = family.special_tokens();
    let n_merges = MERGES.len().min(shape.first_special.saturating_sub(256));
    let mut tokens = Vec::with_capacity(shape.vocab);
    let mut types = Vec::with_capacity(shape.vocab);
    for i in 0..shape.vocab {
        let (token, kind) = if i < 256 {
            (crate::tokenizer::byte_symbol(i as u8).to_string(), NORMAL)
        } else if let Some((a, b)) = MERGES.get(i - 256).filter(|_| i - 256 < n_merges) {
            (format!("{a}{b}"), NORMAL)
        } else if i < shape.first_special {
            (format!("<filler{i}>"), NORMAL)
        } else if let Some((name, kind)) = specials.get(i - shape.first_special) {
            (name.clone(), *kind)
        } else {
            (format!("[PAD{i}]"), UNUSED)
        };
        tokens.push(token);
        types.push(kind);
    }
    let merges = MERGES[..n_merges]
        .iter()
        .map(|(a, b)| format!("{a} {b}"))
        .collect();
    let (bos, eos) = family.bos_eos();
    let id = |offset: usize| Value::U32(u32::try_from(shape.first_special + offset).unwrap_or(0));
    w.add_metadata("tokenizer.ggml.model", "gpt2");
    w.add_metadata("tokenizer.ggml.pre", family.tokenizer_pre());
    w.add_metadata("tokenizer.ggml.tokens", Array::String(tokens));
    w.add_metadata("tokenizer.ggml.token_type", Array::I32(types));
    w.add_metadata("tokenizer.ggml.merges", Array::String(merges));
    w.add_metadata("tokenizer.ggml.bos_token_id", id(bos));
    w.add_metadata("tokenizer.ggml.eos_token_id", id(eos));
    if family != Family::Llama3 {
        w.add_metadata("tokenizer.ggml.padding_token_id", id(0));
    }
    w.add_metadata(
        "tokenizer.ggml.add_bos_token",
        Value::Bool(family == Family::Llama3),
    );
    w.add_metadata("tokenizer.chat_template", family.chat_template());
}

/// A model like `template` (its metadata and tensors; only its header is
/// read), every tensor filled with deterministic random values of its type
/// ([`SyntheticModel::like`]). Held in memory: [`SyntheticModel::write`]
/// streams a large one to a file instead.
pub fn synthetic_like(template: &GgufFile, seed: u64) -> Vec<u8> {
    SyntheticModel::like(template).to_bytes(seed)
}

/// A small synthetic Llama model's GGUF bytes ([`SyntheticModel::from_spec`]).
pub fn synthetic_gguf(spec: &SyntheticSpec) -> Vec<u8> {
    SyntheticModel::from_spec(spec).to_bytes(spec.seed)
}

/// Bytes generated per chunk: each chunk has its own generator, so chunks
/// are generated in parallel and the bytes do not depend on the threads.
const CHUNK_BYTES: usize = 1 << 20;
/// Chunks generated at once, while the previous batch is written.
const BATCH_CHUNKS: usize = 32;

/// One tensor's generator.
struct TensorFill<'a> {
    dtype: DType,
    values: &'a Values,
    /// The standard deviation of the type's blocks at scale 1 ([`unit_std`]).
    unit: f32,
    seed: u64,
}

impl TensorFill<'_> {
    /// Elements per chunk: whole blocks, about [`CHUNK_BYTES`].
    fn chunk_len(&self) -> usize {
        self.dtype.block_len() * (CHUNK_BYTES / self.dtype.block_bytes()).max(1)
    }

    /// Writes the tensor's `n` elements to `out`: batches of chunks
    /// generated in parallel, each batch generated while the one before it
    /// is written. The two `buffers` are reused from tensor to tensor, so
    /// their memory is allocated and zeroed once.
    fn stream(&self, n: usize, out: &mut dyn Write, buffers: &mut [Vec<u8>; 2]) -> io::Result<()> {
        let chunks = n.div_ceil(self.chunk_len());
        let batches = chunks.div_ceil(BATCH_CHUNKS);
        let [current, next] = buffers;
        let mut len = self.generate(0, n, current);
        for batch in 0..batches {
            let next_len = std::thread::scope(|s| {
                let ahead =
                    (batch + 1 < batches).then(|| s.spawn(|| self.generate(batch + 1, n, next)));
                let written = out.write_all(&current[..len]);
                let next_len = match ahead {
                    Some(ahead) => ahead
                        .join()
                        .map_err(|_| io::Error::other("a generator thread panicked"))?,
                    None => 0,
                };
                written.map(|()| next_len)
            })?;
            std::mem::swap(current, next);
            len = next_len;
        }
        Ok(())
    }

    /// Fills the start of `out` (grown if too short) with batch `batch` of a
    /// tensor of `n` elements, and returns the batch's length in bytes.
    fn generate(&self, batch: usize, n: usize, out: &mut Vec<u8>) -> usize {
        let chunk = self.chunk_len();
        let first = (batch * BATCH_CHUNKS * chunk).min(n);
        let last = (first + BATCH_CHUNKS * chunk).min(n);
        let bytes_per_chunk = chunk / self.dtype.block_len() * self.dtype.block_bytes();
        let len = (last - first) / self.dtype.block_len() * self.dtype.block_bytes();
        if out.len() < len {
            out.resize(len, 0);
        }
        let fill_chunk = |(i, bytes): (usize, &mut [u8])| {
            let index = first / chunk + i;
            let mut rng = Rng(mix(self.seed ^ mix(index as u64)));
            fill(
                self.dtype,
                self.values,
                self.unit,
                index * chunk,
                &mut rng,
                bytes,
            );
        };
        let out = &mut out[..len];
        if len > bytes_per_chunk {
            out.par_chunks_mut(bytes_per_chunk)
                .enumerate()
                .for_each(fill_chunk);
        } else {
            out.chunks_mut(bytes_per_chunk)
                .enumerate()
                .for_each(fill_chunk);
        }
        len
    }
}

/// splitmix64's finalizer: a hash of `x`, for seeding.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// splitmix64: a small, fast deterministic generator.
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

    /// Near-normal with mean 0 and standard deviation 1: the sum of four
    /// uniform 16-bit values (bounded, so always finite), rescaled.
    fn normal(&mut self) -> f32 {
        let x = self.next();
        let sum = (x & 0xffff) + ((x >> 16) & 0xffff) + ((x >> 32) & 0xffff) + (x >> 48);
        // Mean 2 * 65535; variance 4 * (65536^2 - 1) / 12.
        (sum as f32 - 131_070.0) * (1.732_050_8 / 65_536.0)
    }

    /// Random bytes.
    fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut words = out.chunks_exact_mut(8);
        for word in &mut words {
            word.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = words.into_remainder();
        if !rest.is_empty() {
            let x = self.next().to_le_bytes();
            rest.copy_from_slice(&x[..rest.len()]);
        }
    }
}

/// Fills `out` (whole blocks of `dtype`) with values drawn as `values`
/// says; `first` is the index of the first element in the tensor, and
/// `unit` the standard deviation of `dtype`'s blocks at scale 1.
fn fill(dtype: DType, values: &Values, unit: f32, first: usize, rng: &mut Rng, out: &mut [u8]) {
    if dtype.is_quantized() {
        fill_blocks(dtype, values.rms() / unit, rng, out);
        return;
    }
    let width = dtype.block_bytes();
    for (i, slot) in out.chunks_exact_mut(width).enumerate() {
        let v = match values {
            Values::Normal(std) => std * rng.normal(),
            Values::Uniform(lo, hi) => rng.uniform(*lo, *hi),
            Values::Exact(v) => v.get(first + i).copied().unwrap_or(1.0),
        };
        match dtype {
            DType::F32 => slot.copy_from_slice(&v.to_le_bytes()),
            DType::F16 => slot.copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            _ => slot.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
}

/// Writes an f16 at byte `at` of `block`.
fn put_f16(block: &mut [u8], at: usize, v: half::f16) {
    block[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

/// Packs eight 6-bit sub-block scales and minimums into Q4_K's and Q5_K's
/// 12 bytes, as llama.cpp's `get_scale_min_k4` reads them: sub-blocks 0-3
/// in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums), sub-blocks
/// 4-7 in the nibbles of bytes 8-11 with their top two bits in the top
/// bits of bytes 0-7.
fn pack_k4_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xf) | ((m[j + 4] & 0xf) << 4);
    }
    q
}

/// Fills quantized blocks: random codes, each block's scale `scale` times a
/// random factor in `[0.75, 1.25)` with a random sign (centring the types
/// whose codes are signed), and the minimums of the unsigned types set to
/// centre their codes.
fn fill_blocks(dtype: DType, scale: f32, rng: &mut Rng, out: &mut [u8]) {
    // The largest |d| whose multiples (dmin = 16 d) stay finite in f16.
    let limit = 60_000.0 / 16.0;
    for block in out.chunks_exact_mut(dtype.block_bytes()) {
        rng.fill_bytes(block);
        let r = rng.next();
        let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
        let d = half::f16::from_f32((sign * scale * rng.uniform(0.75, 1.25)).clamp(-limit, limit));
        // Multiplying by a power of two is exact, so the minimums centre
        // the codes exactly.
        let times = |k: f32| half::f16::from_f32(d.to_f32() * k);
        match dtype {
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4_NL | DType::IQ4_XS => {
                put_f16(block, 0, d)
            }
            // w = d * q + m with q in 0..16 (0..32): m centres q at 7.5 (15.5).
            DType::Q4_1 => {
                put_f16(block, 0, d);
                put_f16(block, 2, half::f16::from_f32(-7.5 * d.to_f32()));
            }
            DType::Q5_1 => {
                put_f16(block, 0, d);
                put_f16(block, 2, half::f16::from_f32(-15.5 * d.to_f32()));
            }
            // w = d * sc * q - dmin * m, q in 0..4: dmin = 2 d and m = 3/4 sc
            // centre q at 1.5.
            DType::Q2_K => {
                let mut bits = r >> 1;
                for s in &mut block[..16] {
                    let sc = 8 + (bits & 7) as u8;
                    // round(3/4 sc), in integers.
                    let m = ((3 * sc + 2) / 4).min(15);
                    *s = sc | (m << 4);
                    bits >>= 3;
                }
                put_f16(block, 80, d);
                put_f16(block, 82, times(2.0));
            }
            DType::Q3_K => put_f16(block, 108, d),
            // q in 0..16 (0..32): dmin = 8 d (16 d) and m = 15/16 sc (31/32
            // sc) centre q at 7.5 (15.5).
            DType::Q4_K | DType::Q5_K => {
                let (levels, dmin) = if dtype == DType::Q4_K {
                    (15u16, 8u16)
                } else {
                    (31, 16)
                };
                let mut sc = [0u8; 8];
                let mut m = [0u8; 8];
                let mut bits = r >> 1;
                for j in 0..8 {
                    sc[j] = 32 + (bits & 31) as u8;
                    // round(sc * levels / (2 dmin)), in integers.
                    let m_j = (u16::from(sc[j]) * levels + dmin) / (2 * dmin);
                    m[j] = u8::try_from(m_j).unwrap_or(63).min(63);
                    bits >>= 5;
                }
                block[4..16].copy_from_slice(&pack_k4_scales(sc, m));
                put_f16(block, 0, d);
                put_f16(block, 2, times(f32::from(dmin)));
            }
            // Signed codes (q - 32); sub-block scales positive, as large as
            // a quantizer makes them.
            DType::Q6_K => {
                let mut bits = r >> 1;
                for s in &mut block[192..208] {
                    *s = 64 + (bits & 63) as u8;
                    bits = bits.rotate_right(6);
                }
                put_f16(block, 208, d);
            }
            DType::F32 | DType::F16 | DType::BF16 => {}
        }
    }
}

/// The standard deviation of `dtype`'s blocks as [`fill_blocks`] writes
/// them at scale 1, measured by dequantizing a sample on the CPU.
fn unit_std(dtype: DType) -> io::Result<f32> {
    let n = 1 << 16;
    let mut bytes = vec![0u8; dtype.bytes_for(n).unwrap_or(0)];
    fill_blocks(dtype, 1.0, &mut Rng(0x5eed), &mut bytes);
    let mut values = vec![0f32; n];
    encore_ops::cpu::dequantize_row(dtype, &bytes, &mut values)
        .map_err(|e| io::Error::other(format!("calibrating {dtype}: {e}")))?;
    let (mean, std) = mean_std(&values);
    if std.is_finite() && std > 0.0 && mean.is_finite() {
        Ok(std as f32)
    } else {
        Err(io::Error::other(format!(
            "calibrating {dtype}: standard deviation {std}"
        )))
    }
}

/// Mean and standard deviation, in f64.
fn mean_std(values: &[f32]) -> (f64, f64) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = values
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, var.sqrt())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::gguf::GgufFile;

    /// Dequantized values of `n` elements of `dtype` drawn as `values`.
    fn sample(dtype: DType, values: &Values, n: usize, seed: u64) -> Vec<f32> {
        let unit = if dtype.is_quantized() {
            unit_std(dtype).unwrap()
        } else {
            1.0
        };
        let mut bytes = vec![0u8; dtype.bytes_for(n).unwrap()];
        fill(dtype, values, unit, 0, &mut Rng(seed), &mut bytes);
        assert_eq!(dtype.first_non_finite(&bytes), None, "{dtype}");
        let mut out = vec![0f32; n];
        encore_ops::cpu::dequantize_row(dtype, &bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn every_type_is_zero_mean_with_the_target_deviation() {
        for dtype in DType::ALL {
            // A few thousand blocks.
            let n = dtype.block_len().max(32) * 2048;
            for target in [0.02f32, 1.0 / 4096f32.sqrt(), 1.0 / 29568f32.sqrt()] {
                let values = sample(dtype, &Values::Normal(target), n, 7);
                assert!(values.iter().all(|v| v.is_finite()), "{dtype}");
                let (mean, std) = mean_std(&values);
                let target = f64::from(target);
                assert!(
                    (std / target - 1.0).abs() < 0.1,
                    "{dtype}: std {std:.3e}, target {target:.3e}"
                );
                assert!(
                    mean.abs() < 0.05 * std,
                    "{dtype}: mean {mean:.3e}, std {std:.3e}"
                );
            }
        }
    }

    #[test]
    fn norms_and_factors_hold_their_values() {
        let norms = sample(DType::F32, &Values::Uniform(0.8, 1.2), 4096, 1);
        assert!(norms.iter().all(|v| (0.8..1.2).contains(v)));
        let factors = llama3_rope_factors(128, 500_000.0);
        assert_eq!(factors.len(), 64);
        // High frequencies unscaled, low ones by 8, a blend between.
        assert_eq!(factors[0], 1.0);
        assert_eq!(factors[63], 8.0);
        assert!(factors.windows(2).all(|w| w[0] <= w[1]));
        assert!(factors.iter().any(|&f| f > 1.0 && f < 8.0));
        assert_eq!(
            sample(DType::F32, &Values::Exact(factors.clone()), 64, 1),
            factors
        );
    }

    #[test]
    fn k4_scales_unpack_as_llama_cpp_reads_them() {
        let sc = [1, 22, 33, 44, 50, 61, 37, 63];
        let m = [63, 5, 16, 27, 38, 49, 60, 2];
        let q = pack_k4_scales(sc, m);
        for j in 0..8 {
            let (s, n) = if j < 4 {
                (q[j] & 63, q[j + 4] & 63)
            } else {
                (
                    (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
                    (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
                )
            };
            assert_eq!((s, n), (sc[j], m[j]), "sub-block {j}");
        }
    }

    #[test]
    fn layers_with_more_bits_follow_llama_quantize() {
        let more: Vec<usize> = (0..28).filter(|&i| use_more_bits(i, 28)).collect();
        assert_eq!(more, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
        let more: Vec<usize> = (0..8).filter(|&i| use_more_bits(i, 8)).collect();
        assert_eq!(more, [0, 3, 6, 7]);
    }

    fn types_of(model: &SyntheticModel) -> Vec<(String, DType)> {
        model
            .tensors()
            .map(|(name, _, dtype)| (name.to_owned(), dtype))
            .collect()
    }

    fn type_of(model: &SyntheticModel, name: &str) -> DType {
        model
            .tensors()
            .find(|(n, _, _)| *n == name)
            .map(|(_, _, t)| t)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    #[test]
    fn q4_k_m_types_follow_llama_quantize_on_the_72b_shape() {
        let shape = ModelShape::named("qwen2.5-72b").unwrap();
        let model = SyntheticModel::from_shape(shape, FileType::Q4_K_M).unwrap();
        assert_eq!(type_of(&model, "token_embd.weight"), DType::Q4_K);
        assert_eq!(type_of(&model, "output.weight"), DType::Q6_K);
        for i in 0..80 {
            let more = use_more_bits(i, 80);
            let t = |s: &str| type_of(&model, &format!("blk.{i}.{s}"));
            // Rows of 29568 are not whole super-blocks: Q6_K falls back to
            // Q8_0, Q4_K to Q5_0.
            let down = if more { DType::Q8_0 } else { DType::Q5_0 };
            assert_eq!(t("ffn_down.weight"), down, "layer {i}");
            // A 70B-class model's attn_v is at least Q5_K.
            let v = if more { DType::Q6_K } else { DType::Q5_K };
            assert_eq!(t("attn_v.weight"), v, "layer {i}");
            for s in [
                "attn_q.weight",
                "attn_k.weight",
                "attn_output.weight",
                "ffn_gate.weight",
                "ffn_up.weight",
            ] {
                assert_eq!(t(s), DType::Q4_K, "layer {i} {s}");
            }
            assert_eq!(t("attn_q.bias"), DType::F32);
            assert_eq!(t("ffn_norm.weight"), DType::F32);
        }
        let q8 = SyntheticModel::from_shape(shape, FileType::Q8_0).unwrap();
        let bf16 = SyntheticModel::from_shape(shape, FileType::BF16).unwrap();
        for (model, matrix) in [(&q8, DType::Q8_0), (&bf16, DType::BF16)] {
            for (name, dims, dtype) in model.tensors() {
                let want = if dims.len() == 2 { matrix } else { DType::F32 };
                assert_eq!(dtype, want, "{name}");
            }
        }
        assert!(bf16.file_len() > 140_000_000_000 && bf16.file_len() < 150_000_000_000);
    }

    #[test]
    fn a_tied_embedding_is_typed_as_the_output_head() {
        // Qwen2.5-0.5B: rows of 896 are not whole super-blocks.
        let shape = ModelShape::named("qwen2.5-0.5b").unwrap();
        let model = SyntheticModel::from_shape(shape, FileType::Q4_K_M).unwrap();
        assert_eq!(type_of(&model, "token_embd.weight"), DType::Q8_0);
        assert_eq!(type_of(&model, "blk.0.attn_q.weight"), DType::Q5_0);
        assert_eq!(type_of(&model, "blk.0.attn_v.weight"), DType::Q8_0);
        assert_eq!(type_of(&model, "blk.3.attn_v.weight"), DType::Q5_0);
        assert_eq!(type_of(&model, "blk.0.ffn_down.weight"), DType::Q6_K);
        assert_eq!(type_of(&model, "blk.3.ffn_down.weight"), DType::Q4_K);
        assert!(!types_of(&model).iter().any(|(n, _)| n == "output.weight"));
    }

    /// A small model of `family` with rows of whole super-blocks.
    fn small(family: Family, n_layer: usize) -> ModelShape {
        let (vocab, first_special, tied) = match family {
            Family::Qwen2 => (512, 400, true),
            Family::Llama3 => (768, 512, false),
            Family::Qwen3Moe => (512, 400, false),
        };
        ModelShape {
            name: "small",
            family,
            n_layer,
            n_embd: 256,
            n_ff: 512,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 64,
            experts: None,
            vocab,
            context_length: 4096,
            tied_embeddings: tied,
            first_special,
        }
    }

    #[test]
    fn a_small_q4_k_m_model_has_llama_quantize_types() {
        let model =
            SyntheticModel::from_shape(&small(Family::Llama3, 8), FileType::Q4_K_M).unwrap();
        assert_eq!(type_of(&model, "output.weight"), DType::Q6_K);
        assert_eq!(type_of(&model, "token_embd.weight"), DType::Q4_K);
        assert_eq!(type_of(&model, "rope_freqs.weight"), DType::F32);
        for i in 0..8 {
            let want = if [0, 3, 6, 7].contains(&i) {
                DType::Q6_K
            } else {
                DType::Q4_K
            };
            for s in ["attn_v.weight", "ffn_down.weight"] {
                assert_eq!(
                    type_of(&model, &format!("blk.{i}.{s}")),
                    want,
                    "layer {i} {s}"
                );
            }
        }
        // Tied: the embedding table is typed as the output head.
        let tied = SyntheticModel::from_shape(&small(Family::Qwen2, 2), FileType::Q4_K_M).unwrap();
        assert_eq!(type_of(&tied, "token_embd.weight"), DType::Q6_K);
    }

    #[test]
    fn a_streamed_file_reads_back_with_its_metadata_and_shapes() {
        let shape = small(Family::Qwen2, 2);
        let model = SyntheticModel::from_shape(&shape, FileType::Q4_K_M).unwrap();
        let bytes = model.to_bytes(3);
        assert_eq!(bytes.len() as u64, model.file_len());
        assert_eq!(
            bytes,
            model.to_bytes(3),
            "the same seed gives the same bytes"
        );
        let file = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(file.metadata(), model.metadata());
        assert_eq!(file.get_str("general.architecture").unwrap(), "qwen2");
        assert_eq!(file.get_u32("general.file_type").unwrap(), 15);
        assert_eq!(file.get_u32("qwen2.block_count").unwrap(), 2);
        assert_eq!(file.get_f32("qwen2.rope.freq_base").unwrap(), 1e6);
        assert_eq!(file.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 400);
        assert_eq!(file.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 402);
        let tokens = file.get_str_array("tokenizer.ggml.tokens").unwrap();
        assert_eq!(tokens.len(), 512);
        assert_eq!(tokens[402], "<|im_end|>");
        assert_eq!(tokens[258], "he");
        assert_eq!(
            file.get_i32_array("tokenizer.ggml.token_type").unwrap()[402],
            CONTROL
        );
        assert_eq!(file.tensors().len(), model.tensors().len());
        for (t, (name, dims, dtype)) in file.tensors().iter().zip(model.tensors()) {
            assert_eq!(
                (t.name.as_str(), t.dims.as_slice(), t.dtype),
                (name, dims, dtype)
            );
            let data = file.tensor_data(t);
            assert_eq!(
                Some(data.len()),
                dtype.bytes_for(t.n_elements as usize),
                "{name}"
            );
            assert_eq!(dtype.first_non_finite(data), None, "{name}");
        }
        let bias = file.tensor("blk.1.attn_k.bias").unwrap();
        assert_eq!(bias.dims, [128]);
    }

    #[test]
    fn small_models_of_both_families_run_on_the_cpu() {
        let device = encore::Device::open("cpu", &encore::Config::default()).unwrap();
        for family in [Family::Qwen2, Family::Llama3] {
            let model = SyntheticModel::from_shape(&small(family, 2), FileType::Q4_K_M).unwrap();
            let file = GgufFile::from_bytes(model.to_bytes(5)).unwrap();
            let engine =
                crate::Engine::from_gguf(&file, &device, &crate::EngineOptions::default()).unwrap();
            if family == Family::Llama3 {
                assert!(engine.model().rope_factors.is_some());
            }
            let prompt = engine
                .prompt_tokens("the cat is on the mat", false)
                .unwrap();
            assert!(prompt.len() > 3, "{family:?}: {prompt:?}");
            let mut session = engine.session(32).unwrap();
            let logits = session.prefill(&prompt).unwrap();
            assert_eq!(logits.len(), small(family, 2).vocab);
            assert!(logits.iter().all(|v| v.is_finite()), "{family:?}");
            let (_, std) = mean_std(&logits);
            assert!(std > 0.01 && std < 100.0, "{family:?}: logits std {std}");
        }
    }

    #[test]
    fn the_one_layer_7b_header_has_real_sizes() {
        let shape = ModelShape::named("qwen2.5-7b-1layer").unwrap();
        let model = SyntheticModel::from_shape(shape, FileType::Q4_K_M).unwrap();
        let dir = std::env::temp_dir().join(format!("encore-synthetic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qwen2.5-7b-1layer.gguf");
        // The header, and a sparse file as long as the whole.
        let mut f = std::fs::File::create(&path).unwrap();
        model.write_header(&mut f).unwrap();
        f.set_len(model.file_len()).unwrap();
        drop(f);
        let file = GgufFile::open(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            file.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
            152_064
        );
        let embd = file.tensor("token_embd.weight").unwrap();
        assert_eq!(
            (embd.dims.as_slice(), embd.dtype),
            (&[3584, 152_064][..], DType::Q4_K)
        );
        let output = file.tensor("output.weight").unwrap();
        assert_eq!(output.dtype, DType::Q6_K);
        assert_eq!(output.n_bytes, 3584 / 256 * 210 * 152_064);
        assert_eq!(
            file.tensor("blk.0.ffn_down.weight").unwrap().dims,
            [18944, 3584]
        );
        let config = crate::ModelConfig::from_gguf(&file).unwrap();
        assert_eq!(
            (config.n_layer, config.n_embd, config.vocab),
            (1, 3584, 152_064)
        );
        assert_eq!(
            (config.n_head, config.n_head_kv, config.head_dim),
            (28, 4, 128)
        );
    }

    #[test]
    fn every_shape_in_the_table_is_consistent() {
        for shape in &ModelShape::ALL {
            shape.check().unwrap();
        }
        let size = |name, ftype| {
            SyntheticModel::from_shape(ModelShape::named(name).unwrap(), ftype)
                .unwrap()
                .file_len()
        };
        // Within a few percent of the published files.
        let gb = |b: u64| b as f64 / 1e9;
        assert!((gb(size("qwen2.5-7b", FileType::Q4_K_M)) - 4.68).abs() < 0.15);
        assert!((gb(size("llama-3.1-8b", FileType::Q8_0)) - 8.54).abs() < 0.15);
        assert!((gb(size("llama-3.3-70b", FileType::Q4_K_M)) - 42.5).abs() < 1.0);
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

    #[test]
    fn large_tensors_are_the_same_whatever_the_batching() {
        // More than one batch of chunks: generated in parallel.
        let values = Values::Normal(0.02);
        let tensor = TensorFill {
            dtype: DType::Q8_0,
            values: &values,
            unit: unit_std(DType::Q8_0).unwrap(),
            seed: 9,
        };
        let n = tensor.chunk_len() * (BATCH_CHUNKS + 3) + 64;
        let mut streamed = Vec::new();
        let mut buffers = [Vec::new(), Vec::new()];
        tensor.stream(n, &mut streamed, &mut buffers).unwrap();
        // A smaller tensor after it reuses the buffers.
        let mut small = Vec::new();
        tensor.stream(100 * 32, &mut small, &mut buffers).unwrap();
        assert_eq!(small[..], streamed[..small.len()]);
        assert_eq!(Some(streamed.len()), DType::Q8_0.bytes_for(n));
        // Chunk by chunk, one generator each, in order.
        let chunk_bytes = DType::Q8_0.bytes_for(tensor.chunk_len()).unwrap();
        for (i, chunk) in streamed.chunks(chunk_bytes).enumerate() {
            let mut one = vec![0u8; chunk.len()];
            let mut rng = Rng(mix(9 ^ mix(i as u64)));
            fill(DType::Q8_0, &values, tensor.unit, 0, &mut rng, &mut one);
            assert!(one == chunk, "chunk {i}");
        }
    }
}
