//! How each CUDA kernel is launched: threads a block, the grid, dynamic
//! shared memory. The constants a kernel's source needs as well reach it as
//! `#define` lines put before the source (the `*_defines` functions), so
//! each is written once, here. Only CUDA launches on a grid: the CPU
//! computes no geometry.

use crate::kernels::gemm_dense::DENSE_TILE;
use encore::Launch;

use crate::kernels::attention::AttnShape;
use crate::kernels::fused::{FusedShape, EPILOGUE_SWIGLU};
use crate::kernels::paged::PagedAttnShape;
use crate::DType;

/// Threads a block of `rms_norm`.
pub const RMS_NORM_BLOCK: u32 = 256;

/// `rms_norm` over `rows` rows: a block a row.
pub fn rms_norm_launch(rows: u32) -> Launch {
    Launch::new(rows.max(1), RMS_NORM_BLOCK)
}

/// Warps a block of `matmul` and of the exact `fused_matmul`: four a block
/// were faster for decode-shaped products on f32 activations than two or
/// eight (and for output heads on 8-bit ones than eight or sixteen).
pub const MATMUL_WARPS_PER_BLOCK: u32 = 4;

/// Output columns a warp of `fused_matmul` computes for one activation row
/// (`MM_COLS` in its source). More columns a warp load the activations
/// fewer times and make each product faster in a chain of identical
/// products, but the decode step slower (fewer, longer warps).
pub const FUSED_COLUMNS_PER_WARP: u32 = 1;

/// Output columns a warp of `matmul` computes for one activation row of a
/// product at least [`MATMUL_WIDE_MIN_COLUMNS`] wide (`MM_COLS` in its
/// source), one in narrower ones. An output head's warps, tens of thousands
/// of them, keep more weight bytes in flight with two columns each; a
/// narrow product needs every warp it can get.
pub const MATMUL_COLUMNS_PER_WARP: u32 = 2;

/// The narrowest `matmul` whose warps take [`MATMUL_COLUMNS_PER_WARP`]
/// columns for one activation row (`MM_WIDE_N`): the output heads of large
/// vocabularies (Qwen2.5's 151,936 columns, Gemma 3's 262,144) gained;
/// SmolLM2's 49,152 keeps the one column a warp it was tuned with, and the
/// layers' products are far narrower.
pub const MATMUL_WIDE_MIN_COLUMNS: u32 = 65_536;

/// The warps of a product of `rows` activation rows and `n` output columns:
/// `columns` (a kernel's columns a warp) for one row, else one.
fn product_warps(rows: u32, n: u32, columns: u32) -> u32 {
    if rows == 1 {
        n.div_ceil(columns)
    } else {
        n
    }
}

/// The warps of a `matmul` of `rows` activation rows and `n` output columns.
pub fn matmul_warps(rows: u32, n: u32) -> u32 {
    let columns = if n >= MATMUL_WIDE_MIN_COLUMNS {
        MATMUL_COLUMNS_PER_WARP
    } else {
        1
    };
    product_warps(rows, n, columns)
}

/// `matmul` run by `warps` warps, [`MATMUL_WARPS_PER_BLOCK`] a block, with
/// `shared` bytes of dynamic shared memory ([`matmul_shared_bytes`]).
pub fn matmul_launch(warps: u32, shared: u32) -> Launch {
    Launch::new(
        warps.div_ceil(MATMUL_WARPS_PER_BLOCK).max(1),
        32 * MATMUL_WARPS_PER_BLOCK,
    )
    .with_shared(shared)
}

/// The longest row whose activations a block of `matmul` or `fused_matmul`
/// quantizes to 8 bits (`Q8X_MAX_K`): the down products of Qwen2.5-32B
/// (27,648 inputs) and Llama-3.3-70B (28,672) fit, and the codes and scales
/// stay within the 48 KiB a launch gets without opting in.
pub const EIGHT_BIT_MAX_K: u32 = 32_768;

/// Weight types whose decode products take 8-bit activations in blocks of
/// 32 (`q8_activations` in quant_dots_fast.cuh).
const EIGHT_BIT_BLOCK_TYPES: [DType; 4] = [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q8_0];

/// Super-block weight types whose decode products take 8-bit activations
/// (`k8_activations` in quant_dots_k8.cuh).
const EIGHT_BIT_SUPER_TYPES: [DType; 2] = [DType::Q4_K, DType::Q6_K];

/// Whether a one-row product over rows of `k` of weights of the ggml types
/// `types` (all of them) quantizes its input to 8 bits once a block: in
/// blocks of 32 where `blocks` allows it, or as super-blocks.
fn eight_bit_types(types: &[u32], k: u32, blocks: bool) -> bool {
    let all = |set: &[DType]| {
        types
            .iter()
            .all(|&t| DType::from_ggml_id(t).is_some_and(|d| set.contains(&d)))
    };
    k <= EIGHT_BIT_MAX_K
        && ((blocks && k.is_multiple_of(32) && all(&EIGHT_BIT_BLOCK_TYPES))
            || (k.is_multiple_of(256) && all(&EIGHT_BIT_SUPER_TYPES)))
}

