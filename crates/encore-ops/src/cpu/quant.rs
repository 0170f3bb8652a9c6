//! Block layouts of 32 weights, dequantization of weight rows, and the 8-bit
//! quantization of activations that the integer dot products consume.

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

use super::kquant::{
    quantize_row_q8_k, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K,
    SuperBlock, IQ4_LEVELS, SUPER,
};
use super::simd::Isa;
use super::QuantError;
use crate::DType;

/// A Q8_0 weight block: weight `i` is `d * qs[i]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// The scale, a little-endian f16.
    pub d: [u8; 2],
    pub qs: [i8; 32],
}

/// A Q4_0 weight block: weight `j` is `d * (low nibble of qs[j] - 8)` and
/// weight `j + 16` is `d * (high nibble of qs[j] - 8)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// The scale, a little-endian f16.
    pub d: [u8; 2],
    pub qs: [u8; 16],
}

/// A Q4_1 weight block: weight `j` is `d * (low nibble of qs[j]) + m` and
/// weight `j + 16` is `d * (high nibble of qs[j]) + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// The scale, a little-endian f16.
    pub d: [u8; 2],
    /// The minimum, a little-endian f16.
    pub m: [u8; 2],
    pub qs: [u8; 16],
}

/// A Q5_0 weight block: the low four bits of weight `j` and `j + 16` as in
/// Q4_0, the fifth at bit `j` and `j + 16` of `qh` (a little-endian u32);
/// weight = `d * (q - 16)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub(crate) struct BlockQ5_0 {
    pub d: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// A Q5_1 weight block: `q` as in Q5_0; weight = `d * q + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub(crate) struct BlockQ5_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// An IQ4_NL weight block: nibbles as in Q4_0; weight = `d * IQ4_LEVELS[nibble]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub(crate) struct BlockIQ4NL {
    pub d: [u8; 2],
    pub qs: [u8; 16],
}

