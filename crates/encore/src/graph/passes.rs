//! Graph passes: fusion, dead-node removal and scheduling.

use std::collections::HashMap;
use std::sync::Arc;

use super::Node;
use crate::buffer::Buffer;
use crate::hazard::{AccessRange, HazardTracker};

/// Which passes run when a graph is instantiated.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub fusion: bool,
    pub remove_dead: bool,
    pub schedule: bool,
    /// Compile specializable kernels for each node's shape (see
    /// [`crate::KernelDef::specializable`]).
    pub specialize: bool,
}

/// Builds the fused node for a matched group, or declines with `None`.
pub type FuseFn = Arc<dyn Fn(&[&Node]) -> Option<Node> + Send + Sync>;

/// Which nodes a fusion pattern matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Match {
    /// A chain of op kinds linked by dataflow, in order. Each node after the
    /// first must be the first later node that reads what its predecessor
    /// wrote.
    Chain(Vec<String>),
    /// Up to `max` independent nodes of one op kind (at least two) that read
    /// one identical byte range, such as projections of the same input.
    Siblings { op: String, max: usize },
}

/// A fusion rule: which nodes it matches, and the builder of the node that
/// replaces them. The op layer registers these; the pass knows no
/// particular kernel.
#[derive(Clone)]
pub struct FusionPattern {
    pub name: String,
    pub matches: Match,
    pub build: FuseFn,
}

impl FusionPattern {
    /// A chain pattern over `ops`.
    pub fn new(
        name: impl Into<String>,
        ops: &[&str],
        build: impl Fn(&[&Node]) -> Option<Node> + Send + Sync + 'static,
    ) -> FusionPattern {
        FusionPattern {
            name: name.into(),
            matches: Match::Chain(ops.iter().map(|s| s.to_string()).collect()),
            build: Arc::new(build),
        }
    }

    /// A sibling pattern: up to `max` nodes of kind `op` sharing an input.
    pub fn siblings(
        name: impl Into<String>,
        op: &str,
        max: usize,
        build: impl Fn(&[&Node]) -> Option<Node> + Send + Sync + 'static,
    ) -> FusionPattern {
        FusionPattern {
            name: name.into(),
            matches: Match::Siblings {
                op: op.to_string(),
                max,
            },
            build: Arc::new(build),
        }
    }

    fn first_op(&self) -> Option<&str> {
        match &self.matches {
            Match::Chain(ops) => ops.first().map(String::as_str),
            Match::Siblings { op, .. } => Some(op),
        }
    }
}

impl std::fmt::Debug for FusionPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.matches {
            Match::Chain(ops) => write!(f, "FusionPattern({}: {})", self.name, ops.join(" -> ")),
            Match::Siblings { op, max } => {
                write!(f, "FusionPattern({}: up to {max} x {op})", self.name)
            }
        }
    }
}

fn overlaps(a: &AccessRange, b: &AccessRange) -> bool {
    a.alloc == b.alloc && a.start < b.end && b.start < a.end
}

fn output_ranges(outputs: &[Buffer]) -> Vec<AccessRange> {
    outputs
        .iter()
        .map(|b| AccessRange {
            alloc: b.allocation_id(),
            start: b.offset(),
            end: b.offset() + b.len(),
            write: false,
        })
        .collect()
}

/// The first node after `from` that reads any range `from` writes.
fn next_reader(nodes: &[Node], from: usize) -> Option<usize> {
    let writes: Vec<AccessRange> = nodes.get(from)?.writes().collect();
    (from + 1..nodes.len()).find(|&j| {
        nodes[j]
            .reads()
            .any(|r| writes.iter().any(|w| overlaps(w, &r)))
    })
}

