// f16 values in f32 kernels. WGSL's `pack2x16float` leaves the rounding
// direction and out-of-range results to the implementation, so the
// conversion to f16 is written out here, rounding to nearest even as the
// CPU (the `half` crate, x86's F16C) does; `unpack2x16float` is exact.
// A buffer of f16 is bound as `array<u32>`, element `e` in half `e & 1` of
// word `e >> 1` (little-endian); the runtime binds arguments only at
// 4-byte offsets, so element 0 of an argument is always a word's first half.

// The bits of `v` rounded to the nearest f16, ties to even: overflow to
// infinity, subnormals rounded, a NaN kept quiet with its high payload.
fn f16_bits(v: f32) -> u32 {
    let x = bitcast<u32>(v);
    let sign = (x >> 16u) & 0x8000u;
    let a = x & 0x7fffffffu;
    if a >= 0x47800000u {
        // At least 2^16: infinity, or a NaN.
        if a > 0x7f800000u {
            return sign | 0x7e00u | ((a & 0x7fffffu) >> 13u);
        }
        return sign | 0x7c00u;
    }
    if a < 0x38800000u {
        // Below f16's smallest normal, 2^-14: a subnormal or zero, in units
        // of 2^-24.
        let shift = 126u - (a >> 23u);
        if shift > 24u {
            return sign;
        }
        let m = (a & 0x7fffffu) | 0x800000u;
        let r = m >> shift;
        let rest = m & ((1u << shift) - 1u);
        let half = 1u << (shift - 1u);
        let up = rest > half || (rest == half && (r & 1u) == 1u);
        return sign | (r + select(0u, 1u, up));
    }
    // Normal: rebias the exponent and round the 13 dropped bits; a carry
    // moves into the exponent, up to infinity.
    let odd = (a >> 13u) & 1u;
    return sign | ((a - 0x38000000u + 0xfffu + odd) >> 13u);
}

// `v` rounded to the nearest f16, as an f32.
fn round_f16(v: f32) -> f32 {
    return unpack2x16float(f16_bits(v)).x;
}
