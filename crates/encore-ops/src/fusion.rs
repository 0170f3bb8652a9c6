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
//! 5. `rope` then `kv_store` of the rotated rows: `rope_store`;
//! 6. for one decode row, `rope` of the query, `rope_store` (or `kv_store`)
//!    of the new K row and `kv_store` of the new V row, each folded into the
//!    `attention` that reads them: `attention_step`.

use encore::graph::passes::FusionPattern;
use encore::{Access, Buffer, Kernel, Launch, Node, NodeArg};

use crate::kernels::attention::{AttnShape, KvShape};
use crate::kernels::attention_step::{self, AttnStepShape};
use crate::kernels::fused::{self, FusedShape};
use crate::kernels::rope::{self, RopeShape, RopeStoreShape};
use crate::kernels::{matmul, norm::NormShape};

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
            launch: matmul::cuda_launch(self.shape.warps()),
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
/// (measured on an H200: 44 µs fused against 21 µs apart for SmolLM2's head;
/// with one memory round trip a warp, on an H100: decode 390.2 against 380.8
/// µs a step).
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

/// An `attention` of one query row (or an `attention_step`) taken apart.
struct Attend {
    q: Buffer,
    k_new: Option<Buffer>,
    v_new: Option<Buffer>,
    k: Buffer,
    v: Buffer,
    pos: Buffer,
    out: Buffer,
    shape: AttnStepShape,
    label: String,
}

impl Attend {
    fn parse(node: &Node) -> Option<Attend> {
        let label = node.label.to_string();
        match node.op() {
            "attention" => {
                let attn: AttnShape = value(node, 5)?;
                if attn.rows != 1 {
                    return None;
                }
                Some(Attend {
                    q: buffer(node, 0)?.clone(),
                    k_new: None,
                    v_new: None,
                    k: buffer(node, 1)?.clone(),
                    v: buffer(node, 2)?.clone(),
                    pos: buffer(node, 3)?.clone(),
                    out: buffer(node, 4)?.clone(),
                    shape: AttnStepShape {
                        attn,
                        rope: bytemuck::Zeroable::zeroed(),
                        flags: 0,
                    },
                    label,
                })
            }
            "attention_step" => {
                let shape: AttnStepShape = value(node, 7)?;
                let has = |bit: u32| shape.flags & bit != 0;
                Some(Attend {
                    q: buffer(node, 0)?.clone(),
                    k_new: has(attention_step::STEP_K_NEW)
                        .then(|| buffer(node, 1).cloned())
                        .flatten(),
                    v_new: has(attention_step::STEP_V_NEW)
                        .then(|| buffer(node, 2).cloned())
                        .flatten(),
                    k: buffer(node, 3)?.clone(),
                    v: buffer(node, 4)?.clone(),
                    pos: buffer(node, 5)?.clone(),
                    out: buffer(node, 6)?.clone(),
                    shape,
                    label,
                })
            }
            _ => None,
        }
    }

    /// Whether `r` rotates as the rotation already folded in (if any) does,
    /// and is one the kernel can apply (even sizes, within the head).
    fn takes_rope(&self, r: &RopeShape) -> bool {
        let mine = &self.shape.rope;
        let folded = self.shape.flags & (attention_step::STEP_ROPE_Q | attention_step::STEP_ROPE_K);
        r.rows == 1
            && r.head_dim == self.shape.attn.head_dim
            && r.head_dim.is_multiple_of(2)
            && r.rope_dim <= r.head_dim
            && r.rope_dim.is_multiple_of(2)
            && (folded == 0
                || (mine.rope_dim == r.rope_dim
                    && mine.base.to_bits() == r.base.to_bits()
                    && mine.theta_scale.to_bits() == r.theta_scale.to_bits()
                    && mine.neox == r.neox))
    }

    fn node(self, kernel: &Kernel) -> Option<Node> {
        let empty = self.q.view(0, 0).ok()?;
        let flags = self.shape.flags;
        let cache = |bit: u32| {
            if flags & bit != 0 {
                Access::ReadWrite
            } else {
                Access::Read
            }
        };
        Some(Node {
            kernel: kernel.clone(),
            args: vec![
                NodeArg::Buffer(self.q, Access::Read),
                NodeArg::Buffer(self.k_new.unwrap_or_else(|| empty.clone()), Access::Read),
                NodeArg::Buffer(self.v_new.unwrap_or(empty), Access::Read),
                NodeArg::Buffer(self.k, cache(attention_step::STEP_K_NEW)),
                NodeArg::Buffer(self.v, cache(attention_step::STEP_V_NEW)),
                NodeArg::Buffer(self.pos, Access::Read),
                NodeArg::Buffer(self.out, Access::Write),
                NodeArg::Bytes(bytemuck::bytes_of(&self.shape).to_vec()),
            ],
            launch: Launch::grid3(
                [self.shape.attn.heads.max(1), attention_step::CUDA_SPLITS, 1],
                [attention_step::CUDA_THREADS, 1, 1],
            ),
            label: self.label.into(),
        })
    }
}

