// `scale`: `y[i] *= s` over `n` elements.
//
// Arguments: `y: f32[n]` (read-write), value `{n, s}`. One invocation per
// element, in a grid of `linear_launch`.

// #include "common.wgsl"

struct Args {
    off: array<u32, 16>,
    n: u32,
    s: f32,
}

@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(256)
fn scale(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = linear_index(gid, groups, 256u);
    if i < args.n {
        y[args.off[0] + i] *= args.s;
    }
}
