//! One wgpu adapter as the runtime's `Backend`: memory, pipelines compiled
//! from WGSL, and the device's features and errors.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use wgpu::naga;

use super::submit::{self, WgpuExecutable, WgpuSubmission};
use crate::backend::wgsl::WGSL_MAX_BUFFERS;
use crate::backend::{Backend, BackendSubmission, Executable};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kernel::{Kernel, KernelDef};
use crate::program::Program;
use crate::record::{BackendKind, Capabilities, DeviceInfo, Launch, RawMem, Upload};

/// The process's wgpu instance, created on first use.
fn instance() -> &'static wgpu::Instance {
    static INSTANCE: OnceLock<wgpu::Instance> = OnceLock::new();
    INSTANCE.get_or_init(|| {
        quiet_device_select_without_a_session();
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env())
    })
}

/// Mesa's Vulkan device-select layer asks the display session (Wayland or
/// X) which GPU is the default; on a machine without one (a server, CI) it
/// finds none and prints "XDG_RUNTIME_DIR is invalid or not set" twice on
/// stderr at every probe, which a user reads as Encore's errors. Without a
/// session there is no default for it to find, so there the layer is
/// turned off with Mesa's own switch (`NODEVICE_SELECT=1`), unless the
/// user set that variable; on a desktop it stays, and so does its adapter
/// order. Called once, before the process's Vulkan instance exists.
fn quiet_device_select_without_a_session() {
    #[cfg(target_os = "linux")]
    {
        let session = std::env::var_os("XDG_RUNTIME_DIR")
            .is_some_and(|dir| std::path::Path::new(&dir).is_dir());
        if !session && std::env::var_os("NODEVICE_SELECT").is_none() {
            std::env::set_var("NODEVICE_SELECT", "1");
        }
    }
}

/// Every adapter, in the order `wgpu:N` numbers them.
fn adapters() -> Vec<wgpu::Adapter> {
    pollster::block_on(instance().enumerate_adapters(wgpu::Backends::all()))
}

/// Whether an adapter is a real GPU (not a CPU rasterizer such as lavapipe).
fn is_hardware(info: &wgpu::AdapterInfo) -> bool {
    !matches!(info.device_type, wgpu::DeviceType::Cpu)
}

/// An adapter in words: `NVIDIA H100 (Vulkan, discrete GPU)`.
fn describe(info: &wgpu::AdapterInfo) -> String {
    let kind = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => "discrete GPU",
        wgpu::DeviceType::IntegratedGpu => "integrated GPU",
        wgpu::DeviceType::VirtualGpu => "virtual GPU",
        wgpu::DeviceType::Cpu => "software, on the CPU",
        wgpu::DeviceType::Other => "other",
    };
    format!("{} ({:?}, {kind})", info.name, info.backend)
}

/// The wgpu adapters, for device listings.
pub(crate) fn list() -> Vec<DeviceInfo> {
    adapters()
        .iter()
        .enumerate()
        .map(|(i, a)| DeviceInfo {
            name: format!("wgpu:{i}"),
            description: describe(&a.get_info()),
        })
        .collect()
}

/// The index of the first hardware adapter, if any: what `wgpu` and `auto` open.
pub(crate) fn first_hardware() -> Option<usize> {
    adapters().iter().position(|a| is_hardware(&a.get_info()))
}

/// The first error an error scope caught, if any.
pub(super) fn caught(scope: wgpu::ErrorScopeGuard) -> Option<wgpu::Error> {
    pollster::block_on(scope.pop())
}

/// A wgpu error in full: its description and every cause under it.
pub(super) fn message(error: &wgpu::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = cause.source();
    }
    text
}

/// What the device has, decided once at open.
#[derive(Clone, Copy, Debug)]
pub(super) struct Features {
    /// Timestamp queries at pass boundaries.
    pub(super) timestamps: bool,
    /// Timestamp queries between dispatches inside a pass.
    pub(super) timestamps_in_passes: bool,
    /// Subgroup operations and f16 arithmetic, offered and not turned off
    /// ([`Config::subgroups`], [`Config::shader_f16`]): kernels compile
    /// their versions that use them.
    wgsl: crate::WgslFeatures,
}

