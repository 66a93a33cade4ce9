//! Lightning indexer (DSV4 §3.8): index-key cache writer, weighted-ReLU MQA logits on FP8 tensor cores, and an
//! exact, deadlock-free top-k. Device code and its design notes: kernels/indexer.cu. CPU reference:
//! [`reference`]. Baselines and bench hooks: [`bench`]. Stress suite with a host-side watchdog: [`stress`].
//!
//! Routed path: FP8 keys -> wgmma logits fed by a TMA + mbarrier ring (`indexer_logits_fp8_n1/_n2`), MXFP4 keys ->
//! the e4m3 mma.sync logits (`indexer_logits_mxfp4_n1/_n2`); top-k ([`topk`]) = histogram -> CTA-aggregated
//! threshold select -> multi-CTA exact final pass (`indexer_topk_hist`, `indexer_topk_select`,
//! `indexer_topk_final`), launched through their PDL entry points when k <= [`TOPK_PDL_MAX_K`].
//!
//! Contracts:
//! * Rows are `b * next_n + t` (next_n = 1 or 2); `num_valid[row]` entries of sequence `b` are visible to row
//!   `row`. q is e4m3 `[rows, 64, 128]` (Hadamard-rotated like the keys), `w` f32 `[rows, 64]` with the per-token
//!   q scale folded in (relu(s x) = s relu(x) for s > 0).
//! * `num_valid` is read on the device only: every grid is sized from capacities (the cache capacity, the score
//!   row length), so one captured call replays correctly for any device-side `num_valid`. A device value below
//!   0 counts as 0; above the capacity it is clamped: the logits to the cache capacity, the top-k to its score
//!   row length `score_stride` (equal to the capacity in [`run`]). Host-made `num_valid` is checked when it is
//!   uploaded ([`QueryBatch::upload`]).
//! * Top-k returns, per row, exactly `min(k, num_valid)` indices ordered by (score desc, index asc), then `-1`;
//!   the scores alongside (`-inf` on padding).
//! * NaN / Inf policy: [`QueryBatch::upload`] rejects NaN e4m3 q codes and non-finite `w` before any launch. A
//!   NaN score that still arises (e.g. a NaN fp32 key scale in a cache written elsewhere) ranks as `-inf`; `-inf`
//!   scores are ordinary (lowest) values; `-0` ranks as `+0`. ReLU is `fmaxf(x, 0)` (NaN -> 0). The CPU
//!   reference follows the same rules and the stress suite tests them.
//! * Launchers allocate nothing: scratch comes from a caller's [`Arena`] ([`TopkWorkspace`],
//!   [`IndexerWorkspace`], sized by their `workspace_bytes`), outputs are the caller's buffers, and every launch
//!   goes on the caller's stream. A sequence of calls can be captured in a CUDA graph and replayed.

pub mod bench;
pub mod exec;
pub mod reference;
pub mod stress;

use anyhow::{bail, ensure, Result};
use cudarc::driver::CudaSlice;

