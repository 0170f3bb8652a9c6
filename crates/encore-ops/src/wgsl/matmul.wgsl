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
// memory. Workgroups go tile of rows fastest, so the tiles that share a
// column's weights run together and find them in cache. `MATMUL_COLS` and
// `MATMUL_TILE` come from Rust, prepended to the source (`wgsl/mod.rs`).

// #include "quant.wgsl"

struct Args {
    off: array<u32, 16>,
    rows: u32,
    n: u32,
    k: u32,
    dtype: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

fn weight_word(sel: u32, i: u32) -> u32 {
    return w[i];
}

const MATMUL_LANES: u32 = 32u;
const MATMUL_THREADS: u32 = MATMUL_COLS * MATMUL_LANES;

// Each invocation's partial sums, by tile row.
var<workgroup> partial: array<f32, MATMUL_TILE * MATMUL_THREADS>;

@compute @workgroup_size(MATMUL_THREADS)
fn matmul(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let row_tiles = (args.rows + MATMUL_TILE - 1u) / MATMUL_TILE;
    let group = wid.y * groups.x + wid.x;
    let col_tile = group / max(row_tiles, 1u);
    if args.rows == 0u || col_tile * MATMUL_COLS >= args.n {
        return;
    }
    let r0 = (group % row_tiles) * MATMUL_TILE;
    let nr = min(MATMUL_TILE, args.rows - r0);
    let k = args.k;
    let lane = lid % MATMUL_LANES;
    // A column past `n` repeats the last one; its sum is not stored.
    let j = min(col_tile * MATMUL_COLS + lid / MATMUL_LANES, args.n - 1u);
    let row = 4u * args.off[0] + j * row_bytes(args.dtype, k);
    let xt = args.off[1] + r0 * k;

    var acc: array<f32, MATMUL_TILE>;
    for (var u = lane; u < k / 8u; u += MATMUL_LANES) {
        let e = 8u * u;
        let q = decode8(0u, row, e, args.dtype);
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
        let v = float_at(0u, row, e, args.dtype);
        for (var r = 0u; r < MATMUL_TILE; r++) {
            if r < nr {
                acc[r] += v * x[xt + r * k + e];
            }
        }
    }

    for (var r = 0u; r < MATMUL_TILE; r++) {
        partial[r * MATMUL_THREADS + lid] = acc[r];
    }
    workgroupBarrier();
    // Invocation (c, r) sums column c's lanes for tile row r.
    if lid < MATMUL_COLS * MATMUL_TILE {
        let c = lid / MATMUL_TILE;
        let r = lid % MATMUL_TILE;
        let jc = col_tile * MATMUL_COLS + c;
        if r < nr && jc < args.n {
            let base = r * MATMUL_THREADS + c * MATMUL_LANES;
            var s = 0.0;
            for (var l = 0u; l < MATMUL_LANES; l++) {
                s += partial[base + l];
            }
            y[args.off[2] + (r0 + r) * args.n + jc] = s;
        }
    }
}
