//! One file per operation, backend-neutral: its math, its shape (the
//! `#[repr(C)]` value every implementation reads), its argument layout
//! (declared with [`op_args!`](crate::op_args)) and its definition, the
//! table of its implementations: the CPU body in [`crate::cpu::kernels`],
//! the CUDA source in [`crate::cuda`].
//!
//! A kernel that needs the decode position reads it from a 4-byte parameter
//! buffer, so a recorded graph reads the current position on every replay.
//!
//! [`KernelSet`] picks, once, which version of each kernel a device loads.

pub mod advance;
pub mod argmax;
pub mod attention;
pub mod attention_exact;
pub mod attention_step;
pub mod elementwise;
pub mod embed;
pub mod fused;
pub mod gemm;
pub mod matmul;
pub mod norm;
pub mod paged;
pub mod prefill_attention;
pub mod rope;

use crate::dtype::WeightTypes;
use encore::KernelDef;

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

/// The definitions of one [`KernelSet`], one per slot of [`crate::Ops`];
/// `None` where the set leaves a kernel out.
#[derive(Clone)]
pub struct KernelDefs {
    pub rms_norm: KernelDef,
    pub matmul: KernelDef,
    /// The tensor-core product of many rows, where a backend has it.
    pub gemm: Option<KernelDef>,
    pub rope: KernelDef,
    pub rope_store: KernelDef,
    pub kv_store: KernelDef,
    pub attention: KernelDef,
    /// The tiled attention of a prefill batch, where a backend has it.
    pub attention_prefill: Option<KernelDef>,
    /// Decode attention with the step's RoPE and stores folded in (fusion only).
    pub attention_step: Option<KernelDef>,
    pub add: KernelDef,
    pub add_rows: KernelDef,
    pub silu_mul: KernelDef,
    pub gelu_mul: KernelDef,
    pub scale: KernelDef,
    pub embed: KernelDef,
    pub argmax: KernelDef,
    pub advance: KernelDef,
    pub fused_matmul: KernelDef,
    /// The ops of a batch of independent sequences over a paged cache
    /// ([`paged`]).
    pub matmul_rows: KernelDef,
    pub rope_rows: KernelDef,
    pub kv_store_paged: KernelDef,
    pub attention_paged: KernelDef,
    pub argmax_rows: KernelDef,
    pub fused_matmul_rows: KernelDef,
    /// Paged decode attention with the rows' RoPE and stores folded in
    /// (fusion only; not in the exact set, as `attention_step`).
    pub attention_step_paged: Option<KernelDef>,
}

impl KernelSet {
    /// Every definition of this set, for weights of every type.
    pub fn defs(self) -> KernelDefs {
        self.defs_for(WeightTypes::ALL)
    }

    /// Every definition of this set, the products of weights built for the
    /// weight types `types` alone (see [`WeightTypes`]).
    pub fn defs_for(self, types: WeightTypes) -> KernelDefs {
        let exact = self == KernelSet::Exact;
        let narrow = |def: KernelDef| match crate::cuda::types_option(types) {
            Some(option) => def.option(option),
            None => def,
        };
        KernelDefs {
            rms_norm: norm::def(),
            matmul: narrow(matmul::def(exact)),
            gemm: (!exact).then(|| narrow(gemm::def())),
            rope: rope::def(),
            rope_store: rope::rope_store_def(),
            kv_store: attention::kv_store_def(),
            attention: if exact {
                attention_exact::def()
            } else {
                attention::attention_def()
            },
            attention_prefill: (!exact).then(prefill_attention::def),
            attention_step: (!exact).then(attention_step::def),
            add: elementwise::add_def(),
            add_rows: elementwise::add_rows_def(),
            silu_mul: elementwise::silu_mul_def(),
            gelu_mul: elementwise::gelu_mul_def(),
            scale: elementwise::scale_def(),
            embed: embed::def(),
            argmax: argmax::def(),
            advance: advance::def(),
            fused_matmul: narrow(fused::def(exact)),
            matmul_rows: narrow(paged::matmul_rows_def(exact)),
            rope_rows: paged::rope_rows_def(),
            kv_store_paged: paged::kv_store_paged_def(),
            attention_paged: paged::attention_paged_def(),
            argmax_rows: paged::argmax_rows_def(),
            fused_matmul_rows: narrow(fused::rows_def(exact)),
            attention_step_paged: (!exact).then(paged::attention_step_paged_def),
        }
    }
}

/// Loads every kernel of `sets` that `device`'s backend implements, each
/// distinct one once and all at the same time, so that a backend that
/// compiles kernels (NVRTC compiles on one core) fills its kernel cache in
/// the time of the slowest compile instead of the sum of all: a warm-up for
/// processes that open several devices or kernel sets. Returns how many
/// distinct kernels were loaded.
pub fn load_all(device: &encore::Device, sets: &[KernelSet]) -> encore::Result<usize> {
    load_defs(device, sets.iter().flat_map(|s| s.defs().all()).collect())
}

/// [`load_all`] of the definitions `all`.
pub(crate) fn load_defs(device: &encore::Device, all: Vec<KernelDef>) -> encore::Result<usize> {
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
                .unwrap_or_else(|p| Err(encore::Error::Graph(panic_message(&p))))?;
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

impl KernelDefs {
    /// Every definition, in slot order.
    pub fn all(self) -> Vec<KernelDef> {
        let mut all = vec![self.rms_norm, self.matmul];
        all.extend(self.gemm);
        all.extend([self.rope, self.rope_store, self.kv_store, self.attention]);
        all.extend(self.attention_prefill);
        all.extend(self.attention_step);
        all.extend([
            self.add,
            self.add_rows,
            self.silu_mul,
            self.gelu_mul,
            self.scale,
            self.embed,
            self.argmax,
            self.advance,
            self.fused_matmul,
            self.matmul_rows,
            self.rope_rows,
            self.kv_store_paged,
            self.attention_paged,
            self.argmax_rows,
            self.fused_matmul_rows,
        ]);
        all.extend(self.attention_step_paged);
        all
    }
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
        for def in [defs.gemm, defs.attention_prefill, defs.attention_step]
            .into_iter()
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
    fn load_all_loads_each_distinct_kernel_once() -> encore::Result<()> {
        let device = encore::Device::cpu()?;
        let default = load_all(&device, &[KernelSet::Default])?;
        let both = load_all(&device, &[KernelSet::Default, KernelSet::Exact])?;
        // On the CPU: every kernel but the CUDA-only gemm and prefill.
        assert_eq!(default, KernelSet::Default.defs().all().len() - 2);
        // The exact set adds its attention (another name, the CPU's body).
        assert_eq!(both, default + 1);
        Ok(())
    }
}
