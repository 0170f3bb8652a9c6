//! Programs: recorded dispatches in concurrent groups, with their arguments
//! resolved to device memory, as a backend runs or instantiates them.

use crate::kernel::Kernel;
use crate::record::{ArgRec, Launch};
use crate::Label;

/// One dispatch of a program.
#[derive(Clone, Debug)]
pub(crate) struct DispatchRec {
    pub kernel: Kernel,
    pub args: std::ops::Range<u32>,
    pub launch: Launch,
    pub label: Label,
}

/// Dispatches in concurrent groups, ready for a backend to run or instantiate.
/// Dispatches of one group may run in any order or at the same time; a group
/// starts after the previous one has finished.
#[derive(Debug, Default)]
pub(crate) struct Program {
    pub dispatches: Vec<DispatchRec>,
    pub args: Vec<ArgRec>,
    pub bytes: Vec<u8>,
    /// End index (exclusive) of each group in `dispatches`.
    pub group_ends: Vec<u32>,
    /// Dependency edges (from, to) between dispatches, used by backends that
    /// build native graphs; empty for eager programs.
    pub edges: Vec<(u32, u32)>,
}

impl Program {
    pub(crate) fn groups(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let mut start = 0usize;
        self.group_ends.iter().map(move |&end| {
            let r = start..end as usize;
            start = end as usize;
            r
        })
    }

    pub(crate) fn args_of(&self, d: &DispatchRec) -> &[ArgRec] {
        self.args
            .get(d.args.start as usize..d.args.end as usize)
            .unwrap_or(&[])
    }

    /// The program run `times` times in a row: copy `i + 1` starts after
    /// all of copy `i` (its first groups follow the last group before them;
    /// with edges, every dispatch nothing in its copy waits for precedes
    /// every dispatch that waits for nothing in the next copy). The copies
    /// share the inline-byte arena.
    pub(crate) fn repeated(&self, times: usize) -> Program {
        let n = self.dispatches.len() as u32;
        let arg_count = self.args.len() as u32;
        let (mut has_out, mut has_in) = (vec![false; n as usize], vec![false; n as usize]);
        for &(a, b) in &self.edges {
            has_out[a as usize] = true;
            has_in[b as usize] = true;
        }
        let mut out = Program {
            bytes: self.bytes.clone(),
            ..Program::default()
        };
        for copy in 0..times as u32 {
            let (first, args_at) = (copy * n, copy * arg_count);
            out.args.extend_from_slice(&self.args);
            out.dispatches
                .extend(self.dispatches.iter().map(|d| DispatchRec {
                    args: d.args.start + args_at..d.args.end + args_at,
                    ..d.clone()
                }));
            out.group_ends
                .extend(self.group_ends.iter().map(|&e| e + first));
            out.edges
                .extend(self.edges.iter().map(|&(a, b)| (a + first, b + first)));
            if copy > 0 && !self.edges.is_empty() {
                let prev = first - n;
                for sink in (0..n).filter(|&i| !has_out[i as usize]) {
                    for source in (0..n).filter(|&i| !has_in[i as usize]) {
                        out.edges.push((prev + sink, first + source));
                    }
                }
            }
        }
        out
    }
}
