//! A small pool of worker threads for CPU kernels, with fork/join in a
//! microsecond or two.
//!
//! ```
//! use encore::parallel::{self, WorkerPool};
//!
//! let pool = WorkerPool::new(2)?;
//! let mut squares = vec![0u64; 1000];
//! pool.install(|| {
//!     // Ten tasks of 100 elements, spread over the pool's two threads.
//!     parallel::for_each_chunk_mut(&mut squares, 100, |c, chunk| {
//!         for (i, s) in chunk.iter_mut().enumerate() {
//!             let n = (c * 100 + i) as u64;
//!             *s = n * n;
//!         }
//!     });
//! });
//! assert_eq!(squares[999], 999 * 999);
//! # Ok::<(), encore::Error>(())
//! ```
//!
//! # Why not rayon
//!
//! Decoding one token on the CPU runs about 500 kernels, most of them split
//! over the threads, each for a few to a few tens of microseconds. Rayon's
//! idle workers go to sleep within microseconds and take several to wake, and
//! its work stealing adds a little to every split; together that cost about a
//! fifth of the decode time. This pool works much as ggml's does instead: the
//! thread that installed it opens a job by bumping a counter, the workers spin
//! on that counter for a while after each job (then sleep on a condition
//! variable, so an idle pool costs nothing), and every thread takes task
//! indices from a shared atomic counter. When no task is left to take, the
//! caller closes the job and waits only for the workers that joined it: one
//! that the operating system has not run meanwhile (the machine may be busy
//! with other work) is not waited for.
//!
//! Tasks must not block on each other. A task that calls [`for_each`] runs
//! its inner tasks itself, serially, as does code outside any installed pool.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// How long an idle worker waits for the next job before it sleeps. Decode
/// kernels follow each other within microseconds and tokens within a few
/// hundred; sleeping sooner would pay a wake-up on most jobs.
const SPIN_TIME: Duration = Duration::from_millis(1);
/// Spins of an idle worker before it starts yielding its core between looks
/// at the counter: on a machine busier than the pool has threads, the thread
/// that will open the next job may be waiting for that core.
const WORKER_SPINS: u32 = 256;
/// Spins of the publishing thread, waiting for the workers to finish, before
/// it starts yielding its core to them (it matters only when the machine is
/// busier than the pool has threads).
const CALLER_SPINS: u32 = 1 << 14;

thread_local! {
    /// The pool installed on this thread, null when none (always, on workers)
    /// and while this thread runs one of the pool's tasks.
    static CURRENT: Cell<*const Shared> = const { Cell::new(std::ptr::null()) };
}