/// The table of live allocations, keyed by the runtime's handles.
#[derive(Default)]
struct Buffers {
    next: u64,
    live: HashMap<RawMem, wgpu::Buffer>,
}

/// State shared by the backend and its in-flight submissions.
pub(crate) struct Shared {
    pub(super) name: String,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    /// Why the device is unusable, once something made it so.
    pub(super) failure: Arc<Mutex<Option<String>>>,
    buffers: Mutex<Buffers>,
    /// The offset every storage binding must start at a multiple of.
    pub(super) storage_align: u64,
    /// Bound in place of empty buffer arguments: one for read-only
    /// bindings and one for writable ones, since one buffer may not be both
    /// in a dispatch.
    pub(super) placeholders: [wgpu::Buffer; 2],
    pub(super) features: Features,
    /// Nanoseconds per timestamp tick.
    pub(super) timestamp_period: f64,
    /// A graph replay encoded but not yet submitted (see [`Shared::hold`]).
    held: Mutex<Option<(wgpu::CommandBuffer, Arc<submit::Slot>)>>,
}

impl Shared {
    /// Records the first failure; later ones keep the first's cause.
    pub(super) fn fail(&self, cause: String) {
        let mut f = self.failure.lock();
        if f.is_none() {
            tracing::error!(device = %self.name, %cause, "wgpu device failed");
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

    /// The buffer behind a handle.
    pub(super) fn buffer(&self, mem: RawMem) -> Result<wgpu::Buffer> {
        self.buffers
            .lock()
            .live
            .get(&mem)
            .cloned()
            .ok_or_else(|| self.driver_error("binding a buffer", "unknown allocation".into()))
    }

    pub(super) fn driver_error(&self, operation: &str, message: String) -> Error {
        Error::Driver {
            device: self.name.clone(),
            operation: operation.into(),
            message,
        }
    }

    /// Turns an error a scope caught into a typed error and, for errors
    /// that leave the device in doubt (out of memory, internal), marks the
    /// device failed.
    pub(super) fn scoped(&self, operation: &str, error: Option<wgpu::Error>) -> Result<()> {
        match error {
            None => Ok(()),
            Some(wgpu::Error::OutOfMemory { .. }) => {
                let cause = format!("{operation}: out of device memory");
                self.fail(cause.clone());
                Err(self.driver_error(operation, cause))
            }
            Some(e) => {
                let message = message(&e);
                if matches!(e, wgpu::Error::Internal { .. }) {
                    self.fail(format!("{operation}: {message}"));
                }
                Err(self.driver_error(operation, message))
            }
        }
    }

    /// Blocks until every submission so far (the held one included) has
    /// completed.
    pub(super) fn wait_idle(&self, operation: &str) -> Result<()> {
        self.flush();
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(drop)
            .map_err(|e| {
                let message = e.to_string();
                self.fail(format!("{operation}: {message}"));
                self.driver_error(operation, message)
            })
    }

    /// Keeps a graph replay's commands back, submitting whatever was held
    /// before. The next operation on the queue submits them first (a
    /// write, an ordered read, another launch, a wait or poll, a
    /// synchronization), except reads of what earlier work wrote
    /// ([`Backend::read_settled`]), which go ahead of them and submit them
    /// right behind their copy. A decode loop encodes its next replay
    /// before it reads the previous one's tokens and logits; on one wgpu
    /// queue those reads would otherwise wait for the next replay to
    /// finish. Held, the next replay starts right after the read's copy,
    /// while the host takes the tokens, or else when the loop begins to
    /// launch the one after it, before encoding it.
    pub(super) fn hold(&self, commands: wgpu::CommandBuffer, slot: Arc<submit::Slot>) {
        self.flush();
        *self.held.lock() = Some((commands, slot));
    }

    /// Submits the held replay, if any.
    pub(super) fn flush(&self) {
        let held = self.held.lock().take();
        if let Some((commands, slot)) = held {
            slot.submit(self, commands);
        }
    }

    /// Copies `data` to `offset` of `mem`, ordered after submitted work
    /// and before any later submission.
    pub(super) fn write(&self, mem: RawMem, offset: usize, data: &[u8]) -> Result<()> {
        self.usable()?;
        self.flush();
        if data.is_empty() {
            return Ok(());
        }
        let buffer = self.buffer(mem)?;
        // wgpu writes whole words at word-aligned offsets: widen the range
        // to its words, keeping the bytes around it.
        let start = offset & !3;
        let end = (offset + data.len()).next_multiple_of(4);
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        if start == offset && end == offset + data.len() {
            self.queue.write_buffer(&buffer, offset as u64, data);
        } else {
            let mut words = vec![0u8; end - start];
            self.read(&mut [(mem, start, &mut words[..])], false)?;
            words[offset - start..offset - start + data.len()].copy_from_slice(data);
            self.queue.write_buffer(&buffer, start as u64, &words);
        }
        self.scoped("writing a buffer", caught(scope))
    }

    /// Copies each range `(mem, offset, out)` out (`out.len()` bytes at
    /// `offset` of `mem`), after all submitted work, through one staging
    /// buffer and one submission. wgpu copies whole words from word-aligned
    /// offsets, so each copy covers the words around its range.
    ///
    /// With `settled` (the caller has seen the work that wrote the ranges
    /// complete), a held replay stays behind the copies and is submitted
    /// right after them, before the wait: the device goes on to it at once
    /// instead of idling until the host launches again.
    fn read(&self, reads: &mut [(RawMem, usize, &mut [u8])], settled: bool) -> Result<()> {
        self.usable()?;
        if reads.iter().all(|(_, _, out)| out.is_empty()) {
            return Ok(());
        }
        if !settled {
            self.flush();
        }
        // Each range's words and their place in the staging buffer.
        let mut copies = Vec::with_capacity(reads.len());
        let mut size = 0u64;
        for (mem, offset, out) in reads.iter() {
            let start = (*offset as u64) & !3;
            let end = (*offset as u64 + out.len() as u64).next_multiple_of(4);
            copies.push((self.buffer(*mem)?, start, end - start, size));
            size += end - start;
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("encore read"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        for (src, start, len, at) in &copies {
            if *len > 0 {
                encoder.copy_buffer_to_buffer(src, *start, &staging, *at, *len);
            }
        }
        let index = self.queue.submit([encoder.finish()]);
        if settled {
            self.flush();
        }
        let mapped = Arc::new(Mutex::new(None));
        let done = mapped.clone();
        staging.map_async(wgpu::MapMode::Read, .., move |r| *done.lock() = Some(r));
        self.scoped("reading a buffer", caught(scope))?;
        let wait = wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: None,
        };
        if let Err(e) = self.device.poll(wait) {
            let message = e.to_string();
            self.fail(format!("reading a buffer: {message}"));
            return Err(self.driver_error("reading a buffer", message));
        }
        if mapped.lock().is_none() {
            self.wait_idle("reading a buffer")?;
        }
        match mapped.lock().take() {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(self.driver_error("mapping a buffer", e.to_string())),
            None => {
                return Err(self.driver_error("mapping a buffer", "the map never completed".into()))
            }
        }
        let copied = staging.get_mapped_range(..).map(|view| {
            for ((_, offset, out), (_, start, _, at)) in reads.iter_mut().zip(&copies) {
                let skip = (*at + (*offset as u64 - start)) as usize;
                out.copy_from_slice(&view[skip..skip + out.len()]);
            }
        });
        staging.unmap();
        copied.map_err(|e| self.driver_error("mapping a buffer", e.to_string()))
    }
}

/// A pipeline and the layout of its buffer bindings.
pub(crate) struct Compiled {
    pub(super) pipeline: wgpu::ComputePipeline,
    pub(super) buffers: wgpu::BindGroupLayout,
}

/// A compiled kernel: its pipeline and the group-0 bindings its shader
/// declares, `(binding, read_only)`, ascending.
///
/// wgpu requires a binding's layout to match the shader's access, and
/// refuses a dispatch that binds one buffer read-only and writable at once.
/// A dispatch that does (reads and writes views of one allocation) gets
/// the variant in which every binding is writable, compiled when first
/// needed.
pub(crate) struct Pipeline {
    name: String,
    source: String,
    entry: String,
    finite_loops: bool,
    pub(super) bindings: Vec<(u32, bool)>,
    plain: Compiled,
    aliased: OnceLock<std::result::Result<Compiled, String>>,
}

impl Pipeline {
    /// The variant for a dispatch whose buffers do or do not alias.
    pub(super) fn variant(
        &self,
        shared: &Shared,
        args_layout: &wgpu::BindGroupLayout,
        aliasing: bool,
    ) -> Result<&Compiled> {
        if !aliasing {
            return Ok(&self.plain);
        }
        self.aliased
            .get_or_init(|| {
                let source = all_writable(&self.source);
                let bindings: Vec<(u32, bool)> =
                    self.bindings.iter().map(|&(b, _)| (b, false)).collect();
                build(
                    shared,
                    args_layout,
                    &self.name,
                    (&source, &self.entry, self.finite_loops),
                    &bindings,
                )
                .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|log| Error::Compile {
                kernel: self.name.clone(),
                log: log.clone(),
            })
    }
}

/// `source` with every read-only buffer argument (a `@group(0)` storage
/// binding, declared on one line as the convention has it) made
/// `read_write`.
fn all_writable(source: &str) -> String {
    source
        .lines()
        .map(|line| {
            if line.contains("@group(0)") {
                line.replacen("var<storage, read>", "var<storage, read_write>", 1)
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Compiles `source`'s `entry` with buffer bindings `bindings`, without
/// naga's loop bounding where `finite_loops` (see
/// [`crate::WgpuKernel::with_finite_loops`]).
fn build(
    shared: &Shared,
    args_layout: &wgpu::BindGroupLayout,
    name: &str,
    (source, entry, finite_loops): (&str, &str, bool),
    bindings: &[(u32, bool)],
) -> Result<Compiled> {
    let device = &shared.device;
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let descriptor = wgpu::ShaderModuleDescriptor {
        label: Some(name),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    };
    let module = if finite_loops {
        // Every check but loop bounding.
        let checks = wgpu::ShaderRuntimeChecks {
            force_loop_bounding: false,
            ..wgpu::ShaderRuntimeChecks::checked()
        };
        // SAFETY: the kernel's author declared every loop finite
        // (`WgpuKernel::with_finite_loops`, itself unsafe).
        unsafe { device.create_shader_module_trusted(descriptor, checks) }
    } else {
        device.create_shader_module(descriptor)
    };
    let entries: Vec<wgpu::BindGroupLayoutEntry> = bindings
        .iter()
        .map(|&(binding, read_only)| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        })
        .collect();
    let buffers = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some(name),
        entries: &entries,
    });
    let layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some(name),
        bind_group_layouts: &[Some(&buffers), Some(args_layout)],
        immediate_size: 0,
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(name),
        layout: Some(&layout),
        module: &module,
        entry_point: Some(entry),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants: &[],
            // Kernels initialize the workgroup memory they read.
            zero_initialize_workgroup_memory: false,
        },
        cache: None,
    });
    match caught(scope) {
        Some(e) => Err(Error::Compile {
            kernel: name.to_string(),
            log: message(&e),
        }),
        None => Ok(Compiled { pipeline, buffers }),
    }
}

/// One wgpu adapter opened as a device.
pub(crate) struct WgpuBackend {
    shared: Arc<Shared>,
    /// Layout of group 1 (the argument block), shared by every pipeline.
    args_layout: wgpu::BindGroupLayout,
    arch: String,
    toolchain: String,
}

impl WgpuBackend {
    /// Opens adapter `index` (`wgpu:N`).
    pub(crate) fn open(index: usize, config: &Config) -> Result<Arc<dyn Backend>> {
        let name = format!("wgpu:{index}");
        let unavailable = |reason: String| Error::DeviceUnavailable {
            name: name.clone(),
            reason,
        };
        let all = adapters();
        let count = all.len();
        let adapter = all.into_iter().nth(index).ok_or_else(|| {
            unavailable(format!(
                "there are {count} wgpu adapters (a Vulkan, Metal or DirectX 12 driver; \
                 on Debian `mesa-vulkan-drivers` adds a software one)"
            ))
        })?;
        let info = adapter.get_info();
        let mut wanted =
            wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        if config.subgroups {
            wanted |= wgpu::Features::SUBGROUP;
        }
        if config.shader_f16 {
            wanted |= wgpu::Features::SHADER_F16;
        }
        let features = adapter.features() & wanted;
        let wgsl = crate::WgslFeatures {
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            f16: features.contains(wgpu::Features::SHADER_F16),
        };
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("encore"),
            required_features: features,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| unavailable(format!("{}: {e}", describe(&info))))?;
        let failure = Arc::new(Mutex::new(None::<String>));
        let lost = failure.clone();
        let lost_name = name.clone();
        device.set_device_lost_callback(move |reason, message| {
            let mut f = lost.lock();
            if f.is_none() && reason != wgpu::DeviceLostReason::Destroyed {
                tracing::error!(device = %lost_name, %message, "wgpu device lost");
                *f = Some(format!("device lost: {message}"));
            }
        });
        let uncaught = failure.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut f = uncaught.lock();
            if f.is_none() {
                *f = Some(format!("uncaught device error: {}", message(&e)));
            }
        }));
        let placeholder = || {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("encore placeholder"),
                size: 256,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        };
        let placeholders = [placeholder(), placeholder()];
        let args_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("encore arguments"),
            entries: &[wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: true },
                    has_dynamic_offset: true,
                    min_binding_size: None,
                },
                count: None,
            }],
        });
        let timestamp_period = f64::from(queue.get_timestamp_period());
        let shared = Arc::new(Shared {
            name,
            device,
            queue,
            failure,
            buffers: Mutex::new(Buffers::default()),
            storage_align: u64::from(limits.min_storage_buffer_offset_alignment.max(4)),
            placeholders,
            features: Features {
                timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
                timestamps_in_passes: features
                    .contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES),
                wgsl,
            },
            timestamp_period,
            held: Mutex::new(None),
        });
        Ok(Arc::new(WgpuBackend {
            shared,
            args_layout,
            // Kernels compile to other code with these features, so their keys differ.
            arch: format!(
                "{:?}-{:#x}-{:#x}{}{}",
                info.backend,
                info.vendor,
                info.device,
                if wgsl.subgroups { "+subgroups" } else { "" },
                if wgsl.f16 { "+f16" } else { "" }
            ),
            toolchain: format!("wgpu-30 {} {}", info.driver, info.driver_info),
        }))
    }

    /// The group-0 bindings a WGSL module declares, `(binding, read_only)`,
    /// ascending, after checking that it follows the binding convention.
    fn bindings(def: &KernelDef, source: &str) -> Result<Vec<(u32, bool)>> {
        let compile_error = |log: String| Error::Compile {
            kernel: def.name().to_string(),
            log,
        };
        let module = naga::front::wgsl::parse_str(source)
            .map_err(|e| compile_error(e.emit_to_string(source)))?;
        let mut bindings = Vec::new();
        let mut has_args = false;
        for (_, var) in module.global_variables.iter() {
            let Some(b) = &var.binding else { continue };
            match b.group {
                0 if (b.binding as usize) < WGSL_MAX_BUFFERS => {
                    let read_only = match var.space {
                        naga::AddressSpace::Storage { access } => {
                            !access.contains(naga::StorageAccess::STORE)
                        }
                        _ => {
                            return Err(compile_error(format!(
                                "buffer binding {} is not a storage buffer",
                                b.binding
                            )))
                        }
                    };
                    bindings.push((b.binding, read_only));
                }
                1 if b.binding == 0 => has_args = true,
                _ => {
                    return Err(compile_error(format!(
                        "binding @group({}) @binding({}) is outside the convention \
                         (group 0: buffers 0..{WGSL_MAX_BUFFERS}; group 1: the argument block)",
                        b.group, b.binding
                    )))
                }
            }
        }
        if !has_args {
            return Err(compile_error(
                "no argument block at @group(1) @binding(0)".into(),
            ));
        }
        bindings.sort_unstable();
        bindings.dedup_by_key(|b| b.0);
        Ok(bindings)
    }
}

