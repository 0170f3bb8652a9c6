//! The Metal device as the runtime's backend: opening it, allocation,
//! kernels compiled to pipelines, and the capture (the module docs say how
//! and why). What it shares with in-flight work is in `shared.rs`.

use std::any::Any;
use std::sync::Arc;

use objc2::rc::Retained;
use objc2::runtime::{NSObjectProtocol, ProtocolObject};
use objc2::sel;
use objc2_foundation::{NSProcessInfo, NSString, NSURL};
use objc2_metal::{
    MTLCaptureDescriptor, MTLCaptureDestination, MTLCaptureManager, MTLCommandQueue,
    MTLCommonCounterSetTimestamp, MTLCompileOptions, MTLComputePipelineState, MTLCopyAllDevices,
    MTLCounterSamplingPoint, MTLCounterSet, MTLDevice, MTLLanguageVersion, MTLLibrary,
    MTLResidencySet, MTLResidencySetDescriptor, MTLResourceOptions,
};
use parking_lot::Mutex;

use super::shared::{Buffers, Pipeline, Sendable, Shared};
use super::submit::{MetalExecutable, Prepared};
use super::{msl, plan};
use crate::backend::failure::Failure;
use crate::backend::{Backend, BackendSubmission, Executable};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kernel::{Kernel, KernelDef};
use crate::program::Program;
use crate::record::{BackendKind, Capabilities, DeviceInfo, Launch, RawMem, Upload};

/// The Metal devices, in the order `metal` picks from (the first).
fn devices() -> Vec<Retained<ProtocolObject<dyn MTLDevice>>> {
    MTLCopyAllDevices().to_vec()
}

/// Whether a Metal device exists (what `auto` asks).
pub(crate) fn has_device() -> bool {
    !devices().is_empty()
}

/// The Metal device, for device listings.
pub(crate) fn list() -> Vec<DeviceInfo> {
    devices()
        .first()
        .map(|d| DeviceInfo {
            name: "metal".into(),
            description: format!("{} (Metal)", d.name()),
        })
        .into_iter()
        .collect()
}

/// The Metal device as a backend.
pub(crate) struct MetalBackend {
    shared: Arc<Shared>,
    arch: String,
    toolchain: String,
}

impl MetalBackend {
    /// Opens the first Metal device (`metal`).
    pub(crate) fn open(config: &Config) -> Result<Arc<dyn Backend>> {
        let unavailable = |reason: &str| Error::DeviceUnavailable {
            name: "metal".into(),
            reason: reason.into(),
        };
        let device = devices()
            .into_iter()
            .next()
            .ok_or_else(|| unavailable("this system has no Metal device"))?;
        let queue = device
            .newCommandQueue()
            .ok_or_else(|| unavailable("Metal made no command queue"))?;
        queue.setLabel(Some(&NSString::from_str("encore")));
        let residency = residency_set(&device, &queue);
        let timestamps = timestamp_counters(&device);
        let placeholder = device
            .newBufferWithLength_options(256, MTLResourceOptions::StorageModeShared)
            .ok_or_else(|| unavailable("Metal could not allocate 256 bytes"))?;
        let arch = format!("{} {:#x}", device.name(), device.registryID());
        let os = NSProcessInfo::processInfo().operatingSystemVersionString();
        let (major, minor) = msl::LANGUAGE_VERSION;
        let shared = Arc::new(Shared {
            name: "metal".into(),
            device,
            queue,
            failure: Failure::default(),
            buffers: Mutex::new(Buffers::default()),
            residency,
            pending: Mutex::new(plan::Residency::default()),
            capture: Mutex::new(plan::Capture::new(config.capture.as_deref())),
            serial: config.serial,
            timestamps,
            placeholder: Sendable(placeholder),
            last: Mutex::new(None),
        });
        Ok(Arc::new(MetalBackend {
            shared,
            arch,
            toolchain: format!("naga-30 msl-{major}.{minor} {os}"),
        }))
    }
}

