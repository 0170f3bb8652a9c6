//! The device's stream: kernel launches, completion events and timing.
//!
//! All work of a device goes to one stream in submission order, so a
//! program's concurrent groups run one dispatch after another here; native
//! graphs (see `graph.rs`) are where groups run concurrently. Completion of
//! a submission is an event recorded after its last launch.
//!
//! The launch a one-shot capture records runs here too (graphs run eagerly
//! when timed), inside an NVTX range for the step and one per dispatch, so
//! Nsight tools can attribute each kernel to its dispatch.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::Duration;

use cudarc::driver::sys::{self, CUevent, CUfunction, CUmodule, CUresult, CUstream};
use parking_lot::Mutex;

use super::driver::Context;
use super::nvtx;
use crate::backend::{BackendSubmission, Timing};
use crate::error::{Error, Result};
use crate::program::{DispatchRec, Program};
use crate::record::{ArgRec, Upload};

/// Dynamic shared memory a kernel may use without opting in.
const DEFAULT_SHARED_LIMIT: u32 = 48 << 10;

/// A compiled kernel: its module and entry point, and the sizes of the
/// entry point's parameters for checking dispatch arguments.
pub(crate) struct CudaKernel {
    pub(super) ctx: Arc<Context>,
    pub(super) module: CUmodule,
    pub(super) function: CUfunction,
    /// Byte size of each parameter; `None` if the driver cannot say.
    pub(super) params: Option<Vec<usize>>,
    /// Dynamic shared memory the function has been allowed so far.
    pub(super) shared_limit: AtomicU32,
}

// SAFETY: module and function handles are context-wide and usable from any
// thread where the context is current; the only mutation is atomic.
unsafe impl Send for CudaKernel {}
// SAFETY: as above.
unsafe impl Sync for CudaKernel {}

