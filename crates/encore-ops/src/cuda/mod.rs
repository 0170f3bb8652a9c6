//! The CUDA backend of the kernels: one `.cu` file per kernel (per op)
//! and `.cuh` headers for what several kernels share, all in this folder;
//! [`geometry`], which says how each kernel is launched; and one function
//! per kernel that puts the two together as the kernel's
//! [`CudaKernel`] implementation, its launch computed from the dispatch's
//! value (the op's shape).
//!
//! The runtime hands NVRTC one string and no headers (its content is the
//! kernel's address), so `source` puts the headers' text in place of their
//! `#include "name.cuh"` lines before a source goes to the runtime; some
//! sources also get `#define` lines for constants the Rust side owns
//! (`source_with`). Each kernel file opens with its arguments and its math.
//!
//! The ops that read positions (`rope.cu`, `kv_store.cu`, `attention.cu`,
//! `attention_step.cu`) hold one body for one sequence's contiguous cache
//! and for a paged one, the position source a template argument; the
//! `POSITION_ROWS` define picks the entry point a compilation has (`rope`
//! or `rope_rows`, ...), so each is compiled once per
//! [`PositionSource`].

pub mod geometry;

use encore::CudaKernel;

use crate::kernels::attention::{AttnShape, KvShape};
use crate::kernels::attention_step::{
    AttnStepShape, STEP_K_NEW, STEP_ROPE_K, STEP_ROPE_Q, STEP_V_NEW,
};
use crate::kernels::elementwise::ScaleShape;
use crate::kernels::embed::EmbedShape;
use crate::kernels::fused::{FusedShape, EPILOGUE_ACCUMULATE, EPILOGUE_STORE, EPILOGUE_SWIGLU};
use crate::kernels::gemm_dense::{DequantShape, GemmF16Shape, SplitsShape};
use crate::kernels::matmul::MatmulShape;
use crate::kernels::norm::NormShape;
use crate::kernels::paged::{ArgmaxRowsShape, AttnStepPagedShape};
use crate::kernels::positions::PositionSource;
use crate::kernels::prefill_attention::check_head_dim;
use crate::kernels::rope::{RopeShape, RopeStoreShape};
use crate::DType;

