//! Kernels and the content-addressed kernel cache.
//!
//! A [`KernelDef`] names a program and gives an implementation per backend: a
//! Rust function for the CPU (identified by a definition string that changes
//! whenever its behaviour does) and CUDA C source for NVRTC. Loading one
//! yields a [`Kernel`], cached under a [`KernelKey`]: name, a hash of the
//! backend's full specialized source, backend, architecture, toolchain and
//! options. Two kernels that share a name but differ in source get different
//! keys and coexist (invariant 3). A loaded kernel is reference-counted and
//! retained by every submission and graph that binds it, so evicting it from
//! the cache never frees code that in-flight work still runs.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::cpu::CpuArgs;
use crate::backend::{Backend, BackendKind};
use crate::error::Result;

/// A CPU kernel body. It receives its arguments and launch geometry and
/// returns an error message on failure.
pub type CpuFn = Arc<dyn Fn(&CpuArgs<'_>) -> std::result::Result<(), String> + Send + Sync>;

/// CUDA C the runtime puts before every kernel's source.
///
/// `encore_grid_wait()` waits until every dispatch this one depends on has
/// finished and its writes are visible, then lets the dispatches that depend
/// on this one start their blocks (PTX `griddepcontrol`; nothing on GPUs
/// before sm_90 or when the kernel was launched the ordinary way). A kernel
/// declared [`KernelDef::programmatic`] calls it in every thread before its
/// first access to memory another dispatch writes. Calling it only after
/// that wait keeps the early start one kernel deep: the next kernel's blocks
/// arrive while this one computes, never further ahead.
///
/// `encore_prefetch_l2(p)` asks for the 128-byte line at `p` in L2; it may
/// run before the wait (it reads nothing into registers).
///
/// `encore_smem_addr(p)` is the 32-bit shared-memory address of the
/// shared variable at `p`, as PTX instructions on shared memory take it
/// (`ldmatrix`, `mbarrier`, `mapa`).
///
/// `encore_fix_value(v)` does nothing in a kernel compiled from its plain
/// source. In a variant specialized for one value argument (see
/// [`KernelDef::specializable`]) it overwrites `v` with the words that
/// variant was compiled for, so the compiler sees every field as a
/// constant: loops over a known length unroll, branches on the data type
/// fold away and only the code of that one shape is left.
pub const CUDA_PRELUDE: &str = r#"// Encore runtime prelude.
__device__ __forceinline__ void encore_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void encore_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}
__device__ __forceinline__ unsigned int encore_smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
#ifdef ENCORE_VALUE_WORDS
template <typename T> __device__ __forceinline__ void encore_fix_value(T& v) {
    const unsigned int words[] = ENCORE_VALUE_WORDS;
    static_assert(sizeof(words) == sizeof(T), "specialized for a value of another size");
#pragma unroll
    for (unsigned int i = 0; i < sizeof(T) / 4; ++i) reinterpret_cast<unsigned int*>(&v)[i] = words[i];
}
#else
template <typename T> __device__ __forceinline__ void encore_fix_value(T&) {}
#endif
// End of the Encore runtime prelude.
"#;

/// The compile option that makes a specialized variant (see [`KernelDef::specialized`]).
const VALUE_WORDS_OPTION: &str = "--define-macro=ENCORE_VALUE_WORDS=";

/// CUDA C source and the name of its `extern "C" __global__` entry point.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CudaSource {
    pub source: String,
    pub entry: String,
}

/// A kernel's definition: its name, the operation it performs (used by graph
/// fusion patterns) and an implementation per backend.
#[derive(Clone)]
pub struct KernelDef {
    name: String,
    op: String,
    cpu: Option<(String, CpuFn)>,
    cuda: Option<CudaSource>,
    options: Vec<String>,
    programmatic: bool,
    specializable: bool,
}

