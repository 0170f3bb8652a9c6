// Rotary position embedding, shared by `rope` and `rope_store`: the shape,
// the angle of a pair and its sine and cosine, as the CPU's `rope_head`
// (cpu/kernels/rope.rs) computes them.

struct RopeShape {
    rows: u32,
    heads: u32,
    head_dim: u32,
    rope_dim: u32,
    base: f32,
    // 1 for the NeoX layout, 0 for the normal one.
    neox: u32,
    // `base^(-2 / rope_dim)` as the CPU computes it.
    theta_scale: f32,
    // 1: `rope` divides each angle by its factor.
    factors: u32,
}

// Whether a shape is one the kernels rotate: `rope_dim` even and within
// the head (`Ops::rope` rejects the others before dispatch).
fn rope_shape_ok(s: RopeShape) -> bool {
    return s.rope_dim <= s.head_dim && (s.rope_dim & 1u) == 0u;
}

// The angle of pair `i` at position `p`: `p * theta_scale^i` by the CPU's
// f32 recurrence, one rounded product a step.
fn rope_theta(s: RopeShape, i: u32, p: u32) -> f32 {
    var theta = f32(p);
    for (var t = 0u; t < i; t++) {
        theta = theta * s.theta_scale;
    }
    return theta;
}

// The sine and cosine of `y`, within a few ulp of the correctly rounded
// ones for every angle RoPE makes (below 2^17): WGSL's `sin` and `cos`
// promise accuracy only within [-pi, pi] and GPUs differ past it, so the
// angle is reduced here by `n` times pi/2 and the quadrant's polynomial
// (Cephes' `sinf` and `cosf`, for |r| <= pi/4) is evaluated. WGSL's `fma`
// need not fuse (lavapipe's does not), so the reduction takes pi/2 in five
// parts, the first four of 7 significant bits, whose products with `n` are
// exact in plain f32 (Cody and Waite's method); each subtraction is exact
// but the last two, which round once each.
fn rope_sincos(y: f32) -> vec2<f32> {
    let n = round(y * bitcast<f32>(0x3f22f983u)); // 2/pi
    var r = y - n * bitcast<f32>(0x3fc80000u);
    r = r - n * bitcast<f32>(0x3c060000u);
    r = r - n * bitcast<f32>(0x38f60000u);
    r = r - n * bitcast<f32>(0x34a80000u);
    r = r - n * bitcast<f32>(0x30885a31u);
    let z = r * r;
    let sn = fma(fma(fma(-1.9515295891e-4, z, 8.3321608736e-3), z, -1.6666654611e-1) * z, r, r);
    let cs = fma(fma(fma(2.443315711809948e-5, z, -1.388731625493765e-3), z, 4.166664568298827e-2) * z, z, fma(-0.5, z, 1.0));
    switch i32(n) & 3 {
        case 0: { return vec2<f32>(sn, cs); }
        case 1: { return vec2<f32>(cs, -sn); }
        case 2: { return vec2<f32>(-sn, -cs); }
        default: { return vec2<f32>(-cs, sn); }
    }
}

// The element indices of rotated pair `i` of a head.
fn rope_index(s: RopeShape, i: u32) -> vec2<u32> {
    if s.neox != 0u {
        return vec2<u32>(i, i + s.rope_dim / 2u);
    }
    return vec2<u32>(2u * i, 2u * i + 1u);
}

// The pair that element `j` (below `rope_dim`) of a head belongs to, and
// whether `j` is the pair's second element (1) or its first (0).
fn rope_pair_of(s: RopeShape, j: u32) -> vec2<u32> {
    if s.neox != 0u {
        let half = s.rope_dim / 2u;
        if j >= half {
            return vec2<u32>(j - half, 1u);
        }
        return vec2<u32>(j, 0u);
    }
    return vec2<u32>(j / 2u, j & 1u);
}

// The pair `(a, b)` rotated by the angle whose sine and cosine are `sc`:
// each output a multiply-add over the other product, rounded alone, as on
// the CPU (fused where the device fuses `fma`).
fn rope_apply(a: f32, b: f32, sc: vec2<f32>) -> vec2<f32> {
    return vec2<f32>(fma(a, sc.y, -(b * sc.x)), fma(a, sc.x, b * sc.y));
}

// Element `pair.y` of pair `pair.x` (from `rope_pair_of`) after the
// rotation at position `p`, the pair's elements being `(a, b)` (at
// `rope_index(s, pair.x)` of the head).
fn rope_element(s: RopeShape, pair: vec2<u32>, a: f32, b: f32, p: u32) -> f32 {
    let v = rope_apply(a, b, rope_sincos(rope_theta(s, pair.x, p)));
    return select(v.x, v.y, pair.y == 1u);
}
