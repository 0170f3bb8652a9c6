//! One CUDA device as the runtime's `Backend`: memory, NVRTC compilation
//! with the on-disk cache, submissions and graphs.

use std::any::Any;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr, CUfunction, CUmodule, CUresult};

use super::driver::{self, Context};
use super::queue::{CudaKernel, Queue};
use super::{graph, nvrtc, nvtx};
use crate::backend::{Backend, BackendSubmission, Executable};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kernel::{Kernel, KernelCache, KernelDef};
use crate::program::Program;
use crate::record::{BackendKind, Capabilities, DeviceInfo, Launch, MemoryInfo, RawMem, Upload};

/// The number of CUDA GPUs (0 when there is no driver).
pub(crate) fn device_count() -> usize {
    driver::device_count()
}

/// The CUDA GPUs, for device listings.
pub(crate) fn list() -> Vec<DeviceInfo> {
    (0..device_count())
        .map(|i| DeviceInfo {
            name: format!("cuda:{i}"),
            description: driver::describe_device(i).unwrap_or_else(|| "CUDA device".into()),
        })
        .collect()
}

/// The driver function of a kernel loaded on a CUDA device, for benchmarks
/// that compare Encore with launching it directly. Not a stable API.
#[doc(hidden)]
pub fn raw_function(kernel: &Kernel) -> Option<CUfunction> {
    kernel
        .artifact()
        .downcast_ref::<CudaKernel>()
        .map(CudaKernel::function)
}

/// One CUDA device.
pub(crate) struct CudaBackend {
    queue: Arc<Queue>,
    arch: String,
    toolchain: String,
    cache_dir: Option<PathBuf>,
    disk_hits: AtomicU64,
    /// Programmatic graph edges: asked for, sm_90 or later, driver 12.3 or later.
    early_launch: bool,
}

impl CudaBackend {
    /// Opens GPU `ordinal`: its primary context and a new stream.
    pub(crate) fn open(ordinal: usize, config: &Config) -> Result<Arc<dyn Backend>> {
        let ctx = Context::get(ordinal)?;
        ctx.usable()?;
        use sys::CUdevice_attribute::*;
        let major = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
        let minor = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
        let compiler = nvrtc::nvrtc().map_or_else(|_| "nvrtc-none".to_string(), |n| n.version());
        let queue = Arc::new(Queue::new(ctx)?);
        Ok(Arc::new(CudaBackend {
            queue,
            arch: format!("sm_{major}{minor}"),
            toolchain: format!("{compiler}-driver-{}", driver::driver_version()),
            cache_dir: config.cache_dir.clone(),
            disk_hits: AtomicU64::new(0),
            early_launch: config.early_launch
                && major >= 9
                && driver::driver_version_number().is_some_and(|v| v >= 12030),
        }))
    }

    fn ctx(&self) -> &Context {
        &self.queue.ctx
    }

    /// Where a kernel's device code persists: `<cache_dir>/kernels/<digest>.cubin`.
    fn cache_path(&self, def: &KernelDef) -> Option<PathBuf> {
        let dir = self.cache_dir.as_ref()?;
        let key = KernelCache::key_for(BackendKind::Cuda, self.arch(), self.toolchain(), def)?;
        Some(dir.join("kernels").join(format!("{}.cubin", key.digest())))
    }

    /// Copies device bytes to `out`: after all submitted work (`ordered`),
    /// or beside it.
    fn copy_out(&self, mem: RawMem, offset: usize, out: &mut [u8], ordered: bool) -> Result<()> {
        let ctx = self.ctx();
        ctx.bind()?;
        ctx.usable()?;
        if out.is_empty() {
            return Ok(());
        }
        let (dst, src, len) = (out.as_mut_ptr().cast(), mem + offset as u64, out.len());
        // SAFETY: the caller checked `offset + len` against the buffer, which
        // stays allocated while borrowed, and `out` is exclusively borrowed
        // until the copy is complete: ordered, it runs on the queue's stream
        // after submitted work and the synchronization below waits for it;
        // otherwise it runs on the legacy default stream, which the queue's
        // non-blocking stream does not wait for, and is complete on return.
        let code = unsafe {
            if ordered {
                sys::cuMemcpyDtoHAsync_v2(dst, src, len, self.queue.stream)
            } else {
                sys::cuMemcpyDtoH_v2(dst, src, len)
            }
        };
        ctx.check(code, || format!("copy {len} bytes from the device"))?;
        if ordered {
            self.queue.synchronize()
        } else {
            Ok(())
        }
    }

