//! Programs on wgpu: bind groups built once per program, passes encoded per
//! launch, completion and timestamps read back.
//!
//! A [`Prepared`] program holds, per dispatch, its pipeline and its bind
//! group of buffers, and one argument buffer with every dispatch's block
//! (offset table and value) at a stride the device's dynamic offsets allow.
//! An eager submission prepares and launches once; a graph's executable
//! prepares once and launches every replay, which only re-encodes the
//! passes: its graph parameters live in device buffers that the launch's
//! uploads rewrite first.
//!
//! A program is one compute pass, its concurrent groups included: within a
//! pass wgpu orders the dispatches by the buffers they use (a barrier
//! before a dispatch that uses a buffer an earlier one wrote, whole
//! buffers as wgpu tracks them), as it orders passes. Measured on an H200
//! through NVIDIA's Vulkan driver, a pass per concurrent group cost the
//! device about 5 µs a pass (a SmolLM2 decode step, 160 dispatches: 3.81
//! against 2.99 ms). With timing asked for and timestamp queries inside
//! passes, a timestamp brackets every dispatch; with timestamps only at
//! pass boundaries, each dispatch gets a pass of its own; the first and
//! last timestamps give the submission's device time.

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::shared::{caught, message, Pipeline, Shared};
use crate::backend::wgsl::ArgBlocks;
use crate::backend::{BackendSubmission, Executable, Timing};
use crate::error::{Error, Result};
use crate::program::{DispatchRec, Program};
use crate::record::Upload;

/// The most queries one query set holds (WebGPU's limit).
const MAX_QUERIES: u32 = 4096;

/// One dispatch, ready to encode.
struct Ready {
    pipeline: wgpu::ComputePipeline,
    buffers: wgpu::BindGroup,
    grid: [u32; 3],
}

