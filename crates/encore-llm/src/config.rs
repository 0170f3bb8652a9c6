//! The shape of a model, read from GGUF metadata: the Llama family
//! (`llama`, `qwen2`, `qwen3`), Qwen3's mixture of experts (`qwen3moe`)
//! and Gemma 3 (`gemma3`).
//!
//! What differs between the architectures is data here, not code paths in
//! the forward pass: the RoPE layout, biases (found by tensor name),
//! per-head Q/K norms, the feed-forward activation, the norms after the
//! attention and the feed-forward blocks, the embedding scale, per layer a
//! sliding window with its own RoPE base, and the experts that replace the
//! feed-forward ([`ExpertConfig`]).

use crate::error::{LlmError, Result};
use crate::gguf::{Array, GgufError, GgufFile, Value};

/// How rotary embeddings pair up the elements of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(2i, 2i+1)`: Llama as stored in GGUF.
    Normal,
    /// Halves `(i, i + d/2)`: Qwen and Gemma.
    Neox,
}

/// The architectures Encore runs, by `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    /// Qwen3's mixture of experts: Qwen3 attention, a routed feed-forward.
    Qwen3Moe,
    Gemma3,
}

impl Architecture {
    /// Every supported architecture.
    pub const ALL: [Architecture; 5] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Qwen3Moe,
        Architecture::Gemma3,
    ];

    /// The name GGUF metadata uses.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Moe => "qwen3moe",
            Architecture::Gemma3 => "gemma3",
        }
    }

    /// The architecture named `name`, if supported.
    pub fn from_name(name: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.name() == name)
    }
}

/// The gated feed-forward's activation: `down(act(gate(x)) * up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): Llama, Qwen.
    Silu,
    /// GELU, tanh approximation (GeGLU): Gemma.
    Gelu,
}

/// What one layer's attention sees and how it rotates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    /// The sliding window in positions, 0 for global attention.
    pub window: usize,
    /// The RoPE base of this layer.
    pub rope_base: f32,
    /// Whether this layer's RoPE is scaled ([`ModelConfig::rope_scale`] and
    /// the model's frequency factors): every layer but Gemma's local ones.
    pub scaled: bool,
}

/// The experts that replace a layer's feed-forward: a router picks `used`
/// of `count` gated feed-forwards of width `ff` for each position, and
/// their outputs are summed, each weighted by its router probability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertConfig {
    /// Experts in a layer (`expert_count`).
    pub count: usize,
    /// Experts each position runs (`expert_used_count`).
    pub used: usize,
    /// The width of one expert's feed-forward (`expert_feed_forward_length`).
    pub ff: usize,
    /// Whether the chosen experts' probabilities are divided by their sum
    /// (`expert_weights_norm`; Qwen3-MoE always, as llama.cpp does).
    pub norm_weights: bool,
}

/// Hyperparameters of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    /// The RoPE base of global layers (see [`ModelConfig::layers`]).
    pub rope_base: f32,
    pub rope: RopeLayout,
    pub norm_eps: f32,
    pub context_length: usize,
    pub vocab: usize,
    /// The attention's score scale: `1 / sqrt(head_dim)`.
    pub attn_scale: f32,
    /// The feed-forward activation.
    pub activation: Activation,
    /// Embeddings are multiplied by this before the first layer (Gemma:
    /// `sqrt(n_embd)`).
    pub embed_scale: Option<f32>,
    /// RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm of the attention output and of the feed-forward output
    /// before each is added to the residual (Gemma 3).
    pub post_norms: bool,
    /// Per layer: sliding window and RoPE base.
    pub layers: Vec<LayerAttention>,
    /// Linear RoPE scaling: positions are multiplied by this (1 without).
    pub rope_scale: f32,
    /// The experts of a mixture-of-experts model, whose every layer's
    /// feed-forward they replace; `None` for a dense model.
    pub experts: Option<ExpertConfig>,
}

/// A size read from `what` (a metadata key or tensor dimension), checked to
/// lie in `1..=max`.
fn in_range(what: &str, value: usize, max: usize) -> Result<usize> {
    if value == 0 {
        return Err(LlmError::Model(format!("{what} is zero")));
    }
    if value > max {
        return Err(LlmError::Model(format!(
            "{what} = {value} exceeds the limit {max}"
        )));
    }
    Ok(value)
}

/// A metadata value that may be absent, falling back to a default.
fn optional<T>(r: std::result::Result<T, GgufError>, default: T) -> Result<T> {
    match r {
        Ok(v) => Ok(v),
        Err(GgufError::MissingKey(_)) => Ok(default),
        Err(e) => Err(e.into()),
    }
}

