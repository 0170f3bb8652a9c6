//! A generation session: one KV cache and the buffers of one conversation
//! over a shared [`Model`].
//!
//! The prompt is prefilled in one batched forward pass. Each decode step is
//! recorded once as a graph whose parameters are the position and the input
//! token, then replayed for every later token; in a session made without
//! graphs ([`crate::EngineOptions::graphs`]), each step is encoded eagerly
//! instead, as they are for a model whose forward pass cannot be recorded
//! ([`Model::can_record_graphs`]: a mixture of experts).
//!
//! Greedy decoding ([`Session::decode_greedy`]) replays a variant of the step
//! that feeds itself: its argmax becomes the next token and the position
//! moves on, on the device, so a batch of steps is queued back to back (no
//! host round trip between them) and their tokens come back to the host in
//! one read per batch.
//!
//! Logits that hold a NaN or an infinity (corrupt weights) are an error,
//! [`LlmError::NonFinite`], wherever the host reads them: after the prefill,
//! in [`Session::logits`] (which sampling reads after each step), and in
//! greedy decoding, whose logits never leave the device otherwise. There,
//! the last step of each batch writes its logits to one of two buffers, in
//! turn, and the host checks them while the next batch, writing the other,
//! runs: one read of the logits per batch, overlapped with the device's
//! work. A corrupt weight spoils every later step (through the KV cache, or
//! directly when it is in the output head), so a batch's last step finds
//! it; the steps of a failing batch are then run again one by one to find
//! the first that failed. A NaN that appears in one step and never again
//! (an overflow in the last layer, say) can go unseen inside a batch.

use std::sync::Arc;

use encore::{Buffer, GraphCache, GraphExec, Params};

pub use crate::error::Pass;
use crate::error::{LlmError, Result};
use crate::model::{Activations, LayerCache, Model};

/// Whether every value is finite. Written as a reduction without an early
/// exit so that it vectorizes: a pass over the logits costs about as much
/// as copying them.
fn all_finite(x: &[f32]) -> bool {
    x.iter().fold(true, |ok, v| ok & v.is_finite())
}

/// `Ok` when `logits` are all finite, else [`LlmError::NonFinite`].
fn check_finite(logits: &[f32], pass: Pass, position: usize) -> Result<()> {
    if all_finite(logits) {
        Ok(())
    } else {
        Err(LlmError::NonFinite { pass, position })
    }
}

/// One conversation's state on the device.
pub struct Session {
    model: Arc<Model>,
    cache: Vec<LayerCache>,
    max_seq: usize,
    pos: usize,
    params: Params,
    /// The decode step's activations; greedy batches alternate between the
    /// two, so that the host can read one batch's last logits while the
    /// next batch writes the other's. Single steps use the first.
    decode: [Activations; 2],
    /// Which of `decode` holds the logits [`Session::logits`] reads, and
    /// the position of the step that wrote them.
    logits_at: (usize, usize),
    argmax_out: Buffer,
    /// Tokens chosen on the device by greedy steps, by the position of the
    /// step that chose them.
    history: Buffer,
    graphs: GraphCache,
    step: Option<GraphExec>,
    /// The self-feeding greedy step on each of `decode`, once recorded:
    /// one run a replay, and [`encore_ops::Ops::steps_per_replay`] runs a
    /// replay.
    greedy: [[Option<GraphExec>; 2]; 2],
    use_graphs: bool,
    last_step_time: Option<std::time::Duration>,
    step_times: Vec<std::time::Duration>,
}

