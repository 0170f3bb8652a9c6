// The attention kernels' shape (`AttnShape` in `kernels/attention.rs`).

struct AttnShape {
    rows: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    max_seq: u32,
    scale: f32,
    window: u32,
}
