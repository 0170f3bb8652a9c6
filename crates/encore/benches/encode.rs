//! Encoding cost on the CPU backend: nanoseconds per dispatch of an empty
//! kernel with three buffer arguments, with hazard tracking and in serial
//! mode (a barrier after every dispatch, no range checks), for concurrent
//! groups of 1 to 64 dispatches. Only encoding is timed; nothing is submitted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use encore::{Arg, Device, KernelDef};

const DISPATCHES: usize = 1024;

fn encode(c: &mut Criterion) {
    let device = Device::cpu().expect("cpu device");
    let empty = device
        .load_kernel(&KernelDef::new("empty").cpu("empty", |_| Ok(())))
        .expect("kernel");
    let input = device.alloc(1 << 16).expect("alloc");
    let weights = device.alloc(1 << 16).expect("alloc");
    let outputs = device.alloc(64 * 256).expect("alloc");
    let views: Vec<_> = (0..64)
        .map(|i| outputs.view(i * 256, 256).expect("view"))
        .collect();

    let mut group = c.benchmark_group("encode");
    group.throughput(Throughput::Elements(DISPATCHES as u64));
    for serial in [false, true] {
        for group_size in [1usize, 2, 4, 8, 16, 32, 64] {
            let name = if serial { "serial" } else { "tracked" };
            group.bench_with_input(BenchmarkId::new(name, group_size), &group_size, |b, &g| {
                let mut enc = device.encoder();
                enc.set_serial(serial);
                b.iter(|| {
                    for i in 0..DISPATCHES {
                        // Dispatch i writes view i % g: every g-th dispatch
                        // overwrites a view of the current group (a barrier).
                        let out = &views[i % g];
                        enc.dispatch(
                            &empty,
                            &[Arg::read(&input), Arg::read(&weights), Arg::write(out)],
                            "empty",
                        )
                        .expect("dispatch");
                    }
                    enc.reset();
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);
