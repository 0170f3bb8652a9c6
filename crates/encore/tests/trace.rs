//! Traces, profiles and the one-shot capture on the CPU backend.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use encore::{Arg, Buffer, Config, Device, GraphExec, Kernel, KernelDef, ProfileMode};
use serde_json::Value;

/// y = 2 x over the shorter of the two.
fn double(d: &Device) -> Kernel {
    d.load_kernel(&KernelDef::new("double").op("scale").cpu("double v1", |a| {
        let x = a.read::<f32>(0)?;
        let y = a.write::<f32>(1)?;
        y.iter_mut().zip(x).for_each(|(y, x)| *y = 2.0 * x);
        Ok(())
    }))
    .unwrap()
}

/// y += 1.
fn increment(d: &Device) -> Kernel {
    d.load_kernel(
        &KernelDef::new("increment")
            .op("add")
            .cpu("increment v1", |a| {
                a.write::<f32>(0)?.iter_mut().for_each(|v| *v += 1.0);
                Ok(())
            }),
    )
    .unwrap()
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("encore-{}-{name}.json", std::process::id()))
}

fn parse(trace: &encore::Trace) -> Value {
    let mut json = Vec::new();
    trace.write_to(&mut json).unwrap();
    serde_json::from_slice(&json).unwrap()
}

fn events(json: &Value) -> Vec<Value> {
    json["traceEvents"].as_array().unwrap().clone()
}

fn complete<'a>(events: &'a [Value], cat: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == cat)
        .collect()
}

fn span(e: &Value) -> (f64, f64) {
    let ts = e["ts"].as_f64().unwrap();
    (ts, ts + e["dur"].as_f64().unwrap())
}

/// `inner` lies within `outer` (timestamps are microseconds with
/// nanosecond precision; allow rounding).
fn within(inner: &Value, outer: &Value) -> bool {
    let ((a, b), (c, d)) = (span(inner), span(outer));
    a >= c - 0.01 && b <= d + 0.01
}

/// Five dispatches: three independent (one concurrent group), then two that
/// depend on the first.
fn record_batch(d: &Device, bufs: &[Buffer]) -> encore::Submission {
    let (dbl, inc) = (double(d), increment(d));
    let mut enc = d.encoder();
    enc.set_label("batch");
    enc.dispatch(&dbl, &[Arg::read(&bufs[0]), Arg::write(&bufs[1])], "first")
        .unwrap();
    enc.dispatch(&dbl, &[Arg::read(&bufs[0]), Arg::write(&bufs[2])], "second")
        .unwrap();
    enc.dispatch(&inc, &[Arg::read_write(&bufs[3])], "third")
        .unwrap();
    enc.dispatch(&inc, &[Arg::read_write(&bufs[1])], "fourth")
        .unwrap();
    enc.dispatch(
        &dbl,
        &[
            Arg::read(&bufs[1].view(0, 8).unwrap()),
            Arg::write(&bufs[2]),
        ],
        "fifth",
    )
    .unwrap();
    enc.commit_and_wait().unwrap()
}

fn buffers(d: &Device) -> Vec<Buffer> {
    (0..4)
        .map(|_| d.buffer_from(&[1.0f32; 16]).unwrap())
        .collect()
}

