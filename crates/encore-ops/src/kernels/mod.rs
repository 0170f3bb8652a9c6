//! One file per operation: its argument layout, its math, and its
//! implementation for each backend side by side.
//!
//! Every kernel takes its shape as one `#[repr(C)]` value argument (the same
//! struct the CUDA source declares) and its decode position, when it needs
//! one, from a 4-byte parameter buffer, so a recorded graph reads the current
//! position on every replay.

pub mod argmax;
pub mod attention;
pub mod elementwise;
pub mod embed;
pub mod fused;
pub mod matmul;
pub mod norm;
pub mod rope;

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
