//! The fusion rules of the op layer: how recorded dispatches of a graph
//! become the fused kernels of [`crate::kernels::fused`] and
//! [`crate::kernels::rope`]. The graph pass ([`encore::graph::passes::fuse`])
//! finds the matches and checks that replacing them keeps every result; the
//! rules here check that the arguments line up and build the fused node.
//!
//! In table order (a later rule extends what an earlier one built):
//! 1. `matmul` siblings reading the same input: one `fused_matmul` (Q, K
//!    and V; gate and up);
//! 2. a product then `add_rows` of a bias into one of its outputs: the bias
//!    added as the product stores (Qwen2's Q, K and V, one output at a time);
//! 3. gate and up then `silu_mul`: the SwiGLU epilogue;
//! 4. a product then `add` into the residual: the accumulate epilogue;
//! 5. `rms_norm` then a product of its output: the norm folded in (after
//!    the epilogues, so that the width it is checked against is a SwiGLU
//!    product's output width, not its gate and up columns together);
//! 6. `rope` then `kv_store` of the rotated rows: `rope_store`;
//! 7. for one decode row, `rope` of the query, `rope_store` (or `kv_store`)
//!    of the new K row and `kv_store` of the new V row, each folded into the
//!    `attention` that reads them: `attention_step`;
//! 8. in a batch's graph ([`row_patterns`]), the same for the decode rows
//!    of a paged cache: `kv_store_paged` of the new K and V rows, then
//!    `rope_rows` of the query and of the new K rows, each folded into the
//!    `attention_paged` that reads them: `attention_step_paged`.
//!
//! Every rule reads the nodes it matches through their ops' argument
//! layouts (`from_node`) and builds the fused node through the fused
//! kernel's (`into_node`), so no rule knows an argument's position. The
//! fused node's launch geometry is not the rules' concern: the backend
//! computes it from the fused kernel and the node's value.

use encore::graph::passes::FusionPattern;
use encore::{Buffer, Kernel, Node};

use crate::kernels::attention::{AttnArgs, KvArgs};
use crate::kernels::attention_step::{self, AttnStepArgs, AttnStepShape};
use crate::kernels::elementwise::{AddArgs, AddRowsArgs, SiluMulArgs};
use crate::kernels::fused::{self, FusedArgs, FusedShape};
use crate::kernels::matmul::MatmulArgs;
use crate::kernels::norm::NormArgs;
use crate::kernels::paged::{AttnStepPagedArgs, AttnStepPagedShape, PagedAttnArgs};
use crate::kernels::rope::{RopeArgs, RopeShape, RopeStoreArgs, RopeStoreShape};
use crate::DType;

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
    /// Each output's bias, if any (`node` sets `shape.bias` from them).
    b: [Option<Buffer>; 3],
    shape: FusedShape,
    label: String,
}

impl Product {
    fn parse(node: &Node) -> Option<Product> {
        match node.op() {
            "matmul" | "matmul_rows" => {
                let a = MatmulArgs::from_node(node)?;
                let s = a.shape;
                Some(Product {
                    x: a.x,
                    g: None,
                    w: vec![a.w],
                    y: vec![a.y],
                    b: [None, None, None],
                    shape: FusedShape {
                        rows: s.rows,
                        k: s.k,
                        n: [s.n, 0, 0],
                        dtype: [s.dtype, 0, 0],
                        weights: 1,
                        epilogue: fused::EPILOGUE_STORE,
                        norm: 0,
                        eps: 0.0,
                        bias: 0,
                    },
                    label: node.label.to_string(),
                })
            }
            "fused_matmul" | "fused_matmul_rows" => {
                let a = FusedArgs::from_node(node)?;
                let shape = a.shape;
                let weights = (shape.weights as usize).min(3);
                let outputs = if shape.epilogue == fused::EPILOGUE_STORE {
                    weights
                } else {
                    1
                };
                let biases = a.biases();
                Some(Product {
                    g: (shape.norm != 0).then(|| a.g.clone()),
                    b: [0, 1, 2].map(|i| (shape.bias & 1 << i != 0).then(|| biases[i].clone())),
                    w: a.weights()[..weights].iter().map(|&b| b.clone()).collect(),
                    y: a.outputs()[..outputs].iter().map(|&b| b.clone()).collect(),
                    x: a.x,
                    shape,
                    label: node.label.to_string(),
                })
            }
            _ => None,
        }
    }

