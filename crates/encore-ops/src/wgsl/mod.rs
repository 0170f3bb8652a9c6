//! The wgpu backend of the kernels: one `.wgsl` file per kernel entry point
//! and headers for what several kernels share, all in this folder, and one
//! function per kernel that turns its file into the kernel's
//! [`WgpuKernel`] implementation, its launch (workgroup counts) computed
//! from the dispatch's value.
//!
//! WGSL has no preprocessor: a kernel names the headers it needs with
//! `// #include "name.wgsl"` lines, which `source` expands. Every kernel
//! follows the runtime's binding convention (see [`WgpuKernel`]): buffer
//! argument `i` at `@group(0) @binding(i)`, indexed from `args.off[i]`, and
//! the value's fields after `off` in `@group(1) @binding(0)`.
//!
//! In graphs, `matmul`, `fused_matmul` and `attention_step` run variants
//! with their value compiled in as WGSL constants (`shape_constants`,
//! [`encore::KernelDef::wgpu_variants`]); every kernel here is compiled
//! without naga's loop bounding (`finite`).
//!
//! `rope.wgsl` and `kv_store.wgsl` serve both position sources: the
//! constant `POSITION_ROWS`, prepended to the source (`with_positions`),
//! says where a row's position or slot comes from.

use encore::{Launch, WgpuKernel, WgslFeatures};

use crate::kernels::attention::{AttnShape, KvShape, MAX_HEAD_DIM};
use crate::kernels::attention_step::{
    AttnStepShape, STEP_K_NEW, STEP_ROPE_K, STEP_ROPE_Q, STEP_V_NEW,
};
use crate::kernels::elementwise::ScaleShape;
use crate::kernels::embed::EmbedShape;
use crate::kernels::fused::{FusedShape, EPILOGUE_ACCUMULATE, EPILOGUE_STORE, EPILOGUE_SWIGLU};
use crate::kernels::matmul::MatmulShape;
use crate::kernels::norm::NormShape;
use crate::kernels::positions::PositionSource;
use crate::kernels::prefill_attention::check_head_dim;
use crate::kernels::rope::{RopeShape, RopeStoreShape};
use crate::DType;

/// The most workgroups a grid dimension may hold (WebGPU's default limit).
pub const MAX_WORKGROUPS: u32 = 65_535;

/// A launch of `groups` workgroups in one dimension, folded into a second
/// when they exceed [`MAX_WORKGROUPS`]; kernels recover the linear index
/// with `linear_index` (`common.wgsl`) and skip the overhang.
pub fn linear_launch(groups: u32) -> Launch {
    let groups = groups.max(1);
    if groups <= MAX_WORKGROUPS {
        return Launch::new(groups, 1);
    }
    let rows = groups.div_ceil(MAX_WORKGROUPS);
    Launch::grid3([groups.div_ceil(rows), rows, 1], [1, 1, 1])
}

/// A launch of one invocation per element for `n` elements, in workgroups
/// of `size`.
pub fn elementwise_launch(n: u32, size: u32) -> Launch {
    linear_launch(n.div_ceil(size))
}

/// `kernel`, compiled without naga's loop bounding (see
/// [`WgpuKernel::with_finite_loops`]), as every kernel of this folder is.
///
/// Their loops end for every value and buffer contents: each counts up to
/// a bound by a nonzero step, in 32-bit counters that stay below 2^31
/// (bounds are element counts of bound buffers, which wgpu keeps under
/// 4 GiB), halves a nonzero count, or retries a compare-exchange that fails
/// only when another invocation's has succeeded (`argmax.wgsl`).
fn finite(kernel: WgpuKernel) -> WgpuKernel {
    // SAFETY: the loops of this folder's kernels end, as said above.
    unsafe { kernel.with_finite_loops() }
}

pub(crate) fn add() -> WgpuKernel {
    finite(WgpuKernel::new(source("add.wgsl"), "add", |n: &u32| {
        elementwise_launch(*n, 256)
    }))
}

/// The weight types the WGSL kernels (`quant.wgsl`) have code for.
pub const WEIGHT_TYPES: [DType; 15] = DType::ALL;

/// The weight type of ggml id `id`, or why `kernel` refuses it.
fn weight_type(kernel: &str, id: u32) -> Result<DType, String> {
    match DType::from_ggml_id(id) {
        Some(dtype) if WEIGHT_TYPES.contains(&dtype) => Ok(dtype),
        Some(dtype) => Err(format!(
            "{kernel} on wgpu has no code for {dtype} weights (it has for {})",
            WEIGHT_TYPES.map(DType::name).join(", ")
        )),
        None => Err(format!(
            "{kernel} has no code for ggml type {id} ({})",
            crate::dtype::ggml_type_name(id)
        )),
    }
}

