//! Device-time profiles: per submission label and per dispatch.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

use crate::backend::{Program, Timing};
use crate::Label;

/// Summary statistics of a set of timings.
#[derive(Clone, Debug, PartialEq)]
pub struct TimeStats {
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

/// Collected device times. Submissions are recorded when their completion is
/// observed; dispatches only when the device profiles dispatches.
#[derive(Default)]
pub struct Profile {
    submissions: Mutex<HashMap<String, Vec<Duration>>>,
    dispatches: Mutex<HashMap<String, Vec<Duration>>>,
}

impl Profile {
    pub(crate) fn record(&self, label: &Label, program: &Program, timing: &Timing) {
        self.submissions
            .lock()
            .entry(label.to_string())
            .or_default()
            .push(timing.elapsed);
        if !timing.dispatches.is_empty() {
            let mut map = self.dispatches.lock();
            for (d, &t) in program.dispatches.iter().zip(&timing.dispatches) {
                let key = d.kernel.name();
                match map.get_mut(key) {
                    Some(v) => v.push(t),
                    None => {
                        map.insert(key.to_string(), vec![t]);
                    }
                }
            }
        }
    }

    /// Per-label submission times, sorted by total time, largest first.
    pub fn submissions(&self) -> Vec<TimeStats> {
        sorted(&self.submissions.lock())
    }

    /// Per-kernel dispatch times, sorted by total time, largest first.
    pub fn dispatches(&self) -> Vec<TimeStats> {
        sorted(&self.dispatches.lock())
    }

    /// Forgets everything recorded.
    pub fn clear(&self) {
        self.submissions.lock().clear();
        self.dispatches.lock().clear();
    }
}

fn sorted(map: &HashMap<String, Vec<Duration>>) -> Vec<TimeStats> {
    let mut v: Vec<TimeStats> = map.iter().map(|(k, t)| summarize(k, t)).collect();
    v.sort_by(|a, b| b.total.cmp(&a.total).then(a.name.cmp(&b.name)));
    v
}
