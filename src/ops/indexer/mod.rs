//! Lightning indexer (DSV4 §3.8): index-key cache writer, weighted-ReLU MQA logits on FP8 tensor cores,
//! and an exact, deadlock-free top-k; plus the seeds' baseline (dequantize -> fp32 einsum -> full sort).
//! Device code and its design notes: kernels/indexer.cu. CPU reference: [`reference`]. Stress suite with a
//! host-side watchdog: [`stress`].
//!
//! Default path: FP8 keys -> wgmma logits fed by a TMA + mbarrier ring (`indexer_logits_fp8tma_n1/_n2`,
//! [`Fp8LogitsKernel::TmaRing`]), MXFP4 keys -> the e4m3 mma.sync logits; top-k ([`topk`]) = histogram ->
//! CTA-aggregated threshold select -> multi-CTA exact final pass (`indexer_topk2_hist`,
//! `indexer_topk5_select_agg`, `indexer_topk4_final_mcta`), launched through their PDL entry points when
//! k <= [`TOPK_PDL_MAX_K`] (each launch overlaps the previous kernel's tail).
//!
//! Options kept measurable ([`IndexerPaths`], [`run_with`], bench variants in [`VARIANTS`]): the previous FP8
//! logits ([`Fp8LogitsKernel::CpAsyncRounds`]) and each top-k launch mode forced ([`TopkPath`]); `graph_*` bench
//! variants replay a call as a CUDA graph.
//!
//! Contracts:
//! * Rows are `b * next_n + t` (next_n = 1 or 2); `num_valid[row]` entries of sequence `b` are visible to
//!   row `row`. q is e4m3 `[rows, 64, 128]` (Hadamard-rotated like the keys), `w` f32 `[rows, 64]` with the
//!   per-token q scale folded in (relu(s x) = s relu(x) for s > 0).
//! * Top-k returns, per row, exactly `min(k, num_valid)` indices ordered by (score desc, index asc), then
//!   `-1`; the scores alongside (`-inf` on padding).
//! * NaN / Inf policy: `QueryBatch::upload` rejects NaN e4m3 q codes and non-finite `w` before any launch.
//!   A NaN score that still arises (e.g. a NaN fp32 key scale in a cache written elsewhere) ranks as `-inf`;
//!   `-inf` scores are ordinary (lowest) values; `-0` ranks as `+0`. ReLU is `fmaxf(x, 0)` (NaN -> 0).
//!   The CPU reference follows the same rules and the stress suite tests them.

pub mod bench;
pub mod exec_entry;
pub mod reference;
pub mod stress;

use anyhow::{bail, ensure, Result};
use cudarc::driver::CudaSlice;

use crate::formats::e4m3;
use crate::gpu::pdl::{launch_ex, LaunchExOpts, RawArgs};
use crate::gpu::timing::TimingPlan;
use crate::gpu::{drv, launch_cfg, Gpu, PushKernelArg};
pub use exec_entry::{exec_kernels, parse_exec_inputs};
pub use reference::{KeyCacheHost, KeyFormat, HEAD_DIM, NUM_HEADS};

/// Kernel family name (kernels/indexer.cu).
pub const FAMILY: &str = "indexer";
/// Largest supported k (kernel constant TOPK_MAX_K).
pub const TOPK_MAX_K: usize = 2048;
/// Histogram bins of top-k v2 (kernel constant TK2_BINS: the top 12 bits of the order key).
pub const TOPK2_BINS: usize = 4096;
/// Entries per top-k v2 histogram / select CTA (kernel constant TK2_SLICE) and their block size.
const TOPK2_SLICE: usize = 4096;
const TOPK2_THREADS: u32 = 512;
/// Multi-CTA final pass (kernel constants TK4_THREADS, TK4_MIN_SPLIT, TK4_BUCKET_CAP).
const TOPK4_THREADS: u32 = 512;
/// Fewest / most CTAs per row of `indexer_topk4_final_mcta` (the kernel's static rank arrays assume >= 8).
pub const TOPK4_MIN_CTAS_PER_ROW: u32 = 8;
pub const TOPK4_MAX_CTAS_PER_ROW: u32 = 64;
/// Threshold-bucket composites the multi-CTA final pass ranks in shared memory; larger buckets (heavy ties)
/// take its one-CTA radix-select fallback.
pub const TOPK4_BUCKET_CAP: usize = 4096;
/// Largest k for which [`topk`] launches the chain through its PDL entry points ([`TopkPath::Pdl`]). Session-6
/// A/B (results/h200/session6-ab/indexer.csv): PDL won at every k = 512 point (b1 4K-1M: whole call -3.5 to -4
/// us; b16-b64 @ 64K -2 to -5.5 us; next_n 2 b16 up to 1M) and lost at k = 1024 from batch 16 at 1M (top-k
/// 42.9 -> 52.9 us: dependent CTAs launched early hold SM slots the running kernel still needs).
pub const TOPK_PDL_MAX_K: usize = 512;
/// Keys per logits CTA (kernel constant LG_CTA_KEYS) and its block size.
const LOGITS_CTA_KEYS: usize = 1024;
const LOGITS_THREADS: u32 = 256;

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

    /// Bytes of the first `n` entries of one sequence (what a logits pass reads).
    pub fn bytes_for(&self, n: usize) -> usize {
        n * self.format.entry_bytes()
    }
}

