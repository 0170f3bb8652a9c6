// The element type of the tiled product's workgroup tiles (matmul.wgsl's
// `gemm_tile`): f32 here. gemm_stage_f16.wgsl, the version for devices with
// f16 arithmetic, makes it f16, which halves the tiles' workgroup memory and
// the traffic through it; the tiles' values are then multiplied as f32 (a
// product of two f16 values is exact in f32) and summed in f32, as tensor
// cores do.
alias stage = f32;

// Whether a tile element has a narrower range than the f32 activations (in
// which case matmul.wgsl computes rows beyond it apart, in f32).
const STAGE_NARROW: bool = false;

// `v` as a tile element.
fn to_stage(v: f32) -> stage {
    return v;
}
