//! The CPU bodies of the elementwise operations
//! ([`crate::kernels::elementwise`]), and the math they share with the
//! fused kernels: `e^x` as [`ggml_expf`] (or [`ggml_expf_avx512`], see
//! [`GgmlVector`]), as in llama.cpp's SwiGLU.

use encore::CpuArgs;

use crate::kernels::elementwise::{AddArgs, AddRowsArgs, GeluMulArgs, ScaleArgs, SiluMulArgs};

/// `e^x` as ggml's AVX2 `ggml_v_expf` computes it, one lane at a time: a
/// polynomial within about 1.5 ulp of `exp`, with its fused multiply-adds.
/// llama.cpp's SwiGLU uses it (on every element when the row length is a
/// multiple of 8), so following it keeps the activations bit-identical.
#[inline]
pub fn ggml_expf(x: f32) -> f32 {
    // ggml's constants (hexadecimal floats in its source).
    const SHIFT: f32 = f32::from_bits(0x4b40_0000); // 0x1.8p23
    const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b); // 0x1.715476p+0
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0x1.62e4p-1
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 0x1.7f7d1cp-20
    const C0: f32 = f32::from_bits(0x3c07_2010); // 0x1.0e4020p-7
    const C1: f32 = f32::from_bits(0x3d2b_9f17); // 0x1.573e2ep-5
    const C2: f32 = f32::from_bits(0x3e2a_af33); // 0x1.555e66p-3
    const C3: f32 = f32::from_bits(0x3eff_fedb); // 0x1.fffdb6p-2
    const C4: f32 = f32::from_bits(0x3f7f_fff6); // 0x1.ffffecp-1
    let z = x.mul_add(LOG2E, SHIFT);
    let n = z - SHIFT;
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = C0
        .mul_add(b, C1)
        .mul_add(u, C2.mul_add(b, C3))
        .mul_add(u, C4 * b);
    if n.abs() <= 126.0 {
        return k.mul_add(j, k);
    }
    // Past 2^126 the scale `k` would overflow: split it in two factors.
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// `e^x` as ggml's AVX-512 `ggml_v_expf` computes it, one lane at a time:
/// the polynomial of [`ggml_expf`], but with its leading 1 added inside the
/// last fused multiply-add, and scaled by `2^n` with one rounding
/// (`vscalefps`); past `|n| > 192`, 0 or infinity.
#[inline]
pub fn ggml_expf_avx512(x: f32) -> f32 {
    const SHIFT: f32 = f32::from_bits(0x4b40_0000); // 0x1.8p23
    const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b); // 0x1.715476p+0
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0x1.62e4p-1
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 0x1.7f7d1cp-20
    const C0: f32 = f32::from_bits(0x3c07_2010); // 0x1.0e4020p-7
    const C1: f32 = f32::from_bits(0x3d2b_9f17); // 0x1.573e2ep-5
    const C2: f32 = f32::from_bits(0x3e2a_af33); // 0x1.555e66p-3
    const C3: f32 = f32::from_bits(0x3eff_fedb); // 0x1.fffdb6p-2
    const C4: f32 = f32::from_bits(0x3f7f_fff6); // 0x1.ffffecp-1
    /// `2^e` for a normal exponent `e`.
    fn pow2(e: i32) -> f32 {
        f32::from_bits(((e + 127) as u32) << 23)
    }
    let z = x.mul_add(LOG2E, SHIFT);
    let n = z - SHIFT;
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let u = b * b;
    let j = C0
        .mul_add(b, C1)
        .mul_add(u, C2.mul_add(b, C3))
        .mul_add(u, C4.mul_add(b, 1.0));
    if n.is_nan() {
        return n;
    }
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // `n` is an integer here. Within ±126 `2^n` is a normal float and one
    // product rounds once, as `scalef` does; further out, a first exact
    // product brings the exponent within range of the second, which rounds.
    let n = n as i32;
    if n.abs() <= 126 {
        j * pow2(n)
    } else if n > 0 {
        j * pow2(n - 100) * pow2(100)
    } else {
        j * pow2(n + 100) * pow2(-100)
    }
}

