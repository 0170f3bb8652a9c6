//! The wgpu backend: any GPU through Vulkan, Metal or DirectX 12, with
//! WGSL kernels.
//!
//! - Memory: each allocation is a `wgpu::Buffer` usable as storage and as a
//!   copy source and destination; the runtime's handle to it (`RawMem`) is
//!   a key into this backend's table of buffers. Copies in go through
//!   `Queue::write_buffer`, ordered after submitted work; copies out go
//!   through a mapped staging buffer.
//! - Kernels: WGSL compiled by wgpu (naga, then the driver) into a compute
//!   pipeline with an explicit layout read off the shader: group 0 holds the
//!   buffer arguments, group 1 the argument block (offsets and value) at a
//!   dynamic offset (the convention is on [`crate::WgpuKernel`], in
//!   `kernel.rs`, which builds without the `wgpu` feature; the block's
//!   layout, shared with Metal, is `backend/wgsl.rs`). Every
//!   buffer binding's layout entry is writable, so a dispatch may bind one
//!   allocation several times, read and written (a shader that only reads a
//!   binding may still declare it `read`). Where the adapter offers
//!   subgroup operations or f16 arithmetic (and [`crate::Config::subgroups`] or
//!   [`crate::Config::shader_f16`] is on), the device is opened with wgpu's
//!   `SUBGROUP` or `SHADER_F16` feature and a kernel with a version that
//!   uses them ([`crate::WgpuKernel::with_version`]) compiles that; the
//!   device's arch then ends in `+subgroups`, `+f16` or both, so the
//!   versions have different keys.
//! - Programs: one compute pass each, in which wgpu's own usage tracking
//!   orders the dispatches; see `submit.rs`. The device itself and its
//!   memory are `device.rs`; what both share (queue, allocations, failure,
//!   pipelines) is `shared.rs`.
//! - Errors: validation, out-of-memory and internal errors are caught in
//!   error scopes around every call that can raise them; device loss and
//!   anything uncaught (wgpu would panic by default) are recorded by
//!   callbacks. A submission returns its error from `wait`, and from then on
//!   the device reports itself failed.

mod kernel;

#[cfg(feature = "wgpu")]
mod device;
#[cfg(feature = "wgpu")]
mod shared;
#[cfg(feature = "wgpu")]
mod submit;

#[cfg(feature = "wgpu")]
pub(crate) use device::{first_hardware, list, WgpuBackend};
pub use kernel::{WgpuKernel, WgslFeatures};