/// Replaces every group of nodes matching a pattern with the pattern's fused
/// node, pattern by pattern in table order (so a later pattern can extend
/// what an earlier one built). Returns the new node list and how many fused
/// nodes were made.
///
/// A match is applied only when it preserves results: the fused node takes
/// the place of the group's last node, so no node between the members may
/// conflict with an earlier member, and every range a member writes that is
/// read outside the group before being overwritten (or is a graph output)
/// must still be written by the fused node.
pub fn fuse(
    mut nodes: Vec<Node>,
    patterns: &[FusionPattern],
    outputs: &[Buffer],
) -> (Vec<Node>, usize) {
    let outputs = output_ranges(outputs);
    let mut fused = 0;
    for pattern in patterns {
        let Some(first_op) = pattern.first_op() else {
            continue;
        };
        let mut i = 0;
        while i < nodes.len() {
            if nodes[i].op() == first_op {
                let found = match &pattern.matches {
                    Match::Chain(ops) => match_chain(&nodes, i, ops, pattern, &outputs),
                    Match::Siblings { max, .. } => {
                        match_siblings(&nodes, i, *max, pattern, &outputs)
                    }
                };
                if let Some((chain, node)) = found {
                    // `chain` ascends; the fused node takes the last member's place.
                    let last = chain[chain.len() - 1];
                    nodes[last] = node;
                    for &member in chain[..chain.len() - 1].iter().rev() {
                        nodes.remove(member);
                    }
                    fused += 1;
                    continue;
                }
            }
            i += 1;
        }
    }
    (nodes, fused)
}

fn match_chain(
    nodes: &[Node],
    start: usize,
    ops: &[String],
    pattern: &FusionPattern,
    outputs: &[AccessRange],
) -> Option<(Vec<usize>, Node)> {
    let mut chain = vec![start];
    for op in ops.iter().skip(1) {
        let next = next_reader(nodes, *chain.last()?)?;
        if nodes[next].op() != op {
            return None;
        }
        chain.push(next);
    }
    build_checked(nodes, chain, pattern, outputs)
}

/// Later nodes of the same kind that read a range `start` reads, exactly,
/// and do not depend on `start` or on each other; the largest group the
/// pattern's builder accepts wins.
fn match_siblings(
    nodes: &[Node],
    start: usize,
    max: usize,
    pattern: &FusionPattern,
    outputs: &[AccessRange],
) -> Option<(Vec<usize>, Node)> {
    let first = &nodes[start];
    let shared: Vec<AccessRange> = first.reads().collect();
    let mut group = vec![start];
    for j in start + 1..nodes.len() {
        if group.len() >= max {
            break;
        }
        let candidate = &nodes[j];
        if candidate.op() != first.op() {
            continue;
        }
        let shares = candidate.reads().any(|r| {
            shared
                .iter()
                .any(|s| s.alloc == r.alloc && s.start == r.start && s.end == r.end)
        });
        if shares && group.iter().all(|&g| !nodes[g].conflicts(candidate)) {
            group.push(j);
        }
    }
    while group.len() >= 2 {
        if let Some(found) = build_checked(nodes, group.clone(), pattern, outputs) {
            return Some(found);
        }
        group.pop();
    }
    None
}

/// Builds the fused node for `members` (ascending) if moving them all to
/// the last member's place keeps every result.
fn build_checked(
    nodes: &[Node],
    members: Vec<usize>,
    pattern: &FusionPattern,
    outputs: &[AccessRange],
) -> Option<(Vec<usize>, Node)> {
    let last = *members.last()?;
    // Moving members to the last position must not cross a conflicting node.
    for &member in &members[..members.len() - 1] {
        for between in member + 1..last {
            if !members.contains(&between) && nodes[member].conflicts(&nodes[between]) {
                return None;
            }
        }
    }
    let group: Vec<&Node> = members.iter().map(|&c| &nodes[c]).collect();
    let node = (pattern.build)(&group)?;
    // Ranges written by the group and needed outside it must still be written.
    let produced: Vec<AccessRange> = node.writes().collect();
    for &member in &members {
        for w in nodes[member].writes() {
            let covered = produced
                .iter()
                .any(|p| p.alloc == w.alloc && p.start <= w.start && w.end <= p.end);
            if !covered && needed_after(nodes, last, &w, outputs) {
                return None;
            }
        }
    }
    Some((members, node))
}

/// Whether the bytes of `w` are read after node `last` before a later node
/// overwrites all of them, or survive to the end as part of a graph output.
fn needed_after(nodes: &[Node], last: usize, w: &AccessRange, outputs: &[AccessRange]) -> bool {
    for n in &nodes[last + 1..] {
        if n.reads().any(|r| overlaps(&r, w)) {
            return true;
        }
        if n.writes()
            .any(|o| o.alloc == w.alloc && o.start <= w.start && w.end <= o.end)
        {
            return false;
        }
    }
    outputs.iter().any(|o| overlaps(o, w))
}