/// Which of ggml's vector forms llama.cpp follows on this CPU. A native
/// llama.cpp build on a CPU with AVX-512 (F and DQ) computes `e^x` (SwiGLU,
/// the softmax of its flash attention) with `ggml_v_expf`'s AVX-512 form,
/// which rounds differently from the AVX2 form, and sums softmax weights 16
/// lanes at a time. Small as they are, these differences flip the rounding
/// of 8-bit activations now and then, and from there the two engines'
/// results part, by as much as a different quantization would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlVector {
    /// [`ggml_expf`]; softmax weights summed 8 lanes at a time.
    Avx2,
    /// [`ggml_expf_avx512`]; softmax weights summed 16 lanes at a time.
    Avx512,
}

impl GgmlVector {
    /// The form for this CPU: [`GgmlVector::Avx512`] where it has AVX-512 F
    /// and DQ, else [`GgmlVector::Avx2`].
    #[inline]
    pub fn detect() -> GgmlVector {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
        {
            return GgmlVector::Avx512;
        }
        GgmlVector::Avx2
    }

    /// `e^x` in this form.
    #[inline]
    pub fn expf(self, x: f32) -> f32 {
        match self {
            GgmlVector::Avx2 => ggml_expf(x),
            GgmlVector::Avx512 => ggml_expf_avx512(x),
        }
    }

    /// `v / (1 + e^-v)` in this form, as ggml's `ggml_v_silu`.
    #[inline]
    pub fn silu(self, v: f32) -> f32 {
        v / (1.0 + self.expf(0.0 - v))
    }
}

/// `v / (1 + e^-v)` with [`ggml_expf`], as ggml's AVX2 `ggml_v_silu`.
#[inline]
pub fn silu(v: f32) -> f32 {
    GgmlVector::Avx2.silu(v)
}

fn silu_mul_rows(form: GgmlVector, g: &[f32], u: &[f32], y: &mut [f32]) {
    for ((y, g), u) in y.iter_mut().zip(g).zip(u) {
        *y = form.silu(*g) * u;
    }
}

/// AVX2 versions of [`ggml_expf`] and [`silu_mul_rows`], eight lanes at a
/// time: ggml's `ggml_v_expf` and `ggml_v_silu` instruction for instruction,
/// so every lane is what the scalar code gives.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`ggml_expf`](super::ggml_expf) of each lane.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn expf(x: __m256) -> __m256 {
        let r = _mm256_set1_ps(f32::from_bits(0x4b40_0000));
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32::from_bits(0x3fb8_aa3b)), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(f32::from_bits(0x35bf_be8e)),
            _mm256_fnmadd_ps(n, _mm256_set1_ps(f32::from_bits(0x3f31_7200)), x),
        );
        let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
        let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(0x3f80_0000)));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let c = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(
                    _mm256_set1_ps(f32::from_bits(0x3c07_2010)),
                    b,
                    _mm256_set1_ps(f32::from_bits(0x3d2b_9f17)),
                ),
                u,
                _mm256_fmadd_ps(
                    _mm256_set1_ps(f32::from_bits(0x3e2a_af33)),
                    b,
                    _mm256_set1_ps(f32::from_bits(0x3eff_fedb)),
                ),
            ),
            u,
            _mm256_mul_ps(_mm256_set1_ps(f32::from_bits(0x3f7f_fff6)), b),
        );
        if _mm256_movemask_ps(c) == 0 {
            return _mm256_fmadd_ps(j, k, k);
        }
        let g = _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
            _mm256_set1_epi32(0x8200_0000u32 as i32),
        );
        let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
        let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
        let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
        _mm256_or_ps(
            _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
            _mm256_andnot_ps(
                d,
                _mm256_or_ps(
                    _mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                    _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)),
                ),
            ),
        )
    }

    /// [`silu_mul_rows`](super::silu_mul_rows), eight elements at a time and
    /// the rest one at a time.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul_rows(g: &[f32], u: &[f32], y: &mut [f32]) {
        let n = y.len().min(g.len()).min(u.len());
        let body = n - n % 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..body).step_by(8) {
            // SAFETY: i + 8 <= n for all three slices; accesses are unaligned.
            unsafe {
                let x = _mm256_loadu_ps(g.as_ptr().add(i));
                let e = expf(_mm256_sub_ps(_mm256_setzero_ps(), x));
                let silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
                let r = _mm256_mul_ps(silu, _mm256_loadu_ps(u.as_ptr().add(i)));
                _mm256_storeu_ps(y.as_mut_ptr().add(i), r);
            }
        }
        super::silu_mul_rows(
            super::GgmlVector::Avx2,
            &g[body..n],
            &u[body..n],
            &mut y[body..n],
        );
    }
}

