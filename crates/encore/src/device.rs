//! Devices: the entry point of the runtime.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::backend::{cpu::CpuBackend, Backend, Timing};
use crate::config::Config;
use crate::counters::{AtomicCounters, Counters};
use crate::error::{Error, Result};
use crate::kernel::{Kernel, KernelCache, KernelDef, Loaded};
use crate::pool::{Pool, PoolStats};
use crate::profile::Profile;
use crate::program::Program;
use crate::record::{BackendKind, Capabilities, DeviceInfo, MemoryInfo, Replay};
use crate::retain::InFlight;
use crate::trace::{Span, Trace};
use crate::Label;

static NEXT_DEVICE_ID: AtomicU64 = AtomicU64::new(1);

/// One device: a backend context with its queue, memory pool, kernel cache,
/// counters and profile. Cheap to clone; all clones are the same device.
#[derive(Clone)]
pub struct Device(Arc<Shared>);

struct Shared {
    id: u64,
    backend: Arc<dyn Backend>,
    pool: Arc<Pool>,
    kernels: KernelCache,
    counters: AtomicCounters,
    profile: Profile,
    config: Config,
    /// Submissions dropped before completion, kept alive until they finish.
    orphans: Mutex<Vec<(Label, InFlight)>>,
    /// An error from an orphaned submission, reported at the next commit or sync.
    deferred: Mutex<Option<Error>>,
    /// The trace being recorded, once [`Device::start_trace`] was called.
    trace: OnceLock<Arc<Trace>>,
    /// Graph replays launched (numbers them for traces and the capture).
    replays: AtomicU64,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({})", self.name())
    }
}

/// The devices available on this machine.
pub fn list_devices() -> Vec<DeviceInfo> {
    let cpu = DeviceInfo {
        name: "cpu".into(),
        description: crate::backend::cpu::describe(),
    };
    let mut all = vec![cpu];
    #[cfg(feature = "cuda")]
    all.extend(crate::backend::cuda::list());
    #[cfg(target_vendor = "apple")]
    all.extend(crate::backend::metal::list());
    #[cfg(feature = "wgpu")]
    all.extend(crate::backend::wgpu::list());
    all
}

impl Device {
    /// Opens a device by name: `cpu`, `cuda`, `cuda:N`, `metal`, `wgpu`,
    /// `wgpu:N` or `auto`. `metal` is the system's default Metal device
    /// (on other platforms opening it is [`Error::DeviceUnavailable`]);
    /// `wgpu` is the first hardware wgpu adapter; `wgpu:N` is adapter
    /// `N` as [`list_devices`] numbers them, software ones included. `auto`
    /// opens [`Config::device`] when that names a device (`ENCORE_DEVICE`),
    /// else CUDA when a driver and a device exist, else Metal on Apple
    /// platforms, else the first hardware wgpu adapter, else the CPU (never
    /// a software adapter).
    pub fn open(name: &str, config: &Config) -> Result<Device> {
        let name = name.trim();
        let backend: Arc<dyn Backend> = match name {
            "auto" if config.device.trim() != "auto" => {
                return Device::open(&config.device, config)
            }
            "auto" => {
                #[cfg(feature = "cuda")]
                if crate::backend::cuda::device_count() > 0 {
                    return Device::open("cuda:0", config);
                }
                #[cfg(target_vendor = "apple")]
                if crate::backend::metal::has_device() {
                    return Device::open("metal", config);
                }
                #[cfg(feature = "wgpu")]
                if let Some(index) = crate::backend::wgpu::first_hardware() {
                    return Device::open(&format!("wgpu:{index}"), config);
                }
                Arc::new(CpuBackend::new(config)?)
            }
            "cpu" => Arc::new(CpuBackend::new(config)?),
            "wgpu" => open_wgpu(None, config)?,
            "metal" => open_metal(config)?,
            _ => {
                let ordinal = |rest: &str| {
                    rest.strip_prefix(':')
                        .and_then(|n| n.parse::<usize>().ok())
                        .ok_or_else(|| Error::UnknownDevice(name.to_string()))
                };
                if let Some(rest) = name.strip_prefix("cuda") {
                    open_cuda(if rest.is_empty() { 0 } else { ordinal(rest)? }, config)?
                } else if let Some(rest) = name.strip_prefix("wgpu") {
                    open_wgpu(Some(ordinal(rest)?), config)?
                } else {
                    return Err(Error::UnknownDevice(name.to_string()));
                }
            }
        };
        Ok(Device::from_backend(backend, config.clone()))
    }

