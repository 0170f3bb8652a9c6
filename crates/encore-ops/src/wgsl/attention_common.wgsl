// The attention of one query head at one position over the f16 KV cache,
// shared by `attention` and `attention_step`.
//
// For the query `q16` (rounded to f16, as on the CPU) at position `at`
// with KV head elements from `kv_off` of each cache row: `s[t] = scale *
// q16 · K[t]` for `first <= t <= at` (`first` is 0, or with a sliding
// window `w`, `at + 1 - w` when that is positive), `p = softmax(s)`, the
// result `sum_t p[t] V[t]`.
//
// One workgroup of ATT_THREADS invocations per (head, position), splitting
// the positions among its invocations: a chunk of ATT_THREADS positions at
// a time, an invocation per position computes its score (where the rows are
// whole words and the head a multiple of 16, ATT_SCORE_LANES invocations
// first take a position's row together, each every ATT_SCORE_LANES-th word,
// so that neighbouring invocations read neighbouring words and each has
// ATT_K_BATCH loads in flight; the invocation of the position then adds
// their parts in a fixed order), the workgroup
// takes the chunk's maximum (of runs of ATT_RUN scores, then of the
// runs'), and the running maximum `m`, sum `l` and
// weighted sum of V are rescaled by `e^(m_old - m_new)` (the online
// softmax, safe for any magnitude of scores) before the chunk's weights
// `e^(s - m_new)` are added in. For the weighted sum the invocations
// split the other way: a column of `att_width` dimensions each (eight, four
// words, where the scores' lanes take rows together; else two) and the
// chunk's positions dealt out among the invocations of a column (`lanes` of
// them), each loading ATT_V_BATCH positions before adding any (with eight
// dimensions, the chunk's first batch together with the K words, before
// the scores), whose sums meet in shared memory at the end. The weighted sum is f32
// where the CPU keeps it in f16 (llama.cpp's recurrence, below 64 rows), so
// the two agree to about 2^-11 relative.
//
// The including kernel defines `k_word(i: u32) -> u32` and `v_word(i: u32)
// -> u32`, word `i` of its K and V cache arguments (two halves a word, as
// `f16.wgsl` describes). It may supply the K and V rows of position `at`
// in `k_row` and `v_row` (f16 values as f32) instead of the caches, for a
// row it stores in the same dispatch: another workgroup's stores are not
// visible within a dispatch, so the rows it writes are never read back.

// #include "f16.wgsl"
// #include "attn_shape.wgsl"

const ATT_THREADS: u32 = 256u;
const ATT_MAX_HEAD: u32 = 256u;
// Below every score: the running maximum before the first chunk.
const ATT_LOWEST: f32 = -3.0e38;

var<workgroup> qs: array<f32, ATT_MAX_HEAD>;
var<workgroup> k_row: array<f32, ATT_MAX_HEAD>;
var<workgroup> v_row: array<f32, ATT_MAX_HEAD>;
var<workgroup> red: array<f32, ATT_THREADS>;
// The maxima of `red`'s runs of ATT_RUN scores.
const ATT_RUN: u32 = 16u;
var<workgroup> red_runs: array<f32, ATT_THREADS / ATT_RUN>;
var<workgroup> probs: array<f32, ATT_THREADS>;
var<workgroup> lsum: array<f32, ATT_THREADS>;
// Invocations that take one position's row together for its score, and
// the K words each has in flight.
const ATT_SCORE_LANES: u32 = 8u;
const ATT_K_BATCH: u32 = 32u;
// The parts of the chunk's scores, `position * ATT_SCORE_LANES + lane`;
// after the last chunk, a lane's weighted sums, `lane * cols * width + d` (at
// most ATT_THREADS invocations of at most eight dimensions each). Workgroup memory
// in all stays under 16 KiB, the least every adapter offers.
var<workgroup> part: array<f32, ATT_THREADS * ATT_SCORE_LANES>;

// Whether the kernels take a shape: heads a multiple of the KV heads, a
// head of 1 to ATT_MAX_HEAD elements.
fn attn_shape_ok(s: AttnShape) -> bool {
    return s.kv_heads != 0u && s.heads % s.kv_heads == 0u && s.head_dim != 0u
        && s.head_dim <= ATT_MAX_HEAD;
}

// The first element of query head `h`'s KV head in a cache row.
fn attn_kv_offset(s: AttnShape, h: u32) -> u32 {
    return (h / (s.heads / s.kv_heads)) * s.head_dim;
}