/// Dynamic shared memory that holds a row of `k` 8-bit activations: the
/// codes, then an f32 scale per 32. The kernels decide from the shape, as
/// this module does, and stop with a device error where a launch that
/// takes the 8-bit products gives them less (`x8_require_shared`).
fn eight_bit_shared_bytes(k: u32) -> u32 {
    k + k / 32 * 4
}

/// Dynamic shared memory of a `matmul`: an output head's 8-bit activations
/// (`eight_bit_types`) in the default version, else none.
pub fn matmul_shared_bytes(rows: u32, n: u32, k: u32, dtype: u32, exact: bool) -> u32 {
    if !exact && rows == 1 && n >= MATMUL_WIDE_MIN_COLUMNS && eight_bit_types(&[dtype], k, true) {
        eight_bit_shared_bytes(k)
    } else {
        0
    }
}

/// Most rows `matmul_rows`, `argmax_rows` and `attention_step_paged` take:
/// the grid's y (and z) dimension.
const MAX_GRID_Y: u32 = 65_535;

/// `matmul_rows` over `rows` rows: the one-row grid of `n` columns, once a
/// row along the grid's y.
pub fn matmul_rows_launch(rows: u32, n: u32, shared: u32) -> Result<Launch, String> {
    if rows > MAX_GRID_Y {
        return Err(format!(
            "matmul_rows takes at most {MAX_GRID_Y} rows a dispatch (got {rows})"
        ));
    }
    let one = matmul_launch(matmul_warps(1, n), shared);
    Ok(Launch::grid3([one.grid[0], rows.max(1), 1], one.block).with_shared(shared))
}

/// Warps of one block that share a column of a decode `fused_matmul` over
/// long rows, each taking a run of its row (`MM_SPLIT`): with few columns
/// and long rows, one warp a column leaves too few loads in flight. On
/// Qwen2.5's down products (rows of 4864) two gained over four and eight,
/// which spend more of the product meeting in shared memory.
pub const FUSED_SPLIT_WARPS: u32 = 2;

/// Warps a block of the default `fused_matmul` (the exact one keeps
/// [`MATMUL_WARPS_PER_BLOCK`]). A decode product on 8-bit activations
/// quantizes its input once a block, so eight warps halve that work (and
/// the input's reads) against four; sixteen were slower.
pub const FUSED_WARPS_PER_BLOCK: u32 = 8;

/// Columns a block of a split `fused_matmul` takes ([`fused_split`] warps
/// each): two, rather than the four that [`FUSED_WARPS_PER_BLOCK`] warps
/// would hold, or one.
pub const FUSED_SPLIT_COLUMNS_PER_BLOCK: u32 = 2;

/// Most warps a block of `fused_matmul` has (`MM_THREADS / 32` in its
/// source, which sizes its shared arrays and launch bounds; the kernel reads
/// a launch's own size from `blockDim`).
fn fused_max_warps(exact: bool) -> u32 {
    if exact {
        MATMUL_WARPS_PER_BLOCK
    } else {
        FUSED_WARPS_PER_BLOCK
    }
}

/// The shortest rows whose columns [`FUSED_SPLIT_WARPS`] warps share
/// (`MM_SPLIT_MIN_K`). Qwen2.5's down products (rows of 4864) gained;
/// SmolLM2's rows of 1536 were slower two warps a column, the warps'
/// meeting costing more than their shorter runs saved.
pub const FUSED_SPLIT_MIN_K: u32 = 2048;

/// Warps that share each column of a `fused_matmul` of `shape`: one
/// activation row over rows of at least [`FUSED_SPLIT_MIN_K`] elements
/// splits each column among [`FUSED_SPLIT_WARPS`] warps, except in the
/// exact version, whose sums keep the CPU's order (as `fused_split` in
/// fused_matmul.cuh computes it).
pub fn fused_split(shape: &FusedShape, exact: bool) -> u32 {
    if !exact && shape.rows == 1 && shape.k >= FUSED_SPLIT_MIN_K && !fused_eight_bit(shape, exact) {
        FUSED_SPLIT_WARPS
    } else {
        1
    }
}

/// Fewest output columns from which a one-row product of weights in blocks
/// of 32 over rows long enough to split ([`FUSED_SPLIT_MIN_K`]) takes 8-bit
/// activations all the same: such a product never splits a column, so it
/// needs columns enough to give every multiprocessor its blocks (a 0.5B
/// model's down product, 896 columns, is faster split on f32 activations).
pub const EIGHT_BIT_BLOCKS_MIN_COLUMNS: u32 = 2048;

