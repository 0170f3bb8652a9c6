//! Products of several activation rows at once (prompts, batched decoding)
//! on AVX-512 with VNNI, where the work is arithmetic rather than memory
//! traffic. This module takes the super-block types (K-quants, IQ4_XS);
//! [`blocks`] the types in blocks of 32, summed in llama.cpp's order.
//!
//! Both sides are first laid out in pairs of 64 values, one 512-bit register
//! each, in one form for every super-block type:
//!
//! - weights ([`WeightPair`]): integer codes `c` stored as the unsigned bytes
//!   `c + 128`, and per group of 16 a scale and an offset, so that
//!   `w = scale * c + offset`;
//! - activations ([`ActivationPair`]): the 8-bit `q` of
//!   [`BlockQ8K`](super::kquant::BlockQ8K)s, and per group of 16 the scale
//!   `d` (`x ≈ d q`) and the group's sum `d Σ q`.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes and sums each four products
//! into a 32-bit lane in one instruction; starting each lane from `-128 Σ q`
//! over its four activations makes it the exact integer `Σ c q`. Lane `l`
//! belongs to group `l / 4` and adds `(scale d) Σ c q` to an f32 lane; the
//! offsets' products `offset Σ x` are added into the same lanes 16 groups at
//! a time, and the 16 lanes are added up once per output. The sums are the
//! dot products' up to the order of the float additions, and each weight is
//! unpacked once per product rather than once for every few activation rows.
//!
//! The weights are unpacked a few rows at a time, into a buffer the size of
//! the L1 cache, and each tile of 4 weight rows meets the activation rows 4 at
//! a time: 16 accumulators stay in registers while the tile's weights serve 4
//! activation rows and each activation register 4 weight rows.

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub(crate) mod blocks;

use std::arch::x86_64::*;

use std::cell::RefCell;

use bytemuck::Zeroable;

use super::kquant::scale_and_min_bytes;
use super::kquant::{
    BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, SuperBlock, SUPER,
};
use super::quant::{blocks, f16_le, ActivationFormat, QuantizedActivations};
use super::simd::Avx512VnniProof;
use crate::DType;

/// Values per pair: two blocks of 32, four groups of 16.
const PAIR: usize = 64;
/// Unpacked weights per buffer: a tile's rows and the activations they meet
/// stay in L1 (48 KiB on the machines this was tuned on).
const UNPACKED_BYTES: usize = 24 * 1024;
/// Weight rows per tile.
const TILE_W: usize = 4;
/// Activation rows per tile.
const TILE_X: usize = 4;

/// 64 weights as `w = scale[g] * c + offset[g]` for group `g` of 16; the
/// offsets are kept apart, in a row of their own ([`Rows`]).
#[repr(C, align(64))]
#[derive(Clone, Copy, Zeroable)]
pub(crate) struct WeightPair {
    /// `c + 128` for each weight's integer code `c`.
    codes: [u8; PAIR],
    /// Each group's scale, in the four lanes of its products.
    scale: [f32; 16],
}

/// 64 activations as `x ≈ d[g] * q` for group `g` of 16; the groups' sums
/// `Σ x` are kept apart, in a row of their own ([`Rows`]).
#[repr(C, align(64))]
#[derive(Clone, Copy, Zeroable)]
pub(crate) struct ActivationPair {
    q: [i8; PAIR],
    /// `-128` times the sum of each lane's four `q`.
    start: [i32; 16],
    /// Each group's scale, in the four lanes of its products.
    d: [f32; 16],
}

/// Rows laid out for the tiles: `width` pairs a row, and, for weights with
/// offsets, a row of `groups` f32s each (one per group of 16, zero-padded to
/// a multiple of 16): the weights' offsets, or the activations' sums.
struct Rows<P> {
    pairs: Vec<P>,
    groups: Vec<f32>,
    width: usize,
    group_width: usize,
}

impl<P> Default for Rows<P> {
    fn default() -> Self {
        Rows {
            pairs: Vec::new(),
            groups: Vec::new(),
            width: 0,
            group_width: 0,
        }
    }
}

