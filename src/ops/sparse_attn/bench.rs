//! Measurement hooks of the sparse_attn family: sweep-point shapes (DSV4 layer kinds), the bytes and FLOPs of a
//! call, the bench variants and the paths they run, and the timing of one point on random data. Plain structs
//! only; the bench layer (`bench::kernels::sparse_attn`) turns them into CSV rows.

use anyhow::{bail, Result};
use half::bf16;

use super::{
    decode, reference, DecodeInputs, DecodeShape, DecodeWorkspace, Path, SplitPlan, ENTRY_BYTES,
    HEAD_DIM, WINDOW,
};
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;

/// Kernel name of the bench rows.
pub const KERNEL: &str = "sparse_attn_decode";
/// Variants in the order they are timed: `fp8` (the routed path), the two forcing variants of the combine rule
/// ([`super::HEADS_PER_THREAD_MIN_SPLITS`]) and `bf16_staging`, the baseline of the others.
pub const VARIANTS: [&str; 4] = [
    "fp8",
    "fp8_combine_warp_per_head",
    "fp8_combine_heads_per_thread",
    "bf16_staging",
];
/// The baseline the FP8 variants are measured against.
pub const BASELINE: &str = "bf16_staging";

/// The path a bench variant name runs.
pub fn path_of(variant: &str) -> Result<Path> {
    Ok(match variant {
        "fp8" => Path::Fp8,
        "fp8_combine_warp_per_head" => Path::Fp8WarpPerHeadCombine,
        "fp8_combine_heads_per_thread" => Path::Fp8HeadsPerThreadCombine,
        "bf16_staging" => Path::Bf16Staging,
        other => bail!(
            "sparse_attn: unknown bench variant `{other}` (have: {})",
            VARIANTS.join(", ")
        ),
    })
}

/// Which DSV4 layer kind a sweep point models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// CSA (m = 4): 128 window + min(topk, ctx/4) indexer-selected entries.
    Csa { topk: usize },
    /// HCA (m = 128): 128 window + ctx/128 entries.
    Hca,
}

/// Candidates per query at context `ctx`.
pub fn candidates_per_query(kind: LayerKind, ctx: usize) -> usize {
    WINDOW
        + match kind {
            LayerKind::Csa { topk } => topk.min(ctx / 4),
            LayerKind::Hca => ctx / 128,
        }
}

/// Work of one call: bytes (KV entries read once per sequence, q read, output written; the baseline also
/// writes and re-reads its BF16 staging buffer) and FLOPs (2*H*L*512 for QK^T + 2*H*L*512 for P.V).
pub fn work(batch: usize, heads: usize, cands: usize, path: Path) -> (u64, u64) {
    let (b, h, l) = (batch as u64, heads as u64, cands as u64);
    let io = b * h * HEAD_DIM as u64 * 2 * 2; // q in + out, BF16
    let kv = match path {
        Path::Fp8 | Path::Fp8WarpPerHeadCombine | Path::Fp8HeadsPerThreadCombine => {
            b * l * ENTRY_BYTES as u64
        }
        // gather reads 584 B, writes 1024 B, the attention kernel reads 1024 B back.
        Path::Bf16Staging => b * l * (ENTRY_BYTES as u64 + 2 * 2 * HEAD_DIM as u64),
    };
    (io + kv, 4 * b * h * l * HEAD_DIM as u64)
}

/// One sweep point's shape.
#[derive(Debug, Clone, Copy)]
pub struct BenchShape {
    pub kind: LayerKind,
    pub ctx: usize,
    pub batch: usize,
    pub heads: usize,
}

impl BenchShape {
    pub fn candidates(&self) -> usize {
        candidates_per_query(self.kind, self.ctx)
    }
}

/// What [`time_point`] measured.
#[derive(Debug, Clone)]
pub struct PointTiming {
    /// Microseconds per call, one sample per timed rep.
    pub samples_us: Vec<f64>,
    pub bytes: u64,
    pub flops: u64,
    pub candidates: usize,
    /// The plan the call ran with.
    pub plan: SplitPlan,
}

/// Time one variant at one point on random data from `seed`: every sequence gets `candidates_per_query`
/// distinct valid entries of a shared pool, all lists full. The workspace is carved once, outside the timed
/// region.
pub fn time_point(
    gpu: &Gpu,
    variant: &str,
    point: BenchShape,
    plan: TimingPlan,
    seed: u64,
) -> Result<PointTiming> {
    use rand::{Rng, SeedableRng};
    let BenchShape {
        ctx, batch, heads, ..
    } = point;
    let cands = point.candidates();
    // Pool: enough distinct entries for every sequence (each sequence reads its own).
    let n_entries = batch * cands;
    let shape = DecodeShape {
        batch,
        heads,
        stride: cands,
        n_entries,
    };
    shape.validate()?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut pool = vec![0u8; n_entries * ENTRY_BYTES];
    // Encode a few hundred random entries and tile them over the pool: the bytes are realistic, the encode
    // cost stays small for 1M-context points.
    let distinct: Vec<[u8; ENTRY_BYTES]> = (0..256)
        .map(|_| {
            let x: Vec<f32> = (0..HEAD_DIM)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect();
            reference::encode_entry(&x)
        })
        .collect::<Result<_>>()?;
    for (i, e) in pool.chunks_mut(ENTRY_BYTES).enumerate() {
        e.copy_from_slice(&distinct[i % distinct.len()]);
    }
    let candidates: Vec<i32> = (0..n_entries as i32).collect();
    let q: Vec<bf16> = (0..batch * heads * HEAD_DIM)
        .map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0)))
        .collect();
    let freqs = reference::rope_freqs(160_000.0, true);
    let d_q = gpu.upload(&q)?;
    let d_pool = gpu.upload(&pool)?;
    let d_cand = gpu.upload(&candidates)?;
    let d_len = gpu.upload(&vec![cands as i32; batch])?;
    let d_pos = gpu.upload(&vec![ctx.saturating_sub(1) as i32; batch])?;
    let d_sinks = gpu.upload(&vec![0.5f32; heads])?;
    let d_freqs = gpu.upload(&freqs)?;
    let inp = DecodeInputs {
        q: &d_q,
        pool: &d_pool,
        candidates: &d_cand,
        lengths: &d_len,
        positions: &d_pos,
        sinks: &d_sinks,
        freqs: &d_freqs,
    };
    let path = path_of(variant)?;
    let split = SplitPlan::for_path(gpu.info.sm_count as usize, &shape, path);
    let mut out = gpu.zeros::<bf16>(batch * heads * HEAD_DIM)?;
    let (_arena, ws) = DecodeWorkspace::with_arena(gpu, &shape, split, path == Path::Bf16Staging)?;
    let stream = gpu.stream.clone();
    let samples_us = gpu.time_us(plan, || {
        decode(gpu, &stream, path, &shape, &inp, &ws, &mut out)
    })?;
    let (bytes, flops) = work(batch, heads, cands, path);
    Ok(PointTiming {
        samples_us,
        bytes,
        flops,
        candidates: cands,
        plan: split,
    })
}
