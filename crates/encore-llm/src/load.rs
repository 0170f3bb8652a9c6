//! Loading a model's weights from a GGUF file onto a device.
//!
//! Before anything is allocated (or any kernel compiled), the load sums what
//! every buffer it fills takes on the device, from the file's tensor list,
//! and compares that with the device's free memory: a model that cannot fit
//! is refused at once, both sizes named, rather than out of memory partway
//! through a copy of tens of gigabytes. The weights are then copied a piece
//! at a time, each piece's file pages released once copied, and the caller
//! hears of every piece ([`LoadProgress`]).

use std::sync::Arc;

use encore::{Buffer, Device, MemoryInfo};
use encore_ops::{KernelSet, Ops, Weight, WeightTypes};

use crate::config::ModelConfig;
use crate::error::{LlmError, Result};
use crate::gguf::GgufFile;
use crate::model::{Block, Model};

/// How far a load has come, in bytes of weights copied to the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadProgress {
    /// Bytes copied so far.
    pub bytes_done: u64,
    /// Bytes the load copies in all.
    pub bytes_total: u64,
}

/// Device memory a load leaves free beyond the weights, for activations, a
/// KV cache and the runtime's own allocations: a model that fits only
/// without it could not run. A larger cache is checked when it is allocated.
pub const LOAD_MARGIN_BYTES: u64 = 512 << 20;

/// Bytes of a weight copied to the device at a time when loading.
const LOAD_PIECE_BYTES: usize = 8 << 20;

/// Checks that weights taking `weights` bytes on `device` fit in its free
/// memory `memory` with [`LOAD_MARGIN_BYTES`] to spare:
/// [`LlmError::WeightsDoNotFit`] if not. Unknown memory (`None`) passes.
pub fn check_fits(device: &str, weights: u64, memory: Option<MemoryInfo>) -> Result<()> {
    let Some(m) = memory else {
        return Ok(());
    };
    let needed = weights.checked_add(LOAD_MARGIN_BYTES);
    if needed.is_some_and(|needed| needed <= m.free) {
        return Ok(());
    }
    Err(LlmError::WeightsDoNotFit {
        device: device.to_string(),
        weights,
        margin: LOAD_MARGIN_BYTES,
        free: m.free,
        total: m.total,
    })
}

impl Model {
    /// Loads every weight of `f` onto `device`, with the op layer's
    /// kernels of `kernels`. [`Model::load_with_progress`] without progress.
    pub fn load(f: &GgufFile, device: &Device, kernels: KernelSet) -> Result<Arc<Model>> {
        Model::load_with_progress(f, device, kernels, |_| {})
    }

