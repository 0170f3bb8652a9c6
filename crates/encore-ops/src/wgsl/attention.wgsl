// `attention`: causal grouped-query attention over the f16 KV cache.
//
// Arguments: `q: f32[rows, heads * head_dim]` (read), `k, v: f16[max_seq,
// kv_dim]` (read; bound as words, two halves each), `pos: u32[1]` (read),
// `out: f32[rows, heads * head_dim]` (write), value `AttnShape` (rows,
// heads, kv_heads, head_dim, max_seq, scale, window).
//
// For query row `r` (position `at = pos + r`) and head `h`, with KV head
// `h / (heads / kv_heads)`: `s[t] = scale * q16 · K[t]` for `first <= t <=
// at` (`first` is 0, or with a sliding window `w`, `at + 1 - w` when that
// is positive), `p = softmax(s)`, `out[r, h] = sum_t p[t] V[t]`; `q16` is
// the query rounded to f16, as on the CPU.
//
// One workgroup per (head, row), in a grid of `linear_launch`, splitting
// the positions among its invocations: a chunk of ATT_THREADS positions at
// a time, an invocation per position computes its score, the workgroup
// takes the chunk's maximum, and the running maximum `m`, sum `l` and
// weighted sum of V are rescaled by `e^(m_old - m_new)` (the online
// softmax, safe for any magnitude of scores) before the chunk's weights
// `e^(s - m_new)` are added in. For the weighted sum the invocations
// split the other way: a column of two dimensions each and the chunk's
// positions dealt out among the invocations of a column (`lanes` of them),
// whose sums meet in shared memory at the end. The weighted sum is f32
// where the CPU keeps it in f16 (llama.cpp's recurrence, below 64 rows), so
// the two agree to about 2^-11 relative.
//
// A shape the kernel cannot take (heads not a multiple of kv_heads, a head
// over ATT_MAX_HEAD, rows past the cache) writes nothing; `Ops::attention`
// rejects the first two before dispatch.

// #include "common.wgsl"
// #include "f16.wgsl"

