//! A Llama-family model's weights on a device, and its forward pass.
//!
//! One transformer block, as the forward pass below encodes it:
//!
//! ```text
//! x ─┬─ rms_norm ─ q,k,v proj ─ rope(q,k) ─ kv_store ─ attention ─ o proj ─(+)─┬─ rms_norm ─ gate,up ─ silu·mul ─ down ─(+)─ x'
//!    └────────────────────────────── residual ─────────────────────────────────┘└──────────────── residual ─────────────┘
//! ```
//!
//! The embedding table feeds the first block; a final RMSNorm and the output
//! head (the embedding table itself when tied) turn the last row into logits.

use std::sync::Arc;

use encore::{Buffer, Device, Encoder};
use encore_ops::kernels::attention::AttnShape;
use encore_ops::{KernelSet, Ops, Weight};

use crate::config::{ModelConfig, RopeLayout};
use crate::error::{LlmError, Result};
use crate::gguf::GgufFile;

/// The weights of one transformer block.
pub struct Block {
    pub attn_norm: Buffer,
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub bq: Option<Buffer>,
    pub bk: Option<Buffer>,
    pub bv: Option<Buffer>,
    pub wo: Weight,
    pub ffn_norm: Buffer,
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

/// A loaded model: configuration, weights on a device, and the device's ops.
/// Shared between sessions (`Arc<Model>`); each session has its own KV cache.
pub struct Model {
    pub config: ModelConfig,
    pub device: Device,
    pub ops: Ops,
    pub embed: Weight,
    pub blocks: Vec<Block>,
    pub output_norm: Buffer,
    pub output: Weight,
}

fn upload_weight(device: &Device, f: &GgufFile, name: &str, n: usize, k: usize) -> Result<Weight> {
    let t = f.tensor(name)?;
    if t.dims.len() != 2 || t.dims[0] as usize != k || t.dims[1] as usize != n {
        return Err(LlmError::Model(format!(
            "tensor `{name}` has shape {:?}, expected [{k}, {n}]",
            t.dims
        )));
    }
    let data = f.tensor_data(t);
    if let Some(at) = t.dtype.first_non_finite(data) {
        return Err(non_finite(name, t.dtype.is_quantized(), at));
    }
    let buffer = device.buffer_from(data)?;
    f.release_tensor(t);
    Ok(Weight {
        buffer,
        dtype: t.dtype,
        n,
        k,
    })
}

/// Uploads a vector (norm weight or bias) as f32, whatever its stored type.
fn upload_vector(device: &Device, f: &GgufFile, name: &str, len: usize) -> Result<Buffer> {
    let t = f.tensor(name)?;
    if t.n_elements as usize != len || t.dims.len() != 1 {
        return Err(LlmError::Model(format!(
            "tensor `{name}` has shape {:?}, expected [{len}]",
            t.dims
        )));
    }
    let mut v = vec![0f32; len];
    encore_ops::cpu::dequantize_row(t.dtype, f.tensor_data(t), &mut v)
        .map_err(|e| LlmError::Model(format!("tensor {name}: {e}")))?;
    if let Some(at) = v.iter().position(|x| !x.is_finite()) {
        return Err(non_finite(name, false, at));
    }
    Ok(device.buffer_from(&v)?)
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

fn optional_vector(
    device: &Device,
    f: &GgufFile,
    name: &str,
    len: usize,
) -> Result<Option<Buffer>> {
    if f.tensors().iter().any(|t| t.name == name) {
        upload_vector(device, f, name, len).map(Some)
    } else {
        Ok(None)
    }
}

impl Model {
    /// Loads every weight of `f` onto `device`, with the op layer's
    /// kernels of `kernels`.
    pub fn load(f: &GgufFile, device: &Device, kernels: KernelSet) -> Result<Arc<Model>> {
        let c = ModelConfig::from_gguf(f)?;
        let ops = Ops::new(device, kernels)?;
        let (d, kv, ff) = (c.n_embd, c.kv_dim(), c.n_ff);
        let embed = upload_weight(device, f, "token_embd.weight", c.vocab, d)?;
        let mut blocks = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let name = |s: &str| format!("blk.{i}.{s}");
            blocks.push(Block {
                attn_norm: upload_vector(device, f, &name("attn_norm.weight"), d)?,
                wq: upload_weight(device, f, &name("attn_q.weight"), d, d)?,
                wk: upload_weight(device, f, &name("attn_k.weight"), kv, d)?,
                wv: upload_weight(device, f, &name("attn_v.weight"), kv, d)?,
                bq: optional_vector(device, f, &name("attn_q.bias"), d)?,
                bk: optional_vector(device, f, &name("attn_k.bias"), kv)?,
                bv: optional_vector(device, f, &name("attn_v.bias"), kv)?,
                wo: upload_weight(device, f, &name("attn_output.weight"), d, d)?,
                ffn_norm: upload_vector(device, f, &name("ffn_norm.weight"), d)?,
                gate: upload_weight(device, f, &name("ffn_gate.weight"), ff, d)?,
                up: upload_weight(device, f, &name("ffn_up.weight"), ff, d)?,
                down: upload_weight(device, f, &name("ffn_down.weight"), d, ff)?,
            });
        }
        let output_norm = upload_vector(device, f, "output_norm.weight", d)?;
        let output = if f.tensors().iter().any(|t| t.name == "output.weight") {
            upload_weight(device, f, "output.weight", c.vocab, d)?
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
        }))
    }

    /// Bytes of weights read per decoded token.
    pub fn weight_bytes(&self) -> usize {
        let w = |w: &Weight| w.buffer.len();
        self.blocks
            .iter()
            .map(|b| w(&b.wq) + w(&b.wk) + w(&b.wv) + w(&b.wo) + w(&b.gate) + w(&b.up) + w(&b.down))
            .sum::<usize>()
            + w(&self.output)
    }
}