/// A program with its bind groups and argument blocks built.
pub(crate) struct Prepared {
    shared: Arc<Shared>,
    ready: Vec<Ready>,
    args: wgpu::BindGroup,
    stride: u32,
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
    pub(crate) fn new(
        shared: &Arc<Shared>,
        args_layout: &wgpu::BindGroupLayout,
        program: &Program,
    ) -> Result<Prepared> {
        shared.usable()?;
        let mut blocks = ArgBlocks::new(program, shared.storage_align as usize);
        let stride = blocks.stride();
        let scope = shared
            .device
            .push_error_scope(wgpu::ErrorFilter::Validation);
        let mut ready = Vec::with_capacity(program.dispatches.len());
        for (i, d) in program.dispatches.iter().enumerate() {
            let Some(pipeline) = d.kernel.artifact().downcast_ref::<Pipeline>() else {
                return Err(invalid(d, "not a wgpu kernel".into()));
            };
            // Each buffer argument's binding; `None` for an empty one.
            let buffers = blocks.fill(i, program, d, |mem| {
                let buffer = shared.buffer(mem)?;
                let size = buffer.size() as usize;
                Ok((buffer, size))
            })?;
            let bound = |read_only: bool| {
                pipeline
                    .bindings
                    .iter()
                    .filter(move |&&(_, r)| r == read_only)
                    .filter_map(|&(b, _)| buffers.get(b as usize)?.as_ref())
                    .map(|bound| &bound.buffer)
            };
            let aliasing = bound(true).any(|r| bound(false).any(|w| w == r));
            let compiled = pipeline.variant(shared, args_layout, aliasing)?;
            let mut entries = Vec::with_capacity(pipeline.bindings.len());
            for &(binding, read_only) in &pipeline.bindings {
                let Some(bound) = buffers.get(binding as usize) else {
                    return Err(invalid(
                        d,
                        format!(
                            "the shader binds buffer {binding}, the dispatch has {}",
                            buffers.len()
                        ),
                    ));
                };
                let placeholder = &shared.placeholders[usize::from(read_only)];
                let (buffer, offset, size) = match bound {
                    Some(b) => (&b.buffer, b.start as u64, NonZeroU64::new(b.bytes as u64)),
                    None => (placeholder, 0, None),
                };
                entries.push(wgpu::BindGroupEntry {
                    binding,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer,
                        offset,
                        size,
                    }),
                });
            }
            let group = shared.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &compiled.buffers,
                entries: &entries,
            });
            ready.push(Ready {
                pipeline: compiled.pipeline.clone(),
                buffers: group,
                grid: d.launch.grid,
            });
        }
        let args_buffer = shared.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("encore argument blocks"),
            size: blocks.bytes().len() as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        shared.queue.write_buffer(&args_buffer, 0, blocks.bytes());
        let args = shared.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("encore arguments"),
            layout: args_layout,
            entries: &[wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &args_buffer,
                    offset: 0,
                    size: NonZeroU64::new(stride as u64),
                }),
            }],
        });
        shared.scoped("binding a program's buffers", caught(scope))?;
        Ok(Prepared {
            shared: shared.clone(),
            ready,
            args,
            stride: stride as u32,
        })
    }

    /// Writes `uploads`, then encodes the program and submits it, or with
    /// `hold` leaves it for the next operation on the queue to submit.
    pub(crate) fn launch(
        &self,
        uploads: &[Upload],
        timing: bool,
        hold: bool,
    ) -> Result<WgpuSubmission> {
        let s = &self.shared;
        s.usable()?;
        // A held replay starts before this one is encoded, so that the
        // device runs it while the host encodes.
        s.flush();
        for u in uploads {
            s.write(u.mem, u.offset, &u.bytes)?;
        }
        let n = self.ready.len() as u32;
        let mode = match (s.features.timestamps, timing) {
            (false, _) => Stamps::None,
            (true, false) => Stamps::Ends,
            (true, true) if s.features.timestamps_in_passes => Stamps::Dispatches,
            (true, true) => Stamps::PassPerDispatch,
        };
        let queries = match mode {
            Stamps::None => 0,
            Stamps::Ends => 2,
            Stamps::Dispatches | Stamps::PassPerDispatch => 2 * n,
        };
        let oom = s.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let scope = s.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let sets: Vec<wgpu::QuerySet> = (0..queries.div_ceil(MAX_QUERIES))
            .map(|k| {
                s.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: None,
                    ty: wgpu::QueryType::Timestamp,
                    count: (queries - k * MAX_QUERIES).min(MAX_QUERIES),
                })
            })
            .collect();
        let slot = |q: u32| (&sets[(q / MAX_QUERIES) as usize], q % MAX_QUERIES);
        let mut encoder = s
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        // The passes, as ranges of dispatches: one for the whole program
        // (within a pass wgpu orders the dispatches by the buffers they
        // use, as between passes), or one a dispatch.
        let n_ready = self.ready.len();
        let passes: Vec<std::ops::Range<usize>> = match mode {
            Stamps::PassPerDispatch => (0..n_ready).map(|i| i..i + 1).collect(),
            _ => std::iter::once(0..n_ready)
                .filter(|r| !r.is_empty())
                .collect(),
        };
        let last = passes.len().saturating_sub(1);
        for (g, range) in passes.into_iter().enumerate() {
            let writes = match mode {
                Stamps::Ends if g == 0 || g == last => {
                    let (set, _) = slot(0);
                    Some(wgpu::ComputePassTimestampWrites {
                        query_set: set,
                        beginning_of_pass_write_index: (g == 0).then_some(0),
                        end_of_pass_write_index: (g == last).then_some(1),
                    })
                }
                Stamps::PassPerDispatch => {
                    let (set, at) = slot(2 * range.start as u32);
                    Some(wgpu::ComputePassTimestampWrites {
                        query_set: set,
                        beginning_of_pass_write_index: Some(at),
                        end_of_pass_write_index: Some(at + 1),
                    })
                }
                _ => None,
            };
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: writes,
            });
            for i in range {
                let r = &self.ready[i];
                pass.set_pipeline(&r.pipeline);
                pass.set_bind_group(0, &r.buffers, &[]);
                pass.set_bind_group(1, &self.args, &[i as u32 * self.stride]);
                if mode == Stamps::Dispatches {
                    let (set, at) = slot(2 * i as u32);
                    pass.write_timestamp(set, at);
                }
                let [x, y, z] = r.grid;
                if x > 0 && y > 0 && z > 0 {
                    pass.dispatch_workgroups(x, y, z);
                }
                if mode == Stamps::Dispatches {
                    let (set, at) = slot(2 * i as u32 + 1);
                    pass.write_timestamp(set, at);
                }
            }
        }
        let readback = (queries > 0).then(|| {
            let bytes = u64::from(queries) * 8;
            let resolved = s.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("encore timestamps"),
                size: bytes,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let staging = s.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("encore timestamps read"),
                size: bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            for (k, set) in sets.iter().enumerate() {
                let count = (queries - k as u32 * MAX_QUERIES).min(MAX_QUERIES);
                encoder.resolve_query_set(set, 0..count, &resolved, k as u64 * 8 * 4096);
            }
            encoder.copy_buffer_to_buffer(&resolved, 0, &staging, 0, bytes);
            staging
        });
        let stamps = readback.map(|staging| Readback {
            staging,
            mapped: Arc::new(Mutex::new(None)),
            mode,
            read: Mutex::new(None),
        });
        let slot = Arc::new(Slot {
            index: Mutex::new(None),
            done: Arc::new(AtomicBool::new(false)),
            started: Mutex::new(None),
            stamps,
        });
        let commands = encoder.finish();
        let error = [caught(scope), caught(oom)]
            .into_iter()
            .flatten()
            .next()
            .map(|e| {
                let cause = format!("submitting a program: {}", message(&e));
                s.fail(cause.clone());
                cause
            });
        if error.is_none() {
            if hold {
                let held = slot.clone();
                s.hold(Box::new(move |s: &Shared| held.submit(s, commands)));
            } else {
                s.flush();
                slot.submit(s, commands);
            }
        }
        Ok(WgpuSubmission {
            shared: s.clone(),
            slot,
            error,
            dispatches: self.ready.len(),
        })
    }
}