impl ModelConfig {
    /// Reads `general.architecture` and the architecture's hyperparameters.
    pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig> {
        let name = f.get_str("general.architecture")?;
        let arch = Architecture::from_name(name).ok_or_else(|| {
            let known: Vec<_> = Architecture::ALL.iter().map(|a| a.name()).collect();
            LlmError::Model(format!(
                "architecture `{name}` is not supported (supported: {})",
                known.join(", ")
            ))
        })?;
        let (rope, activation) = match arch {
            Architecture::Llama => (RopeLayout::Normal, Activation::Silu),
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                (RopeLayout::Neox, Activation::Silu)
            }
            Architecture::Gemma3 => (RopeLayout::Neox, Activation::Gelu),
        };
        let key = |k: &str| format!("{}.{k}", arch.name());
        let size = |k: &str, max: usize| -> Result<usize> {
            let k = key(k);
            in_range(&format!("metadata `{k}`"), f.get_u32(&k)? as usize, max)
        };
        let optional_size = |k: &str, default: usize, max: usize| -> Result<usize> {
            let k = key(k);
            match f.get_u32(&k) {
                Ok(v) => in_range(&format!("metadata `{k}`"), v as usize, max),
                Err(GgufError::MissingKey(_)) => Ok(default),
                Err(e) => Err(e.into()),
            }
        };
        let n_embd = size("embedding_length", 1 << 16)?;
        let n_head = size("attention.head_count", n_embd)?;
        let n_head_kv = optional_size("attention.head_count_kv", n_head, n_head)?;
        if n_head % n_head_kv != 0 {
            return Err(LlmError::Model(format!(
                "inconsistent heads: metadata `{}` = {n_head_kv} must divide `{}` = {n_head}",
                key("attention.head_count_kv"),
                key("attention.head_count"),
            )));
        }
        // The head size is `attention.key_length` where given (Qwen3 and
        // Gemma 3 heads are wider than `n_embd / n_head`), else the quotient.
        let head_dim = match f.get_u32(&key("attention.key_length")) {
            Ok(v) => in_range(
                &format!("metadata `{}`", key("attention.key_length")),
                v as usize,
                encore_ops::kernels::attention::MAX_HEAD_DIM,
            )?,
            Err(GgufError::MissingKey(_)) if n_embd % n_head == 0 => n_embd / n_head,
            Err(GgufError::MissingKey(_)) => {
                return Err(LlmError::Model(format!(
                    "metadata `{}` = {n_head} does not divide `{}` = {n_embd}, \
                     and `{}` is absent",
                    key("attention.head_count"),
                    key("embedding_length"),
                    key("attention.key_length"),
                )))
            }
            Err(e) => return Err(e.into()),
        };
        let value_length = optional_size("attention.value_length", head_dim, 1 << 16)?;
        if value_length != head_dim {
            return Err(LlmError::Model(format!(
                "metadata `{}` = {value_length} differs from the key length {head_dim}; \
                 Encore needs them equal",
                key("attention.value_length"),
            )));
        }
        let rope_dim = optional(f.get_u32(&key("rope.dimension_count")), head_dim as u32)? as usize;
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(LlmError::Model(format!(
                "metadata `{}` = {rope_dim} must be even and at most the head size {head_dim}",
                key("rope.dimension_count")
            )));
        }
        let rope_scale = rope_scale(f, &key)?;
        let vocab = match f.get_u32(&key("vocab_size")) {
            Ok(v) => in_range(
                &format!("metadata `{}`", key("vocab_size")),
                v as usize,
                usize::MAX,
            )?,
            Err(GgufError::MissingKey(_)) => {
                let embd = f.tensor("token_embd.weight")?;
                let rows = embd.dims.get(1).copied().unwrap_or(0) as usize;
                in_range(
                    "the row count of tensor `token_embd.weight`",
                    rows,
                    usize::MAX,
                )?
            }
            Err(e) => return Err(e.into()),
        };
        let n_layer = size("block_count", 1024)?;
        let rope_base = optional(f.get_f32(&key("rope.freq_base")), 10_000.0)?;
        let layers = layer_attention(f, arch, n_layer, rope_base, &key)?;
        let gemma = arch == Architecture::Gemma3;
        let experts = expert_config(f, arch, &key)?;
        // A mixture of experts' `feed_forward_length` (the dense width of
        // its relatives) is unused; files may omit it.
        let n_ff = match experts {
            Some(e) => optional_size("feed_forward_length", e.ff, 1 << 18)?,
            None => size("feed_forward_length", 1 << 18)?,
        };
        let config = ModelConfig {
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            rope_dim,
            rope_base,
            rope,
            norm_eps: optional(f.get_f32(&key("attention.layer_norm_rms_epsilon")), 1e-5)?,
            context_length: optional(f.get_u32(&key("context_length")), 2048)? as usize,
            vocab,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            activation,
            embed_scale: gemma.then(|| (n_embd as f32).sqrt()),
            qk_norm: matches!(
                arch,
                Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3
            ),
            post_norms: gemma,
            layers,
            rope_scale,
            experts,
            arch,
        };
        Ok(config)
    }

    /// Elements of one position's queries across all heads.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// The width of a feed-forward as the forward pass runs it: one
    /// expert's in a mixture of experts, else `n_ff`.
    pub fn ffn_width(&self) -> usize {
        self.experts.map_or(self.n_ff, |e| e.ff)
    }

    /// Elements of one position's K (or V) across all KV heads.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

