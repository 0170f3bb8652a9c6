// gemm_stage.wgsl's version for devices with f16 arithmetic (the source
// begins with `enable f16;`): tiles of f16. Values beyond f16's range are
// held at its largest finite value (WGSL leaves the conversion of such
// values undefined).
alias stage = f16;

// `v` as a tile element, rounded to f16.
fn to_stage(v: f32) -> stage {
    return f16(clamp(v, -65504.0, 65504.0));
}
