//! Measurement hooks of the indexer family and its baseline (the seeds' path: dequantize -> fp32 einsum -> full
//! bitonic sort). The sweep adapter that turns bench-configs/indexer.toml points into calls of these hooks is
//! src/bench/kernels/indexer.rs.

use anyhow::{bail, ensure, Result};

use super::{
    logits, run_with, topk_with, write_keys, IndexerWorkspace, KeyCacheGpu, KeyFormat, QueryBatch,
    TopkOutput, TopkPath, FAMILY, HEAD_DIM, NUM_HEADS,
};
use crate::gpu::arena::{Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;

// ---------------------------------------------------------------------------------------------------------
// Baseline: the seeds' path.
// ---------------------------------------------------------------------------------------------------------

/// Scratch of the baseline: fp32 keys `[batch, capacity, 128]` and the sort buffer `[rows, npad]`, npad = the
/// next power of two >= capacity.
#[derive(Clone, Copy, Debug)]
pub struct BaselineWorkspace {
    pub keys_f32: DevBuf<f32>,
    pub sort: DevBuf<u64>,
    pub npad: usize,
}

impl BaselineWorkspace {
    fn npad(capacity: usize) -> usize {
        capacity.next_power_of_two().max(2)
    }
    pub fn workspace_bytes(batch: usize, rows: usize, capacity: usize) -> usize {
        let mut l = WorkspaceLayout::new();
        l.add::<f32>(batch * capacity * HEAD_DIM)
            .add::<u64>(rows * Self::npad(capacity));
        l.bytes()
    }
    pub fn carve(
        arena: &mut Arena,
        batch: usize,
        rows: usize,
        capacity: usize,
    ) -> Result<BaselineWorkspace> {
        let npad = Self::npad(capacity);
        Ok(BaselineWorkspace {
            keys_f32: arena.carve::<f32>(batch * capacity * HEAD_DIM, "baseline fp32 keys")?,
            sort: arena.carve::<u64>(rows * npad, "baseline sort buffer")?,
            npad,
        })
    }
}

/// Baseline logits: dequantize the visible keys to fp32, then an fp32 CUDA-core "einsum". Same output contract
/// as [`super::logits`] (grids from the capacity, num_valid read and clamped on the device).
pub fn baseline_logits(
    gpu: &Gpu,
    stream: &Stream,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    base: &BaselineWorkspace,
    scores: &impl DeviceBuf<f32>,
    score_stride: usize,
) -> Result<()> {
    ensure!(
        cache.batch == q.batch && base.keys_f32.len() >= cache.num_slots() * HEAD_DIM,
        "baseline workspace does not match the cache"
    );
    ensure!(
        scores.elems() >= q.rows() * score_stride && score_stride >= cache.capacity,
        "scores buffer too small"
    );
    let (fp4, next_n, cap) = (
        (cache.format == KeyFormat::Mxfp4) as i32,
        q.next_n as i32,
        cache.capacity as i32,
    );
    let k = gpu.kernel(FAMILY, "indexer_baseline_dequant")?;
    let mut a = KernelArgs::new();
    a.buf(&cache.codes)
        .buf(&cache.scales)
        .i32(fp4)
        .buf(&q.num_valid)
        .i32(next_n)
        .i32(cap)
        .buf(&base.keys_f32);
    let gx = (cache.capacity * HEAD_DIM).div_ceil(256) as u32;
    unsafe {
        launch(
            stream,
            &k,
            Launch::new((gx, q.batch as u32, 1), (256, 1, 1)),
            &mut a,
        )?
    };
    let smem = 2 * 64 * 129 * 4;
    let k = gpu.kernel_with_smem(FAMILY, "indexer_baseline_logits_f32", smem)?;
    let mut a = KernelArgs::new();
    a.buf(&q.q)
        .buf(&q.w)
        .buf(&base.keys_f32)
        .buf(&q.num_valid)
        .i32(next_n)
        .i32(cap)
        .buf(scores)
        .i32(score_stride as i32);
    let gx = cache.capacity.div_ceil(64) as u32;
    unsafe {
        launch(
            stream,
            &k,
            Launch::new((gx, q.batch as u32, 1), (256, 1, 1)).smem(smem),
            &mut a,
        )
    }
}

/// Baseline top-k: bitonic sort of every full row (one launch per compare-exchange step), then take k. Rows
/// are `score_stride` apart with `num_valid` (device) clamped to it; outputs `[rows, k]`.
#[allow(clippy::too_many_arguments)]
pub fn baseline_topk(
    gpu: &Gpu,
    stream: &Stream,
    scores: &impl DeviceBuf<f32>,
    score_stride: usize,
    num_valid: &impl DeviceBuf<i32>,
    rows: usize,
    k: usize,
    base: &BaselineWorkspace,
    out_idx: &impl DeviceBuf<i32>,
    out_score: &impl DeviceBuf<f32>,
) -> Result<()> {
    ensure!(
        base.sort.len() >= rows * base.npad && score_stride <= base.npad,
        "baseline sort buffer does not match"
    );
    ensure!(
        scores.elems() >= rows * score_stride
            && num_valid.elems() >= rows
            && out_idx.elems() >= rows * k
            && out_score.elems() >= rows * k,
        "baseline top-k buffers too small"
    );
    let (stride, npad) = (score_stride as i32, base.npad as i32);
    let init = gpu.kernel(FAMILY, "indexer_baseline_sort_init")?;
    let mut a = KernelArgs::new();
    a.buf(scores)
        .i32(stride)
        .buf(num_valid)
        .i32(npad)
        .buf(&base.sort);
    let grid = (base.npad.div_ceil(256) as u32, rows as u32, 1);
    unsafe { launch(stream, &init, Launch::new(grid, (256, 1, 1)), &mut a)? };
    let step = gpu.kernel(FAMILY, "indexer_baseline_bitonic_step")?;
    let pairs_grid = ((base.npad / 2).div_ceil(256) as u32, rows as u32, 1);
    let mut size = 2usize;
    while size <= base.npad {
        let mut st = size / 2;
        while st > 0 {
            let mut a = KernelArgs::new();
            a.buf(&base.sort).i32(npad).i32(size as i32).i32(st as i32);
            unsafe { launch(stream, &step, Launch::new(pairs_grid, (256, 1, 1)), &mut a)? };
            st /= 2;
        }
        size *= 2;
    }
    let gather = gpu.kernel(FAMILY, "indexer_baseline_sort_gather")?;
    let mut a = KernelArgs::new();
    a.buf(&base.sort)
        .i32(npad)
        .i32(stride)
        .buf(num_valid)
        .i32(k as i32)
        .buf(out_idx)
        .buf(out_score);
    let grid = (k.div_ceil(256) as u32, rows as u32, 1);
    unsafe { launch(stream, &gather, Launch::new(grid, (256, 1, 1)), &mut a) }
}

// ---------------------------------------------------------------------------------------------------------
// Bench inputs and timing.
// ---------------------------------------------------------------------------------------------------------

/// Random inputs of one sweep point on the device (keys written by the GPU writer; never zeros). The cache
/// capacity is `num_valid`: every launch covers exactly the visible entries.
pub struct BenchInputs {
    pub q: QueryBatch,
    pub cache: KeyCacheGpu,
    pub num_valid: usize,
}

pub fn bench_inputs(
    gpu: &Gpu,
    format: KeyFormat,
    batch: usize,
    next_n: usize,
    num_valid: usize,
    seed: u64,
) -> Result<BenchInputs> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let rows = batch * next_n;
    let q_codes: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
        .map(|_| super::reference::random_e4m3(&mut rng))
        .collect();
    let w: Vec<f32> = (0..rows * NUM_HEADS)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let nv = vec![num_valid as i32; rows];
    let q = QueryBatch::upload(gpu, batch, next_n, &q_codes, &w, &nv)?;
    let capacity = num_valid.max(1);
    let mut cache = KeyCacheGpu::filled(gpu, format, batch, capacity, 0)?;
    // Raw keys in slabs so the host buffer stays small.
    let per = 65536usize;
    let total = batch * capacity;
    let mut start = 0;
    while start < total {
        let n = per.min(total - start);
        let raw: Vec<f32> = (0..n * HEAD_DIM)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let slots: Vec<i32> = (start..start + n).map(|s| s as i32).collect();
        let raw_dev = gpu.upload(&raw)?;
        let slots_dev = cache.upload_slots(gpu, &slots)?;
        write_keys(gpu, &gpu.stream, &mut cache, &raw_dev, &slots_dev)?;
        start += n;
    }
    gpu.synchronize()?;
    Ok(BenchInputs {
        q,
        cache,
        num_valid,
    })
}

