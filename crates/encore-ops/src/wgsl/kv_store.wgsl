// `kv_store`: writes `rows` f32 rows into an f16 KV cache at the position
// parameter.
//
// Arguments: `src: f32[rows, kv_dim]` (read), `cache: f16[max_seq, kv_dim]`
// (written; bound as words, two halves each), `pos: u32[1]` (read), value
// `KvShape`.
//
// `cache[pos * kv_dim + i] = f16(src[i])`, rounding to nearest even like
// the CPU. One invocation per word of the cache, so that no two
// invocations write halves of one word; a word the rows only half cover
// keeps its other half. A position past the cache writes nothing (the CPU
// reports it; the session checks before).

// #include "common.wgsl"
// #include "f16.wgsl"

struct Args {
    off: array<u32, 16>,
    rows: u32,
    kv_dim: u32,
    max_seq: u32,
}

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> cache: array<u32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(256)
fn kv_store(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let p = pos[args.off[2]];
    let n = args.rows * args.kv_dim;
    if p > args.max_seq || args.rows > args.max_seq - p {
        return;
    }
    // The cache elements written are `start .. start + n`.
    let start = p * args.kv_dim;
    let w = (start >> 1u) + linear_index(gid, groups, 256u);
    if n == 0u || w > (start + n - 1u) >> 1u {
        return;
    }
    let at = args.off[1] + w;
    var old = 0u;
    if 2u * w < start || 2u * w + 1u >= start + n {
        old = cache[at];
    }
    var lo = old & 0xffffu;
    var hi = old >> 16u;
    if 2u * w >= start {
        lo = f16_bits(src[args.off[0] + 2u * w - start]);
    }
    if 2u * w + 1u < start + n {
        hi = f16_bits(src[args.off[0] + 2u * w + 1u - start]);
    }
    cache[at] = lo | (hi << 16u);
}
