//! [`Ops`]: the kernels of one [`KernelSet`] loaded on one device, and one
//! method per operation that builds the op's typed arguments (every buffer
//! with its access, over exactly the byte range the kernel touches) and
//! dispatches them.
//!
//! Shapes that a kernel cannot handle are rejected here, before dispatch,
//! with the same rule on every backend. Which kernel computes an op is
//! decided by what the device has, never by which backend it is: a variant
//! (the tensor-core gemm, the tiled prefill attention) runs where the
//! device loaded it and its kernel takes the shape, the general kernel
//! elsewhere; an op whose kernel the device's backend does not implement
//! fails with [`Error::Unsupported`] when it is dispatched. Launch
//! geometry is the backend's business (see [`encore::CudaKernel`]).
//!
//! An op that reads positions has one method for one sequence's contiguous
//! cache and for a paged cache of many sequences: [`Positions`] or
//! [`AttnRows`] says where the rows sit, and picks the kernel compiled for
//! that source.

use std::sync::Mutex;

use encore::graph::passes::FusionPattern;
use encore::{Buffer, Device, Encoder, Error, Kernel, Result};

use crate::dtype::WeightTypes;
use crate::kernels::advance::AdvanceArgs;
use crate::kernels::argmax::{self, ArgmaxArgs};
use crate::kernels::attention::{self, AttnArgs, KvArgs};
use crate::kernels::elementwise::{
    AddArgs, AddRowsArgs, GeluMulArgs, ScaleArgs, ScaleShape, SiluMulArgs,
};
use crate::kernels::embed::{EmbedArgs, EmbedShape};
use crate::kernels::gemm_dense::{
    self, DequantArgs, DequantShape, GemmF16Args, GemmF16Shape, SplitsShape, SumSplitsArgs,
    ToF16Args, WideRowsArgs,
};
use crate::kernels::matmul::{MatmulArgs, MatmulShape};
use crate::kernels::norm::{NormArgs, NormShape};
use crate::kernels::paged::{ArgmaxRowsArgs, ArgmaxRowsShape, PagedAttnArgs, PagedAttnShape};
use crate::kernels::rope::{self, RopeArgs, RopeShape};
use crate::kernels::{gemm, prefill_attention};
use crate::registry::{KernelSet, Slot, Slots};
use crate::DType;

/// Where the rows of a [`Ops::rope`] or [`Ops::kv_store`] sit: in one
/// sequence's contiguous cache or in a paged cache of many sequences
/// ([`crate::kernels::positions`]).
#[derive(Clone, Copy, Debug)]
pub enum Positions<'a> {
    /// Consecutive rows of one sequence: row `r` at position `start + r`,
    /// where `start` is the first word of the buffer (a one-element graph
    /// parameter), stored in cache row `start + r`.
    Contiguous(&'a Buffer),
    /// Rows of independent sequences, one `u32` a row: for [`Ops::rope`]
    /// each row's position, for [`Ops::kv_store`] each row's slot in the
    /// paged pool.
    Rows(&'a Buffer),
}

/// Where the query rows of an [`Ops::attention`] sit and how their
/// sequences' positions map to cache rows.
#[derive(Clone, Copy, Debug)]
pub enum AttnRows<'a> {
    /// `shape.rows` consecutive rows of one sequence from the position
    /// `pos` (a one-element graph parameter), over its own cache of
    /// `shape.max_seq` positions.
    Contiguous {
        pos: &'a Buffer,
        shape: attention::AttnShape,
    },
    /// `shape.rows` rows of independent sequences over a paged cache: row
    /// `r` at `positions[r]` through block table `tables[r]` (`u32[rows,
    /// max_blocks]`); see [`crate::kernels::paged`].
    Paged {
        positions: &'a Buffer,
        tables: &'a Buffer,
        shape: PagedAttnShape,
    },
}

/// A weight matrix of `n` rows of `k` inputs in GGUF block layout.
#[derive(Clone, Debug)]
pub struct Weight {
    pub buffer: Buffer,
    pub dtype: DType,
    pub n: usize,
    pub k: usize,
}

/// The first `n` f32 elements of a buffer, as the exact range a kernel touches.
fn f32s(b: &Buffer, n: usize) -> Result<Buffer> {
    b.view(0, n * 4)
}

