//! [`BatchRunner`]: forward passes over rows of many sequences at once,
//! with their K and V in one paged cache.
//!
//! A step is a list of rows, each a token at a position of some sequence
//! (with that sequence's block table and the slot its K and V go to), and
//! the rows whose results are wanted. Decode rows (positions past a
//! sequence's prompt) replay a graph recorded once per batch-size bucket:
//! the rows are padded to the next bucket with rows that write to the pad
//! block and whose logits nobody reads. The per-row inputs live in one
//! device buffer that the host writes before each replay, so one recorded
//! graph serves every step of its bucket. Prompt rows (chunked prefill) run
//! in an eager pass of their own: their counts vary.
//!
//! Every op computes each row independently of the others
//! ([`crate::model::Placement::Paged`]), and a row of either kind always
//! runs the same kernels (decode graphs are fused with the row-invariant
//! fused kernels, prompt passes are not fused), so a sequence's results do
//! not depend on the batch it ran in.
//!
//! Several decode rows of one sequence (a draft that speculative decoding
//! verifies) run in one decode graph as groups of one row a sequence, laid
//! out one group after the other, each group padded to the bucket: the
//! products take every row at once and the attention runs group by group,
//! so that each row gets a lone decode row's arithmetic.
//!
//! Greedy rows take their argmax on the device and bring back one index
//! each; only rows that sample bring back their logits.

use std::collections::HashMap;
use std::sync::Arc;

use encore::{Buffer, Encoder, GraphCache, GraphExec};
use encore_ops::{DType, Weight};

use crate::blocks::PAD_BLOCK;
use crate::error::{LlmError, Pass, Result};
use crate::model::{Activations, LayerCache, Model, PagedRows, Placement};

/// One row of a step: `token` at `position` of a sequence whose block
/// table is `table` (covering `position`).
#[derive(Clone, Debug)]
pub struct Row<'a> {
    pub token: u32,
    pub position: usize,
    pub table: &'a [u32],
    /// A position past the prompt (a generated token): run by the decode
    /// graphs. Prompt rows run eagerly.
    pub decode: bool,
    /// A decode row's place among its sequence's decode rows in the step:
    /// 0 for the first, 1, 2, ... for the drafted tokens that speculative
    /// decoding verifies with it ([`crate::speculate`]), each at the
    /// position after the one before. Rows of one place form a group that
    /// holds one row a sequence; the groups run their attention one after
    /// the other ([`PagedRows::groups`]). 0 for prompt rows.
    pub group: usize,
}

/// The block table of padding rows.
const PAD_TABLE: [u32; 1] = [PAD_BLOCK];

/// An output row of a step: the row, and whether only its argmax is
/// wanted (a greedy sampler) rather than its logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Output {
    pub row: usize,
    pub greedy: bool,
}

/// What a step gives for an [`Output`]: the argmax, taken on the device,
/// for a greedy one; else the logits; or, where they hold a NaN or an
/// infinity, where that was ([`LlmError::NonFinite`]): a failure of that
/// row's sequence, not of the step or the device.
#[derive(Clone, Debug, PartialEq)]
pub enum RowResult {
    Token(u32),
    Logits(Vec<f32>),
    NonFinite { pass: Pass, position: usize },
}

/// Batch sizes a decode graph is recorded for; more decode rows than the
/// largest replay its graph once for each part of that size.
pub const BUCKETS: [usize; 8] = [1, 2, 4, 8, 16, 32, 48, 64];

/// The device buffers of one row count: activations, the per-row inputs,
/// the gathered rows and their logits.
struct StepBuffers {
    rows: usize,
    /// Groups of `rows / groups` rows ([`PagedRows::groups`]).
    groups: usize,
    acts: Activations,
    /// `u32`s: tokens, positions, slots and output rows (`rows` each), then
    /// the tables (`rows * max_blocks`).
    inputs: Buffer,
    gathered: Buffer,
    normed: Buffer,
    logits: Buffer,
    /// The argmax of each output row ([`encore_ops::Ops::argmax_rows`]).
    ids: Buffer,
}