/// Whether a decode `fused_matmul` of `shape` quantizes its input to 8 bits
/// once a block (`eight_bit_types` of every weight, and the up weight's in
/// the SwiGLU epilogue): weights in blocks of 32 over rows too short to
/// split or in products of [`EIGHT_BIT_BLOCKS_MIN_COLUMNS`] columns, and
/// super-blocks over any row (such a product never splits: a block's warps
/// share its activations). Never in the exact version.
pub fn fused_eight_bit(shape: &FusedShape, exact: bool) -> bool {
    let mut types = shape.dtype[..(shape.weights as usize).min(3)].to_vec();
    if shape.epilogue == EPILOGUE_SWIGLU {
        types.push(shape.dtype[1]);
    }
    let blocks = shape.k < FUSED_SPLIT_MIN_K || shape.columns() >= EIGHT_BIT_BLOCKS_MIN_COLUMNS;
    !exact && shape.rows == 1 && eight_bit_types(&types, shape.k, blocks)
}

/// `MM_Q8`, whether a kernel's one-row products of weights in blocks of 32,
/// Q4_K and Q6_K ([`fused_eight_bit`], [`matmul_shared_bytes`]) quantize
/// their input to 8 bits once a block and multiply it with `dp4a`
/// (quant_dots_fast.cuh, quant_dots_k8.cuh): in the default version, where a decode step's
/// products were bound by the instructions each weight cost; never in the
/// exact one, which keeps the CPU's arithmetic.
fn eight_bit_activations(exact: bool) -> String {
    u32::from(!exact).to_string()
}

/// The defines of `fused_matmul`: `MM_THREADS` (its largest block),
/// `MM_COLS` ([`FUSED_COLUMNS_PER_WARP`]), `MM_SPLIT` and `MM_SPLIT_MIN_K`
/// ([`fused_split`]), `MM_Q8` ([`eight_bit_activations`]).
pub(crate) fn fused_matmul_defines(exact: bool) -> Vec<(&'static str, String)> {
    let split = if exact { 1 } else { FUSED_SPLIT_WARPS };
    let mut defines = vec![
        ("MM_THREADS", (32 * fused_max_warps(exact)).to_string()),
        ("MM_COLS", FUSED_COLUMNS_PER_WARP.to_string()),
    ];
    defines.extend([
        ("MM_SPLIT", format!("{split}u")),
        ("MM_SPLIT_MIN_K", format!("{FUSED_SPLIT_MIN_K}u")),
        (
            "MM_Q8_MIN_COLUMNS",
            format!("{EIGHT_BIT_BLOCKS_MIN_COLUMNS}u"),
        ),
        ("MM_Q8", eight_bit_activations(exact)),
        ("Q8X_MAX_K", format!("{EIGHT_BIT_MAX_K}u")),
    ]);
    defines
}

/// The warps of a `fused_matmul` of `shape`: each weight's columns,
/// [`FUSED_COLUMNS_PER_WARP`] a warp for one row and one for more (the
/// gate's alone in the SwiGLU epilogue, whose warps compute gate and up
/// together), times the warps that share a column ([`fused_split`]).
pub fn fused_matmul_warps(shape: &FusedShape, exact: bool) -> u32 {
    let split = fused_split(shape, exact);
    let warps = |n| product_warps(shape.rows, n, FUSED_COLUMNS_PER_WARP) * split;
    if shape.epilogue == EPILOGUE_SWIGLU {
        warps(shape.n[0])
    } else {
        shape
            .n
            .iter()
            .take(shape.weights as usize)
            .map(|&n| warps(n))
            .sum()
    }
}

/// Warps a block of a `fused_matmul` of `shape`: the warps of
/// [`FUSED_SPLIT_COLUMNS_PER_BLOCK`] columns of a split product (the exact
/// version never splits), else the version's largest block.
pub fn fused_block_warps(shape: &FusedShape, exact: bool) -> u32 {
    match fused_split(shape, exact) {
        1 => fused_max_warps(exact),
        split => split * FUSED_SPLIT_COLUMNS_PER_BLOCK,
    }
}

/// `fused_matmul` of `shape`.
pub fn fused_matmul_launch(shape: &FusedShape, exact: bool) -> Launch {
    let block = fused_block_warps(shape, exact);
    let shared = if fused_eight_bit(shape, exact) {
        eight_bit_shared_bytes(shape.k)
    } else {
        0
    };
    Launch::new(
        fused_matmul_warps(shape, exact).div_ceil(block).max(1),
        32 * block,
    )
    .with_shared(shared)
}