/// Quantize `n` new raw keys (`raw`: f32 `[n, 128]` on the device, before the Hadamard transform) into the
/// cache at flat slots `slots[i] = b * capacity + j` (checked here, uploaded per call).
pub fn write_keys(
    gpu: &Gpu,
    cache: &mut KeyCacheGpu,
    raw: &CudaSlice<f32>,
    slots: &[i32],
) -> Result<()> {
    let n = slots.len();
    ensure!(
        raw.len() == n * HEAD_DIM,
        "raw keys hold {} floats, expected {n} x 128",
        raw.len()
    );
    let num_slots = cache.batch * cache.capacity;
    ensure!(
        num_slots <= i32::MAX as usize,
        "cache too large for i32 slots"
    );
    if let Some((i, s)) = slots
        .iter()
        .enumerate()
        .find(|(_, &s)| s < 0 || s as usize >= num_slots)
    {
        bail!("slot {s} of key {i} is outside the cache (0..{num_slots})");
    }
    if n == 0 {
        return Ok(());
    }
    let slots_dev = gpu.upload(slots)?;
    let name = match cache.format {
        KeyFormat::Fp8 => "indexer_write_keys_fp8",
        KeyFormat::Mxfp4 => "indexer_write_keys_mxfp4",
    };
    let f = gpu.function(FAMILY, name)?;
    let (n_i, slots_i) = (n as i32, num_slots as i32);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(raw)
        .arg(&slots_dev)
        .arg(&n_i)
        .arg(&slots_i)
        .arg(&mut cache.codes)
        .arg(&mut cache.scales);
    unsafe { b.launch(launch_cfg((n.div_ceil(8) as u32, 1, 1), (256, 1, 1), 0)) }
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!("indexer write_keys launch: {e:?}"))
}

/// Queries of one call: `batch` sequences x `next_n` tokens.
pub struct QueryBatch {
    pub batch: usize,
    pub next_n: usize,
    pub q: CudaSlice<u8>,
    pub w: CudaSlice<f32>,
    pub num_valid_host: Vec<i32>,
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
            num_valid_host: num_valid.to_vec(),
            num_valid: gpu.upload(num_valid)?,
        })
    }
    pub fn rows(&self) -> usize {
        self.batch * self.next_n
    }
    pub fn max_valid(&self) -> usize {
        self.num_valid_host
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(0) as usize
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

/// The FP8 logits kernels: (entry point for next_n = 1, for next_n = 2), key tiles per round and CTAs per SM
/// (the 3-CTA configuration of the wgmma template; kernels/indexer.cu "FP8 logits v5").
const WGMMA_N1: &str = "indexer_logits_fp8w3_n1";
const WGMMA_N2: &str = "indexer_logits_fp8w3_n2";
const WGMMA_ROUND: usize = 3;
const WGMMA_CTAS_PER_SM: usize = 3;

/// Threads and keys per tile of the wgmma logits (kernel constants LW_THREADS, LW_KEYS).
const WGMMA_THREADS: u32 = 128;
const WGMMA_TILE_KEYS: usize = 64;

/// Dynamic shared memory of the wgmma logits (kernel `lw_smem_bytes<NEXT_N, ROUND>`): 1 KB alignment slack +
/// two rounds of `round` key tiles (8 KB codes + 256 B scales each) + q (8 KB per query token).
fn wgmma_smem_bytes(next_n: usize, round: usize) -> usize {
    1024 + 2 * round * WGMMA_TILE_KEYS * (HEAD_DIM + 4) + next_n * NUM_HEADS * HEAD_DIM
}

/// Scores `[rows, score_stride]`: rows of sequence `b` get scores for every `j < max_t num_valid[b * next_n +
/// t]`; nothing past that is written. FP8 keys: native wgmma e4m3 (not bit-identical to an fp32-accumulated
/// dot product: the FP8 tensor core's accumulation keeps fewer bits, see kernels/indexer.cu; tests bound it
/// by 2^-9 of `sum_h |w_h| sum_d |q_hd k_jd|`). MXFP4 keys: e4m3 mma.sync with fp32 block-scale steps.
pub fn logits(
    gpu: &Gpu,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    scores: &mut CudaSlice<f32>,
    score_stride: usize,
) -> Result<()> {
    logits_with(
        gpu,
        q,
        cache,
        scores,
        score_stride,
        Fp8LogitsKernel::default(),
    )
}

/// [`logits`] with an explicit choice of the FP8 logits kernel (the A/B candidates; MXFP4 keys have one
/// kernel and ignore it). Same contract and same output: the candidates are bit-identical to the default.
pub fn logits_with(
    gpu: &Gpu,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    scores: &mut CudaSlice<f32>,
    score_stride: usize,
    fp8_kernel: Fp8LogitsKernel,
) -> Result<()> {
    ensure!(
        cache.batch == q.batch,
        "cache has {} sequences, queries {}",
        cache.batch,
        q.batch
    );
    ensure!(
        score_stride >= cache.capacity.min(q.max_valid()),
        "score_stride {score_stride} is shorter than the visible entries"
    );
    ensure!(
        scores.len() >= q.rows() * score_stride,
        "scores buffer holds {} floats, need {}",
        scores.len(),
        q.rows() * score_stride
    );
    if let Some(i) = q
        .num_valid_host
        .iter()
        .position(|&n| n as usize > cache.capacity)
    {
        bail!(
            "num_valid[{i}] = {} exceeds the cache capacity {}",
            q.num_valid_host[i],
            cache.capacity
        );
    }
    let max_n = q.max_valid();
    if max_n == 0 {
        return Ok(());
    }
    if cache.format == KeyFormat::Fp8 && fp8_kernel == Fp8LogitsKernel::TmaRing {
        return logits_tma(gpu, q, cache, scores, score_stride, max_n);
    }
    let name = match (cache.format, q.next_n) {
        (KeyFormat::Fp8, 1) => {
            return logits_wgmma(gpu, q, cache, scores, score_stride, max_n, WGMMA_N1)
        }
        (KeyFormat::Fp8, _) => {
            return logits_wgmma(gpu, q, cache, scores, score_stride, max_n, WGMMA_N2)
        }
        (KeyFormat::Mxfp4, 1) => "indexer_logits_mxfp4_n1",
        (KeyFormat::Mxfp4, _) => "indexer_logits_mxfp4_n2",
    };
    let f = gpu.function(FAMILY, name)?;
    let (cap, stride) = (cache.capacity as i32, score_stride as i32);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&q.q)
        .arg(&q.w)
        .arg(&cache.codes)
        .arg(&cache.scales)
        .arg(&q.num_valid)
        .arg(&cap)
        .arg(scores)
        .arg(&stride);
    let grid = (max_n.div_ceil(LOGITS_CTA_KEYS) as u32, q.batch as u32, 1);
    drv(
        unsafe { b.launch(launch_cfg(grid, (LOGITS_THREADS, 1, 1), 0)) },
        "indexer logits launch",
    )
    .map(|_| ())
}

