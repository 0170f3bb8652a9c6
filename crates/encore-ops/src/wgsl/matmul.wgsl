// `matmul`: `y[r, j] = sum_i w[j, i] x[r, i]`, weights of any type of
// quant.wgsl, multiplied dequantized with f32 activations.
//
// Arguments: `w: dtype[n, k]` (read, GGUF blocks), `x: f32[rows, k]`
// (read), `y: f32[rows, n]` (write), `MatmulShape` (value: rows, n, k, the
// weights' ggml type id).
//
// A workgroup computes `MATMUL_COLS` output columns (weight rows) for a
// tile of up to `MATMUL_TILE` activation rows: `MATMUL_LANES` invocations a
// column walk its weight row eight weights at a time, decode each eight once
// and multiply them with every row of the tile, so weights are read once per
// tile of rows rather than once per row. The lanes' sums meet in workgroup
// memory, through subgroups where the device has them (lanes.wgsl).
// Workgroups go tile of rows fastest, so the tiles that share a
// column's weights run together and find them in cache.
//
// From `MATMUL_GEMM_ROWS` activation rows on (and rows a whole number of
// 32-element steps long), a workgroup instead computes a tile of 32 output
// columns by 32 activation rows (`gemm_tile`): per step of 32 elements it
// dequantizes the weights' 32 by 32 into workgroup memory once (one
// `decode8` an invocation), stages the activations' 32 by 32 beside them,
// and each invocation sums a 2-column by 4-row block out of both, so each
// weight is decoded once per 32 rows and each activation read once per 32
// columns. The tiles hold f32, or f16 on devices with f16 arithmetic
// (gemm_stage.wgsl); there an activation row with a value beyond f16's
// range (real models have such rows) is marked as it is staged and its
// outputs computed apart as f32 dot products (`wide_dot`). `MATMUL_COLS`, `MATMUL_LANES`, `MATMUL_TILE` and `MATMUL_GEMM_ROWS` come from
// Rust, prepended to the source (`wgsl/mod.rs`), which launches the
// workgroups of either path.

// #include "quant.wgsl"
// #include "lanes.wgsl"
// #include "gemm_stage.wgsl"

struct MatmulShape {
    rows: u32,
    n: u32,
    k: u32,
    dtype: u32,
}

