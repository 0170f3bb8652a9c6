//! Graph capture, passes and replay on the CPU backend.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::graph::passes::FusionPattern;
use encore::{
    Arg, Buffer, Config, Device, Error, GraphCache, Kernel, KernelDef, Node, NodeArg, Params,
};
use proptest::prelude::*;

fn device_with(fusion: bool, schedule: bool) -> Device {
    let config = Config {
        fusion,
        schedule,
        ..Config::default()
    };
    Device::open("cpu", &config).unwrap()
}

/// y = y * 0.5 + x * scale + param, elementwise (x wraps around).
fn mix_kernel(d: &Device) -> Kernel {
    d.load_kernel(&KernelDef::new("mix").cpu("mix with param v1", |a| {
        let p = a.read::<u32>(2)?[0] as f32;
        let scale: f32 = a.scalar(3)?;
        let x = a.read::<f32>(0)?;
        let y = a.write::<f32>(1)?;
        for (i, v) in y.iter_mut().enumerate() {
            *v = *v * 0.5 + x[i % x.len()] * scale + p;
        }
        Ok(())
    }))
    .unwrap()
}

#[derive(Clone, Debug)]
struct Op {
    src: (usize, usize),
    dst: (usize, usize),
    scale: f32,
    scratch: bool,
}

fn op_strategy(len: usize) -> impl Strategy<Value = Op> {
    let range = move || (0..len - 1).prop_flat_map(move |s| (Just(s), 1..=(len - s).min(48)));
    (range(), range(), -2.0f32..2.0, prop::bool::weighted(0.15)).prop_map(
        |(src, dst, scale, scratch)| Op {
            src,
            dst,
            scale,
            scratch,
        },
    )
}

fn encode_ops(
    d: &Device,
    enc: &mut encore::Encoder,
    k: &Kernel,
    buf: &Buffer,
    scratch: &Buffer,
    params: &Params,
    ops: &[Op],
) {
    let p = params.slot("p").unwrap();
    for op in ops {
        let overlaps = op.src.0 < op.dst.0 + op.dst.1 && op.dst.0 < op.src.0 + op.src.1;
        if overlaps {
            continue;
        }
        let src = buf.view_elems::<f32>(op.src.0, op.src.1).unwrap();
        let dst = if op.scratch {
            scratch.view_elems::<f32>(0, op.dst.1).unwrap()
        } else {
            buf.view_elems::<f32>(op.dst.0, op.dst.1).unwrap()
        };
        enc.dispatch(
            k,
            &[
                Arg::read(&src),
                Arg::write(&dst),
                Arg::read(&p),
                Arg::value(&op.scale),
            ],
            "mix",
        )
        .unwrap();
    }
    let _ = d;
}

fn init(seed: u32) -> Vec<f32> {
    (0..256u32)
        .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 100.0 + 0.01)
        .collect()
}

fn eager(ops: &[Op], values: &[u32], seed: u32) -> Vec<f32> {
    let d = device_with(false, false);
    let k = mix_kernel(&d);
    let buf = d.buffer_from(&init(seed)).unwrap();
    let scratch = d.alloc(256 * 4).unwrap();
    let params = Params::new(&d, &["p"]).unwrap();
    for &v in values {
        params.set("p", v).unwrap();
        let mut enc = d.encoder();
        enc.set_serial(true);
        encode_ops(&d, &mut enc, &k, &buf, &scratch, &params, ops);
        enc.commit_and_wait().unwrap();
    }
    buf.download().unwrap()
}