    /// Whether a kernel reading `x` (and `g` and the biases) may write the
    /// outputs: no output may overlap an input another warp is still reading.
    fn outputs_clear_of_inputs(&self) -> bool {
        let inputs: Vec<&Buffer> = [Some(&self.x), self.g.as_ref()]
            .into_iter()
            .chain(self.b.iter().map(Option::as_ref))
            .flatten()
            .collect();
        self.y.iter().all(|y| inputs.iter().all(|i| !overlap(y, i)))
    }

    fn node(self, kernel: &Kernel) -> Option<Node> {
        if !self.outputs_clear_of_inputs() {
            return None;
        }
        let empty = self.x.view(0, 0).ok()?;
        let pick = |v: &[Buffer], i: usize| v.get(i).cloned().unwrap_or_else(|| empty.clone());
        let mut shape = self.shape;
        shape.bias = (0..3)
            .filter(|&i| self.b[i].is_some())
            .map(|i| 1 << i)
            .sum();
        let [b0, b1, b2] = self.b.map(|b| b.unwrap_or_else(|| empty.clone()));
        let args = FusedArgs {
            g: self.g.clone().unwrap_or_else(|| empty.clone()),
            w0: pick(&self.w, 0),
            w1: pick(&self.w, 1),
            w2: pick(&self.w, 2),
            y0: pick(&self.y, 0),
            y1: pick(&self.y, 1),
            y2: pick(&self.y, 2),
            b0,
            b1,
            b2,
            x: self.x,
            shape,
        };
        Some(args.into_node(kernel, self.label))
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
            && p.shape.bias == 0
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
        b: [None, None, None],
        shape,
        label,
    }
    .node(kernel)
}

/// Widest product the norm is folded into. Every warp of the fused kernel
/// re-reads the activations and the norm weights, which for an output head
/// of tens of thousands of columns costs more than a separate `rms_norm`;
/// except in one-row products on 8-bit activations, whose blocks read them
/// once to quantize them ([`folds_at_any_width`]).
const NORM_FOLD_MAX_COLUMNS: u32 = 8192;

/// Widest product of [`folds_at_any_width`]: narrower than any vocabulary.
const NORM_FOLD_MAX_WIDE_COLUMNS: u32 = 65_536;

/// Whether a product of `shape` reads its input once a block of its kernel,
/// not once a warp, so that folding the norm in costs little at a layer's
/// widths (a feed-forward's 18,944 gate and up columns): one activation row
/// and only weights whose decode products take 8-bit activations at such
/// widths (Q4_K and Q6_K in CUDA's `quant_dots_k8.cuh`, Q4_0, Q4_1, Q5_0
/// and Q8_0 in `quant_dots_fast.cuh`; elsewhere the fold is merely one
/// dispatch fewer). An output head stays a `matmul`, whose warps take two
/// columns each where `fused_matmul`'s take one.
fn folds_at_any_width(shape: &FusedShape) -> bool {
    let eight_bit = [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
    ];
    shape.rows == 1
        && shape.columns() <= NORM_FOLD_MAX_WIDE_COLUMNS
        && shape.dtype[..(shape.weights as usize).min(3)]
            .iter()
            .all(|&t| eight_bit.iter().any(|d| d.ggml_id() == t))
}

/// Rule 5: `rms_norm` whose output is exactly a product's input.
fn norm_into_product(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [norm, product] = nodes else { return None };
    let n = NormArgs::from_node(norm)?;
    let s = n.shape;
    let mut p = Product::parse(product)?;
    if p.shape.norm != 0
        || (p.shape.columns() > NORM_FOLD_MAX_COLUMNS && !folds_at_any_width(&p.shape))
        || !same(&n.y, &p.x)
        || s.rows != p.shape.rows
        || s.dim != p.shape.k
    {
        return None;
    }
    p.x = n.x;
    p.g = Some(n.w);
    p.shape.norm = 1;
    p.shape.eps = s.eps;
    p.label = format!("rms_norm+{}", p.label);
    p.node(kernel)
}

