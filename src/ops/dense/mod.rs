//! Decode dense linears of DeepSeek-V4 on the GPU (kernels/dense.cu): `y[M, N] = x[M, K] . W[N, K]^T` for
//! M = 1..=64 activation rows, the weight streamed once from HBM.
//!
//! Contract (the CPU oracles are the model's own functions, see [`reference`]):
//! * [`fp8_linear`]: W e4m3 codes `[N, K]` with the checkpoint's ue8m0 128x128 block scales `[N/128, K/128]`; x the
//!   FP8 1x128 rows that `norm_quant`'s `OutFormat::Fp8` writes (e4m3 codes `[M, K]`, ue8m0 scale codes
//!   `[M, K/128]`); `y = bf16(sum_k dequant(W)[n, k] * dequant(x)[m, k])`, BF16 `[M, N]`. `Model::fp8_linear`.
//! * [`wo_a_grouped`]: the grouped output projection's first half: group g of G reads BF16 `o[m, g*K .. (g+1)*K]`
//!   (not quantized) and rows `g*R .. (g+1)*R` of the FP8 `wo_a` `[G*R, K]`; `z[m, g*R + r] = bf16(sum)`, BF16
//!   `[M, G*R]`. `Model::out_proj`'s `matvec_rows` loop. The weight stays FP8 in memory.
//! * [`swiglu_fp8`]: the shared expert's first half: g = bf16(w1 . x), u = bf16(w3 . x) (x FP8 1x128, read once for
//!   both), clamped (`g <= L`, `-L <= u <= L` when L > 0), `h = bf16(silu(g) * u)`, written as FP8 1x128 (codes
//!   `[M, I]` + ue8m0 scales `[M, I/128]`, the `formats::fp8` rule). [`shared_expert`] = it + [`fp8_linear`] with w2:
//!   `Model::expert(prefix, x, 1.0)`.
//! * [`bf16_linear`]: W BF16 `[N_j, K]` for up to [`MAX_JOBS`] weights sharing one BF16 x `[M, K]` (one launch
//!   reads x once): `y_j = x . W_j^T`, f32 `[M, N_j]` (the model's `matvec`; callers round).
//!
//! Shape rules (checked before any launch, with the reason in the message): 1 <= M <= [`MAX_CALL_ROWS`]; FP8 weights:
//! N % 128 == 0 and K % 128 == 0 (one CTA = one 128-row scale block; scale blocks along K); BF16: N >= 1 (any),
//! K % 64 == 0 (128-byte row lines); all device buffers 16-byte aligned.
//!
//! Graph-safe: grids and split-K come from the capacities (M, N, K) and the SM count, never from device data. Split-K
//! partials and the per-tile arrival counters live in the caller's [`DenseWorkspace`]; the counters must be zero
//! before the first call ([`DenseWorkspace::carve`] zeroes them) and every call leaves them zero. One call at a time
//! per workspace (calls on one stream serialize, so one workspace serves every linear of a decode step).
//!
//! Prefill sizes (M up to 16K) go through cuBLASLt's block-scaled FP8 GEMM: [`prefill`].
//!
//! Calls of more than [`MAX_ROWS`] rows (the chunked prefill's chunks, `engine::prefill`): the FP8 and BF16 linears
//! take the tensor-core route whatever the route in force ([`route::path_for`]; the GEMV cannot take them in one
//! launch), and what has no tensor-core route (the shared expert's fused SwiGLU half, the grouped wo_a with BF16 x on
//! FP8 weights, an FP8 weight without f32 scales) runs as GEMV launches of at most [`MAX_ROWS`] rows each, in order
//! on the stream, each piece streaming the whole weight again ([`row_pieces`]). Calls of up to [`MAX_ROWS`] rows (the
//! decode step) are unchanged.
//!
//! The tensor-core route ([`route`]): from some M on, the GEMV's time grows with M while cuBLASLt's stays flat, so
//! [`fp8_linear`] / [`fp8_linears`] (and the shared expert's w2) may run as cuBLASLt's block-scaled FP8 GEMM
//! ([`prefill::fp8_linears_prefill`], one GEMM per job; needs the weight's f32 block scales,
//! [`Fp8Weight::scales_f32`]) and [`bf16_linear`] as cuBLASLt BF16 GEMMs with an f32 output
//! ([`crate::gpu::blas::Blas::bf16_gemm_f32`], one per job). The route is decided per launch from the shape by the
//! rule in [`route`] under the route the workspace was carved with ([`DenseWorkspace::path`]); the default route
//! is the GEMV everywhere ([`route::DEFAULT_ROUTE`]). The cuBLASLt handle is the GPU's ([`Gpu::blas`]); its workspace
//! and the FP8 route's scratch are carved in the caller's [`DenseWorkspace`] (one call at a time per workspace, as
//! for the split-K partials), so concurrent calls on other streams (the overlapped shared expert) each use their
//! own. PDL: cuBLASLt's kernels are launched without our PDL attribute. That is safe: a PDL kernel (the mHC pair's) after one of them
//! starts with `griddepcontrol.wait`, which waits for the full completion (and memory flush) of its prerequisite
//! grid whether or not that grid triggers early, and a cuBLASLt kernel after one of ours is an ordinary stream-ordered
//! launch.
//!
//! Rooms: `reference.rs` (glue to the CPU model), `bench.rs` (measurement hooks), `exec.rs` (`megamoe exec`),
//! `prefill.rs` (the cuBLASLt path), `route.rs` (the GEMV / tensor-core rule).

pub mod bench;
pub mod exec;
pub mod prefill;
pub mod reference;
pub mod route;

pub use route::{with_route, DensePath, DenseRoute};

use std::borrow::Borrow;

use anyhow::{ensure, Result};
use half::bf16;

use crate::gpu::arena::{self, Arena, WorkspaceLayout};
use crate::gpu::blas::{Bf16GemmShape, BlockScaledShape, BLOCK_SCALED_MAX_WORKSPACE};
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
use prefill::{Fp8LinearWorkspace, Fp8PrefillJob, Fp8WeightView};

/// Kernel family name (kernels/dense.cu).
pub const FAMILY: &str = "dense";
/// Most activation rows per GEMV launch (the kernels' token capacity, 8 MMA token groups).
pub const MAX_ROWS: usize = 64;
/// Most activation rows per launcher call: above [`MAX_ROWS`] a call takes the tensor-core route or runs as GEMV
/// pieces of [`MAX_ROWS`] rows (module docs).
pub const MAX_CALL_ROWS: usize = 16384;