/// The experts of a `qwen3moe` model from its metadata (`None` for the
/// dense architectures, whatever their files say): `expert_count`,
/// `expert_used_count` (at most the count), `expert_feed_forward_length`,
/// and `expert_weights_norm` (default true: llama.cpp renormalizes
/// Qwen3-MoE's chosen weights unconditionally).
fn expert_config(
    f: &GgufFile,
    arch: Architecture,
    key: &dyn Fn(&str) -> String,
) -> Result<Option<ExpertConfig>> {
    if arch != Architecture::Qwen3Moe {
        return Ok(None);
    }
    let size = |k: &str, max: usize| -> Result<usize> {
        let k = key(k);
        in_range(&format!("metadata `{k}`"), f.get_u32(&k)? as usize, max)
    };
    let count = size("expert_count", 1 << 12)?;
    let used = size("expert_used_count", count)?;
    let ff = size("expert_feed_forward_length", 1 << 18)?;
    let norm_weights = optional(f.get_bool(&key("expert_weights_norm")), true)?;
    Ok(Some(ExpertConfig {
        count,
        used,
        ff,
        norm_weights,
    }))
}

/// The linear RoPE scale: 1 without scaling, `1 / factor` for
/// `rope.scaling.type = linear`. Llama 3's scaling comes as per-pair
/// frequency factors in the tensor `rope_freqs.weight` (read by the
/// model), with no scaling type. Other types (YaRN, LongRoPE) are refused.
fn rope_scale(f: &GgufFile, key: &dyn Fn(&str) -> String) -> Result<f32> {
    let kind = match f.get_str(&key("rope.scaling.type")) {
        Ok(t) => t.to_string(),
        Err(GgufError::MissingKey(_)) => "none".to_string(),
        Err(e) => return Err(e.into()),
    };
    let factor = optional(f.get_f32(&key("rope.scaling.factor")), 1.0)?;
    match kind.as_str() {
        "none" => Ok(1.0),
        "linear" if factor.is_finite() && factor >= 1.0 => Ok(1.0 / factor),
        "linear" => Err(LlmError::Model(format!(
            "metadata `{}` = {factor} must be finite and at least 1",
            key("rope.scaling.factor")
        ))),
        other => Err(LlmError::Model(format!(
            "RoPE scaling type `{other}` is not supported (supported: none, linear, and Llama 3's frequency factors)"
        ))),
    }
}

/// Each layer's sliding window and RoPE base. Gemma 3 interleaves local
/// layers (a window of `attention.sliding_window` positions, RoPE base
/// `rope.freq_base_swa`, default 10 000) with global ones: in each period of
/// `attention.sliding_window_pattern` layers (default 6) the last is global.
/// Every other architecture's layers are global.
fn layer_attention(
    f: &GgufFile,
    arch: Architecture,
    n_layer: usize,
    rope_base: f32,
    key: &dyn Fn(&str) -> String,
) -> Result<Vec<LayerAttention>> {
    let global = LayerAttention {
        window: 0,
        rope_base,
        scaled: true,
    };
    let window = match f.get_u32(&key("attention.sliding_window")) {
        Ok(w) if arch == Architecture::Gemma3 => w as usize,
        Ok(_) | Err(GgufError::MissingKey(_)) => 0,
        Err(e) => return Err(e.into()),
    };
    if window == 0 {
        return Ok(vec![global; n_layer]);
    }
    let local = LayerAttention {
        window,
        rope_base: optional(f.get_f32(&key("rope.freq_base_swa")), 10_000.0)?,
        scaled: false,
    };
    let pattern_key = key("attention.sliding_window_pattern");
    let is_local: Vec<bool> = match f.get(&pattern_key) {
        None => (0..n_layer).map(|i| i % 6 < 5).collect(),
        Some(Value::U32(p)) => {
            let p = *p as usize;
            (0..n_layer).map(|i| p == 0 || i % p < p - 1).collect()
        }
        Some(Value::Array(Array::Bool(flags))) if flags.len() == n_layer => flags.clone(),
        Some(_) => {
            return Err(LlmError::Model(format!(
                "metadata `{pattern_key}` must be a period or one boolean per layer ({n_layer})"
            )))
        }
    };
    Ok(is_local
        .into_iter()
        .map(|l| if l { local } else { global })
        .collect())
}
