// `gelu_mul`: `y[i] = gelu(g[i]) * u[i]` with GELU's tanh approximation,
// `gelu(v) = v/2 (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))` (GeGLU), as the
// CPU (and llama.cpp's CPU backend, through its f16 table) evaluates it: 0
// at or below -10, `v` at or above 10, else of `v` rounded to f16, rounded
// to f16.
//
// Arguments: `g: f32[n]` (read), `u: f32[n]` (read), `y: f32[n]` (write),
// value `n`. One invocation per element, in a grid of `linear_launch`.

// #include "common.wgsl"
// #include "f16.wgsl"
// #include "ggml_exp.wgsl"

struct Args {
    off: array<u32, 16>,
    n: u32,
}

@group(0) @binding(0) var<storage, read> g: array<f32>;
@group(0) @binding(1) var<storage, read> u: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

// `tanh(x)` within a few ulp over the whole range (WGSL's `tanh` has no
// stated accuracy): Cephes' `tanhf` polynomial below 0.625, else
// `1 - 2 / (e^2|x| + 1)` with ggml's `e^x` and the sign of `x`.
fn tanh_accurate(x: f32) -> f32 {
    let a = abs(x);
    if a < 0.625 {
        let z = x * x;
        let p = fma(fma(fma(fma(-5.70498872745e-3, z, 2.06390887954e-2), z, -5.37397155531e-2), z,
                        1.33314422036e-1), z, -3.33332819422e-1);
        return fma(p * z, x, x);
    }
    let t = 1.0 - 2.0 / (ggml_expf(min(2.0 * a, 88.0)) + 1.0);
    return select(t, -t, x < 0.0);
}

// GELU of `x`, as the CPU's `gelu_like_ggml`.
fn gelu_like_ggml(x: f32) -> f32 {
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    let v = round_f16(x);
    let inner = 0.7978846 * v * (1.0 + 0.044715 * v * v);
    return round_f16(0.5 * v * (1.0 + tanh_accurate(inner)));
}

@compute @workgroup_size(256)
fn gelu_mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = linear_index(gid, groups, 256u);
    if i < args.n {
        y[args.off[2] + i] = gelu_like_ggml(g[args.off[0] + i]) * u[args.off[1] + i];
    }
}
