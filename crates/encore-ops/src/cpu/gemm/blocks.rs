//! Products of several activation rows for the types in blocks of 32 (Q8_0,
//! Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) on AVX-512 VNNI, each output summed in the
//! order of the AVX2 dot products, which is llama.cpp's: one 8-lane f32
//! accumulator per output, the blocks in turn, `acc += (d_w d_x) Σ c q` with
//! lane `l` summing products `4l..4l + 4` in integers; the offsets' products
//! `m_w s_x` added up apart, one block after another; at the end the lanes
//! folded as [`hsum`] folds them, plus the offsets. The results are the dot
//! products' bit for bit, so perplexity keeps agreeing with llama.cpp's to
//! the last digit: any other order of the same additions moves it by tenths
//! of a percent, as rounding flips later layers' 8-bit activations.
//!
//! A 512-bit register holds one weight block twice against the same block of
//! two activation rows ([`RowPairBlock`]), so that each half is one output's
//! accumulator. Weights are unpacked once per product, as in the parent
//! module, into [`WeightBlock`]s: codes `c + 128` (unsigned, for `vpdpbusd`,
//! each lane starting from `-128 Σ q` so that its sum is the exact `Σ c q`),
//! the scale, and the offset `m_w` (Q4_1's and Q5_1's minimum, Q4_0's `-8 d`).

use std::arch::x86_64::*;
use std::cell::RefCell;

use bytemuck::Zeroable;

use super::super::kquant::IQ4_LEVELS;
use super::super::quant::{ActivationFormat, QuantizedActivations};
use super::super::simd::avx2::{fifth_bits, hsum, nibbles};
use super::super::simd::Avx512VnniProof;
use super::{chunk_rows, lane_starts, with_scratch, Rows, TILE_W};
use crate::DType;

/// Values per block.
const BLOCK: usize = 32;
/// Activation row pairs per tile: 4 rows.
const TILE_P: usize = 2;

/// One weight block: `w = d c + m` for the codes `c`.
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub(crate) struct WeightBlock {
    /// `c + 128`.
    codes: [u8; BLOCK],
    d: f32,
    m: f32,
}

/// One block of two activation rows: lanes 0..8 the first row's, 8..16 the
/// second's (zero where there is no second row).
#[repr(C, align(64))]
#[derive(Clone, Copy, Zeroable)]
pub(crate) struct RowPairBlock {
    q: [i8; 2 * BLOCK],
    /// `-128` times the sum of each lane's four `q`.
    start: [i32; 16],
    /// Each row's `d`, in its 8 lanes.
    d: [f32; 16],
    /// Each row's `s = d Σ q`, in its 8 lanes.
    s: [f32; 16],
}

/// Whether the products of several rows take this path for `dtype`.
pub(crate) fn supports(dtype: DType) -> bool {
    ActivationFormat::of(dtype) == Some(ActivationFormat::Q8)
}

/// Whether `dtype`'s blocks have an offset term `m_w s_x`.
fn has_offset(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q5_1)
}

thread_local! {
    /// As the parent module's buffers.
    static ACTIVATIONS: RefCell<Rows<RowPairBlock>> = RefCell::new(Rows::default());
    static WEIGHTS: RefCell<Rows<WeightBlock>> = RefCell::new(Rows::default());
}

/// `y = x · Wᵀ` for `rows` rows of `dtype` weights (a type [`supports`]
/// takes; whole rows, checked by the caller, as are `x`'s format and `y`'s
/// length) and the `x.rows()` activation rows of `x`.
pub(crate) fn multiply(
    proof: Avx512VnniProof,
    dtype: DType,
    weights: &[u8],
    rows: usize,
    x: &QuantizedActivations,
    y: &mut [f32],
) {
    let _ = proof;
    let blocks = x.cols() / BLOCK;
    let m = x.rows();
    if blocks == 0 {
        y.fill(0.0); // empty dot products
        return;
    }
    with_scratch(&ACTIVATIONS, |acts| {
        acts.reset(m.div_ceil(2), blocks, false);
        // SAFETY: the proof says the CPU has AVX-512 F, BW and VNNI.
        unsafe { pack_activations(x, acts) };
        let acts = &*acts;
        let row_bytes = weights.len().checked_div(rows).unwrap_or(0);
        super::super::tasks::for_each_task(weights, row_bytes, m, y, |w, out| {
            with_scratch(&WEIGHTS, |unpacked| {
                // SAFETY: as above.
                unsafe { multiply_task(dtype, w, row_bytes, acts, unpacked, out) }
            });
        });
    });
}

