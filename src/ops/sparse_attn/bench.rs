//! Measurement hooks of the sparse_attn family: the BF16-staging baseline (its launcher and split plan), the
//! bench variants and what they run, sweep-point shapes (DSV4 layer kinds), the bytes and FLOPs of a call, and the
//! timing of one point on random data. Plain structs only; the bench layer (`bench::kernels::sparse_attn`) turns
//! them into CSV rows.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use super::{
    check_call, combine_kernel, decode, launch_attention, launch_combine, reference, Combine,
    DecodeInputs, DecodeShape, DecodeWorkspace, Path, SplitPlan, ENTRY_BYTES, FAMILY,
    HEADS_PER_CTA, HEAD_DIM, WINDOW,
};
use crate::gpu::launch::{launch, KernelArgs, Launch, Stream};
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;

/// The baseline's attention kernel over the BF16 staging buffer (mma.sync).
const BF16_KERNEL: &str = "sparse_attn_decode_bf16";
/// Dynamic shared memory of `sparse_attn_decode_bf16` (mirrors `sa::kB16SmemBytes`).
const BF16_SMEM_BYTES: usize = 210_688;
/// The baseline's gather + dequantize step.
const GATHER_KERNEL: &str = "sparse_attn_gather_bf16";

/// The baseline's split plan (what its numbers were measured with): about one CTA per SM, but at least
/// `min(4, tiles)` tiles per split so that the f32 partials (H x 2 KiB per split) stay small next to the KV bytes
/// a split reads (37 KB per tile).
pub fn baseline_plan(sm_count: usize, shape: &DecodeShape) -> SplitPlan {
    let tiles = shape.tiles();
    let ctas_per_split = shape.batch * (shape.heads / HEADS_PER_CTA);
    let want_splits = sm_count.div_ceil(ctas_per_split).max(1);
    let tps = tiles.div_ceil(want_splits).max(tiles.min(4));
    SplitPlan {
        n_splits: tiles.div_ceil(tps),
        tiles_per_split: tps,
    }
}

/// The baseline the targets are measured against: `sparse_attn_gather_bf16` dequantizes every valid candidate
/// into the workspace's BF16 staging buffer (carved with `staging = true`), then `sparse_attn_decode_bf16`
/// (mma.sync) attends over it, and the warp-per-head merge combines split partials. Same contract and inputs as
/// [`decode`]; graph-capturable like it (the gather's grid is the stride, lengths are read on the device).
pub fn decode_bf16_staging(
    gpu: &Gpu,
    stream: &Stream,
    shape: &DecodeShape,
    inp: &DecodeInputs,
    ws: &DecodeWorkspace,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check_call(shape, inp, ws, out)?;
    let Some(staging) = ws.staging() else {
        bail!("the BF16 staging baseline needs a workspace carved with staging = true");
    };
    let gather = gpu.kernel(FAMILY, GATHER_KERNEL)?;
    let attn = gpu.kernel_with_smem(FAMILY, BF16_KERNEL, BF16_SMEM_BYTES)?;
    let merge = match ws.plan().n_splits {
        1 => None,
        n => Some(combine_kernel(gpu, Combine::WarpPerHead, shape, n)?),
    };
    // One warp per candidate, 8 per CTA: grid (ceil(stride / 8), batch).
    let mut a = KernelArgs::new();
    a.buf(staging)
        .buf(inp.pool)
        .i32(shape.n_entries as i32)
        .buf(inp.candidates)
        .i32(shape.stride as i32)
        .buf(inp.lengths);
    let l = Launch::new(
        (shape.stride.div_ceil(8) as u32, shape.batch as u32, 1),
        (256, 1, 1),
    );
    // SAFETY: argument list of sparse_attn_gather_bf16; staging holds batch * stride * 512 BF16 (carved for this
    // shape), the inputs were checked against the shape.
    unsafe { launch(stream, &gather, l, &mut a)? };
    launch_attention(
        stream,
        &attn,
        (BF16_SMEM_BYTES, 256),
        shape,
        inp,
        Some(staging),
        ws,
        out,
    )?;
    if let Some((k, l)) = merge {
        launch_combine(stream, &k, l, shape, inp, ws, out)?;
    }
    Ok(())
}

/// What a bench variant runs: a path of the routed entry point, or the baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    Path(Path),
    Bf16Staging,
}

