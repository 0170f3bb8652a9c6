// `argmax`: `out[0] = argmax_i x[i]`, the first index among equal maxima;
// a NaN never wins, and a NaN at index 0 makes the answer 0 (the CPU's
// `if x[i] > x[best]` gives that).
//
// Arguments: `x: f32[n]` (read), `out: u32[4]` (read-write), value `n`.
// `out[1..4]` is scratch: zero before a dispatch and zero again after it.
//
// One dispatch of up to ARGMAX_GROUPS workgroups, each taking
// ARGMAX_PER_THREAD values an invocation per round of a grid-stride loop
// (`wgsl/mod.rs` launches enough for one round where they suffice). An
// invocation keeps its best `(value, index)`, the workgroup reduces them in
// shared memory, preferring the larger value and, among equal values, the
// smaller index. The workgroups then merge their winners in `out[2]`,
// which holds one more than the index of the best so far (0: none): a
// compare-and-swap loop that reads the current holder's value back from
// `x`, so that value and index change together in one 32-bit word. The
// last workgroup to finish (counted in `out[1]`) writes the index to
// `out[0]` and sets the scratch back to zero.
//
// Values are compared as integers whose order is the floats' (-0 counted
// as +0, which compares equal to it), NaNs set aside by their bits, so that
// no compiler's float assumptions change the answer.

// #include "common.wgsl"

struct Args {
    off: array<u32, 16>,
    n: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<atomic<u32>>;
@group(1) @binding(0) var<storage, read> args: Args;

const ARGMAX_THREADS: u32 = 256u;
const ARGMAX_PER_THREAD: u32 = 16u;

var<workgroup> best_key: array<u32, ARGMAX_THREADS>;
var<workgroup> best_index: array<u32, ARGMAX_THREADS>;
var<workgroup> last: u32;

// No value at all: below every key a value can have.
const NO_INDEX: u32 = 0xffffffffu;

// The order key of `v`: larger values, larger keys; 0 for a NaN.
fn key_of(v: f32) -> u32 {
    var b = bitcast<u32>(v);
    if (b & 0x7fffffffu) > 0x7f800000u {
        return 0u;
    }
    if b == 0x80000000u {
        b = 0u;
    }
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// Whether `(k, i)` beats `(bk, bi)`: a larger key, or an equal key at a
// smaller index. NaNs (key 0) never win; every other value beats no value.
fn beats(k: u32, i: u32, bk: u32, bi: u32) -> bool {
    return k != 0u && (bi == NO_INDEX || k > bk || (k == bk && i < bi));
}

@compute @workgroup_size(ARGMAX_THREADS)
fn argmax(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let n = args.n;
    let base = args.off[0];
    let group = wid.x;
    let stride = groups.x * ARGMAX_THREADS * ARGMAX_PER_THREAD;
    var bk = 0u;
    var bi = NO_INDEX;
    for (var start = group * ARGMAX_THREADS * ARGMAX_PER_THREAD; start < n; start += stride) {
        for (var u = 0u; u < ARGMAX_PER_THREAD; u++) {
            let i = start + u * ARGMAX_THREADS + tid;
            if i < n {
                let k = key_of(x[base + i]);
                if beats(k, i, bk, bi) {
                    bk = k;
                    bi = i;
                }
            }
        }
    }
    best_key[tid] = bk;
    best_index[tid] = bi;
    for (var half = ARGMAX_THREADS / 2u; half > 0u; half /= 2u) {
        workgroupBarrier();
        if tid < half {
            let k = best_key[tid + half];
            let i = best_index[tid + half];
            if beats(k, i, best_key[tid], best_index[tid]) {
                best_key[tid] = k;
                best_index[tid] = i;
            }
        }
    }
    workgroupBarrier();
    if tid == 0u {
        let k = best_key[0];
        let i = best_index[0];
        if i != NO_INDEX {
            var held = atomicLoad(&out[args.off[1] + 2u]);
            loop {
                if held != 0u {
                    let hi = held - 1u;
                    if !beats(k, i, key_of(x[base + hi]), hi) {
                        break;
                    }
                }
                let r = atomicCompareExchangeWeak(&out[args.off[1] + 2u], held, i + 1u);
                if r.exchanged {
                    break;
                }
                held = r.old_value;
            }
        }
    }
    // Orders this workgroup's merge before its count (a device-scope
    // release on the backends naga targets).
    storageBarrier();
    if tid == 0u {
        last = select(0u, 1u, atomicAdd(&out[args.off[1] + 1u], 1u) == groups.x - 1u);
    }
    if workgroupUniformLoad(&last) == 0u {
        return;
    }
    // The acquire that pairs with every workgroup's release above.
    storageBarrier();
    if tid == 0u {
        let held = atomicExchange(&out[args.off[1] + 2u], 0u);
        atomicStore(&out[args.off[1] + 1u], 0u);
        let nan_first = n > 0u && key_of(x[base]) == 0u;
        atomicStore(&out[args.off[1]], select(held - 1u, 0u, held == 0u || nan_first));
    }
}