    /// The CPU device with the default configuration.
    pub fn cpu() -> Result<Device> {
        Device::open("cpu", &Config::default())
    }

    fn from_backend(backend: Arc<dyn Backend>, config: Config) -> Device {
        Device(Arc::new(Shared {
            id: NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed),
            pool: Arc::new(Pool::new(backend.clone())),
            backend,
            kernels: KernelCache::default(),
            counters: AtomicCounters::default(),
            profile: Profile::default(),
            config,
            orphans: Mutex::new(Vec::new()),
            deferred: Mutex::new(None),
            trace: OnceLock::new(),
            replays: AtomicU64::new(0),
        }))
    }

    pub(crate) fn id(&self) -> u64 {
        self.0.id
    }

    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.0.pool
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.0.backend
    }

    /// The device's name (`cpu`, `cuda:0`).
    pub fn name(&self) -> &str {
        self.0.backend.name()
    }

    /// The backend this device runs on.
    pub fn kind(&self) -> BackendKind {
        self.0.backend.kind()
    }

    /// What the device's backend can do.
    pub fn capabilities(&self) -> Capabilities {
        self.0.backend.capabilities()
    }

    /// The target architecture kernels are built for.
    pub fn arch(&self) -> String {
        self.0.backend.arch()
    }

    /// The configuration the device was opened with.
    pub fn config(&self) -> &Config {
        &self.0.config
    }

    /// Whether two handles are the same device.
    pub fn same(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Loads (compiling on a cache miss) a kernel for this device.
    pub fn load_kernel(&self, def: &KernelDef) -> Result<Kernel> {
        let backend = &self.0.backend;
        let key = KernelCache::key_for(backend.kind(), backend.arch(), backend.toolchain(), def)
            .ok_or_else(|| Error::Unsupported {
                op: def.name().to_string(),
                backend: self.kind(),
            })?;
        match self
            .0
            .kernels
            .load(key, def, |def| self.0.backend.compile(def))?
        {
            Loaded::Hit(k) => {
                self.0.counters.add(&Counters {
                    kernel_cache_hits: 1,
                    ..Counters::default()
                });
                Ok(k)
            }
            Loaded::Compiled(k) => {
                self.0.counters.add(&Counters {
                    kernel_compiles: 1,
                    kernel_disk_hits: self.0.backend.take_disk_hits(),
                    ..Counters::default()
                });
                Ok(k)
            }
        }
    }

    /// Drops cached kernels that nothing references (no handle, submission or
    /// graph). Returns how many were dropped.
    pub fn evict_unused_kernels(&self) -> usize {
        self.0.kernels.evict_unused()
    }

    /// Kernels in the in-memory cache.
    pub fn cached_kernels(&self) -> usize {
        self.0.kernels.len()
    }

    /// Waits for all submitted work, releases what it retained, and reports
    /// any error from work whose submission was dropped unobserved.
    pub fn synchronize(&self) -> Result<()> {
        self.count_wait();
        let synced = self.0.backend.synchronize();
        self.reap();
        synced?;
        self.take_deferred()
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> Counters {
        self.0.counters.snapshot()
    }

    /// Zeroes the counters.
    pub fn reset_counters(&self) {
        self.0.counters.reset()
    }

    /// The device's profile (per-label submission and dispatch times).
    pub fn profile(&self) -> &Profile {
        &self.0.profile
    }

    /// Starts recording a [`Trace`] of this device's work: host spans, and
    /// every submission and dispatch whose completion is observed from now
    /// on (dispatches are timed while tracing). Later calls return the same
    /// trace.
    pub fn start_trace(&self) -> Arc<Trace> {
        self.0
            .trace
            .get_or_init(|| Arc::new(Trace::new(self.name())))
            .clone()
    }

    /// The trace being recorded, if [`Device::start_trace`] was called.
    pub fn trace(&self) -> Option<&Arc<Trace>> {
        self.0.trace.get()
    }

    /// Marks a host phase (`"prefill"`) in the trace from now until the
    /// returned guard is dropped. Without a trace it records nothing and
    /// costs next to nothing.
    pub fn trace_span(&self, name: impl Into<Label>) -> Span {
        match self.0.trace.get() {
            Some(trace) => trace.span(name.into()),
            None => Span::inactive(),
        }
    }

    /// Memory pool statistics.
    pub fn pool_stats(&self) -> PoolStats {
        self.0.pool.stats()
    }

    /// The device's free and total memory as its driver (or, for the CPU,
    /// the operating system) reports them now, memory this device's pool
    /// holds for reuse counted as free (the pool gives it back when an
    /// allocation needs it); `None` when the backend cannot tell (wgpu,
    /// Metal, the CPU off Linux).
    pub fn memory(&self) -> Result<Option<MemoryInfo>> {
        let pooled = self.0.pool.stats().pooled_bytes;
        Ok(self.0.backend.memory()?.map(|m| MemoryInfo {
            free: m.free.saturating_add(pooled).min(m.total),
            total: m.total,
        }))
    }

    /// The bytes an allocation of `bytes` takes from the device: its pool
    /// size class, at most an eighth more than asked for.
    pub fn allocated_size(&self, bytes: usize) -> usize {
        crate::pool::size_class(bytes)
    }

    /// Frees pooled memory that no buffer uses.
    pub fn trim_pool(&self) {
        self.0.pool.trim()
    }

    pub(crate) fn add_counters(&self, c: &Counters) {
        self.0.counters.add(c);
    }

    pub(crate) fn count_wait(&self) {
        self.0.counters.add(&Counters {
            waits: 1,
            ..Counters::default()
        });
    }

    pub(crate) fn check_failed(&self) -> Result<()> {
        match self.0.backend.failure() {
            Some(cause) => Err(Error::DeviceFailed {
                device: self.name().to_string(),
                cause,
            }),
            None => Ok(()),
        }
    }

    fn take_deferred(&self) -> Result<()> {
        match self.0.deferred.lock().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Releases finished orphans and reports deferred or sticky errors.
    pub(crate) fn before_submit(&self) -> Result<()> {
        self.reap();
        self.take_deferred()?;
        self.check_failed()
    }

    /// Whether submissions time each dispatch: when profiling dispatches or
    /// tracing.
    pub(crate) fn profiles_dispatches(&self) -> bool {
        self.0.config.profile >= crate::config::ProfileMode::Dispatches
            || self.0.trace.get().is_some()
    }

    /// Numbers a graph replay about to launch and decides whether the
    /// one-shot capture (`ENCORE_CAPTURE`) records it; if so, opens the
    /// backend's capture range.
    pub(crate) fn next_replay(&self) -> Replay {
        let number = self.0.replays.fetch_add(1, Ordering::Relaxed) + 1;
        let captured = self.0.config.capture.is_some() && number == self.0.config.capture_at;
        if captured {
            self.0
                .backend
                .capture_begin(&format!("graph replay {number}"));
        }
        Replay { number, captured }
    }

    /// Closes the capture range of a captured replay whose launch failed.
    pub(crate) fn abandon_capture(&self) {
        self.0.backend.capture_end();
    }

    /// Records a submission's completion (`timing`) or failure (`None`) into
    /// the profile, the trace and the one-shot capture.
    pub(crate) fn observe_completion(
        &self,
        label: &Label,
        in_flight: &InFlight,
        timing: Option<&Timing>,
    ) {
        let program = &in_flight.program;
        let replay = in_flight.replay.map(|r| r.number);
        if let Some(t) = timing {
            self.0
                .profile
                .record(self.0.config.profile, label, program, t);
            if let Some(trace) = self.0.trace.get() {
                trace.record_submission(label, program, t, replay);
            }
        }
        if let Some(n) = in_flight.replay.filter(|r| r.captured).map(|r| r.number) {
            self.write_capture(label, program, timing, n);
        }
    }

    /// Writes the captured replay's trace (where the backend says, beside
    /// any trace of its own) and closes the capture range. A capture that
    /// cannot be written is reported once on stderr and changes nothing
    /// else.
    fn write_capture(&self, label: &Label, program: &Program, timing: Option<&Timing>, n: u64) {
        let written = match (timing, &self.0.config.capture) {
            (Some(t), Some(path)) => {
                let trace = Trace::starting_at(self.name(), crate::trace::started(t));
                trace.record_submission(label, program, t, Some(n));
                trace
                    .save(self.0.backend.capture_trace_path(path))
                    .map_err(|e| e.to_string())
            }
            (None, _) => Err(format!("graph replay {n} failed")),
            (_, None) => Ok(()),
        };
        self.0.backend.capture_end();
        if let Err(e) = written {
            eprintln!("encore: warning: one-shot capture not written: {e}");
        }
    }

    /// Takes over an unfinished submission whose handle was dropped.
    pub(crate) fn adopt(&self, in_flight: InFlight, label: Label) {
        self.0.orphans.lock().push((label, in_flight));
    }

    /// Releases orphaned submissions that have completed.
    fn reap(&self) {
        let mut orphans = self.0.orphans.lock();
        if orphans.is_empty() {
            return;
        }
        let mut still_running = Vec::with_capacity(orphans.len());
        for (label, in_flight) in orphans.drain(..) {
            match in_flight.backend.poll() {
                None => still_running.push((label, in_flight)),
                Some(Ok(timing)) => self.observe_completion(&label, &in_flight, Some(&timing)),
                Some(Err(e)) => {
                    self.observe_completion(&label, &in_flight, None);
                    let mut deferred = self.0.deferred.lock();
                    if deferred.is_none() {
                        *deferred = Some(e);
                    }
                }
            }
        }
        *orphans = still_running;
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Orphans must finish before their memory returns to the pool.
        let _ = self.backend.synchronize();
        for (_, in_flight) in self.orphans.get_mut().drain(..) {
            if in_flight.replay.is_some_and(|r| r.captured) {
                self.backend.capture_end();
            }
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize, config: &Config) -> Result<Arc<dyn Backend>> {
    crate::backend::cuda::CudaBackend::open(ordinal, config)
}

/// Opens wgpu adapter `index`, or the first hardware one.
#[cfg(feature = "wgpu")]
fn open_wgpu(index: Option<usize>, config: &Config) -> Result<Arc<dyn Backend>> {
    let index = match index {
        Some(i) => i,
        None => crate::backend::wgpu::first_hardware().ok_or_else(|| Error::DeviceUnavailable {
            name: "wgpu".into(),
            reason: "no hardware wgpu adapter (Vulkan, Metal or DirectX 12 GPU); \
                     `encore devices` lists software ones, which `wgpu:N` opens"
                .into(),
        })?,
    };
    crate::backend::wgpu::WgpuBackend::open(index, config)
}

#[cfg(not(feature = "wgpu"))]
fn open_wgpu(index: Option<usize>, _config: &Config) -> Result<Arc<dyn Backend>> {
    Err(Error::DeviceUnavailable {
        name: index.map_or_else(|| "wgpu".into(), |i| format!("wgpu:{i}")),
        reason: "Encore was built without the `wgpu` feature".into(),
    })
}

#[cfg(target_vendor = "apple")]
fn open_metal(config: &Config) -> Result<Arc<dyn Backend>> {
    crate::backend::metal::MetalBackend::open(config)
}

#[cfg(not(target_vendor = "apple"))]
fn open_metal(_config: &Config) -> Result<Arc<dyn Backend>> {
    Err(Error::DeviceUnavailable {
        name: "metal".into(),
        reason: "Metal is only available on Apple platforms".into(),
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize, _config: &Config) -> Result<Arc<dyn Backend>> {
    Err(Error::DeviceUnavailable {
        name: format!("cuda:{ordinal}"),
        reason: "Encore was built without the `cuda` feature".into(),
    })
}

#[cfg(all(test, not(target_vendor = "apple")))]
mod tests {
    use super::*;

    #[test]
    fn metal_elsewhere_is_a_typed_error_saying_where_it_exists() {
        let e = Device::open("metal", &Config::default()).unwrap_err();
        assert!(
            matches!(&e, Error::DeviceUnavailable { name, .. } if name == "metal"),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("only available on Apple platforms"),
            "{e}"
        );
        let auto = Config {
            device: "metal".into(),
            ..Config::default()
        };
        assert!(matches!(
            Device::open("auto", &auto),
            Err(Error::DeviceUnavailable { .. })
        ));
        assert!(matches!(
            Device::open("metal:0", &Config::default()),
            Err(Error::UnknownDevice(_))
        ));
    }
}

#[cfg(all(test, target_os = "linux"))]
mod memory_tests {
    use super::*;

    #[test]
    fn the_cpu_reports_the_machines_memory() {
        let m = Device::cpu().unwrap().memory().unwrap().unwrap();
        assert!(0 < m.free && m.free <= m.total, "{m:?}");
    }

    #[test]
    fn an_allocation_takes_its_size_class() {
        let cpu = Device::cpu().unwrap();
        assert_eq!(cpu.allocated_size(100), 256);
        let big = 100 << 20;
        assert!((big..=big + big / 8).contains(&cpu.allocated_size(big)));
        let before = cpu.pool_stats().live_bytes;
        let _held = cpu.alloc(big).unwrap();
        assert_eq!(
            cpu.pool_stats().live_bytes - before,
            cpu.allocated_size(big) as u64
        );
    }
}