/// Rule 2: `add_rows` of a bias into exactly one of a storing product's
/// outputs, every row of it.
fn bias_into_product(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [product, add] = nodes else { return None };
    let mut p = Product::parse(product)?;
    let add = AddRowsArgs::from_node(add)?;
    let [rows, n] = add.shape;
    if p.shape.epilogue != fused::EPILOGUE_STORE || rows != p.shape.rows {
        return None;
    }
    let i = p.y.iter().position(|y| same(y, &add.y))?;
    if p.b[i].is_some() || p.shape.n[i] != n {
        return None;
    }
    p.b[i] = Some(add.b);
    p.label = format!("{}+bias", p.label);
    p.node(kernel)
}

/// Rule 3: gate and up products, then `silu_mul` of exactly their outputs.
fn swiglu(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [product, silu] = nodes else { return None };
    let mut p = Product::parse(product)?;
    let silu = SiluMulArgs::from_node(silu)?;
    let s = p.shape;
    if s.weights != 2
        || s.bias != 0
        || s.epilogue != fused::EPILOGUE_STORE
        || s.n[0] != s.n[1]
        || silu.n != s.rows * s.n[0]
        || !same(&silu.g, &p.y[0])
        || !same(&silu.u, &p.y[1])
    {
        return None;
    }
    p.shape.epilogue = fused::EPILOGUE_SWIGLU;
    p.y = vec![silu.y];
    p.label = format!("{}+silu_mul", p.label);
    p.node(kernel)
}

/// Rule 4: one product, then `add` of exactly its output into another buffer.
fn accumulate(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [product, add] = nodes else { return None };
    let mut p = Product::parse(product)?;
    let add = AddArgs::from_node(add)?;
    let s = p.shape;
    if s.weights != 1
        || s.bias != 0
        || s.epilogue != fused::EPILOGUE_STORE
        || add.n != s.rows * s.n[0]
        || !same(&add.x, &p.y[0])
    {
        return None;
    }
    p.shape.epilogue = fused::EPILOGUE_ACCUMULATE;
    p.y = vec![add.y];
    p.label = format!("{}+add", p.label);
    p.node(kernel)
}

/// Rule 6: `rope` of rows that `kv_store` then writes into the cache.
fn rope_then_store(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [rope, store] = nodes else { return None };
    let (r_args, kv_args) = (RopeArgs::from_node(rope)?, KvArgs::from_node(store)?);
    let (r, kv) = (r_args.shape, kv_args.shape);
    if r.factors != 0
        || !same(&r_args.x, &kv_args.src)
        || !same(&r_args.pos, &kv_args.pos)
        || r.rows != kv.rows
        || r.heads * r.head_dim != kv.kv_dim
        || !r.head_dim.is_multiple_of(2)
        || r.rope_dim > r.head_dim
        || !r.rope_dim.is_multiple_of(2)
    {
        return None;
    }
    let args = RopeStoreArgs {
        x: r_args.x,
        pos: r_args.pos,
        cache: kv_args.cache,
        shape: RopeStoreShape {
            rope: r,
            max_seq: kv.max_seq,
        },
    };
    Some(args.into_node(kernel, format!("{}+{}", rope.label, store.label)))
}