/// `fused_matmul_rows` of `shape`: the one-row grid, once a row along the
/// grid's y.
pub fn fused_matmul_rows_launch(shape: &FusedShape, exact: bool) -> Result<Launch, String> {
    if shape.rows > MAX_GRID_Y {
        return Err(format!(
            "fused_matmul_rows takes at most {MAX_GRID_Y} rows a dispatch (got {})",
            shape.rows
        ));
    }
    let one = fused_matmul_launch(&FusedShape { rows: 1, ..*shape }, exact);
    Ok(Launch::grid3([one.grid[0], shape.rows.max(1), 1], one.block).with_shared(one.shared_bytes))
}

/// The defines of `matmul`: `MM_THREADS` (threads a block), `MM_COLS`
/// ([`MATMUL_COLUMNS_PER_WARP`]), `MM_WIDE_N` ([`MATMUL_WIDE_MIN_COLUMNS`])
/// and `MM_Q8` ([`eight_bit_activations`]; output heads only).
pub(crate) fn matmul_defines(exact: bool) -> Vec<(&'static str, String)> {
    let mut defines = product_defines(MATMUL_COLUMNS_PER_WARP);
    defines.push(("MM_WIDE_N", format!("{MATMUL_WIDE_MIN_COLUMNS}u")));
    defines.push(("MM_Q8", eight_bit_activations(exact)));
    defines.push(("Q8X_MAX_K", format!("{EIGHT_BIT_MAX_K}u")));
    defines
}

fn product_defines(columns: u32) -> Vec<(&'static str, String)> {
    vec![
        ("MM_THREADS", (32 * MATMUL_WARPS_PER_BLOCK).to_string()),
        ("MM_COLS", columns.to_string()),
    ]
}

/// Activation rows a block of `gemm` takes (`GM_BM`).
pub const GEMM_TILE_ROWS: u32 = 64;

/// Output columns (weight rows) a block of `gemm` takes (`GM_BN`).
pub const GEMM_TILE_COLUMNS: u32 = 64;

/// 16-bit elements a row of a `gemm` tile in shared memory (`GM_PITCH`): a
/// GGUF block of 32 and 8 of padding, so that `ldmatrix` reads the tile
/// without bank conflicts.
const GEMM_TILE_PITCH: u32 = 40;

/// Threads of a `gemm` warp group, four warps each owning a 32 x 32 corner
/// of the tile (`GM_THREADS`).
const GEMM_GROUP_THREADS: u32 = 128;

/// Warp groups a block of `gemm` takes at most (`GM_MAX_GROUPS`).
const GEMM_MAX_GROUPS: u32 = 4;

/// Rows (`k`) from which a narrow `gemm` takes [`GEMM_MAX_GROUPS`] warp
/// groups a block.
const GEMM_DEEP_MIN_K: u32 = 2048;

/// Outputs (`n`) up to which a `gemm` counts as narrow: 32 tiles of 64
/// columns, a fourth of an H100's or H200's 132 multiprocessors for each
/// tile of 64 activation rows.
const GEMM_DEEP_MAX_N: u32 = 32 * GEMM_TILE_COLUMNS;

/// Warp groups a block of `gemm` of `n` outputs over rows of `k` takes:
/// each group takes one GGUF block of 32 positions of every step, so G
/// groups divide the steps by G. BF16 and F32 weights, whose tiles take two
/// parts, keep one group within the 48 KiB of shared memory a launch gets
/// without opting in; other types take two, and four for long rows and few
/// outputs (a feed-forward down product of a small model: Qwen2.5-0.5B's
/// 896 outputs, rows of 4864, are 14 tiles a row of tiles, 112 for a
/// 512-row prompt), which puts twice the warps on each multiprocessor the
/// grid reaches and halves its walk along `k`. The choice depends on the
/// weights' shape alone, never on the activation rows: each row's sums are
/// then the same whatever rows share its product (a prompt split into
/// chunks, a serving step's rows).
fn gemm_warp_groups(dtype: DType, n: u32, k: u32) -> u32 {
    match dtype {
        DType::BF16 | DType::F32 => 1,
        _ if k >= GEMM_DEEP_MIN_K && n <= GEMM_DEEP_MAX_N => GEMM_MAX_GROUPS,
        _ => 2,
    }
}