impl<P: Zeroable + Copy> Rows<P> {
    /// Makes this `rows` rows of `width` zeroed pairs (and groups if `offsets`),
    /// keeping the memory it has.
    fn reset(&mut self, rows: usize, width: usize, offsets: bool) {
        let group_width = if offsets {
            (4 * width).next_multiple_of(16)
        } else {
            0
        };
        self.pairs.clear();
        self.pairs.resize(rows * width, P::zeroed());
        self.groups.clear();
        self.groups.resize(rows * group_width, 0.0);
        (self.width, self.group_width) = (width, group_width);
    }

    /// Row `r`'s pairs and groups.
    fn row_mut(&mut self, r: usize) -> (&mut [P], &mut [f32]) {
        let (w, g) = (self.width, self.group_width);
        (
            &mut self.pairs[r * w..(r + 1) * w],
            &mut self.groups[r * g..(r + 1) * g],
        )
    }

    /// Pointers to row `r`'s pairs and groups.
    fn row_ptr(&self, r: usize) -> (*const P, *const f32) {
        let (w, g) = (self.width, self.group_width);
        (self.pairs[r * w..].as_ptr(), self.groups[r * g..].as_ptr())
    }
}

/// Four per-group values spread over 16 lanes, value `g` in lanes `4g..4g + 4`.
fn spread<T: Copy>(quad: [T; 4]) -> [T; 16] {
    std::array::from_fn(|l| quad[l / 4])
}

/// Whether the products of several rows take this path for `dtype`: the
/// super-block types. The types in blocks of 32 keep the dot-product tiles,
/// whose float sums follow llama.cpp's order bit for bit, so that their
/// perplexity agrees with llama.cpp's to the last digit; these tiles add the
/// same block products in another order, which moved the default model's
/// perplexity by 0.1–0.5% in those types (rounding differences that flip
/// activations' 8-bit quantization in later layers). [`multiply`] itself
/// takes every quantized type.
pub(crate) fn supports(dtype: DType) -> bool {
    ActivationFormat::of(dtype) == Some(ActivationFormat::Q8K)
}

/// Whether `dtype`'s weights have offsets (`w = scale c + offset`: the
/// K-quants with minimums), whose products need the activations' sums.
fn has_offset(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_K | DType::Q5_K | DType::Q2_K)
}

/// `y = x · Wᵀ` for `rows` rows of `dtype` weights (whole rows, checked by
/// the caller, as are `x`'s format and `y`'s length) and the `x.rows()`
/// activation rows of `x`: on AMX where the process may use it
/// ([`amx::detect`]), else on the VNNI tiles.
pub(crate) fn multiply(
    proof: Avx512VnniProof,
    dtype: DType,
    weights: &[u8],
    rows: usize,
    x: &QuantizedActivations,
    y: &mut [f32],
) {
    match amx::detect() {
        Some(amx) => amx::multiply(amx, dtype, weights, rows, x, y),
        None => multiply_vnni(proof, dtype, weights, rows, x, y),
    }
}

/// [`multiply`] on the AVX-512 VNNI tiles.
fn multiply_vnni(
    proof: Avx512VnniProof,
    dtype: DType,
    weights: &[u8],
    rows: usize,
    x: &QuantizedActivations,
    y: &mut [f32],
) {
    let _ = proof;
    let pairs = x.cols().div_ceil(PAIR);
    let m = x.rows();
    if pairs == 0 {
        y.fill(0.0); // empty dot products
        return;
    }
    let offsets = has_offset(dtype);
    with_scratch(&ACTIVATIONS, |acts| {
        acts.reset(m, pairs, offsets);
        // SAFETY: the proof says the CPU has AVX-512 F, BW and VNNI.
        unsafe { pack_activations(x, acts) };
        let acts = &*acts;
        let row_bytes = weights.len().checked_div(rows).unwrap_or(0);
        super::tasks::for_each_task(weights, row_bytes, m, y, |w, out| {
            with_scratch(&WEIGHTS, |unpacked| {
                // SAFETY: as above.
                unsafe { multiply_task(dtype, w, row_bytes, acts, unpacked, out) }
            });
        });
    });
}