/// Whether an attention step of `head_dim` whose folded rotation is `mine`
/// (per `flags`) can take rotation `r` too: an even rotation within the
/// head, without frequency factors, the same as any folded in already.
fn rope_fits(mine: &RopeShape, flags: u32, r: &RopeShape, head_dim: u32) -> bool {
    let folded = flags & (attention_step::STEP_ROPE_Q | attention_step::STEP_ROPE_K);
    r.factors == 0
        && r.head_dim == head_dim
        && r.head_dim.is_multiple_of(2)
        && r.rope_dim <= r.head_dim
        && r.rope_dim.is_multiple_of(2)
        && (folded == 0
            || (mine.rope_dim == r.rope_dim
                && mine.base.to_bits() == r.base.to_bits()
                && mine.theta_scale.to_bits() == r.theta_scale.to_bits()
                && mine.neox == r.neox))
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
                let a = AttnArgs::from_node(node)?;
                if a.shape.rows != 1 {
                    return None;
                }
                Some(Attend {
                    q: a.q,
                    k_new: None,
                    v_new: None,
                    k: a.k,
                    v: a.v,
                    pos: a.pos,
                    out: a.out,
                    shape: AttnStepShape {
                        attn: a.shape,
                        rope: bytemuck::Zeroable::zeroed(),
                        flags: 0,
                    },
                    label,
                })
            }
            "attention_step" => {
                let a = AttnStepArgs::from_node(node)?;
                let has = |bit: u32| a.shape.flags & bit != 0;
                Some(Attend {
                    k_new: has(attention_step::STEP_K_NEW).then(|| a.k_new.clone()),
                    v_new: has(attention_step::STEP_V_NEW).then(|| a.v_new.clone()),
                    q: a.q,
                    k: a.k,
                    v: a.v,
                    pos: a.pos,
                    out: a.out,
                    shape: a.shape,
                    label,
                })
            }
            _ => None,
        }
    }

    /// Whether `r` rotates as the rotation already folded in (if any) does,
    /// and is one the kernel can apply (even sizes, within the head).
    fn takes_rope(&self, r: &RopeShape) -> bool {
        r.rows == 1
            && rope_fits(
                &self.shape.rope,
                self.shape.flags,
                r,
                self.shape.attn.head_dim,
            )
    }

    fn node(self, kernel: &Kernel) -> Option<Node> {
        let empty = self.q.view(0, 0).ok()?;
        let args = AttnStepArgs {
            q: self.q,
            k_new: self.k_new.unwrap_or_else(|| empty.clone()),
            v_new: self.v_new.unwrap_or(empty),
            k: self.k,
            v: self.v,
            pos: self.pos,
            out: self.out,
            shape: self.shape,
        };
        Some(args.into_node(kernel, self.label))
    }
}

