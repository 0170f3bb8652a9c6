//! Graphs: recorded dispatch sequences that are optimized once and replayed.
//!
//! An encoder from [`Device::capture`](crate::Device::capture) records a
//! graph with the same calls that record eager work, as nodes that own their
//! kernels and buffers; [`Encoder::finish_graph`](crate::Encoder::finish_graph)
//! hands them over as a [`Graph`].
//! Because every dispatch declares its access (invariant 2), the dependency
//! edges between nodes follow from byte-range conflicts, and every pass works
//! on every graph:
//!
//! - [`passes::fuse`]: pattern-table fusion of dataflow chains into one kernel;
//! - [`passes::remove_dead`]: removal of nodes whose outputs nothing reads;
//! - [`passes::schedule`]: whole-graph scheduling into as few concurrent
//!   groups as the dependencies allow, which is also minimal barrier placement;
//! - specialization: on a backend that compiles kernels from source
//!   ([`Capabilities::specialization`](crate::Capabilities::specialization)),
//!   a node whose kernel is
//!   [`KernelDef::specializable`](crate::KernelDef::specializable) gets the
//!   variant compiled for its shape (its value argument as constants).
//!
//! [`Graph::instantiate`] builds a backend executable (ordered concurrent
//! groups on CPU, a native graph with real edges on CUDA) that owns every
//! buffer and kernel it references; [`GraphExec::replay`] runs it with new
//! [`Params`] values and is an ordinary safe call (invariant 4).

mod exec;
mod params;
pub mod passes;

pub use exec::{GraphCache, GraphExec};
pub use params::Params;

use crate::buffer::Buffer;
use crate::hazard::AccessRange;
use crate::kernel::Kernel;
use crate::record::Access;
use crate::Label;

/// One argument of a graph node.
#[derive(Clone, Debug)]
pub enum NodeArg {
    Buffer(Buffer, Access),
    Bytes(Vec<u8>),
}

impl NodeArg {
    /// The byte range this argument touches, if it is a buffer.
    pub fn access(&self) -> Option<AccessRange> {
        match self {
            NodeArg::Buffer(b, a) => Some(AccessRange {
                alloc: b.allocation_id(),
                start: b.offset(),
                end: b.offset() + b.len(),
                write: a.writes(),
            }),
            NodeArg::Bytes(_) => None,
        }
    }
}

/// One dispatch of a graph. Its launch geometry is not part of it: the
/// backend computes that from the kernel and the node's value when the
/// graph is instantiated, for recorded and fused nodes alike.
#[derive(Clone, Debug)]
pub struct Node {
    pub kernel: Kernel,
    pub args: Vec<NodeArg>,
    pub label: Label,
}

impl Node {
    /// The op kind fusion patterns match on.
    pub fn op(&self) -> &str {
        self.kernel.op_kind()
    }

    /// Every buffer range the node touches.
    pub fn accesses(&self) -> Vec<AccessRange> {
        self.args.iter().filter_map(NodeArg::access).collect()
    }

    /// The ranges it writes.
    pub fn writes(&self) -> impl Iterator<Item = AccessRange> + '_ {
        self.args
            .iter()
            .filter_map(NodeArg::access)
            .filter(|a| a.write)
    }

    /// The ranges it reads (read and read-write arguments).
    pub fn reads(&self) -> impl Iterator<Item = AccessRange> + '_ {
        self.args.iter().filter_map(|arg| match arg {
            NodeArg::Buffer(_, access) if access.reads() => arg.access().map(|mut a| {
                a.write = false;
                a
            }),
            _ => None,
        })
    }

    /// Whether this node must be ordered with `other` (either way).
    pub fn conflicts(&self, other: &Node) -> bool {
        let theirs = other.accesses();
        self.accesses()
            .iter()
            .any(|a| theirs.iter().any(|b| a.conflicts(b)))
    }
}

/// The shape of a graph's dependency structure.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GraphShape {
    /// Dispatches.
    pub nodes: usize,
    /// Dependency edges (transitively reduced).
    pub edges: usize,
    /// Concurrent groups (barriers + 1).
    pub groups: usize,
    /// Mean dispatches per concurrent group.
    pub mean_group: f64,
    /// Largest concurrent group.
    pub max_group: usize,
}

