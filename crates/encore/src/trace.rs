//! Traces: what the host and the device did, on one timeline, written as
//! Chrome Trace Event JSON (opens in Perfetto and `chrome://tracing`).
//!
//! A device records into a [`Trace`] once [`Device::start_trace`] has been
//! called: every submission whose completion is observed adds a span for
//! itself and one complete event per dispatch, placed on the host clock, and
//! host code marks its phases with [`Device::trace_span`]. Without a trace a
//! span is an empty guard, so instrumented code costs nothing.
//!
//! The one-shot capture ([`Config::capture`], `ENCORE_CAPTURE=PATH` with
//! `ENCORE_CAPTURE_AT=N`) writes the Nth graph replay of a device alone, in
//! the same format, whether or not a trace is being recorded; on CUDA the
//! backend also opens a profiler range and NVTX ranges (the step, and each
//! dispatch) around it, for Nsight tools (see [`crate::config`]).
//!
//! ```
//! use encore::{Arg, Device, KernelDef};
//! let device = Device::cpu()?;
//! let trace = device.start_trace();
//! let fill = device.load_kernel(&KernelDef::new("fill").cpu("fill v1", |a| {
//!     a.write::<f32>(0)?.fill(1.0);
//!     Ok(())
//! }))?;
//! let buf = device.alloc(64)?;
//! {
//!     let _span = device.trace_span("work");
//!     let mut enc = device.encoder();
//!     enc.dispatch(&fill, &[Arg::write(&buf)], "fill")?;
//!     enc.commit_and_wait()?;
//! }
//! let mut json = Vec::new();
//! trace.write_to(&mut json)?; // or trace.save("trace.json")
//! assert!(String::from_utf8(json)?.contains(r#""name":"fill""#));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`Config::capture`]: crate::Config::capture
//! [`Device::start_trace`]: crate::Device::start_trace
//! [`Device::trace_span`]: crate::Device::trace_span

use std::cell::Cell;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::{json, Map, Value};

use crate::backend::Timing;
use crate::error::{Error, Result};
use crate::program::Program;
use crate::record::{ArgRec, Launch};
use crate::Label;

/// Process id of the host's tracks.
const HOST_PID: u32 = 1;
/// Process id of the device's tracks.
const DEVICE_PID: u32 = 2;
/// The device track that holds submission and graph replay spans.
const QUEUE_TID: u32 = 1;
/// Dispatch lanes: overlapping dispatches go to separate tracks from here on.
const FIRST_LANE_TID: u32 = 100;

/// One complete ("ph":"X") event.
struct Event {
    name: String,
    cat: &'static str,
    pid: u32,
    tid: u32,
    start: Instant,
    dur: Duration,
    args: Map<String, Value>,
}

/// A recording of host spans, submissions and dispatches on the host clock.
pub struct Trace {
    origin: Instant,
    device: String,
    events: Mutex<Vec<Event>>,
    /// Host threads seen, by track id, with their names.
    threads: Mutex<Vec<(u32, String)>>,
    /// Dispatch lanes used so far.
    lanes: AtomicU32,
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Trace({}, {} events)", self.device, self.len())
    }
}

static NEXT_HOST_TID: AtomicU32 = AtomicU32::new(1);

thread_local! {
    static HOST_TID: Cell<u32> = const { Cell::new(0) };
}

/// A small, stable track id for the calling thread.
fn host_tid() -> u32 {
    HOST_TID.with(|tid| {
        if tid.get() == 0 {
            tid.set(NEXT_HOST_TID.fetch_add(1, Ordering::Relaxed));
        }
        tid.get()
    })
}

impl Trace {
    /// An empty trace of device `device` whose time zero is now.
    pub(crate) fn new(device: &str) -> Trace {
        Trace::starting_at(device, Instant::now())
    }

    /// An empty trace whose time zero is `origin`.
    pub(crate) fn starting_at(device: &str, origin: Instant) -> Trace {
        Trace {
            origin,
            device: device.to_string(),
            events: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
            lanes: AtomicU32::new(0),
        }
    }

