//! Graph executables and their cache.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::passes::{self, FusionPattern, Options};
use super::{Graph, GraphShape, GraphStats, Node, NodeArg, Params};
use crate::backend::Executable;
use crate::counters::Counters;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::program::{DispatchRec, Program};
use crate::record::{ArgRec, Upload};
use crate::retain::{InFlight, Keep, Retained};
use crate::submission::Submission;
use crate::Label;

struct ExecInner {
    device: Device,
    executable: Box<dyn Executable>,
    program: Arc<Program>,
    /// The scheduled nodes: they own every buffer and kernel the executable
    /// references, so replay can never touch freed memory.
    nodes: Vec<Node>,
    params: Option<Params>,
    stats: GraphStats,
}

/// An instantiated graph, ready to replay. Cheap to clone.
#[derive(Clone)]
pub struct GraphExec(Arc<ExecInner>);

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphExec({:?})", self.0.stats)
    }
}

/// Gives every node whose kernel has variants on `backend` (the device's
/// own, outside tests; [`crate::KernelDef::specialized_for`]) the variant
/// for its value argument, loaded on `device`. Nodes of one shape share one
/// variant, loaded once; distinct variants load at the same time, one a
/// core, so that a graph's first instantiation waits about as long as its
/// slowest compile rather than the sum of all (NVRTC compiles on one core).
/// Returns how many nodes changed kernels.
fn specialize(device: &Device, backend: crate::BackendKind, nodes: &mut [Node]) -> Result<usize> {
    let variants: Vec<Option<crate::KernelDef>> =
        nodes.iter().map(|n| variant(n, backend)).collect();
    // Each node's index into the distinct variants.
    let mut distinct: Vec<&crate::KernelDef> = Vec::new();
    let slots: Vec<Option<usize>> = variants
        .iter()
        .map(|v| {
            let def = v.as_ref()?;
            let same = |d: &&crate::KernelDef| {
                d.name() == def.name()
                    && d.options() == def.options()
                    && d.content(backend) == def.content(backend)
            };
            Some(distinct.iter().position(same).unwrap_or_else(|| {
                distinct.push(def);
                distinct.len() - 1
            }))
        })
        .collect();
    let loaded = load_at_once(device, &distinct)?;
    let mut changed = 0;
    for (node, slot) in nodes.iter_mut().zip(slots) {
        if let Some(i) = slot {
            node.kernel = loaded[i].clone();
            changed += 1;
        }
    }
    Ok(changed)
}

/// The variant of `node`'s kernel on `backend` for its one value argument,
/// if the kernel has variants there and the node has exactly one.
fn variant(node: &Node, backend: crate::BackendKind) -> Option<crate::KernelDef> {
    let mut values = node.args.iter().filter_map(|a| match a {
        NodeArg::Bytes(bytes) => Some(bytes),
        NodeArg::Buffer(..) => None,
    });
    match (values.next(), values.next()) {
        (Some(value), None) => node.kernel.def().specialized_for(backend, value),
        _ => None,
    }
}

/// Loads `defs` on `device`, as many at a time as the machine has cores.
fn load_at_once(device: &Device, defs: &[&crate::KernelDef]) -> Result<Vec<crate::Kernel>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut loaded = Vec::with_capacity(defs.len());
    for batch in defs.chunks(cores) {
        let results: Vec<Result<crate::Kernel>> = std::thread::scope(|s| {
            let loads: Vec<_> = batch
                .iter()
                .map(|def| s.spawn(move || device.load_kernel(def)))
                .collect();
            loads
                .into_iter()
                .map(|load| {
                    load.join().unwrap_or_else(|_| {
                        Err(Error::Graph(
                            "compiling a specialized kernel panicked".into(),
                        ))
                    })
                })
                .collect()
        });
        for result in results {
            loaded.push(result?);
        }
    }
    Ok(loaded)
}

