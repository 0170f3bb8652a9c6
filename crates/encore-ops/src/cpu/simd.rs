//! Which instruction set the kernels run on, and the AVX2 building blocks they
//! share (the NEON ones are in `simd/neon.rs`).

/// The instruction set a kernel call uses. The public functions take
/// [`Isa::detect`]; tests pass [`Isa::Scalar`] to compare the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Portable Rust, on every target.
    Scalar,
    /// AVX2 + FMA + F16C, holding the proof that the CPU has them (and
    /// whether it also has AVX-512 with VNNI, for the products of several
    /// activation rows).
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2Proof),
    /// NEON, which every aarch64 CPU has, multiplying bytes with widening
    /// multiplies.
    #[cfg(target_arch = "aarch64")]
    Neon,
    /// NEON with the dot-product extension (`SDOT`), holding the proof that
    /// the CPU has it.
    #[cfg(target_arch = "aarch64")]
    NeonDotprod(DotprodProof),
}

/// Evidence that the running CPU supports AVX2, FMA and F16C. Its private field
/// means only [`Isa::detect`] can make one, so code holding it may call the
/// `#[target_feature(enable = "avx2,fma,f16c")]` kernels.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Avx2Proof {
    avx512_vnni: Option<Avx512VnniProof>,
}

/// Evidence that the running CPU also supports AVX-512 (F, BW and VL) with
/// VNNI, so code holding it may call the `#[target_feature(enable =
/// "avx512f,avx512bw,avx512vl,avx512vnni,...")]` kernels. Only [`Isa::detect`]
/// makes one.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Avx512VnniProof(());

/// Evidence that the running CPU has the aarch64 dot-product extension. Its
/// private field means only [`Isa::detect`] can make one, so code holding it
/// may execute `SDOT`.
#[cfg(target_arch = "aarch64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DotprodProof(());

impl Isa {
    /// The fastest instruction set this CPU supports.
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            let avx512_vnni = (is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni"))
            .then_some(Avx512VnniProof(()));
            return Isa::Avx2(Avx2Proof { avx512_vnni });
        }
        #[cfg(target_arch = "aarch64")]
        return if std::arch::is_aarch64_feature_detected!("dotprod") {
            Isa::NeonDotprod(DotprodProof(()))
        } else {
            Isa::Neon
        };
        #[cfg(not(target_arch = "aarch64"))]
        Isa::Scalar
    }

    /// The proof of AVX-512 VNNI, where the CPU has it.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn avx512_vnni(self) -> Option<Avx512VnniProof> {
        match self {
            Isa::Avx2(p) => p.avx512_vnni,
            Isa::Scalar => None,
        }
    }

    /// Whether products of several rows run on the AVX-512 VNNI tiles, whose
    /// super-block sums add in another order than the dot products'.
    #[cfg(test)]
    pub(crate) fn has_avx512_vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        let vnni = self.avx512_vnni().is_some();
        #[cfg(not(target_arch = "x86_64"))]
        let vnni = false;
        vnni
    }

    /// Every instruction set this CPU can run, the scalar code first, so
    /// that tests compare them all.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut all = vec![Isa::Scalar];
        #[cfg(target_arch = "aarch64")]
        all.push(Isa::Neon);
        // Without AVX-512 too, as on CPUs that lack it.
        #[cfg(target_arch = "x86_64")]
        if let Isa::Avx2(p) = Isa::detect() {
            if p.avx512_vnni.is_some() {
                all.push(Isa::Avx2(Avx2Proof { avx512_vnni: None }));
            }
        }
        if Isa::detect() != Isa::Scalar && !all.contains(&Isa::detect()) {
            all.push(Isa::detect());
        }
        all
    }

    /// Whether the dot products of blocks of 32 add the blocks' products one
    /// after another as the scalar code does, and so match it bit for bit
    /// (the AVX2 kernels keep eight partial sums instead).
    #[cfg(test)]
    pub(crate) fn sums_blocks_in_order(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(_) => false,
            _ => true,
        }
    }
}

#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;

/// AVX2 helpers shared by the kernels. Callers must have AVX2, FMA and F16C,
/// which every `#[target_feature]` function here requires.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// The sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
    }

    /// Lane 1 of `v`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn lane1(v: __m128) -> f32 {
        _mm_cvtss_f32(_mm_movehdup_ps(v))
    }

    /// The 16 bytes at `qs` split into 32 nibbles, one per byte: the low
    /// nibbles of bytes 0..16 then their high nibbles (ggml's Q4 order).
    ///
    /// # Safety
    /// `qs` must point at 16 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn nibbles(qs: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 16 readable bytes; the load is unaligned.
        let packed = unsafe { _mm_loadu_si128(qs.cast()) };
        // Both halves hold the 16 bytes; shift the upper half's right by 4.
        let both = _mm256_srlv_epi64(
            _mm256_broadcastsi128_si256(packed),
            _mm256_setr_epi64x(0, 0, 4, 4),
        );
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// The 32 fifth bits at `qh` (a little-endian u32) as bytes of 0xFF or 0,
    /// in weight order.
    ///
    /// # Safety
    /// `qh` must point at 4 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn fifth_bits(qh: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 4 readable bytes; read_unaligned has no alignment needs.
        let bits = unsafe { qh.cast::<i32>().read_unaligned() };
        // Byte k takes byte k / 8 of the word, then tests bit k % 8 of it.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits),
            _mm256_setr_epi64x(
                0,
                0x0101_0101_0101_0101,
                0x0202_0202_0202_0202,
                0x0303_0303_0303_0303,
            ),
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
    }

    /// The little-endian f16 at `p` in lane 0, zero in the other lanes.
    ///
    /// # Safety
    /// `p` must point at 2 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn load_f16(p: *const u8) -> __m128 {
        // SAFETY: the caller guarantees 2 readable bytes; read_unaligned has no alignment needs.
        let bits = unsafe { p.cast::<u16>().read_unaligned() };
        _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits)))
    }

    /// The two little-endian f16s at `p` in lanes 0 and 1, zero in lanes 2 and 3.
    ///
    /// # Safety
    /// `p` must point at 4 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn load_f16_pair(p: *const u8) -> __m128 {
        // SAFETY: the caller guarantees 4 readable bytes; read_unaligned has no alignment needs.
        let bits = unsafe { p.cast::<i32>().read_unaligned() };
        _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
    }
}
