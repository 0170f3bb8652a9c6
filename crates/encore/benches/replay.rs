//! Replay versus eager encoding on the CPU backend: the same N dispatches of
//! an empty three-argument kernel, either encoded, committed and waited for
//! every step, or recorded once and replayed. Reports time per step; divide
//! by N for the per-node cost.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use encore::{Arg, Buffer, Device, Encoder, Kernel, KernelDef, Launch, Params};

fn record(enc: &mut Encoder, k: &Kernel, x: &Buffer, p: &Buffer, views: &[Buffer], n: usize) {
    for i in 0..n {
        // A chain through 8 rotating views: groups of up to 8 dispatches.
        enc.dispatch(
            k,
            &[Arg::read(x), Arg::read(p), Arg::write(&views[i % 8])],
            Launch::new(1, 1),
            "empty",
        )
        .expect("dispatch");
    }
}

fn replay_vs_eager(c: &mut Criterion) {
    let device = Device::cpu().expect("cpu");
    let k = device
        .load_kernel(&KernelDef::new("empty").cpu("empty", |_| Ok(())))
        .expect("kernel");
    let x = device.alloc(4096).expect("alloc");
    let params = Params::new(&device, &["pos"]).expect("params");
    let p = params.slot("pos").expect("slot");
    let out = device.alloc(8 * 256).expect("alloc");
    let views: Vec<Buffer> = (0..8)
        .map(|i| out.view(i * 256, 256).expect("view"))
        .collect();

    let mut group = c.benchmark_group("step");
    for n in [64usize, 512] {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("eager", n), &n, |b, &n| {
            let mut enc = device.encoder();
            b.iter(|| {
                params.set("pos", 7).expect("set");
                record(&mut enc, &k, &x, &p, &views, n);
                enc.commit_and_wait().expect("run");
            });
        });
        let mut enc = device.encoder();
        record(&mut enc, &k, &x, &p, &views, n);
        let mut graph = enc.finish_graph().expect("graph");
        graph.set_params(&params);
        graph.mark_output(&out);
        let exec = graph.instantiate(&[]).expect("instantiate");
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
    let device = Device::cpu().expect("cpu");
    let k = device
        .load_kernel(&KernelDef::new("empty").cpu("empty", |_| Ok(())))
        .expect("kernel");
    let x = device.alloc(4096).expect("alloc");
    let params = Params::new(&device, &["pos"]).expect("params");
    let p = params.slot("pos").expect("slot");
    let out = device.alloc(8 * 256).expect("alloc");
    let views: Vec<Buffer> = (0..8)
        .map(|i| out.view(i * 256, 256).expect("view"))
        .collect();
    let mut group = c.benchmark_group("instantiate");
    for n in [155usize, 1240, 2480] {
        let mut enc = device.encoder();
        record(&mut enc, &k, &x, &p, &views, n);
        let mut graph = enc.finish_graph().expect("graph");
        graph.set_params(&params);
        graph.mark_output(&out);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| graph.instantiate(&[]).expect("instantiate"));
        });
    }
    group.finish();
}

criterion_group!(benches, replay_vs_eager, instantiate);
criterion_main!(benches);