/// `(first row, rows)` of each GEMV launch of a call of `rows` rows: pieces of [`MAX_ROWS`], the last one shorter.
pub fn row_pieces(rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..rows)
        .step_by(MAX_ROWS)
        .map(move |r0| (r0, MAX_ROWS.min(rows - r0)))
}
/// Most weights (or wo_a groups) per launch (`kMaxJobs`).
pub const MAX_JOBS: usize = 16;
/// Rows per CTA (`kTileRows`; one FP8 scale row block).
pub const TILE_ROWS: usize = 128;
const THREADS: u32 = 256;
/// The per-CTA weight ring (`kRingBytes`; the SwiGLU pair's `kRingBytesPair`), also the epilogue's buffer.
const RING_BYTES: usize = 65536;
const RING_BYTES_PAIR: usize = 98304;
/// Shared memory a launch may plan on (the H100/H200 opt-in limit is 227 KB; 1 KB left for static use).
const SMEM_BUDGET: usize = 226 * 1024;

/// What a launch computes (the kernel's `Mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseKind {
    /// FP8 weight, FP8 1x128 x, BF16 y.
    Fp8,
    /// FP8 weight, BF16 x, BF16 y (the grouped wo_a).
    Fp8Bf16x,
    /// BF16 weight, BF16 x, f32 y.
    Bf16,
    /// FP8 w1 and w3, FP8 x, FP8 1x128 h.
    Swiglu,
    /// FP8 weight, BF16 x quantized to FP8 1x128 as it is staged (norm_quant's rule), BF16 y: [`Fp8`]'s bits on
    /// `quantize_bf16_rows` of x, without the quantizer's launch ([`fp8_linears_of_bf16`]; GEMV only).
    ///
    /// [`Fp8`]: DenseKind::Fp8
    Fp8QuantX,
    /// [`Fp8QuantX`] after an RMSNorm of each x row: [`Fp8`]'s bits on norm_quant's RMSNorm + FP8 of x.
    ///
    /// [`Fp8QuantX`]: DenseKind::Fp8QuantX
    /// [`Fp8`]: DenseKind::Fp8
    Fp8NormQuantX,
}

impl DenseKind {
    fn prefix(self) -> &'static str {
        match self {
            DenseKind::Fp8 => "dense_fp8",
            DenseKind::Fp8Bf16x => "dense_fp8_bf16x",
            DenseKind::Bf16 => "dense_bf16",
            DenseKind::Swiglu => "dense_swiglu",
            DenseKind::Fp8QuantX => "dense_fp8_qx",
            DenseKind::Fp8NormQuantX => "dense_fp8_normqx",
        }
    }
    fn weight_fp8(self) -> bool {
        self != DenseKind::Bf16
    }
    /// Whether x is FP8 1x128 rows (codes and ue8m0 scales); else BF16.
    fn x_fp8(self) -> bool {
        matches!(self, DenseKind::Fp8 | DenseKind::Swiglu)
    }
    /// Weights one warp streams (w1 and w3 for SwiGLU).
    fn weights_per_warp(self) -> usize {
        if self == DenseKind::Swiglu {
            2
        } else {
            1
        }
    }
    /// Bytes of staged x per lane per step (16-bit values): 32 with FP8 weights, 16 with BF16 weights.
    fn x_pad(self) -> usize {
        if self.weight_fp8() {
            16
        } else {
            64
        }
    }
    /// Granule of a split's K slice: a scale block (FP8) or 64 columns (BF16, keeps the staged rows bank-aligned).
    fn k_granule(self) -> usize {
        if self.weight_fp8() {
            128
        } else {
            64
        }
    }
}

/// The sizes of one launch: `rows` (M) activation rows, `jobs` weights (or wo_a groups) of `n` rows each (the
/// largest, for jobs of different heights) and `k` columns. The grid has a row tile of every job for each of the
/// `ceil(n / 128)` tiles; `busy_tiles` counts those that hold rows of their job (the others exit at once), which is
/// what [`plan`]'s occupancy rule counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseShape {
    pub kind: DenseKind,
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub jobs: usize,
    pub busy_tiles: usize,
}

impl DenseShape {
    /// `jobs` weights of `n` rows each: every tile of the grid holds rows.
    pub fn new(kind: DenseKind, rows: usize, n: usize, k: usize, jobs: usize) -> DenseShape {
        DenseShape {
            kind,
            rows,
            n,
            k,
            jobs,
            busy_tiles: jobs * n.div_ceil(TILE_ROWS),
        }
    }
    /// One launch of weights of these heights (job `j` has the `j`-th) sharing x: `n` the tallest. One pass, no
    /// allocation (the launchers call it on every launch).
    pub fn of_heights<H: Borrow<usize>>(
        kind: DenseKind,
        rows: usize,
        k: usize,
        heights: impl IntoIterator<Item = H>,
    ) -> DenseShape {
        let mut s = DenseShape::new(kind, rows, 0, k, 0);
        for h in heights {
            let h = *h.borrow();
            s.n = s.n.max(h);
            s.jobs += 1;
            s.busy_tiles += h.div_ceil(TILE_ROWS);
        }
        s
    }
    /// The shape rules of the module docs.
    pub fn check(&self) -> Result<()> {
        let DenseShape {
            kind,
            rows,
            n,
            k,
            jobs,
            busy_tiles,
        } = *self;
        ensure!(
            (1..=MAX_CALL_ROWS).contains(&rows),
            "dense: {rows} activation rows (1..={MAX_CALL_ROWS})"
        );
        ensure!(
            (1..=MAX_JOBS).contains(&jobs),
            "dense: {jobs} weights in one launch (1..={MAX_JOBS})"
        );
        ensure!(n >= 1 && k >= 1, "dense: empty weight {n} x {k}");
        if kind.weight_fp8() {
            ensure!(
                n.is_multiple_of(TILE_ROWS) && k.is_multiple_of(128),
                "dense: FP8 weight [{n}, {k}]: N and K must be multiples of 128 (128x128 scale blocks, one per CTA row tile)"
            );
        } else {
            ensure!(
                k.is_multiple_of(64),
                "dense: BF16 weight [{n}, {k}]: K must be a multiple of 64 (a step reads one 128-byte line of a row)"
            );
        }
        ensure!(
            n * jobs <= i32::MAX as usize && k <= i32::MAX as usize / 2,
            "dense: [{n}, {k}] x {jobs} exceeds the kernels' int indices"
        );
        let tiles = n.div_ceil(TILE_ROWS);
        ensure!(
            (jobs..=jobs * tiles).contains(&busy_tiles),
            "dense: {busy_tiles} busy row tiles in a launch of {jobs} jobs x {tiles} tiles (each job has at least one)"
        );
        Ok(())
    }
    fn tiles(&self) -> usize {
        self.n.div_ceil(TILE_ROWS)
    }
    /// The shape of one GEMV launch of this call: at most [`MAX_ROWS`] rows ([`row_pieces`]).
    pub fn gemv_piece(&self) -> DenseShape {
        DenseShape {
            rows: self.rows.min(MAX_ROWS),
            ..*self
        }
    }
}

/// How a shape is launched: token groups of 8 (`mt`), K slice per CTA (`kc`), `splits` = ceil(K / kc), dynamic
/// shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DensePlan {
    pub mt: usize,
    pub kc: usize,
    pub splits: usize,
    pub smem: usize,
}

