//! [`Ops`]: the kernels loaded on one device, and one method per operation
//! that encodes a dispatch with exactly the byte ranges it reads and writes.
//!
//! Launch geometry is the CUDA kernels' (each kernel file states its
//! layout); the CPU bodies ignore it, so one geometry serves every backend.
//! Shapes that a kernel cannot handle are rejected here, before dispatch,
//! with the same rule on every backend.

use encore::graph::passes::FusionPattern;
use encore::{Arg, BackendKind, Buffer, Device, Encoder, Error, Kernel, Launch, Result};

use crate::kernels::{
    advance, argmax, attention, attention_exact, attention_step, elementwise, embed, fused, gemm,
    matmul, norm, prefill_attention, rope,
};
use crate::DType;

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

/// One block per row.
fn per_row(rows: usize, block: u32) -> Launch {
    Launch::new(rows.max(1) as u32, block)
}

/// One thread per element.
fn per_element(n: usize, block: u32) -> Launch {
    Launch::cover(n as u32, block)
}

fn invalid(kernel: &str, label: &str, reason: String) -> Error {
    Error::InvalidDispatch {
        kernel: kernel.to_string(),
        label: label.to_string(),
        reason,
    }
}

/// Every operation's kernel, loaded on one device.
pub struct Ops {
    device: Device,
    /// Whether the exact kernels were loaded ([`encore::Config::exact`]).
    exact: bool,
    rms_norm: Kernel,
    matmul: Kernel,
    gemm: Kernel,
    rope: Kernel,
    kv_store: Kernel,
    attention: Kernel,
    attention_prefill: Kernel,
    add: Kernel,
    add_rows: Kernel,
    silu_mul: Kernel,
    embed: Kernel,
    argmax: Kernel,
    advance: Kernel,
    fused_matmul: Kernel,
    rope_store: Kernel,
    attention_step: Kernel,
}

