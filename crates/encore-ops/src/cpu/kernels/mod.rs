//! The CPU bodies of the kernels, one file per operation as in
//! [`crate::kernels`]. Each takes its op's argument layout apart with
//! `from_cpu`, checks the sizes it was given, and runs the math of
//! [`crate::cpu`] (or its own, where only one op needs it). Bodies of ops
//! with a decode position read it from the parameter buffer at run time.

pub mod advance;
pub mod argmax;
pub mod attention;
pub mod attention_step;
pub mod elementwise;
pub mod embed;
pub mod fused;
pub mod matmul;
pub mod norm;
pub mod paged;
pub mod rope;

/// Checks that a slice holds at least `n` elements.
pub(crate) fn need<T>(what: &str, s: &[T], n: usize) -> Result<(), String> {
    if s.len() < n {
        Err(format!("{what}: {} elements, need {n}", s.len()))
    } else {
        Ok(())
    }
}
