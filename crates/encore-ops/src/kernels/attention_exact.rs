//! `attention_exact`: a CUDA kernel for the `attention` op that gives the
//! CPU's results bit for bit.
//!
//! Greedy decoding of a small quantized model is chaotic: one ulp anywhere
//! changes the generated text within a few tokens. A GPU run that must
//! produce the CPU's text needs every op to produce the CPU's bits, and the
//! `attention` kernel of [`super::attention`] does not: it computes the
//! exact softmax in f32, which agrees with the CPU's llama.cpp recurrence to
//! about 2^-11 only.
//!
//! This kernel performs each rounding step of the CPU body (`attend_rows` in
//! [`crate::cpu::kernels::attention`]) in the same order, per (query head,
//! query row):
//!
//! - Below [`FA_TILE_Q`] rows, llama.cpp's one-pass recurrence
//!   ([`attend_head`]): Q rounded to f16; scores summed in ggml's AVX2
//!   order; a running maximum `m`; per position either a rescale
//!   `ms = e^(m_old - s)` (new maximum) or a weight `vs = e^(s - m)`; `sum =
//!   fma(sum, ms, vs)`; the accumulator of V rescaled and updated in f16.
//! - From [`FA_TILE_Q`] rows, ggml's tiled f32 path
//!   ([`attend_head_tiled`]): tiles of [`FA_TILE_KV`] positions, fused score chains, the maximum moved once per tile, weights
//!   from ggml's exponential summed eight lanes at a time into an f64 total,
//!   an f32 accumulator of fused multiply-adds.
//!
//! What has no rounding order runs in parallel: scores (a thread per
//! position), the running maximum (a block scan of "the later value when
//! strictly greater"), and the exponentials. The chains that round at every
//! step run in one thread each, in position order: the sum, and the
//! accumulator of each dimension (a thread per dimension).
//!
//! The CPU's `f32::exp` is glibc's `expf`, ported to CUDA as `glibc_expf`
//! (its Rust mirror, in this file's tests, equals `f32::exp`); the tiled
//! weights use ggml's exponential, whose CUDA port the elementwise kernels
//! share. The source is compiled with `--fmad=false`, so NVRTC fuses no
//! `a * b + c` on its own: every `fmaf`/`__fma_rn` stands where the CPU
//! fuses, and every plain operation where it does not.
//!
//! CUDA: `cuda/attention_exact.cu`.
//!
//! [`FA_TILE_Q`]: crate::cpu::kernels::attention::FA_TILE_Q
//! [`FA_TILE_KV`]: crate::cpu::kernels::attention::FA_TILE_KV
//! [`attend_head`]: crate::cpu::kernels::attention::attend_head
//! [`attend_head_tiled`]: crate::cpu::kernels::attention::attend_head_tiled

/// glibc's `expf` in Rust, the reference the CUDA `glibc_expf` follows line
/// by line: the tests check it against `f32::exp` and the CUDA source
/// against its constants.
///
/// It is glibc's generic C as the x86-64 build with FMA compiles it, the
/// multiply-adds fused. Only the fused `r` changes results: rounded
/// separately, e^x of -63.09946 and of 32.564632 come out an ulp lower. With
/// it, every f32 in [-110, 100] gives `f32::exp`'s bits (glibc 2.36); a
/// platform whose `expf` differs (the build without FMA, or a correctly
/// rounded one) fails the sweep test below, and the CUDA kernel would not
/// match its CPU there.
#[cfg(test)]
mod reference {
    /// `__exp2f_data.tab`: the bits of `2^(i/32)`, less `i << 47`.
    pub const EXP2F_TABLE: [u64; 32] = [
        0x3ff0000000000000,
        0x3fefd9b0d3158574,
        0x3fefb5586cf9890f,
        0x3fef9301d0125b51,
        0x3fef72b83c7d517b,
        0x3fef54873168b9aa,
        0x3fef387a6e756238,
        0x3fef1e9df51fdee1,
        0x3fef06fe0a31b715,
        0x3feef1a7373aa9cb,
        0x3feedea64c123422,
        0x3feece086061892d,
        0x3feebfdad5362a27,
        0x3feeb42b569d4f82,
        0x3feeab07dd485429,
        0x3feea47eb03a5585,
        0x3feea09e667f3bcd,
        0x3fee9f75e8ec5f74,
        0x3feea11473eb0187,
        0x3feea589994cce13,
        0x3feeace5422aa0db,
        0x3feeb737b0cdc5e5,
        0x3feec49182a3f090,
        0x3feed503b23e255d,
        0x3feee89f995ad3ad,
        0x3feeff76f2fb5e47,
        0x3fef199bdd85529c,
        0x3fef3720dcef9069,
        0x3fef5818dcfba487,
        0x3fef7c97337b9b5f,
        0x3fefa4afa2a490da,
        0x3fefd0765b6e4540,
    ];
    /// `0x1.71547652b82fep0 * 32`: 32 / ln 2.
    pub const INV_LN2_N: u64 = 0x4047_1547_652b_82fe;
    /// `0x1.8p52`: adding it rounds to an integer.
    pub const SHIFT: u64 = 0x4338_0000_0000_0000;
    /// The cubic's coefficients: `0x1.c6af84b912394p-5 / 32^3`,
    /// `0x1.ebfce50fac4f3p-3 / 32^2`, `0x1.62e42ff0c52d6p-1 / 32`.
    pub const C: [u64; 3] = [
        0x3ebc_6af8_4b91_2394,
        0x3f2e_bfce_50fa_c4f3,
        0x3f96_2e42_ff0c_52d6,
    ];

