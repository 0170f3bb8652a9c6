//! Elementwise kernels.
//!
//! - `add`: `y[i] += x[i]` — `y: f32[n]` (read-write), `x: f32[n]` (read), `n: u32`.
//! - `add_rows`: `y[r, j] += b[j]` — `y: f32[rows, n]` (read-write),
//!   `b: f32[n]` (read), `[rows, n]: [u32; 2]`.
//! - `silu_mul`: `y[i] = silu(g[i]) * u[i]`, `silu(v) = v / (1 + e^-v)` —
//!   `g: f32[n]` (read), `u: f32[n]` (read), `y: f32[n]` (write), `n: u32`.

use encore::KernelDef;

pub fn add_def() -> KernelDef {
    KernelDef::new("add").op("add").cpu("add f32 v1", |a| {
        let n = a.scalar::<u32>(2)? as usize;
        let (y, x) = (a.write::<f32>(0)?, a.read::<f32>(1)?);
        super::need("y", y, n)?;
        super::need("x", x, n)?;
        y[..n].iter_mut().zip(&x[..n]).for_each(|(y, x)| *y += x);
        Ok(())
    })
}

pub fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

pub fn silu_mul_def() -> KernelDef {
    KernelDef::new("silu_mul")
        .op("silu_mul")
        .cpu("silu_mul f32 v1", |a| {
            let n = a.scalar::<u32>(3)? as usize;
            let (g, u, y) = (a.read::<f32>(0)?, a.read::<f32>(1)?, a.write::<f32>(2)?);
            super::need("g", g, n)?;
            super::need("u", u, n)?;
            super::need("y", y, n)?;
            for ((y, g), u) in y[..n].iter_mut().zip(&g[..n]).zip(&u[..n]) {
                *y = silu(*g) * u;
            }
            Ok(())
        })
}

pub fn add_rows_def() -> KernelDef {
    KernelDef::new("add_rows")
        .op("add_rows")
        .cpu("add_rows f32 v1", |a| {
            let [rows, n] = a.scalar::<[u32; 2]>(2)?.map(|v| v as usize);
            let (y, b) = (a.write::<f32>(0)?, a.read::<f32>(1)?);
            super::need("y", y, rows * n)?;
            super::need("b", b, n)?;
            for row in y[..rows * n].chunks_exact_mut(n.max(1)) {
                row.iter_mut().zip(&b[..n]).for_each(|(y, b)| *y += b);
            }
            Ok(())
        })
}
