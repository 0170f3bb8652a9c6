// `attention_prefill`: the `attention` op (attention.wgsl; the same
// arguments and result) for a prefill batch, tiled flash-attention style:
// a workgroup takes FA_ROWS query rows of one head and walks the cache
// FA_KEYS positions at a time, so each K and V row it loads serves all its
// query rows instead of one (attention.wgsl loads the history once per
// query row and head).
//
// Arguments: `q: f32[rows, heads * head_dim]` (read), `k, v: f16[max_seq,
// kv_dim]` (read; bound as words, two halves each), `pos: u32[1]` (read),
// `out: f32[rows, heads * head_dim]` (write), value `AttnShape`.
//
// For each tile of positions: the workgroup converts the tile's K and V
// rows to f32 in workgroup memory; invocation `(r, g)` (8 a query row)
// scores positions `g` and `g + 8` of the tile against query row `r`
// (rounded to f16 in batches of fewer than FA_F32_ROWS rows, as the CPU
// does below its tiled path's rows), masking those past the row's position;
// the row's 8 invocations meet for the tile's maximum and turn the scores
// into weights `e^(s - m)` against the running maximum `m`; then
// invocation `(pair, c)` rescales the running sums of query rows `2 pair,
// 2 pair + 1` for dimensions `4c .. 4c + 4` by `e^(m_old - m_new)` (the
// online softmax) and adds the tile's weighted V rows. The next tile's K
// and V words are loaded into registers while the current one is summed.
// Tiles go the longest first (the last query rows see the most
// positions), so the short ones fill the end of the launch.
//
// Sums are f32 throughout, and the weights are `ggml_expf`'s, the CPU's
// exponential (WGSL's `exp` is coarser on some devices: lavapipe's put a
// row of two positions 1e-4 off); against the CPU (f32 sums from 64 rows
// on, in another order) the results agree to about 1e-6 for |q|, |k|,
// |v| < 1.
//
// Shapes: a head of at most FA_HEAD elements, a multiple of 8; no sliding
// window; heads a multiple of the KV heads (`Ops::attention` sends no
// other shape here; another writes nothing). FA_ROWS and FA_F32_ROWS come
// from Rust, prepended to the source (`wgsl/mod.rs`), which launches a
// workgroup per head and tile of rows.

// #include "common.wgsl"
// #include "f16.wgsl"
// #include "attn_shape.wgsl"
// #include "ggml_exp.wgsl"