/// Removes nodes none of whose writes are read by a later node or overlap a
/// graph output. Returns the remaining nodes and how many were removed.
pub fn remove_dead(nodes: Vec<Node>, outputs: &[Buffer]) -> (Vec<Node>, usize) {
    let mut needed = output_ranges(outputs);
    let mut keep = vec![false; nodes.len()];
    for (i, node) in nodes.iter().enumerate().rev() {
        let writes: Vec<AccessRange> = node.writes().collect();
        let live =
            writes.is_empty() || writes.iter().any(|w| needed.iter().any(|n| overlaps(n, w)));
        if live {
            keep[i] = true;
            needed.extend(node.reads());
        }
    }
    let before = nodes.len();
    let kept: Vec<Node> = nodes
        .into_iter()
        .zip(keep)
        .filter_map(|(n, k)| k.then_some(n))
        .collect();
    let removed = before - kept.len();
    (kept, removed)
}

/// The result of scheduling: an order of the nodes, their concurrent groups,
/// and the transitively reduced dependency edges (indices into `order`).
#[derive(Clone, Debug, Default)]
pub struct Schedule {
    pub order: Vec<usize>,
    pub group_ends: Vec<u32>,
    pub edges: Vec<(u32, u32)>,
}

/// The accesses of earlier nodes to one allocation that later nodes may
/// still have to wait for, with the node of each.
#[derive(Default)]
struct LiveAccesses {
    reads: Vec<(AccessRange, usize)>,
    writes: Vec<(AccessRange, usize)>,
}

/// Dependencies: for each node, earlier nodes it conflicts with, enough of
/// them that every conflicting earlier node is one or an ancestor of one.
///
/// An access that a later write covers entirely (and so conflicts with) is
/// dropped from the live set: that write depends on it, and whatever
/// conflicts with it later conflicts with the write too. So a node is
/// compared with the live accesses of the allocations it touches, not with
/// every earlier node, and a long graph costs about linear time instead of
/// quadratic. The ancestors, levels and reduced edges come out the same as
/// from every conflicting pair.
fn predecessors(accesses: &[Vec<AccessRange>]) -> Vec<Vec<usize>> {
    let mut live: HashMap<u64, LiveAccesses> = HashMap::new();
    let mut preds = Vec::with_capacity(accesses.len());
    for (j, accesses) in accesses.iter().enumerate() {
        let mut p = Vec::new();
        for a in accesses {
            let Some(l) = live.get(&a.alloc) else {
                continue;
            };
            let reads: &[(AccessRange, usize)] = if a.write { &l.reads } else { &[] };
            p.extend(
                l.writes
                    .iter()
                    .chain(reads)
                    .filter(|(r, _)| a.conflicts(r))
                    .map(|&(_, i)| i),
            );
        }
        for a in accesses {
            let l = live.entry(a.alloc).or_default();
            if a.write {
                let visible = |(r, _): &(AccessRange, usize)| {
                    !(a.conflicts(r) && a.start <= r.start && r.end <= a.end)
                };
                l.reads.retain(visible);
                l.writes.retain(visible);
                l.writes.push((*a, j));
            } else {
                l.reads.push((*a, j));
            }
        }
        p.sort_unstable();
        p.dedup();
        preds.push(p);
    }
    preds
}

/// Bit set over node indices, for ancestor sets.
#[derive(Clone)]
struct Bits(Vec<u64>);

impl Bits {
    fn new(n: usize) -> Bits {
        Bits(vec![0; n.div_ceil(64)])
    }
    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
    fn get(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }
    fn union(&mut self, other: &Bits) {
        self.0.iter_mut().zip(&other.0).for_each(|(a, b)| *a |= b);
    }
}

/// Dependency edges with redundant (transitively implied) ones removed.
fn reduced_edges(preds: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = preds.len();
    let mut ancestors: Vec<Bits> = Vec::with_capacity(n);
    let mut reduced = Vec::with_capacity(n);
    for p in preds {
        let mut anc = Bits::new(n);
        for &i in p {
            anc.union(&ancestors[i]);
        }
        // `i` is redundant when it is already an ancestor of another predecessor.
        let direct: Vec<usize> = p.iter().copied().filter(|&i| !anc.get(i)).collect();
        for &i in p {
            anc.set(i);
        }
        ancestors.push(anc);
        reduced.push(direct);
    }
    reduced
}

/// Each node's level: the length of the longest dependency path ending at it.
fn levels(preds: &[Vec<usize>]) -> Vec<usize> {
    let mut level = vec![0usize; preds.len()];
    for (j, p) in preds.iter().enumerate() {
        level[j] = p.iter().map(|&i| level[i] + 1).max().unwrap_or(0);
    }
    level
}

