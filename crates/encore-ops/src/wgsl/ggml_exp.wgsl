// `e^x` as ggml's AVX2 `ggml_v_expf` computes it (the CPU's `ggml_expf`,
// cpu/kernels/elementwise.rs): a polynomial within about 1.5 ulp of `exp`
// over the whole range. WGSL's `exp` promises only an error that grows
// with |x|; this keeps the GPU's activations within an ulp or two of the
// CPU's on every device. Two steps differ in form, not in value: ggml
// rounds `x log2(e)` to an integer by adding and subtracting 1.5 * 2^23,
// which a compiler may fold away (lavapipe's does), so `round` does it
// here, and the scale `2^n` is built from `n` itself. `fma` need not fuse;
// the products it takes here are exact or small enough that the result
// moves by an ulp at most.
fn ggml_expf(x: f32) -> f32 {
    let n = round(x * bitcast<f32>(0x3fb8aa3bu)); // log2(e)
    let b = fma(-n, bitcast<f32>(0x35bfbe8eu), fma(-n, bitcast<f32>(0x3f317200u), x));
    // `2^n` in the exponent field (wrapping, as ggml's shift of the
    // rounded sum does, for the split below).
    let e = bitcast<u32>(i32(n)) << 23u;
    let k = bitcast<f32>(e + 0x3f800000u);
    let u = b * b;
    let j = fma(
        fma(fma(bitcast<f32>(0x3c072010u), b, bitcast<f32>(0x3d2b9f17u)), u,
            fma(bitcast<f32>(0x3e2aaf33u), b, bitcast<f32>(0x3efffedbu))),
        u,
        bitcast<f32>(0x3f7ffff6u) * b);
    if abs(n) <= 126.0 {
        return fma(k, j, k);
    }
    // Past 2^126 the scale `k` would overflow: split it in two factors.
    let g = select(0u, 0x82000000u, n <= 0.0);
    let s1 = bitcast<f32>(g + 0x7f000000u);
    let s2 = bitcast<f32>(e - g);
    if abs(n) > 192.0 {
        return s1 * s1;
    }
    return fma(s2, j, s2) * s1;
}
