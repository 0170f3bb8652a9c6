//! The CPU body of `matmul` ([`crate::kernels::matmul`]): the activations
//! quantized to 8-bit blocks for quantized weights, as ggml does.

use encore::CpuArgs;

use crate::kernels::matmul::MatmulArgs;
use crate::DType;

thread_local! {
    static SCRATCH: std::cell::Cell<crate::cpu::QuantizedActivations> =
        std::cell::Cell::new(crate::cpu::QuantizedActivations::new());
}

/// Inlined into the kernel's closure: passed as a plain function pointer it
/// is not inlined into the worker's loop, which makes CPU prefill slower.
#[inline(always)]
pub(crate) fn matmul(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = MatmulArgs::from_cpu(a)?;
    let s = args.shape;
    let dtype = DType::from_ggml_id(s.dtype).ok_or("unsupported weight type")?;
    let (rows, n, k) = (s.rows as usize, s.n as usize, s.k as usize);
    let w_bytes = dtype
        .bytes_for(k)
        .and_then(|b| b.checked_mul(n))
        .ok_or("row length not a whole number of blocks")?;
    let (w, x, y) = (
        args.w.read::<u8>()?,
        args.x.read::<f32>()?,
        args.y.write::<f32>()?,
    );
    super::need("w", w, w_bytes)?;
    super::need("x", x, rows * k)?;
    super::need("y", y, rows * n)?;
    // Quantized activations are staged in a per-thread buffer that grows
    // once and is reused by later products on that thread.
    let mut scratch = SCRATCH.with(|s| s.take());
    let result = crate::cpu::matmul_with_scratch(
        dtype,
        &w[..w_bytes],
        n,
        k,
        &x[..rows * k],
        &mut y[..rows * n],
        &mut scratch,
    );
    SCRATCH.with(|s| s.replace(scratch));
    result.map_err(|e| e.to_string())
}