use crate::formats::e4m3;
use crate::gpu::arena::{self, Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
pub use exec::{exec_kernels, parse_exec_inputs};
pub use reference::{KeyCacheHost, KeyFormat, HEAD_DIM, NUM_HEADS};

/// Kernel family name (kernels/indexer.cu).
pub const FAMILY: &str = "indexer";
/// Largest supported k (kernel constant TOPK_MAX_K).
pub const TOPK_MAX_K: usize = 2048;
/// Histogram bins of the top-k (kernel constant TKS_BINS: the top 12 bits of the order key).
pub const TOPK_BINS: usize = 4096;
/// Entries per histogram / select CTA (kernel constant TKS_SLICE) and their block size.
const TOPK_SLICE: usize = 4096;
const TOPK_SLICE_THREADS: u32 = 512;
/// Block size of the multi-CTA final pass (kernel constant TKF_THREADS).
const TOPK_FINAL_THREADS: u32 = 512;
/// Fewest / most CTAs per row of `indexer_topk_final` (the kernel's static rank arrays assume >= 8).
pub const TOPK_FINAL_MIN_CTAS_PER_ROW: u32 = 8;
pub const TOPK_FINAL_MAX_CTAS_PER_ROW: u32 = 64;
/// Threshold-bucket composites the final pass ranks in shared memory (kernel TKF_BUCKET_CAP); larger buckets
/// (heavy ties) take its one-CTA radix-select fallback.
pub const TOPK_BUCKET_CAP: usize = 4096;
/// Largest k for which [`topk`] launches the chain through its PDL entry points ([`TopkPath::Pdl`]). Decided by
/// results/h200/archive/session6-ab/indexer.csv (variants `fused` = plain chain, `fused_pdl`): PDL won at every k = 512
/// point and lost at k = 1024 from batch 16 at 1M context, where dependent CTAs launched early hold SM slots the
/// running kernel still needs.
pub const TOPK_PDL_MAX_K: usize = 512;
/// Keys per MXFP4 logits CTA (kernel constant LG_CTA_KEYS) and its block size.
const MXFP4_CTA_KEYS: usize = 1024;
const MXFP4_THREADS: u32 = 256;

/// An index-key cache on the device: the same two planes as [`KeyCacheHost`].
pub struct KeyCacheGpu {
    pub format: KeyFormat,
    pub batch: usize,
    pub capacity: usize,
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
}

impl KeyCacheGpu {
    pub fn upload(gpu: &Gpu, host: &KeyCacheHost) -> Result<KeyCacheGpu> {
        ensure!(
            host.capacity > 0 && host.batch > 0,
            "empty key cache ({} x {})",
            host.batch,
            host.capacity
        );
        ensure!(
            host.codes.len() == host.batch * host.capacity * host.format.code_bytes()
                && host.scales.len() == host.batch * host.capacity * reference::SCALE_BYTES,
            "key cache planes have the wrong length"
        );
        Ok(KeyCacheGpu {
            format: host.format,
            batch: host.batch,
            capacity: host.capacity,
            codes: gpu.upload(&host.codes)?,
            scales: gpu.upload(&host.scales)?,
        })
    }

    /// A cache with every byte set to `pattern` (0xFF poisons: NaN codes and scales).
    pub fn filled(
        gpu: &Gpu,
        format: KeyFormat,
        batch: usize,
        capacity: usize,
        pattern: u8,
    ) -> Result<KeyCacheGpu> {
        ensure!(
            capacity > 0 && batch > 0,
            "empty key cache ({batch} x {capacity})"
        );
        Ok(KeyCacheGpu {
            format,
            batch,
            capacity,
            codes: gpu.poisoned::<u8>(batch * capacity * format.code_bytes(), pattern)?,
            scales: gpu.poisoned::<u8>(batch * capacity * reference::SCALE_BYTES, pattern)?,
        })
    }

    pub fn download(&self, gpu: &Gpu) -> Result<KeyCacheHost> {
        Ok(KeyCacheHost {
            format: self.format,
            batch: self.batch,
            capacity: self.capacity,
            codes: gpu.download(&self.codes)?,
            scales: gpu.download(&self.scales)?,
        })
    }

    /// Entry slots of the cache (`batch * capacity`): the valid range of a writer slot.
    pub fn num_slots(&self) -> usize {
        self.batch * self.capacity
    }

    /// Bytes of the first `n` entries of one sequence (what a logits pass reads).
    pub fn bytes_for(&self, n: usize) -> usize {
        n * self.format.entry_bytes()
    }

    /// Check host-made writer slots (`b * capacity + j`, each in `0..num_slots()`) and upload them.
    pub fn upload_slots(&self, gpu: &Gpu, slots: &[i32]) -> Result<CudaSlice<i32>> {
        let num_slots = self.num_slots();
        if let Some((i, s)) = slots
            .iter()
            .enumerate()
            .find(|(_, &s)| s < 0 || s as usize >= num_slots)
        {
            bail!("slot {s} of key {i} is outside the cache (0..{num_slots})");
        }
        gpu.upload(slots)
    }
}

/// Quantize `slots.elems()` new raw keys (`raw`: f32 `[n, 128]` on the device, before the Hadamard transform)
/// into the cache at the flat entry slots `slots[i] = b * capacity + j`, read on the device (a decode step's
/// graph writes the slots it is given without any host value). A device slot outside `0..batch * capacity` is
/// skipped (nothing written); host-made slots are checked by [`KeyCacheGpu::upload_slots`].
pub fn write_keys(
    gpu: &Gpu,
    stream: &Stream,
    cache: &mut KeyCacheGpu,
    raw: &impl DeviceBuf<f32>,
    slots: &impl DeviceBuf<i32>,
) -> Result<()> {
    let n = slots.elems();
    ensure!(
        raw.elems() >= n * HEAD_DIM,
        "raw keys hold {} floats, expected {n} x 128",
        raw.elems()
    );
    let num_slots = cache.num_slots();
    ensure!(
        num_slots <= i32::MAX as usize && n <= i32::MAX as usize,
        "cache or key count too large for i32 slots"
    );
    if n == 0 {
        return Ok(());
    }
    let name = match cache.format {
        KeyFormat::Fp8 => "indexer_write_keys_fp8",
        KeyFormat::Mxfp4 => "indexer_write_keys_mxfp4",
    };
    let k = gpu.kernel(FAMILY, name)?;
    let mut a = KernelArgs::new();
    a.buf(raw)
        .buf(slots)
        .i32(n as i32)
        .i32(num_slots as i32)
        .buf(&cache.codes)
        .buf(&cache.scales);
    // One warp per key, 8 keys per 256-thread CTA.
    let grid = (n.div_ceil(8) as u32, 1, 1);
    unsafe { launch(stream, &k, Launch::new(grid, (256, 1, 1)), &mut a) }
}

/// Queries of one call: `batch` sequences x `next_n` tokens. `num_valid` lives on the device only; change it
/// between graph replays with [`Gpu::write`].
pub struct QueryBatch {
    pub batch: usize,
    pub next_n: usize,
    pub q: CudaSlice<u8>,
    pub w: CudaSlice<f32>,
    pub num_valid: CudaSlice<i32>,
}

impl QueryBatch {
    /// Validate (shapes, next_n in {1, 2}, no NaN q code, finite w, num_valid >= 0) and upload.
    pub fn upload(
        gpu: &Gpu,
        batch: usize,
        next_n: usize,
        q_codes: &[u8],
        w: &[f32],
        num_valid: &[i32],
    ) -> Result<QueryBatch> {
        validate_queries(batch, next_n, q_codes, w, num_valid)?;
        Ok(QueryBatch {
            batch,
            next_n,
            q: gpu.upload(q_codes)?,
            w: gpu.upload(w)?,
            num_valid: gpu.upload(num_valid)?,
        })
    }
    pub fn rows(&self) -> usize {
        self.batch * self.next_n
    }
}

/// The launcher's input policy, callable without a GPU (the tests exercise it on the CPU).
pub fn validate_queries(
    batch: usize,
    next_n: usize,
    q_codes: &[u8],
    w: &[f32],
    num_valid: &[i32],
) -> Result<()> {
    ensure!(batch > 0, "batch must be at least 1");
    ensure!(
        next_n == 1 || next_n == 2,
        "next_n = {next_n}: only 1 and 2 query tokens per sequence are supported"
    );
    let rows = batch * next_n;
    ensure!(
        q_codes.len() == rows * NUM_HEADS * HEAD_DIM,
        "q holds {} codes, expected {rows} x 64 x 128",
        q_codes.len()
    );
    ensure!(
        w.len() == rows * NUM_HEADS,
        "w holds {} weights, expected {rows} x 64",
        w.len()
    );
    ensure!(
        num_valid.len() == rows,
        "num_valid has {} entries, expected one per row ({rows})",
        num_valid.len()
    );
    if let Some(i) = q_codes.iter().position(|&c| c & 0x7F == e4m3::NAN_CODE) {
        bail!(
            "q code {i} is an e4m3 NaN (0x{:02X}): rejected before launch",
            q_codes[i]
        );
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        bail!("w[{i}] = {} is not finite: rejected before launch", w[i]);
    }
    if let Some(i) = num_valid.iter().position(|&n| n < 0) {
        bail!("num_valid[{i}] = {} is negative", num_valid[i]);
    }
    Ok(())
}

/// Keys per tile of the FP8 logits (kernel constant LW_KEYS: the wgmma M).
const FP8_TILE_KEYS: usize = 64;
/// The FP8 logits kernels: entry points, ring stages per next_n, CTAs per SM and block size (kernel constants of
/// `INDEXER_LOGITS_TMA_ENTRY` / `LT_THREADS`).
const FP8_N1: &str = "indexer_logits_fp8_n1";
const FP8_N2: &str = "indexer_logits_fp8_n2";
const FP8_STAGES_N1: usize = 7;
const FP8_STAGES_N2: usize = 6;
const FP8_CTAS_PER_SM: usize = 3;
const FP8_THREADS: u32 = 128 + 32;

/// Key scales per TMA scale box (kernel `LT_SCALE_BOX`): a tile's 64 rows + up to 3 rows of slack, because the
/// box starts at the tile's first slot rounded down to a multiple of 4 (a TMA box must start 16-byte aligned in
/// global memory).
pub const TMA_SCALE_BOX: usize = FP8_TILE_KEYS + 4;
/// Shared-memory bytes per ring stage of the scale boxes (kernel `LT_SCALE_STAGE_BYTES`): the 272-byte box
/// rounded up to the TMA destination alignment of 128 bytes.
const TMA_SCALE_STAGE_BYTES: usize = (TMA_SCALE_BOX * 4).next_multiple_of(128);

/// First element of the scale box of the tile starting at plane slot `slot0`, and the element of that box that
/// holds `slot0`'s scale (kernel: `slot0 & ~3`, `slot0 & 3`). Mirrored here for the CPU test of the alignment
/// rule.
pub const fn tma_scale_box_start(slot0: usize) -> (usize, usize) {
    (slot0 & !3, slot0 & 3)
}

/// Dynamic shared memory of the FP8 logits (kernel `lt_smem_bytes<NEXT_N, STAGES>`): 1 KB alignment slack +
/// `stages` x (8 KB codes + 384 B scale box) + q (8 KB per query token) + a full and an empty mbarrier per stage.
const fn fp8_smem_bytes(next_n: usize, stages: usize) -> usize {
    1024 + stages * (FP8_TILE_KEYS * HEAD_DIM + TMA_SCALE_STAGE_BYTES)
        + next_n * NUM_HEADS * HEAD_DIM
        + 2 * stages * 8
}

// FP8_CTAS_PER_SM CTAs (each with 1 KB of shared memory reserved by the hardware) must fit the H200's 228 KB of
// shared memory per SM for both query widths, or the persistent grid would not be resident at once.
const _: () = assert!(
    FP8_CTAS_PER_SM * (fp8_smem_bytes(1, FP8_STAGES_N1) + 1024) <= 228 * 1024
        && FP8_CTAS_PER_SM * (fp8_smem_bytes(2, FP8_STAGES_N2) + 1024) <= 228 * 1024
);

/// Scores `[rows, score_stride]`: rows of sequence `b` get scores for every `j < max_t min(num_valid[b * next_n +
/// t], capacity)`; nothing past that is written. `score_stride >= cache.capacity`. Grids come from the cache
/// capacity; the kernels read `num_valid` on the device and skip tiles past it. FP8 keys: native wgmma e4m3 (not
/// bit-identical to an fp32-accumulated dot product: the FP8 tensor core's accumulation keeps fewer bits, see
/// kernels/indexer.cu; tests bound it by 2^-9 of `sum_h |w_h| sum_d |q_hd k_jd|`). MXFP4 keys: e4m3 mma.sync
/// with fp32 block-scale steps.
pub fn logits(
    gpu: &Gpu,
    stream: &Stream,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    scores: &impl DeviceBuf<f32>,
    score_stride: usize,
) -> Result<()> {
    logits_mapped(
        gpu,
        stream,
        q,
        cache,
        None::<&DevBuf<i32>>,
        scores,
        score_stride,
    )
}

/// [`logits`] with a key-sequence map: query sequence `b` (rows `b * next_n + t`) scores the keys of cache
/// sequence `key_seq[b]` (i32 `[q.batch]`, read on the device; every value must be in `0..cache.batch`), each row
/// up to its own `num_valid`. `None` is the identity (`cache.batch == q.batch`). With a map, several query
/// sequences may share one cache sequence: the engine's prefill chunk runs C query rows (batch C, next_n 1) of
/// one sequence, row `i` seeing the keys emitted up to its position.
pub fn logits_mapped(
    gpu: &Gpu,
    stream: &Stream,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    key_seq: Option<&impl DeviceBuf<i32>>,
    scores: &impl DeviceBuf<f32>,
    score_stride: usize,
) -> Result<()> {
    match key_seq {
        None => ensure!(
            cache.batch == q.batch,
            "cache has {} sequences, queries {}",
            cache.batch,
            q.batch
        ),
        Some(m) => ensure!(
            m.elems() >= q.batch && cache.batch >= 1,
            "key_seq holds {} entries for {} query sequences",
            m.elems(),
            q.batch
        ),
    }
    ensure!(
        q.num_valid.len() >= q.rows(),
        "num_valid holds {} entries, expected {}",
        q.num_valid.len(),
        q.rows()
    );
    ensure!(
        score_stride >= cache.capacity,
        "score_stride {score_stride} is shorter than the cache capacity {}",
        cache.capacity
    );
    ensure!(
        scores.elems() >= q.rows() * score_stride,
        "scores buffer holds {} floats, need {}",
        scores.elems(),
        q.rows() * score_stride
    );
    ensure!(
        cache.num_slots() <= i32::MAX as usize && score_stride <= i32::MAX as usize,
        "logits: {} sequences x {} entries exceed the kernels' i32 indexing",
        cache.batch,
        cache.capacity
    );
    match cache.format {
        KeyFormat::Fp8 => logits_fp8(gpu, stream, q, cache, key_seq, scores, score_stride),
        KeyFormat::Mxfp4 => {
            ensure!(
                q.batch <= 65_535,
                "logits: batch {} exceeds the grid's y limit",
                q.batch
            );
            let name = match q.next_n {
                1 => "indexer_logits_mxfp4_n1",
                _ => "indexer_logits_mxfp4_n2",
            };
            let k = gpu.kernel(FAMILY, name)?;
            let mut a = KernelArgs::new();
            a.buf(&q.q)
                .buf(&q.w)
                .buf(&cache.codes)
                .buf(&cache.scales)
                .buf(&q.num_valid);
            match key_seq {
                Some(m) => a.buf(m),
                None => a.null(),
            };
            a.i32(cache.capacity as i32)
                .buf(scores)
                .i32(score_stride as i32);
            // A CTA whose first key is at or past its sequence's num_valid returns before its only barrier.
            let grid = (
                cache.capacity.div_ceil(MXFP4_CTA_KEYS) as u32,
                q.batch as u32,
                1,
            );
            unsafe { launch(stream, &k, Launch::new(grid, (MXFP4_THREADS, 1, 1)), &mut a) }
        }
    }
}

/// The FP8 logits launch (arguments checked by [`logits`]). The persistent grid walks the flattened (sequence,
/// tile) list of the whole capacity; tiles past a sequence's device num_valid are skipped by the kernel. The two
/// tensor maps cover exactly the cache's planes (`batch * capacity` entries), so a tile's rows past `num_valid`
/// read allocated cache bytes (discarded by the kernel) and rows past the plane's end are zero-filled by the TMA.
fn logits_fp8(
    gpu: &Gpu,
    stream: &Stream,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    key_seq: Option<&impl DeviceBuf<i32>>,
    scores: &impl DeviceBuf<f32>,
    score_stride: usize,
) -> Result<()> {
    use cudarc::driver::sys::{CUtensorMapDataType, CUtensorMapSwizzle};
    let (name, stages) = match q.next_n {
        1 => (FP8_N1, FP8_STAGES_N1),
        _ => (FP8_N2, FP8_STAGES_N2),
    };
    let tiles_per_seq = cache.capacity.div_ceil(FP8_TILE_KEYS);
    let total_tiles = tiles_per_seq * q.batch;
    let entries = cache.num_slots();
    ensure!(
        total_tiles <= i32::MAX as usize,
        "fp8 logits: {} sequences x {} tiles exceed the kernel's i32 indexing",
        q.batch,
        tiles_per_seq
    );
    ensure!(
        cache.codes.len() == entries * HEAD_DIM && cache.scales.len() == entries * 4,
        "fp8 logits: key cache planes have the wrong length"
    );
    let codes_map = crate::gpu::tma::encode_tiled(
        "fp8 logits key codes",
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        1,
        cache.codes.device_addr(),
        &[HEAD_DIM as u64, entries as u64],
        &[HEAD_DIM as u64],
        &[HEAD_DIM as u32, FP8_TILE_KEYS as u32],
        CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )?;
    let scales_map = crate::gpu::tma::encode_tiled(
        "fp8 logits key scales",
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        4,
        cache.scales.device_addr(),
        &[entries as u64],
        &[],
        &[TMA_SCALE_BOX as u32],
        CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    )?;
    let smem = fp8_smem_bytes(q.next_n, stages);
    // The persistent grid assumes FP8_CTAS_PER_SM resident CTAs: the largest shared-memory carveout.
    let k = gpu.kernel_with_max_carveout(FAMILY, name, smem)?;
    let persistent = (gpu.info.sm_count.max(1) as usize) * FP8_CTAS_PER_SM;
    let grid_x = total_tiles.min(persistent) as u32;
    let mut a = KernelArgs::new();
    a.pod(&codes_map)
        .pod(&scales_map)
        .buf(&q.q)
        .buf(&q.w)
        .buf(&q.num_valid);
    match key_seq {
        Some(m) => a.buf(m),
        None => a.null(),
    };
    a.i32(cache.capacity as i32)
        .buf(scores)
        .i32(score_stride as i32)
        .i32(tiles_per_seq as i32)
        .i32(total_tiles as i32);
    unsafe {
        launch(
            stream,
            &k,
            Launch::new((grid_x, 1, 1), (FP8_THREADS, 1, 1)).smem(smem),
            &mut a,
        )
    }
}

/// Top-k outputs of `rows` rows: indices `[rows, k]` and scores `[rows, k]`.
pub struct TopkOutput {
    pub rows: usize,
    pub k: usize,
    pub idx: CudaSlice<i32>,
    pub score: CudaSlice<f32>,
}

impl TopkOutput {
    /// Poisoned outputs (0xFF: index -1, score NaN).
    pub fn new(gpu: &Gpu, rows: usize, k: usize) -> Result<TopkOutput> {
        Ok(TopkOutput {
            rows,
            k,
            idx: gpu.poisoned::<i32>(rows * k, 0xFF)?,
            score: gpu.poisoned::<f32>(rows * k, 0xFF)?,
        })
    }
    /// Fill both outputs with `pattern` (0xFF poisons) on `stream`.
    pub fn fill(&mut self, stream: &Stream, pattern: u8) -> Result<()> {
        crate::gpu::fill_bytes_on(stream, &mut self.idx, pattern)?;
        crate::gpu::fill_bytes_on(stream, &mut self.score, pattern)
    }
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<i32>, Vec<f32>)> {
        Ok((gpu.download(&self.idx)?, gpu.download(&self.score)?))
    }
}