/// A program's submission: made when encoded, or held back until the next
/// operation on the queue (see [`Shared::hold`]).
pub(crate) struct Slot {
    /// The queue's index of the submission, once made.
    index: Mutex<Option<wgpu::SubmissionIndex>>,
    /// Set by the queue once the work is done.
    done: Arc<AtomicBool>,
    /// When it was submitted.
    started: Mutex<Option<Instant>>,
    stamps: Option<Readback>,
}

impl Slot {
    /// Submits `commands` and asks to hear of their completion and, with
    /// timestamps, for their read-back.
    pub(crate) fn submit(&self, s: &Shared, commands: wgpu::CommandBuffer) {
        *self.started.lock() = Some(Instant::now());
        *self.index.lock() = Some(s.queue.submit([commands]));
        let flag = self.done.clone();
        s.queue
            .on_submitted_work_done(move || flag.store(true, Ordering::Release));
        if let Some(r) = &self.stamps {
            let result = r.mapped.clone();
            r.staging.map_async(wgpu::MapMode::Read, .., move |m| {
                *result.lock() = Some(m.is_ok())
            });
        }
    }
}

/// Which timestamps a launch writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stamps {
    /// The device has no timestamp queries.
    None,
    /// The start of the first pass and the end of the last.
    Ends,
    /// Before and after every dispatch, inside passes.
    Dispatches,
    /// Every dispatch in a pass of its own, stamped at its ends.
    PassPerDispatch,
}

/// Timestamps on their way back to the host.
struct Readback {
    staging: wgpu::Buffer,
    /// `Some(mapped)` once the map has completed.
    mapped: Arc<Mutex<Option<bool>>>,
    mode: Stamps,
    /// The times, once read (the staging buffer is unmapped then).
    read: Mutex<Option<std::result::Result<Timing, String>>>,
}

/// A launched program.
pub(crate) struct WgpuSubmission {
    shared: Arc<Shared>,
    slot: Arc<Slot>,
    /// Why the submission failed, found when it was made.
    error: Option<String>,
    dispatches: usize,
}

