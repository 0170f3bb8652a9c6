//! Dot products of super-block weight rows (the K-quants and IQ4_XS) with
//! Q8_K activations ([`BlockQ8K`]), as the module docs of `kquant` define
//! them: each super-block summed in integers, then added to the row's f32
//! sum by [`accumulate`]. The AVX2 kernels form the same integers (in
//! another order, which integers do not mind) and finish each block with the
//! same function, so they give the scalar code's results bit for bit.
//!
//! The AVX2 kernels unpack a block's codes to bytes and multiply them with
//! the activations by `_mm256_maddubs_epi16`, unsigned codes times signed
//! activations. Codes that are signed are made unsigned first: Q6_K's `q - 32`
//! becomes `q` and `32 Σ sc bsum` is taken off after; Q3_K's `q - 4` becomes
//! two products, `q` and `4` where the high bit is clear; IQ4_XS's levels
//! trade signs with the activations (`|a| * (level * sign a)`, which stays in
//! range where `|level| * (a * sign level)` would not: Q8_K activations
//! reach -128).
//!
//! The NEON kernels (`kdot/neon.rs`) unpack the codes to signed bytes, as
//! the scalar code's are, and multiply them with the activations by
//! `SDOT` or widening multiplies, one group of 16 at a time.

use super::kquant::{
    accumulate, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, SuperBlock,
};
use super::quant::{blocks, ActivationFormat};
use super::simd::Isa;
use crate::DType;

#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "aarch64")]
use super::simd::neon::Widening;

