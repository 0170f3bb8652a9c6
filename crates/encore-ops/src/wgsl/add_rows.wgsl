// `add_rows`: `y[r, j] += b[j]` over `rows` rows of `n` (a bias).
//
// Arguments: `y: f32[rows, n]` (read-write), `b: f32[n]` (read), value
// `[rows, n]`. One invocation per element of `y`, in a grid of
// `linear_launch`.

// #include "common.wgsl"

struct Args {
    off: array<u32, 16>,
    rows: u32,
    n: u32,
}

@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(256)
fn add_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = linear_index(gid, groups, 256u);
    if i < args.rows * args.n {
        y[args.off[0] + i] += b[args.off[1] + i % args.n];
    }
}
