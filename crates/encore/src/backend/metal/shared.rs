//! What the Metal backend and its in-flight work share: the device and
//! queue, the allocations, the residency set, the first failure, and what
//! each command buffer keeps alive until it completes.
//!
//! It sits below both the backend (`device.rs`) and the encoding of
//! programs (`submit.rs`), which use it and not each other's internals.

use std::collections::HashMap;
use std::ptr::NonNull;

use block2::RcBlock;
use objc2::rc::Retained;
use objc2::runtime::ProtocolObject;
use objc2_metal::{
    MTLAllocation, MTLBlitCommandEncoder, MTLBuffer, MTLCommandBuffer, MTLCommandBufferStatus,
    MTLCommandEncoder, MTLCommandQueue, MTLComputePipelineState, MTLCounterSet, MTLDevice,
    MTLResidencySet, MTLResourceOptions,
};
use parking_lot::Mutex;

use super::{msl, plan};
use crate::backend::failure::Failure;
use crate::error::{Error, Result};
use crate::record::RawMem;

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
pub(super) struct Buffers {
    pub(super) next: u64,
    pub(super) live: HashMap<RawMem, Sendable<Buffer>>,
}

/// State shared by the backend and its in-flight work.
pub(super) struct Shared {
    pub(super) name: String,
    pub(super) device: Retained<ProtocolObject<dyn MTLDevice>>,
    pub(super) queue: Retained<ProtocolObject<dyn MTLCommandQueue>>,
    pub(super) failure: Failure,
    pub(super) buffers: Mutex<Buffers>,
    /// The device's residency set, where the OS has them.
    pub(super) residency: Option<Sendable<Retained<ProtocolObject<dyn MTLResidencySet>>>>,
    /// Changes to the residency set not yet committed.
    pub(super) pending: Mutex<plan::Residency<Sendable<Buffer>>>,
    pub(super) capture: Mutex<plan::Capture>,
    /// `ENCORE_SERIAL`: a barrier after every dispatch.
    pub(super) serial: bool,
    /// The timestamp counter set, where counters can be sampled at
    /// encoder boundaries.
    pub(super) timestamps: Option<Retained<ProtocolObject<dyn MTLCounterSet>>>,
    /// Bound in place of empty buffer arguments.
    pub(super) placeholder: Sendable<Buffer>,
    /// The last command buffer committed: the queue runs command buffers
    /// in commit order, so when it has completed, everything has.
    pub(super) last: Mutex<Option<Sendable<CommandBuffer>>>,
}

impl Shared {
    /// Records the first failure; later ones keep the first's cause.
    pub(super) fn fail(&self, cause: String) {
        if self.failure.record(&cause) {
            tracing::error!(device = %self.name, %cause, "Metal device failed");
        }
    }

    /// `Err` when the device has failed.
    pub(super) fn usable(&self) -> Result<()> {
        self.failure.check(&self.name)
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
    pub(super) fn apply(&self, changes: plan::Changes<Sendable<Buffer>>) {
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
    pub(super) fn read(
        &self,
        mem: RawMem,
        offset: usize,
        out: &mut [u8],
        settled: bool,
    ) -> Result<()> {
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