impl Drop for CudaKernel {
    fn drop(&mut self) {
        // Submissions and graphs retain the kernel, so nothing running uses
        // the module any more.
        if self.ctx.bind().is_ok() {
            // SAFETY: `module` was loaded in this context and is unloaded once.
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

impl CudaKernel {
    /// The driver function handle, for tools that launch it directly.
    pub(crate) fn function(&self) -> CUfunction {
        self.function
    }

    /// Raises the function's dynamic shared memory limit when a launch needs more.
    pub(super) fn allow_shared(&self, bytes: u32) -> Result<()> {
        if bytes <= DEFAULT_SHARED_LIMIT || bytes <= self.shared_limit.load(Ordering::Relaxed) {
            return Ok(());
        }
        // SAFETY: sets an attribute of a live function.
        let code = unsafe {
            sys::cuFuncSetAttribute(
                self.function,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        };
        self.ctx.check(code, || {
            format!("allow {bytes} bytes of dynamic shared memory")
        })?;
        self.shared_limit.fetch_max(bytes, Ordering::Relaxed);
        Ok(())
    }
}

/// Reusable storage for one launch's parameter values and the pointers to them.
pub(super) struct Params {
    /// Parameter values, 8-byte aligned; a buffer argument takes one word.
    words: Vec<u64>,
    /// Index in `words` where each parameter's value starts.
    starts: Vec<usize>,
    /// `kernelParams`: one pointer per parameter into `words`.
    pointers: Vec<*mut c_void>,
}

// SAFETY: the pointers only ever point into `words` of the same value and
// are rebuilt before each use; the struct is used under a mutex.
unsafe impl Send for Params {}

impl Params {
    pub(super) fn new() -> Params {
        Params {
            words: Vec::with_capacity(64),
            starts: Vec::with_capacity(16),
            pointers: Vec::with_capacity(16),
        }
    }

    /// Lays out the arguments of `d` as kernel parameters and returns the
    /// compiled kernel. Checks argument count and sizes when the driver
    /// reports the parameter list.
    pub(super) fn build<'p>(
        &mut self,
        program: &'p Program,
        d: &'p DispatchRec,
    ) -> Result<&'p CudaKernel> {
        let invalid = |reason: String| Error::InvalidDispatch {
            kernel: d.kernel.name().to_string(),
            label: d.label.to_string(),
            reason,
        };
        let kernel = d
            .kernel
            .artifact()
            .downcast_ref::<CudaKernel>()
            .ok_or_else(|| invalid("not a CUDA kernel".into()))?;
        let args = program.args_of(d);
        if let Some(sizes) = &kernel.params {
            if sizes.len() != args.len() {
                return Err(invalid(format!(
                    "the kernel takes {} parameters, the dispatch passes {}",
                    sizes.len(),
                    args.len()
                )));
            }
            for (i, (arg, &size)) in args.iter().zip(sizes).enumerate() {
                let given = match arg {
                    ArgRec::Buffer { .. } => 8,
                    ArgRec::Bytes { len, .. } => *len as usize,
                };
                if given != size {
                    return Err(invalid(format!(
                        "argument {i} is {given} bytes, the kernel's parameter {i} is {size}"
                    )));
                }
            }
        }
        self.words.clear();
        self.starts.clear();
        self.pointers.clear();
        for arg in args {
            let start = self.words.len();
            match *arg {
                ArgRec::Buffer { mem, offset, .. } => self.words.push(mem + offset as u64),
                ArgRec::Bytes { start: at, len } => {
                    let bytes = program
                        .bytes
                        .get(at as usize..at as usize + len as usize)
                        .ok_or_else(|| invalid("inline bytes out of range".into()))?;
                    self.words.resize(start + bytes.len().div_ceil(8).max(1), 0);
                    let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words[start..]);
                    dst[..bytes.len()].copy_from_slice(bytes);
                }
            }
            self.starts.push(start);
        }
        // Pointers are taken once `words` has stopped growing.
        let base = self.words.as_mut_ptr();
        for &start in &self.starts {
            // SAFETY: each start is below `words.len()`; `words` is not
            // resized again before the launch that reads these pointers.
            self.pointers.push(unsafe { base.add(start) }.cast());
        }
        kernel.allow_shared(d.launch.shared_bytes)?;
        Ok(kernel)
    }

    /// The `kernelParams` array for the last built dispatch.
    pub(super) fn pointers(&mut self) -> *mut *mut c_void {
        self.pointers.as_mut_ptr()
    }
}

/// One device's stream, its reusable events and its launch scratch.
pub(super) struct Queue {
    pub(super) ctx: Arc<Context>,
    pub(super) stream: CUstream,
    /// Held while enqueueing, so one submission's launches stay contiguous.
    pub(super) params: Mutex<Params>,
    events: Mutex<Vec<CUevent>>,
    /// The capture armed by [`Queue::arm_capture`], until a run takes it.
    capture: Mutex<Option<ArmedCapture>>,
}

/// A one-shot capture about to be launched: the next program run on
/// `thread` (the one that armed it) gets NVTX ranges named after `step`.
struct ArmedCapture {
    thread: ThreadId,
    step: String,
}

// SAFETY: the stream handle is usable from any thread with the context
// current; enqueueing is serialized by `params`, the event pool by its mutex.
unsafe impl Send for Queue {}
// SAFETY: as above.
unsafe impl Sync for Queue {}

impl Queue {
    pub(super) fn new(ctx: Arc<Context>) -> Result<Queue> {
        ctx.bind()?;
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: creates a stream in the current context. Non-blocking: it
        // does not synchronize with the legacy default stream.
        let code = unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        };
        ctx.check(code, || "create a stream".into())?;
        Ok(Queue {
            ctx,
            stream,
            params: Mutex::new(Params::new()),
            events: Mutex::new(Vec::new()),
            capture: Mutex::new(None),
        })
    }

    /// Marks the next program this thread runs as the captured step named
    /// `step`: it opens an NVTX range for the step and one per dispatch.
    pub(super) fn arm_capture(&self, step: &str) {
        *self.capture.lock() = Some(ArmedCapture {
            thread: std::thread::current().id(),
            step: format!("encore {step}"),
        });
    }

    /// Drops an armed capture that no run took (its launch failed first).
    pub(super) fn disarm_capture(&self) {
        self.capture.lock().take();
    }

    /// The step name of the capture armed by this thread, if any; taken
    /// once. Other threads' submissions never take it.
    fn take_capture(&self) -> Option<String> {
        let mut armed = self.capture.lock();
        let mine = armed
            .as_ref()
            .is_some_and(|a| a.thread == std::thread::current().id());
        if mine {
            armed.take().map(|a| a.step)
        } else {
            None
        }
    }