struct Args {
    off: array<u32, 16>,
    s: AttnShape,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k: array<u32>;
@group(0) @binding(2) var<storage, read> v: array<u32>;
@group(0) @binding(3) var<storage, read> pos: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

const FA_KEYS: u32 = 16u;
const FA_THREADS: u32 = 128u;
const FA_HEAD: u32 = 64u;
// Score invocations a query row: each takes FA_KEYS / FA_SCORE_LANES positions.
const FA_SCORE_LANES: u32 = 8u;
// Words of a tile's K (or V) rows one invocation loads: FA_KEYS rows of
// at most FA_HEAD / 2 words, in pairs.
const FA_PAIRS: u32 = FA_KEYS * FA_HEAD / 4u / FA_THREADS;
// A query or K row in workgroup memory, in fours: the head and one four
// more, so that the rows of neighbouring invocations start in other banks.
const FA_STRIDE: u32 = FA_HEAD / 4u + 1u;
const FA_LOWEST: f32 = -3.0e38;

const_assert FA_ROWS * FA_SCORE_LANES == FA_THREADS;
const_assert FA_ROWS / 2u * FA_HEAD / 4u == FA_THREADS;

var<workgroup> fa_q: array<vec4<f32>, FA_ROWS * FA_STRIDE>;
var<workgroup> fa_k: array<vec4<f32>, FA_KEYS * FA_STRIDE>;
var<workgroup> fa_v: array<vec4<f32>, FA_KEYS * FA_HEAD / 4u>;
// The tile's weights, `row * FA_KEYS + position`.
var<workgroup> fa_p: array<f32, FA_ROWS * FA_KEYS>;
// Each score invocation's maximum, `row * FA_SCORE_LANES + lane`.
var<workgroup> fa_max: array<f32, FA_THREADS>;

// The largest score of query row `r` in the tile (after the barrier that
// follows the score invocations' stores to `fa_max`).
fn tile_max(r: u32) -> f32 {
    var m = FA_LOWEST;
    for (var i = 0u; i < FA_SCORE_LANES; i++) {
        m = max(m, fa_max[r * FA_SCORE_LANES + i]);
    }
    return m;
}

// A tile's K and V words in registers: pair `i` of this invocation holds
// words `2w, 2w + 1` of the tile's rows, `w = tid + i * FA_THREADS`.
struct TileWords {
    k: array<vec2<u32>, FA_PAIRS>,
    v: array<vec2<u32>, FA_PAIRS>,
}

// The words of the tile of positions from `t0` (rows at `end` and past
// it read as zeros), from element `kv_off` of each row of `kv_dim`.
fn load_tile(t0: u32, end: u32, kv_dim: u32, kv_off: u32, hd: u32, tid: u32) -> TileWords {
    var tw: TileWords;
    let pairs = hd / 4u;
    for (var i = 0u; i < FA_PAIRS; i++) {
        let w = tid + i * FA_THREADS;
        let j = w / pairs;
        let t = t0 + j;
        var kw = vec2<u32>(0u);
        var vw = vec2<u32>(0u);
        if j < FA_KEYS && t < end {
            let at = (t * kv_dim + kv_off) / 2u + 2u * (w % pairs);
            kw = vec2<u32>(k[args.off[1] + at], k[args.off[1] + at + 1u]);
            vw = vec2<u32>(v[args.off[2] + at], v[args.off[2] + at + 1u]);
        }
        tw.k[i] = kw;
        tw.v[i] = vw;
    }
    return tw;
}

// Stores loaded words into the K and V tiles as f32.
fn store_tile(tw: TileWords, hd: u32, tid: u32) {
    let pairs = hd / 4u;
    for (var i = 0u; i < FA_PAIRS; i++) {
        let w = tid + i * FA_THREADS;
        let j = w / pairs;
        if j < FA_KEYS {
            let c = w % pairs;
            fa_k[j * FA_STRIDE + c] = vec4<f32>(unpack2x16float(tw.k[i].x), unpack2x16float(tw.k[i].y));
            fa_v[j * (FA_HEAD / 4u) + c] = vec4<f32>(unpack2x16float(tw.v[i].x), unpack2x16float(tw.v[i].y));
        }
    }
}

@compute @workgroup_size(FA_THREADS)
fn attention_prefill(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    // Every condition of an early return is the same for the whole
    // workgroup: the barriers below stay in uniform control flow.
    let s = args.s;
    let hd = s.head_dim;
    if s.kv_heads == 0u || s.heads % s.kv_heads != 0u || hd == 0u || hd > FA_HEAD || hd % 8u != 0u
        || s.window != 0u {
        return;
    }
    let tiles = (s.rows + FA_ROWS - 1u) / FA_ROWS;
    let group = linear_index(wid, groups, 1u);
    if group >= s.heads * tiles {
        return;
    }
    let p = pos[args.off[3]];
    if p > s.max_seq || s.rows > s.max_seq - p {
        return;
    }
    let h = group % s.heads;
    let r0 = (tiles - 1u - group / s.heads) * FA_ROWS;
    let kv_dim = s.kv_heads * hd;
    let kv_off = (h / (s.heads / s.kv_heads)) * hd;
    // The positions the tile's last row sees.
    let end = p + min(r0 + FA_ROWS, s.rows);

    // The queries, rounded to f16 below FA_F32_ROWS rows as on the CPU
    // (rows past the batch are zeros).
    let round = s.rows < FA_F32_ROWS;
    for (var e = tid; e < FA_ROWS * hd / 4u; e += FA_THREADS) {
        let r = e / (hd / 4u);
        let c = e % (hd / 4u);
        var qv = vec4<f32>(0.0);
        if r0 + r < s.rows {
            let b = args.off[0] + ((r0 + r) * s.heads + h) * hd + 4u * c;
            qv = vec4<f32>(q[b], q[b + 1u], q[b + 2u], q[b + 3u]);
            if round {
                qv = vec4<f32>(round_f16(qv.x), round_f16(qv.y), round_f16(qv.z), round_f16(qv.w));
            }
        }
        fa_q[r * FA_STRIDE + c] = qv;
    }

    // Scoring: query row `sr`, positions `g` and `g + 8` of a tile.
    let sr = tid / FA_SCORE_LANES;
    let g = tid % FA_SCORE_LANES;
    let at = p + r0 + sr;
    var sm = FA_LOWEST;
    // Summing: query rows `2 pair` and `2 pair + 1`, dimensions `4c ..`.
    let pair = tid / (FA_HEAD / 4u);
    let c = tid % (FA_HEAD / 4u);
    let ra = 2u * pair;
    let summing = 4u * c < hd;
    var ma = FA_LOWEST;
    var mb = FA_LOWEST;
    var la = 0.0;
    var lb = 0.0;
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);