/// Lays out the activations in `out` (zeroed, a row per pair of rows).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn pack_activations(x: &QuantizedActivations, out: &mut Rows<RowPairBlock>) {
    let blocks = out.width;
    for (r, row) in x.blocks().chunks(blocks).enumerate() {
        let (pairs, _) = out.row_mut(r / 2);
        let h = r % 2;
        for (pb, b) in pairs.iter_mut().zip(row) {
            pb.q[BLOCK * h..BLOCK * (h + 1)].copy_from_slice(&b.qs);
            pb.d[8 * h..8 * h + 8].fill(b.d);
            pb.s[8 * h..8 * h + 8].fill(b.s);
        }
    }
    for pb in out.pairs.iter_mut() {
        pb.start = lane_starts(&pb.q);
    }
}

/// One task's weight rows `w` (of `row_bytes` each) against all of `acts`,
/// unpacked a few rows at a time into `unpacked`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `acts` must hold
/// `out.len().div_ceil(2)` row pairs of the weights' block count.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn multiply_task(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &Rows<RowPairBlock>,
    unpacked: &mut Rows<WeightBlock>,
    out: &mut [&mut [f32]],
) {
    let blocks = acts.width;
    let task_rows = w.len().checked_div(row_bytes).unwrap_or(0);
    let chunk_rows = chunk_rows(blocks * size_of::<WeightBlock>());
    unpacked.reset(chunk_rows.min(task_rows), blocks, false);
    let mut first = 0;
    while first < task_rows {
        let count = chunk_rows.min(task_rows - first);
        for r in 0..count {
            let at = (first + r) * row_bytes;
            let (row, _) = unpacked.row_mut(r);
            unpack_row(dtype, &w[at..at + row_bytes], row);
        }
        // SAFETY: `unpacked` holds `count` rows and `acts` the row pairs of
        // `out`, of `blocks` blocks each; the CPU has the features.
        unsafe {
            if has_offset(dtype) {
                tiles::<true>(unpacked, count, acts, first, out);
            } else {
                tiles::<false>(unpacked, count, acts, first, out);
            }
        }
        first += count;
    }
}

/// A weight row of a type in blocks of 32 as [`WeightBlock`]s.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn unpack_row(dtype: DType, row: &[u8], out: &mut [WeightBlock]) {
    match dtype {
        DType::Q8_0 => unpack::<{ DType::Q8_0 as u8 }>(row, out),
        DType::Q4_0 => unpack::<{ DType::Q4_0 as u8 }>(row, out),
        DType::Q4_1 => unpack::<{ DType::Q4_1 as u8 }>(row, out),
        DType::Q5_0 => unpack::<{ DType::Q5_0 as u8 }>(row, out),
        DType::Q5_1 => unpack::<{ DType::Q5_1 as u8 }>(row, out),
        DType::IQ4_NL => unpack::<{ DType::IQ4_NL as u8 }>(row, out),
        _ => {}
    }
}

