//! Native CUDA graphs built from a program's dependency edges.
//!
//! Every dispatch becomes a kernel node; the program's edges become graph
//! edges, so independent dispatches run concurrently on the GPU. Without
//! edges, the concurrent groups give them: each node depends on the nodes
//! of the previous group (through one empty join node when that takes fewer
//! edges). The executable owns the program, and with it every kernel it
//! launches; the runtime above retains the buffers.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUgraph, CUgraphExec, CUgraphNode, CUresult};

use super::queue::{Params, Pending, Queue};
use crate::backend::{BackendSubmission, Executable, Program, Upload};
use crate::error::{Error, Result};

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
    pub(super) fn build(queue: &Arc<Queue>, program: Arc<Program>) -> Result<CudaGraph> {
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

        let (from, to) = if program.edges.is_empty() {
            group_edges(&program, &nodes, graph.0, ctx)?
        } else {
            program
                .edges
                .iter()
                .map(|&(a, b)| (nodes[a as usize], nodes[b as usize]))
                .unzip()
        };
        if !from.is_empty() {
            // SAFETY: `from` and `to` have equal lengths and hold nodes of this graph.
            let code = unsafe {
                sys::cuGraphAddDependencies(graph.0, from.as_ptr(), to.as_ptr(), from.len())
            };
            ctx.check(code, || format!("add {} graph edges", from.len()))?;
        }
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
        Ok(CudaGraph {
            queue: queue.clone(),
            exec,
            program,
        })
    }
}

/// Edges that order each concurrent group after the previous one.
fn group_edges(
    program: &Program,
    nodes: &[CUgraphNode],
    graph: CUgraph,
    ctx: &super::driver::Context,
) -> Result<(Vec<CUgraphNode>, Vec<CUgraphNode>)> {
    let (mut from, mut to) = (Vec::new(), Vec::new());
    let mut previous: &[CUgraphNode] = &[];
    for group in program.groups() {
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
                from.push(p);
                to.push(join);
            }
            for &c in current {
                from.push(join);
                to.push(c);
            }
        } else {
            for &p in previous {
                for &c in current {
                    from.push(p);
                    to.push(c);
                }
            }
        }
        if !current.is_empty() {
            previous = current;
        }
    }
    Ok((from, to))
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
