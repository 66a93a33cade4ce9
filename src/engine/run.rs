//! Running the model: an [`Engine`] holds the weights and one decode state, feeds prompts through the layers, and
//! replays one CUDA graph per decode step (captured once per engine: the batch and context capacity are fixed by
//! the state, every count and position lives on the device).
//!
//! A step's graph is captured after one eager run of the same work (the eager run loads every kernel module and
//! sets its attributes, which a capture must not do), so the first prompt token and the first decode step run
//! eagerly and every later one replays.

use crate::engine::io::{StepMarks, StepShape};
use crate::engine::prefill::{self, PrefillState, DEFAULT_PREFILL_CHUNK};
use crate::engine::step::DecodeState;
use crate::engine::weights::DeviceWeights;
use crate::gpu::arena;
use crate::gpu::timing::{capture_on, TimingPlan};
use crate::gpu::trace::{trace_kernels, KernelSpan};
use crate::gpu::Gpu;
use crate::model::weights::element_bits;
use crate::ops::sampler::{SamplerParams, STATUS_RUNNING};
use anyhow::{anyhow, ensure, Result};
use cudarc::driver::CudaGraph;
use std::time::Instant;

/// One decode state over borrowed weights (several engines, e.g. the points of a sweep, share one load), with the
/// graphs of its prompt and decode steps.
pub struct Engine<'w> {
    pub weights: &'w DeviceWeights,
    pub state: DecodeState,
    prompt_graph: Option<CudaGraph>,
    step_graph: Option<CudaGraph>,
    prompt_steps_run: usize,
    decode_steps_run: usize,
    /// Prompt tokens per prefill chunk ([`Engine::set_prefill_chunk`]; 1 = token by token).
    prefill_chunk: usize,
    /// The chunked prefill's state, built by the first [`Engine::prefill`] with a chunk above 1.
    pub prefill_state: Option<PrefillState>,
}

/// What a prefill measured.
#[derive(Clone, Copy, Debug)]
pub struct PrefillTiming {
    /// Prompt tokens per sequence (the last one is run by the first decode step).
    pub tokens: usize,
    /// Wall time from the first prompt token to the first sampled token (the first decode step included), in
    /// seconds.
    pub ttft_s: f64,
}

