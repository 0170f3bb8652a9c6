// `silu_mul`: `y[i] = silu(g[i]) * u[i]`, `silu(v) = v / (1 + e^-v)` with
// ggml's `e^x` (llama.cpp's SwiGLU), as the CPU computes it.
//
// Arguments: `g: f32[n]` (read), `u: f32[n]` (read), `y: f32[n]` (write),
// value `n`. One invocation per element, in a grid of `linear_launch`.

// #include "common.wgsl"
// #include "ggml_exp.wgsl"

struct Args {
    off: array<u32, 16>,
    n: u32,
}

@group(0) @binding(0) var<storage, read> g: array<f32>;
@group(0) @binding(1) var<storage, read> u: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(256)
fn silu_mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = linear_index(gid, groups, 256u);
    if i < args.n {
        let v = g[args.off[0] + i];
        y[args.off[2] + i] = v / (1.0 + ggml_expf(0.0 - v)) * u[args.off[1] + i];
    }
}