/// Rule 6a: `rope` of exactly the query a one-row attention reads.
fn rope_into_attention(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [rope, attn] = nodes else { return None };
    let r: RopeShape = value(rope, 2)?;
    let (x, pos) = (buffer(rope, 0)?, buffer(rope, 1)?);
    let mut a = Attend::parse(attn)?;
    if a.shape.flags & attention_step::STEP_ROPE_Q != 0
        || !same(x, &a.q)
        || !same(pos, &a.pos)
        || r.heads != a.shape.attn.heads
        || !a.takes_rope(&r)
    {
        return None;
    }
    a.shape.rope = r;
    a.shape.flags |= attention_step::STEP_ROPE_Q;
    a.label = format!("{}+{}", rope.label, a.label);
    a.node(kernel)
}

/// Rule 6b: `rope_store` of the new K row into the cache the attention reads.
fn rope_store_into_attention(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [store, attn] = nodes else { return None };
    let rs: RopeStoreShape = value(store, 3)?;
    let (x, pos, cache) = (buffer(store, 0)?, buffer(store, 1)?, buffer(store, 2)?);
    let mut a = Attend::parse(attn)?;
    if a.shape.flags & attention_step::STEP_K_NEW != 0
        || !same(cache, &a.k)
        || !same(pos, &a.pos)
        || rs.max_seq != a.shape.attn.max_seq
        || rs.rope.heads != a.shape.attn.kv_heads
        || !a.takes_rope(&rs.rope)
    {
        return None;
    }
    a.shape.rope = rs.rope;
    a.shape.flags |= attention_step::STEP_K_NEW | attention_step::STEP_ROPE_K;
    a.k_new = Some(x.clone());
    a.label = format!("{}+{}", store.label, a.label);
    a.node(kernel)
}

/// Rule 6c: `kv_store` of the new V (or unrotated K) row into a cache the
/// attention reads.
fn store_into_attention(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [store, attn] = nodes else { return None };
    let kv: KvShape = value(store, 3)?;
    let (src, cache, pos) = (buffer(store, 0)?, buffer(store, 1)?, buffer(store, 2)?);
    let mut a = Attend::parse(attn)?;
    let s = a.shape.attn;
    if kv.rows != 1
        || kv.kv_dim != s.kv_heads * s.head_dim
        || kv.max_seq != s.max_seq
        || !s.head_dim.is_multiple_of(2)
        || !same(pos, &a.pos)
    {
        return None;
    }
    let flags = a.shape.flags;
    if same(cache, &a.v) && flags & attention_step::STEP_V_NEW == 0 {
        a.shape.flags |= attention_step::STEP_V_NEW;
        a.v_new = Some(src.clone());
    } else if same(cache, &a.k) && flags & attention_step::STEP_K_NEW == 0 {
        a.shape.flags |= attention_step::STEP_K_NEW;
        a.k_new = Some(src.clone());
    } else {
        return None;
    }
    a.label = format!("{}+{}", store.label, a.label);
    a.node(kernel)
}

/// The rules, in the order the pass applies them; the rules that fold into
/// `attention_step` only when it is given (the exact kernels leave it out:
/// its split softmax is not the CPU's recurrence).
pub fn patterns(
    fused_matmul: &Kernel,
    rope_store: &Kernel,
    attention_step: Option<&Kernel>,
) -> Vec<FusionPattern> {
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
    let Some(attention_step) = attention_step else {
        return table;
    };
    type Rule = fn(&[&Node], &Kernel) -> Option<Node>;
    let into_attention: [(&str, &str, Rule); 3] = [
        ("rope into attention", "rope", rope_into_attention),
        (
            "rope_store into attention",
            "rope_store",
            rope_store_into_attention,
        ),
        ("kv_store into attention", "kv_store", store_into_attention),
    ];
    for (name, op, rule) in into_attention {
        for attention in ["attention", "attention_step"] {
            let k = attention_step.clone();
            table.push(FusionPattern::new(name, &[op, attention], move |n| {
                rule(n, &k)
            }));
        }
    }
    table
}
