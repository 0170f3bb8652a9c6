//! Native CUDA graphs built from a program's dependency edges.
//!
//! Every dispatch becomes a kernel node; the program's edges become graph
//! edges, so independent dispatches run concurrently on the GPU. Without
//! edges, the concurrent groups give them: each node depends on the nodes
//! of the previous group (through one empty join node when that takes fewer
//! edges). The executable owns the program, and with it every kernel it
//! launches; the runtime above retains the buffers.
//!
//! With early launch on (sm_90 and later), an edge into a kernel declared
//! [`crate::KernelDef::programmatic`] is a programmatic edge: that kernel's
//! blocks may start once the kernels before it have reached their own
//! `encore_grid_wait()`, and they wait there for those kernels to finish.
//! Every programmatic kernel waits before touching shared memory, and no
//! kernel finishes before its wait returns, so ordering stays transitive:
//! a kernel that waited for its direct predecessors also waited for theirs.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUgraph, CUgraphExec, CUgraphNode, CUresult};

use super::queue::{Params, Pending, Queue};
use crate::backend::{BackendSubmission, Executable};
use crate::error::{Error, Result};
use crate::program::Program;
use crate::record::Upload;

/// An instantiated graph, launched on the device's stream.
pub(super) struct CudaGraph {
    queue: Arc<Queue>,
    exec: CUgraphExec,
    program: Arc<Program>,
}

// SAFETY: a graph executable is a context-wide handle; launches are
// serialized by the queue's lock.
unsafe impl Send for CudaGraph {}
// SAFETY: as above.
unsafe impl Sync for CudaGraph {}

/// Destroys a graph under construction on every path.
struct GraphGuard(CUgraph);

impl Drop for GraphGuard {
    fn drop(&mut self) {
        // SAFETY: the graph was created by cuGraphCreate and is destroyed
        // once; an instantiated executable does not depend on it.
        unsafe { sys::cuGraphDestroy(self.0) };
    }
}

impl CudaGraph {
    /// Builds and instantiates the graph of `program`; `early` gives kernels
    /// declared programmatic programmatic edges (see the module docs).
    pub(super) fn build(
        queue: &Arc<Queue>,
        program: Arc<Program>,
        early: bool,
    ) -> Result<CudaGraph> {
        let ctx = &queue.ctx;
        let n = program.dispatches.len();
        if let Some(&(from, to)) = program
            .edges
            .iter()
            .find(|&&(from, to)| from as usize >= n || to as usize >= n || from == to)
        {
            return Err(Error::Graph(format!(
                "edge {from} -> {to} is invalid in a program of {n} dispatches"
            )));
        }
        ctx.bind()?;
        ctx.usable()?;
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: creates an empty graph; flags must be 0.
        let code = unsafe { sys::cuGraphCreate(&mut graph, 0) };
        ctx.check(code, || "create a graph".into())?;
        let graph = GraphGuard(graph);

        let mut nodes: Vec<CUgraphNode> = Vec::with_capacity(n);
        let mut params = Params::new();
        for d in &program.dispatches {
            let kernel = params.build(&program, d)?;
            let l = &d.launch;
            kernel.allow_shared(l.shared_bytes)?;
            let node_params = sys::CUDA_KERNEL_NODE_PARAMS {
                func: kernel.function,
                gridDimX: l.grid[0],
                gridDimY: l.grid[1],
                gridDimZ: l.grid[2],
                blockDimX: l.block[0],
                blockDimY: l.block[1],
                blockDimZ: l.block[2],
                sharedMemBytes: l.shared_bytes,
                kernelParams: params.pointers(),
                extra: std::ptr::null_mut(),
                kern: std::ptr::null_mut(),
                ctx: std::ptr::null_mut(),
            };
            let mut node: CUgraphNode = std::ptr::null_mut();
            // SAFETY: as for cuLaunchKernel: one pointer per parameter to a
            // value of its size; the driver copies the values into the node.
            let code = unsafe {
                sys::cuGraphAddKernelNode_v2(&mut node, graph.0, std::ptr::null(), 0, &node_params)
            };
            ctx.check(code, || {
                format!(
                    "add kernel {} (dispatch `{}`) to a graph",
                    d.kernel.name(),
                    d.label
                )
            })?;
            nodes.push(node);
        }

        let early_into: Vec<bool> = program
            .dispatches
            .iter()
            .map(|d| early && d.kernel.def().is_programmatic())
            .collect();
        let edges = if program.edges.is_empty() {
            group_edges(&program, &nodes, &early_into, graph.0, ctx)?
        } else {
            let mut edges = Edges::default();
            for &(a, b) in program.edges.iter() {
                edges.push(nodes[a as usize], nodes[b as usize], early_into[b as usize]);
            }
            edges
        };
        edges.add_to(graph.0, ctx)?;
        if nodes.is_empty() {
            let mut empty: CUgraphNode = std::ptr::null_mut();
            // SAFETY: adds one node without dependencies, so the graph is not empty.
            let code =
                unsafe { sys::cuGraphAddEmptyNode(&mut empty, graph.0, std::ptr::null(), 0) };
            ctx.check(code, || "add an empty graph node".into())?;
        }

        let mut exec: CUgraphExec = std::ptr::null_mut();
        // SAFETY: instantiates the complete graph; the executable is
        // independent of the graph, which the guard then destroys.
        let code = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph.0, 0) };
        ctx.check(code, || format!("instantiate a graph of {n} kernels"))?;
        // Owned from here on, so that every error path below destroys it.
        let built = CudaGraph {
            queue: queue.clone(),
            exec,
            program,
        };
        // The first launch of an executable otherwise sets up its work on
        // the device first (hundreds of microseconds for a decode step):
        // do it now, in stream order, so that no replay pays for it.
        // SAFETY: the executable and the stream belong to this context.
        let code = unsafe { sys::cuGraphUpload(built.exec, queue.stream) };
        ctx.check(code, || format!("upload a graph of {n} kernels"))?;
        Ok(built)
    }
}