/// Launch of the wgmma logits (arguments already checked by [`logits`]; `max_n` >= 1).
fn logits_wgmma(
    gpu: &Gpu,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    scores: &mut CudaSlice<f32>,
    score_stride: usize,
    max_n: usize,
    name: &str,
) -> Result<()> {
    let (round, ctas_per_sm) = (WGMMA_ROUND, WGMMA_CTAS_PER_SM);
    let tiles_per_seq = max_n.div_ceil(WGMMA_TILE_KEYS);
    let total_tiles = tiles_per_seq * q.batch;
    ensure!(
        total_tiles <= i32::MAX as usize
            && q.batch * cache.capacity <= i32::MAX as usize
            && score_stride <= i32::MAX as usize,
        "wgmma logits: {} sequences x {} tiles exceed the kernel's i32 indexing",
        q.batch,
        tiles_per_seq
    );
    let smem = wgmma_smem_bytes(q.next_n, round);
    // The persistent grid assumes `ctas_per_sm` resident CTAs: the largest shared-memory carveout.
    let f = gpu.function_with_max_carveout(FAMILY, name, smem)?;
    let persistent = (gpu.info.sm_count.max(1) as usize) * ctas_per_sm;
    let grid_x = total_tiles.min(persistent) as u32;
    let (cap, stride, tps, total) = (
        cache.capacity as i32,
        score_stride as i32,
        tiles_per_seq as i32,
        total_tiles as i32,
    );
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&q.q)
        .arg(&q.w)
        .arg(&cache.codes)
        .arg(&cache.scales)
        .arg(&q.num_valid)
        .arg(&cap)
        .arg(scores)
        .arg(&stride)
        .arg(&tps)
        .arg(&total);
    drv(
        unsafe {
            b.launch(launch_cfg(
                (grid_x, 1, 1),
                (WGMMA_THREADS, 1, 1),
                smem as u32,
            ))
        },
        "indexer wgmma logits launch",
    )
    .map(|_| ())
}

/// Which FP8 logits kernel [`logits_with`] / [`run_with`] launch. Both compute bit-identical scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8LogitsKernel {
    /// `indexer_logits_fp8tma_n1/_n2` (the default since session 6; it won every FP8 point of the session-5
    /// A/B, e.g. 1M b1 18.5 vs 20.6 us, b16 @1M 146 vs 178 us): key tiles by tensor-map bulk copies (TMA) into
    /// a ring of full/empty mbarriers fed by one producer thread.
    #[default]
    TmaRing,
    /// `indexer_logits_fp8w3_n1/_n2` (the default until session 5; bench variants `*_rounds*`): cp.async rounds
    /// of 3 key tiles, double-buffered.
    CpAsyncRounds,
}

/// The TMA logits kernels (kernels/indexer.cu "FP8 logits v6"): entry points, ring stages per next_n, CTAs per
/// SM and block size (kernel constants of `INDEXER_LOGITS_TMA_ENTRY` / `LT_THREADS`).
const TMA_N1: &str = "indexer_logits_fp8tma_n1";
const TMA_N2: &str = "indexer_logits_fp8tma_n2";
const TMA_STAGES_N1: usize = 7;
const TMA_STAGES_N2: usize = 6;
const TMA_CTAS_PER_SM: usize = 3;
const TMA_THREADS: u32 = 128 + 32;

/// Key scales per TMA scale box (kernel `LT_SCALE_BOX`): a tile's 64 rows + up to 3 rows of slack, because the
/// box starts at the tile's first slot rounded down to a multiple of 4 (the TMA faults with
/// CUDA_ERROR_ILLEGAL_INSTRUCTION when a box's first element is not 16-byte aligned in global memory).
pub const TMA_SCALE_BOX: usize = WGMMA_TILE_KEYS + 4;
/// Shared-memory bytes per ring stage of the scale boxes (kernel `LT_SCALE_STAGE_BYTES`): the 272-byte box rounded
/// up to the TMA destination alignment of 128 bytes.
const TMA_SCALE_STAGE_BYTES: usize = (TMA_SCALE_BOX * 4).next_multiple_of(128);

/// First element of the scale box of the tile starting at plane slot `slot0`, and the element of that box that
/// holds `slot0`'s scale (kernel: `slot0 & ~3`, `slot0 & 3`). Mirrored here for the CPU test of the alignment
/// rule.
pub const fn tma_scale_box_start(slot0: usize) -> (usize, usize) {
    (slot0 & !3, slot0 & 3)
}

/// Dynamic shared memory of the TMA logits (kernel `lt_smem_bytes<NEXT_N, STAGES>`): 1 KB alignment slack +
/// `stages` x (8 KB codes + 384 B scale box) + q (8 KB per query token) + a full and an empty mbarrier per stage.
const fn tma_smem_bytes(next_n: usize, stages: usize) -> usize {
    1024 + stages * (WGMMA_TILE_KEYS * HEAD_DIM + TMA_SCALE_STAGE_BYTES)
        + next_n * NUM_HEADS * HEAD_DIM
        + 2 * stages * 8
}

// TMA_CTAS_PER_SM CTAs (each with 1 KB of shared memory reserved by the hardware) must fit the H200's 228 KB of
// shared memory per SM for both query widths, or the persistent grid would not be resident at once.
const _: () = assert!(
    TMA_CTAS_PER_SM * (tma_smem_bytes(1, TMA_STAGES_N1) + 1024) <= 228 * 1024
        && TMA_CTAS_PER_SM * (tma_smem_bytes(2, TMA_STAGES_N2) + 1024) <= 228 * 1024
);

