// `attention_step`: decode attention (one query row) with the step's own
// work on the new position folded in: RoPE of the query, RoPE of the new K
// row and its store into the cache, the store of the new V row. Each part
// is optional (the STEP_* bits of `flags`, prepended from Rust).
//
// Arguments: `q: f32[heads * head_dim]` (read), `k_new, v_new: f32[kv_dim]`
// (read; empty when not folded), `k, v: f16[max_seq, kv_dim]` (written at
// `pos` when the new row is stored, read otherwise; bound as words, two
// halves each), `pos: u32[1]` (read), `out: f32[heads * head_dim]` (write),
// value `AttnStepShape` (the `AttnShape`, the `RopeShape`, flags).
//
// One workgroup per query head, in a grid of `linear_launch`. Each:
// 1. rotates its query head (where folded) as `rope` does and rounds it to
//    f16, as `attention` does;
// 2. rotates (where folded) and rounds to f16 the new K and V rows of its
//    KV head as `rope_store` and `kv_store` do, into `k_row` and `v_row`;
//    the first query head of each KV group also stores them in the caches,
//    whole words, since a row of an even head size starts on a word;
// 3. attends as `attention` does (`attention_common.wgsl`), over positions
//    up to `pos`, taking position `pos` from `k_row` and `v_row` where the
//    step stores it: the stores of one workgroup are not visible to the
//    others of the dispatch, which share the KV head under grouped-query
//    attention, so no workgroup reads position `pos` back from a cache it
//    is written to in this dispatch.
//
// A shape the kernel cannot take (which its launch in `wgsl/mod.rs`
// refuses) or a position past the cache (which the CPU reports) writes
// nothing.

// #include "common.wgsl"
// #include "f16.wgsl"
// #include "rope_common.wgsl"
// #include "attention_common.wgsl"

struct StepShape {
    attn: AttnShape,
    rope: RopeShape,
    flags: u32,
}

struct Args {
    off: array<u32, 16>,
    s: StepShape,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k_new: array<f32>;
@group(0) @binding(2) var<storage, read> v_new: array<f32>;
@group(0) @binding(3) var<storage, read_write> k: array<u32>;
@group(0) @binding(4) var<storage, read_write> v: array<u32>;
@group(0) @binding(5) var<storage, read> pos: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

// The shape: in a variant specialized for one, the constant `SHAPE`
// (`SPECIALIZED` and `SHAPE` come from Rust, prepended to the source), so
// the driver's compiler folds the folded parts' branches and unrolls the
// loops over the head; else the dispatch's value. The rotation is always
// the value's: with `theta_scale` a constant, NVIDIA's compiler evaluated
// the angles' recurrence (`rope_theta`) in another order, two f16 steps
// off the CPU's rotated K row at position 269.
fn step_shape() -> StepShape {
    if SPECIALIZED {
        var s = SHAPE;
        s.rope = args.s.rope;
        return s;
    }
    return args.s;
}

fn k_word(i: u32) -> u32 {
    return k[args.off[3] + i];
}

fn v_word(i: u32) -> u32 {
    return v[args.off[4] + i];
}

// Element `j` of the query head from element `at` of `q`, rotated as `r`
// says at position `p` where `rotate`.
fn query_element(r: RopeShape, at: u32, j: u32, p: u32, rotate: bool) -> f32 {
    if !rotate || j >= r.rope_dim {
        return q[at + j];
    }
    let pair = rope_pair_of(r, j);
    let ix = rope_index(r, pair.x);
    return rope_element(r, pair, q[at + ix.x], q[at + ix.y], p);
}

// Element `j` of the new K row's head from element `at` of `k_new`,
// rotated as `r` says at position `p` where `rotate`.
fn key_element(r: RopeShape, at: u32, j: u32, p: u32, rotate: bool) -> f32 {
    if !rotate || j >= r.rope_dim {
        return k_new[at + j];
    }
    let pair = rope_pair_of(r, j);
    let ix = rope_index(r, pair.x);
    return rope_element(r, pair, k_new[at + ix.x], k_new[at + ix.y], p);
}

@compute @workgroup_size(ATT_THREADS)
fn attention_step(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    // Every condition of an early return is the same for the whole
    // workgroup: the barriers below stay in uniform control flow.
    let shape = step_shape();
    let s = shape.attn;
    let r = shape.rope;
    let flags = shape.flags;
    let hd = s.head_dim;
    let rope_ok = r.rope_dim <= hd && (r.rope_dim & 1u) == 0u;
    if !attn_shape_ok(s) || s.rows != 1u
        || ((flags & (STEP_K_NEW | STEP_V_NEW)) != 0u && (hd & 1u) != 0u)
        || ((flags & (STEP_ROPE_Q | STEP_ROPE_K)) != 0u && !rope_ok) {
        return;
    }
    let h = linear_index(wid, groups, 1u);
    if h >= s.heads {
        return;
    }
    let p = pos[args.off[5]];
    if p >= s.max_seq {
        return;
    }
    let kv_off = attn_kv_offset(s, h);

    let qh = args.off[0] + h * hd;
    let rope_q = (flags & STEP_ROPE_Q) != 0u;
    for (var d = tid; d < hd; d += ATT_THREADS) {
        qs[d] = round_f16(query_element(r, qh, d, p, rope_q));
    }

    // The new rows, a word (two halves) an invocation: the cache words of
    // position `p` and this KV head are `row + w` for `w < hd / 2`.
    let new_k = (flags & STEP_K_NEW) != 0u;
    let new_v = (flags & STEP_V_NEW) != 0u;
    let rope_k = (flags & STEP_ROPE_K) != 0u;
    let stores = h % (s.heads / s.kv_heads) == 0u;
    let row = (p * s.kv_heads * hd + kv_off) / 2u;
    for (var w = tid; w < hd / 2u; w += ATT_THREADS) {
        if new_k {
            let at = args.off[1] + kv_off;
            let word = f16_bits(key_element(r, at, 2u * w, p, rope_k))
                | (f16_bits(key_element(r, at, 2u * w + 1u, p, rope_k)) << 16u);
            let f = unpack2x16float(word);
            k_row[2u * w] = f.x;
            k_row[2u * w + 1u] = f.y;
            if stores {
                k[args.off[3] + row + w] = word;
            }
        }
        if new_v {
            let at = args.off[2] + kv_off + 2u * w;
            let word = f16_bits(v_new[at]) | (f16_bits(v_new[at + 1u]) << 16u);
            let f = unpack2x16float(word);
            v_row[2u * w] = f.x;
            v_row[2u * w + 1u] = f.y;
            if stores {
                v[args.off[4] + row + w] = word;
            }
        }
    }
    workgroupBarrier();

    attend(s, p, kv_off, tid, new_k, new_v);
    let oh = args.off[6] + h * hd;
    for (var d = tid; d < hd; d += ATT_THREADS) {
        out[oh + d] = attended(s, d);
    }
}
