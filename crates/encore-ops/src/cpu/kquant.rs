//! The super-block weight types, K-quants (Q2_K to Q6_K) and IQ4_XS: their
//! layouts, their dequantization, and the Q8_K activations that their dot
//! products take.
//!
//! A super-block holds 256 weights in 16 groups of 16 consecutive weights
//! (sub-blocks of 32 span two groups). Each type unpacks ([`SuperBlock::unpack`])
//! to one form, [`Unpacked`]:
//!
//! `w[i] = d * scale[i / 16] * code[i] - dmin * min[i / 16]`
//!
//! with integer codes, scales and minimums, and f32 `d` and `dmin` (the
//! block's f16 fields; `dmin = 0` for the types without minimums). Where the
//! bits lie (`l` counts 0..32, `h` the halves of 128 weights, `s` 0..4):
//!
//! - Q4_K: `qs` byte `32c + l` holds weight `64c + l` in its low nibble and
//!   `64c + 32 + l` in its high one. `scales` packs eight 6-bit scales and
//!   eight 6-bit minimums, one each per sub-block `j` of 32: for `j < 4`,
//!   `sc = scales[j] & 63` and `m = scales[j + 4] & 63`; for `j >= 4`,
//!   `sc = scales[j + 4] & 15 | (scales[j - 4] >> 6) << 4` and
//!   `m = scales[j + 4] >> 4 | (scales[j] >> 6) << 4`.
//! - Q5_K: Q4_K's, plus a fifth bit (16) from `qh[l]`: bit `2c` for weight
//!   `64c + l`, bit `2c + 1` for weight `64c + 32 + l`.
//! - Q6_K: weight `128h + 32s + l` has its low four bits in the low (`s < 2`)
//!   or high (`s >= 2`) nibble of `ql[64h + 32(s % 2) + l]` and its high two
//!   bits at bit `2s` of `qh[32h + l]`; code = that - 32; one i8 scale per group.
//! - Q2_K: weight `128h + 32s + l` is bits `2s..2s+2` of `qs[32h + l]`; group
//!   `g` has scale `scales[g] & 15` and minimum `scales[g] >> 4`.
//! - Q3_K: Q2_K's two low bits, minus 4 unless bit `4h + s` of `hmask[l]` is
//!   set. Group `g`'s 6-bit scale, minus 32, has its low four bits in the
//!   low (`g < 8`) or high nibble of `scales[g % 8]` and its high two at bit
//!   `2 (g / 4)` of `scales[8 + g % 4]`.
//! - IQ4_XS: sub-block `b` of 32 is IQ4_NL's layout in `qs[16b..16b + 16]`,
//!   codes from [`IQ4_LEVELS`]; its 6-bit scale, minus 32, has its low four
//!   bits in nibble `b % 2` of `scales_l[b / 2]` and its high two at bit
//!   `2b` of `scales_h`.
//!
//! The dot products quantize the activations as ggml does for these types,
//! to [`BlockQ8K`], and sum each super-block in integers:
//! `sumi = Σ_g scale[g] Σ_i code[i] q[i]` and `summ = Σ_g min[g] bsums[g]`,
//! then add `(d_w d_x) sumi - (dmin_w d_x) summ` ([`accumulate`]) to the
//! row's f32 sum, one super-block after another, on every instruction set.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::QuantError;

/// Weights per super-block, and activations per [`BlockQ8K`].
pub(crate) const SUPER: usize = 256;

/// The 16 levels of the IQ4 types (IQ4_NL, IQ4_XS), indexed by a weight's nibble.
pub const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// 256 activations quantized for the super-block dot products (ggml's
/// Q8_K): `x[i] ≈ d * qs[i]`, and `bsums[g]` is the sum of `qs[16g..16g + 16]`.
///
/// Made as ggml makes it (`quantize_row_q8_K_ref`, which its x86 build
/// uses): with `max` the first value of largest magnitude, `iscale = -128 /
/// max`, `qs[i] = min(127, round_ties_even(iscale * x[i]))` and
/// `d = 1 / iscale`, kept in f32. The value at `max` becomes -128.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; SUPER],
    pub bsums: [i16; 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        Self::zeroed()
    }
}

