//! Compiled kernels by content: the key a compiled kernel is cached under,
//! the handle work binds, and the cache.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use super::KernelDef;
use crate::error::Result;
use crate::record::BackendKind;

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
        self.0.def.op_kind()
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
            name: def.name().to_string(),
            source_hash: h.finish(),
            backend: kind,
            arch,
            toolchain,
            options: def.options().to_vec(),
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
    use crate::backend::cuda::CudaKernel;
    use crate::backend::wgpu::WgpuKernel;
    use crate::record::Launch;

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
}
