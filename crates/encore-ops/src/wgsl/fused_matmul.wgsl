// `fused_matmul`: up to three products of weights that share the input `x`,
// with an optional RMSNorm of `x` first and one epilogue (see
// `kernels/fused.rs`): STORE `y_i = p_i` (plus the bias `b_i` where bit `i`
// of `bias` is set), ACCUMULATE `y_0 += p_0`, SWIGLU `y_0 = silu(p_0) * p_1`.
//
// Arguments: `x: f32[rows, k]`, `g: f32[k]` (empty without norm), `w0, w1,
// w2` (GGUF blocks; empty when unused), `y0, y1, y2: f32[rows, n_i]` (empty
// when unused), `b0, b1, b2: f32[n_i]` (empty where `bias` has no bit),
// `FusedShape` (value).
//
// Workgroups and lanes as `matmul` (matmul.wgsl, lanes.wgsl). The column tiles of the
// weights are laid end to end, so one launch covers Q, K and V, and no tile
// spans two weights; in the SwiGLU epilogue a lane decodes the gate and the
// up weights at the same elements and multiplies both with one load of
// `x`. The norm is folded into the product: each lane multiplies the input
// by `g` and sums its squares, and a column's finished sums are scaled by
// `1 / rms`. `MATMUL_COLS`, `MATMUL_LANES`, `MATMUL_TILE` and the `EPILOGUE_` constants come
// from Rust, prepended to the source (`wgsl/mod.rs`).

// #include "quant.wgsl"
// #include "lanes.wgsl"

struct FusedShape {
    rows: u32,
    k: u32,
    n: array<u32, 3>,
    dtype: array<u32, 3>,
    weights: u32,
    epilogue: u32,
    norm: u32,
    eps: f32,
    bias: u32,
}