/// The five-bit values `0..32` of a Q5 block's weights, in order.
fn five_bits(qh: [u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    let high = u32::from_le_bytes(qh);
    std::array::from_fn(|i| {
        let low = if i < 16 {
            qs[i] & 0x0F
        } else {
            qs[i - 16] >> 4
        };
        low | (((high >> i) & 1) as u8) << 4
    })
}

impl BlockQ5_0 {
    /// The weights' integer values, `q - 16`.
    pub(crate) fn codes(&self) -> [i8; 32] {
        five_bits(self.qh, &self.qs).map(|q| q as i8 - 16)
    }
}

impl BlockQ5_1 {
    /// The weights' integer values `q`.
    pub(crate) fn codes(&self) -> [i8; 32] {
        five_bits(self.qh, &self.qs).map(|q| q as i8)
    }
}

impl BlockIQ4NL {
    /// The weights' levels.
    pub(crate) fn codes(&self) -> [i8; 32] {
        std::array::from_fn(|i| {
            let nibble = if i < 16 {
                self.qs[i] & 0x0F
            } else {
                self.qs[i - 16] >> 4
            };
            IQ4_LEVELS[usize::from(nibble)]
        })
    }
}

/// 32 activations quantized for the integer dot products: `x[i] ≈ d * qs[i]`,
/// and `s = d * sum(qs)`, which Q4_1's and Q5_1's offset `m` (and Q4_0's `-8`)
/// multiplies.
///
/// ggml's Q8_1 block, computed exactly as ggml's AVX2 code does so that dot
/// products match llama.cpp's: `id = 127 / amax`, `q = round_ties_even(x * id)`,
/// `d = f16(amax / 127)` and `s = f16((amax / 127) * Σq)`, kept here as the
/// f32 values of those halves (beyond f16's range, see `block_scales`). (Q4_0 weights use `s` for their `-8` offset,
/// which rounds that term where ggml's integer form does not.) `qs` stays within `-127..=127`, which the
/// Q8_0 kernel relies on (it moves the weights' signs onto the activations).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct ActivationBlock {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

/// Weights per quantized block, and activations per [`ActivationBlock`].
pub(crate) const BLOCK: usize = 32;

pub(crate) fn f16_le(bytes: [u8; 2]) -> f32 {
    f16::from_le_bytes(bytes).to_f32()
}

impl BlockQ8_0 {
    /// The block's scale `d`.
    pub fn scale(&self) -> f32 {
        f16_le(self.d)
    }
}

impl BlockQ4_0 {
    /// The block's scale `d`.
    pub fn scale(&self) -> f32 {
        f16_le(self.d)
    }
}

impl BlockQ4_1 {
    /// The block's scale `d`.
    pub fn scale(&self) -> f32 {
        f16_le(self.d)
    }

    /// The block's minimum `m`.
    pub fn min(&self) -> f32 {
        f16_le(self.m)
    }
}

/// Views `bytes` as blocks of `T`; every `T` here has alignment 1, so only the
/// length can be wrong, and the callers have checked it.
pub(crate) fn blocks<T: Pod>(bytes: &[u8]) -> &[T] {
    bytemuck::try_cast_slice(bytes).unwrap_or(&[])
}

/// Decodes one row of `dtype` weights into `dst`, whose length is the row's
/// element count.
///
/// # Errors
/// [`QuantError::PartialBlock`] if `dst.len()` is not a whole number of
/// blocks, [`QuantError::WeightBytes`] if `src` is not exactly that many blocks.
pub fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    QuantError::check_weights(dtype, src.len(), 1, dst.len())?;
    match dtype {
        DType::F32 => {
            for (out, b) in dst.iter_mut().zip(blocks::<[u8; 4]>(src)) {
                *out = f32::from_le_bytes(*b);
            }
        }
        DType::F16 => {
            for (out, b) in dst.iter_mut().zip(blocks::<[u8; 2]>(src)) {
                *out = f16::from_le_bytes(*b).to_f32();
            }
        }
        DType::BF16 => {
            for (out, b) in dst.iter_mut().zip(blocks::<[u8; 2]>(src)) {
                *out = bf16::from_le_bytes(*b).to_f32();
            }
        }
        DType::Q8_0 => {
            for (out, b) in dst.chunks_exact_mut(BLOCK).zip(blocks::<BlockQ8_0>(src)) {
                let d = b.scale();
                for (o, &q) in out.iter_mut().zip(&b.qs) {
                    *o = d * f32::from(q);
                }
            }
        }
        DType::Q4_0 => {
            for (out, b) in dst.chunks_exact_mut(BLOCK).zip(blocks::<BlockQ4_0>(src)) {
                let d = b.scale();
                let (lo, hi) = out.split_at_mut(BLOCK / 2);
                for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b.qs) {
                    *l = d * (f32::from(q & 0x0F) - 8.0);
                    *h = d * (f32::from(q >> 4) - 8.0);
                }
            }
        }
        DType::Q4_1 => {
            for (out, b) in dst.chunks_exact_mut(BLOCK).zip(blocks::<BlockQ4_1>(src)) {
                let (d, m) = (b.scale(), b.min());
                let (lo, hi) = out.split_at_mut(BLOCK / 2);
                for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b.qs) {
                    *l = d * f32::from(q & 0x0F) + m;
                    *h = d * f32::from(q >> 4) + m;
                }
            }
        }
        DType::Q5_0 => {
            for (out, b) in dst.chunks_exact_mut(BLOCK).zip(blocks::<BlockQ5_0>(src)) {
                let d = f16_le(b.d);
                for (o, q) in out.iter_mut().zip(b.codes()) {
                    *o = d * f32::from(q);
                }
            }
        }
        DType::Q5_1 => {
            for (out, b) in dst.chunks_exact_mut(BLOCK).zip(blocks::<BlockQ5_1>(src)) {
                let (d, m) = (f16_le(b.d), f16_le(b.m));
                for (o, q) in out.iter_mut().zip(b.codes()) {
                    *o = d * f32::from(q) + m;
                }
            }
        }
        DType::IQ4_NL => {
            for (out, b) in dst.chunks_exact_mut(BLOCK).zip(blocks::<BlockIQ4NL>(src)) {
                let d = f16_le(b.d);
                for (o, q) in out.iter_mut().zip(b.codes()) {
                    *o = d * f32::from(q);
                }
            }
        }
        DType::Q2_K => dequantize_super::<BlockQ2K>(src, dst),
        DType::Q3_K => dequantize_super::<BlockQ3K>(src, dst),
        DType::Q4_K => dequantize_super::<BlockQ4K>(src, dst),
        DType::Q5_K => dequantize_super::<BlockQ5K>(src, dst),
        DType::Q6_K => dequantize_super::<BlockQ6K>(src, dst),
        DType::IQ4_XS => dequantize_super::<BlockIQ4XS>(src, dst),
    }
    Ok(())
}