/// A graph's edges; `data[i]` says whether edge `i` is programmatic.
#[derive(Default)]
struct Edges {
    from: Vec<CUgraphNode>,
    to: Vec<CUgraphNode>,
    data: Vec<sys::CUgraphEdgeData>,
}

impl Edges {
    fn push(&mut self, from: CUgraphNode, to: CUgraphNode, programmatic: bool) {
        self.from.push(from);
        self.to.push(to);
        self.data.push(if programmatic {
            sys::CUgraphEdgeData {
                from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                to_port: 0,
                type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
                reserved: [0; 5],
            }
        } else {
            // All zeros: full completion of `from`, with its writes visible.
            sys::CUgraphEdgeData {
                from_port: 0,
                to_port: 0,
                type_: 0,
                reserved: [0; 5],
            }
        });
    }

    fn add_to(&self, graph: CUgraph, ctx: &super::driver::Context) -> Result<()> {
        if self.from.is_empty() {
            return Ok(());
        }
        let programmatic = self.data.iter().filter(|d| d.type_ != 0).count();
        let code = if programmatic == 0 {
            // SAFETY: `from` and `to` have equal lengths and hold nodes of this graph.
            unsafe {
                sys::cuGraphAddDependencies(
                    graph,
                    self.from.as_ptr(),
                    self.to.as_ptr(),
                    self.from.len(),
                )
            }
        } else {
            // SAFETY: as above, with one edge annotation per edge; early
            // launch is only asked for on drivers that have this call
            // (CUDA 12.3 and later, checked when the backend opened).
            unsafe {
                sys::cuGraphAddDependencies_v2(
                    graph,
                    self.from.as_ptr(),
                    self.to.as_ptr(),
                    self.data.as_ptr(),
                    self.from.len(),
                )
            }
        };
        ctx.check(code, || {
            format!(
                "add {} graph edges ({programmatic} programmatic)",
                self.from.len()
            )
        })
    }
}

/// Edges that order each concurrent group after the previous one.
fn group_edges(
    program: &Program,
    nodes: &[CUgraphNode],
    early_into: &[bool],
    graph: CUgraph,
    ctx: &super::driver::Context,
) -> Result<Edges> {
    let mut edges = Edges::default();
    let mut previous: &[CUgraphNode] = &[];
    for group in program.groups() {
        let early = early_into.get(group.clone()).unwrap_or(&[]);
        let current = nodes.get(group).unwrap_or(&[]);
        if previous.len() > 1
            && current.len() > 1
            && previous.len() * current.len() > previous.len() + current.len()
        {
            let mut join: CUgraphNode = std::ptr::null_mut();
            // SAFETY: adds an empty node to this graph, without dependencies yet.
            let code = unsafe { sys::cuGraphAddEmptyNode(&mut join, graph, std::ptr::null(), 0) };
            ctx.check(code, || "add a join node".into())?;
            for &p in previous {
                edges.push(p, join, false);
            }
            for &c in current {
                edges.push(join, c, false);
            }
        } else {
            for &p in previous {
                for (&c, &e) in current.iter().zip(early) {
                    edges.push(p, c, e);
                }
            }
        }
        if !current.is_empty() {
            previous = current;
        }
    }
    Ok(edges)
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if self.queue.ctx.bind().is_ok() {
            // SAFETY: destroys the executable once; a launch still running
            // is completed by the driver before the executable is freed.
            unsafe { sys::cuGraphExecDestroy(self.exec) };
        }
    }
}

impl Executable for CudaGraph {
    /// Launches the graph after the uploads. With `timing`, the program runs
    /// eagerly instead, one dispatch after another with an event pair each,
    /// because a graph's nodes cannot be timed individually; the result is
    /// the same, the elapsed time is that of the eager run.
    fn launch(&self, uploads: &[Upload], timing: bool) -> Result<Box<dyn BackendSubmission>> {
        if timing {
            return self.queue.run(&self.program, uploads, true);
        }
        let queue = &self.queue;
        let guard = queue.params.lock();
        queue.ctx.bind()?;
        queue.ctx.usable()?;
        let mut pending = Pending::new(queue);
        let enqueued = (|| {
            queue.upload(uploads)?;
            pending.start = queue.event()?;
            queue.record(pending.start)?;
            // SAFETY: the executable and stream belong to this context; the
            // program's kernels live as long as `self`, its buffers are
            // retained by the caller until completion.
            let code = unsafe { sys::cuGraphLaunch(self.exec, queue.stream) };
            if code != CUresult::CUDA_SUCCESS {
                return Err(queue.ctx.error(
                    code,
                    format!(
                        "launch a graph of {} kernels",
                        self.program.dispatches.len()
                    ),
                ));
            }
            pending.end = queue.event()?;
            queue.record(pending.end)
        })();
        drop(guard);
        match enqueued {
            Ok(()) => Ok(Box::new(pending.into_submission())),
            Err(e) => {
                let _ = queue.synchronize();
                Err(e)
            }
        }
    }
}
