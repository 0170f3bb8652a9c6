//! The fusion rules of the op layer: how recorded dispatches of a graph
//! become the fused kernels of [`crate::kernels::fused`] and
//! [`crate::kernels::rope`]. The graph pass ([`encore::graph::passes::fuse`])
//! finds the matches and checks that replacing them keeps every result; the
//! rules here check that the arguments line up and build the fused node.
//!
//! In table order (a later rule extends what an earlier one built):
//! 1. `matmul` siblings reading the same input: one `fused_matmul` (Q, K
//!    and V; gate and up);
//! 2. `rms_norm` then a product of its output: the norm folded in;
//! 3. gate and up then `silu_mul`: the SwiGLU epilogue;
//! 4. a product then `add` into the residual: the accumulate epilogue;
//! 5. `rope` then `kv_store` of the rotated rows: `rope_store`.

use encore::graph::passes::FusionPattern;
use encore::{Access, Buffer, Kernel, Launch, Node, NodeArg};

use crate::kernels::fused::{self, FusedShape};
use crate::kernels::rope::{self, RopeShape, RopeStoreShape};
use crate::kernels::{attention::KvShape, matmul, norm::NormShape};

fn buffer(node: &Node, i: usize) -> Option<&Buffer> {
    match node.args.get(i)? {
        NodeArg::Buffer(b, _) => Some(b),
        NodeArg::Bytes(_) => None,
    }
}

fn value<T: bytemuck::Pod>(node: &Node, i: usize) -> Option<T> {
    match node.args.get(i)? {
        NodeArg::Bytes(bytes) => bytemuck::try_pod_read_unaligned(bytes).ok(),
        NodeArg::Buffer(..) => None,
    }
}

fn same(a: &Buffer, b: &Buffer) -> bool {
    a.allocation_id() == b.allocation_id() && a.offset() == b.offset() && a.len() == b.len()
}

fn overlap(a: &Buffer, b: &Buffer) -> bool {
    a.allocation_id() == b.allocation_id()
        && a.offset() < b.offset() + b.len()
        && b.offset() < a.offset() + a.len()
}

/// A `fused_matmul` (or a plain `matmul` seen as one) taken apart.
struct Product {
    x: Buffer,
    g: Option<Buffer>,
    w: Vec<Buffer>,
    y: Vec<Buffer>,
    shape: FusedShape,
    label: String,
}

impl Product {
    fn parse(node: &Node) -> Option<Product> {
        match node.op() {
            "matmul" => {
                let s: matmul::MatmulShape = value(node, 3)?;
                Some(Product {
                    x: buffer(node, 1)?.clone(),
                    g: None,
                    w: vec![buffer(node, 0)?.clone()],
                    y: vec![buffer(node, 2)?.clone()],
                    shape: FusedShape {
                        rows: s.rows,
                        k: s.k,
                        n: [s.n, 0, 0],
                        dtype: [s.dtype, 0, 0],
                        weights: 1,
                        epilogue: fused::EPILOGUE_STORE,
                        norm: 0,
                        eps: 0.0,
                    },
                    label: node.label.to_string(),
                })
            }
            "fused_matmul" => {
                let shape: FusedShape = value(node, 8)?;
                let weights = shape.weights as usize;
                let outputs = if shape.epilogue == fused::EPILOGUE_STORE {
                    weights
                } else {
                    1
                };
                Some(Product {
                    x: buffer(node, 0)?.clone(),
                    g: if shape.norm != 0 {
                        Some(buffer(node, 1)?.clone())
                    } else {
                        None
                    },
                    w: (0..weights)
                        .map(|i| buffer(node, 2 + i).cloned())
                        .collect::<Option<_>>()?,
                    y: (0..outputs)
                        .map(|i| buffer(node, 5 + i).cloned())
                        .collect::<Option<_>>()?,
                    shape,
                    label: node.label.to_string(),
                })
            }
            _ => None,
        }
    }

    /// Whether a kernel reading `x` (and `g`) may write the outputs: no
    /// output may overlap an input another warp is still reading.
    fn outputs_clear_of_inputs(&self) -> bool {
        self.y
            .iter()
            .all(|y| !overlap(y, &self.x) && self.g.as_ref().is_none_or(|g| !overlap(y, g)))
    }