    var next = load_tile(0u, end, kv_dim, kv_off, hd, tid);
    for (var t0 = 0u; t0 < end; t0 += FA_KEYS) {
        store_tile(next, hd, tid);
        workgroupBarrier();
        if t0 + FA_KEYS < end {
            next = load_tile(t0 + FA_KEYS, end, kv_dim, kv_off, hd, tid);
        }

        var s0 = 0.0;
        var s1 = 0.0;
        for (var d = 0u; d < hd / 4u; d++) {
            let qv = fa_q[sr * FA_STRIDE + d];
            s0 += dot(qv, fa_k[g * FA_STRIDE + d]);
            s1 += dot(qv, fa_k[(g + FA_SCORE_LANES) * FA_STRIDE + d]);
        }
        s0 = select(FA_LOWEST, s.scale * s0, t0 + g <= at);
        s1 = select(FA_LOWEST, s.scale * s1, t0 + g + FA_SCORE_LANES <= at);
        fa_max[tid] = max(s0, s1);
        workgroupBarrier();
        let m_new = max(sm, tile_max(sr));
        sm = m_new;
        fa_p[sr * FA_KEYS + g] = ggml_expf(s0 - m_new);
        fa_p[sr * FA_KEYS + g + FA_SCORE_LANES] = ggml_expf(s1 - m_new);
        workgroupBarrier();

        if summing {
            let na = max(ma, tile_max(ra));
            let nb = max(mb, tile_max(ra + 1u));
            let alpha_a = ggml_expf(ma - na);
            let alpha_b = ggml_expf(mb - nb);
            ma = na;
            mb = nb;
            acc_a *= alpha_a;
            acc_b *= alpha_b;
            la *= alpha_a;
            lb *= alpha_b;
            for (var j = 0u; j < FA_KEYS; j++) {
                let pa = fa_p[ra * FA_KEYS + j];
                let pb = fa_p[(ra + 1u) * FA_KEYS + j];
                let vv = fa_v[j * (FA_HEAD / 4u) + c];
                acc_a = fma(vec4<f32>(pa), vv, acc_a);
                acc_b = fma(vec4<f32>(pb), vv, acc_b);
                la += pa;
                lb += pb;
            }
        }
        // Every invocation is done with the tiles before the next stores.
        workgroupBarrier();
    }

    if summing {
        for (var i = 0u; i < 2u; i++) {
            let r = r0 + ra + i;
            if r < s.rows {
                let o = args.off[4] + (r * s.heads + h) * hd + 4u * c;
                let a = select(acc_a / la, acc_b / lb, i == 1u);
                out[o] = a.x;
                out[o + 1u] = a.y;
                out[o + 2u] = a.z;
                out[o + 3u] = a.w;
            }
        }
    }
}
