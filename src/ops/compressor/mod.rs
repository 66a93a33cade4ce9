//! The KV compressors of DeepSeek-V4 (dsv4-architecture §3.7) on the GPU (kernels/compressor.cu): the
//! decode-time state update that emits a compressed entry every `m` tokens, and a chunk of one sequence continuing its
//! state (the chunked prefill). CPU oracle: `model::reference::{CompressorState, pool_softmax}` and
//! `Model::{compressor_inputs, finalize_entry}` (glue in [`reference`]).
//!
//! Contract, for a compressor of ratio m and d channels ([`CompressorKind`]: CSA main m = 4, d = 512,
//! overlapping; HCA main m = 128, d = 512; CSA indexer m = 4, d = 128, overlapping), W = coff*d (coff = 2 when
//! overlapping):
//! * Inputs per token: kv and gate f32 `[W]` (the BF16 linears of the attention input); the layer's `ape` f32
//!   `[m, W]` is added to the gate here (score = gate + ape[t mod m]).
//! * Device state per sequence ([`CompressorShape::state_floats`] f32): CompressorState's `kv` then `score`, each
//!   `[coff*m, W]` row-major, bit for bit the CPU state after the same tokens ([`reference::host_state`]). An empty
//!   state is kv 0, score -inf ([`reference::host_state`] of a new state, uploaded).
//! * Decode ([`decode_step`]): `positions[b]` (device) is sequence b's position t; t < 0 leaves everything of
//!   row b untouched. When (t + 1) % m == 0 the kernel pools, finalizes and stores entry j = (t+1)/m - 1 at slot
//!   `base[b] + j` of the cache, only if `j < capacity[b]` and the slot is inside the cache; otherwise it writes no
//!   entry and sets bit 0 of `error` (never cleared by the kernels; the host reads it after the step).
//! * Chunk ([`chunk`], one sequence): n tokens at positions `p0..p0 + n` (`positions[0]` = p0, device) continuing
//!   the sequence's state: the entries and the state of n decode steps, bit for bit (the same pooling in the same
//!   order; the state moves are copies), in two launches instead of n (the engine's chunked prefill).
//! * Cache formats: main = 584-byte FP8 KV entries (`formats::kv`, the pool `sparse_attn` reads); indexer = the
//!   indexer family's key cache ([`KeyCacheGpu`], FP8 132 B or MXFP4 68 B; its logits read sequence b's keys at
//!   `b * capacity + j`, so set `base[b] = b * capacity`).
//! * Graph-safe: grids from the batch capacity / the token capacity, positions, token counts, bases and
//!   capacities read on the device, no scratch (the state is the caller's), nothing read back.
//!
//! Numerics (kernels/compressor.cu states the identities): the state and the stored codes are exact functions of
//! the pooled values; pooling rounds like `pool_softmax` except exp (f64 exp rounded to f32 vs the host's expf,
//! which agree except near an f32 rounding boundary); the RMSNorm sum is in f64 and exact for these inputs.
//!
//! No `megamoe exec` entry: the CPU side of the finalize is `Model::finalize_entry`, bound to a model's weights
//! and layer, so an exec on user tensors would need a second CPU derivation of it.

pub mod bench;
pub mod reference;

use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;

use crate::formats::kv::ENTRY_BYTES as KV_ENTRY_BYTES;
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
use crate::ops::indexer::{reference::SCALE_BYTES as KEY_SCALE_BYTES, KeyCacheGpu, KeyFormat};

/// Kernel family name (kernels/compressor.cu).
pub const FAMILY: &str = "compressor";
/// Channels of a main compressor (head_dim; the KV entry's 512 dims).
pub const MAIN_DIM: usize = 512;
/// Channels of the indexer compressor (index_head_dim).
pub const INDEX_DIM: usize = 128;
/// RoPE dims at the end of every entry (rope_head_dim): the kernels take `ROPE_DIMS / 2` f64 frequencies.
pub const ROPE_DIMS: usize = 64;
/// Block size of the chunk's state kernel (compressor_chunk_state).
const STATE_THREADS: u32 = 256;

/// Which compressor: its channel count, overlap and entry format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressorKind {
    /// CSA layer, main compressor: overlapping, d = 512, 584-byte KV entries.
    CsaMain,
    /// HCA layer, main compressor: no overlap, d = 512, 584-byte KV entries.
    HcaMain,
    /// CSA layer, indexer compressor: overlapping, d = 128, indexer keys in the given cache format.
    CsaIndex(KeyFormat),
}

