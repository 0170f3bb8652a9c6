// GGUF weights read out of `array<u32>` bindings and dequantized, for every
// weight type Encore supports (their layouts: `dtype.rs`, `cpu/kquant.rs`).
//
// The including kernel defines `fn weight_word(sel: u32, i: u32) -> u32`,
// word `i` of the weight binding `sel` (a kernel with several weight
// arguments picks one by `sel`; WGSL functions cannot take storage
// pointers). Addresses here are byte addresses within that binding. Blocks
// are 18 to 210 bytes, most only 2-byte aligned, so every field is cut out
// of the words that hold it with shifts.
//
// `decode8` reads eight consecutive weights of a row (from an element that
// is a multiple of 8) as integer codes `q` (or the values themselves, for
// float types) with a scale `d` and an offset `m`: weight `t` is
// `d * q[t] + m`. `d` and `m` are formed as the CPU's dequantization forms
// them (the super-blocks' `d * sc` and `-(dmin * mn)`), so `d * q + m`
// unfused gives the CPU's value bit for bit.

const GGML_F32: u32 = 0u;
const GGML_F16: u32 = 1u;
const GGML_Q4_0: u32 = 2u;
const GGML_Q4_1: u32 = 3u;
const GGML_Q5_0: u32 = 6u;
const GGML_Q5_1: u32 = 7u;
const GGML_Q8_0: u32 = 8u;
const GGML_Q2_K: u32 = 10u;
const GGML_Q3_K: u32 = 11u;
const GGML_Q4_K: u32 = 12u;
const GGML_Q5_K: u32 = 13u;
const GGML_Q6_K: u32 = 14u;
const GGML_IQ4_NL: u32 = 20u;
const GGML_IQ4_XS: u32 = 23u;
const GGML_BF16: u32 = 30u;

// Weights per block (1 for floats; 0 for a type without code here).
fn block_len(dtype: u32) -> u32 {
    switch dtype {
        case GGML_F32, GGML_F16, GGML_BF16: { return 1u; }
        case GGML_Q8_0, GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_IQ4_NL: { return 32u; }
        case GGML_Q2_K, GGML_Q3_K, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K, GGML_IQ4_XS: { return 256u; }
        default: { return 0u; }
    }
}

// Bytes per block.
fn block_bytes(dtype: u32) -> u32 {
    switch dtype {
        case GGML_F32: { return 4u; }
        case GGML_F16, GGML_BF16: { return 2u; }
        case GGML_Q8_0: { return 34u; }
        case GGML_Q4_0, GGML_IQ4_NL: { return 18u; }
        case GGML_Q4_1: { return 20u; }
        case GGML_Q5_0: { return 22u; }
        case GGML_Q5_1: { return 24u; }
        case GGML_Q2_K: { return 84u; }
        case GGML_Q3_K: { return 110u; }
        case GGML_Q4_K: { return 144u; }
        case GGML_Q5_K: { return 176u; }
        case GGML_Q6_K: { return 210u; }
        case GGML_IQ4_XS: { return 136u; }
        default: { return 0u; }
    }
}

// Bytes of one row of `k` weights.
fn row_bytes(dtype: u32, k: u32) -> u32 {
    return (k / max(block_len(dtype), 1u)) * block_bytes(dtype);
}

// The byte at `a`.
fn w_byte(sel: u32, a: u32) -> u32 {
    return (weight_word(sel, a >> 2u) >> ((a & 3u) * 8u)) & 0xffu;
}

// The f16 at `a` (even) as f32.
fn w_f16(sel: u32, a: u32) -> f32 {
    let h = (weight_word(sel, a >> 2u) >> ((a & 2u) * 8u)) & 0xffffu;
    return unpack2x16float(h).x;
}

// The word of bytes `lo` and `hi` (consecutive words) from byte `s / 8` of `lo` on.
fn funnel(lo: u32, hi: u32, s: u32) -> u32 {
    return select((lo >> s) | (hi << (32u - s)), lo, s == 0u);
}

// Four bytes from `a` on as a little-endian word.
fn w_bytes4(sel: u32, a: u32) -> u32 {
    let i = a >> 2u;
    return funnel(weight_word(sel, i), weight_word(sel, i + 1u), (a & 3u) * 8u);
}