fn dequantize_super<T: SuperBlock>(src: &[u8], dst: &mut [f32]) {
    for (out, b) in dst.chunks_exact_mut(SUPER).zip(blocks::<T>(src)) {
        b.unpack().dequantize(out);
    }
}

/// Quantizes `src` to 8-bit activation blocks, 32 values per block: with
/// `amax` the block's largest magnitude, `d = amax / 127` and
/// `qs[i] = round(src[i] / d)`, ties to even.
///
/// # Errors
/// [`QuantError::Length`] unless `src.len() == 32 * dst.len()`.
pub fn quantize_row_q8(src: &[f32], dst: &mut [ActivationBlock]) -> Result<(), QuantError> {
    quantize_row_on(Isa::detect(), src, dst)
}

/// Values below which one thread quantizes all the rows: handing work to
/// another thread costs about what it saves.
const PARALLEL_VALUES: usize = 16 * 1024;

/// `quantize(src, dst)` over `x` (rows of `cols` values) into `dst`
/// (`per_row` blocks a row): for many rows (a prompt), a share of the rows a
/// task on the worker pool ([`encore::parallel`]). Returns the first error.
fn by_rows<T: Send>(
    x: &[f32],
    cols: usize,
    dst: &mut [T],
    per_row: usize,
    quantize: impl Fn(&[f32], &mut [T]) -> Result<(), QuantError> + Sync,
) -> Result<(), QuantError> {
    let threads = encore::parallel::threads();
    let rows = x.len().checked_div(cols).unwrap_or(0);
    if threads <= 1 || x.len() < PARALLEL_VALUES || per_row == 0 {
        return quantize(x, dst);
    }
    let task_rows = rows.div_ceil(2 * threads).max(1);
    let failed = std::sync::Mutex::new(None);
    encore::parallel::for_each_chunk_mut(dst, task_rows * per_row, |t, d| {
        let first = t * task_rows * cols;
        let src = x
            .get(first..first + d.len() / per_row * cols)
            .unwrap_or(&[]);
        if let Err(e) = quantize(src, d) {
            if let Ok(mut f) = failed.lock() {
                f.get_or_insert(e);
            }
        }
    });
    match failed.into_inner() {
        Ok(Some(e)) => Err(e),
        _ => Ok(()),
    }
}

pub(crate) fn quantize_row_on(
    isa: Isa,
    src: &[f32],
    dst: &mut [ActivationBlock],
) -> Result<(), QuantError> {
    if src.len() != dst.len() * BLOCK {
        return Err(QuantError::Length {
            what: "activations to quantize",
            expected: dst.len() * BLOCK,
            actual: src.len(),
        });
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2(_) => {
            for (x, out) in src.chunks_exact(BLOCK).zip(dst) {
                // SAFETY: the Isa::Avx2 proof says the CPU has AVX2, FMA and
                // F16C; `x` is a chunk of exactly 32 floats.
                unsafe { avx2::quantize_block(x.as_ptr(), out) };
            }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon | Isa::NeonDotprod(_) => {
            for (x, out) in src.chunks_exact(BLOCK).zip(dst) {
                // SAFETY: `x` is a chunk of exactly 32 floats.
                unsafe { neon::quantize_block(x.as_ptr(), out) };
            }
        }
        Isa::Scalar => {
            for (x, out) in src.chunks_exact(BLOCK).zip(dst) {
                quantize_block_scalar(x, out);
            }
        }
    }
    Ok(())
}

fn quantize_block_scalar(x: &[f32], out: &mut ActivationBlock) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in out.qs.iter_mut().zip(x) {
        // In range: |v * id| <= 127 up to rounding, and `as` saturates anyway.
        *q = (v * id).round_ties_even() as i8;
        sum += i32::from(*q);
    }
    (out.d, out.s) = block_scales(d, sum);
}

