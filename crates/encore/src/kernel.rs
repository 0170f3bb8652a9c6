//! Kernels and the content-addressed kernel cache.
//!
//! A [`KernelDef`] names a program and holds a table of implementations, one
//! per backend: a Rust function for the CPU (identified by a definition
//! string that changes whenever its behaviour does), CUDA C source for NVRTC
//! with the function that computes its launch geometry, WGSL for wgpu. Metal
//! runs WGSL too, translated to Metal Shading Language by naga: a kernel's
//! Metal implementation is its own ([`KernelDef::metal`]) or else its wgpu
//! one. A backend missing
//! from the table makes loading the kernel there fail with
//! [`crate::Error::Unsupported`]. Loading one
//! yields a [`Kernel`], cached under a [`KernelKey`]: name, a hash of the
//! backend's full specialized source, backend, architecture, toolchain and
//! options. Two kernels that share a name but differ in source get different
//! keys and coexist (invariant 3). A loaded kernel is reference-counted and
//! retained by every submission and graph that binds it, so evicting it from
//! the cache never frees code that in-flight work still runs.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::cpu_args::CpuArgs;
use crate::error::Result;
use crate::record::{BackendKind, Launch};

/// A CPU kernel body. It receives its arguments and returns an error
/// message on failure.
pub type CpuFn = Arc<dyn Fn(&CpuArgs<'_>) -> std::result::Result<(), String> + Send + Sync>;

/// Computes a dispatch's launch geometry from its inline bytes (its value
/// arguments, concatenated in order), or says why it cannot.
pub type Geometry = Arc<dyn Fn(&[u8]) -> std::result::Result<Launch, String> + Send + Sync>;

/// CUDA C the runtime puts before every kernel's source (the file
/// `backend/cuda/prelude.cuh`, which documents each helper).
///
/// `encore_grid_wait()` waits until every dispatch this one depends on has
/// finished and its writes are visible, then lets the dependents start (see
/// [`KernelDef::programmatic`]); `encore_prefetch_l2(p)` asks for a line in
/// L2; `encore_smem_addr(p)` is a shared variable's 32-bit address;
/// `encore_fix_value(v)` turns a value argument into constants in a
/// specialized variant (see [`KernelDef::specializable`]).
pub const CUDA_PRELUDE: &str = include_str!("backend/cuda/prelude.cuh");

/// The compile option that makes a specialized variant (see [`KernelDef::specialized`]).
const VALUE_WORDS_OPTION: &str = "--define-macro=ENCORE_VALUE_WORDS=";

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
}

impl fmt::Debug for CudaKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaKernel")
            .field("entry", &self.entry)
            .field("source_bytes", &self.source.len())
            .finish()
    }
}

/// The size of the word-offset table at the head of a WGSL kernel's
/// argument block: at most this many buffer arguments per dispatch.
pub const WGSL_MAX_BUFFERS: usize = 16;

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
///   begins with `off: array<u32, 16>` ([`WGSL_MAX_BUFFERS`]: the word offset
///   of each buffer argument's first byte in its binding) and continues with
///   the value's fields (the op's `#[repr(C)]` shape, field by field, all
///   4-byte scalars or arrays of them).
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
}

impl fmt::Debug for WgpuKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuKernel")
            .field("entry", &self.entry)
            .field("source_bytes", &self.source.len())
            .finish()
    }
}

/// A Metal implementation: WGSL that follows the binding convention of
/// [`WgpuKernel`], which the Metal backend translates to Metal Shading
/// Language with naga when it compiles the kernel (the mapping of bindings
/// to Metal buffer indices is documented in `backend/metal/msl.rs`). A
/// kernel without one runs its wgpu implementation on Metal; an op gives
/// Metal its own WGSL only where Apple GPUs want other code.
#[derive(Clone, Debug)]
pub struct MetalKernel(pub WgpuKernel);