impl GraphShape {
    pub(crate) fn new(nodes: usize, edges: usize, group_ends: &[u32]) -> GraphShape {
        let mut prev = 0u32;
        let max_group = group_ends
            .iter()
            .map(|&end| {
                let size = (end - prev) as usize;
                prev = end;
                size
            })
            .max()
            .unwrap_or(0);
        let groups = group_ends.len();
        GraphShape {
            nodes,
            edges,
            groups,
            mean_group: if groups == 0 {
                0.0
            } else {
                nodes as f64 / groups as f64
            },
            max_group,
        }
    }
}

/// Statistics of a graph before and after its passes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GraphStats {
    /// As recorded: recording order, groups where the hazard tracker would
    /// put barriers.
    pub before: GraphShape,
    /// As instantiated: after fusion, dead-node removal and scheduling.
    pub after: GraphShape,
    /// Nodes created by fusion.
    pub fused: usize,
    /// Nodes removed because nothing read their outputs.
    pub removed: usize,
    /// Nodes given a kernel variant compiled for their shape.
    pub specialized: usize,
    /// Runs of the graph one replay makes (the shapes above are one run's).
    pub runs_per_replay: usize,
}

/// A recorded sequence of dispatches.
#[derive(Clone, Debug)]
pub struct Graph {
    pub(crate) device: crate::Device,
    nodes: Vec<Node>,
    outputs: Vec<Buffer>,
    params: Option<Params>,
    runs: usize,
}

impl Graph {
    pub(crate) fn new(device: crate::Device, nodes: Vec<Node>) -> Graph {
        Graph {
            device,
            nodes,
            outputs: Vec::new(),
            params: None,
            runs: 1,
        }
    }

    /// The nodes in recording order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Declares a buffer the graph produces for later use (logits, a KV
    /// cache): nodes writing it are never removed as dead.
    pub fn mark_output(&mut self, buffer: &Buffer) {
        self.outputs.push(buffer.clone());
    }

    /// The parameter block replays write before running.
    pub fn set_params(&mut self, params: &Params) {
        self.params = Some(params.clone());
    }

    pub fn params(&self) -> Option<&Params> {
        self.params.as_ref()
    }

    /// Makes one replay of the executable run the graph `runs` times in a
    /// row, each run after the whole of the one before: for a graph whose
    /// runs feed each other on the device (a greedy decode step), so that
    /// the boundary between two replays is paid once per `runs` runs. The
    /// passes work on one run. At least 1 (the default).
    pub fn set_runs_per_replay(&mut self, runs: usize) {
        self.runs = runs.max(1);
    }

    /// Runs of the graph in one replay.
    pub fn runs_per_replay(&self) -> usize {
        self.runs
    }

    pub fn outputs(&self) -> &[Buffer] {
        &self.outputs
    }

    /// Instantiates the graph with the passes the device's config enables
    /// and the device's fusion patterns.
    pub fn instantiate(&self, patterns: &[passes::FusionPattern]) -> crate::Result<GraphExec> {
        let config = self.device.config();
        let options = passes::Options {
            fusion: config.fusion,
            remove_dead: true,
            schedule: config.schedule,
            specialize: config.specialize,
        };
        GraphExec::build(self, patterns, options)
    }

    /// A hash of everything that determines the executable: kernels,
    /// argument allocations, offsets, lengths and inline bytes (which
    /// determine the launch geometry). Parameter values are not part of it.
    pub fn signature(&self) -> u64 {
        let mut h = crate::kernel::Fnv::new();
        for n in &self.nodes {
            h.write(n.kernel.name().as_bytes());
            h.write(&n.kernel.key().source_hash.to_le_bytes());
            for a in &n.args {
                match a {
                    NodeArg::Buffer(b, access) => {
                        h.write(&b.allocation_id().to_le_bytes());
                        h.write(&(b.offset() as u64).to_le_bytes());
                        h.write(&(b.len() as u64).to_le_bytes());
                        h.write(&[*access as u8]);
                    }
                    NodeArg::Bytes(bytes) => {
                        h.write(&(bytes.len() as u64).to_le_bytes());
                        h.write(bytes);
                    }
                }
            }
            h.write(&[0xff]);
        }
        for o in &self.outputs {
            h.write(&o.allocation_id().to_le_bytes());
            h.write(&(o.offset() as u64).to_le_bytes());
            h.write(&(o.len() as u64).to_le_bytes());
        }
        h.write(&(self.runs as u64).to_le_bytes());
        h.finish()
    }

    pub(crate) fn into_parts(self) -> (Vec<Node>, Vec<Buffer>, Option<Params>) {
        (self.nodes, self.outputs, self.params)
    }
}
