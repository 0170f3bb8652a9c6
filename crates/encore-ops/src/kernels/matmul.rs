//! Matrix products with (possibly quantized) weights:
//! `y[r, j] = sum_i w[j, i] * x[r, i]` for `rows` activation rows.
//!
//! Arguments: `w: dtype[n, k]` (read, raw GGUF blocks), `x: f32[rows, k]`
//! (read), `y: f32[rows, n]` (write), [`MatmulShape`] (value).

use encore::KernelDef;

use crate::DType;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MatmulShape {
    pub rows: u32,
    pub n: u32,
    pub k: u32,
    /// ggml type id of the weights.
    pub dtype: u32,
}

thread_local! {
    static SCRATCH: std::cell::Cell<crate::cpu::QuantizedActivations> =
        std::cell::Cell::new(crate::cpu::QuantizedActivations::new());
}

pub fn def() -> KernelDef {
    KernelDef::new("matmul").op("matmul").cpu("matmul v1", |a| {
        let s: MatmulShape = a.scalar(3)?;
        let dtype = DType::from_ggml_id(s.dtype).ok_or("unsupported weight type")?;
        let (rows, n, k) = (s.rows as usize, s.n as usize, s.k as usize);
        let w_bytes = dtype
            .bytes_for(k)
            .and_then(|b| b.checked_mul(n))
            .ok_or("row length not a whole number of blocks")?;
        let (w, x, y) = (a.read::<u8>(0)?, a.read::<f32>(1)?, a.write::<f32>(2)?);
        super::need("w", w, w_bytes)?;
        super::need("x", x, rows * k)?;
        super::need("y", y, rows * n)?;
        // Quantized activations are staged in a per-thread buffer that grows
        // once and is reused by later products on that thread. It is taken
        // out for the call: while rayon waits inside it, this thread may run
        // another product that wants the buffer too.
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
    })
}
