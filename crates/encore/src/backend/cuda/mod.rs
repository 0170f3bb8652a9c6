//! The CUDA backend: device memory, NVRTC kernels, one stream, native graphs.
//!
//! Built on cudarc's raw driver bindings with dynamic loading, so Encore
//! builds and runs without a CUDA toolkit and reports a missing driver or
//! GPU as [`crate::Error::DeviceUnavailable`]. Kernels are CUDA C compiled by NVRTC
//! for the device's architecture and kept on disk by content key. Every
//! submission goes to the device's one stream and is launched with
//! `cuLaunchKernel` directly, reusing its parameter storage; an event after
//! the last launch marks completion. A sticky device error (illegal
//! address, launch failure) marks the device failed, and it refuses further
//! work rather than return wrong results.
//!
//! - `kernel.rs`: a kernel's CUDA implementation ([`CudaKernel`]) and the
//!   prelude put before its source ([`CUDA_PRELUDE`]); compiled with or
//!   without the `cuda` feature;
//! - `device.rs`: the device, as the runtime's backend;
//! - `driver.rs`: loading libcuda, error codes, the per-GPU context;
//! - `nvrtc.rs`: loading NVRTC and compiling;
//! - `queue.rs`: the stream, launches, completion and timing;
//! - `graph.rs`: native graphs with real dependency edges;
//! - `nvtx.rs`: NVTX ranges for Nsight tools, without the NVTX headers.
//!
//! The one-shot capture (`ENCORE_CAPTURE`) is a CUDA profiler range
//! (`cuProfilerStart`/`cuProfilerStop`) around the captured graph replay,
//! which runs eagerly (it is timed per dispatch) inside an NVTX range named
//! `encore graph replay N`, with one nested range per dispatch named by its
//! kernel and label (`matmul attn_q`). Nsight Systems records exactly that
//! step with `--capture-range=cudaProfilerApi --trace=cuda,nvtx`; Nsight
//! Compute profiles only its kernels with `--profile-from-start off`, and
//! shows their ranges with `--nvtx`.

mod kernel;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod nvrtc;
#[cfg(feature = "cuda")]
mod nvtx;
#[cfg(feature = "cuda")]
mod queue;

#[cfg(feature = "cuda")]
pub use device::raw_function;
#[cfg(feature = "cuda")]
pub(crate) use device::{device_count, list, CudaBackend};
pub use kernel::{CudaKernel, CUDA_PRELUDE};
