//! Dot products of weight rows with activations, computed in tiles: `NW`
//! weight rows times `NX` activation rows, so each loaded weight block serves
//! `NX` activation rows and each activation block `NW` weight rows.
//!
//! Quantized weights in blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL)
//! meet 8-bit [`ActivationBlock`]s; per block of 32 the products are summed
//! in integers and scaled once:
//!
//! - Q8_0, Q5_0, IQ4_NL: `d_w * d_x * Σ c q_x`, `c` the weight's integer
//!   value (`q - 16` for Q5_0, the level for IQ4_NL)
//! - Q4_0: `d_w * d_x * Σ n q_x - 8 d_w * s_x` (since `w = d_w (n - 8)`)
//! - Q4_1, Q5_1: `d_w * d_x * Σ n q_x + m_w * s_x` (since `w = d_w n + m_w`)
//!
//! where `n` are the weight nibbles (five-bit values for Q5_1) and
//! `s_x = d_x Σ q_x`. Float weights (F32, F16, BF16) meet f32 activations;
//! the super-block types (K-quants, IQ4_XS) meet Q8_K ones (`kdot.rs`).
//!
//! The scalar and NEON kernels add the blocks' products ([`block_product`])
//! to each row's sum one after another, so they agree bit for bit; the AVX2
//! kernels keep eight partial sums, which agree to rounding (they are
//! llama.cpp's). On CPUs with AVX-512 VNNI the AVX2 kernels take each lane's
//! integer sum of four products with one `vpdpbusd` instead of `maddubs`,
//! `madd` and a sign flip: the same integers, so the same results bit for
//! bit, in fewer instructions (decode 4–11% faster on two cores of a Xeon,
//! `BENCHMARKS.md`). For float
//! weights the AVX2 and NEON kernels both keep eight lanes of fused
//! multiply-adds and add them up the same way.

use super::kdot::super_rows;
use super::kquant::{BlockQ8K, SUPER};
use super::quant::{
    blocks, f16_le, ActivationBlock, ActivationFormat, BlockIQ4NL, BlockQ4_0, BlockQ4_1, BlockQ5_0,
    BlockQ5_1, BlockQ8_0, BLOCK,
};
use super::simd::Isa;
use super::QuantError;
use crate::DType;

#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "aarch64")]
use super::simd::neon::Widening;

/// The [`QuantError::ActivationKind`] for `dtype` weights given activations
/// in `given`, or `None` if they take them.
fn wrong_activations(dtype: DType, given: Option<ActivationFormat>) -> Option<QuantError> {
    let wanted = ActivationFormat::of(dtype);
    (wanted != given).then_some(QuantError::ActivationKind {
        dtype,
        expected: wanted.map_or("f32", ActivationFormat::name),
    })
}

/// The dot product of one row of quantized `dtype` weights (a type in blocks
/// of 32, see [`ActivationFormat::Q8`]) with activations quantized by
/// [`quantize_row_q8`](super::quantize_row_q8).
///
/// # Errors
/// [`QuantError::ActivationKind`] for other `dtype`s, and
/// [`QuantError::WeightBytes`] unless `w` holds as many blocks as `x`.
pub fn dot_q8(dtype: DType, w: &[u8], x: &[ActivationBlock]) -> Result<f32, QuantError> {
    if let Some(e) = wrong_activations(dtype, Some(ActivationFormat::Q8)) {
        return Err(e);
    }
    QuantError::check_weights(dtype, w.len(), 1, x.len() * BLOCK)?;
    let mut dot = 0.0;
    quant_rows::<1, 1>(
        Isa::detect(),
        dtype,
        w,
        [x],
        [std::slice::from_mut(&mut dot)],
    );
    Ok(dot)
}

/// The dot product of one row of super-block `dtype` weights (the K-quants
/// and IQ4_XS, see [`ActivationFormat::Q8K`]) with activations quantized by
/// [`quantize_row_q8_k`](super::quantize_row_q8_k).
///
/// # Errors
/// [`QuantError::ActivationKind`] for other `dtype`s, and
/// [`QuantError::WeightBytes`] unless `w` holds as many blocks as `x`.
pub fn dot_q8_k(dtype: DType, w: &[u8], x: &[BlockQ8K]) -> Result<f32, QuantError> {
    if let Some(e) = wrong_activations(dtype, Some(ActivationFormat::Q8K)) {
        return Err(e);
    }
    QuantError::check_weights(dtype, w.len(), 1, x.len() * SUPER)?;
    let mut dot = 0.0;
    super_rows::<1, 1>(
        Isa::detect(),
        dtype,
        w,
        [x],
        [std::slice::from_mut(&mut dot)],
    );
    Ok(dot)
}

/// The dot product of one row of F32, F16 or BF16 weights with f32 activations.
///
/// # Errors
/// [`QuantError::ActivationKind`] for quantized `dtype`s, and
/// [`QuantError::WeightBytes`] unless `w` holds `x.len()` weights.
pub fn dot_f32(dtype: DType, w: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    if let Some(e) = wrong_activations(dtype, None) {
        return Err(e);
    }
    QuantError::check_weights(dtype, w.len(), 1, x.len())?;
    let mut dot = 0.0;
    float_rows::<1, 1>(
        Isa::detect(),
        dtype,
        w,
        [x],
        [std::slice::from_mut(&mut dot)],
    );
    Ok(dot)
}