    fn node(self, kernel: &Kernel) -> Option<Node> {
        if !self.outputs_clear_of_inputs() {
            return None;
        }
        let empty = self.x.view(0, 0).ok()?;
        let pick = |v: &[Buffer], i: usize| v.get(i).cloned().unwrap_or_else(|| empty.clone());
        let output = if self.shape.epilogue == fused::EPILOGUE_ACCUMULATE {
            Access::ReadWrite
        } else {
            Access::Write
        };
        let mut args = vec![
            NodeArg::Buffer(self.x.clone(), Access::Read),
            NodeArg::Buffer(
                self.g.clone().unwrap_or_else(|| empty.clone()),
                Access::Read,
            ),
        ];
        args.extend((0..3).map(|i| NodeArg::Buffer(pick(&self.w, i), Access::Read)));
        args.extend((0..3).map(|i| NodeArg::Buffer(pick(&self.y, i), output)));
        args.push(NodeArg::Bytes(bytemuck::bytes_of(&self.shape).to_vec()));
        Some(Node {
            kernel: kernel.clone(),
            args,
            launch: Launch::new(
                self.shape
                    .columns()
                    .div_ceil(matmul::CUDA_COLUMNS_PER_BLOCK)
                    .max(1),
                32 * matmul::CUDA_COLUMNS_PER_BLOCK,
            ),
            label: self.label.into(),
        })
    }
}

/// Rule 1: products of one input, stored separately, as one dispatch.
fn siblings(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let parts: Vec<Product> = nodes
        .iter()
        .map(|n| Product::parse(n))
        .collect::<Option<_>>()?;
    let first = parts.first()?;
    let fits = |p: &Product| {
        p.shape.weights == 1
            && p.shape.norm == 0
            && p.shape.epilogue == fused::EPILOGUE_STORE
            && same(&p.x, &first.x)
            && p.shape.rows == first.shape.rows
            && p.shape.k == first.shape.k
    };
    if parts.len() > 3 || !parts.iter().all(fits) {
        return None;
    }
    let mut shape = first.shape;
    shape.weights = parts.len() as u32;
    for (i, p) in parts.iter().enumerate() {
        shape.n[i] = p.shape.n[0];
        shape.dtype[i] = p.shape.dtype[0];
    }
    let label = parts
        .iter()
        .map(|p| p.label.as_str())
        .collect::<Vec<_>>()
        .join("+");
    Product {
        x: first.x.clone(),
        g: None,
        w: parts.iter().map(|p| p.w[0].clone()).collect(),
        y: parts.iter().map(|p| p.y[0].clone()).collect(),
        shape,
        label,
    }
    .node(kernel)
}

/// Widest product the norm is folded into. Every warp of the fused kernel
/// re-reads the activations and the norm weights, which for an output head
/// of tens of thousands of columns costs more than a separate `rms_norm`
/// (measured on an H200: 44 µs fused against 21 µs apart for SmolLM2's head).
const NORM_FOLD_MAX_COLUMNS: u32 = 8192;

/// Rule 2: `rms_norm` whose output is exactly a product's input.
fn norm_into_product(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [norm, product] = nodes else { return None };
    let s: NormShape = value(norm, 3)?;
    let mut p = Product::parse(product)?;
    let (x, g, y) = (buffer(norm, 0)?, buffer(norm, 1)?, buffer(norm, 2)?);
    if p.shape.norm != 0
        || p.shape.columns() > NORM_FOLD_MAX_COLUMNS
        || !same(y, &p.x)
        || s.rows != p.shape.rows
        || s.dim != p.shape.k
    {
        return None;
    }
    p.x = x.clone();
    p.g = Some(g.clone());
    p.shape.norm = 1;
    p.shape.eps = s.eps;
    p.label = format!("rms_norm+{}", p.label);
    p.node(kernel)
}