/// AVX-512 versions of [`ggml_expf_avx512`] and [`silu_mul_rows`], 16 lanes
/// at a time: ggml's AVX-512 `ggml_v_expf` and `ggml_v_silu` instruction for
/// instruction.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    /// [`ggml_expf_avx512`](super::ggml_expf_avx512) of each lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(in super::super) fn expf(x: __m512) -> __m512 {
        let r = _mm512_set1_ps(f32::from_bits(0x4b40_0000));
        let z = _mm512_fmadd_ps(x, _mm512_set1_ps(f32::from_bits(0x3fb8_aa3b)), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(
            n,
            _mm512_set1_ps(f32::from_bits(0x35bf_be8e)),
            _mm512_fnmadd_ps(n, _mm512_set1_ps(f32::from_bits(0x3f31_7200)), x),
        );
        let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(
                    _mm512_set1_ps(f32::from_bits(0x3c07_2010)),
                    b,
                    _mm512_set1_ps(f32::from_bits(0x3d2b_9f17)),
                ),
                u,
                _mm512_fmadd_ps(
                    _mm512_set1_ps(f32::from_bits(0x3e2a_af33)),
                    b,
                    _mm512_set1_ps(f32::from_bits(0x3eff_fedb)),
                ),
            ),
            u,
            _mm512_fmadd_ps(
                _mm512_set1_ps(f32::from_bits(0x3f7f_fff6)),
                b,
                _mm512_set1_ps(1.0),
            ),
        );
        let res = _mm512_scalef_ps(j, n);
        if d == 0 {
            return res;
        }
        let zero = _mm512_setzero_ps();
        let alt = _mm512_mask_blend_ps(
            _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero),
            _mm512_set1_ps(f32::INFINITY),
            zero,
        );
        _mm512_mask_blend_ps(d, res, alt)
    }

    /// [`silu_mul_rows`](super::silu_mul_rows), 16 elements at a time and
    /// the rest one at a time.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and DQ.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn silu_mul_rows(g: &[f32], u: &[f32], y: &mut [f32]) {
        let n = y.len().min(g.len()).min(u.len());
        let body = n - n % 16;
        let one = _mm512_set1_ps(1.0);
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= n for all three slices; accesses are unaligned.
            unsafe {
                let x = _mm512_loadu_ps(g.as_ptr().add(i));
                let e = expf(_mm512_sub_ps(_mm512_setzero_ps(), x));
                let silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
                let r = _mm512_mul_ps(silu, _mm512_loadu_ps(u.as_ptr().add(i)));
                _mm512_storeu_ps(y.as_mut_ptr().add(i), r);
            }
        }
        super::silu_mul_rows(
            super::GgmlVector::Avx512,
            &g[body..n],
            &u[body..n],
            &mut y[body..n],
        );
    }

    /// [`gelu_mul_rows`](super::gelu_mul_rows), 16 elements at a time (each
    /// input rounded to f16 as `half` rounds it, to nearest even, its table
    /// entry gathered as a 32-bit word whose low half it is) and the rest
    /// one at a time.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and DQ; `table` must be
    /// `gelu_table()`, with its padding entry.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn gelu_mul_rows(table: &[half::f16], g: &[f32], u: &[f32], y: &mut [f32]) {
        let n = y.len().min(g.len()).min(u.len());
        let body = n - n % 16;
        let (low, high) = (_mm512_set1_ps(-10.0), _mm512_set1_ps(10.0));
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= n for all three slices; accesses are
            // unaligned; each gathered word lies within the table (65 537
            // entries of 2 bytes, the last one padding).
            unsafe {
                let x = _mm512_loadu_ps(g.as_ptr().add(i));
                let bits = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
                let at = _mm512_cvtepu16_epi32(bits);
                let words = _mm512_i32gather_epi32::<2>(at, table.as_ptr().cast());
                let v = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
                let v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, high), v, x);
                let v = _mm512_maskz_mov_ps(!_mm512_cmp_ps_mask::<_CMP_LE_OQ>(x, low), v);
                let r = _mm512_mul_ps(v, _mm512_loadu_ps(u.as_ptr().add(i)));
                _mm512_storeu_ps(y.as_mut_ptr().add(i), r);
            }
        }
        super::gelu_mul_rows(&g[body..n], &u[body..n], &mut y[body..n]);
    }
}