/// The device's residency set, attached to the queue once, where the OS
/// has residency sets (asked at run time, since the binary runs on older
/// systems too).
fn residency_set(
    device: &ProtocolObject<dyn MTLDevice>,
    queue: &ProtocolObject<dyn MTLCommandQueue>,
) -> Option<Sendable<Retained<ProtocolObject<dyn MTLResidencySet>>>> {
    if !device.respondsToSelector(sel!(newResidencySetWithDescriptor:error:))
        || !queue.respondsToSelector(sel!(addResidencySet:))
    {
        return None;
    }
    let descriptor = MTLResidencySetDescriptor::new();
    descriptor.setLabel(Some(&NSString::from_str("encore")));
    match device.newResidencySetWithDescriptor_error(&descriptor) {
        Ok(set) => {
            queue.addResidencySet(&set);
            Some(Sendable(set))
        }
        Err(e) => {
            tracing::warn!(error = %e.localizedDescription(), "no Metal residency set");
            None
        }
    }
}

/// The timestamp counter set, where the device samples counters at
/// encoder boundaries (Apple GPUs sample nowhere else).
fn timestamp_counters(
    device: &ProtocolObject<dyn MTLDevice>,
) -> Option<Retained<ProtocolObject<dyn MTLCounterSet>>> {
    if !device.supportsCounterSampling(MTLCounterSamplingPoint::AtStageBoundary) {
        return None;
    }
    // SAFETY: a constant string Metal exports.
    let wanted = unsafe { MTLCommonCounterSetTimestamp };
    device
        .counterSets()?
        .to_vec()
        .into_iter()
        .find(|set| &*set.name() == wanted)
}