thread_local! {
    /// Each thread's buffers, kept from one product to the next so that a
    /// product allocates (and has fresh pages zeroed) only when it needs more.
    static ACTIVATIONS: RefCell<Rows<ActivationPair>> = RefCell::new(Rows::default());
    static WEIGHTS: RefCell<Rows<WeightPair>> = RefCell::new(Rows::default());
}

/// The most memory a thread's buffer keeps between products; a larger one
/// (a long prompt's activations) is freed after its product.
const KEEP_BYTES: usize = 8 << 20;

/// `f` on this thread's buffer in `cell`, or on a fresh one if it is in use.
fn with_scratch<P: Zeroable + Copy>(
    cell: &'static std::thread::LocalKey<RefCell<Rows<P>>>,
    f: impl FnOnce(&mut Rows<P>),
) {
    let mut f = Some(f);
    let _ = cell.try_with(|c| {
        if let (Ok(mut rows), Some(f)) = (c.try_borrow_mut(), f.take()) {
            f(&mut rows);
            let kept = rows.pairs.capacity() * size_of::<P>() + rows.groups.capacity() * 4;
            if kept > KEEP_BYTES {
                *rows = Rows::default();
            }
        }
    });
    if let Some(f) = f {
        f(&mut Rows::default());
    }
}

/// One task's weight rows `w` (of `row_bytes` each) against all of `acts`,
/// unpacked a few rows at a time into `unpacked`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `acts` must hold `out.len()`
/// rows laid out for `dtype` (with groups if it has offsets).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn multiply_task(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &Rows<ActivationPair>,
    unpacked: &mut Rows<WeightPair>,
    out: &mut [&mut [f32]],
) {
    let (pairs, offsets) = (acts.width, acts.group_width > 0);
    let task_rows = w.len().checked_div(row_bytes).unwrap_or(0);
    let chunk_rows = chunk_rows(pairs * size_of::<WeightPair>() + 4 * acts.group_width);
    unpacked.reset(chunk_rows.min(task_rows), pairs, offsets);
    let mut first = 0;
    while first < task_rows {
        let count = chunk_rows.min(task_rows - first);
        for r in 0..count {
            let at = (first + r) * row_bytes;
            let (codes, offsets) = unpacked.row_mut(r);
            unpack_row(dtype, &w[at..at + row_bytes], codes, offsets);
        }
        // SAFETY: `unpacked` holds `count` rows and `acts` `out.len()` rows,
        // of `pairs` pairs each; the CPU has the features.
        unsafe {
            if offsets {
                tiles::<true>(unpacked, count, acts, first, out);
            } else {
                tiles::<false>(unpacked, count, acts, first, out);
            }
        }
        first += count;
    }
}

/// Lays out the activations in `out` (zeroed, `x.rows()` rows): `out.width`
/// pairs a row (the last one padded with zeros), and the groups' sums if it
/// has groups.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn pack_activations(x: &QuantizedActivations, out: &mut Rows<ActivationPair>) {
    let sums = out.group_width > 0;
    for r in 0..x.rows() {
        let (row, groups) = out.row_mut(r);
        match x.format() {
            // The types in blocks of 32 take `blocks`.
            ActivationFormat::Q8 => {}
            ActivationFormat::Q8K => {
                let per_row = x.cols() / SUPER;
                let blocks = &x.super_blocks()[r * per_row..(r + 1) * per_row];
                for (s, (four, b)) in row.chunks_mut(SUPER / PAIR).zip(blocks).enumerate() {
                    for (p, pair) in four.iter_mut().enumerate() {
                        pair.q.copy_from_slice(&b.qs[PAIR * p..PAIR * (p + 1)]);
                        pair.d = [b.d; 16];
                    }
                    if sums {
                        for (g, &bsum) in b.bsums.iter().enumerate() {
                            groups[16 * s + g] = b.d * f32::from(bsum);
                        }
                    }
                }
            }
        }
        for pair in row.iter_mut() {
            pair.start = lane_starts(&pair.q);
        }
    }
}