/// Launch of the TMA logits (arguments already checked by [`logits_with`]; `max_n` >= 1). The two tensor maps
/// cover exactly the cache's planes (`batch * capacity` entries), so a tile's rows past `num_valid` read
/// allocated cache bytes (discarded by the kernel) and rows past the plane's end are zero-filled by the TMA.
fn logits_tma(
    gpu: &Gpu,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    scores: &mut CudaSlice<f32>,
    score_stride: usize,
    max_n: usize,
) -> Result<()> {
    use cudarc::driver::sys::{CUtensorMapDataType, CUtensorMapSwizzle};
    use cudarc::driver::DevicePtr;
    let (name, stages) = match q.next_n {
        1 => (TMA_N1, TMA_STAGES_N1),
        _ => (TMA_N2, TMA_STAGES_N2),
    };
    let tiles_per_seq = max_n.div_ceil(WGMMA_TILE_KEYS);
    let total_tiles = tiles_per_seq * q.batch;
    let entries = cache.batch * cache.capacity;
    ensure!(
        total_tiles <= i32::MAX as usize
            && entries <= i32::MAX as usize
            && score_stride <= i32::MAX as usize,
        "tma logits: {} sequences x {} entries exceed the kernel's i32 indexing",
        q.batch,
        cache.capacity
    );
    ensure!(
        cache.codes.len() == entries * HEAD_DIM && cache.scales.len() == entries * 4,
        "tma logits: key cache planes have the wrong length"
    );
    let codes_addr = cache.codes.device_ptr(&gpu.stream).0;
    let scales_addr = cache.scales.device_ptr(&gpu.stream).0;
    let codes_map = crate::gpu::tma::encode_tiled(
        "tma logits key codes",
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        1,
        codes_addr,
        &[HEAD_DIM as u64, entries as u64],
        &[HEAD_DIM as u64],
        &[HEAD_DIM as u32, WGMMA_TILE_KEYS as u32],
        CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )?;
    let scales_map = crate::gpu::tma::encode_tiled(
        "tma logits key scales",
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        4,
        scales_addr,
        &[entries as u64],
        &[],
        &[TMA_SCALE_BOX as u32],
        CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    )?;
    let smem = tma_smem_bytes(q.next_n, stages);
    // As for the wgmma logits: the persistent grid assumes TMA_CTAS_PER_SM resident CTAs.
    let f = gpu.function_with_max_carveout(FAMILY, name, smem)?;
    let persistent = (gpu.info.sm_count.max(1) as usize) * TMA_CTAS_PER_SM;
    let grid_x = total_tiles.min(persistent) as u32;
    let (cap, stride, tps, total) = (
        cache.capacity as i32,
        score_stride as i32,
        tiles_per_seq as i32,
        total_tiles as i32,
    );
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&codes_map)
        .arg(&scales_map)
        .arg(&q.q)
        .arg(&q.w)
        .arg(&q.num_valid)
        .arg(&cap)
        .arg(scores)
        .arg(&stride)
        .arg(&tps)
        .arg(&total);
    drv(
        unsafe { b.launch(launch_cfg((grid_x, 1, 1), (TMA_THREADS, 1, 1), smem as u32)) },
        "indexer tma logits launch",
    )
    .map(|_| ())
}

/// Output and scratch of the top-k for `rows` rows of at most `max_n` entries.
pub struct TopkBuffers {
    pub rows: usize,
    pub k: usize,
    pub max_n: usize,
    pub out_idx: CudaSlice<i32>,
    pub out_score: CudaSlice<f32>,
    // Histogram -> select -> final scratch. `hist` and `counters` are zero between calls (the final
    // pass re-zeroes them); `v2_dirty` is set while a call is being enqueued, so a call that failed
    // half-way is followed by an explicit zeroing.
    hist: CudaSlice<u32>,
    counters: CudaSlice<u32>,
    above: CudaSlice<u64>,
    bucket: CudaSlice<u64>,
    bucket_stride: usize,
    /// Per-row arrival counter of the multi-CTA final pass (zero between calls; see its reset protocol).
    arrivals: CudaSlice<u32>,
    v2_dirty: bool,
}

impl TopkBuffers {
    pub fn new(gpu: &Gpu, rows: usize, k: usize, max_n: usize) -> Result<TopkBuffers> {
        ensure!(
            (1..=TOPK_MAX_K).contains(&k),
            "k = {k}: supported 1..={TOPK_MAX_K}"
        );
        ensure!(rows > 0, "no rows");
        ensure!(max_n < i32::MAX as usize / 2, "max_n {max_n} too large");
        let bucket_stride = max_n.max(1);
        Ok(TopkBuffers {
            rows,
            k,
            max_n,
            out_idx: gpu.poisoned::<i32>(rows * k, 0xFF)?,
            out_score: gpu.poisoned::<f32>(rows * k, 0xFF)?,
            hist: gpu.zeros::<u32>(rows * TOPK2_BINS)?,
            counters: gpu.zeros::<u32>(rows * 2)?,
            above: gpu.zeros::<u64>(rows * k)?,
            bucket: gpu.zeros::<u64>(rows * bucket_stride)?,
            bucket_stride,
            arrivals: gpu.zeros::<u32>(rows)?,
            v2_dirty: false,
        })
    }
}

/// Argument checks of the top-k; returns the longest row.
fn check_topk_args(
    scores: &CudaSlice<f32>,
    score_stride: usize,
    num_valid: &CudaSlice<i32>,
    num_valid_host: &[i32],
    bufs: &TopkBuffers,
) -> Result<usize> {
    let rows = bufs.rows;
    ensure!(
        num_valid_host.len() == rows && num_valid.len() >= rows,
        "num_valid has {} entries, expected {rows}",
        num_valid_host.len()
    );
    ensure!(
        scores.len() >= rows * score_stride,
        "scores buffer holds {} floats, need {}",
        scores.len(),
        rows * score_stride
    );
    ensure!(
        score_stride <= i32::MAX as usize,
        "score_stride {score_stride} too large"
    );
    if let Some(i) = num_valid_host
        .iter()
        .position(|&n| n < 0 || n as usize > score_stride.min(bufs.max_n))
    {
        bail!(
            "num_valid[{i}] = {} outside 0..={}",
            num_valid_host[i],
            score_stride.min(bufs.max_n)
        );
    }
    Ok(num_valid_host.iter().copied().max().unwrap_or(0) as usize)
}

/// CTAs per row of the multi-CTA final pass: about two CTAs per SM in one wave (512 threads, 41-53 KB of
/// shared memory each): `2 * sm_count / rows`, clamped to 8..=32 (132 SMs: 32 at 1-8 rows, 16 at 16, 8 from
/// 33). Always within `TOPK4_MIN_CTAS_PER_ROW..=TOPK4_MAX_CTAS_PER_ROW`.
fn topk_ctas_per_row(gpu: &Gpu, rows: usize) -> u32 {
    (2 * gpu.info.sm_count as usize / rows.max(1)).clamp(8, 32) as u32
}