struct Args {
    off: array<u32, 16>,
    rows: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    max_seq: u32,
    scale: f32,
    window: u32,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k: array<u32>;
@group(0) @binding(2) var<storage, read> v: array<u32>;
@group(0) @binding(3) var<storage, read> pos: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

const ATT_THREADS: u32 = 256u;
const ATT_MAX_HEAD: u32 = 256u;
// Below every score: the running maximum before the first chunk.
const ATT_LOWEST: f32 = -3.0e38;

var<workgroup> qs: array<f32, ATT_MAX_HEAD>;
var<workgroup> red: array<f32, ATT_THREADS>;
var<workgroup> probs: array<f32, ATT_THREADS>;
// A lane's weighted sums, `lane * 2 * cols + d`: at most ATT_THREADS
// invocations of two dimensions each.
var<workgroup> part: array<f32, 512>;
var<workgroup> lsum: array<f32, ATT_THREADS>;

// Element `e` of a K or V cache (element `e` of the argument).
fn k_at(e: u32) -> f32 {
    let w = unpack2x16float(k[args.off[1] + (e >> 1u)]);
    return select(w.x, w.y, (e & 1u) == 1u);
}

fn v_at(e: u32) -> f32 {
    let w = unpack2x16float(v[args.off[2] + (e >> 1u)]);
    return select(w.x, w.y, (e & 1u) == 1u);
}

// `q16 · K` over the `hd` elements of K from element `e`; `aligned` when
// `e` and `hd` are even, so that the row is whole words.
fn score(e: u32, hd: u32, aligned: bool) -> f32 {
    var acc = 0.0;
    if aligned {
        let w0 = args.off[1] + (e >> 1u);
        for (var i = 0u; i < hd / 2u; i++) {
            let kv = unpack2x16float(k[w0 + i]);
            acc = fma(qs[2u * i], kv.x, acc);
            acc = fma(qs[2u * i + 1u], kv.y, acc);
        }
    } else {
        for (var d = 0u; d < hd; d++) {
            acc = fma(qs[d], k_at(e + d), acc);
        }
    }
    return acc;
}

// Elements `e` and `e + 1` of V (the second only when `two`).
fn v_pair(e: u32, two: bool, aligned: bool) -> vec2<f32> {
    if aligned {
        return unpack2x16float(v[args.off[2] + (e >> 1u)]);
    }
    return vec2<f32>(v_at(e), select(0.0, v_at(e + 1u), two));
}

@compute @workgroup_size(ATT_THREADS)
fn attention(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    // Every condition of an early return is the same for the whole
    // workgroup: the barriers below stay in uniform control flow.
    let heads = args.heads;
    let kv_heads = args.kv_heads;
    let hd = args.head_dim;
    if kv_heads == 0u || heads % kv_heads != 0u || hd > ATT_MAX_HEAD || hd == 0u {
        return;
    }
    let group = linear_index(wid, groups, 1u);
    if group >= heads * args.rows {
        return;
    }
    let p = pos[args.off[3]];
    if p > args.max_seq || args.rows > args.max_seq - p {
        return;
    }
    let h = group % heads;
    let r = group / heads;
    let at = p + r;
    var first = 0u;
    if args.window != 0u && at + 1u > args.window {
        first = at + 1u - args.window;
    }
    let len = at + 1u - first;
    let kv_dim = kv_heads * hd;
    let kv_off = (h / (heads / kv_heads)) * hd;
    let aligned = (hd & 1u) == 0u && (kv_dim & 1u) == 0u;

    let qh = args.off[0] + (r * heads + h) * hd;
    for (var d = tid; d < hd; d += ATT_THREADS) {
        qs[d] = round_f16(q[qh + d]);
    }
    workgroupBarrier();

    // The weighted sum's layout: columns of two dimensions, `lanes`
    // invocations a column.
    let cols = (hd + 1u) / 2u;
    let lanes = ATT_THREADS / cols;
    let c = tid % cols;
    let lane = tid / cols;
    let summing = lane < lanes;
    let two = 2u * c + 1u < hd;

    var m = ATT_LOWEST;
    var l = 0.0;
    var acc = vec2<f32>(0.0, 0.0);
    for (var t0 = 0u; t0 < len; t0 += ATT_THREADS) {
        let t = t0 + tid;
        var s = ATT_LOWEST;
        if t < len {
            s = args.scale * score((first + t) * kv_dim + kv_off, hd, aligned);
        }
        red[tid] = s;
        for (var half = ATT_THREADS / 2u; half > 0u; half /= 2u) {
            workgroupBarrier();
            if tid < half {
                red[tid] = max(red[tid], red[tid + half]);
            }
        }
        workgroupBarrier();
        let m_new = max(m, red[0]);
        if t < len {
            probs[tid] = exp(s - m_new);
        }
        workgroupBarrier();
        let alpha = exp(m - m_new);
        acc *= alpha;
        l *= alpha;
        m = m_new;
        if summing {
            let end = min(len - t0, ATT_THREADS);
            for (var j = lane; j < end; j += lanes) {
                let pj = probs[j];
                let e = (first + t0 + j) * kv_dim + kv_off + 2u * c;
                acc = fma(vec2<f32>(pj, pj), v_pair(e, two, aligned), acc);
                l += pj;
            }
        }
        // Every invocation is done with `red` and `probs` before the next
        // chunk writes them.
        workgroupBarrier();
    }

    if summing {
        part[lane * 2u * cols + 2u * c] = acc.x;
        part[lane * 2u * cols + 2u * c + 1u] = acc.y;
        if c == 0u {
            lsum[lane] = l;
        }
    }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < lanes; i++) {
        total += lsum[i];
    }
    let oh = args.off[4] + (r * heads + h) * hd;
    for (var d = tid; d < hd; d += ATT_THREADS) {
        var o = 0.0;
        for (var i = 0u; i < lanes; i++) {
            o += part[i * 2u * cols + d];
        }
        out[oh + d] = o / total;
    }
}