/// `y[i] += x[i]`.
pub fn add_into(y: &mut [f32], x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += x);
}

/// `y[i] = silu(g[i]) * u[i]` in this CPU's [`GgmlVector`] form, with SIMD
/// where the CPU has it (the results are the same either way: `mul_add` is
/// always fused).
pub fn silu_mul_into(g: &[f32], u: &[f32], y: &mut [f32]) {
    let form = GgmlVector::detect();
    #[cfg(target_arch = "x86_64")]
    if form == GgmlVector::Avx512 {
        // SAFETY: `detect` found AVX-512 F and DQ.
        unsafe { avx512::silu_mul_rows(g, u, y) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU features were just detected.
        unsafe { avx2::silu_mul_rows(g, u, y) };
        return;
    }
    silu_mul_rows(form, g, u, y);
}

/// The CPU body of `add`.
pub(crate) fn add(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = AddArgs::from_cpu(a)?;
    let n = args.n as usize;
    let (y, x) = (args.y.write::<f32>()?, args.x.read::<f32>()?);
    super::need("y", y, n)?;
    super::need("x", x, n)?;
    add_into(&mut y[..n], &x[..n]);
    Ok(())
}

/// The CPU body of `add_rows`.
pub(crate) fn add_rows(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = AddRowsArgs::from_cpu(a)?;
    let [rows, n] = args.shape.map(|v| v as usize);
    let (y, b) = (args.y.write::<f32>()?, args.b.read::<f32>()?);
    super::need("y", y, rows * n)?;
    super::need("b", b, n)?;
    add_bias(&mut y[..rows * n], &b[..n]);
    Ok(())
}

/// `y[r, j] += b[j]` for every row of `y` (rows of `b.len()`).
pub(crate) fn add_bias(y: &mut [f32], b: &[f32]) {
    for row in y.chunks_exact_mut(b.len().max(1)) {
        row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
    }
}

/// The CPU body of `silu_mul`.
pub(crate) fn silu_mul(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = SiluMulArgs::from_cpu(a)?;
    let n = args.n as usize;
    let (g, u, y) = (
        args.g.read::<f32>()?,
        args.u.read::<f32>()?,
        args.y.write::<f32>()?,
    );
    super::need("g", g, n)?;
    super::need("u", u, n)?;
    super::need("y", y, n)?;
    silu_mul_into(&g[..n], &u[..n], &mut y[..n]);
    Ok(())
}

/// GELU, tanh approximation, in f32.
#[inline]
pub fn gelu(v: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    0.5 * v * (1.0 + (SQRT_2_OVER_PI * v * (1.0 + COEF_A * v * v)).tanh())
}

/// GELU as llama.cpp's CPU backend computes it: 0 below -10, the identity
/// above 10, and between them [`gelu`] of the input rounded to f16, itself
/// rounded to f16 (ggml's lookup table).
#[inline]
pub fn gelu_like_ggml(v: f32) -> f32 {
    use half::f16;
    if v <= -10.0 {
        0.0
    } else if v >= 10.0 {
        v
    } else {
        gelu_table()[f16::from_f32(v).to_bits() as usize].to_f32()
    }
}

/// [`gelu`] of every f16 value, rounded to f16, by the value's bits: built
/// once (65 536 entries, 128 KiB), so that GELU costs a lookup. One zero
/// entry follows, so that a 32-bit gather of the last entry stays within it.
fn gelu_table() -> &'static [half::f16] {
    use half::f16;
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu(f16::from_bits(bits).to_f32())))
            .chain([f16::ZERO])
            .collect()
    })
}