/// Quantizes `src` to Q8_K blocks, 256 values per block (see [`BlockQ8K`]).
///
/// # Errors
/// [`QuantError::Length`] unless `src.len() == 256 * dst.len()`.
pub fn quantize_row_q8_k(src: &[f32], dst: &mut [BlockQ8K]) -> Result<(), QuantError> {
    if src.len() != dst.len() * SUPER {
        return Err(QuantError::Length {
            what: "activations to quantize",
            expected: dst.len() * SUPER,
            actual: src.len(),
        });
    }
    for (x, out) in src.chunks_exact(SUPER).zip(dst) {
        quantize_block(x, out);
    }
    Ok(())
}

fn quantize_block(x: &[f32], out: &mut BlockQ8K) {
    // The largest magnitude, NaN left out, as an integer maximum of the bits
    // (which orders non-negative floats and vectorizes); then the first value
    // of that magnitude.
    let bits = x
        .iter()
        .map(|v| v.to_bits() & 0x7fff_ffff)
        .map(|b| if b > 0x7f80_0000 { 0 } else { b })
        .fold(0, u32::max);
    let amax = f32::from_bits(bits);
    let max = x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0);
    if amax == 0.0 {
        *out = BlockQ8K::zeroed();
        return;
    }
    let iscale = -128.0 / max;
    for (q, &v) in out.qs.iter_mut().zip(x) {
        // Rounded to the nearest integer, ties to even, as ggml's `nearest_int`
        // does (exact for magnitudes below 2^22; these are within 128): adding
        // 1.5 * 2^23 leaves the integer in the low mantissa bits. Unlike
        // `round_ties_even`, this vectorizes.
        let rounded = ((iscale * v + 12_582_912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000;
        *q = rounded.min(127) as i8;
    }
    for (sum, group) in out.bsums.iter_mut().zip(out.qs.chunks_exact(16)) {
        *sum = group.iter().map(|&q| i16::from(q)).sum();
    }
    out.d = 1.0 / iscale;
}

/// A super-block in integers: weight `i` is
/// `d * scales[i / 16] * codes[i] - dmin * mins[i / 16]`.
pub(crate) struct Unpacked {
    pub d: f32,
    pub dmin: f32,
    pub codes: [i8; SUPER],
    pub scales: [i16; 16],
    pub mins: [i16; 16],
}

impl Unpacked {
    fn new(d: [u8; 2], dmin: [u8; 2]) -> Unpacked {
        Unpacked {
            d: f16::from_le_bytes(d).to_f32(),
            dmin: f16::from_le_bytes(dmin).to_f32(),
            codes: [0; SUPER],
            scales: [0; 16],
            mins: [0; 16],
        }
    }

    /// Writes the 256 weights to `out`, each as `(d * scale) * code - dmin * min`
    /// in f32, as ggml's dequantization forms them.
    pub(crate) fn dequantize(&self, out: &mut [f32]) {
        for ((group, codes), (&sc, &m)) in out
            .chunks_exact_mut(16)
            .zip(self.codes.chunks_exact(16))
            .zip(self.scales.iter().zip(&self.mins))
        {
            let (dl, ml) = (self.d * f32::from(sc), self.dmin * f32::from(m));
            for (w, &q) in group.iter_mut().zip(codes) {
                *w = dl * f32::from(q) - ml;
            }
        }
    }

    /// `(sumi, summ)` of this block with activations `a` (see the module docs).
    pub(crate) fn dot(&self, a: &BlockQ8K) -> (i32, i32) {
        let mut sumi = 0i32;
        for ((codes, qs), &sc) in self
            .codes
            .chunks_exact(16)
            .zip(a.qs.chunks_exact(16))
            .zip(&self.scales)
        {
            let sum: i32 = codes
                .iter()
                .zip(qs)
                .map(|(&c, &q)| i32::from(c) * i32::from(q))
                .sum();
            sumi += i32::from(sc) * sum;
        }
        let summ = self
            .mins
            .iter()
            .zip(&a.bsums)
            .map(|(&m, &s)| i32::from(m) * i32::from(s))
            .sum();
        (sumi, summ)
    }
}

/// `acc` plus one super-block's product: `(d_w d_x) sumi - (dmin_w d_x) summ`.
/// Every instruction set finishes its blocks with this function, so that
/// their results are bit-identical.
#[inline(always)]
pub(crate) fn accumulate(acc: f32, d_w: f32, dmin_w: f32, d_x: f32, sumi: i32, summ: i32) -> f32 {
    acc + (d_w * d_x) * sumi as f32 - (dmin_w * d_x) * summ as f32
}

/// A super-block weight type.
pub(crate) trait SuperBlock: Pod {
    fn unpack(&self) -> Unpacked;
}

/// A Q4_K super-block (144 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(crate) struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}

/// A Q5_K super-block (176 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(crate) struct BlockQ5K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}

/// A Q6_K super-block (210 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(crate) struct BlockQ6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: [u8; 2],
}

