//! Measurement hooks of the compressor family: one decode step of `batch` sequences (the graph form the engine
//! replays), either with every sequence completing a block (`emit`: state update + pooling + finalize + store +
//! state reset, the worst step) or with none (`update`: the state row write only, the m - 1 steps in m), launched
//! as the engine's cluster kernel or the former one-CTA kernel ([`DecodeGrid`], the A/B). The sweep adapter is
//! `bench::kernels::compressor`.

use anyhow::{anyhow, ensure, Result};

use super::{
    decode_step_with, CompressorShape, CompressorWeights, DecodeGrid, DecodeIo, EntryCache,
    EntrySlots, ROPE_DIMS,
};
use crate::gpu::timing::TimingPlan;
use crate::gpu::{DevBuf, Gpu};
use crate::ops::indexer::KeyCacheGpu;
use crate::ops::inputs;

/// Which step is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// Every sequence is at position m - 1: each pools and stores an entry.
    Emit,
    /// Every sequence is at position 0 (m > 1): each writes its state row only.
    Update,
}

/// One measured point: per-replay device times and the bytes one step moves.
pub struct Measured {
    pub samples_us: Vec<f64>,
    pub bytes: u64,
}

/// Bytes one step moves for `batch` sequences: kv + gate + the ape row read and the state row written per
/// sequence; on an emission also the pooled sources read (both planes, d channels of coff*m rows), the state
/// reset written (CSA: m rows copied = read + written, m rows emptied; HCA: m rows emptied; both planes), the
/// norm weight read and the entry written.
pub fn step_bytes(s: &CompressorShape, batch: usize, step: StepKind) -> u64 {
    let (w, d, m, rows) = (s.width(), s.dim(), s.ratio, s.rows());
    let f = 4usize;
    let mut per_seq = 3 * w * f + 2 * w * f;
    if step == StepKind::Emit {
        let pool_reads = 2 * rows * d * f;
        let reset = if s.kind.overlap() {
            2 * (2 * m * w * f) + 2 * m * w * f
        } else {
            2 * m * w * f
        };
        per_seq += pool_reads + reset + s.kind.entry_bytes();
    }
    (batch * per_seq + d * f + ROPE_DIMS / 2 * 8) as u64
}

/// Time one captured decode step of `batch` sequences on seeded inputs (graph replays, 20 per event pair),
/// launched as `grid` (`None`: the routed [`DecodeGrid::for_batch`]).
pub fn decode_point(
    gpu: &Gpu,
    plan: impl Fn(u64) -> TimingPlan,
    shape: &CompressorShape,
    batch: usize,
    step: StepKind,
    grid: Option<DecodeGrid>,
    seed: u64,
) -> Result<Measured> {
    shape.check()?;
    ensure!(
        step == StepKind::Emit || shape.ratio > 1,
        "compressor: an update-only step needs m > 1"
    );
    let (w, d) = (shape.width(), shape.dim());
    let freqs: Vec<f64> = (0..ROPE_DIMS / 2)
        .map(|i| 160000f64.powf(-(2.0 * i as f64) / ROPE_DIMS as f64))
        .collect();
    let weights = CompressorWeights::upload(
        gpu,
        shape,
        &inputs::uniform(shape.ratio * w, 0.5, seed ^ 1),
        &inputs::uniform(d, 1.0, seed ^ 2),
        &freqs,
        1e-6,
    )?;
    let kv = gpu.upload(&inputs::uniform(batch * w, 1.0, seed ^ 3))?;
    let gate = gpu.upload(&inputs::uniform(batch * w, 2.0, seed ^ 4))?;
    let pos = match step {
        StepKind::Emit => shape.ratio as i32 - 1,
        StepKind::Update => 0,
    };
    let positions = gpu.upload(&vec![pos; batch])?;
    let state = gpu.poisoned::<f32>(batch * shape.state_floats(), 0)?;
    let base = gpu.upload(&(0..batch as i32).collect::<Vec<_>>())?;
    let capacity = gpu.upload(&vec![1i32; batch])?;
    let error = gpu.poisoned::<u32>(1, 0)?;
    let kv_pool;
    let key_cache;
    let cache = match shape.kind {
        super::CompressorKind::CsaIndex(f) => {
            key_cache = KeyCacheGpu::filled(gpu, f, batch, 1, 0)?;
            EntryCache::index(&key_cache)
        }
        _ => {
            kv_pool = gpu.poisoned::<u8>(batch * crate::formats::kv::ENTRY_BYTES, 0)?;
            EntryCache::kv(&kv_pool)
        }
    };
    let io = DecodeIo {
        batch,
        kv: DevBuf::of(&kv),
        gate: DevBuf::of(&gate),
        positions: DevBuf::of(&positions),
        state: DevBuf::of(&state),
        slots: EntrySlots {
            base: DevBuf::of(&base),
            capacity: DevBuf::of(&capacity),
        },
        cache,
        pooled: None,
        error: DevBuf::of(&error),
    };
    // One plain call first: the kernel is resolved outside the capture.
    let grid = grid.unwrap_or(DecodeGrid::for_batch(
        batch,
        d,
        gpu.info.sm_count.max(1) as usize,
    ));
    decode_step_with(gpu, &gpu.stream, shape, &weights, &io, grid)?;
    let graph = gpu.capture(|| decode_step_with(gpu, &gpu.stream, shape, &weights, &io, grid))?;
    graph
        .launch()
        .map_err(|e| anyhow!("compressor graph launch: {e:?}"))?;
    let bytes = step_bytes(shape, batch, step);
    let samples_us = gpu.time_graph_us(&graph, plan(bytes), 20)?;
    Ok(Measured { samples_us, bytes })
}