impl Ops {
    /// Loads (compiling where needed) every kernel on `device`, in the
    /// exact versions when the device's [`encore::Config::exact`] asks for
    /// them.
    pub fn new(device: &Device) -> Result<Ops> {
        let load = |def| device.load_kernel(&def);
        let exact = device.config().exact;
        Ok(Ops {
            device: device.clone(),
            exact,
            rms_norm: load(norm::def())?,
            matmul: load(matmul::def(exact))?,
            gemm: load(gemm::def())?,
            rope: load(rope::def())?,
            kv_store: load(attention::kv_store_def())?,
            attention: load(if exact {
                attention_exact::def()
            } else {
                attention::attention_def()
            })?,
            attention_prefill: load(prefill_attention::def())?,
            add: load(elementwise::add_def())?,
            add_rows: load(elementwise::add_rows_def())?,
            silu_mul: load(elementwise::silu_mul_def())?,
            embed: load(embed::def())?,
            argmax: load(argmax::def())?,
            advance: load(advance::def())?,
            fused_matmul: load(fused::def(exact))?,
            rope_store: load(rope::rope_store_def())?,
            attention_step: load(attention_step::def())?,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether these are the exact kernels ([`encore::Config::exact`]),
    /// which give the CPU's results bit for bit on every backend.
    pub fn exact(&self) -> bool {
        self.exact
    }

    /// Steps of a self-feeding decode loop worth running in one graph
    /// replay on this device: [`Ops::steps_per_replay_on`] its kind.
    pub fn steps_per_replay(&self) -> usize {
        Self::steps_per_replay_on(self.device.kind())
    }

    /// Steps of a self-feeding decode loop worth running in one graph
    /// replay on a device of `kind`. On CUDA the steps inside one replay
    /// start early behind one another, which a replay boundary (the end of
    /// one graph, two events, the start of the next) prevents: synthetic
    /// SmolLM2 on an H200, µs a token on the wall with 2, 4 and 8 steps a
    /// replay: 332.2–332.8, 331.6–332.1, 331.6–331.8. On the CPU a boundary
    /// costs nothing measurable, and a longer program only takes longer to
    /// instantiate.
    pub fn steps_per_replay_on(kind: encore::BackendKind) -> usize {
        match kind {
            encore::BackendKind::Cpu => 2,
            _ => 4,
        }
    }

    /// The fusion rules worth applying on this device, for graph
    /// instantiation: every rule of [`crate::fusion`] on CUDA, where each
    /// dispatch costs a launch; none on the CPU, where a fused body runs the
    /// products of Q, K and V (or gate and up) one after another instead of
    /// as one concurrent group, which measured slower (SmolLM2 decode, 2
    /// threads: 90 tok/s fused against 106 unfused).
    pub fn fusion_patterns(&self) -> Vec<FusionPattern> {
        match self.device.kind() {
            encore::BackendKind::Cpu => Vec::new(),
            _ => self.all_fusion_patterns(),
        }
    }

    /// Every fusion rule, whatever the device (the CPU bodies of the fused
    /// kernels give the unfused results bit for bit, which tests rely on).
    pub fn all_fusion_patterns(&self) -> Vec<FusionPattern> {
        let attention_step = (!self.exact).then_some(&self.attention_step);
        crate::fusion::patterns(&self.fused_matmul, &self.rope_store, attention_step)
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
        let shape = norm::NormShape {
            rows: rows as u32,
            dim: dim as u32,
            eps,
        };
        enc.dispatch(
            &self.rms_norm,
            &[
                Arg::read(&f32s(x, rows * dim)?),
                Arg::read(&f32s(w, dim)?),
                Arg::write(&f32s(y, rows * dim)?),
                Arg::value(&shape),
            ],
            per_row(rows, norm::CUDA_BLOCK),
            "rms_norm",
        )
    }

    /// `y[rows, n] = x[rows, k] · wᵀ`. On CUDA, from
    /// [`gemm::GEMM_MIN_ROWS`] rows on, the tiled tensor-core kernel of
    /// [`gemm`] computes it (activations rounded to f16 or split into bf16
    /// parts, see there), except with the exact kernels; fewer rows, and
    /// every row count on the CPU, take [`matmul`].
    pub fn matmul(
        &self,
        enc: &mut Encoder,
        w: &Weight,
        x: &Buffer,
        y: &Buffer,
        rows: usize,
        label: &'static str,
    ) -> Result<()> {
        let shape = matmul::MatmulShape {
            rows: rows as u32,
            n: w.n as u32,
            k: w.k as u32,
            dtype: w.dtype.ggml_id(),
        };
        let (x, y) = (f32s(x, rows * w.k)?, f32s(y, rows * w.n)?);
        let args = [
            Arg::read(&w.buffer),
            Arg::read(&x),
            Arg::write(&y),
            Arg::value(&shape),
        ];
        if rows >= gemm::GEMM_MIN_ROWS && self.device.kind() == BackendKind::Cuda && !self.exact {
            let launch = Launch::grid3(
                [
                    (w.n as u32).div_ceil(gemm::CUDA_TILE_COLUMNS).max(1),
                    (rows as u32).div_ceil(gemm::CUDA_TILE_ROWS),
                    1,
                ],
                [gemm::cuda_threads(w.dtype), 1, 1],
            )
            .with_shared(gemm::cuda_shared_bytes(w.dtype));
            return enc.dispatch(&self.gemm, &args, launch, label);
        }
        enc.dispatch(
            &self.matmul,
            &args,
            matmul::cuda_launch(matmul::cuda_warps(rows as u32, w.n as u32)),
            label,
        )
    }

    /// Rotates `rows` rows of `heads` heads in place, positions from `pos`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        enc: &mut Encoder,
        x: &Buffer,
        pos: &Buffer,
        rows: usize,
        heads: usize,
        head_dim: usize,
        rope_dim: usize,
        base: f32,
        neox: bool,
        label: &'static str,
    ) -> Result<()> {
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(invalid(
                "rope",
                label,
                format!("rope_dim {rope_dim} must be even and at most head_dim {head_dim}"),
            ));
        }
        let shape = rope::RopeShape {
            rows: rows as u32,
            heads: heads as u32,
            head_dim: head_dim as u32,
            rope_dim: rope_dim as u32,
            base,
            neox: neox as u32,
            theta_scale: rope::theta_scale(base, rope_dim),
        };
        enc.dispatch(
            &self.rope,
            &[
                Arg::read_write(&f32s(x, rows * heads * head_dim)?),
                Arg::read(pos),
                Arg::value(&shape),
            ],
            per_element(rows * heads * (rope_dim / 2), rope::CUDA_BLOCK),
            label,
        )
    }

    /// Stores `rows` rows of `src` into an f16 cache at the position parameter.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        enc: &mut Encoder,
        src: &Buffer,
        cache: &Buffer,
        pos: &Buffer,
        rows: usize,
        kv_dim: usize,
        max_seq: usize,
        label: &'static str,
    ) -> Result<()> {
        let shape = attention::KvShape {
            rows: rows as u32,
            kv_dim: kv_dim as u32,
            max_seq: max_seq as u32,
        };
        enc.dispatch(
            &self.kv_store,
            &[
                Arg::read(&f32s(src, rows * kv_dim)?),
                Arg::write(cache),
                Arg::read(pos),
                Arg::value(&shape),
            ],
            per_element(rows * kv_dim, attention::CUDA_KV_STORE_BLOCK),
            label,
        )
    }

