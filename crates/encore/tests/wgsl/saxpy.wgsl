// saxpy(x, y, a, n): y[i] = fma(a, x[i], y[i]) for i < n.
struct Args {
    off: array<u32, 16>,
    a: f32,
    n: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(256)
fn saxpy(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < args.n {
        let yi = args.off[1] + i;
        y[yi] = fma(args.a, x[args.off[0] + i], y[yi]);
    }
}
