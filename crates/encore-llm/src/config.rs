//! The shape of a Llama-family model, read from GGUF metadata.

use crate::error::{LlmError, Result};
use crate::gguf::{GgufError, GgufFile};

/// How rotary embeddings pair up the elements of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(2i, 2i+1)`: Llama as stored in GGUF.
    Normal,
    /// Halves `(i, i + d/2)`: Qwen2.
    Neox,
}

/// Hyperparameters of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    pub rope: RopeLayout,
    pub norm_eps: f32,
    pub context_length: usize,
    pub vocab: usize,
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
        let arch = f.get_str("general.architecture")?.to_string();
        let rope = match arch.as_str() {
            "llama" => RopeLayout::Normal,
            "qwen2" => RopeLayout::Neox,
            other => {
                return Err(LlmError::Model(format!(
                    "architecture `{other}` is not supported (supported: llama, qwen2)"
                )))
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let n_embd = f.get_u32(&key("embedding_length"))? as usize;
        let n_head = f.get_u32(&key("attention.head_count"))? as usize;
        let n_head_kv =
            optional(f.get_u32(&key("attention.head_count_kv")), n_head as u32)? as usize;
        if n_head == 0 || n_head_kv == 0 || n_embd % n_head != 0 || n_head % n_head_kv != 0 {
            return Err(LlmError::Model(format!(
                "inconsistent heads: embedding {n_embd}, {n_head} heads, {n_head_kv} KV heads"
            )));
        }
        let head_dim = n_embd / n_head;
        let rope_dim = optional(f.get_u32(&key("rope.dimension_count")), head_dim as u32)? as usize;
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(LlmError::Model(format!(
                "rope dimension {rope_dim} must be even and at most the head size {head_dim}"
            )));
        }
        let vocab = match f.get_u32(&key("vocab_size")) {
            Ok(v) => v as usize,
            Err(GgufError::MissingKey(_)) => f
                .tensor("token_embd.weight")?
                .dims
                .get(1)
                .copied()
                .unwrap_or(0) as usize,
            Err(e) => return Err(e.into()),
        };
        let config = ModelConfig {
            n_layer: f.get_u32(&key("block_count"))? as usize,
            n_embd,
            n_ff: f.get_u32(&key("feed_forward_length"))? as usize,
            n_head,
            n_head_kv,
            head_dim,
            rope_dim,
            rope_base: optional(f.get_f32(&key("rope.freq_base")), 10_000.0)?,
            rope,
            norm_eps: optional(f.get_f32(&key("attention.layer_norm_rms_epsilon")), 1e-5)?,
            context_length: optional(f.get_u32(&key("context_length")), 2048)? as usize,
            vocab,
            arch,
        };
        if config.n_layer == 0 || config.n_ff == 0 || config.vocab == 0 {
            return Err(LlmError::Model(format!(
                "empty model dimensions: {config:?}"
            )));
        }
        if config.n_layer > 1024 || config.n_embd > 1 << 16 || config.n_ff > 1 << 18 {
            return Err(LlmError::Model(format!(
                "implausible model dimensions: {config:?}"
            )));
        }
        Ok(config)
    }

    /// Elements of one position's K (or V) across all KV heads.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}