/// Dynamic shared memory of `indexer_topk4_final_mcta` for `k`: the above / sort buffer (next power of two
/// >= k, + 2 pad slots) and the bucket buffer (TK4_BUCKET_CAP + 2), 8 bytes each (kernel: tk4_above_slots).
pub fn topk4_smem_bytes(k: usize) -> usize {
    8 * (k.next_power_of_two().max(2) + 2 + TOPK4_BUCKET_CAP + 2)
}

/// Top-k of `scores` rows (`num_valid` per row, host copy for validation and grid sizing): exactly
/// `min(k, num_valid)` indices per row ordered by (score desc, index asc), then -1 (see the module contract).
/// Three launches ([`TopkPath::Chain`]), through their PDL entry points when k <= [`TOPK_PDL_MAX_K`]
/// ([`TopkPath::Pdl`]); both give bit-identical outputs.
pub fn topk(
    gpu: &Gpu,
    scores: &CudaSlice<f32>,
    score_stride: usize,
    num_valid: &CudaSlice<i32>,
    num_valid_host: &[i32],
    bufs: &mut TopkBuffers,
) -> Result<()> {
    topk_with(
        gpu,
        TopkPath::Default,
        scores,
        score_stride,
        num_valid,
        num_valid_host,
        bufs,
    )
}

/// Top-k in three launches ([`TopkPath::Chain`]; with `pdl`, [`TopkPath::Pdl`]): histogram of the top 12 key
/// bits (`indexer_topk2_hist`) -> threshold select with many CTAs per row and one slot atomic per counter per CTA
/// (`indexer_topk5_select_agg`) -> exact final pass with several CTAs per row (`indexer_topk4_final_mcta`: rank
/// by counting, each CTA a slice of the chosen entries; a one-CTA radix select and bitonic sort fallback when
/// the threshold bucket exceeds TOPK4_BUCKET_CAP). See kernels/indexer.cu
/// "Top-k v2" (passes 1-2), "Top-k v4" (final pass) and "Top-k pass 2 with CTA-aggregated slot allocation".
/// With `pdl`, the same kernel bodies through their PDL entry points (`indexer_topk2_hist_pdl`,
/// `indexer_topk5_select_agg_pdl`, `indexer_topk4_final_mcta_pdl`), each launched with programmatic stream
/// serialization so its launch overlaps the previous kernel's tail; bit-identical outputs (kernels/indexer.cu
/// "Top-k PDL entry points" has the protocol).
fn topk_chain(
    gpu: &Gpu,
    pdl: bool,
    scores: &CudaSlice<f32>,
    score_stride: usize,
    num_valid: &CudaSlice<i32>,
    num_valid_host: &[i32],
    bufs: &mut TopkBuffers,
) -> Result<()> {
    let max_n = check_topk_args(scores, score_stride, num_valid, num_valid_host, bufs)?;
    let rows = bufs.rows;
    ensure!(
        rows <= 65_535,
        "top-k: {rows} rows exceed the grid's y limit (65,535)"
    );
    let ctas_per_row = topk_ctas_per_row(gpu, rows);
    debug_assert!((TOPK4_MIN_CTAS_PER_ROW..=TOPK4_MAX_CTAS_PER_ROW).contains(&ctas_per_row));
    if bufs.v2_dirty {
        // A previous call stopped between its launches: its histogram / counters were not re-zeroed.
        gpu.fill_bytes(&mut bufs.hist, 0)?;
        gpu.fill_bytes(&mut bufs.counters, 0)?;
        gpu.fill_bytes(&mut bufs.arrivals, 0)?;
    }
    bufs.v2_dirty = true;
    let slices = max_n.div_ceil(TOPK2_SLICE).max(1) as u32;
    let (stride, k, bstride) = (
        score_stride as i32,
        bufs.k as i32,
        bufs.bucket_stride as i32,
    );
    if pdl {
        return topk_chain_pdl(
            gpu,
            scores,
            stride,
            num_valid,
            k,
            bstride,
            slices,
            ctas_per_row,
            bufs,
        );
    }
    let f = gpu.function(FAMILY, "indexer_topk2_hist")?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(scores)
        .arg(&stride)
        .arg(num_valid)
        .arg(&mut bufs.hist);
    drv(
        unsafe {
            b.launch(launch_cfg(
                (slices, rows as u32, 1),
                (TOPK2_THREADS, 1, 1),
                0,
            ))
        },
        "indexer top-k histogram",
    )?;
    let f = gpu.function(FAMILY, "indexer_topk5_select_agg")?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(scores)
        .arg(&stride)
        .arg(num_valid)
        .arg(&k)
        .arg(&bufs.hist)
        .arg(&mut bufs.counters)
        .arg(&mut bufs.above)
        .arg(&mut bufs.bucket)
        .arg(&bstride);
    drv(
        unsafe {
            b.launch(launch_cfg(
                (slices, rows as u32, 1),
                (TOPK2_THREADS, 1, 1),
                0,
            ))
        },
        "indexer top-k select",
    )?;
    let smem = topk4_smem_bytes(bufs.k);
    let f = gpu.function_with_smem(FAMILY, "indexer_topk4_final_mcta", smem)?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&stride)
        .arg(num_valid)
        .arg(&k)
        .arg(&mut bufs.hist)
        .arg(&mut bufs.counters)
        .arg(&mut bufs.arrivals)
        .arg(&bufs.above)
        .arg(&bufs.bucket)
        .arg(&bstride)
        .arg(&mut bufs.out_idx)
        .arg(&mut bufs.out_score);
    drv(
        unsafe {
            b.launch(launch_cfg(
                (ctas_per_row, rows as u32, 1),
                (TOPK4_THREADS, 1, 1),
                smem as u32,
            ))
        },
        "indexer top-k final (multi-CTA)",
    )?;
    bufs.v2_dirty = false;
    Ok(())
}

