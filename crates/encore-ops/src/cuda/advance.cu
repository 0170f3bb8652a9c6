// `advance`: the bookkeeping of one greedy decode step on the device: the
// step's argmax becomes the next input token, is appended to a history of
// tokens at the current position, and the position moves on by one.
//
// Arguments: `next: u32[1]` (read, the argmax), `token: u32[1]` (write, the
// token parameter), `pos: u32[1]` (read-write, the position parameter),
// `history: u32[cap]` (write), `cap: u32` (value). A position at or past
// `cap` appends nothing (the position still moves on). One thread does it all.

extern "C" __global__ void advance(const unsigned int* __restrict__ next, unsigned int* __restrict__ token,
                                   unsigned int* __restrict__ pos, unsigned int* __restrict__ history,
                                   unsigned int cap) {
    encore_grid_wait();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const unsigned int t = next[0], p = pos[0];
    if (p < cap) history[p] = t;
    token[0] = t;
    pos[0] = p + 1;
}