    /// Loads device code and finds `entry` in it.
    fn load(&self, def: &KernelDef, image: &[u8], entry: &str) -> Result<CudaKernel> {
        let ctx = &self.queue.ctx;
        ctx.bind()?;
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is a complete cubin produced by NVRTC (or read back
        // from the cache); the driver copies what it needs.
        let code = unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) };
        ctx.check(code, || format!("load kernel {}", def.name()))?;
        let not_found = || Error::Compile {
            kernel: def.name().to_string(),
            log: format!("entry point `{entry}` not found; declare the kernel `extern \"C\"`"),
        };
        let mut function: CUfunction = std::ptr::null_mut();
        let code = match CString::new(entry) {
            // SAFETY: looks up a NUL-terminated name in the module just loaded.
            Ok(name) => unsafe { sys::cuModuleGetFunction(&mut function, module, name.as_ptr()) },
            Err(_) => CUresult::CUDA_ERROR_NOT_FOUND,
        };
        if code != CUresult::CUDA_SUCCESS {
            // SAFETY: unloads the module loaded above, once.
            unsafe { sys::cuModuleUnload(module) };
            return Err(not_found());
        }
        Ok(CudaKernel {
            ctx: self.queue.ctx.clone(),
            module,
            function,
            params: parameter_sizes(function),
            shared_limit: AtomicU32::new(0),
        })
    }
}

/// The byte size of each parameter of `function`, if the driver reports them.
fn parameter_sizes(function: CUfunction) -> Option<Vec<usize>> {
    let mut sizes = Vec::new();
    for index in 0..4096usize {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: queries a live function; writes two integers.
        let code = unsafe { sys::cuFuncGetParamInfo(function, index, &mut offset, &mut size) };
        match code {
            CUresult::CUDA_SUCCESS => sizes.push(size),
            // Past the last parameter.
            CUresult::CUDA_ERROR_INVALID_VALUE => return Some(sizes),
            _ => return None,
        }
    }
    None
}