/// The PDL launches of [`TopkPath::Pdl`] (after [`topk_chain`]'s checks and dirty-buffer reset). Same grids,
/// blocks, shared memory and parameters as the plain launches; parameter slots in the kernels' order.
#[allow(clippy::too_many_arguments)]
fn topk_chain_pdl(
    gpu: &Gpu,
    scores: &CudaSlice<f32>,
    stride: i32,
    num_valid: &CudaSlice<i32>,
    k: i32,
    bstride: i32,
    slices: u32,
    ctas_per_row: u32,
    bufs: &mut TopkBuffers,
) -> Result<()> {
    let rows = bufs.rows as u32;
    let opts = LaunchExOpts {
        pdl: true,
        ..Default::default()
    };
    let f = gpu.function(FAMILY, "indexer_topk2_hist_pdl")?;
    let mut a = RawArgs::default();
    a.slice(gpu, scores)
        .i32(stride)
        .slice(gpu, num_valid)
        .slice(gpu, &bufs.hist);
    launch_ex(
        gpu,
        &f,
        (slices, rows, 1),
        (TOPK2_THREADS, 1, 1),
        opts,
        &mut a,
        "indexer top-k histogram (PDL)",
    )?;
    let f = gpu.function(FAMILY, "indexer_topk5_select_agg_pdl")?;
    let mut a = RawArgs::default();
    a.slice(gpu, scores)
        .i32(stride)
        .slice(gpu, num_valid)
        .i32(k)
        .slice(gpu, &bufs.hist)
        .slice(gpu, &bufs.counters)
        .slice(gpu, &bufs.above)
        .slice(gpu, &bufs.bucket)
        .i32(bstride);
    launch_ex(
        gpu,
        &f,
        (slices, rows, 1),
        (TOPK2_THREADS, 1, 1),
        opts,
        &mut a,
        "indexer top-k select (PDL)",
    )?;
    let smem = topk4_smem_bytes(bufs.k);
    let f = gpu.function_with_smem(FAMILY, "indexer_topk4_final_mcta_pdl", smem)?;
    let mut a = RawArgs::default();
    a.i32(stride)
        .slice(gpu, num_valid)
        .i32(k)
        .slice(gpu, &bufs.hist)
        .slice(gpu, &bufs.counters)
        .slice(gpu, &bufs.arrivals)
        .slice(gpu, &bufs.above)
        .slice(gpu, &bufs.bucket)
        .i32(bstride)
        .slice(gpu, &bufs.out_idx)
        .slice(gpu, &bufs.out_score);
    launch_ex(
        gpu,
        &f,
        (ctas_per_row, rows, 1),
        (TOPK4_THREADS, 1, 1),
        LaunchExOpts {
            smem_bytes: smem as u32,
            ..opts
        },
        &mut a,
        "indexer top-k final (multi-CTA, PDL)",
    )?;
    bufs.v2_dirty = false;
    Ok(())
}

/// Which top-k launch mode a call uses ([`TopkPath::Default`] is [`topk`]). Every path has the same contract and
/// bit-identical outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TopkPath {
    /// [`topk`]: [`TopkPath::Pdl`] for k <= [`TOPK_PDL_MAX_K`], else [`TopkPath::Chain`].
    #[default]
    Default,
    /// Three plain launches: histogram -> CTA-aggregated threshold select -> multi-CTA final pass (bench
    /// `*_chain`).
    Chain,
    /// The chain's kernels through their PDL entry points: each launch overlaps the previous kernel's tail
    /// (bench `*_pdl`).
    Pdl,
}

/// Top-k along `path`. Same contract and outputs (bit-identical indices and scores).
pub fn topk_with(
    gpu: &Gpu,
    path: TopkPath,
    scores: &CudaSlice<f32>,
    score_stride: usize,
    num_valid: &CudaSlice<i32>,
    num_valid_host: &[i32],
    bufs: &mut TopkBuffers,
) -> Result<()> {
    let pdl = match path {
        TopkPath::Default => bufs.k <= TOPK_PDL_MAX_K,
        TopkPath::Chain => false,
        TopkPath::Pdl => true,
    };
    topk_chain(
        gpu,
        pdl,
        scores,
        score_stride,
        num_valid,
        num_valid_host,
        bufs,
    )
}

/// Everything one indexer call needs on the device besides its inputs.
pub struct IndexerBuffers {
    pub score_stride: usize,
    pub scores: CudaSlice<f32>,
    pub topk: TopkBuffers,
}

impl IndexerBuffers {
    pub fn new(gpu: &Gpu, rows: usize, capacity: usize, k: usize) -> Result<IndexerBuffers> {
        let score_stride = capacity.next_multiple_of(4).max(4);
        Ok(IndexerBuffers {
            score_stride,
            scores: gpu.poisoned::<f32>(rows * score_stride, 0xFF)?,
            topk: TopkBuffers::new(gpu, rows, k, capacity)?,
        })
    }
}

/// Which kernels a fused indexer call runs (A/B candidates; `IndexerPaths::default()` = the defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexerPaths {
    /// The FP8-key logits kernel (MXFP4 keys ignore it).
    pub logits: Fp8LogitsKernel,
    pub topk: TopkPath,
}

/// Logits then top-k with the default kernels (four launches in all).
pub fn run(
    gpu: &Gpu,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    bufs: &mut IndexerBuffers,
) -> Result<()> {
    run_with(gpu, IndexerPaths::default(), q, cache, bufs)
}

/// [`run`] along explicit kernel paths (see [`IndexerPaths`]).
pub fn run_with(
    gpu: &Gpu,
    paths: IndexerPaths,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    bufs: &mut IndexerBuffers,
) -> Result<()> {
    logits_with(
        gpu,
        q,
        cache,
        &mut bufs.scores,
        bufs.score_stride,
        paths.logits,
    )?;
    topk_with(
        gpu,
        paths.topk,
        &bufs.scores,
        bufs.score_stride,
        &q.num_valid,
        &q.num_valid_host,
        &mut bufs.topk,
    )
}

// ---------------------------------------------------------------------------------------------------------
// Baseline: the seeds' path.
// ---------------------------------------------------------------------------------------------------------

/// Scratch of the baseline: fp32 keys `[batch, capacity, 128]` and the sort buffer `[rows, npad]`.
pub struct BaselineBuffers {
    pub keys_f32: CudaSlice<f32>,
    pub sort: CudaSlice<u64>,
    pub npad: usize,
}

