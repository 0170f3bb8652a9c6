//! The Metal device: memory, copies, kernels, the residency set and the
//! capture (the module docs say how and why).

use std::any::Any;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;

use block2::RcBlock;
use objc2::rc::Retained;
use objc2::runtime::{NSObjectProtocol, ProtocolObject};
use objc2::sel;
use objc2_foundation::{NSProcessInfo, NSString, NSURL};
use objc2_metal::{
    MTLAllocation, MTLBlitCommandEncoder, MTLBuffer, MTLCaptureDescriptor, MTLCaptureDestination,
    MTLCaptureManager, MTLCommandBuffer, MTLCommandBufferStatus, MTLCommandEncoder,
    MTLCommandQueue, MTLCommonCounterSetTimestamp, MTLCompileOptions, MTLComputePipelineState,
    MTLCopyAllDevices, MTLCounterSamplingPoint, MTLCounterSet, MTLDevice, MTLLanguageVersion,
    MTLLibrary, MTLResidencySet, MTLResidencySetDescriptor, MTLResourceOptions,
};
use parking_lot::Mutex;

use super::submit::{MetalExecutable, Prepared};
use super::{msl, plan};
use crate::backend::{Backend, BackendSubmission, Executable};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kernel::{Kernel, KernelDef};
use crate::program::Program;
use crate::record::{BackendKind, Capabilities, DeviceInfo, Launch, RawMem, Upload};

pub(super) type Buffer = Retained<ProtocolObject<dyn MTLBuffer>>;
pub(super) type CommandBuffer = Retained<ProtocolObject<dyn MTLCommandBuffer>>;
pub(super) type PipelineState = Retained<ProtocolObject<dyn MTLComputePipelineState>>;

/// A Metal object used from more than one thread.
///
/// `objc2-metal` marks only some protocols thread-safe; buffers, command
/// buffers, residency sets and counter sample buffers are not marked,
/// though Metal allows retaining, releasing and reading them from any
/// thread. Encore encodes into a command buffer only on the thread that
/// made it, before committing it; after that, other threads only wait on
/// it and read its status, times and error, which Metal allows. Buffer
/// contents are touched by the host only when no work uses them (see
/// [`Shared::write`]).
pub(super) struct Sendable<T>(pub(super) T);

// SAFETY: see the type's docs: the wrapped Metal objects are used across
// threads only in the ways Metal documents as thread-safe.
unsafe impl<T> Send for Sendable<T> {}
// SAFETY: as for `Send`; shared references only retain, bind, wait on or
// read the objects.
unsafe impl<T> Sync for Sendable<T> {}

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

/// Something a command buffer keeps alive until its completion handler
/// has run, beside the buffers and pipelines of its dispatches. Held only
/// to be dropped then.
#[allow(dead_code)]
pub(super) enum Held {
    Buffer(Buffer),
    Samples(Retained<ProtocolObject<dyn objc2_metal::MTLCounterSampleBuffer>>),
}

/// What one command buffer keeps alive (see [`plan::Retention`]).
#[derive(Default)]
pub(super) struct Keep {
    pub(super) buffers: plan::Retention<Buffer>,
    pub(super) pipelines: plan::Retention<PipelineState>,
    pub(super) other: Vec<Held>,
}

/// The allocations, keyed by the runtime's handles.
#[derive(Default)]
struct Buffers {
    next: u64,
    live: HashMap<RawMem, Sendable<Buffer>>,
}

/// State shared by the backend and its in-flight work.
pub(super) struct Shared {
    pub(super) name: String,
    pub(super) device: Retained<ProtocolObject<dyn MTLDevice>>,
    pub(super) queue: Retained<ProtocolObject<dyn MTLCommandQueue>>,
    failure: Mutex<Option<String>>,
    buffers: Mutex<Buffers>,
    /// The device's residency set, where the OS has them.
    residency: Option<Sendable<Retained<ProtocolObject<dyn MTLResidencySet>>>>,
    /// Changes to the residency set not yet committed.
    pending: Mutex<plan::Residency<Sendable<Buffer>>>,
    capture: Mutex<plan::Capture>,
    /// `ENCORE_SERIAL`: a barrier after every dispatch.
    pub(super) serial: bool,
    /// The timestamp counter set, where counters can be sampled at
    /// encoder boundaries.
    pub(super) timestamps: Option<Retained<ProtocolObject<dyn MTLCounterSet>>>,
    /// Bound in place of empty buffer arguments.
    pub(super) placeholder: Sendable<Buffer>,
    /// The last command buffer committed: the queue runs command buffers
    /// in commit order, so when it has completed, everything has.
    last: Mutex<Option<Sendable<CommandBuffer>>>,
}