/// Where each lane of `vpdpbusd` over codes `c + 128` and activations `q`
/// starts, so that it ends at `Σ c q`: `-128` times the sum of the lane's four `q`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn lane_starts(q: &[i8; PAIR]) -> [i32; 16] {
    // SAFETY: `q` is 64 readable bytes; the load is unaligned.
    let q = unsafe { _mm512_loadu_si512(q.as_ptr().cast()) };
    let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q);
    let start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(sums));
    let mut out = [0; 16];
    // SAFETY: `out` is 64 writable bytes; the store is unaligned.
    unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), start) };
    out
}

/// Weight rows unpacked at a time, of `row_size` bytes unpacked: a whole
/// number of tiles, about [`UNPACKED_BYTES`] in all.
fn chunk_rows(row_size: usize) -> usize {
    (UNPACKED_BYTES / row_size.max(1))
        .next_multiple_of(TILE_W)
        .max(TILE_W)
}

/// One weight row of `dtype` as pairs.
///
/// `offsets` receives each group's offset where the type has them (it is
/// empty otherwise).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn unpack_row(dtype: DType, row: &[u8], out: &mut [WeightPair], offsets: &mut [f32]) {
    match dtype {
        DType::Q4_K => unpack_q4_k(row, out, offsets),
        DType::Q6_K => unpack_q6_k(row, out),
        DType::Q5_K => unpack_super::<BlockQ5K>(row, out, offsets),
        DType::Q2_K => unpack_super::<BlockQ2K>(row, out, offsets),
        DType::Q3_K => unpack_super::<BlockQ3K>(row, out, offsets),
        DType::IQ4_XS => unpack_super::<BlockIQ4XS>(row, out, offsets),
        _ => {}
    }
}

/// A row of super-blocks through their portable [`SuperBlock::unpack`]:
/// four pairs each.
fn unpack_super<T: SuperBlock>(row: &[u8], out: &mut [WeightPair], offsets: &mut [f32]) {
    for (s, (four, block)) in out
        .chunks_exact_mut(SUPER / PAIR)
        .zip(blocks::<T>(row))
        .enumerate()
    {
        let u = block.unpack();
        for (p, pair) in four.iter_mut().enumerate() {
            for (code, &c) in pair.codes.iter_mut().zip(&u.codes[PAIR * p..]) {
                *code = (c as u8) ^ 0x80;
            }
            pair.scale = spread(std::array::from_fn(|g| {
                u.d * f32::from(u.scales[4 * p + g])
            }));
        }
        if let Some(o) = offsets.get_mut(16 * s..16 * s + 16) {
            for (o, &m) in o.iter_mut().zip(&u.mins) {
                *o = -(u.dmin * f32::from(m));
            }
        }
    }
}

/// Stores 32 codes into half `h` of `pair`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn store_half(pair: &mut WeightPair, h: usize, codes: __m256i) {
    let half = &mut pair.codes[32 * h..32 * h + 32];
    // SAFETY: `half` is 32 writable bytes; the store is unaligned.
    unsafe { _mm256_storeu_si256(half.as_mut_ptr().cast(), codes) };
}