impl BaselineBuffers {
    pub fn new(gpu: &Gpu, batch: usize, rows: usize, capacity: usize) -> Result<BaselineBuffers> {
        let npad = capacity.next_power_of_two().max(2);
        Ok(BaselineBuffers {
            keys_f32: gpu.zeros::<f32>(batch * capacity * HEAD_DIM)?,
            sort: gpu.zeros::<u64>(rows * npad)?,
            npad,
        })
    }
}

/// Baseline logits: dequantize the visible keys to fp32, then an fp32 CUDA-core "einsum".
pub fn baseline_logits(
    gpu: &Gpu,
    q: &QueryBatch,
    cache: &KeyCacheGpu,
    base: &mut BaselineBuffers,
    scores: &mut CudaSlice<f32>,
    score_stride: usize,
) -> Result<()> {
    ensure!(
        cache.batch == q.batch && base.keys_f32.len() >= cache.batch * cache.capacity * HEAD_DIM,
        "baseline buffers do not match the cache"
    );
    ensure!(
        scores.len() >= q.rows() * score_stride && score_stride >= q.max_valid(),
        "scores buffer too small"
    );
    if let Some(i) = q
        .num_valid_host
        .iter()
        .position(|&n| n as usize > cache.capacity)
    {
        bail!(
            "num_valid[{i}] exceeds the cache capacity {}",
            cache.capacity
        );
    }
    let (fp4, next_n, cap, stride) = (
        (cache.format == KeyFormat::Mxfp4) as i32,
        q.next_n as i32,
        cache.capacity as i32,
        score_stride as i32,
    );
    let f = gpu.function(FAMILY, "indexer_baseline_dequant")?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&cache.codes)
        .arg(&cache.scales)
        .arg(&fp4)
        .arg(&q.num_valid)
        .arg(&next_n)
        .arg(&cap)
        .arg(&mut base.keys_f32);
    let gx = (cache.capacity * HEAD_DIM).div_ceil(256) as u32;
    drv(
        unsafe { b.launch(launch_cfg((gx, q.batch as u32, 1), (256, 1, 1), 0)) },
        "baseline dequant",
    )?;
    let smem = 2 * 64 * 129 * 4;
    let f = gpu.function_with_smem(FAMILY, "indexer_baseline_logits_f32", smem)?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&q.q)
        .arg(&q.w)
        .arg(&base.keys_f32)
        .arg(&q.num_valid)
        .arg(&next_n)
        .arg(&cap)
        .arg(scores)
        .arg(&stride);
    let gx = cache.capacity.div_ceil(64) as u32;
    drv(
        unsafe {
            b.launch(launch_cfg(
                (gx, q.batch as u32, 1),
                (256, 1, 1),
                smem as u32,
            ))
        },
        "baseline logits",
    )
    .map(|_| ())
}

/// Baseline top-k: bitonic sort of every full row (one launch per compare-exchange step), then take k.
pub fn baseline_topk(
    gpu: &Gpu,
    scores: &CudaSlice<f32>,
    score_stride: usize,
    q: &QueryBatch,
    base: &mut BaselineBuffers,
    out: &mut TopkBuffers,
) -> Result<()> {
    let rows = q.rows();
    ensure!(
        base.sort.len() >= rows * base.npad && out.rows == rows,
        "baseline sort buffer does not match"
    );
    ensure!(
        q.max_valid() <= base.npad.min(score_stride),
        "rows longer than the sort buffer"
    );
    let (stride, npad_i, k) = (score_stride as i32, base.npad as i32, out.k as i32);
    let f = gpu.function(FAMILY, "indexer_baseline_sort_init")?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(scores)
        .arg(&stride)
        .arg(&q.num_valid)
        .arg(&npad_i)
        .arg(&mut base.sort);
    drv(
        unsafe {
            b.launch(launch_cfg(
                (base.npad.div_ceil(256) as u32, rows as u32, 1),
                (256, 1, 1),
                0,
            ))
        },
        "baseline sort init",
    )?;
    let step = gpu.function(FAMILY, "indexer_baseline_bitonic_step")?;
    let pairs_grid = ((base.npad / 2).div_ceil(256) as u32, rows as u32, 1);
    let mut size = 2usize;
    while size <= base.npad {
        let mut st = size / 2;
        while st > 0 {
            let (size_i, st_i) = (size as i32, st as i32);
            let mut b = gpu.stream.launch_builder(&step);
            b.arg(&mut base.sort).arg(&npad_i).arg(&size_i).arg(&st_i);
            drv(
                unsafe { b.launch(launch_cfg(pairs_grid, (256, 1, 1), 0)) },
                "baseline bitonic step",
            )?;
            st /= 2;
        }
        size *= 2;
    }
    let f = gpu.function(FAMILY, "indexer_baseline_sort_gather")?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&base.sort)
        .arg(&npad_i)
        .arg(&stride)
        .arg(&q.num_valid)
        .arg(&k)
        .arg(&mut out.out_idx)
        .arg(&mut out.out_score);
    drv(
        unsafe {
            b.launch(launch_cfg(
                (out.k.div_ceil(256) as u32, rows as u32, 1),
                (256, 1, 1),
                0,
            ))
        },
        "baseline gather",
    )
    .map(|_| ())
}

// ---------------------------------------------------------------------------------------------------------
// Bench inputs and timing (the sweep hook is in [`bench`]).
// ---------------------------------------------------------------------------------------------------------

/// Random inputs of one sweep point on the device (keys written by the GPU writer; never zeros).
pub struct BenchInputs {
    pub q: QueryBatch,
    pub cache: KeyCacheGpu,
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
        .map(|_| reference::random_e4m3(&mut rng))
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
        write_keys(gpu, &mut cache, &raw_dev, &slots)?;
        start += n;
    }
    gpu.synchronize()?;
    Ok(BenchInputs { q, cache })
}

/// Timing samples (us) of one variant: logits alone, top-k alone, both back to back.
pub struct IndexerSamples {
    pub logits: Vec<f64>,
    pub topk: Vec<f64>,
    pub total: Vec<f64>,
}

