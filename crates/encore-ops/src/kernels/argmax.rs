//! Argmax: `out[0] = argmax_i x[i]` (the first index among equal maxima).
//!
//! Arguments: `x: f32[n]` (read), `out: u32[1]` (write), `n: u32` (value).

use encore::KernelDef;

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

pub fn def() -> KernelDef {
    KernelDef::new("argmax")
        .op("argmax")
        .cpu("argmax f32 v1", |a| {
            let n = a.scalar::<u32>(2)? as usize;
            let x = a.read::<f32>(0)?;
            super::need("x", x, n)?;
            let out = a.write::<u32>(1)?;
            super::need("out", out, 1)?;
            out[0] = argmax(&x[..n]);
            Ok(())
        })
}