/// Scratch of the top-k for `rows` rows of `score_stride` scores and a given k, carved from an [`Arena`].
/// `hist`, `counters` and `arrivals` must be zero before a call: [`TopkWorkspace::carve`] zeroes them and the
/// final pass leaves them zero (kernels/indexer.cu, "Reset protocol"), so back-to-back calls and graph replays
/// need no memset. A call that failed between its launches leaves them undefined: call
/// [`TopkWorkspace::reset`] before the next one.
#[derive(Clone, Copy, Debug)]
pub struct TopkWorkspace {
    pub rows: usize,
    pub k: usize,
    /// Scores per row (the row stride of the scores the top-k reads, and the clamp of a device num_valid).
    pub score_stride: usize,
    hist: DevBuf<u32>,
    counters: DevBuf<u32>,
    above: DevBuf<u64>,
    bucket: DevBuf<u64>,
    arrivals: DevBuf<u32>,
}

impl TopkWorkspace {
    fn check_shape(rows: usize, k: usize, score_stride: usize) -> Result<()> {
        ensure!(
            (1..=TOPK_MAX_K).contains(&k),
            "k = {k}: supported 1..={TOPK_MAX_K}"
        );
        ensure!(
            (1..=65_535).contains(&rows),
            "top-k: {rows} rows (1..=65,535: the grid's y limit)"
        );
        ensure!(
            (1..i32::MAX as usize / 2).contains(&score_stride),
            "top-k: score_stride {score_stride} outside 1..2^30"
        );
        Ok(())
    }

