// `rope` and `rope_rows`: rotary position embedding, in place, row `r` at
// position `pos[0] + r` (consecutive rows of one sequence) or `pos[r]` (a
// batch of independent sequences), as the constant `POSITION_ROWS`
// (prepended from Rust) says.
//
// Arguments: `x: f32[rows, heads, head_dim]` (read-write), `pos: u32[1]`
// (read, a graph parameter) or `u32[rows]`, `factors: f32[rope_dim / 2]`
// (read where `s.factors` is 1; otherwise bound to `pos` and never read),
// value `RopeShape`.
//
// For pair `i` (of `rope_dim / 2`) at position `p`: `theta = p *
// theta_scale^i`, divided by `factors[i]` where given, and the pair `(a, b)`
// becomes `(a cos - b sin, a sin + b cos)`; the pair is `(x[2i], x[2i+1])`
// in the normal layout, `(x[i], x[i + rope_dim/2])` in the NeoX one.
// Elements past `rope_dim` are left alone. One invocation per rotated pair
// `(row, head, i)`, in a grid of `linear_launch`.

// #include "common.wgsl"
// #include "rope_common.wgsl"

struct Args {
    off: array<u32, 16>,
    s: RopeShape,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> pos: array<u32>;
@group(0) @binding(2) var<storage, read> factors: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(256)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let s = args.s;
    let half = s.rope_dim / 2u;
    let g = linear_index(gid, groups, 256u);
    if !rope_shape_ok(s) || g >= s.rows * s.heads * half {
        return;
    }
    let i = g % half;
    let row_head = g / half;
    let r = row_head / s.heads;
    var theta = rope_theta(s, i, row_position(r));
    if s.factors != 0u {
        theta = theta / factors[args.off[2] + i];
    }
    let at = args.off[0] + row_head * s.head_dim;
    let ix = rope_index(s, i);
    let v = rope_apply(x[at + ix.x], x[at + ix.y], rope_sincos(theta));
    x[at + ix.x] = v.x;
    x[at + ix.y] = v.y;
}

// Row `r`'s position.
fn row_position(r: u32) -> u32 {
    if POSITION_ROWS {
        return pos[args.off[1] + r];
    }
    return pos[args.off[1]] + r;
}
