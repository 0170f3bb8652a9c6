// `rope_store`: RoPE of `rows` rows of K followed by their store into the
// f16 cache at the position parameter, in one dispatch; `x` itself is left
// as it was. Built by the fusion pass from `rope` then `kv_store`.
//
// Arguments: `x: f32[rows, heads, head_dim]` (read), `pos: u32[1]` (read),
// `cache: f16[max_seq, heads * head_dim]` (written; bound as words, two
// halves each), value `RopeStoreShape` (the `RopeShape` and `max_seq`).
//
// Each element is rotated as `rope` rotates it (elements past `rope_dim`
// copied) and rounded to f16 as `kv_store` rounds. One invocation per word
// of the cache, so that no two invocations write halves of one word; a
// word the stored rows only half cover keeps its other half. A position
// past the cache writes nothing (`Ops` and the CPU report it).

// #include "common.wgsl"
// #include "f16.wgsl"
// #include "rope_common.wgsl"

struct RopeStoreShape {
    rope: RopeShape,
    max_seq: u32,
}

struct Args {
    off: array<u32, 16>,
    s: RopeStoreShape,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> pos: array<u32>;
@group(0) @binding(2) var<storage, read_write> cache: array<u32>;
@group(1) @binding(0) var<storage, read> args: Args;

// Element `e` (of `rows * heads * head_dim`) of `x` after the rotation at
// first position `p0`.
fn rotated(s: RopeShape, e: u32, p0: u32) -> f32 {
    let j = e % s.head_dim;
    let head = e - j;
    if j >= s.rope_dim {
        return x[args.off[0] + e];
    }
    let pair = rope_pair_of(s, j);
    let ix = rope_index(s, pair.x);
    let a = x[args.off[0] + head + ix.x];
    let b = x[args.off[0] + head + ix.y];
    return rope_element(s, pair, a, b, p0 + e / (s.heads * s.head_dim));
}

@compute @workgroup_size(256)
fn rope_store(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let s = args.s.rope;
    let p = pos[args.off[1]];
    let dim = s.heads * s.head_dim;
    let n = s.rows * dim;
    if !rope_shape_ok(s) || s.head_dim == 0u || p > args.s.max_seq || s.rows > args.s.max_seq - p {
        return;
    }
    // The cache elements written are `start .. start + n`.
    let start = p * dim;
    let w = (start >> 1u) + linear_index(gid, groups, 256u);
    if n == 0u || w > (start + n - 1u) >> 1u {
        return;
    }
    let at = args.off[2] + w;
    var old = 0u;
    if 2u * w < start || 2u * w + 1u >= start + n {
        old = cache[at];
    }
    var lo = old & 0xffffu;
    var hi = old >> 16u;
    if 2u * w >= start {
        lo = f16_bits(rotated(s, 2u * w - start, p));
    }
    if 2u * w + 1u < start + n {
        hi = f16_bits(rotated(s, 2u * w + 1u - start, p));
    }
    cache[at] = lo | (hi << 16u);
}