    /// A timing-capable event from the pool.
    pub(super) fn event(&self) -> Result<CUevent> {
        if let Some(e) = self.events.lock().pop() {
            return Ok(e);
        }
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: creates an event in the current context (callers bind first).
        let code =
            unsafe { sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) };
        self.ctx.check(code, || "create an event".into())?;
        Ok(event)
    }

    fn give_back(&self, events: impl IntoIterator<Item = CUevent>) {
        self.events.lock().extend(events);
    }

    /// Records `event` on the stream.
    pub(super) fn record(&self, event: CUevent) -> Result<()> {
        // SAFETY: both handles are live and belong to this context.
        let code = unsafe { sys::cuEventRecord(event, self.stream) };
        self.ctx.check(code, || "record an event".into())
    }

    /// Copies each upload's bytes to the device, in stream order. The driver
    /// stages pageable source memory before the call returns, so the bytes
    /// need not outlive it.
    pub(super) fn upload(&self, uploads: &[Upload]) -> Result<()> {
        for u in uploads {
            // SAFETY: the runtime bounds-checked `offset + len` against a
            // live allocation retained by the executable; the source slice
            // is valid for the call.
            let code = unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    u.mem + u.offset as u64,
                    u.bytes.as_ptr().cast(),
                    u.bytes.len(),
                    self.stream,
                )
            };
            self.ctx
                .check(code, || format!("upload {} parameter bytes", u.bytes.len()))?;
        }
        Ok(())
    }

    /// Waits for everything on the stream.
    pub(super) fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the stream is live.
        let code = unsafe { sys::cuStreamSynchronize(self.stream) };
        self.ctx.check(code, || "wait for submitted work".into())
    }

    /// Runs a program eagerly: uploads, then every dispatch in order, with
    /// a start and an end event (and an event pair per dispatch when timing).
    /// The captured step also gets its NVTX ranges.
    pub(super) fn run(
        self: &Arc<Self>,
        program: &Program,
        uploads: &[Upload],
        timing: bool,
    ) -> Result<Box<dyn BackendSubmission>> {
        let step = self.take_capture().filter(|_| nvtx::enabled());
        let mut params = self.params.lock();
        self.ctx.bind()?;
        self.ctx.usable()?;
        let mut pending = Pending::new(self);
        let outcome = self.enqueue(
            &mut params,
            program,
            uploads,
            timing,
            step.as_deref(),
            &mut pending,
        );
        drop(params);
        match outcome {
            Ok(()) => Ok(Box::new(pending.into_submission())),
            Err(e) => {
                // Launches already enqueued use memory the caller frees on
                // error: let them finish first.
                let _ = self.synchronize();
                Err(e)
            }
        }
    }

    /// Enqueues the uploads and launches of `run`. With `step`, the whole
    /// step and each dispatch (named by kernel and label, `matmul attn_q`)
    /// are NVTX ranges, closed on every path out.
    fn enqueue(
        &self,
        params: &mut Params,
        program: &Program,
        uploads: &[Upload],
        timing: bool,
        step: Option<&str>,
        pending: &mut Pending,
    ) -> Result<()> {
        let _step_range = step.map(nvtx::Range::push);
        self.upload(uploads)?;
        pending.start = self.event()?;
        self.record(pending.start)?;
        if timing {
            pending.marks.reserve(2 * program.dispatches.len());
        }
        for d in &program.dispatches {
            let _dispatch_range =
                step.map(|_| nvtx::Range::push(&format!("{} {}", d.kernel.name(), d.label)));
            let kernel = params.build(program, d)?;
            if timing {
                let e = self.event()?;
                pending.marks.push(e);
                self.record(e)?;
            }
            let l = &d.launch;
            // SAFETY: the function belongs to this context; `params` holds
            // one pointer per kernel parameter, each to a value of the
            // parameter's size (checked in `build` when the driver reports
            // sizes), and the driver copies the values before returning.
            // Device pointers in them are retained by the submission.
            let code = unsafe {
                sys::cuLaunchKernel(
                    kernel.function,
                    l.grid[0],
                    l.grid[1],
                    l.grid[2],
                    l.block[0],
                    l.block[1],
                    l.block[2],
                    l.shared_bytes,
                    self.stream,
                    params.pointers(),
                    std::ptr::null_mut(),
                )
            };
            if code != CUresult::CUDA_SUCCESS {
                return Err(self.ctx.error(
                    code,
                    format!("launch kernel {} (dispatch `{}`)", d.kernel.name(), d.label),
                ));
            }
            if timing {
                let e = self.event()?;
                pending.marks.push(e);
                self.record(e)?;
            }
        }
        pending.end = self.event()?;
        self.record(pending.end)
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: nothing else holds the queue; the stream is drained before
        // it and the pooled events are destroyed, once each.
        unsafe {
            sys::cuStreamSynchronize(self.stream);
            for e in self.events.get_mut().drain(..) {
                sys::cuEventDestroy_v2(e);
            }
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

/// The events of a submission being enqueued; returned to the pool if
/// enqueueing fails.
pub(super) struct Pending {
    queue: Arc<Queue>,
    pub(super) start: CUevent,
    pub(super) end: CUevent,
    pub(super) marks: Vec<CUevent>,
}

impl Pending {
    pub(super) fn new(queue: &Arc<Queue>) -> Pending {
        Pending {
            queue: queue.clone(),
            start: std::ptr::null_mut(),
            end: std::ptr::null_mut(),
            marks: Vec::new(),
        }
    }

    pub(super) fn into_submission(mut self) -> CudaSubmission {
        CudaSubmission {
            queue: self.queue.clone(),
            start: std::mem::replace(&mut self.start, std::ptr::null_mut()),
            end: std::mem::replace(&mut self.end, std::ptr::null_mut()),
            marks: std::mem::take(&mut self.marks),
            outcome: Mutex::new(None),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let events = [self.start, self.end]
            .into_iter()
            .chain(self.marks.drain(..))
            .filter(|e| !e.is_null());
        self.queue.give_back(events);
    }
}

/// How a submission ended, kept so later polls and waits report the same.
#[derive(Clone)]
enum Outcome {
    Done(Timing),
    Failed { operation: String, message: String },
}

/// Enqueued work: complete when its end event has been reached.
pub(super) struct CudaSubmission {
    queue: Arc<Queue>,
    start: CUevent,
    end: CUevent,
    /// Start and end event of each dispatch, when timing.
    marks: Vec<CUevent>,
    outcome: Mutex<Option<Outcome>>,
}

// SAFETY: event handles are context-wide; the outcome is behind a mutex.
unsafe impl Send for CudaSubmission {}
// SAFETY: as above.
unsafe impl Sync for CudaSubmission {}

impl CudaSubmission {
    fn report(&self, outcome: &Outcome) -> Result<Timing> {
        match outcome {
            Outcome::Done(t) => Ok(t.clone()),
            Outcome::Failed { operation, message } => Err(Error::Driver {
                device: self.queue.ctx.name.clone(),
                operation: operation.clone(),
                message: message.clone(),
            }),
        }
    }

    /// Settles the outcome after the end event completed (`code` success)
    /// or failed.
    fn settle(&self, code: CUresult) -> Outcome {
        if code != CUresult::CUDA_SUCCESS {
            let operation = "run submitted work".to_string();
            let message = self.queue.ctx.fault(code, &operation);
            return Outcome::Failed { operation, message };
        }
        match self.timing() {
            Ok(t) => Outcome::Done(t),
            Err(e) => Outcome::Failed {
                operation: "read event times".into(),
                message: e.to_string(),
            },
        }
    }

    /// Device times from the events. The host instant the work started at
    /// is left to the runtime (`started: None`): events say nothing about
    /// the host clock.
    fn timing(&self) -> Result<Timing> {
        let ctx = &self.queue.ctx;
        let total = elapsed(ctx, self.start, self.end)?;
        let mut dispatches = Vec::with_capacity(self.marks.len() / 2);
        let mut dispatch_starts = Vec::with_capacity(self.marks.len() / 2);
        for pair in self.marks.chunks_exact(2) {
            if let [begin, end] = *pair {
                dispatch_starts.push(elapsed(ctx, self.start, begin)?);
                dispatches.push(elapsed(ctx, begin, end)?);
            }
        }
        Ok(Timing {
            elapsed: total,
            dispatches,
            started: None,
            dispatch_starts,
        })
    }
}

fn elapsed(ctx: &Context, start: CUevent, end: CUevent) -> Result<Duration> {
    let mut ms = 0f32;
    // SAFETY: both events were recorded on this context's stream and have completed.
    let code = unsafe { sys::cuEventElapsedTime(&mut ms, start, end) };
    ctx.check(code, || "read event times".into())?;
    Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
}

impl BackendSubmission for CudaSubmission {
    fn poll(&self) -> Option<Result<Timing>> {
        let mut outcome = self.outcome.lock();
        if let Some(o) = &*outcome {
            return Some(self.report(o));
        }
        if let Err(e) = self.queue.ctx.bind() {
            return Some(Err(e));
        }
        // SAFETY: the event is live and was recorded on this context.
        let code = unsafe { sys::cuEventQuery(self.end) };
        if code == CUresult::CUDA_ERROR_NOT_READY {
            return None;
        }
        let settled = self.settle(code);
        let report = self.report(&settled);
        *outcome = Some(settled);
        Some(report)
    }

    fn wait(&self) -> Result<Timing> {
        let mut outcome = self.outcome.lock();
        if let Some(o) = &*outcome {
            return self.report(o);
        }
        self.queue.ctx.bind()?;
        // SAFETY: the event is live and was recorded on this context.
        let code = unsafe { sys::cuEventSynchronize(self.end) };
        let settled = self.settle(code);
        let report = self.report(&settled);
        *outcome = Some(settled);
        report
    }
}

impl Drop for CudaSubmission {
    fn drop(&mut self) {
        // Re-recording a pooled event later is harmless even if this one
        // never completed: nobody waits on it any more.
        let events = [self.start, self.end]
            .into_iter()
            .chain(self.marks.drain(..));
        self.queue.give_back(events);
    }
}
