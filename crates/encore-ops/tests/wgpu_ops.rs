//! Every op's WGSL kernel against its CPU body, on random inputs.
//!
//! Each test runs one op through [`Ops`] on the CPU device and on a wgpu
//! device with the same inputs and compares, with the tolerance stated at
//! the test. The wgpu device is `ENCORE_TEST_WGPU` (default `wgpu:0`, the
//! first adapter: Mesa's lavapipe where no GPU exists, which `.ci/run`
//! installs); without any adapter the tests fail and say how to get one.
//! The tests by op family live in `tests/wgpu/`.

// Helpers fail a test the way assertions do: by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::{Config, Device, Encoder, Result};
use encore_ops::{KernelSet, Ops};

mod common;
use common::assert_close;

#[path = "wgpu/attention.rs"]
mod attention;
#[path = "wgpu/attention_step.rs"]
mod attention_step;
#[path = "wgpu/elementwise.rs"]
mod elementwise;
#[path = "wgpu/matmul.rs"]
mod matmul;

/// The name of the wgpu device under test.
fn wgpu_name() -> String {
    std::env::var("ENCORE_TEST_WGPU")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "wgpu:0".into())
}

/// The ops of `kernels` on device `name`.
fn open_with(name: &str, kernels: KernelSet) -> Ops {
    open_configured(name, kernels, &Config::default())
}

/// The ops of `kernels` on device `name` opened with `config`.
fn open_configured(name: &str, kernels: KernelSet, config: &Config) -> Ops {
    let device = Device::open(name, config).unwrap_or_else(|e| {
        panic!(
            "device {name}: {e} (the wgpu tests need a Vulkan, Metal or DirectX 12 \
             adapter; on Debian `apt-get install mesa-vulkan-drivers` gives lavapipe)"
        )
    });
    Ops::new(&device, kernels).unwrap_or_else(|e| panic!("ops on {name}: {e}"))
}

/// The CPU and the wgpu ops, in that order.
fn both() -> [Ops; 2] {
    [
        open_with("cpu", KernelSet::Default),
        open_with(&wgpu_name(), KernelSet::Default),
    ]
}

/// [`both`], and the CPU with the wgpu device opened without subgroup
/// operations or f16 arithmetic (`Config::subgroups` and
/// `Config::shader_f16` off): the kernels that have versions using them
/// run those in the first pair where the adapter offers them (the device's
/// arch then ends in `+subgroups`, `+f16` or both, which the pairs' names
/// say), and their portable version in the second.
fn both_with_and_without_features() -> [[Ops; 2]; 2] {
    let without = Config {
        subgroups: false,
        shader_f16: false,
        ..Config::default()
    };
    let plain = open_configured(&wgpu_name(), KernelSet::Default, &without);
    let arch = plain.device().arch();
    assert!(
        !arch.contains("+subgroups") && !arch.contains("+f16"),
        "{arch}: subgroups and f16 were turned off"
    );
    [both(), [open_with("cpu", KernelSet::Default), plain]]
}

/// Records one op with `f` into a graph that outputs `outs`, instantiates
/// it (its kernels specialized for their shapes where they have variants)
/// and replays it once; returns how many nodes got a specialized kernel.
fn run_graph(
    ops: &Ops,
    outs: &[&encore::Buffer],
    f: impl FnOnce(&Ops, &mut Encoder) -> Result<()>,
) -> usize {
    let name = ops.device().name().to_string();
    let mut enc = ops.device().capture();
    f(ops, &mut enc).unwrap_or_else(|e| panic!("{name}: record: {e}"));
    let mut graph = enc
        .finish_graph()
        .unwrap_or_else(|e| panic!("{name}: graph: {e}"));
    for out in outs {
        graph.mark_output(out);
    }
    let exec = graph
        .instantiate(&[])
        .unwrap_or_else(|e| panic!("{name}: instantiate: {e}"));
    exec.replay(&[])
        .and_then(|s| s.wait().map(drop))
        .unwrap_or_else(|e| panic!("{name}: replay: {e}"));
    exec.stats().specialized
}

/// Encodes one op with `f` and waits for it.
fn run(ops: &Ops, f: impl FnOnce(&Ops, &mut Encoder) -> Result<()>) {
    let mut enc = ops.device().encoder();
    f(ops, &mut enc).unwrap_or_else(|e| panic!("{}: encode: {e}", ops.device().name()));
    enc.commit_and_wait()
        .unwrap_or_else(|e| panic!("{}: run: {e}", ops.device().name()));
}