    /// Loads every weight of `f` onto `device`, with the op layer's kernels
    /// of `kernels`, calling `on_progress` once the kernels are ready and
    /// copying starts (with nothing done) and then after each piece copied;
    /// the last call has `bytes_done == bytes_total`.
    ///
    /// Fails with [`LlmError::WeightsDoNotFit`] before allocating anything
    /// when the device says its free memory cannot hold the weights (see
    /// [`check_fits`]).
    pub fn load_with_progress(
        f: &GgufFile,
        device: &Device,
        kernels: KernelSet,
        on_progress: impl FnMut(LoadProgress),
    ) -> Result<Arc<Model>> {
        let c = ModelConfig::from_gguf(f)?;
        let sizes = upload_sizes(f, &c)?;
        let on_device = sizes.iter().map(|&s| device.allocated_size(s) as u64).sum();
        check_fits(device.name(), on_device, device.memory()?)?;
        // The products are built for the file's weight types alone, which
        // compiles them in a fraction of the time of every type's code.
        let types = WeightTypes::of(f.tensors().iter().map(|t| t.dtype));
        let ops = Ops::for_weight_types(device, kernels, types)?;
        let mut load = Loader {
            device,
            file: f,
            done: 0,
            total: sizes.iter().map(|&s| s as u64).sum(),
            on_progress,
        };
        load.advance(0);
        let (d, q, kv, ff, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff, c.head_dim);
        let embed = load.weight("token_embd.weight", c.vocab, d)?;
        let mut blocks = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let name = |s: &str| format!("blk.{i}.{s}");
            let needed = |load: &mut Loader<'_, _>, on: bool, s: &str, len: usize| {
                on.then(|| load.vector(&name(s), len)).transpose()
            };
            let (gate, up, down, router) = match c.experts {
                Some(e) => (
                    load.experts(&name("ffn_gate_exps.weight"), e.ff, d, e.count)?,
                    load.experts(&name("ffn_up_exps.weight"), e.ff, d, e.count)?,
                    load.experts(&name("ffn_down_exps.weight"), d, e.ff, e.count)?,
                    Some(load.weight(&name("ffn_gate_inp.weight"), e.count, d)?),
                ),
                None => (
                    load.weight(&name("ffn_gate.weight"), ff, d)?,
                    load.weight(&name("ffn_up.weight"), ff, d)?,
                    load.weight(&name("ffn_down.weight"), d, ff)?,
                    None,
                ),
            };
            blocks.push(Block {
                attn_norm: load.vector(&name("attn_norm.weight"), d)?,
                wq: load.weight(&name("attn_q.weight"), q, d)?,
                wk: load.weight(&name("attn_k.weight"), kv, d)?,
                wv: load.weight(&name("attn_v.weight"), kv, d)?,
                bq: load.optional_vector(&name("attn_q.bias"), q)?,
                bk: load.optional_vector(&name("attn_k.bias"), kv)?,
                bv: load.optional_vector(&name("attn_v.bias"), kv)?,
                wo: load.weight(&name("attn_output.weight"), d, q)?,
                ffn_norm: load.vector(&name("ffn_norm.weight"), d)?,
                gate,
                up,
                down,
                router,
                q_norm: needed(&mut load, c.qk_norm, "attn_q_norm.weight", hd)?,
                k_norm: needed(&mut load, c.qk_norm, "attn_k_norm.weight", hd)?,
                post_attn_norm: needed(&mut load, c.post_norms, "post_attention_norm.weight", d)?,
                post_ffn_norm: needed(&mut load, c.post_norms, "post_ffw_norm.weight", d)?,
            });
        }
        let rope_factors = load.rope_factors(&c)?;
        let output_norm = load.vector("output_norm.weight", d)?;
        let output = if has(f, "output.weight") {
            load.weight("output.weight", c.vocab, d)?
        } else {
            embed.clone()
        };
        Ok(Arc::new(Model {
            config: c,
            device: device.clone(),
            ops,
            embed,
            blocks,
            output_norm,
            output,
            rope_factors,
        }))
    }
}

/// Whether the file holds a tensor named `name`.
fn has(f: &GgufFile, name: &str) -> bool {
    f.tensors().iter().any(|t| t.name == name)
}

/// The bytes of every buffer [`Model::load_with_progress`] fills, as it
/// fills them: quantized and half-precision matrices as stored, vectors as
/// f32. A tensor the model needs and the file lacks is an error here,
/// before anything is allocated.
fn upload_sizes(f: &GgufFile, c: &ModelConfig) -> Result<Vec<usize>> {
    let matrix = |name: &str| -> Result<usize> { Ok(f.tensor(name)?.n_bytes) };
    let vector = |name: &str, len: usize| -> Result<usize> {
        f.tensor(name)?;
        Ok(len * 4)
    };
    check_expert_layout(f, c)?;
    let (d, q, kv, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.head_dim);
    let ffn: &[&str] = match c.experts {
        Some(_) => &[
            "ffn_gate_inp.weight",
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
            "ffn_down_exps.weight",
        ],
        None => &["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"],
    };
    let mut sizes = vec![matrix("token_embd.weight")?];
    for i in 0..c.n_layer {
        let name = |s: &str| format!("blk.{i}.{s}");
        sizes.push(vector(&name("attn_norm.weight"), d)?);
        for s in ["attn_q.weight", "attn_k.weight", "attn_v.weight"] {
            sizes.push(matrix(&name(s))?);
        }
        for (s, len) in [("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)] {
            if has(f, &name(s)) {
                sizes.push(vector(&name(s), len)?);
            }
        }
        sizes.push(matrix(&name("attn_output.weight"))?);
        sizes.push(vector(&name("ffn_norm.weight"), d)?);
        for s in ffn {
            sizes.push(matrix(&name(s))?);
        }
        if c.qk_norm {
            sizes.push(vector(&name("attn_q_norm.weight"), hd)?);
            sizes.push(vector(&name("attn_k_norm.weight"), hd)?);
        }
        if c.post_norms {
            sizes.push(vector(&name("post_attention_norm.weight"), d)?);
            sizes.push(vector(&name("post_ffw_norm.weight"), d)?);
        }
    }
    if has(f, "rope_freqs.weight") || c.rope_scale != 1.0 {
        sizes.push(c.rope_dim / 2 * 4);
    }
    sizes.push(vector("output_norm.weight", d)?);
    if has(f, "output.weight") {
        sizes.push(matrix("output.weight")?);
    }
    Ok(sizes)
}

/// The expert tensors Encore runs: a router and stacked gated experts.
const EXPERT_TENSORS: [&str; 4] = [
    "ffn_gate_inp.weight",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
];

/// Refuses, naming the tensor, a file whose experts Encore does not know:
/// expert tensors in an architecture without experts (a Mixtral-style
/// `llama`), or, in one with experts, any but [`EXPERT_TENSORS`] (shared
/// experts, expert biases, fused gate and up).
fn check_expert_layout(f: &GgufFile, c: &ModelConfig) -> Result<()> {
    let expert_like = |name: &str| {
        ["_exps", "_shexp", "ffn_gate_inp", "exp_probs"]
            .iter()
            .any(|part| name.contains(part))
    };
    let known = |name: &str| {
        c.experts.is_some()
            && name
                .split_once('.')
                .and_then(|(_, rest)| rest.split_once('.'))
                .is_some_and(|(_, s)| EXPERT_TENSORS.contains(&s))
    };
    match f
        .tensors()
        .iter()
        .find(|t| t.name.starts_with("blk.") && expert_like(&t.name) && !known(&t.name))
    {
        Some(t) => Err(LlmError::Model(format!(
            "the expert layout of this `{}` file is not supported: tensor `{}` \
             (supported: qwen3moe's {})",
            c.arch.name(),
            t.name,
            EXPERT_TENSORS.join(", ")
        ))),
        None => Ok(()),
    }
}

/// Copies tensors of `file` to `device`, counting the bytes copied and
/// reporting them to `on_progress`.
struct Loader<'a, F> {
    device: &'a Device,
    file: &'a GgufFile,
    done: u64,
    total: u64,
    on_progress: F,
}