    /// The carves of a workspace for this shape (in [`TopkWorkspace::carve`]'s order).
    pub fn layout(rows: usize, k: usize, score_stride: usize) -> WorkspaceLayout {
        let mut l = WorkspaceLayout::new();
        l.add::<u32>(rows * TOPK_BINS)
            .add::<u32>(rows * 2)
            .add::<u64>(rows * k)
            .add::<u64>(rows * score_stride)
            .add::<u32>(rows);
        l
    }

    /// Bytes of arena a workspace of this shape needs.
    pub fn workspace_bytes(rows: usize, k: usize, score_stride: usize) -> usize {
        Self::layout(rows, k, score_stride).bytes()
    }

    /// Carve a workspace from `arena` and zero its protocol buffers on `stream`.
    pub fn carve(
        arena: &mut Arena,
        stream: &Stream,
        rows: usize,
        k: usize,
        score_stride: usize,
    ) -> Result<TopkWorkspace> {
        Self::check_shape(rows, k, score_stride)?;
        let ws = TopkWorkspace {
            rows,
            k,
            score_stride,
            hist: arena.carve::<u32>(rows * TOPK_BINS, "top-k histogram")?,
            counters: arena.carve::<u32>(rows * 2, "top-k counters")?,
            above: arena.carve::<u64>(rows * k, "top-k above-threshold composites")?,
            bucket: arena.carve::<u64>(rows * score_stride, "top-k threshold bucket")?,
            arrivals: arena.carve::<u32>(rows, "top-k arrival counters")?,
        };
        ws.reset(stream)?;
        Ok(ws)
    }