#[test]
fn trace_holds_one_complete_event_per_dispatch_with_its_arguments() {
    let d = Device::cpu().unwrap();
    let bufs = buffers(&d);
    let trace = d.start_trace();
    {
        let _phase = d.trace_span("phase").arg("items", 5);
        record_batch(&d, &bufs);
    }
    let json = parse(&trace);
    let events = events(&json);
    assert!(events.iter().all(|e| e["ph"] == "X" || e["ph"] == "M"));

    let dispatches = complete(&events, "dispatch");
    assert_eq!(dispatches.len(), 5, "{dispatches:#?}");
    let labels: Vec<&str> = dispatches
        .iter()
        .map(|e| e["args"]["label"].as_str().unwrap())
        .collect();
    for label in ["first", "second", "third", "fourth", "fifth"] {
        assert!(labels.contains(&label), "{labels:?}");
    }
    for e in &dispatches {
        let args = &e["args"];
        let expect = match args["label"].as_str().unwrap() {
            "first" | "second" => ("double", "scale", 128),
            "third" | "fourth" => ("increment", "add", 64),
            _ => ("double", "scale", 72),
        };
        assert_eq!(e["name"], expect.0);
        assert_eq!(args["op"], expect.1);
        assert_eq!(args["bytes"], expect.2, "{e}");
        // The CPU computes no launch geometry: no dispatch carries any.
        for key in ["grid", "block", "shared_bytes"] {
            assert!(args.get(key).is_none(), "{key} in {e}");
        }
        assert!(e["dur"].as_f64().unwrap() >= 0.0);
    }

    // Device times sit on the host clock: dispatches inside their
    // submission, the submission inside the host phase that waited for it.
    let submissions = complete(&events, "submission");
    assert_eq!(submissions.len(), 1);
    assert_eq!(submissions[0]["name"], "batch");
    assert!(dispatches.iter().all(|e| within(e, submissions[0])));
    let host = complete(&events, "host");
    assert_eq!(host.len(), 1);
    assert_eq!(host[0]["name"], "phase");
    assert_eq!(host[0]["args"]["items"], 5);
    assert!(within(submissions[0], host[0]));

    // Events on one track never partly overlap (Perfetto nests them).
    for (i, a) in dispatches.iter().enumerate() {
        for b in &dispatches[i + 1..] {
            if a["tid"] == b["tid"] {
                let ((a0, a1), (b0, b1)) = (span(a), span(b));
                assert!(a1 <= b0 + 0.01 || b1 <= a0 + 0.01, "{a} overlaps {b}");
            }
        }
    }
    // Tracks are named.
    assert!(events
        .iter()
        .any(|e| e["ph"] == "M" && e["args"]["name"] == "cpu"));
}

#[test]
fn spans_are_free_without_a_trace() {
    let d = Device::cpu().unwrap();
    assert!(d.trace().is_none());
    let span = d.trace_span("nothing");
    assert!(!span.is_active());
    drop(span);
    record_batch(&d, &buffers(&d));
    assert!(d.trace().is_none());
}

fn graph_of(
    d: &Device,
    k: &Kernel,
    target: &Buffer,
    nodes: usize,
    label: &'static str,
) -> GraphExec {
    let mut enc = d.capture();
    for _ in 0..nodes {
        enc.dispatch(k, &[Arg::read_write(target)], label).unwrap();
    }
    let mut graph = enc.finish_graph().unwrap();
    graph.mark_output(target);
    graph.instantiate(&[]).unwrap()
}

#[test]
fn graph_replays_are_traced_and_profiled_per_dispatch() {
    let config = Config {
        profile: ProfileMode::Dispatches,
        ..Config::default()
    };
    let d = Device::open("cpu", &config).unwrap();
    let inc = increment(&d);
    let buf = d.buffer_from(&[0.0f32; 4]).unwrap();
    let exec = graph_of(&d, &inc, &buf, 3, "inc");
    let trace = d.start_trace();
    for _ in 0..4 {
        let sub = exec.replay(&[]).unwrap();
        sub.wait().unwrap();
        assert_eq!(sub.dispatch_times().unwrap().len(), 3);
    }
    assert_eq!(buf.download::<f32>().unwrap(), vec![12.0; 4]);

    let events = events(&parse(&trace));
    let replays = complete(&events, "graph replay");
    assert_eq!(replays.len(), 4);
    let numbers: Vec<u64> = replays
        .iter()
        .map(|e| e["args"]["replay"].as_u64().unwrap())
        .collect();
    assert_eq!(numbers, [1, 2, 3, 4]);
    let dispatches = complete(&events, "dispatch");
    assert_eq!(dispatches.len(), 12);
    for r in &replays {
        assert_eq!(dispatches.iter().filter(|e| within(e, r)).count(), 3);
    }

    let by_kernel = d.profile().dispatches();
    assert_eq!(by_kernel.len(), 1);
    assert_eq!(
        (by_kernel[0].name.as_str(), by_kernel[0].count),
        ("increment", 12)
    );
    let by_label = d.profile().dispatches_by_label();
    assert_eq!((by_label[0].name.as_str(), by_label[0].count), ("inc", 12));
    let submissions = d.profile().submissions();
    assert_eq!(
        (submissions[0].name.as_str(), submissions[0].count),
        ("graph replay", 4)
    );
}

