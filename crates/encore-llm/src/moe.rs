//! A mixture of experts' feed-forward, routed on the host: the first,
//! simple version, correct on every backend and not yet fast.
//!
//! ```text
//! xn ─ router (matmul) ─▶ host: softmax over all experts, top `used`,
//!                              weights renormalized to sum 1 (when the model says so)
//! for each row, for each chosen expert e with weight w:
//!   x_row += w · down_e( silu(gate_e(xn_row)) · up_e(xn_row) )
//! ```
//!
//! The router's logits are computed on the device with the existing
//! product, then the encoder submits and waits and the host reads them: a
//! layer's choices are made between two submissions. Each chosen expert
//! then runs the existing products on a view of its rows of the stacked
//! expert tensors (`ffn_{gate,up,down}_exps`, one expert's rows contiguous),
//! one row at a time, with the existing elementwise ops. The round trip
//! means a mixture-of-experts forward pass cannot be recorded as a graph
//! ([`Model::can_record_graphs`]): sessions and batches of these models
//! run eagerly.

use encore::{Buffer, Encoder};
use encore_ops::Weight;

use crate::error::{LlmError, Result};
use crate::model::{Activations, Block, Model};

/// A product of `rows` rows of `x` with a weight into `y`, as the pass's
/// placement runs it.
pub(crate) type Product<'a> =
    dyn Fn(&mut Encoder, &Weight, &Buffer, &Buffer, usize, &'static str) -> encore::Result<()> + 'a;

/// The experts one position runs and their weights, from the router's
/// `logits` (one per expert): the softmax over all experts, the `used`
/// most probable (the lower index first among equals), their
/// probabilities divided by their sum when `normalize`. Ordered by
/// probability, highest first.
pub fn route(logits: &[f32], used: usize, normalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
    let mut chosen: Vec<(usize, f32)> = order
        .into_iter()
        .take(used)
        .map(|e| (e, exp[e] / sum))
        .collect();
    if normalize {
        let total: f32 = chosen.iter().map(|&(_, p)| p).sum();
        chosen.iter_mut().for_each(|(_, p)| *p /= total);
    }
    chosen
}

/// Expert `e` of `count` stacked in `w`: a view of its rows.
pub fn expert(w: &Weight, e: usize, count: usize) -> Result<Weight> {
    let n = w.n / count;
    let bytes = w.dtype.bytes_for(n * w.k).ok_or_else(|| {
        LlmError::Model(format!(
            "an expert's rows of {} {:?} weights are not whole blocks",
            w.k, w.dtype
        ))
    })?;
    Ok(Weight {
        buffer: w.buffer.view(e * bytes, bytes)?,
        dtype: w.dtype,
        n,
        k: w.k,
    })
}

impl Model {
    /// Encodes the routed feed-forward of block `b` over the normed rows in
    /// `a.xn`, adding each row's weighted expert outputs to `a.x`. Submits
    /// what `enc` holds and waits, to read the router's logits; a capturing
    /// encoder is refused.
    pub(crate) fn encode_experts(
        &self,
        enc: &mut Encoder,
        a: &Activations,
        b: &Block,
        router: &Weight,
        product: &Product<'_>,
    ) -> Result<()> {
        let c = &self.config;
        let (Some(experts), Some(logits)) = (c.experts, &a.router) else {
            return Err(LlmError::Model(
                "a block with a router in a model without experts".into(),
            ));
        };
        if enc.is_capturing() {
            return Err(LlmError::Model(
                "a mixture-of-experts layer routes on the host and cannot be recorded as a graph"
                    .into(),
            ));
        }
        let ops = &self.ops;
        let (rows, d, ff, count) = (a.rows, c.n_embd, experts.ff, experts.count);
        product(enc, router, &a.xn, logits, rows, "ffn_gate_inp")?;
        enc.commit_and_wait()?;
        let all = logits.view(0, rows * count * 4)?.download::<f32>()?;
        let (gate, up) = (a.gate.view(0, ff * 4)?, a.up.view(0, ff * 4)?);
        let out = &a.ffn.view(0, ff * 4)?;
        for (r, row_logits) in all.chunks_exact(count).enumerate() {
            let xn = a.xn.view(r * d * 4, d * 4)?;
            let x = a.x.view(r * d * 4, d * 4)?;
            // The attention's output was added; the row's `proj` is free.
            let sum = a.proj.view(r * d * 4, d * 4)?;
            for (e, weight) in route(row_logits, experts.used, experts.norm_weights) {
                product(
                    enc,
                    &expert(&b.gate, e, count)?,
                    &xn,
                    &gate,
                    1,
                    "ffn_gate_exps",
                )?;
                product(enc, &expert(&b.up, e, count)?, &xn, &up, 1, "ffn_up_exps")?;
                ops.silu_mul(enc, &gate, &up, out, ff)?;
                ops.scale(enc, out, weight, ff)?;
                product(
                    enc,
                    &expert(&b.down, e, count)?,
                    out,
                    &sum,
                    1,
                    "ffn_down_exps",
                )?;
                ops.add(enc, &x, &sum, d)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn the_router_takes_the_most_probable_and_renormalizes_them() {
        let logits = [0.0f32, 2.0, 1.0, 2.0, -1.0];
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        let raw = route(&logits, 3, false);
        let picked: Vec<usize> = raw.iter().map(|&(e, _)| e).collect();
        assert_eq!(picked, [1, 3, 2]);
        assert!((raw[0].1 - 2f32.exp() / z).abs() < 1e-6);
        assert!((raw[2].1 - 1f32.exp() / z).abs() < 1e-6);
        let normed = route(&logits, 3, true);
        let total: f32 = normed.iter().map(|&(_, w)| w).sum();
        assert!((total - 1.0).abs() < 1e-6);
        let e2 = 2f32.exp();
        assert!((normed[0].1 - e2 / (2.0 * e2 + 1f32.exp())).abs() < 1e-6);
    }
}
