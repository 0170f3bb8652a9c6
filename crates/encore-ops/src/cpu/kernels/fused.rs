//! The CPU body of `fused_matmul` ([`crate::kernels::fused`]): the unfused
//! operations' own code in sequence, so a fused graph gives bit-identical
//! results on the CPU.

use std::cell::Cell;

use encore::CpuArgs;

use super::elementwise::{add_bias, add_into, silu_mul_into};
use super::norm::rms_norm_row;
use crate::kernels::fused::{FusedArgs, EPILOGUE_ACCUMULATE, EPILOGUE_STORE, EPILOGUE_SWIGLU};
use crate::DType;

thread_local! {
    static NORMED: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static PRODUCTS: Cell<[Vec<f32>; 2]> = const { Cell::new([Vec::new(), Vec::new()]) };
    static QUANT: Cell<crate::cpu::QuantizedActivations> =
        Cell::new(crate::cpu::QuantizedActivations::new());
}

/// The CPU body: the unfused operations in sequence, with per-thread scratch
/// buffers taken out for the call (the products run on the worker pool,
/// which may start another fused product on this thread meanwhile).
pub(crate) fn fused_matmul(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = FusedArgs::from_cpu(a)?;
    let s = args.shape;
    let (rows, k) = (s.rows as usize, s.k as usize);
    let weights = s.weights as usize;
    if !(1..=3).contains(&weights)
        || s.epilogue > EPILOGUE_SWIGLU
        || (s.epilogue == EPILOGUE_SWIGLU && (weights != 2 || s.n[0] != s.n[1]))
        || (s.epilogue == EPILOGUE_ACCUMULATE && weights != 1)
    {
        return Err(format!("inconsistent fused shape {s:?}"));
    }
    let x = args.x.read::<f32>()?;
    super::need("x", x, rows * k)?;
    let mut normed = NORMED.with(Cell::take);
    let mut products = PRODUCTS.with(Cell::take);
    let mut quant = QUANT.with(Cell::take);
    let result = (|| {
        let input: &[f32] = if s.norm != 0 {
            let g = args.g.read::<f32>()?;
            super::need("g", g, k)?;
            normed.resize(rows * k, 0.0);
            for (xr, yr) in x[..rows * k]
                .chunks_exact(k.max(1))
                .zip(normed.chunks_exact_mut(k.max(1)))
            {
                rms_norm_row(xr, &g[..k], yr, s.eps);
            }
            &normed
        } else {
            &x[..rows * k]
        };
        let product = |i: usize, out: &mut [f32], quant: &mut _| -> Result<(), String> {
            let dtype = DType::from_ggml_id(s.dtype[i]).ok_or("unsupported weight type")?;
            let n = s.n[i] as usize;
            let w_bytes = dtype
                .bytes_for(k)
                .and_then(|b| b.checked_mul(n))
                .ok_or("row length not a whole number of blocks")?;
            let w = args.weights()[i].read::<u8>()?;
            super::need("w", w, w_bytes)?;
            crate::cpu::matmul_with_scratch(dtype, &w[..w_bytes], n, k, input, out, quant)
                .map_err(|e| e.to_string())
        };
        match s.epilogue {
            EPILOGUE_STORE => {
                for i in 0..weights {
                    let n = s.n[i] as usize;
                    let y = args.outputs()[i].write::<f32>()?;
                    super::need("y", y, rows * n)?;
                    product(i, &mut y[..rows * n], &mut quant)?;
                    if s.bias & 1 << i != 0 {
                        let b = args.biases()[i].read::<f32>()?;
                        super::need("b", b, n)?;
                        add_bias(&mut y[..rows * n], &b[..n]);
                    }
                }
            }
            EPILOGUE_ACCUMULATE => {
                let n = rows * s.n[0] as usize;
                let [p, _] = &mut products;
                p.resize(n, 0.0);
                product(0, p, &mut quant)?;
                let y = args.y0.write::<f32>()?;
                super::need("y", y, n)?;
                add_into(&mut y[..n], p);
            }
            _ => {
                let n = rows * s.n[0] as usize;
                let [gate, up] = &mut products;
                gate.resize(n, 0.0);
                up.resize(n, 0.0);
                product(0, gate, &mut quant)?;
                product(1, up, &mut quant)?;
                let y = args.y0.write::<f32>()?;
                super::need("y", y, n)?;
                silu_mul_into(gate, up, &mut y[..n]);
            }
        }
        Ok(())
    })();
    NORMED.with(|c| c.set(normed));
    PRODUCTS.with(|c| c.set(products));
    QUANT.with(|c| c.set(quant));
    result
}