/// A team of threads that [`for_each`] spreads tasks over, once installed on
/// the calling thread with [`WorkerPool::install`]. The calling thread is one
/// of the team: a pool of `n` threads starts `n - 1`.
pub struct WorkerPool {
    shared: Arc<Shared>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

/// One published job: a type-erased `&F` and the task count.
#[derive(Clone, Copy)]
struct Job {
    data: *const (),
    call: unsafe fn(*const (), usize),
    tasks: usize,
}

/// The state the installing thread shares with the workers.
struct Shared {
    /// Written only by the installing thread while no job is open and no
    /// worker has joined one (`joined == 0`).
    job: UnsafeCell<Job>,
    /// Bumped to open a job (it becomes odd) and again to close it (even).
    state: AtomicUsize,
    /// The next task index to take.
    next: AtomicUsize,
    /// Workers inside the current job: a worker counts itself in before it
    /// checks that the job is open, and out when it has no task left.
    joined: AtomicUsize,
    /// The first panic of a task on a worker, re-raised by the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Workers asleep on `wake`, and the lock that orders them with publishing.
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    /// Set when the pool is dropped.
    stop: AtomicBool,
    /// Set while the pool is installed on some thread.
    installed: AtomicBool,
    threads: usize,
}

// SAFETY: `job` is the only field that is not `Sync` by itself. It is written
// by the installing thread only between jobs: after it closed the last one and
// saw `joined == 0`, so every worker that read the old job is done with it,
// and a worker that joins later finds the job closed and does not read it
// until the next one is opened (after the write). The closure it points at is
// `Sync` and stays alive until `run` has seen `joined == 0`.
unsafe impl Sync for Shared {}
// SAFETY: as above; a `Job` is plain data plus a pointer to a `Sync` closure.
unsafe impl Send for Shared {}

impl WorkerPool {
    /// A pool of `threads` threads in all: the installing thread and
    /// `threads - 1` workers (none when `threads <= 1`).
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] when a worker thread cannot be started.
    pub fn new(threads: usize) -> Result<WorkerPool> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(Job {
                data: std::ptr::null(),
                call: noop,
                tasks: 0,
            }),
            state: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            joined: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            installed: AtomicBool::new(false),
            threads,
        });
        let mut pool = WorkerPool {
            shared,
            workers: Vec::with_capacity(threads - 1),
        };
        for i in 1..threads {
            let shared = pool.shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("encore-cpu-{i}"))
                .spawn(move || shared.serve())
                .map_err(|e| Error::DeviceUnavailable {
                    name: "cpu".into(),
                    reason: format!("cannot start worker thread {i} of {threads}: {e}"),
                })?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// The number of threads, the installing one included.
    pub fn threads(&self) -> usize {
        self.shared.threads
    }

    /// Runs `f` with this pool installed on the calling thread, so that
    /// [`for_each`] called from `f` spreads over the pool. A pool serves one
    /// thread at a time: where it is already installed on another thread (or
    /// further up on this one), `f` runs with whatever was installed before.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.shared.installed.swap(true, Ordering::Acquire) {
            return f();
        }
        struct Restore<'a> {
            previous: *const Shared,
            installed: &'a AtomicBool,
        }
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.previous));
                self.installed.store(false, Ordering::Release);
            }
        }
        let _restore = Restore {
            previous: CURRENT.with(|c| c.replace(Arc::as_ptr(&self.shared))),
            installed: &self.shared.installed,
        };
        f()
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _lock = self.shared.sleep_lock.lock();
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

unsafe fn noop(_: *const (), _: usize) {}

/// Calls the `F` that `data` points at with task `i`.
///
/// # Safety
/// `data` must point at a live `F`.
unsafe fn call<F: Fn(usize) + Sync>(data: *const (), i: usize) {
    // SAFETY: the caller guarantees `data` is a live `F`.
    let f = unsafe { &*data.cast::<F>() };
    f(i);
}

impl Shared {
    /// Runs `tasks` tasks of `f` over the team and returns when all are done.
    /// Must be called only by the thread the pool is installed on.
    fn run<F: Fn(usize) + Sync>(&self, tasks: usize, f: &F) {
        let job = Job {
            data: (f as *const F).cast(),
            call: call::<F>,
            tasks,
        };
        // SAFETY: no job is open and no worker is inside one (see `Shared`).
        unsafe { *self.job.get() = job };
        self.next.store(0, Ordering::Relaxed);
        // Opens the job, publishing it and `next` to the workers.
        self.state.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = self.sleep_lock.lock();
            self.wake.notify_all();
        }
        // This thread takes tasks too, with the pool uninstalled so that a
        // nested `for_each` runs serially.
        let previous = CURRENT.with(|c| c.replace(std::ptr::null()));
        let mine = catch_unwind(AssertUnwindSafe(|| self.work(job)));
        CURRENT.with(|c| c.set(previous));
        // No task is left to take: close the job, then wait for the workers
        // inside it to finish theirs. The closure must outlive every worker's
        // use of it, so this waits even when a task panicked.
        self.state.fetch_add(1, Ordering::SeqCst);
        let mut spins = 0u32;
        while self.joined.load(Ordering::SeqCst) != 0 {
            if spins < CALLER_SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // Take the workers' panic even when re-raising this thread's, so
        // that it is not reported by the next job.
        let theirs = self.panic.lock().take();
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if let Some(p) = theirs {
            resume_unwind(p);
        }
    }