/// Rule 3: gate and up products, then `silu_mul` of exactly their outputs.
fn swiglu(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [product, silu] = nodes else { return None };
    let mut p = Product::parse(product)?;
    let n: u32 = value(silu, 3)?;
    let (g, u, y) = (buffer(silu, 0)?, buffer(silu, 1)?, buffer(silu, 2)?);
    let s = p.shape;
    if s.weights != 2
        || s.epilogue != fused::EPILOGUE_STORE
        || s.n[0] != s.n[1]
        || n != s.rows * s.n[0]
        || !same(g, &p.y[0])
        || !same(u, &p.y[1])
    {
        return None;
    }
    p.shape.epilogue = fused::EPILOGUE_SWIGLU;
    p.y = vec![y.clone()];
    p.label = format!("{}+silu_mul", p.label);
    p.node(kernel)
}

/// Rule 4: one product, then `add` of exactly its output into another buffer.
fn accumulate(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [product, add] = nodes else { return None };
    let mut p = Product::parse(product)?;
    let n: u32 = value(add, 2)?;
    let (y, x) = (buffer(add, 0)?, buffer(add, 1)?);
    let s = p.shape;
    if s.weights != 1
        || s.epilogue != fused::EPILOGUE_STORE
        || n != s.rows * s.n[0]
        || !same(x, &p.y[0])
    {
        return None;
    }
    p.shape.epilogue = fused::EPILOGUE_ACCUMULATE;
    p.y = vec![y.clone()];
    p.label = format!("{}+add", p.label);
    p.node(kernel)
}

/// Rule 5: `rope` of rows that `kv_store` then writes into the cache.
fn rope_then_store(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [rope, store] = nodes else { return None };
    let r: RopeShape = value(rope, 2)?;
    let kv: KvShape = value(store, 3)?;
    let (x, pos) = (buffer(rope, 0)?, buffer(rope, 1)?);
    let (src, cache, store_pos) = (buffer(store, 0)?, buffer(store, 1)?, buffer(store, 2)?);
    if !same(x, src)
        || !same(pos, store_pos)
        || r.rows != kv.rows
        || r.heads * r.head_dim != kv.kv_dim
        || !r.head_dim.is_multiple_of(2)
        || r.rope_dim > r.head_dim
        || !r.rope_dim.is_multiple_of(2)
    {
        return None;
    }
    let shape = RopeStoreShape {
        rope: r,
        max_seq: kv.max_seq,
    };
    Some(Node {
        kernel: kernel.clone(),
        args: vec![
            NodeArg::Buffer(x.clone(), Access::Read),
            NodeArg::Buffer(pos.clone(), Access::Read),
            NodeArg::Buffer(cache.clone(), Access::Write),
            NodeArg::Bytes(bytemuck::bytes_of(&shape).to_vec()),
        ],
        launch: Launch::cover(r.rows * r.heads * (r.head_dim / 2), rope::CUDA_BLOCK),
        label: format!("{}+{}", rope.label, store.label).into(),
    })
}

/// The rules, in the order the pass applies them.
pub fn patterns(fused_matmul: &Kernel, rope_store: &Kernel) -> Vec<FusionPattern> {
    let k = fused_matmul.clone();
    let mut table = vec![FusionPattern::siblings(
        "shared-input products",
        "matmul",
        3,
        move |n| siblings(n, &k),
    )];
    for product in ["fused_matmul", "matmul"] {
        let k = fused_matmul.clone();
        table.push(FusionPattern::new(
            "rms_norm into product",
            &["rms_norm", product],
            move |n| norm_into_product(n, &k),
        ));
    }
    let k = fused_matmul.clone();
    table.push(FusionPattern::new(
        "swiglu",
        &["fused_matmul", "silu_mul"],
        move |n| swiglu(n, &k),
    ));
    for product in ["fused_matmul", "matmul"] {
        let k = fused_matmul.clone();
        table.push(FusionPattern::new(
            "product into residual",
            &[product, "add"],
            move |n| accumulate(n, &k),
        ));
    }
    let k = rope_store.clone();
    table.push(FusionPattern::new(
        "rope then kv_store",
        &["rope", "kv_store"],
        move |n| rope_then_store(n, &k),
    ));
    table
}
