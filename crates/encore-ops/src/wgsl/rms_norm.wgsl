// `rms_norm`: `y[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * w[i]`.
//
// Arguments: `x: f32[rows, dim]` (read), `w: f32[dim]` (read),
// `y: f32[rows, dim]` (write), value `NormShape` (rows, dim, eps).
//
// One workgroup per row, in a grid of `linear_launch`. Each invocation sums
// the squares of a strided part of the row, the workgroup adds the 256
// partial sums in shared memory as a tree, then every invocation scales
// its part: `y = x * (1 / sqrt(mean + eps)) * w`, multiplied in the CPU's
// order. WGSL has no f64, so the sum is f32 where the CPU's is f64: a
// pairwise sum, within a few ulp of it.

// #include "common.wgsl"

struct Args {
    off: array<u32, 16>,
    rows: u32,
    dim: u32,
    eps: f32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;

const NORM_THREADS: u32 = 256u;

var<workgroup> partial: array<f32, NORM_THREADS>;

@compute @workgroup_size(NORM_THREADS)
fn rms_norm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let r = linear_index(wid, groups, 1u);
    // Every invocation of a workgroup takes the same branch: the barriers
    // below stay in uniform control flow.
    if r >= args.rows {
        return;
    }
    let dim = args.dim;
    let xr = args.off[0] + r * dim;
    var sum = 0.0;
    for (var i = tid; i < dim; i += NORM_THREADS) {
        let v = x[xr + i];
        sum += v * v;
    }
    partial[tid] = sum;
    for (var half = NORM_THREADS / 2u; half > 0u; half /= 2u) {
        workgroupBarrier();
        if tid < half {
            partial[tid] += partial[tid + half];
        }
    }
    workgroupBarrier();
    let mean_sq = partial[0] / f32(max(dim, 1u));
    let scale = 1.0 / sqrt(mean_sq + args.eps);
    let yr = args.off[2] + r * dim;
    for (var i = tid; i < dim; i += NORM_THREADS) {
        y[yr + i] = x[xr + i] * scale * w[args.off[1] + i];
    }
}
