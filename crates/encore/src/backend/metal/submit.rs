//! Programs on Metal: bindings resolved once per program, a command buffer
//! encoded per launch as [`plan::encoding`] lays it out, completion and
//! times read back.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use objc2::rc::Retained;
use objc2::runtime::ProtocolObject;
use objc2_foundation::{NSRange, NSString};
use objc2_metal::{
    MTLBarrierScope, MTLBlitCommandEncoder, MTLBuffer, MTLCommandBuffer, MTLCommandBufferStatus,
    MTLCommandEncoder, MTLComputeCommandEncoder, MTLComputePassDescriptor, MTLCounterSampleBuffer,
    MTLCounterSampleBufferDescriptor, MTLDevice, MTLDispatchType, MTLSize, MTLStorageMode,
};

use super::msl::{self, ARGS_INDEX, SIZES_INDEX};
use super::shared::{
    command_error, Buffer, CommandBuffer, Held, Keep, Pipeline, PipelineState, Sendable, Shared,
};
use super::{plan, BIND_ALIGN};
use crate::backend::wgsl::ArgBlocks;
use crate::backend::{BackendSubmission, Executable, Timing};
use crate::error::{Error, Result};
use crate::program::{DispatchRec, Program};
use crate::record::{RawMem, Upload};

/// The id under which command buffers retain the placeholder buffer
/// (allocation handles start at 1).
const PLACEHOLDER: RawMem = 0;

/// A buffer bound for one dispatch.
struct Binding {
    index: usize,
    mem: RawMem,
    buffer: Sendable<Buffer>,
    offset: usize,
}

/// One dispatch, ready to encode.
struct Ready {
    pipeline: PipelineState,
    bindings: Vec<Binding>,
    /// The words of the sizes buffer (empty: none bound).
    sizes: Vec<u32>,
    grid: [u32; 3],
    threads: [u32; 3],
}

/// A program with its bindings and argument blocks resolved.
pub(super) struct Prepared {
    shared: Arc<Shared>,
    /// Retains the program's kernels and describes its groups.
    program: Arc<Program>,
    ready: Vec<Ready>,
    /// Every dispatch's argument block, `stride` bytes apart.
    args: Sendable<Buffer>,
    stride: usize,
}

/// Says why dispatch `d` cannot be bound.
fn invalid(d: &DispatchRec, reason: String) -> Error {
    Error::InvalidDispatch {
        kernel: d.kernel.name().to_string(),
        label: d.label.to_string(),
        reason,
    }
}

impl Prepared {
    pub(super) fn new(shared: &Arc<Shared>, program: Arc<Program>) -> Result<Prepared> {
        shared.usable()?;
        let mut blocks = ArgBlocks::new(&program, BIND_ALIGN);
        let stride = blocks.stride();
        let mut ready = Vec::with_capacity(program.dispatches.len());
        for (i, d) in program.dispatches.iter().enumerate() {
            let Some(pipeline) = d.kernel.artifact().downcast_ref::<Pipeline>() else {
                return Err(invalid(d, "not a Metal kernel".into()));
            };
            // Each buffer argument's handle and buffer, as bound; `None`
            // for an empty one.
            let args = blocks.fill(i, &program, d, |mem| {
                let buffer = shared.buffer(mem)?;
                let size = buffer.length();
                Ok(((mem, buffer), size))
            })?;
            let mut bindings = Vec::with_capacity(pipeline.msl.buffers.len());
            for &(binding, _) in &pipeline.msl.buffers {
                let Some(arg) = args.get(binding as usize) else {
                    return Err(invalid(
                        d,
                        format!(
                            "the shader binds buffer {binding}, the dispatch has {}",
                            args.len()
                        ),
                    ));
                };
                bindings.push(match arg {
                    Some(arg) => Binding {
                        index: binding as usize,
                        mem: arg.buffer.0,
                        buffer: Sendable(arg.buffer.1.clone()),
                        offset: arg.start,
                    },
                    None => Binding {
                        index: binding as usize,
                        mem: PLACEHOLDER,
                        buffer: Sendable(shared.placeholder.0.clone()),
                        offset: 0,
                    },
                });
            }
            let bound = |i: u32| args.get(i as usize)?.as_ref().map(|a| a.bytes as u64);
            let sizes = msl::sizes_words(&pipeline.msl.sizes, bound, stride as u64);
            ready.push(Ready {
                pipeline: pipeline.state.clone(),
                bindings,
                sizes,
                grid: d.launch.grid,
                threads: pipeline.msl.threads,
            });
        }
        let args = shared.staging(blocks.bytes())?;
        Ok(Prepared {
            shared: shared.clone(),
            program,
            ready,
            args: Sendable(args),
            stride,
        })
    }