/// Schedules the whole dependency graph: each node goes into the earliest
/// concurrent group after all its predecessors (as soon as possible), which
/// gives the fewest groups, and so the fewest barriers, the dependencies
/// allow. With `reorder` false the recording order is kept and groups break
/// where the hazard tracker would put a barrier.
pub fn schedule(nodes: &[Node], reorder: bool) -> Schedule {
    let accesses: Vec<Vec<AccessRange>> = nodes.iter().map(Node::accesses).collect();
    let preds = predecessors(&accesses);
    let reduced = reduced_edges(&preds);
    let (order, group_ends) = if reorder {
        let level = levels(&preds);
        // Level by level, recording order within a level (a stable sort).
        let mut order: Vec<usize> = (0..nodes.len()).collect();
        order.sort_by_key(|&j| level[j]);
        let mut group_ends: Vec<u32> = (1..order.len())
            .filter(|&p| level[order[p]] != level[order[p - 1]])
            .map(|p| p as u32)
            .collect();
        if !order.is_empty() {
            group_ends.push(order.len() as u32);
        }
        (order, group_ends)
    } else {
        ((0..nodes.len()).collect(), recording_order_groups(nodes))
    };
    let mut position = vec![0u32; nodes.len()];
    for (p, &j) in order.iter().enumerate() {
        position[j] = p as u32;
    }
    let edges = reduced
        .iter()
        .enumerate()
        .flat_map(|(j, p)| p.iter().map(move |&i| (i, j)))
        .map(|(i, j)| (position[i], position[j]))
        .collect();
    Schedule {
        order,
        group_ends,
        edges,
    }
}

/// Group ends in recording order, as the encoder's hazard tracker makes them.
pub fn recording_order_groups(nodes: &[Node]) -> Vec<u32> {
    let mut tracker = HazardTracker::default();
    let mut ends = Vec::new();
    for (j, node) in nodes.iter().enumerate() {
        let accesses = node.accesses();
        if tracker.group_len() > 0 && tracker.conflicts(&accesses) {
            ends.push(j as u32);
            tracker.clear();
        }
        tracker.add(&accesses);
    }
    if !nodes.is_empty() {
        ends.push(nodes.len() as u32);
    }
    ends
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every earlier node each node conflicts with: the definition
    /// [`predecessors`] must agree with.
    fn all_conflicts(accesses: &[Vec<AccessRange>]) -> Vec<Vec<usize>> {
        (0..accesses.len())
            .map(|j| {
                (0..j)
                    .filter(|&i| {
                        accesses[i]
                            .iter()
                            .any(|a| accesses[j].iter().any(|b| a.conflicts(b)))
                    })
                    .collect()
            })
            .collect()
    }

    fn ancestors(preds: &[Vec<usize>]) -> Vec<Vec<bool>> {
        let mut anc: Vec<Vec<bool>> = Vec::with_capacity(preds.len());
        for p in preds {
            let mut a = vec![false; preds.len()];
            for &i in p {
                a[i] = true;
                for (k, &x) in anc[i].iter().enumerate() {
                    a[k] |= x;
                }
            }
            anc.push(a);
        }
        anc
    }

    /// Nodes of one to three accesses over two allocations of 16 bytes,
    /// ranges of up to 8 bytes (empty ones included), reads and writes.
    fn graphs() -> impl Strategy<Value = Vec<Vec<AccessRange>>> {
        let access = (0u64..2, 0usize..16, 0usize..9, any::<bool>()).prop_map(
            |(alloc, start, len, write)| AccessRange {
                alloc,
                start,
                end: (start + len).min(16),
                write,
            },
        );
        prop::collection::vec(prop::collection::vec(access, 1..4), 0..40)
    }

    proptest! {
        #[test]
        fn live_accesses_keep_every_dependency(accesses in graphs()) {
            let all = all_conflicts(&accesses);
            let pruned = predecessors(&accesses);
            for (p, a) in pruned.iter().zip(&all) {
                prop_assert!(p.iter().all(|i| a.contains(i)), "an edge that is no conflict");
            }
            prop_assert_eq!(ancestors(&pruned), ancestors(&all));
            prop_assert_eq!(levels(&pruned), levels(&all));
            prop_assert_eq!(reduced_edges(&pruned), reduced_edges(&all));
        }
    }
}