/// Bench variants of the indexer: "fused" (the default kernels, [`run`]), "baseline" (the seeds' path), and
/// the A/B paths named `fused[_rounds][_chain|_pdl]`: `_rounds` = the cp.async-rounds FP8 logits
/// ([`Fp8LogitsKernel::CpAsyncRounds`], the default until session 5; MXFP4 points run the same kernels as
/// "fused"), `_chain` / `_pdl` = the top-k forced to [`TopkPath::Chain`] / [`TopkPath::Pdl`]
/// ("fused_rounds_chain" is the session-5 default). "graph_<variant>": the same calls captured once into CUDA
/// graphs and replayed (logits alone, top-k alone, the whole call), i.e. device time as a decode step's graph sees
/// it, without host launch gaps.
pub const VARIANTS: &[&str] = &[
    "fused",
    "baseline",
    "fused_chain",
    "fused_pdl",
    "fused_rounds_chain",
    "graph_fused",
    "graph_fused_chain",
    "graph_fused_pdl",
];

/// The kernel paths of a fused variant name (without the `graph_` prefix).
fn variant_paths(fused_variant: &str) -> Option<IndexerPaths> {
    let rest = fused_variant.strip_prefix("fused")?;
    let (logits, rest) = match rest.strip_prefix("_rounds") {
        Some(r) => (Fp8LogitsKernel::CpAsyncRounds, r),
        None => (Fp8LogitsKernel::TmaRing, rest),
    };
    let topk = match rest {
        "" => TopkPath::Default,
        "_chain" => TopkPath::Chain,
        "_pdl" => TopkPath::Pdl,
        _ => return None,
    };
    Some(IndexerPaths { logits, topk })
}

/// Graph replays per timed sample of the graph_* variants: ONE, so that every replay sees the L2 state the
/// plan asks for (with `flush_l2`, the 34.6 MB of keys at 1M / batch 1 would otherwise stay in the 50 MB L2
/// from the previous replay, which a decode step, with other layers in between, never sees). The replay is
/// still free of host gaps: the flush (a 128 MB memset, tens of us) is enqueued before the start event, so
/// the host has enqueued the event and the graph long before the device reaches them.
const GRAPH_REPLAYS_PER_SAMPLE: usize = 1;

/// Time one of [`VARIANTS`]: a fused path (eager or `graph_` replays) or "baseline" (the seeds' path).
pub fn time_variant(
    gpu: &Gpu,
    variant: &str,
    inp: &BenchInputs,
    k: usize,
    plan: TimingPlan,
) -> Result<IndexerSamples> {
    let (q, cache) = (&inp.q, &inp.cache);
    let mut bufs = IndexerBuffers::new(gpu, q.rows(), cache.capacity, k)?;
    let stride = bufs.score_stride;
    if let Some(paths) = variant_paths(variant) {
        let logits_s = gpu.time_us(plan, || {
            logits_with(gpu, q, cache, &mut bufs.scores, stride, paths.logits)
        })?;
        let IndexerBuffers {
            scores, topk: tb, ..
        } = &mut bufs;
        let topk_s = gpu.time_us(plan, || {
            topk_with(
                gpu,
                paths.topk,
                scores,
                stride,
                &q.num_valid,
                &q.num_valid_host,
                tb,
            )
        })?;
        let total = gpu.time_us(plan, || run_with(gpu, paths, q, cache, &mut bufs))?;
        return Ok(IndexerSamples {
            logits: logits_s,
            topk: topk_s,
            total,
        });
    }
    if let Some(paths) = variant.strip_prefix("graph_").and_then(variant_paths) {
        // One eager call first: loads the modules and sets the function attributes (not capturable), and
        // leaves the scores in place for the top-k-only graph.
        run_with(gpu, paths, q, cache, &mut bufs)?;
        gpu.synchronize()?;
        let logits_g =
            gpu.capture(|| logits_with(gpu, q, cache, &mut bufs.scores, stride, paths.logits))?;
        let topk_g = {
            let IndexerBuffers {
                scores, topk: tb, ..
            } = &mut bufs;
            gpu.capture(|| {
                topk_with(
                    gpu,
                    paths.topk,
                    scores,
                    stride,
                    &q.num_valid,
                    &q.num_valid_host,
                    tb,
                )
            })?
        };
        let total_g = gpu.capture(|| run_with(gpu, paths, q, cache, &mut bufs))?;
        let n = GRAPH_REPLAYS_PER_SAMPLE;
        return Ok(IndexerSamples {
            logits: gpu.time_graph_us(&logits_g, plan, n)?,
            topk: gpu.time_graph_us(&topk_g, plan, n)?,
            total: gpu.time_graph_us(&total_g, plan, n)?,
        });
    }
    match variant {
        "baseline" => {
            let mut base = BaselineBuffers::new(gpu, q.batch, q.rows(), cache.capacity)?;
            let logits_s = gpu.time_us(plan, || {
                baseline_logits(gpu, q, cache, &mut base, &mut bufs.scores, stride)
            })?;
            let IndexerBuffers {
                scores, topk: tb, ..
            } = &mut bufs;
            let topk_s = gpu.time_us(plan, || {
                baseline_topk(gpu, scores, stride, q, &mut base, tb)
            })?;
            let total = gpu.time_us(plan, || {
                baseline_logits(gpu, q, cache, &mut base, &mut bufs.scores, stride)?;
                let IndexerBuffers {
                    scores, topk: tb, ..
                } = &mut bufs;
                baseline_topk(gpu, scores, stride, q, &mut base, tb)
            })?;
            Ok(IndexerSamples {
                logits: logits_s,
                topk: topk_s,
                total,
            })
        }
        _ => bail!(
            "unknown indexer variant `{variant}` (expected one of {})",
            VARIANTS.join(", ")
        ),
    }
}

/// Bytes one call moves: (logits: keys + q + w read, scores written; top-k: scores read, k x 8 B written).
pub fn traffic_bytes(inp: &BenchInputs, k: usize) -> (u64, u64) {
    let (q, cache) = (&inp.q, &inp.cache);
    let n = q.max_valid();
    let rows = q.rows();
    let key_bytes = q.batch * cache.bytes_for(n);
    let logits = key_bytes + rows * NUM_HEADS * (HEAD_DIM + 4) + rows * n * 4;
    let topk = rows * n * 4 + rows * k * 8;
    (logits as u64, topk as u64)
}
