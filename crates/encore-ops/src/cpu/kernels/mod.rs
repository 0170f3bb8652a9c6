//! The CPU bodies of the kernels, one file per operation as in
//! [`crate::kernels`]. Each takes its op's argument layout apart with
//! `from_cpu`, checks the sizes it was given, and runs the math of
//! [`crate::cpu`] (or its own, where only one op needs it). Bodies of ops
//! with a decode position read it from the parameter buffer at run time;
//! the same bodies read one position a row for a paged cache, their
//! [`PositionSource`] a parameter (read through a private `Positions`).

use crate::kernels::positions::PositionSource;

pub mod advance;
pub mod argmax;
pub mod attention;
pub mod attention_step;
pub mod elementwise;
pub mod embed;
pub mod fused;
pub mod matmul;
pub mod norm;
pub mod rope;

/// Checks that a slice holds at least `n` elements.
pub(crate) fn need<T>(what: &str, s: &[T], n: usize) -> Result<(), String> {
    if s.len() < n {
        Err(format!("{what}: {} elements, need {n}", s.len()))
    } else {
        Ok(())
    }
}

/// The positions (or cache slots) of a dispatch's rows, read from the
/// argument its [`PositionSource`] names.
#[derive(Clone, Copy)]
pub(crate) enum Positions<'a> {
    /// Row `r` at `start + r`.
    Start(u32),
    /// Row `r` at `rows[r]`.
    Rows(&'a [u32]),
}

impl<'a> Positions<'a> {
    /// Reads `arg` as `source` says, checking that it holds `rows` rows'
    /// positions.
    pub(crate) fn read(
        arg: &crate::args::CpuArg<'_, 'a>,
        source: PositionSource,
        rows: usize,
    ) -> Result<Positions<'a>, String> {
        Ok(match source {
            PositionSource::Start => Positions::Start(arg.param()?),
            PositionSource::Rows => {
                let p = arg.read::<u32>()?;
                need("positions", p, rows)?;
                Positions::Rows(p)
            }
        })
    }

    /// Row `r`'s position.
    #[inline(always)]
    pub(crate) fn at(&self, r: usize) -> u32 {
        match self {
            Positions::Start(start) => start + r as u32,
            Positions::Rows(rows) => rows[r],
        }
    }
}
