//! Kernels and the content-addressed kernel cache.
//!
//! A [`KernelDef`] names a program and holds a table of implementations, one
//! per backend: a Rust function for the CPU (identified by a definition
//! string that changes whenever its behaviour does), CUDA C source for NVRTC
//! with the function that computes its launch geometry, WGSL for wgpu. Metal
//! runs WGSL too, translated to Metal Shading Language by naga: a kernel's
//! Metal implementation is its own ([`KernelDef::metal`]) or else its wgpu
//! one. Each backend's implementation type lives in its folder
//! (`backend/cuda/kernel.rs`, `backend/wgpu/kernel.rs`,
//! `backend/metal/kernel.rs`). A backend missing from the table makes
//! loading the kernel there fail with [`crate::Error::Unsupported`].
//!
//! Loading one yields a [`Kernel`], cached under a [`KernelKey`]: name, a
//! hash of the backend's full specialized source, backend, architecture,
//! toolchain and options. Two kernels that share a name but differ in
//! source get different keys and coexist (invariant 3). A loaded kernel is
//! reference-counted and retained by every submission and graph that binds
//! it, so evicting it from the cache never frees code that in-flight work
//! still runs.
//!
//! - `def.rs`: the definition, its implementations and its specialized
//!   variants;
//! - `cache.rs`: keys, loaded kernels and the cache.

mod cache;
mod def;

pub(crate) use cache::{Fnv, KernelCache, Loaded};
pub use cache::{Kernel, KernelKey, WeakKernel};
pub use def::{CpuFn, CpuKernel, Implementation, KernelDef, VariantOptions, WgpuVariant};
