//! Device-time profiles: per submission label, and per dispatch by kernel and
//! by label.
//!
//! What is recorded follows [`Config::profile`](crate::Config::profile):
//! nothing with `off` or `counters` (the counters are always on), submission
//! times from `submissions` on, dispatch times with `dispatches`. With
//! profiling off, a completed submission costs one comparison here.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

use crate::backend::Timing;
use crate::config::ProfileMode;
use crate::program::Program;

/// Summary statistics of a set of timings.
#[derive(Clone, Debug, PartialEq)]
pub struct TimeStats {
    /// The kernel or label the times belong to.
    pub name: String,
    pub count: usize,
    pub total: Duration,
    pub min: Duration,
    pub median: Duration,
    pub max: Duration,
}

fn summarize(name: &str, times: &[Duration]) -> TimeStats {
    let mut sorted = times.to_vec();
    sorted.sort_unstable();
    TimeStats {
        name: name.to_string(),
        count: sorted.len(),
        total: sorted.iter().sum(),
        min: sorted.first().copied().unwrap_or_default(),
        median: sorted.get(sorted.len() / 2).copied().unwrap_or_default(),
        max: sorted.last().copied().unwrap_or_default(),
    }
}

/// Times keyed by name; looked up before inserting so a known name costs no
/// allocation.
#[derive(Default)]
struct TimesByName(HashMap<String, Vec<Duration>>);

impl TimesByName {
    fn push(&mut self, name: &str, time: Duration) {
        match self.0.get_mut(name) {
            Some(v) => v.push(time),
            None => {
                self.0.insert(name.to_string(), vec![time]);
            }
        }
    }

    /// Summaries sorted by total time, largest first.
    fn sorted(&self) -> Vec<TimeStats> {
        let mut v: Vec<TimeStats> = self.0.iter().map(|(k, t)| summarize(k, t)).collect();
        v.sort_by(|a, b| b.total.cmp(&a.total).then(a.name.cmp(&b.name)));
        v
    }
}

/// Collected device times. Submissions are recorded when their completion is
/// observed.
#[derive(Default)]
pub struct Profile {
    submissions: Mutex<TimesByName>,
    kernels: Mutex<TimesByName>,
    labels: Mutex<TimesByName>,
}

impl Profile {
    pub(crate) fn record(
        &self,
        mode: ProfileMode,
        label: &str,
        program: &Program,
        timing: &Timing,
    ) {
        if mode < ProfileMode::Submissions {
            return;
        }
        self.submissions.lock().push(label, timing.elapsed);
        if mode < ProfileMode::Dispatches || timing.dispatches.is_empty() {
            return;
        }
        let mut kernels = self.kernels.lock();
        let mut labels = self.labels.lock();
        for (d, &t) in program.dispatches.iter().zip(&timing.dispatches) {
            kernels.push(d.kernel.name(), t);
            labels.push(&d.label, t);
        }
    }

    /// Per-label submission times, sorted by total time, largest first.
    pub fn submissions(&self) -> Vec<TimeStats> {
        self.submissions.lock().sorted()
    }

    /// Per-kernel dispatch times, sorted by total time, largest first.
    pub fn dispatches(&self) -> Vec<TimeStats> {
        self.kernels.lock().sorted()
    }

    /// Per-label dispatch times, sorted by total time, largest first.
    pub fn dispatches_by_label(&self) -> Vec<TimeStats> {
        self.labels.lock().sorted()
    }

    /// Forgets everything recorded.
    pub fn clear(&self) {
        self.submissions.lock().0.clear();
        self.kernels.lock().0.clear();
        self.labels.lock().0.clear();
    }
}