/// Invocations a workgroup of `matmul` and `fused_matmul` (`MATMUL_THREADS`
/// there; `gemm_tile` lays its tile over exactly this many).
const MATMUL_THREADS: u32 = 128;

/// Output columns a workgroup of `matmul` and `fused_matmul` computes, each
/// with `MATMUL_THREADS / MATMUL_COLS` lanes: on an H200 through Vulkan, 2
/// columns of 64 lanes decoded faster than 4 of 32 (one row: 835 against
/// 767 tok/s for the default model, BENCHMARKS.md) and 1 of 128 no faster.
const MATMUL_COLS: u32 = 2;

/// Columns a workgroup of a `matmul` variant for few rows and at least
/// [`WIDE_MIN_COLUMNS`] columns (an output head) computes instead, 16 lanes
/// each: with so many columns the device is full either way, and each lane
/// has several weight blocks to read instead of one.
const WIDE_COLS: u32 = 8;
const WIDE_MIN_COLUMNS: u32 = 16_384;
/// Activation rows those workgroups multiply per read of their weights.
const MATMUL_TILE: u32 = 8;

/// From this many activation rows on, `matmul` multiplies tiles of 32
/// output columns by 32 rows (where rows are whole steps of 32 elements).
const MATMUL_GEMM_ROWS: u32 = 32;

/// The constants the products' sources take from Rust, with `tile` rows a
/// workgroup (MATMUL_TILE, or fewer in a variant for fewer rows).
fn matmul_constants(tile: u32, cols: u32) -> String {
    let lanes = MATMUL_THREADS / cols;
    format!(
        "const MATMUL_COLS: u32 = {cols}u;\nconst MATMUL_LANES: u32 = {lanes}u;\n\
         const MATMUL_TILE: u32 = {tile}u;\n\
         const MATMUL_GEMM_ROWS: u32 = {MATMUL_GEMM_ROWS}u;\n\
         const EPILOGUE_STORE: u32 = {EPILOGUE_STORE}u;\n\
         const EPILOGUE_ACCUMULATE: u32 = {EPILOGUE_ACCUMULATE}u;\n\
         const EPILOGUE_SWIGLU: u32 = {EPILOGUE_SWIGLU}u;\n"
    )
}

/// The rows a workgroup of a product's variant for `rows` rows takes: all
/// of them where they are fewer than MATMUL_TILE (one workgroup's rows
/// either way, so the launch is the same), which leaves the decode
/// variants one row's sums and workgroup memory instead of MATMUL_TILE's.
fn variant_tile(rows: u32) -> u32 {
    rows.clamp(1, MATMUL_TILE)
}

/// Workgroups for `columns` output columns of `rows` activation rows, `cols`
/// columns a workgroup.
fn matmul_launch(columns: u32, rows: u32, cols: u32) -> Launch {
    linear_launch(columns.div_ceil(cols) * rows.div_ceil(MATMUL_TILE))
}

/// The header a product's version swaps in for subgroup operations (the
/// lanes' sums) and the one for f16 (the tiles of `gemm_tile`).
const SUBGROUP_HEADER: (&str, &str) = ("lanes.wgsl", include_str!("lanes_subgroups.wgsl"));
const F16_HEADER: (&str, &str) = ("gemm_stage.wgsl", include_str!("gemm_stage_f16.wgsl"));

