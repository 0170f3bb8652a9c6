//! The Metal backend's decisions, apart from the Metal calls that carry
//! them out, so they compile and are tested on every platform.
//!
//! - [`Retention`]: what one command buffer keeps alive, each object once.
//! - [`encoding`]: the encoders, dispatches and barriers of a program.
//! - [`Residency`]: the changes to the device's residency set, committed
//!   once per command-buffer commit and held back during a capture.
//! - [`Capture`]: the one-shot GPU trace capture's lifecycle.
//! - [`dispatch_times`]: per-dispatch device times from encoder-boundary
//!   counter samples.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::retain::IdMap;

/// Everything one command buffer binds, each object once: what its
/// completion handler releases.
///
/// Command buffers are made with unretained references, so Metal does not
/// keep bound buffers and pipelines alive; this does, for the life of the
/// command buffer. Objects are keyed by an id the caller chooses (the
/// allocation handle, the pipeline's address), so binding one buffer in
/// every dispatch costs one lookup each time and one reference in all.
pub(crate) struct Retention<T> {
    seen: IdMap<()>,
    held: Vec<T>,
}

impl<T> Default for Retention<T> {
    fn default() -> Retention<T> {
        Retention {
            seen: IdMap::default(),
            held: Vec::new(),
        }
    }
}

impl<T> Retention<T> {
    /// Keeps the object `id` alive (made by `object` the first time this
    /// command buffer sees it). Returns whether it was new.
    pub(crate) fn retain(&mut self, id: u64, object: impl FnOnce() -> T) -> bool {
        if self.seen.insert(id, ()).is_some() {
            return false;
        }
        self.held.push(object());
        true
    }

    /// Distinct objects kept.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// The objects kept, in the order first retained.
    #[cfg(test)]
    pub(crate) fn into_held(self) -> Vec<T> {
        self.held
    }
}

/// One step of encoding a program into a command buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Ends the current compute encoder (if any) and begins another with
    /// concurrent dispatch. With `sample`, the encoder's start and end are
    /// sampled into counter slots `2 * sample` and `2 * sample + 1`.
    Encoder { sample: Option<usize> },
    /// Dispatch `i` of the program.
    Dispatch(usize),
    /// A buffer-scope memory barrier: every dispatch before it has finished
    /// and its writes are visible to every dispatch after it.
    Barrier,
}

/// How a program of `dispatches` in concurrent `groups` (ranges of its
/// dispatches, in order) is encoded.
///
/// - Normally one concurrent encoder holds the whole program, with a
///   barrier between consecutive groups: dispatches of one group may run
///   together, and each group starts after the previous one's writes.
/// - `serial` (the runtime's debugging mode) puts a barrier after every
///   dispatch but the last, whatever the groups.
/// - `per_dispatch` (per-dispatch timing) gives every dispatch an encoder of
///   its own, sampled at its boundaries: Apple GPUs sample counters only at
///   encoder boundaries. Metal orders the encoders of a command buffer, so
///   no barrier is needed there.
pub(crate) fn encoding(
    dispatches: usize,
    groups: impl Iterator<Item = Range<usize>>,
    serial: bool,
    per_dispatch: bool,
) -> Vec<Step> {
    if per_dispatch {
        return (0..dispatches)
            .flat_map(|i| [Step::Encoder { sample: Some(i) }, Step::Dispatch(i)])
            .collect();
    }
    let mut steps = Vec::with_capacity(dispatches * 2 + 1);
    steps.push(Step::Encoder { sample: None });
    let mut placed = 0;
    for group in groups {
        for i in group.clone() {
            if placed > 0 && (serial || i == group.start) {
                steps.push(Step::Barrier);
            }
            steps.push(Step::Dispatch(i));
            placed += 1;
        }
    }
    steps
}

/// The changes a residency set needs, applied and committed at once.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Changes<T> {
    pub(crate) add: Vec<(u64, T)>,
    pub(crate) remove: Vec<(u64, T)>,
}

/// The device's residency set, as the backend changes it.
///
/// Allocations are added as they are made and removed as they are freed,
/// but the set is committed only when a command buffer is committed, once
/// for every change since. While a programmatic capture is active the set
/// is frozen: a capture records the queue's state, and changing the set
/// then is what made a queue exceed its limit of residency sets in MLX.
/// Changes made during a capture wait until it ends. A buffer bound to an
/// encoder is resident for that encoder whether or not the set holds it,
/// so holding changes back costs speed at most, never correctness.
///
/// `T` is the object the set holds (the buffer), kept by pending changes
/// so a removal can still name it after the allocation was freed.
pub(crate) struct Residency<T> {
    add: Vec<(u64, T)>,
    remove: Vec<(u64, T)>,
    frozen: bool,
}