impl CompressorKind {
    pub fn dim(self) -> usize {
        match self {
            CompressorKind::CsaMain | CompressorKind::HcaMain => MAIN_DIM,
            CompressorKind::CsaIndex(_) => INDEX_DIM,
        }
    }
    pub fn overlap(self) -> bool {
        !matches!(self, CompressorKind::HcaMain)
    }
    /// Bytes of one stored entry (KV entry, or indexer key in its format).
    pub fn entry_bytes(self) -> usize {
        match self {
            CompressorKind::CsaIndex(f) => f.entry_bytes(),
            _ => KV_ENTRY_BYTES,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            CompressorKind::CsaMain => "csa_main",
            CompressorKind::HcaMain => "hca_main",
            CompressorKind::CsaIndex(KeyFormat::Fp8) => "csa_index_fp8",
            CompressorKind::CsaIndex(KeyFormat::Mxfp4) => "csa_index_mxfp4",
        }
    }
    fn decode_kernel(self) -> String {
        format!("compressor_decode_{}", self.name())
    }
    fn chunk_kernel(self) -> String {
        format!("compressor_chunk_entries_{}", self.name())
    }
}

/// One compressor's geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompressorShape {
    pub kind: CompressorKind,
    /// m: tokens per compressed entry.
    pub ratio: usize,
}

impl CompressorShape {
    pub fn dim(&self) -> usize {
        self.kind.dim()
    }
    pub fn coff(&self) -> usize {
        if self.kind.overlap() {
            2
        } else {
            1
        }
    }
    /// W = coff * d: channels of one token's kv / gate and of one state row.
    pub fn width(&self) -> usize {
        self.coff() * self.dim()
    }
    /// Rows of the state: coff * m.
    pub fn rows(&self) -> usize {
        self.coff() * self.ratio
    }
    /// f32 of one sequence's state: the kv plane then the score plane, `[rows, W]` each.
    pub fn state_floats(&self) -> usize {
        2 * self.rows() * self.width()
    }
    /// `1 <= m`, and the state of one sequence indexable by the kernels' 32-bit row offsets.
    pub fn check(&self) -> Result<()> {
        ensure!(self.ratio >= 1, "compressor: ratio m = 0");
        ensure!(
            self.state_floats() <= i32::MAX as usize,
            "compressor: ratio {} makes a state of {} floats per sequence",
            self.ratio,
            self.state_floats()
        );
        Ok(())
    }
}

/// A layer's constant device inputs of one compressor.
pub struct CompressorWeights {
    /// Learned position bias, f32 `[m, W]`.
    pub ape: CudaSlice<f32>,
    /// The compressor's `norm.weight`, f32 `[d]`.
    pub norm: CudaSlice<f32>,
    /// The layer's RoPE frequencies (`RopeTable::freqs`), f64 `[ROPE_DIMS / 2]`.
    pub freqs: CudaSlice<f64>,
    /// RMSNorm epsilon.
    pub eps: f32,
}

impl CompressorWeights {
    /// Upload host values after checking their lengths against `shape`.
    pub fn upload(
        gpu: &Gpu,
        shape: &CompressorShape,
        ape: &[f32],
        norm: &[f32],
        freqs: &[f64],
        eps: f32,
    ) -> Result<CompressorWeights> {
        shape.check()?;
        ensure!(
            ape.len() == shape.ratio * shape.width(),
            "compressor: ape has {} values, expected m x W = {} x {}",
            ape.len(),
            shape.ratio,
            shape.width()
        );
        ensure!(
            norm.len() == shape.dim(),
            "compressor: norm weight has {} values, expected d = {}",
            norm.len(),
            shape.dim()
        );
        ensure!(
            freqs.len() == ROPE_DIMS / 2,
            "compressor: {} RoPE frequencies, expected {}",
            freqs.len(),
            ROPE_DIMS / 2
        );
        ensure!(
            eps.is_finite() && eps >= 0.0,
            "compressor: eps {eps} must be finite and >= 0"
        );
        Ok(CompressorWeights {
            ape: gpu.upload(ape)?,
            norm: gpu.upload(norm)?,
            freqs: gpu.upload(freqs)?,
            eps,
        })
    }
}

