//! Replay versus eager encoding: the same N dispatches of an empty
//! three-argument kernel, either encoded, committed and waited for every
//! step, or recorded once and replayed. Reports time per step; divide by N
//! for the per-node cost. Also the cost of instantiating such a graph as it
//! grows.
//!
//! Runs on the CPU and on the first wgpu adapter when there is one (on a
//! wgpu device, a replay re-encodes the instantiated program's passes, and
//! eager encoding also builds its bind groups); `ENCORE_BENCH_DEVICES`
//! (comma-separated device names) chooses others.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use encore::{
    Arg, Buffer, Config, Device, Encoder, Graph, Kernel, KernelDef, Launch, Params, WgpuKernel,
};

/// An empty kernel on every backend that runs this benchmark.
fn empty() -> KernelDef {
    let wgsl = "struct Args { off: array<u32, 16> }\n\
        @group(0) @binding(0) var<storage, read> x: array<u32>;\n\
        @group(0) @binding(1) var<storage, read> pos: array<u32>;\n\
        @group(0) @binding(2) var<storage, read_write> y: array<u32>;\n\
        @group(1) @binding(0) var<storage, read> args: Args;\n\
        @compute @workgroup_size(1) fn empty() {}\n";
    KernelDef::new("empty")
        .cpu("empty", |_| Ok(()))
        .wgpu(WgpuKernel::fixed(wgsl, "empty", Launch::new(1, 1)))
}

/// The devices to measure: `ENCORE_BENCH_DEVICES`, else the CPU and the
/// first wgpu adapter if there is one.
fn devices() -> Vec<Device> {
    let names = std::env::var("ENCORE_BENCH_DEVICES").unwrap_or_else(|_| "cpu,wgpu:0".into());
    names
        .split(',')
        .filter_map(|name| match Device::open(name.trim(), &Config::default()) {
            Ok(d) => Some(d),
            Err(e) => {
                eprintln!("skipping device {name}: {e}");
                None
            }
        })
        .collect()
}

/// An empty kernel, its input, a `pos` parameter and 8 output views.
struct Fixture {
    device: Device,
    kernel: Kernel,
    x: Buffer,
    params: Params,
    pos: Buffer,
    out: Buffer,
    views: Vec<Buffer>,
}

impl Fixture {
    fn new(device: Device) -> Fixture {
        let kernel = device.load_kernel(&empty()).expect("kernel");
        let x = device.alloc(4096).expect("alloc");
        let params = Params::new(&device, &["pos"]).expect("params");
        let pos = params.slot("pos").expect("slot");
        let out = device.alloc(8 * 256).expect("alloc");
        let views = (0..8)
            .map(|i| out.view(i * 256, 256).expect("view"))
            .collect();
        Fixture {
            device,
            kernel,
            x,
            params,
            pos,
            out,
            views,
        }
    }

    /// `n` dispatches, a chain through the 8 rotating views: groups of up
    /// to 8 dispatches.
    fn record(&self, enc: &mut Encoder, n: usize) {
        for i in 0..n {
            enc.dispatch(
                &self.kernel,
                &[
                    Arg::read(&self.x),
                    Arg::read(&self.pos),
                    Arg::write(&self.views[i % 8]),
                ],
                "empty",
            )
            .expect("dispatch");
        }
    }

    /// The `n` dispatches recorded as a graph.
    fn graph(&self, n: usize) -> Graph {
        let mut enc = self.device.capture();
        self.record(&mut enc, n);
        let mut graph = enc.finish_graph().expect("graph");
        graph.set_params(&self.params);
        graph.mark_output(&self.out);
        graph
    }
}

fn replay_vs_eager(c: &mut Criterion) {
    for device in devices() {
        replay_vs_eager_on(c, Fixture::new(device));
    }
}

fn replay_vs_eager_on(c: &mut Criterion, f: Fixture) {
    let mut group = c.benchmark_group(format!("step/{}", f.device.name()));
    for n in [64usize, 512] {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("eager", n), &n, |b, &n| {
            let mut enc = f.device.encoder();
            b.iter(|| {
                f.params.set("pos", 7).expect("set");
                f.record(&mut enc, n);
                enc.commit_and_wait().expect("run");
            });
        });
        let exec = f.graph(n).instantiate(&[]).expect("instantiate");
        group.bench_with_input(BenchmarkId::new("replay", n), &n, |b, _| {
            b.iter(|| {
                exec.replay(&[("pos", 7)])
                    .expect("replay")
                    .wait()
                    .expect("wait")
            });
        });
    }
    group.finish();
}

/// Instantiating a recorded graph (its passes and the CPU executable) as
/// the graph grows: the time per node should stay about flat, so that
/// multi-step or 80-layer graphs are as cheap to prepare per node as one
/// step of a small model.
fn instantiate(c: &mut Criterion) {
    let f = Fixture::new(Device::cpu().expect("cpu"));
    let mut group = c.benchmark_group("instantiate");
    for n in [155usize, 1240, 2480] {
        let graph = f.graph(n);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| graph.instantiate(&[]).expect("instantiate"));
        });
    }
    group.finish();
}

criterion_group!(benches, replay_vs_eager, instantiate);
criterion_main!(benches);