    /// Takes task indices of `job` until none are left.
    fn work(&self, job: Job) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= job.tasks {
                return;
            }
            // SAFETY: `job.data` points at the closure of the `run` in
            // progress, which does not return before every worker that joined
            // the job has left it, and `call` was made for its type.
            unsafe { (job.call)(job.data, i) };
        }
    }

    /// A worker's life: wait for a job to open, join it, take tasks, repeat.
    fn serve(&self) {
        let mut seen = 0;
        while self.wait_for_job(seen) {
            self.joined.fetch_add(1, Ordering::SeqCst);
            let state = self.state.load(Ordering::SeqCst);
            if state % 2 == 1 {
                seen = state;
                // SAFETY: the job is open and this worker has joined it, so
                // the installing thread wrote it before opening it and will
                // not write it again before this worker leaves (see `Shared`).
                let job = unsafe { *self.job.get() };
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| self.work(job))) {
                    self.panic.lock().get_or_insert(p);
                }
            }
            self.joined.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Whether a job other than `seen` is open.
    fn has_job(&self, seen: usize) -> bool {
        let state = self.state.load(Ordering::SeqCst);
        state % 2 == 1 && state != seen
    }

    /// Waits until a job other than `seen` is open (true) or the pool stops
    /// (false): spinning for [`SPIN_TIME`], then asleep.
    fn wait_for_job(&self, seen: usize) -> bool {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if self.has_job(seen) {
                return true;
            }
            if self.stop.load(Ordering::Relaxed) {
                return false;
            }
            if spins < WORKER_SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            if start.elapsed() < SPIN_TIME {
                std::thread::yield_now();
                continue;
            }
            let mut lock = self.sleep_lock.lock();
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            // A job opened after this check finds `sleepers > 0` and
            // notifies under the lock, which this thread holds until it waits.
            while !self.has_job(seen) && !self.stop.load(Ordering::SeqCst) {
                self.wake.wait(&mut lock);
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// The number of threads [`for_each`] spreads over when called from here: the
/// installed pool's, or 1 outside a pool and inside a task.
pub fn threads() -> usize {
    let shared = CURRENT.with(Cell::get);
    if shared.is_null() {
        1
    } else {
        // SAFETY: a non-null `CURRENT` is the pool that `install` put there;
        // it lives until `install` returns and restores the previous value.
        unsafe { (*shared).threads }
    }
}

/// Runs `f(0)`, ..., `f(tasks - 1)`, spread over the installed pool's threads
/// (this one included), and returns when all have run. Outside a pool, or
/// inside one of its tasks, they run here one after another.
///
/// A panic in a task is re-raised here, after the other tasks have finished.
pub fn for_each(tasks: usize, f: impl Fn(usize) + Sync) {
    let shared = CURRENT.with(Cell::get);
    if shared.is_null() || tasks <= 1 {
        (0..tasks).for_each(f);
        return;
    }
    // SAFETY: as in `threads`.
    let shared = unsafe { &*shared };
    if shared.threads <= 1 {
        (0..tasks).for_each(f);
        return;
    }
    shared.run(tasks, &f);
}

/// Runs `f(i, &mut items[i])` for every item, as [`for_each`] does.
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    let items = &Items(items.as_mut_ptr(), items.len());
    for_each(items.1, |i| {
        if i < items.1 {
            // SAFETY: `i` is in bounds, and `for_each` runs every index once,
            // so no two tasks hold the same item; `items` outlives the call.
            f(i, unsafe { &mut *items.0.add(i) });
        }
    });
}

/// Splits `data` into chunks of `chunk` elements (the last may be shorter) and
/// runs `f(c, chunk_c)` for each, as [`for_each`] does.
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk = chunk.max(1);
    let len = data.len();
    let items = &Items(data.as_mut_ptr(), len);
    for_each(len.div_ceil(chunk), |c| {
        let start = c * chunk;
        if start < items.1 {
            let n = chunk.min(items.1 - start);
            // SAFETY: `start + n <= len`; chunks of distinct indices are
            // disjoint and `for_each` runs every index once; `data` outlives the call.
            f(c, unsafe {
                std::slice::from_raw_parts_mut(items.0.add(start), n)
            });
        }
    });
}

/// A mutable slice handed to tasks that each take their own part of it.
struct Items<T>(*mut T, usize);

