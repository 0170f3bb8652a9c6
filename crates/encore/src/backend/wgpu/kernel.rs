//! A kernel's WGSL implementation: source, entry point, optional versions
//! for device features, and launch geometry. Metal runs the same kernels,
//! translated (see [`crate::MetalKernel`]).
//!
//! Compiled on every build, with or without the `wgpu` feature, so that ops
//! describe their WGSL implementations everywhere.

use std::fmt;
use std::sync::Arc;

use crate::record::{typed_geometry, Geometry, Launch};

/// A WGSL implementation, for the wgpu backend: full source, the name of
/// its `@compute` entry point, and how many workgroups a dispatch launches.
///
/// # The binding convention
///
/// - Buffer argument `i` (in the op's argument order) is
///   `@group(0) @binding(i) var<storage, read> name: array<T>` when the
///   dispatch reads it and `var<storage, read_write>` when it writes it,
///   `T` a 4-byte type (`f32`, `u32`, `i32` or an atomic). The runtime binds
///   the allocation from an aligned offset at or before the argument's first
///   byte, so a kernel indexes element `j` of argument `i` as
///   `name[args.off[i] + j]`.
/// - The arguments' offsets and the dispatch's value come in
///   `@group(1) @binding(0) var<storage, read> args: Args`, where `Args`
///   begins with `off: array<u32, 16>` ([`crate::WGSL_MAX_BUFFERS`]: the
///   word offset of each buffer argument's first byte in its binding) and
///   continues with the value's fields (the op's `#[repr(C)]` shape, field
///   by field, all 4-byte scalars or arrays of them).
/// - A buffer argument of length zero is bound to a small placeholder.
///
/// The launch is `grid` workgroups (each at most 65,535); the workgroup size
/// is the shader's own `@workgroup_size`, so [`Launch::block`] is unused.
#[derive(Clone)]
pub struct WgpuKernel {
    pub source: String,
    pub entry: String,
    /// Versions of the kernel that use optional device features, each with
    /// the features it needs, in the order a device tries them
    /// ([`WgpuKernel::with_version`]).
    pub versions: Vec<(WgslFeatures, String)>,
    /// The versions' features and sources as one text, for the kernel's key.
    versions_key: String,
    /// Whether the shader is compiled without naga's loop bounding
    /// ([`WgpuKernel::with_finite_loops`]).
    finite_loops: bool,
    geometry: Geometry,
}

/// Optional device features a WGSL kernel's version may use, and those a
/// device offers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WgslFeatures {
    /// Subgroup operations (wgpu's `SUBGROUP`).
    pub subgroups: bool,
    /// f16 arithmetic and storage (`enable f16;`, wgpu's `SHADER_F16`).
    pub f16: bool,
}

impl WgslFeatures {
    /// Whether a device offering `self` runs a version that needs `needs`.
    pub fn covers(self, needs: WgslFeatures) -> bool {
        (self.subgroups || !needs.subgroups) && (self.f16 || !needs.f16)
    }
}

impl WgpuKernel {
    /// `source` with entry point `entry`, launched as `geometry` computes
    /// from the dispatch's value (one `Pod` of type `T`), or refused with
    /// the reason it gives (a weight type it has no code for, say).
    pub fn checked<T: bytemuck::Pod>(
        source: impl Into<String>,
        entry: impl Into<String>,
        geometry: impl Fn(&T) -> std::result::Result<Launch, String> + Send + Sync + 'static,
    ) -> WgpuKernel {
        WgpuKernel {
            source: source.into(),
            entry: entry.into(),
            versions: Vec::new(),
            versions_key: String::new(),
            finite_loops: false,
            geometry: typed_geometry(geometry),
        }
    }

    /// Adds a version of the kernel that uses the optional features
    /// `needs` (with the same entry point, bindings and launch), which the
    /// wgpu backend compiles instead of `source` where the device offers
    /// them (and [`crate::Config`] lets it use them): the first added
    /// whose features the device covers. Metal translates `source`.
    pub fn with_version(mut self, needs: WgslFeatures, source: impl Into<String>) -> WgpuKernel {
        let source = source.into();
        self.versions_key += &format!("{needs:?}\n{source}\n");
        self.versions.push((needs, source));
        self
    }