    /// Zero the buffers the kernels expect zero on entry (after an interrupted call, or a poisoned arena).
    pub fn reset(&self, stream: &Stream) -> Result<()> {
        arena::fill(stream, &self.hist, 0)?;
        arena::fill(stream, &self.counters, 0)?;
        arena::fill(stream, &self.arrivals, 0)
    }
}

/// CTAs per row of the multi-CTA final pass: about two CTAs per SM in one wave (512 threads, 41-53 KB of
/// shared memory each): `2 * sm_count / rows`, clamped to 8..=32 (132 SMs: 32 at 1-8 rows, 16 at 16, 8 from
/// 33). Always within `TOPK_FINAL_MIN_CTAS_PER_ROW..=TOPK_FINAL_MAX_CTAS_PER_ROW`.
fn topk_final_ctas_per_row(gpu: &Gpu, rows: usize) -> u32 {
    (2 * gpu.info.sm_count as usize / rows.max(1)).clamp(8, 32) as u32
}

/// Dynamic shared memory of `indexer_topk_final` for `k`: the above / sort buffer (next power of two >= k, + 2
/// pad slots) and the bucket buffer (TKF_BUCKET_CAP + 2), 8 bytes each (kernel: tkf_above_slots).
pub fn topk_final_smem_bytes(k: usize) -> usize {
    8 * (k.next_power_of_two().max(2) + 2 + TOPK_BUCKET_CAP + 2)
}