/// The f32 value of the nearest f16, as ggml stores block scales.
pub(crate) fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// An activation block's stored scale and scaled code sum for a scale `d`
/// and codes summing to `sum`: `(f16(d), f16(d Σq))`, as ggml stores them.
/// Where f16 cannot hold one (a block holding a value in the hundreds of
/// thousands, which real models' feed-forward outputs reach on a few
/// tokens), ggml's is infinite and its products NaN; here the scale stays
/// as f16 holds it or else f32, and the sum is that scale times `Σq`, so
/// that Q4_0's `d Σ q w - 8 s` still cancels as its integer form would. A
/// block holding a NaN (whose code sum is out of range: the SIMD
/// conversions make a NaN's code the most negative integer) keeps ggml's
/// values, so that the NaN still reaches the product.
pub(crate) fn block_scales(d: f32, sum: i32) -> (f32, f32) {
    let (rd, rs) = (round_f16(d), round_f16(d * sum as f32));
    let codes_in_range = sum.unsigned_abs() <= 127 * BLOCK as u32;
    if rd.is_finite() && rs.is_finite() || !d.is_finite() || !codes_in_range {
        return (rd, rs);
    }
    let d = if rd.is_finite() { rd } else { d };
    (d, d * sum as f32)
}

#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::ActivationBlock;

    /// The same arithmetic as `quantize_block_scalar`, eight lanes at a time,
    /// so both give bit-identical blocks.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, and `x` must point at 32
    /// readable floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_block(x: *const f32, out: &mut ActivationBlock) {
        // SAFETY: the caller guarantees 32 readable floats; loads are unaligned.
        let v = unsafe {
            [
                _mm256_loadu_ps(x),
                _mm256_loadu_ps(x.add(8)),
                _mm256_loadu_ps(x.add(16)),
                _mm256_loadu_ps(x.add(24)),
            ]
        };
        let sign = _mm256_set1_ps(-0.0);
        let abs = |a: __m256| _mm256_andnot_ps(sign, a);
        let max8 = _mm256_max_ps(
            _mm256_max_ps(abs(v[0]), abs(v[1])),
            _mm256_max_ps(abs(v[2]), abs(v[3])),
        );
        let max4 = _mm_max_ps(
            _mm256_castps256_ps128(max8),
            _mm256_extractf128_ps::<1>(max8),
        );
        let max2 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
        let amax = _mm_cvtss_f32(_mm_max_ss(max2, _mm_movehdup_ps(max2)));

        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let round = |a: __m256| {
            _mm256_cvtps_epi32(_mm256_round_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(_mm256_mul_ps(a, id)))
        };
        let q = [round(v[0]), round(v[1]), round(v[2]), round(v[3])];

        let sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let sum4 = _mm_add_epi32(
            _mm256_castsi256_si128(sum8),
            _mm256_extracti128_si256::<1>(sum8),
        );
        let sum2 = _mm_add_epi32(sum4, _mm_unpackhi_epi64(sum4, sum4));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum2, _mm_shuffle_epi32::<0b01>(sum2)));

        // Packing works within 128-bit lanes, leaving the 32-bit groups in the
        // order 0 4 1 5 2 6 3 7; the permute restores 0..8.
        let packed = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let ordered =
            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `qs` is 32 writable bytes; the store is unaligned.
        unsafe { _mm256_storeu_si256(out.qs.as_mut_ptr().cast(), ordered) };
        (out.d, out.s) = super::block_scales(d, sum);
    }
}

/// The form the integer dot products take activations in, which depends on
/// the weights' type (as ggml's `vec_dot_type` does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationFormat {
    /// Blocks of 32, [`ActivationBlock`]: for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
    /// and IQ4_NL weights.
    #[default]
    Q8,
    /// Super-blocks of 256, [`BlockQ8K`]: for the K-quants and IQ4_XS.
    Q8K,
}

