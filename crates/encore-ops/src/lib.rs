//! The kernels an LLM needs, for every Encore backend.
//!
//! ```
//! use encore::{Config, Device};
//! use encore_ops::{KernelSet, Ops};
//!
//! let device = Device::open("cpu", &Config::default())?;
//! let ops = Ops::new(&device, KernelSet::Default)?;
//! let (x, y) = (device.buffer_from(&[1.0f32, 2.0, 3.0])?, device.buffer_from(&[0.5f32; 3])?);
//! let mut enc = device.encoder();
//! ops.add(&mut enc, &x, &y, 3)?; // x += y
//! enc.commit_and_wait()?;
//! assert_eq!(x.download::<f32>()?, [1.5, 2.5, 3.5]);
//! # Ok::<(), encore::Error>(())
//! ```
//!
//! # Layout: a folder per backend, a table above them
//!
//! - [`kernels`]: one file per operation, backend-neutral: its math, its
//!   shape (the `#[repr(C)]` value every implementation reads), its
//!   argument layout ([`op_args!`]), its constants. It names no backend.
//! - [`cpu`]: the CPU backend: the fast CPU math (quantized dot products)
//!   and, in [`cpu::kernels`], one CPU body per operation.
//! - [`cuda`]: the CUDA backend: `.cu` kernels and `.cuh` headers, and
//!   [`cuda::geometry`], how each kernel is launched.
//! - [`wgsl`]: the wgpu backend (and, translated by naga, Metal's): one
//!   `.wgsl` file per kernel and its launch.
//! - [`registry`]: the one table that maps each kernel to its CPU body,
//!   CUDA kernel and WGSL kernel, and says which [`KernelSet`] has it.
//!   Backends import the descriptions of [`kernels`]; only the table
//!   imports the backends.
//! - [`Ops`] loads a [`KernelSet`] on a device and encodes each operation
//!   with the exact byte ranges it reads and writes; [`fusion`] holds the
//!   rules that fuse recorded dispatches of a graph.
//!
//! # Adding an op
//!
//! Its description in `kernels/<op>.rs`, its implementations in the
//! backends' folders, one row in the [`registry`]'s table and its method on
//! [`Ops`].
//!
//! # Adding a backend
//!
//! Once the runtime has the backend (see the `encore` crate's docs):
//!
//! 1. Add a folder beside `cpu/`, `cuda/` and `wgsl/` with one kernel
//!    source per entry point and a `mod.rs` that turns each into the
//!    runtime's implementation for that backend: the source, its entry
//!    point and its launch geometry as a function of the op's shape (see
//!    `cuda/mod.rs` and `cuda/geometry.rs` for the pattern).
//! 2. In the [`registry`]'s table, add the implementation to each row,
//!    beside `.cpu(...)` and `.cuda(...)`. An op you have not written yet
//!    needs nothing: [`Ops`] reports [`encore::Error::Unsupported`] when it
//!    is dispatched on the new backend, so the backend comes up one op at
//!    a time.
//! 3. The kernel reads its arguments in the order of the op's layout type
//!    (`NormArgs`, `MatmulArgs`, ...), which lists every buffer with its
//!    access, then the shape.
//! 4. What the backend declares in its `encore::Capabilities` (fusion pays,
//!    steps per replay) decides which fusion rules and replay lengths
//!    [`Ops`] uses there; variants (the tensor-core gemm, the tiled prefill
//!    attention) are used wherever a device has them and their kernel
//!    takes the shape (a kernel may refuse at launch what it has no code
//!    for).
//! 5. Tests: `tests/cuda_ops.rs` opens `Ops` on the CPU and on CUDA and
//!    compares every op on random inputs with stated tolerances; a new
//!    backend's suite does the same with its device name.

pub mod args;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod fusion;
mod include;
pub mod kernels;
mod ops;
pub mod registry;
pub mod wgsl;

pub use args::CpuArg;
pub use dtype::{DType, WeightTypes};
pub use ops::{AttnRows, Ops, Positions, Weight};
pub use registry::KernelSet;
