//! `fused_matmul`: up to three matrix products that share their input, with
//! an optional RMSNorm of the input before them and one of three epilogues.
//! The graph's fusion pass builds it from recorded `rms_norm`, `matmul`,
//! `add_rows`, `silu_mul` and `add` dispatches (see [`crate::fusion`]); nothing encodes
//! it directly.
//!
//! With `xn = norm ? rms_norm(x) * g : x` and `p_i[r, j] = Σ_c w_i[j, c] xn[r, c]`:
//! - [`EPILOGUE_STORE`]: `y_i = p_i` for each weight `i` (Q, K and V), or
//!   `y_i = p_i + b_i` where bit `i` of `bias` is set (a bias, as Qwen2's);
//! - [`EPILOGUE_ACCUMULATE`]: `y_0 += p_0` (a projection into the residual);
//! - [`EPILOGUE_SWIGLU`]: `y_0 = silu(p_0) * p_1` (gate and up).
//!
//! The CPU body ([`crate::cpu::kernels::fused`]) runs the unfused
//! operations' own code in sequence, so a fused graph gives bit-identical
//! results on the CPU. So does the exact version of the CUDA kernel (in
//! [`KernelSet::Exact`](super::KernelSet::Exact)) with quantized weights:
//! each warp normalizes the input it reads as `rms_norm` does,
//! then multiplies as the exact `matmul` does (see [`super::matmul`]).
//! Otherwise the CUDA kernel folds the norm into the product: each warp sums
//! the squares of the activations it reads anyway and scales its finished
//! dot product by `1 / rms`.
//!
//! CUDA: `cuda/fused_matmul.cu` and `cuda/fused_matmul_exact.cu`, the
//! kernel in `cuda/fused_matmul.cuh` over the products of `matmul`. wgpu
//! (default set only: not bit for bit): `wgsl/fused_matmul.wgsl`, which folds
//! the norm into the product as the fast CUDA kernel does.

use encore::Access;

/// `y_i = p_i`.
pub const EPILOGUE_STORE: u32 = 0;
/// `y_0 += p_0`.
pub const EPILOGUE_ACCUMULATE: u32 = 1;
/// `y_0 = silu(p_0) * p_1`.
pub const EPILOGUE_SWIGLU: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct FusedShape {
    pub rows: u32,
    pub k: u32,
    /// Output columns of each weight (0 when unused).
    pub n: [u32; 3],
    /// ggml type id of each weight.
    pub dtype: [u32; 3],
    /// Weights in use, 1 to 3.
    pub weights: u32,
    pub epilogue: u32,
    /// 1: RMSNorm the input with `g` first.
    pub norm: u32,
    pub eps: f32,
    /// Bit `i` set: the store epilogue adds the bias `b_i` to every row of
    /// `y_i`, as `add_rows` does.
    pub bias: u32,
}

impl FusedShape {
    /// Output columns: every weight's, or the gate's in the SwiGLU epilogue.
    pub fn columns(&self) -> u32 {
        if self.epilogue == EPILOGUE_SWIGLU {
            self.n[0]
        } else {
            self.n.iter().take(self.weights as usize).sum()
        }
    }
}

impl FusedShape {
    /// How the outputs are bound: read-write when the epilogue adds into
    /// them, written otherwise.
    pub fn output_access(&self) -> Access {
        if self.epilogue == EPILOGUE_ACCUMULATE {
            Access::ReadWrite
        } else {
            Access::Write
        }
    }
}

crate::op_args! {
    /// `fused_matmul`'s arguments: `x: f32[rows, k]`, `g: f32[k]` (empty
    /// without norm), `w0, w1, w2` (GGUF blocks; empty when unused), `y0, y1,
    /// y2: f32[rows, n_i]` (empty when unused), `b0, b1, b2: f32[n_i]` (the
    /// biases; empty where `bias` has no bit).
    pub struct FusedArgs {
        x: Access::Read,
        g: Access::Read,
        w0: Access::Read,
        w1: Access::Read,
        w2: Access::Read,
        y0: shape.output_access(),
        y1: shape.output_access(),
        y2: shape.output_access(),
        b0: Access::Read,
        b1: Access::Read,
        b2: Access::Read;
        shape: FusedShape
    }
}

impl<B> FusedArgs<B> {
    /// The weights, in order.
    pub fn weights(&self) -> [&B; 3] {
        [&self.w0, &self.w1, &self.w2]
    }

    /// The outputs, in order.
    pub fn outputs(&self) -> [&B; 3] {
        [&self.y0, &self.y1, &self.y2]
    }

    /// The biases, in order (bound or not as `shape.bias` says).
    pub fn biases(&self) -> [&B; 3] {
        [&self.b0, &self.b1, &self.b2]
    }
}
