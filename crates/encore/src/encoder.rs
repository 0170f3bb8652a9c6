//! The encoder: records dispatches with their declared access, derives the
//! barriers between them, and submits them as one batch.
//!
//! Every buffer argument says whether the kernel reads it, writes it or both,
//! over the byte range of the (view of the) buffer bound (invariant 2). The
//! [`HazardTracker`](crate::hazard::HazardTracker) closes the current
//! concurrent group exactly when a new dispatch conflicts with it, so
//! dispatches that touch disjoint data run together and ordered ones never do.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::backend::{ArgRec, DispatchRec, Program};
use crate::buffer::{Allocation, Buffer};
use crate::counters::Counters;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::graph::{Graph, Node, NodeArg};
use crate::hazard::{AccessRange, HazardTracker};
use crate::kernel::Kernel;
use crate::submission::Submission;
use crate::Label;

/// How a dispatch uses a buffer argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    Write,
    ReadWrite,
}

impl Access {
    pub fn reads(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }
    pub fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }
}

/// Launch geometry: a grid of blocks of threads, and dynamic shared memory.
/// CPU kernels read it as a description of the work (for example rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
}

impl Launch {
    /// `grid` blocks of `block` threads in one dimension.
    pub fn new(grid: u32, block: u32) -> Launch {
        Launch {
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            shared_bytes: 0,
        }
    }

    /// Enough blocks of `block` threads to cover `threads` threads.
    pub fn cover(threads: u32, block: u32) -> Launch {
        Launch::new(threads.div_ceil(block.max(1)).max(1), block)
    }

    /// A 3-D grid.
    pub fn grid3(grid: [u32; 3], block: [u32; 3]) -> Launch {
        Launch {
            grid,
            block,
            shared_bytes: 0,
        }
    }

    /// The same launch with `bytes` of dynamic shared memory.
    pub fn with_shared(mut self, bytes: u32) -> Launch {
        self.shared_bytes = bytes;
        self
    }
}