impl DensePlan {
    /// f32 partial sums of one call (0 without split-K).
    pub fn partial_floats(&self, s: &DenseShape) -> usize {
        if self.splits == 1 {
            0
        } else {
            self.splits * s.rows * s.kind.weights_per_warp() * s.tiles() * TILE_ROWS * s.jobs
        }
    }
    /// Arrival counters of one call.
    pub fn counters(&self, s: &DenseShape) -> usize {
        s.tiles() * s.jobs
    }
}

/// Dynamic shared memory of a CTA: the weight ring, the staged x slice (16-bit, padded rows), x and weight scales.
fn smem_bytes(kind: DenseKind, mt: usize, kc: usize) -> usize {
    let tok = mt * 8;
    let ring = if kind.weights_per_warp() == 2 {
        RING_BYTES_PAIR
    } else {
        RING_BYTES
    };
    ring + tok * (2 * kc + kind.x_pad()) + 4 * (tok + kind.weights_per_warp()) * (kc / 128)
}

/// From this many activation rows, a weight whose row tiles alone give fewer CTAs than SMs (split-K) gets K slices
/// of at least [`MIN_SLICE_COLUMNS`] columns from [`plan`] (fewer, longer CTAs) instead of its occupancy rule's; a
/// weight with enough row tiles (the LM head) keeps its two-CTAs-per-SM slices. Measured on an H100 (bde2acd, results/h100/dense.csv, the
/// rule then forced as a bench variant), us, occupancy rule / slices of >= 512 / >= 1024: wq_a (FP8 1024 x 4096) M = 1
/// 10.1 / 10.3 / 11.5, M = 8 13.3 / 11.9 / 13.2, M = 64 48.1 / 32.1 / 37.7; wkv (512 x 4096) 9.4 / 10.1 / 11.6,
/// 12.4 / 11.6 / 13.1, 42.8 / 32.2 / 37.9; wo_b (4096 x 8192) equal within 1% at every M; the CSA compressors' two
/// BF16 1024 x 4096 weights 14.0 / 14.1 / 14.9, 15.8 / 15.8 / 16.1, 41.2 / 32.5 / 35.5. So 512 from 8 rows; at one
/// row the short slices keep more CTAs streaming and win by 2-7%.
pub const MIN_SLICE_ROWS: usize = 8;
/// The shortest K slice of a CTA from [`MIN_SLICE_ROWS`] rows on.
pub const MIN_SLICE_COLUMNS: usize = 512;

/// The launch plan of `s` on a GPU of `sm_count` SMs. Split-K when the busy row tiles alone give fewer CTAs than SMs:
/// at most 2 CTAs per SM (one wave), K slices a multiple of the granule, capped so that the partials (f32, written and read
/// once, mostly in L2) stay within twice the weight bytes, and at least as many splits as the shared memory for
/// the staged x needs; then slices halved while a CTA needs more than half the shared memory and the partials stay
/// under 1/16 of the weight bytes (two resident CTAs per SM).
pub fn plan(s: &DenseShape, sm_count: usize) -> Result<DensePlan> {
    s.check()?;
    ensure!(
        s.rows <= MAX_ROWS,
        "dense: a GEMV launch of {} rows (1..={MAX_ROWS}; larger calls run in pieces, DenseShape::gemv_piece)",
        s.rows
    );
    let mt = s.rows.div_ceil(8).next_power_of_two();
    let gran = s.kind.k_granule();
    let mut kc_max = s.k.div_ceil(gran) * gran;
    while kc_max > gran && smem_bytes(s.kind, mt, kc_max) > SMEM_BUDGET {
        kc_max -= gran;
    }
    ensure!(
        smem_bytes(s.kind, mt, kc_max) <= SMEM_BUDGET,
        "dense: no K slice fits shared memory"
    );
    let splits_smem = s.k.div_ceil(kc_max);
    // The CTAs that stream rows: a launch of jobs of different heights leaves the shorter jobs' tail tiles idle.
    let ctas = s.busy_tiles;
    let sms = sm_count.max(1);
    // As many splits as fit two CTAs per SM in one wave (rounded down): rounding up would leave a second, partial
    // wave of CTAs that starts only when the first ones finish (the grouped wo_a: 64 tiles, 5 splits = 320 CTAs on
    // 264 slots, where 4 splits fit). From one CTA per SM on, no split: splitting a launch of one to three busy
    // CTAs per SM to even out the SMs' shares (CSA's wq_b + indexer wq_b, 320 CTAs, 2 splits) measured slower, and
    // it slowed the GEMV before it (likely: the extra resident CTAs prefetch during that GEMV's stream; the perf log).
    let splits_occ = if ctas >= sms { 1 } else { 2 * sms / ctas };
    let esize = if s.kind.weight_fp8() { 1 } else { 2 };
    let splits_cap = (2 * s.k * esize / (4 * s.rows)).max(1);
    let splits = splits_smem
        .max(splits_occ.min(splits_cap))
        .min(s.k.div_ceil(gran));
    let mut kc = (s.k.div_ceil(splits).div_ceil(gran) * gran).min(kc_max);
    if s.rows >= MIN_SLICE_ROWS && ctas < sms {
        let kc = kc.max(MIN_SLICE_COLUMNS.div_ceil(gran) * gran).min(kc_max);
        return Ok(DensePlan {
            mt,
            kc,
            splits: s.k.div_ceil(kc),
            smem: smem_bytes(s.kind, mt, kc),
        });
    }
    let mut splits = s.k.div_ceil(kc);
    // Two resident CTAs per SM hide one CTA's prologue behind the other's stream: halve the slice while a CTA needs
    // more than half the shared memory and the partials stay under 1/16 of the weight bytes (the LM head at small M).
    let weight_bytes = s.jobs * s.kind.weights_per_warp() * s.n * s.k * esize;
    while smem_bytes(s.kind, mt, kc) > SMEM_BUDGET / 2 && kc > gran {
        let kc_half = (kc / 2).div_ceil(gran) * gran;
        let splits_half = s.k.div_ceil(kc_half);
        let partial_bytes =
            4 * splits_half * s.rows * s.kind.weights_per_warp() * s.tiles() * TILE_ROWS * s.jobs;
        if 16 * partial_bytes > weight_bytes {
            break;
        }
        kc = kc_half;
        splits = splits_half;
    }
    Ok(DensePlan {
        mt,
        kc,
        splits,
        smem: smem_bytes(s.kind, mt, kc),
    })
}

/// The caller-owned scratch of the dense launchers: split-K partial sums and per-tile arrival counters (zero between
/// calls), and, when a shape it was carved for takes the tensor-core route, that route's scratch (cuBLASLt's
/// workspace and the FP8 GEMM's activation scales and tail staging). One workspace sized for every shape a decode
/// step uses serves all of them in stream order.
#[derive(Debug, Clone, Copy)]
pub struct DenseWorkspace {
    pub part: DevBuf<f32>,
    pub count: DevBuf<u32>,
    /// The tensor-core route's scratch: [`ROUTE_CUBLAS_BYTES`] of cuBLASLt workspace for BF16 GEMMs, or an
    /// [`Fp8LinearWorkspace`] laid out from its start ([`Fp8LinearWorkspace::within`]); empty when no shape it was
    /// carved for takes the route.
    pub tc: DevBuf<u8>,
    /// The route in force when it was carved ([`route::with_route`]): every launch on it follows this route's rule.
    pub route: DenseRoute,
}