/// Which top-k launch mode a call uses ([`TopkPath::Default`] is [`topk`]). Every path has the same contract and
/// bit-identical outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TopkPath {
    /// [`topk`]: [`TopkPath::Pdl`] for k <= [`TOPK_PDL_MAX_K`], else [`TopkPath::Chain`].
    #[default]
    Default,
    /// Three plain launches (bench `fused_chain`; forced to re-measure the [`TOPK_PDL_MAX_K`] rule).
    Chain,
    /// The chain's kernels through their PDL entry points: each launch overlaps the previous kernel's tail
    /// (bench `fused_pdl`; forced to re-measure the [`TOPK_PDL_MAX_K`] rule).
    Pdl,
}

/// Top-k of the `ws.rows` score rows (`ws.score_stride` floats apart; `num_valid` per row, read on the device and
/// clamped to `0..=score_stride`): exactly `min(k, num_valid)` indices per row ordered by (score desc, index asc),
/// then -1 (see the module contract), into `out_idx` / `out_score` (`[rows, k]` each). Three launches, through
/// their PDL entry points when k <= [`TOPK_PDL_MAX_K`]; grids come from `rows` and `score_stride` only.
pub fn topk(
    gpu: &Gpu,
    stream: &Stream,
    scores: &impl DeviceBuf<f32>,
    num_valid: &impl DeviceBuf<i32>,
    ws: &TopkWorkspace,
    out_idx: &impl DeviceBuf<i32>,
    out_score: &impl DeviceBuf<f32>,
) -> Result<()> {
    topk_with(
        gpu,
        stream,
        TopkPath::Default,
        scores,
        num_valid,
        ws,
        out_idx,
        out_score,
    )
}

