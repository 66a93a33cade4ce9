//! Token sampling of a decode batch on the GPU (kernels/sampler.cu), equal to the CPU model's
//! [`model::sampler`](crate::model::sampler) on the same f32 logits and the same draws.
//!
//! Contract, per sequence b of a batch (one launch of [`sample_step`], one CTA per sequence):
//! * The choice is `Sampler::sample_at(logits[b], history_b, steps[b])` of the sequence's
//!   [`SamplerConfig`](crate::model::sampler::SamplerConfig): greedy (temperature 0, argmax, the lower id on ties),
//!   temperature, top-k, top-p and the repetition penalty over the last `penalty_window` tokens of the history
//!   (prompt included); the draw is the exponential race over the kept ids (`race_key`, the Gumbel draws of
//!   `race_bits(seed_b, steps[b], id)`). Options are per sequence ([`SamplerParams`]).
//! * The loop of `model::sampler::generate`: a sequence whose `steps` reached `max_new_tokens` stops
//!   ([`STATUS_MAX_TOKENS`]) without sampling; a sampled member of the stop set stops it ([`STATUS_STOPPED`],
//!   the id in `sampled`, not appended); otherwise the id is appended (steps + 1, penalty history updated) and
//!   written to `next`, the ids buffer the next step's embedding reads ([`crate::ops::head::embed_tokens`]: -1 is
//!   an empty row). A finished sequence writes -1 to `sampled` and `next` and nothing else.
//! * A NaN logit (the CPU bails) or parameters the kernel cannot honour mark the sequence [`STATUS_FAILED`] and set
//!   a bit of the sticky device error word ([`ERR_NAN_LOGIT`], [`ERR_BAD_PARAMS`]).
//! * Exactness: ids equal the CPU's bit for bit wherever the arithmetic is exact or the same IEEE operations in the
//!   same order (the order, greedy, top-k, counts, the race keys); the nucleus' probability sums are f64 in another
//!   order than the CPU's sequential sums, so a top_p within ~1e-15 (relative) of a running-sum boundary may round
//!   the other way. The tests run many seeds.
//!
//! Graph-safe: the grid is the batch capacity; every per-sequence input (params, status, counters, the penalty
//! history, the draws' step counter) lives in [`SamplerState`] on the device; nothing on the host reads a result.
//! The host writes a sequence's slot only when it admits one ([`SamplerState::admit`]), outside the graph.
//!
//! Rooms: `reference.rs` (the CPU twin of the device state, over `model::sampler`), `bench.rs` (measurement hooks).

pub mod bench;
pub mod reference;

use anyhow::{ensure, Result};

use crate::gpu::arena::{self, Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
use crate::model::sampler::SamplerConfig;

/// Kernel family name (kernels/sampler.cu).
pub const FAMILY: &str = "sampler";
/// Largest vocabulary: ids take the low 17 bits of the kernel's sort key.
pub const MAX_VOCAB: usize = 1 << 17;
/// Most stop ids (`MAX_STOP`).
pub const MAX_STOP: usize = 16;
/// Largest penalty window (the seen-token counts are u16).
pub const MAX_WINDOW: usize = u16::MAX as usize;
const THREADS: u32 = 1024;

/// `status[b]`: the sequence samples at the next step.
pub const STATUS_RUNNING: i32 = 0;
/// It sampled a member of the stop set (the id is in `sampled`).
pub const STATUS_STOPPED: i32 = 1;
/// It generated `max_new_tokens` tokens.
pub const STATUS_MAX_TOKENS: i32 = 2;
/// A NaN logit or unusable parameters (see the error word).
pub const STATUS_FAILED: i32 = 3;
/// Error word bit: a NaN logit.
pub const ERR_NAN_LOGIT: u32 = 1;
/// Error word bit: parameters outside the sampler's domain (or a window above the ring capacity).
pub const ERR_BAD_PARAMS: u32 = 2;

/// One sequence's sampling options as the kernel reads them (`SamplerParams` of kernels/sampler.cu: 8 words).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerParams {
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = off.
    pub top_k: u32,
    pub repetition_penalty: f32,
    pub penalty_window: u32,
    pub max_new_tokens: u32,
    pub seed: u64,
}