/// A row of Q4_K super-blocks (layout in `kquant.rs`): pair `c` is the low
/// nibbles of `qs[32c..32c + 32]` then their high nibbles, with sub-blocks
/// `2c` and `2c + 1`'s scales and minimums.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn unpack_q4_k(row: &[u8], out: &mut [WeightPair], offsets: &mut [f32]) {
    let (low, bias) = (_mm256_set1_epi8(15), _mm256_set1_epi8(-128));
    for (s, (four, b)) in out
        .chunks_exact_mut(4)
        .zip(blocks::<BlockQ4K>(row))
        .enumerate()
    {
        let (d, dmin) = (f16_le(b.d), f16_le(b.dmin));
        let (scales, mins) = scale_and_min_bytes(&b.scales);
        for (c, pair) in four.iter_mut().enumerate() {
            let qs = &b.qs[32 * c..32 * c + 32];
            // SAFETY: `qs` is 32 readable bytes; the load is unaligned.
            let v = unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) };
            let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
            store_half(pair, 0, _mm256_or_si256(_mm256_and_si256(v, low), bias));
            store_half(pair, 1, _mm256_or_si256(high, bias));
            pair.scale = spread(std::array::from_fn(|g| {
                d * f32::from(scales[2 * c + g / 2])
            }));
        }
        if let Some(o) = offsets.get_mut(16 * s..16 * s + 16) {
            for (g, o) in o.iter_mut().enumerate() {
                *o = -(dmin * f32::from(mins[g / 2]));
            }
        }
    }
}

/// A row of Q6_K super-blocks (layout in `kquant.rs`): pair `p` of half `h`
/// is the low (`p` even) or high nibbles of `ql[64h..64h + 64]`, with two high
/// bits from `qh[32h..32h + 32]` at bits `4 (p % 2)` (first 32) and
/// `4 (p % 2) + 2` (next 32); codes are those six bits less 32.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn unpack_q6_k(row: &[u8], out: &mut [WeightPair]) {
    let (low, two) = (_mm256_set1_epi8(15), _mm256_set1_epi8(3));
    // c + 128 = q - 32 + 128
    let bias = _mm256_set1_epi8(96);
    for (four, b) in out.chunks_exact_mut(4).zip(blocks::<BlockQ6K>(row)) {
        let d = f16_le(b.d);
        for (p, pair) in four.iter_mut().enumerate() {
            let (h, odd) = (p / 2, p % 2 == 1);
            let ql = &b.ql[64 * h..64 * h + 64];
            let qh = &b.qh[32 * h..32 * h + 32];
            // SAFETY: `ql` is 64 and `qh` 32 readable bytes; the loads are unaligned.
            let (l0, l1, hv) = unsafe {
                (
                    _mm256_loadu_si256(ql.as_ptr().cast()),
                    _mm256_loadu_si256(ql.as_ptr().add(32).cast()),
                    _mm256_loadu_si256(qh.as_ptr().cast()),
                )
            };
            let nib = |v| match odd {
                true => _mm256_and_si256(_mm256_srli_epi16::<4>(v), low),
                false => _mm256_and_si256(v, low),
            };
            // The high bits of the first 32, and of the next 32, moved to bits 4 and 5.
            let (h0, h1) = match odd {
                true => (_mm256_srli_epi16::<4>(hv), _mm256_srli_epi16::<6>(hv)),
                false => (hv, _mm256_srli_epi16::<2>(hv)),
            };
            let high = |x| _mm256_slli_epi16::<4>(_mm256_and_si256(x, two));
            store_half(
                pair,
                0,
                _mm256_add_epi8(_mm256_or_si256(nib(l0), high(h0)), bias),
            );
            store_half(
                pair,
                1,
                _mm256_add_epi8(_mm256_or_si256(nib(l1), high(h1)), bias),
            );
            pair.scale = spread(std::array::from_fn(|g| d * f32::from(b.scales[4 * p + g])));
        }
    }
}

/// Pairs of one slice of the rows: long rows (FFN down's) are taken a slice
/// at a time, so that a tile's 4 weight and 4 activation slices stay in L1.
/// A multiple of 4, so that slices start on whole groups of 16 groups.
const SLICE_PAIRS: usize = 32;