// SAFETY: the tasks touch disjoint elements (see the callers), and `T: Send`
// lets each element be used from another thread.
unsafe impl<T: Send> Sync for Items<T> {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_task_runs_once_on_the_pool() {
        let pool = WorkerPool::new(3).unwrap();
        let hits: Vec<AtomicU64> = (0..1000).map(|_| AtomicU64::new(0)).collect();
        let threads = Mutex::new(std::collections::HashSet::new());
        pool.install(|| {
            assert_eq!(super::threads(), 3);
            for round in 0..200u64 {
                for_each(hits.len(), |i| {
                    hits[i].fetch_add(round + 1, Ordering::Relaxed);
                    threads.lock().insert(std::thread::current().id());
                });
            }
        });
        let expected = (1..=200u64).sum::<u64>();
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == expected));
        assert!(!threads.lock().is_empty());
        assert_eq!(super::threads(), 1);
    }

    #[test]
    fn workers_take_part() {
        // Each of two tasks waits until a second thread has run a task: the
        // caller alone would sit out the (generous) deadline, whatever the
        // machine's load, so this holds only if a worker took one.
        let pool = WorkerPool::new(2).unwrap();
        let seen = Mutex::new(std::collections::HashSet::new());
        pool.install(|| {
            for_each(2, |_| {
                seen.lock().insert(std::thread::current().id());
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                while seen.lock().len() < 2 && std::time::Instant::now() < deadline {
                    std::thread::yield_now();
                }
            });
        });
        assert_eq!(seen.lock().len(), 2);
    }

    #[test]
    fn nested_calls_and_calls_outside_a_pool_run_serially() {
        let pool = WorkerPool::new(2).unwrap();
        let mut data = vec![0u32; 64];
        pool.install(|| {
            for_each_chunk_mut(&mut data, 8, |c, chunk| {
                assert_eq!(super::threads(), 1);
                let me = std::thread::current().id();
                for_each_mut(chunk, |i, x| {
                    assert_eq!(std::thread::current().id(), me);
                    *x = (c * 8 + i) as u32;
                });
            });
        });
        assert!(data.iter().enumerate().all(|(i, &x)| x == i as u32));
        let mut out = vec![0usize; 10];
        for_each_mut(&mut out, |i, x| *x = i * 2);
        assert_eq!(out[9], 18);
    }

    #[test]
    fn a_panicking_task_is_reraised_after_the_others_finish() {
        let pool = WorkerPool::new(2).unwrap();
        let done = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.install(|| {
                for_each(100, |i| {
                    if i == 37 {
                        std::panic::panic_any("task 37 failed");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                })
            })
        }));
        let payload = result.unwrap_err();
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"task 37 failed"));
        assert_eq!(done.load(Ordering::Relaxed), 99);
        // When tasks panic on both threads, one panic is re-raised and the
        // other is not left behind for the next job.
        for _ in 0..20 {
            let all_fail = catch_unwind(AssertUnwindSafe(|| {
                pool.install(|| for_each(64, |_| std::panic::panic_any("every task fails")))
            }));
            assert!(all_fail.is_err());
            let clean = catch_unwind(AssertUnwindSafe(|| pool.install(|| for_each(64, |_| {}))));
            assert!(clean.is_ok());
        }
        // The pool still works, and is no longer installed.
        assert_eq!(super::threads(), 1);
        let sum = AtomicUsize::new(0);
        pool.install(|| {
            for_each(10, |i| {
                sum.fetch_add(i, Ordering::Relaxed);
            })
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }

    #[test]
    fn sleeping_workers_wake_for_the_next_job() {
        let pool = WorkerPool::new(2).unwrap();
        let started = AtomicUsize::new(0);
        let met = AtomicUsize::new(0);
        pool.install(|| {
            for round in 1..=3 {
                // Long enough for the worker to go to sleep.
                std::thread::sleep(SPIN_TIME * 5);
                // Each of the two tasks waits for the other to start, which
                // only happens if the woken worker takes one.
                for_each(2, |_| {
                    started.fetch_add(1, Ordering::SeqCst);
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while Instant::now() < deadline {
                        if started.load(Ordering::SeqCst) >= 2 * round {
                            met.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        std::thread::yield_now();
                    }
                });
            }
        });
        assert_eq!(met.load(Ordering::SeqCst), 6);
    }

    #[test]
    fn a_pool_serves_one_thread_at_a_time() {
        let pool = WorkerPool::new(2).unwrap();
        pool.install(|| {
            assert_eq!(super::threads(), 2);
            std::thread::scope(|s| {
                s.spawn(|| pool.install(|| assert_eq!(super::threads(), 1)));
            });
            pool.install(|| assert_eq!(super::threads(), 2));
        });
        assert_eq!(super::threads(), 1);
    }
}