impl SamplerParams {
    /// The options of a CPU [`SamplerConfig`] (validated) with a token budget.
    pub fn from_config(c: &SamplerConfig, max_new_tokens: usize) -> Result<SamplerParams> {
        c.validate()?;
        let fits = |v: usize, what: &str| -> Result<u32> {
            ensure!(v <= i32::MAX as usize, "sampler: {what} = {v} exceeds i32");
            Ok(v as u32)
        };
        Ok(SamplerParams {
            temperature: c.temperature,
            top_p: c.top_p,
            top_k: fits(c.top_k, "top_k")?,
            repetition_penalty: c.repetition_penalty,
            penalty_window: fits(c.penalty_window, "penalty_window")?,
            max_new_tokens: fits(max_new_tokens, "max_new_tokens")?,
            seed: c.seed,
        })
    }

    /// The 8 words of the device struct, in field order (the seed little-endian in the last two).
    pub fn to_words(&self) -> [u32; 8] {
        [
            self.temperature.to_bits(),
            self.top_p.to_bits(),
            self.top_k,
            self.repetition_penalty.to_bits(),
            self.penalty_window,
            self.max_new_tokens,
            self.seed as u32,
            (self.seed >> 32) as u32,
        ]
    }
}

/// The sizes the sampler's device state is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplerShape {
    /// Sequence slots (the grid).
    pub batch: usize,
    pub vocab: usize,
    /// Capacity of each sequence's penalty ring: the largest `penalty_window` a sequence may use.
    pub ring_cap: usize,
}

impl SamplerShape {
    /// `1 <= batch <= 65535`, `1 <= vocab <= 2^17`, `1 <= ring_cap <= 65535`.
    pub fn check(&self) -> Result<()> {
        let SamplerShape {
            batch,
            vocab,
            ring_cap,
        } = *self;
        ensure!(
            (1..=65535).contains(&batch),
            "sampler: batch {batch} (1..=65535)"
        );
        ensure!(
            (1..=MAX_VOCAB).contains(&vocab),
            "sampler: vocab {vocab} (1..={MAX_VOCAB}: ids are 17-bit key fields)"
        );
        ensure!(
            (1..=MAX_WINDOW).contains(&ring_cap),
            "sampler: ring capacity {ring_cap} (1..={MAX_WINDOW}: the seen-token counts are u16)"
        );
        Ok(())
    }
}

/// The device buffers the engine owns for sampling (carved once from a long-lived arena; they persist across
/// steps and graph replays). Per sequence slot b:
/// `params [B, 8]` u32 ([`SamplerParams::to_words`]), `status`, `steps` (tokens generated), `hist_len` (prompt +
/// generated), `sampled` (this step's id or -1), `next` (the next step's embedding id or -1) `[B]` i32,
/// `ring [B, ring_cap]` i32 (history token n at slot n % window), `counts [B, vocab]` u16 (occurrences among the
/// last `window` history tokens); shared: `stop_ids [MAX_STOP]` i32 + its length, `error [1]` u32 (sticky bits).
#[derive(Debug, Clone, Copy)]
pub struct SamplerState {
    pub shape: SamplerShape,
    pub params: DevBuf<u32>,
    pub status: DevBuf<i32>,
    pub steps: DevBuf<i32>,
    pub hist_len: DevBuf<i32>,
    pub sampled: DevBuf<i32>,
    pub next: DevBuf<i32>,
    pub ring: DevBuf<i32>,
    pub counts: DevBuf<u16>,
    pub stop_ids: DevBuf<i32>,
    /// Stop ids in use (host-side: set by [`SamplerState::set_stop_ids`], a launch argument).
    pub n_stop: usize,
    pub error: DevBuf<u32>,
}

impl SamplerState {
    pub fn layout(shape: &SamplerShape) -> WorkspaceLayout {
        let b = shape.batch;
        let mut l = WorkspaceLayout::new();
        l.add::<u32>(8 * b);
        for _ in 0..5 {
            l.add::<i32>(b);
        }
        l.add::<i32>(b * shape.ring_cap)
            .add::<u16>(b * shape.vocab)
            .add::<i32>(MAX_STOP)
            .add::<u32>(1);
        l
    }

