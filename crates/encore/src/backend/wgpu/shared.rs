//! What the wgpu backend and its in-flight work share: the device and
//! queue, the allocations, the first failure, the replay held back for the
//! next operation on the queue, and the pipelines kernels compile to.
//!
//! It sits below both the backend (`device.rs`) and the encoding of
//! programs (`submit.rs`), which use it and not each other's internals.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::backend::failure::Failure;
use crate::error::{Error, Result};
use crate::record::RawMem;

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
    /// ([`crate::Config::subgroups`], [`crate::Config::shader_f16`]):
    /// kernels compile their versions that use them.
    pub(super) wgsl: crate::WgslFeatures,
}

/// The table of live allocations, keyed by the runtime's handles.
#[derive(Default)]
pub(super) struct Buffers {
    pub(super) next: u64,
    pub(super) live: HashMap<RawMem, wgpu::Buffer>,
}

/// State shared by the backend and its in-flight submissions.
pub(crate) struct Shared {
    pub(super) name: String,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    /// Why the device is unusable, once something made it so.
    pub(super) failure: Failure,
    pub(super) buffers: Mutex<Buffers>,
    /// The offset every storage binding must start at a multiple of.
    pub(super) storage_align: u64,
    /// Bound in place of empty buffer arguments: one for read-only
    /// bindings and one for writable ones, since one buffer may not be both
    /// in a dispatch.
    pub(super) placeholders: [wgpu::Buffer; 2],
    pub(super) features: Features,
    /// Nanoseconds per timestamp tick.
    pub(super) timestamp_period: f64,
    /// A graph replay encoded but not yet submitted, as the call that
    /// submits it (see [`Shared::hold`]).
    pub(super) held: Mutex<Option<Submit>>,
}

impl Shared {
    /// Records the first failure; later ones keep the first's cause.
    pub(super) fn fail(&self, cause: String) {
        if self.failure.record(&cause) {
            tracing::error!(device = %self.name, %cause, "wgpu device failed");
        }
    }

    /// `Err` when the device has failed.
    pub(super) fn usable(&self) -> Result<()> {
        self.failure.check(&self.name)
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
    /// ([`crate::backend::Backend::read_settled`]), which go ahead of them and submit them
    /// right behind their copy. A decode loop encodes its next replay
    /// before it reads the previous one's tokens and logits; on one wgpu
    /// queue those reads would otherwise wait for the next replay to
    /// finish. Held, the next replay starts right after the read's copy,
    /// while the host takes the tokens, or else when the loop begins to
    /// launch the one after it, before encoding it.
    pub(super) fn hold(&self, submit: Submit) {
        self.flush();
        *self.held.lock() = Some(submit);
    }

    /// Submits the held replay, if any.
    pub(super) fn flush(&self) {
        let held = self.held.lock().take();
        if let Some(submit) = held {
            submit(self);
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
    pub(super) fn read(
        &self,
        reads: &mut [(RawMem, usize, &mut [u8])],
        settled: bool,
    ) -> Result<()> {
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

/// The submission of a held replay's commands (see [`Shared::hold`]).
pub(super) type Submit = Box<dyn FnOnce(&Shared) + Send>;

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
    /// Compiles `source`'s `entry` (without naga's loop bounding where
    /// `finite_loops`) with buffer bindings `bindings`, as the shader
    /// declares them; the variant for aliased buffers waits until needed.
    pub(super) fn compile(
        shared: &Shared,
        args_layout: &wgpu::BindGroupLayout,
        name: &str,
        (source, entry, finite_loops): (&str, &str, bool),
        bindings: Vec<(u32, bool)>,
    ) -> Result<Pipeline> {
        let plain = build(
            shared,
            args_layout,
            name,
            (source, entry, finite_loops),
            &bindings,
        )?;
        Ok(Pipeline {
            name: name.to_string(),
            source: source.to_string(),
            entry: entry.to_string(),
            finite_loops,
            bindings,
            plain,
            aliased: OnceLock::new(),
        })
    }

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
