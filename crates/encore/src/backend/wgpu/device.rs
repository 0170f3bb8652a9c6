//! One wgpu adapter as the runtime's `Backend`: opening it, memory, and
//! kernels compiled to pipelines. What it shares with in-flight work is in
//! `shared.rs`.

use std::any::Any;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use wgpu::naga;

use super::shared::{caught, message, Buffers, Features, Pipeline, Shared};
use super::submit::{self, WgpuExecutable, WgpuSubmission};
use crate::backend::failure::Failure;
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
        let failure = Failure::default();
        let lost = failure.clone();
        let lost_name = name.clone();
        device.set_device_lost_callback(move |reason, message| {
            if reason != wgpu::DeviceLostReason::Destroyed
                && lost.record(&format!("device lost: {message}"))
            {
                tracing::error!(device = %lost_name, %message, "wgpu device lost");
            }
        });
        let uncaught = failure.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            uncaught.record(&format!("uncaught device error: {}", message(&e)));
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
        let pipeline = Pipeline::compile(
            s,
            &self.args_layout,
            def.name(),
            (source, &kernel.entry, finite_loops),
            bindings,
        )?;
        Ok(Arc::new(pipeline))
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
        self.shared.failure.cause()
    }
}