/// The weight types the CUDA kernels that take weights (`matmul`, `gemm`,
/// `fused_matmul`, `embed`) have code for. A dispatch of one of them with
/// another type fails with [`encore::Error::InvalidDispatch`] naming the
/// type, before anything runs.
pub const WEIGHT_TYPES: [DType; 15] = [
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

/// The weight type of ggml id `id` if the CUDA kernels have code for it,
/// else why `kernel` refuses it.
fn weight_type(kernel: &str, id: u32) -> Result<DType, String> {
    match DType::from_ggml_id(id) {
        Some(dtype) if WEIGHT_TYPES.contains(&dtype) => Ok(dtype),
        Some(dtype) => Err(format!(
            "{kernel} on CUDA has no code for {dtype} weights (it has for {})",
            WEIGHT_TYPES.map(DType::name).join(", ")
        )),
        None => Err(format!(
            "{kernel} has no code for ggml type {id} ({})",
            crate::dtype::ggml_type_name(id)
        )),
    }
}

pub(crate) fn rms_norm() -> CudaKernel {
    CudaKernel::new(source("rms_norm.cu"), "rms_norm", |s: &NormShape| {
        geometry::rms_norm_launch(s.rows)
    })
}

/// The compile options of a variant specialized for a shape whose weights
/// have the ggml types `types`: `ENCORE_TYPE_MASK` (see gguf.cuh), so that
/// it carries those types' code alone, which makes NVRTC's work a fraction
/// of the generic code's. No option where an id lies outside the mask (a type
/// no kernel has code for: the dispatch is refused before it compiles).
fn type_mask_options(types: &[u32]) -> Vec<String> {
    if types.iter().any(|&t| t >= 32) {
        return Vec::new();
    }
    let mask = types.iter().fold(0u32, |mask, &t| mask | 1 << t);
    vec![format!("--define-macro=ENCORE_TYPE_MASK={mask:#x}u")]
}

/// The compile option that narrows a generic product kernel to the weight
/// types `types` (`ENCORE_TYPE_MASK`, as a variant's); `None` for every
/// type. A type left out traps if it reaches the kernel (gguf.cuh); the
/// ops refuse it before that ([`crate::Ops::for_weight_types`]).
pub(crate) fn types_option(types: crate::dtype::WeightTypes) -> Option<String> {
    (types != crate::dtype::WeightTypes::ALL)
        .then(|| format!("--define-macro=ENCORE_TYPE_MASK={:#x}u", types.mask()))
}

/// [`encore::KernelDef::variant_options`] of `matmul` and `matmul_rows`:
/// the weights' type.
pub(crate) fn matmul_variant_options(value: &[u8]) -> Vec<String> {
    bytemuck::try_pod_read_unaligned::<MatmulShape>(value)
        .map(|s| type_mask_options(&[s.dtype]))
        .unwrap_or_default()
}

/// [`encore::KernelDef::variant_options`] of `fused_matmul` and
/// `fused_matmul_rows`: the types of the weights in use, and the up
/// weight's in the SwiGLU epilogue (the kernel reads it there whatever the
/// weight count says); three blocks a multiprocessor for a product on 8-bit
/// activations (`MM_MIN_BLOCKS`, fused_matmul.cuh).
pub(crate) fn fused_variant_options(value: &[u8]) -> Vec<String> {
    let Ok(s) = bytemuck::try_pod_read_unaligned::<FusedShape>(value) else {
        return Vec::new();
    };
    let mut types = s.dtype[..(s.weights as usize).min(3)].to_vec();
    if s.epilogue == EPILOGUE_SWIGLU {
        types.push(s.dtype[1]);
    }
    let mut options = type_mask_options(&types);
    if geometry::fused_eight_bit(&s, false) {
        options.push("--define-macro=MM_MIN_BLOCKS=3".to_string());
    }
    options
}

/// `matmul`, its quantized products the exact ones with `exact`.
pub(crate) fn matmul(exact: bool) -> CudaKernel {
    matmul_kernel(exact, false)
}

/// `matmul_rows`: `matmul` held to its one-row path for every row
/// (`MM_ROW_INVARIANT`), a row per grid row, so that a row's sums do not
/// depend on the batch.
pub(crate) fn matmul_rows(exact: bool) -> CudaKernel {
    matmul_kernel(exact, true)
}

fn matmul_kernel(exact: bool, row_invariant: bool) -> CudaKernel {
    let file = if exact {
        "matmul_exact.cu"
    } else {
        "matmul.cu"
    };
    let mut defines = geometry::matmul_defines(exact);
    defines.push(("MM_ROW_INVARIANT", u32::from(row_invariant).to_string()));
    CudaKernel::checked(
        source_with(file, &defines),
        "matmul",
        move |s: &MatmulShape| {
            weight_type("matmul", s.dtype)?;
            let one_row = if row_invariant { 1 } else { s.rows };
            let shared = geometry::matmul_shared_bytes(one_row, s.n, s.k, s.dtype, exact);
            if row_invariant {
                geometry::matmul_rows_launch(s.rows, s.n, shared)
            } else {
                Ok(geometry::matmul_launch(
                    geometry::matmul_warps(s.rows, s.n),
                    shared,
                ))
            }
        },
    )
}

pub(crate) fn gemm() -> CudaKernel {
    CudaKernel::checked(
        source_with("gemm.cu", &geometry::gemm_defines()),
        "gemm",
        |s: &MatmulShape| {
            let dtype = weight_type("gemm", s.dtype)?;
            Ok(geometry::gemm_launch(s.rows, s.n, s.k, dtype))
        },
    )
}

pub(crate) fn gemm_f16() -> CudaKernel {
    CudaKernel::new(
        source_with("gemm_f16.cu", &geometry::gemm_f16_defines()),
        "gemm_f16",
        |s: &GemmF16Shape| geometry::gemm_f16_launch(s.rows, s.n, s.splits),
    )
}

pub(crate) fn sum_splits() -> CudaKernel {
    CudaKernel::new(source("sum_splits.cu"), "sum_splits", |s: &SplitsShape| {
        geometry::sum_splits_launch(u64::from(s.rows) * u64::from(s.n))
    })
}

pub(crate) fn to_f16_rows() -> CudaKernel {
    CudaKernel::new(source("to_f16_rows.cu"), "to_f16_rows", |s: &[u32; 2]| {
        geometry::to_f16_rows_launch(s[0])
    })
}

pub(crate) fn dequant_f16() -> CudaKernel {
    CudaKernel::checked(
        source("dequant_f16.cu"),
        "dequant_f16",
        |s: &DequantShape| {
            match weight_type("dequant_f16", s.dtype)? {
                DType::BF16 | DType::F32 => {
                    return Err(
                        "dequant_f16 takes weights within f16's range, not BF16 or F32".into(),
                    )
                }
                _ => {}
            }
            Ok(geometry::dequant_f16_launch(
                u64::from(s.n) * u64::from(s.k),
            ))
        },
    )
}

pub(crate) fn matmul_wide_rows() -> CudaKernel {
    CudaKernel::checked(
        source_with("matmul_wide_rows.cu", &geometry::matmul_wide_rows_defines()),
        "matmul_wide_rows",
        |s: &MatmulShape| {
            weight_type("matmul_wide_rows", s.dtype)?;
            Ok(geometry::matmul_wide_rows_launch(s.n))
        },
    )
}

/// `fused_matmul`, its quantized products the exact ones with `exact`.
pub(crate) fn fused_matmul(exact: bool) -> CudaKernel {
    fused_matmul_kernel(exact, false)
}

/// `fused_matmul_rows`: `fused_matmul` held to its one-row path for every
/// row, a row per grid row (as `matmul_rows`).
pub(crate) fn fused_matmul_rows(exact: bool) -> CudaKernel {
    fused_matmul_kernel(exact, true)
}

fn fused_matmul_kernel(exact: bool, row_invariant: bool) -> CudaKernel {
    let mut defines = geometry::fused_matmul_defines(exact);
    defines.push(("MM_ROW_INVARIANT", u32::from(row_invariant).to_string()));
    defines.extend([
        ("EPILOGUE_STORE", format!("{EPILOGUE_STORE}u")),
        ("EPILOGUE_ACCUMULATE", format!("{EPILOGUE_ACCUMULATE}u")),
        ("EPILOGUE_SWIGLU", format!("{EPILOGUE_SWIGLU}u")),
    ]);
    let file = if exact {
        "fused_matmul_exact.cu"
    } else {
        "fused_matmul.cu"
    };
    CudaKernel::checked(
        source_with(file, &defines),
        "fused_matmul",
        move |s: &FusedShape| {
            for &id in s.dtype.iter().take(s.weights as usize) {
                weight_type("fused_matmul", id)?;
            }
            if row_invariant {
                geometry::fused_matmul_rows_launch(s, exact)
            } else {
                Ok(geometry::fused_matmul_launch(s, exact))
            }
        },
    )
}

/// The `#define` that selects the entry point of a kernel with either
/// [`PositionSource`] (`rope.cu`, `kv_store.cu`, `attention.cu`,
/// `attention_step.cu`).
fn position_define(source: PositionSource) -> (&'static str, String) {
    ("POSITION_ROWS", source.rows_flag().to_string())
}

/// `rope` or, with [`PositionSource::Rows`], `rope_rows`.
pub(crate) fn rope(source: PositionSource) -> CudaKernel {
    let entry = match source {
        PositionSource::Start => "rope",
        PositionSource::Rows => "rope_rows",
    };
    CudaKernel::new(
        source_with("rope.cu", &[position_define(source)]),
        entry,
        |s: &RopeShape| {
            geometry::rope_launch(
                s.rows
                    .saturating_mul(s.heads)
                    .saturating_mul(s.rope_dim / 2),
            )
        },
    )
}

pub(crate) fn rope_store() -> CudaKernel {
    CudaKernel::new(
        source("rope_store.cu"),
        "rope_store",
        |s: &RopeStoreShape| {
            let r = &s.rope;
            geometry::rope_launch(
                r.rows
                    .saturating_mul(r.heads)
                    .saturating_mul(r.head_dim / 2),
            )
        },
    )
}

/// `kv_store` or, with [`PositionSource::Rows`], `kv_store_paged`.
pub(crate) fn kv_store(source: PositionSource) -> CudaKernel {
    let entry = match source {
        PositionSource::Start => "kv_store",
        PositionSource::Rows => "kv_store_paged",
    };
    CudaKernel::new(
        source_with("kv_store.cu", &[position_define(source)]),
        entry,
        |s: &KvShape| geometry::kv_store_launch(s.rows.saturating_mul(s.kv_dim)),
    )
}

/// `attention` or, with [`PositionSource::Rows`], `attention_paged`:
/// `attention.cu` after its geometry and the position source.
pub(crate) fn attention(source: PositionSource) -> CudaKernel {
    let mut defines = geometry::attention_defines();
    defines.push(position_define(source));
    let code = source_with("attention.cu", &defines);
    match source {
        PositionSource::Start => CudaKernel::new(code, "attention", geometry::attention_launch),
        PositionSource::Rows => {
            CudaKernel::new(code, "attention_paged", geometry::attention_paged_launch)
        }
    }
}

pub(crate) fn attention_exact() -> CudaKernel {
    use crate::cpu::kernels::attention::{FA_TILE_KV, FA_TILE_Q};
    // The source takes both of the CPU's tile sizes as defines, but its
    // code assumes 64.
    const _: () = assert!(FA_TILE_Q == 64 && FA_TILE_KV == 64);
    let mut defines = geometry::attention_exact_defines();
    defines.push(("EXA_TILE_Q", FA_TILE_Q.to_string()));
    defines.push(("EXA_TILE_KV", FA_TILE_KV.to_string()));
    CudaKernel::new(
        source_with("attention_exact.cu", &defines),
        "attention_exact",
        geometry::attention_exact_launch,
    )
}

/// The head sizes `prefill_attention.cu` has code for; the kernel refuses
/// others at launch, and `Ops::attention` then keeps the general kernel.
pub const PREFILL_HEAD_DIMS: [u32; 4] = [16, 32, 64, 128];

pub(crate) fn prefill_attention() -> CudaKernel {
    CudaKernel::checked(
        source_with(
            "prefill_attention.cu",
            &geometry::prefill_attention_defines(),
        ),
        "attention_prefill",
        |s: &AttnShape| {
            check_head_dim("CUDA", &PREFILL_HEAD_DIMS, s.head_dim)?;
            Ok(geometry::prefill_attention_launch(s))
        },
    )
}

/// The defines of an attention step kernel: the flag bits, then its
/// `geometry`.
fn attention_step_defines(geometry: Vec<(&'static str, String)>) -> Vec<(&'static str, String)> {
    let mut defines = vec![
        ("STEP_ROPE_Q", format!("{STEP_ROPE_Q}u")),
        ("STEP_K_NEW", format!("{STEP_K_NEW}u")),
        ("STEP_ROPE_K", format!("{STEP_ROPE_K}u")),
        ("STEP_V_NEW", format!("{STEP_V_NEW}u")),
    ];
    defines.extend(geometry);
    defines
}

/// `attention_step` or, with [`PositionSource::Rows`],
/// `attention_step_paged`: `attention_step.cu` after its flag bits, its
/// geometry (a paged step has its own) and the position source.
pub(crate) fn attention_step(source: PositionSource) -> CudaKernel {
    let geometry = match source {
        PositionSource::Start => geometry::attention_step_defines(),
        PositionSource::Rows => geometry::attention_step_paged_defines(),
    };
    let mut defines = attention_step_defines(geometry);
    defines.push(position_define(source));
    let code = source_with("attention_step.cu", &defines);
    match source {
        PositionSource::Start => CudaKernel::new(code, "attention_step", |s: &AttnStepShape| {
            geometry::attention_step_launch(s.attn.heads)
        }),
        PositionSource::Rows => {
            CudaKernel::checked(code, "attention_step_paged", |s: &AttnStepPagedShape| {
                geometry::attention_step_paged_launch(s.attn.heads, s.attn.rows)
            })
        }
    }
}

pub(crate) fn add() -> CudaKernel {
    CudaKernel::new(source("add.cu"), "add", |n: &u32| {
        geometry::elementwise_launch(*n)
    })
}

pub(crate) fn add_rows() -> CudaKernel {
    CudaKernel::new(source("add_rows.cu"), "add_rows", |[rows, n]: &[u32; 2]| {
        geometry::elementwise_launch(rows.saturating_mul(*n))
    })
}

pub(crate) fn silu_mul() -> CudaKernel {
    CudaKernel::new(source("silu_mul.cu"), "silu_mul", |n: &u32| {
        geometry::elementwise_launch(*n)
    })
}

pub(crate) fn gelu_mul() -> CudaKernel {
    CudaKernel::new(source("gelu_mul.cu"), "gelu_mul", |n: &u32| {
        geometry::elementwise_launch(*n)
    })
}

pub(crate) fn scale() -> CudaKernel {
    CudaKernel::new(source("scale.cu"), "scale", |s: &ScaleShape| {
        geometry::elementwise_launch(s.n)
    })
}

pub(crate) fn embed() -> CudaKernel {
    CudaKernel::checked(source("embed.cu"), "embed", |s: &EmbedShape| {
        weight_type("embed", s.dtype)?;
        Ok(geometry::embed_launch(s.rows))
    })
}

pub(crate) fn argmax() -> CudaKernel {
    CudaKernel::new(
        source_with("argmax.cu", &geometry::argmax_defines()),
        "argmax",
        |n: &u32| geometry::argmax_launch(*n),
    )
}

pub(crate) fn argmax_rows() -> CudaKernel {
    CudaKernel::checked(
        source_with("argmax_rows.cu", &geometry::argmax_defines()),
        "argmax_rows",
        |s: &ArgmaxRowsShape| geometry::argmax_rows_launch(s.rows, s.n),
    )
}

pub(crate) fn advance() -> CudaKernel {
    CudaKernel::new(source("advance.cu"), "advance", |_cap: &u32| {
        geometry::advance_launch()
    })
}

/// Every CUDA file of this folder, by name.
const FILES: &[(&str, &str)] = &[
    // Headers.
    ("gguf.cuh", include_str!("gguf.cuh")),
    ("matmul_shape.cuh", include_str!("matmul_shape.cuh")),
    ("matmul_dots.cuh", include_str!("matmul_dots.cuh")),
    ("quant_codes.cuh", include_str!("quant_codes.cuh")),
    ("quant_dots_fast.cuh", include_str!("quant_dots_fast.cuh")),
    ("quant_dots_k8.cuh", include_str!("quant_dots_k8.cuh")),
    ("quant_dots_exact.cuh", include_str!("quant_dots_exact.cuh")),
    ("matmul.cuh", include_str!("matmul.cuh")),
    ("fused_matmul.cuh", include_str!("fused_matmul.cuh")),
    ("mma.cuh", include_str!("mma.cuh")),
    ("wide_rows.cuh", include_str!("wide_rows.cuh")),
    ("rope_common.cuh", include_str!("rope_common.cuh")),
    ("attention_common.cuh", include_str!("attention_common.cuh")),
    ("argmax_common.cuh", include_str!("argmax_common.cuh")),
    // Kernels.
    ("rms_norm.cu", include_str!("rms_norm.cu")),
    ("matmul.cu", include_str!("matmul.cu")),
    ("matmul_exact.cu", include_str!("matmul_exact.cu")),
    ("fused_matmul.cu", include_str!("fused_matmul.cu")),
    (
        "fused_matmul_exact.cu",
        include_str!("fused_matmul_exact.cu"),
    ),
    ("gemm.cu", include_str!("gemm.cu")),
    ("gemm_f16.cu", include_str!("gemm_f16.cu")),
    ("to_f16_rows.cu", include_str!("to_f16_rows.cu")),
    ("sum_splits.cu", include_str!("sum_splits.cu")),
    ("dequant_f16.cu", include_str!("dequant_f16.cu")),
    ("matmul_wide_rows.cu", include_str!("matmul_wide_rows.cu")),
    ("rope.cu", include_str!("rope.cu")),
    ("rope_store.cu", include_str!("rope_store.cu")),
    ("kv_store.cu", include_str!("kv_store.cu")),
    ("attention.cu", include_str!("attention.cu")),
    ("attention_exact.cu", include_str!("attention_exact.cu")),
    ("attention_step.cu", include_str!("attention_step.cu")),
    ("prefill_attention.cu", include_str!("prefill_attention.cu")),
    ("add.cu", include_str!("add.cu")),
    ("add_rows.cu", include_str!("add_rows.cu")),
    ("silu_mul.cu", include_str!("silu_mul.cu")),
    ("gelu_mul.cu", include_str!("gelu_mul.cu")),
    ("scale.cu", include_str!("scale.cu")),
    ("embed.cu", include_str!("embed.cu")),
    ("argmax.cu", include_str!("argmax.cu")),
    ("argmax_rows.cu", include_str!("argmax_rows.cu")),
    ("advance.cu", include_str!("advance.cu")),
];

/// The text of `file` (a name in this folder) with its `#include
/// "name.cuh"` lines expanded (see [`crate::include`]); a file that does
/// not exist becomes an `#error` line, which NVRTC reports by name.
pub(crate) fn source(file: &str) -> String {
    crate::include::expand(FILES, file, |f| format!("#error \"no CUDA file {f}\"\n"))
}

/// [`source`] after one `#define NAME VALUE` line for each of `defines`:
/// constants the Rust side owns (launch geometry, flag bits), so that each
/// is written once.
pub(crate) fn source_with(file: &str, defines: &[(&str, String)]) -> String {
    let mut out: String = defines
        .iter()
        .map(|(name, value)| format!("#define {name} {value}\n"))
        .collect();
    out.push_str(&source(file));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every CUDA source of every kernel, default and exact, is complete:
    /// no include is left unresolved, no file was missing.
    #[test]
    fn every_kernel_source_has_its_includes_resolved() {
        let sets = [crate::KernelSet::Default, crate::KernelSet::Exact];
        for def in sets.into_iter().flat_map(|s| s.defs().all()) {
            let Some(cuda) = def.cuda_impl() else {
                panic!("{} has no CUDA source", def.name());
            };
            for line in cuda.source.lines() {
                assert!(
                    !line.trim_start().starts_with("#include") && !line.contains("#error"),
                    "{}: {line}",
                    def.name()
                );
            }
        }
    }

    /// A specializable kernel's source holds one entry point: specializing
    /// compiles the whole source for one value type, so a second entry
    /// calling `encore_fix_value` on another type would fail to compile.
    #[test]
    fn specializable_kernels_have_one_entry_point_in_their_source() {
        let sets = [crate::KernelSet::Default, crate::KernelSet::Exact];
        for def in sets.into_iter().flat_map(|s| s.defs().all()) {
            let (Some(cuda), true) = (def.cuda_impl(), def.is_specializable()) else {
                continue;
            };
            let entries = cuda.source.matches("extern \"C\"").count();
            assert_eq!(entries, 1, "{}: {entries} entry points", def.name());
        }
    }

    /// A decode product of Q4_K and Q6_K weights on 8-bit activations is
    /// compiled for three blocks a multiprocessor; other products, and the
    /// same weights over several rows, keep the default.
    #[test]
    fn eight_bit_decode_variants_ask_for_three_blocks() {
        let swiglu = |dtype: DType, rows: u32| FusedShape {
            rows,
            k: 3584,
            n: [18944, 18944, 0],
            dtype: [dtype.ggml_id(), dtype.ggml_id(), 0],
            weights: 2,
            epilogue: EPILOGUE_SWIGLU,
            norm: 1,
            eps: 1e-6,
            bias: 0,
        };
        let asks = |s: FusedShape| {
            fused_variant_options(bytemuck::bytes_of(&s))
                .contains(&"--define-macro=MM_MIN_BLOCKS=3".to_string())
        };
        assert!(asks(swiglu(DType::Q4_K, 1)));
        assert!(asks(swiglu(DType::Q6_K, 1)));
        assert!(asks(swiglu(DType::Q8_0, 1)));
        assert!(!asks(swiglu(DType::Q4_K, 4)));
        assert!(!asks(swiglu(DType::Q5_K, 1)));
        // Weights in blocks of 32 over long rows and few columns split on
        // f32 activations instead (a 0.5B model's down product).
        let down = |n: u32| FusedShape {
            rows: 1,
            k: 4864,
            n: [n, 0, 0],
            dtype: [DType::Q8_0.ggml_id(), 0, 0],
            weights: 1,
            epilogue: EPILOGUE_ACCUMULATE,
            norm: 0,
            eps: 0.0,
            bias: 0,
        };
        assert!(!asks(down(896)));
        assert!(asks(down(3584)));
    }

    /// A specialized product carries the code of its weights' types alone
    /// (`ENCORE_TYPE_MASK`), for every type in use and none other; the
    /// type is part of the variant's key, so two types never share one.
    #[test]
    fn specialized_products_carry_only_their_weight_types() {
        let mask_of = |def: &encore::KernelDef, value: &[u8]| {
            let variant = def.specialized(value).expect("specializable");
            let masks: Vec<&String> = variant
                .options()
                .iter()
                .filter(|o| o.starts_with("--define-macro=ENCORE_TYPE_MASK="))
                .collect();
            assert_eq!(masks.len(), 1, "{}: {:?}", def.name(), variant.options());
            masks[0].clone()
        };
        let bit = |d: DType| 1u32 << d.ggml_id();
        let option = |mask: u32| format!("--define-macro=ENCORE_TYPE_MASK={mask:#x}u");
        for exact in [false, true] {
            let set = if exact {
                crate::KernelSet::Exact
            } else {
                crate::KernelSet::Default
            };
            let defs = set.defs();
            let matmul = defs.matmul.clone();
            for dtype in WEIGHT_TYPES {
                let shape = MatmulShape {
                    rows: 1,
                    n: 64,
                    k: 256,
                    dtype: dtype.ggml_id(),
                };
                assert_eq!(
                    mask_of(&matmul, bytemuck::bytes_of(&shape)),
                    option(bit(dtype))
                );
            }
            // Gate and up of two types; the third weight's type is unused.
            let swiglu = FusedShape {
                rows: 1,
                k: 256,
                n: [64, 64, 0],
                dtype: [
                    DType::Q4_K.ggml_id(),
                    DType::Q6_K.ggml_id(),
                    DType::F16.ggml_id(),
                ],
                weights: 2,
                epilogue: EPILOGUE_SWIGLU,
                norm: 1,
                eps: 1e-6,
                bias: 0,
            };
            let both = bit(DType::Q4_K) | bit(DType::Q6_K);
            for def in [defs.fused_matmul.clone(), defs.fused_matmul_rows.clone()] {
                assert_eq!(mask_of(&def, bytemuck::bytes_of(&swiglu)), option(both));
                let qkv = FusedShape {
                    weights: 3,
                    epilogue: EPILOGUE_STORE,
                    ..swiglu
                };
                let all = both | bit(DType::F16);
                assert_eq!(mask_of(&def, bytemuck::bytes_of(&qkv)), option(all));
            }
        }
    }

    /// A header shared by several files comes once, and a missing file
    /// becomes an `#error` line NVRTC reports.
    #[test]
    fn headers_expand_once_and_missing_files_become_errors() {
        assert_eq!(source("no_such.cu"), "#error \"no CUDA file no_such.cu\"\n");
        let fused = source("fused_matmul.cu");
        assert_eq!(fused.matches("float f16_to_f32(").count(), 1);
    }

    /// The kernels that take weights refuse a type they have no code for,
    /// naming it, and launch the types of [`WEIGHT_TYPES`].
    #[test]
    fn weight_kernels_refuse_types_without_cuda_code() {
        let matmul_shape = |dtype: DType| MatmulShape {
            rows: 1,
            n: 64,
            k: 256,
            dtype: dtype.ggml_id(),
        };
        let fused_shape = |dtype: DType| FusedShape {
            rows: 1,
            k: 256,
            n: [64, 64, 0],
            dtype: [DType::Q8_0.ggml_id(), dtype.ggml_id(), 0],
            weights: 2,
            epilogue: EPILOGUE_STORE,
            norm: 0,
            eps: 1e-5,
            bias: 0,
        };
        let embed_shape = |dtype: DType| EmbedShape {
            rows: 1,
            dim: 256,
            vocab: 10,
            dtype: dtype.ggml_id(),
        };
        let (matmul, gemm, fused, embed) = (matmul(false), gemm(), fused_matmul(true), embed());
        for dtype in DType::ALL {
            let launches = [
                (
                    "matmul",
                    matmul.launch(bytemuck::bytes_of(&matmul_shape(dtype))),
                ),
                (
                    "gemm",
                    gemm.launch(bytemuck::bytes_of(&matmul_shape(dtype))),
                ),
                (
                    "fused_matmul",
                    fused.launch(bytemuck::bytes_of(&fused_shape(dtype))),
                ),
                (
                    "embed",
                    embed.launch(bytemuck::bytes_of(&embed_shape(dtype))),
                ),
            ];
            for (name, launch) in launches {
                if WEIGHT_TYPES.contains(&dtype) {
                    assert!(launch.is_ok(), "{name} {dtype}: {launch:?}");
                } else {
                    let Err(reason) = launch else {
                        panic!("{name} launched {dtype}");
                    };
                    assert!(
                        reason.contains(name) && reason.contains(dtype.name()),
                        "{name} {dtype}: {reason}"
                    );
                }
            }
        }
        // An id Encore does not know at all.
        let mut shape = matmul_shape(DType::F32);
        shape.dtype = 16;
        let reason = matmul.launch(bytemuck::bytes_of(&shape)).unwrap_err();
        assert!(reason.contains("IQ2_XXS"), "{reason}");
    }

    /// The table lists every `.cu` and `.cuh` file of this folder.
    #[test]
    fn the_table_holds_every_file_of_the_folder() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu") || n.ends_with(".cuh"))
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = FILES.iter().map(|(n, _)| n.to_string()).collect();
        listed.sort();
        assert_eq!(on_disk, listed);
    }
}