/// `out[j][r] = (row r of w) · x[j]` for super-block `dtype` weights: `w`
/// holds `out[j].len()` rows of as many blocks as each `x[j]`. Rows are
/// taken one at a time (`NW` is the caller's tile height, which does not
/// change results). Callers check shapes; on a mismatch (or a `dtype` of
/// another kind) the scalar code runs, which writes only what both sides
/// have (zeros for another kind).
pub(crate) fn super_rows<const NW: usize, const NX: usize>(
    isa: Isa,
    dtype: DType,
    w: &[u8],
    x: [&[BlockQ8K]; NX],
    out: [&mut [f32]; NX],
) {
    let nb = x.first().map_or(0, |r| r.len());
    let row_bytes = nb * dtype.block_bytes();
    let rows = out.first().map_or(0, |o| o.len());
    let fits = ActivationFormat::of(dtype) == Some(ActivationFormat::Q8K)
        && x.iter().all(|r| r.len() == nb)
        && out.iter().all(|o| o.len() == rows)
        && w.len() == rows * row_bytes;
    #[cfg(target_arch = "aarch64")]
    if fits && isa != Isa::Scalar {
        let (w, x) = (w.as_ptr(), x.map(<[BlockQ8K]>::as_ptr));
        // SAFETY: `w` holds `rows` rows of `nb` blocks and every `x[j]` `nb`
        // blocks (checked just above); a DotprodProof says the CPU has the
        // dot-product extension.
        unsafe {
            match isa {
                Isa::NeonDotprod(p) => neon::super_rows::<_, NX>(p, dtype, w, rows, x, nb, out),
                _ => neon::super_rows::<_, NX>(Widening, dtype, w, rows, x, nb, out),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Isa::Avx2(_) = isa {
        if fits {
            let (w, x) = (w.as_ptr(), x.map(<[BlockQ8K]>::as_ptr));
            // SAFETY: the Avx2 proof says the CPU has AVX2, FMA and F16C; `w`
            // holds `rows` rows of `nb` blocks and every `x[j]` `nb` blocks
            // (checked just above).
            unsafe {
                match dtype {
                    DType::Q2_K => avx2::super_rows::<{ avx2::Q2_K }, NX>(w, rows, x, nb, out),
                    DType::Q3_K => avx2::super_rows::<{ avx2::Q3_K }, NX>(w, rows, x, nb, out),
                    DType::Q4_K => avx2::super_rows::<{ avx2::Q4_K }, NX>(w, rows, x, nb, out),
                    DType::Q5_K => avx2::super_rows::<{ avx2::Q5_K }, NX>(w, rows, x, nb, out),
                    DType::Q6_K => avx2::super_rows::<{ avx2::Q6_K }, NX>(w, rows, x, nb, out),
                    DType::IQ4_XS => avx2::super_rows::<{ avx2::IQ4_XS }, NX>(w, rows, x, nb, out),
                    _ => {}
                }
            }
            return;
        }
    }
    let _ = (isa, fits);
    if row_bytes == 0 {
        out.into_iter().for_each(|o| o.fill(0.0));
        return;
    }
    for (o, xj) in out.into_iter().zip(x) {
        for (y, wr) in o.iter_mut().zip(w.chunks_exact(row_bytes)) {
            *y = dot_scalar(dtype, wr, xj);
        }
    }
}

/// Portable [`super_rows`] for one pair of rows; 0 for other types.
fn dot_scalar(dtype: DType, w: &[u8], x: &[BlockQ8K]) -> f32 {
    fn row<T: SuperBlock>(w: &[u8], x: &[BlockQ8K]) -> f32 {
        blocks::<T>(w).iter().zip(x).fold(0.0, |acc, (b, a)| {
            let u = b.unpack();
            let (sumi, summ) = u.dot(a);
            accumulate(acc, u.d, u.dmin, a.d, sumi, summ)
        })
    }
    match dtype {
        DType::Q2_K => row::<BlockQ2K>(w, x),
        DType::Q3_K => row::<BlockQ3K>(w, x),
        DType::Q4_K => row::<BlockQ4K>(w, x),
        DType::Q5_K => row::<BlockQ5K>(w, x),
        DType::Q6_K => row::<BlockQ6K>(w, x),
        DType::IQ4_XS => row::<BlockIQ4XS>(w, x),
        _ => 0.0,
    }
}

/// The AVX2 kernels: one weight row against `NX` activation rows, each
/// block's codes unpacked once for all of them.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // tiles index several arrays by the same row numbers
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::kquant::{
        accumulate, iq4xs_scales, q3k_scales, scales_and_mins, BlockIQ4XS, BlockQ8K, IQ4_LEVELS,
    };
    use super::super::simd::avx2::{lane1, load_f16, load_f16_pair, nibbles};

    /// Super-block formats, as const parameters.
    pub(super) const Q2_K: u8 = 0;
    pub(super) const Q3_K: u8 = 1;
    pub(super) const Q4_K: u8 = 2;
    pub(super) const Q5_K: u8 = 3;
    pub(super) const Q6_K: u8 = 4;
    pub(super) const IQ4_XS: u8 = 5;

    /// How far ahead of the block being multiplied its weights are
    /// prefetched (as for the blocks of 32, see `dot.rs`).
    const PREFETCH_BYTES: usize = 2048;

    const fn block_bytes(kind: u8) -> usize {
        match kind {
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            _ => 136,
        }
    }

    /// A block's integer sums with each activation row, `(sumi, summ)`.
    type Sums<const NX: usize> = [(i32, i32); NX];

    /// `out[j][r] = (row r of w) · x[j]` for `rows` rows of `nb` blocks.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `w` must point at `rows`
    /// readable rows of `nb` blocks of format `KIND`, each `x[j]` at `nb`
    /// activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn super_rows<const KIND: u8, const NX: usize>(
        w: *const u8,
        rows: usize,
        x: [*const BlockQ8K; NX],
        nb: usize,
        mut out: [&mut [f32]; NX],
    ) {
        let row_bytes = nb * block_bytes(KIND);
        for r in 0..rows {
            // SAFETY: as this function's, for row r < rows.
            let dots = unsafe { row::<KIND, NX>(w.add(r * row_bytes), x, nb) };
            for (o, d) in out.iter_mut().zip(dots) {
                if let Some(y) = o.get_mut(r) {
                    *y = d;
                }
            }
        }
    }

    /// One row of `nb` blocks against each `x[j]`.
    ///
    /// # Safety
    /// As [`super_rows`], for one row.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn row<const KIND: u8, const NX: usize>(
        w: *const u8,
        x: [*const BlockQ8K; NX],
        nb: usize,
    ) -> [f32; NX] {
        let mut acc = [0.0f32; NX];
        for b in 0..nb {
            // SAFETY: b < nb, so the block and each activation block are in
            // bounds; a prefetch never faults, even past the end.
            unsafe {
                let block = w.add(b * block_bytes(KIND));
                _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(PREFETCH_BYTES).cast());
                let a = x.map(|p| p.add(b));
                let sums = match KIND {
                    Q2_K => q2k(block, a),
                    Q3_K => q3k(block, a),
                    Q4_K => q4k::<NX, false>(block, a),
                    Q5_K => q4k::<NX, true>(block, a),
                    Q6_K => q6k(block, a),
                    _ => iq4xs(block, a),
                };
                let (d, dmin) = match KIND {
                    Q2_K => header(block.add(80)),
                    Q3_K => (f16_at(block.add(108)), 0.0),
                    Q4_K | Q5_K => header(block),
                    Q6_K => (f16_at(block.add(208)), 0.0),
                    _ => (f16_at(block), 0.0),
                };
                for j in 0..NX {
                    acc[j] = accumulate(acc[j], d, dmin, (*a[j]).d, sums[j].0, sums[j].1);
                }
            }
        }
        acc
    }

    /// The f16 pair `d, dmin` at `p`, as f32.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `p` must point at 4 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn header(p: *const u8) -> (f32, f32) {
        // SAFETY: the caller guarantees 4 readable bytes.
        let v = unsafe { load_f16_pair(p) };
        (_mm_cvtss_f32(v), lane1(v))
    }

    /// The f16 at `p`, as f32.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `p` must point at 2 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_at(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees 2 readable bytes.
        _mm_cvtss_f32(unsafe { load_f16(p) })
    }

    /// The sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256i) -> i32 {
        let q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let p = _mm_add_epi32(q, _mm_unpackhi_epi64(q, q));
        _mm_cvtsi128_si32(_mm_add_epi32(p, _mm_shuffle_epi32::<0b01>(p)))
    }

    /// The sums of the eight lanes of `a` and of `b`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum2(a: __m256i, b: __m256i) -> (i32, i32) {
        // Pairs of a then of b in each half; both halves added; pairs again.
        let h = _mm256_hadd_epi32(a, b);
        let q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        let p = _mm_hadd_epi32(q, q);
        (_mm_cvtsi128_si32(p), _mm_extract_epi32::<1>(p))
    }

    /// The two shuffle indices (as one 16-bit lane) that copy 16-bit element `k`.
    const fn element(k: usize) -> i16 {
        let k = k as i16;
        ((2 * k + 1) << 8) | (2 * k)
    }

    /// A shuffle that puts 16-bit element `k` of each 128-bit half in every
    /// lane of that half.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn pick(k: usize) -> __m256i {
        _mm256_set1_epi16(element(k))
    }

    /// A shuffle that puts 16-bit element `k` in every lane of the lower
    /// 128-bit half and element `k + 1` in every lane of the upper one: the
    /// scales of two groups of 16 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn pick_pair(k: usize) -> __m256i {
        _mm256_set_m128i(_mm_set1_epi16(element(k + 1)), _mm_set1_epi16(element(k)))
    }

    /// Eight 16-bit values in both 128-bit halves.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn both_halves(v: __m128i) -> __m256i {
        _mm256_broadcastsi128_si256(v)
    }

    /// 32 activation bytes of `a` from `at` on.
    ///
    /// # Safety
    /// `a` must point at a readable block and `at + 32 <= 256`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn act(a: *const BlockQ8K, at: usize) -> __m256i {
        // SAFETY: the caller guarantees the block; `qs` holds 256 bytes.
        unsafe { _mm256_loadu_si256((&raw const (*a).qs).cast::<i8>().add(at).cast()) }
    }

    /// The 16 group sums of `a`.
    ///
    /// # Safety
    /// `a` must point at a readable block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bsums(a: *const BlockQ8K) -> __m256i {
        // SAFETY: the caller guarantees the block; `bsums` is 32 bytes.
        unsafe { _mm256_loadu_si256((&raw const (*a).bsums).cast()) }
    }

    /// Q4_K (or with `FIVE`, Q5_K): 32 codes a sub-block, one scale each.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `w` must point at a readable
    /// block and each `x[j]` at a readable activation block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4k<const NX: usize, const FIVE: bool>(
        w: *const u8,
        x: [*const BlockQ8K; NX],
    ) -> Sums<NX> {
        // SAFETY: every read is within the block (144 or 176 bytes) or an
        // activation block, as the caller guarantees.
        unsafe {
            let [s0, s1, m0, m1] = scales_and_mins(&w.add(4).cast::<[u8; 12]>().read_unaligned());
            let packed = _mm_setr_epi32(s0 as i32, s1 as i32, m0 as i32, m1 as i32);
            let sc16 = both_halves(_mm_cvtepu8_epi16(packed));
            let m8 = _mm_unpackhi_epi64(packed, packed);
            // Each minimum twice: groups 2j and 2j + 1 share sub-block j's.
            let m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
            let qs = w.add(if FIVE { 48 } else { 16 });
            let mut qh = if FIVE {
                _mm256_loadu_si256(w.add(16).cast())
            } else {
                _mm256_setzero_si256()
            };
            let low = _mm256_set1_epi8(15);
            let mut acc = [_mm256_setzero_si256(); NX];
            for c in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * c).cast());
                let mut lo = _mm256_and_si256(q, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
                if FIVE {
                    // Bits 2c and 2c + 1 of qh, brought down to bits 0 and 1.
                    let one = _mm256_set1_epi8(1);
                    let two = _mm256_set1_epi8(2);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(qh, one)));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(qh, two)));
                    qh = _mm256_srli_epi16::<2>(qh);
                }
                let s_lo = _mm256_shuffle_epi8(sc16, pick(2 * c));
                let s_hi = _mm256_shuffle_epi8(sc16, pick(2 * c + 1));
                for j in 0..NX {
                    let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, act(x[j], 64 * c)), s_lo);
                    let p_hi =
                        _mm256_madd_epi16(_mm256_maddubs_epi16(hi, act(x[j], 64 * c + 32)), s_hi);
                    acc[j] = _mm256_add_epi32(acc[j], _mm256_add_epi32(p_lo, p_hi));
                }
            }
            std::array::from_fn(|j| hsum2(acc[j], _mm256_madd_epi16(bsums(x[j]), m16)))
        }
    }

    /// Q6_K: codes `q` in 0..64 times the activations, less `32 Σ sc bsum`.
    ///
    /// # Safety
    /// As [`q4k`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6k<const NX: usize>(w: *const u8, x: [*const BlockQ8K; NX]) -> Sums<NX> {
        // SAFETY: every read is within the block (210 bytes) or an
        // activation block, as the caller guarantees.
        unsafe {
            let scales = _mm_loadu_si128(w.add(192).cast());
            let (low, high) = (_mm256_set1_epi8(15), _mm256_set1_epi8(0x30));
            let mut acc = [_mm256_setzero_si256(); NX];
            for h in 0..2 {
                let l0 = _mm256_loadu_si256(w.add(64 * h).cast());
                let l1 = _mm256_loadu_si256(w.add(64 * h + 32).cast());
                let hb = _mm256_loadu_si256(w.add(128 + 32 * h).cast());
                // Weights 128h + 32s + l: the high bits 2s..2s+2 of qh moved to bits 4..6.
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(l0, low),
                        _mm256_and_si256(_mm256_slli_epi16::<4>(hb), high),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(l1, low),
                        _mm256_and_si256(_mm256_slli_epi16::<2>(hb), high),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l0), low),
                        _mm256_and_si256(hb, high),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l1), low),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(hb), high),
                    ),
                ];
                let half = if h == 0 {
                    scales
                } else {
                    _mm_unpackhi_epi64(scales, scales)
                };
                let sc16 = both_halves(_mm_cvtepi8_epi16(half));
                for s in 0..4 {
                    let scale = _mm256_shuffle_epi8(sc16, pick_pair(2 * s));
                    for j in 0..NX {
                        let p = _mm256_maddubs_epi16(q[s], act(x[j], 128 * h + 32 * s));
                        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(p, scale));
                    }
                }
            }
            let sc16 = _mm256_cvtepi8_epi16(scales);
            std::array::from_fn(|j| {
                let offset = _mm256_madd_epi16(bsums(x[j]), sc16);
                (
                    hsum(_mm256_sub_epi32(acc[j], _mm256_slli_epi32::<5>(offset))),
                    0,
                )
            })
        }
    }

    /// Q2_K: two-bit codes, a scale and a minimum per group of 16.
    ///
    /// # Safety
    /// As [`q4k`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2k<const NX: usize>(w: *const u8, x: [*const BlockQ8K; NX]) -> Sums<NX> {
        // SAFETY: every read is within the block (84 bytes) or an activation
        // block, as the caller guarantees.
        unsafe {
            let packed = _mm_loadu_si128(w.cast());
            let nibble = _mm_set1_epi8(15);
            let sc = _mm_and_si128(packed, nibble);
            let m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), nibble));
            let three = _mm256_set1_epi8(3);
            let mut acc = [_mm256_setzero_si256(); NX];
            for h in 0..2 {
                let mut q = _mm256_loadu_si256(w.add(16 + 32 * h).cast());
                let half = if h == 0 {
                    sc
                } else {
                    _mm_unpackhi_epi64(sc, sc)
                };
                let sc16 = both_halves(_mm_cvtepu8_epi16(half));
                for s in 0..4 {
                    let codes = _mm256_and_si256(q, three);
                    q = _mm256_srli_epi16::<2>(q);
                    let scale = _mm256_shuffle_epi8(sc16, pick_pair(2 * s));
                    for j in 0..NX {
                        let p = _mm256_maddubs_epi16(codes, act(x[j], 128 * h + 32 * s));
                        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(p, scale));
                    }
                }
            }
            std::array::from_fn(|j| hsum2(acc[j], _mm256_madd_epi16(bsums(x[j]), m16)))
        }
    }

    /// Q3_K: two low bits times the activations, less 4 times them where
    /// the high bit is clear; a signed scale per group of 16.
    ///
    /// # Safety
    /// As [`q4k`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q3k<const NX: usize>(w: *const u8, x: [*const BlockQ8K; NX]) -> Sums<NX> {
        // SAFETY: every read is within the block (110 bytes) or an
        // activation block, as the caller guarantees.
        unsafe {
            let sc = q3k_scales(&w.add(96).cast::<[u8; 12]>().read_unaligned());
            let scales = _mm_loadu_si128(sc.as_ptr().cast());
            let mut hm = _mm256_loadu_si256(w.cast());
            let (one, three) = (_mm256_set1_epi8(1), _mm256_set1_epi8(3));
            let mut acc = [_mm256_setzero_si256(); NX];
            for h in 0..2 {
                let mut q = _mm256_loadu_si256(w.add(32 + 32 * h).cast());
                let half = if h == 0 {
                    scales
                } else {
                    _mm_unpackhi_epi64(scales, scales)
                };
                let sc16 = both_halves(_mm_cvtepi8_epi16(half));
                for s in 0..4 {
                    let codes = _mm256_and_si256(q, three);
                    q = _mm256_srli_epi16::<2>(q);
                    // 4 where bit 4h + s of hmask is clear.
                    let four = _mm256_slli_epi16::<2>(_mm256_andnot_si256(hm, one));
                    hm = _mm256_srli_epi16::<1>(hm);
                    let scale = _mm256_shuffle_epi8(sc16, pick_pair(2 * s));
                    for j in 0..NX {
                        let a = act(x[j], 128 * h + 32 * s);
                        let p = _mm256_sub_epi16(
                            _mm256_maddubs_epi16(codes, a),
                            _mm256_maddubs_epi16(four, a),
                        );
                        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(p, scale));
                    }
                }
            }
            std::array::from_fn(|j| (hsum(acc[j]), 0))
        }
    }

    /// IQ4_XS: levels looked up by nibble, a signed scale per sub-block of 32.
    ///
    /// # Safety
    /// As [`q4k`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4xs<const NX: usize>(w: *const u8, x: [*const BlockQ8K; NX]) -> Sums<NX> {
        // SAFETY: every read is within the block (136 bytes, alignment 1) or
        // an activation block, as the caller guarantees.
        unsafe {
            let sc = iq4xs_scales(&*w.cast::<BlockIQ4XS>());
            let sc16 = both_halves(_mm_cvtepi8_epi16(_mm_loadl_epi64(sc.as_ptr().cast())));
            let table = both_halves(_mm_loadu_si128(IQ4_LEVELS.as_ptr().cast()));
            let mut acc = [_mm256_setzero_si256(); NX];
            for b in 0..8 {
                let codes = _mm256_shuffle_epi8(table, nibbles(w.add(8 + 16 * b)));
                let scale = _mm256_shuffle_epi8(sc16, pick(b));
                for j in 0..NX {
                    let a = act(x[j], 32 * b);
                    let p =
                        _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(codes, a));
                    acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(p, scale));
                }
            }
            std::array::from_fn(|j| (hsum(acc[j]), 0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kquant::quantize_row_q8_k;
    use crate::cpu::testing::{random_activations, random_weights, reference};
    use rand::{rngs::StdRng, SeedableRng};

    /// The types whose products take Q8_K activations.
    fn types() -> impl Iterator<Item = DType> {
        DType::ALL
            .into_iter()
            .filter(|d| ActivationFormat::of(*d) == Some(ActivationFormat::Q8K))
    }

    fn quantize(x: &[f32]) -> Vec<BlockQ8K> {
        let mut blocks = vec![BlockQ8K::default(); x.len() / 256];
        quantize_row_q8_k(x, &mut blocks).unwrap();
        blocks
    }

    fn rows<const NX: usize>(
        isa: Isa,
        dtype: DType,
        w: &[u8],
        q: &[Vec<BlockQ8K>],
    ) -> Vec<Vec<f32>> {
        let rows = w.len() / (q[0].len() * dtype.block_bytes());
        let mut out = vec![vec![f32::NAN; rows]; NX];
        let mut outs = out.iter_mut();
        let out_rows = std::array::from_fn(|_| outs.next().unwrap().as_mut_slice());
        super_rows::<1, NX>(isa, dtype, w, std::array::from_fn(|j| &q[j][..]), out_rows);
        out
    }

    /// Every instruction set against the f64 reference, and the SIMD
    /// kernels against the scalar code bit for bit, for one activation row
    /// and several.
    #[test]
    fn super_block_dots_match_reference_and_scalar_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(40);
        for dtype in types() {
            for n in [256, 512, 2816] {
                let nrows = 7;
                let w = random_weights(&mut rng, dtype, nrows, n);
                let x: Vec<Vec<f32>> = (0..3).map(|_| random_activations(&mut rng, n)).collect();
                let q: Vec<Vec<BlockQ8K>> = x.iter().map(|r| quantize(r)).collect();
                let scalar1 = rows::<1>(Isa::Scalar, dtype, &w, &q);
                let scalar3 = rows::<3>(Isa::Scalar, dtype, &w, &q);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                for isa in Isa::available() {
                    let simd1 = rows::<1>(isa, dtype, &w, &q);
                    let simd3 = rows::<3>(isa, dtype, &w, &q);
                    for j in 0..3 {
                        let (a, b) = (bits(&scalar3[j]), bits(&simd3[j]));
                        assert_eq!(a, b, "{dtype} n={n} {isa:?} row {j}");
                    }
                    assert_eq!(bits(&simd1[0]), bits(&scalar1[0]), "{dtype} {isa:?}");
                }
                for j in 0..3 {
                    let (exact, tol) = reference(dtype, &w, nrows, n, &x[j]);
                    for r in 0..nrows {
                        let err = (f64::from(scalar3[j][r]) - exact[r]).abs();
                        assert!(
                            err <= tol[r],
                            "{dtype} n={n} ({r},{j}): error {err} > {}",
                            tol[r]
                        );
                    }
                }
                assert_eq!(bits(&scalar1[0]), bits(&scalar3[0]), "{dtype}");
            }
        }
    }

    /// Activations at the ends of their range: every block has a -128 (the
    /// largest magnitude), and here many values clamp at 127.
    #[test]
    fn extreme_activations_agree_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(41);
        let n = 512;
        let mut x = random_activations(&mut rng, n);
        for (i, v) in x.iter_mut().enumerate() {
            *v = if i % 3 == 0 {
                -3.0
            } else if i % 3 == 1 {
                3.0
            } else {
                *v
            };
        }
        let q = vec![quantize(&x)];
        assert!(q[0][0].qs.contains(&-128) && q[0][0].qs.contains(&127));
        for dtype in types() {
            let w = random_weights(&mut rng, dtype, 5, n);
            let scalar = rows::<1>(Isa::Scalar, dtype, &w, &q);
            for isa in Isa::available() {
                assert_eq!(rows::<1>(isa, dtype, &w, &q), scalar, "{dtype} {isa:?}");
            }
        }
    }
}