/// Where emitted entries go.
#[derive(Clone, Copy, Debug)]
pub enum EntryCache {
    /// A pool of 584-byte KV entries (`n_slots * 584` bytes).
    Kv { entries: DevBuf<u8> },
    /// An indexer key cache: codes `[n_slots, 128 | 64]`, scales `[n_slots, 4 bytes]` (f32 or 4 ue8m0).
    Index {
        format: KeyFormat,
        codes: DevBuf<u8>,
        scales: DevBuf<u8>,
    },
}

impl EntryCache {
    pub fn kv(entries: &CudaSlice<u8>) -> EntryCache {
        EntryCache::Kv {
            entries: DevBuf::of(entries),
        }
    }
    /// The whole key cache (slots `0..batch * capacity`).
    pub fn index(cache: &KeyCacheGpu) -> EntryCache {
        EntryCache::Index {
            format: cache.format,
            codes: DevBuf::of(&cache.codes),
            scales: DevBuf::of(&cache.scales),
        }
    }
    /// Entries the cache holds.
    pub fn n_slots(&self) -> usize {
        match self {
            EntryCache::Kv { entries } => entries.len() / KV_ENTRY_BYTES,
            EntryCache::Index {
                format,
                codes,
                scales,
            } => (codes.len() / format.code_bytes()).min(scales.len() / KEY_SCALE_BYTES),
        }
    }
    fn check(&self, kind: CompressorKind) -> Result<()> {
        match (self, kind) {
            (EntryCache::Kv { .. }, CompressorKind::CsaMain | CompressorKind::HcaMain) => {}
            (EntryCache::Index { format, .. }, CompressorKind::CsaIndex(f)) => ensure!(
                *format == f,
                "compressor: a {} key cache for a {} compressor",
                format.name(),
                kind.name()
            ),
            _ => anyhow::bail!(
                "compressor: the {} compressor cannot write this cache kind ({self:?})",
                kind.name()
            ),
        }
        ensure!(
            self.n_slots() >= 1 && self.n_slots() <= i32::MAX as usize,
            "compressor: cache of {} entries (1..=i32::MAX)",
            self.n_slots()
        );
        Ok(())
    }
    fn push_args(&self, a: &mut KernelArgs) {
        match self {
            EntryCache::Kv { entries } => {
                a.i32(self.n_slots() as i32).buf(entries).null();
            }
            EntryCache::Index { codes, scales, .. } => {
                a.i32(self.n_slots() as i32).buf(codes).buf(scales);
            }
        }
    }
}

/// Per-sequence entry placement, read on the device: entry j of sequence b goes to slot `base[b] + j` when
/// `j < capacity[b]`.
#[derive(Clone, Copy, Debug)]
pub struct EntrySlots {
    pub base: DevBuf<i32>,
    pub capacity: DevBuf<i32>,
}

/// The device buffers of one decode step of `batch` sequences.
#[derive(Clone, Copy, Debug)]
pub struct DecodeIo {
    pub batch: usize,
    /// f32 `[batch, W]` each.
    pub kv: DevBuf<f32>,
    pub gate: DevBuf<f32>,
    /// i32 `[batch]`: each sequence's position (< 0: an empty row).
    pub positions: DevBuf<i32>,
    /// f32 `[batch, state_floats]`.
    pub state: DevBuf<f32>,
    pub slots: EntrySlots,
    pub cache: EntryCache,
    /// Optional probe: the pooled f32 values `[batch, d]` of the rows that emitted (tests).
    pub pooled: Option<DevBuf<f32>>,
    /// u32 `[1]`: bit 0 set when an entry fell outside its capacity or the cache.
    pub error: DevBuf<u32>,
}

fn check_len<T>(b: &impl DeviceBuf<T>, need: usize, what: &str) -> Result<()> {
    ensure!(
        b.elems() >= need,
        "compressor: {what} has {} elements, needs {need}",
        b.elems()
    );
    Ok(())
}

fn check_weights(shape: &CompressorShape, w: &CompressorWeights) -> Result<()> {
    check_len(&w.ape, shape.ratio * shape.width(), "ape [m, W]")?;
    check_len(&w.norm, shape.dim(), "norm weight [d]")?;
    check_len(&w.freqs, ROPE_DIMS / 2, "RoPE frequencies")
}

/// The parameters the decode kernels take after their inputs, in their order: norm_w, freqs, eps,
/// base, capacity, n_slots, out_codes, out_scales, pooled_out, error.
fn push_finalize_args(
    a: &mut KernelArgs,
    w: &CompressorWeights,
    slots: &EntrySlots,
    cache: &EntryCache,
    pooled: &Option<DevBuf<f32>>,
    error: &DevBuf<u32>,
) {
    a.buf(&w.norm)
        .buf(&w.freqs)
        .f32(w.eps)
        .buf(&slots.base)
        .buf(&slots.capacity);
    cache.push_args(a);
    match pooled {
        Some(p) => a.buf(p),
        None => a.null(),
    };
    a.buf(error);
}

