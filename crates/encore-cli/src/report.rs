//! The profile printed at exit: counters, submission times by label, and
//! dispatch times by kernel and by label, each sorted by total time.

use std::fmt::Write;
use std::time::Duration;

use encore::{Device, ProfileMode, TimeStats};

/// The tables `mode` asks for, as text.
pub fn profile(device: &Device, mode: ProfileMode) -> String {
    let mut out = String::new();
    if mode >= ProfileMode::Counters {
        let _ = writeln!(out, "encore profile: {} counters", device.name());
        for (name, value) in device.counters().entries() {
            let _ = writeln!(out, "  {name:<24} {value:>12}");
        }
    }
    let profile = device.profile();
    if mode >= ProfileMode::Submissions {
        times(
            &mut out,
            "submissions by label",
            "label",
            &profile.submissions(),
        );
    }
    if mode >= ProfileMode::Dispatches {
        times(
            &mut out,
            "dispatches by kernel",
            "kernel",
            &profile.dispatches(),
        );
        times(
            &mut out,
            "dispatches by label",
            "label",
            &profile.dispatches_by_label(),
        );
    }
    out
}

fn times(out: &mut String, title: &str, what: &str, stats: &[TimeStats]) {
    let all: Duration = stats.iter().map(|s| s.total).sum();
    let width = stats
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(0)
        .max(what.len());
    let _ = writeln!(out, "encore profile: {title} (device time)");
    let _ = writeln!(
        out,
        "  {what:<width$} {:>8} {:>11} {:>6} {:>10} {:>10} {:>10}",
        "count", "total", "share", "min", "median", "max"
    );
    for s in stats {
        let share = 100.0 * s.total.as_secs_f64() / all.as_secs_f64().max(1e-12);
        let _ = writeln!(
            out,
            "  {:<width$} {:>8} {:>11} {:>5.1}% {:>10} {:>10} {:>10}",
            s.name,
            s.count,
            duration(s.total),
            share,
            duration(s.min),
            duration(s.median),
            duration(s.max),
        );
    }
    if stats.is_empty() {
        let _ = writeln!(out, "  (none recorded)");
    }
}

/// A duration in a unit that keeps three or four significant digits.
fn duration(d: Duration) -> String {
    let ns = d.as_nanos() as f64;
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.1} us", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.3} s", ns / 1e9)
    }
}
