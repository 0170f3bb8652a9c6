//! A kernel's Metal implementation: WGSL of its own for Apple GPUs.

use crate::backend::wgpu::WgpuKernel;

/// A Metal implementation: WGSL that follows the binding convention of
/// [`WgpuKernel`], which the Metal backend translates to Metal Shading
/// Language with naga when it compiles the kernel (the mapping of bindings
/// to Metal buffer indices is documented in `backend/metal/msl.rs`). A
/// kernel without one runs its wgpu implementation on Metal; an op gives
/// Metal its own WGSL only where Apple GPUs want other code.
#[derive(Clone, Debug)]
pub struct MetalKernel(pub WgpuKernel);