/// Dynamic shared memory of one `gemm` block for weights of `dtype` and
/// `groups` warp groups: per stage (two) and warp group, the activation
/// tile (one or two 16-bit parts), the weight tile (one or two parts), and
/// the per-column scales and minimums and per-row activation sums; then,
/// once, a mark per activation row and one for the tile. Must match `GemmSmem` in `gemm.cu`. At the end the groups but the first
/// write their sums into the same memory, which holds them: 16 KiB a group.
fn gemm_shared_bytes(dtype: DType, groups: u32) -> u32 {
    let (a_parts, b_parts) = match dtype {
        DType::BF16 => (2, 1),
        DType::F32 => (2, 2),
        _ => (1, 1),
    };
    let tiles = (a_parts * GEMM_TILE_ROWS + b_parts * GEMM_TILE_COLUMNS) * GEMM_TILE_PITCH * 2;
    let vectors = (2 * GEMM_TILE_COLUMNS + GEMM_TILE_ROWS) * 4;
    let stages = 2 * groups * (tiles + vectors);
    let sums = (groups - 1) * 32 * GEMM_GROUP_THREADS * 4;
    debug_assert!(sums <= stages, "gemm: the groups' sums outgrow the stages");
    // Which activation rows are beyond f16's range, and whether any is.
    stages + (GEMM_TILE_ROWS + 1) * 4
}

/// `gemm` of `rows` activation rows and `n` output columns over rows of
/// `k`: a block a tile.
pub fn gemm_launch(rows: u32, n: u32, k: u32, dtype: DType) -> Launch {
    let groups = gemm_warp_groups(dtype, n, k);
    Launch::grid3(
        [
            n.div_ceil(GEMM_TILE_COLUMNS).max(1),
            rows.div_ceil(GEMM_TILE_ROWS),
            1,
        ],
        [GEMM_GROUP_THREADS * groups, 1, 1],
    )
    .with_shared(gemm_shared_bytes(dtype, groups))
}

/// The defines of `gemm`: the tile shape and a warp group's threads.
pub(crate) fn gemm_defines() -> Vec<(&'static str, String)> {
    vec![
        ("GM_BM", GEMM_TILE_ROWS.to_string()),
        ("GM_BN", GEMM_TILE_COLUMNS.to_string()),
        ("GM_PITCH", GEMM_TILE_PITCH.to_string()),
        ("GM_THREADS", GEMM_GROUP_THREADS.to_string()),
        ("GM_MAX_GROUPS", GEMM_MAX_GROUPS.to_string()),
    ]
}

/// Warps of a `gemm_f16` block along the activation rows and along the
/// weight rows (`GF_WARPS_M`, `GF_WARPS_N`), each owning 64 x 64 outputs:
/// tiles of [`DENSE_TILE`] both ways.
const GEMM_F16_WARPS: [u32; 2] = [DENSE_TILE as u32 / 64, DENSE_TILE as u32 / 64];

/// Positions a step of `gemm_f16` (`GF_BK`, 32 or 64): eight 16-byte
/// chunks a tile row, 128 `mma` a warp between two barriers.
const GEMM_F16_STEP: u32 = 64;

/// Steps of `gemm_f16` in flight (`GF_STAGES`): 96 KiB of shared memory
/// a block, two blocks a multiprocessor.
const GEMM_F16_STAGES: u32 = 3;

/// `gemm_f16` of `rows` activation rows by `n` weight rows in `splits`
/// runs of `k`: a block a tile and run, along the rows first (blocks
/// sharing weights run together), the stages' tiles in dynamic shared
/// memory.
pub fn gemm_f16_launch(rows: u32, n: u32, splits: u32) -> Launch {
    let [wm, wn] = GEMM_F16_WARPS;
    Launch::grid3(
        [
            rows.div_ceil(64 * wm).max(1),
            n.div_ceil(64 * wn).max(1),
            splits.max(1),
        ],
        [32 * wm * wn, 1, 1],
    )
    .with_shared(GEMM_F16_STAGES * 64 * (wm + wn) * GEMM_F16_STEP * 2)
}

/// The defines of `gemm_f16`.
pub(crate) fn gemm_f16_defines() -> Vec<(&'static str, String)> {
    vec![
        ("GF_WARPS_M", GEMM_F16_WARPS[0].to_string()),
        ("GF_WARPS_N", GEMM_F16_WARPS[1].to_string()),
        ("GF_BK", GEMM_F16_STEP.to_string()),
        ("GF_STAGES", GEMM_F16_STAGES.to_string()),
    ]
}

/// Threads a block of `sum_splits`, a thread an output.
const SUM_SPLITS_BLOCK: u32 = 256;

/// `sum_splits` of `outputs` outputs.
pub fn sum_splits_launch(outputs: u64) -> Launch {
    let blocks = outputs
        .div_ceil(u64::from(SUM_SPLITS_BLOCK))
        .clamp(1, 65535);
    Launch::new(blocks as u32, SUM_SPLITS_BLOCK)
}

/// Threads a block of `to_f16_rows` (a block a row).
const TO_F16_BLOCK: u32 = 256;

/// `to_f16_rows` of `rows` rows.
pub fn to_f16_rows_launch(rows: u32) -> Launch {
    Launch::new(rows.max(1), TO_F16_BLOCK)
}

/// Threads a block of `dequant_f16`, each eight weights at a time.
const DEQUANT_BLOCK: u32 = 256;