/// The checks of [`decode_step`], before any launch.
pub fn check_decode(shape: &CompressorShape, w: &CompressorWeights, io: &DecodeIo) -> Result<()> {
    shape.check()?;
    check_weights(shape, w)?;
    ensure!(
        (1..=65535).contains(&io.batch),
        "compressor: batch {} (1..=65535)",
        io.batch
    );
    let b = io.batch;
    check_len(&io.kv, b * shape.width(), "kv [B, W]")?;
    check_len(&io.gate, b * shape.width(), "gate [B, W]")?;
    check_len(&io.positions, b, "positions [B]")?;
    check_len(
        &io.state,
        b * shape.state_floats(),
        "state [B, state_floats]",
    )?;
    check_len(&io.slots.base, b, "base [B]")?;
    check_len(&io.slots.capacity, b, "capacity [B]")?;
    if let Some(p) = &io.pooled {
        check_len(p, b * shape.dim(), "pooled probe [B, d]")?;
    }
    check_len(&io.error, 1, "error word")?;
    io.cache.check(shape.kind)
}

/// Channels of one decode CTA (`kSliceDims` in kernels/compressor.cu): a sequence's step runs as one cluster of
/// `d / DECODE_SLICE_DIMS` CTAs (8 for the main compressors, 2 for the indexer), fixed by the kernel
/// (`__cluster_dims__`).
pub const DECODE_SLICE_DIMS: usize = 64;
/// Most sequences of one decode launch (the sequence is grid.y).
pub const DECODE_MAX_BATCH: usize = 65535;

/// One decode step of `io.batch` sequences, one launch on the grid [`DecodeGrid::for_batch`] picks (module docs
/// for the contract; kernels/compressor.cu for why the cluster's split gives the one-CTA kernel's bits). Every check
/// runs before the launch.
pub fn decode_step(
    gpu: &Gpu,
    stream: &Stream,
    shape: &CompressorShape,
    w: &CompressorWeights,
    io: &DecodeIo,
) -> Result<()> {
    let grid = DecodeGrid::for_batch(io.batch, shape.dim(), gpu.info.sm_count.max(1) as usize);
    decode_step_with(gpu, stream, shape, w, io, grid)
}

/// How [`decode_step_with`] launches a decode step. Both give the same bits (tests/compressor.rs compares them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeGrid {
    /// A cluster of `d / 64` CTAs of d threads per sequence (`compressor_decode_<kind>`, grid `(d / 64, batch)`):
    /// each CTA updates and pools 64 channels, cluster rank 0 finalizes and stores the entry.
    Cluster,
    /// One CTA per sequence (`compressor_decode_<kind>_one_cta`, grid = batch).
    OneCta,
}

impl DecodeGrid {
    /// The routed rule: [`DecodeGrid::Cluster`] while the clusters fit in one wave (`batch x d / 64 <= SMs`), else
    /// [`DecodeGrid::OneCta`]. Measured (results/h100/compressor_decode.csv, bench-configs/ab/compressor_cluster.toml,
    /// H100, us, cluster / one CTA): HCA main emit batch 1 14.0 / 41.0, batch 8 13.5 / 40.9, batch 64 50.5 / 45.4; CSA
    /// main emit 6.4 / 8.0, 6.6 / 8.0, 14.3 / 8.2; update at batch 64 4.1-4.2 / 2.4-2.5 (equal below); the indexer's
    /// (d = 128, 2 CTAs a sequence) 8.3-8.8 / 8.2-8.4 at every batch (a tie: one wave either way). At batch 64 the
    /// main compressors' 512 clusters' CTAs need four waves on 132 SMs where the one-CTA grid needs one.
    pub fn for_batch(batch: usize, dim: usize, sms: usize) -> DecodeGrid {
        if batch * (dim / DECODE_SLICE_DIMS).max(1) <= sms {
            DecodeGrid::Cluster
        } else {
            DecodeGrid::OneCta
        }
    }
}

