// add(a, b, c, n): c[i] = a[i] + b[i] for i < n.
struct Args {
    off: array<u32, 16>,
    n: u32,
}

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(128)
fn add(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < args.n {
        c[args.off[2] + i] = a[args.off[0] + i] + b[args.off[1] + i];
    }
}