impl ActivationFormat {
    /// The format `dtype` weights take, or `None` for float weights (which
    /// take f32 activations).
    pub const fn of(dtype: DType) -> Option<ActivationFormat> {
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => None,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::IQ4_NL => {
                Some(ActivationFormat::Q8)
            }
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS => {
                Some(ActivationFormat::Q8K)
            }
        }
    }

    /// Values per block.
    pub const fn block_len(self) -> usize {
        match self {
            ActivationFormat::Q8 => BLOCK,
            ActivationFormat::Q8K => SUPER,
        }
    }

    /// The format's name in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            ActivationFormat::Q8 => "8-bit blocks of 32 (ActivationBlock)",
            ActivationFormat::Q8K => "Q8_K (BlockQ8K)",
        }
    }
}

/// Activations quantized once and reused by several matrix products (such as
/// the q, k and v projections of one input), or kept between calls so that
/// quantizing allocates nothing once the buffer has grown.
#[derive(Clone, Debug, Default)]
pub struct QuantizedActivations {
    format: ActivationFormat,
    blocks: Vec<ActivationBlock>,
    super_blocks: Vec<BlockQ8K>,
    rows: usize,
    cols: usize,
}

impl QuantizedActivations {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Quantizes `x`, rows of `cols` values, to `format`, replacing the
    /// contents. Reuses the buffer's allocation when it is large enough.
    ///
    /// # Errors
    /// [`QuantError::Ragged`] if `x` is not whole rows of `cols` (or `cols` is
    /// 0), [`QuantError::PartialBlock`] if `cols` is not a whole number of
    /// the format's blocks.
    pub fn quantize(
        &mut self,
        format: ActivationFormat,
        x: &[f32],
        cols: usize,
    ) -> Result<(), QuantError> {
        self.quantize_on(Isa::detect(), format, x, cols)
    }

    pub(crate) fn quantize_on(
        &mut self,
        isa: Isa,
        format: ActivationFormat,
        x: &[f32],
        cols: usize,
    ) -> Result<(), QuantError> {
        if cols == 0 || !x.len().is_multiple_of(cols) {
            return Err(QuantError::Ragged {
                what: "activations",
                len: x.len(),
                cols,
            });
        }
        let block = format.block_len();
        if !cols.is_multiple_of(block) {
            // Named by a weight type that takes the format.
            let dtype = match format {
                ActivationFormat::Q8 => DType::Q8_0,
                ActivationFormat::Q8K => DType::Q4_K,
            };
            return Err(QuantError::partial_block(dtype, cols));
        }
        self.format = format;
        self.rows = x.len() / cols;
        self.cols = cols;
        self.blocks.clear();
        self.super_blocks.clear();
        let per_row = cols / block;
        match format {
            ActivationFormat::Q8 => {
                self.blocks
                    .resize(x.len() / block, ActivationBlock::zeroed());
                by_rows(x, cols, &mut self.blocks, per_row, |src, dst| {
                    quantize_row_on(isa, src, dst)
                })
            }
            ActivationFormat::Q8K => {
                self.super_blocks
                    .resize(x.len() / block, BlockQ8K::zeroed());
                by_rows(x, cols, &mut self.super_blocks, per_row, quantize_row_q8_k)
            }
        }
    }

    /// The format of the activations held.
    pub fn format(&self) -> ActivationFormat {
        self.format
    }

    /// Rows of activations held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// All rows' blocks, row after row (`cols / 32` blocks per row), in the
    /// [`ActivationFormat::Q8`] format; empty in the other.
    pub fn blocks(&self) -> &[ActivationBlock] {
        &self.blocks
    }