/// [`decode_step`] with an explicit [`DecodeGrid`].
pub fn decode_step_with(
    gpu: &Gpu,
    stream: &Stream,
    shape: &CompressorShape,
    w: &CompressorWeights,
    io: &DecodeIo,
    grid: DecodeGrid,
) -> Result<()> {
    check_decode(shape, w, io)?;
    ensure!(
        io.batch <= DECODE_MAX_BATCH,
        "compressor decode: batch {} is above {DECODE_MAX_BATCH} sequences per launch",
        io.batch
    );
    let (name, grid) = match grid {
        DecodeGrid::Cluster => (
            shape.kind.decode_kernel(),
            ((shape.dim() / DECODE_SLICE_DIMS) as u32, io.batch as u32, 1),
        ),
        DecodeGrid::OneCta => (
            format!("{}_one_cta", shape.kind.decode_kernel()),
            (io.batch as u32, 1, 1),
        ),
    };
    let k = gpu.kernel(FAMILY, &name)?;
    let mut a = KernelArgs::new();
    a.buf(&io.kv)
        .buf(&io.gate)
        .buf(&w.ape)
        .buf(&io.positions)
        .i32(shape.ratio as i32)
        .buf(&io.state);
    push_finalize_args(&mut a, w, &io.slots, &io.cache, &io.pooled, &io.error);
    // SAFETY: arguments in the kernel's order (COMPRESSOR_DECODE_PARAMS); every buffer was checked against the
    // batch and the shape; the kernel reads base/capacity/positions for b < batch only and bounds every slot by
    // the cache's entry count.
    unsafe {
        launch(
            stream,
            &k,
            Launch::new(grid, (shape.dim() as u32, 1, 1)),
            &mut a,
        )
    }
}

/// The arguments of `compressor_chunk_state`: kv, gate, ape, then `at` (the chunk's first position, read on the
/// device), the rows `n`, the ratio, W, the overlap flag and the state.
fn state_rows_args(
    shape: &CompressorShape,
    w: &CompressorWeights,
    kv: &DevBuf<f32>,
    gate: &DevBuf<f32>,
    at: &DevBuf<i32>,
    n: usize,
    state: &DevBuf<f32>,
) -> KernelArgs {
    let mut a = KernelArgs::new();
    a.buf(kv)
        .buf(gate)
        .buf(&w.ape)
        .buf(at)
        .i32(n as i32)
        .i32(shape.ratio as i32)
        .i32(shape.width() as i32)
        .i32(shape.kind.overlap() as i32)
        .buf(state);
    a
}

/// The device buffers of a chunk of one sequence ([`chunk`]).
#[derive(Clone, Copy, Debug)]
pub struct ChunkIo {
    /// Tokens of the chunk (its real rows; the host knows it): rows `0..n` of `kv` / `gate`.
    pub n: usize,
    /// f32 `[>= n, W]` each (the raw gate: `ape` is added by the kernels).
    pub kv: DevBuf<f32>,
    pub gate: DevBuf<f32>,
    /// i32 `[>= 1]`: `positions[0]` is the chunk's first position p0 (< 0: the chunk changes nothing); row i is at
    /// position p0 + i.
    pub positions: DevBuf<i32>,
    /// f32 `[state_floats]`: the sequence's state, as p0 decode steps left it; updated in place.
    pub state: DevBuf<f32>,
    /// `[>= 1]` each: the sequence's entry base and capacity (element 0 is read).
    pub slots: EntrySlots,
    pub cache: EntryCache,
    pub error: DevBuf<u32>,
}

