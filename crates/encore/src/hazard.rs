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

/// The accesses of the current concurrent group.
#[derive(Debug, Default)]
pub struct HazardTracker {
    group: Vec<AccessRange>,
    dispatches: usize,
}

impl HazardTracker {
    /// Whether a dispatch with these accesses must wait for the current group.
    pub fn conflicts(&self, accesses: &[AccessRange]) -> bool {
        accesses
            .iter()
            .any(|a| self.group.iter().any(|g| g.conflicts(a)))
    }

    /// Adds a dispatch's accesses to the current group.
    pub fn add(&mut self, accesses: &[AccessRange]) {
        self.group.extend_from_slice(accesses);
        self.dispatches += 1;
    }

    /// Starts a new group (after a barrier).
    pub fn clear(&mut self) {
        self.group.clear();
        self.dispatches = 0;
    }

    /// Dispatches in the current group.
    pub fn group_len(&self) -> usize {
        self.dispatches
    }
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
    fn clearing_starts_a_new_group() {
        let mut t = HazardTracker::default();
        t.add(&[r(1, 0, 64, true)]);
        assert_eq!(t.group_len(), 1);
        t.clear();
        assert!(!t.conflicts(&[r(1, 0, 64, true)]));
        assert_eq!(t.group_len(), 0);
    }
}