/// cuBLASLt workspace bytes of the tensor-core route, carved per [`DenseWorkspace`] that has the route: the cap
/// the plans are built under (`BLOCK_SCALED_MAX_WORKSPACE`, also the BF16 plans' cap), so whatever algorithm
/// cuBLASLt's heuristic picks for a shape fits without asking it at layout time (the layouts are host arithmetic,
/// computed without a GPU). The same 32 MiB the bench's cuBLASLt baselines ran with, so the route runs the
/// algorithms they measured; at most one such region per workspace (attention half, FFN half, LM head, and the
/// chunked prefill's two halves), and none on the GEMV route.
pub const ROUTE_CUBLAS_BYTES: usize = BLOCK_SCALED_MAX_WORKSPACE;

/// Bytes of tensor-core scratch a call of `s` takes (0 when `route` sends it to the GEMV).
fn tc_bytes(s: &DenseShape, route: DenseRoute) -> usize {
    if route::path_for(route, s) == DensePath::Gemv {
        return 0;
    }
    match s.kind {
        DenseKind::Fp8 => Fp8LinearWorkspace::layout(s.rows, s.n, s.k, ROUTE_CUBLAS_BYTES).bytes(),
        _ => ROUTE_CUBLAS_BYTES,
    }
}

/// (partial floats, counters, tensor-core bytes) the shapes need on a GPU of `sm_count` SMs under `route` (the
/// largest of each).
fn workspace_need(
    shapes: &[DenseShape],
    sm_count: usize,
    route: DenseRoute,
) -> Result<(usize, usize, usize)> {
    let (mut floats, mut counters, mut tc) = (1, 1, 0);
    for s in shapes {
        // A call of more than MAX_ROWS rows on the GEMV runs in pieces of MAX_ROWS, one at a time.
        let g = s.gemv_piece();
        let p = plan(&g, sm_count)?;
        floats = floats.max(p.partial_floats(&g));
        counters = counters.max(p.counters(&g));
        tc = tc.max(tc_bytes(s, route));
    }
    Ok((floats, counters, tc))
}

/// The [`DenseWorkspace`] layout for calls of `shapes` under the route in force ([`route::route_in_force`]: the
/// GEMV by default, whose layout has no tensor-core region).
pub fn workspace_layout(shapes: &[DenseShape], sm_count: usize) -> Result<WorkspaceLayout> {
    let (floats, counters, tc) = workspace_need(shapes, sm_count, route::route_in_force())?;
    let mut l = WorkspaceLayout::new();
    l.add::<f32>(floats).add::<u32>(counters).add::<u8>(tc);
    Ok(l)
}

impl DenseWorkspace {
    /// Carve the workspace for `shapes` under the route in force ([`route::route_in_force`], recorded in the
    /// workspace) and zero its counters on `stream`.
    pub fn carve(
        arena: &mut Arena,
        stream: &Stream,
        shapes: &[DenseShape],
        sm_count: usize,
    ) -> Result<DenseWorkspace> {
        let route = route::route_in_force();
        let (floats, counters, tc) = workspace_need(shapes, sm_count, route)?;
        let ws = DenseWorkspace {
            part: arena.carve::<f32>(floats, "dense split-K partials")?,
            count: arena.carve::<u32>(counters, "dense tile counters")?,
            tc: arena.carve::<u8>(tc, "dense tensor-core route scratch")?,
            route,
        };
        arena::fill(stream, &ws.count, 0)?;
        Ok(ws)
    }

    /// Creates the GPU's cuBLASLt handle ([`Gpu::blas`]) when this workspace has the tensor-core route: call it
    /// where the workspace is set up, so that no launch inside a graph capture is the first (the creation
    /// allocates).
    pub fn prepare(&self, gpu: &Gpu) -> Result<()> {
        if !self.tc.is_empty() {
            gpu.blas()?;
        }
        Ok(())
    }

    /// The engine a launch of `shape` on this workspace takes: the rule of its route ([`route::path_for`]), and only
    /// when the launch's jobs are `tc_ready`: for FP8 linears every weight has its f32 block scales
    /// ([`Fp8Weight::scales_f32`]), for BF16 linears every job's f32 output rows are 16-byte multiples (`n % 4 == 0`;
    /// the shape shows the tallest job's only).
    pub fn path(&self, shape: &DenseShape, tc_ready: bool) -> DensePath {
        match route::path_for(self.route, shape) {
            DensePath::TensorCores if !tc_ready => DensePath::Gemv,
            p => p,
        }
    }
}

/// An FP8 weight on the device: e4m3 codes `[n, k]`, ue8m0 128x128 scale codes `[n/128, k/128]`, and optionally
/// the same scales as f32 in the block-scaled GEMM's layout `[ceil(n/128), L4]` ([`prefill::weight_scales_f32`];
/// the engine builds them at load), which the tensor-core route needs (without them the GEMV runs).
pub struct Fp8Weight<'a> {
    pub codes: &'a dyn DeviceBuf<u8>,
    pub scales: &'a dyn DeviceBuf<u8>,
    pub n: usize,
    pub k: usize,
    pub scales_f32: Option<&'a dyn DeviceBuf<f32>>,
}

/// FP8 1x128 activation rows on the device (norm_quant's `OutFormat::Fp8`): e4m3 codes `[rows, k]`, ue8m0 scale
/// codes `[rows, k/128]`.
pub struct Fp8Rows<'a> {
    pub codes: &'a dyn DeviceBuf<u8>,
    pub scales: &'a dyn DeviceBuf<u8>,
    pub rows: usize,
    pub k: usize,
}

/// One BF16 weight of a [`bf16_linear`] launch and its f32 output `[M, n]`.
pub struct Bf16Job<'a> {
    pub w: &'a dyn DeviceBuf<bf16>,
    pub n: usize,
    pub y: &'a dyn DeviceBuf<f32>,
}

/// The kernels' parameter block (`DenseParams` in kernels/dense.cu, same field order; 768 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
struct DenseParams {
    w: [u64; MAX_JOBS],
    w_scale: [u64; MAX_JOBS],
    y: [u64; MAX_JOBS],
    x: u64,
    x_scale: u64,
    part: u64,
    count: u64,
    n: [i32; MAX_JOBS],
    x_col: [i32; MAX_JOBS],
    part_off: [i32; MAX_JOBS],
    count_off: [i32; MAX_JOBS],
    /// Job z's output row stride in elements (the shared expert's SwiGLU half: `ldy[0]` for codes and scales).
    ldy: [i32; MAX_JOBS],
    m: i32,
    k: i32,
    ldx: i32,
    kc: i32,
    splits: i32,
    /// kSwiglu: the clamp limit; kFp8NormQx: the RMSNorm eps.
    scalar: f32,
    reserved: i32,
}

