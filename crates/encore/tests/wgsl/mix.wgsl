// mix(x, y, c, n): y[i] = (y[i] * 0.5 + x[i]) + c for i < n, each step
// rounded like the CPU body (WGSL does not contract a * b + c into an fma
// unless asked).
struct Args {
    off: array<u32, 16>,
    c: f32,
    n: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(32)
fn mix(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < args.n {
        let yi = args.off[1] + i;
        let half = y[yi] * 0.5;
        let sum = half + x[args.off[0] + i];
        y[yi] = sum + args.c;
    }
}
