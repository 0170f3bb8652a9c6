// `embed`: `y[r, :] = dequantize(table[tokens[r], :])`.
//
// Arguments: `table: dtype[vocab, dim]` (read, GGUF blocks), `tokens:
// u32[rows]` (read), `y: f32[rows, dim]` (write), `EmbedShape` (value:
// rows, dim, vocab, the table's ggml type id).
//
// One workgroup per token, invocations over the row eight elements at a
// time (quant.wgsl's `decode8`), each value formed as the CPU forms it
// (`d * q + m`, the two operations kept apart), so they match to the bit.
// An out-of-range token id writes zeros (the CPU reports it; the session
// checks ids before they reach the device). The grid may be
// two-dimensional (`linear_launch`).

// #include "quant.wgsl"

struct Args {
    off: array<u32, 16>,
    rows: u32,
    dim: u32,
    vocab: u32,
    dtype: u32,
}

@group(0) @binding(0) var<storage, read> table: array<u32>;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

fn weight_word(sel: u32, i: u32) -> u32 {
    return table[i];
}

const EMBED_THREADS: u32 = 64u;

@compute @workgroup_size(EMBED_THREADS)
fn embed(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let r = wid.y * groups.x + wid.x;
    if r >= args.rows {
        return;
    }
    let dim = args.dim;
    let t = tokens[args.off[1] + r];
    let out = args.off[2] + r * dim;
    if t >= args.vocab {
        for (var e = lid; e < dim; e += EMBED_THREADS) {
            y[out + e] = 0.0;
        }
        return;
    }
    let row = 4u * args.off[0] + t * row_bytes(args.dtype, dim);
    for (var u = lid; u < dim / 8u; u += EMBED_THREADS) {
        let e = 8u * u;
        let q = decode8(0u, row, e, args.dtype);
        let lo = q.d * q.lo;
        let hi = q.d * q.hi;
        y[out + e] = lo.x + q.m;
        y[out + e + 1u] = lo.y + q.m;
        y[out + e + 2u] = lo.z + q.m;
        y[out + e + 3u] = lo.w + q.m;
        y[out + e + 4u] = hi.x + q.m;
        y[out + e + 5u] = hi.y + q.m;
        y[out + e + 6u] = hi.z + q.m;
        y[out + e + 7u] = hi.w + q.m;
    }
    // Float rows whose length is not a multiple of 8: the last elements.
    for (var e = (dim & ~7u) + lid; e < dim; e += EMBED_THREADS) {
        y[out + e] = float_at(0u, row, e, args.dtype);
    }
}