impl Backend for MetalBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Metal
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            specialization: false,
            early_launch: false,
            // A replay is a command buffer commit, which costs the host
            // time to encode and the device a gap; a few steps share one.
            steps_per_replay: 4,
            // Every dispatch is a pipeline switch, and groups are separated
            // by barriers.
            fusion_pays: true,
            exact_by_default: false,
        }
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn arch(&self) -> String {
        self.arch.clone()
    }

    fn toolchain(&self) -> String {
        self.toolchain.clone()
    }

    fn launch(&self, kernel: &Kernel, value: &[u8]) -> std::result::Result<Launch, String> {
        match kernel.def().metal_impl() {
            Some(w) => w.launch(value),
            None => Err("the kernel has no WGSL implementation for Metal".into()),
        }
    }

    fn alloc(&self, bytes: usize) -> Result<RawMem> {
        let s = &self.shared;
        s.usable()?;
        let buffer = s
            .device
            .newBufferWithLength_options(bytes.max(4), MTLResourceOptions::StorageModeShared)
            .ok_or(Error::OutOfMemory {
                device: s.name.clone(),
                bytes,
            })?;
        let mem = {
            let mut buffers = s.buffers.lock();
            buffers.next += 1;
            let mem = buffers.next;
            buffers.live.insert(mem, Sendable(buffer.clone()));
            mem
        };
        if s.residency.is_some() {
            s.pending.lock().allocated(mem, Sendable(buffer));
        }
        Ok(mem)
    }

    fn free(&self, mem: RawMem, _bytes: usize) {
        // Command buffers still running keep their own references to the
        // buffer; the table and the residency set let go of it here.
        let s = &self.shared;
        let removed = s.buffers.lock().live.remove(&mem);
        if let (Some(buffer), Some(_)) = (removed, &s.residency) {
            s.pending.lock().freed(mem, buffer);
        }
    }

    fn write(&self, mem: RawMem, offset: usize, data: &[u8]) -> Result<()> {
        self.shared.write(mem, offset, data)
    }

    fn read(&self, mem: RawMem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.shared.read(mem, offset, out, false)
    }

    fn read_settled(&self, mem: RawMem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.shared.read(mem, offset, out, true)
    }

    fn compile(&self, def: &KernelDef) -> Result<Arc<dyn Any + Send + Sync>> {
        let Some(kernel) = def.metal_impl() else {
            return Err(Error::Unsupported {
                op: def.name().to_string(),
                backend: BackendKind::Metal,
            });
        };
        let s = &self.shared;
        s.usable()?;
        let compile_error = |log: String| Error::Compile {
            kernel: def.name().to_string(),
            log,
        };
        let msl = msl::translate(def.name(), &kernel.source, &kernel.entry)?;
        let options = MTLCompileOptions::new();
        options.setLanguageVersion(MTLLanguageVersion::Version2_4);
        // WGSL's arithmetic, not fast math (the wgpu backend's choice too).
        #[allow(deprecated)]
        options.setFastMathEnabled(false);
        let library = s
            .device
            .newLibraryWithSource_options_error(&NSString::from_str(&msl.source), Some(&options))
            .map_err(|e| compile_error(e.localizedDescription().to_string()))?;
        let function = library
            .newFunctionWithName(&NSString::from_str(&msl.entry))
            .ok_or_else(|| compile_error(format!("no function `{}` in the MSL", msl.entry)))?;
        let state = s
            .device
            .newComputePipelineStateWithFunction_error(&function)
            .map_err(|e| compile_error(e.localizedDescription().to_string()))?;
        let threads: usize = msl.threads.iter().map(|&t| t as usize).product();
        if threads > state.maxTotalThreadsPerThreadgroup() {
            return Err(compile_error(format!(
                "a threadgroup of {:?} exceeds the pipeline's {} threads",
                msl.threads,
                state.maxTotalThreadsPerThreadgroup()
            )));
        }
        Ok(Arc::new(Pipeline { state, msl }))
    }

    fn submit(
        &self,
        program: Arc<Program>,
        uploads: Vec<Upload>,
        timing: bool,
    ) -> Result<Box<dyn BackendSubmission>> {
        let prepared = Prepared::new(&self.shared, program)?;
        Ok(Box::new(prepared.launch(&uploads, timing)?))
    }

    fn instantiate(&self, program: Arc<Program>) -> Result<Box<dyn Executable>> {
        Ok(Box::new(MetalExecutable(Prepared::new(
            &self.shared,
            program,
        )?)))
    }

    fn synchronize(&self) -> Result<()> {
        self.shared.usable()?;
        self.shared.wait_idle("synchronizing")
    }

    fn failure(&self) -> Option<String> {
        self.shared.failure.cause()
    }

    fn capture_begin(&self, _name: &str) {
        let s = &self.shared;
        // SAFETY: the shared capture manager exists in every process.
        let manager = unsafe { MTLCaptureManager::sharedCaptureManager() };
        let support = if manager.supportsDestination(MTLCaptureDestination::GPUTraceDocument) {
            plan::Support::Available
        } else {
            plan::Support::NotEnabled
        };
        let mut capture = s.capture.lock();
        let mut step = capture.begin(support);
        if let plan::Begin::Start(path) = &step {
            let descriptor = MTLCaptureDescriptor::new();
            let queue: &ProtocolObject<dyn MTLCommandQueue> = &s.queue;
            // SAFETY: a command queue is a valid capture object.
            unsafe { descriptor.setCaptureObject(Some(queue.as_ref())) };
            descriptor.setDestination(MTLCaptureDestination::GPUTraceDocument);
            let url = NSURL::fileURLWithPath(&NSString::from_str(&path.to_string_lossy()));
            descriptor.setOutputURL(Some(&url));
            step = match manager.startCaptureWithDescriptor_error(&descriptor) {
                Ok(()) => {
                    s.pending.lock().freeze();
                    plan::Begin::Skip
                }
                Err(e) => capture.failed(&e.localizedDescription().to_string()),
            };
        }
        if let plan::Begin::Warn(message) = step {
            tracing::warn!(%message, "Metal capture");
            eprintln!("encore: warning: {message}");
        }
    }

    fn capture_end(&self) {
        let s = &self.shared;
        if !s.capture.lock().end() {
            return;
        }
        // SAFETY: as in `capture_begin`.
        unsafe { MTLCaptureManager::sharedCaptureManager() }.stopCapture();
        let changes = s.pending.lock().thaw();
        if let Some(changes) = changes {
            s.apply(changes);
        }
    }

    fn capture_trace_path(&self, path: &std::path::Path) -> std::path::PathBuf {
        plan::chrome_trace_path(path)
    }
}