    /// Compiles the kernel without the loop bounding naga otherwise adds
    /// to every loop (an extra counter that ends it after 2^64 iterations,
    /// which keeps the driver's compiler from seeing the trip count of a
    /// loop it could unroll). Part of the kernel's key.
    ///
    /// # Safety
    ///
    /// Every loop of the source and of every version must end for every
    /// value and buffer contents a dispatch can bind: a driver may treat an
    /// infinite loop as unreachable and compile the shader into one that
    /// reads or writes out of bounds.
    pub unsafe fn with_finite_loops(mut self) -> WgpuKernel {
        self.finite_loops = true;
        self.versions_key += "finite loops\n";
        self
    }

    /// Whether [`WgpuKernel::with_finite_loops`] was declared.
    pub fn has_finite_loops(&self) -> bool {
        self.finite_loops
    }

    /// The source a device offering `features` compiles: the first version
    /// it covers, else `source`.
    pub fn source_for(&self, features: WgslFeatures) -> &str {
        self.versions
            .iter()
            .find(|(needs, _)| features.covers(*needs))
            .map_or(&self.source, |(_, source)| source)
    }

    /// Like [`WgpuKernel::checked`], for a kernel that launches every value.
    pub fn new<T: bytemuck::Pod>(
        source: impl Into<String>,
        entry: impl Into<String>,
        geometry: impl Fn(&T) -> Launch + Send + Sync + 'static,
    ) -> WgpuKernel {
        WgpuKernel::checked(source, entry, move |v: &T| Ok(geometry(v)))
    }

    /// Like [`WgpuKernel::new`], always launched as `launch`.
    pub fn fixed(
        source: impl Into<String>,
        entry: impl Into<String>,
        launch: Launch,
    ) -> WgpuKernel {
        WgpuKernel {
            source: source.into(),
            entry: entry.into(),
            versions: Vec::new(),
            versions_key: String::new(),
            finite_loops: false,
            geometry: Arc::new(move |_: &[u8]| Ok(launch)),
        }
    }

    /// The launch of a dispatch whose inline bytes are `value`.
    pub fn launch(&self, value: &[u8]) -> std::result::Result<Launch, String> {
        (self.geometry)(value)
    }

    /// The versions' features and sources (and the loop bounding) as one
    /// text, which the kernel's key hashes beside the source.
    pub(crate) fn versions_key(&self) -> &str {
        &self.versions_key
    }
}

impl fmt::Debug for WgpuKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuKernel")
            .field("entry", &self.entry)
            .field("source_bytes", &self.source.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::BackendKind;
    use crate::KernelDef;

    #[test]
    fn a_wgsl_kernel_compiles_the_first_version_the_device_covers() {
        let features = |subgroups, f16| WgslFeatures { subgroups, f16 };
        let plain = || WgpuKernel::fixed("plain", "k", Launch::new(1, 1));
        let kernel = plain()
            .with_version(features(true, true), "both")
            .with_version(features(true, false), "subgroups")
            .with_version(features(false, true), "f16");
        assert_eq!(kernel.source_for(features(true, true)), "both");
        assert_eq!(kernel.source_for(features(true, false)), "subgroups");
        assert_eq!(kernel.source_for(features(false, true)), "f16");
        assert_eq!(kernel.source_for(WgslFeatures::default()), "plain");
        // A version with nothing to offer the device is never picked.
        let only_f16 = plain().with_version(features(false, true), "f16");
        assert_eq!(only_f16.source_for(features(true, false)), "plain");
        // The versions are part of the kernel's content, so of its key.
        let content = |k: WgpuKernel| {
            KernelDef::new("k")
                .wgpu(k)
                .content(BackendKind::Wgpu)
                .map(|c| c.map(String::from))
        };
        assert_ne!(content(kernel.clone()), content(plain()));
        assert_ne!(content(kernel), content(only_f16));
    }
}