/// A chunk of `io.n` tokens of one sequence at positions `p0..p0 + n` (p0 = `positions[0]`, read on the device)
/// continuing its state: every entry whose block ends in the chunk (`compressor_chunk_entries_<kind>`, grid n / m +
/// 1, one CTA an entry, d threads), then the state as n more decode steps leave it (`compressor_chunk_state`, grid m,
/// 256 threads). Exactly n [`decode_step`]s of the sequence, bit for bit (kernels/compressor.cu; host twin
/// [`reference::chunk_host`]), in two launches. Every check runs before the first launch.
pub fn chunk(
    gpu: &Gpu,
    stream: &Stream,
    shape: &CompressorShape,
    w: &CompressorWeights,
    io: &ChunkIo,
) -> Result<()> {
    shape.check()?;
    check_weights(shape, w)?;
    let n = io.n;
    ensure!(
        (1..=i32::MAX as usize / shape.width()).contains(&n),
        "compressor chunk: {n} tokens"
    );
    check_len(&io.kv, n * shape.width(), "kv [n, W]")?;
    check_len(&io.gate, n * shape.width(), "gate [n, W]")?;
    check_len(&io.positions, 1, "positions [1]")?;
    check_len(&io.state, shape.state_floats(), "state")?;
    check_len(&io.slots.base, 1, "base [1]")?;
    check_len(&io.slots.capacity, 1, "capacity [1]")?;
    check_len(&io.error, 1, "error word")?;
    io.cache.check(shape.kind)?;
    let k_entries = gpu.kernel(FAMILY, &shape.kind.chunk_kernel())?;
    let k_state = gpu.kernel(FAMILY, "compressor_chunk_state")?;
    // The decode kernels' finalize parameters without the pooled probe.
    let mut a = KernelArgs::new();
    a.buf(&io.kv)
        .buf(&io.gate)
        .buf(&w.ape)
        .buf(&io.positions)
        .i32(n as i32)
        .i32(shape.ratio as i32)
        .buf(&io.state)
        .buf(&w.norm)
        .buf(&w.freqs)
        .f32(w.eps)
        .buf(&io.slots.base)
        .buf(&io.slots.capacity);
    io.cache.push_args(&mut a);
    a.buf(&io.error);
    let blocks = n / shape.ratio + 1;
    // SAFETY: arguments in the kernel's order (kv_in, gate_in, ape, positions, n, ratio, state, norm_w, freqs, eps,
    // base, capacity, n_slots, out_codes, out_scales, error); kv/gate hold n rows and the kernel reads rows < n
    // only; the state holds state_floats; slots are bounded by the cache's entry count.
    unsafe {
        launch(
            stream,
            &k_entries,
            Launch::new((blocks as u32, 1, 1), (shape.dim() as u32, 1, 1)),
            &mut a,
        )?
    };
    let mut a = state_rows_args(shape, w, &io.kv, &io.gate, &io.positions, n, &io.state);
    // SAFETY: arguments in the kernel's order; CTA r < m touches state rows r and m + r (< coff * m) of W channels
    // and input rows < n.
    unsafe {
        launch(
            stream,
            &k_state,
            Launch::new((shape.ratio as u32, 1, 1), (STATE_THREADS, 1, 1)),
            &mut a,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_of_the_three_compressors() {
        let csa = CompressorShape {
            kind: CompressorKind::CsaMain,
            ratio: 4,
        };
        assert_eq!(
            (csa.width(), csa.rows(), csa.state_floats()),
            (1024, 8, 2 * 8 * 1024)
        );
        let hca = CompressorShape {
            kind: CompressorKind::HcaMain,
            ratio: 128,
        };
        assert_eq!(
            (hca.width(), hca.rows(), hca.state_floats()),
            (512, 128, 2 * 128 * 512)
        );
        let idx = CompressorShape {
            kind: CompressorKind::CsaIndex(KeyFormat::Mxfp4),
            ratio: 4,
        };
        assert_eq!((idx.width(), idx.rows()), (256, 8));
        assert_eq!(idx.kind.entry_bytes(), 68);
        assert_eq!(csa.kind.entry_bytes(), 584);
        assert!(CompressorShape {
            kind: CompressorKind::HcaMain,
            ratio: 0
        }
        .check()
        .is_err());
    }

    /// Every entry point a launcher resolves is one nvcc compiled (the names come from ptxas, so the macro-made
    /// entry points are listed; without cubins the list holds literal names only).
    #[cfg(has_cubins)]
    #[test]
    fn every_launched_entry_point_is_compiled() {
        let src = crate::gpu::module::find(FAMILY).unwrap();
        let mut names = vec!["compressor_chunk_state".to_string()];
        for kind in [
            CompressorKind::CsaMain,
            CompressorKind::HcaMain,
            CompressorKind::CsaIndex(KeyFormat::Fp8),
            CompressorKind::CsaIndex(KeyFormat::Mxfp4),
        ] {
            names.push(kind.decode_kernel());
            names.push(format!("{}_one_cta", kind.decode_kernel()));
            names.push(kind.chunk_kernel());
        }
        for n in &names {
            assert!(src.functions.contains(&n.as_str()), "{n} not compiled");
        }
        assert_eq!(src.functions.len(), names.len());
    }

    #[test]
    fn kernel_names_match_the_entry_points() {
        assert_eq!(
            CompressorKind::CsaIndex(KeyFormat::Fp8).decode_kernel(),
            "compressor_decode_csa_index_fp8"
        );
        assert_eq!(
            CompressorKind::HcaMain.chunk_kernel(),
            "compressor_chunk_entries_hca_main"
        );
    }
}