// Element `e` of the K or V cache.
fn k_at(e: u32) -> f32 {
    let w = unpack2x16float(k_word(e >> 1u));
    return select(w.x, w.y, (e & 1u) == 1u);
}

fn v_at(e: u32) -> f32 {
    let w = unpack2x16float(v_word(e >> 1u));
    return select(w.x, w.y, (e & 1u) == 1u);
}

// `q16 · K` over the `hd` elements of K from element `e`; `aligned` when
// `e` and `hd` are even, so that the row is whole words.
fn score(e: u32, hd: u32, aligned: bool) -> f32 {
    var acc = 0.0;
    if aligned {
        let w0 = e >> 1u;
        for (var i = 0u; i < hd / 2u; i++) {
            let kv = unpack2x16float(k_word(w0 + i));
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

// The parts of the scores of the chunk's positions `j < end` (positions
// `base + j`) into `part`, for rows of whole words and a head a multiple of
// 16: position `j`'s lane `l` sums `q16[d] * K[d]` over the words `l, l +
// ATT_SCORE_LANES, ...` of the row (two elements a word, in order), and
// leaves 0 for position `at` where `new_k` (its row is `k_row`). Loads come
// `k_batch` (at most ATT_K_BATCH) at a time: a batch covers `batch` passes
// of ATT_THREADS / ATT_SCORE_LANES positions.
fn score_parts(base: u32, end: u32, row_words: u32, kv_off: u32, hd: u32, at: u32, new_k: bool, tid: u32, k_batch: u32) {
    let lane = tid % ATT_SCORE_LANES;
    let slot = tid / ATT_SCORE_LANES;
    let stride = ATT_THREADS / ATT_SCORE_LANES;
    let per = hd / (2u * ATT_SCORE_LANES);
    let batch = max(k_batch / per, 1u);
    for (var j0 = 0u; j0 < end; j0 += batch * stride) {
        var words: array<u32, ATT_K_BATCH>;
        for (var b = 0u; b < batch; b++) {
            let j = j0 + b * stride + slot;
            if j < end && !(new_k && base + j == at) {
                let w0 = (base + j) * row_words + kv_off / 2u + lane;
                for (var i = 0u; i < per; i++) {
                    words[b * per + i] = k_word(w0 + i * ATT_SCORE_LANES);
                }
            }
        }
        for (var b = 0u; b < batch; b++) {
            let j = j0 + b * stride + slot;
            if j < end {
                var acc = 0.0;
                if !(new_k && base + j == at) {
                    for (var i = 0u; i < per; i++) {
                        let kv = unpack2x16float(words[b * per + i]);
                        let d = 2u * (lane + i * ATT_SCORE_LANES);
                        acc = fma(qs[d], kv.x, acc);
                        acc = fma(qs[d + 1u], kv.y, acc);
                    }
                }
                part[j * ATT_SCORE_LANES + lane] = acc;
            }
        }
    }
}

// `q16 · k_row`, in the order of `score`.
fn score_row(hd: u32) -> f32 {
    var acc = 0.0;
    for (var d = 0u; d < hd; d++) {
        acc = fma(qs[d], k_row[d], acc);
    }
    return acc;
}

// Whether the lanes take a row together for a score (the rows whole
// words, the head a multiple of 16), the same for every invocation.
fn lanes_score(s: AttnShape) -> bool {
    let hd = s.head_dim;
    return (hd & 1u) == 0u && ((s.kv_heads * hd) & 1u) == 0u && hd % (2u * ATT_SCORE_LANES) == 0u;
}

// The dimensions an invocation of the weighted sum takes (a column).
fn att_width(s: AttnShape) -> u32 {
    return select(2u, 8u, lanes_score(s));
}

// Elements `e` and `e + 1` of V (the second only when `two`).
fn v_pair(e: u32, two: bool, aligned: bool) -> vec2<f32> {
    if aligned {
        return unpack2x16float(v_word(e >> 1u));
    }
    return vec2<f32>(v_at(e), select(0.0, v_at(e + 1u), two));
}

// Where `attend` reads V: the column of dimensions `2c, 2c + 1` (the second
// only when `two`) in rows of `kv_dim` from `kv_off`, and position `at`'s
// row from `v_row` where `new_v`.
struct VColumn {
    at: u32,
    new_v: bool,
    kv_dim: u32,
    kv_off: u32,
    c: u32,
    two: bool,
    aligned: bool,
}

// The column's two elements at position `t`.
fn v_column(v: VColumn, t: u32) -> vec2<f32> {
    if v.new_v && t == v.at {
        return vec2<f32>(v_row[2u * v.c], select(0.0, v_row[2u * v.c + 1u], v.two));
    }
    return v_pair(t * v.kv_dim + v.kv_off + 2u * v.c, v.two, v.aligned);
}

// A column of eight dimensions `8c ..` at position `t`, as four words of
// two halves (`att_width` 8: rows of whole words, the head a multiple of 8).
fn v_column8(v: VColumn, t: u32) -> vec4<u32> {
    if v.new_v && t == v.at {
        let d = 8u * v.c;
        return vec4<u32>(
            pack2x16float(vec2<f32>(v_row[d], v_row[d + 1u])),
            pack2x16float(vec2<f32>(v_row[d + 2u], v_row[d + 3u])),
            pack2x16float(vec2<f32>(v_row[d + 4u], v_row[d + 5u])),
            pack2x16float(vec2<f32>(v_row[d + 6u], v_row[d + 7u])),
        );
    }
    let w = (t * v.kv_dim + v.kv_off) / 2u + 4u * v.c;
    return vec4<u32>(v_word(w), v_word(w + 1u), v_word(w + 2u), v_word(w + 3u));
}

// `acc + p * V` for a column of eight dimensions: `acc[0]` the first four.
fn add_v8(acc: array<vec4<f32>, 2>, p: f32, w: vec4<u32>) -> array<vec4<f32>, 2> {
    let lo = vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
    let hi = vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w));
    return array<vec4<f32>, 2>(fma(vec4<f32>(p), lo, acc[0]), fma(vec4<f32>(p), hi, acc[1]));
}

// Positions of a chunk a lane of the weighted sum loads before it adds
// any: independent loads, whose latencies overlap.
const ATT_V_BATCH: u32 = 8u;

// A batch of a lane's positions for `att_width` 8: the column's words at
// positions `base + j0 + u * lanes` for `u < ATT_V_BATCH` (zeros from
// `end` on).
fn v_batch8(v: VColumn, base: u32, j0: u32, lanes: u32, end: u32) -> array<vec4<u32>, ATT_V_BATCH> {
    var vs: array<vec4<u32>, ATT_V_BATCH>;
    for (var u = 0u; u < ATT_V_BATCH; u++) {
        let j = j0 + u * lanes;
        vs[u] = vec4<u32>(0u);
        if j < end {
            vs[u] = v_column8(v, base + j);
        }
    }
    return vs;
}

// Attends with the query in `qs` (written before a barrier every
// invocation has passed) at position `at`, taking position `at`'s K row
// from `k_row` where `new_k` and its V row from `v_row` where `new_v`.
// Every invocation of the workgroup calls it, in uniform control flow; the
// result's element `d` is then `attended(s, d)`.
fn attend(s: AttnShape, at: u32, kv_off: u32, tid: u32, new_k: bool, new_v: bool) {
    let hd = s.head_dim;
    var first = 0u;
    if s.window != 0u && at + 1u > s.window {
        first = at + 1u - s.window;
    }
    let len = at + 1u - first;
    let kv_dim = s.kv_heads * hd;
    let aligned = (hd & 1u) == 0u && (kv_dim & 1u) == 0u;

    // The weighted sum's layout: columns of `width` dimensions, `lanes`
    // invocations a column.
    let width = att_width(s);
    let wide = width == 8u;
    let cols = (hd + width - 1u) / width;
    let lanes = ATT_THREADS / cols;
    let c = tid % cols;
    let lane = tid / cols;
    let summing = lane < lanes;
    let two = 2u * c + 1u < hd;

    // The same for every invocation: whether the lanes take a row together.
    let lanes_score = lanes_score(s);
    // All of a decode step's K loads in flight where they fit; half as
    // many for a prefill's rows, whose many workgroups keep the device busy.
    let k_batch = select(ATT_K_BATCH / 2u, ATT_K_BATCH, s.rows == 1u);

    var m = ATT_LOWEST;
    var l = 0.0;
    // The column's sums: with two dimensions, `acc[0].xy`.
    var acc = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
    for (var t0 = 0u; t0 < len; t0 += ATT_THREADS) {
        let t = t0 + tid;
        let end = min(len - t0, ATT_THREADS);
        // The weighted sum's first batch of V words, loaded with K's (they
        // do not depend on the scores).
        let column8 = VColumn(at, new_v, kv_dim, kv_off, c, true, aligned);
        var first_vs: array<vec4<u32>, ATT_V_BATCH>;
        if summing && wide {
            first_vs = v_batch8(column8, first + t0, lane, lanes, end);
        }
        var s_t = ATT_LOWEST;
        if lanes_score {
            score_parts(first + t0, end, kv_dim / 2u, kv_off, hd, at, new_k, tid, k_batch);
            workgroupBarrier();
            if t < len {
                if new_k && first + t == at {
                    s_t = s.scale * score_row(hd);
                } else {
                    var sum = 0.0;
                    for (var i = 0u; i < ATT_SCORE_LANES; i++) {
                        sum += part[tid * ATT_SCORE_LANES + i];
                    }
                    s_t = s.scale * sum;
                }
            }
        } else if t < len {
            if new_k && first + t == at {
                s_t = s.scale * score_row(hd);
            } else {
                s_t = s.scale * score((first + t) * kv_dim + kv_off, hd, aligned);
            }
        }
        // The chunk's maximum: of runs of ATT_RUN, then of the runs' maxima.
        red[tid] = s_t;
        workgroupBarrier();
        if tid < ATT_THREADS / ATT_RUN {
            var run = red[tid * ATT_RUN];
            for (var i = 1u; i < ATT_RUN; i++) {
                run = max(run, red[tid * ATT_RUN + i]);
            }
            red_runs[tid] = run;
        }
        workgroupBarrier();
        var m_new = m;
        for (var i = 0u; i < ATT_THREADS / ATT_RUN; i++) {
            m_new = max(m_new, red_runs[i]);
        }
        if t < len {
            probs[tid] = exp(s_t - m_new);
        }
        workgroupBarrier();
        let alpha = exp(m - m_new);
        acc[0] *= alpha;
        acc[1] *= alpha;
        l *= alpha;
        m = m_new;
        if summing && wide {
            // A lane's positions `lane, lane + lanes, ...` in batches (the
            // first loaded above), added in that order.
            for (var j0 = lane; j0 < end; j0 += ATT_V_BATCH * lanes) {
                var vs = first_vs;
                if j0 != lane {
                    vs = v_batch8(column8, first + t0, j0, lanes, end);
                }
                for (var u = 0u; u < ATT_V_BATCH; u++) {
                    let j = j0 + u * lanes;
                    if j < end {
                        let pj = probs[j];
                        acc = add_v8(acc, pj, vs[u]);
                        l += pj;
                    }
                }
            }
        } else if summing {
            let column = VColumn(at, new_v, kv_dim, kv_off, c, two, aligned);
            // A lane's positions `j, j + lanes, ...` in batches, added in
            // the same order as one at a time.
            var j = lane;
            for (; j + (ATT_V_BATCH - 1u) * lanes < end; j += ATT_V_BATCH * lanes) {
                var vs: array<vec2<f32>, ATT_V_BATCH>;
                for (var u = 0u; u < ATT_V_BATCH; u++) {
                    vs[u] = v_column(column, first + t0 + j + u * lanes);
                }
                for (var u = 0u; u < ATT_V_BATCH; u++) {
                    let pj = probs[j + u * lanes];
                    acc[0] = vec4<f32>(fma(vec2<f32>(pj, pj), vs[u], acc[0].xy), 0.0, 0.0);
                    l += pj;
                }
            }
            for (; j < end; j += lanes) {
                let pj = probs[j];
                acc[0] = vec4<f32>(fma(vec2<f32>(pj, pj), v_column(column, first + t0 + j), acc[0].xy), 0.0, 0.0);
                l += pj;
            }
        }
        // Every invocation is done with `red`, `probs` and `part` before
        // the next chunk (or the sums below) writes them.
        workgroupBarrier();
    }

    // A lane's sums at `lane * span + d`, dimension `d` of its column.
    // (Constant indices into `acc`, which stays in registers.)
    if summing {
        let d0 = lane * cols * width + width * c;
        part[d0] = acc[0].x;
        part[d0 + 1u] = acc[0].y;
        if wide {
            part[d0 + 2u] = acc[0].z;
            part[d0 + 3u] = acc[0].w;
            part[d0 + 4u] = acc[1].x;
            part[d0 + 5u] = acc[1].y;
            part[d0 + 6u] = acc[1].z;
            part[d0 + 7u] = acc[1].w;
        }
        if c == 0u {
            lsum[lane] = l;
        }
    }
    workgroupBarrier();
}

// Element `d` of the result of `attend` (after it returns).
fn attended(s: AttnShape, d: u32) -> f32 {
    let width = att_width(s);
    let cols = (s.head_dim + width - 1u) / width;
    let lanes = ATT_THREADS / cols;
    var total = 0.0;
    var o = 0.0;
    for (var i = 0u; i < lanes; i++) {
        total += lsum[i];
        o += part[i * cols * width + d];
    }
    return o / total;
}