/// A geometry function over raw value bytes from one over a typed value.
fn typed_geometry<T: bytemuck::Pod>(
    geometry: impl Fn(&T) -> std::result::Result<Launch, String> + Send + Sync + 'static,
) -> Geometry {
    Arc::new(move |value: &[u8]| {
        let v: T = bytemuck::try_pod_read_unaligned(value).map_err(|_| {
            format!(
                "launch geometry needs a value of {} bytes, got {}",
                std::mem::size_of::<T>(),
                value.len()
            )
        })?;
        geometry(&v)
    })
}

/// A CPU implementation: a definition string (hashed into the kernel's key)
/// and the body.
#[derive(Clone)]
pub struct CpuKernel {
    pub definition: String,
    pub body: CpuFn,
}

/// One backend's implementation of a kernel.
#[derive(Clone)]
pub enum Implementation {
    Cpu(CpuKernel),
    Cuda(CudaKernel),
    Wgpu(WgpuKernel),
    Metal(MetalKernel),
}

impl Implementation {
    /// The backend this implementation runs on.
    pub fn backend(&self) -> BackendKind {
        match self {
            Implementation::Cpu(_) => BackendKind::Cpu,
            Implementation::Cuda(_) => BackendKind::Cuda,
            Implementation::Wgpu(_) => BackendKind::Wgpu,
            Implementation::Metal(_) => BackendKind::Metal,
        }
    }

    /// The text that defines it, hashed into the kernel's key: the CPU
    /// body's definition string, or the full source and entry point (and
    /// a WGSL kernel's subgroup version).
    fn content(&self) -> [&str; 3] {
        match self {
            Implementation::Cpu(c) => [&c.definition, "", ""],
            Implementation::Cuda(c) => [&c.source, &c.entry, ""],
            Implementation::Wgpu(w) | Implementation::Metal(MetalKernel(w)) => {
                [&w.source, &w.entry, &w.versions_key]
            }
        }
    }
}

/// A kernel's definition: its name, the operation it performs (used by graph
/// fusion patterns) and a table of implementations, one per backend.
#[derive(Clone)]
pub struct KernelDef {
    name: String,
    op: String,
    implementations: BTreeMap<BackendKind, Implementation>,
    options: Vec<String>,
    programmatic: bool,
    specializable: bool,
    /// Value words a specialized variant leaves out (compiled as 0).
    unspecialized_words: Vec<usize>,
    /// Compile options a specialized variant derives from its value.
    variant_options: Option<VariantOptions>,
    /// The options this variant derived from its value (none unspecialized).
    derived_options: Vec<String>,
    /// Builds the WGSL kernel of a variant for one value.
    wgpu_variant: Option<WgpuVariant>,
}

/// Compile options a specialized variant adds for its value argument (see
/// [`KernelDef::variant_options`]).
pub type VariantOptions = fn(value: &[u8]) -> Vec<String>;

/// The WGSL kernel of a variant specialized for a value argument, or `None`
/// where the value gets no variant (see [`KernelDef::wgpu_variants`]).
pub type WgpuVariant = fn(value: &[u8]) -> Option<WgpuKernel>;

impl fmt::Debug for KernelDef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelDef")
            .field("name", &self.name)
            .field("op", &self.op)
            .field("backends", &self.implementations.keys().collect::<Vec<_>>())
            .field("options", &self.options)
            .field("programmatic", &self.programmatic)
            .field("specializable", &self.specializable)
            .finish()
    }
}

impl KernelDef {
    /// A definition with no implementations yet; its op kind defaults to the name.
    pub fn new(name: impl Into<String>) -> KernelDef {
        let name = name.into();
        KernelDef {
            op: name.clone(),
            name,
            implementations: BTreeMap::new(),
            options: Vec::new(),
            programmatic: false,
            specializable: false,
            unspecialized_words: Vec::new(),
            variant_options: None,
            derived_options: Vec::new(),
            wgpu_variant: None,
        }
    }

    /// Sets the op kind graph passes match on (`rms_norm`, `mul`, ...).
    pub fn op(mut self, op: impl Into<String>) -> KernelDef {
        self.op = op.into();
        self
    }