impl<T> Default for Residency<T> {
    fn default() -> Residency<T> {
        Residency {
            add: Vec::new(),
            remove: Vec::new(),
            frozen: false,
        }
    }
}

impl<T> Residency<T> {
    /// A new allocation, to add at the next commit.
    pub(crate) fn allocated(&mut self, id: u64, object: T) {
        self.add.push((id, object));
    }

    /// A freed allocation, to remove at the next commit; one that was
    /// never added is dropped from the pending additions instead.
    pub(crate) fn freed(&mut self, id: u64, object: T) {
        match self.add.iter().position(|(a, _)| *a == id) {
            Some(i) => {
                self.add.swap_remove(i);
            }
            None => self.remove.push((id, object)),
        }
    }

    /// What to apply and commit when a command buffer is committed:
    /// nothing while frozen or when nothing changed.
    pub(crate) fn at_commit(&mut self) -> Option<Changes<T>> {
        if self.frozen || (self.add.is_empty() && self.remove.is_empty()) {
            return None;
        }
        Some(Changes {
            add: std::mem::take(&mut self.add),
            remove: std::mem::take(&mut self.remove),
        })
    }

    /// A capture began: no changes until [`Residency::thaw`].
    pub(crate) fn freeze(&mut self) {
        self.frozen = true;
    }

    /// The capture ended: the changes held back, to apply now.
    pub(crate) fn thaw(&mut self) -> Option<Changes<T>> {
        self.frozen = false;
        self.at_commit()
    }

    pub(crate) fn is_frozen(&self) -> bool {
        self.frozen
    }
}

/// What [`Capture::begin`] asks the backend to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Begin {
    /// Start a GPU trace capture of the queue into this document.
    Start(PathBuf),
    /// Do not capture; print this warning (the first time only).
    Warn(String),
    /// Do not capture, and say nothing.
    Skip,
}

/// Whether the capture manager can write a trace document, as the backend
/// found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Support {
    /// It can.
    Available,
    /// GPU trace documents are not an available destination: capture is
    /// not enabled for the process.
    NotEnabled,
}

/// The one-shot GPU trace capture of `ENCORE_CAPTURE=FILE.gputrace`.
///
/// The runtime chooses which launch is captured (the `ENCORE_CAPTURE_AT`th
/// graph replay) and calls the backend's `capture_begin` before it and
/// `capture_end` once it has completed. This decides what those calls do:
/// start a capture only for a `.gputrace` destination, only once, and only
/// when the capture manager supports the destination; otherwise warn once
/// with what to do, and let the run go on.
#[derive(Debug)]
pub(crate) struct Capture {
    document: Option<PathBuf>,
    active: bool,
    warned: bool,
    done: bool,
}

/// The extension of the GPU trace documents Metal writes.
pub(crate) const DOCUMENT_EXTENSION: &str = "gputrace";

impl Capture {
    /// The capture for the configured destination `path`, if any. Only a
    /// `.gputrace` path asks for a GPU trace document; any other gets the
    /// runtime's Chrome trace alone, as on every backend.
    pub(crate) fn new(path: Option<&Path>) -> Capture {
        Capture {
            document: path.filter(|p| is_document(p)).map(Path::to_path_buf),
            active: false,
            warned: false,
            done: false,
        }
    }

    /// The launch to capture is about to be encoded.
    pub(crate) fn begin(&mut self, support: Support) -> Begin {
        let Some(document) = self.document.clone().filter(|_| !self.active && !self.done) else {
            return Begin::Skip;
        };
        self.done = true;
        match support {
            Support::Available if document.exists() => self.warn(format!(
                "{} already exists and Metal does not overwrite trace documents; \
                 remove it or name another with ENCORE_CAPTURE",
                document.display()
            )),
            Support::Available => {
                self.active = true;
                Begin::Start(document)
            }
            Support::NotEnabled => self.warn(format!(
                "Metal GPU capture is not enabled, so {} was not written; \
                 run with METAL_CAPTURE_ENABLED=1 in the environment \
                 (or under Xcode) to capture",
                document.display()
            )),
        }
    }

    /// The capture could not start (the capture manager refused it).
    pub(crate) fn failed(&mut self, reason: &str) -> Begin {
        self.active = false;
        self.warn(format!("Metal GPU capture did not start: {reason}"))
    }

    fn warn(&mut self, message: String) -> Begin {
        if std::mem::replace(&mut self.warned, true) {
            Begin::Skip
        } else {
            Begin::Warn(message)
        }
    }

    /// The captured launch completed: whether a capture is to be stopped.
    pub(crate) fn end(&mut self) -> bool {
        std::mem::replace(&mut self.active, false)
    }

    #[cfg(test)]
    pub(crate) fn is_active(&self) -> bool {
        self.active
    }
}