impl Backend for WgpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Wgpu
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            specialization: true,
            early_launch: false,
            // A replay is a queue submission, which costs the host time
            // to encode and the device a gap; a few steps share one.
            steps_per_replay: 4,
            // Every dispatch is a pipeline switch and a barrier.
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
        match kernel.def().wgpu_impl() {
            Some(w) => w.launch(value),
            None => Err("the kernel has no WGSL implementation".into()),
        }
    }

    fn alloc(&self, bytes: usize) -> Result<RawMem> {
        let s = &self.shared;
        s.usable()?;
        let scope = s.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = s.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let buffer = s.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (bytes.max(4) as u64).next_multiple_of(4),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let invalid = caught(validation);
        if caught(scope).is_some() || invalid.is_some() {
            // A size beyond the device's limits is a validation error.
            return Err(Error::OutOfMemory {
                device: s.name.clone(),
                bytes,
            });
        }
        let mut buffers = s.buffers.lock();
        buffers.next += 1;
        let mem = buffers.next;
        buffers.live.insert(mem, buffer);
        Ok(mem)
    }

    fn free(&self, mem: RawMem, _bytes: usize) {
        // The runtime frees only what no work uses; dropping the handle
        // lets wgpu release the memory.
        self.shared.buffers.lock().live.remove(&mem);
    }

    fn write(&self, mem: RawMem, offset: usize, data: &[u8]) -> Result<()> {
        self.shared.write(mem, offset, data)
    }

    fn read(&self, mem: RawMem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.shared.read(&mut [(mem, offset, out)], false)
    }

    fn read_settled(&self, mem: RawMem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.shared.read(&mut [(mem, offset, out)], true)
    }

    fn read_settled_many(&self, reads: &mut [(RawMem, usize, &mut [u8])]) -> Result<()> {
        self.shared.read(reads, true)
    }

    fn compile(&self, def: &KernelDef) -> Result<Arc<dyn Any + Send + Sync>> {
        let Some(kernel) = def.wgpu_impl() else {
            return Err(Error::Unsupported {
                op: def.name().to_string(),
                backend: BackendKind::Wgpu,
            });
        };
        let s = &self.shared;
        s.usable()?;
        let source = kernel.source_for(s.features.wgsl);
        let bindings = Self::bindings(def, source)?;
        let finite_loops = kernel.has_finite_loops();
        let plain = build(
            s,
            &self.args_layout,
            def.name(),
            (source, &kernel.entry, finite_loops),
            &bindings,
        )?;
        Ok(Arc::new(Pipeline {
            name: def.name().to_string(),
            source: source.to_string(),
            entry: kernel.entry.clone(),
            finite_loops,
            bindings,
            plain,
            aliased: OnceLock::new(),
        }))
    }

    fn submit(
        &self,
        program: Arc<Program>,
        uploads: Vec<Upload>,
        timing: bool,
    ) -> Result<Box<dyn BackendSubmission>> {
        let prepared = submit::Prepared::new(&self.shared, &self.args_layout, &program)?;
        let submission: WgpuSubmission = prepared.launch(&uploads, timing, false)?;
        Ok(Box::new(submission))
    }

    fn instantiate(&self, program: Arc<Program>) -> Result<Box<dyn Executable>> {
        let prepared = submit::Prepared::new(&self.shared, &self.args_layout, &program)?;
        Ok(Box::new(WgpuExecutable(prepared)))
    }

    fn synchronize(&self) -> Result<()> {
        self.shared.usable()?;
        self.shared.flush();
        self.shared.wait_idle("synchronizing")
    }

    fn failure(&self) -> Option<String> {
        self.shared.failure.lock().clone()
    }
}
