//! The CPU backend: host memory, Rust kernels, a queue thread and a worker pool.
//!
//! Submissions run in order on one queue thread, like a device stream, with a
//! [`WorkerPool`] of the configured size installed on it. The dispatches of
//! one concurrent group run in parallel on the pool, and kernels spread their
//! own work over it ([`crate::parallel`]) when they run alone, so a wrong
//! hazard decision shows up as a wrong answer in tests rather than hiding
//! behind serial execution.

use std::alloc::Layout;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{Backend, BackendSubmission, Executable, Timing};
use crate::config::Config;
use crate::cpu_args::CpuArgs;
use crate::error::{Error, Result};
use crate::kernel::{CpuFn, KernelDef};
use crate::parallel::{self, WorkerPool};
use crate::program::{DispatchRec, Program};
use crate::record::{BackendKind, Capabilities, MemoryInfo, RawMem, Upload};

const ALIGN: usize = 64;

/// A description of the host CPU for device listings.
pub fn describe() -> String {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{} host CPU, {threads} threads", std::env::consts::ARCH)
}

struct Job {
    program: Arc<Program>,
    uploads: Vec<Upload>,
    timing: bool,
    done: Arc<Completion>,
}

#[derive(Default)]
struct Completion {
    outcome: Mutex<Option<Result<Timing, Failure>>>,
    cv: Condvar,
}

/// A failed dispatch, as reported by the queue thread.
#[derive(Clone, Debug)]
struct Failure {
    kernel: String,
    label: String,
    message: String,
}

impl From<&Failure> for Error {
    fn from(f: &Failure) -> Error {
        Error::KernelFailed {
            kernel: f.kernel.clone(),
            label: f.label.clone(),
            message: f.message.clone(),
        }
    }
}

struct CpuSubmission(Arc<Completion>);

impl CpuSubmission {
    fn outcome(r: &Result<Timing, Failure>) -> Result<Timing> {
        r.clone().map_err(|f| Error::from(&f))
    }
}

impl BackendSubmission for CpuSubmission {
    fn poll(&self) -> Option<Result<Timing>> {
        self.0.outcome.lock().as_ref().map(Self::outcome)
    }

    fn wait(&self) -> Result<Timing> {
        let mut g = self.0.outcome.lock();
        loop {
            if let Some(r) = g.as_ref() {
                return Self::outcome(r);
            }
            self.0.cv.wait(&mut g);
        }
    }
}

/// Submitted and completed job counts, to wait for an idle queue.
#[derive(Default)]
struct QueueState {
    counts: Mutex<(u64, u64)>,
    idle: Condvar,
}

struct Queue {
    sender: Mutex<Option<mpsc::Sender<Job>>>,
    state: Arc<QueueState>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Queue {
    fn push(&self, job: Job) -> Result<()> {
        self.state.counts.lock().0 += 1;
        let sent = match &*self.sender.lock() {
            Some(s) => s.send(job).is_ok(),
            None => false,
        };
        if sent {
            Ok(())
        } else {
            self.state.counts.lock().0 -= 1;
            Err(Error::DeviceFailed {
                device: "cpu".into(),
                cause: "the CPU queue thread has stopped".into(),
            })
        }
    }

    fn wait_idle(&self) {
        let mut c = self.state.counts.lock();
        while c.1 < c.0 {
            self.state.idle.wait(&mut c);
        }
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.sender.lock().take();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

/// The CPU backend.
pub(crate) struct CpuBackend {
    queue: Arc<Queue>,
    threads: usize,
}

impl CpuBackend {
    pub(crate) fn new(config: &Config) -> Result<CpuBackend> {
        let threads = config.cpu_threads();
        let pool = WorkerPool::new(threads)?;
        let (sender, receiver) = mpsc::channel::<Job>();
        let state = Arc::new(QueueState::default());
        let thread_state = state.clone();
        let thread = std::thread::Builder::new()
            .name("encore-cpu-queue".into())
            .spawn(move || {
                pool.install(|| {
                    for job in receiver {
                        let outcome = run_job(&job);
                        *job.done.outcome.lock() = Some(outcome);
                        job.done.cv.notify_all();
                        drop(job);
                        let mut c = thread_state.counts.lock();
                        c.1 += 1;
                        thread_state.idle.notify_all();
                    }
                })
            })
            .map_err(|e| Error::DeviceUnavailable {
                name: "cpu".into(),
                reason: format!("cannot start the queue thread: {e}"),
            })?;
        Ok(CpuBackend {
            queue: Arc::new(Queue {
                sender: Mutex::new(Some(sender)),
                state,
                thread: Mutex::new(Some(thread)),
            }),
            threads,
        })
    }
}

fn run_job(job: &Job) -> Result<Timing, Failure> {
    for u in &job.uploads {
        // SAFETY: uploads target parameter blocks retained by the executable;
        // the runtime bounds-checked `offset + len` against the allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                u.bytes.as_ptr(),
                (u.mem as usize + u.offset) as *mut u8,
                u.bytes.len(),
            );
        }
    }
    let program = &*job.program;
    let start = Instant::now();
    let (mut times, mut starts) = if job.timing {
        let n = program.dispatches.len();
        (vec![Duration::ZERO; n], vec![Duration::ZERO; n])
    } else {
        (Vec::new(), Vec::new())
    };
    for group in program.groups() {
        let dispatches = program.dispatches.get(group.clone()).unwrap_or(&[]);
        if dispatches.len() == 1 {
            let t = Instant::now();
            run_dispatch(program, &dispatches[0])?;
            if let (Some(time), Some(at)) =
                (times.get_mut(group.start), starts.get_mut(group.start))
            {
                *time = t.elapsed();
                *at = t.duration_since(start);
            }
        } else {
            let failures = Mutex::new(Vec::new());
            let group_times = Mutex::new(Vec::new());
            parallel::for_each(dispatches.len(), |k| {
                let Some(d) = dispatches.get(k) else { return };
                let t = Instant::now();
                if let Err(e) = run_dispatch(program, d) {
                    failures.lock().push((k, e));
                }
                group_times
                    .lock()
                    .push((k, t.duration_since(start), t.elapsed()));
            });
            let mut failures = failures.into_inner();
            failures.sort_by_key(|(k, _)| *k);
            if let Some((_, e)) = failures.into_iter().next() {
                return Err(e);
            }
            for (k, offset, time) in group_times.into_inner() {
                if let (Some(slot), Some(at)) = (
                    times.get_mut(group.start + k),
                    starts.get_mut(group.start + k),
                ) {
                    *slot = time;
                    *at = offset;
                }
            }
        }
    }
    Ok(Timing {
        elapsed: start.elapsed(),
        dispatches: times,
        started: Some(start),
        dispatch_starts: starts,
    })
}

fn run_dispatch(program: &Program, d: &DispatchRec) -> Result<(), Failure> {
    let fail = |message: String| Failure {
        kernel: d.kernel.name().to_string(),
        label: d.label.to_string(),
        message,
    };
    let Some(body) = d.kernel.artifact().downcast_ref::<CpuFn>() else {
        return Err(fail("not a CPU kernel".into()));
    };
    let args = CpuArgs::new(program.args_of(d), &program.bytes);
    match catch_unwind(AssertUnwindSafe(|| body(&args))) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(message)) => Err(fail(message)),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panicked".into());
            Err(fail(format!("panicked: {message}")))
        }
    }
}