/// [`topk`] along `path`: histogram of the top 12 key bits (`indexer_topk_hist`) -> threshold select with many
/// CTAs per row and one slot atomic per counter per CTA (`indexer_topk_select`) -> exact final pass with several
/// CTAs per row (`indexer_topk_final`: rank by counting, each CTA a slice of the chosen entries; a one-CTA radix
/// select and bitonic sort fallback when the threshold bucket exceeds [`TOPK_BUCKET_CAP`]). With PDL, the same
/// kernel bodies through their `_pdl` entry points (kernels/indexer.cu "Top-k PDL entry points" has the
/// protocol). A histogram / select CTA whose slice starts at or past its row's num_valid returns at once (after
/// the PDL wait); the final pass's grid never depends on num_valid (every CTA of a row takes part in its arrival
/// protocol).
#[allow(clippy::too_many_arguments)]
pub fn topk_with(
    gpu: &Gpu,
    stream: &Stream,
    path: TopkPath,
    scores: &impl DeviceBuf<f32>,
    num_valid: &impl DeviceBuf<i32>,
    ws: &TopkWorkspace,
    out_idx: &impl DeviceBuf<i32>,
    out_score: &impl DeviceBuf<f32>,
) -> Result<()> {
    let (rows, k, stride) = (ws.rows, ws.k, ws.score_stride);
    ensure!(
        num_valid.elems() >= rows,
        "num_valid has {} entries, expected {rows}",
        num_valid.elems()
    );
    ensure!(
        scores.elems() >= rows * stride,
        "scores buffer holds {} floats, need {rows} x {stride}",
        scores.elems()
    );
    ensure!(
        out_idx.elems() >= rows * k && out_score.elems() >= rows * k,
        "top-k outputs hold {} / {} entries, need {rows} x {k}",
        out_idx.elems(),
        out_score.elems()
    );
    let pdl = match path {
        TopkPath::Default => k <= TOPK_PDL_MAX_K,
        TopkPath::Chain => false,
        TopkPath::Pdl => true,
    };
    let sfx = |name: &'static str, pdl_name: &'static str| if pdl { pdl_name } else { name };
    let ctas_per_row = topk_final_ctas_per_row(gpu, rows);
    debug_assert!(
        (TOPK_FINAL_MIN_CTAS_PER_ROW..=TOPK_FINAL_MAX_CTAS_PER_ROW).contains(&ctas_per_row)
    );
    let slices = stride.div_ceil(TOPK_SLICE) as u32;
    let slice_launch = Launch::new((slices, rows as u32, 1), (TOPK_SLICE_THREADS, 1, 1)).pdl(pdl);

    let hist = gpu.kernel(FAMILY, sfx("indexer_topk_hist", "indexer_topk_hist_pdl"))?;
    let mut a = KernelArgs::new();
    a.buf(scores)
        .i32(stride as i32)
        .buf(num_valid)
        .buf(&ws.hist);
    unsafe { launch(stream, &hist, slice_launch, &mut a)? };

    let select = gpu.kernel(
        FAMILY,
        sfx("indexer_topk_select", "indexer_topk_select_pdl"),
    )?;
    let mut a = KernelArgs::new();
    a.buf(scores)
        .i32(stride as i32)
        .buf(num_valid)
        .i32(k as i32)
        .buf(&ws.hist)
        .buf(&ws.counters)
        .buf(&ws.above)
        .buf(&ws.bucket)
        .i32(stride as i32);
    unsafe { launch(stream, &select, slice_launch, &mut a)? };

    let smem = topk_final_smem_bytes(k);
    let fin = gpu.kernel_with_smem(
        FAMILY,
        sfx("indexer_topk_final", "indexer_topk_final_pdl"),
        smem,
    )?;
    let mut a = KernelArgs::new();
    a.i32(stride as i32)
        .buf(num_valid)
        .i32(k as i32)
        .buf(&ws.hist)
        .buf(&ws.counters)
        .buf(&ws.arrivals)
        .buf(&ws.above)
        .buf(&ws.bucket)
        .i32(stride as i32)
        .buf(out_idx)
        .buf(out_score);
    let l = Launch::new((ctas_per_row, rows as u32, 1), (TOPK_FINAL_THREADS, 1, 1))
        .smem(smem)
        .pdl(pdl);
    unsafe { launch(stream, &fin, l, &mut a) }
}