struct Args {
    off: array<u32, 16>,
    s: FusedShape,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> g: array<f32>;
@group(0) @binding(2) var<storage, read> w0: array<u32>;
@group(0) @binding(3) var<storage, read> w1: array<u32>;
@group(0) @binding(4) var<storage, read> w2: array<u32>;
@group(0) @binding(5) var<storage, read_write> y0: array<f32>;
@group(0) @binding(6) var<storage, read_write> y1: array<f32>;
@group(0) @binding(7) var<storage, read_write> y2: array<f32>;
@group(0) @binding(8) var<storage, read> b0: array<f32>;
@group(0) @binding(9) var<storage, read> b1: array<f32>;
@group(0) @binding(10) var<storage, read> b2: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

fn weight_word(sel: u32, i: u32) -> u32 {
    switch sel {
        case 0u: { return w0[i]; }
        case 1u: { return w1[i]; }
        default: { return w2[i]; }
    }
}

// The shape: in a variant specialized for one, the constant `SHAPE`
// (`SPECIALIZED` and `SHAPE` come from Rust, prepended to the source), so
// the driver's compiler folds the epilogue's, the norm's and the weight
// types' branches and the tile's loops; else the dispatch's value.
fn shape() -> FusedShape {
    if SPECIALIZED {
        return SHAPE;
    }
    return args.s;
}

// Element `i` of `a`, by constant indices (which a constant `a` folds).
fn pick3(a: array<u32, 3>, i: u32) -> u32 {
    return select(select(a[2], a[1], i == 1u), a[0], i == 0u);
}

const MATMUL_THREADS: u32 = MATMUL_COLS * MATMUL_LANES;

// Each invocation's partial sums by tile row: products of the first and
// the second (SwiGLU's up) weight, and the squares of the input.
var<workgroup> partial: array<f32, MATMUL_TILE * MATMUL_THREADS>;
var<workgroup> partial2: array<f32, MATMUL_TILE * MATMUL_THREADS>;
var<workgroup> squares: array<f32, MATMUL_TILE * MATMUL_THREADS>;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

@compute @workgroup_size(MATMUL_THREADS)
fn fused_matmul(
    ids: Lanes,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let s = shape();
    let swiglu = s.epilogue == EPILOGUE_SWIGLU;
    let norm = s.norm != 0u;
    let row_tiles = (s.rows + MATMUL_TILE - 1u) / MATMUL_TILE;
    let group = wid.y * groups.x + wid.x;
    var t = group / max(row_tiles, 1u);
    if s.rows == 0u {
        return;
    }
    // The weight whose column tiles hold tile `t`: the SwiGLU epilogue
    // walks the gate's columns (the up weight has the same), the others
    // every weight's in turn.
    let used = select(min(s.weights, 3u), 1u, swiglu);
    var wi = 0u;
    for (; wi < used; wi++) {
        let tiles = (pick3(s.n, wi) + MATMUL_COLS - 1u) / MATMUL_COLS;
        if t < tiles {
            break;
        }
        t -= tiles;
    }
    if wi >= used {
        return;
    }
    let n = pick3(s.n, wi);
    let r0 = (group % row_tiles) * MATMUL_TILE;
    let nr = min(MATMUL_TILE, s.rows - r0);
    let k = s.k;
    let at = column_lane(ids);
    let lane = at.y;
    let j = min(t * MATMUL_COLS + at.x, n - 1u);
    let dt = pick3(s.dtype, wi);
    let row = 4u * args.off[2u + wi] + j * row_bytes(dt, k);
    // SwiGLU's up weight (w1).
    let dt2 = s.dtype[1];
    let row2 = 4u * args.off[3] + j * row_bytes(dt2, k);
    let xt = args.off[0] + r0 * k;

    var acc: array<f32, MATMUL_TILE>;
    var acc2: array<f32, MATMUL_TILE>;
    var sq: array<f32, MATMUL_TILE>;
    for (var u = lane; u < k / 8u; u += MATMUL_LANES) {
        let e = 8u * u;
        let q = decode8(wi, row, e, dt);
        var q2 = Dec8(vec4<f32>(0.0), vec4<f32>(0.0), 0.0, 0.0);
        if swiglu {
            q2 = decode8(1u, row2, e, dt2);
        }
        var g0 = vec4<f32>(1.0);
        var g1 = vec4<f32>(1.0);
        if norm {
            let b = args.off[1] + e;
            g0 = vec4<f32>(g[b], g[b + 1u], g[b + 2u], g[b + 3u]);
            g1 = vec4<f32>(g[b + 4u], g[b + 5u], g[b + 6u], g[b + 7u]);
        }
        for (var r = 0u; r < MATMUL_TILE; r++) {
            if r < nr {
                let a = xt + r * k + e;
                var x0 = vec4<f32>(x[a], x[a + 1u], x[a + 2u], x[a + 3u]);
                var x1 = vec4<f32>(x[a + 4u], x[a + 5u], x[a + 6u], x[a + 7u]);
                if norm {
                    sq[r] += dot(x0, x0) + dot(x1, x1);
                    x0 *= g0;
                    x1 *= g1;
                }
                let sum = dot(x0 + x1, vec4<f32>(1.0));
                acc[r] += q.d * (dot(q.lo, x0) + dot(q.hi, x1)) + q.m * sum;
                if swiglu {
                    acc2[r] += q2.d * (dot(q2.lo, x0) + dot(q2.hi, x1)) + q2.m * sum;
                }
            }
        }
    }
    // Float rows whose length is not a multiple of 8: the last elements.
    for (var e = (k & ~7u) + lane; e < k; e += MATMUL_LANES) {
        let v = float_at(wi, row, e, dt);
        var v2 = 0.0;
        if swiglu {
            v2 = float_at(1u, row2, e, dt2);
        }
        var ge = 1.0;
        if norm {
            ge = g[args.off[1] + e];
        }
        for (var r = 0u; r < MATMUL_TILE; r++) {
            if r < nr {
                let xv = x[xt + r * k + e];
                sq[r] += xv * xv;
                acc[r] += v * (xv * ge);
                acc2[r] += v2 * (xv * ge);
            }
        }
    }

    // The tile's rows only (`nr` is the same for the whole workgroup, so
    // the lanes' subgroup sums stay in uniform control flow), and the
    // second product and the squares only where used.
    for (var r = 0u; r < MATMUL_TILE; r++) {
        if r < nr {
            let p = lane_part(ids, acc[r]);
            var p2 = 0.0;
            if swiglu {
                p2 = lane_part(ids, acc2[r]);
            }
            var ss = 0.0;
            if norm {
                ss = lane_part(ids, sq[r]);
            }
            if stores_part(ids) {
                let slot = r * MATMUL_THREADS + part_slot(ids);
                partial[slot] = p;
                partial2[slot] = p2;
                squares[slot] = ss;
            }
        }
    }
    workgroupBarrier();
    // Invocation (c, r) sums column c's parts for tile row r.
    let lid = ids.lid;
    if lid < MATMUL_COLS * MATMUL_TILE {
        let c = lid / MATMUL_TILE;
        let r = lid % MATMUL_TILE;
        let jc = t * MATMUL_COLS + c;
        if r < nr && jc < n {
            let base = r * MATMUL_THREADS + c * MATMUL_LANES;
            var p = 0.0;
            var p2 = 0.0;
            var ss = 0.0;
            for (var l = 0u; l < column_parts(ids); l++) {
                p += partial[base + l];
                p2 += partial2[base + l];
                ss += squares[base + l];
            }
            if norm {
                let inv = 1.0 / sqrt(ss / f32(k) + s.eps);
                p *= inv;
                p2 *= inv;
            }
            let at = (r0 + r) * n + jc;
            if swiglu {
                y0[args.off[5] + at] = silu(p) * p2;
            } else if s.epilogue == EPILOGUE_ACCUMULATE {
                y0[args.off[5] + at] += p;
            } else {
                var v = p;
                let biased = (s.bias & (1u << wi)) != 0u;
                switch wi {
                    case 0u: {
                        if biased { v += b0[args.off[8] + jc]; }
                        y0[args.off[5] + at] = v;
                    }
                    case 1u: {
                        if biased { v += b1[args.off[9] + jc]; }
                        y1[args.off[6] + at] = v;
                    }
                    default: {
                        if biased { v += b2[args.off[10] + jc]; }
                        y2[args.off[7] + at] = v;
                    }
                }
            }
        }
    }
}
