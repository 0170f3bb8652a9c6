//! The op registry: one table that maps every kernel [`crate::Ops`] loads
//! to its implementation on each backend (the CPU body in
//! [`crate::cpu::kernels`], the CUDA kernel in [`crate::cuda`], the WGSL
//! kernel in [`crate::wgsl`]) and says which [`KernelSet`] has it.
//!
//! It sits above the backends so that imports point one way: an op's
//! description ([`crate::kernels`]: arguments, shape, math) names no
//! backend, each backend's implementation imports the description, and
//! only this table names the implementations. A new kernel is a
//! description, its implementations, one row here and its method on
//! `Ops`; the row gives [`KernelDefs`] its field, [`KernelDefs::all`] its
//! entry and `Ops` its slot. A backend without an implementation in a row
//! reports [`Error::Unsupported`] when the op is dispatched there.
//!
//! An op that reads positions has a row for each
//! [`PositionSource`](crate::kernels::positions::PositionSource) (`rope`
//! and `rope_rows`, `kv_store` and `kv_store_paged`, `attention` and
//! `attention_paged`, `attention_step` and `attention_step_paged`): each
//! backend's one body for the op, compiled for that source, so that a
//! kernel reads its positions without a branch. [`crate::Ops`] has one
//! method for both.

use encore::{
    Device, Error, Implementation, Kernel, KernelDef, MetalKernel, Result, WgpuKernel, WgpuVariant,
};

use crate::cpu::kernels as cpu;
use crate::dtype::WeightTypes;
use crate::kernels::positions::PositionSource::{Rows, Start};
use crate::{cuda, wgsl};

/// Which version of the kernels [`crate::Ops`] loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelSet {
    /// The fastest kernels of each backend. GPU results agree with the
    /// CPU's to rounding, not bit for bit.
    #[default]
    Default,
    /// Kernels that give the CPU backend's results bit for bit on every
    /// backend (the same arithmetic in the same order), slower: products
    /// that quantize their input as the CPU does, an attention that follows
    /// the CPU's recurrence, and no variant or fusion whose arithmetic the
    /// CPU does not share (the tensor-core gemm and prefill attention, the
    /// fused attention step).
    Exact,
}

impl KernelSet {
    /// Every definition of this set, for weights of every type.
    pub fn defs(self) -> KernelDefs {
        self.defs_for(WeightTypes::ALL)
    }
}