struct CpuExecutable {
    queue: Arc<Queue>,
    program: Arc<Program>,
}

impl Executable for CpuExecutable {
    fn launch(&self, uploads: &[Upload], timing: bool) -> Result<Box<dyn BackendSubmission>> {
        submit(&self.queue, self.program.clone(), uploads.to_vec(), timing)
    }
}

fn submit(
    queue: &Queue,
    program: Arc<Program>,
    uploads: Vec<Upload>,
    timing: bool,
) -> Result<Box<dyn BackendSubmission>> {
    let done = Arc::new(Completion::default());
    queue.push(Job {
        program,
        uploads,
        timing,
        done: done.clone(),
    })?;
    Ok(Box::new(CpuSubmission(done)))
}

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // Kernels are Rust functions: nothing to compile per shape.
            specialization: false,
            early_launch: false,
            // A replay boundary costs nothing measurable here, and a longer
            // program only takes longer to instantiate.
            steps_per_replay: 2,
            // A fused body runs the products it fuses one after another,
            // where unfused they run side by side in one concurrent group.
            fusion_pays: false,
            exact_by_default: true,
        }
    }

    fn name(&self) -> &str {
        "cpu"
    }

    fn memory(&self) -> Result<Option<MemoryInfo>> {
        Ok(crate::host::memory())
    }

    fn arch(&self) -> String {
        std::env::consts::ARCH.to_string()
    }

    fn toolchain(&self) -> String {
        format!("rust-{}-threads", self.threads)
    }

    fn alloc(&self, bytes: usize) -> Result<RawMem> {
        let layout =
            Layout::from_size_align(bytes.max(1), ALIGN).map_err(|_| Error::OutOfMemory {
                device: "cpu".into(),
                bytes,
            })?;
        // SAFETY: the layout has a nonzero size. Zeroing makes every byte
        // initialized, so kernels may view the memory as any `Pod` type.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::OutOfMemory {
                device: "cpu".into(),
                bytes,
            });
        }
        Ok(ptr as RawMem)
    }

    fn free(&self, mem: RawMem, bytes: usize) {
        if let Ok(layout) = Layout::from_size_align(bytes.max(1), ALIGN) {
            // SAFETY: `mem` came from `alloc` with this same layout, and the
            // pool frees it only when no buffer, submission or graph holds it.
            unsafe { std::alloc::dealloc(mem as *mut u8, layout) };
        }
    }

    fn write(&self, mem: RawMem, offset: usize, data: &[u8]) -> Result<()> {
        self.queue.wait_idle();
        // SAFETY: the caller checked `offset + data.len()` against the
        // buffer, and no submitted work is running (waited above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (mem as usize + offset) as *mut u8,
                data.len(),
            );
        }
        Ok(())
    }

    fn read(&self, mem: RawMem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.queue.wait_idle();
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (mem as usize + offset) as *const u8,
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    fn compile(&self, def: &KernelDef) -> Result<Arc<dyn Any + Send + Sync>> {
        match def.cpu_impl() {
            Some(f) => Ok(Arc::new(f.clone())),
            None => Err(Error::Unsupported {
                op: def.name().to_string(),
                backend: BackendKind::Cpu,
            }),
        }
    }

    fn submit(
        &self,
        program: Arc<Program>,
        uploads: Vec<Upload>,
        timing: bool,
    ) -> Result<Box<dyn BackendSubmission>> {
        submit(&self.queue, program, uploads, timing)
    }

    fn instantiate(&self, program: Arc<Program>) -> Result<Box<dyn Executable>> {
        Ok(Box::new(CpuExecutable {
            queue: self.queue.clone(),
            program,
        }))
    }

    fn synchronize(&self) -> Result<()> {
        self.queue.wait_idle();
        Ok(())
    }

    fn failure(&self) -> Option<String> {
        None
    }
}