    /// Events recorded so far.
    pub fn len(&self) -> usize {
        self.events.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every event (the time zero stays).
    pub fn clear(&self) {
        self.events.lock().clear();
    }

    fn push(&self, event: Event) {
        self.events.lock().push(event);
    }

    /// Records a host span that ran on the calling thread.
    fn record_host(&self, name: &str, start: Instant, args: Map<String, Value>) {
        let tid = host_tid();
        {
            let mut threads = self.threads.lock();
            if !threads.iter().any(|(t, _)| *t == tid) {
                let current = std::thread::current();
                let name = current.name().unwrap_or("thread").to_string();
                threads.push((tid, name));
            }
        }
        self.push(Event {
            name: name.to_string(),
            cat: "host",
            pid: HOST_PID,
            tid,
            start,
            dur: start.elapsed(),
            args,
        });
    }

    /// Records a completed submission: a span on the queue track, then one
    /// event per dispatch when the backend timed them. `replay` is the graph
    /// replay's number for replays.
    pub(crate) fn record_submission(
        &self,
        label: &str,
        program: &Program,
        timing: &Timing,
        replay: Option<u64>,
    ) {
        let started = started(timing);
        let mut args = Map::new();
        args.insert("dispatches".into(), program.dispatches.len().into());
        args.insert("groups".into(), program.group_ends.len().into());
        if let Some(n) = replay {
            args.insert("replay".into(), n.into());
        }
        let mut events = Vec::with_capacity(1 + timing.dispatches.len());
        events.push(Event {
            name: label.to_string(),
            cat: if replay.is_some() {
                "graph replay"
            } else {
                "submission"
            },
            pid: DEVICE_PID,
            tid: QUEUE_TID,
            start: started,
            dur: timing.elapsed,
            args,
        });
        let n = program.dispatches.len();
        if timing.dispatches.len() == n {
            let offsets = dispatch_offsets(program, timing);
            let lanes = assign_lanes(&offsets, &timing.dispatches);
            let used = lanes.iter().copied().max().map_or(0, |l| l + 1);
            self.lanes.fetch_max(used, Ordering::Relaxed);
            for (i, d) in program.dispatches.iter().enumerate() {
                let bytes: usize = program
                    .args_of(d)
                    .iter()
                    .map(|a| match *a {
                        ArgRec::Buffer { len, .. } => len,
                        ArgRec::Bytes { .. } => 0,
                    })
                    .sum();
                let mut args = Map::new();
                args.insert("label".into(), d.label.as_ref().into());
                args.insert("op".into(), d.kernel.op_kind().into());
                if d.launch != Launch::NONE {
                    args.insert("grid".into(), json!(d.launch.grid));
                    args.insert("block".into(), json!(d.launch.block));
                    args.insert("shared_bytes".into(), d.launch.shared_bytes.into());
                }
                args.insert("bytes".into(), bytes.into());
                args.insert("index".into(), i.into());
                events.push(Event {
                    name: d.kernel.name().to_string(),
                    cat: "dispatch",
                    pid: DEVICE_PID,
                    tid: FIRST_LANE_TID + lanes[i],
                    start: started + offsets[i],
                    dur: timing.dispatches[i],
                    args,
                });
            }
        }
        self.events.lock().extend(events);
    }

    /// Writes the trace as Chrome Trace Event JSON.
    pub fn write_to(&self, mut out: impl Write) -> std::io::Result<()> {
        let mut meta = vec![
            metadata("process_name", HOST_PID, 0, "host"),
            metadata("process_name", DEVICE_PID, 0, &self.device),
            metadata("thread_name", DEVICE_PID, QUEUE_TID, "submissions"),
        ];
        for (tid, name) in self.threads.lock().iter() {
            meta.push(metadata("thread_name", HOST_PID, *tid, name));
        }
        for lane in 0..self.lanes.load(Ordering::Relaxed) {
            meta.push(metadata(
                "thread_name",
                DEVICE_PID,
                FIRST_LANE_TID + lane,
                &format!("dispatches {lane}"),
            ));
        }
        out.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n")?;
        let mut first = true;
        let mut separator = |out: &mut dyn Write| -> std::io::Result<()> {
            if !std::mem::take(&mut first) {
                out.write_all(b",\n")?;
            }
            Ok(())
        };
        for m in &meta {
            separator(&mut out)?;
            serde_json::to_writer(&mut out, m)?;
        }
        for e in self.events.lock().iter() {
            separator(&mut out)?;
            let event = json!({
                "name": e.name,
                "cat": e.cat,
                "ph": "X",
                "pid": e.pid,
                "tid": e.tid,
                "ts": micros(e.start.saturating_duration_since(self.origin)),
                "dur": micros(e.dur),
                "args": e.args,
            });
            serde_json::to_writer(&mut out, &event)?;
        }
        out.write_all(b"\n]}\n")?;
        out.flush()
    }

    /// Writes the trace to a file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::create(path).map_err(io)?;
        self.write_to(std::io::BufWriter::new(file)).map_err(io)
    }