/// Timing samples (us) of one variant: logits alone, top-k alone, both back to back.
pub struct IndexerSamples {
    pub logits: Vec<f64>,
    pub topk: Vec<f64>,
    pub total: Vec<f64>,
}

/// Bench variants of the indexer: "fused" (the routed kernels, [`super::run`]), "baseline" (the seeds' path),
/// `fused_chain` / `fused_pdl` (the top-k forced to [`TopkPath::Chain`] / [`TopkPath::Pdl`]: they decide
/// [`super::TOPK_PDL_MAX_K`]), and `graph_<variant>`: the same calls captured once into CUDA graphs and replayed
/// (logits alone, top-k alone, the whole call), i.e. device time as a decode step's graph sees it, without host
/// launch gaps.
pub const VARIANTS: &[&str] = &[
    "fused",
    "baseline",
    "fused_chain",
    "fused_pdl",
    "graph_fused",
    "graph_fused_chain",
    "graph_fused_pdl",
];

/// The top-k path of a fused variant name (without the `graph_` prefix).
fn variant_path(fused_variant: &str) -> Option<TopkPath> {
    match fused_variant {
        "fused" => Some(TopkPath::Default),
        "fused_chain" => Some(TopkPath::Chain),
        "fused_pdl" => Some(TopkPath::Pdl),
        _ => None,
    }
}

