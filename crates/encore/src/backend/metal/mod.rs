//! The Metal backend: Apple GPUs through `objc2-metal`, with the WGSL
//! kernels translated to Metal Shading Language by naga.
//!
//! It has never run on Apple hardware: the project's machines have none.
//! It is compiled for `aarch64-apple-darwin` in CI (type-checked and linted)
//! and its decisions live in `plan`, which compiles and is unit-tested on
//! every platform; the translation of every kernel ([`msl`]) is tested on
//! every platform too. Everything below is how it is built to behave.
//!
//! Encore's design comes from a Metal runtime, and from three failures of
//! MLX's Metal backend that this one avoids by construction:
//!
//! - **Retention.** Command buffers are made with unretained references
//!   (Metal then neither retains nor releases what they bind, which saves
//!   host time per dispatch), so the backend keeps every buffer and pipeline
//!   bound into a command buffer itself, each once (`plan::Retention`),
//!   and releases them in the command buffer's completion handler. A buffer
//!   the runtime frees while work still uses it stays alive until then.
//! - **Kernels by content.** Pipelines are cached by the runtime's kernel
//!   cache under a content key (name, a hash of the WGSL, backend, device,
//!   toolchain, options), so two variants of one name coexist; the programs
//!   and graphs that bind a kernel hold it, and every command buffer holds
//!   its pipelines, so nothing in flight is evicted.
//! - **Residency.** One residency set per device, where the OS has them
//!   (checked at run time: macOS 15, iOS 18), attached to the queue once.
//!   Allocations join it as they are made and leave as they are freed; the
//!   set is committed once per command-buffer commit, and never changed
//!   during a programmatic capture (`plan::Residency`).
//!
//! # Encoding
//!
//! A program is one command buffer with one compute encoder of concurrent
//! dispatch type: the runtime's concurrent groups run side by side and are
//! separated by buffer-scope memory barriers; the serial mode
//! (`ENCORE_SERIAL`) puts one after every dispatch (`plan::encoding`).
//! Buffers are shared-storage (one copy, visible to host and device, as
//! Apple silicon's unified memory wants) with Metal's default hazard
//! tracking, which orders the encoders and command buffers of the queue;
//! within the concurrent encoder the barriers alone order dispatches.
//! Buffer arguments are bound at the multiple of [`BIND_ALIGN`] at or before
//! their first byte, with the word offset in the argument block, as on
//! wgpu and by the same code (`backend/wgsl.rs`); the argument blocks of a
//! program live in one buffer.
//!
//! # Graphs
//!
//! A graph's executable binds its program once and re-encodes its command
//! buffer at every replay; indirect command buffers are not used. Graph
//! parameters live in device buffers, written by a blit at the head of the
//! replay's own command buffer.
//!
//! # Timing, capture and errors
//!
//! A command buffer's device time is its `GPUEndTime - GPUStartTime`,
//! which the runtime files under the submission's label. Per-dispatch
//! times (`--profile dispatches`, traces) give every dispatch an encoder of
//! its own, with timestamp counters sampled at its boundaries: Apple GPUs
//! sample only there. `ENCORE_CAPTURE=FILE.gputrace` records the
//! `ENCORE_CAPTURE_AT`th graph replay with the capture manager into a GPU
//! trace document (the runtime's Chrome trace goes beside it, as
//! `FILE.gputrace.json`); without `METAL_CAPTURE_ENABLED=1` one warning says
//! so and the run goes on (`plan::Capture`). A command buffer that ends in
//! error makes `wait` return a typed error and marks the device failed.

mod kernel;
pub mod msl;
#[cfg_attr(not(target_vendor = "apple"), allow(dead_code))]
pub(crate) mod plan;

#[cfg(target_vendor = "apple")]
mod device;
#[cfg(target_vendor = "apple")]
mod shared;
#[cfg(target_vendor = "apple")]
mod submit;

#[cfg(target_vendor = "apple")]
pub(crate) use device::{has_device, list, MetalBackend};
pub use kernel::MetalKernel;

/// The alignment of the offsets buffer arguments are bound at; the
/// remainder reaches the kernel as a word offset (`args.off[i]`). It is
/// also the stride alignment of the argument blocks.
pub const BIND_ALIGN: usize = 256;