    /// Carves the state (contents undefined): [`SamplerState::clear`] it, then [`SamplerState::admit`] each
    /// sequence before sampling.
    pub fn carve(arena: &mut Arena, shape: &SamplerShape) -> Result<SamplerState> {
        shape.check()?;
        let b = shape.batch;
        Ok(SamplerState {
            shape: *shape,
            params: arena.carve(8 * b, "sampler params")?,
            status: arena.carve(b, "sampler status")?,
            steps: arena.carve(b, "sampler steps")?,
            hist_len: arena.carve(b, "sampler history length")?,
            sampled: arena.carve(b, "sampler sampled ids")?,
            next: arena.carve(b, "sampler next ids")?,
            ring: arena.carve(b * shape.ring_cap, "sampler penalty ring")?,
            counts: arena.carve(b * shape.vocab, "sampler seen-token counts")?,
            stop_ids: arena.carve(MAX_STOP, "sampler stop ids")?,
            n_stop: 0,
            error: arena.carve(1, "sampler error word")?,
        })
    }

    /// Every slot empty (status [`STATUS_STOPPED`], next -1: a slot nobody admitted samples nothing), the error
    /// word cleared. Host-side setup, outside a graph.
    pub fn clear(&self, stream: &Stream) -> Result<()> {
        let b = self.shape.batch;
        arena::upload(stream, &self.status, &vec![STATUS_STOPPED; b])?;
        arena::upload(stream, &self.next, &vec![-1i32; b])?;
        arena::upload(stream, &self.sampled, &vec![-1i32; b])?;
        arena::upload(stream, &self.steps, &vec![0i32; b])?;
        arena::upload(stream, &self.hist_len, &vec![0i32; b])?;
        arena::upload(stream, &self.params, &vec![0u32; 8 * b])?;
        arena::fill(stream, &self.counts, 0)?;
        arena::fill(stream, &self.ring, 0xFF)?;
        arena::upload(stream, &self.error, &[0u32])
    }

    /// The stop set shared by every sequence (`StopSet::ids`, at most [`MAX_STOP`]).
    pub fn set_stop_ids(&mut self, stream: &Stream, ids: &[u32]) -> Result<()> {
        ensure!(
            ids.len() <= MAX_STOP,
            "sampler: {} stop ids, at most {MAX_STOP}",
            ids.len()
        );
        let v: Vec<i32> = ids
            .iter()
            .map(|&i| {
                ensure!(i <= i32::MAX as u32, "sampler: stop id {i} exceeds i32");
                Ok(i as i32)
            })
            .collect::<Result<_>>()?;
        arena::upload(stream, &self.stop_ids, &v)?;
        self.n_stop = v.len();
        Ok(())
    }

    /// Admits a sequence into slot `slot`: its options, status running, steps 0, `sampled` / `next` -1, and the
    /// penalty history seeded from `prompt` ([`HistoryTables`]). The first [`sample_step`] then samples from the
    /// prompt's last logits (the prefill's) and writes the first generated id to `next`. Host-side, outside a graph.
    pub fn admit(
        &self,
        stream: &Stream,
        slot: usize,
        params: &SamplerParams,
        prompt: &[u32],
    ) -> Result<()> {
        let s = self.shape;
        ensure!(
            slot < s.batch,
            "sampler: slot {slot} of a {}-slot state",
            s.batch
        );
        ensure!(
            (params.penalty_window as usize) <= s.ring_cap,
            "sampler: penalty window {} above the ring capacity {}",
            params.penalty_window,
            s.ring_cap
        );
        let h = HistoryTables::from_prompt(prompt, params.penalty_window as usize, s.vocab)?;
        arena::upload(stream, &self.params.sub(8 * slot, 8), &params.to_words())?;
        arena::upload(stream, &self.counts.sub(slot * s.vocab, s.vocab), &h.counts)?;
        if !h.ring.is_empty() {
            arena::upload(
                stream,
                &self.ring.sub(slot * s.ring_cap, h.ring.len()),
                &h.ring,
            )?;
        }
        arena::upload(stream, &self.hist_len.sub(slot, 1), &[h.len as i32])?;
        arena::upload(stream, &self.steps.sub(slot, 1), &[0])?;
        arena::upload(stream, &self.sampled.sub(slot, 1), &[-1])?;
        arena::upload(stream, &self.next.sub(slot, 1), &[-1])?;
        arena::upload(stream, &self.status.sub(slot, 1), &[STATUS_RUNNING])
    }
}