/// Everything one indexer call needs on the device besides its inputs and outputs: the scores `[rows,
/// capacity]` (row stride = the cache capacity, so the top-k clamps a device num_valid where the logits do) and
/// the top-k scratch.
#[derive(Clone, Copy, Debug)]
pub struct IndexerWorkspace {
    pub score_stride: usize,
    pub scores: DevBuf<f32>,
    pub topk: TopkWorkspace,
}

impl IndexerWorkspace {
    pub fn layout(rows: usize, capacity: usize, k: usize) -> WorkspaceLayout {
        let mut l = WorkspaceLayout::new();
        l.add::<f32>(rows * capacity)
            .add_bytes(TopkWorkspace::workspace_bytes(rows, k, capacity));
        l
    }
    /// Bytes of arena an indexer call of `rows` query rows over a cache of `capacity` entries per sequence needs.
    pub fn workspace_bytes(rows: usize, capacity: usize, k: usize) -> usize {
        Self::layout(rows, capacity, k).bytes()
    }
    /// Carve the workspace from `arena` (zeroing the top-k's protocol buffers on `stream`).
    pub fn carve(
        arena: &mut Arena,
        stream: &Stream,
        rows: usize,
        capacity: usize,
        k: usize,
    ) -> Result<IndexerWorkspace> {
        ensure!(capacity > 0, "empty key cache");
        let scores = arena.carve::<f32>(rows * capacity, "indexer scores")?;
        Ok(IndexerWorkspace {
            score_stride: capacity,
            scores,
            topk: TopkWorkspace::carve(arena, stream, rows, k, capacity)?,
        })
    }
}

/// Logits then top-k (five launches in all, no host value read): [`logits`] into `ws.scores`, [`topk`] of them
/// into `out_idx` / `out_score`.
pub fn run(
    gpu: &Gpu,
    stream: &Stream,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    ws: &IndexerWorkspace,
    out_idx: &impl DeviceBuf<i32>,
    out_score: &impl DeviceBuf<f32>,
) -> Result<()> {
    run_with(
        gpu,
        stream,
        TopkPath::Default,
        q,
        cache,
        ws,
        out_idx,
        out_score,
    )
}

/// [`run`] with the top-k along `path`.
#[allow(clippy::too_many_arguments)]
pub fn run_with(
    gpu: &Gpu,
    stream: &Stream,
    path: TopkPath,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    ws: &IndexerWorkspace,
    out_idx: &impl DeviceBuf<i32>,
    out_score: &impl DeviceBuf<f32>,
) -> Result<()> {
    ensure!(
        ws.topk.rows == q.rows() && ws.score_stride == cache.capacity,
        "indexer workspace is for {} rows x {} entries, the call has {} x {}",
        ws.topk.rows,
        ws.score_stride,
        q.rows(),
        cache.capacity
    );
    logits(gpu, stream, q, cache, &ws.scores, ws.score_stride)?;
    topk_with(
        gpu,
        stream,
        path,
        &ws.scores,
        &q.num_valid,
        &ws.topk,
        out_idx,
        out_score,
    )
}