/// `y[i] = gelu_like_ggml(g[i]) * u[i]`, 16 lanes at a time where the CPU
/// has AVX-512 (the table looked up with a gather: the same bits).
pub fn gelu_mul_into(g: &[f32], u: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if GgmlVector::detect() == GgmlVector::Avx512 {
        // SAFETY: `detect` found AVX-512 F and DQ; the table has its padding entry.
        unsafe { avx512::gelu_mul_rows(gelu_table(), g, u, y) };
        return;
    }
    gelu_mul_rows(g, u, y);
}

fn gelu_mul_rows(g: &[f32], u: &[f32], y: &mut [f32]) {
    for ((y, g), u) in y.iter_mut().zip(g).zip(u) {
        *y = gelu_like_ggml(*g) * u;
    }
}

/// The CPU body of `gelu_mul`.
pub(crate) fn gelu_mul(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = GeluMulArgs::from_cpu(a)?;
    let n = args.n as usize;
    let (g, u, y) = (
        args.g.read::<f32>()?,
        args.u.read::<f32>()?,
        args.y.write::<f32>()?,
    );
    super::need("g", g, n)?;
    super::need("u", u, n)?;
    super::need("y", y, n)?;
    // Chunks of 4096 elements across the worker threads.
    const CHUNK: usize = 4096;
    encore::parallel::for_each_chunk_mut(&mut y[..n], CHUNK, |c, y| {
        let at = c * CHUNK;
        let len = y.len();
        gelu_mul_into(&g[at..at + len], &u[at..at + len], y);
    });
    Ok(())
}