// Eight bytes from `a` on as two little-endian words.
fn w_bytes8(sel: u32, a: u32) -> vec2<u32> {
    let i = a >> 2u;
    let s = (a & 3u) * 8u;
    let w0 = weight_word(sel, i);
    let w1 = weight_word(sel, i + 1u);
    let w2 = weight_word(sel, i + 2u);
    return vec2<u32>(funnel(w0, w1, s), funnel(w1, w2, s));
}

// Sixteen bytes from `a` (even) on as four little-endian words.
fn w_bytes16(sel: u32, a: u32) -> vec4<u32> {
    let i = a >> 2u;
    let s = (a & 3u) * 8u;
    let w0 = weight_word(sel, i);
    let w1 = weight_word(sel, i + 1u);
    let w2 = weight_word(sel, i + 2u);
    let w3 = weight_word(sel, i + 3u);
    let w4 = weight_word(sel, i + 4u);
    return vec4<u32>(funnel(w0, w1, s), funnel(w1, w2, s), funnel(w2, w3, s), funnel(w3, w4, s));
}

const BYTE_SHIFTS: vec4<u32> = vec4<u32>(0u, 8u, 16u, 24u);

// Bits `sh..sh + bits` of each byte of `v`, low byte first.
fn fields4(v: u32, sh: u32, mask: u32) -> vec4<u32> {
    return (vec4<u32>(v) >> (BYTE_SHIFTS + vec4<u32>(sh))) & vec4<u32>(mask);
}

// The bytes of `v` as signed integers.
fn signed_bytes4(v: u32) -> vec4<f32> {
    let b = vec4<i32>(bitcast<i32>(v)) << (vec4<u32>(24u) - BYTE_SHIFTS);
    return vec4<f32>(b >> vec4<u32>(24u));
}

// The IQ4 levels (-127..113) of four nibbles, from the table packed as
// signed bytes four to a word.
fn iq4_levels4(n: vec4<u32>) -> vec4<f32> {
    let upper = (n & vec4<u32>(4u)) != vec4<u32>(0u);
    let low = select(vec4<u32>(0xbfad9881u), vec4<u32>(0xf6eaddcfu), upper);
    let high = select(vec4<u32>(0x26190d01u), vec4<u32>(0x71594535u), upper);
    let word = select(low, high, n >= vec4<u32>(8u));
    let b = bitcast<vec4<i32>>(word) << (vec4<u32>(24u) - (n & vec4<u32>(3u)) * 8u);
    return vec4<f32>(b >> vec4<u32>(24u));
}

// Eight weights as `d * q + m`.
struct Dec8 {
    lo: vec4<f32>,
    hi: vec4<f32>,
    d: f32,
    m: f32,
}

// Bit `b + t` of `bits` for t = 0..4, as a vector.
fn bits4(bits: u32, b: u32) -> vec4<u32> {
    return (vec4<u32>(bits) >> (vec4<u32>(b) + vec4<u32>(0u, 1u, 2u, 3u))) & vec4<u32>(1u);
}