/// One argument of a dispatch.
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    /// A buffer or view and how the kernel accesses it.
    Buffer(&'a Buffer, Access),
    /// Small inline bytes (scalars, shapes), copied at encode time.
    Bytes(&'a [u8]),
}

impl<'a> Arg<'a> {
    pub fn read(buffer: &'a Buffer) -> Arg<'a> {
        Arg::Buffer(buffer, Access::Read)
    }
    pub fn write(buffer: &'a Buffer) -> Arg<'a> {
        Arg::Buffer(buffer, Access::Write)
    }
    pub fn read_write(buffer: &'a Buffer) -> Arg<'a> {
        Arg::Buffer(buffer, Access::ReadWrite)
    }
    /// The bytes of a plain value (`u32`, `f32`, a `#[repr(C)]` struct).
    pub fn value<T: bytemuck::Pod>(value: &'a T) -> Arg<'a> {
        Arg::Bytes(bytemuck::bytes_of(value))
    }
}

/// Hashes allocation ids (already unique integers) by identity.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Everything a submission or graph keeps alive: each allocation and kernel
/// bound into it, once.
#[derive(Default)]
pub(crate) struct Retained {
    pub(crate) allocations: IdMap<Arc<Allocation>>,
    pub(crate) kernels: Vec<Kernel>,
    /// Other owners of device state, such as a replayed graph executable;
    /// held only so they outlive the work.
    #[allow(dead_code)]
    pub(crate) keep: Vec<crate::graph::Keep>,
}

impl Retained {
    fn retain_buffer(&mut self, buf: &Buffer) {
        self.allocations
            .entry(buf.alloc.id)
            .or_insert_with(|| buf.alloc.clone());
    }

    fn retain_kernel(&mut self, kernel: &Kernel) {
        if !self.kernels.iter().any(|k| k.same(kernel)) {
            self.kernels.push(kernel.clone());
        }
    }
}

/// Records dispatches and barriers, then commits them as one submission.
///
/// ```
/// use encore::{Arg, Device, KernelDef, Launch};
/// let device = Device::cpu()?;
/// let fill = device.load_kernel(&KernelDef::new("fill").cpu("fill v1", |a| {
///     let value: f32 = a.scalar(1)?;
///     a.write::<f32>(0)?.fill(value);
///     Ok(())
/// }))?;
/// let buf = device.alloc(16 * 4)?;
/// let mut enc = device.encoder();
/// enc.dispatch(&fill, &[Arg::write(&buf), Arg::value(&2.5f32)], Launch::new(1, 1), "fill")?;
/// enc.commit_and_wait()?;
/// assert_eq!(buf.download::<f32>()?, vec![2.5; 16]);
/// # Ok::<(), encore::Error>(())
/// ```
pub struct Encoder {
    device: Device,
    program: Program,
    tracker: HazardTracker,
    accesses: Vec<AccessRange>,
    retained: Retained,
    counts: Counters,
    serial: bool,
    label: Label,
}

impl Encoder {
    pub(crate) fn new(device: Device) -> Encoder {
        let serial = device.config().serial;
        Encoder {
            device,
            program: Program::default(),
            tracker: HazardTracker::default(),
            accesses: Vec::with_capacity(8),
            retained: Retained::default(),
            counts: Counters::default(),
            serial,
            label: Label::from("submission"),
        }
    }

    /// Names the next submission (for profiles and errors).
    pub fn set_label(&mut self, label: impl Into<Label>) {
        self.label = label.into();
    }

    /// Turns hazard tracking into a barrier after every dispatch (or back).
    pub fn set_serial(&mut self, serial: bool) {
        self.serial = serial;
    }

    /// Dispatches recorded since the last commit.
    pub fn len(&self) -> usize {
        self.program.dispatches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.program.dispatches.is_empty()
    }

    /// The device this encoder records for.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Records one dispatch of `kernel` over `args`.
    pub fn dispatch(
        &mut self,
        kernel: &Kernel,
        args: &[Arg<'_>],
        launch: Launch,
        label: impl Into<Label>,
    ) -> Result<()> {
        let label = label.into();
        if kernel.key().backend != self.device.kind() {
            return Err(self.invalid(kernel, &label, "kernel was loaded for another backend"));
        }
        self.accesses.clear();
        let args_start = self.program.args.len();
        for arg in args {
            match *arg {
                Arg::Buffer(buf, access) => {
                    if buf.alloc.device_id != self.device.id() {
                        self.program.args.truncate(args_start);
                        return Err(Error::WrongDevice("dispatch"));
                    }
                    self.accesses.push(AccessRange {
                        alloc: buf.alloc.id,
                        start: buf.offset,
                        end: buf.offset + buf.len,
                        write: access.writes(),
                    });
                    self.program.args.push(ArgRec::Buffer {
                        mem: buf.alloc.mem,
                        alloc: buf.alloc.id,
                        offset: buf.offset,
                        len: buf.len,
                        access,
                    });
                }
                Arg::Bytes(bytes) => {
                    let start = self.program.bytes.len();
                    self.program.bytes.extend_from_slice(bytes);
                    self.program.args.push(ArgRec::Bytes {
                        start: start as u32,
                        len: bytes.len() as u32,
                    });
                }
            }
        }
        if let Some(reason) = self_overlap(&self.accesses) {
            self.program.args.truncate(args_start);
            return Err(self.invalid(kernel, &label, reason));
        }
        for arg in args {
            if let Arg::Buffer(buf, _) = arg {
                self.retained.retain_buffer(buf);
            }
        }
        self.retained.retain_kernel(kernel);

        if self.tracker.group_len() > 0 {
            if self.serial || self.tracker.conflicts(&self.accesses) {
                self.counts.auto_barriers += 1;
                self.close_group();
            } else {
                self.counts.concurrent_dispatches += 1;
            }
        }
        self.tracker.add(&self.accesses);
        self.program.dispatches.push(DispatchRec {
            kernel: kernel.clone(),
            args: args_start as u32..self.program.args.len() as u32,
            launch,
            label,
        });
        self.counts.dispatches += 1;
        Ok(())
    }

    /// Orders everything recorded so far before everything recorded next.
    pub fn barrier(&mut self) {
        if self.tracker.group_len() > 0 {
            self.close_group();
        }
    }

    fn close_group(&mut self) {
        self.program
            .group_ends
            .push(self.program.dispatches.len() as u32);
        self.tracker.clear();
        self.counts.barriers += 1;
    }

    fn invalid(&self, kernel: &Kernel, label: &Label, reason: &str) -> Error {
        Error::InvalidDispatch {
            kernel: kernel.name().to_string(),
            label: label.to_string(),
            reason: reason.to_string(),
        }
    }

    /// Takes the recorded program and what it retains, leaving the encoder empty.
    pub(crate) fn take(&mut self) -> (Program, Retained, Counters) {
        if self.tracker.group_len() > 0 {
            self.program
                .group_ends
                .push(self.program.dispatches.len() as u32);
            self.tracker.clear();
        }
        (
            std::mem::take(&mut self.program),
            std::mem::take(&mut self.retained),
            std::mem::take(&mut self.counts),
        )
    }

    /// Discards everything recorded since the last commit.
    pub fn reset(&mut self) {
        let _ = self.take();
    }

    /// Submits everything recorded since the last commit.
    pub fn commit(&mut self) -> Result<Submission> {
        let label = self.label.clone();
        let (program, retained, counts) = self.take();
        self.device.submit(program, retained, counts, label)
    }

    /// Ends recording and returns the recorded dispatches as a [`Graph`]
    /// instead of running them. Graphs order nodes by declared access only;
    /// explicit barriers are not kept.
    pub fn finish_graph(&mut self) -> Result<Graph> {
        let (program, retained, _) = self.take();
        let mut nodes = Vec::with_capacity(program.dispatches.len());
        for d in &program.dispatches {
            let mut args = Vec::with_capacity(d.args.len());
            for arg in program.args_of(d) {
                args.push(match *arg {
                    ArgRec::Buffer {
                        alloc,
                        offset,
                        len,
                        access,
                        ..
                    } => {
                        let alloc = retained.allocations.get(&alloc).ok_or_else(|| {
                            Error::Graph("a recorded buffer was not retained".into())
                        })?;
                        NodeArg::Buffer(
                            Buffer {
                                alloc: alloc.clone(),
                                offset,
                                len,
                                device: self.device.clone(),
                            },
                            access,
                        )
                    }
                    ArgRec::Bytes { start, len } => NodeArg::Bytes(
                        program
                            .bytes
                            .get(start as usize..(start + len) as usize)
                            .unwrap_or(&[])
                            .to_vec(),
                    ),
                });
            }
            nodes.push(Node {
                kernel: d.kernel.clone(),
                args,
                launch: d.launch,
                label: d.label.clone(),
            });
        }
        Ok(Graph::new(self.device.clone(), nodes))
    }

    /// Submits and waits for completion.
    pub fn commit_and_wait(&mut self) -> Result<Submission> {
        let submission = self.commit()?;
        submission.wait()?;
        Ok(submission)
    }
}

/// A dispatch may not write bytes that another of its own arguments binds:
/// kernels get plain slices, and such aliasing would make them unsound.
fn self_overlap(accesses: &[AccessRange]) -> Option<&'static str> {
    for (i, a) in accesses.iter().enumerate() {
        for b in &accesses[i + 1..] {
            if a.conflicts(b) {
                return Some("a written argument overlaps another argument of the same dispatch (bind it once as read_write)");
            }
        }
    }
    None
}

/// Host time of a submission's lifetime retention alone, for benchmarks:
/// the bookkeeping [`Encoder::dispatch`] does for each of `dispatches`
/// (every buffer it binds and its kernel, deduplicated), then the release a
/// completed submission does. Lets a benchmark set the cost of invariant 1
/// against the time of the step it protects.
#[doc(hidden)]
pub fn retention_cost(dispatches: &[(&Kernel, &[Buffer])]) -> std::time::Duration {
    let start = std::time::Instant::now();
    let mut retained = Retained::default();
    for (kernel, buffers) in dispatches {
        for b in *buffers {
            retained.retain_buffer(b);
        }
        retained.retain_kernel(kernel);
    }
    drop(std::hint::black_box(retained));
    start.elapsed()
}