impl GraphExec {
    pub(crate) fn build(
        graph: &Graph,
        patterns: &[FusionPattern],
        options: Options,
    ) -> Result<GraphExec> {
        let device = graph.device.clone();
        let runs = graph.runs_per_replay();
        let (nodes, outputs, params) = graph.clone().into_parts();
        let recorded = passes::schedule(&nodes, false);
        let before = GraphShape::new(nodes.len(), recorded.edges.len(), &recorded.group_ends);
        let (nodes, fused) = if options.fusion {
            passes::fuse(nodes, patterns, &outputs)
        } else {
            (nodes, 0)
        };
        let (nodes, removed) = if options.remove_dead {
            passes::remove_dead(nodes, &outputs)
        } else {
            (nodes, 0)
        };
        let schedule = passes::schedule(&nodes, options.schedule);
        let mut nodes: Vec<Node> = schedule.order.iter().map(|&i| nodes[i].clone()).collect();
        let specialized = if options.specialize && device.capabilities().specialization {
            specialize(&device, device.kind(), &mut nodes)?
        } else {
            0
        };

        let mut program = Program::default();
        for node in &nodes {
            if node.kernel.key().backend != device.kind() {
                return Err(Error::Graph(format!(
                    "node `{}` uses a kernel loaded for another backend",
                    node.label
                )));
            }
            let (start, bytes_start) = (program.args.len() as u32, program.bytes.len());
            for arg in &node.args {
                program.args.push(match arg {
                    NodeArg::Buffer(b, access) => ArgRec::Buffer {
                        mem: b.alloc.mem,
                        offset: b.offset,
                        len: b.len,
                        access: *access,
                    },
                    NodeArg::Bytes(bytes) => {
                        let at = program.bytes.len() as u32;
                        program.bytes.extend_from_slice(bytes);
                        ArgRec::Bytes {
                            start: at,
                            len: bytes.len() as u32,
                        }
                    }
                });
            }
            let value = program.bytes.get(bytes_start..).unwrap_or(&[]);
            let launch = device
                .backend()
                .launch(&node.kernel, value)
                .map_err(|reason| Error::InvalidDispatch {
                    kernel: node.kernel.name().to_string(),
                    label: node.label.to_string(),
                    reason,
                })?;
            program.dispatches.push(DispatchRec {
                kernel: node.kernel.clone(),
                args: start..program.args.len() as u32,
                launch,
                label: node.label.clone(),
            });
        }
        program.group_ends = schedule.group_ends.clone();
        program.edges = schedule.edges.clone();

        let stats = GraphStats {
            before,
            after: GraphShape::new(nodes.len(), program.edges.len(), &program.group_ends),
            fused,
            removed,
            specialized,
            runs_per_replay: runs,
        };
        let program = Arc::new(if runs > 1 {
            program.repeated(runs)
        } else {
            program
        });
        let executable = device.backend().instantiate(program.clone())?;
        device.add_counters(&Counters {
            graph_instantiations: 1,
            ..Counters::default()
        });
        Ok(GraphExec(Arc::new(ExecInner {
            device,
            executable,
            program,
            nodes,
            params,
            stats,
        })))
    }

    /// What the passes did.
    pub fn stats(&self) -> &GraphStats {
        &self.0.stats
    }

    /// The scheduled nodes, in execution order.
    pub fn nodes(&self) -> &[Node] {
        &self.0.nodes
    }

    /// Concurrent groups as ranges of [`GraphExec::nodes`].
    pub fn groups(&self) -> Vec<std::ops::Range<usize>> {
        self.0.program.groups().collect()
    }

    /// Runs the graph once with the given parameter values (unnamed
    /// parameters keep the values they last had).
    pub fn replay(&self, values: &[(&str, u32)]) -> Result<Submission> {
        let inner = &self.0;
        let device = &inner.device;
        device.before_submit()?;
        let mut uploads = Vec::with_capacity(values.len());
        if !values.is_empty() {
            let params = inner.params.as_ref().ok_or_else(|| {
                Error::Graph("replay got parameter values but the graph has no parameters".into())
            })?;
            for (name, value) in values {
                let slot = params.slot(name)?;
                uploads.push(Upload {
                    mem: slot.alloc.mem,
                    offset: slot.offset,
                    bytes: value.to_le_bytes().to_vec(),
                });
            }
        }
        device.add_counters(&Counters {
            graph_replays: 1,
            submissions: 1,
            dispatches: (inner.nodes.len() * inner.stats.runs_per_replay) as u64,
            barriers: (inner.stats.after.groups * inner.stats.runs_per_replay).saturating_sub(1)
                as u64,
            ..Counters::default()
        });
        let replay = device.next_replay();
        let timing = replay.captured || device.profiles_dispatches();
        let backend = match inner.executable.launch(&uploads, timing) {
            Ok(backend) => backend,
            Err(e) => {
                if replay.captured {
                    device.abandon_capture();
                }
                return Err(e);
            }
        };
        let keep: Keep = self.0.clone();
        let retained = Retained {
            keep: vec![keep],
            ..Retained::default()
        };
        Ok(Submission::new(
            device.clone(),
            Label::from("graph replay"),
            InFlight {
                backend,
                retained,
                program: inner.program.clone(),
                replay: Some(replay),
            },
        ))
    }
}

