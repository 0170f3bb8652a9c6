//! Element and block types of weights and activations, in ggml's GGUF block layouts.
//!
//! Quantized types store a block of `block_len` weights in `block_bytes` bytes:
//!
//! | type | weights/block | bytes/block | layout |
//! | --- | --- | --- | --- |
//! | F32  | 1  | 4  | little-endian f32 |
//! | F16  | 1  | 2  | IEEE half |
//! | BF16 | 1  | 2  | bfloat16 |
//! | Q8_0 | 32 | 34 | `d: f16`, `qs: [i8; 32]`; w = d * q |
//! | Q4_0 | 32 | 18 | `d: f16`, `qs: [u8; 16]`; w = d * (nibble - 8) |
//! | Q4_1 | 32 | 20 | `d: f16`, `m: f16`, `qs: [u8; 16]`; w = d * nibble + m |
//! | Q5_0 | 32 | 22 | `d: f16`, `qh: [u8; 4]`, `qs: [u8; 16]`; w = d * (q - 16) |
//! | Q5_1 | 32 | 24 | `d: f16`, `m: f16`, `qh: [u8; 4]`, `qs: [u8; 16]`; w = d * q + m |
//! | IQ4_NL | 32 | 18 | `d: f16`, `qs: [u8; 16]`; w = d * IQ4(nibble) |
//! | Q2_K | 256 | 84 | `scales: [u8; 16]`, `qs: [u8; 64]`, `d: f16`, `dmin: f16`; w = d * sc * q - dmin * m |
//! | Q3_K | 256 | 110 | `hmask: [u8; 32]`, `qs: [u8; 64]`, `scales: [u8; 12]`, `d: f16`; w = d * (sc - 32) * (q - (h ? 0 : 4)) |
//! | Q4_K | 256 | 144 | `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qs: [u8; 128]`; w = d * sc * q - dmin * m |
//! | Q5_K | 256 | 176 | `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qh: [u8; 32]`, `qs: [u8; 128]`; w = d * sc * q - dmin * m |
//! | Q6_K | 256 | 210 | `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`, `d: f16`; w = d * sc * (q - 32) |
//! | IQ4_XS | 256 | 136 | `d: f16`, `scales_h: u16`, `scales_l: [u8; 4]`, `qs: [u8; 128]`; w = d * (sc - 32) * IQ4(nibble) |
//!
//! In the blocks of 32, byte `j` of `qs` holds weight `j` in its low nibble
//! and weight `j + 16` in its high nibble; Q5's fifth bit of weight `i` is
//! bit `i` of `qh` (a little-endian u32). IQ4 is the table of 16 non-linear
//! levels (`-127 ..= 113`, [`crate::cpu::IQ4_LEVELS`]) that IQ4_NL and IQ4_XS share.
//!
//! The K-quants (`_K`) and IQ4_XS are super-blocks of 256 weights in
//! sub-blocks of 16 or 32, each with its own integer scale `sc` (and
//! minimum `m`) of a few bits, themselves scaled by the f16 `d` (and
//! `dmin`); `cpu/kquant.rs` says where each weight's bits lie. Their rows
//! are whole super-blocks, so they suit only rows whose length is a multiple
//! of 256: quantized files store other rows in Q5_0, Q5_1 or Q8_0.

use std::fmt;

/// A tensor element type Encore can store and compute with.
// ggml's names: `Q4_K` reads better here than `Q4K`.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    IQ4_NL,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_XS,
}

impl DType {
    /// Every type Encore can read and compute with on the CPU. Other
    /// backends may support fewer (CUDA: [`crate::cuda::WEIGHT_TYPES`]).
    pub const ALL: [DType; 15] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::IQ4_NL,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_XS,
    ];

    /// Byte offsets, within a block, of the half-precision scales (and
    /// minimums) that multiply every weight of the block. A non-finite
    /// value there poisons the whole block, so loading checks them (see
    /// [`DType::first_non_finite`]). Empty for plain floats.
    pub const fn scale_offsets(self) -> &'static [usize] {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => &[],
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4_NL | DType::IQ4_XS => &[0],
            DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
            DType::Q2_K => &[80, 82],
            DType::Q3_K => &[108],
            DType::Q6_K => &[208],
        }
    }

    /// The index of the first element (plain floats) or block (quantized
    /// types) of `data` that holds an infinity or a NaN: a value itself, or
    /// a block's scale. `None` when every value is finite. Quantized codes
    /// are integers and always finite, so only scales are read: a pass over
    /// a few bytes of each block.
    pub fn first_non_finite(self, data: &[u8]) -> Option<usize> {
        let f16_at = |b: &[u8], at: usize| {
            b.get(at..at + 2)
                .map(|h| half::f16::from_le_bytes([h[0], h[1]]).is_finite())
        };
        match self {
            DType::F32 => data
                .chunks_exact(4)
                .position(|v| !f32::from_le_bytes([v[0], v[1], v[2], v[3]]).is_finite()),
            DType::F16 => data
                .chunks_exact(2)
                .position(|v| f16_at(v, 0) == Some(false)),
            DType::BF16 => data
                .chunks_exact(2)
                .position(|v| !half::bf16::from_le_bytes([v[0], v[1]]).is_finite()),
            _ => data.chunks_exact(self.block_bytes()).position(|block| {
                self.scale_offsets()
                    .iter()
                    .any(|&at| f16_at(block, at) == Some(false))
            }),
        }
    }

    /// Weights per block (1 for plain floats).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::IQ4_NL => {
                32
            }
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS => {
                256
            }
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::IQ4_NL => 18,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::IQ4_XS => 136,
        }
    }

    /// Whether weights are stored in quantized blocks.
    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Bytes taken by `n` elements, or `None` when `n` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }

    /// The type's id in ggml's `ggml_type` enumeration (as stored in GGUF).
    pub const fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q2_K => 10,
            DType::Q3_K => 11,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::IQ4_NL => 20,
            DType::IQ4_XS => 23,
            DType::BF16 => 30,
        }
    }

    /// The type with the given ggml id, if Encore supports it.
    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// ggml's name for the type.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::IQ4_NL => "IQ4_NL",
            DType::Q2_K => "Q2_K",
            DType::Q3_K => "Q3_K",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
            DType::IQ4_XS => "IQ4_XS",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// ggml's name for a type id, including types Encore does not support, for error messages.