/// A Q2_K super-block (84 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(crate) struct BlockQ2K {
    pub scales: [u8; 16],
    pub qs: [u8; 64],
    pub d: [u8; 2],
    pub dmin: [u8; 2],
}

/// A Q3_K super-block (110 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(crate) struct BlockQ3K {
    pub hmask: [u8; 32],
    pub qs: [u8; 64],
    pub scales: [u8; 12],
    pub d: [u8; 2],
}

/// An IQ4_XS super-block (136 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(crate) struct BlockIQ4XS {
    pub d: [u8; 2],
    /// A little-endian u16.
    pub scales_h: [u8; 2],
    pub scales_l: [u8; 4],
    pub qs: [u8; 128],
}

/// Q4_K's and Q5_K's eight 6-bit scales and eight 6-bit minimums, as the
/// little-endian words of `[scales; 8]` then `[mins; 8]`: four bytes at a
/// time, each byte as the module docs say.
pub(crate) fn scales_and_mins(s: &[u8; 12]) -> [u32; 4] {
    let word = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    let (six, four, two) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    [
        a & six,
        (c & four) | (((a >> 6) & two) << 4),
        b & six,
        ((c >> 4) & four) | (((b >> 6) & two) << 4),
    ]
}

/// [`scales_and_mins`] as bytes: `(scales, mins)`.
pub(crate) fn scale_and_min_bytes(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let w = scales_and_mins(s).map(u32::to_le_bytes);
    let join =
        |x: [u8; 4], y: [u8; 4]| std::array::from_fn(|i| if i < 4 { x[i] } else { y[i - 4] });
    (join(w[0], w[1]), join(w[2], w[3]))
}

/// Q3_K's sixteen 6-bit scales, minus 32.
pub(crate) fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    std::array::from_fn(|g| {
        let low = if g < 8 { s[g] & 15 } else { s[g - 8] >> 4 };
        let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        (low | high << 4) as i8 - 32
    })
}

/// IQ4_XS's eight 6-bit scales, minus 32.
pub(crate) fn iq4xs_scales(b: &BlockIQ4XS) -> [i8; 8] {
    let high = u16::from_le_bytes(b.scales_h);
    std::array::from_fn(|j| {
        let low = (b.scales_l[j / 2] >> (4 * (j % 2))) & 15;
        let hi = ((high >> (2 * j)) & 3) as u8;
        (low | hi << 4) as i8 - 32
    })
}

/// Spreads eight per-sub-block values over the 16 groups.
fn per_group(v: [i16; 8]) -> [i16; 16] {
    std::array::from_fn(|g| v[g / 2])
}