/// Writes `bytes` to `path` through a temporary file, so readers never see
/// a partial file.
fn store(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A name of its own per write: threads of one process (and other
    // processes) may store the same kernel at once; the renames then race
    // harmlessly, each leaving a whole file.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // NVRTC compiles every kernel: a variant per shape costs one compile.
            specialization: true,
            early_launch: self.early_launch,
            // The steps inside one replay start early behind one another,
            // which the boundary between two replays prevents.
            steps_per_replay: 4,
            // Every dispatch costs a launch.
            fusion_pays: true,
            exact_by_default: false,
        }
    }

    fn name(&self) -> &str {
        &self.ctx().name
    }

    fn launch(&self, kernel: &Kernel, value: &[u8]) -> std::result::Result<Launch, String> {
        match kernel.def().cuda_impl() {
            Some(cuda) => cuda.launch(value),
            None => Err("the kernel has no CUDA implementation".into()),
        }
    }

    fn arch(&self) -> String {
        self.arch.clone()
    }

    fn toolchain(&self) -> String {
        self.toolchain.clone()
    }

    fn alloc(&self, bytes: usize) -> Result<RawMem> {
        let ctx = self.ctx();
        ctx.bind()?;
        ctx.usable()?;
        let mut mem: CUdeviceptr = 0;
        // SAFETY: allocates device memory in the current context.
        let code = unsafe { sys::cuMemAlloc_v2(&mut mem, bytes.max(1)) };
        if code == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(Error::OutOfMemory {
                device: ctx.name.clone(),
                bytes,
            });
        }
        ctx.check(code, || format!("allocate {bytes} bytes"))?;
        Ok(mem)
    }

    fn memory(&self) -> Result<Option<MemoryInfo>> {
        let ctx = self.ctx();
        ctx.bind()?;
        ctx.usable()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two integers; the context is current on this thread.
        let code = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        ctx.check(code, || "query free memory".into())?;
        Ok(Some(MemoryInfo {
            free: free as u64,
            total: total as u64,
        }))
    }

    fn free(&self, mem: RawMem, _bytes: usize) {
        if self.ctx().bind().is_ok() {
            // SAFETY: `mem` came from `alloc`, and the pool frees it only
            // when no buffer, submission or graph holds it.
            unsafe { sys::cuMemFree_v2(mem) };
        }
    }

    fn write(&self, mem: RawMem, offset: usize, data: &[u8]) -> Result<()> {
        let ctx = self.ctx();
        ctx.bind()?;
        ctx.usable()?;
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller checked `offset + len` against the buffer; the
        // copy is ordered after submitted work on the stream and complete
        // when the synchronization below returns, while `data` is borrowed.
        let code = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                mem + offset as u64,
                data.as_ptr().cast(),
                data.len(),
                self.queue.stream,
            )
        };
        ctx.check(code, || format!("copy {} bytes to the device", data.len()))?;
        self.queue.synchronize()
    }

    fn read(&self, mem: RawMem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.copy_out(mem, offset, out, true)
    }

    fn read_settled(&self, mem: RawMem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.copy_out(mem, offset, out, false)
    }

    fn compile(&self, def: &KernelDef) -> Result<Arc<dyn Any + Send + Sync>> {
        let source = def.cuda_impl().ok_or_else(|| Error::Unsupported {
            op: def.name().to_string(),
            backend: BackendKind::Cuda,
        })?;
        let own = source.own_source();
        if def.is_programmatic() && !own.contains("encore_grid_wait()") {
            return Err(Error::Compile {
                kernel: def.name().to_string(),
                log: "declared programmatic, but the source never calls encore_grid_wait()".into(),
            });
        }
        if def.is_specializable() && !own.contains("encore_fix_value(") {
            return Err(Error::Compile {
                kernel: def.name().to_string(),
                log: "declared specializable, but the source never calls encore_fix_value()".into(),
            });
        }
        let path = self.cache_path(def);
        if let Some(image) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
            match self.load(def, &image, &source.entry) {
                Ok(kernel) => {
                    self.disk_hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(Arc::new(kernel));
                }
                Err(e) => {
                    self.ctx().usable()?;
                    tracing::warn!("discarding cached kernel {}: {e}", def.name());
                }
            }
        }
        let compiler = nvrtc::nvrtc().map_err(|reason| Error::DeviceUnavailable {
            name: self.ctx().name.clone(),
            reason: format!("cannot compile kernel {}: {reason}", def.name()),
        })?;
        let image = match compiler.compile(def.name(), &source.source, &self.arch, def.options()) {
            Ok(nvrtc::Compiled::Binary(image)) => image,
            Ok(nvrtc::Compiled::Rejected(log)) => {
                return Err(Error::Compile {
                    kernel: def.name().to_string(),
                    log,
                })
            }
            Err(log) => {
                return Err(Error::Compile {
                    kernel: def.name().to_string(),
                    log,
                })
            }
        };
        let kernel = self.load(def, &image, &source.entry)?;
        if let Some(path) = &path {
            if let Err(e) = store(path, &image) {
                tracing::warn!(
                    "cannot cache kernel {} at {}: {e}",
                    def.name(),
                    path.display()
                );
            }
        }
        Ok(Arc::new(kernel))
    }

    fn submit(
        &self,
        program: Arc<Program>,
        uploads: Vec<Upload>,
        timing: bool,
    ) -> Result<Box<dyn BackendSubmission>> {
        self.queue.run(&program, &uploads, timing)
    }

    fn instantiate(&self, program: Arc<Program>) -> Result<Box<dyn Executable>> {
        Ok(Box::new(graph::CudaGraph::build(
            &self.queue,
            program,
            self.early_launch,
        )?))
    }

    fn synchronize(&self) -> Result<()> {
        self.queue.synchronize()
    }

    fn failure(&self) -> Option<String> {
        self.ctx().failure().map(str::to_string)
    }

    fn take_disk_hits(&self) -> u64 {
        self.disk_hits.swap(0, Ordering::Relaxed)
    }

    /// Opens a CUDA profiler range (`cuProfilerStart`): Nsight Systems run
    /// with `--capture-range=cudaProfilerApi` records exactly the captured
    /// launch. Also arms the NVTX ranges of that launch, loading the NVTX
    /// tool first so that its start-up stays outside the range. Without a
    /// profiler attached it does nothing.
    fn capture_begin(&self, name: &str) {
        nvtx::initialize();
        self.queue.arm_capture(name);
        if self.ctx().bind().is_ok() {
            // SAFETY: no arguments; starts profiling of the current context.
            unsafe { sys::cuProfilerStart() };
        }
    }

    /// Closes the profiler range opened by [`Backend::capture_begin`].
    fn capture_end(&self) {
        self.queue.disarm_capture();
        if self.ctx().bind().is_ok() {
            // SAFETY: no arguments; stops profiling of the current context.
            unsafe { sys::cuProfilerStop() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_gpu_is_a_typed_error_not_a_panic() {
        match CudaBackend::open(0, &Config::default()) {
            Ok(backend) => assert_eq!(backend.kind(), BackendKind::Cuda),
            Err(Error::DeviceUnavailable { .. }) => assert_eq!(device_count(), 0),
            Err(e) => panic!("unexpected error: {e}"),
        }
        assert!(matches!(
            CudaBackend::open(4096, &Config::default()),
            Err(Error::DeviceUnavailable { .. })
        ));
        assert_eq!(list().len(), device_count());
    }
}
