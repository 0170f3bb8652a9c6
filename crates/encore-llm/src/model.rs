//! A model's weights on a device, and its forward pass.
//!
//! One transformer block, as the forward pass below encodes it:
//!
//! ```text
//! x ─┬─ rms_norm ─ q,k,v proj ─ [q,k norm] ─ rope(q,k) ─ kv_store ─ attention ─ o proj ─ [norm] ─(+)─┐
//!    └─────────────────────────────────────── residual ─────────────────────────────────────────────┘
//!  ─┬─ rms_norm ─ gate,up ─ act·mul ─ down ─ [norm] ─(+)─ x'
//!   └──────────────────── residual ──────────────────┘
//! ```
//!
//! The bracketed steps and the activation (SiLU or GELU) depend on the
//! architecture ([`ModelConfig`]); Qwen2's Q, K and V biases are added after
//! their products where the file has them. In a mixture of experts the
//! gated feed-forward is the routed sum of [`crate::moe`]'s experts. The embedding table (scaled, for
//! Gemma) feeds the first block; a final RMSNorm and the output head (the
//! embedding table itself when tied) turn the last row into logits.
//!
//! Loading the weights from a GGUF file is [`crate::load`]'s.

use encore::{Buffer, Device, Encoder};
use encore_ops::kernels::attention::AttnShape;
use encore_ops::kernels::paged::PagedAttnShape;
use encore_ops::{AttnRows, Ops, Positions, Weight};

use crate::config::{Activation, ModelConfig, RopeLayout};
use crate::error::{LlmError, Result};

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
    /// The feed-forward's matrices. In a mixture of experts, every
    /// expert's stacked: expert `e` holds rows `e * n / count..` of each
    /// ([`crate::moe::expert`]).
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
    /// The router of a mixture of experts (`ffn_gate_inp`): one logit per
    /// expert; `None` in a dense model.
    pub router: Option<Weight>,
    /// Per-head norms of the queries and keys (`head_dim` each).
    pub q_norm: Option<Buffer>,
    pub k_norm: Option<Buffer>,
    /// Norms of the attention output and the feed-forward output.
    pub post_attn_norm: Option<Buffer>,
    pub post_ffn_norm: Option<Buffer>,
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
    /// Per-pair RoPE divisors of scaled layers (`rope_dim / 2`): Llama 3's
    /// frequency factors divided by the linear scale. `None` when neither
    /// is present.
    pub rope_factors: Option<Buffer>,
}

impl Model {
    /// Bytes of weights read per decoded token: of a mixture of experts,
    /// the router and the share of the experts a token runs.
    pub fn weight_bytes(&self) -> usize {
        let w = |w: &Weight| w.buffer.len();
        let (used, count) = self.config.experts.map_or((1, 1), |e| (e.used, e.count));
        self.blocks
            .iter()
            .map(|b| {
                let ffn = (w(&b.gate) + w(&b.up) + w(&b.down)) / count * used;
                w(&b.wq) + w(&b.wk) + w(&b.wv) + w(&b.wo) + ffn + b.router.as_ref().map_or(0, w)
            })
            .sum::<usize>()
            + w(&self.output)
    }

    /// Whether a forward pass can be recorded as a graph and replayed: not
    /// for a mixture of experts, whose router's choices go through the host
    /// ([`crate::moe`]); sessions and batches of such a model run eagerly.
    pub fn can_record_graphs(&self) -> bool {
        self.config.experts.is_none()
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
    /// Q and K before their per-head norms (models with QK-norm only).
    pub qk_raw: Option<(Buffer, Buffer)>,
    pub attn: Buffer,
    pub proj: Buffer,
    pub gate: Buffer,
    pub up: Buffer,
    pub ffn: Buffer,
    /// The router's logits (`rows * expert count`) of a mixture of experts.
    pub router: Option<Buffer>,
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
            q: f(rows * c.q_dim())?,
            k: f(rows * c.kv_dim())?,
            v: f(rows * c.kv_dim())?,
            qk_raw: if c.qk_norm {
                Some((f(rows * c.q_dim())?, f(rows * c.kv_dim())?))
            } else {
                None
            },
            attn: f(rows * c.q_dim())?,
            proj: f(rows * c.n_embd)?,
            gate: f(rows * c.ffn_width())?,
            up: f(rows * c.ffn_width())?,
            ffn: f(rows * c.ffn_width())?,
            router: c.experts.map(|e| f(rows * e.count)).transpose()?,
            last_norm: f(c.n_embd)?,
            logits: f(c.vocab)?,
        })
    }
}