    /// `e^x` as glibc's `expf` computes it, with the fused multiply-adds of
    /// its x86-64 build.
    #[cfg(target_arch = "x86_64")]
    pub fn glibc_expf(x: f32) -> f32 {
        let abstop = (x.to_bits() >> 20) & 0x7ff;
        if abstop >= 0x42b {
            // |x| >= 88, or NaN.
            if x.to_bits() == f32::NEG_INFINITY.to_bits() {
                return 0.0;
            }
            if abstop >= 0x7f8 {
                return x + x;
            }
            if x > f32::from_bits(0x42b1_7217) {
                return f32::INFINITY;
            }
            if x < f32::from_bits(0xc2cf_f1b4) {
                return 0.0;
            }
        }
        let (inv_ln2_n, shift) = (f64::from_bits(INV_LN2_N), f64::from_bits(SHIFT));
        let [c0, c1, c2] = C.map(f64::from_bits);
        let xd = f64::from(x);
        let mut kd = inv_ln2_n.mul_add(xd, shift);
        let ki = kd.to_bits();
        kd -= shift;
        let r = inv_ln2_n.mul_add(xd, -kd);
        let t = EXP2F_TABLE[(ki & 31) as usize].wrapping_add(ki << 47);
        let s = f64::from_bits(t);
        let y = c0.mul_add(r, c1).mul_add(r * r, c2.mul_add(r, 1.0));
        (y * s) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::reference::*;

    /// The exact set's `attention` kernel: this one.
    fn def() -> encore::KernelDef {
        crate::KernelSet::Exact.defs().attention
    }

    #[cfg(target_arch = "x86_64")]
    fn assert_same_as_libm(x: f32) {
        // black_box: the compiler folds `exp` of a constant by itself,
        // correctly rounded, which is not always what glibc returns.
        assert_eq!(
            glibc_expf(x).to_bits(),
            std::hint::black_box(x).exp().to_bits(),
            "e^{x:e} (bits {:#010x})",
            x.to_bits()
        );
    }

    // The mirror follows x86-64 glibc's expf; aarch64 glibc's differs by an ulp.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_expf_mirror_is_the_platform_expf() {
        // Every 31st f32 from -0 to -110 (the scores minus the maximum lie
        // in [-inf, 0]), every f32 around the underflow thresholds, inputs
        // where a separately rounded r gives another result, a sparse sweep
        // of the positive side, and the special values.
        let (from, to) = ((-0.0f32).to_bits(), (-110.0f32).to_bits());
        for b in (from..=to).step_by(31) {
            assert_same_as_libm(f32::from_bits(b));
        }
        for b in (-103.0f32).to_bits()..=(-105.0f32).to_bits() {
            assert_same_as_libm(f32::from_bits(b));
        }
        for b in [0xc27c_65d9, 0x4202_422f] {
            assert_same_as_libm(f32::from_bits(b));
        }
        for b in (0..=100.0f32.to_bits()).step_by(997) {
            assert_same_as_libm(f32::from_bits(b));
        }
        for x in [
            f32::NEG_INFINITY,
            f32::INFINITY,
            -0.0,
            0.0,
            f32::MIN,
            f32::MAX,
        ] {
            assert_same_as_libm(x);
        }
        assert!(glibc_expf(f32::NAN).is_nan());
    }

    #[test]
    fn the_cuda_expf_has_the_mirrors_constants() {
        let source = def()
            .cuda_impl()
            .map(|c| c.source.clone())
            .unwrap_or_default();
        for bits in EXP2F_TABLE {
            assert!(
                source.contains(&format!("{bits:#018x}ull")),
                "table entry {bits:#018x}"
            );
        }
        for bits in [INV_LN2_N, SHIFT, C[0], C[1], C[2]] {
            assert!(
                source.contains(&format!("__longlong_as_double({bits:#018x}ll)")),
                "constant {bits:#018x}"
            );
        }
    }

    #[test]
    fn the_kernel_is_an_attention_compiled_without_contraction() {
        let d = def();
        assert_eq!((d.name(), d.op_kind()), ("attention_exact", "attention"));
        assert!(d.options().iter().any(|o| o == "--fmad=false"));
        assert!(d.cpu_impl().is_some() && d.is_programmatic());
    }
}
