// scale(x, y, s, n): y[i] = x[i] * s[0] for i < n, the factor read from a
// buffer (a graph parameter).
struct Args {
    off: array<u32, 16>,
    n: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> s: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(128)
fn scale(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < args.n {
        y[args.off[1] + i] = x[args.off[0] + i] * s[args.off[2]];
    }
}