/// [`unpack_row`] for the type whose `DType` discriminant is `KIND`. Codes
/// are `c + 128` for `w = d c + m`: Q4_0, Q4_1 and Q5_1 take their unsigned
/// values as `c` (`m` is `-8 d` or the block's minimum), Q8_0, Q5_0 and
/// IQ4_NL their signed ones (`m = 0`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn unpack<const KIND: u8>(row: &[u8], out: &mut [WeightBlock]) {
    const Q8_0: u8 = DType::Q8_0 as u8;
    const Q4_0: u8 = DType::Q4_0 as u8;
    const Q4_1: u8 = DType::Q4_1 as u8;
    const Q5_0: u8 = DType::Q5_0 as u8;
    const Q5_1: u8 = DType::Q5_1 as u8;
    let bytes = match KIND {
        Q8_0 => 34,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 18, // Q4_0, IQ4_NL
    };
    let bias = _mm256_set1_epi8(-128);
    let sixteen = _mm256_set1_epi8(16);
    // SAFETY: the table is 16 readable bytes; the load is unaligned.
    let levels =
        _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(IQ4_LEVELS.as_ptr().cast()) });
    for (wb, block) in out.iter_mut().zip(row.chunks_exact(bytes)) {
        let p = block.as_ptr();
        // SAFETY: `block` is one whole block of its type; each load below
        // lies within it (the layouts in `quant.rs`) and is unaligned. Every
        // block starts with its f16 scale (and Q4_1's and Q5_1's minimum).
        let (codes, head) = unsafe {
            let head = _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned()));
            let codes = match KIND {
                Q8_0 => _mm256_xor_si256(_mm256_loadu_si256(p.add(2).cast()), bias),
                Q4_0 => _mm256_or_si256(nibbles(p.add(2)), bias),
                Q4_1 => _mm256_or_si256(nibbles(p.add(4)), bias),
                // c + 128 = (q - 16) + 128
                Q5_0 => {
                    let fifth = _mm256_and_si256(fifth_bits(p.add(2)), sixteen);
                    let q = _mm256_or_si256(nibbles(p.add(6)), fifth);
                    _mm256_add_epi8(q, _mm256_set1_epi8(112))
                }
                Q5_1 => {
                    let fifth = _mm256_and_si256(fifth_bits(p.add(4)), sixteen);
                    _mm256_or_si256(_mm256_or_si256(nibbles(p.add(8)), fifth), bias)
                }
                _ => _mm256_xor_si256(_mm256_shuffle_epi8(levels, nibbles(p.add(2))), bias),
            };
            (codes, head)
        };
        // SAFETY: `codes` is 32 writable bytes; the store is unaligned.
        unsafe { _mm256_storeu_si256(wb.codes.as_mut_ptr().cast(), codes) };
        wb.d = _mm_cvtss_f32(head);
        wb.m = match KIND {
            // As the dot products form it: d * -8, exact.
            Q4_0 => -8.0 * wb.d,
            Q4_1 | Q5_1 => _mm_cvtss_f32(_mm_movehdup_ps(head)),
            _ => 0.0,
        };
    }
}

/// All tiles of `count` unpacked weight rows against every activation row;
/// row `r` of `w` is output `first + r` of each `out[j]`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `w` must hold `count` rows
/// and `acts` `out.len().div_ceil(2)` row pairs, of as many blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tiles<const OFFSET: bool>(
    w: &Rows<WeightBlock>,
    count: usize,
    acts: &Rows<RowPairBlock>,
    first: usize,
    out: &mut [&mut [f32]],
) {
    let blocks = w.width;
    let pairs = out.len().div_ceil(2);
    let mut p = 0;
    while p < pairs {
        let np = TILE_P.min(pairs - p);
        let mut r = 0;
        while r < count {
            let nw = TILE_W.min(count - r);
            let wr = |i: usize| w.row_ptr(r + i.min(nw - 1)).0;
            let xr = |t: usize| acts.row_ptr(p + t.min(np - 1)).0;
            // SAFETY: rows r..r + nw of `w` and pairs p..p + np of `acts`
            // exist, with `blocks` blocks each.
            unsafe {
                if nw == TILE_W && np == TILE_P {
                    let x = std::array::from_fn(xr);
                    let dots = tile::<OFFSET, TILE_W, TILE_P>(std::array::from_fn(wr), x, blocks);
                    store(out, 2 * p, first + r, &dots, nw, np);
                } else {
                    for i in 0..nw {
                        for t in 0..np {
                            let dots = tile::<OFFSET, 1, 1>([wr(i)], [xr(t)], blocks);
                            store(out, 2 * (p + t), first + r + i, &dots, 1, 1);
                        }
                    }
                }
            }
            r += nw;
        }
        p += np;
    }
}

/// Writes `dots[i][t]` (the first `nw` x `np`: row pair `t`'s two outputs) to
/// output `at + i` of rows `j + 2t` and `j + 2t + 1` (where they exist).
fn store<const NW: usize, const NP: usize>(
    out: &mut [&mut [f32]],
    j: usize,
    at: usize,
    dots: &[[[f32; 2]; NP]; NW],
    nw: usize,
    np: usize,
) {
    for (i, d) in dots[..nw].iter().enumerate() {
        for (t, pair) in d[..np].iter().enumerate() {
            for (h, &v) in pair.iter().enumerate() {
                if let Some(y) = out.get_mut(j + 2 * t + h).and_then(|o| o.get_mut(at + i)) {
                    *y = v;
                }
            }
        }
    }
}

