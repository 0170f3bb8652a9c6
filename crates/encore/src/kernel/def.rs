//! A kernel's definition: its name, the op it performs, its implementation
//! for each backend, and the variants specialized for a value.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::backend::cuda::CudaKernel;
use crate::backend::metal::MetalKernel;
use crate::backend::wgpu::WgpuKernel;
use crate::cpu_args::CpuArgs;
use crate::record::BackendKind;

/// A CPU kernel body. It receives its arguments and returns an error
/// message on failure.
pub type CpuFn = Arc<dyn Fn(&CpuArgs<'_>) -> std::result::Result<(), String> + Send + Sync>;

/// The compile option that makes a specialized variant (see [`KernelDef::specialized`]).
const VALUE_WORDS_OPTION: &str = "--define-macro=ENCORE_VALUE_WORDS=";

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
                [&w.source, &w.entry, w.versions_key()]
            }
        }
    }
}

/// The macro a compile option defines (`--define-macro=NAME=...` or
/// `-DNAME=...`), if it defines one.
fn macro_name(option: &str) -> Option<&str> {
    let body = option
        .strip_prefix("--define-macro=")
        .or_else(|| option.strip_prefix("-D"))?;
    Some(body.split('=').next().unwrap_or(body))
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
    /// [`crate::CUDA_PRELUDE`]) before it first touches memory another dispatch
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
    /// passes it to `encore_fix_value()` (from [`crate::CUDA_PRELUDE`]) before
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
        // Specializing a variant again replaces its value and what it
        // derived; a macro the value defines replaces the definition's own
        // (a generic kernel narrowed to some weight types, say, gives way
        // to the variant's one type).
        let mut def = self.clone();
        def.derived_options = self.variant_options.map(|f| f(value)).unwrap_or_default();
        let redefined = |o: &String| {
            macro_name(o)
                .is_some_and(|m| def.derived_options.iter().any(|d| macro_name(d) == Some(m)))
        };
        def.options = self
            .options
            .iter()
            .filter(|o| {
                !o.starts_with(VALUE_WORDS_OPTION)
                    && !self.derived_options.contains(o)
                    && !redefined(o)
            })
            .cloned()
            .collect();
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
    pub(crate) fn same_geometry(&self, other: &KernelDef) -> bool {
        match (self.cuda_impl(), other.cuda_impl()) {
            (Some(a), Some(b)) => a.same_geometry(b),
            (None, None) => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Launch;

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
    fn a_macro_the_value_derives_replaces_the_definitions_own() {
        let derived = def()
            .option("--define-macro=TYPES=0x5000u")
            .option("--use_fast_math")
            .variant_options(|v| vec![format!("--define-macro=TYPES={}", v[v.len() - 4])]);
        let v = derived
            .specialized(bytemuck::cast_slice(&[576u32, 12]))
            .unwrap();
        assert_eq!(
            v.options(),
            [
                "--use_fast_math",
                "--define-macro=TYPES=12",
                "--define-macro=ENCORE_VALUE_WORDS={0x240u,0xcu}"
            ]
        );
        // A value that derives nothing keeps the definition's own.
        let none = def()
            .option("--define-macro=TYPES=0x5000u")
            .variant_options(|_| Vec::new());
        let v = none.specialized(bytemuck::cast_slice(&[576u32])).unwrap();
        assert_eq!(v.options()[0], "--define-macro=TYPES=0x5000u");
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
}