/// One layer's K and V cache, f16: `max_seq` positions of one sequence,
/// or a pool of blocks shared by many ([`Placement::Paged`]).
pub struct LayerCache {
    pub k: Buffer,
    pub v: Buffer,
}

/// Where the rows of a forward pass sit and where their K and V go.
#[derive(Clone, Copy)]
pub enum Placement<'a> {
    /// Rows at consecutive positions `pos..pos + rows` of one sequence
    /// (`pos` a one-element parameter buffer), its own cache of `max_seq`
    /// positions.
    Contiguous {
        pos: &'a Buffer,
        cache: &'a [LayerCache],
        max_seq: usize,
    },
    /// Rows of independent sequences over a paged cache: every row has its
    /// own position, slot and block table ([`PagedRows`]). Every product
    /// keeps each row's arithmetic independent of the batch.
    Paged(&'a PagedRows<'a>),
}

/// The per-row inputs of a [`Placement::Paged`] pass: `positions`, `slots`
/// (`u32[rows]`) and `tables` (`u32[rows, max_blocks]`), over pools of
/// `blocks` blocks of `block_size` positions.
#[derive(Clone, Copy)]
pub struct PagedRows<'a> {
    /// Prompt rows, many at once: products on the tiled kernel
    /// (`tiled` in [`encore_ops::Ops::matmul_rows`]); else decode rows, at
    /// most one a sequence (the promise of
    /// [`encore_ops::kernels::paged::PagedAttnShape::decode`]).
    pub prompt: bool,
    pub positions: &'a Buffer,
    pub slots: &'a Buffer,
    pub tables: &'a Buffer,
    pub cache: &'a [LayerCache],
    pub block_size: usize,
    pub max_blocks: usize,
    pub blocks: usize,
    /// The rows come in this many equal groups, one after another, each
    /// holding at most one row a sequence. Their RoPE, K and V stores and
    /// attention run one group after the other, so that a group reads the
    /// K and V that the groups before it stored: several decode rows of one
    /// sequence (a verified draft, [`crate::speculate`]) run in one pass,
    /// each with the arithmetic of a lone decode row. 1 for prompt rows.
    pub groups: usize,
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
        let place = Placement::Contiguous {
            pos,
            cache,
            max_seq,
        };
        self.encode_blocks(enc, a, tokens, place)?;
        let last = a.x.view(
            (a.rows - 1) * self.config.n_embd * 4,
            self.config.n_embd * 4,
        )?;
        self.encode_head(enc, &last, &a.last_norm, &a.logits, 1)
    }

    /// Encodes the output head of `rows` rows of hidden states `x`: the
    /// final RMSNorm into `normed`, then the logits (`rows * vocab`) into
    /// `logits`.
    pub fn encode_head(
        &self,
        enc: &mut Encoder,
        x: &Buffer,
        normed: &Buffer,
        logits: &Buffer,
        rows: usize,
    ) -> Result<()> {
        self.encode_head_with(enc, x, normed, logits, rows, false)
    }

    /// [`Model::encode_head`], the product row-invariant with `by_rows`
    /// (see [`Placement::Paged`]).
    pub fn encode_head_with(
        &self,
        enc: &mut Encoder,
        x: &Buffer,
        normed: &Buffer,
        logits: &Buffer,
        rows: usize,
        by_rows: bool,
    ) -> Result<()> {
        let c = &self.config;
        let ops = &self.ops;
        ops.rms_norm(
            enc,
            x,
            &self.output_norm,
            normed,
            rows,
            c.n_embd,
            c.norm_eps,
        )?;
        if by_rows {
            ops.matmul_rows(enc, &self.output, normed, logits, rows, false, "output")?;
        } else {
            ops.matmul(enc, &self.output, normed, logits, rows, "output")?;
        }
        Ok(())
    }

    /// Encodes the embedding and every block for `a.rows` tokens placed as
    /// `place` says, leaving the hidden states in `a.x`.
    pub fn encode_blocks(
        &self,
        enc: &mut Encoder,
        a: &Activations,
        tokens: &Buffer,
        place: Placement<'_>,
    ) -> Result<()> {
        let c = &self.config;
        let ops = &self.ops;
        let (m, d, q_dim, kv, ff) = (a.rows, c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff);
        let neox = c.rope == RopeLayout::Neox;
        let product =
            |enc: &mut Encoder, w: &Weight, x: &Buffer, y: &Buffer, rows, label| match place {
                Placement::Paged(p) => ops.matmul_rows(enc, w, x, y, rows, p.prompt, label),
                Placement::Contiguous { .. } => ops.matmul(enc, w, x, y, rows, label),
            };
        let matmul = |enc: &mut Encoder, w: &Weight, x: &Buffer, y: &Buffer, label| {
            product(enc, w, x, y, m, label)
        };
        let cache = match place {
            Placement::Contiguous { cache, .. } => cache,
            Placement::Paged(p) => {
                if p.groups == 0 || m % p.groups != 0 {
                    return Err(LlmError::Request(format!(
                        "{m} rows do not split into {} equal groups",
                        p.groups
                    )));
                }
                p.cache
            }
        };
        ops.embed(enc, &self.embed, tokens, &a.x, m)?;
        if let Some(s) = c.embed_scale {
            ops.scale(enc, &a.x, s, m * d)?;
        }
        for ((b, lc), la) in self.blocks.iter().zip(cache).zip(&c.layers) {
            ops.rms_norm(enc, &a.x, &b.attn_norm, &a.xn, m, d, c.norm_eps)?;
            // With QK-norm the products land in the raw buffers and the
            // per-head norms write `q` and `k`.
            let (q_out, k_out) = match &a.qk_raw {
                Some((q, k)) => (q, k),
                None => (&a.q, &a.k),
            };
            matmul(enc, &b.wq, &a.xn, q_out, "attn_q")?;
            matmul(enc, &b.wk, &a.xn, k_out, "attn_k")?;
            matmul(enc, &b.wv, &a.xn, &a.v, "attn_v")?;
            for (bias, out, n) in [(&b.bq, q_out, q_dim), (&b.bk, k_out, kv), (&b.bv, &a.v, kv)] {
                if let Some(bias) = bias {
                    ops.add_rows(enc, out, bias, m, n)?;
                }
            }
            if let (Some(qn), Some(kn)) = (&b.q_norm, &b.k_norm) {
                let hd = c.head_dim;
                ops.rms_norm(enc, q_out, qn, &a.q, m * c.n_head, hd, c.norm_eps)?;
                ops.rms_norm(enc, k_out, kn, &a.k, m * c.n_head_kv, hd, c.norm_eps)?;
            }
            let factors = self.rope_factors.as_ref().filter(|_| la.scaled);
            let rope = |enc: &mut Encoder, x: &Buffer, at: Positions<'_>, rows, heads, label| {
                let (hd, rd, base) = (c.head_dim, c.rope_dim, la.rope_base);
                ops.rope(enc, x, at, rows, heads, hd, rd, base, neox, factors, label)
            };
            match place {
                Placement::Contiguous { pos, max_seq, .. } => {
                    let at = Positions::Contiguous(pos);
                    rope(enc, &a.q, at, m, c.n_head, "rope_q")?;
                    rope(enc, &a.k, at, m, c.n_head_kv, "rope_k")?;
                    ops.kv_store(enc, &a.k, &lc.k, at, m, kv, "k_store")?;
                    ops.kv_store(enc, &a.v, &lc.v, at, m, kv, "v_store")?;
                    let shape = AttnShape {
                        rows: m as u32,
                        heads: c.n_head as u32,
                        kv_heads: c.n_head_kv as u32,
                        head_dim: c.head_dim as u32,
                        max_seq: max_seq as u32,
                        scale: c.attn_scale,
                        window: la.window as u32,
                    };
                    let rows = AttnRows::Contiguous { pos, shape };
                    ops.attention(enc, &a.q, &lc.k, &lc.v, rows, &a.attn)?;
                }
                Placement::Paged(p) => {
                    let n = m / p.groups;
                    // Group `g`'s rows of a buffer of `width` 4-byte values a row.
                    let part = |x: &Buffer, width: usize, g: usize| {
                        x.view(g * n * width * 4, n * width * 4)
                    };
                    for g in 0..p.groups {
                        let (q, k, v) = (
                            part(&a.q, q_dim, g)?,
                            part(&a.k, kv, g)?,
                            part(&a.v, kv, g)?,
                        );
                        let positions = part(p.positions, 1, g)?;
                        let slots = part(p.slots, 1, g)?;
                        let at = Positions::Rows(&positions);
                        rope(enc, &q, at, n, c.n_head, "rope_q")?;
                        rope(enc, &k, at, n, c.n_head_kv, "rope_k")?;
                        ops.kv_store(enc, &k, &lc.k, Positions::Rows(&slots), n, kv, "k_store")?;
                        ops.kv_store(enc, &v, &lc.v, Positions::Rows(&slots), n, kv, "v_store")?;
                        let shape = PagedAttnShape {
                            rows: n as u32,
                            heads: c.n_head as u32,
                            kv_heads: c.n_head_kv as u32,
                            head_dim: c.head_dim as u32,
                            block_size: p.block_size as u32,
                            max_blocks: p.max_blocks as u32,
                            blocks: p.blocks as u32,
                            scale: c.attn_scale,
                            window: la.window as u32,
                            // Decode passes hold one row a sequence a group.
                            decode: u32::from(!p.prompt),
                        };
                        let tables = part(p.tables, p.max_blocks, g)?;
                        let rows = AttnRows::Paged {
                            positions: &positions,
                            tables: &tables,
                            shape,
                        };
                        ops.attention(enc, &q, &lc.k, &lc.v, rows, &part(&a.attn, q_dim, g)?)?;
                    }
                }
            }
            matmul(enc, &b.wo, &a.attn, &a.proj, "attn_output")?;
            self.residual(enc, a, b.post_attn_norm.as_ref())?;
            ops.rms_norm(enc, &a.x, &b.ffn_norm, &a.xn, m, d, c.norm_eps)?;
            if let Some(router) = &b.router {
                self.encode_experts(enc, a, b, router, &product)?;
                continue;
            }
            matmul(enc, &b.gate, &a.xn, &a.gate, "ffn_gate")?;
            matmul(enc, &b.up, &a.xn, &a.up, "ffn_up")?;
            match c.activation {
                Activation::Silu => ops.silu_mul(enc, &a.gate, &a.up, &a.ffn, m * ff)?,
                Activation::Gelu => ops.gelu_mul(enc, &a.gate, &a.up, &a.ffn, m * ff)?,
            }
            matmul(enc, &b.down, &a.ffn, &a.proj, "ffn_down")?;
            self.residual(enc, a, b.post_ffn_norm.as_ref())?;
        }
        Ok(())
    }

    /// `x += proj`, or `x += rms_norm(proj)` with a post-norm (through `xn`).
    fn residual(&self, enc: &mut Encoder, a: &Activations, norm: Option<&Buffer>) -> Result<()> {
        let c = &self.config;
        let n = a.rows * c.n_embd;
        match norm {
            Some(w) => {
                self.ops
                    .rms_norm(enc, &a.proj, w, &a.xn, a.rows, c.n_embd, c.norm_eps)?;
                self.ops.add(enc, &a.x, &a.xn, n)
            }
            None => self.ops.add(enc, &a.x, &a.proj, n),
        }
        .map_err(Into::into)
    }

    /// Allocates a KV cache of `max_seq` positions (or slots of a paged
    /// pool) for every layer.
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