struct Args {
    off: array<u32, 16>,
    s: MatmulShape,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

fn weight_word(sel: u32, i: u32) -> u32 {
    return w[i];
}

// The shape: in a variant specialized for one, the constant `SHAPE`
// (`SPECIALIZED` and `SHAPE` come from Rust, prepended to the source), so
// the driver's compiler folds the weight type's branches and the tile's
// loops; else the dispatch's value.
fn shape() -> MatmulShape {
    if SPECIALIZED {
        return SHAPE;
    }
    return args.s;
}

const MATMUL_THREADS: u32 = MATMUL_COLS * MATMUL_LANES;
// `gemm_tile` lays its 32 by 32 tile over exactly this many invocations.
const_assert MATMUL_THREADS == 128u;

// Each invocation's partial sums, by tile row.
var<workgroup> partial: array<f32, MATMUL_TILE * MATMUL_THREADS>;

// The tiled path's weights and activations for one step, element-major:
// `gemm_w[kk][c]` pairs of columns, `gemm_x[kk][r]` fours of rows.
var<workgroup> gemm_w: array<vec2<stage>, 512>;
var<workgroup> gemm_x: array<vec4<stage>, 256>;
// Which of the tile's activation rows hold a value beyond the stage's range.
var<workgroup> wide_rows: array<atomic<u32>, 32>;

// Whether a launch takes the tiled path (as `matmul_launch` in Rust decides).
fn use_gemm(s: MatmulShape) -> bool {
    return s.rows >= MATMUL_GEMM_ROWS && s.k % 32u == 0u;
}

// The largest finite f16.
const F16_MAX: f32 = 65504.0;

// Output `j` of activation row `r` as one f32 dot product of the
// dequantized weight row with the activations: for the rows the f16 tiles
// cannot hold.
fn wide_dot(s: MatmulShape, j: u32, r: u32) -> f32 {
    let row = 4u * args.off[0] + j * row_bytes(s.dtype, s.k);
    let a0 = args.off[1] + r * s.k;
    var sum = 0.0;
    for (var e = 0u; e < s.k; e += 8u) {
        let q = decode8(0u, row, e, s.dtype);
        let a = a0 + e;
        sum += dot(q.d * q.lo + q.m, vec4<f32>(x[a], x[a + 1u], x[a + 2u], x[a + 3u]));
        sum += dot(q.d * q.hi + q.m, vec4<f32>(x[a + 4u], x[a + 5u], x[a + 6u], x[a + 7u]));
    }
    return sum;
}

// The 32-column by 32-row tile `group` of the output (rows fastest).
fn gemm_tile(s: MatmulShape, lid: u32, group: u32) {
    let row_tiles = (s.rows + 31u) / 32u;
    let c0 = (group / row_tiles) * 32u;
    if c0 >= s.n {
        return;
    }
    let r0 = (group % row_tiles) * 32u;
    let k = s.k;
    // What this invocation loads: weight column `lc` elements `8 lu ..`
    // of the step, activation row `lc` the same elements (a column or row
    // past the end repeats the last; its sums are not stored).
    let lc = lid / 4u;
    let lu = lid % 4u;
    let row = 4u * args.off[0] + min(c0 + lc, s.n - 1u) * row_bytes(s.dtype, k);
    let xrow = args.off[1] + min(r0 + lc, s.rows - 1u) * k;
    // What it sums: columns `2 tc, 2 tc + 1` and rows `4 tr .. 4 tr + 4`.
    let tc = lid % 16u;
    let tr = lid / 16u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    if STAGE_NARROW && lid < 32u {
        atomicStore(&wide_rows[lid], 0u);
    }
    workgroupBarrier();
    for (var k0 = 0u; k0 < k; k0 += 32u) {
        let e = k0 + 8u * lu;
        let q = decode8(0u, row, e, s.dtype);
        let wlo = q.d * q.lo + q.m;
        let whi = q.d * q.hi + q.m;
        let a = xrow + e;
        let half = lc % 2u;
        let quad = lc % 4u;
        let wi = 8u * lu * 16u + lc / 2u;
        let xi = 8u * lu * 8u + lc / 4u;
        var largest = 0.0;
        for (var t = 0u; t < 4u; t++) {
            gemm_w[wi + 16u * t][half] = to_stage(wlo[t]);
            gemm_w[wi + 16u * (t + 4u)][half] = to_stage(whi[t]);
            gemm_x[xi + 8u * t][quad] = to_stage(x[a + t]);
            gemm_x[xi + 8u * (t + 4u)][quad] = to_stage(x[a + 4u + t]);
            largest = max(largest, max(abs(x[a + t]), abs(x[a + 4u + t])));
        }
        if STAGE_NARROW && largest > F16_MAX {
            atomicStore(&wide_rows[lc], 1u);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 32u; kk++) {
            let wv = vec2<f32>(gemm_w[kk * 16u + tc]);
            let xv = vec4<f32>(gemm_x[kk * 8u + tr]);
            acc0 += wv.x * xv;
            acc1 += wv.y * xv;
        }
        workgroupBarrier();
    }
    let j = c0 + 2u * tc;
    for (var i = 0u; i < 4u; i++) {
        let r = r0 + 4u * tr + i;
        if r < s.rows {
            let out = args.off[2] + r * s.n + j;
            let wide = STAGE_NARROW && atomicLoad(&wide_rows[4u * tr + i]) != 0u;
            if j < s.n {
                y[out] = acc0[i];
                if wide {
                    y[out] = wide_dot(s, j, r);
                }
            }
            if j + 1u < s.n {
                y[out + 1u] = acc1[i];
                if wide {
                    y[out + 1u] = wide_dot(s, j + 1u, r);
                }
            }
        }
    }
}

@compute @workgroup_size(MATMUL_THREADS)
fn matmul(
    ids: Lanes,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let s = shape();
    if use_gemm(s) {
        gemm_tile(s, ids.lid, wid.y * groups.x + wid.x);
        return;
    }
    let row_tiles = (s.rows + MATMUL_TILE - 1u) / MATMUL_TILE;
    let group = wid.y * groups.x + wid.x;
    let col_tile = group / max(row_tiles, 1u);
    if s.rows == 0u || col_tile * MATMUL_COLS >= s.n {
        return;
    }
    let r0 = (group % row_tiles) * MATMUL_TILE;
    let nr = min(MATMUL_TILE, s.rows - r0);
    let k = s.k;
    let at = column_lane(ids);
    let lane = at.y;
    // A column past `n` repeats the last one; its sum is not stored.
    let j = min(col_tile * MATMUL_COLS + at.x, s.n - 1u);
    let row = 4u * args.off[0] + j * row_bytes(s.dtype, k);
    let xt = args.off[1] + r0 * k;

    var acc: array<f32, MATMUL_TILE>;
    for (var u = lane; u < k / 8u; u += MATMUL_LANES) {
        let e = 8u * u;
        let q = decode8(0u, row, e, s.dtype);
        for (var r = 0u; r < MATMUL_TILE; r++) {
            if r < nr {
                let a = xt + r * k + e;
                let x0 = vec4<f32>(x[a], x[a + 1u], x[a + 2u], x[a + 3u]);
                let x1 = vec4<f32>(x[a + 4u], x[a + 5u], x[a + 6u], x[a + 7u]);
                acc[r] += q.d * (dot(q.lo, x0) + dot(q.hi, x1)) + q.m * dot(x0 + x1, vec4<f32>(1.0));
            }
        }
    }
    // Float rows whose length is not a multiple of 8: the last elements.
    for (var e = (k & ~7u) + lane; e < k; e += MATMUL_LANES) {
        let v = float_at(0u, row, e, s.dtype);
        for (var r = 0u; r < MATMUL_TILE; r++) {
            if r < nr {
                acc[r] += v * x[xt + r * k + e];
            }
        }
    }

    // The tile's rows only (`nr` is the same for the whole workgroup, so
    // the lanes' subgroup sums stay in uniform control flow).
    for (var r = 0u; r < MATMUL_TILE; r++) {
        if r < nr {
            let part = lane_part(ids, acc[r]);
            if stores_part(ids) {
                partial[r * MATMUL_THREADS + part_slot(ids)] = part;
            }
        }
    }
    workgroupBarrier();
    // Invocation (c, r) sums column c's parts for tile row r.
    let lid = ids.lid;
    if lid < MATMUL_COLS * MATMUL_TILE {
        let c = lid / MATMUL_TILE;
        let r = lid % MATMUL_TILE;
        let jc = col_tile * MATMUL_COLS + c;
        if r < nr && jc < s.n {
            let base = r * MATMUL_THREADS + c * MATMUL_LANES;
            var sum = 0.0;
            for (var l = 0u; l < column_parts(ids); l++) {
                sum += partial[base + l];
            }
            y[args.off[2] + (r0 + r) * s.n + jc] = sum;
        }
    }
}