    /// Encodes the program into a command buffer of its own (its uploads
    /// first) and commits it.
    pub(super) fn launch(&self, uploads: &[Upload], timing: bool) -> Result<MetalSubmission> {
        let s = &self.shared;
        s.usable()?;
        let commands = s.command_buffer()?;
        commands.setLabel(Some(&NSString::from_str("encore")));
        let mut keep = Keep::default();
        self.encode_uploads(&commands, uploads, &mut keep)?;
        let n = self.ready.len();
        let samples = if timing && n > 0 && 2 * n <= plan::MAX_SAMPLES {
            self.sample_buffer(2 * n)
        } else {
            None
        };
        let steps = plan::encoding(n, self.program.groups(), s.serial, samples.is_some());
        // A captured launch names every dispatch for the trace document.
        let named = s.capturing();
        let no_encoder = || s.driver_error("encoding a program", "Metal made no encoder".into());
        let mut encoder: Option<Retained<ProtocolObject<dyn MTLComputeCommandEncoder>>> = None;
        for step in steps {
            match step {
                plan::Step::Encoder { sample } => {
                    if let Some(e) = encoder.take() {
                        e.endEncoding();
                    }
                    let e = match (sample, &samples) {
                        (Some(i), Some(buffer)) => {
                            let pass = MTLComputePassDescriptor::computePassDescriptor();
                            pass.setDispatchType(MTLDispatchType::Concurrent);
                            // SAFETY: attachment 0 always exists; the sample
                            // indices lie inside the buffer (2 per dispatch).
                            unsafe {
                                let at = pass.sampleBufferAttachments().objectAtIndexedSubscript(0);
                                at.setSampleBuffer(Some(buffer));
                                at.setStartOfEncoderSampleIndex(2 * i);
                                at.setEndOfEncoderSampleIndex(2 * i + 1);
                            }
                            commands.computeCommandEncoderWithDescriptor(&pass)
                        }
                        _ => commands
                            .computeCommandEncoderWithDispatchType(MTLDispatchType::Concurrent),
                    }
                    .ok_or_else(no_encoder)?;
                    // SAFETY: the argument blocks' buffer is kept alive by
                    // this program and by the command buffer's `keep`.
                    unsafe { e.setBuffer_offset_atIndex(Some(&self.args.0), 0, ARGS_INDEX) };
                    encoder = Some(e);
                }
                plan::Step::Dispatch(i) => {
                    let e = encoder.as_ref().ok_or_else(no_encoder)?;
                    let d = &self.program.dispatches[i];
                    if named {
                        let name = format!("{} {}", d.kernel.name(), d.label);
                        e.pushDebugGroup(&NSString::from_str(&name));
                    }
                    self.encode_dispatch(e, i, &mut keep);
                    if named {
                        e.popDebugGroup();
                    }
                }
                plan::Step::Barrier => {
                    let e = encoder.as_ref().ok_or_else(no_encoder)?;
                    e.memoryBarrierWithScope(MTLBarrierScope::Buffers);
                }
            }
        }
        if let Some(e) = encoder.take() {
            e.endEncoding();
        }
        keep.other.push(Held::Buffer(self.args.0.clone()));
        if let Some(buffer) = &samples {
            keep.other.push(Held::Samples(buffer.clone()));
        }
        let started = Instant::now();
        s.commit(&commands, keep);
        Ok(MetalSubmission {
            shared: s.clone(),
            commands: Sendable(commands),
            started,
            samples: samples.map(Sendable),
            dispatches: n,
        })
    }