impl Session {
    /// A session with room for `max_seq` positions, whose decode steps
    /// replay recorded graphs when `graphs` is set and the model's pass can
    /// be recorded ([`Model::can_record_graphs`]), and are encoded eagerly
    /// otherwise.
    pub fn new(model: Arc<Model>, max_seq: usize, graphs: bool) -> Result<Session> {
        if max_seq == 0 {
            return Err(LlmError::Request(
                "the context must hold at least one token".into(),
            ));
        }
        let device = model.device.clone();
        let cache = model.new_cache(max_seq)?;
        let params = Params::new(&device, &["pos", "token"])?;
        let decode = [Activations::new(&model, 1)?, Activations::new(&model, 1)?];
        let argmax_out = model.ops.argmax_buffer()?;
        let history = device.alloc(max_seq * 4)?;
        let use_graphs = graphs && model.can_record_graphs();
        let graphs = GraphCache::new(model.ops.fusion_patterns());
        Ok(Session {
            model,
            cache,
            max_seq,
            pos: 0,
            params,
            decode,
            logits_at: (0, 0),
            argmax_out,
            history,
            graphs,
            step: None,
            greedy: [[None, None], [None, None]],
            use_graphs,
            last_step_time: None,
            step_times: Vec::new(),
        })
    }

    /// Tokens processed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.max_seq
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Forgets the conversation (the cache is overwritten from position 0).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Forgets every position from `n` on, keeping the ones before (a chat
    /// whose new prompt shares its first `n` tokens with what was run);
    /// `n` past the current position changes nothing.
    pub fn truncate(&mut self, n: usize) {
        self.pos = self.pos.min(n);
    }

    fn check_room(&self, n: usize) -> Result<()> {
        if self.pos + n > self.max_seq {
            return Err(LlmError::Request(format!(
                "context full: {} + {n} tokens exceed the {} positions of this session",
                self.pos, self.max_seq
            )));
        }
        Ok(())
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(t) => Err(LlmError::Request(format!(
                "token id {t} is outside the vocabulary of {vocab}"
            ))),
            None => Ok(()),
        }
    }