/// All tiles of `count` unpacked weight rows against every activation row
/// of `acts`; row `r` of `w` is output `first + r` of each `out[j]`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `w` must hold `count` rows
/// and `acts` `out.len()` rows, of as many pairs (and groups, if `OFFSET`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tiles<const OFFSET: bool>(
    w: &Rows<WeightPair>,
    count: usize,
    acts: &Rows<ActivationPair>,
    first: usize,
    out: &mut [&mut [f32]],
) {
    let (pairs, groups) = (w.width, w.group_width);
    // Equal slices of at most SLICE_PAIRS, in multiples of 4 pairs.
    let slice = pairs
        .div_ceil(pairs.div_ceil(SLICE_PAIRS))
        .next_multiple_of(4);
    let m = out.len();
    let mut k = 0;
    while k < pairs {
        let n = slice.min(pairs - k);
        // The last slice takes the groups' padding too.
        let g = match (groups, k + n == pairs) {
            (0, _) => 0,
            (_, true) => groups - 4 * k,
            (_, false) => 4 * n,
        };
        let skip = if groups == 0 { 0 } else { 4 * k };
        let add = k > 0;
        let mut j = 0;
        while j < m {
            let nx = TILE_X.min(m - j);
            let mut r = 0;
            while r < count {
                let nw = TILE_W.min(count - r);
                let at = |(p, q): (*const WeightPair, *const f32)| {
                    // SAFETY: pair k and group `skip` are within the row.
                    unsafe { (p.add(k), q.add(skip)) }
                };
                let wr = |i: usize| at(w.row_ptr(r + i.min(nw - 1)));
                let xr = |t: usize| {
                    let (p, q) = acts.row_ptr(j + t.min(nx - 1));
                    // SAFETY: as above.
                    unsafe { (p.add(k), q.add(skip)) }
                };
                // SAFETY: rows r..r + nw of `w` and j..j + nx of `acts` exist,
                // with `n` pairs from pair `k` and `g` groups from group `4k`.
                unsafe {
                    if nw == TILE_W && nx == TILE_X {
                        let dots = tile::<OFFSET, TILE_W, TILE_X>(
                            std::array::from_fn(wr),
                            std::array::from_fn(xr),
                            n,
                            g,
                        );
                        store(out, j, first + r, &dots, nw, nx, add);
                    } else if nx == TILE_X {
                        for i in 0..nw {
                            let x = std::array::from_fn(xr);
                            let dots = tile::<OFFSET, 1, TILE_X>([wr(i)], x, n, g);
                            store(out, j, first + r + i, &dots, 1, nx, add);
                        }
                    } else {
                        for t in 0..nx {
                            let w = std::array::from_fn(wr);
                            let dots = tile::<OFFSET, TILE_W, 1>(w, [xr(t)], n, g);
                            store(out, j + t, first + r, &dots, nw, 1, add);
                        }
                    }
                }
                r += nw;
            }
            j += nx;
        }
        k += n;
    }
}

/// Writes (or with `add`, adds) `dots[i][t]` (the first `nw` x `nx`) to
/// output `at + i` of row `j + t`.
fn store<const NW: usize, const NX: usize>(
    out: &mut [&mut [f32]],
    j: usize,
    at: usize,
    dots: &[[f32; NX]; NW],
    nw: usize,
    nx: usize,
    add: bool,
) {
    for (t, row) in out[j..j + nx].iter_mut().enumerate() {
        for (i, d) in dots[..nw].iter().enumerate() {
            if let Some(y) = row.get_mut(at + i) {
                *y = if add { *y + d[t] } else { d[t] };
            }
        }
    }
}