/// `out[j][r] = (row r of w) · x[j]` for `dtype` weights in blocks of 32: `w`
/// holds `out[j].len()` rows of as many blocks as each `x[j]`, and is walked
/// `NW` rows at a time. Callers check shapes; on a mismatch (or a `dtype` of
/// another kind) the scalar code runs, which writes only what both sides
/// have (zeros for another kind).
pub(crate) fn quant_rows<const NW: usize, const NX: usize>(
    isa: Isa,
    dtype: DType,
    w: &[u8],
    x: [&[ActivationBlock]; NX],
    out: [&mut [f32]; NX],
) {
    let nb = x.first().map_or(0, |r| r.len());
    let row_bytes = nb * dtype.block_bytes();
    let rows = out.first().map_or(0, |o| o.len());
    let fits = ActivationFormat::of(dtype) == Some(ActivationFormat::Q8)
        && x.iter().all(|r| r.len() == nb)
        && out.iter().all(|o| o.len() == rows)
        && w.len() == rows * row_bytes;
    #[cfg(target_arch = "aarch64")]
    if fits && isa != Isa::Scalar {
        let (w, x) = (w.as_ptr(), x.map(<[ActivationBlock]>::as_ptr));
        // SAFETY: `w` holds `rows` rows of `nb` blocks and every `x[j]` `nb`
        // blocks (checked just above); a DotprodProof says the CPU has the
        // dot-product extension.
        unsafe {
            match isa {
                Isa::NeonDotprod(p) => neon::quant_rows::<_, NW, NX>(p, dtype, w, rows, x, nb, out),
                _ => neon::quant_rows::<_, NW, NX>(Widening, dtype, w, rows, x, nb, out),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Isa::Avx2(_) = isa {
        if fits {
            let (w, x) = (w.as_ptr(), x.map(<[ActivationBlock]>::as_ptr));
            let kind = match dtype {
                DType::Q8_0 => avx2::Q8_0,
                DType::Q4_0 => avx2::Q4_0,
                DType::Q4_1 => avx2::Q4_1,
                DType::Q5_0 => avx2::Q5_0,
                DType::Q5_1 => avx2::Q5_1,
                _ => avx2::IQ4_NL,
            };
            // SAFETY: the Avx2 proof says the CPU has AVX2, FMA and F16C, an
            // Avx512VnniProof that it also has AVX-512 F, BW, VL and VNNI; `w`
            // holds `rows` rows of `nb` blocks of `kind` and every `x[j]` `nb`
            // blocks (checked just above: `fits` admits the six kinds only).
            unsafe {
                match isa.avx512_vnni() {
                    Some(p) => avx2::quant_rows_vnni::<NW, NX>(p, kind, w, rows, x, nb, out),
                    None => avx2::quant_rows::<NW, NX>(kind, w, rows, x, nb, out),
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
            *y = dot_q8_scalar(dtype, wr, xj);
        }
    }
}

/// `out[j][r] = (row r of w) · x[j]` for float `dtype` weights, under the
/// same rules as [`quant_rows`].
pub(crate) fn float_rows<const NW: usize, const NX: usize>(
    isa: Isa,
    dtype: DType,
    w: &[u8],
    x: [&[f32]; NX],
    out: [&mut [f32]; NX],
) {
    let n = x.first().map_or(0, |r| r.len());
    let row_bytes = n * dtype.block_bytes();
    let rows = out.first().map_or(0, |o| o.len());
    let fits = !dtype.is_quantized()
        && x.iter().all(|r| r.len() == n)
        && out.iter().all(|o| o.len() == rows)
        && w.len() == rows * row_bytes;
    // The SIMD kernels cover the first multiple of 8 elements; the rest of
    // each row is added by the scalar code below.
    let simd_len = n - n % 8;
    let mut out = out;
    let mut simd_done = false;
    #[cfg(target_arch = "aarch64")]
    if fits && isa != Isa::Scalar {
        let (wp, xp) = (w.as_ptr(), x.map(<[f32]>::as_ptr));
        let out_rows = out.each_mut().map(|o| &mut **o);
        // SAFETY: `w` holds `rows` rows of `n >= simd_len` elements and every
        // `x[j]` `n` floats (checked just above).
        unsafe { neon::float_rows::<NW, NX>(dtype, wp, rows, n, xp, simd_len, out_rows) };
        simd_done = true;
    }
    #[cfg(target_arch = "x86_64")]
    if let Isa::Avx2(_) = isa {
        if fits {
            let (wp, xp) = (w.as_ptr(), x.map(<[f32]>::as_ptr));
            let out_rows = out.each_mut().map(|o| &mut **o);
            // SAFETY: the Avx2 proof says the CPU has AVX2, FMA and F16C; `w`
            // holds `rows` rows of `n >= simd_len` elements and every `x[j]`
            // `n` floats (checked just above).
            unsafe {
                match dtype {
                    DType::F32 => avx2::float_rows::<{ avx2::F32 }, NW, NX>(
                        wp, rows, n, xp, simd_len, out_rows,
                    ),
                    DType::F16 => avx2::float_rows::<{ avx2::F16 }, NW, NX>(
                        wp, rows, n, xp, simd_len, out_rows,
                    ),
                    DType::BF16 => avx2::float_rows::<{ avx2::BF16 }, NW, NX>(
                        wp, rows, n, xp, simd_len, out_rows,
                    ),
                    _ => {}
                }
            }
            simd_done = true;
        }
    }
    if simd_done {
        if simd_len < n {
            let tail = simd_len * dtype.block_bytes();
            for (o, xj) in out.iter_mut().zip(x) {
                for (y, wr) in o.iter_mut().zip(w.chunks_exact(row_bytes)) {
                    *y += dot_f32_scalar(dtype, &wr[tail..], &xj[simd_len..]);
                }
            }
        }
        return;
    }
    let _ = (isa, fits);
    if row_bytes == 0 {
        out.into_iter().for_each(|o| o.fill(0.0));
        return;
    }
    for (o, xj) in out.into_iter().zip(x) {
        for (y, wr) in o.iter_mut().zip(w.chunks_exact(row_bytes)) {
            *y = dot_f32_scalar(dtype, wr, xj);
        }
    }
}

/// How a block's offset enters its product (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Offset {
    /// Signed codes, no offset: Q8_0, Q5_0, IQ4_NL.
    None,
    /// Nibbles less 8: Q4_0.
    Eight,
    /// Unsigned codes plus the block's minimum `m_w`: Q4_1, Q5_1.
    Min,
}

/// One block's product from the integer sum `sum` of its codes times the
/// activations (nibbles for Q4_0), with weight scale `d_w` and minimum `m_w`.
/// The scalar and NEON kernels both form every block's product here.
#[inline(always)]
pub(crate) fn block_product(
    offset: Offset,
    d_w: f32,
    m_w: f32,
    a: &ActivationBlock,
    sum: i32,
) -> f32 {
    match offset {
        Offset::None => d_w * a.d * sum as f32,
        Offset::Eight => d_w * (a.d * sum as f32 - 8.0 * a.s),
        Offset::Min => d_w * a.d * sum as f32 + m_w * a.s,
    }
}

/// Writes a tile's `dots[i][j]` to `out[j][first + i]`.
#[inline]
fn store<const NW: usize, const NX: usize>(
    out: &mut [&mut [f32]; NX],
    first: usize,
    dots: &[[f32; NX]; NW],
) {
    for (j, o) in out.iter_mut().enumerate() {
        for (i, d) in dots.iter().enumerate() {
            if let Some(y) = o.get_mut(first + i) {
                *y = d[j];
            }
        }
    }
}

/// Portable [`quant_rows`] for one pair of rows; 0 for other types.
fn dot_q8_scalar(dtype: DType, w: &[u8], x: &[ActivationBlock]) -> f32 {
    /// The row's blocks of `T`, each giving `(d_w, m_w, sum)`, summed in order.
    fn row<T: bytemuck::Pod>(
        w: &[u8],
        x: &[ActivationBlock],
        offset: Offset,
        block: impl Fn(&T, &ActivationBlock) -> (f32, f32, i32),
    ) -> f32 {
        blocks::<T>(w).iter().zip(x).fold(0.0, |acc, (b, a)| {
            let (d_w, m_w, sum) = block(b, a);
            acc + block_product(offset, d_w, m_w, a, sum)
        })
    }
    fn code_dot(codes: [i8; 32], a: &ActivationBlock) -> i32 {
        codes
            .iter()
            .zip(&a.qs)
            .map(|(&c, &q)| i32::from(c) * i32::from(q))
            .sum()
    }
    fn nibble_dot(qs: &[u8; 16], a: &ActivationBlock) -> i32 {
        let (lo, hi) = a.qs.split_at(BLOCK / 2);
        qs.iter()
            .zip(lo.iter().zip(hi))
            .map(|(&q, (&l, &h))| {
                i32::from(q & 0x0F) * i32::from(l) + i32::from(q >> 4) * i32::from(h)
            })
            .sum()
    }
    match dtype {
        DType::Q8_0 => row(w, x, Offset::None, |b: &BlockQ8_0, a| {
            (b.scale(), 0.0, code_dot(b.qs, a))
        }),
        DType::Q4_0 => row(w, x, Offset::Eight, |b: &BlockQ4_0, a| {
            (b.scale(), 0.0, nibble_dot(&b.qs, a))
        }),
        DType::Q4_1 => row(w, x, Offset::Min, |b: &BlockQ4_1, a| {
            (b.scale(), b.min(), nibble_dot(&b.qs, a))
        }),
        DType::Q5_0 => row(w, x, Offset::None, |b: &BlockQ5_0, a| {
            (f16_le(b.d), 0.0, code_dot(b.codes(), a))
        }),
        DType::Q5_1 => row(w, x, Offset::Min, |b: &BlockQ5_1, a| {
            (f16_le(b.d), f16_le(b.m), code_dot(b.codes(), a))
        }),
        DType::IQ4_NL => row(w, x, Offset::None, |b: &BlockIQ4NL, a| {
            (f16_le(b.d), 0.0, code_dot(b.codes(), a))
        }),
        _ => 0.0,
    }
}

/// Portable [`float_rows`] for one pair of rows; 0 for quantized types.
fn dot_f32_scalar(dtype: DType, w: &[u8], x: &[f32]) -> f32 {
    use half::{bf16, f16};
    match dtype {
        DType::F32 => blocks::<[u8; 4]>(w)
            .iter()
            .zip(x)
            .map(|(b, v)| f32::from_le_bytes(*b) * v)
            .sum(),
        DType::F16 => blocks::<[u8; 2]>(w)
            .iter()
            .zip(x)
            .map(|(b, v)| f16::from_le_bytes(*b).to_f32() * v)
            .sum(),
        DType::BF16 => blocks::<[u8; 2]>(w)
            .iter()
            .zip(x)
            .map(|(b, v)| bf16::from_le_bytes(*b).to_f32() * v)
            .sum(),
        _ => 0.0,
    }
}

/// The AVX2 tile kernels. The loops over `NW` and `NX` have constant bounds,
/// so they unroll and the accumulator arrays live in registers.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // tiles index several arrays by the same row numbers
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::kquant::IQ4_LEVELS;
    use super::super::simd::avx2::{fifth_bits, hsum, lane1, load_f16, load_f16_pair, nibbles};
    use super::super::simd::Avx512VnniProof;
    use super::{store, ActivationBlock};

    /// Quantized weight formats, as const parameters.
    pub(super) const Q8_0: u8 = 0;
    pub(super) const Q4_0: u8 = 1;
    pub(super) const Q5_0: u8 = 3;
    pub(super) const Q5_1: u8 = 4;
    pub(super) const IQ4_NL: u8 = 5;
    /// How far ahead of the block being multiplied its weights are prefetched:
    /// enough to cover memory latency at a thread's share of the bandwidth
    /// (2 KiB streamed faster than 384 bytes when decoding one weight row at
    /// a time).
    const PREFETCH_BYTES: usize = 2048;
    pub(super) const Q4_1: u8 = 2;
    /// Float weight formats, as const parameters.
    pub(super) const F32: u8 = 0;
    pub(super) const F16: u8 = 1;
    pub(super) const BF16: u8 = 2;

    /// `out[j][r] = (row r of w) · x[j]` for `rows` rows of `nb` blocks of
    /// format `kind`, `NW` rows per tile.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `w` must point at `rows`
    /// readable rows of `nb` blocks of format `kind`, each `x[j]` at `nb`
    /// activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quant_rows<const NW: usize, const NX: usize>(
        kind: u8,
        w: *const u8,
        rows: usize,
        x: [*const ActivationBlock; NX],
        nb: usize,
        out: [&mut [f32]; NX],
    ) {
        // SAFETY: as this function's.
        unsafe { rows_of_kind::<NW, NX, false>(kind, w, rows, x, nb, out) }
    }

    /// [`quant_rows`] with AVX-512 VNNI's `vpdpbusd` (on 256-bit registers)
    /// for the integer sums: the same sums, so the same results bit for bit,
    /// in fewer instructions.
    ///
    /// # Safety
    /// As [`quant_rows`]'s; the proof says the CPU has AVX-512 F, BW, VL and VNNI.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn quant_rows_vnni<const NW: usize, const NX: usize>(
        proof: Avx512VnniProof,
        kind: u8,
        w: *const u8,
        rows: usize,
        x: [*const ActivationBlock; NX],
        nb: usize,
        out: [&mut [f32]; NX],
    ) {
        let _ = proof;
        // SAFETY: as this function's.
        unsafe { rows_of_kind::<NW, NX, true>(kind, w, rows, x, nb, out) }
    }

    /// [`quant_rows`] by `kind`, inlined into the callers above, whose
    /// target features it takes.
    ///
    /// # Safety
    /// As theirs.
    #[inline(always)]
    unsafe fn rows_of_kind<const NW: usize, const NX: usize, const VNNI: bool>(
        kind: u8,
        w: *const u8,
        rows: usize,
        x: [*const ActivationBlock; NX],
        nb: usize,
        out: [&mut [f32]; NX],
    ) {
        // SAFETY: as this function's, for the format of `kind`.
        unsafe {
            match kind {
                Q8_0 => tiles::<Q8_0, NW, NX, VNNI>(w, rows, x, nb, out),
                Q4_0 => tiles::<Q4_0, NW, NX, VNNI>(w, rows, x, nb, out),
                Q4_1 => tiles::<Q4_1, NW, NX, VNNI>(w, rows, x, nb, out),
                Q5_0 => tiles::<Q5_0, NW, NX, VNNI>(w, rows, x, nb, out),
                Q5_1 => tiles::<Q5_1, NW, NX, VNNI>(w, rows, x, nb, out),
                _ => tiles::<IQ4_NL, NW, NX, VNNI>(w, rows, x, nb, out),
            }
        }
    }

    /// [`quant_rows`] for the format `KIND`.
    ///
    /// # Safety
    /// As [`quant_rows`]'s, and with VNNI as [`quant_rows_vnni`]'s.
    #[inline(always)]
    unsafe fn tiles<const KIND: u8, const NW: usize, const NX: usize, const VNNI: bool>(
        w: *const u8,
        rows: usize,
        x: [*const ActivationBlock; NX],
        nb: usize,
        mut out: [&mut [f32]; NX],
    ) {
        let row_bytes = nb * block_bytes(KIND);
        let mut r = 0;
        while r + NW <= rows {
            let mut tile = [w; NW];
            for i in 0..NW {
                // SAFETY: row r + i < rows is within `w`.
                tile[i] = unsafe { w.add((r + i) * row_bytes) };
            }
            // SAFETY: as this function's, for the NW rows of `tile`.
            let dots = unsafe {
                if VNNI {
                    quant_tile_vnni::<KIND, NW, NX>(tile, x, nb)
                } else {
                    quant_tile::<KIND, NW, NX>(tile, x, nb)
                }
            };
            store(&mut out, r, &dots);
            r += NW;
        }
        while r < rows {
            // SAFETY: as this function's, for row r < rows.
            let dots = unsafe {
                let row = [w.add(r * row_bytes)];
                if VNNI {
                    quant_tile_vnni::<KIND, 1, NX>(row, x, nb)
                } else {
                    quant_tile::<KIND, 1, NX>(row, x, nb)
                }
            };
            store(&mut out, r, &dots);
            r += 1;
        }
    }

    const fn block_bytes(kind: u8) -> usize {
        match kind {
            Q8_0 => 34,
            Q4_0 | IQ4_NL => 18,
            Q5_0 => 22,
            Q5_1 => 24,
            _ => 20,
        }
    }

    /// Formats whose weights are signed integers: their signs move onto the
    /// activations (which stay within ±127) so that `maddubs` sees |c|, and
    /// they have no offset term.
    const fn signed(kind: u8) -> bool {
        matches!(kind, Q8_0 | Q5_0 | IQ4_NL)
    }

    /// `acc + Σ a b` over each 32-bit lane's four bytes, `a` unsigned and `b`
    /// signed (`vpdpbusd`).
    ///
    /// # Safety
    /// The CPU must support AVX-512 VL and VNNI.
    #[inline]
    #[target_feature(enable = "avx512vl,avx512vnni")]
    unsafe fn dpbusd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, a, b)
    }

    /// The unsigned bias `vpdpbusd` takes the [`signed`] formats' codes
    /// with: `c + bias` is a byte from 0 to 255.
    const fn vnni_bias(kind: u8) -> i8 {
        match kind {
            Q5_0 => 16,
            _ => -128, // 0x80, 128 as an unsigned byte
        }
    }

    /// Defines the tile kernel `$name` with the target features of `$attr`,
    /// with (`$vnni`) or without `vpdpbusd`: one body compiled twice, as a
    /// target feature cannot be a generic parameter.
    macro_rules! quant_tile {
        ($(#[$attr:meta])* $name:ident, $vnni:literal) => {
        /// Per block: the weight bytes as unsigned values for `maddubs` (nibbles or
        /// five-bit values, or |c| for the [`signed`] formats), and the scale
        /// pair `[d_w, m_w]` (`m_w = -8 d_w` for Q4_0, 0 for the signed formats). Multiplied by
        /// the activation's `[d_x, s_x]`, lane 0 scales the integer sum and lane 1
        /// is the block's offset term.
        ///
        /// With `VNNI`, each lane's integer sum of four products is one
        /// `vpdpbusd` instead of `maddubs` and `madd` (and, for the signed
        /// formats, the sign moved onto the activations): the signed formats'
        /// codes go in as `c + bias` ([`vnni_bias`]), the lane starting from
        /// `-bias Σ q` over its four activations, so that it ends at the same
        /// exact `Σ c q`.
        ///
        /// # Safety
        /// The CPU must support the function's target features; each `w[i]` must
        /// point at `nb` readable blocks of format `KIND` and each `x[j]` at `nb`
        /// activation blocks.
        $(#[$attr])*
        #[inline]
        unsafe fn $name<const KIND: u8, const NW: usize, const NX: usize>(
            w: [*const u8; NW],
            x: [*const ActivationBlock; NX],
            nb: usize,
        ) -> [[f32; NX]; NW] {
            const VNNI: bool = $vnni;
            let block_bytes = block_bytes(KIND);
            let ones = _mm256_set1_epi16(1);
            let q4_0_offset = _mm_setr_ps(1.0, -8.0, 0.0, 0.0);
            // SAFETY: the table is 16 bytes; the load is unaligned.
            let levels = unsafe { _mm_loadu_si128(IQ4_LEVELS.as_ptr().cast()) };
            let levels = _mm256_broadcastsi128_si256(levels);
            let mut acc = [[_mm256_setzero_ps(); NX]; NW];
            let mut offsets = [[_mm_setzero_ps(); NX]; NW];
            for b in 0..nb {
                let mut scales = [_mm_setzero_ps(); NW];
                let mut bytes = [_mm256_setzero_si256(); NW];
                let mut signs = [_mm256_setzero_si256(); NW];
                for i in 0..NW {
                    // SAFETY: b < nb and row i holds nb blocks, so the block and
                    // the fields read below are in bounds.
                    unsafe {
                        let block = w[i].add(b * block_bytes);
                        // Ask for the weights a few cache lines ahead: the loop
                        // is otherwise bound by memory latency, not bandwidth.
                        // A prefetch never faults, even past the end.
                        _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(PREFETCH_BYTES).cast());
                        match KIND {
                            Q8_0 if VNNI => {
                                let q = _mm256_loadu_si256(block.add(2).cast());
                                scales[i] = load_f16(block);
                                bytes[i] = _mm256_xor_si256(q, _mm256_set1_epi8(vnni_bias(KIND)));
                            }
                            Q8_0 => {
                                let q = _mm256_loadu_si256(block.add(2).cast());
                                scales[i] = load_f16(block);
                                bytes[i] = _mm256_sign_epi8(q, q);
                                signs[i] = q;
                            }
                            Q4_0 => {
                                scales[i] =
                                    _mm_mul_ps(_mm_broadcastss_ps(load_f16(block)), q4_0_offset);
                                bytes[i] = nibbles(block.add(2));
                            }
                            Q5_0 if VNNI => {
                                // q = c + 16: the nibble plus 16 where the fifth bit is set.
                                let high =
                                    _mm256_and_si256(fifth_bits(block.add(2)), _mm256_set1_epi8(16));
                                scales[i] = load_f16(block);
                                bytes[i] = _mm256_or_si256(nibbles(block.add(6)), high);
                            }
                            Q5_0 => {
                                // q - 16: the nibble where the fifth bit is set,
                                // else the nibble - 16 (its high bits set).
                                let high = _mm256_andnot_si256(
                                    fifth_bits(block.add(2)),
                                    _mm256_set1_epi8(0xF0_u8 as i8),
                                );
                                let q = _mm256_or_si256(nibbles(block.add(6)), high);
                                scales[i] = load_f16(block);
                                bytes[i] = _mm256_sign_epi8(q, q);
                                signs[i] = q;
                            }
                            Q5_1 => {
                                scales[i] = load_f16_pair(block);
                                let high =
                                    _mm256_and_si256(fifth_bits(block.add(4)), _mm256_set1_epi8(16));
                                bytes[i] = _mm256_or_si256(nibbles(block.add(8)), high);
                            }
                            IQ4_NL => {
                                let q = _mm256_shuffle_epi8(levels, nibbles(block.add(2)));
                                scales[i] = load_f16(block);
                                if VNNI {
                                    bytes[i] = _mm256_xor_si256(q, _mm256_set1_epi8(vnni_bias(KIND)));
                                } else {
                                    bytes[i] = _mm256_sign_epi8(q, q);
                                    signs[i] = q;
                                }
                            }
                            _ => {
                                scales[i] = load_f16_pair(block);
                                bytes[i] = nibbles(block.add(4));
                            }
                        }
                    }
                }
                for j in 0..NX {
                    // SAFETY: b < nb and activation row j holds nb blocks; `d` and
                    // `s` are the block's first 8 bytes and `qs` the next 32.
                    let (xs, xq) = unsafe {
                        let a = x[j].add(b);
                        (
                            _mm_castpd_ps(_mm_load_sd(a.cast())),
                            _mm256_loadu_si256(a.cast::<u8>().add(8).cast()),
                        )
                    };
                    // With VNNI, `-bias Σ q` for each lane's four activations.
                    let start = if VNNI && signed(KIND) {
                        // SAFETY: VNNI is set only in quant_tile_vnni,
                        // whose target features are dpbusd's.
                        let biased = unsafe {
                            dpbusd(_mm256_setzero_si256(), _mm256_set1_epi8(vnni_bias(KIND)), xq)
                        };
                        _mm256_sub_epi32(_mm256_setzero_si256(), biased)
                    } else {
                        _mm256_setzero_si256()
                    };
                    for i in 0..NW {
                        let products = if VNNI {
                            // SAFETY: as above.
                            unsafe { dpbusd(start, bytes[i], xq) }
                        } else if signed(KIND) {
                            let xq = _mm256_sign_epi8(xq, signs[i]);
                            _mm256_madd_epi16(_mm256_maddubs_epi16(bytes[i], xq), ones)
                        } else {
                            _mm256_madd_epi16(_mm256_maddubs_epi16(bytes[i], xq), ones)
                        };
                        let sum = _mm256_cvtepi32_ps(products);
                        let scale = _mm_mul_ps(scales[i], xs);
                        acc[i][j] = _mm256_fmadd_ps(_mm256_broadcastss_ps(scale), sum, acc[i][j]);
                        if !signed(KIND) {
                            offsets[i][j] = _mm_add_ps(offsets[i][j], scale);
                        }
                    }
                }
            }
            let mut out = [[0.0; NX]; NW];
            for i in 0..NW {
                for j in 0..NX {
                    out[i][j] = hsum(acc[i][j]) + lane1(offsets[i][j]);
                }
            }
            out
        }

        };
    }

    quant_tile!(
        #[target_feature(enable = "avx2,fma,f16c")]
        quant_tile,
        false
    );
    quant_tile!(
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        quant_tile_vnni,
        true
    );

    /// Eight weights of format `KIND` from element `k` on, as f32.
    ///
    /// # Safety
    /// `w` must point at at least `k + 8` readable elements of format `KIND`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const KIND: u8>(w: *const u8, k: usize) -> __m256 {
        // SAFETY: the caller guarantees elements k..k + 8 are readable; all loads are unaligned.
        unsafe {
            match KIND {
                F32 => _mm256_loadu_ps(w.add(4 * k).cast()),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * k).cast())),
                _ => {
                    // bf16 is the top half of an f32.
                    let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(w.add(2 * k).cast()));
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
                }
            }
        }
    }

    /// `out[j][r] = (row r of w) · x[j]` over the first `simd_len` (a
    /// multiple of 8) of the `n` elements of each row, `NW` rows per tile.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `w` must point at `rows`
    /// readable rows of `n >= simd_len` elements of format `KIND`, each
    /// `x[j]` at `simd_len` floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn float_rows<const KIND: u8, const NW: usize, const NX: usize>(
        w: *const u8,
        rows: usize,
        n: usize,
        x: [*const f32; NX],
        simd_len: usize,
        mut out: [&mut [f32]; NX],
    ) {
        let row_bytes = n * if KIND == F32 { 4 } else { 2 };
        let mut r = 0;
        while r + NW <= rows {
            let mut tile = [w; NW];
            for i in 0..NW {
                // SAFETY: row r + i < rows is within `w`.
                tile[i] = unsafe { w.add((r + i) * row_bytes) };
            }
            // SAFETY: as this function's, for the NW rows of `tile`.
            let dots = unsafe { float_tile::<KIND, NW, NX>(tile, x, simd_len) };
            store(&mut out, r, &dots);
            r += NW;
        }
        while r < rows {
            // SAFETY: as this function's, for row r < rows.
            let dots = unsafe { float_tile::<KIND, 1, NX>([w.add(r * row_bytes)], x, simd_len) };
            store(&mut out, r, &dots);
            r += 1;
        }
    }

    /// Float weights times f32 activations over the first `n` elements (a
    /// multiple of 8).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; each `w[i]` must point at `n`
    /// readable elements of format `KIND` and each `x[j]` at `n` floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn float_tile<const KIND: u8, const NW: usize, const NX: usize>(
        w: [*const u8; NW],
        x: [*const f32; NX],
        n: usize,
    ) -> [[f32; NX]; NW] {
        let mut acc = [[_mm256_setzero_ps(); NX]; NW];
        for k in (0..n).step_by(8) {
            let mut wv = [_mm256_setzero_ps(); NW];
            for i in 0..NW {
                // SAFETY: k + 8 <= n, and row i holds n elements.
                wv[i] = unsafe { load8::<KIND>(w[i], k) };
            }
            for j in 0..NX {
                // SAFETY: k + 8 <= n, and activation row j holds n floats.
                let xv = unsafe { _mm256_loadu_ps(x[j].add(k)) };
                for i in 0..NW {
                    acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
                }
            }
        }
        let mut out = [[0.0; NX]; NW];
        for i in 0..NW {
            for j in 0..NX {
                out[i][j] = hsum(acc[i][j]);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::quant::quantize_row_on;
    use crate::cpu::testing::{random_activations, random_weights, reference};
    use rand::{rngs::StdRng, SeedableRng};

    fn quantize(x: &[f32]) -> Vec<ActivationBlock> {
        let mut blocks = vec![ActivationBlock::default(); x.len() / BLOCK];
        quantize_row_on(Isa::Scalar, x, &mut blocks).unwrap();
        blocks
    }

    /// The types in blocks of 32 and the float ones (the super-block types
    /// are tested in `kdot.rs`).
    fn types() -> impl Iterator<Item = DType> {
        DType::ALL
            .into_iter()
            .filter(|&t| ActivationFormat::of(t) != Some(ActivationFormat::Q8K))
    }

    fn lengths(dtype: DType) -> &'static [usize] {
        if dtype.is_quantized() {
            &[32, 96, 576, 1536]
        } else {
            &[1, 7, 37, 576, 1536]
        }
    }

    #[test]
    fn dot_products_match_f64_reference() {
        let mut rng = StdRng::seed_from_u64(10);
        for dtype in types() {
            for &n in lengths(dtype) {
                let w = random_weights(&mut rng, dtype, 1, n);
                let x = random_activations(&mut rng, n);
                let (exact, tol) = reference(dtype, &w, 1, n, &x);
                let got = if dtype.is_quantized() {
                    dot_q8(dtype, &w, &quantize(&x)).unwrap()
                } else {
                    dot_f32(dtype, &w, &x).unwrap()
                };
                let err = (f64::from(got) - exact[0]).abs();
                assert!(
                    err <= tol[0],
                    "{dtype} n={n}: {got} vs {} (error {err} > {})",
                    exact[0],
                    tol[0]
                );
            }
        }
    }

    /// `rows` random weight rows against `NX` activation rows, tiled `NW`
    /// rows at a time, on every instruction set, against the reference.
    fn check_rows<const NW: usize, const NX: usize>(rng: &mut StdRng, dtype: DType, n: usize) {
        let rows = 7; // not a multiple of any tile height
        let w = random_weights(rng, dtype, rows, n);
        let x: Vec<Vec<f32>> = (0..NX).map(|_| random_activations(rng, n)).collect();
        let q: Vec<Vec<ActivationBlock>> = match dtype.is_quantized() {
            true => x.iter().map(|r| quantize(r)).collect(),
            false => Vec::new(),
        };
        for isa in Isa::available() {
            let mut out = vec![vec![f32::NAN; rows]; NX];
            let mut outs = out.iter_mut();
            let out_rows = std::array::from_fn(|_| outs.next().unwrap().as_mut_slice());
            if dtype.is_quantized() {
                quant_rows::<NW, NX>(isa, dtype, &w, std::array::from_fn(|j| &q[j][..]), out_rows);
            } else {
                float_rows::<NW, NX>(isa, dtype, &w, std::array::from_fn(|j| &x[j][..]), out_rows);
            }
            for (j, xj) in x.iter().enumerate() {
                let (exact, tol) = reference(dtype, &w, rows, n, xj);
                for r in 0..rows {
                    let err = (f64::from(out[j][r]) - exact[r]).abs();
                    assert!(
                        err <= tol[r],
                        "{dtype} n={n} {NW}x{NX} {isa:?} ({r},{j}): error {err} > {}",
                        tol[r]
                    );
                }
            }
        }
    }

    #[test]
    fn tiled_rows_match_reference_on_every_isa() {
        let mut rng = StdRng::seed_from_u64(11);
        for dtype in types() {
            for &n in lengths(dtype) {
                check_rows::<1, 1>(&mut rng, dtype, n);
                check_rows::<2, 1>(&mut rng, dtype, n);
                check_rows::<4, 1>(&mut rng, dtype, n);
                check_rows::<1, 4>(&mut rng, dtype, n);
                check_rows::<2, 3>(&mut rng, dtype, n);
            }
        }
    }

    #[test]
    fn scalar_and_simd_agree() {
        let mut rng = StdRng::seed_from_u64(12);
        for dtype in types() {
            let (rows, n) = (5, 1536);
            let w = random_weights(&mut rng, dtype, rows, n);
            let x = random_activations(&mut rng, n);
            let q = quantize(&x);
            let run = |isa| {
                let mut out = vec![0.0; rows];
                if dtype.is_quantized() {
                    quant_rows::<2, 1>(isa, dtype, &w, [&q[..]], [&mut out[..]]);
                } else {
                    float_rows::<2, 1>(isa, dtype, &w, [&x[..]], [&mut out[..]]);
                }
                out
            };
            let scalar = run(Isa::Scalar);
            let (_, tol) = reference(dtype, &w, rows, n, &x);
            for isa in Isa::available() {
                let simd = run(isa);
                if dtype.is_quantized() && isa.sums_blocks_in_order() {
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&simd), bits(&scalar), "{dtype} {isa:?}");
                    continue;
                }
                // Same (quantized) inputs; only the float summation order
                // differs, so quantized types agree far closer than their
                // tolerance.
                let share = if dtype.is_quantized() { 0.01 } else { 1.0 };
                for ((a, b), t) in simd.iter().zip(&scalar).zip(&tol) {
                    assert!(
                        f64::from((a - b).abs()) <= t * share,
                        "{dtype} {isa:?}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// The AVX2 kernels with VNNI's `vpdpbusd` give the sums of those
    /// without it bit for bit, for every type in blocks of 32 and every tile
    /// shape the matmul uses, on random blocks and on Q8_0 weights of -128
    /// and 127 against activations of ±127. (A CPU without AVX-512 VNNI has
    /// one AVX2 kernel set only, and nothing to compare.)
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_tiles_give_the_avx2_sums_bit_for_bit() {
        let avx2: Vec<Isa> = Isa::available()
            .into_iter()
            .filter(|i| matches!(i, Isa::Avx2(_)))
            .collect();
        let mut rng = StdRng::seed_from_u64(14);
        let (rows, n) = (7, 1536);
        let mut cases: Vec<(DType, Vec<u8>, Vec<f32>)> = types()
            .filter(|t| t.is_quantized())
            .map(|t| {
                let w = random_weights(&mut rng, t, rows, n);
                (t, w, random_activations(&mut rng, n))
            })
            .collect();
        let mut extreme = random_weights(&mut rng, DType::Q8_0, rows, n);
        for (k, byte) in extreme.iter_mut().enumerate() {
            if k % 34 >= 2 {
                *byte = if k % 2 == 0 { 0x80 } else { 0x7F };
            }
        }
        let signs = (0..n)
            .map(|i| if i % 3 == 0 { -2.0 } else { 2.0 })
            .collect();
        cases.push((DType::Q8_0, extreme, signs));
        for (dtype, w, x) in &cases {
            let q = quantize(x);
            let run = |isa| {
                let mut out = vec![vec![0f32; rows]; 4];
                let [o0, o1, o2, o3] = &mut out[..] else {
                    unreachable!()
                };
                quant_rows::<4, 1>(isa, *dtype, w, [&q[..]], [&mut o0[..]]);
                quant_rows::<1, 1>(isa, *dtype, w, [&q[..]], [&mut o1[..]]);
                quant_rows::<2, 2>(isa, *dtype, w, [&q[..]; 2], [&mut o2[..], &mut o3[..]]);
                out.iter()
                    .flatten()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            };
            let first = avx2.first().map(|&isa| run(isa));
            for &isa in avx2.iter().skip(1) {
                assert_eq!(Some(run(isa)), first, "{dtype} {isa:?}");
            }
        }
    }

    /// Weights and activations at the ends of their ranges: Q8_0 weights of
    /// -128 and 127 against activations of ±127, for every tile shape the
    /// matmul uses.
    #[test]
    fn extreme_blocks_agree_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(13);
        let (rows, n) = (5, 256);
        let mut w = random_weights(&mut rng, DType::Q8_0, rows, n);
        for (k, byte) in w.iter_mut().enumerate() {
            if k % 34 >= 2 {
                *byte = if k % 2 == 0 { 0x80 } else { 0x7F };
            }
        }
        let x: Vec<f32> = (0..n)
            .map(|i| if i % 3 == 0 { -2.0 } else { 2.0 })
            .collect();
        let q = quantize(&x);
        assert!(q[0].qs.contains(&-127) && q[0].qs.contains(&127));
        let run = |isa| {
            let mut out = vec![vec![0.0; rows]; 4];
            let [o0, o1, o2, o3] = &mut out[..] else {
                unreachable!()
            };
            quant_rows::<1, 4>(isa, DType::Q8_0, &w, [&q[..]; 4], [o0, o1, o2, o3]);
            out
        };
        let scalar = run(Isa::Scalar);
        for isa in Isa::available()
            .into_iter()
            .filter(|i| i.sums_blocks_in_order())
        {
            assert_eq!(run(isa), scalar, "{isa:?}");
        }
    }

    #[test]
    fn dots_reject_bad_operands() {
        let x = vec![ActivationBlock::default(); 2];
        assert!(matches!(
            dot_q8(DType::F16, &[0; 128], &x),
            Err(QuantError::ActivationKind { .. })
        ));
        assert!(matches!(
            dot_q8(DType::Q4_1, &[0; 20], &x),
            Err(QuantError::WeightBytes {
                expected: 40,
                actual: 20,
                ..
            })
        ));
        assert!(matches!(
            dot_f32(DType::Q8_0, &[0; 34], &[0.0; 32]),
            Err(QuantError::ActivationKind { .. })
        ));
        assert!(matches!(
            dot_f32(DType::BF16, &[0; 6], &[1.0; 4]),
            Err(QuantError::WeightBytes { .. })
        ));
        assert!(matches!(
            dot_q8(DType::Q4_K, &[0; 144], &[ActivationBlock::default(); 8]),
            Err(QuantError::ActivationKind {
                expected: "Q8_K (BlockQ8K)",
                ..
            })
        ));
        assert!(matches!(
            dot_q8_k(DType::Q5_0, &[0; 176], &[BlockQ8K::default()]),
            Err(QuantError::ActivationKind { .. })
        ));
        assert!(matches!(
            dot_q8_k(DType::Q6_K, &[0; 210], &[BlockQ8K::default(); 2]),
            Err(QuantError::WeightBytes { expected: 420, .. })
        ));
    }
}