/// The arguments of a product of `rows` rows of `x` with `w` into `y`.
fn matmul_args(w: &Weight, x: &Buffer, y: &Buffer, rows: usize) -> Result<MatmulArgs> {
    Ok(MatmulArgs {
        w: w.buffer.clone(),
        x: f32s(x, rows * w.k)?,
        y: f32s(y, rows * w.n)?,
        shape: MatmulShape {
            rows: rows as u32,
            n: w.n as u32,
            k: w.k as u32,
            dtype: w.dtype.ggml_id(),
        },
    })
}

/// The shape of a rotation of `rows` rows of `heads` heads.
fn rope_shape(
    rows: usize,
    heads: usize,
    head_dim: usize,
    rope_dim: usize,
    base: f32,
    neox: bool,
    factors: bool,
) -> RopeShape {
    RopeShape {
        rows: rows as u32,
        heads: heads as u32,
        head_dim: head_dim as u32,
        rope_dim: rope_dim as u32,
        base,
        neox: neox as u32,
        theta_scale: rope::theta_scale(base, rope_dim),
        factors: factors as u32,
    }
}

fn invalid(kernel: &str, label: &str, reason: String) -> Error {
    Error::InvalidDispatch {
        kernel: kernel.to_string(),
        label: label.to_string(),
        reason,
    }
}

/// The kernels of the long prompts' products ([`gemm_dense`]).
#[derive(Clone, Copy)]
struct DenseKernels<'a> {
    to_f16: &'a Kernel,
    dequant: &'a Kernel,
    gemm: &'a Kernel,
    sum_splits: &'a Kernel,
    wide_rows: &'a Kernel,
}

/// Every operation's kernel, loaded on one device.
pub struct Ops {
    device: Device,
    kernels: KernelSet,
    types: WeightTypes,
    /// A slot per row of the registry's table.
    slots: Slots,
    /// Working memory of the long prompts' products (f16 activations,
    /// their marks, a slice of f16 weights, split sums), grown to the
    /// largest asked for. Each use declares its ranges, so the products of
    /// one submission wait on each other's use of it, and the device's one
    /// queue runs submissions in order; a buffer given up stays alive for
    /// the submissions that hold it.
    scratch: Mutex<Option<Buffer>>,
}

impl Ops {
    /// Loads (compiling where needed) the kernels of `kernels` that the
    /// device's backend implements. One it does not implement fails when
    /// its op is dispatched, so a backend can be brought up one op at a time.
    pub fn new(device: &Device, kernels: KernelSet) -> Result<Ops> {
        Ops::for_weight_types(device, kernels, WeightTypes::ALL)
    }