impl<F: FnMut(LoadProgress)> Loader<'_, F> {
    /// Counts `bytes` more copied and reports the progress.
    fn advance(&mut self, bytes: usize) {
        self.done += bytes as u64;
        (self.on_progress)(LoadProgress {
            bytes_done: self.done,
            bytes_total: self.total,
        });
    }

    /// Uploads the matrix `name` (`n` rows of `k`) as stored.
    fn weight(&mut self, name: &str, n: usize, k: usize) -> Result<Weight> {
        self.stored(name, &[k, n], n, k)
    }

    /// Uploads `count` stacked experts' matrices of `n` rows of `k` (GGUF
    /// dimensions `[k, n, count]`) as one weight of `count * n` rows,
    /// expert `e`'s rows from `e * n` on.
    fn experts(&mut self, name: &str, n: usize, k: usize, count: usize) -> Result<Weight> {
        self.stored(name, &[k, n, count], count * n, k)
    }

    /// Uploads the tensor `name` of GGUF dimensions `dims` as stored, as a
    /// weight of `n` rows of `k`.
    fn stored(&mut self, name: &str, dims: &[usize], n: usize, k: usize) -> Result<Weight> {
        let f = self.file;
        let t = f.tensor(name)?;
        if t.dims.len() != dims.len() || t.dims.iter().zip(dims).any(|(&a, &b)| a as usize != b) {
            return Err(LlmError::Model(format!(
                "tensor `{name}` has shape {:?}, expected {dims:?}",
                t.dims
            )));
        }
        // Copied a piece at a time, each piece's file pages released once
        // copied, so that a large tensor (an embedding table of 262,144
        // tokens) never has both its file pages and its copy resident.
        let data = f.tensor_data(t);
        let unit = t.dtype.block_bytes().max(1);
        let piece = (LOAD_PIECE_BYTES / unit).max(1) * unit;
        let buffer = self.device.alloc(data.len())?;
        for (i, bytes) in data.chunks(piece).enumerate() {
            if let Some(at) = t.dtype.first_non_finite(bytes) {
                return Err(non_finite(
                    name,
                    t.dtype.is_quantized(),
                    i * piece / unit + at,
                ));
            }
            buffer.upload_at(i * piece, bytes)?;
            f.release_tensor_bytes(t, i * piece..i * piece + bytes.len());
            self.advance(bytes.len());
        }
        Ok(Weight {
            buffer,
            dtype: t.dtype,
            n,
            k,
        })
    }

    /// Uploads a vector (norm weight or bias) as f32, whatever its stored type.
    fn vector(&mut self, name: &str, len: usize) -> Result<Buffer> {
        let t = self.file.tensor(name)?;
        if t.n_elements as usize != len || t.dims.len() != 1 {
            return Err(LlmError::Model(format!(
                "tensor `{name}` has shape {:?}, expected [{len}]",
                t.dims
            )));
        }
        let mut v = vec![0f32; len];
        encore_ops::cpu::dequantize_row(t.dtype, self.file.tensor_data(t), &mut v)
            .map_err(|e| LlmError::Model(format!("tensor {name}: {e}")))?;
        if let Some(at) = v.iter().position(|x| !x.is_finite()) {
            return Err(non_finite(name, false, at));
        }
        self.upload(&v)
    }

    /// [`Loader::vector`] of a tensor the file may lack.
    fn optional_vector(&mut self, name: &str, len: usize) -> Result<Option<Buffer>> {
        if has(self.file, name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The RoPE divisors of scaled layers: `rope_freqs.weight` (Llama 3)
    /// over the linear scale, or `None` when both are absent.
    fn rope_factors(&mut self, c: &ModelConfig) -> Result<Option<Buffer>> {
        let f = self.file;
        let pairs = c.rope_dim / 2;
        let mut factors = vec![1f32; pairs];
        let present = has(f, "rope_freqs.weight");
        if present {
            let t = f.tensor("rope_freqs.weight")?;
            if t.n_elements as usize != pairs {
                return Err(LlmError::Model(format!(
                    "tensor `rope_freqs.weight` has {} values, expected {pairs} (half the rotated dimensions)",
                    t.n_elements
                )));
            }
            encore_ops::cpu::dequantize_row(t.dtype, f.tensor_data(t), &mut factors)
                .map_err(|e| LlmError::Model(format!("tensor rope_freqs.weight: {e}")))?;
            if let Some(at) = factors.iter().position(|x| !x.is_finite() || *x <= 0.0) {
                return Err(LlmError::Model(format!(
                    "tensor `rope_freqs.weight` holds {} at {at}; factors must be positive",
                    factors[at]
                )));
            }
        }
        if !present && c.rope_scale == 1.0 {
            return Ok(None);
        }
        factors.iter_mut().for_each(|x| *x /= c.rope_scale);
        self.upload(&factors).map(Some)
    }

    /// Uploads `values` whole.
    fn upload(&mut self, values: &[f32]) -> Result<Buffer> {
        let buffer = self.device.buffer_from(values)?;
        self.advance(std::mem::size_of_val(values));
        Ok(buffer)
    }
}

/// A tensor holding an infinity or a NaN: a corrupt file, refused at load
/// rather than found in the logits (where the CPU's 8-bit activation
/// blocks can turn some NaNs into finite, wrong values).
fn non_finite(name: &str, quantized: bool, at: usize) -> LlmError {
    let place = if quantized {
        format!("the scale of block {at}")
    } else {
        format!("element {at}")
    };
    LlmError::Model(format!(
        "tensor `{name}` holds a non-finite value ({place}); the model file is corrupt"
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use crate::gguf::{GgufWriter, Value};
    use crate::synthetic::{synthetic_gguf, SyntheticSpec};
    use encore_ops::DType;

    const GB: u64 = 1_000_000_000;

    #[test]
    fn weights_that_fit_with_the_margin_pass_and_others_are_refused_with_both_sizes() {
        let memory = |free: u64| {
            Some(MemoryInfo {
                free,
                total: 24 * GB,
            })
        };
        assert!(check_fits("cuda:0", 19_900_000_000, None).is_ok());
        assert!(check_fits("cuda:0", 10 * GB, memory(12 * GB)).is_ok());
        let exact = 10 * GB + LOAD_MARGIN_BYTES;
        assert!(check_fits("cuda:0", 10 * GB, memory(exact)).is_ok());
        assert!(check_fits("cuda:0", 10 * GB + 1, memory(exact)).is_err());
        // No room for the margin is no room.
        assert!(check_fits("cuda:0", 10 * GB, memory(10 * GB)).is_err());
        assert!(check_fits("cpu", u64::MAX, memory(u64::MAX)).is_err());
        let e = check_fits("cuda:0", 19_900_000_000, memory(12_300_000_000)).unwrap_err();
        assert!(
            matches!(
                e,
                LlmError::WeightsDoNotFit {
                    weights: 19_900_000_000,
                    free: 12_300_000_000,
                    ..
                }
            ),
            "{e:?}"
        );
        let message = e.to_string();
        assert!(message.contains("need 19.9 GB on cuda:0"), "{message}");
        assert!(message.contains("12.3 GB free of 24.0 GB"), "{message}");
    }

    /// The tiny synthetic Llama made a Gemma 3 with every optional tensor
    /// the loader knows: Q, K and V biases (stored f16, uploaded f32),
    /// QK-norms, post-norms, RoPE frequency factors and an untied output.
    fn every_optional_tensor() -> GgufFile {
        let spec = SyntheticSpec::tiny(3);
        let base = GgufFile::from_bytes(synthetic_gguf(&spec)).unwrap();
        let mut w = GgufWriter::new();
        for (key, value) in base.metadata() {
            let key = match key.strip_prefix("llama.") {
                Some(rest) => format!("gemma3.{rest}"),
                None => key.clone(),
            };
            w.add_metadata(key, value.clone());
        }
        w.add_metadata("general.architecture", Value::String("gemma3".into()));
        for t in base.tensors() {
            w.add_tensor(&t.name, &t.dims, t.dtype, base.tensor_data(t).to_vec())
                .unwrap();
        }
        let c = ModelConfig::from_gguf(&base).unwrap();
        let f32s = |n: usize| (0..n).flat_map(|_| 1f32.to_le_bytes()).collect::<Vec<u8>>();
        let f16s = |n: usize| (0..n).flat_map(|_| 0x3c00u16.to_le_bytes()).collect();
        for i in 0..c.n_layer {
            let name = |s: &str| format!("blk.{i}.{s}");
            for (s, n) in [
                ("attn_q.bias", c.q_dim()),
                ("attn_k.bias", c.kv_dim()),
                ("attn_v.bias", c.kv_dim()),
            ] {
                w.add_tensor(name(s), &[n as u64], DType::F16, f16s(n))
                    .unwrap();
            }
            for (s, n) in [
                ("attn_q_norm.weight", c.head_dim),
                ("attn_k_norm.weight", c.head_dim),
                ("post_attention_norm.weight", c.n_embd),
                ("post_ffw_norm.weight", c.n_embd),
            ] {
                w.add_tensor(name(s), &[n as u64], DType::F32, f32s(n))
                    .unwrap();
            }
        }
        let pairs = c.rope_dim / 2;
        w.add_tensor(
            "rope_freqs.weight",
            &[pairs as u64],
            DType::F32,
            f32s(pairs),
        )
        .unwrap();
        let embed = base.tensor("token_embd.weight").unwrap();
        w.add_tensor(
            "output.weight",
            &embed.dims,
            embed.dtype,
            base.tensor_data(embed).to_vec(),
        )
        .unwrap();
        GgufFile::from_bytes(w.to_bytes()).unwrap()
    }

    #[test]
    fn progress_counts_every_byte_the_load_copies_and_the_plan_is_what_it_allocates() {
        let spec = SyntheticSpec::tiny(3);
        let llama = GgufFile::from_bytes(synthetic_gguf(&spec)).unwrap();
        for (what, f) in [("llama", llama), ("gemma3+", every_optional_tensor())] {
            let device = Device::cpu().unwrap();
            let mut seen = Vec::new();
            let model =
                Model::load_with_progress(&f, &device, KernelSet::Default, |p| seen.push(p))
                    .unwrap();
            let first = seen.first().copied().unwrap();
            let last = seen.last().copied().unwrap();
            assert_eq!(first.bytes_done, 0, "{what}");
            assert_eq!(last.bytes_done, last.bytes_total, "{what}");
            assert!(
                seen.windows(2)
                    .all(|w| w[0].bytes_done <= w[1].bytes_done
                        && w[0].bytes_total == w[1].bytes_total),
                "{what}"
            );
            let c = &model.config;
            let sizes = upload_sizes(&f, c).unwrap();
            let planned: u64 = sizes.iter().map(|&s| device.allocated_size(s) as u64).sum();
            assert_eq!(device.pool_stats().live_bytes, planned, "{what}");
            if what == "gemma3+" {
                let b = &model.blocks[0];
                assert!(b.bq.is_some() && b.q_norm.is_some() && b.post_ffn_norm.is_some());
                assert!(model.rope_factors.is_some());
                assert_ne!(
                    model.output.buffer.allocation_id(),
                    model.embed.buffer.allocation_id()
                );
            }
        }
    }
}