impl fmt::Debug for KernelDef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelDef")
            .field("name", &self.name)
            .field("op", &self.op)
            .field("cpu", &self.cpu.as_ref().map(|(d, _)| d))
            .field("cuda", &self.cuda.as_ref().map(|c| &c.entry))
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
            cpu: None,
            cuda: None,
            options: Vec::new(),
            programmatic: false,
            specializable: false,
        }
    }

    /// Sets the op kind graph passes match on (`rms_norm`, `mul`, ...).
    pub fn op(mut self, op: impl Into<String>) -> KernelDef {
        self.op = op.into();
        self
    }

    /// Adds the CPU implementation. `definition` identifies the function's
    /// behaviour, including any specialization it captures; it is hashed into
    /// the cache key, so two bodies under one name must have different ones.
    pub fn cpu(
        mut self,
        definition: impl Into<String>,
        body: impl Fn(&CpuArgs<'_>) -> std::result::Result<(), String> + Send + Sync + 'static,
    ) -> KernelDef {
        self.cpu = Some((definition.into(), Arc::new(body)));
        self
    }

    /// Adds the CUDA implementation: full source and entry point name. The
    /// runtime's [`CUDA_PRELUDE`] is put before the source (and so is part of
    /// the content address).
    pub fn cuda(mut self, source: impl Into<String>, entry: impl Into<String>) -> KernelDef {
        self.cuda = Some(CudaSource {
            source: format!("{CUDA_PRELUDE}{}", source.into()),
            entry: entry.into(),
        });
        self
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
            || self.cuda.is_none()
            || value.is_empty()
            || !value.len().is_multiple_of(4)
        {
            return None;
        }
        let words: Vec<String> = value
            .chunks_exact(4)
            .map(|w| format!("{:#x}u", u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
            .collect();
        // Specializing a variant again replaces its value.
        let mut def = self.clone();
        def.options.retain(|o| !o.starts_with(VALUE_WORDS_OPTION));
        Some(def.option(format!("{VALUE_WORDS_OPTION}{{{}}}", words.join(","))))
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

    pub fn cpu_impl(&self) -> Option<&CpuFn> {
        self.cpu.as_ref().map(|(_, f)| f)
    }

    pub fn cuda_impl(&self) -> Option<&CudaSource> {
        self.cuda.as_ref()
    }

    pub fn options(&self) -> &[String] {
        &self.options
    }

    /// The text that defines this kernel on `backend`, if it has an implementation there.
    fn source_for(&self, backend: BackendKind) -> Option<&str> {
        match backend {
            BackendKind::Cpu => self.cpu.as_ref().map(|(d, _)| d.as_str()),
            BackendKind::Cuda => self.cuda.as_ref().map(|c| c.source.as_str()),
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
    pub(crate) fn key_for(backend: &dyn Backend, def: &KernelDef) -> Option<KernelKey> {
        let source = def.source_for(backend.kind())?;
        let mut h = Fnv::new();
        h.write(source.as_bytes());
        if let Some(c) = &def.cuda {
            if backend.kind() == BackendKind::Cuda {
                h.write(c.entry.as_bytes());
            }
        }
        Some(KernelKey {
            name: def.name.clone(),
            source_hash: h.finish(),
            backend: backend.kind(),
            arch: backend.arch(),
            toolchain: backend.toolchain(),
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
            return Ok(Loaded::Hit(k.clone()));
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
            .cuda(
                "extern \"C\" __global__ void k(unsigned int n) { encore_fix_value(n); }",
                "k",
            )
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
        assert_eq!(v.cuda_impl(), def().cuda_impl());
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

    #[test]
    fn only_declared_kernels_with_whole_words_specialize() {
        assert!(def().specialized(&[1, 2, 3]).is_none());
        assert!(def().specialized(&[]).is_none());
        let plain = KernelDef::new("k").cuda("", "k");
        assert!(plain.specialized(&[0; 4]).is_none());
        let cpu_only = KernelDef::new("k").cpu("k v1", |_| Ok(())).specializable();
        assert!(cpu_only.specialized(&[0; 4]).is_none());
    }
}
