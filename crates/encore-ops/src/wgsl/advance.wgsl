// `advance`: the bookkeeping of one greedy decode step on the device: the
// step's argmax becomes the next input token, is appended to a history of
// tokens at the current position, and the position moves on by one.
//
// Arguments: `next: u32[1]` (read, the argmax), `token: u32[1]` (write, the
// token parameter), `pos: u32[1]` (read-write, the position parameter),
// `history: u32[cap]` (write), value `cap`. A position at or past `cap`
// appends nothing (the position still moves on). One invocation does it all.

struct Args {
    off: array<u32, 16>,
    cap: u32,
}

@group(0) @binding(0) var<storage, read> next: array<u32>;
@group(0) @binding(1) var<storage, read_write> token: array<u32>;
@group(0) @binding(2) var<storage, read_write> pos: array<u32>;
@group(0) @binding(3) var<storage, read_write> history: array<u32>;
@group(1) @binding(0) var<storage, read> args: Args;

@compute @workgroup_size(1)
fn advance() {
    let t = next[args.off[0]];
    let p = pos[args.off[2]];
    if p < args.cap {
        history[args.off[3] + p] = t;
    }
    token[args.off[1]] = t;
    pos[args.off[2]] = p + 1u;
}
