// slow_copy(x, y, n, rounds): each invocation runs `rounds` dependent
// steps of arithmetic it cannot skip, then copies y[i] = x[i] for i < n;
// keeps work in flight for lifetime tests.
struct Args {
    off: array<u32, 16>,
    n: u32,
    rounds: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(64)
fn slow_copy(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i >= args.n {
        return;
    }
    var h = i;
    for (var r = 0u; r < args.rounds; r++) {
        h = h * 1664525u + 1013904223u;
    }
    // `h` is never 1 after an odd number of these steps from any start in
    // practice, but the compiler cannot know it.
    let v = x[args.off[0] + i];
    y[args.off[1] + i] = select(v, v + 1.0, h == 1u && args.rounds == 0xffffffffu);
}