    /// Binds and dispatches dispatch `i`, retaining its pipeline and
    /// buffers for the command buffer (each once).
    fn encode_dispatch(
        &self,
        e: &ProtocolObject<dyn MTLComputeCommandEncoder>,
        i: usize,
        keep: &mut Keep,
    ) {
        let r = &self.ready[i];
        e.setComputePipelineState(&r.pipeline);
        let id = Retained::as_ptr(&r.pipeline) as usize as u64;
        keep.pipelines.retain(id, || r.pipeline.clone());
        for b in &r.bindings {
            // SAFETY: the binding's offset lies inside the buffer (checked
            // when the program was prepared), its index is below the
            // argument table's size, and the buffer is kept alive by the
            // command buffer's `keep` until it completes.
            unsafe { e.setBuffer_offset_atIndex(Some(&b.buffer.0), b.offset, b.index) };
            keep.buffers.retain(b.mem, || b.buffer.0.clone());
        }
        // SAFETY: block `i` lies inside the argument buffer.
        unsafe { e.setBufferOffset_atIndex(i * self.stride, ARGS_INDEX) };
        if !r.sizes.is_empty() {
            let words = NonNull::from(&r.sizes[..]).cast();
            // SAFETY: `words` points to the sizes' bytes, which Metal
            // copies into the command buffer.
            unsafe { e.setBytes_length_atIndex(words, r.sizes.len() * 4, SIZES_INDEX) };
        }
        let [x, y, z] = r.grid;
        if x > 0 && y > 0 && z > 0 {
            let size = |v: [u32; 3]| MTLSize {
                width: v[0] as usize,
                height: v[1] as usize,
                depth: v[2] as usize,
            };
            e.dispatchThreadgroups_threadsPerThreadgroup(size(r.grid), size(r.threads));
        }
    }

    /// Puts the uploads (graph parameters) at the head of the command
    /// buffer: a blit from a copy of their bytes when every one is whole
    /// words, else host writes once the device is idle.
    fn encode_uploads(
        &self,
        commands: &CommandBuffer,
        uploads: &[Upload],
        keep: &mut Keep,
    ) -> Result<()> {
        let uploads: Vec<&Upload> = uploads.iter().filter(|u| !u.bytes.is_empty()).collect();
        if uploads.is_empty() {
            return Ok(());
        }
        let s = &self.shared;
        if uploads
            .iter()
            .any(|u| !u.offset.is_multiple_of(4) || !u.bytes.len().is_multiple_of(4))
        {
            for u in uploads {
                s.write(u.mem, u.offset, &u.bytes)?;
            }
            return Ok(());
        }
        let bytes: Vec<u8> = uploads
            .iter()
            .flat_map(|u| u.bytes.iter().copied())
            .collect();
        let staging = s.staging(&bytes)?;
        let blit = commands
            .blitCommandEncoder()
            .ok_or_else(|| s.driver_error("writing parameters", "no blit encoder".into()))?;
        let mut from = 0;
        for u in uploads {
            let target = s.buffer(u.mem)?;
            if u.offset + u.bytes.len() > target.length() {
                return Err(Error::OutOfRange {
                    what: "graph parameter",
                    offset: u.offset,
                    end: u.offset + u.bytes.len(),
                    len: target.length(),
                });
            }
            // SAFETY: both ranges lie inside their buffers (the staging
            // buffer holds every upload's bytes in order; the target's is
            // checked above), and `keep` holds both until completion.
            unsafe {
                blit.copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size(
                    &staging,
                    from,
                    &target,
                    u.offset,
                    u.bytes.len(),
                )
            };
            from += u.bytes.len();
            keep.buffers.retain(u.mem, || target.clone());
        }
        blit.endEncoding();
        keep.other.push(Held::Buffer(staging));
        Ok(())
    }

