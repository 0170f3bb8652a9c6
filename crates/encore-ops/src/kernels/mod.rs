//! One file per operation: its argument layout, its math, and its
//! implementation for each backend side by side.
//!
//! Every kernel takes its shape as one `#[repr(C)]` value argument (the same
//! struct the CUDA source declares) and its decode position, when it needs
//! one, from a 4-byte parameter buffer, so a recorded graph reads the current
//! position on every replay.

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
pub mod prefill_attention;
pub mod rope;

/// Every kernel definition of this crate that [`crate::Ops::new`] loads,
/// in the default version or the exact one ([`encore::Config::exact`]).
pub fn all(exact: bool) -> Vec<encore::KernelDef> {
    vec![
        norm::def(),
        matmul::def(exact),
        gemm::def(),
        rope::def(),
        rope::rope_store_def(),
        attention::kv_store_def(),
        if exact {
            attention_exact::def()
        } else {
            attention::attention_def()
        },
        attention_step::def(),
        prefill_attention::def(),
        elementwise::add_def(),
        elementwise::add_rows_def(),
        elementwise::silu_mul_def(),
        embed::def(),
        argmax::def(),
        advance::def(),
        fused::def(exact),
    ]
}

/// Reads a one-element `u32` buffer argument (a graph parameter slot).
pub(crate) fn param(a: &encore::CpuArgs<'_>, i: usize) -> Result<u32, String> {
    a.read::<u32>(i)?
        .first()
        .copied()
        .ok_or_else(|| format!("argument {i}: empty parameter slot"))
}

/// Checks that a slice holds at least `n` elements.
pub(crate) fn need<T>(what: &str, s: &[T], n: usize) -> Result<(), String> {
    if s.len() < n {
        Err(format!("{what}: {} elements, need {n}", s.len()))
    } else {
        Ok(())
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
        let defs = [all(false), all(true)].concat();
        for def in defs {
            let Some(cuda) = def.cuda_impl() else {
                panic!("{} has no CUDA source", def.name());
            };
            assert!(def.is_programmatic(), "{} is not programmatic", def.name());
            let own = &cuda.source[encore::CUDA_PRELUDE.len()..];
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
}