/// Bytes of the [`SamplerState`] of `shape`.
pub fn state_bytes(shape: &SamplerShape) -> usize {
    SamplerState::layout(shape).bytes()
}

/// The penalty history of a prompt as the device keeps it: `counts[v]` = occurrences of id v among the last
/// `window` tokens (ids >= vocab are not counted: the CPU ignores them), `ring[n % window]` = token n for the
/// last `window` tokens, `len` = the prompt's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryTables {
    pub counts: Vec<u16>,
    pub ring: Vec<i32>,
    pub len: usize,
}

impl HistoryTables {
    pub fn from_prompt(prompt: &[u32], window: usize, vocab: usize) -> Result<HistoryTables> {
        ensure!(
            window <= MAX_WINDOW,
            "sampler: penalty window {window} above {MAX_WINDOW}"
        );
        ensure!(
            prompt.len() <= i32::MAX as usize && prompt.iter().all(|&t| t <= i32::MAX as u32),
            "sampler: the prompt's length or ids exceed i32"
        );
        let mut counts = vec![0u16; vocab];
        let mut ring = vec![-1i32; window];
        for n in prompt.len().saturating_sub(window)..prompt.len() {
            let t = prompt[n];
            ring[n % window] = t as i32;
            if (t as usize) < vocab {
                counts[t as usize] += 1;
            }
        }
        Ok(HistoryTables {
            counts,
            ring,
            len: prompt.len(),
        })
    }
}

/// Per-call scratch: the f64 weights `[B, vocab]` (e, then q, then the drawn probabilities).
#[derive(Debug, Clone, Copy)]
pub struct SamplerWorkspace {
    pub shape: SamplerShape,
    pub weights: DevBuf<f64>,
}

impl SamplerWorkspace {
    pub fn layout(shape: &SamplerShape) -> WorkspaceLayout {
        let mut l = WorkspaceLayout::new();
        l.add::<f64>(shape.batch * shape.vocab);
        l
    }
    pub fn carve(arena: &mut Arena, shape: &SamplerShape) -> Result<SamplerWorkspace> {
        shape.check()?;
        Ok(SamplerWorkspace {
            shape: *shape,
            weights: arena.carve(shape.batch * shape.vocab, "sampler weights")?,
        })
    }
}

/// Bytes of the [`SamplerWorkspace`] of `shape`.
pub fn workspace_bytes(shape: &SamplerShape) -> usize {
    SamplerWorkspace::layout(shape).bytes()
}

