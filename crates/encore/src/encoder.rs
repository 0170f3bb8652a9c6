//! The encoder: records dispatches with their declared access, derives the
//! barriers between them, and submits them as one batch.
//!
//! Every buffer argument says whether the kernel reads it, writes it or both,
//! over the byte range of the (view of the) buffer bound (invariant 2). The
//! [`HazardTracker`](crate::hazard::HazardTracker) closes the current
//! concurrent group exactly when a new dispatch conflicts with it, so
//! dispatches that touch disjoint data run together and ordered ones never do.

use crate::buffer::Buffer;
use crate::counters::Counters;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::graph::{Graph, Node, NodeArg};
use crate::hazard::{AccessRange, HazardTracker};
use crate::kernel::Kernel;
use crate::program::{DispatchRec, Program};
use crate::record::{Access, ArgRec};
use crate::retain::Retained;
use crate::submission::Submission;
use crate::Label;

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

/// Records dispatches and barriers, then commits them as one submission, or,
/// when made by [`Device::capture`], records them as the nodes of a
/// [`Graph`].
///
/// ```
/// use encore::{Arg, Device, KernelDef};
/// let device = Device::cpu()?;
/// let fill = device.load_kernel(&KernelDef::new("fill").cpu("fill v1", |a| {
///     let value: f32 = a.scalar(1)?;
///     a.write::<f32>(0)?.fill(value);
///     Ok(())
/// }))?;
/// let buf = device.alloc(16 * 4)?;
/// let mut enc = device.encoder();
/// enc.dispatch(&fill, &[Arg::write(&buf), Arg::value(&2.5f32)], "fill")?;
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
    /// While capturing, the graph's nodes; the program then stays empty.
    nodes: Option<Vec<Node>>,
}

impl Device {
    /// An encoder whose dispatches run when it commits.
    pub fn encoder(&self) -> Encoder {
        Encoder::new(self.clone(), None)
    }

    /// An encoder that records its dispatches as graph nodes, for
    /// [`Encoder::finish_graph`], instead of running them.
    pub fn capture(&self) -> Encoder {
        Encoder::new(self.clone(), Some(Vec::new()))
    }
}

impl Encoder {
    fn new(device: Device, nodes: Option<Vec<Node>>) -> Encoder {
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
            nodes,
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

    /// Dispatches recorded since the last commit (or since capture began).
    pub fn len(&self) -> usize {
        match &self.nodes {
            Some(nodes) => nodes.len(),
            None => self.program.dispatches.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether this encoder records a graph ([`Device::capture`]).
    pub fn is_capturing(&self) -> bool {
        self.nodes.is_some()
    }

    /// The device this encoder records for.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Records one dispatch of `kernel` over `args`. Its launch geometry,
    /// where the backend has one, comes from the kernel's implementation
    /// for the backend (see [`crate::CudaKernel`]).
    pub fn dispatch(
        &mut self,
        kernel: &Kernel,
        args: &[Arg<'_>],
        label: impl Into<Label>,
    ) -> Result<()> {
        let label = label.into();
        if kernel.key().backend != self.device.kind() {
            return Err(self.invalid(kernel, &label, "kernel was loaded for another backend"));
        }
        self.accesses.clear();
        for arg in args {
            if let Arg::Buffer(buf, access) = *arg {
                if buf.alloc.device_id != self.device.id() {
                    return Err(Error::WrongDevice("dispatch"));
                }
                self.accesses.push(AccessRange {
                    alloc: buf.alloc.id,
                    start: buf.offset,
                    end: buf.offset + buf.len,
                    write: access.writes(),
                });
            }
        }
        if let Some(reason) = self_overlap(&self.accesses) {
            return Err(self.invalid(kernel, &label, reason));
        }
        if self.nodes.is_some() {
            // The geometry is computed again at instantiation; computing it
            // here reports a value it cannot read where it was recorded.
            let value: Vec<u8> = args
                .iter()
                .filter_map(|arg| match arg {
                    Arg::Bytes(bytes) => Some(*bytes),
                    Arg::Buffer(..) => None,
                })
                .flatten()
                .copied()
                .collect();
            if let Err(reason) = self.device.backend().launch(kernel, &value) {
                return Err(self.invalid(kernel, &label, &reason));
            }
        }
        if let Some(nodes) = &mut self.nodes {
            let args = args
                .iter()
                .map(|arg| match *arg {
                    Arg::Buffer(buf, access) => NodeArg::Buffer(buf.clone(), access),
                    Arg::Bytes(bytes) => NodeArg::Bytes(bytes.to_vec()),
                })
                .collect();
            nodes.push(Node {
                kernel: kernel.clone(),
                args,
                label,
            });
            return Ok(());
        }

        let (args_start, bytes_start) = (self.program.args.len(), self.program.bytes.len());
        for arg in args {
            match *arg {
                Arg::Buffer(buf, access) => self.program.args.push(ArgRec::Buffer {
                    mem: buf.alloc.mem,
                    offset: buf.offset,
                    len: buf.len,
                    access,
                }),
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
        let value = self.program.bytes.get(bytes_start..).unwrap_or(&[]);
        let launch = match self.device.backend().launch(kernel, value) {
            Ok(launch) => launch,
            Err(reason) => {
                self.program.args.truncate(args_start);
                self.program.bytes.truncate(bytes_start);
                return Err(self.invalid(kernel, &label, &reason));
            }
        };
        for arg in args {
            if let Arg::Buffer(buf, _) = arg {
                self.retained.retain_allocation(&buf.alloc);
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
    /// Graphs order nodes by declared access only, so a capturing encoder
    /// keeps no barriers.
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
    fn take(&mut self) -> (Program, Retained, Counters) {
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

    /// Discards everything recorded since the last commit (or since capture began).
    pub fn reset(&mut self) {
        let _ = self.take();
        if let Some(nodes) = &mut self.nodes {
            nodes.clear();
        }
    }

    /// Submits everything recorded since the last commit. A capturing
    /// encoder runs nothing: it refuses.
    pub fn commit(&mut self) -> Result<Submission> {
        if self.is_capturing() {
            return Err(Error::Graph(
                "a capturing encoder records a graph; finish it with finish_graph".into(),
            ));
        }
        let label = self.label.clone();
        let (program, retained, counts) = self.take();
        self.device.submit(program, retained, counts, label)
    }

    /// Ends a capture ([`Device::capture`]) and returns the recorded
    /// dispatches as a [`Graph`]; the encoder goes on capturing a new one.
    pub fn finish_graph(&mut self) -> Result<Graph> {
        let nodes = self.nodes.as_mut().ok_or_else(|| {
            Error::Graph(
                "finish_graph on an encoder that is not capturing (use Device::capture)".into(),
            )
        })?;
        Ok(Graph::new(self.device.clone(), std::mem::take(nodes)))
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
            retained.retain_allocation(&b.alloc);
        }
        retained.retain_kernel(kernel);
    }
    drop(std::hint::black_box(retained));
    start.elapsed()
}
