// `add`: `y[i] += x[i]`.
//
// Arguments: `y: f32[n]` (read-write), `x: f32[n]` (read), `n: u32` (value).
// One invocation per element; the grid may be two-dimensional (see
// `wgsl/mod.rs`, `linear_launch`), so the element index folds both.

// #include "common.wgsl"

struct Args {
    off: array<u32, 16>,
    n: u32,
}

@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(256)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = linear_index(gid, groups, 256u);
    if i < args.n {
        y[args.off[0] + i] += x[args.off[1] + i];
    }
}
