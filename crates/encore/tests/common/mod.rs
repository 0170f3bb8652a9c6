//! What the GPU backends' runtime tests share: random inputs, and kernels
//! with a body for every backend (CPU, CUDA, WGSL) that the tests run on
//! one GPU and compare with the CPU.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{SystemTime, UNIX_EPOCH};

use encore::{Arg, Buffer, CudaKernel, KernelDef, Launch, WgpuKernel};
use proptest::prelude::*;

/// A small xorshift generator: fresh inputs per run, reproducible from the printed seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn new() -> Rng {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        eprintln!("random seed {seed:#x}");
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

pub const SAXPY: &str = include_str!("../cuda/saxpy.cu");

/// The value of a `saxpy` dispatch: its two value arguments, `a` then `n`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SaxpyValue {
    pub a: f32,
    pub n: u32,
}

/// `saxpy` with a CPU body, a CUDA body that computes bit-identical results,
/// and a WGSL body (whose `fma` a Vulkan driver may round twice).
pub fn saxpy() -> KernelDef {
    KernelDef::new("saxpy")
        .cpu("saxpy f32 fma v1", |a| {
            let x = a.read::<f32>(0)?;
            let y = a.write::<f32>(1)?;
            let s: f32 = a.scalar(2)?;
            let n = a.scalar::<u32>(3)? as usize;
            y.iter_mut()
                .zip(x)
                .take(n)
                .for_each(|(y, &x)| *y = s.mul_add(x, *y));
            Ok(())
        })
        .cuda(CudaKernel::new(SAXPY, "saxpy", |v: &SaxpyValue| {
            Launch::cover(v.n, 256)
        }))
        .wgpu(WgpuKernel::new(
            include_str!("../wgsl/saxpy.wgsl"),
            "saxpy",
            |v: &SaxpyValue| Launch::cover(v.n, 256),
        ))
}

/// The value of a `mix` dispatch: its two value arguments, `c` then `n`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MixValue {
    pub c: f32,
    pub n: u32,
}

pub fn mix() -> KernelDef {
    KernelDef::new("mix")
        .cpu("mix f32 v1", |a| {
            let x = a.read::<f32>(0)?;
            let y = a.write::<f32>(1)?;
            let c: f32 = a.scalar(2)?;
            let n = a.scalar::<u32>(3)? as usize;
            y.iter_mut()
                .zip(x)
                .take(n)
                .for_each(|(y, &x)| *y = (*y * 0.5 + x) + c);
            Ok(())
        })
        .cuda(CudaKernel::new(
            include_str!("../cuda/mix.cu"),
            "mix",
            |v: &MixValue| Launch::cover(v.n, 32),
        ))
        .wgpu(WgpuKernel::new(
            include_str!("../wgsl/mix.wgsl"),
            "mix",
            |v: &MixValue| Launch::cover(v.n, 32),
        ))
}

/// One random dispatch: `y view += ...` reading an `x` view of either allocation.
#[derive(Clone, Debug)]
pub struct Op {
    pub src: usize,
    pub src_at: usize,
    pub dst: usize,
    pub dst_at: usize,
    pub len: usize,
    pub c: i8,
}

pub const FLOATS: usize = 96;

pub fn op() -> impl Strategy<Value = Op> {
    (
        0..2usize,
        0..64usize,
        0..2usize,
        0..64usize,
        1..32usize,
        -4i8..4,
    )
        .prop_map(|(src, src_at, dst, dst_at, len, c)| Op {
            src,
            src_at,
            dst,
            dst_at,
            len,
            c,
        })
}

/// Records `ops` into `enc` over two allocations; returns which ops were
/// accepted (an op whose views overlap is rejected, identically everywhere).
pub fn record(
    enc: &mut encore::Encoder,
    k: &encore::Kernel,
    bufs: &[Buffer],
    ops: &[Op],
) -> Vec<bool> {
    ops.iter()
        .map(|o| {
            let x = bufs[o.src].view_elems::<f32>(o.src_at, o.len).unwrap();
            let y = bufs[o.dst].view_elems::<f32>(o.dst_at, o.len).unwrap();
            let c = f32::from(o.c);
            let n = o.len as u32;
            enc.dispatch(
                k,
                &[
                    Arg::read(&x),
                    Arg::read_write(&y),
                    Arg::value(&c),
                    Arg::value(&n),
                ],
                "mix",
            )
            .is_ok()
        })
        .collect()
}

pub fn initial() -> [Vec<f32>; 2] {
    let a = (0..FLOATS).map(|i| i as f32 * 0.25).collect();
    let b = (0..FLOATS).map(|i| 7.0 - i as f32 * 0.125).collect();
    [a, b]
}