/// The CPU body of `scale`.
pub(crate) fn scale(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = ScaleArgs::from_cpu(a)?;
    let (n, s) = (args.shape.n as usize, args.shape.s);
    let y = args.y.write::<f32>()?;
    super::need("y", y, n)?;
    y[..n].iter_mut().for_each(|v| *v *= s);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform values in `[-1, 1)` from a linear congruential generator.
    fn uniform(seed: u32) -> impl FnMut() -> f32 {
        let mut seed = seed;
        move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        }
    }

    #[test]
    fn vector_and_scalar_silu_mul_agree_bit_for_bit() {
        let mut next = uniform(11);
        // Typical activations, and magnitudes past both of ggml_expf's
        // special ranges (|n| > 126 and > 192), signed zeros and infinities.
        let mut g: Vec<f32> = (0..4000)
            .map(|i| next() * [4.0, 30.0, 100.0, 150.0, 250.0][i % 5])
            .collect();
        g.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            87.0,
            -87.0,
            88.8,
            -88.8,
            1e-40,
            -1e-40,
            3.0,
        ]);
        let u: Vec<f32> = (0..g.len()).map(|_| next() * 2.0).collect();
        let mut scalar = vec![0.0; g.len()];
        silu_mul_rows(GgmlVector::detect(), &g, &u, &mut scalar);
        let mut fast = vec![0.0; g.len()];
        silu_mul_into(&g, &u, &mut fast);
        for (i, (a, b)) in fast.iter().zip(&scalar).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "silu({}) * {}: {a} vs {b}",
                g[i],
                u[i]
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_ggml_expf_equals_the_scalar_one() {
        use std::arch::x86_64::*;
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma"))
        {
            return;
        }
        // Every 997th float, both signs: all ranges of the exponent, NaNs aside.
        let xs: Vec<f32> = (0..u32::MAX / 997)
            .map(|i| f32::from_bits(i * 997))
            .filter(|x| !x.is_nan())
            .collect();
        for c in xs.chunks_exact(8) {
            let mut got = [0.0f32; 8];
            // SAFETY: the CPU features were checked above; `c` and `got` hold 8 floats.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), avx2::expf(_mm256_loadu_ps(c.as_ptr()))) };
            for (x, g) in c.iter().zip(got) {
                let want = ggml_expf(*x);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "e^{x}: {g} vs {want}"
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_ggml_expf_equals_the_scalar_one() {
        use std::arch::x86_64::*;
        if GgmlVector::detect() != GgmlVector::Avx512 {
            return;
        }
        // Every 997th float, both signs, and the edges of the scaling ranges.
        let mut xs: Vec<f32> = (0..u32::MAX / 997)
            .map(|i| f32::from_bits(i * 997))
            .filter(|x| !x.is_nan())
            .collect();
        for e in [
            -87.0f32, -87.4, -88.0, -88.8, -100.0, -103.9, -104.0, -133.0, -134.0,
        ] {
            xs.extend([e, e - 0.3, e + 0.3, -e, -e + 0.3, -e - 0.3]);
        }
        xs.resize(xs.len().next_multiple_of(16), 0.0);
        for c in xs.chunks_exact(16) {
            let mut got = [0.0f32; 16];
            // SAFETY: `detect` found AVX-512 F and DQ; `c` and `got` hold 16 floats.
            unsafe {
                _mm512_storeu_ps(got.as_mut_ptr(), avx512::expf(_mm512_loadu_ps(c.as_ptr())))
            };
            for (x, g) in c.iter().zip(got) {
                let want = ggml_expf_avx512(*x);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "e^{x}: {g} vs {want}"
                );
            }
        }
    }

    #[test]
    fn ggml_expf_matches_ggml_bit_for_bit() {
        // Results of ggml's AVX2 `ggml_v_expf` (through `ggml_vec_soft_max_f32`).
        for (x, bits) in [
            (0.0f32, 0x3f80_0000u32),
            (1.0, 0x402d_f855),
            (-1.0, 0x3ebc_5ab2),
            (0.5, 0x3fd3_094c),
            (-0.5, 0x3f1b_4597),
            (10.0, 0x46ac_14f0),
            (-10.0, 0x383e_6bce),
            (80.0, 0x792a_bbcf),
            (88.7, 0x7f7a_37fc),
            (89.0, 0x7f80_0000),
            (-87.5, 0x006c_b2bb),
            (-90.0, 0x0008_ec28),
            (-100.0, 0x0000_001b),
            (-104.0, 0),
            (-150.0, 0),
            (f32::NEG_INFINITY, 0),
        ] {
            assert_eq!(ggml_expf(x).to_bits(), bits, "e^{x}");
        }
    }

    #[test]
    fn vector_and_scalar_gelu_mul_agree_bit_for_bit() {
        let mut next = uniform(7);
        // Typical activations, the table's ends, both cut-offs and values
        // past them, f16's subnormals and overflow, signed zeros.
        let mut g: Vec<f32> = (0..4000).map(|_| next() * 15.0).collect();
        g.extend([
            -10.0, 10.0, -9.999, 9.999, -10.001, 10.001, 0.0, -0.0, 1e-7, -1e-7, 65504.0, 70000.0,
            -70000.0, 3e-5, -6e-8,
        ]);
        let u: Vec<f32> = (0..g.len()).map(|_| next() * 2.0).collect();
        let mut want = vec![0.0; g.len()];
        gelu_mul_rows(&g, &u, &mut want);
        let mut got = vec![0.0; g.len()];
        gelu_mul_into(&g, &u, &mut got);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "gelu({}) * {}", g[i], u[i]);
        }
    }

    #[test]
    fn gelu_follows_ggml_table_semantics() {
        use half::f16;
        for i in 0..20_000 {
            let v = (i as f32 - 10_000.0) / 800.0; // -12.5 .. 12.5
            let got = gelu_like_ggml(v);
            // The lookup is the f32 formula of the f16 input, rounded to f16.
            let direct = if v <= -10.0 {
                0.0
            } else if v >= 10.0 {
                v
            } else {
                f16::from_f32(gelu(f16::from_f32(v).to_f32())).to_f32()
            };
            assert_eq!(got.to_bits(), direct.to_bits(), "gelu({v})");
            // And the formula is GELU: against f64 where f32 does not cancel.
            if (-3.0..10.0).contains(&v) {
                let x = f64::from(f16::from_f32(v).to_f32());
                let want = 0.5 * x * (1.0 + (0.797_884_560_8 * (x + 0.044_715 * x * x * x)).tanh());
                let tol = want.abs().max(1e-4) / 512.0;
                assert!(
                    (f64::from(got) - want).abs() <= tol,
                    "gelu({v}) = {got}, want {want}"
                );
            }
        }
    }
}