/// Activation buffers for a forward pass over `rows` positions.
pub struct Activations {
    pub rows: usize,
    pub x: Buffer,
    pub xn: Buffer,
    pub q: Buffer,
    pub k: Buffer,
    pub v: Buffer,
    pub attn: Buffer,
    pub proj: Buffer,
    pub gate: Buffer,
    pub up: Buffer,
    pub ffn: Buffer,
    pub last_norm: Buffer,
    pub logits: Buffer,
}

impl Activations {
    pub fn new(model: &Model, rows: usize) -> Result<Activations> {
        let c = &model.config;
        let dev = &model.device;
        let f = |n: usize| dev.alloc(n * 4);
        Ok(Activations {
            rows,
            x: f(rows * c.n_embd)?,
            xn: f(rows * c.n_embd)?,
            q: f(rows * c.n_embd)?,
            k: f(rows * c.kv_dim())?,
            v: f(rows * c.kv_dim())?,
            attn: f(rows * c.n_embd)?,
            proj: f(rows * c.n_embd)?,
            gate: f(rows * c.n_ff)?,
            up: f(rows * c.n_ff)?,
            ffn: f(rows * c.n_ff)?,
            last_norm: f(c.n_embd)?,
            logits: f(c.vocab)?,
        })
    }
}

/// One layer's K and V cache, f16, `max_seq` positions.
pub struct LayerCache {
    pub k: Buffer,
    pub v: Buffer,
}

impl Model {
    /// Encodes a forward pass of `a.rows` tokens (read from `tokens`) at
    /// positions `pos..pos + rows` (`pos` is a parameter slot), leaving the
    /// last row's logits in `a.logits`.
    pub fn encode_forward(
        &self,
        enc: &mut Encoder,
        a: &Activations,
        tokens: &Buffer,
        pos: &Buffer,
        cache: &[LayerCache],
        max_seq: usize,
    ) -> Result<()> {
        let c = &self.config;
        let ops = &self.ops;
        let (m, d, kv, ff) = (a.rows, c.n_embd, c.kv_dim(), c.n_ff);
        let neox = c.rope == RopeLayout::Neox;
        ops.embed(enc, &self.embed, tokens, &a.x, m)?;
        for (b, lc) in self.blocks.iter().zip(cache) {
            ops.rms_norm(enc, &a.x, &b.attn_norm, &a.xn, m, d, c.norm_eps)?;
            ops.matmul(enc, &b.wq, &a.xn, &a.q, m, "attn_q")?;
            ops.matmul(enc, &b.wk, &a.xn, &a.k, m, "attn_k")?;
            ops.matmul(enc, &b.wv, &a.xn, &a.v, m, "attn_v")?;
            for (bias, out, n) in [(&b.bq, &a.q, d), (&b.bk, &a.k, kv), (&b.bv, &a.v, kv)] {
                if let Some(bias) = bias {
                    ops.add_rows(enc, out, bias, m, n)?;
                }
            }
            ops.rope(
                enc,
                &a.q,
                pos,
                m,
                c.n_head,
                c.head_dim,
                c.rope_dim,
                c.rope_base,
                neox,
                "rope_q",
            )?;
            ops.rope(
                enc,
                &a.k,
                pos,
                m,
                c.n_head_kv,
                c.head_dim,
                c.rope_dim,
                c.rope_base,
                neox,
                "rope_k",
            )?;
            ops.kv_store(enc, &a.k, &lc.k, pos, m, kv, max_seq, "k_store")?;
            ops.kv_store(enc, &a.v, &lc.v, pos, m, kv, max_seq, "v_store")?;
            let shape = AttnShape {
                rows: m as u32,
                heads: c.n_head as u32,
                kv_heads: c.n_head_kv as u32,
                head_dim: c.head_dim as u32,
                max_seq: max_seq as u32,
                scale: 1.0 / (c.head_dim as f32).sqrt(),
            };
            ops.attention(enc, &a.q, &lc.k, &lc.v, pos, &a.attn, shape)?;
            ops.matmul(enc, &b.wo, &a.attn, &a.proj, m, "attn_output")?;
            ops.add(enc, &a.x, &a.proj, m * d)?;
            ops.rms_norm(enc, &a.x, &b.ffn_norm, &a.xn, m, d, c.norm_eps)?;
            ops.matmul(enc, &b.gate, &a.xn, &a.gate, m, "ffn_gate")?;
            ops.matmul(enc, &b.up, &a.xn, &a.up, m, "ffn_up")?;
            ops.silu_mul(enc, &a.gate, &a.up, &a.ffn, m * ff)?;
            ops.matmul(enc, &b.down, &a.ffn, &a.proj, m, "ffn_down")?;
            ops.add(enc, &a.x, &a.proj, m * d)?;
        }
        let last = a.x.view((m - 1) * d * 4, d * 4)?;
        ops.rms_norm(
            enc,
            &last,
            &self.output_norm,
            &a.last_norm,
            1,
            d,
            c.norm_eps,
        )?;
        ops.matmul(enc, &self.output, &a.last_norm, &a.logits, 1, "output")?;
        Ok(())
    }

    /// Allocates a KV cache of `max_seq` positions for every layer.
    pub fn new_cache(&self, max_seq: usize) -> Result<Vec<LayerCache>> {
        let bytes = max_seq * self.config.kv_dim() * 2;
        (0..self.config.n_layer)
            .map(|_| {
                Ok(LayerCache {
                    k: self.device.alloc(bytes)?,
                    v: self.device.alloc(bytes)?,
                })
            })
            .collect()
    }
}
