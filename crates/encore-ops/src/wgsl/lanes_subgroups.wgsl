// lanes.wgsl's functions with subgroup operations (for devices with wgpu's
// SUBGROUP feature): where the workgroup's subgroups are
// full and each column's lanes are whole subgroups, a column's lanes are
// its subgroups' invocations, each subgroup adds its lanes' sums with
// `subgroupAdd` and leaves one part, so the invocation that finishes a
// column adds `MATMUL_LANES / subgroup_size` parts instead of MATMUL_LANES.
// Elsewhere (subgroups wider than a column, or not full) the lanes go as in
// lanes.wgsl. The choice depends only on the subgroup size and count, the
// same for every invocation of the workgroup, so the products' barriers stay
// in uniform control flow.

struct Lanes {
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_invocation_id) sid: u32,
    @builtin(subgroup_size) size: u32,
    @builtin(subgroup_id) group: u32,
    @builtin(num_subgroups) groups: u32,
}

// Whether the columns' lanes are whole subgroups.
fn subgroup_lanes(ids: Lanes) -> bool {
    return ids.size * ids.groups == MATMUL_THREADS && MATMUL_LANES % ids.size == 0u;
}

fn column_lane(ids: Lanes) -> vec2<u32> {
    if subgroup_lanes(ids) {
        let per = MATMUL_LANES / ids.size;
        return vec2<u32>(ids.group / per, (ids.group % per) * ids.size + ids.sid);
    }
    return vec2<u32>(ids.lid / MATMUL_LANES, ids.lid % MATMUL_LANES);
}

fn column_parts(ids: Lanes) -> u32 {
    return select(MATMUL_LANES, MATMUL_LANES / ids.size, subgroup_lanes(ids));
}

fn lane_part(ids: Lanes, v: f32) -> f32 {
    if subgroup_lanes(ids) {
        return subgroupAdd(v);
    }
    return v;
}

fn stores_part(ids: Lanes) -> bool {
    return !subgroup_lanes(ids) || ids.sid == 0u;
}

fn part_slot(ids: Lanes) -> u32 {
    if subgroup_lanes(ids) {
        let per = MATMUL_LANES / ids.size;
        return (ids.group / per) * MATMUL_LANES + ids.group % per;
    }
    return ids.lid;
}