/// Rule 7a: `rope` of exactly the query a one-row attention reads.
fn rope_into_attention(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [rope, attn] = nodes else { return None };
    let rope_args = RopeArgs::from_node(rope)?;
    let r = rope_args.shape;
    let mut a = Attend::parse(attn)?;
    if a.shape.flags & attention_step::STEP_ROPE_Q != 0
        || !same(&rope_args.x, &a.q)
        || !same(&rope_args.pos, &a.pos)
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

/// Rule 7b: `rope_store` of the new K row into the cache the attention reads.
fn rope_store_into_attention(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [store, attn] = nodes else { return None };
    let store_args = RopeStoreArgs::from_node(store)?;
    let rs = store_args.shape;
    let mut a = Attend::parse(attn)?;
    if a.shape.flags & attention_step::STEP_K_NEW != 0
        || !same(&store_args.cache, &a.k)
        || !same(&store_args.pos, &a.pos)
        || rs.max_seq != a.shape.attn.max_seq
        || rs.rope.heads != a.shape.attn.kv_heads
        || !a.takes_rope(&rs.rope)
    {
        return None;
    }
    a.shape.rope = rs.rope;
    a.shape.flags |= attention_step::STEP_K_NEW | attention_step::STEP_ROPE_K;
    a.k_new = Some(store_args.x);
    a.label = format!("{}+{}", store.label, a.label);
    a.node(kernel)
}

/// Rule 7c: `kv_store` of the new V (or unrotated K) row into a cache the
/// attention reads.
fn store_into_attention(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [store, attn] = nodes else { return None };
    let store_args = KvArgs::from_node(store)?;
    let kv = store_args.shape;
    let (src, cache, pos) = (&store_args.src, &store_args.cache, &store_args.pos);
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

/// Rules 1 to 5 over products of op `plain`, fused into `kernel` (whose
/// op the later rules extend).
fn product_rules(table: &mut Vec<FusionPattern>, kernel: &Kernel, plain: &str) {
    let fused = kernel.op_kind().to_string();
    let k = kernel.clone();
    table.push(FusionPattern::siblings(
        "shared-input products",
        plain,
        3,
        move |n| siblings(n, &k),
    ));
    for product in [fused.as_str(), plain] {
        let k = kernel.clone();
        table.push(FusionPattern::new(
            "bias into product",
            &[product, "add_rows"],
            move |n| bias_into_product(n, &k),
        ));
    }
    let k = kernel.clone();
    table.push(FusionPattern::new(
        "swiglu",
        &[fused.as_str(), "silu_mul"],
        move |n| swiglu(n, &k),
    ));
    for product in [fused.as_str(), plain] {
        let k = kernel.clone();
        table.push(FusionPattern::new(
            "product into residual",
            &[product, "add"],
            move |n| accumulate(n, &k),
        ));
    }
    for product in [fused.as_str(), plain] {
        let k = kernel.clone();
        table.push(FusionPattern::new(
            "rms_norm into product",
            &["rms_norm", product],
            move |n| norm_into_product(n, &k),
        ));
    }
}

/// A paged attention (`attention_paged`, or an `attention_step_paged` with
/// some parts folded in) taken apart.
struct PagedAttend {
    args: AttnStepPagedArgs,
    label: String,
}

impl PagedAttend {
    fn parse(node: &Node) -> Option<PagedAttend> {
        let label = node.label.to_string();
        match node.op() {
            "attention_paged" => {
                let a = PagedAttnArgs::from_node(node)?;
                let empty = a.q.view(0, 0).ok()?;
                Some(PagedAttend {
                    args: AttnStepPagedArgs {
                        k_new: empty.clone(),
                        v_new: empty,
                        slots: a.positions.clone(),
                        q: a.q,
                        k: a.k,
                        v: a.v,
                        positions: a.positions,
                        tables: a.tables,
                        out: a.out,
                        shape: AttnStepPagedShape::unfused(a.shape),
                    },
                    label,
                })
            }
            "attention_step_paged" => Some(PagedAttend {
                args: AttnStepPagedArgs::from_node(node)?,
                label,
            }),
            _ => None,
        }
    }

    /// Whether `args.slots` is bound: a store is folded in.
    fn has_slots(&self) -> bool {
        let stores = attention_step::STEP_K_NEW | attention_step::STEP_V_NEW;
        self.args.shape.flags & stores != 0
    }

    fn node(self, kernel: &Kernel) -> Node {
        self.args.into_node(kernel, self.label)
    }
}

/// Rule 8a: `kv_store_paged` of the new K or V rows into a paged cache the
/// attention reads, at the slots of any store folded in before.
fn paged_store_into_attention(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [store, attn] = nodes else { return None };
    let st = KvArgs::from_node(store)?;
    let mut a = PagedAttend::parse(attn)?;
    let s = a.args.shape.attn;
    if s.decode == 0
        || st.shape.rows != s.rows
        || st.shape.kv_dim != s.kv_heads * s.head_dim
        || st.shape.max_seq as u64 != s.blocks as u64 * s.block_size as u64
        || !s.head_dim.is_multiple_of(2)
        || (a.has_slots() && !same(&st.pos, &a.args.slots))
    {
        return None;
    }
    let flags = a.args.shape.flags;
    if same(&st.cache, &a.args.v) && flags & attention_step::STEP_V_NEW == 0 {
        a.args.shape.flags |= attention_step::STEP_V_NEW;
        a.args.v_new = st.src;
    } else if same(&st.cache, &a.args.k) && flags & attention_step::STEP_K_NEW == 0 {
        a.args.shape.flags |= attention_step::STEP_K_NEW;
        a.args.k_new = st.src;
    } else {
        return None;
    }
    a.args.slots = st.pos;
    a.label = format!("{}+{}", store.label, a.label);
    Some(a.node(kernel))
}

/// Rule 8b: `rope_rows` of the query, or of the new K rows whose store is
/// folded in already, at the attention's positions.
fn paged_rope_into_attention(nodes: &[&Node], kernel: &Kernel) -> Option<Node> {
    let [rope, attn] = nodes else { return None };
    let r = RopeArgs::from_node(rope)?;
    let mut a = PagedAttend::parse(attn)?;
    let (s, flags) = (a.args.shape.attn, a.args.shape.flags);
    if r.shape.rows != s.rows
        || !same(&r.pos, &a.args.positions)
        || !rope_fits(&a.args.shape.rope, flags, &r.shape, s.head_dim)
    {
        return None;
    }
    let is_q = same(&r.x, &a.args.q) && r.shape.heads == s.heads;
    let is_k = same(&r.x, &a.args.k_new) && r.shape.heads == s.kv_heads;
    if is_q && flags & attention_step::STEP_ROPE_Q == 0 {
        a.args.shape.flags |= attention_step::STEP_ROPE_Q;
    } else if is_k
        && flags & attention_step::STEP_K_NEW != 0
        && flags & attention_step::STEP_ROPE_K == 0
    {
        a.args.shape.flags |= attention_step::STEP_ROPE_K;
    } else {
        return None;
    }
    // Its row and head counts are not the kernel's (they come from the
    // attention): zero, so that every batch size shares one variant.
    a.args.shape.rope = RopeShape {
        rows: 0,
        heads: 0,
        ..r.shape
    };
    a.label = format!("{}+{}", rope.label, a.label);
    Some(a.node(kernel))
}

/// The rules for graphs of a batch of independent sequences, for the fused
/// kernels given (a rule whose kernel is `None` is left out): rules 1 to 5
/// over `matmul_rows`, fused into `fused_matmul_rows`, whose rows keep
/// their one-row arithmetic; then rule 8, the paged stores and then the
/// RoPE of each decode row folded into `attention_step_paged`, one part at
/// a time (the stores first: the new K rows' rotation folds in only once
/// their store has, as the rotation's next reader is then the attention).
pub fn row_patterns(
    fused_matmul_rows: Option<&Kernel>,
    attention_step_paged: Option<&Kernel>,
) -> Vec<FusionPattern> {
    let mut table = Vec::new();
    if let Some(kernel) = fused_matmul_rows {
        product_rules(&mut table, kernel, "matmul_rows");
    }
    let Some(step) = attention_step_paged else {
        return table;
    };
    type Rule = fn(&[&Node], &Kernel) -> Option<Node>;
    let into_attention: [(&str, &str, Rule); 2] = [
        (
            "kv_store_paged into attention",
            "kv_store_paged",
            paged_store_into_attention,
        ),
        (
            "rope_rows into attention",
            "rope_rows",
            paged_rope_into_attention,
        ),
    ];
    for (name, op, rule) in into_attention {
        for attention in ["attention_paged", "attention_step_paged"] {
            let k = step.clone();
            table.push(FusionPattern::new(name, &[op, attention], move |n| {
                rule(n, &k)
            }));
        }
    }
    table
}

/// The rules, in the order the pass applies them, for the fused kernels
/// given: a rule whose fused kernel is `None` (the device has no
/// implementation of it, or the kernel set leaves it out, as the exact set
/// leaves out `attention_step`, whose split softmax is not the CPU's
/// recurrence) is not in the table.
pub fn patterns(
    fused_matmul: Option<&Kernel>,
    rope_store: Option<&Kernel>,
    attention_step: Option<&Kernel>,
) -> Vec<FusionPattern> {
    let mut table = Vec::new();
    if let Some(fused_matmul) = fused_matmul {
        product_rules(&mut table, fused_matmul, "matmul");
    }
    if let Some(rope_store) = rope_store {
        let k = rope_store.clone();
        table.push(FusionPattern::new(
            "rope then kv_store",
            &["rope", "kv_store"],
            move |n| rope_then_store(n, &k),
        ));
    }
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