/// Blocks of `dequant_f16` at most (a grid-stride loop covers the rest).
const DEQUANT_MAX_BLOCKS: u32 = 4096;

/// `dequant_f16` of `weights` weights.
pub fn dequant_f16_launch(weights: u64) -> Launch {
    let groups = weights.div_ceil(8);
    let blocks = groups
        .div_ceil(u64::from(DEQUANT_BLOCK))
        .clamp(1, u64::from(DEQUANT_MAX_BLOCKS));
    Launch::new(blocks as u32, DEQUANT_BLOCK)
}

/// Columns a block of `matmul_wide_rows` takes (`WR_COLS` in its source).
const WIDE_ROWS_COLUMNS: u32 = 64;

/// Threads a block of `matmul_wide_rows`: a warp a column at a time.
const WIDE_ROWS_BLOCK: u32 = 256;

/// The defines of `matmul_wide_rows`.
pub(crate) fn matmul_wide_rows_defines() -> Vec<(&'static str, String)> {
    vec![("WR_COLS", WIDE_ROWS_COLUMNS.to_string())]
}

/// `matmul_wide_rows` over `n` output columns.
pub fn matmul_wide_rows_launch(n: u32) -> Launch {
    Launch::new(n.div_ceil(WIDE_ROWS_COLUMNS).max(1), WIDE_ROWS_BLOCK)
}

/// Threads a block of `rope` and `rope_store`.
pub const ROPE_BLOCK: u32 = 128;

/// `rope` or `rope_store` over `pairs` element pairs: a thread a pair.
pub fn rope_launch(pairs: u32) -> Launch {
    Launch::cover(pairs, ROPE_BLOCK)
}

/// Threads a block of `kv_store`.
pub const KV_STORE_BLOCK: u32 = 256;

/// `kv_store` of `elements` values: a thread a value.
pub fn kv_store_launch(elements: u32) -> Launch {
    Launch::cover(elements, KV_STORE_BLOCK)
}

/// Threads a block of `attention` (`ATT_THREADS`).
pub const ATTENTION_THREADS: u32 = 256;

/// Positions whose scores `attention` keeps in shared memory (32 KiB,
/// which with the kernel's 10 KiB of fixed shared memory stays under the
/// 48 KiB a block gets without opting in); longer contexts recompute scores.
const ATTENTION_CACHED_SCORES: u32 = 8192;

/// Dynamic shared memory of an `attention` block over a cache of `max_seq`.
pub fn attention_shared_bytes(max_seq: u32) -> u32 {
    max_seq.min(ATTENTION_CACHED_SCORES) * 4
}

/// `attention` for `shape`: a block per (head, query row).
pub fn attention_launch(shape: &AttnShape) -> Launch {
    Launch::grid3(
        [shape.heads.max(1), shape.rows.max(1), 1],
        [ATTENTION_THREADS, 1, 1],
    )
    .with_shared(attention_shared_bytes(shape.max_seq))
}

/// `attention_paged` for `shape`: a block per (head, row), scores of up to
/// a block's worth of positions in shared memory, as `attention`.
pub fn attention_paged_launch(shape: &PagedAttnShape) -> Launch {
    Launch::grid3(
        [shape.heads.max(1), shape.rows.max(1), 1],
        [ATTENTION_THREADS, 1, 1],
    )
    .with_shared(attention_shared_bytes(
        shape.max_blocks.saturating_mul(shape.block_size),
    ))
}

/// The defines of `attention`.
pub(crate) fn attention_defines() -> Vec<(&'static str, String)> {
    vec![("ATT_THREADS", ATTENTION_THREADS.to_string())]
}

/// Threads a block of `attention_exact` (`EXA_THREADS`).
pub const ATTENTION_EXACT_THREADS: u32 = 256;

/// `attention_exact` for `shape`: a block per (head, query row), no dynamic
/// shared memory.
pub fn attention_exact_launch(shape: &AttnShape) -> Launch {
    Launch::grid3(
        [shape.heads.max(1), shape.rows.max(1), 1],
        [ATTENTION_EXACT_THREADS, 1, 1],
    )
}

/// The defines of `attention_exact` that are launch geometry.
pub(crate) fn attention_exact_defines() -> Vec<(&'static str, String)> {
    vec![("EXA_THREADS", ATTENTION_EXACT_THREADS.to_string())]
}

/// Blocks (splits of the positions, one thread-block cluster) per query
/// head of `attention_step` (`STEP_SPLITS`).
pub const ATTENTION_STEP_SPLITS: u32 = 8;

/// Threads a block of `attention_step` (`STEP_THREADS`). Eight warps
/// rather than four halve each warp's serial share of the V rows, which
/// long contexts feel most.
pub const ATTENTION_STEP_THREADS: u32 = 256;