impl SuperBlock for BlockQ4K {
    fn unpack(&self) -> Unpacked {
        let mut u = Unpacked::new(self.d, self.dmin);
        let (sc, m) = scale_and_min_bytes(&self.scales);
        u.scales = per_group(sc.map(i16::from));
        u.mins = per_group(m.map(i16::from));
        for (c, qs) in self.qs.chunks_exact(32).enumerate() {
            for (l, &q) in qs.iter().enumerate() {
                u.codes[64 * c + l] = (q & 15) as i8;
                u.codes[64 * c + 32 + l] = (q >> 4) as i8;
            }
        }
        u
    }
}

impl SuperBlock for BlockQ5K {
    fn unpack(&self) -> Unpacked {
        let mut u = Unpacked::new(self.d, self.dmin);
        let (sc, m) = scale_and_min_bytes(&self.scales);
        u.scales = per_group(sc.map(i16::from));
        u.mins = per_group(m.map(i16::from));
        for (c, qs) in self.qs.chunks_exact(32).enumerate() {
            for (l, (&q, &h)) in qs.iter().zip(&self.qh).enumerate() {
                let (lo, hi) = ((h >> (2 * c)) & 1, (h >> (2 * c + 1)) & 1);
                u.codes[64 * c + l] = ((q & 15) | lo << 4) as i8;
                u.codes[64 * c + 32 + l] = ((q >> 4) | hi << 4) as i8;
            }
        }
        u
    }
}

impl SuperBlock for BlockQ6K {
    fn unpack(&self) -> Unpacked {
        let mut u = Unpacked::new(self.d, [0; 2]);
        u.scales = self.scales.map(i16::from);
        for h in 0..2 {
            for l in 0..32 {
                let high = self.qh[32 * h + l];
                for s in 0..4 {
                    let low = self.ql[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2));
                    let q = (low & 15) | ((high >> (2 * s)) & 3) << 4;
                    u.codes[128 * h + 32 * s + l] = q as i8 - 32;
                }
            }
        }
        u
    }
}

impl SuperBlock for BlockQ2K {
    fn unpack(&self) -> Unpacked {
        let mut u = Unpacked::new(self.d, self.dmin);
        u.scales = self.scales.map(|s| i16::from(s & 15));
        u.mins = self.scales.map(|s| i16::from(s >> 4));
        for h in 0..2 {
            for l in 0..32 {
                for s in 0..4 {
                    u.codes[128 * h + 32 * s + l] = ((self.qs[32 * h + l] >> (2 * s)) & 3) as i8;
                }
            }
        }
        u
    }
}

impl SuperBlock for BlockQ3K {
    fn unpack(&self) -> Unpacked {
        let mut u = Unpacked::new(self.d, [0; 2]);
        u.scales = q3k_scales(&self.scales).map(i16::from);
        for h in 0..2 {
            for l in 0..32 {
                for s in 0..4 {
                    let low = ((self.qs[32 * h + l] >> (2 * s)) & 3) as i8;
                    let set = (self.hmask[l] >> (4 * h + s)) & 1 != 0;
                    u.codes[128 * h + 32 * s + l] = if set { low } else { low - 4 };
                }
            }
        }
        u
    }
}