/// Runs steps of many sequences over one paged KV cache.
pub struct BatchRunner {
    model: Arc<Model>,
    cache: Vec<LayerCache>,
    block_size: usize,
    blocks: usize,
    max_blocks: usize,
    graphs: Option<GraphCache>,
    /// Decode buffers and graph by bucket and groups.
    decode: HashMap<(usize, usize), (StepBuffers, Option<GraphExec>)>,
}

impl BatchRunner {
    /// A runner with a pool of `blocks` blocks of `block_size` positions
    /// per layer, sequences of at most `max_blocks` blocks, replaying decode
    /// graphs when `graphs` and the model's pass can be recorded
    /// ([`Model::can_record_graphs`]).
    pub fn new(
        model: Arc<Model>,
        blocks: usize,
        block_size: usize,
        max_blocks: usize,
        graphs: bool,
    ) -> Result<BatchRunner> {
        if blocks < 2 || block_size == 0 || max_blocks == 0 {
            return Err(LlmError::Request(format!(
                "a paged cache needs at least 2 blocks of at least 1 position (got {blocks} of {block_size})"
            )));
        }
        let cache = model.new_cache(blocks * block_size)?;
        // Fusion into the row-invariant fused kernels only: decode rows
        // always run fused (in a graph), prompt rows never.
        let patterns = model.ops.row_fusion_patterns();
        let graphs = graphs && model.can_record_graphs();
        Ok(BatchRunner {
            model,
            cache,
            block_size,
            blocks,
            max_blocks,
            graphs: graphs.then(|| GraphCache::new(patterns)),
            decode: HashMap::new(),
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Bytes of the KV cache on the device.
    pub fn cache_bytes(&self) -> usize {
        self.cache.iter().map(|l| l.k.len() + l.v.len()).sum()
    }

    fn buffers(&self, rows: usize, groups: usize) -> Result<StepBuffers> {
        let c = &self.model.config;
        let dev = &self.model.device;
        Ok(StepBuffers {
            rows,
            groups,
            acts: Activations::new(&self.model, rows)?,
            inputs: dev.alloc((4 * rows + rows * self.max_blocks) * 4)?,
            gathered: dev.alloc(rows * c.n_embd * 4)?,
            normed: dev.alloc(rows * c.n_embd * 4)?,
            logits: dev.alloc(rows * c.vocab * 4)?,
            ids: self.model.ops.argmax_rows_buffer(rows)?,
        })
    }

    /// Encodes the pass of `b.rows` rows whose inputs are in `b.inputs`,
    /// with the logits of `outputs` rows (the first `outputs` entries of
    /// the output-row list) left in `b.logits`, and with `argmax` their
    /// argmax in `b.ids`; `prompt` for a pass of prompt rows.
    fn encode(
        &self,
        enc: &mut Encoder,
        b: &StepBuffers,
        outputs: usize,
        argmax: bool,
        prompt: bool,
    ) -> Result<()> {
        let (r, d) = (b.rows, self.model.config.n_embd);
        let part = |i: usize, n: usize| b.inputs.view(i * r * 4, n * 4);
        let tokens = part(0, r)?;
        let rows = PagedRows {
            prompt,
            positions: &part(1, r)?,
            slots: &part(2, r)?,
            tables: &b.inputs.view(4 * r * 4, r * self.max_blocks * 4)?,
            cache: &self.cache,
            block_size: self.block_size,
            max_blocks: self.max_blocks,
            blocks: self.blocks,
            groups: b.groups,
        };
        self.model
            .encode_blocks(enc, &b.acts, &tokens, Placement::Paged(&rows))?;
        if outputs == 0 {
            return Ok(());
        }
        // The rows whose logits are wanted, gathered by an embedding
        // lookup into the hidden states.
        let hidden = Weight {
            buffer: b.acts.x.clone(),
            dtype: DType::F32,
            n: r,
            k: d,
        };
        self.model
            .ops
            .embed(enc, &hidden, &part(3, outputs)?, &b.gathered, outputs)?;
        self.model
            .encode_head_with(enc, &b.gathered, &b.normed, &b.logits, outputs, true)?;
        if argmax {
            let vocab = self.model.config.vocab;
            self.model
                .ops
                .argmax_rows(enc, &b.logits, &b.ids, outputs, vocab)?;
        }
        Ok(())
    }

    /// Writes the per-row inputs of `rows` (padded to `b.rows`) and the
    /// output rows into `b.inputs`.
    fn write_inputs(&self, b: &StepBuffers, rows: &[Row<'_>], outputs: &[usize]) -> Result<()> {
        let (n, mb, bs) = (b.rows, self.max_blocks, self.block_size);
        let mut v = vec![0u32; 4 * n + n * mb];
        for (i, row) in rows.iter().enumerate() {
            let block = row.position / bs;
            let Some(&b) = row.table.get(block) else {
                return Err(LlmError::Request(format!(
                    "row {i}: position {} is past its block table of {} blocks",
                    row.position,
                    row.table.len()
                )));
            };
            if row.table.len() > mb || row.table.iter().any(|&b| b as usize >= self.blocks) {
                return Err(LlmError::Request(format!(
                    "row {i}: its block table does not fit the pool"
                )));
            }
            v[i] = row.token;
            v[n + i] = row.position as u32;
            v[2 * n + i] = b * bs as u32 + (row.position % bs) as u32;
            v[4 * n + i * mb..4 * n + i * mb + row.table.len()].copy_from_slice(row.table);
        }
        // Padding rows: token 0 at position 0 of the pad block.
        for i in rows.len()..n {
            v[2 * n + i] = PAD_BLOCK * bs as u32;
            v[4 * n + i * mb] = PAD_BLOCK;
        }
        for (i, &o) in outputs.iter().enumerate() {
            v[3 * n + i] = o as u32;
        }
        b.inputs.upload(&v)?;
        Ok(())
    }

    /// Runs one step and returns what each of `outputs` wants, in order. A
    /// row whose logits are not finite is an error (the model went bad).
    ///
    /// With graphs on, decode rows replay the decode graph of their bucket
    /// (a graph of at most the largest bucket at a time) and prompt rows
    /// run in one eager pass: a row of either kind always runs the same
    /// kernels, whatever the step holds besides.
    pub fn run(&mut self, rows: &[Row<'_>], outputs: &[Output]) -> Result<Vec<RowResult>> {
        if let Some(o) = outputs.iter().find(|o| o.row >= rows.len()) {
            return Err(LlmError::Request(format!(
                "output row {} of a step of {} rows",
                o.row,
                rows.len()
            )));
        }
        let graphs = self.graphs.is_some();
        let (decode, prompt): (Vec<usize>, Vec<usize>) =
            (0..rows.len()).partition(|&i| graphs && rows[i].decode);
        self.check_decode_rows(rows, &decode)?;
        let device = self.model.device.clone();
        let _span = device
            .trace_span("batch step")
            .arg("rows", rows.len() as u64);
        let mut results: Vec<Option<RowResult>> = vec![None; outputs.len()];
        let groups = decode.iter().map(|&i| rows[i].group + 1).max();
        match groups {
            Some(groups) if groups > 1 => {
                let (sub, index) = self.lay_out(rows, &decode, groups)?;
                self.pass(&sub, &index, outputs, &mut results, groups, true)?;
            }
            _ => {
                let largest = BUCKETS[BUCKETS.len() - 1];
                for part in decode.chunks(largest) {
                    let sub: Vec<Row<'_>> = part.iter().map(|&i| rows[i].clone()).collect();
                    self.pass(&sub, part, outputs, &mut results, 1, true)?;
                }
            }
        }
        if !prompt.is_empty() {
            let sub: Vec<Row<'_>> = prompt.iter().map(|&i| rows[i].clone()).collect();
            self.pass(&sub, &prompt, outputs, &mut results, 1, false)?;
        }
        results
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| LlmError::Request("a step lost an output row".into()))
    }

    /// Lays the decode rows `decode` of `rows` out as `groups` groups of
    /// one bucket each, group `g` holding the rows whose
    /// [`Row::group`] is `g`, padded: the rows, and the index in `rows` of
    /// each (`usize::MAX` for padding).
    fn lay_out<'a>(
        &self,
        rows: &[Row<'a>],
        decode: &[usize],
        groups: usize,
    ) -> Result<(Vec<Row<'a>>, Vec<usize>)> {
        let mut sizes = vec![0usize; groups];
        for &i in decode {
            sizes[rows[i].group] += 1;
        }
        let widest = sizes.iter().copied().max().unwrap_or(0);
        let Some(bucket) = BUCKETS.iter().copied().find(|&b| b >= widest) else {
            return Err(LlmError::Request(format!(
                "{widest} sequences verify drafts in one step; at most {} can",
                BUCKETS[BUCKETS.len() - 1]
            )));
        };
        let pad = Row {
            token: 0,
            position: 0,
            table: &PAD_TABLE,
            decode: true,
            group: 0,
        };
        let mut sub = vec![pad; bucket * groups];
        let mut filled = vec![0usize; groups];
        let mut index = vec![usize::MAX; sub.len()];
        for &i in decode {
            let g = rows[i].group;
            let place = g * bucket + filled[g];
            filled[g] += 1;
            sub[place] = rows[i].clone();
            index[place] = i;
        }
        Ok((sub, index))
    }

    /// Checks the promise decode rows make (one a sequence in each group,
    /// see [`PagedRows::prompt`]): no decode row stores into a block
    /// another decode row of its group reads, which a decode graph's fused
    /// attention, storing and reading in one dispatch, would race on.
    fn check_decode_rows(&self, rows: &[Row<'_>], decode: &[usize]) -> Result<()> {
        let bs = self.block_size;
        // (group, block, row) of each decode row's store, sorted.
        let mut stores: Vec<(usize, u32, usize)> = decode
            .iter()
            .filter_map(|&i| {
                let row = &rows[i];
                Some((row.group, *row.table.get(row.position / bs)?, i))
            })
            .collect();
        stores.sort_unstable();
        for &i in decode {
            let row = &rows[i];
            let seen = row.table.get(..=row.position / bs).unwrap_or(row.table);
            for &block in seen {
                let key = (row.group, block);
                let from = stores.partition_point(|s| (s.0, s.1) < key);
                let other = stores[from..]
                    .iter()
                    .take_while(|s| (s.0, s.1) == key)
                    .find(|s| s.2 != i);
                if let Some(&(_, _, j)) = other {
                    return Err(LlmError::Request(format!(
                        "decode rows {i} and {j} of one step share block {block}: \
                         a step takes one decode row a sequence"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Runs the rows `sub` (in `groups` equal groups), `sub[j]` being row
    /// `part[j]` of the step (a padding row where that is past the step):
    /// replaying their bucket's decode graph with `graph`, else
    /// eagerly; puts the results of the outputs among them into `results`.
    fn pass(
        &mut self,
        sub: &[Row<'_>],
        part: &[usize],
        outputs: &[Output],
        results: &mut [Option<RowResult>],
        groups: usize,
        graph: bool,
    ) -> Result<()> {
        // (index into `outputs`, the output within `sub`).
        let mine: Vec<(usize, Output)> = outputs
            .iter()
            .enumerate()
            .filter_map(|(k, o)| {
                let row = part.iter().position(|&i| i == o.row)?;
                Some((k, Output { row, ..*o }))
            })
            .collect();
        let local: Vec<Output> = mine.iter().map(|m| m.1).collect();
        let order: Vec<usize> = local.iter().map(|o| o.row).collect();
        let per_group = sub.len().div_ceil(groups);
        let found = match BUCKETS.iter().copied().find(|&b| b >= per_group) {
            Some(bucket) if graph => {
                let exec = self.decode_graph(bucket, groups)?;
                let Some((b, _)) = self.decode.get(&(bucket, groups)) else {
                    return Err(LlmError::Request("decode buffers missing".into()));
                };
                // Every row produces logits; only the wanted ones are read.
                let all = 0..b.rows;
                let order: Vec<usize> = order.into_iter().chain(all).take(b.rows).collect();
                self.write_inputs(b, sub, &order)?;
                exec.replay(&[])?.wait()?;
                self.results(b, sub, &local)?
            }
            _ => {
                let b = self.buffers(sub.len(), 1)?;
                self.write_inputs(&b, sub, &order)?;
                let mut enc = self.model.device.encoder();
                enc.set_label("batch step");
                let argmax = local.iter().any(|o| o.greedy);
                // Eager passes hold the prompt rows (every row, with graphs off).
                self.encode(&mut enc, &b, local.len(), argmax, true)?;
                enc.commit_and_wait()?;
                self.results(&b, sub, &local)?
            }
        };
        for ((k, _), r) in mine.into_iter().zip(found) {
            results[k] = Some(r);
        }
        Ok(())
    }

    /// Reads each output's result off the device: the argmaxes of greedy
    /// rows in one download, the logits of the others row by row.
    fn results(
        &self,
        b: &StepBuffers,
        rows: &[Row<'_>],
        outputs: &[Output],
    ) -> Result<Vec<RowResult>> {
        let vocab = self.model.config.vocab;
        let bad = |o: &Output| {
            let row = &rows[o.row];
            let pass = if row.decode {
                Pass::Decode
            } else {
                Pass::Prefill
            };
            RowResult::NonFinite {
                pass,
                position: row.position,
            }
        };
        let ids: Vec<u32> = if outputs.iter().any(|o| o.greedy) {
            b.ids.view(0, outputs.len() * 16)?.download()?
        } else {
            Vec::new()
        };
        let mut results = Vec::with_capacity(outputs.len());
        for (i, o) in outputs.iter().enumerate() {
            if o.greedy {
                match ids.get(4 * i) {
                    Some(&id) if id != u32::MAX => results.push(RowResult::Token(id)),
                    _ => results.push(bad(o)),
                }
                continue;
            }
            let logits: Vec<f32> = b.logits.view(i * vocab * 4, vocab * 4)?.download()?;
            if logits.iter().any(|x| !x.is_finite()) {
                results.push(bad(o));
            } else {
                results.push(RowResult::Logits(logits));
            }
        }
        Ok(results)
    }

    /// Records the decode graphs of every batch size up to `rows` now, so
    /// that no later step waits for a recording.
    pub fn prepare(&mut self, rows: usize) -> Result<()> {
        if self.graphs.is_none() {
            return Ok(());
        }
        let last = BUCKETS.iter().copied().find(|&b| b >= rows);
        for bucket in BUCKETS.iter().copied().filter(|&b| b < rows) {
            self.decode_graph(bucket, 1)?;
        }
        if let Some(bucket) = last {
            self.decode_graph(bucket, 1)?;
        }
        Ok(())
    }

    /// The decode graph of `groups` groups of `bucket` rows, recorded (with
    /// its buffers) on first use.
    fn decode_graph(&mut self, bucket: usize, groups: usize) -> Result<GraphExec> {
        let key = (bucket, groups);
        if !self.decode.contains_key(&key) {
            let b = self.buffers(bucket * groups, groups)?;
            self.decode.insert(key, (b, None));
        }
        match self.decode.get(&key) {
            Some((_, Some(exec))) => Ok(exec.clone()),
            Some((b, None)) => {
                let exec = self.record(b)?;
                if let Some(entry) = self.decode.get_mut(&key) {
                    entry.1 = Some(exec.clone());
                }
                Ok(exec)
            }
            None => Err(LlmError::Request("decode buffers missing".into())),
        }
    }

    /// Records the decode pass of `b` (every row's logits) as a graph.
    fn record(&self, b: &StepBuffers) -> Result<GraphExec> {
        let Some(graphs) = &self.graphs else {
            return Err(LlmError::Request("graphs are off".into()));
        };
        let mut enc = self.model.device.capture();
        self.encode(&mut enc, b, b.rows, true, false)?;
        let mut graph = enc.finish_graph()?;
        graph.mark_output(&b.logits);
        graph.mark_output(&b.ids);
        for lc in &self.cache {
            graph.mark_output(&lc.k);
            graph.mark_output(&lc.v);
        }
        Ok(graphs.get_or_instantiate(&graph)?)
    }
}
