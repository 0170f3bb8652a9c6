// `kv_store` and `kv_store_paged`: write `rows` f32 rows into an f16 KV
// cache, row `r` into cache row `pos[0] + r` (consecutive positions of one
// sequence) or into slot `pos[r]` (a paged pool), as the constant
// `POSITION_ROWS` (prepended from Rust) says.
//
// Arguments: `src: f32[rows, kv_dim]` (read), `cache: f16[max_seq, kv_dim]`
// (written; bound as words, two halves each), `pos: u32[1]` (read) or
// `u32[rows]`, value `KvShape`.
//
// `cache[row * kv_dim + i] = f16(src[r * kv_dim + i])`, rounding to nearest
// even like the CPU. One invocation per word of the cache, so that no two
// invocations write halves of one word: consecutive rows from `pos[0]`
// cover one range, whose first and last words may be half covered and keep
// their other half; rows at their own slots start at even elements (an even
// `kv_dim`, which the launch checks), so each word is one row's. A position
// past the cache writes nothing, nor does a slot past the pool (the CPU
// reports them; the engine never makes one).

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
    if POSITION_ROWS {
        store_at_slots(linear_index(gid, groups, 256u));
        return;
    }
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

// Word `w` of the rows (`kv_dim` even): its two halves into their row's slot.
fn store_at_slots(w: u32) {
    let half_row = args.kv_dim / 2u;
    if half_row == 0u || w >= args.rows * half_row {
        return;
    }
    let r = w / half_row;
    let slot = pos[args.off[2] + r];
    if slot >= args.max_seq {
        return;
    }
    let e = 2u * w;
    let lo = f16_bits(src[args.off[0] + e]);
    let hi = f16_bits(src[args.off[0] + e + 1u]);
    cache[args.off[1] + slot * half_row + (w - r * half_row)] = lo | (hi << 16u);
}