    /// All rows' super-blocks, row after row (`cols / 256` per row), in the
    /// [`ActivationFormat::Q8K`] format; empty in the other.
    pub fn super_blocks(&self) -> &[BlockQ8K] {
        &self.super_blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// A prompt's rows, quantized a share a task on a pool of 3 threads, give
    /// the blocks one thread gives, in both formats.
    #[test]
    fn rows_quantized_on_the_pool_equal_one_thread() {
        let mut rng = StdRng::seed_from_u64(41);
        let (rows, cols) = (67, 512);
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let pool = encore::parallel::WorkerPool::new(3).unwrap();
        for format in [ActivationFormat::Q8, ActivationFormat::Q8K] {
            let mut serial = QuantizedActivations::new();
            serial.quantize(format, &x, cols).unwrap();
            let mut pooled = QuantizedActivations::new();
            pool.install(|| pooled.quantize(format, &x, cols)).unwrap();
            assert_eq!(pooled.rows(), rows);
            match format {
                ActivationFormat::Q8 => assert_eq!(pooled.blocks(), serial.blocks()),
                ActivationFormat::Q8K => assert_eq!(pooled.super_blocks(), serial.super_blocks()),
            }
        }
    }

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    /// A random non-zero f16 value in `±[lo, hi)`.
    fn scale(rng: &mut StdRng, lo: f32, hi: f32) -> f32 {
        let v = f16::from_f32(rng.gen_range(lo..hi)).to_f32();
        if rng.gen() {
            v
        } else {
            -v
        }
    }

    #[test]
    fn dequantize_q4_1_blocks_built_by_hand() {
        let mut rng = StdRng::seed_from_u64(1);
        let (mut bytes, mut expected) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let (d, m) = (scale(&mut rng, 0.001, 0.1), scale(&mut rng, 0.01, 1.0));
            let nibbles: [u8; 32] = std::array::from_fn(|_| rng.gen_range(0..16));
            bytes.extend(f16_bytes(d));
            bytes.extend(f16_bytes(m));
            bytes.extend((0..16).map(|j| nibbles[j] | nibbles[j + 16] << 4));
            expected.extend(nibbles.iter().map(|&q| d * f32::from(q) + m));
        }
        let mut out = vec![0.0; expected.len()];
        dequantize_row(DType::Q4_1, &bytes, &mut out).unwrap();
        assert_eq!(out, expected);
    }