/// `attention_step` over `heads` query heads: a cluster of
/// [`ATTENTION_STEP_SPLITS`] blocks a head.
pub fn attention_step_launch(heads: u32) -> Launch {
    Launch::grid3(
        [heads.max(1), ATTENTION_STEP_SPLITS, 1],
        [ATTENTION_STEP_THREADS, 1, 1],
    )
}

/// Threads a block of `attention_step_paged`. A batch's step has a cluster
/// for every (row, head), each block taking a few dozen positions, so
/// smaller blocks, several resident on a multiprocessor, beat one large one.
pub const ATTENTION_STEP_PAGED_THREADS: u32 = 128;

/// Blocks of `attention_step_paged` the compiler keeps room for on one
/// multiprocessor (`STEP_MIN_BLOCKS`, the launch bounds' second number).
pub const ATTENTION_STEP_PAGED_BLOCKS: u32 = 4;

/// `attention_step_paged` over `rows` rows of `heads` query heads: a
/// cluster of [`ATTENTION_STEP_SPLITS`] blocks a (head, row), the row along
/// the grid's z.
pub fn attention_step_paged_launch(heads: u32, rows: u32) -> Result<Launch, String> {
    if rows > MAX_GRID_Y {
        return Err(format!(
            "attention_step_paged takes at most {MAX_GRID_Y} rows a dispatch (got {rows})"
        ));
    }
    Ok(Launch::grid3(
        [heads.max(1), ATTENTION_STEP_SPLITS, rows.max(1)],
        [ATTENTION_STEP_PAGED_THREADS, 1, 1],
    ))
}

/// The defines of `attention_step` that are launch geometry.
pub(crate) fn attention_step_defines() -> Vec<(&'static str, String)> {
    vec![
        ("STEP_THREADS", ATTENTION_STEP_THREADS.to_string()),
        ("STEP_SPLITS", ATTENTION_STEP_SPLITS.to_string()),
        ("STEP_MIN_BLOCKS", "1".to_string()),
    ]
}

/// The defines of `attention_step_paged` that are launch geometry.
pub(crate) fn attention_step_paged_defines() -> Vec<(&'static str, String)> {
    vec![
        ("STEP_THREADS", ATTENTION_STEP_PAGED_THREADS.to_string()),
        ("STEP_SPLITS", ATTENTION_STEP_SPLITS.to_string()),
        ("STEP_MIN_BLOCKS", ATTENTION_STEP_PAGED_BLOCKS.to_string()),
    ]
}

/// Query rows a block of `attention_prefill` takes, 16 a warp (`FA_ROWS`).
pub const PREFILL_QUERY_ROWS: u32 = 64;

/// Cache positions a K and V tile of `attention_prefill` (`FA_KV`).
pub const PREFILL_KV_TILE: u32 = 64;

/// Threads a block of `attention_prefill` (`FA_THREADS`).
pub const PREFILL_THREADS: u32 = 128;

/// Dynamic shared memory of one `attention_prefill` block for heads of
/// `head_dim`: a K tile (which first holds the queries) and a V tile of
/// [`PREFILL_KV_TILE`] rows of `head_dim + 8` halves.
pub fn prefill_attention_shared_bytes(head_dim: u32) -> u32 {
    2 * PREFILL_KV_TILE * (head_dim + 8) * 2
}

/// `attention_prefill` for `shape`: a block per head and
/// [`PREFILL_QUERY_ROWS`] query rows.
pub fn prefill_attention_launch(shape: &AttnShape) -> Launch {
    Launch::grid3(
        [shape.heads, shape.rows.div_ceil(PREFILL_QUERY_ROWS), 1],
        [PREFILL_THREADS, 1, 1],
    )
    .with_shared(prefill_attention_shared_bytes(shape.head_dim))
}

/// The defines of `attention_prefill`.
pub(crate) fn prefill_attention_defines() -> Vec<(&'static str, String)> {
    vec![
        ("FA_ROWS", PREFILL_QUERY_ROWS.to_string()),
        ("FA_KV", PREFILL_KV_TILE.to_string()),
        ("FA_THREADS", PREFILL_THREADS.to_string()),
    ]
}

/// Threads a block of `add`, `add_rows` and `silu_mul`, which cover their
/// elements with a grid-stride loop.
pub const ELEMENTWISE_BLOCK: u32 = 256;

/// `add`, `add_rows` or `silu_mul` over `n` elements: a thread an element.
pub fn elementwise_launch(n: u32) -> Launch {
    Launch::cover(n, ELEMENTWISE_BLOCK)
}

/// Threads a block of `embed`.
pub const EMBED_BLOCK: u32 = 256;