    /// [`Ops::new`] with the products of weights built for the types
    /// `types` alone: a model's few types compile in a fraction of the time
    /// of every type's code. A product of another type is refused when it
    /// is dispatched, with an error naming the types these ops were built for.
    pub fn for_weight_types(
        device: &Device,
        kernels: KernelSet,
        types: WeightTypes,
    ) -> Result<Ops> {
        let defs = kernels.defs_for(types);
        // Every kernel of the set compiles at once first, into the device's
        // kernel cache, where the loads below find it: a backend that
        // compiles from source then takes its slowest kernel's time, not
        // the sum of all.
        crate::registry::load_defs(device, defs.clone().all())?;
        // A kernel the exact set lacks on a backend is named as the exact
        // set's, so the error says which set to leave.
        let set = |mut slot: Slot| {
            if kernels == KernelSet::Exact && slot.kernel.is_none() && !slot.name.is_empty() {
                slot.name = format!("{} (exact kernel set)", slot.name);
            }
            slot
        };
        Ok(Ops {
            device: device.clone(),
            kernels,
            types,
            slots: Slots::load(device, defs, set)?,
            scratch: Mutex::new(None),
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The weight types these ops' products are built for.
    pub fn weight_types(&self) -> WeightTypes {
        self.types
    }

    /// Refuses a product of `w` where these ops were built for other types.
    fn check_type(&self, w: &Weight, label: &str) -> Result<()> {
        if self.types.contains(w.dtype) {
            return Ok(());
        }
        Err(invalid(
            "matmul",
            label,
            format!(
                "weights of type {} reach kernels built for the types {} alone",
                w.dtype.name(),
                self.types.names().join(", ")
            ),
        ))
    }

    /// The kernel set these are.
    pub fn kernels(&self) -> KernelSet {
        self.kernels
    }

    /// Whether these kernels give the CPU backend's results bit for bit:
    /// the exact set, or any set on a backend whose kernels are the
    /// reference ([`encore::Capabilities::exact_by_default`]).
    pub fn exact(&self) -> bool {
        self.kernels == KernelSet::Exact || self.device.capabilities().exact_by_default
    }

    /// Steps of a self-feeding decode loop worth running in one graph
    /// replay on this device ([`encore::Capabilities::steps_per_replay`]).
    pub fn steps_per_replay(&self) -> usize {
        self.device.capabilities().steps_per_replay
    }

    /// The fusion rules worth applying on this device, for graph
    /// instantiation: every rule of [`crate::fusion`] where fusion pays
    /// ([`encore::Capabilities::fusion_pays`]), none elsewhere.
    pub fn fusion_patterns(&self) -> Vec<FusionPattern> {
        if self.device.capabilities().fusion_pays {
            self.all_fusion_patterns()
        } else {
            Vec::new()
        }
    }

    /// Every fusion rule whose fused kernel the device has, whatever the
    /// device (the CPU bodies of the fused kernels give the unfused results
    /// bit for bit, which tests rely on).
    pub fn all_fusion_patterns(&self) -> Vec<FusionPattern> {
        crate::fusion::patterns(
            self.slots.fused_matmul.kernel.as_ref(),
            self.slots.rope_store.kernel.as_ref(),
            self.slots.attention_step.kernel.as_ref(),
        )
    }

    /// The fusion rules for graphs of row-invariant ops (a batch of
    /// independent sequences: `matmul_rows` into `fused_matmul_rows`, the
    /// paged RoPE and stores into `attention_step_paged`), where fusion
    /// pays off; empty elsewhere.
    pub fn row_fusion_patterns(&self) -> Vec<FusionPattern> {
        if self.device.capabilities().fusion_pays {
            self.all_row_fusion_patterns()
        } else {
            Vec::new()
        }
    }

    /// Every row fusion rule whose fused kernel the device has, whatever
    /// the device (as [`Ops::all_fusion_patterns`]).
    pub fn all_row_fusion_patterns(&self) -> Vec<FusionPattern> {
        crate::fusion::row_patterns(
            self.slots.fused_matmul_rows.kernel.as_ref(),
            self.slots.attention_step_paged.kernel.as_ref(),
        )
    }

    /// `y = rms_norm(x) * w` over `rows` rows of `dim`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        enc: &mut Encoder,
        x: &Buffer,
        w: &Buffer,
        y: &Buffer,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let args = NormArgs {
            x: f32s(x, rows * dim)?,
            w: f32s(w, dim)?,
            y: f32s(y, rows * dim)?,
            shape: NormShape {
                rows: rows as u32,
                dim: dim as u32,
                eps,
            },
        };
        enc.dispatch(
            self.slots.rms_norm.get(&self.device)?,
            &args.args(),
            "rms_norm",
        )
    }

    /// `y[rows, n] = x[rows, k] · wᵀ`. From [`gemm_dense::DENSE_MIN_ROWS`]
    /// rows on, where the device has them and the weights' type suits,
    /// the kernels of [`gemm_dense`] compute it on dequantized f16 tiles;
    /// from [`gemm::GEMM_MIN_ROWS`] rows on the tiled tensor-core kernel of
    /// [`gemm`] (activations rounded to f16 or split into bf16 parts, see
    /// there); fewer rows, and devices without either (the CPU, the exact
    /// set), take [`matmul`](crate::kernels::matmul).
    pub fn matmul(
        &self,
        enc: &mut Encoder,
        w: &Weight,
        x: &Buffer,
        y: &Buffer,
        rows: usize,
        label: &'static str,
    ) -> Result<()> {
        self.check_type(w, label)?;
        let args = matmul_args(w, x, y, rows)?;
        if rows >= gemm_dense::DENSE_MIN_ROWS && gemm_dense::takes(w.dtype, w.k) {
            if let Some(kernels) = self.dense_kernels() {
                return self.matmul_dense(enc, kernels, w, &args, label);
            }
        }
        let kernel = match &self.slots.gemm.kernel {
            Some(gemm) if rows >= gemm::GEMM_MIN_ROWS => gemm,
            _ => self.slots.matmul.get(&self.device)?,
        };
        enc.dispatch(kernel, &args.args(), label)
    }

    /// The kernels of [`gemm_dense`], where the device has them all.
    fn dense_kernels(&self) -> Option<DenseKernels<'_>> {
        Some(DenseKernels {
            to_f16: self.slots.to_f16_rows.kernel.as_ref()?,
            dequant: self.slots.dequant_f16.kernel.as_ref()?,
            gemm: self.slots.gemm_f16.kernel.as_ref()?,
            sum_splits: self.slots.sum_splits.kernel.as_ref()?,
            wide_rows: self.slots.matmul_wide_rows.kernel.as_ref()?,
        })
    }

    /// The scratch buffer, at least `bytes` long.
    fn scratch(&self, bytes: usize) -> Result<Buffer> {
        // A panic elsewhere cannot leave the slot half-written: take it as is.
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        match &*scratch {
            Some(b) if b.len() >= bytes => Ok(b.clone()),
            _ => {
                let b = self.device.alloc(bytes)?;
                *scratch = Some(b.clone());
                Ok(b)
            }
        }
    }

    /// [`Ops::matmul`] on dequantized tiles ([`gemm_dense`]): the
    /// activations to f16, then slice by slice of the weights' rows their
    /// decode and product (split along `k` where the tiles are few), then
    /// the rows beyond f16's range in f32.
    fn matmul_dense(
        &self,
        enc: &mut Encoder,
        kernels: DenseKernels,
        w: &Weight,
        args: &MatmulArgs,
        label: &'static str,
    ) -> Result<()> {
        let MatmulShape { rows, n, k, dtype } = args.shape;
        let (rows_u, n_u, k_u) = (rows as usize, n as usize, k as usize);
        let slice = gemm_dense::slice_rows(n_u, k_u);
        let splits = gemm_dense::splits(rows_u, slice, k_u);
        // Scratch: f16 activations, their marks, a slice of f16 weights,
        // and the runs' sums of a split product.
        let aligned = |bytes: usize| bytes.next_multiple_of(256);
        let x16_at = 0;
        let wide_at = x16_at + aligned(rows_u * k_u * 2);
        let w16_at = wide_at + aligned(rows_u * 4);
        let part_at = w16_at + aligned(slice * k_u * 2);
        let part_bytes = if splits > 1 {
            splits * rows_u * slice * 4
        } else {
            0
        };
        let scratch = self.scratch(part_at + part_bytes)?;
        let x16 = scratch.view(x16_at, rows_u * k_u * 2)?;
        let wide = scratch.view(wide_at, rows_u * 4)?;
        let to_f16_args = ToF16Args {
            x: args.x.clone(),
            x16: x16.clone(),
            wide: wide.clone(),
            shape: [rows, k],
        };
        enc.dispatch(kernels.to_f16, &to_f16_args.args(), label)?;
        for n0 in (0..n_u).step_by(slice) {
            let count = slice.min(n_u - n0);
            let w16 = scratch.view(w16_at, count * k_u * 2)?;
            let dequant_args = DequantArgs {
                w: w.buffer.clone(),
                w16: w16.clone(),
                shape: DequantShape {
                    n0: n0 as u32,
                    n: count as u32,
                    k,
                    dtype,
                },
            };
            enc.dispatch(kernels.dequant, &dequant_args.args(), label)?;
            let shape = GemmF16Shape {
                rows,
                n: count as u32,
                k,
                ldy: n,
                n0: n0 as u32,
                splits: splits as u32,
            };
            if splits == 1 {
                let gemm_args = GemmF16Args {
                    a: x16.clone(),
                    b: w16,
                    y: args.y.clone(),
                    shape,
                };
                enc.dispatch(kernels.gemm, &gemm_args.args(), label)?;
                continue;
            }
            let part = scratch.view(part_at, splits * rows_u * count * 4)?;
            let gemm_args = GemmF16Args {
                a: x16.clone(),
                b: w16,
                y: part.clone(),
                shape: GemmF16Shape {
                    ldy: count as u32,
                    n0: 0,
                    ..shape
                },
            };
            enc.dispatch(kernels.gemm, &gemm_args.args(), label)?;
            let sum_args = SumSplitsArgs {
                part,
                y: args.y.clone(),
                shape: SplitsShape {
                    rows,
                    n: count as u32,
                    splits: splits as u32,
                    ldy: n,
                    n0: n0 as u32,
                },
            };
            enc.dispatch(kernels.sum_splits, &sum_args.args(), label)?;
        }
        let wide_args = WideRowsArgs {
            w: args.w.clone(),
            x: args.x.clone(),
            wide,
            y: args.y.clone(),
            shape: args.shape,
        };
        enc.dispatch(kernels.wide_rows, &wide_args.args(), label)
    }

    /// Rotates `rows` rows of `heads` heads in place, each at its position
    /// (`at`), each pair's angle divided by its entry of `factors` where
    /// given (`rope_dim / 2` values).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        enc: &mut Encoder,
        x: &Buffer,
        at: Positions<'_>,
        rows: usize,
        heads: usize,
        head_dim: usize,
        rope_dim: usize,
        base: f32,
        neox: bool,
        factors: Option<&Buffer>,
        label: &'static str,
    ) -> Result<()> {
        let (slot, name, pos) = match at {
            Positions::Contiguous(pos) => (&self.slots.rope, "rope", pos.clone()),
            Positions::Rows(positions) => (
                &self.slots.rope_rows,
                "rope_rows",
                positions.view(0, rows * 4)?,
            ),
        };
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(invalid(
                name,
                label,
                format!("rope_dim {rope_dim} must be even and at most head_dim {head_dim}"),
            ));
        }
        let args = RopeArgs {
            x: f32s(x, rows * heads * head_dim)?,
            factors: match factors {
                Some(f) => f32s(f, rope_dim / 2)?,
                None => pos.clone(),
            },
            pos,
            shape: rope_shape(
                rows,
                heads,
                head_dim,
                rope_dim,
                base,
                neox,
                factors.is_some(),
            ),
        };
        enc.dispatch(slot.get(&self.device)?, &args.args(), label)
    }

    /// Stores `rows` rows of `src` into an f16 cache of `kv_dim` values a
    /// row, row `r` at cache row `start + r` or at its slot (`at`); the
    /// cache's rows are its length over a row's bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        enc: &mut Encoder,
        src: &Buffer,
        cache: &Buffer,
        at: Positions<'_>,
        rows: usize,
        kv_dim: usize,
        label: &'static str,
    ) -> Result<()> {
        let (slot, pos) = match at {
            Positions::Contiguous(pos) => (&self.slots.kv_store, pos.clone()),
            Positions::Rows(slots) => (&self.slots.kv_store_paged, slots.view(0, rows * 4)?),
        };
        let cache_rows = cache.len() / (kv_dim * 2).max(1);
        let args = KvArgs {
            src: f32s(src, rows * kv_dim)?,
            cache: cache.view(0, cache_rows * kv_dim * 2)?,
            pos,
            shape: attention::KvShape {
                rows: rows as u32,
                kv_dim: kv_dim as u32,
                max_seq: cache_rows as u32,
            },
        };
        enc.dispatch(slot.get(&self.device)?, &args.args(), label)
    }

    /// Causal grouped-query attention of `rows` query rows over the cache,
    /// the rows placed as `rows` says. Batches of one sequence of
    /// [`prefill_attention::PREFILL_MIN_ROWS`] rows or more with no sliding
    /// window and 16-byte aligned caches take the tiled kernel of
    /// [`prefill_attention`] where the device has it and it takes the head
    /// size; the exact set's `attention` kernel takes every batch. Rows of
    /// a paged cache take `attention_paged`, whose rows' results do not
    /// depend on the batch.
    pub fn attention(
        &self,
        enc: &mut Encoder,
        q: &Buffer,
        k: &Buffer,
        v: &Buffer,
        rows: AttnRows<'_>,
        out: &Buffer,
    ) -> Result<()> {
        let (name, heads, kv_heads, head_dim) = match rows {
            AttnRows::Contiguous { shape: s, .. } => ("attention", s.heads, s.kv_heads, s.head_dim),
            AttnRows::Paged { shape: s, .. } => {
                ("attention_paged", s.heads, s.kv_heads, s.head_dim)
            }
        };
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(invalid(
                name,
                "attention",
                format!("{heads} heads do not divide into {kv_heads} KV heads"),
            ));
        }
        match rows {
            AttnRows::Contiguous { pos, shape } => {
                if head_dim as usize > attention::MAX_HEAD_DIM {
                    return Err(invalid(
                        name,
                        "attention",
                        format!("head size {head_dim} above {}", attention::MAX_HEAD_DIM),
                    ));
                }
                self.attention_contiguous(enc, q, k, v, pos, out, shape)
            }
            AttnRows::Paged {
                positions,
                tables,
                shape,
            } => {
                if head_dim as usize > attention::MAX_HEAD_DIM || shape.block_size == 0 {
                    return Err(invalid(
                        name,
                        "attention",
                        format!(
                            "head size {head_dim} (at most {}) or block size {} (at least 1)",
                            attention::MAX_HEAD_DIM,
                            shape.block_size
                        ),
                    ));
                }
                let rows = shape.rows as usize;
                let n = rows * (heads * head_dim) as usize;
                let cache = shape.blocks as usize
                    * shape.block_size as usize
                    * (kv_heads * head_dim) as usize
                    * 2;
                let args = PagedAttnArgs {
                    q: f32s(q, n)?,
                    k: k.view(0, cache)?,
                    v: v.view(0, cache)?,
                    positions: positions.view(0, rows * 4)?,
                    tables: tables.view(0, rows * shape.max_blocks as usize * 4)?,
                    out: f32s(out, n)?,
                    shape,
                };
                enc.dispatch(
                    self.slots.attention_paged.get(&self.device)?,
                    &args.args(),
                    "attention",
                )
            }
        }
    }

    /// [`Ops::attention`] of one sequence's rows: the tiled prefill kernel
    /// where it applies, else the `attention` kernel.
    #[allow(clippy::too_many_arguments)]
    fn attention_contiguous(
        &self,
        enc: &mut Encoder,
        q: &Buffer,
        k: &Buffer,
        v: &Buffer,
        pos: &Buffer,
        out: &Buffer,
        shape: attention::AttnShape,
    ) -> Result<()> {
        let n = (shape.rows * shape.heads * shape.head_dim) as usize;
        let args = AttnArgs {
            q: f32s(q, n)?,
            k: k.clone(),
            v: v.clone(),
            pos: pos.clone(),
            out: f32s(out, n)?,
            shape,
        };
        let tiled = shape.rows as usize >= prefill_attention::PREFILL_MIN_ROWS
            && shape.window == 0
            && k.offset().is_multiple_of(16)
            && v.offset().is_multiple_of(16);
        let prefill = if tiled {
            (self.slots.attention_prefill).launching(bytemuck::bytes_of(&shape))
        } else {
            None
        };
        let kernel = match prefill {
            Some(prefill) => prefill,
            None => self.slots.attention.get(&self.device)?,
        };
        enc.dispatch(kernel, &args.args(), "attention")
    }

    /// `y[rows, n] = x[rows, k] · wᵀ` with each row's arithmetic independent
    /// of the other rows: the product of a batch of independent sequences,
    /// whose results must not depend on the batch ([`crate::kernels::paged`]).
    /// With `tiled` (a pass of many prompt rows), on a device with the tiled
    /// tensor-core product (`gemm`, CUDA), that product at any row count,
    /// since its sums for a row do not depend on the rows sharing its tile;
    /// else, and elsewhere, the matrix-vector kernel row by row.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_rows(
        &self,
        enc: &mut Encoder,
        w: &Weight,
        x: &Buffer,
        y: &Buffer,
        rows: usize,
        tiled: bool,
        label: &'static str,
    ) -> Result<()> {
        self.check_type(w, label)?;
        let args = matmul_args(w, x, y, rows)?;
        let kernel = match &self.slots.gemm.kernel {
            Some(gemm) if tiled => gemm,
            _ => self.slots.matmul_rows.get(&self.device)?,
        };
        enc.dispatch(kernel, &args.args(), label)
    }

    /// `y += x` over `n` elements.
    pub fn add(&self, enc: &mut Encoder, y: &Buffer, x: &Buffer, n: usize) -> Result<()> {
        let args = AddArgs {
            y: f32s(y, n)?,
            x: f32s(x, n)?,
            n: n as u32,
        };
        enc.dispatch(self.slots.add.get(&self.device)?, &args.args(), "add")
    }

    /// `y[r, :] += b` for `rows` rows of `n` (a bias).
    pub fn add_rows(
        &self,
        enc: &mut Encoder,
        y: &Buffer,
        b: &Buffer,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let args = AddRowsArgs {
            y: f32s(y, rows * n)?,
            b: f32s(b, n)?,
            shape: [rows as u32, n as u32],
        };
        enc.dispatch(
            self.slots.add_rows.get(&self.device)?,
            &args.args(),
            "add_rows",
        )
    }

    /// `y = silu(g) * u` over `n` elements.
    pub fn silu_mul(
        &self,
        enc: &mut Encoder,
        g: &Buffer,
        u: &Buffer,
        y: &Buffer,
        n: usize,
    ) -> Result<()> {
        let args = SiluMulArgs {
            g: f32s(g, n)?,
            u: f32s(u, n)?,
            y: f32s(y, n)?,
            n: n as u32,
        };
        enc.dispatch(
            self.slots.silu_mul.get(&self.device)?,
            &args.args(),
            "silu_mul",
        )
    }

    /// `y = gelu(g) * u` over `n` elements (tanh approximation).
    pub fn gelu_mul(
        &self,
        enc: &mut Encoder,
        g: &Buffer,
        u: &Buffer,
        y: &Buffer,
        n: usize,
    ) -> Result<()> {
        let args = GeluMulArgs {
            g: f32s(g, n)?,
            u: f32s(u, n)?,
            y: f32s(y, n)?,
            n: n as u32,
        };
        enc.dispatch(
            self.slots.gelu_mul.get(&self.device)?,
            &args.args(),
            "gelu_mul",
        )
    }

    /// `y *= s` over `n` elements.
    pub fn scale(&self, enc: &mut Encoder, y: &Buffer, s: f32, n: usize) -> Result<()> {
        let args = ScaleArgs {
            y: f32s(y, n)?,
            shape: ScaleShape { n: n as u32, s },
        };
        enc.dispatch(self.slots.scale.get(&self.device)?, &args.args(), "scale")
    }

    /// `y[r] = table[tokens[r]]`, dequantized, for `rows` tokens.
    pub fn embed(
        &self,
        enc: &mut Encoder,
        table: &Weight,
        tokens: &Buffer,
        y: &Buffer,
        rows: usize,
    ) -> Result<()> {
        let args = EmbedArgs {
            table: table.buffer.clone(),
            tokens: tokens.view(0, rows * 4)?,
            y: f32s(y, rows * table.k)?,
            shape: EmbedShape {
                rows: rows as u32,
                dim: table.k as u32,
                vocab: table.n as u32,
                dtype: table.dtype.ggml_id(),
            },
        };
        enc.dispatch(self.slots.embed.get(&self.device)?, &args.args(), "embed")
    }

    /// `out[0] = argmax(x[..n])`, the first index of the largest value;
    /// `out` comes from [`Ops::argmax_buffer`] (its other bytes are the
    /// kernel's scratch, zero between dispatches).
    pub fn argmax(&self, enc: &mut Encoder, x: &Buffer, out: &Buffer, n: usize) -> Result<()> {
        if out.len() < argmax::OUT_BYTES || !out.offset().is_multiple_of(8) {
            return Err(invalid(
                "argmax",
                "argmax",
                format!(
                    "out must hold {} bytes at an 8-byte aligned offset (Ops::argmax_buffer makes one); \
                     got {} bytes at offset {}",
                    argmax::OUT_BYTES,
                    out.len(),
                    out.offset()
                ),
            ));
        }
        let args = ArgmaxArgs {
            x: f32s(x, n)?,
            out: out.view(0, argmax::OUT_BYTES)?,
            n: n as u32,
        };
        enc.dispatch(self.slots.argmax.get(&self.device)?, &args.args(), "argmax")
    }

    /// A buffer for [`Ops::argmax`]'s result: [`argmax::OUT_BYTES`] bytes,
    /// zeroed, the index in the first four.
    pub fn argmax_buffer(&self) -> Result<Buffer> {
        self.device.buffer_from(&[0u32; argmax::OUT_BYTES / 4])
    }

    /// The argmax of each of `rows` rows of `n` values of `x` into
    /// `out[4 * r]` (`u32::MAX` where a row's largest value is not finite);
    /// `out` comes from [`Ops::argmax_rows_buffer`].
    pub fn argmax_rows(
        &self,
        enc: &mut Encoder,
        x: &Buffer,
        out: &Buffer,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let bytes = rows * argmax::OUT_BYTES;
        if out.len() < bytes || !out.offset().is_multiple_of(8) {
            return Err(invalid(
                "argmax_rows",
                "argmax_rows",
                format!(
                    "out must hold {bytes} bytes at an 8-byte aligned offset \
                     (Ops::argmax_rows_buffer makes one); got {} bytes at offset {}",
                    out.len(),
                    out.offset()
                ),
            ));
        }
        let args = ArgmaxRowsArgs {
            x: f32s(x, rows * n)?,
            out: out.view(0, bytes)?,
            shape: ArgmaxRowsShape {
                rows: rows as u32,
                n: n as u32,
            },
        };
        enc.dispatch(
            self.slots.argmax_rows.get(&self.device)?,
            &args.args(),
            "argmax",
        )
    }

    /// A buffer for [`Ops::argmax_rows`] over `rows` rows, zeroed.
    pub fn argmax_rows_buffer(&self, rows: usize) -> Result<Buffer> {
        self.device
            .buffer_from(&vec![0u32; rows.max(1) * argmax::OUT_BYTES / 4])
    }

    /// One greedy step's bookkeeping on the device: `token = next`,
    /// `history[pos] = next` (when `pos` is below the history's length),
    /// `pos += 1`. `next`, `token` and `pos` are one-element `u32` buffers.
    pub fn advance(
        &self,
        enc: &mut Encoder,
        next: &Buffer,
        token: &Buffer,
        pos: &Buffer,
        history: &Buffer,
    ) -> Result<()> {
        let cap = history.len() / 4;
        let args = AdvanceArgs {
            next: next.view(0, 4)?,
            token: token.view(0, 4)?,
            pos: pos.view(0, 4)?,
            history: history.view(0, cap * 4)?,
            cap: cap as u32,
        };
        enc.dispatch(
            self.slots.advance.get(&self.device)?,
            &args.args(),
            "advance",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The general kernels serve the CPU for every row count: the tiled
    /// variants, which it has no body of, leave their slots empty.
    #[test]
    fn the_cpu_runs_the_general_kernels() -> Result<()> {
        let device = Device::cpu()?;
        let ops = Ops::new(&device, KernelSet::Default)?;
        let slots = &ops.slots;
        assert!(slots.gemm.kernel.is_none() && slots.attention_prefill.kernel.is_none());
        assert!(slots.matmul.kernel.is_some() && slots.attention_step.kernel.is_some());
        Ok(())
    }

    /// Fusion rules follow the backend's capabilities: none on the CPU,
    /// where fusion does not pay, every one when asked for all.
    #[test]
    fn fusion_rules_follow_capabilities() -> Result<()> {
        let ops = Ops::new(&Device::cpu()?, KernelSet::Default)?;
        assert!(!ops.device().capabilities().fusion_pays);
        assert!(ops.fusion_patterns().is_empty());
        let all = ops.all_fusion_patterns().len();
        let exact = Ops::new(&Device::cpu()?, KernelSet::Exact)?;
        assert!(
            all > exact.all_fusion_patterns().len(),
            "exact leaves out attention_step"
        );
        Ok(())
    }

    /// Ops built for some weight types refuse a product of another type
    /// with an error naming both, and compute the types they were built for.
    #[test]
    fn products_of_a_type_left_out_are_refused() -> Result<()> {
        let device = Device::cpu()?;
        let ops = Ops::for_weight_types(
            &device,
            KernelSet::Default,
            WeightTypes::of([DType::F32, DType::Q4_K]),
        )?;
        let (n, k) = (4, 256);
        let x = device.buffer_from(&vec![0.5f32; k])?;
        let y = device.alloc(n * 4)?;
        let weight = |dtype: DType, bytes: usize| -> Result<Weight> {
            Ok(Weight {
                buffer: device.buffer_from(&vec![0x11u8; bytes])?,
                dtype,
                n,
                k,
            })
        };
        let q6 = weight(DType::Q6_K, n * 210)?;
        let mut enc = device.encoder();
        let err = ops
            .matmul(&mut enc, &q6, &x, &y, 1, "head")
            .expect_err("a Q6_K product on ops built for F32 and Q4_K");
        let text = err.to_string();
        assert!(
            text.contains("Q6_K") && text.contains("F32, Q4_K"),
            "{text}"
        );
        let err = ops.matmul_rows(&mut enc, &q6, &x, &y, 1, false, "head");
        assert!(err.is_err(), "the paged product refuses it too");
        let q4 = weight(DType::Q4_K, n * 144)?;
        ops.matmul(&mut enc, &q4, &x, &y, 1, "ffn")?;
        enc.commit()?.wait()?;
        Ok(())
    }
}