    /// A host span recorded into this trace when dropped.
    pub(crate) fn span(self: &Arc<Trace>, name: Label) -> Span {
        Span(Some(OpenSpan {
            trace: self.clone(),
            name,
            start: Instant::now(),
            args: Map::new(),
        }))
    }
}

/// When a submission started on the host clock: as the backend measured, or
/// else estimated back from now (its completion has just been observed).
pub(crate) fn started(timing: &Timing) -> Instant {
    let now = Instant::now();
    timing
        .started
        .unwrap_or_else(|| now.checked_sub(timing.elapsed).unwrap_or(now))
}

/// Microseconds, the unit of trace timestamps, with nanosecond precision.
fn micros(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e3
}

fn metadata(kind: &str, pid: u32, tid: u32, name: &str) -> Value {
    json!({"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
}

/// Each dispatch's start relative to the submission's start: as measured,
/// or else group after group (the dispatches of a group together).
fn dispatch_offsets(program: &Program, timing: &Timing) -> Vec<Duration> {
    if timing.dispatch_starts.len() == program.dispatches.len() {
        return timing.dispatch_starts.clone();
    }
    let mut offsets = vec![Duration::ZERO; program.dispatches.len()];
    let mut at = Duration::ZERO;
    for group in program.groups() {
        let mut longest = Duration::ZERO;
        for i in group {
            if let (Some(o), Some(&t)) = (offsets.get_mut(i), timing.dispatches.get(i)) {
                *o = at;
                longest = longest.max(t);
            }
        }
        at += longest;
    }
    offsets
}

/// Packs dispatches into the fewest lanes in which none overlaps another, so
/// each lane is a well-nested track; dispatches that ran one after another
/// share lane 0.
fn assign_lanes(offsets: &[Duration], durations: &[Duration]) -> Vec<u32> {
    let mut order: Vec<usize> = (0..offsets.len()).collect();
    order.sort_by_key(|&i| offsets[i]);
    let mut lane_ends: Vec<Duration> = Vec::new();
    let mut lanes = vec![0u32; offsets.len()];
    for i in order {
        let (start, end) = (offsets[i], offsets[i] + durations[i]);
        let lane = match lane_ends.iter().position(|&e| e <= start) {
            Some(l) => l,
            None => {
                lane_ends.push(Duration::ZERO);
                lane_ends.len() - 1
            }
        };
        lane_ends[lane] = end;
        lanes[i] = lane as u32;
    }
    lanes
}

struct OpenSpan {
    trace: Arc<Trace>,
    name: Label,
    start: Instant,
    args: Map<String, Value>,
}

/// A host phase being traced: recorded from its creation until it is
/// dropped. Inactive (and free) when the device records no trace.
#[must_use = "a span measures until it is dropped"]
pub struct Span(Option<OpenSpan>);

impl Span {
    /// A span that records nothing.
    pub fn inactive() -> Span {
        Span(None)
    }

    /// Whether this span will be recorded.
    pub fn is_active(&self) -> bool {
        self.0.is_some()
    }

    /// Attaches a number to the span (shown in its details).
    pub fn arg(mut self, key: &'static str, value: u64) -> Span {
        if let Some(open) = &mut self.0 {
            open.args.insert(key.into(), value.into());
        }
        self
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(open) = self.0.take() {
            open.trace.record_host(&open.name, open.start, open.args);
        }
    }
}