#[test]
fn profiling_off_times_no_dispatch_and_records_nothing() {
    let d = Device::cpu().unwrap();
    let sub = record_batch(&d, &buffers(&d));
    assert!(sub.elapsed().is_some());
    assert!(sub.dispatch_times().is_none());
    let inc = increment(&d);
    let buf = d.buffer_from(&[0.0f32; 4]).unwrap();
    let replay = graph_of(&d, &inc, &buf, 2, "inc").replay(&[]).unwrap();
    replay.wait().unwrap();
    assert!(replay.dispatch_times().is_none());
    assert!(d.profile().submissions().is_empty());
    assert!(d.profile().dispatches().is_empty());

    // `submissions` records submission times but times no dispatch.
    let config = Config {
        profile: ProfileMode::Submissions,
        ..Config::default()
    };
    let d = Device::open("cpu", &config).unwrap();
    let sub = record_batch(&d, &buffers(&d));
    assert!(sub.dispatch_times().is_none());
    assert_eq!(d.profile().submissions()[0].name, "batch");
    assert!(d.profile().dispatches().is_empty());
}

fn capturing(path: &std::path::Path, at: u64) -> Device {
    let config = Config {
        capture: Some(path.to_path_buf()),
        capture_at: at,
        ..Config::default()
    };
    Device::open("cpu", &config).unwrap()
}

#[test]
fn capture_writes_exactly_the_nth_replay() {
    let path = temp_path("capture-3");
    let _ = std::fs::remove_file(&path);
    let d = capturing(&path, 3);
    let inc = increment(&d);
    let buf = d.buffer_from(&[0.0f32; 4]).unwrap();
    let two = graph_of(&d, &inc, &buf, 2, "two");
    let three = graph_of(&d, &inc, &buf, 3, "three");
    two.replay(&[]).unwrap().wait().unwrap();
    two.replay(&[]).unwrap().wait().unwrap();
    assert!(!path.exists(), "written before the third replay");
    three.replay(&[]).unwrap().wait().unwrap();
    two.replay(&[]).unwrap().wait().unwrap();
    assert_eq!(buf.download::<f32>().unwrap(), vec![9.0; 4]);

    let json: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let events = events(&json);
    let replays = complete(&events, "graph replay");
    assert_eq!(replays.len(), 1);
    assert_eq!(replays[0]["args"]["replay"], 3);
    let dispatches = complete(&events, "dispatch");
    assert_eq!(dispatches.len(), 3);
    assert!(dispatches.iter().all(|e| e["args"]["label"] == "three"));
    assert!(dispatches.iter().all(|e| within(e, replays[0])));
    // The capture alone does not start a trace or a profile.
    assert!(d.trace().is_none());
    assert!(d.profile().dispatches().is_empty());
}

#[test]
fn unwritable_capture_path_changes_nothing() {
    let d = capturing(std::path::Path::new("/proc/nonexistent/x"), 1);
    let inc = increment(&d);
    let buf = d.buffer_from(&[0.0f32; 4]).unwrap();
    let exec = graph_of(&d, &inc, &buf, 2, "inc");
    for _ in 0..3 {
        exec.replay(&[]).unwrap().wait().unwrap();
    }
    d.synchronize().unwrap();
    assert_eq!(buf.download::<f32>().unwrap(), vec![6.0; 4]);
}

#[test]
fn a_dropped_captured_replay_is_still_written() {
    let path = temp_path("capture-dropped");
    let _ = std::fs::remove_file(&path);
    let d = capturing(&path, 1);
    let inc = increment(&d);
    let buf = d.buffer_from(&[0.0f32; 4]).unwrap();
    let exec = graph_of(&d, &inc, &buf, 2, "inc");
    drop(exec.replay(&[]).unwrap());
    d.synchronize().unwrap();
    let json: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(complete(&events(&json), "dispatch").len(), 2);
}

#[test]
fn saved_traces_report_unwritable_paths() {
    let d = Device::cpu().unwrap();
    let trace = d.start_trace();
    let e = trace.save("/proc/nonexistent/trace.json").unwrap_err();
    assert!(
        e.to_string().contains("/proc/nonexistent/trace.json"),
        "{e}"
    );
    let path = temp_path("saved");
    record_batch(&d, &buffers(&d));
    trace.save(&path).unwrap();
    let json: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(complete(&events(&json), "dispatch").len(), 5);
}
