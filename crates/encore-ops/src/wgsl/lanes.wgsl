// How a product's workgroup lays its invocations over its columns and how a
// column's lanes meet (matmul.wgsl and fused_matmul.wgsl, which need
// MATMUL_LANES and MATMUL_THREADS): this version without subgroup
// operations; lanes_subgroups.wgsl defines the same with them, and Rust
// builds each product with either (`wgsl/mod.rs`).
//
// A column's lanes each leave partial sums in workgroup memory, at slots
// `column * MATMUL_LANES + i` for `i < column_parts`, and one invocation
// adds a column's parts. Here every lane leaves its own.

// The invocation ids the products take, as one entry point parameter.
struct Lanes {
    @builtin(local_invocation_index) lid: u32,
}

// The invocation's column within the workgroup (x) and lane within the column (y).
fn column_lane(ids: Lanes) -> vec2<u32> {
    return vec2<u32>(ids.lid / MATMUL_LANES, ids.lid % MATMUL_LANES);
}

// How many parts a column leaves.
fn column_parts(ids: Lanes) -> u32 {
    return MATMUL_LANES;
}

// The part a lane's partial sum `v` contributes, which the invocation stores
// at `part_slot` where `stores_part`.
fn lane_part(ids: Lanes, v: f32) -> f32 {
    return v;
}

fn stores_part(ids: Lanes) -> bool {
    return true;
}

fn part_slot(ids: Lanes) -> u32 {
    return ids.lid;
}