    /// Adds (or replaces) the implementation for its backend.
    pub fn implementation(mut self, implementation: Implementation) -> KernelDef {
        self.implementations
            .insert(implementation.backend(), implementation);
        self
    }

    /// Adds the CPU implementation. `definition` identifies the function's
    /// behaviour, including any specialization it captures; it is hashed into
    /// the cache key, so two bodies under one name must have different ones.
    pub fn cpu(
        self,
        definition: impl Into<String>,
        body: impl Fn(&CpuArgs<'_>) -> std::result::Result<(), String> + Send + Sync + 'static,
    ) -> KernelDef {
        self.implementation(Implementation::Cpu(CpuKernel {
            definition: definition.into(),
            body: Arc::new(body),
        }))
    }

    /// Adds the CUDA implementation.
    pub fn cuda(self, kernel: CudaKernel) -> KernelDef {
        self.implementation(Implementation::Cuda(kernel))
    }

    /// Adds the WGSL implementation (see [`WgpuKernel`] for its bindings).
    pub fn wgpu(self, kernel: WgpuKernel) -> KernelDef {
        self.implementation(Implementation::Wgpu(kernel))
    }

    /// Adds a Metal implementation of its own: WGSL for Apple GPUs, used
    /// there instead of the wgpu implementation (see [`MetalKernel`]).
    pub fn metal(self, kernel: WgpuKernel) -> KernelDef {
        self.implementation(Implementation::Metal(MetalKernel(kernel)))
    }

    /// Declares that the CUDA kernel may be launched before the dispatches it
    /// depends on have finished (programmatic dependent launch, sm_90 and
    /// later), because every thread calls `encore_grid_wait()` (from
    /// [`CUDA_PRELUDE`]) before it first touches memory another dispatch
    /// writes, and on every path before it returns. Before that call a
    /// kernel may only compute from its arguments and prefetch (read-only
    /// weights, say). Graphs then give the kernel programmatic edges: its
    /// blocks start while the previous kernel finishes, which hides launch
    /// latency. A kernel marked so whose source never calls
    /// `encore_grid_wait()` fails to compile with [`crate::Error::Compile`].
    pub fn programmatic(mut self) -> KernelDef {
        self.programmatic = true;
        self
    }

    /// Whether [`KernelDef::programmatic`] was declared.
    pub fn is_programmatic(&self) -> bool {
        self.programmatic
    }

    /// Declares that the CUDA kernel takes exactly one value argument and
    /// passes it to `encore_fix_value()` (from [`CUDA_PRELUDE`]) before
    /// using it. Graph instantiation then replaces each such dispatch's
    /// kernel by [`KernelDef::specialized`] for its value (unless
    /// [`crate::Config::specialize`] is off): a variant with the shape
    /// compiled in, cached by content like any other kernel.
    pub fn specializable(mut self) -> KernelDef {
        self.specializable = true;
        self
    }

    /// [`KernelDef::specializable`], with the value's 32-bit words at
    /// `words` compiled as 0 in every variant, so that values that differ
    /// only there share one variant. The kernel must not read those fields
    /// after `encore_fix_value()`: a kernel over independent rows, with
    /// the row from the grid, does not need the row count (one compilation
    /// serves every batch size).
    pub fn specializable_except(mut self, words: &[usize]) -> KernelDef {
        self.specializable = true;
        self.unspecialized_words = words.to_vec();
        self
    }

    /// Gives every specialized variant the compile options `options`
    /// derives from its value, beside the value's words: what the shape
    /// lets the variant leave out that the compiler would not find on its
    /// own soon enough (the code of weight types the shape does not use,
    /// which it would optimize before folding the dispatch on the type).
    /// The options are part of the variant's key like any other.
    pub fn variant_options(mut self, options: VariantOptions) -> KernelDef {
        self.variant_options = Some(options);
        self
    }

    /// Gives the WGSL implementation variants specialized for a value:
    /// `variant` builds the kernel of one (its value's fields as WGSL
    /// constants, say), which graph instantiation on wgpu puts in place of
    /// the implementation ([`KernelDef::specialized_for`]). Independent of
    /// [`KernelDef::specializable`], which concerns the CUDA source.
    pub fn wgpu_variants(mut self, variant: WgpuVariant) -> KernelDef {
        self.wgpu_variant = Some(variant);
        self
    }

    /// Whether [`KernelDef::specializable`] was declared.
    pub fn is_specializable(&self) -> bool {
        self.specializable
    }

    /// The variant of a specializable kernel compiled for the value argument
    /// `value`: the same definition with `ENCORE_VALUE_WORDS` defined as the
    /// value's 32-bit words (a compile option, so part of the key). `None`
    /// when the kernel is not specializable, has no CUDA source, or the value
    /// is empty or not a whole number of words.
    pub fn specialized(&self, value: &[u8]) -> Option<KernelDef> {
        if !self.specializable
            || self.cuda_impl().is_none()
            || value.is_empty()
            || !value.len().is_multiple_of(4)
        {
            return None;
        }
        let words: Vec<String> = value
            .chunks_exact(4)
            .enumerate()
            .map(|(i, w)| match self.unspecialized_words.contains(&i) {
                true => "0x0u".to_string(),
                false => format!("{:#x}u", u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
            })
            .collect();
        // Specializing a variant again replaces its value and what it derived.
        let mut def = self.clone();
        def.options
            .retain(|o| !o.starts_with(VALUE_WORDS_OPTION) && !self.derived_options.contains(o));
        def.derived_options = self.variant_options.map(|f| f(value)).unwrap_or_default();
        def.options.extend(def.derived_options.iter().cloned());
        Some(def.option(format!("{VALUE_WORDS_OPTION}{{{}}}", words.join(","))))
    }

    /// The variant for the value argument `value` on `backend`: on CUDA
    /// [`KernelDef::specialized`], on wgpu the definition with the WGSL
    /// kernel its [`KernelDef::wgpu_variants`] builds for the value. `None`
    /// where the kernel has no variants on `backend` or none for `value`.
    pub fn specialized_for(&self, backend: BackendKind, value: &[u8]) -> Option<KernelDef> {
        match backend {
            BackendKind::Cuda => self.specialized(value),
            BackendKind::Wgpu => {
                let kernel = (self.wgpu_variant?)(value)?;
                Some(self.clone().wgpu(kernel))
            }
            BackendKind::Cpu | BackendKind::Metal => None,
        }
    }

    /// Adds a compile option (such as `--use_fast_math`), part of the key.
    pub fn option(mut self, option: impl Into<String>) -> KernelDef {
        self.options.push(option.into());
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn op_kind(&self) -> &str {
        &self.op
    }

    /// The implementation for `backend`, if the table has one.
    pub fn implementation_for(&self, backend: BackendKind) -> Option<&Implementation> {
        self.implementations.get(&backend)
    }

    /// The backends this kernel has implementations of its own for. Metal
    /// also runs the wgpu implementation ([`KernelDef::metal_impl`]) and is
    /// listed only when it has one of its own.
    pub fn backends(&self) -> impl Iterator<Item = BackendKind> + '_ {
        self.implementations.keys().copied()
    }

    pub fn cpu_impl(&self) -> Option<&CpuFn> {
        match self.implementation_for(BackendKind::Cpu)? {
            Implementation::Cpu(c) => Some(&c.body),
            _ => None,
        }
    }

    pub fn wgpu_impl(&self) -> Option<&WgpuKernel> {
        match self.implementation_for(BackendKind::Wgpu)? {
            Implementation::Wgpu(w) => Some(w),
            _ => None,
        }
    }

    /// The WGSL the Metal backend translates: the kernel's own Metal
    /// implementation, else its wgpu one.
    pub fn metal_impl(&self) -> Option<&WgpuKernel> {
        match self.implementation_for(BackendKind::Metal) {
            Some(Implementation::Metal(MetalKernel(w))) => Some(w),
            _ => self.wgpu_impl(),
        }
    }

    /// The text that defines the implementation `backend` runs, the part
    /// of the kernel's key that comes from its code: the CPU body's
    /// definition string, or the full source and entry point. On Metal
    /// it is the WGSL Metal translates ([`KernelDef::metal_impl`]). `None`
    /// when the kernel does not run on `backend`.
    pub fn content(&self, backend: BackendKind) -> Option<[&str; 3]> {
        match (self.implementation_for(backend), backend) {
            (Some(i), _) => Some(i.content()),
            (None, BackendKind::Metal) => self.metal_impl().map(|w| [&*w.source, &*w.entry, ""]),
            (None, _) => None,
        }
    }

    pub fn cuda_impl(&self) -> Option<&CudaKernel> {
        match self.implementation_for(BackendKind::Cuda)? {
            Implementation::Cuda(c) => Some(c),
            _ => None,
        }
    }

    pub fn options(&self) -> &[String] {
        &self.options
    }

    /// Whether `other` launches its CUDA implementation with the same
    /// geometry function (geometry is code, not content, so it is compared
    /// by identity; it is not part of the key).
    fn same_geometry(&self, other: &KernelDef) -> bool {
        match (self.cuda_impl(), other.cuda_impl()) {
            (Some(a), Some(b)) => Arc::ptr_eq(&a.geometry, &b.geometry),
            (None, None) => true,
            _ => false,
        }
    }
}

/// The content address of a compiled kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    pub name: String,
    /// FNV-1a 64 of the backend's full source (or CPU definition) and entry point.
    pub source_hash: u64,
    pub backend: BackendKind,
    pub arch: String,
    pub toolchain: String,
    pub options: Vec<String>,
}

impl KernelKey {
    /// A file-name-safe digest of the whole key, for the on-disk cache.
    pub fn digest(&self) -> String {
        let mut h = Fnv::new();
        h.write(self.name.as_bytes());
        h.write(&self.source_hash.to_le_bytes());
        h.write(self.backend.name().as_bytes());
        h.write(self.arch.as_bytes());
        h.write(self.toolchain.as_bytes());
        for o in &self.options {
            h.write(o.as_bytes());
            h.write(&[0]);
        }
        format!("{}-{:016x}", sanitize(&self.name), h.finish())
    }
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect()
}

/// 64-bit FNV-1a: stable across runs and platforms (unlike `DefaultHasher`),
/// which the on-disk cache needs.
pub(crate) struct Fnv(u64);

impl Fnv {
    pub(crate) fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) struct CompiledKernel {
    pub(crate) key: KernelKey,
    pub(crate) def: KernelDef,
    pub(crate) artifact: Arc<dyn Any + Send + Sync>,
}

/// A kernel loaded on a device: cheap to clone, retained by the work that binds it.
#[derive(Clone)]
pub struct Kernel(pub(crate) Arc<CompiledKernel>);

impl Kernel {
    pub fn name(&self) -> &str {
        &self.0.key.name
    }
    pub fn op_kind(&self) -> &str {
        &self.0.def.op
    }
    pub fn key(&self) -> &KernelKey {
        &self.0.key
    }
    pub fn def(&self) -> &KernelDef {
        &self.0.def
    }
    pub(crate) fn artifact(&self) -> &Arc<dyn Any + Send + Sync> {
        &self.0.artifact
    }
    /// Whether two handles refer to the same compiled kernel.
    pub fn same(&self, other: &Kernel) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
    /// A weak reference, to observe when the compiled kernel is released.
    pub fn downgrade(&self) -> WeakKernel {
        WeakKernel(Arc::downgrade(&self.0))
    }
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Kernel({} {:016x})",
            self.0.key.name, self.0.key.source_hash
        )
    }
}