    #[test]
    fn dequantize_q4_0_blocks_built_by_hand() {
        let mut rng = StdRng::seed_from_u64(2);
        let (mut bytes, mut expected) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let d = scale(&mut rng, 0.001, 0.1);
            let nibbles: [u8; 32] = std::array::from_fn(|_| rng.gen_range(0..16));
            bytes.extend(f16_bytes(d));
            bytes.extend((0..16).map(|j| nibbles[j] | nibbles[j + 16] << 4));
            expected.extend(nibbles.iter().map(|&q| d * (f32::from(q) - 8.0)));
        }
        let mut out = vec![0.0; expected.len()];
        dequantize_row(DType::Q4_0, &bytes, &mut out).unwrap();
        assert_eq!(out, expected);
    }

    #[test]
    fn dequantize_q8_0_blocks_built_by_hand() {
        let mut rng = StdRng::seed_from_u64(3);
        let (mut bytes, mut expected) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let d = scale(&mut rng, 0.001, 0.1);
            let qs: [i8; 32] = std::array::from_fn(|_| rng.gen_range(-128..=127));
            bytes.extend(f16_bytes(d));
            bytes.extend(qs.iter().map(|&q| q as u8));
            expected.extend(qs.iter().map(|&q| d * f32::from(q)));
        }
        let mut out = vec![0.0; expected.len()];
        dequantize_row(DType::Q8_0, &bytes, &mut out).unwrap();
        assert_eq!(out, expected);
    }

    /// Q5 bytes for 32 five-bit values: the fifth bits (bit 4 of each) in a
    /// little-endian u32, then the low nibbles as in Q4.
    fn pack_q5(q: &[u8; 32]) -> Vec<u8> {
        let high = (0..32).fold(0u32, |h, i| h | u32::from(q[i] >> 4) << i);
        let mut bytes = Vec::from(high.to_le_bytes());
        bytes.extend((0..16).map(|j| (q[j] & 15) | (q[j + 16] & 15) << 4));
        bytes
    }

    #[test]
    fn dequantize_q5_0_blocks_built_by_hand() {
        let mut rng = StdRng::seed_from_u64(8);
        let (mut bytes, mut expected) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let d = scale(&mut rng, 0.001, 0.1);
            let q: [u8; 32] = std::array::from_fn(|_| rng.gen_range(0..32));
            bytes.extend(f16_bytes(d));
            bytes.extend(pack_q5(&q));
            expected.extend(q.iter().map(|&v| (f32::from(v) - 16.0) * d));
        }
        let mut out = vec![0.0; expected.len()];
        dequantize_row(DType::Q5_0, &bytes, &mut out).unwrap();
        assert_eq!(out, expected);
    }

    #[test]
    fn dequantize_q5_1_blocks_built_by_hand() {
        let mut rng = StdRng::seed_from_u64(9);
        let (mut bytes, mut expected) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let (d, m) = (scale(&mut rng, 0.001, 0.1), scale(&mut rng, 0.01, 1.0));
            let q: [u8; 32] = std::array::from_fn(|_| rng.gen_range(0..32));
            bytes.extend(f16_bytes(d));
            bytes.extend(f16_bytes(m));
            bytes.extend(pack_q5(&q));
            expected.extend(q.iter().map(|&v| f32::from(v) * d + m));
        }
        let mut out = vec![0.0; expected.len()];
        dequantize_row(DType::Q5_1, &bytes, &mut out).unwrap();
        assert_eq!(out, expected);
    }

    #[test]
    fn dequantize_iq4_nl_blocks_built_by_hand() {
        const LEVELS: [f32; 16] = [
            -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0,
            69.0, 89.0, 113.0,
        ];
        let mut rng = StdRng::seed_from_u64(10);
        let (mut bytes, mut expected) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let d = scale(&mut rng, 0.001, 0.1);
            let nibbles: [u8; 32] = std::array::from_fn(|_| rng.gen_range(0..16));
            bytes.extend(f16_bytes(d));
            bytes.extend((0..16).map(|j| nibbles[j] | nibbles[j + 16] << 4));
            expected.extend(nibbles.iter().map(|&n| d * LEVELS[usize::from(n)]));
        }
        let mut out = vec![0.0; expected.len()];
        dequantize_row(DType::IQ4_NL, &bytes, &mut out).unwrap();
        assert_eq!(out, expected);
    }

    #[test]
    fn dequantize_floats() {
        let mut rng = StdRng::seed_from_u64(4);
        let values: Vec<f32> = (0..37).map(|_| rng.gen_range(-4.0..4.0)).collect();
        let mut out = vec![0.0; values.len()];

        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        dequantize_row(DType::F32, &bytes, &mut out).unwrap();
        assert_eq!(out, values);

        let bytes: Vec<u8> = values.iter().flat_map(|&v| f16_bytes(v)).collect();
        dequantize_row(DType::F16, &bytes, &mut out).unwrap();
        let expected: Vec<f32> = values.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        assert_eq!(out, expected);

        // bf16 is the top half of an f32: build it by truncating the bits.
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        dequantize_row(DType::BF16, &bytes, &mut out).unwrap();
        let expected: Vec<f32> = values
            .iter()
            .map(|v| f32::from_bits(v.to_bits() & 0xFFFF_0000))
            .collect();
        assert_eq!(out, expected);
    }

    #[test]
    fn dequantize_rejects_wrong_lengths() {
        let mut out = vec![0.0; 64];
        assert_eq!(
            dequantize_row(DType::Q4_1, &[0; 39], &mut out),
            Err(QuantError::WeightBytes {
                dtype: DType::Q4_1,
                rows: 1,
                cols: 64,
                expected: 40,
                actual: 39
            })
        );
        assert!(matches!(
            dequantize_row(DType::Q8_0, &[0; 34], &mut out[..33]),
            Err(QuantError::PartialBlock { len: 33, .. })
        ));
        assert!(dequantize_row(DType::F16, &[0; 127], &mut out).is_err());
    }

    fn random_row(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect()
    }

    #[test]
    fn activation_blocks_beyond_f16_keep_finite_consistent_scales() {
        // Blocks whose scaled code sum (3e5 and 3e6) or scale itself (3e7)
        // is beyond f16: finite, and the sum is the stored scale times Σq,
        // so that Q4_0's `d Σq w - 8 s` cancels for a weight code of 8.
        // In range, ggml's rounding of both.
        for large in [3e5f32, 3e6, 3e7, 1e3] {
            let mut x: Vec<f32> = (0..32).map(|i| 0.5 + (i % 5) as f32).collect();
            x[7] = large;
            for isa in Isa::available() {
                let mut blocks = vec![ActivationBlock::default(); 1];
                quantize_row_on(isa, &x, &mut blocks).unwrap();
                let b = &blocks[0];
                let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
                assert!(b.d.is_finite() && b.s.is_finite(), "{large} {isa:?}: {b:?}");
                if large < 1e4 {
                    assert_eq!(b.s, round_f16(large / 127.0 * sum as f32), "{isa:?}");
                } else {
                    assert_eq!(b.s, b.d * sum as f32, "{large} {isa:?}");
                }
            }
        }
    }

    #[test]
    fn quantized_activations_round_trip() {
        let mut rng = StdRng::seed_from_u64(5);
        let x = random_row(&mut rng, 32 * 9);
        let mut blocks = vec![ActivationBlock::default(); 9];
        quantize_row_q8(&x, &mut blocks).unwrap();
        for (chunk, b) in x.chunks(32).zip(&blocks) {
            let amax = chunk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            assert_eq!(b.d, round_f16(amax / 127.0));
            assert!(b.qs.iter().any(|&q| q.abs() == 127));
            let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
            assert_eq!(b.s, round_f16(amax / 127.0 * sum as f32));
            // Rounding to the nearest step, plus the f16 rounding of d
            // (relative 2^-11) over up to 127 steps.
            for (&v, &q) in chunk.iter().zip(&b.qs) {
                assert!((v - b.d * f32::from(q)).abs() <= 0.5 * b.d + 127.0 * b.d / 2048.0);
            }
        }
    }

    #[test]
    fn quantize_scalar_and_simd_agree_exactly() {
        let mut rng = StdRng::seed_from_u64(6);
        let mut x = random_row(&mut rng, 32 * 40);
        x[32..64].fill(0.0); // an all-zero block quantizes to d = 0
        x[64..96].iter_mut().for_each(|v| *v = v.round()); // exact ties at 0.5 steps
        let mut scalar = vec![ActivationBlock::default(); 40];
        quantize_row_on(Isa::Scalar, &x, &mut scalar).unwrap();
        assert_eq!(scalar[1].d, 0.0);
        for isa in Isa::available() {
            let mut simd = vec![ActivationBlock::default(); 40];
            quantize_row_on(isa, &x, &mut simd).unwrap();
            assert_eq!(simd, scalar, "{isa:?}");
        }
    }

    #[test]
    fn quantized_activations_reuse_and_check() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut qa = QuantizedActivations::new();
        let q8 = ActivationFormat::Q8;
        qa.quantize(q8, &random_row(&mut rng, 3 * 64), 64).unwrap();
        assert_eq!((qa.rows(), qa.cols(), qa.blocks().len()), (3, 64, 6));
        qa.quantize(q8, &random_row(&mut rng, 64), 64).unwrap();
        assert_eq!((qa.rows(), qa.blocks().len()), (1, 2));
        assert!(matches!(
            qa.quantize(q8, &[1.0; 65], 64),
            Err(QuantError::Ragged { .. })
        ));
        assert!(matches!(
            qa.quantize(q8, &[1.0; 48], 48),
            Err(QuantError::PartialBlock { .. })
        ));
        assert!(qa.quantize(q8, &[], 0).is_err());

        let q8k = ActivationFormat::Q8K;
        qa.quantize(q8k, &random_row(&mut rng, 2 * 512), 512)
            .unwrap();
        assert_eq!(qa.format(), q8k);
        assert_eq!(
            (qa.rows(), qa.super_blocks().len(), qa.blocks().len()),
            (2, 4, 0)
        );
        assert!(matches!(
            qa.quantize(q8k, &[1.0; 96], 96),
            Err(QuantError::PartialBlock { block_len: 256, .. })
        ));
    }
}