pub fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
        "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL",
        "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

/// The weight types a set of kernels is built for. A model's products need
/// the code of its few types only, and the GPU compilers' time grows with
/// the code: kernels narrowed to a file's types compile in a fraction of
/// the time of kernels for every type. A product of a type outside the set
/// is refused when it is dispatched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightTypes(u32);

impl WeightTypes {
    /// Every type.
    pub const ALL: WeightTypes = WeightTypes(u32::MAX);

    /// The types of `types`.
    pub fn of(types: impl IntoIterator<Item = DType>) -> WeightTypes {
        WeightTypes(types.into_iter().fold(0, |m, t| m | 1 << t.ggml_id()))
    }

    pub fn contains(self, dtype: DType) -> bool {
        self.0 >> dtype.ggml_id() & 1 == 1
    }

    /// The set as a bit mask over ggml type ids (bit `t` for type `t`).
    pub fn mask(self) -> u32 {
        self.0
    }

    /// The names of the types in the set (every type's for [`WeightTypes::ALL`]).
    pub fn names(self) -> Vec<&'static str> {
        DType::ALL
            .iter()
            .filter(|t| self.contains(**t))
            .map(|t| t.name())
            .collect()
    }
}

impl Default for WeightTypes {
    fn default() -> Self {
        WeightTypes::ALL
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn weight_types_hold_what_they_were_made_of() {
        let types = WeightTypes::of([DType::Q4_K, DType::Q6_K, DType::F32]);
        assert!(types.contains(DType::Q4_K) && types.contains(DType::F32));
        assert!(!types.contains(DType::Q5_K) && !types.contains(DType::BF16));
        assert_eq!(types.names(), ["F32", "Q4_K", "Q6_K"]);
        assert_eq!(types.mask(), 1 | 1 << 12 | 1 << 14);
        assert!(DType::ALL.iter().all(|t| WeightTypes::ALL.contains(*t)));
    }

    #[test]
    fn a_non_finite_scale_or_value_is_found_where_it_is() {
        for dtype in DType::ALL {
            let blocks = 5;
            let mut data = vec![0u8; dtype.block_bytes() * blocks];
            // Finite everywhere: small positive scales and values.
            for block in data.chunks_exact_mut(dtype.block_bytes()) {
                for at in dtype.scale_offsets() {
                    block[*at..*at + 2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
                }
            }
            assert_eq!(dtype.first_non_finite(&data), None, "{dtype}");
            let bad = 3 * dtype.block_bytes();
            match dtype {
                DType::F32 => data[bad..bad + 4].copy_from_slice(&f32::NAN.to_le_bytes()),
                DType::F16 => {
                    data[bad..bad + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes())
                }
                DType::BF16 => data[bad..bad + 2].copy_from_slice(&half::bf16::NAN.to_le_bytes()),
                _ => {
                    let at = bad + dtype.scale_offsets().last().copied().unwrap_or(0);
                    data[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
                }
            }
            assert_eq!(dtype.first_non_finite(&data), Some(3), "{dtype}");
        }
    }

    use super::*;

    #[test]
    fn ggml_ids_round_trip() {
        for t in DType::ALL {
            assert_eq!(DType::from_ggml_id(t.ggml_id()), Some(t));
            assert_eq!(ggml_type_name(t.ggml_id()), t.name());
        }
        // Q8_K is an activation type only; IQ2_XXS is not supported.
        assert_eq!(DType::from_ggml_id(15), None);
        assert_eq!(DType::from_ggml_id(16), None);
    }

    #[test]
    fn sizes_follow_blocks() {
        assert_eq!(DType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(DType::Q8_0.bytes_for(33), None);
        assert_eq!(DType::F16.bytes_for(3), Some(6));
        assert_eq!(DType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(DType::Q6_K.bytes_for(128), None);
        assert_eq!(DType::Q5_0.bytes_for(64), Some(44));
    }
}
