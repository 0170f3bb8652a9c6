//! Dataflow hazard detection over byte ranges.
//!
//! The tracker holds the accesses of the current concurrent group. A new
//! dispatch conflicts with the group when one of its ranges overlaps a range of
//! the same allocation and at least one of the two writes (read-after-write,
//! write-after-read, write-after-write). Reads of the same bytes, disjoint or
//! merely touching ranges, and different allocations never conflict.

/// One access of a dispatch: a half-open byte range of an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccessRange {
    pub alloc: u64,
    pub start: usize,
    pub end: usize,
    pub write: bool,
}

impl AccessRange {
    /// Whether the two accesses must be ordered.
    pub fn conflicts(&self, other: &AccessRange) -> bool {
        self.alloc == other.alloc
            && self.start < other.end
            && other.start < self.end
            && (self.write || other.write)
    }
}

/// The accesses of the current concurrent group, per allocation.
///
/// Within a group, written ranges never overlap each other or any read range
/// (that would have been a conflict), so each allocation keeps its writes as a
/// sorted list of disjoint ranges and its reads as the sorted union of the
/// read ranges. A check is then two binary searches per argument, whatever
/// the size of the group.
#[derive(Debug, Default)]
pub struct HazardTracker {
    entries: Vec<AllocRanges>,
    active: usize,
    dispatches: usize,
}

#[derive(Debug, Default)]
struct AllocRanges {
    alloc: u64,
    writes: Vec<(usize, usize)>,
    reads: Vec<(usize, usize)>,
}

/// Whether a sorted list of disjoint ranges overlaps `start..end`.
fn overlaps(list: &[(usize, usize)], start: usize, end: usize) -> bool {
    let i = list.partition_point(|r| r.1 <= start);
    list.get(i).is_some_and(|r| r.0 < end)
}

impl HazardTracker {
    fn entry(&self, alloc: u64) -> Option<&AllocRanges> {
        self.entries[..self.active]
            .iter()
            .find(|e| e.alloc == alloc)
    }

    /// Whether a dispatch with these accesses must wait for the current group.
    pub fn conflicts(&self, accesses: &[AccessRange]) -> bool {
        accesses.iter().any(|a| {
            if a.start >= a.end {
                return false;
            }
            self.entry(a.alloc).is_some_and(|e| {
                overlaps(&e.writes, a.start, a.end)
                    || (a.write && overlaps(&e.reads, a.start, a.end))
            })
        })
    }

    /// Adds a dispatch's accesses to the current group. The caller has checked
    /// that they do not conflict with it.
    pub fn add(&mut self, accesses: &[AccessRange]) {
        for a in accesses {
            if a.start >= a.end {
                continue;
            }
            let e = match self.entries[..self.active]
                .iter()
                .position(|e| e.alloc == a.alloc)
            {
                Some(i) => &mut self.entries[i],
                None => {
                    if self.active == self.entries.len() {
                        self.entries.push(AllocRanges::default());
                    }
                    let e = &mut self.entries[self.active];
                    self.active += 1;
                    e.alloc = a.alloc;
                    e
                }
            };
            if a.write {
                let i = e.writes.partition_point(|r| r.0 < a.start);
                e.writes.insert(i, (a.start, a.end));
            } else {
                insert_merged(&mut e.reads, a.start, a.end);
            }
        }
        self.dispatches += 1;
    }

    /// Starts a new group (after a barrier).
    pub fn clear(&mut self) {
        for e in &mut self.entries[..self.active] {
            e.writes.clear();
            e.reads.clear();
        }
        self.active = 0;
        self.dispatches = 0;
    }

    /// Dispatches in the current group.
    pub fn group_len(&self) -> usize {
        self.dispatches
    }
}

/// Inserts `start..end` into a sorted list of disjoint ranges, merging it with
/// every range it overlaps or touches.
fn insert_merged(list: &mut Vec<(usize, usize)>, start: usize, end: usize) {
    let first = list.partition_point(|r| r.1 < start);
    let last = list.partition_point(|r| r.0 <= end);
    if first == last {
        list.insert(first, (start, end));
        return;
    }
    let merged = (start.min(list[first].0), end.max(list[last - 1].1));
    list.drain(first + 1..last);
    list[first] = merged;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(alloc: u64, start: usize, end: usize, write: bool) -> AccessRange {
        AccessRange {
            alloc,
            start,
            end,
            write,
        }
    }

    fn conflict(a: AccessRange, b: AccessRange) -> bool {
        let mut t = HazardTracker::default();
        t.add(&[a]);
        t.conflicts(&[b])
    }

    #[test]
    fn read_after_write_conflicts() {
        assert!(conflict(r(1, 0, 64, true), r(1, 32, 96, false)));
    }

    #[test]
    fn write_after_read_conflicts() {
        assert!(conflict(r(1, 0, 64, false), r(1, 63, 64, true)));
    }

    #[test]
    fn write_after_write_conflicts() {
        assert!(conflict(r(1, 10, 20, true), r(1, 0, 100, true)));
    }

    #[test]
    fn read_after_read_does_not_conflict() {
        assert!(!conflict(r(1, 0, 64, false), r(1, 0, 64, false)));
    }

    #[test]
    fn disjoint_and_touching_ranges_do_not_conflict() {
        assert!(!conflict(r(1, 0, 64, true), r(1, 64, 128, true)));
        assert!(!conflict(r(1, 64, 128, true), r(1, 0, 64, false)));
        assert!(!conflict(r(1, 0, 10, true), r(1, 500, 510, true)));
    }

    #[test]
    fn different_allocations_do_not_conflict() {
        assert!(!conflict(r(1, 0, 64, true), r(2, 0, 64, true)));
    }

    #[test]
    fn large_groups_match_a_linear_scan() {
        // Pseudo-random accesses against a naive pairwise check.
        let mut seed = 12345u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..2000 {
            let mut t = HazardTracker::default();
            let mut group: Vec<AccessRange> = Vec::new();
            for _ in 0..20 {
                let start = next(200) as usize;
                let a = r(next(3), start, start + 1 + next(40) as usize, next(3) == 0);
                let naive = group.iter().any(|g| g.conflicts(&a));
                assert_eq!(t.conflicts(&[a]), naive, "{a:?} vs {group:?}");
                if naive {
                    t.clear();
                    group.clear();
                }
                t.add(&[a]);
                group.push(a);
            }
        }
    }

    #[test]
    fn clearing_starts_a_new_group() {
        let mut t = HazardTracker::default();
        t.add(&[r(1, 0, 64, true)]);
        assert_eq!(t.group_len(), 1);
        t.clear();
        assert!(!t.conflicts(&[r(1, 0, 64, true)]));
        assert_eq!(t.group_len(), 0);
    }
}