const _: () = assert!(std::mem::size_of::<DenseParams>() == 768);

fn check_len<T>(b: &dyn DeviceBuf<T>, need: usize, what: &str) -> Result<()> {
    ensure!(
        b.elems() >= need,
        "dense: {what} has {} elements, needs {need}",
        b.elems()
    );
    ensure!(
        b.device_addr().is_multiple_of(16),
        "dense: {what} is not 16-byte aligned"
    );
    Ok(())
}

fn check_fp8_weight(w: &Fp8Weight, what: &str) -> Result<()> {
    check_len(
        w.codes,
        w.n * w.k,
        &format!("{what} codes [{}, {}]", w.n, w.k),
    )?;
    check_len(
        w.scales,
        w.n.div_ceil(128) * w.k.div_ceil(128),
        &format!("{what} scales"),
    )?;
    if let Some(s) = w.scales_f32 {
        check_len(
            s,
            w.n.div_ceil(128) * w.k.div_ceil(128).div_ceil(4) * 4,
            &format!("{what} f32 scales [n/128, L4]"),
        )?;
    }
    Ok(())
}

fn check_fp8_rows(x: &Fp8Rows, k: usize) -> Result<()> {
    ensure!(x.k == k, "dense: x has {} columns, the weight {k}", x.k);
    check_len(x.codes, x.rows * x.k, "x codes [M, K]")?;
    check_len(x.scales, x.rows * x.k.div_ceil(128), "x scales [M, K/128]")
}

/// Everything one launch needs besides the plan.
struct LaunchSpec {
    shape: DenseShape,
    p: DenseParams,
}

fn blank_params() -> DenseParams {
    DenseParams {
        w: [0; MAX_JOBS],
        w_scale: [0; MAX_JOBS],
        y: [0; MAX_JOBS],
        x: 0,
        x_scale: 0,
        part: 0,
        count: 0,
        n: [0; MAX_JOBS],
        x_col: [0; MAX_JOBS],
        part_off: [0; MAX_JOBS],
        count_off: [0; MAX_JOBS],
        m: 0,
        k: 0,
        ldx: 0,
        ldy: [0; MAX_JOBS],
        kc: 0,
        splits: 0,
        scalar: 0.0,
        reserved: 0,
    }
}

/// The GEMV launches of a call (every other check done by the caller): one per [`row_pieces`] piece (a single one
/// up to [`MAX_ROWS`] rows, its shift the identity), in order, each with its x and y moved to the piece's first row (each piece streams the
/// whole weight again).
fn run(gpu: &Gpu, stream: &Stream, spec: LaunchSpec, ws: &DenseWorkspace) -> Result<()> {
    for (r0, m) in row_pieces(spec.shape.rows) {
        let piece = LaunchSpec {
            shape: DenseShape {
                rows: m,
                ..spec.shape
            },
            p: shift_rows(spec.shape.kind, &spec.p, spec.shape.jobs, r0),
        };
        run_one(gpu, stream, piece, ws)?;
    }
    Ok(())
}

/// `p` with x (and its scales) and every job's y moved `r0` rows down (the kernel's row strides: x `ldx` elements,
/// FP8 x scales `ldx / 128` codes, y `ldy[z]` elements; the SwiGLU half's y[1] scales `ldy[0] / 128` codes).
fn shift_rows(kind: DenseKind, p: &DenseParams, jobs: usize, r0: usize) -> DenseParams {
    let mut q = *p;
    let (r0, ldx) = (r0 as u64, p.ldx as u64);
    let x_elem = if kind.x_fp8() { 1 } else { 2 };
    q.x += r0 * ldx * x_elem;
    if kind.x_fp8() {
        q.x_scale += r0 * ldx / 128;
    }
    match kind {
        DenseKind::Swiglu => {
            let ldy = p.ldy[0] as u64;
            q.y[0] += r0 * ldy;
            q.y[1] += r0 * ldy / 128;
        }
        _ => {
            let y_elem = if kind == DenseKind::Bf16 { 4 } else { 2 };
            for z in 0..jobs {
                q.y[z] += r0 * p.ldy[z] as u64 * y_elem;
            }
        }
    }
    q
}

/// Plan, check the workspace, fill the split-K fields and launch one GEMV of at most [`MAX_ROWS`] rows.
fn run_one(gpu: &Gpu, stream: &Stream, spec: LaunchSpec, ws: &DenseWorkspace) -> Result<()> {
    let s = spec.shape;
    let pl = plan(&s, gpu.info.sm_count as usize)?;
    let per_job_floats = pl.partial_floats(&s) / s.jobs;
    ensure!(
        ws.part.len() >= pl.partial_floats(&s) && ws.count.len() >= pl.counters(&s),
        "dense: workspace holds {} partials and {} counters, this call needs {} and {} (carve it for this shape)",
        ws.part.len(),
        ws.count.len(),
        pl.partial_floats(&s),
        pl.counters(&s)
    );
    ensure!(
        pl.partial_floats(&s) <= i32::MAX as usize,
        "dense: split-K partials exceed the kernels' int offsets"
    );
    let mut p = spec.p;
    p.part = ws.part.device_addr();
    p.count = ws.count.device_addr();
    for j in 0..s.jobs {
        p.part_off[j] = (j * per_job_floats) as i32;
        p.count_off[j] = (j * s.tiles()) as i32;
    }
    p.m = s.rows as i32;
    p.k = s.k as i32;
    p.kc = pl.kc as i32;
    p.splits = pl.splits as i32;
    let name = format!("{}_m{}", s.kind.prefix(), pl.mt * 8);
    let kernel = gpu.kernel_with_smem(FAMILY, &name, pl.smem)?;
    // PDL (kernels/common/pdl.cuh): the CTAs may start while the previous kernel runs, issue their first weight
    // stages and the weight scales, and wait for it before reading x; a predecessor that triggers early (the decode
    // step's norms, quantizers, q / KV prep, router selection, attention combine, another GEMV) overlaps its run with
    // the prefetch. The weights must therefore be complete before the previous kernel starts (loaded, then synced).
    let l = Launch::new(
        (s.tiles() as u32, pl.splits as u32, s.jobs as u32),
        (THREADS, 1, 1),
    )
    .smem(pl.smem)
    .pdl(true);
    let mut args = KernelArgs::new();
    args.pod(&p);
    // SAFETY: every buffer was checked against the shape by the public launcher; the workspace against the plan.
    unsafe { launch(stream, &kernel, l, &mut args) }
}