impl<'w> Engine<'w> {
    /// A decode state of `shape` over `weights`.
    pub fn new(gpu: &Gpu, weights: &'w DeviceWeights, shape: StepShape) -> Result<Engine<'w>> {
        let state = DecodeState::new(gpu, weights, shape)?;
        Ok(Engine {
            weights,
            state,
            prompt_graph: None,
            step_graph: None,
            prompt_steps_run: 0,
            decode_steps_run: 0,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            prefill_state: None,
        })
    }

    /// Sets the prompt tokens per prefill chunk (1..=1024, default 1024; `--prefill-chunk`): 1 feeds the prompt token
    /// by token through replays of the prompt step's graph (every sequence of the batch at once); above 1, each
    /// sequence's prompt goes through the layers in chunks of that many rows ([`crate::engine::prefill`]). Fails
    /// once a prefill ran.
    pub fn set_prefill_chunk(&mut self, chunk: usize) -> Result<()> {
        prefill::check_chunk(chunk)?;
        ensure!(
            self.prompt_steps_run == 0 && self.decode_steps_run == 0,
            "set the prefill chunk before the first step"
        );
        self.prefill_chunk = chunk;
        Ok(())
    }

    /// The prompt tokens per prefill chunk.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Builds the chunked prefill's state for prompts of `len` tokens if it is not built yet: `min(chunk, len -
    /// 1)` rows (the prompt's last token goes through the first decode step). Returns the rows; 1 or 0 means
    /// token by token (no state). [`Engine::prefill`] calls it; a test calls it first to poison the state.
    pub fn prepare_prefill(&mut self, gpu: &Gpu, len: usize) -> Result<usize> {
        let rows = self.prefill_chunk.min(len.saturating_sub(1));
        if rows > 1 && self.prefill_state.as_ref().is_none_or(|p| p.rows != rows) {
            self.prefill_state = Some(PrefillState::new(
                gpu,
                self.weights,
                &self.state.caches,
                self.state.shape.context,
                rows,
            )?);
        }
        Ok(rows)
    }

    /// Admits one prompt per slot (every slot of the batch; prompts of equal length, at least one token) with
    /// the sampler's options and stop ids, runs all but the last prompt token through the layers (filling the
    /// caches), then the first decode step, which samples each sequence's first token.
    ///
    /// With a prefill chunk above 1 ([`Engine::set_prefill_chunk`], the default) each sequence's first `len - 1`
    /// tokens go through the layers in chunks of up to `chunk` rows, one sequence after the other (eager launches;
    /// [`PrefillState::run_chunk`]); with chunk 1, token by token for the whole batch at once (one replay of the
    /// prompt step's graph per token; host work between tokens: one upload of the next ids).
    ///
    /// The time to the first token is cold: it includes loading the kernel modules (the first eager chunk or
    /// step) and capturing the prompt and decode graphs; building the chunked prefill's state (its halves' weight
    /// copies, the arena) happens before the clock starts, like the admission.
    pub fn prefill(
        &mut self,
        gpu: &Gpu,
        prompts: &[Vec<u32>],
        params: &SamplerParams,
        stop_ids: &[u32],
    ) -> Result<PrefillTiming> {
        let len = prompts.first().map_or(0, |p| p.len());
        ensure!(len >= 1, "a prompt needs at least one token");
        ensure!(
            prompts.iter().all(|p| p.len() == len),
            "the prompts of one batch must have equal lengths (ragged prefill is not implemented)"
        );
        ensure!(
            len < self.state.shape.context,
            "a prompt of {len} tokens leaves no room to generate in a context of {}",
            self.state.shape.context
        );
        let vocab = self.state.config.vocab_size;
        for p in prompts {
            if let Some(&t) = p.iter().find(|&&t| t as usize >= vocab) {
                anyhow::bail!("prompt token {t} is outside the vocabulary of {vocab}");
            }
        }
        let stream = gpu.stream.clone();
        self.admit(gpu, prompts, params, stop_ids, 0)?;
        let rows = self.prepare_prefill(gpu, len)?;
        gpu.synchronize()?;
        let t0 = Instant::now();
        if rows > 1 {
            let ps = self.prefill_state.as_mut().expect("built above");
            for (seq, p) in prompts.iter().enumerate() {
                for (start, n) in prefill::chunks(len - 1, rows) {
                    ps.run_chunk(
                        gpu,
                        &stream,
                        self.weights,
                        &self.state.caches,
                        seq,
                        &p[start..start + n],
                        start,
                    )?;
                    self.prompt_steps_run += 1;
                }
            }
            // The last prompt token of every sequence: the first decode step, at position len - 1.
            self.state
                .set_positions(&stream, &vec![(len - 1) as i32; prompts.len()])?;
            let ids: Vec<u32> = prompts.iter().map(|p| p[len - 1]).collect();
            self.state.set_tokens(&stream, &ids)?;
        } else {
            for i in 0..len {
                let ids: Vec<u32> = prompts.iter().map(|p| p[i]).collect();
                self.state.set_tokens(&stream, &ids)?;
                if i + 1 < len {
                    self.prompt_step(gpu)?;
                }
            }
        }
        self.decode_step(gpu)?;
        gpu.synchronize()?;
        let ttft_s = t0.elapsed().as_secs_f64();
        if let Some(ps) = self.prefill_state.as_ref().filter(|_| rows > 1) {
            let e = ps.read_error(&stream)?;
            ensure!(
                e == 0,
                "the chunked prefill's error bits are {e:#x} (1: embedding id, 2: compressor cache full)"
            );
        }
        Ok(PrefillTiming {
            tokens: len,
            ttft_s,
        })
    }

    /// Starts every sequence at `position` without a prompt (for timing a long context without prefilling it):
    /// each slot is admitted with the one-token history `[tokens[b]]`, positions are set to `position`, and the
    /// first decode step runs there. Below `position` the KV entries are zero and the compressor states empty, as
    /// [`DecodeState::new`] built them, and the indexer keys are synthetic
    /// ([`KvPool::fill_synthetic_index_keys`](crate::engine::cache::KvPool::fill_synthetic_index_keys): zero keys
    /// would make every score tie), so later steps read the bytes of a `position`-token context and select among
    /// distinct scores, but not a real prompt's values.
    pub fn start_at(
        &mut self,
        gpu: &Gpu,
        position: usize,
        tokens: &[u32],
        params: &SamplerParams,
    ) -> Result<()> {
        ensure!(
            position < self.state.shape.context,
            "position {position} is outside the context of {}",
            self.state.shape.context
        );
        let pos =
            i32::try_from(position).map_err(|_| anyhow!("position {position} exceeds i32"))?;
        let histories: Vec<Vec<u32>> = tokens.iter().map(|&t| vec![t]).collect();
        self.admit(gpu, &histories, params, &[], pos)?;
        self.state
            .caches
            .fill_synthetic_index_keys(gpu, 0x5EED_0000 ^ position as u64)?;
        self.state.set_tokens(&gpu.stream, tokens)?;
        self.decode_step(gpu)
    }

    /// Admits one history per slot (every slot of the batch) into the sampler with `params` and `stop_ids`, and
    /// sets every position to `position`. The caches, compressor states and the stop count baked into the step
    /// graph are those of one batch: an engine serves one admission.
    fn admit(
        &mut self,
        gpu: &Gpu,
        histories: &[Vec<u32>],
        params: &SamplerParams,
        stop_ids: &[u32],
        position: i32,
    ) -> Result<()> {
        let b = self.state.shape.batch;
        ensure!(
            self.prompt_steps_run == 0 && self.decode_steps_run == 0,
            "this engine already ran a batch; build a new one"
        );
        ensure!(
            histories.len() == b,
            "{} prompts for a batch of {b}",
            histories.len()
        );
        let stream = &gpu.stream;
        self.state.ws.sampler.set_stop_ids(stream, stop_ids)?;
        for (slot, h) in histories.iter().enumerate() {
            self.state.ws.sampler.admit(stream, slot, params, h)?;
        }
        self.state.set_positions(stream, &vec![position; b])
    }

    /// One prompt token of every sequence (ids already written): eager the first time, then a graph replay.
    fn prompt_step(&mut self, gpu: &Gpu) -> Result<()> {
        let stream = gpu.stream.clone();
        if self.prompt_graph.is_none() && self.prompt_steps_run >= 1 {
            let (state, weights) = (&mut self.state, self.weights);
            self.prompt_graph = Some(capture_on(&stream, || {
                state.prompt_step(gpu, &stream, weights)
            })?);
        }
        match &self.prompt_graph {
            Some(g) => g
                .launch()
                .map_err(|e| anyhow!("prompt graph launch: {e:?}"))?,
            None => self.state.prompt_step(gpu, &stream, self.weights)?,
        }
        self.prompt_steps_run += 1;
        Ok(())
    }

    /// Captures the decode step's graph if it is not yet (after at least one eager step).
    fn capture_decode_step(&mut self, gpu: &Gpu) -> Result<()> {
        if self.step_graph.is_none() && self.decode_steps_run >= 1 {
            let stream = gpu.stream.clone();
            let (state, weights) = (&mut self.state, self.weights);
            self.step_graph = Some(capture_on(&stream, || {
                state.decode_step(gpu, &stream, weights)
            })?);
        }
        Ok(())
    }

    /// The kernels one decode step launches (the captured step graph's kernel nodes); `None` before the graph is
    /// captured (after the first step).
    pub fn decode_kernel_count(&self) -> Result<Option<usize>> {
        self.step_graph
            .as_ref()
            .map(crate::gpu::timing::graph_kernel_count)
            .transpose()
    }

    /// One decode step of every sequence: eager the first time, then a graph replay.
    pub fn decode_step(&mut self, gpu: &Gpu) -> Result<()> {
        let stream = gpu.stream.clone();
        self.capture_decode_step(gpu)?;
        match &self.step_graph {
            Some(g) => g
                .launch()
                .map_err(|e| anyhow!("step graph launch: {e:?}"))?,
            None => self.state.decode_step(gpu, &stream, self.weights)?,
        }
        self.decode_steps_run += 1;
        Ok(())
    }

    /// `steps` decode steps replayed back to back through the shared event-pair timing loop
    /// ([`Gpu::time_us_on`]; no host work between steps): the device time of each step in microseconds. Every
    /// sequence must keep running for all of them (the caller sizes the sampler's budget and the context).
    pub fn timed_decode(&mut self, gpu: &Gpu, steps: usize) -> Result<Vec<f64>> {
        // Captured before the timing loop, so no step's time includes the host's capture.
        self.capture_decode_step(gpu)?;
        let Some(graph) = &self.step_graph else {
            anyhow::bail!(
                "timed decode needs the first decode step run (prefill or start_at) before it"
            );
        };
        let plan = TimingPlan {
            warmup: 0,
            reps: steps,
            flush_l2: false,
        };
        let us = gpu.time_us_on(&gpu.stream, plan, || {
            graph
                .launch()
                .map_err(|e| anyhow!("step graph launch: {e:?}"))
        })?;
        self.decode_steps_run += steps;
        Ok(us)
    }

    /// One decode step replayed from a graph captured with an event after each group of kernels (the embedding,
    /// each half's groups per layer, the head, the sampler) and one after every kernel: the device time of each
    /// group and of each kernel (from the end of the kernel before it, the gap included), summed over the layers
    /// by name, in step order, with the number of times each ran. Both sets of events are in the one graph, so
    /// each time includes the event nodes' own cost. A real step: the state advances.
    pub fn profile_step(&mut self, gpu: &Gpu) -> Result<ProfiledStep> {
        let stream = gpu.stream.clone();
        self.capture_decode_step(gpu)?;
        self.state.marks = Some(StepMarks::new(&stream));
        let (state, weights) = (&mut self.state, self.weights);
        let (graph, kernel_marks) = with_kernel_marks(&stream, |marked| {
            capture_on(&stream, || {
                marked()?;
                state.decode_step(gpu, &stream, weights)
            })
        });
        let marks = self.state.marks.take().expect("marks set above");
        graph?
            .launch()
            .map_err(|e| anyhow!("profiled graph launch: {e:?}"))?;
        stream
            .synchronize()
            .map_err(|e| anyhow!("profiled step: {e:?}"))?;
        self.decode_steps_run += 1;
        ProfiledStep::of(&marks, &kernel_marks)
    }

    /// One decode step replayed from a graph captured for it while CUPTI records every kernel
    /// ([`crate::gpu::trace`]): the step as the GPU runs it, launch gaps and PDL overlaps included, with nothing
    /// inserted between its kernels. A real step: the state advances. The step runs even where this machine
    /// cannot trace; then the inner result says why there are no kernels.
    pub fn trace_step(&mut self, gpu: &Gpu) -> Result<Result<Vec<KernelSpan>>> {
        let stream = gpu.stream.clone();
        self.capture_decode_step(gpu)?;
        ensure!(
            self.step_graph.is_some(),
            "tracing a step needs the first decode step run (prefill or start_at) before it"
        );
        let (state, weights) = (&mut self.state, self.weights);
        // A graph captured while tracing is on: whether CUPTI reports the kernel nodes of a graph instantiated
        // before it was enabled is not something to depend on.
        let ((), spans) = trace_kernels(|| {
            let graph = capture_on(&stream, || state.decode_step(gpu, &stream, weights))?;
            graph
                .launch()
                .map_err(|e| anyhow!("traced graph launch: {e:?}"))?;
            stream
                .synchronize()
                .map_err(|e| anyhow!("traced step: {e:?}"))
        })?;
        self.decode_steps_run += 1;
        Ok(spans)
    }

    /// One prefill chunk of sequence `seq`, tokens `toks` at positions `pos0..`, run eagerly with an event after
    /// each group of kernels and one after every kernel (the prefill state's `marks` and the launch marks): the
    /// device time of each group and of each kernel, summed over the layers by name, as in [`Engine::profile_step`].
    /// Beside them, the chunk's kernels as CUPTI traced them (or why there are none). A real chunk: the sequence's
    /// caches and compressor states advance, so it belongs after a run's timed steps (at the sequence's next
    /// position), not inside one. Needs the chunked prefill's state (a prefill with a chunk above 1 built it) of
    /// at least `toks.len()` rows.
    pub fn profile_prefill_chunk(
        &mut self,
        gpu: &Gpu,
        seq: usize,
        toks: &[u32],
        pos0: usize,
    ) -> Result<(ProfiledStep, Result<Vec<KernelSpan>>)> {
        let stream = gpu.stream.clone();
        let ps = self
            .prefill_state
            .as_mut()
            .filter(|p| p.rows >= toks.len())
            .ok_or_else(|| {
                anyhow!(
                    "profiling a prefill chunk of {} rows needs a chunked prefill state of as many rows",
                    toks.len()
                )
            })?;
        ps.marks = Some(StepMarks::new(&stream));
        let (weights, caches) = (self.weights, &self.state.caches);
        let (run, kernel_marks) = with_kernel_marks(&stream, |marked| {
            // Traced as well where this machine can: the kernels' own times (the idle time between them includes
            // the events').
            trace_kernels(|| {
                marked()?;
                ps.run_chunk(gpu, &stream, weights, caches, seq, toks, pos0)?;
                stream
                    .synchronize()
                    .map_err(|e| anyhow!("profiled prefill chunk: {e:?}"))
            })
        });
        let marks = ps.marks.take().expect("marks set above");
        let ((), spans) = run?;
        let e = ps.read_error(&stream)?;
        ensure!(e == 0, "the profiled prefill chunk set error bits {e:#x}");
        Ok((ProfiledStep::of(&marks, &kernel_marks)?, spans))
    }

    /// Whether any sequence is still running (reads the sampler's status; waits for the stream).
    pub fn any_running(&self, gpu: &Gpu) -> Result<bool> {
        let status = arena::download(&gpu.stream, &self.state.ws.sampler.status)?;
        Ok(status.contains(&STATUS_RUNNING))
    }

    /// The ids the last step sampled per slot (-1: none; waits for the stream).
    pub fn sampled(&self, gpu: &Gpu) -> Result<Vec<i32>> {
        arena::download(&gpu.stream, &self.state.ws.sampler.sampled)
    }

    /// The sampler's sticky error word (`sampler::ERR_*` bits; waits for the stream).
    pub fn sampler_error(&self, gpu: &Gpu) -> Result<u32> {
        Ok(arena::download(&gpu.stream, &self.state.ws.sampler.error)?[0])
    }

    /// The sampler's status per slot (waits for the stream).
    pub fn status(&self, gpu: &Gpu) -> Result<Vec<i32>> {
        arena::download(&gpu.stream, &self.state.ws.sampler.status)
    }
}

/// What [`Engine::profile_step`] measured: `(name, microseconds summed over the runs, runs)` per kernel group and
/// per kernel, in the order each name first ran; and every marked kernel launch in order with the group it ran in
/// (`(entry point, group)`: what [`crate::gpu::trace::by_group`] aligns a traced step of the same kernels with).
pub struct ProfiledStep {
    pub groups: Vec<(String, f64, usize)>,
    pub kernels: Vec<(String, f64, usize)>,
    pub kernel_groups: Vec<(String, String)>,
}

impl ProfiledStep {
    /// The group and kernel tables of a profiled run from its two sets of events (waits for them).
    fn of(groups: &StepMarks, kernels: &StepMarks) -> Result<ProfiledStep> {
        Ok(ProfiledStep {
            kernel_groups: kernel_groups(&groups.sequence(), &kernels.sequence()),
            groups: sum_by_name(groups.durations()?),
            kernels: sum_by_name(kernels.durations()?),
        })
    }
}

/// Each kernel mark (after the first, the start) with the group whose mark is the first recorded after it: a group's
/// mark follows its kernels. Kernels after the last group mark are left out.
fn kernel_groups(groups: &[(u64, String)], kernels: &[(u64, String)]) -> Vec<(String, String)> {
    kernels
        .iter()
        .skip(1)
        .filter_map(|(at, k)| {
            groups
                .iter()
                .find(|(g_at, _)| g_at > at)
                .map(|(_, g)| (k.clone(), g.clone()))
        })
        .collect()
}

/// Runs `work` with an event recorded after every kernel launched through `gpu::launch` (named by entry point,
/// `with_launch_marks`); `work` calls the closure it is given once, where the first kernel's interval starts.
/// Returns its result and the events.
fn with_kernel_marks<R>(
    stream: &crate::gpu::Stream,
    work: impl FnOnce(&dyn Fn() -> Result<()>) -> R,
) -> (R, std::rc::Rc<StepMarks>) {
    let marks = std::rc::Rc::new(StepMarks::new(stream));
    let start = || marks.mark(stream, "start");
    let out = crate::gpu::launch::with_launch_marks(marks.clone(), || work(&start));
    (out, marks)
}

/// Sums `(name, us)` intervals by name, in first-seen order, counting the runs.
fn sum_by_name(intervals: Vec<(String, f64)>) -> Vec<(String, f64, usize)> {
    let mut out: Vec<(String, f64, usize)> = Vec::new();
    for (name, us) in intervals {
        match out.iter_mut().find(|g| g.0 == name) {
            Some(g) => {
                g.1 += us;
                g.2 += 1;
            }
            None => out.push((name, us, 1)),
        }
    }
    out
}

/// The synthetic prompts of `megamoe decode` (one per sequence, `len` token ids below `vocab`, a pure function of the
/// seed): the single-GPU run and the expert-parallel ranks (`--ranks`) decode the same prompts for the same seed.
pub fn synthetic_prompts(seed: u64, batch: usize, len: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            (0..len as u64)
                .map(|i| (element_bits(seed ^ (0xB0 + b as u64), i) % vocab as u64) as u32)
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::kernel_groups;

    /// A kernel belongs to the group whose mark follows it first; the first kernel mark is the start; kernels after
    /// the last group mark belong to none.
    #[test]
    fn kernels_take_the_group_marked_after_them() {
        let m = |at: u64, n: &str| (at, n.to_string());
        let groups = [m(3, "g1"), m(6, "g2")];
        let kernels = [
            m(0, "start"),
            m(1, "k1"),
            m(2, "k2"),
            m(4, "k3"),
            m(5, "k4"),
            m(7, "k5"),
        ];
        let got = kernel_groups(&groups, &kernels);
        let want: Vec<(String, String)> = [("k1", "g1"), ("k2", "g1"), ("k3", "g2"), ("k4", "g2")]
            .iter()
            .map(|(k, g)| (k.to_string(), g.to_string()))
            .collect();
        assert_eq!(got, want);
    }
}