impl Shared {
    /// Records the first failure; later ones keep the first's cause.
    pub(super) fn fail(&self, cause: String) {
        let mut f = self.failure.lock();
        if f.is_none() {
            tracing::error!(device = %self.name, %cause, "Metal device failed");
            *f = Some(cause);
        }
    }

    /// `Err` when the device has failed.
    pub(super) fn usable(&self) -> Result<()> {
        match &*self.failure.lock() {
            Some(cause) => Err(Error::DeviceFailed {
                device: self.name.clone(),
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(super) fn driver_error(&self, operation: &str, message: String) -> Error {
        Error::Driver {
            device: self.name.clone(),
            operation: operation.into(),
            message,
        }
    }

    /// The buffer behind a handle.
    pub(super) fn buffer(&self, mem: RawMem) -> Result<Buffer> {
        self.buffers
            .lock()
            .live
            .get(&mem)
            .map(|b| b.0.clone())
            .ok_or_else(|| self.driver_error("binding a buffer", "unknown allocation".into()))
    }

    /// A new command buffer that does not retain what it binds.
    pub(super) fn command_buffer(&self) -> Result<CommandBuffer> {
        self.queue
            .commandBufferWithUnretainedReferences()
            .ok_or_else(|| self.driver_error("making a command buffer", "Metal made none".into()))
    }

    /// Commits `commands`, keeping `keep` alive until its completion
    /// handler has run, and first commits the residency set's changes
    /// (once per commit; none during a capture).
    pub(super) fn commit(&self, commands: &CommandBuffer, keep: Keep) {
        let changes = self.pending.lock().at_commit();
        if let Some(changes) = changes {
            self.apply(changes);
        }
        tracing::trace!(
            buffers = keep.buffers.len(),
            pipelines = keep.pipelines.len(),
            "committing a Metal command buffer"
        );
        let held = Mutex::new(Some(Sendable(keep)));
        let handler = RcBlock::new(move |_: NonNull<ProtocolObject<dyn MTLCommandBuffer>>| {
            // The command buffer has completed: release what it bound.
            drop(held.lock().take());
        });
        // SAFETY: the block is valid for this call; Metal copies it and
        // calls it once, on a thread of its own, after the command buffer
        // completes; it only drops objects that are safe to release there.
        unsafe { commands.addCompletedHandler(RcBlock::as_ptr(&handler)) };
        commands.commit();
        *self.last.lock() = Some(Sendable(commands.clone()));
    }

    /// Adds and removes allocations and commits the residency set.
    fn apply(&self, changes: plan::Changes<Sendable<Buffer>>) {
        let Some(set) = &self.residency else {
            return;
        };
        for (_, buffer) in &changes.add {
            set.0
                .addAllocation(ProtocolObject::<dyn MTLAllocation>::from_ref(&*buffer.0));
        }
        for (_, buffer) in &changes.remove {
            set.0
                .removeAllocation(ProtocolObject::<dyn MTLAllocation>::from_ref(&*buffer.0));
        }
        set.0.commit();
    }

    /// Whether every committed command buffer has completed.
    fn idle(&self) -> bool {
        self.last
            .lock()
            .as_ref()
            .is_none_or(|c| c.0.status().0 >= MTLCommandBufferStatus::Completed.0)
    }

    /// Waits until every committed command buffer has completed; one that
    /// ended in error fails the device.
    pub(super) fn wait_idle(&self, operation: &str) -> Result<()> {
        let last = self.last.lock().as_ref().map(|c| c.0.clone());
        if let Some(last) = last {
            last.waitUntilCompleted();
            if let Some(message) = command_error(&last) {
                self.fail(format!("{operation}: {message}"));
            }
        }
        self.usable()
    }

    /// Whether a GPU trace capture is recording.
    pub(super) fn capturing(&self) -> bool {
        self.pending.lock().is_frozen()
    }

    /// Checks that `offset..offset + len` lies inside `buffer`.
    fn check_range(&self, buffer: &Buffer, offset: usize, len: usize) -> Result<()> {
        let size = buffer.length();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                what: "Metal buffer copy",
                offset,
                end: offset.saturating_add(len),
                len: size,
            });
        }
        Ok(())
    }

    /// Copies `data` to `offset` of `mem`, ordered after submitted work and
    /// complete on return: by the host when the device is idle, else by a
    /// blit in a command buffer of its own (from a copy of the bytes), or,
    /// for a range Metal cannot blit (not whole words), by the host after
    /// waiting for the device.
    pub(super) fn write(&self, mem: RawMem, offset: usize, data: &[u8]) -> Result<()> {
        self.usable()?;
        if data.is_empty() {
            return Ok(());
        }
        let buffer = self.buffer(mem)?;
        self.check_range(&buffer, offset, data.len())?;
        let words = offset.is_multiple_of(4) && data.len().is_multiple_of(4);
        if !self.idle() && words {
            let staging = self.staging(data)?;
            let commands = self.command_buffer()?;
            let blit = commands
                .blitCommandEncoder()
                .ok_or_else(|| self.driver_error("writing a buffer", "no blit encoder".into()))?;
            // SAFETY: both ranges lie inside their buffers (checked above;
            // the staging buffer holds exactly `data`), and both buffers
            // are kept alive until the command buffer completes.
            unsafe {
                blit.copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size(
                    &staging,
                    0,
                    &buffer,
                    offset,
                    data.len(),
                )
            };
            blit.endEncoding();
            let mut keep = Keep::default();
            keep.other.push(Held::Buffer(staging));
            keep.buffers.retain(mem, || buffer.clone());
            self.commit(&commands, keep);
            return Ok(());
        }
        self.wait_idle("writing a buffer")?;
        // SAFETY: the range lies inside the shared-storage buffer (checked
        // above) and no work uses the buffer now (the queue is idle), so
        // the host may write its contents.
        unsafe {
            let to = buffer.contents().cast::<u8>().as_ptr().add(offset);
            std::ptr::copy_nonoverlapping(data.as_ptr(), to, data.len());
        }
        Ok(())
    }

    /// A new shared buffer holding a copy of `data` (not empty).
    pub(super) fn staging(&self, data: &[u8]) -> Result<Buffer> {
        let bytes = NonNull::from(data).cast();
        // SAFETY: `bytes` points to `data.len()` readable bytes, which
        // Metal copies before returning.
        unsafe {
            self.device.newBufferWithBytes_length_options(
                bytes,
                data.len(),
                MTLResourceOptions::StorageModeShared,
            )
        }
        .ok_or(Error::OutOfMemory {
            device: self.name.clone(),
            bytes: data.len(),
        })
    }

    /// Copies `out.len()` bytes at `offset` of `mem` out: after all
    /// submitted work, or at once when `settled` (the caller has seen the
    /// work that wrote them complete).
    fn read(&self, mem: RawMem, offset: usize, out: &mut [u8], settled: bool) -> Result<()> {
        self.usable()?;
        if out.is_empty() {
            return Ok(());
        }
        if !settled {
            self.wait_idle("reading a buffer")?;
        }
        let buffer = self.buffer(mem)?;
        self.check_range(&buffer, offset, out.len())?;
        // SAFETY: the range lies inside the shared-storage buffer, and the
        // work that wrote it has completed (waited for above, or seen by
        // the caller), so its contents are visible to the host.
        unsafe {
            let from = buffer.contents().cast::<u8>().as_ptr().add(offset);
            std::ptr::copy_nonoverlapping(from, out.as_mut_ptr(), out.len());
        }
        Ok(())
    }
}

/// The error of a command buffer that ended in one, in words.
pub(super) fn command_error(commands: &ProtocolObject<dyn MTLCommandBuffer>) -> Option<String> {
    if commands.status() != MTLCommandBufferStatus::Error {
        return None;
    }
    Some(match commands.error() {
        Some(e) => e.localizedDescription().to_string(),
        None => "the command buffer ended in error".into(),
    })
}

/// A compiled kernel: its pipeline and what its MSL binds.
pub(super) struct Pipeline {
    pub(super) state: PipelineState,
    pub(super) msl: msl::Msl,
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
            failure: Mutex::new(None),
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
        self.shared.failure.lock().clone()
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