// Eight consecutive weights, elements `e..e + 8` (e a multiple of 8) of
// the row of type `dtype` that begins at byte `row` of binding `sel`. A
// type without code here reads as zeros.
fn decode8(sel: u32, row: u32, e: u32, dtype: u32) -> Dec8 {
    var o = Dec8(vec4<f32>(0.0), vec4<f32>(0.0), 1.0, 0.0);
    let bl = max(block_len(dtype), 1u);
    let blk = row + (e / bl) * block_bytes(dtype);
    let i = e % bl;
    switch dtype {
        case GGML_F32: {
            let a = (row >> 2u) + e;
            o.lo = bitcast<vec4<f32>>(vec4<u32>(weight_word(sel, a), weight_word(sel, a + 1u),
                weight_word(sel, a + 2u), weight_word(sel, a + 3u)));
            o.hi = bitcast<vec4<f32>>(vec4<u32>(weight_word(sel, a + 4u), weight_word(sel, a + 5u),
                weight_word(sel, a + 6u), weight_word(sel, a + 7u)));
        }
        case GGML_F16: {
            let v = w_bytes16(sel, row + 2u * e);
            o.lo = vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
            o.hi = vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w));
        }
        case GGML_BF16: {
            let v = w_bytes16(sel, row + 2u * e);
            let m = vec4<u32>(0xffff0000u);
            o.lo = bitcast<vec4<f32>>(vec4<u32>(v.x << 16u, v.x, v.y << 16u, v.y) & m);
            o.hi = bitcast<vec4<f32>>(vec4<u32>(v.z << 16u, v.z, v.w << 16u, v.w) & m);
        }
        case GGML_Q8_0: {
            let v = w_bytes8(sel, blk + 2u + i);
            o.lo = signed_bytes4(v.x);
            o.hi = signed_bytes4(v.y);
            o.d = w_f16(sel, blk);
        }
        case GGML_Q4_0, GGML_Q4_1, GGML_IQ4_NL: {
            // Byte j of qs: weight j (low nibble) and j + 16 (high).
            let qs = select(2u, 4u, dtype == GGML_Q4_1);
            let v = w_bytes8(sel, blk + qs + (i & 15u));
            let sh = select(0u, 4u, i >= 16u);
            let a = fields4(v.x, sh, 15u);
            let b = fields4(v.y, sh, 15u);
            if dtype == GGML_IQ4_NL {
                o.lo = iq4_levels4(a);
                o.hi = iq4_levels4(b);
            } else if dtype == GGML_Q4_0 {
                o.lo = vec4<f32>(a) - 8.0;
                o.hi = vec4<f32>(b) - 8.0;
            } else {
                o.lo = vec4<f32>(a);
                o.hi = vec4<f32>(b);
                o.m = w_f16(sel, blk + 2u);
            }
            o.d = w_f16(sel, blk);
        }
        case GGML_Q5_0, GGML_Q5_1: {
            // Q4's nibbles with a fifth bit: bit i of qh for weight i.
            let one = dtype == GGML_Q5_1;
            let qh = w_bytes4(sel, blk + select(2u, 4u, one));
            let v = w_bytes8(sel, blk + select(6u, 8u, one) + (i & 15u));
            let sh = select(0u, 4u, i >= 16u);
            let a = fields4(v.x, sh, 15u) | (bits4(qh, i) << vec4<u32>(4u));
            let b = fields4(v.y, sh, 15u) | (bits4(qh, i + 4u) << vec4<u32>(4u));
            let bias = select(16.0, 0.0, one);
            o.lo = vec4<f32>(a) - bias;
            o.hi = vec4<f32>(b) - bias;
            o.d = w_f16(sel, blk);
            if one {
                o.m = w_f16(sel, blk + 2u);
            }
        }
        case GGML_Q2_K: {
            // Weight 128h + 32s + l: bits 2s..2s+2 of qs[32h + l].
            let h = i / 128u;
            let s = (i % 128u) / 32u;
            let l = i % 32u;
            let v = w_bytes8(sel, blk + 16u + 32u * h + l);
            o.lo = vec4<f32>(fields4(v.x, 2u * s, 3u));
            o.hi = vec4<f32>(fields4(v.y, 2u * s, 3u));
            let sc = w_byte(sel, blk + i / 16u);
            o.d = w_f16(sel, blk + 80u) * f32(sc & 15u);
            o.m = -(w_f16(sel, blk + 82u) * f32(sc >> 4u));
        }
        case GGML_Q3_K: {
            // Q2_K's two low bits, minus 4 unless bit 4h + s of hmask[l] is set.
            let h = i / 128u;
            let s = (i % 128u) / 32u;
            let l = i % 32u;
            let g = i / 16u;
            let v = w_bytes8(sel, blk + 32u + 32u * h + l);
            let hm = w_bytes8(sel, blk + l);
            let hb = 4u * h + s;
            o.lo = vec4<f32>(fields4(v.x, 2u * s, 3u)) - 4.0 + 4.0 * vec4<f32>(fields4(hm.x, hb, 1u));
            o.hi = vec4<f32>(fields4(v.y, 2u * s, 3u)) - 4.0 + 4.0 * vec4<f32>(fields4(hm.y, hb, 1u));
            let low = (w_byte(sel, blk + 96u + g % 8u) >> select(0u, 4u, g >= 8u)) & 15u;
            let high = (w_byte(sel, blk + 104u + g % 4u) >> (2u * (g / 4u))) & 3u;
            o.d = w_f16(sel, blk + 108u) * f32(i32(low | (high << 4u)) - 32);
        }
        case GGML_Q4_K, GGML_Q5_K: {
            // qs byte 32c + l: weight 64c + l (low nibble), 64c + 32 + l (high);
            // Q5_K's fifth bit at bit 2c (+1 for the high nibble) of qh[l].
            let c = i / 64u;
            let up = (i % 64u) / 32u;
            let j = i / 32u;
            let l = i % 32u;
            let five = dtype == GGML_Q5_K;
            let v = w_bytes8(sel, blk + select(16u, 48u, five) + 32u * c + l);
            var a = fields4(v.x, 4u * up, 15u);
            var b = fields4(v.y, 4u * up, 15u);
            if five {
                let qh = w_bytes8(sel, blk + 16u + l);
                a |= fields4(qh.x, 2u * c + up, 1u) << vec4<u32>(4u);
                b |= fields4(qh.y, 2u * c + up, 1u) << vec4<u32>(4u);
            }
            o.lo = vec4<f32>(a);
            o.hi = vec4<f32>(b);
            var sc: u32;
            var mn: u32;
            if j < 4u {
                sc = w_byte(sel, blk + 4u + j) & 63u;
                mn = w_byte(sel, blk + 8u + j) & 63u;
            } else {
                let packed = w_byte(sel, blk + 8u + j);
                sc = (packed & 15u) | ((w_byte(sel, blk + j) >> 6u) << 4u);
                mn = (packed >> 4u) | ((w_byte(sel, blk + 4u + j) >> 6u) << 4u);
            }
            o.d = w_f16(sel, blk) * f32(sc);
            o.m = -(w_f16(sel, blk + 2u) * f32(mn));
        }
        case GGML_Q6_K: {
            // Weight 128h + 32s + l: low four bits in nibble s / 2 of
            // ql[64h + 32(s % 2) + l], high two at bit 2s of qh[32h + l].
            let h = i / 128u;
            let s = (i % 128u) / 32u;
            let l = i % 32u;
            let ql = w_bytes8(sel, blk + 64u * h + 32u * (s % 2u) + l);
            let qh = w_bytes8(sel, blk + 128u + 32u * h + l);
            let sh = select(0u, 4u, s >= 2u);
            let a = fields4(ql.x, sh, 15u) | (fields4(qh.x, 2u * s, 3u) << vec4<u32>(4u));
            let b = fields4(ql.y, sh, 15u) | (fields4(qh.y, 2u * s, 3u) << vec4<u32>(4u));
            o.lo = vec4<f32>(a) - 32.0;
            o.hi = vec4<f32>(b) - 32.0;
            let sc = (bitcast<i32>(w_byte(sel, blk + 192u + i / 16u)) << 24u) >> 24u;
            o.d = w_f16(sel, blk + 208u) * f32(sc);
        }
        case GGML_IQ4_XS: {
            // Sub-block b of 32 is IQ4_NL's layout in qs[16b..16b + 16].
            let b = i / 32u;
            let j = i % 32u;
            let v = w_bytes8(sel, blk + 8u + 16u * b + (j & 15u));
            let sh = select(0u, 4u, j >= 16u);
            o.lo = iq4_levels4(fields4(v.x, sh, 15u));
            o.hi = iq4_levels4(fields4(v.y, sh, 15u));
            let low = (w_byte(sel, blk + 4u + b / 2u) >> (4u * (b % 2u))) & 15u;
            let scales_h = w_byte(sel, blk + 2u) | (w_byte(sel, blk + 3u) << 8u);
            let high = (scales_h >> (2u * b)) & 3u;
            o.d = w_f16(sel, blk) * f32(i32(low | (high << 4u)) - 32);
        }
        default: {
            o.d = 0.0;
        }
    }
    return o;
}

// Element `e` of a row of floats (F32, F16 or BF16) that begins at byte
// `row`: the elements past the last whole eight, which `decode8` does not
// reach in rows whose length is not a multiple of 8.
fn float_at(sel: u32, row: u32, e: u32, dtype: u32) -> f32 {
    switch dtype {
        case GGML_F32: {
            return bitcast<f32>(weight_word(sel, (row >> 2u) + e));
        }
        case GGML_F16: {
            return w_f16(sel, row + 2u * e);
        }
        case GGML_BF16: {
            let a = row + 2u * e;
            let h = (weight_word(sel, a >> 2u) >> ((a & 2u) * 8u)) & 0xffffu;
            return bitcast<f32>(h << 16u);
        }
        default: {
            return 0.0;
        }
    }
}