impl SuperBlock for BlockIQ4XS {
    fn unpack(&self) -> Unpacked {
        let mut u = Unpacked::new(self.d, [0; 2]);
        u.scales = per_group(iq4xs_scales(self).map(i16::from));
        for (b, qs) in self.qs.chunks_exact(16).enumerate() {
            for (j, &q) in qs.iter().enumerate() {
                u.codes[32 * b + j] = IQ4_LEVELS[usize::from(q & 15)];
                u.codes[32 * b + 16 + j] = IQ4_LEVELS[usize::from(q >> 4)];
            }
        }
        u
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    #[test]
    fn block_sizes_match_the_dtypes() {
        use crate::DType;
        use std::mem::size_of;
        assert_eq!(size_of::<BlockQ2K>(), DType::Q2_K.block_bytes());
        assert_eq!(size_of::<BlockQ3K>(), DType::Q3_K.block_bytes());
        assert_eq!(size_of::<BlockQ4K>(), DType::Q4_K.block_bytes());
        assert_eq!(size_of::<BlockQ5K>(), DType::Q5_K.block_bytes());
        assert_eq!(size_of::<BlockQ6K>(), DType::Q6_K.block_bytes());
        assert_eq!(size_of::<BlockIQ4XS>(), DType::IQ4_XS.block_bytes());
        assert_eq!(size_of::<BlockQ8K>(), 292);
    }

    /// ggml's Q8_K, written out: the largest magnitude (the first one on a
    /// tie) maps to -128.
    #[test]
    fn q8k_quantization_follows_ggml() {
        let mut rng = StdRng::seed_from_u64(30);
        let mut x: Vec<f32> = (0..3 * SUPER).map(|_| rng.gen_range(-2.0..2.0)).collect();
        x[17] = 2.5; // block 0: a positive maximum
        x[SUPER + 200] = -3.0; // block 1: a negative one, tied later by +3
        x[SUPER + 201] = 3.0;
        x[2 * SUPER..].fill(0.0);
        let mut blocks = vec![BlockQ8K::default(); 3];
        quantize_row_q8_k(&x, &mut blocks).unwrap();

        for (b, (chunk, max)) in blocks.iter().zip(x.chunks(SUPER).zip([2.5f32, -3.0])) {
            let iscale = -128.0 / max;
            assert_eq!(b.d, 1.0 / iscale);
            for (i, (&v, &q)) in chunk.iter().zip(&b.qs).enumerate() {
                let expected = (iscale * v).round_ties_even().min(127.0);
                assert_eq!(f32::from(q), expected, "element {i}");
            }
            for (g, &s) in b.bsums.iter().enumerate() {
                let sum: i32 = b.qs[16 * g..16 * g + 16]
                    .iter()
                    .map(|&q| i32::from(q))
                    .sum();
                assert_eq!(i32::from(s), sum);
            }
        }
        assert_eq!(blocks[0].qs[17], -128);
        assert_eq!(blocks[1].qs[200], -128);
        assert_eq!(blocks[1].qs[201], 127); // +3 * 128/3 clamped
        assert_eq!(blocks[2], BlockQ8K::default());
        assert!(quantize_row_q8_k(&x[1..], &mut blocks[..1]).is_err());
    }
    fn f16_scale(rng: &mut StdRng) -> f32 {
        let v = f16::from_f32(rng.gen_range(0.001..0.1)).to_f32();
        if rng.gen() {
            v
        } else {
            -v
        }
    }

    fn le(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    /// A random value in `range` other than zero.
    fn nonzero(rng: &mut StdRng, range: std::ops::Range<i32>) -> i32 {
        loop {
            let v = rng.gen_range(range.clone());
            if v != 0 {
                return v;
            }
        }
    }

    /// Dequantizes `blocks` super-blocks that `make` builds (bytes and the
    /// weights expected), checking every weight bit for bit.
    fn check(dtype: crate::DType, make: impl Fn(&mut StdRng) -> (Vec<u8>, Vec<f32>)) {
        let mut rng = StdRng::seed_from_u64(31 + dtype.ggml_id() as u64);
        let (mut bytes, mut expected) = (Vec::new(), Vec::new());
        for _ in 0..4 {
            let (b, e) = make(&mut rng);
            assert_eq!(b.len(), dtype.block_bytes());
            bytes.extend(b);
            expected.extend(e);
        }
        let mut out = vec![f32::NAN; expected.len()];
        super::super::dequantize_row(dtype, &bytes, &mut out).unwrap();
        for (i, (o, e)) in out.iter().zip(&expected).enumerate() {
            assert_eq!(o.to_bits(), e.to_bits(), "{dtype} weight {i}: {o} vs {e}");
        }
    }

    #[test]
    fn dequantize_q4_k_blocks_built_by_hand() {
        check(crate::DType::Q4_K, |rng| {
            let (d, dmin) = (f16_scale(rng), f16_scale(rng));
            let sc: [u8; 8] = std::array::from_fn(|_| nonzero(rng, 1..64) as u8);
            let m: [u8; 8] = std::array::from_fn(|_| rng.gen_range(0..64));
            let q: [u8; 256] = std::array::from_fn(|_| rng.gen_range(0..16));
            let mut b = Vec::from(le(d));
            b.extend(le(dmin));
            b.extend((0..4).map(|j| sc[j] | (sc[j + 4] >> 4) << 6));
            b.extend((0..4).map(|j| m[j] | (m[j + 4] >> 4) << 6));
            b.extend((0..4).map(|j| (sc[j + 4] & 15) | (m[j + 4] & 15) << 4));
            b.extend(
                (0..128).map(|k| q[64 * (k / 32) + k % 32] | q[64 * (k / 32) + 32 + k % 32] << 4),
            );
            let w = (0..256)
                .map(|i| d * f32::from(sc[i / 32]) * f32::from(q[i]) - dmin * f32::from(m[i / 32]))
                .collect();
            (b, w)
        });
    }

    #[test]
    fn dequantize_q5_k_blocks_built_by_hand() {
        check(crate::DType::Q5_K, |rng| {
            let (d, dmin) = (f16_scale(rng), f16_scale(rng));
            let sc: [u8; 8] = std::array::from_fn(|_| nonzero(rng, 1..64) as u8);
            let m: [u8; 8] = std::array::from_fn(|_| rng.gen_range(0..64));
            let q: [u8; 256] = std::array::from_fn(|_| rng.gen_range(0..32));
            let mut b = Vec::from(le(d));
            b.extend(le(dmin));
            b.extend((0..4).map(|j| sc[j] | (sc[j + 4] >> 4) << 6));
            b.extend((0..4).map(|j| m[j] | (m[j + 4] >> 4) << 6));
            b.extend((0..4).map(|j| (sc[j + 4] & 15) | (m[j + 4] & 15) << 4));
            // qh[l]: bit 2c is weight 64c + l's fifth bit, bit 2c + 1 weight 64c + 32 + l's.
            b.extend((0..32).map(|l| {
                (0..4)
                    .map(|c| {
                        (q[64 * c + l] >> 4) << (2 * c) | (q[64 * c + 32 + l] >> 4) << (2 * c + 1)
                    })
                    .fold(0, |a, v| a | v)
            }));
            b.extend((0..128).map(|k| {
                (q[64 * (k / 32) + k % 32] & 15) | (q[64 * (k / 32) + 32 + k % 32] & 15) << 4
            }));
            let w = (0..256)
                .map(|i| d * f32::from(sc[i / 32]) * f32::from(q[i]) - dmin * f32::from(m[i / 32]))
                .collect();
            (b, w)
        });
    }

    #[test]
    fn dequantize_q6_k_blocks_built_by_hand() {
        check(crate::DType::Q6_K, |rng| {
            let d = f16_scale(rng);
            let sc: [i8; 16] = std::array::from_fn(|_| nonzero(rng, -128..128) as i8);
            let q: [u8; 256] = std::array::from_fn(|_| rng.gen_range(0..64));
            let mut b = Vec::new();
            // ql: for each half h, 64 bytes; byte l holds weights 128h + l
            // (low nibble) and 128h + 64 + l (high); byte 32 + l weights
            // 128h + 32 + l and 128h + 96 + l.
            for h in 0..2 {
                let at = |i: usize| q[128 * h + i];
                b.extend((0..32).map(|l| (at(l) & 15) | (at(64 + l) & 15) << 4));
                b.extend((0..32).map(|l| (at(32 + l) & 15) | (at(96 + l) & 15) << 4));
            }
            for h in 0..2 {
                b.extend((0..32).map(|l| {
                    (0..4)
                        .map(|s| (q[128 * h + 32 * s + l] >> 4) << (2 * s))
                        .fold(0, |a, v| a | v)
                }));
            }
            b.extend(sc.map(|v| v as u8));
            b.extend(le(d));
            let w = (0..256)
                .map(|i| d * f32::from(sc[i / 16]) * (f32::from(q[i]) - 32.0))
                .collect();
            (b, w)
        });
    }

    #[test]
    fn dequantize_q2_k_blocks_built_by_hand() {
        check(crate::DType::Q2_K, |rng| {
            let (d, dmin) = (f16_scale(rng), f16_scale(rng));
            let sc: [u8; 16] = std::array::from_fn(|_| nonzero(rng, 1..16) as u8);
            let m: [u8; 16] = std::array::from_fn(|_| rng.gen_range(0..16));
            let q: [u8; 256] = std::array::from_fn(|_| rng.gen_range(0..4));
            let mut b: Vec<u8> = (0..16).map(|g| sc[g] | m[g] << 4).collect();
            for h in 0..2 {
                b.extend((0..32).map(|l| {
                    (0..4)
                        .map(|s| q[128 * h + 32 * s + l] << (2 * s))
                        .fold(0, |a, v| a | v)
                }));
            }
            b.extend(le(d));
            b.extend(le(dmin));
            let w = (0..256)
                .map(|i| d * f32::from(sc[i / 16]) * f32::from(q[i]) - dmin * f32::from(m[i / 16]))
                .collect();
            (b, w)
        });
    }

    #[test]
    fn dequantize_q3_k_blocks_built_by_hand() {
        check(crate::DType::Q3_K, |rng| {
            let d = f16_scale(rng);
            // Scales in -32..32 stored plus 32; weights in -4..4, stored as
            // two low bits of q + 4 and a high bit set for q >= 0.
            let sc: [i32; 16] = std::array::from_fn(|_| nonzero(rng, -32..32));
            let q: [i32; 256] = std::array::from_fn(|_| rng.gen_range(-4..4));
            let stored = sc.map(|s| (s + 32) as u8);
            let mut b: Vec<u8> = (0..32)
                .map(|l| {
                    (0..8)
                        .map(|k| u8::from(q[32 * k + l] >= 0) << k)
                        .fold(0, |a, v| a | v)
                })
                .collect();
            for h in 0..2 {
                b.extend((0..32).map(|l| {
                    (0..4)
                        .map(|s| (((q[128 * h + 32 * s + l] + 4) & 3) as u8) << (2 * s))
                        .fold(0, |a, v| a | v)
                }));
            }
            b.extend((0..8).map(|j| (stored[j] & 15) | (stored[j + 8] & 15) << 4));
            b.extend((0..4).map(|j| {
                (0..4)
                    .map(|k| (stored[4 * k + j] >> 4) << (2 * k))
                    .fold(0, |a, v| a | v)
            }));
            b.extend(le(d));
            let w = (0..256)
                .map(|i| d * sc[i / 16] as f32 * q[i] as f32)
                .collect();
            (b, w)
        });
    }

    #[test]
    fn dequantize_iq4_xs_blocks_built_by_hand() {
        const LEVELS: [f32; 16] = [
            -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0,
            69.0, 89.0, 113.0,
        ];
        check(crate::DType::IQ4_XS, |rng| {
            let d = f16_scale(rng);
            let sc: [i32; 8] = std::array::from_fn(|_| nonzero(rng, -32..32));
            let n: [u8; 256] = std::array::from_fn(|_| rng.gen_range(0..16));
            let stored = sc.map(|s| (s + 32) as u16);
            let high: u16 = (0..8).map(|j| (stored[j] >> 4) << (2 * j)).sum();
            let mut b = Vec::from(le(d));
            b.extend(high.to_le_bytes());
            b.extend((0..4).map(|k| ((stored[2 * k] & 15) | (stored[2 * k + 1] & 15) << 4) as u8));
            for s in 0..8 {
                b.extend((0..16).map(|j| n[32 * s + j] | n[32 * s + 16 + j] << 4));
            }
            let w = (0..256)
                .map(|i| d * sc[i / 32] as f32 * LEVELS[usize::from(n[i])])
                .collect();
            (b, w)
        });
    }
}