/// `y[M, N] = bf16(x_q . dequant(W)^T)`: FP8 1x128 rows `x` (norm_quant's FP8 output), FP8 128x128-block weight,
/// BF16 `y` `[x.rows, w.n]`. Oracle: `Model::fp8_linear`.
pub fn fp8_linear(
    gpu: &Gpu,
    stream: &Stream,
    x: &Fp8Rows,
    w: &Fp8Weight,
    ws: &DenseWorkspace,
    y: &dyn DeviceBuf<bf16>,
) -> Result<()> {
    fp8_linears(gpu, stream, x, &[Fp8Job { w, y }], ws)
}

/// One weight of [`fp8_linears`] and its output `y` `[M, w.n]` BF16.
pub struct Fp8Job<'a> {
    pub w: &'a Fp8Weight<'a>,
    pub y: &'a dyn DeviceBuf<bf16>,
}

/// [`fp8_linear`] of several weights that read the same FP8 rows `x` (e.g. wq_a and wkv of `a`), in one launch:
/// `y_j = bf16(x_q . dequant(W_j)^T)`, each job with its own height (a multiple of 128) and output stride. The grid
/// covers the tallest job; a CTA past its job's rows returns at once. Each job's result is bit for bit that of its
/// own [`fp8_linear`] call whenever the launch plans the same K slices for it (the plan depends on the launch's
/// total CTAs, so a job's split-K partition, and with it the f32 summation order, may differ from its solo call).
pub fn fp8_linears(
    gpu: &Gpu,
    stream: &Stream,
    x: &Fp8Rows,
    jobs: &[Fp8Job],
    ws: &DenseWorkspace,
) -> Result<()> {
    let (shape, mut p) = fp8_jobs(jobs, x)?;
    if fp8_path(ws, &shape, jobs) == DensePath::TensorCores {
        return fp8_linears_tensor_cores(gpu, stream, x, jobs, ws);
    }
    p.x = x.codes.device_addr();
    p.x_scale = x.scales.device_addr();
    p.ldx = shape.k as i32;
    run(gpu, stream, LaunchSpec { shape, p }, ws)
}

/// What [`fp8_linears_of_bf16`] does to its BF16 rows to get the FP8 1x128 rows the weights read.
#[derive(Clone, Copy)]
pub enum Bf16Rows<'a> {
    /// Quantize them (norm_quant's `quantize_bf16_rows`).
    Quantize,
    /// RMSNorm each row with `weight` (BF16 `[K]`) and `eps`, then quantize (norm_quant's `rmsnorm_quant_into`
    /// to FP8).
    NormQuantize {
        weight: &'a dyn DeviceBuf<bf16>,
        eps: f32,
    },
}

/// [`fp8_linears`] of BF16 rows `x` `[M, K]` made FP8 1x128 rows on the way as `how` says, with norm_quant's rules:
/// the bits of norm_quant's kernel into `x_fp8` followed by [`fp8_linears`] on it. On the GEMV route the GEMV does
/// it as each CTA stages its K slice (`dense_fp8_qx_*`, `dense_fp8_normqx_*`): no launch of norm_quant's, and
/// `x_fp8` is not written. On the tensor-core route cuBLASLt needs the FP8 rows: `prepare` (the caller's
/// norm_quant call writing `x_fp8`, so that this family calls no other) runs first.
#[allow(clippy::too_many_arguments)]
pub fn fp8_linears_of_bf16(
    gpu: &Gpu,
    stream: &Stream,
    x: &dyn DeviceBuf<bf16>,
    how: Bf16Rows,
    x_fp8: &Fp8Rows,
    prepare: impl FnOnce() -> Result<()>,
    jobs: &[Fp8Job],
    ws: &DenseWorkspace,
) -> Result<()> {
    let (shape, mut p) = fp8_jobs(jobs, x_fp8)?;
    let k = shape.k;
    check_len(x, shape.rows * k, "x [M, K] BF16")?;
    ensure!(
        x.device_addr().is_multiple_of(16),
        "dense: BF16 x must be 16-byte aligned (the GEMV reads it 8 values at a time)"
    );
    if fp8_path(ws, &shape, jobs) == DensePath::TensorCores {
        prepare()?;
        return fp8_linears_tensor_cores(gpu, stream, x_fp8, jobs, ws);
    }
    let kind = match how {
        Bf16Rows::Quantize => DenseKind::Fp8QuantX,
        Bf16Rows::NormQuantize { weight, eps } => {
            check_len(weight, k, "RMSNorm weight [K]")?;
            ensure!(
                weight.device_addr().is_multiple_of(16),
                "dense: the RMSNorm weight must be 16-byte aligned"
            );
            ensure!(
                eps.is_finite() && eps > 0.0,
                "dense: RMSNorm eps {eps} must be finite and > 0"
            );
            ensure!(
                k <= NORM_MAX_K,
                "dense: an RMSNorm of {k} values per row (the GEMV's norm takes up to {NORM_MAX_K})"
            );
            p.x_scale = weight.device_addr();
            p.scalar = eps;
            DenseKind::Fp8NormQuantX
        }
    };
    p.x = x.device_addr();
    p.ldx = k as i32;
    run(
        gpu,
        stream,
        LaunchSpec {
            shape: DenseShape { kind, ..shape },
            p,
        },
        ws,
    )
}

/// Longest row the GEMV's RMSNorm takes (`dense_fp8_normqx_*`: norm_quant's row kernel over at most 8 warps).
pub const NORM_MAX_K: usize = 8192;

/// The launch shape of FP8 `jobs` on the FP8 rows `x` and their parameters (weights, outputs, heights), checked;
/// x itself is the caller's to set.
fn fp8_jobs(jobs: &[Fp8Job], x: &Fp8Rows) -> Result<(DenseShape, DenseParams)> {
    ensure!(!jobs.is_empty(), "dense: FP8 linears without a weight");
    let (rows, k) = (x.rows, jobs[0].w.k);
    let shape = DenseShape::of_heights(DenseKind::Fp8, rows, k, jobs.iter().map(|j| j.w.n));
    shape.check()?;
    check_fp8_rows(x, k)?;
    let mut p = blank_params();
    for (j, job) in jobs.iter().enumerate() {
        ensure!(
            job.w.k == k,
            "dense: weight {j} has {} columns, weight 0 {k} (the jobs of one launch read the same x)",
            job.w.k
        );
        ensure!(
            job.w.n.is_multiple_of(TILE_ROWS),
            "dense: FP8 weight {j} has {} rows, not a multiple of {TILE_ROWS}",
            job.w.n
        );
        check_fp8_weight(job.w, &format!("W{j}"))?;
        check_len(job.y, rows * job.w.n, &format!("y{j} [M, {}]", job.w.n))?;
        p.w[j] = job.w.codes.device_addr();
        p.w_scale[j] = job.w.scales.device_addr();
        p.y[j] = job.y.device_addr();
        p.n[j] = job.w.n as i32;
        p.ldy[j] = job.w.n as i32;
    }
    Ok((shape, p))
}

/// The route `jobs` of `shape` take: the workspace's, the tensor cores only when every weight has its f32 scales.
fn fp8_path(ws: &DenseWorkspace, shape: &DenseShape, jobs: &[Fp8Job]) -> DensePath {
    ws.path(shape, jobs.iter().all(|j| j.w.scales_f32.is_some()))
}