/// Whether `path` names a GPU trace document.
pub(crate) fn is_document(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case(DOCUMENT_EXTENSION))
}

/// Where the runtime writes its Chrome trace of a captured launch whose
/// destination is `path`: beside a GPU trace document (`step.gputrace`
/// gets `step.gputrace.json`), which Metal writes at `path` itself; else
/// at `path`.
pub(crate) fn chrome_trace_path(path: &Path) -> PathBuf {
    if is_document(path) {
        let mut name = path.as_os_str().to_os_string();
        name.push(".json");
        PathBuf::from(name)
    } else {
        path.to_path_buf()
    }
}

/// A counter sample Metal could not take reads as this.
const SAMPLE_ERROR: u64 = u64::MAX;

/// The most counter samples one launch takes (two per dispatch); a program
/// with more dispatches gets no per-dispatch times.
pub(crate) const MAX_SAMPLES: usize = 16 * 1024;

/// Per-dispatch device times from encoder-boundary samples: `ticks` holds
/// each dispatch's (start, end) counter values, `elapsed` the command
/// buffer's device time (its `GPUEndTime - GPUStartTime`). Counter ticks
/// are scaled to time by the command buffer's own span, so no separate
/// calibration of the GPU clock is needed. Returns each dispatch's start
/// (from the first one's) and duration; empty when a sample is missing
/// (zero, or the error value Metal writes for a sample it could not
/// take) or the
/// samples do not advance.
pub(crate) fn dispatch_times(
    ticks: &[(u64, u64)],
    elapsed: Duration,
) -> (Vec<Duration>, Vec<Duration>) {
    let (Some(first), Some(last)) = (
        ticks.iter().map(|t| t.0).min(),
        ticks.iter().map(|t| t.1).max(),
    ) else {
        return (Vec::new(), Vec::new());
    };
    let missing = |t: u64| t == 0 || t == SAMPLE_ERROR;
    if last <= first
        || ticks
            .iter()
            .any(|&(a, b)| missing(a) || missing(b) || b < a)
    {
        return (Vec::new(), Vec::new());
    }
    let per_tick = elapsed.as_secs_f64() / (last - first) as f64;
    let time = |t: u64| Duration::from_secs_f64(t as f64 * per_tick);
    ticks
        .iter()
        .map(|&(a, b)| (time(a - first), time(b - a)))
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_buffer_retains_each_object_once() {
        let mut r = Retention::default();
        let mut made = 0;
        for id in [7, 3, 7, 7, 3, 9] {
            r.retain(id, || {
                made += 1;
                id
            });
        }
        assert_eq!(made, 3, "an object bound again is not retained again");
        assert_eq!(r.len(), 3);
        assert_eq!(r.into_held(), [7, 3, 9]);
        // Another command buffer retains on its own.
        let mut other = Retention::default();
        assert!(other.retain(7, || 7));
        assert!(!other.retain(7, || 7));
    }

    fn groups(ends: &[usize]) -> Vec<Range<usize>> {
        let mut start = 0;
        ends.iter()
            .map(|&e| {
                let r = start..e;
                start = e;
                r
            })
            .collect()
    }

    use Step::{Barrier as B, Dispatch as D};
    const E: Step = Step::Encoder { sample: None };

    #[test]
    fn barriers_separate_concurrent_groups() {
        let steps = encoding(5, groups(&[2, 3, 5]).into_iter(), false, false);
        assert_eq!(steps, [E, D(0), D(1), B, D(2), B, D(3), D(4)]);
        // One group: no barrier at all; no dispatches: an empty encoder.
        assert_eq!(
            encoding(2, groups(&[2]).into_iter(), false, false),
            [E, D(0), D(1)]
        );
        assert_eq!(encoding(0, std::iter::empty(), false, false), [E]);
    }

    #[test]
    fn serial_mode_puts_a_barrier_after_every_dispatch() {
        let steps = encoding(4, groups(&[3, 4]).into_iter(), true, false);
        assert_eq!(steps, [E, D(0), B, D(1), B, D(2), B, D(3)]);
    }

    #[test]
    fn timing_dispatches_gives_each_its_own_sampled_encoder() {
        let steps = encoding(3, groups(&[2, 3]).into_iter(), false, true);
        let enc = |i| Step::Encoder { sample: Some(i) };
        assert_eq!(steps, [enc(0), D(0), enc(1), D(1), enc(2), D(2)]);
        assert!(!steps.contains(&B));
    }

    #[test]
    fn residency_commits_changes_once_per_commit() {
        let mut r = Residency::default();
        assert_eq!(r.at_commit(), None);
        r.allocated(1, "a");
        r.allocated(2, "b");
        let c = r.at_commit().unwrap();
        assert_eq!((c.add, c.remove), (vec![(1, "a"), (2, "b")], vec![]));
        assert_eq!(r.at_commit(), None, "nothing changed since");
        r.freed(1, "a");
        assert_eq!(r.at_commit().unwrap().remove, [(1, "a")]);
        // Allocated and freed between commits: never added.
        r.allocated(3, "c");
        r.freed(3, "c");
        assert_eq!(r.at_commit(), None);
    }

    #[test]
    fn residency_is_frozen_during_a_capture_and_catches_up_after() {
        let mut r = Residency::default();
        r.allocated(1, "a");
        r.freeze();
        r.allocated(2, "b");
        r.freed(4, "d");
        assert!(r.is_frozen());
        assert_eq!(r.at_commit(), None, "no change while capturing");
        assert_eq!(r.at_commit(), None);
        let c = r.thaw().unwrap();
        assert_eq!(c.add, [(1, "a"), (2, "b")]);
        assert_eq!(c.remove, [(4, "d")]);
        assert!(!r.is_frozen());
        assert_eq!(r.thaw(), None);
    }

    #[test]
    fn a_capture_starts_once_for_a_trace_document() {
        let path = std::env::temp_dir().join("encore-plan-never-written.gputrace");
        let mut c = Capture::new(Some(&path));
        assert_eq!(c.begin(Support::Available), Begin::Start(path.clone()));
        assert!(c.is_active());
        assert_eq!(c.begin(Support::Available), Begin::Skip, "one shot");
        assert!(c.end());
        assert!(!c.end(), "stopped once");
        assert_eq!(c.begin(Support::Available), Begin::Skip);
        // A Chrome trace path asks for no Metal capture.
        let mut json = Capture::new(Some(Path::new("step.json")));
        assert_eq!(json.begin(Support::Available), Begin::Skip);
        assert!(!json.end());
        assert_eq!(Capture::new(None).begin(Support::Available), Begin::Skip);
    }

    #[test]
    fn an_unavailable_capture_warns_once_with_the_fix_and_never_stops() {
        let mut c = Capture::new(Some(Path::new("step.gputrace")));
        match c.begin(Support::NotEnabled) {
            Begin::Warn(w) => assert!(w.contains("METAL_CAPTURE_ENABLED=1"), "{w}"),
            other => panic!("expected a warning, got {other:?}"),
        }
        assert!(!c.is_active());
        assert_eq!(c.begin(Support::NotEnabled), Begin::Skip);
        assert!(!c.end(), "nothing to stop");
        let mut refused = Capture::new(Some(Path::new("other.GPUTRACE")));
        assert!(matches!(refused.begin(Support::Available), Begin::Start(_)));
        assert!(matches!(refused.failed("busy"), Begin::Warn(w) if w.contains("busy")));
        assert!(!refused.end());
    }

    #[test]
    fn an_existing_document_is_not_overwritten() {
        let dir = std::env::temp_dir().join(format!("encore-plan-{}", std::process::id()));
        let path = dir.join("step.gputrace");
        std::fs::create_dir_all(&path).unwrap();
        let mut c = Capture::new(Some(&path));
        let begun = c.begin(Support::Available);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(begun, Begin::Warn(w) if w.contains("already exists")));
        assert!(!c.is_active());
    }

    #[test]
    fn the_chrome_trace_goes_beside_a_trace_document() {
        assert_eq!(
            chrome_trace_path(Path::new("/t/step.gputrace")),
            Path::new("/t/step.gputrace.json")
        );
        assert_eq!(
            chrome_trace_path(Path::new("step.json")),
            Path::new("step.json")
        );
    }

    #[test]
    fn dispatch_times_scale_ticks_by_the_command_buffers_span() {
        let ticks = [(1000, 1200), (1200, 1300), (1500, 2000)];
        let (starts, times) = dispatch_times(&ticks, Duration::from_micros(100));
        let us = |d: &[Duration]| {
            d.iter()
                .map(|d| d.as_nanos() as u64 / 1000)
                .collect::<Vec<_>>()
        };
        assert_eq!(us(&starts), [0, 20, 50]);
        assert_eq!(us(&times), [20, 10, 50]);
        // A missing sample (zero) or a backward pair gives no times.
        assert!(dispatch_times(&[(0, 5), (5, 9)], Duration::from_micros(1))
            .0
            .is_empty());
        assert!(dispatch_times(&[(9, 5)], Duration::from_micros(1))
            .1
            .is_empty());
        assert!(dispatch_times(&[], Duration::from_micros(1)).1.is_empty());
        let failed = [(1000, 1200), (1200, SAMPLE_ERROR)];
        assert!(dispatch_times(&failed, Duration::from_micros(1))
            .1
            .is_empty());
    }
}
