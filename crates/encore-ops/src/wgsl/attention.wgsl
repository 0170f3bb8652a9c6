// `attention`: causal grouped-query attention over the f16 KV cache.
//
// Arguments: `q: f32[rows, heads * head_dim]` (read), `k, v: f16[max_seq,
// kv_dim]` (read; bound as words, two halves each), `pos: u32[1]` (read),
// `out: f32[rows, heads * head_dim]` (write), value `AttnShape` (rows,
// heads, kv_heads, head_dim, max_seq, scale, window).
//
// Query row `r` is at position `pos + r`; head `h` reads KV head `h /
// (heads / kv_heads)`. One workgroup per (head, row), in a grid of
// `linear_launch`, computing what `attention_common.wgsl` describes.
//
// A shape the kernel cannot take (heads not a multiple of kv_heads, a head
// over ATT_MAX_HEAD, rows past the cache) writes nothing; `Ops::attention`
// rejects the first two before dispatch.

// #include "common.wgsl"
// #include "f16.wgsl"
// #include "attention_common.wgsl"

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

fn k_word(i: u32) -> u32 {
    return k[args.off[1] + i];
}

fn v_word(i: u32) -> u32 {
    return v[args.off[2] + i];
}

@compute @workgroup_size(ATT_THREADS)
fn attention(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    // Every condition of an early return is the same for the whole
    // workgroup: the barriers below stay in uniform control flow.
    let s = args.s;
    if !attn_shape_ok(s) {
        return;
    }
    let group = linear_index(wid, groups, 1u);
    if group >= s.heads * s.rows {
        return;
    }
    let p = pos[args.off[3]];
    if p > s.max_seq || s.rows > s.max_seq - p {
        return;
    }
    let h = group % s.heads;
    let r = group / s.heads;
    let hd = s.head_dim;

    let qh = args.off[0] + (r * s.heads + h) * hd;
    for (var d = tid; d < hd; d += ATT_THREADS) {
        qs[d] = round_f16(q[qh + d]);
    }
    workgroupBarrier();
    attend(s, p + r, attn_kv_offset(s, h), tid, false, false);
    let oh = args.off[4] + (r * s.heads + h) * hd;
    for (var d = tid; d < hd; d += ATT_THREADS) {
        out[oh + d] = attended(s, d);
    }
}