/// The dot products of `NW` unpacked weight rows with `NX` activation rows,
/// each a pointer to its `pairs` pairs and to its `groups` groups.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; the pointers must be valid
/// for `pairs` pairs and (if `OFFSET`) `groups` f32s, a multiple of 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const OFFSET: bool, const NW: usize, const NX: usize>(
    w: [(*const WeightPair, *const f32); NW],
    x: [(*const ActivationPair, *const f32); NX],
    pairs: usize,
    groups: usize,
) -> [[f32; NX]; NW] {
    let mut acc = [[_mm512_setzero_ps(); NX]; NW];
    for p in 0..pairs {
        // SAFETY: p < pairs, and every row holds `pairs` pairs.
        let (ws, xs) = unsafe { (w.map(|r| &*r.0.add(p)), x.map(|r| &*r.0.add(p))) };
        let mut codes = [_mm512_setzero_si512(); NW];
        let mut scale = [_mm512_setzero_ps(); NW];
        for i in 0..NW {
            // SAFETY: a pair's fields are 64 readable bytes each, 64-byte aligned.
            unsafe {
                codes[i] = _mm512_load_si512(ws[i].codes.as_ptr().cast());
                scale[i] = _mm512_load_ps(ws[i].scale.as_ptr());
            }
        }
        for t in 0..NX {
            // SAFETY: as above.
            let (q, start, d) = unsafe {
                (
                    _mm512_load_si512(xs[t].q.as_ptr().cast()),
                    _mm512_load_si512(xs[t].start.as_ptr().cast()),
                    _mm512_load_ps(xs[t].d.as_ptr()),
                )
            };
            for i in 0..NW {
                let dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, codes[i], q));
                acc[i][t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale[i], d), acc[i][t]);
            }
        }
    }
    if OFFSET {
        // Σ offset Σ x over the groups, 16 groups at a time, into the same lanes.
        for g in (0..groups).step_by(16) {
            // SAFETY: g + 16 <= groups, and every row holds `groups` f32s.
            unsafe {
                let offsets = w.map(|r| _mm512_loadu_ps(r.1.add(g)));
                let sums = x.map(|r| _mm512_loadu_ps(r.1.add(g)));
                for i in 0..NW {
                    for t in 0..NX {
                        acc[i][t] = _mm512_fmadd_ps(offsets[i], sums[t], acc[i][t]);
                    }
                }
            }
        }
    }
    let mut dots = [[0.0; NX]; NW];
    for i in 0..NW {
        for t in 0..NX {
            dots[i][t] = _mm512_reduce_add_ps(acc[i][t]);
        }
    }
    dots
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::simd::Isa;
    use crate::cpu::testing::{random_activations, random_weights, reference};
    use rand::{rngs::StdRng, SeedableRng};

    /// `multiply` of every super-block type against the f64 reference, on
    /// shapes off every tile of both paths (rows and activation rows off 4
    /// and 16), with an odd number of blocks of 32, and with rows long
    /// enough to be taken in slices (3,072 and 4,864 values).
    fn check_products(multiply: impl Fn(DType, &[u8], usize, &QuantizedActivations, &mut [f32])) {
        let mut rng = StdRng::seed_from_u64(31);
        for dtype in DType::ALL.into_iter().filter(|&t| supports(t)) {
            for (rows, cols, m) in [(9, 256, 2), (6, 3072, 5), (5, 4864, 4), (19, 512, 17)] {
                let w = random_weights(&mut rng, dtype, rows, cols);
                let x = random_activations(&mut rng, m * cols);
                let format = ActivationFormat::of(dtype).unwrap();
                let mut q = QuantizedActivations::new();
                q.quantize_on(Isa::detect(), format, &x, cols).unwrap();
                let mut y = vec![f32::NAN; m * rows];
                multiply(dtype, &w, rows, &q, &mut y);
                let (exact, tol) = reference(dtype, &w, rows, cols, &x);
                for (k, ((got, want), tol)) in y.iter().zip(&exact).zip(&tol).enumerate() {
                    let err = (f64::from(*got) - want).abs();
                    assert!(
                        err <= *tol,
                        "{dtype} {rows}x{cols}, m={m}, output {k}: {got} vs {want} (error {err} > {tol})"
                    );
                }
            }
        }
    }

    #[test]
    fn vnni_products_of_several_rows_match_the_reference() {
        let Some(proof) = Isa::detect().avx512_vnni() else {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        };
        check_products(|dtype, w, rows, q, y| multiply_vnni(proof, dtype, w, rows, q, y));
    }

    #[test]
    fn amx_products_of_several_rows_match_the_reference() {
        let Some(proof) = amx::detect() else {
            eprintln!("skipped: this CPU has no AMX-INT8, or the kernel did not grant it");
            return;
        };
        check_products(|dtype, w, rows, q, y| amx::multiply(proof, dtype, w, rows, q, y));
    }
}