/// The graph of `ops` replayed once for each of `values`, `runs` runs a
/// replay.
fn replayed(
    ops: &[Op],
    values: &[u32],
    seed: u32,
    fusion: bool,
    schedule: bool,
    runs: usize,
) -> (Vec<f32>, encore::GraphStats) {
    let d = device_with(fusion, schedule);
    let k = mix_kernel(&d);
    let buf = d.buffer_from(&init(seed)).unwrap();
    let scratch = d.alloc(256 * 4).unwrap();
    let params = Params::new(&d, &["p"]).unwrap();
    let mut enc = d.capture();
    encode_ops(&d, &mut enc, &k, &buf, &scratch, &params, ops);
    let mut graph = enc.finish_graph().unwrap();
    graph.set_params(&params);
    graph.set_runs_per_replay(runs);
    graph.mark_output(&buf);
    let exec = graph.instantiate(&[]).unwrap();
    // Drop every handle the caller had: the executable owns what it needs.
    let result_view = buf.clone();
    drop((graph, scratch, params, k));
    for &v in values {
        exec.replay(&[("p", v)]).unwrap().wait().unwrap();
    }
    (result_view.download().unwrap(), exec.stats().clone())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, failure_persistence: None, ..ProptestConfig::default() })]

    /// Optimized replay is bit-identical to eager execution, for random
    /// graphs over random views and random parameter values, and scheduling
    /// never needs more barriers than the recording order.
    #[test]
    fn optimized_replay_equals_eager(
        ops in prop::collection::vec(op_strategy(256), 1..40),
        values in prop::collection::vec(0u32..100, 1..4),
        seed in 0u32..1000,
    ) {
        let expected = eager(&ops, &values, seed);
        let (got, stats) = replayed(&ops, &values, seed, true, true, 1);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&got), bits(&expected));
        prop_assert!(stats.after.groups <= stats.before.groups, "{:?}", stats);
        let (unscheduled, _) = replayed(&ops, &values, seed, false, false, 1);
        prop_assert_eq!(bits(&unscheduled), bits(&expected));
    }

    /// A replay of several runs equals as many eager executions with the
    /// same parameter value, each run seeing what the one before wrote.
    #[test]
    fn a_replay_of_several_runs_equals_running_them_one_after_another(
        ops in prop::collection::vec(op_strategy(256), 1..24),
        value in 0u32..100,
        runs in 2usize..5,
        seed in 0u32..1000,
    ) {
        let expected = eager(&ops, &vec![value; runs], seed);
        let (got, stats) = replayed(&ops, &[value], seed, true, true, runs);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&got), bits(&expected));
        prop_assert_eq!(stats.runs_per_replay, runs);
    }
}

fn unary(d: &Device, name: &'static str, op: &'static str, f: fn(f32) -> f32) -> Kernel {
    d.load_kernel(&KernelDef::new(name).op(op).cpu(name, move |a| {
        let x = a.read::<f32>(0)?;
        let y = a.write::<f32>(1)?;
        y.iter_mut().zip(x).for_each(|(y, &x)| *y = f(x));
        Ok(())
    }))
    .unwrap()
}

/// scale (x * 2) followed by add_one (+1) fuses into one node computing 2x + 1.
fn scale_add_pattern(d: &Device) -> FusionPattern {
    let fused = unary(d, "scale_add_one", "scale_add_one", |x| x * 2.0 + 1.0);
    FusionPattern::new(
        "scale+add_one",
        &["scale", "add_one"],
        move |chain: &[&Node]| {
            let input = chain[0].args[0].clone();
            let output = chain[1].args[1].clone();
            Some(Node {
                kernel: fused.clone(),
                args: vec![input, output],
                label: "scale+add_one".into(),
            })
        },
    )
}