/// The table: for each row, the slot's name, its type (`KernelDef`, or
/// `Option<KernelDef>` where a set may leave it out) and its definition,
/// an expression of `$exact` (the set is [`KernelSet::Exact`]) and
/// `$narrow` (narrows a product's code to the weight types asked for).
macro_rules! kernel_table {
    (
        |$exact:ident, $narrow:ident|
        $( $(#[$doc:meta])* $slot:ident: $ty:ty = $def:expr; )*
    ) => {
        /// The definitions of one [`KernelSet`], one per slot of
        /// [`crate::Ops`]; `None` where the set leaves a kernel out.
        #[derive(Clone)]
        pub struct KernelDefs {
            $( $(#[$doc])* pub $slot: $ty, )*
        }

        impl KernelSet {
            /// Every definition of this set, the products of weights built
            /// for the weight types `types` alone (see [`WeightTypes`]).
            // The closures around the products' CPU body inline it (see
            // `cpu::kernels::matmul` for why).
            #[allow(clippy::redundant_closure)]
            pub fn defs_for(self, types: WeightTypes) -> KernelDefs {
                let $exact = self == KernelSet::Exact;
                let $narrow = |def: KernelDef| narrow(def, types);
                KernelDefs { $( $slot: $def, )* }
            }
        }

        impl KernelDefs {
            /// Every definition, in table order.
            pub fn all(self) -> Vec<KernelDef> {
                let mut all = Vec::new();
                $( all.extend(Row::defined(self.$slot)); )*
                all
            }
        }

        /// Every kernel of a set, loaded on one device: a slot per row.
        pub(crate) struct Slots {
            $( pub(crate) $slot: Slot, )*
        }

        impl Slots {
            /// Loads every kernel of `defs` on `device` that its backend
            /// implements, each slot passed through `named` (which may
            /// rename an empty one for its error).
            pub(crate) fn load(
                device: &Device,
                defs: KernelDefs,
                named: impl Fn(Slot) -> Slot,
            ) -> Result<Slots> {
                Ok(Slots {
                    $( $slot: Slot::load(device, Row::defined(defs.$slot)).map(&named)?, )*
                })
            }
        }
    };
}

/// The definition string of the `attention` op's CPU body, shared by the
/// two kernels of the op that have it (see [`KernelDef::cpu`]).
const ATTENTION_CPU: &str = "attention f16-cache flash tiled v4";

kernel_table! {
    |exact, narrow|

    /// RMSNorm ([`crate::kernels::norm`]).
    rms_norm: KernelDef = KernelDef::new("rms_norm")
        .op("rms_norm")
        .cpu("rms_norm f32 v1", cpu::norm::rms_norm)
        .cuda(cuda::rms_norm())
        .wgpu(wgsl::rms_norm())
        .programmatic()
        .specializable();

    /// Matrix products ([`crate::kernels::matmul`]); with `exact`, CUDA
    /// code that gives the CPU's results bit for bit.
    matmul: KernelDef = narrow(
        KernelDef::new("matmul")
            .op("matmul")
            .cpu("matmul v1", |a| cpu::matmul::matmul(a))
            .cuda(cuda::matmul(exact))
            .wgpu_unless(exact, wgsl::matmul, wgsl::matmul_for)
            .programmatic()
            .specializable()
            .variant_options(cuda::matmul_variant_options),
    );

    /// The tensor-core product of many rows ([`crate::kernels::gemm`]),
    /// where a backend has it.
    gemm: Option<KernelDef> = (!exact).then(|| {
        narrow(KernelDef::new("gemm").op("gemm").cuda(cuda::gemm()).programmatic())
    });

    /// The products of long prompts on dequantized tiles
    /// ([`crate::kernels::gemm_dense`]), where a backend has them: the
    /// activations rounded to f16, ...
    to_f16_rows: Option<KernelDef> = (!exact).then(|| {
        KernelDef::new("to_f16_rows").op("to_f16_rows").cuda(cuda::to_f16_rows()).programmatic()
    });

    /// ... a slice of the weights decoded to f16, ...
    dequant_f16: Option<KernelDef> = (!exact).then(|| {
        narrow(KernelDef::new("dequant_f16").op("dequant_f16").cuda(cuda::dequant_f16()).programmatic())
    });

    /// ... the two multiplied on tensor cores, ...
    gemm_f16: Option<KernelDef> = (!exact).then(|| {
        KernelDef::new("gemm_f16").op("gemm_f16").cuda(cuda::gemm_f16()).programmatic()
    });

    /// ... the runs of a product split along `k` added, ...
    sum_splits: Option<KernelDef> = (!exact).then(|| {
        KernelDef::new("sum_splits").op("sum_splits").cuda(cuda::sum_splits()).programmatic()
    });

    /// ... and the rows beyond f16's range again in f32.
    matmul_wide_rows: Option<KernelDef> = (!exact).then(|| {
        narrow(
            KernelDef::new("matmul_wide_rows")
                .op("matmul_wide_rows")
                .cuda(cuda::matmul_wide_rows())
                .programmatic(),
        )
    });

    /// RoPE ([`crate::kernels::rope`]) of consecutive rows of one sequence.
    rope: KernelDef = KernelDef::new("rope")
        .op("rope")
        .cpu("rope f32 fma factors v3", |a| cpu::rope::rope(a, Start))
        .cuda(cuda::rope(Start))
        .wgpu(wgsl::rope(Start))
        .programmatic();

    /// RoPE of rows each at its own position ([`crate::kernels::paged`]):
    /// `rope`'s body.
    rope_rows: KernelDef = KernelDef::new("rope_rows")
        .op("rope_rows")
        .cpu("rope_rows f32 fma factors v2", |a| cpu::rope::rope(a, Rows))
        .cuda(cuda::rope(Rows))
        .wgpu(wgsl::rope(Rows))
        .programmatic();

    /// RoPE of K rows and their store into the cache (fusion only).
    rope_store: KernelDef = KernelDef::new("rope_store")
        .op("rope_store")
        .cpu("rope_store f16 v1", cpu::rope::rope_store)
        .cuda(cuda::rope_store())
        .wgpu(wgsl::rope_store())
        .programmatic();

    /// The store of K or V rows into the cache at consecutive positions
    /// ([`crate::kernels::attention`]).
    kv_store: KernelDef = KernelDef::new("kv_store")
        .op("kv_store")
        .cpu("kv_store f16 v1", |a| cpu::attention::kv_store(a, Start))
        .cuda(cuda::kv_store(Start))
        .wgpu(wgsl::kv_store(Start))
        .programmatic();

    /// The store of rows into a paged cache, each at its own slot:
    /// `kv_store`'s body.
    kv_store_paged: KernelDef = KernelDef::new("kv_store_paged")
        .op("kv_store_paged")
        .cpu("kv_store_paged f16 v2", |a| cpu::attention::kv_store(a, Rows))
        .cuda(cuda::kv_store(Rows))
        .wgpu(wgsl::kv_store(Rows))
        .programmatic();

    /// Attention over the cache ([`crate::kernels::attention`]); with
    /// `exact`, a CUDA kernel that gives the CPU's bits
    /// ([`crate::kernels::attention_exact`]), compiled without contraction.
    attention: KernelDef = if exact {
        KernelDef::new("attention_exact")
            .op("attention")
            .cpu(ATTENTION_CPU, |a| cpu::attention::attention(a, Start))
            .cuda(cuda::attention_exact())
            .option("--fmad=false")
            .programmatic()
    } else {
        KernelDef::new("attention")
            .op("attention")
            .cpu(ATTENTION_CPU, |a| cpu::attention::attention(a, Start))
            .cuda(cuda::attention(Start))
            .wgpu(wgsl::attention())
            .programmatic()
    };

    /// Attention of rows of independent sequences over a paged cache:
    /// `attention`'s body.
    attention_paged: KernelDef = KernelDef::new("attention_paged")
        .op("attention_paged")
        .cpu("attention_paged gathered flash v2", |a| cpu::attention::attention(a, Rows))
        .cuda(cuda::attention(Rows))
        .programmatic();

    /// The tiled attention of a prefill batch
    /// ([`crate::kernels::prefill_attention`]), where a backend has it.
    attention_prefill: Option<KernelDef> = (!exact).then(|| {
        KernelDef::new("attention_prefill")
            .op("attention_prefill")
            .cuda(cuda::prefill_attention())
            .wgpu(wgsl::prefill_attention())
            .programmatic()
    });

    /// Decode attention with the step's RoPE and stores folded in
    /// ([`crate::kernels::attention_step`]; fusion only).
    attention_step: Option<KernelDef> = (!exact).then(|| {
        KernelDef::new("attention_step")
            .op("attention_step")
            .cpu("attention_step f16-cache v1", |a| cpu::attention_step::attention_step(a, Start))
            .cuda(cuda::attention_step(Start))
            .wgpu(wgsl::attention_step())
            .wgpu_variants(wgsl::attention_step_for)
            .programmatic()
            .specializable()
    });

    /// Paged decode attention with the rows' RoPE and stores folded in
    /// (fusion only; not in the exact set, as `attention_step`):
    /// `attention_step`'s body. Specialized without its row count, as
    /// `matmul_rows`.
    attention_step_paged: Option<KernelDef> = (!exact).then(|| {
        KernelDef::new("attention_step_paged")
            .op("attention_step_paged")
            .cpu("attention_step_paged f16-cache v2", |a| {
                cpu::attention_step::attention_step(a, Rows)
            })
            .cuda(cuda::attention_step(Rows))
            .programmatic()
            .specializable_except(&[0])
    });

    /// `y += x` ([`crate::kernels::elementwise`], as the four below).
    add: KernelDef = KernelDef::new("add")
        .op("add")
        .cpu("add f32 v1", cpu::elementwise::add)
        .cuda(cuda::add())
        .wgpu(wgsl::add())
        .programmatic();

    /// A bias added to every row.
    add_rows: KernelDef = KernelDef::new("add_rows")
        .op("add_rows")
        .cpu("add_rows f32 v1", cpu::elementwise::add_rows)
        .cuda(cuda::add_rows())
        .wgpu(wgsl::add_rows())
        .programmatic();

    /// SwiGLU.
    silu_mul: KernelDef = KernelDef::new("silu_mul")
        .op("silu_mul")
        .cpu("silu_mul f32 ggml-exp v2", cpu::elementwise::silu_mul)
        .cuda(cuda::silu_mul())
        .wgpu(wgsl::silu_mul())
        .programmatic();

    /// GeGLU.
    gelu_mul: KernelDef = KernelDef::new("gelu_mul")
        .op("gelu_mul")
        .cpu("gelu_mul f32 tanh f16-table v2", cpu::elementwise::gelu_mul)
        .cuda(cuda::gelu_mul())
        .wgpu(wgsl::gelu_mul())
        .programmatic();

    /// `y *= s`.
    scale: KernelDef = KernelDef::new("scale")
        .op("scale")
        .cpu("scale f32 v1", cpu::elementwise::scale)
        .cuda(cuda::scale())
        .wgpu(wgsl::scale())
        .programmatic();

    /// Embedding lookup ([`crate::kernels::embed`]).
    embed: KernelDef = KernelDef::new("embed")
        .op("embed")
        .cpu("embed v1", cpu::embed::embed)
        .cuda(cuda::embed())
        .wgpu(wgsl::embed())
        .programmatic()
        .specializable();

    /// Argmax ([`crate::kernels::argmax`]).
    argmax: KernelDef = KernelDef::new("argmax")
        .op("argmax")
        .cpu("argmax f32 v1", cpu::argmax::argmax_op)
        .cuda(cuda::argmax())
        .wgpu(wgsl::argmax())
        .programmatic()
        .specializable();

    /// A greedy step's bookkeeping ([`crate::kernels::advance`]).
    advance: KernelDef = KernelDef::new("advance")
        .op("advance")
        .cpu("advance v1", cpu::advance::advance)
        .cuda(cuda::advance())
        .wgpu(wgsl::advance())
        .programmatic();

    /// Products that share their input, with a norm and an epilogue
    /// ([`crate::kernels::fused`]; fusion only); with `exact`, CUDA code
    /// that gives the CPU's results bit for bit.
    fused_matmul: KernelDef = narrow(
        KernelDef::new("fused_matmul")
            .op("fused_matmul")
            .cpu("fused_matmul v1", cpu::fused::fused_matmul)
            .cuda(cuda::fused_matmul(exact))
            .wgpu_unless(exact, wgsl::fused_matmul, wgsl::fused_matmul_for)
            .programmatic()
            .specializable()
            .variant_options(cuda::fused_variant_options),
    );

    /// `matmul` with each row's arithmetic independent of the batch
    /// ([`crate::kernels::paged`], as `argmax_rows`), specialized
    /// without its row count (the kernel takes the row from the grid), so
    /// one variant serves every batch size.
    matmul_rows: KernelDef = narrow(
        KernelDef::new("matmul_rows")
            .op("matmul_rows")
            .cpu("matmul v1", |a| cpu::matmul::matmul(a))
            .cuda(cuda::matmul_rows(exact))
            .programmatic()
            .specializable_except(&[0])
            .variant_options(cuda::matmul_variant_options),
    );

    /// The argmax of each row.
    argmax_rows: KernelDef = KernelDef::new("argmax_rows")
        .op("argmax_rows")
        .cpu("argmax_rows f32 v1", cpu::argmax::argmax_rows_op)
        .cuda(cuda::argmax_rows())
        .programmatic();

    /// `fused_matmul` with each row's arithmetic independent of the batch,
    /// what the fusion rules of batch graphs build from `matmul_rows`; the
    /// CPU body is `fused_matmul`'s (row by row already). Specialized
    /// without its row count, as `matmul_rows`.
    fused_matmul_rows: KernelDef = narrow(
        KernelDef::new("fused_matmul_rows")
            .op("fused_matmul_rows")
            .cpu("fused_matmul v1", cpu::fused::fused_matmul)
            .cuda(cuda::fused_matmul_rows(exact))
            .programmatic()
            .specializable_except(&[0])
            .variant_options(cuda::fused_variant_options),
    );
}

/// `def` with the option that narrows its CUDA code to the weight types
/// `types` (none for every type).
fn narrow(def: KernelDef, types: WeightTypes) -> KernelDef {
    match cuda::types_option(types) {
        Some(option) => def.option(option),
        None => def,
    }
}

/// What the table's rows add to [`KernelDef`]'s builder.
trait Builder {
    /// Adds the WGSL kernel `kernel` and its graph variants except in the
    /// exact set (`exact`): the WGSL products are not the CPU's bit for bit.
    fn wgpu_unless(
        self,
        exact: bool,
        kernel: fn() -> WgpuKernel,
        variants: WgpuVariant,
    ) -> KernelDef;
}

impl Builder for KernelDef {
    fn wgpu_unless(
        self,
        exact: bool,
        kernel: fn() -> WgpuKernel,
        variants: WgpuVariant,
    ) -> KernelDef {
        if exact {
            self
        } else {
            self.wgpu(kernel()).wgpu_variants(variants)
        }
    }
}

/// A row's definition, whether every set has it or some leave it out.
trait Row {
    fn defined(self) -> Option<KernelDef>;
}

impl Row for KernelDef {
    fn defined(self) -> Option<KernelDef> {
        Some(self)
    }
}

impl Row for Option<KernelDef> {
    fn defined(self) -> Option<KernelDef> {
        self
    }
}

/// One kernel of a set: loaded, or absent where the set leaves it out or
/// the device's backend has no implementation of it.
pub(crate) struct Slot {
    /// The kernel's name, for the error of a dispatch without it (empty
    /// where the set leaves it out).
    pub(crate) name: String,
    pub(crate) kernel: Option<Kernel>,
}

impl Slot {
    /// Loads `def` on `device`; a backend without an implementation leaves
    /// the slot empty, any other failure (a compile error) is returned.
    pub(crate) fn load(device: &Device, def: Option<KernelDef>) -> Result<Slot> {
        let Some(def) = def else {
            return Ok(Slot {
                name: String::new(),
                kernel: None,
            });
        };
        let kernel = match device.load_kernel(&def) {
            Ok(kernel) => Some(kernel),
            Err(Error::Unsupported { .. }) => None,
            Err(e) => return Err(e),
        };
        Ok(Slot {
            name: def.name().to_string(),
            kernel,
        })
    }

    /// The kernel, or [`Error::Unsupported`] on `device`.
    pub(crate) fn get(&self, device: &Device) -> Result<&Kernel> {
        self.kernel.as_ref().ok_or_else(|| Error::Unsupported {
            op: self.name.clone(),
            backend: device.kind(),
        })
    }

    /// The kernel where it is loaded and its implementation launches a
    /// dispatch whose value is `value`: a kernel may refuse at launch what
    /// it has no code for (a head size, say), and the caller then takes
    /// another kernel.
    pub(crate) fn launching(&self, value: &[u8]) -> Option<&Kernel> {
        let kernel = self.kernel.as_ref()?;
        let def = kernel.def();
        let launches = match def.implementation_for(kernel.key().backend) {
            Some(Implementation::Cpu(_)) => true,
            Some(Implementation::Cuda(c)) => c.launch(value).is_ok(),
            Some(Implementation::Wgpu(w) | Implementation::Metal(MetalKernel(w))) => {
                w.launch(value).is_ok()
            }
            // A backend that runs another's implementation (Metal runs the
            // WGSL of the wgpu one).
            None => def.metal_impl().is_some_and(|w| w.launch(value).is_ok()),
        };
        launches.then_some(kernel)
    }
}

/// Loads every kernel of `sets` that `device`'s backend implements, each
/// distinct one once and all at the same time, so that a backend that
/// compiles kernels (NVRTC compiles on one core) fills its kernel cache in
/// the time of the slowest compile instead of the sum of all: a warm-up for
/// processes that open several devices or kernel sets. Returns how many
/// distinct kernels were loaded.
pub fn load_all(device: &Device, sets: &[KernelSet]) -> Result<usize> {
    load_defs(device, sets.iter().flat_map(|s| s.defs().all()).collect())
}

/// [`load_all`] of the definitions `all`.
pub(crate) fn load_defs(device: &Device, all: Vec<KernelDef>) -> Result<usize> {
    let backend = device.kind();
    // Two definitions are one kernel when name, options and code agree.
    let mut seen = std::collections::HashSet::new();
    let defs: Vec<&KernelDef> = all
        .iter()
        .filter(|d| {
            let content = d.content(backend);
            content.is_some() && seen.insert((d.name(), d.options(), content))
        })
        .collect();
    std::thread::scope(|s| {
        let loads: Vec<_> = defs
            .iter()
            .map(|def| s.spawn(move || device.load_kernel(def).map(drop)))
            .collect();
        for load in loads {
            load.join()
                .unwrap_or_else(|p| Err(Error::Graph(panic_message(&p))))?;
        }
        Ok(defs.len())
    })
}

/// The text of a panic payload (a thread that loaded a kernel panicked).
fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    format!("loading a kernel panicked: {text}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every CUDA kernel may be launched early in a graph, so each must wait
    /// for its predecessors before it touches their memory (see
    /// `encore::KernelDef::programmatic`). The runtime refuses a programmatic
    /// kernel whose source never waits; this checks that none of ours opted out.
    #[test]
    fn every_cuda_kernel_is_programmatic_and_waits() {
        let defs = [KernelSet::Default, KernelSet::Exact].map(|s| s.defs().all());
        for def in defs.into_iter().flatten() {
            let Some(cuda) = def.cuda_impl() else {
                panic!("{} has no CUDA source", def.name());
            };
            assert!(def.is_programmatic(), "{} is not programmatic", def.name());
            let own = cuda.own_source();
            assert!(
                cuda.source.starts_with(encore::CUDA_PRELUDE)
                    && own.contains("encore_grid_wait();"),
                "{} never calls encore_grid_wait()",
                def.name()
            );
            assert!(
                !def.is_specializable()
                    || own.contains("encore_fix_value(s);")
                    || own.contains("encore_fix_value(n);"),
                "{} is specializable but never fixes its value",
                def.name()
            );
        }
    }

    /// The exact set differs from the default only where it must, and
    /// leaves out every kernel whose arithmetic the CPU does not share.
    #[test]
    fn the_exact_set_leaves_out_the_kernels_without_cpu_arithmetic() {
        let (default, exact) = (KernelSet::Default.defs(), KernelSet::Exact.defs());
        assert!(default.gemm.is_some() && default.attention_prefill.is_some());
        assert!(default.attention_step.is_some());
        assert!(exact.gemm.is_none() && exact.attention_prefill.is_none());
        assert!(exact.attention_step.is_none());
        assert!(exact.to_f16_rows.is_none() && exact.dequant_f16.is_none());
        assert!(exact.gemm_f16.is_none() && exact.matmul_wide_rows.is_none());
        assert!(exact.sum_splits.is_none());
        assert_eq!(exact.attention.op_kind(), "attention");
        assert_ne!(exact.attention.name(), default.attention.name());
    }

    /// Tensor-core variants have no CPU body: on the CPU they are
    /// unsupported, and `Ops` falls back to the general kernel.
    /// `attention_step` also runs on the CPU (the unfused ops' code) and on
    /// wgpu; `attention_prefill` also on wgpu.
    #[test]
    fn variants_without_a_cpu_body_are_cuda_only() {
        let defs = KernelSet::Default.defs();
        let dense = [
            defs.to_f16_rows,
            defs.dequant_f16,
            defs.gemm_f16,
            defs.sum_splits,
            defs.matmul_wide_rows,
        ];
        for def in [defs.gemm, defs.attention_prefill, defs.attention_step]
            .into_iter()
            .chain(dense)
            .flatten()
        {
            let backends: Vec<_> = def.backends().collect();
            let expected = if def.name() == "attention_step" {
                vec![
                    encore::BackendKind::Cpu,
                    encore::BackendKind::Cuda,
                    encore::BackendKind::Wgpu,
                ]
            } else if def.name() == "attention_prefill" {
                vec![encore::BackendKind::Cuda, encore::BackendKind::Wgpu]
            } else {
                vec![encore::BackendKind::Cuda]
            };
            assert_eq!(backends, expected, "{}", def.name());
        }
    }

    /// The warm-up loads each distinct kernel once: the CPU bodies the two
    /// sets share count once, the exact attention and products once more.
    #[test]
    fn load_all_loads_each_distinct_kernel_once() -> Result<()> {
        let device = Device::cpu()?;
        let default = load_all(&device, &[KernelSet::Default])?;
        let both = load_all(&device, &[KernelSet::Default, KernelSet::Exact])?;
        // On the CPU: every kernel but the CUDA-only gemm, prefill and the
        // five of the long prompts' products.
        assert_eq!(default, KernelSet::Default.defs().all().len() - 7);
        // The exact set adds its attention (another name, the CPU's body).
        assert_eq!(both, default + 1);
        Ok(())
    }

    /// A kernel the device's backend does not implement leaves its slot
    /// empty when it is loaded and fails only when it is dispatched, with
    /// the op and the backend named.
    #[test]
    fn an_unimplemented_kernel_is_unsupported_at_dispatch_not_at_load() -> Result<()> {
        let device = Device::cpu()?;
        let slot = Slot::load(&device, KernelSet::Default.defs().gemm)?;
        assert!(slot.kernel.is_none());
        match slot.get(&device) {
            Err(Error::Unsupported { op, backend }) => {
                assert_eq!((op.as_str(), backend), ("gemm", encore::BackendKind::Cpu));
            }
            other => return Err(Error::Graph(format!("expected Unsupported, got {other:?}"))),
        }
        Ok(())
    }

    /// The prefill attention's kernels refuse at launch the head sizes they
    /// have no code for, so `Ops` keeps the general kernel for those.
    #[test]
    fn the_prefill_kernels_refuse_head_sizes_they_have_no_code_for() {
        let Some(def) = KernelSet::Default.defs().attention_prefill else {
            panic!("the default set has a prefill attention");
        };
        let shape = |head_dim: u32| crate::kernels::attention::AttnShape {
            rows: 32,
            heads: 4,
            kv_heads: 2,
            head_dim,
            max_seq: 64,
            scale: 0.125,
            window: 0,
        };
        let launches = |launch: &dyn Fn(&[u8]) -> bool| -> Vec<u32> {
            [8, 16, 32, 64, 80, 128, 256]
                .into_iter()
                .filter(|&d| launch(bytemuck::bytes_of(&shape(d))))
                .collect()
        };
        let cuda = def.cuda_impl().map(|c| launches(&|v| c.launch(v).is_ok()));
        let wgsl = def.wgpu_impl().map(|w| launches(&|v| w.launch(v).is_ok()));
        assert_eq!(cuda, Some(cuda::PREFILL_HEAD_DIMS.to_vec()));
        assert_eq!(wgsl, Some(wgsl::PREFILL_HEAD_DIMS.to_vec()));
    }
}