    /// Runs the prompt through the model in one batched pass and returns the
    /// logits after its last token: [`LlmError::NonFinite`] when they are
    /// not all finite (the position then stays where it was).
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(LlmError::Request("empty prompt".into()));
        }
        self.check_room(tokens.len())?;
        self.check_tokens(tokens)?;
        let device = &self.model.device;
        let _span = device
            .trace_span("prefill")
            .arg("tokens", tokens.len() as u64);
        let acts = Activations::new(&self.model, tokens.len())?;
        let token_buf = device.buffer_from(tokens)?;
        let pos = device.buffer_from(&[self.pos as u32])?;
        let mut enc = device.encoder();
        enc.set_label("prefill");
        self.model
            .encode_forward(&mut enc, &acts, &token_buf, &pos, &self.cache, self.max_seq)?;
        enc.commit_and_wait()?;
        let logits = acts.logits.download()?;
        check_finite(&logits, Pass::Prefill, self.pos + tokens.len() - 1)?;
        self.pos += tokens.len();
        Ok(logits)
    }

    /// Runs `tokens` through the model in one batched pass, like
    /// [`Session::prefill`], and hands the logits of every row from `from`
    /// on to `each` (row index within `tokens`, logits), computed a few
    /// rows at a time so that memory stays small for large vocabularies.
    /// Non-finite logits are [`LlmError::NonFinite`].
    pub fn logits_from(
        &mut self,
        tokens: &[u32],
        from: usize,
        mut each: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        /// Rows of logits computed per submission.
        const SLICE: usize = 16;
        if tokens.is_empty() || from >= tokens.len() {
            return Err(LlmError::Request(format!(
                "no rows to score: {} tokens, scoring from row {from}",
                tokens.len()
            )));
        }
        self.check_room(tokens.len())?;
        self.check_tokens(tokens)?;
        let model = Arc::clone(&self.model);
        let (d, vocab) = (model.config.n_embd, model.config.vocab);
        let device = &model.device;
        let acts = Activations::new(&model, tokens.len())?;
        let token_buf = device.buffer_from(tokens)?;
        let pos = device.buffer_from(&[self.pos as u32])?;
        let normed = device.alloc(SLICE * d * 4)?;
        let logits = device.alloc(SLICE * vocab * 4)?;
        let mut enc = device.encoder();
        enc.set_label("score");
        let place = crate::model::Placement::Contiguous {
            pos: &pos,
            cache: &self.cache,
            max_seq: self.max_seq,
        };
        model.encode_blocks(&mut enc, &acts, &token_buf, place)?;
        let mut row = from;
        while row < tokens.len() {
            let rows = SLICE.min(tokens.len() - row);
            let x = acts.x.view(row * d * 4, rows * d * 4)?;
            model.encode_head(&mut enc, &x, &normed, &logits, rows)?;
            enc.commit_and_wait()?;
            let all = logits.view(0, rows * vocab * 4)?.download::<f32>()?;
            for (i, l) in all.chunks_exact(vocab).enumerate() {
                check_finite(l, Pass::Prefill, self.pos + row + i)?;
                each(row + i, l)?;
            }
            row += rows;
            enc = device.encoder();
            enc.set_label("score");
        }
        self.pos += tokens.len();
        Ok(())
    }

    fn record_step(&mut self) -> Result<GraphExec> {
        let device = self.model.device.clone();
        let mut enc = device.capture();
        self.encode_step(&mut enc, 0)?;
        let mut graph = enc.finish_graph()?;
        graph.set_params(&self.params);
        graph.mark_output(&self.decode[0].logits);
        graph.mark_output(&self.argmax_out);
        for lc in &self.cache {
            graph.mark_output(&lc.k);
            graph.mark_output(&lc.v);
        }
        Ok(self.graphs.get_or_instantiate(&graph)?)
    }

    /// The self-feeding greedy step (the forward pass, the argmax and
    /// [`encore_ops::Ops::advance`]) on activations `acts` (0 or 1),
    /// recorded and instantiated on first use, with `runs` steps a replay
    /// (1 or the device's [`encore_ops::Ops::steps_per_replay`]).
    fn greedy_graph(&mut self, acts: usize, runs: usize) -> Result<GraphExec> {
        let slot = usize::from(runs > 1);
        if let Some(e) = &self.greedy[acts][slot] {
            return Ok(e.clone());
        }
        let device = self.model.device.clone();
        let mut enc = device.capture();
        self.encode_step(&mut enc, acts)?;
        let (token, pos) = (self.params.slot("token")?, self.params.slot("pos")?);
        self.model
            .ops
            .advance(&mut enc, &self.argmax_out, &token, &pos, &self.history)?;
        let mut graph = enc.finish_graph()?;
        graph.set_params(&self.params);
        graph.set_runs_per_replay(runs);
        graph.mark_output(&self.decode[acts].logits);
        graph.mark_output(self.params.buffer());
        graph.mark_output(&self.history);
        for lc in &self.cache {
            graph.mark_output(&lc.k);
            graph.mark_output(&lc.v);
        }
        let exec = self.graphs.get_or_instantiate(&graph)?;
        self.greedy[acts][slot] = Some(exec.clone());
        Ok(exec)
    }

    /// Records and instantiates the graphs [`Session::decode_greedy`] uses,
    /// so that its first call does not pay for them.
    pub fn prepare_greedy(&mut self) -> Result<()> {
        if self.use_graphs {
            for acts in 0..2 {
                self.greedy_graph(acts, self.model.ops.steps_per_replay())?;
            }
        }
        Ok(())
    }

    /// Greedy decoding from `token` at the current position: up to `max`
    /// steps (fewer where the context ends), each taking the argmax of its
    /// logits as the next step's input, on the device. Steps are queued
    /// `batch` at a time and their tokens read back once per batch;
    /// `on_token` gets each chosen token in order and returns whether to go
    /// on. Returns the number of tokens delivered. The next batch is
    /// queued before a batch's tokens are read, so up to two batches run
    /// past a stop: the position advances by one per delivered token, the
    /// steps queued past it only wrote cache positions that later steps
    /// overwrite (and [`Session::logits`] then holds the last queued step's
    /// logits). Without graphs, each step runs eagerly and its argmax is
    /// read back at once.
    ///
    /// A step whose logits are not finite ends the decode with
    /// [`LlmError::NonFinite`] at its position, after the tokens of the
    /// steps before it were delivered; the position is then the failing
    /// step's. With graphs, the last step of each batch is checked (see the
    /// module's documentation); without, every step.
    pub fn decode_greedy(
        &mut self,
        token: u32,
        max: usize,
        batch: usize,
        mut on_token: impl FnMut(u32) -> Result<bool>,
    ) -> Result<usize> {
        self.check_tokens(&[token])?;
        let max = max.min(self.max_seq - self.pos);
        self.step_times.clear();
        if !self.use_graphs {
            let mut token = token;
            for done in 0..max {
                self.step(token)?;
                self.step_times.extend(self.last_step_time);
                if !all_finite(&self.decode[0].logits.download()?) {
                    self.pos -= 1;
                    return Err(LlmError::NonFinite {
                        pass: Pass::Decode,
                        position: self.pos,
                    });
                }
                token = self.argmax()?;
                if !on_token(token)? {
                    return Ok(done + 1);
                }
            }
            return Ok(max);
        }
        let _span = self
            .model
            .device
            .trace_span("greedy decode")
            .arg("steps", max as u64);
        let start = self.pos;
        let batch = batch.max(1);
        let mut tokens = vec![0u32; batch];
        let mut logits = vec![0f32; self.model.config.vocab];
        let mut done = 0;
        // The input of the current batch's first step.
        let mut input = token;
        // The next batch is queued before this one's tokens are read, so
        // that the device never waits for the host between batches; it
        // writes its logits to the other activations.
        let mut acts = 0;
        let mut current = self.queue_greedy(start, token, 0, batch.min(max), acts)?;
        while done < max {
            let n = batch.min(max - done);
            let next = if done + n < max {
                let n_next = batch.min(max - done - n);
                Some(self.queue_greedy(start, token, done + n, n_next, 1 - acts)?)
            } else {
                None
            };
            let read = self.history.view((start + done) * 4, n * 4)?;
            if let Some((last, _)) = current.last() {
                // One copy for both, after which the device goes on to
                // the next batch while the host takes these tokens.
                encore::Buffer::download_all_after(
                    last,
                    &mut [
                        (&read, bytemuck::cast_slice_mut(&mut tokens[..n])),
                        (
                            &self.decode[acts].logits,
                            bytemuck::cast_slice_mut(&mut logits),
                        ),
                    ],
                )?;
            }
            for (s, runs) in &current {
                s.wait()?;
                if let Some(t) = s.elapsed() {
                    let per_step = t / *runs as u32;
                    self.last_step_time = Some(per_step);
                    self.step_times.extend(std::iter::repeat_n(per_step, *runs));
                }
            }
            // Where the batch's last step is not finite, only the steps
            // before the first that is deliver their tokens.
            let good = if all_finite(&logits) {
                n
            } else {
                for (s, _) in next.iter().flatten() {
                    s.wait()?;
                }
                self.first_non_finite(start + done, input, &tokens[..n])?
            };
            for (i, &t) in tokens[..good].iter().enumerate() {
                self.pos = start + done + i + 1;
                if !on_token(t)? {
                    return Ok(done + i + 1);
                }
            }
            if good < n {
                self.pos = start + done + good;
                return Err(LlmError::NonFinite {
                    pass: Pass::Decode,
                    position: self.pos,
                });
            }
            done += n;
            input = tokens[n - 1];
            acts = 1 - acts;
            current = next.unwrap_or_default();
        }
        Ok(done)
    }

    /// Runs the greedy steps of a batch again one at a time, the first at
    /// position `start` from `input`, the others from `tokens` (the batch's
    /// results), and returns the index of the first whose logits are not
    /// finite (the last, should none be on this run).
    fn first_non_finite(&mut self, start: usize, input: u32, tokens: &[u32]) -> Result<usize> {
        let inputs = std::iter::once(input).chain(tokens.iter().copied());
        for (i, token) in inputs.take(tokens.len()).enumerate() {
            self.pos = start + i;
            self.step(token)?;
            if !all_finite(&self.decode[0].logits.download()?) {
                return Ok(i);
            }
        }
        Ok(tokens.len().saturating_sub(1))
    }

    /// Queues `n` self-feeding greedy steps, the first of them step `done`
    /// of a decode that started from `token` at position `start`: replays
    /// of several steps while they fit, then single steps. Returns each
    /// replay with its steps.
    fn queue_greedy(
        &mut self,
        start: usize,
        token: u32,
        done: usize,
        n: usize,
        acts: usize,
    ) -> Result<Vec<(encore::Submission, usize)>> {
        let mut queued = Vec::new();
        let mut steps = 0;
        let per_replay = self.model.ops.steps_per_replay();
        while steps < n {
            let runs = if n - steps >= per_replay {
                per_replay
            } else {
                1
            };
            let exec = self.greedy_graph(acts, runs)?;
            // The first step starts from the host's token and position;
            // the others from what the step before them left.
            let values = [("pos", start as u32), ("token", token)];
            let first = done == 0 && steps == 0;
            queued.push((exec.replay(if first { &values[..] } else { &[] })?, runs));
            steps += runs;
        }
        if n > 0 {
            self.logits_at = (acts, start + done + n - 1);
        }
        Ok(queued)
    }

    /// Encodes one decode step on activations `acts` (0 or 1): the forward
    /// pass of the token in the `token` parameter at position `pos`, then
    /// the device-side argmax.
    fn encode_step(&self, enc: &mut encore::Encoder, acts: usize) -> Result<()> {
        let token = self.params.slot("token")?;
        let pos = self.params.slot("pos")?;
        let a = &self.decode[acts];
        self.model
            .encode_forward(enc, a, &token, &pos, &self.cache, self.max_seq)?;
        self.model
            .ops
            .argmax(enc, &a.logits, &self.argmax_out, self.model.config.vocab)?;
        Ok(())
    }

    /// Runs one decode step for `token` at the current position. The logits
    /// stay on the device; read them with [`Session::logits`] (which checks
    /// that they are finite) or take the device-side argmax with
    /// [`Session::argmax`] (which does not).
    pub fn step(&mut self, token: u32) -> Result<()> {
        self.check_room(1)?;
        self.check_tokens(&[token])?;
        let _span = self
            .model
            .device
            .trace_span("decode step")
            .arg("pos", self.pos as u64);
        let values = [("pos", self.pos as u32), ("token", token)];
        if self.use_graphs {
            let exec = match &self.step {
                Some(e) => e.clone(),
                None => {
                    let e = self.record_step()?;
                    self.step = Some(e.clone());
                    e
                }
            };
            let submission = exec.replay(&values)?;
            submission.wait()?;
            self.last_step_time = submission.elapsed();
        } else {
            for (name, value) in values {
                self.params.set(name, value)?;
            }
            let device = self.model.device.clone();
            let mut enc = device.encoder();
            enc.set_label("decode");
            self.encode_step(&mut enc, 0)?;
            let submission = enc.commit_and_wait()?;
            self.last_step_time = submission.elapsed();
        }
        self.logits_at = (0, self.pos);
        self.pos += 1;
        Ok(())
    }

    /// Device time of the last decode step (start to end of its work on the
    /// device's queue), where the backend measures it.
    pub fn last_step_time(&self) -> Option<std::time::Duration> {
        self.last_step_time
    }

    /// Device time of each step of the last [`Session::decode_greedy`] (on
    /// the graph path, where the backend measures it).
    pub fn step_times(&self) -> &[std::time::Duration] {
        &self.step_times
    }

    /// The logits of the last decode step: [`LlmError::NonFinite`] when
    /// they are not all finite.
    pub fn logits(&self) -> Result<Vec<f32>> {
        let (acts, position) = self.logits_at;
        let logits = self.decode[acts].logits.download()?;
        check_finite(&logits, Pass::Decode, position)?;
        Ok(logits)
    }

    /// The device-side argmax of the last decode step's logits.
    pub fn argmax(&self) -> Result<u32> {
        let mut out = [0u32];
        self.argmax_out.view(0, 4)?.download_into(&mut out)?;
        Ok(out[0])
    }

    /// Statistics of the recorded decode graph, once recorded.
    pub fn graph_stats(&self) -> Option<encore::GraphStats> {
        self.step.as_ref().map(|e| e.stats().clone())
    }
}