/// The dot products of `NW` unpacked weight rows with `NP` activation row
/// pairs of `blocks` blocks: `[i][t]` holds row pair `t`'s two outputs.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; the pointers must be valid
/// for `blocks` blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const OFFSET: bool, const NW: usize, const NP: usize>(
    w: [*const WeightBlock; NW],
    x: [*const RowPairBlock; NP],
    blocks: usize,
) -> [[[f32; 2]; NP]; NW] {
    let mut acc = [[_mm512_setzero_ps(); NP]; NW];
    let mut offsets = [[_mm512_setzero_ps(); NP]; NW];
    for b in 0..blocks {
        // SAFETY: b < blocks, and every row holds `blocks` blocks.
        let (ws, xs) = unsafe { (w.map(|r| &*r.add(b)), x.map(|r| &*r.add(b))) };
        let mut codes = [_mm512_setzero_si512(); NW];
        for i in 0..NW {
            // SAFETY: 32 readable bytes; the load is unaligned.
            let c = unsafe { _mm256_loadu_si256(ws[i].codes.as_ptr().cast()) };
            codes[i] = _mm512_broadcast_i64x4(c);
        }
        for t in 0..NP {
            // SAFETY: a row pair block's fields are 64 bytes each, 64-byte aligned.
            let (q, start, d) = unsafe {
                (
                    _mm512_load_si512(xs[t].q.as_ptr().cast()),
                    _mm512_load_si512(xs[t].start.as_ptr().cast()),
                    _mm512_load_ps(xs[t].d.as_ptr()),
                )
            };
            for i in 0..NW {
                let sum = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, codes[i], q));
                // (d_w d_x) Σ c q + acc, one rounding, as the dot products' FMA.
                let scale = _mm512_mul_ps(_mm512_set1_ps(ws[i].d), d);
                acc[i][t] = _mm512_fmadd_ps(scale, sum, acc[i][t]);
                if OFFSET {
                    // SAFETY: as above.
                    let s = unsafe { _mm512_load_ps(xs[t].s.as_ptr()) };
                    let term = _mm512_mul_ps(_mm512_set1_ps(ws[i].m), s);
                    offsets[i][t] = _mm512_add_ps(offsets[i][t], term);
                }
            }
        }
    }
    let mut dots = [[[0.0; 2]; NP]; NW];
    for i in 0..NW {
        for t in 0..NP {
            let (lo, hi) = halves(acc[i][t]);
            let (off_lo, off_hi) = halves(offsets[i][t]);
            dots[i][t] = [
                hsum(lo) + _mm256_cvtss_f32(off_lo),
                hsum(hi) + _mm256_cvtss_f32(off_hi),
            ];
        }
    }
    dots
}

/// The two 8-lane halves of `v`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn halves(v: __m512) -> (__m256, __m256) {
    let hi = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v));
    (_mm512_castps512_ps256(v), _mm256_castpd_ps(hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::dot::quant_rows;
    use crate::cpu::simd::Isa;
    use crate::cpu::testing::{random_activations, random_weights};
    use rand::{rngs::StdRng, SeedableRng};

    /// Every type in blocks of 32, on shapes off every tile (weight rows,
    /// activation rows, an odd number of activation rows), equals the AVX2
    /// dot products (whose order is llama.cpp's) bit for bit.
    #[test]
    fn products_of_several_rows_equal_the_dot_products_bit_for_bit() {
        let isa = Isa::detect();
        let Some(proof) = isa.avx512_vnni() else {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        };
        let mut rng = StdRng::seed_from_u64(32);
        for dtype in DType::ALL.into_iter().filter(|&t| supports(t)) {
            for (rows, cols, m) in [
                (9, 32, 2),
                (7, 96, 3),
                (13, 576, 6),
                (6, 1536, 5),
                (4, 64, 9),
            ] {
                let w = random_weights(&mut rng, dtype, rows, cols);
                let x = random_activations(&mut rng, m * cols);
                let mut q = QuantizedActivations::new();
                q.quantize_on(isa, ActivationFormat::Q8, &x, cols).unwrap();
                let mut y = vec![f32::NAN; m * rows];
                multiply(proof, dtype, &w, rows, &q, &mut y);
                for (j, (xj, yj)) in q.blocks().chunks(cols / 32).zip(y.chunks(rows)).enumerate() {
                    let mut want = vec![f32::NAN; rows];
                    quant_rows::<1, 1>(isa, dtype, &w, [xj], [&mut want[..]]);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(yj),
                        bits(&want),
                        "{dtype} {rows}x{cols}, m={m}, row {j}"
                    );
                }
            }
        }
    }
}
