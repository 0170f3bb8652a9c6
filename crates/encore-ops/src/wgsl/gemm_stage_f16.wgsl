// gemm_stage.wgsl's version for devices with f16 arithmetic (the source
// begins with `enable f16;`): tiles of f16. Values beyond f16's range are
// held at its largest finite value (WGSL leaves the conversion of such
// values undefined); matmul.wgsl computes an activation row that holds one
// apart, in f32.
alias stage = f16;

// Whether a tile element has a narrower range than the f32 activations.
const STAGE_NARROW: bool = true;

// `v` as a tile element, rounded to f16.
fn to_stage(v: f32) -> stage {
    return f16(clamp(v, -65504.0, 65504.0));
}