/// One sampling step of every slot of `state` (grid = batch, block 1024): reads `logits` f32 `[B, vocab]`
/// (row b = slot b) and the state, writes `sampled`, `next`, `status`, `steps` and the penalty history.
pub fn sample_step(
    gpu: &Gpu,
    stream: &Stream,
    logits: &impl DeviceBuf<f32>,
    state: &SamplerState,
    ws: &SamplerWorkspace,
) -> Result<()> {
    let s = state.shape;
    s.check()?;
    ensure!(
        ws.shape.batch >= s.batch && ws.shape.vocab == s.vocab,
        "sampler: the workspace is for {} slots of vocab {}, the state {} of {}",
        ws.shape.batch,
        ws.shape.vocab,
        s.batch,
        s.vocab
    );
    ensure!(
        logits.elems() >= s.batch * s.vocab,
        "sampler: logits have {} elements, need batch x vocab = {}",
        logits.elems(),
        s.batch * s.vocab
    );
    ensure!(
        logits.device_addr() % 4 == 0,
        "sampler: logits must be 4-byte aligned"
    );
    ensure!(
        state.n_stop <= MAX_STOP,
        "sampler: {} stop ids",
        state.n_stop
    );
    let k = gpu.kernel(FAMILY, "sampler_step")?;
    let mut a = KernelArgs::new();
    a.buf(logits)
        .i32(s.vocab as i32)
        .buf(&state.params)
        .buf(&state.stop_ids)
        .i32(state.n_stop as i32)
        .buf(&state.status)
        .buf(&state.steps)
        .buf(&state.hist_len)
        .buf(&state.sampled)
        .buf(&state.next)
        .buf(&state.ring)
        .i32(s.ring_cap as i32)
        .buf(&state.counts)
        .buf(&ws.weights)
        .buf(&state.error);
    // SAFETY: arguments in the kernel's order (logits, V, params, stop_ids, n_stop, status, steps, hist_len,
    // sampled, next, ring, ring_cap, counts, weights, error); every buffer was carved for `s` (B slots, vocab V,
    // ring_cap) or checked against it; params are 8 words per slot, 8-byte aligned (arena carves are aligned and
    // each record is 32 bytes), matching the device struct's layout.
    unsafe {
        launch(
            stream,
            &k,
            Launch::new((s.batch as u32, 1, 1), (THREADS, 1, 1)),
            &mut a,
        )
    }
}

/// The end of a decode step (kernel `sampler_advance_positions`): a slot still running (`position >= 0` and the
/// sampler's `next >= 0`) moves to the next position; one that stopped or was never admitted (`next < 0`) becomes
/// idle (position -1). `positions` i32 `[B]`, B = the state's slots.
pub fn advance_positions(
    gpu: &Gpu,
    stream: &Stream,
    state: &SamplerState,
    positions: &impl DeviceBuf<i32>,
) -> Result<()> {
    let b = state.shape.batch;
    ensure!(
        positions.elems() >= b,
        "sampler: {} positions for {b} slots",
        positions.elems()
    );
    let k = gpu.kernel(FAMILY, "sampler_advance_positions")?;
    let mut a = KernelArgs::new();
    a.buf(positions).buf(&state.next).i32(b as i32);
    // SAFETY: (positions, next, B): both hold at least B i32s.
    unsafe { launch(stream, &k, Launch::over(b, 128), &mut a) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_words_follow_the_device_struct() {
        let p = SamplerParams {
            temperature: 0.6,
            top_p: 0.9,
            top_k: 40,
            repetition_penalty: 1.1,
            penalty_window: 64,
            max_new_tokens: 100,
            seed: 0x1234_5678_9ABC_DEF0,
        };
        let w = p.to_words();
        assert_eq!(w[0], 0.6f32.to_bits());
        assert_eq!(w[2], 40);
        assert_eq!(w[6], 0x9ABC_DEF0);
        assert_eq!(w[7], 0x1234_5678);
    }

    #[test]
    fn history_tables_keep_the_last_window() {
        let h = HistoryTables::from_prompt(&[5, 6, 5, 7, 9], 3, 8).unwrap();
        // last 3: 5 (n=2), 7 (n=3), 9 (n=4, out of vocab)
        assert_eq!(h.len, 5);
        assert_eq!(h.ring, vec![7, 9, 5]);
        assert_eq!(h.counts[5], 1);
        assert_eq!(h.counts[6], 0);
        assert_eq!(h.counts[7], 1);
        let empty = HistoryTables::from_prompt(&[1, 2], 0, 4).unwrap();
        assert!(empty.ring.is_empty() && empty.counts.iter().all(|&c| c == 0));
    }

    #[test]
    fn shape_checks() {
        let ok = SamplerShape {
            batch: 8,
            vocab: 129_280,
            ring_cap: 256,
        };
        assert!(ok.check().is_ok());
        assert!(SamplerShape {
            vocab: MAX_VOCAB + 1,
            ..ok
        }
        .check()
        .is_err());
        assert!(SamplerShape { batch: 0, ..ok }.check().is_err());
        assert!(SamplerShape { ring_cap: 0, ..ok }.check().is_err());
    }
}