#[test]
fn fusion_fires_exactly_where_a_pattern_matches_and_preserves_results() {
    let d = device_with(true, true);
    let scale = unary(&d, "scale", "scale", |x| x * 2.0);
    let add_one = unary(&d, "add_one", "add_one", |x| x + 1.0);
    let neg = unary(&d, "neg", "neg", |x| -x);
    let x = d.buffer_from(&[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let [t1, y1, t2, y2, t3, y3, y4] = std::array::from_fn(|_| d.alloc(16).unwrap());
    let mut enc = d.capture();
    // Chain 1: scale -> add_one, intermediate used only inside: fuses.
    enc.dispatch(&scale, &[Arg::read(&x), Arg::write(&t1)], "s1")
        .unwrap();
    enc.dispatch(&add_one, &[Arg::read(&t1), Arg::write(&y1)], "a1")
        .unwrap();
    // Chain 2: scale -> neg: no pattern.
    enc.dispatch(&scale, &[Arg::read(&x), Arg::write(&t2)], "s2")
        .unwrap();
    enc.dispatch(&neg, &[Arg::read(&t2), Arg::write(&y2)], "n2")
        .unwrap();
    // Chain 3: scale -> add_one, but the intermediate is also read later: must not fuse.
    enc.dispatch(&scale, &[Arg::read(&x), Arg::write(&t3)], "s3")
        .unwrap();
    enc.dispatch(&add_one, &[Arg::read(&t3), Arg::write(&y3)], "a3")
        .unwrap();
    enc.dispatch(&neg, &[Arg::read(&t3), Arg::write(&y4)], "n3")
        .unwrap();
    let mut graph = enc.finish_graph().unwrap();
    for out in [&y1, &y2, &y3, &y4] {
        graph.mark_output(out);
    }
    let exec = graph.instantiate(&[scale_add_pattern(&d)]).unwrap();
    assert_eq!(exec.stats().fused, 1);
    assert_eq!(exec.stats().after.nodes, 6);
    let fused_nodes: Vec<_> = exec
        .nodes()
        .iter()
        .filter(|n| n.op() == "scale_add_one")
        .collect();
    assert_eq!(fused_nodes.len(), 1);
    assert_eq!(&*fused_nodes[0].label, "scale+add_one");
    exec.replay(&[]).unwrap().wait().unwrap();
    assert_eq!(y1.download::<f32>().unwrap(), [3.0, 5.0, 7.0, 9.0]);
    assert_eq!(y2.download::<f32>().unwrap(), [-2.0, -4.0, -6.0, -8.0]);
    assert_eq!(y3.download::<f32>().unwrap(), [3.0, 5.0, 7.0, 9.0]);
    assert_eq!(y4.download::<f32>().unwrap(), [-2.0, -4.0, -6.0, -8.0]);
}

#[test]
fn fusion_is_refused_when_it_would_cross_a_conflicting_node() {
    let d = device_with(true, true);
    let scale = unary(&d, "scale", "scale", |x| x * 2.0);
    let add_one = unary(&d, "add_one", "add_one", |x| x + 1.0);
    let neg = unary(&d, "neg", "neg", |x| -x);
    let x = d.buffer_from(&[1.0f32, 2.0]).unwrap();
    let (t, y) = (d.alloc(8).unwrap(), d.alloc(8).unwrap());
    let mut enc = d.capture();
    enc.dispatch(&scale, &[Arg::read(&x), Arg::write(&t)], "s")
        .unwrap();
    // Overwrites x between the chain's members: moving `scale` after it would read the new x.
    enc.dispatch(&neg, &[Arg::read(&y), Arg::write(&x)], "clobber")
        .unwrap();
    enc.dispatch(&add_one, &[Arg::read(&t), Arg::write(&y)], "a")
        .unwrap();
    let mut graph = enc.finish_graph().unwrap();
    graph.mark_output(&y);
    graph.mark_output(&x);
    let exec = graph.instantiate(&[scale_add_pattern(&d)]).unwrap();
    assert_eq!(exec.stats().fused, 0);
}

#[test]
fn dead_nodes_are_removed_and_outputs_kept() {
    let d = device_with(true, true);
    let scale = unary(&d, "scale", "scale", |x| x * 2.0);
    let x = d.buffer_from(&[1.0f32; 4]).unwrap();
    let (unused, y) = (d.alloc(16).unwrap(), d.alloc(16).unwrap());
    let mut enc = d.capture();
    enc.dispatch(&scale, &[Arg::read(&x), Arg::write(&unused)], "dead")
        .unwrap();
    enc.dispatch(&scale, &[Arg::read(&x), Arg::write(&y)], "live")
        .unwrap();
    let mut graph = enc.finish_graph().unwrap();
    graph.mark_output(&y);
    let exec = graph.instantiate(&[]).unwrap();
    assert_eq!(exec.stats().removed, 1);
    assert_eq!(exec.nodes().len(), 1);
    assert_eq!(&*exec.nodes()[0].label, "live");
}

#[test]
fn scheduling_groups_independent_branches() {
    let d = device_with(false, true);
    let scale = unary(&d, "scale", "scale", |x| x * 2.0);
    let x = d.buffer_from(&[1.0f32; 4]).unwrap();
    let bufs: Vec<_> = (0..8).map(|_| d.alloc(16).unwrap()).collect();
    let mut enc = d.capture();
    // Four independent two-step chains, recorded chain by chain.
    for c in 0..4 {
        enc.dispatch(&scale, &[Arg::read(&x), Arg::write(&bufs[2 * c])], "a")
            .unwrap();
        enc.dispatch(
            &scale,
            &[Arg::read(&bufs[2 * c]), Arg::write(&bufs[2 * c + 1])],
            "b",
        )
        .unwrap();
    }
    let mut graph = enc.finish_graph().unwrap();
    for b in &bufs {
        graph.mark_output(b);
    }
    let exec = graph.instantiate(&[]).unwrap();
    let s = exec.stats();
    assert_eq!(s.before.groups, 5);
    assert_eq!(s.after.groups, 2);
    assert_eq!(s.after.max_group, 4);
    assert_eq!(s.after.mean_group, 4.0);
    assert_eq!(s.after.edges, 4);
    assert_eq!(
        s.before.edges, 4,
        "reordering changes groups, not dependencies"
    );
    exec.replay(&[]).unwrap().wait().unwrap();
    for c in 0..4 {
        assert_eq!(bufs[2 * c + 1].download::<f32>().unwrap(), [4.0; 4]);
    }
}

#[test]
fn executable_cache_reuses_by_shape_and_ignores_parameter_values() {
    let d = device_with(true, true);
    let k = mix_kernel(&d);
    let params = Params::new(&d, &["p"]).unwrap();
    let p = params.slot("p").unwrap();
    let x = d.buffer_from(&[1.0f32; 64]).unwrap();
    let y = d.alloc(256).unwrap();
    let cache = GraphCache::new(Vec::new());
    let record = |len: usize| {
        let mut enc = d.capture();
        let yv = y.view_elems::<f32>(0, len).unwrap();
        enc.dispatch(
            &k,
            &[
                Arg::read(&x),
                Arg::write(&yv),
                Arg::read(&p),
                Arg::value(&1.0f32),
            ],
            "mix",
        )
        .unwrap();
        let mut g = enc.finish_graph().unwrap();
        g.set_params(&params);
        g.mark_output(&y);
        g
    };
    let g = record(64);
    let a = cache.get_or_instantiate(&g).unwrap();
    a.replay(&[("p", 1)]).unwrap().wait().unwrap();
    a.replay(&[("p", 2)]).unwrap().wait().unwrap();
    let b = cache.get_or_instantiate(&record(64)).unwrap();
    assert_eq!((cache.hits(), cache.misses()), (1, 1));
    let _ = cache.get_or_instantiate(&record(32)).unwrap();
    assert_eq!(
        (cache.hits(), cache.misses()),
        (1, 2),
        "a changed shape records anew"
    );
    b.replay(&[("p", 3)]).unwrap().wait().unwrap();
    assert_eq!(d.counters().graph_instantiations, 2);
    assert_eq!(d.counters().graph_replays, 3);
    // y = ((0*.5 + 1 + 1)*.5 + 1 + 2)*.5 + 1 + 3 = 6
    assert_eq!(y.download::<f32>().unwrap()[..64], [6.0; 64]);
    assert!(matches!(a.replay(&[("nope", 1)]), Err(Error::Graph(_))));
}

#[test]
fn graph_arguments_keep_their_views() {
    let d = device_with(true, true);
    let scale = unary(&d, "scale", "scale", |x| x * 2.0);
    let buf = d.buffer_from(&[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let (lo, hi) = (
        buf.view_elems::<f32>(0, 2).unwrap(),
        buf.view_elems::<f32>(2, 2).unwrap(),
    );
    let mut enc = d.capture();
    enc.dispatch(&scale, &[Arg::read(&lo), Arg::write(&hi)], "s")
        .unwrap();
    let graph = enc.finish_graph().unwrap();
    match &graph.nodes()[0].args[1] {
        NodeArg::Buffer(b, a) => {
            assert_eq!((b.offset(), b.len(), *a), (8, 8, encore::Access::Write));
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn a_capturing_encoder_refuses_commit_and_a_plain_one_refuses_finish_graph() {
    let d = device_with(true, true);
    let scale = unary(&d, "scale", "scale", |x| x * 2.0);
    let x = d.buffer_from(&[1.0f32; 4]).unwrap();
    let y = d.buffer_from(&[0.0f32; 4]).unwrap();
    let before = d.counters();

    let mut capture = d.capture();
    assert!(capture.is_capturing());
    capture
        .dispatch(&scale, &[Arg::read(&x), Arg::write(&y)], "s")
        .unwrap();
    assert!(matches!(capture.commit(), Err(Error::Graph(_))));
    // The refusal ran nothing and kept the recorded node for the graph.
    assert_eq!(d.counters().since(&before).submissions, 0);
    assert_eq!(y.download::<f32>().unwrap(), [0.0; 4]);
    assert_eq!(capture.len(), 1);
    assert_eq!(capture.finish_graph().unwrap().nodes().len(), 1);

    let mut plain = d.encoder();
    assert!(!plain.is_capturing());
    plain
        .dispatch(&scale, &[Arg::read(&x), Arg::write(&y)], "s")
        .unwrap();
    assert!(matches!(plain.finish_graph(), Err(Error::Graph(_))));
    // The refusal kept the recorded dispatch, which still runs.
    assert_eq!(plain.len(), 1);
    plain.commit_and_wait().unwrap();
    assert_eq!(y.download::<f32>().unwrap(), [2.0; 4]);
}
