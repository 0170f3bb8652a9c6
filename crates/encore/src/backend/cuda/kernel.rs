//! A kernel's CUDA implementation: CUDA C for NVRTC, after the runtime's
//! prelude, with its entry point and launch geometry.
//!
//! Compiled on every build, with or without the `cuda` feature, so that ops
//! describe their CUDA implementations everywhere; only compiling and
//! launching them needs the backend.

use std::fmt;
use std::sync::Arc;

use crate::record::{typed_geometry, Geometry, Launch};

/// CUDA C the runtime puts before every kernel's source (the file
/// `backend/cuda/prelude.cuh`, which documents each helper).
///
/// `encore_grid_wait()` waits until every dispatch this one depends on has
/// finished and its writes are visible, then lets the dependents start (see
/// [`crate::KernelDef::programmatic`]); `encore_prefetch_l2(p)` asks for a
/// line in L2; `encore_smem_addr(p)` is a shared variable's 32-bit address;
/// `encore_fix_value(v)` turns a value argument into constants in a
/// specialized variant (see [`crate::KernelDef::specializable`]).
pub const CUDA_PRELUDE: &str = include_str!("prelude.cuh");

/// A CUDA implementation: full source (the runtime's [`CUDA_PRELUDE`]
/// first), the name of its `extern "C"` entry point, and how a dispatch of
/// it is launched.
#[derive(Clone)]
pub struct CudaKernel {
    pub source: String,
    pub entry: String,
    geometry: Geometry,
}

impl CudaKernel {
    /// `source` (the prelude is put before it, so it is part of the
    /// content address) with entry point `entry`, launched as `geometry`
    /// computes from the dispatch's value: a function of one `Pod` value
    /// argument of type `T`.
    pub fn new<T: bytemuck::Pod>(
        source: impl Into<String>,
        entry: impl Into<String>,
        geometry: impl Fn(&T) -> Launch + Send + Sync + 'static,
    ) -> CudaKernel {
        CudaKernel::checked(source, entry, move |v: &T| Ok(geometry(v)))
    }

    /// Like [`CudaKernel::new`], for a kernel that cannot launch every
    /// value: `geometry` says why it refuses one (a weight type it has no
    /// code for, say), and the dispatch fails with
    /// [`crate::Error::InvalidDispatch`] carrying that reason instead of
    /// running.
    pub fn checked<T: bytemuck::Pod>(
        source: impl Into<String>,
        entry: impl Into<String>,
        geometry: impl Fn(&T) -> std::result::Result<Launch, String> + Send + Sync + 'static,
    ) -> CudaKernel {
        CudaKernel {
            source: format!("{CUDA_PRELUDE}{}", source.into()),
            entry: entry.into(),
            geometry: typed_geometry(geometry),
        }
    }

    /// Like [`CudaKernel::new`], always launched as `launch`.
    pub fn fixed(
        source: impl Into<String>,
        entry: impl Into<String>,
        launch: Launch,
    ) -> CudaKernel {
        CudaKernel {
            source: format!("{CUDA_PRELUDE}{}", source.into()),
            entry: entry.into(),
            geometry: Arc::new(move |_: &[u8]| Ok(launch)),
        }
    }

    /// The launch geometry of a dispatch whose inline bytes are `value`.
    pub fn launch(&self, value: &[u8]) -> std::result::Result<Launch, String> {
        (self.geometry)(value)
    }

    /// The source without the runtime's prelude.
    pub fn own_source(&self) -> &str {
        self.source
            .strip_prefix(CUDA_PRELUDE)
            .unwrap_or(&self.source)
    }

    /// Whether `other` launches with the same geometry function (geometry
    /// is code, not content, so it is compared by identity).
    pub(crate) fn same_geometry(&self, other: &CudaKernel) -> bool {
        Arc::ptr_eq(&self.geometry, &other.geometry)
    }
}

impl fmt::Debug for CudaKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaKernel")
            .field("entry", &self.entry)
            .field("source_bytes", &self.source.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_comes_from_the_value() {
        let k = CudaKernel::new("", "k", |n: &u32| Launch::cover(*n, 128));
        assert_eq!(k.launch(&1000u32.to_le_bytes()), Ok(Launch::new(8, 128)));
        assert!(k.launch(&[1, 2]).is_err());
        let even = CudaKernel::checked("", "k", |n: &u32| match n % 2 {
            0 => Ok(Launch::new(1, 32)),
            _ => Err(format!("{n} is odd")),
        });
        assert_eq!(even.launch(&2u32.to_le_bytes()), Ok(Launch::new(1, 32)));
        assert_eq!(even.launch(&3u32.to_le_bytes()), Err("3 is odd".into()));
    }
}