    /// Causal grouped-query attention of `rows` queries over the cache. On
    /// CUDA, batches of [`prefill_attention::PREFILL_MIN_ROWS`] rows or more
    /// with a head size of [`prefill_attention::HEAD_DIMS`] and 16-byte
    /// aligned caches take the tiled kernel of [`prefill_attention`]; the
    /// exact kernels take [`attention_exact`] for every batch.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        enc: &mut Encoder,
        q: &Buffer,
        k: &Buffer,
        v: &Buffer,
        pos: &Buffer,
        out: &Buffer,
        shape: attention::AttnShape,
    ) -> Result<()> {
        let (heads, kv_heads, head_dim) = (shape.heads, shape.kv_heads, shape.head_dim);
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(invalid(
                "attention",
                "attention",
                format!("{heads} heads do not divide into {kv_heads} KV heads"),
            ));
        }
        if head_dim as usize > attention::MAX_HEAD_DIM {
            return Err(invalid(
                "attention",
                "attention",
                format!("head size {head_dim} above {}", attention::MAX_HEAD_DIM),
            ));
        }
        let n = (shape.rows * shape.heads * shape.head_dim) as usize;
        let (q, out) = (f32s(q, n)?, f32s(out, n)?);
        let args = [
            Arg::read(&q),
            Arg::read(k),
            Arg::read(v),
            Arg::read(pos),
            Arg::write(&out),
            Arg::value(&shape),
        ];
        if self.exact {
            return enc.dispatch(
                &self.attention,
                &args,
                attention_exact::cuda_launch(&shape),
                "attention",
            );
        }
        if shape.rows as usize >= prefill_attention::PREFILL_MIN_ROWS
            && self.device.kind() == BackendKind::Cuda
            && prefill_attention::HEAD_DIMS.contains(&head_dim)
            && k.offset().is_multiple_of(16)
            && v.offset().is_multiple_of(16)
        {
            let launch = Launch::grid3(
                [
                    heads,
                    shape.rows.div_ceil(prefill_attention::CUDA_QUERY_ROWS),
                    1,
                ],
                [prefill_attention::CUDA_THREADS, 1, 1],
            )
            .with_shared(prefill_attention::cuda_shared_bytes(head_dim));
            return enc.dispatch(&self.attention_prefill, &args, launch, "attention");
        }
        enc.dispatch(
            &self.attention,
            &args,
            Launch::grid3(
                [shape.heads.max(1), shape.rows.max(1), 1],
                [attention::CUDA_ATTENTION_THREADS, 1, 1],
            )
            .with_shared(attention::attention_shared_bytes(shape.max_seq)),
            "attention",
        )
    }

    /// `y += x` over `n` elements.
    pub fn add(&self, enc: &mut Encoder, y: &Buffer, x: &Buffer, n: usize) -> Result<()> {
        enc.dispatch(
            &self.add,
            &[
                Arg::read_write(&f32s(y, n)?),
                Arg::read(&f32s(x, n)?),
                Arg::value(&(n as u32)),
            ],
            per_element(n, elementwise::CUDA_BLOCK),
            "add",
        )
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
        enc.dispatch(
            &self.add_rows,
            &[
                Arg::read_write(&f32s(y, rows * n)?),
                Arg::read(&f32s(b, n)?),
                Arg::value(&[rows as u32, n as u32]),
            ],
            per_element(rows * n, elementwise::CUDA_BLOCK),
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
        enc.dispatch(
            &self.silu_mul,
            &[
                Arg::read(&f32s(g, n)?),
                Arg::read(&f32s(u, n)?),
                Arg::write(&f32s(y, n)?),
                Arg::value(&(n as u32)),
            ],
            per_element(n, elementwise::CUDA_BLOCK),
            "silu_mul",
        )
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
        let shape = embed::EmbedShape {
            rows: rows as u32,
            dim: table.k as u32,
            vocab: table.n as u32,
            dtype: table.dtype.ggml_id(),
        };
        enc.dispatch(
            &self.embed,
            &[
                Arg::read(&table.buffer),
                Arg::read(&tokens.view(0, rows * 4)?),
                Arg::write(&f32s(y, rows * table.k)?),
                Arg::value(&shape),
            ],
            per_row(rows, embed::CUDA_BLOCK),
            "embed",
        )
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
        enc.dispatch(
            &self.argmax,
            &[
                Arg::read(&f32s(x, n)?),
                Arg::read_write(&out.view(0, argmax::OUT_BYTES)?),
                Arg::value(&(n as u32)),
            ],
            argmax::cuda_launch(n as u32),
            "argmax",
        )
    }

    /// A buffer for [`Ops::argmax`]'s result: [`argmax::OUT_BYTES`] bytes,
    /// zeroed, the index in the first four.
    pub fn argmax_buffer(&self) -> Result<Buffer> {
        self.device.buffer_from(&[0u32; argmax::OUT_BYTES / 4])
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
        enc.dispatch(
            &self.advance,
            &[
                Arg::read(&next.view(0, 4)?),
                Arg::write(&token.view(0, 4)?),
                Arg::read_write(&pos.view(0, 4)?),
                Arg::write(&history.view(0, cap * 4)?),
                Arg::value(&(cap as u32)),
            ],
            Launch::new(1, 32),
            "advance",
        )
    }
}