impl Variant {
    /// The split plan the variant runs with: [`SplitPlan::fp8`] for every FP8 path, [`baseline_plan`] for the
    /// baseline.
    pub fn plan(self, sm_count: usize, shape: &DecodeShape) -> SplitPlan {
        match self {
            Variant::Path(_) => SplitPlan::fp8(sm_count, shape),
            Variant::Bf16Staging => baseline_plan(sm_count, shape),
        }
    }
    /// Whether its workspace needs the staging buffer.
    pub fn staging(self) -> bool {
        self == Variant::Bf16Staging
    }
    /// Run it (see [`decode`] and [`decode_bf16_staging`]).
    pub fn run(
        self,
        gpu: &Gpu,
        stream: &Stream,
        shape: &DecodeShape,
        inp: &DecodeInputs,
        ws: &DecodeWorkspace,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        match self {
            Variant::Path(p) => decode(gpu, stream, p, shape, inp, ws, out),
            Variant::Bf16Staging => decode_bf16_staging(gpu, stream, shape, inp, ws, out),
        }
    }
}

/// Kernel name of the bench rows (event-timed calls).
pub const KERNEL: &str = "sparse_attn_decode";
/// Kernel name of the graph-replay rows of a sweep with `graph = 1`: the same call captured once in a CUDA graph
/// and replayed ([`PointTiming::graph_samples_us`]), so the launch floor shows against [`KERNEL`]'s event time.
pub const KERNEL_GRAPH: &str = "sparse_attn_decode_graph";
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

/// What a bench variant name runs.
pub fn variant_of(name: &str) -> Result<Variant> {
    Ok(match name {
        "fp8" => Variant::Path(Path::Fp8),
        "fp8_combine_warp_per_head" => Variant::Path(Path::Fp8WarpPerHeadCombine),
        "fp8_combine_heads_per_thread" => Variant::Path(Path::Fp8HeadsPerThreadCombine),
        "bf16_staging" => Variant::Bf16Staging,
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
pub fn work(batch: usize, heads: usize, cands: usize, variant: Variant) -> (u64, u64) {
    let (b, h, l) = (batch as u64, heads as u64, cands as u64);
    let io = b * h * HEAD_DIM as u64 * 2 * 2; // q in + out, BF16
    let kv = match variant {
        Variant::Path(_) => b * l * ENTRY_BYTES as u64,
        // gather reads 584 B, writes 1024 B, the attention kernel reads 1024 B back.
        Variant::Bf16Staging => b * l * (ENTRY_BYTES as u64 + 2 * 2 * HEAD_DIM as u64),
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
    /// Microseconds per call, one sample per timed rep (an event pair around each call).
    pub samples_us: Vec<f64>,
    /// With `graph`: microseconds per replay of the call captured in a CUDA graph (an event pair around
    /// [`GRAPH_REPLAYS`] replays, divided by them), one sample per timed rep.
    pub graph_samples_us: Option<Vec<f64>>,
    pub bytes: u64,
    pub flops: u64,
    pub candidates: usize,
    /// The plan the call ran with.
    pub plan: SplitPlan,
}

/// Replays of the captured call between one event pair in the graph timing (the other families' graph benches use
/// the same count).
pub const GRAPH_REPLAYS: usize = 20;

/// Time one variant at one point on random data from `seed`: every sequence gets `candidates_per_query`
/// distinct valid entries of a shared pool, all lists full. The workspace is carved once, outside the timed
/// region. With `graph`, the call is also captured once in a CUDA graph (after the event-timed calls resolved its
/// kernels) and its replays timed.
pub fn time_point(
    gpu: &Gpu,
    variant: &str,
    point: BenchShape,
    plan: TimingPlan,
    seed: u64,
    graph: bool,
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
    let v = variant_of(variant)?;
    let split = v.plan(gpu.info.sm_count as usize, &shape);
    let mut out = gpu.zeros::<bf16>(batch * heads * HEAD_DIM)?;
    let (_arena, ws) = DecodeWorkspace::with_arena(gpu, &shape, split, v.staging())?;
    let stream = gpu.stream.clone();
    let samples_us = gpu.time_us(plan, || v.run(gpu, &stream, &shape, &inp, &ws, &mut out))?;
    let graph_samples_us = if graph {
        let g = gpu.capture(|| v.run(gpu, &stream, &shape, &inp, &ws, &mut out))?;
        Some(gpu.time_graph_us(&g, plan, GRAPH_REPLAYS)?)
    } else {
        None
    };
    let (bytes, flops) = work(batch, heads, cands, v);
    Ok(PointTiming {
        samples_us,
        graph_samples_us,
        bytes,
        flops,
        candidates: cands,
        plan: split,
    })
}