/// `embed` of `rows` tokens: a block a token.
pub fn embed_launch(rows: u32) -> Launch {
    Launch::new(rows.max(1), EMBED_BLOCK)
}

/// Threads a block of `argmax`.
pub const ARGMAX_BLOCK: u32 = 256;

/// Values a thread of `argmax` takes (`4 * ARGMAX_LOADS` in the source).
pub const ARGMAX_PER_THREAD: u32 = 16;

/// `argmax` over `n` values.
pub fn argmax_launch(n: u32) -> Launch {
    Launch::new(
        n.div_ceil(ARGMAX_BLOCK * ARGMAX_PER_THREAD).max(1),
        ARGMAX_BLOCK,
    )
}

/// `argmax_rows` over `rows` rows of `n` values: `argmax`'s grid for one
/// row, once a row along the grid's y.
pub fn argmax_rows_launch(rows: u32, n: u32) -> Result<Launch, String> {
    if rows > MAX_GRID_Y {
        return Err(format!(
            "argmax_rows takes at most {MAX_GRID_Y} rows a dispatch (got {rows})"
        ));
    }
    let one = argmax_launch(n);
    Ok(Launch::grid3([one.grid[0], rows.max(1), 1], one.block))
}

/// The defines of `argmax`: `ARGMAX_LOADS`, four values a load.
pub(crate) fn argmax_defines() -> Vec<(&'static str, String)> {
    vec![("ARGMAX_LOADS", (ARGMAX_PER_THREAD / 4).to_string())]
}

/// `advance`: one warp, of which one thread works.
pub fn advance_launch() -> Launch {
    Launch::new(1, 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every define the Rust side prepends is written nowhere in the CUDA
    /// files, so the constant has one value.
    #[test]
    fn prepended_defines_are_defined_only_here() {
        let defines = [
            matmul_defines(false),
            matmul_defines(true),
            fused_matmul_defines(false),
            fused_matmul_defines(true),
            gemm_defines(),
            attention_defines(),
            attention_exact_defines(),
            attention_step_defines(),
            attention_step_paged_defines(),
            prefill_attention_defines(),
            argmax_defines(),
        ]
        .concat();
        let sets = [crate::KernelSet::Default, crate::KernelSet::Exact];
        let defs: Vec<_> = sets.into_iter().flat_map(|s| s.defs().all()).collect();
        for (name, value) in defines {
            let line = format!("#define {name} {value}\n");
            let users: Vec<_> = defs
                .iter()
                .filter_map(|d| d.cuda_impl())
                .filter(|c| c.source.contains(&line))
                .collect();
            assert!(!users.is_empty(), "no kernel takes {name}");
            for cuda in users {
                assert_eq!(
                    cuda.source.matches(&format!("#define {name} ")).count(),
                    1,
                    "{name} in {}",
                    cuda.entry
                );
            }
        }
    }

    /// The launches agree with the kernels on the work a thread and a warp take.
    #[test]
    fn launches_cover_the_work() {
        assert_eq!(matmul_launch(9, 0).block[0], 32 * MATMUL_WARPS_PER_BLOCK);
        assert_eq!(matmul_warps(1, 9), 9);
        let wide = MATMUL_WIDE_MIN_COLUMNS + 1;
        assert_eq!(
            matmul_warps(1, wide),
            wide.div_ceil(MATMUL_COLUMNS_PER_WARP)
        );
        assert_eq!(matmul_warps(3, wide), wide);
        assert_eq!(matmul_warps(3, 9), 9);
        assert_eq!(
            matmul_launch(9, 0).grid[0],
            9u32.div_ceil(MATMUL_WARPS_PER_BLOCK)
        );
        for exact in [false, true] {
            for (rows, k, n) in [
                (1u32, 896u32, 4864u32),
                (1, 4864, 896),
                (1, 4864, 7),
                (5, 4864, 896),
            ] {
                let shape = FusedShape {
                    rows,
                    k,
                    n: [n, 0, 0],
                    dtype: [DType::Q4_K.ggml_id(); 3],
                    weights: 1,
                    epilogue: 0,
                    norm: 0,
                    eps: 0.0,
                    bias: 0,
                };
                let launch = fused_matmul_launch(&shape, exact);
                let warps = launch.block[0] / 32;
                assert!(warps <= fused_max_warps(exact), "{shape:?}");
                assert_eq!(warps % fused_split(&shape, exact), 0, "{shape:?}");
                assert!(launch.grid[0] * warps >= fused_matmul_warps(&shape, exact));
            }
        }
        for n in [1u32, 4096, 4097, 49152, 100_003] {
            let launch = argmax_launch(n);
            assert!(
                launch.grid[0] * launch.block[0] * ARGMAX_PER_THREAD >= n,
                "n {n}"
            );
            assert_eq!(launch.block[0], ARGMAX_BLOCK);
        }
    }
}