impl WgpuSubmission {
    fn failed(&self, cause: &str) -> Error {
        Error::DeviceFailed {
            device: self.shared.name.clone(),
            cause: cause.to_string(),
        }
    }

    /// The outcome once the work and the timestamps' map have completed.
    fn outcome(&self) -> Option<Result<Timing>> {
        if let Some(cause) = &self.error {
            return Some(Err(self.failed(cause)));
        }
        if let Some(cause) = self.shared.failure.cause() {
            return Some(Err(self.failed(&cause)));
        }
        if !self.slot.done.load(Ordering::Acquire) {
            return None;
        }
        let started = *self.slot.started.lock();
        let Some(r) = &self.slot.stamps else {
            return Some(Ok(Timing {
                elapsed: started.map(|t| t.elapsed()).unwrap_or_default(),
                started,
                ..Timing::default()
            }));
        };
        match *r.mapped.lock() {
            None => None,
            Some(false) => Some(Err(self
                .shared
                .driver_error("reading timestamps", "the map failed".into()))),
            Some(true) => {
                let mut read = r.read.lock();
                if read.is_none() {
                    *read = Some(self.timing(r).map_err(|e| e.to_string()));
                }
                read.clone()
                    .map(|t| t.map_err(|e| self.shared.driver_error("reading timestamps", e)))
            }
        }
    }

    /// Device times from the mapped timestamps.
    fn timing(&self, r: &Readback) -> Result<Timing> {
        let ticks = r.staging.get_mapped_range(..).map(|view| {
            view.chunks_exact(8)
                .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect::<Vec<u64>>()
        });
        r.staging.unmap();
        let ticks = ticks.map_err(|e| {
            self.shared
                .driver_error("reading timestamps", e.to_string())
        })?;
        let period = self.shared.timestamp_period;
        let span =
            |a: u64, b: u64| Duration::from_nanos((b.saturating_sub(a) as f64 * period) as u64);
        let first = ticks.first().copied().unwrap_or(0);
        let end = ticks.last().copied().unwrap_or(first);
        let mut timing = Timing {
            elapsed: span(first, end),
            started: *self.slot.started.lock(),
            ..Timing::default()
        };
        if r.mode != Stamps::Ends {
            for pair in ticks.chunks_exact(2).take(self.dispatches) {
                timing.dispatch_starts.push(span(first, pair[0]));
                timing.dispatches.push(span(pair[0], pair[1]));
            }
        }
        Ok(timing)
    }
}

impl BackendSubmission for WgpuSubmission {
    fn poll(&self) -> Option<Result<Timing>> {
        if self.error.is_none() {
            if self.slot.index.lock().is_none() {
                self.shared.flush();
            }
            if let Err(e) = self.shared.device.poll(wgpu::PollType::Poll) {
                self.shared.fail(format!("polling: {e}"));
            }
        }
        self.outcome()
    }

    fn wait(&self) -> Result<Timing> {
        if self.error.is_none() {
            if self.slot.index.lock().is_none() {
                self.shared.flush();
            }
            let wait = wgpu::PollType::Wait {
                submission_index: self.slot.index.lock().clone(),
                timeout: None,
            };
            if let Err(e) = self.shared.device.poll(wait) {
                self.shared.fail(format!("waiting for a submission: {e}"));
            }
        }
        // The work is done, but a callback (completion, map) may not have
        // run yet: waiting for everything runs them.
        for _ in 0..64 {
            if let Some(outcome) = self.outcome() {
                return outcome;
            }
            self.shared.wait_idle("waiting for a submission")?;
        }
        let cause = "a completed submission never reported its completion";
        self.shared.fail(cause.into());
        Err(self.failed(cause))
    }
}

/// A graph's program, prepared once and launched every replay.
pub(crate) struct WgpuExecutable(pub(crate) Prepared);

impl Executable for WgpuExecutable {
    fn launch(&self, uploads: &[Upload], timing: bool) -> Result<Box<dyn BackendSubmission>> {
        Ok(Box::new(self.0.launch(uploads, timing, true)?))
    }
}