/// Executables keyed by [`Graph::signature`]: a graph recorded again with the
/// same kernels, geometry and buffers reuses its executable; a changed shape
/// builds a new one. Parameter values are not part of the key.
pub struct GraphCache {
    patterns: Vec<FusionPattern>,
    map: Mutex<HashMap<u64, GraphExec>>,
    hits: std::sync::atomic::AtomicU64,
    misses: std::sync::atomic::AtomicU64,
}

impl GraphCache {
    /// A cache that instantiates with these fusion patterns.
    pub fn new(patterns: Vec<FusionPattern>) -> GraphCache {
        GraphCache {
            patterns,
            map: Mutex::new(HashMap::new()),
            hits: Default::default(),
            misses: Default::default(),
        }
    }

    /// The cached executable for this graph's signature, or a new one.
    pub fn get_or_instantiate(&self, graph: &Graph) -> Result<GraphExec> {
        use std::sync::atomic::Ordering::Relaxed;
        let signature = graph.signature();
        if let Some(exec) = self.map.lock().get(&signature) {
            self.hits.fetch_add(1, Relaxed);
            graph.device.add_counters(&Counters {
                graph_cache_hits: 1,
                ..Counters::default()
            });
            return Ok(exec.clone());
        }
        self.misses.fetch_add(1, Relaxed);
        let exec = graph.instantiate(&self.patterns)?;
        self.map.lock().insert(signature, exec.clone());
        Ok(exec)
    }

    /// Lookups answered from the cache.
    pub fn hits(&self) -> u64 {
        self.hits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lookups that instantiated a new executable.
    pub fn misses(&self) -> u64 {
        self.misses.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Cached executables.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.lock().is_empty()
    }

    /// Drops every cached executable (in-flight replays keep theirs alive).
    pub fn clear(&self) {
        self.map.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::{Arg, Config, CudaKernel, Kernel, KernelDef, Launch};

    /// Nodes of one shape share one variant, other shapes get their own, and
    /// kernels that are not specializable keep theirs. (CUDA's variants,
    /// loaded on the CPU: the same Rust body under another key, which is
    /// enough to see which node got which.)
    #[test]
    fn nodes_get_one_variant_per_shape() {
        let device = Device::open("cpu", &Config::default()).unwrap();
        let body = |a: &crate::CpuArgs<'_>| {
            let v: u32 = a.scalar(1)?;
            a.write::<u32>(0)?[0] = v;
            Ok(())
        };
        let source = || {
            CudaKernel::fixed(
                "/* k(y, v) calls encore_fix_value(v) */",
                "k",
                Launch::new(1, 1),
            )
        };
        let special = device
            .load_kernel(
                &KernelDef::new("k")
                    .cpu("k v1", body)
                    .cuda(source())
                    .specializable(),
            )
            .unwrap();
        let plain = device
            .load_kernel(&KernelDef::new("p").cpu("p v1", body).cuda(source()))
            .unwrap();
        let out = device.alloc(4 * 5).unwrap();
        let mut enc = device.capture();
        for (i, (kernel, value)) in [
            (&special, 7u32),
            (&special, 9),
            (&special, 7),
            (&plain, 7),
            (&special, 9),
        ]
        .into_iter()
        .enumerate()
        {
            let y = out.view(4 * i, 4).unwrap();
            enc.dispatch(kernel, &[Arg::write(&y), Arg::value(&value)], "n")
                .unwrap();
        }
        let (mut nodes, _, _) = enc.finish_graph().unwrap().into_parts();
        let compiles = device.counters().kernel_compiles;
        let cuda = crate::BackendKind::Cuda;
        assert_eq!(specialize(&device, cuda, &mut nodes).unwrap(), 4);
        assert_eq!(
            device.counters().kernel_compiles - compiles,
            2,
            "one compile per shape"
        );
        let k: Vec<&Kernel> = nodes.iter().map(|n| &n.kernel).collect();
        assert!(k[0].same(k[2]) && k[1].same(k[4]) && !k[0].same(k[1]));
        assert!(k[3].same(&plain) && !k[0].same(&special));
        assert!(k[0].def().options()[0].ends_with("={0x7u}"));
        assert!(k[1].def().options()[0].ends_with("={0x9u}"));
    }
}
