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
        let size = |k: &str, max: usize| -> Result<usize> {
            let k = key(k);
            in_range(&format!("metadata `{k}`"), f.get_u32(&k)? as usize, max)
        };
        let n_embd = size("embedding_length", 1 << 16)?;
        let n_head = size("attention.head_count", n_embd)?;
        let n_head_kv = match f.get_u32(&key("attention.head_count_kv")) {
            Ok(v) => in_range(
                &format!("metadata `{}`", key("attention.head_count_kv")),
                v as usize,
                n_head,
            )?,
            Err(GgufError::MissingKey(_)) => n_head,
            Err(e) => return Err(e.into()),
        };
        if n_embd % n_head != 0 || n_head % n_head_kv != 0 {
            return Err(LlmError::Model(format!(
                "inconsistent heads: metadata `{}` = {n_head} must divide `{}` = {n_embd}, \
                 and `{}` = {n_head_kv} must divide the head count",
                key("attention.head_count"),
                key("embedding_length"),
                key("attention.head_count_kv"),
            )));
        }
        let head_dim = n_embd / n_head;
        let rope_dim = optional(f.get_u32(&key("rope.dimension_count")), head_dim as u32)? as usize;
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(LlmError::Model(format!(
                "metadata `{}` = {rope_dim} must be even and at most the head size {head_dim}",
                key("rope.dimension_count")
            )));
        }
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
        let config = ModelConfig {
            n_layer: size("block_count", 1024)?,
            n_embd,
            n_ff: size("feed_forward_length", 1 << 18)?,
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
        Ok(config)
    }

    /// Elements of one position's K (or V) across all KV heads.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}