/// Graph replays per timed sample of the graph_* variants: ONE, so that every replay sees the L2 state the
/// plan asks for (with `flush_l2`, the 34.6 MB of keys at 1M / batch 1 would otherwise stay in the 50 MB L2
/// from the previous replay, which a decode step, with other layers in between, never sees). The replay is
/// still free of host gaps: the flush (a 128 MB memset, tens of us) is enqueued before the start event, so
/// the host has enqueued the event and the graph long before the device reaches them.
const GRAPH_REPLAYS_PER_SAMPLE: usize = 1;

/// Time one of [`VARIANTS`] on the GPU's default stream.
pub fn time_variant(
    gpu: &Gpu,
    variant: &str,
    inp: &BenchInputs,
    k: usize,
    plan: TimingPlan,
) -> Result<IndexerSamples> {
    let (q, cache) = (&inp.q, &inp.cache);
    let (rows, cap) = (q.rows(), cache.capacity);
    let stream = &gpu.stream;
    let mut arena = Arena::new(gpu, IndexerWorkspace::workspace_bytes(rows, cap, k))?;
    let ws = IndexerWorkspace::carve(&mut arena, stream, rows, cap, k)?;
    let out = TopkOutput::new(gpu, rows, k)?;
    let (scores, stride) = (ws.scores, ws.score_stride);
    let logits_call = || logits(gpu, stream, q, cache, &scores, stride);
    if let Some(path) = variant_path(variant) {
        let topk_call = || {
            topk_with(
                gpu,
                stream,
                path,
                &scores,
                &q.num_valid,
                &ws.topk,
                &out.idx,
                &out.score,
            )
        };
        let run_call = || run_with(gpu, stream, path, q, cache, &ws, &out.idx, &out.score);
        return Ok(IndexerSamples {
            logits: gpu.time_us(plan, logits_call)?,
            topk: gpu.time_us(plan, topk_call)?,
            total: gpu.time_us(plan, run_call)?,
        });
    }
    if let Some(path) = variant.strip_prefix("graph_").and_then(variant_path) {
        let topk_call = || {
            topk_with(
                gpu,
                stream,
                path,
                &scores,
                &q.num_valid,
                &ws.topk,
                &out.idx,
                &out.score,
            )
        };
        let run_call = || run_with(gpu, stream, path, q, cache, &ws, &out.idx, &out.score);
        // One eager call first: loads the module and sets the function attributes (not capturable), and
        // leaves the scores in place for the top-k-only graph.
        run_call()?;
        gpu.synchronize()?;
        let logits_g = gpu.capture(logits_call)?;
        let topk_g = gpu.capture(topk_call)?;
        let total_g = gpu.capture(run_call)?;
        let n = GRAPH_REPLAYS_PER_SAMPLE;
        return Ok(IndexerSamples {
            logits: gpu.time_graph_us(&logits_g, plan, n)?,
            topk: gpu.time_graph_us(&topk_g, plan, n)?,
            total: gpu.time_graph_us(&total_g, plan, n)?,
        });
    }
    if variant != "baseline" {
        bail!(
            "unknown indexer variant `{variant}` (expected one of {})",
            VARIANTS.join(", ")
        );
    }
    let mut base_arena = Arena::new(gpu, BaselineWorkspace::workspace_bytes(q.batch, rows, cap))?;
    let base = BaselineWorkspace::carve(&mut base_arena, q.batch, rows, cap)?;
    let b_logits = || baseline_logits(gpu, stream, q, cache, &base, &scores, stride);
    let b_topk = || {
        baseline_topk(
            gpu,
            stream,
            &scores,
            stride,
            &q.num_valid,
            rows,
            k,
            &base,
            &out.idx,
            &out.score,
        )
    };
    Ok(IndexerSamples {
        logits: gpu.time_us(plan, b_logits)?,
        topk: gpu.time_us(plan, b_topk)?,
        total: gpu.time_us(plan, || {
            b_logits()?;
            b_topk()
        })?,
    })
}

/// Bytes one call moves: (logits: keys + q + w read, scores written; top-k: scores read, k x 8 B written).
pub fn traffic_bytes(inp: &BenchInputs, k: usize) -> (u64, u64) {
    let (q, cache) = (&inp.q, &inp.cache);
    let n = inp.num_valid;
    let rows = q.rows();
    let key_bytes = q.batch * cache.bytes_for(n);
    let logits = key_bytes + rows * NUM_HEADS * (HEAD_DIM + 4) + rows * n * 4;
    let topk = rows * n * 4 + rows * k * 8;
    (logits as u64, topk as u64)
}
