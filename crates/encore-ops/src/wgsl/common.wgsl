// What several kernels share.

// The index of an invocation in a launch of `linear_launch`: the grid's
// x dimension holds at most 65,535 workgroups of `size` invocations, and
// the y dimension counts rows of them.
fn linear_index(gid: vec3<u32>, groups: vec3<u32>, size: u32) -> u32 {
    return gid.y * groups.x * size + gid.x;
}