    /// A shared sample buffer of `count` timestamps, where the device
    /// samples at encoder boundaries.
    fn sample_buffer(
        &self,
        count: usize,
    ) -> Option<Retained<ProtocolObject<dyn MTLCounterSampleBuffer>>> {
        let s = &self.shared;
        let counters = s.timestamps.as_ref()?;
        let descriptor = MTLCounterSampleBufferDescriptor::new();
        descriptor.setCounterSet(Some(counters));
        descriptor.setStorageMode(MTLStorageMode::Shared);
        // SAFETY: a count within what the device allows for a launch
        // (`plan::MAX_SAMPLES`).
        unsafe { descriptor.setSampleCount(count) };
        match s
            .device
            .newCounterSampleBufferWithDescriptor_error(&descriptor)
        {
            Ok(buffer) => Some(buffer),
            Err(e) => {
                tracing::warn!(error = %e.localizedDescription(), "no Metal counter samples");
                None
            }
        }
    }
}

/// A committed command buffer.
pub(super) struct MetalSubmission {
    shared: Arc<Shared>,
    commands: Sendable<CommandBuffer>,
    started: Instant,
    samples: Option<Sendable<Retained<ProtocolObject<dyn MTLCounterSampleBuffer>>>>,
    dispatches: usize,
}

impl MetalSubmission {
    /// The outcome of the completed command buffer: its times, or its
    /// error (which fails the device).
    fn outcome(&self) -> Result<Timing> {
        let commands = &self.commands.0;
        if let Some(message) = command_error(commands) {
            let cause = format!("a command buffer failed: {message}");
            self.shared.fail(cause.clone());
            return Err(self.shared.driver_error("running a command buffer", cause));
        }
        let seconds = (commands.GPUEndTime() - commands.GPUStartTime()).max(0.0);
        let elapsed = Duration::from_secs_f64(seconds);
        let mut timing = Timing {
            elapsed,
            started: Some(self.started),
            ..Timing::default()
        };
        if let Some(samples) = &self.samples {
            let range = NSRange::new(0, 2 * self.dispatches);
            // SAFETY: the range lies inside the sample buffer, made with
            // two samples per dispatch, and the command buffer has
            // completed, so every sample has been written.
            let data = unsafe { samples.0.resolveCounterRange(range) };
            let ticks: Vec<(u64, u64)> = data
                .map(|d| d.to_vec())
                .unwrap_or_default()
                .chunks_exact(16)
                .map(|c| {
                    let word = |w: &[u8]| {
                        u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]])
                    };
                    (word(&c[..8]), word(&c[8..]))
                })
                .collect();
            if ticks.len() == self.dispatches {
                let (starts, times) = plan::dispatch_times(&ticks, elapsed);
                timing.dispatch_starts = starts;
                timing.dispatches = times;
            }
        }
        Ok(timing)
    }
}

impl BackendSubmission for MetalSubmission {
    fn poll(&self) -> Option<Result<Timing>> {
        let status = self.commands.0.status();
        if status.0 < MTLCommandBufferStatus::Completed.0 {
            return None;
        }
        Some(self.outcome())
    }

    fn wait(&self) -> Result<Timing> {
        self.commands.0.waitUntilCompleted();
        self.outcome()
    }
}

/// A graph's program, bound once and re-encoded at every replay.
pub(super) struct MetalExecutable(pub(super) Prepared);

impl Executable for MetalExecutable {
    fn launch(&self, uploads: &[Upload], timing: bool) -> Result<Box<dyn BackendSubmission>> {
        Ok(Box::new(self.0.launch(uploads, timing)?))
    }
}