/// A reference that does not keep a compiled kernel alive.
pub struct WeakKernel(std::sync::Weak<CompiledKernel>);

impl WeakKernel {
    /// Whether anything (a handle, the cache, a submission, a graph) still holds the kernel.
    pub fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

/// The outcome of a cache lookup, for counters.
pub(crate) enum Loaded {
    Hit(Kernel),
    Compiled(Kernel),
}

/// In-memory kernel cache keyed by content.
#[derive(Default)]
pub(crate) struct KernelCache {
    map: Mutex<HashMap<KernelKey, Kernel>>,
}

impl KernelCache {
    /// The key of `def` on a backend of `kind` with this target and
    /// toolchain; `None` when the kernel has no implementation there.
    pub(crate) fn key_for(
        kind: BackendKind,
        arch: String,
        toolchain: String,
        def: &KernelDef,
    ) -> Option<KernelKey> {
        let mut h = Fnv::new();
        for part in def.content(kind)? {
            h.write(part.as_bytes());
        }
        Some(KernelKey {
            name: def.name.clone(),
            source_hash: h.finish(),
            backend: kind,
            arch,
            toolchain,
            options: def.options.clone(),
        })
    }

    pub(crate) fn load(
        &self,
        key: KernelKey,
        def: &KernelDef,
        compile: impl FnOnce(&KernelDef) -> Result<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Loaded> {
        if let Some(k) = self.map.lock().get(&key) {
            if k.0.def.same_geometry(def) {
                return Ok(Loaded::Hit(k.clone()));
            }
            // The same code launched another way: share the compiled
            // artifact under the caller's definition.
            return Ok(Loaded::Hit(Kernel(Arc::new(CompiledKernel {
                key,
                def: def.clone(),
                artifact: k.0.artifact.clone(),
            }))));
        }
        // Compile outside the lock; a racing thread may compile the same key,
        // in which case the first one inserted wins and both are valid.
        let artifact = compile(def)?;
        let kernel = Kernel(Arc::new(CompiledKernel {
            key: key.clone(),
            def: def.clone(),
            artifact,
        }));
        let mut map = self.map.lock();
        let entry = map.entry(key).or_insert(kernel);
        Ok(Loaded::Compiled(entry.clone()))
    }

    /// Drops cached kernels that nothing else references: no handle, no
    /// in-flight submission, no live graph. Returns how many were dropped.
    pub(crate) fn evict_unused(&self) -> usize {
        let mut map = self.map.lock();
        let before = map.len();
        map.retain(|_, k| Arc::strong_count(&k.0) > 1);
        before - map.len()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def() -> KernelDef {
        KernelDef::new("k")
            .cuda(CudaKernel::fixed(
                "/* a kernel k(n) that calls encore_fix_value(n) */",
                "k",
                Launch::new(1, 1),
            ))
            .specializable()
    }

    #[test]
    fn a_specialized_variant_defines_the_value_words() {
        let value = [1u32, 576, 0x3727_c5ac];
        let v = def().specialized(bytemuck::cast_slice(&value)).unwrap();
        assert_eq!(
            v.options(),
            ["--define-macro=ENCORE_VALUE_WORDS={0x1u,0x240u,0x3727c5acu}"]
        );
        assert_eq!(
            v.cuda_impl().map(|c| &c.source),
            def().cuda_impl().map(|c| &c.source)
        );
        assert!(v.is_specializable() && v.name() == "k");
        // Another value, another variant; the same value, the same one.
        let other = def()
            .specialized(bytemuck::cast_slice(&[1u32, 577, 0]))
            .unwrap();
        assert_ne!(v.options(), other.options());
        assert_eq!(
            def()
                .specialized(bytemuck::cast_slice(&value))
                .unwrap()
                .options(),
            v.options()
        );
    }

    /// A WGSL kernel compiled without loop bounding has another key, and
    /// a definition's wgpu variants replace its WGSL kernel on wgpu alone.
    #[test]
    fn wgsl_loop_bounding_and_variants_change_the_kernel_on_wgpu_only() {
        let wgsl = |source: &str| WgpuKernel::new(source, "e", |_: &u32| Launch::new(1, 1));
        let bounded = KernelDef::new("k").wgpu(wgsl("fn e() {}"));
        // SAFETY: the kernel has no loop.
        let finite = KernelDef::new("k").wgpu(unsafe { wgsl("fn e() {}").with_finite_loops() });
        assert!(finite.wgpu_impl().unwrap().has_finite_loops());
        assert!(!bounded.wgpu_impl().unwrap().has_finite_loops());
        assert_ne!(
            finite.content(BackendKind::Wgpu),
            bounded.content(BackendKind::Wgpu)
        );
        fn variant(value: &[u8]) -> Option<WgpuKernel> {
            let source = format!("const V: u32 = {}u; fn e() {{}}", value.first()?);
            Some(WgpuKernel::new(source, "e", |_: &u32| Launch::new(1, 1)))
        }
        let def = bounded.wgpu_variants(variant);
        let v = def
            .specialized_for(BackendKind::Wgpu, &[7, 0, 0, 0])
            .unwrap();
        assert!(v.wgpu_impl().unwrap().source.contains("V: u32 = 7u"));
        assert!(def.specialized_for(BackendKind::Wgpu, &[]).is_none());
        // Neither CUDA (no CUDA source) nor the CPU get one.
        assert!(def
            .specialized_for(BackendKind::Cuda, &[7, 0, 0, 0])
            .is_none());
        assert!(def
            .specialized_for(BackendKind::Cpu, &[7, 0, 0, 0])
            .is_none());
    }

    #[test]
    fn words_left_out_of_specialization_do_not_make_variants() {
        let rows = def().specializable_except(&[0]);
        let variant = |v: [u32; 3]| rows.specialized(bytemuck::cast_slice(&v)).unwrap();
        let (a, b) = (variant([1, 576, 7]), variant([64, 576, 7]));
        assert_eq!(a.options(), b.options(), "the row count is left out");
        assert_eq!(
            a.options(),
            ["--define-macro=ENCORE_VALUE_WORDS={0x0u,0x240u,0x7u}"]
        );
        assert_ne!(a.options(), variant([1, 577, 7]).options());
    }

    #[test]
    fn a_variant_takes_the_options_its_value_derives_and_only_those() {
        // Options from the value's last word, as a kernel would list the
        // weight types its shape uses.
        let derived = def().variant_options(|v| vec![format!("-DTYPE={}", v[v.len() - 4])]);
        let variant = |d: &KernelDef, v: [u32; 2]| d.specialized(bytemuck::cast_slice(&v)).unwrap();
        let a = variant(&derived, [576, 12]);
        assert_eq!(
            a.options(),
            [
                "-DTYPE=12",
                "--define-macro=ENCORE_VALUE_WORDS={0x240u,0xcu}"
            ]
        );
        // Specializing the variant again derives afresh: nothing of the
        // first value is left.
        let b = variant(&a, [576, 14]);
        assert_eq!(b.options(), variant(&derived, [576, 14]).options());
        assert!(!b.options().iter().any(|o| o.contains("=12")));
    }

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

    #[test]
    fn only_declared_kernels_with_whole_words_specialize() {
        assert!(def().specialized(&[1, 2, 3]).is_none());
        assert!(def().specialized(&[]).is_none());
        let plain = KernelDef::new("k").cuda(CudaKernel::fixed("", "k", Launch::new(1, 1)));
        assert!(plain.specialized(&[0; 4]).is_none());
        let cpu_only = KernelDef::new("k").cpu("k v1", |_| Ok(())).specializable();
        assert!(cpu_only.specialized(&[0; 4]).is_none());
    }

    #[test]
    fn implementations_are_keyed_by_backend() {
        let def = KernelDef::new("k").cpu("k v1", |_| Ok(()));
        assert_eq!(def.backends().collect::<Vec<_>>(), [BackendKind::Cpu]);
        assert!(
            KernelCache::key_for(BackendKind::Cuda, "sm_90".into(), "t".into(), &def).is_none()
        );
        let key = |d: &KernelDef| KernelCache::key_for(BackendKind::Cpu, "x".into(), "t".into(), d);
        let cpu = key(&def).unwrap();
        // Another body definition is another kernel; a CUDA implementation
        // beside the CPU's leaves the CPU key alone.
        assert_ne!(
            key(&KernelDef::new("k").cpu("k v2", |_| Ok(()))),
            Some(cpu.clone())
        );
        let both = def.cuda(CudaKernel::fixed("src", "k", Launch::new(1, 1)));
        assert_eq!(key(&both), Some(cpu));
        assert_eq!(both.backends().count(), 2);
    }

    #[test]
    fn the_same_code_launched_two_ways_is_compiled_once_and_keeps_each_geometry() {
        let cache = KernelCache::default();
        let def = |block| {
            KernelDef::new("k").cuda(CudaKernel::new("src", "k", move |n: &u32| {
                Launch::cover(*n, block)
            }))
        };
        let (narrow, wide) = (def(32), def(256));
        let key = |d: &KernelDef| {
            KernelCache::key_for(BackendKind::Cuda, "sm_90".into(), "t".into(), d).unwrap()
        };
        assert_eq!(key(&narrow), key(&wide), "geometry is not content");
        let compiles = std::cell::Cell::new(0);
        let load = |d: &KernelDef| {
            let loaded = cache.load(key(d), d, |_| {
                compiles.set(compiles.get() + 1);
                Ok(Arc::new(()))
            });
            match loaded.unwrap() {
                Loaded::Hit(k) | Loaded::Compiled(k) => k,
            }
        };
        let (a, b, again) = (load(&narrow), load(&wide), load(&narrow));
        assert_eq!(compiles.get(), 1);
        assert!(Arc::ptr_eq(a.artifact(), b.artifact()));
        let launch = |k: &Kernel| k.def().cuda_impl().unwrap().launch(&64u32.to_le_bytes());
        assert_eq!(launch(&a), Ok(Launch::new(2, 32)));
        assert_eq!(launch(&b), Ok(Launch::new(1, 256)));
        assert!(
            again.same(&a),
            "the first definition's handle is the cached one"
        );
    }

    #[test]
    fn metal_runs_its_own_wgsl_or_else_the_wgpu_one() {
        let wgsl = |src: &str| WgpuKernel::fixed(src, "main", Launch::new(1, 1));
        let key = |d: &KernelDef, kind| KernelCache::key_for(kind, "a".into(), "t".into(), d);
        let cpu_only = KernelDef::new("k").cpu("k v1", |_| Ok(()));
        assert!(cpu_only.metal_impl().is_none());
        assert!(key(&cpu_only, BackendKind::Metal).is_none());
        let shared = cpu_only.clone().wgpu(wgsl("shared"));
        assert_eq!(shared.metal_impl().map(|w| &*w.source), Some("shared"));
        let own = shared.clone().metal(wgsl("apple"));
        assert_eq!(own.metal_impl().map(|w| &*w.source), Some("apple"));
        assert_eq!(own.wgpu_impl().map(|w| &*w.source), Some("shared"));
        // The Metal key follows the WGSL Metal translates; wgpu's is untouched.
        let metal = |d: &KernelDef| key(d, BackendKind::Metal).unwrap();
        assert_ne!(metal(&shared).source_hash, metal(&own).source_hash);
        assert_eq!(
            metal(&shared).source_hash,
            key(&shared, BackendKind::Wgpu).unwrap().source_hash
        );
        assert_eq!(metal(&shared).backend, BackendKind::Metal);
        assert_eq!(
            key(&own, BackendKind::Wgpu),
            key(&shared, BackendKind::Wgpu)
        );
        assert!(!shared.backends().any(|b| b == BackendKind::Metal));
        assert!(own.backends().any(|b| b == BackendKind::Metal));
    }

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