/// A product's source (`matmul.wgsl` or `fused_matmul.wgsl`) after its
/// constants and those of its `shape` ([`shape_constants`]), with the
/// headers of `swaps` in place of the files of their names; with f16's,
/// `enable f16;` comes first (a directive precedes every declaration).
/// (WGSL's `enable subgroups;` would belong there too, but naga does not
/// take it yet; wgpu enables them with the device feature.)
fn product_source(
    file: &str,
    shape: &str,
    (tile, cols): (u32, u32),
    swaps: &[(&str, &'static str)],
) -> String {
    let files: Vec<(&str, &'static str)> = FILES
        .iter()
        .map(|&(name, text)| {
            swaps
                .iter()
                .copied()
                .find(|s| s.0 == name)
                .unwrap_or((name, text))
        })
        .collect();
    let enable = if swaps.contains(&F16_HEADER) {
        "enable f16;\n"
    } else {
        ""
    };
    enable.to_string()
        + &matmul_constants(tile, cols)
        + shape
        + &crate::include::expand(&files, file, |f| format!("no WGSL file {f};\n"))
}

/// The constants by which a kernel with graph variants (the products,
/// `attention_step`) takes its shape, a WGSL struct `ty`: `SPECIALIZED`
/// and, in a variant specialized for one shape, `SHAPE` built from
/// `fields` (the struct's constructor arguments); unspecialized, a zero
/// `SHAPE` that goes unused. The kernel reads its shape through a function
/// that returns `SHAPE` where `SPECIALIZED`, else the dispatch's value, so
/// the driver's compiler sees a variant's fields as constants.
fn shape_constants(ty: &str, fields: Option<String>) -> String {
    match fields {
        Some(fields) => {
            format!("const SPECIALIZED: bool = true;\nconst SHAPE: {ty} = {ty}({fields});\n")
        }
        None => format!("const SPECIALIZED: bool = false;\nconst SHAPE: {ty} = {ty}();\n"),
    }
}

/// `kernel` (the product `file` for `shape`) with its versions for
/// optional features, most capable first: subgroup operations, and where
/// the file stages tiles (`stages`), f16.
fn with_product_versions(
    kernel: WgpuKernel,
    file: &str,
    shape: &str,
    geometry: (u32, u32),
    stages: bool,
) -> WgpuKernel {
    let subgroups = WgslFeatures {
        subgroups: true,
        f16: false,
    };
    let version = |swaps: &[(&str, &'static str)]| product_source(file, shape, geometry, swaps);
    if !stages {
        return kernel.with_version(subgroups, version(&[SUBGROUP_HEADER]));
    }
    let f16 = WgslFeatures {
        subgroups: false,
        f16: true,
    };
    let both = WgslFeatures {
        subgroups: true,
        f16: true,
    };
    kernel
        .with_version(both, version(&[SUBGROUP_HEADER, F16_HEADER]))
        .with_version(subgroups, version(&[SUBGROUP_HEADER]))
        .with_version(f16, version(&[F16_HEADER]))
}

/// `matmul` for any shape, or specialized for one (`fields`, see
/// [`shape_constants`]), with `tile` rows and `cols` columns a workgroup.
fn matmul_kernel(fields: Option<String>, tile: u32, cols: u32) -> WgpuKernel {
    let shape = shape_constants("MatmulShape", fields);
    let source = product_source("matmul.wgsl", &shape, (tile, cols), &[]);
    let kernel = WgpuKernel::checked(source, "matmul", move |s: &MatmulShape| {
        weight_type("matmul", s.dtype)?;
        if s.rows >= MATMUL_GEMM_ROWS && s.k.is_multiple_of(32) {
            return Ok(linear_launch(s.n.div_ceil(32) * s.rows.div_ceil(32)));
        }
        Ok(matmul_launch(s.n, s.rows, cols))
    });
    finite(with_product_versions(
        kernel,
        "matmul.wgsl",
        &shape,
        (tile, cols),
        true,
    ))
}

pub(crate) fn matmul() -> WgpuKernel {
    matmul_kernel(None, MATMUL_TILE, MATMUL_COLS)
}

/// `matmul` specialized for the value `value` (a [`MatmulShape`]): the
/// graph variant of the `matmul` row of [`crate::registry`] on wgpu.
pub(crate) fn matmul_for(value: &[u8]) -> Option<WgpuKernel> {
    let s: MatmulShape = bytemuck::try_pod_read_unaligned(value).ok()?;
    let fields = format!("{}u, {}u, {}u, {}u", s.rows, s.n, s.k, s.dtype);
    let wide = s.rows < MATMUL_TILE && s.n >= WIDE_MIN_COLUMNS;
    let cols = if wide { WIDE_COLS } else { MATMUL_COLS };
    Some(matmul_kernel(Some(fields), variant_tile(s.rows), cols))
}

/// `fused_matmul` for any shape, or specialized for one (`fields`, see
/// [`shape_constants`]).
fn fused_matmul_kernel(fields: Option<String>, tile: u32) -> WgpuKernel {
    let shape = shape_constants("FusedShape", fields);
    let geometry = (tile, MATMUL_COLS);
    let source = product_source("fused_matmul.wgsl", &shape, geometry, &[]);
    let kernel = WgpuKernel::checked(source, "fused_matmul", |s: &FusedShape| {
        let used = if s.epilogue == EPILOGUE_SWIGLU {
            2
        } else {
            s.weights.min(3)
        };
        for &id in &s.dtype[..used as usize] {
            weight_type("fused_matmul", id)?;
        }
        // Each weight's columns in whole tiles (the SwiGLU epilogue walks
        // the gate's, which the up weight shares).
        let tiles: u32 = if s.epilogue == EPILOGUE_SWIGLU {
            s.n[0].div_ceil(MATMUL_COLS)
        } else {
            s.n[..used as usize]
                .iter()
                .map(|n| n.div_ceil(MATMUL_COLS))
                .sum()
        };
        Ok(linear_launch(tiles * s.rows.div_ceil(MATMUL_TILE)))
    });
    finite(with_product_versions(
        kernel,
        "fused_matmul.wgsl",
        &shape,
        geometry,
        false,
    ))
}

pub(crate) fn fused_matmul() -> WgpuKernel {
    fused_matmul_kernel(None, MATMUL_TILE)
}

/// `fused_matmul` specialized for the value `value` (a [`FusedShape`]): the
/// graph variant of the `fused_matmul` row of [`crate::registry`] on wgpu.
/// `None` for a non-finite `eps`, which has no WGSL literal.
pub(crate) fn fused_matmul_for(value: &[u8]) -> Option<WgpuKernel> {
    let s: FusedShape = bytemuck::try_pod_read_unaligned(value).ok()?;
    if !s.eps.is_finite() {
        return None;
    }
    let three = |a: [u32; 3]| format!("array<u32, 3>({}u, {}u, {}u)", a[0], a[1], a[2]);
    // Rust's shortest representation of an f32 reads back as the same f32.
    let fields = format!(
        "{}u, {}u, {}, {}, {}u, {}u, {}u, {:?}f, {}u",
        s.rows,
        s.k,
        three(s.n),
        three(s.dtype),
        s.weights,
        s.epilogue,
        s.norm,
        s.eps,
        s.bias
    );
    Some(fused_matmul_kernel(Some(fields), variant_tile(s.rows)))
}

pub(crate) fn embed() -> WgpuKernel {
    finite(WgpuKernel::checked(
        source("embed.wgsl"),
        "embed",
        |s: &EmbedShape| {
            weight_type("embed", s.dtype)?;
            Ok(linear_launch(s.rows))
        },
    ))
}

pub(crate) fn add_rows() -> WgpuKernel {
    finite(WgpuKernel::new(
        source("add_rows.wgsl"),
        "add_rows",
        |s: &[u32; 2]| elementwise_launch(s[0].saturating_mul(s[1]), 256),
    ))
}

pub(crate) fn silu_mul() -> WgpuKernel {
    finite(WgpuKernel::new(
        source("silu_mul.wgsl"),
        "silu_mul",
        |n: &u32| elementwise_launch(*n, 256),
    ))
}

pub(crate) fn gelu_mul() -> WgpuKernel {
    finite(WgpuKernel::new(
        source("gelu_mul.wgsl"),
        "gelu_mul",
        |n: &u32| elementwise_launch(*n, 256),
    ))
}

pub(crate) fn scale() -> WgpuKernel {
    finite(WgpuKernel::new(
        source("scale.wgsl"),
        "scale",
        |s: &ScaleShape| elementwise_launch(s.n, 256),
    ))
}

/// One workgroup per row.
pub(crate) fn rms_norm() -> WgpuKernel {
    finite(WgpuKernel::new(
        source("rms_norm.wgsl"),
        "rms_norm",
        |s: &NormShape| linear_launch(s.rows),
    ))
}

/// The constant that selects where a kernel with either [`PositionSource`]
/// (`rope.wgsl`, `kv_store.wgsl`) reads its rows' positions, before its
/// source.
fn with_positions(source: PositionSource, file: &str) -> String {
    let rows = source == PositionSource::Rows;
    format!("const POSITION_ROWS: bool = {rows};\n") + &self::source(file)
}

/// `rope` or, with [`PositionSource::Rows`], `rope_rows`: one invocation
/// per rotated pair.
pub(crate) fn rope(source: PositionSource) -> WgpuKernel {
    finite(WgpuKernel::new(
        with_positions(source, "rope.wgsl"),
        "rope",
        |s: &RopeShape| {
            let pairs = s
                .rows
                .saturating_mul(s.heads)
                .saturating_mul(s.rope_dim / 2);
            elementwise_launch(pairs, 256)
        },
    ))
}

/// Words of the f16 cache that `elements` halves from an unknown position
/// touch: half of them, and one more where the range starts in a word's
/// second half.
fn f16_words(elements: u32) -> u32 {
    elements / 2 + 1
}

/// One invocation per word of the cache.
pub(crate) fn rope_store() -> WgpuKernel {
    finite(WgpuKernel::new(
        source("rope_store.wgsl"),
        "rope_store",
        |s: &RopeStoreShape| {
            let r = s.rope;
            let n = r.rows.saturating_mul(r.heads).saturating_mul(r.head_dim);
            elementwise_launch(f16_words(n), 256)
        },
    ))
}

/// `kv_store` or, with [`PositionSource::Rows`], `kv_store_paged`: one
/// invocation per word of the cache. Rows at their own slots need an even
/// `kv_dim` (each row then starts a word); others are refused at launch.
pub(crate) fn kv_store(source: PositionSource) -> WgpuKernel {
    let code = with_positions(source, "kv_store.wgsl");
    finite(match source {
        PositionSource::Start => WgpuKernel::new(code, "kv_store", |s: &KvShape| {
            elementwise_launch(f16_words(s.rows.saturating_mul(s.kv_dim)), 256)
        }),
        PositionSource::Rows => WgpuKernel::checked(code, "kv_store", |s: &KvShape| {
            if !s.kv_dim.is_multiple_of(2) {
                return Err(format!(
                    "kv_store_paged on wgpu stores rows of an even size (got {})",
                    s.kv_dim
                ));
            }
            Ok(elementwise_launch(s.rows.saturating_mul(s.kv_dim) / 2, 256))
        }),
    })
}

/// One workgroup per (head, query row).
pub(crate) fn attention() -> WgpuKernel {
    finite(WgpuKernel::new(
        source("attention.wgsl"),
        "attention",
        |s: &AttnShape| linear_launch(s.heads.saturating_mul(s.rows)),
    ))
}

/// Query rows a workgroup of `attention_prefill` takes (`FA_ROWS` in
/// `prefill_attention.wgsl`, which lays its invocations over 16).
const PREFILL_QUERY_ROWS: u32 = 16;

/// The head sizes `prefill_attention.wgsl` takes: its tiles of queries and
/// of K and V rows, in f32, fit the 16 KiB of workgroup memory every
/// adapter offers for heads of at most 64. The kernel refuses others at
/// launch, and `Ops::attention` then keeps the general kernel.
pub const PREFILL_HEAD_DIMS: [u32; 3] = [16, 32, 64];

/// One workgroup per (head, tile of [`PREFILL_QUERY_ROWS`] query rows).
pub(crate) fn prefill_attention() -> WgpuKernel {
    finite(WgpuKernel::checked(
        format!(
            "const FA_ROWS: u32 = {PREFILL_QUERY_ROWS}u;\nconst FA_F32_ROWS: u32 = {}u;\n",
            crate::cpu::kernels::attention::FA_TILE_Q
        ) + &source("prefill_attention.wgsl"),
        "attention_prefill",
        |s: &AttnShape| {
            check_head_dim("wgpu", &PREFILL_HEAD_DIMS, s.head_dim)?;
            Ok(linear_launch(
                s.heads.saturating_mul(s.rows.div_ceil(PREFILL_QUERY_ROWS)),
            ))
        },
    ))
}

/// Why `attention_step.wgsl` cannot take `s`, if it cannot: one query row,
/// whole KV groups, a head of 1 to [`MAX_HEAD_DIM`] elements, an even head
/// where a new row is stored (so that it is whole words of the cache), an
/// even `rope_dim` within the head where a rotation is folded, and no
/// frequency factors.
fn attention_step_refusal(s: &AttnStepShape) -> Option<String> {
    let (a, r) = (&s.attn, &s.rope);
    let rotates = s.flags & (STEP_ROPE_Q | STEP_ROPE_K) != 0;
    let stores = s.flags & (STEP_K_NEW | STEP_V_NEW) != 0;
    let why = if a.rows != 1 {
        format!("{} query rows; it takes one", a.rows)
    } else if a.kv_heads == 0 || a.heads % a.kv_heads != 0 {
        format!(
            "{} heads do not divide into {} KV heads",
            a.heads, a.kv_heads
        )
    } else if a.head_dim == 0 || a.head_dim as usize > MAX_HEAD_DIM {
        format!("head size {} outside 1..={MAX_HEAD_DIM}", a.head_dim)
    } else if stores && a.head_dim % 2 != 0 {
        format!("an odd head size {} with a row to store", a.head_dim)
    } else if rotates && (r.rope_dim > a.head_dim || r.rope_dim % 2 != 0) {
        format!(
            "rope_dim {} must be even and at most head_dim {}",
            r.rope_dim, a.head_dim
        )
    } else if rotates && r.factors != 0 {
        "frequency factors, which it does not take".into()
    } else {
        return None;
    };
    Some(format!("attention_step on wgpu: {why}"))
}

/// `attention_step` for any shape, or specialized for one (`fields`, see
/// [`shape_constants`]); one workgroup per query head.
fn attention_step_kernel(fields: Option<String>) -> WgpuKernel {
    let flags = format!(
        "const STEP_ROPE_Q: u32 = {STEP_ROPE_Q}u;\nconst STEP_K_NEW: u32 = {STEP_K_NEW}u;\n\
         const STEP_ROPE_K: u32 = {STEP_ROPE_K}u;\nconst STEP_V_NEW: u32 = {STEP_V_NEW}u;\n"
    );
    let shape = shape_constants("StepShape", fields);
    finite(WgpuKernel::checked(
        flags + &shape + &source("attention_step.wgsl"),
        "attention_step",
        |s: &AttnStepShape| match attention_step_refusal(s) {
            Some(why) => Err(why),
            None => Ok(linear_launch(s.attn.heads)),
        },
    ))
}

pub(crate) fn attention_step() -> WgpuKernel {
    attention_step_kernel(None)
}

/// `attention_step` specialized for the value `value` (an
/// [`AttnStepShape`]): the graph variant of the `attention_step` row of
/// [`crate::registry`] on wgpu. `None` where a float field is not finite
/// (it has no WGSL literal).
pub(crate) fn attention_step_for(value: &[u8]) -> Option<WgpuKernel> {
    let s: AttnStepShape = bytemuck::try_pod_read_unaligned(value).ok()?;
    let (a, r) = (&s.attn, &s.rope);
    if ![a.scale, r.base, r.theta_scale]
        .iter()
        .all(|v| v.is_finite())
    {
        return None;
    }
    // Rust's shortest representation of an f32 reads back as the same f32.
    let attn = format!(
        "AttnShape({}u, {}u, {}u, {}u, {}u, {:?}f, {}u)",
        a.rows, a.heads, a.kv_heads, a.head_dim, a.max_seq, a.scale, a.window
    );
    let rope = format!(
        "RopeShape({}u, {}u, {}u, {}u, {:?}f, {}u, {:?}f, {}u)",
        r.rows, r.heads, r.head_dim, r.rope_dim, r.base, r.neox, r.theta_scale, r.factors
    );
    Some(attention_step_kernel(Some(format!(
        "{attn}, {rope}, {}u",
        s.flags
    ))))
}

/// Values one workgroup of `argmax.wgsl` takes in one round of its loop
/// (`ARGMAX_THREADS * ARGMAX_PER_THREAD` there).
const ARGMAX_ROUND: u32 = 256 * 16;

/// The most workgroups `argmax` merges: past that each loops.
const ARGMAX_GROUPS: u32 = 1024;

/// Enough workgroups for one round over the vector, at most
/// [`ARGMAX_GROUPS`], in one dimension (the kernel counts them).
pub(crate) fn argmax() -> WgpuKernel {
    finite(WgpuKernel::new(
        source("argmax.wgsl"),
        "argmax",
        |n: &u32| Launch::new(n.div_ceil(ARGMAX_ROUND).clamp(1, ARGMAX_GROUPS), 1),
    ))
}

/// One invocation.
pub(crate) fn advance() -> WgpuKernel {
    finite(WgpuKernel::new(
        source("advance.wgsl"),
        "advance",
        |_: &u32| Launch::new(1, 1),
    ))
}

/// Every WGSL file of this folder, by name.
const FILES: &[(&str, &str)] = &[
    // Headers.
    ("common.wgsl", include_str!("common.wgsl")),
    ("attn_shape.wgsl", include_str!("attn_shape.wgsl")),
    (
        "attention_common.wgsl",
        include_str!("attention_common.wgsl"),
    ),
    ("f16.wgsl", include_str!("f16.wgsl")),
    ("gemm_stage.wgsl", include_str!("gemm_stage.wgsl")),
    ("gemm_stage_f16.wgsl", include_str!("gemm_stage_f16.wgsl")),
    ("ggml_exp.wgsl", include_str!("ggml_exp.wgsl")),
    ("lanes.wgsl", include_str!("lanes.wgsl")),
    ("lanes_subgroups.wgsl", include_str!("lanes_subgroups.wgsl")),
    ("quant.wgsl", include_str!("quant.wgsl")),
    ("rope_common.wgsl", include_str!("rope_common.wgsl")),
    // Kernels.
    ("add.wgsl", include_str!("add.wgsl")),
    ("add_rows.wgsl", include_str!("add_rows.wgsl")),
    ("advance.wgsl", include_str!("advance.wgsl")),
    ("argmax.wgsl", include_str!("argmax.wgsl")),
    ("attention.wgsl", include_str!("attention.wgsl")),
    ("attention_step.wgsl", include_str!("attention_step.wgsl")),
    (
        "prefill_attention.wgsl",
        include_str!("prefill_attention.wgsl"),
    ),
    ("embed.wgsl", include_str!("embed.wgsl")),
    ("fused_matmul.wgsl", include_str!("fused_matmul.wgsl")),
    ("gelu_mul.wgsl", include_str!("gelu_mul.wgsl")),
    ("kv_store.wgsl", include_str!("kv_store.wgsl")),
    ("matmul.wgsl", include_str!("matmul.wgsl")),
    ("rms_norm.wgsl", include_str!("rms_norm.wgsl")),
    ("rope.wgsl", include_str!("rope.wgsl")),
    ("rope_store.wgsl", include_str!("rope_store.wgsl")),
    ("scale.wgsl", include_str!("scale.wgsl")),
    ("silu_mul.wgsl", include_str!("silu_mul.wgsl")),
];

/// The text of `file` (a name in this folder) with its `// #include
/// "name.wgsl"` lines expanded (see [`crate::include`]); a file that does
/// not exist becomes a line naga refuses, naming it.
pub(crate) fn source(file: &str) -> String {
    crate::include::expand(FILES, file, |f| format!("no WGSL file {f};\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses and validates `source` with naga, as wgpu will.
    fn validate(name: &str, source: &str) {
        let module = naga::front::wgsl::parse_str(source)
            .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(source)));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(source)));
    }

    /// Every kernel's WGSL, default and exact sets, parses and validates.
    #[test]
    fn every_wgsl_kernel_validates_with_naga() {
        let sets = [crate::KernelSet::Default, crate::KernelSet::Exact];
        let mut seen = 0;
        for def in sets.into_iter().flat_map(|s| s.defs().all()) {
            if let Some(wgsl) = def.wgpu_impl() {
                validate(def.name(), &wgsl.source);
                for (needs, source) in &wgsl.versions {
                    validate(&format!("{} ({needs:?})", def.name()), source);
                }
                seen += 1;
            }
        }
        assert!(seen > 0, "no kernel has WGSL");
    }

    /// The products' graph variants carry their shape as constants, for
    /// every weight type and epilogue, and validate with naga in every
    /// version; a value of another size or a non-finite `eps` gets none.
    #[test]
    fn specialized_products_validate_and_carry_their_shape() {
        let defs = crate::KernelSet::Default.defs();
        let (matmul_def, fused_def) = (defs.matmul, defs.fused_matmul);
        let check = |def: &encore::KernelDef, value: &[u8], constant: &str| {
            let variant = def
                .specialized_for(encore::BackendKind::Wgpu, value)
                .unwrap_or_else(|| panic!("{}: no variant", def.name()));
            let wgsl = variant.wgpu_impl().expect("a WGSL kernel");
            assert_ne!(
                variant.content(encore::BackendKind::Wgpu),
                def.content(encore::BackendKind::Wgpu)
            );
            for source in std::iter::once(&wgsl.source).chain(wgsl.versions.iter().map(|v| &v.1)) {
                assert!(
                    source.contains(constant),
                    "{}: {constant} missing",
                    def.name()
                );
                validate(def.name(), source);
            }
        };
        for dtype in WEIGHT_TYPES.map(DType::ggml_id) {
            for rows in [1, 40] {
                let m = MatmulShape {
                    rows,
                    n: 96,
                    k: 512,
                    dtype,
                };
                let constant = format!("MatmulShape({rows}u, 96u, 512u, {dtype}u)");
                check(&matmul_def, bytemuck::bytes_of(&m), &constant);
            }
            for epilogue in [EPILOGUE_STORE, EPILOGUE_ACCUMULATE, EPILOGUE_SWIGLU] {
                let f = FusedShape {
                    rows: 1,
                    k: 512,
                    n: [64, 32, 32],
                    dtype: [dtype, dtype, DType::Q8_0.ggml_id()],
                    weights: 3,
                    epilogue,
                    norm: 1,
                    eps: 1e-6,
                    bias: 0b101,
                };
                let constant = format!("{epilogue}u, 1u, 1e-6f, 5u)");
                check(&fused_def, bytemuck::bytes_of(&f), &constant);
            }
        }
        let wgpu = encore::BackendKind::Wgpu;
        assert!(matmul_def.specialized_for(wgpu, &[0; 12]).is_none());
        let nan = FusedShape {
            eps: f32::NAN,
            ..bytemuck::Zeroable::zeroed()
        };
        assert!(fused_def
            .specialized_for(wgpu, bytemuck::bytes_of(&nan))
            .is_none());
        // Kernels without WGSL variants get none on wgpu.
        let norm = crate::KernelSet::Default.defs().rms_norm;
        assert!(norm.specialized_for(wgpu, &[0; 16]).is_none());
    }

    /// The weight kernels launch every type of [`WEIGHT_TYPES`] and refuse
    /// another, naming the kernel and the type.
    #[test]
    fn weight_kernels_refuse_types_without_wgsl_code() {
        let kernels = [matmul(), fused_matmul(), embed()];
        let unsupported = 16; // IQ2_XXS
        let ids = WEIGHT_TYPES.map(DType::ggml_id);
        for id in ids.into_iter().chain([unsupported]) {
            let m = MatmulShape {
                rows: 1,
                n: 64,
                k: 256,
                dtype: id,
            };
            let f = FusedShape {
                rows: 1,
                k: 256,
                n: [64, 64, 0],
                dtype: [id, id, 0],
                weights: 2,
                epilogue: EPILOGUE_SWIGLU,
                norm: 0,
                eps: 1e-5,
                bias: 0,
            };
            let e = EmbedShape {
                rows: 1,
                dim: 256,
                vocab: 10,
                dtype: id,
            };
            let values = [
                bytemuck::bytes_of(&m),
                bytemuck::bytes_of(&f),
                bytemuck::bytes_of(&e),
            ];
            for ((kernel, value), name) in
                kernels
                    .iter()
                    .zip(values)
                    .zip(["matmul", "fused_matmul", "embed"])
            {
                let launch = kernel.launch(value);
                if id == unsupported {
                    let reason = launch.expect_err(name);
                    assert!(
                        reason.contains(name) && reason.contains("IQ2_XXS"),
                        "{reason}"
                    );
                } else {
                    assert!(launch.is_ok(), "{name} type {id}: {launch:?}");
                }
            }
        }
    }

    /// `attention_step`'s graph variant carries its shape as constants
    /// and validates; a non-finite float field gets none.
    #[test]
    fn specialized_attention_step_validates_and_carries_its_shape() {
        let Some(def) = crate::KernelSet::Default.defs().attention_step else {
            panic!("the default set has attention_step");
        };
        let wgpu = encore::BackendKind::Wgpu;
        let good = step_shape();
        let variant = def
            .specialized_for(wgpu, bytemuck::bytes_of(&good))
            .expect("a variant");
        let source = &variant.wgpu_impl().expect("WGSL").source;
        assert!(
            source.contains("AttnShape(1u, 9u, 3u, 64u, 128u, 0.125f, 0u)")
                && source.contains("RopeShape(1u, 9u, 64u, 64u, 10000.0f, 0u, 0.75f, 0u)"),
            "{source}"
        );
        validate("attention_step", source);
        let mut inf = good;
        inf.attn.scale = f32::INFINITY;
        assert!(def
            .specialized_for(wgpu, bytemuck::bytes_of(&inf))
            .is_none());
    }

    /// A decode step's shape that `attention_step` takes.
    fn step_shape() -> AttnStepShape {
        AttnStepShape {
            attn: AttnShape {
                rows: 1,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                max_seq: 128,
                scale: 0.125,
                window: 0,
            },
            rope: RopeShape {
                rows: 1,
                heads: 9,
                head_dim: 64,
                rope_dim: 64,
                base: 10_000.0,
                neox: 0,
                theta_scale: 0.75,
                factors: 0,
            },
            flags: STEP_ROPE_Q | STEP_K_NEW | STEP_ROPE_K | STEP_V_NEW,
        }
    }

    /// `attention_step` launches one workgroup per query head and refuses,
    /// by name, the shapes its WGSL has no code for.
    #[test]
    fn attention_step_refuses_shapes_without_wgsl_code() {
        let good = step_shape();
        let kernel = attention_step();
        let launch = kernel.launch(bytemuck::bytes_of(&good));
        assert_eq!(launch.map(|l| l.grid), Ok([9, 1, 1]));
        let mut factors = good;
        factors.rope.factors = 1;
        let mut odd = good;
        odd.attn.head_dim = 63;
        odd.rope.rope_dim = 62;
        let mut rows = good;
        rows.attn.rows = 2;
        let mut wide = good;
        wide.attn.head_dim = 512;
        for (shape, says) in [
            (factors, "factors"),
            (odd, "odd head size"),
            (rows, "query rows"),
            (wide, "head size"),
        ] {
            let reason = kernel.launch(bytemuck::bytes_of(&shape)).expect_err(says);
            assert!(
                reason.contains("attention_step") && reason.contains(says),
                "{reason}"
            );
        }
    }

    /// A missing file is an error naga reports, not a panic.
    #[test]
    fn a_missing_file_fails_to_parse() {
        let text = source("no_such.wgsl");
        assert!(text.contains("no_such.wgsl"));
        assert!(naga::front::wgsl::parse_str(&text).is_err());
    }

    /// Large launches fold into two dimensions that cover every workgroup.
    #[test]
    fn linear_launch_folds_large_grids() {
        for groups in [1, 65_535, 65_536, 200_000, 1 << 24] {
            let l = linear_launch(groups);
            assert!(l.grid[0] <= MAX_WORKGROUPS && l.grid[1] <= MAX_WORKGROUPS);
            assert!(u64::from(l.grid[0]) * u64::from(l.grid[1]) >= u64::from(groups));
        }
    }
}