/// [`fp8_linears`] on the tensor-core route (checked by the caller): cuBLASLt's block-scaled FP8 GEMM, one per job,
/// on the activation scales converted once ([`prefill::fp8_linears_prefill`]); its scratch is laid out in `ws.tc`.
fn fp8_linears_tensor_cores(
    gpu: &Gpu,
    stream: &Stream,
    x: &Fp8Rows,
    jobs: &[Fp8Job],
    ws: &DenseWorkspace,
) -> Result<()> {
    let n_max = jobs.iter().map(|j| j.w.n).max().unwrap_or(0);
    let pws = Fp8LinearWorkspace::within(&ws.tc, x.rows, n_max, x.k, ROUTE_CUBLAS_BYTES).map_err(
        |e| {
            e.context(
                "dense: the workspace's tensor-core region does not fit this call (carve it for this shape under \
                 the same route)",
            )
        },
    )?;
    let pjobs = jobs
        .iter()
        .map(|j| {
            let scales = j.w.scales_f32.ok_or_else(|| {
                anyhow::anyhow!("dense: the tensor-core route needs f32 weight scales")
            })?;
            Ok(Fp8PrefillJob {
                w: Fp8WeightView {
                    n: j.w.n,
                    k: j.w.k,
                    codes: DevBuf::of(j.w.codes),
                    scales: DevBuf::of(scales),
                },
                y: DevBuf::of(j.y),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // Checked here too (the block-scaled GEMM's own rules: n a multiple of 16, k of 128), before any launch.
    for j in &pjobs {
        BlockScaledShape {
            m: prefill::rows_in_place(x.rows).max(4),
            n: j.w.n,
            k: j.w.k,
        }
        .check()?;
    }
    prefill::fp8_linears_prefill(
        gpu,
        stream,
        gpu.blas()?,
        x.rows,
        &DevBuf::of(x.codes),
        &DevBuf::of(x.scales),
        &pjobs,
        &pws,
    )
}

/// [`bf16_linear`] on the tensor-core route (checked by the caller): one cuBLASLt BF16 GEMM with an f32 output per
/// job, in order, on the workspace's cuBLASLt region. Every plan and its workspace need is checked before the first
/// GEMM.
fn bf16_linear_tensor_cores(
    gpu: &Gpu,
    stream: &Stream,
    x: &dyn DeviceBuf<bf16>,
    rows: usize,
    k: usize,
    jobs: &[Bf16Job],
    ws: &DenseWorkspace,
) -> Result<()> {
    let blas = gpu.blas()?;
    ensure!(
        ws.tc.len() >= ROUTE_CUBLAS_BYTES,
        "dense: the workspace's tensor-core region holds {} bytes, the BF16 route needs {ROUTE_CUBLAS_BYTES} (carve \
         it for this shape under the same route)",
        ws.tc.len()
    );
    let cublas = ws.tc.sub(0, ROUTE_CUBLAS_BYTES);
    for job in jobs {
        let need = blas.bf16_f32_workspace_bytes(Bf16GemmShape {
            m: rows,
            n: job.n,
            k,
        })?;
        ensure!(
            need <= cublas.len(),
            "dense: cuBLASLt asks {need} bytes of workspace for m={rows} n={} k={k}, the route carved {}",
            job.n,
            cublas.len()
        );
    }
    for job in jobs {
        blas.bf16_gemm_f32(
            stream,
            Bf16GemmShape {
                m: rows,
                n: job.n,
                k,
            },
            x,
            job.w,
            &cublas,
            job.y,
        )?;
    }
    Ok(())
}

/// The grouped wo_a: `z[m, g*R + r] = bf16(sum_k wo_a[g*R + r, k] * o[m, g*K + k])` for g < `groups`, with
/// `w` = wo_a `[groups*R, K]` FP8 (R = w.n / groups, a multiple of 128), `o` BF16 `[rows, groups*K]`, `z` BF16
/// `[rows, groups*R]`. Oracle: `Model::out_proj`'s per-group `matvec_rows` (BF16-rounded).
#[allow(clippy::too_many_arguments)]
pub fn wo_a_grouped(
    gpu: &Gpu,
    stream: &Stream,
    o: &dyn DeviceBuf<bf16>,
    rows: usize,
    w: &Fp8Weight,
    groups: usize,
    ws: &DenseWorkspace,
    z: &dyn DeviceBuf<bf16>,
) -> Result<()> {
    ensure!(
        (1..=MAX_JOBS).contains(&groups) && w.n.is_multiple_of(groups),
        "dense: wo_a with {groups} groups over {} rows (1..={MAX_JOBS} groups dividing the rows)",
        w.n
    );
    let r = w.n / groups;
    let shape = DenseShape::new(DenseKind::Fp8Bf16x, rows, r, w.k, groups);
    shape.check()?;
    check_fp8_weight(w, "wo_a")?;
    check_len(o, rows * groups * w.k, "o [M, groups*K]")?;
    check_len(z, rows * w.n, "z [M, groups*R]")?;
    let mut p = blank_params();
    let (wa, sa, za) = (
        w.codes.device_addr(),
        w.scales.device_addr(),
        z.device_addr(),
    );
    for g in 0..groups {
        p.w[g] = wa + (g * r * w.k) as u64;
        p.w_scale[g] = sa + ((g * r / 128) * (w.k / 128)) as u64;
        p.y[g] = za + (g * r * 2) as u64;
        p.n[g] = r as i32;
        p.x_col[g] = (g * w.k) as i32;
        p.ldy[g] = w.n as i32;
    }
    p.x = o.device_addr();
    p.ldx = (groups * w.k) as i32;
    run(gpu, stream, LaunchSpec { shape, p }, ws)
}

/// The shared expert's gate/up half: `h = bf16(silu(min(g, L)) * clamp(u, -L, L))` with `g = bf16(w1 . x)`,
/// `u = bf16(w3 . x)` (no clamp when L <= 0), written as FP8 1x128 rows (`h_codes` `[M, I]`, `h_scales` `[M, I/128]`).
#[allow(clippy::too_many_arguments)]
pub fn swiglu_fp8(
    gpu: &Gpu,
    stream: &Stream,
    x: &Fp8Rows,
    w1: &Fp8Weight,
    w3: &Fp8Weight,
    swiglu_limit: f32,
    ws: &DenseWorkspace,
    h_codes: &dyn DeviceBuf<u8>,
    h_scales: &dyn DeviceBuf<u8>,
) -> Result<()> {
    ensure!(
        w1.n == w3.n && w1.k == w3.k,
        "dense: w1 [{}, {}] and w3 [{}, {}] differ",
        w1.n,
        w1.k,
        w3.n,
        w3.k
    );
    ensure!(
        swiglu_limit.is_finite(),
        "dense: swiglu_limit {swiglu_limit} is not finite"
    );
    let shape = DenseShape::new(DenseKind::Swiglu, x.rows, w1.n, w1.k, 1);
    shape.check()?;
    check_fp8_weight(w1, "w1")?;
    check_fp8_weight(w3, "w3")?;
    check_fp8_rows(x, w1.k)?;
    check_len(h_codes, x.rows * w1.n, "h codes [M, I]")?;
    check_len(h_scales, x.rows * w1.n / 128, "h scales [M, I/128]")?;
    let mut p = blank_params();
    p.w[0] = w1.codes.device_addr();
    p.w[1] = w3.codes.device_addr();
    p.w_scale[0] = w1.scales.device_addr();
    p.w_scale[1] = w3.scales.device_addr();
    p.y[0] = h_codes.device_addr();
    p.y[1] = h_scales.device_addr();
    p.n[0] = w1.n as i32;
    p.x = x.codes.device_addr();
    p.x_scale = x.scales.device_addr();
    p.ldx = w1.k as i32;
    p.ldy[0] = w1.n as i32;
    p.scalar = swiglu_limit;
    run(gpu, stream, LaunchSpec { shape, p }, ws)
}

/// The scratch between the two launches of [`shared_expert`]: h as FP8 1x128 rows.
pub struct SharedExpertScratch<'a> {
    pub h_codes: &'a dyn DeviceBuf<u8>,
    pub h_scales: &'a dyn DeviceBuf<u8>,
}

/// The shared expert, `Model::expert(prefix, x, 1.0)`: [`swiglu_fp8`] then [`fp8_linear`] with w2 `[D, I]` into
/// BF16 `y` `[M, D]`. Two launches; every check runs before the first.
#[allow(clippy::too_many_arguments)]
pub fn shared_expert(
    gpu: &Gpu,
    stream: &Stream,
    x: &Fp8Rows,
    w1: &Fp8Weight,
    w3: &Fp8Weight,
    w2: &Fp8Weight,
    swiglu_limit: f32,
    ws: &DenseWorkspace,
    h: &SharedExpertScratch,
    y: &dyn DeviceBuf<bf16>,
) -> Result<()> {
    ensure!(
        w2.k == w1.n,
        "dense: w2 has {} columns, w1 {} rows",
        w2.k,
        w1.n
    );
    let h_rows = Fp8Rows {
        codes: h.h_codes,
        scales: h.h_scales,
        rows: x.rows,
        k: w1.n,
    };
    DenseShape::new(DenseKind::Fp8, x.rows, w2.n, w2.k, 1).check()?;
    check_fp8_weight(w2, "w2")?;
    check_len(y, x.rows * w2.n, "y [M, D]")?;
    swiglu_fp8(
        gpu,
        stream,
        x,
        w1,
        w3,
        swiglu_limit,
        ws,
        h.h_codes,
        h.h_scales,
    )?;
    fp8_linear(gpu, stream, &h_rows, w2, ws, y)
}

/// `y_j[M, n_j] = x[M, K] . W_j^T` in f32 for every job (BF16 weights sharing the BF16 `x`), one launch.
pub fn bf16_linear(
    gpu: &Gpu,
    stream: &Stream,
    x: &dyn DeviceBuf<bf16>,
    rows: usize,
    k: usize,
    jobs: &[Bf16Job],
    ws: &DenseWorkspace,
) -> Result<()> {
    let shape = DenseShape::of_heights(DenseKind::Bf16, rows, k, jobs.iter().map(|j| j.n));
    shape.check()?;
    check_len(x, rows * k, "x [M, K]")?;
    let mut p = blank_params();
    for (j, job) in jobs.iter().enumerate() {
        ensure!(job.n >= 1, "dense: BF16 weight {j} has no rows");
        check_len(job.w, job.n * k, &format!("W{j} [{}, {k}]", job.n))?;
        check_len(job.y, rows * job.n, &format!("y{j} [M, {}]", job.n))?;
        p.w[j] = job.w.device_addr();
        p.y[j] = job.y.device_addr();
        p.n[j] = job.n as i32;
        p.ldy[j] = job.n as i32;
    }
    let rows_aligned = jobs.iter().all(|j| j.n.is_multiple_of(4));
    if ws.path(&shape, rows_aligned) == DensePath::TensorCores {
        return bf16_linear_tensor_cores(gpu, stream, x, rows, k, jobs, ws);
    }
    // One launch whatever the heights: the grid covers the tallest job, each job has its own output stride.
    p.x = x.device_addr();
    p.ldx = k as i32;
    run(gpu, stream, LaunchSpec { shape, p }, ws)
}

#[cfg(test)]
mod piece_tests {
    use super::*;

    /// A GEMV piece starting at row r0 reads x and writes y r0 rows further, by each kind's row strides (bytes).
    #[test]
    fn pieces_move_x_and_y_by_their_row_strides() {
        let mut p = blank_params();
        p.x = 1 << 20;
        p.x_scale = 2 << 20;
        p.y = [3 << 20; MAX_JOBS];
        p.ldx = 4096;
        p.ldy = [1024; MAX_JOBS];
        p.ldy[1] = 512;
        let r0 = 64u64;
        // FP8 x (1 byte a code, ldx / 128 scale codes a row), BF16 y.
        let q = shift_rows(DenseKind::Fp8, &p, 2, 64);
        assert_eq!(q.x - p.x, r0 * 4096);
        assert_eq!(q.x_scale - p.x_scale, r0 * 32);
        assert_eq!(
            (q.y[0] - p.y[0], q.y[1] - p.y[1]),
            (r0 * 1024 * 2, r0 * 512 * 2)
        );
        assert_eq!(q.y[2], p.y[2], "only the launch's jobs move");
        // wo_a: BF16 x, BF16 y; no x scales.
        let q = shift_rows(DenseKind::Fp8Bf16x, &p, 1, 64);
        assert_eq!((q.x - p.x, q.x_scale), (r0 * 4096 * 2, p.x_scale));
        assert_eq!(q.y[0] - p.y[0], r0 * 1024 * 2);
        // BF16 linear: f32 y.
        let q = shift_rows(DenseKind::Bf16, &p, 2, 64);
        assert_eq!(q.x - p.x, r0 * 4096 * 2);
        assert_eq!(q.y[1] - p.y[1], r0 * 512 * 4);
        // SwiGLU: FP8 x; y[0] the h codes (ldy[0] bytes a row), y[1] its scales (ldy[0] / 128 a row).
        let q = shift_rows(DenseKind::Swiglu, &p, 1, 64);
        assert_eq!((q.x - p.x, q.x_scale - p.x_scale), (r0 * 4096, r0 * 32));
        assert_eq!((q.y[0] - p.y[0], q.y[1] - p.y[1]), (r0 * 1024, r0 * 8));
        // Every piece of a 64-multiple start stays 16-byte aligned for the engine's shapes (K, N multiples of 128).
        assert!((q.x_scale - p.x_scale).is_multiple_of(16) && (q.y[1] - p.y[1]).is_multiple_of(8));
    }
}
