//! Sparse FP8 decode attention for DeepSeek-V4 (DSV4 §3.6, §4): each query (H = 64 or 128 heads x 512 dims)
//! attends to its own candidate list of 584-byte FP8 KV entries (sliding window ++ selected compressed
//! entries), with a per-head attention sink and the inverse RoPE on the output. Kernels: `kernels/sparse_attn.cu`
//! (design notes at its top); CPU reference: [`reference`].
//!
//! Data layout
//! * KV pool: `n_entries x 584` bytes, entry layout of `formats::kv` (see [`reference::encode_entry`]).
//!   A sequence's window ring slot `p mod 128` and its compressed entries are pool entries; pages are runs of
//!   entries and need no table of their own, because candidate lists hold pool indices.
//! * Candidate lists: `[batch, stride]` i32 pool indices (-1 = invalid), `lengths[batch]` of them used.
//! * q: `[batch, heads, 512]` BF16 with RoPE at the query position already applied to dims 448..512.
//! * Output: `[batch, heads, 512]` BF16, inverse RoPE at the query position applied to dims 448..512.
//!
//! Precision of the FP8 path: q's 448 nope dims are quantized per (head, 64-tile) with a UE8M0 power-of-two
//! scale (the KV entry rule), K nope dims are the cache's FP8 codes times their pow2 tile scale, rope dims
//! BF16; every product is exact and the scores accumulate in f32. The kernel holds q and each KV tile as
//! exact BF16 values and runs both products on BF16 `wgmma` (kernel `sparse_attn_decode_fp8_v11`); softmax in
//! f32, P rounded to BF16 for P.V (denominator unrounded), V = K dequantized exactly to BF16.
//!
//! History: the A/B run on the H200 (commit 4199846) measured four FP8 kernels; v5 won at every point (e.g.
//! Flash CSA batch 64 @64K 52.3 us vs v4 54.8 / v3 57.0 / v2 60.3, HCA 1M batch 64 250.6 vs 329.2 / 370.4 /
//! 429.3) and is the only one kept; the numbers are in the header of `kernels/sparse_attn.cu`.
//!
//! Session-4 A/B (results/h200/session4-ab): the default [`Path::Fp8`] became `sparse_attn_decode_fp8_v6` (v5
//! with a cheaper q prologue, bit-identical; e.g. Flash batch 128 70.4 us vs 82.9). The in-kernel split merge
//! (last-arriving CTA) and the combine launched by PDL lost and were removed (numbers in the `.cu` header).
//! The session-4 final run (b4862dd) timed v6 against v5 once more: v6 faster at every point and bit-identical
//! in every GPU test, so the v5 path (`Fp8V5`, bench variant `fp8_v5`) was removed.
//!
//! Session-5 A/B (H200, commit 48a7d82): the latency-parallel, bit-identical combine `sparse_attn_combine_v2`
//! won wherever the plan cuts 3 or more splits and lost at 2 splits; the refitted plan [`SplitPlan::by_cost_v6`]
//! won at HCA 1M batch 1. The default [`Path::Fp8`] now routes by those measurements ([`fp8_combine`],
//! [`SplitPlan::fp8_default`]); the previous default stays measurable as [`Path::Fp8OldCombine`] (bench
//! `fp8_oldcombine`), the forced new combine as [`Path::Fp8ParallelCombine`] (`fp8_pcombine`) and
//! [`Path::Fp8ParallelCombineRefit`] (`fp8_pcombine_refit`).
//!
//! Session 7 (results/h200/session7-ab, PERF-LOG "Session 7"): the default kernel became
//! `sparse_attn_decode_fp8_v11`, v6's prologue and main loop with a small epilogue (rope cos / sin once per CTA,
//! one warp-uniform rope branch, the finished output stored through shared memory in whole 16-byte chunks);
//! bit-identical to v6. v6's epilogue was ~7,900 straight-line SASS instructions executed once per warp, 26% of the
//! Pro batch-128 stall samples, mostly instruction fetch. A/B run 2: Pro b128 199.0 -> 145.6 us (the v11 epilogue's
//! one-split path), Pro b64 94.8 -> 77.5, Flash b128 70.1 -> 52.3. The v6 path (`Fp8V6`, bench variant `fp8_v6`)
//! was removed in session 8 after v11 won in two runs.

pub mod exec;
pub mod reference;

use anyhow::{anyhow, bail, ensure, Result};
use cudarc::driver::{CudaFunction, CudaSlice};
use half::bf16;

use crate::bench::config::Sweep;
use crate::bench::runner::{BenchCtx, BenchKernel};
use crate::bench::{MatmulKind, Row, Summary};
use crate::gpu::timing::TimingPlan;
use crate::gpu::{launch_cfg, Gpu, PushKernelArg};
pub use reference::{ENTRY_BYTES, HEAD_DIM, NOPE_DIM, ROPE_DIM, WINDOW};

/// Heads per CTA: a 128-head model runs two head-group CTAs per (sequence, split).
pub const HEADS_PER_CTA: usize = 64;
/// Candidates per KV tile (the kernel's inner-loop step).
pub const BLOCK_N: usize = 64;
/// Dynamic shared memory of `sparse_attn_decode_fp8_v11` (mirrors `sa::kV11SmemBytes`: v6's 206848 B, the 256-byte
/// rope cos / sin table of its epilogue, and 1024 B of slack the kernel uses to align its wgmma tiles to 1024 bytes).
const FP8_SMEM_BYTES: u32 = 208_128;
/// Entry point of the FP8 path since the session-7 A/B (v11: v6's prologue and main loop, an epilogue that is small
/// and stores the finished output in whole 16-byte chunks; bit-identical to v6).
const FP8_KERNEL: &str = "sparse_attn_decode_fp8_v11";
/// Dynamic shared memory of `sparse_attn_decode_bf16` (mirrors `sa::kB16SmemBytes`).
const BF16_SMEM_BYTES: u32 = 210_688;
const FAMILY: &str = "sparse_attn";

/// Shape of one decode-attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: usize,
    pub heads: usize,
    /// Row stride of the candidate array = the longest candidate list the call may see.
    pub stride: usize,
    /// Entries in the KV pool.
    pub n_entries: usize,
}

impl DecodeShape {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.batch >= 1, "batch must be at least 1");
        ensure!(
            self.heads >= HEADS_PER_CTA && self.heads.is_multiple_of(HEADS_PER_CTA),
            "heads = {} must be a positive multiple of {HEADS_PER_CTA} (DSV4: 64 Flash, 128 Pro)",
            self.heads
        );
        ensure!(self.stride >= 1, "candidate stride must be at least 1");
        ensure!(
            self.batch <= 65_535,
            "batch {} exceeds the grid's z limit 65535",
            self.batch
        );
        let fits = |v: usize, what: &str| -> Result<()> {
            ensure!(
                v <= i32::MAX as usize,
                "{what} = {v} does not fit the kernel's i32 arguments"
            );
            Ok(())
        };
        fits(self.stride, "stride")?;
        fits(self.n_entries, "n_entries")?;
        fits(self.heads, "heads")?;
        Ok(())
    }
    fn tiles(&self) -> usize {
        self.stride.div_ceil(BLOCK_N)
    }
}

/// Device inputs of a decode-attention call (shapes in the module doc).
pub struct DecodeInputs<'a> {
    pub q: &'a CudaSlice<bf16>,
    pub pool: &'a CudaSlice<u8>,
    pub candidates: &'a CudaSlice<i32>,
    pub lengths: &'a CudaSlice<i32>,
    pub positions: &'a CudaSlice<i32>,
    pub sinks: &'a CudaSlice<f32>,
    pub freqs: &'a CudaSlice<f32>,
}

impl DecodeInputs<'_> {
    fn check(&self, s: &DecodeShape) -> Result<()> {
        let want = |got: usize, exp: usize, what: &str| -> Result<()> {
            ensure!(
                got == exp,
                "{what} has {got} elements, expected {exp} for {s:?}"
            );
            Ok(())
        };
        want(self.q.len(), s.batch * s.heads * HEAD_DIM, "q")?;
        want(self.pool.len(), s.n_entries * ENTRY_BYTES, "pool (bytes)")?;
        want(self.candidates.len(), s.batch * s.stride, "candidates")?;
        want(self.lengths.len(), s.batch, "lengths")?;
        want(self.positions.len(), s.batch, "positions")?;
        want(self.sinks.len(), s.heads, "sinks")?;
        want(self.freqs.len(), ROPE_DIM / 2, "freqs")?;
        Ok(())
    }
}

/// How a candidate list is cut for split-KV: split `s` takes KV tiles `[s*tps, (s+1)*tps)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    pub n_splits: usize,
    pub tiles_per_split: usize,
}

impl SplitPlan {
    /// Fill the GPU: about one CTA per SM, but at least `min(4, tiles)` tiles per split so that the f32
    /// partials (H x 2 KiB per split) stay small next to the KV bytes a split reads (37 KB per tile).
    pub fn auto(sm_count: usize, shape: &DecodeShape) -> SplitPlan {
        let tiles = shape.tiles().max(1);
        let ctas_per_split = shape.batch * (shape.heads / HEADS_PER_CTA);
        let want_splits = sm_count.div_ceil(ctas_per_split).max(1);
        let tps = tiles.div_ceil(want_splits).max(tiles.min(4));
        SplitPlan {
            n_splits: tiles.div_ceil(tps),
            tiles_per_split: tps,
        }
    }

    /// The plan each path runs with: `Fp8` uses [`SplitPlan::fp8_default`], the forcing variants
    /// `Fp8OldCombine` / `Fp8ParallelCombine` [`SplitPlan::by_cost`] and `Fp8ParallelCombineRefit`
    /// [`SplitPlan::by_cost_v6`]; the baseline keeps [`SplitPlan::auto`] (what it was measured with).
    pub fn for_path(sm_count: usize, shape: &DecodeShape, path: Path) -> SplitPlan {
        match path {
            Path::Fp8 => SplitPlan::fp8_default(sm_count, shape),
            Path::Fp8OldCombine | Path::Fp8ParallelCombine => SplitPlan::by_cost(sm_count, shape),
            Path::Fp8ParallelCombineRefit => SplitPlan::by_cost_v6(sm_count, shape),
            Path::Bf16Staging => SplitPlan::auto(sm_count, shape),
        }
    }

    /// Wave-aware choice for the FP8 kernel (one CTA per SM): minimize the estimated time
    /// `waves * (PROLOGUE + tps * TILE) + [n_splits > 1] * (COMBINE + n_splits * COMBINE_PER_SPLIT)` over
    /// tiles-per-split `tps`, where `waves = ceil(CTAs / sm_count)`. `auto`'s floor of 4 tiles per split left
    /// most SMs idle at batch 1..32 (3 CTAs for batch 1, 640 candidates); a partial second wave costs a whole
    /// CTA time. The constants ([`PlanCosts::V5_ESTIMATE`]) are estimates in microseconds for the H200 (FP8 tile
    /// ~3 us at 64 heads, q prologue ~4 us, combine launch ~4 us); only their ratios matter. Ties go to fewer
    /// splits. Refitted to measurements in [`PlanCosts::V6_FITTED`] ([`SplitPlan::by_cost_v6`]); the default
    /// [`SplitPlan::fp8_default`] takes the refit only where the session-5 data supports it.
    pub fn by_cost(sm_count: usize, shape: &DecodeShape) -> SplitPlan {
        SplitPlan::by_cost_model(sm_count, shape, &PlanCosts::V5_ESTIMATE)
    }

    /// [`SplitPlan::by_cost`]'s model with constants fitted to the measured v6 kernel and the latency-parallel
    /// combine ([`PlanCosts::V6_FITTED`]); the plan of [`Path::Fp8ParallelCombineRefit`]. At the Flash and Pro
    /// target shapes it picks the same plans as `by_cost` (one CTA per SM: both fill exactly one wave); it
    /// differs on long lists (HCA at 1M, batch 1: 65 splits of two tiles instead of 33 of four).
    pub fn by_cost_v6(sm_count: usize, shape: &DecodeShape) -> SplitPlan {
        SplitPlan::by_cost_model(sm_count, shape, &PlanCosts::V6_FITTED)
    }

    /// The default FP8 plan: [`SplitPlan::by_cost_v6`] where both it and [`SplitPlan::by_cost`] cut 3 or more
    /// splits (so both merge with `sparse_attn_combine_v2`, the combine whose cost `V6_FITTED` models), else
    /// [`SplitPlan::by_cost`].
    ///
    /// Data (H200, commit 48a7d82, us, `fp8_pcombine` vs `fp8_pcombine_refit`): the plans differ at one measured
    /// point, HCA 1M batch 1 (130 tiles): by_cost 33 splits x 4 tiles 35.6, by_cost_v6 65 x 2 = 31.8 (the model
    /// predicted 33.6 -> 28.2: right direction, 70% of the size). At HCA 1M batch 4 / 16 / 64 and every Flash /
    /// Pro batch point the two plans are equal (40.6 / 40.6, 81.0 / 81.8, 245.6 / 244.1: noise). Where by_cost_v6
    /// would add a split to a plan with 1 or 2 (e.g. 2 tiles: 1 x 2 -> 2 x 1) or cut to 2 splits (Pro batch 96 at
    /// 513 tiles) nothing was measured and the 2-split merge is the old combine, which the model does not describe,
    /// so those points keep by_cost. Unmeasured points that do change: 20..39 tiles at batch <= 6 and long HCA lists
    /// at batch <= 4 (one tile per split instead of two, or about half the tiles per split), all still one wave.
    pub fn fp8_default(sm_count: usize, shape: &DecodeShape) -> SplitPlan {
        let old = SplitPlan::by_cost(sm_count, shape);
        let refit = SplitPlan::by_cost_v6(sm_count, shape);
        if old.n_splits >= PARALLEL_COMBINE_MIN_SPLITS
            && refit.n_splits >= PARALLEL_COMBINE_MIN_SPLITS
        {
            refit
        } else {
            old
        }
    }

    /// The shared cost model: `waves * (prologue + tps * tile) + [n_splits > 1] * (combine + n_splits *
    /// combine_per_split)`, minimized over tiles per split; ties go to fewer splits.
    fn by_cost_model(sm_count: usize, shape: &DecodeShape, c: &PlanCosts) -> SplitPlan {
        let tiles = shape.tiles().max(1);
        let ctas_per_split = shape.batch * (shape.heads / HEADS_PER_CTA);
        let sms = sm_count.max(1);
        let mut best: Option<(f64, SplitPlan)> = None;
        for tps in (1..=tiles).rev() {
            let n_splits = tiles.div_ceil(tps);
            if n_splits > 65_535 {
                continue;
            }
            let waves = (ctas_per_split * n_splits).div_ceil(sms) as f64;
            let mut t = waves * (c.prologue + tps as f64 * c.tile);
            if n_splits > 1 {
                t += c.combine + n_splits as f64 * c.combine_per_split;
            }
            if best.as_ref().is_none_or(|(bt, _)| t < *bt) {
                best = Some((
                    t,
                    SplitPlan {
                        n_splits,
                        tiles_per_split: tps,
                    },
                ));
            }
        }
        best.expect("tiles >= 1 gives at least one plan").1
    }

    /// A fixed number of tiles per split (tests use it to force the combine path on short lists).
    pub fn with_tiles_per_split(shape: &DecodeShape, tiles_per_split: usize) -> Result<SplitPlan> {
        ensure!(tiles_per_split >= 1, "tiles_per_split must be at least 1");
        let tiles = shape.tiles().max(1);
        Ok(SplitPlan {
            n_splits: tiles.div_ceil(tiles_per_split),
            tiles_per_split,
        })
    }
}

/// Constants (microseconds on the H200) of the split plan's cost model; only their ratios matter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanCosts {
    /// Per CTA and wave, independent of its tile count: launch share, q prologue, epilogue.
    pub prologue: f64,
    /// Per 64-entry KV tile of one CTA (64 heads).
    pub tile: f64,
    /// The combine launch, when the plan splits.
    pub combine: f64,
    /// Combine cost per split.
    pub combine_per_split: f64,
}

impl PlanCosts {
    /// The estimates `by_cost` was built with (v5 era, before any measurement of the plans): FP8 tile ~3 us,
    /// q prologue ~4 us, combine launch ~4 us. The plan of `Fp8OldCombine` / `Fp8ParallelCombine` and the
    /// default's fallback.
    pub const V5_ESTIMATE: PlanCosts = PlanCosts {
        prologue: 4.0,
        tile: 3.0,
        combine: 4.0,
        combine_per_split: 0.3,
    };
    /// Fitted to the session-5 start ncu durations of `sparse_attn_decode_fp8_v6` (one wave each): tiles per
    /// split 1 -> 12.8 us (Flash / Pro batch 1), 3 -> 21.5 (Pro batch 8), 5 -> 31.1 (Flash batch 64),
    /// 18 -> 91.2 (Pro batch 64): slope (91.2 - 12.8) / 17 = 4.6 us per tile, intercept 12.8 - 4.6 = 8.2 us
    /// (residuals <= 0.5 us). The combine is the latency-parallel `sparse_attn_combine_v2`: an estimate (not
    /// measured yet) of ~3 us (launch + one L2 round trip + the merge math) plus ~1 us (one more L2 round trip)
    /// per further chunk of 8 splits, i.e. ~0.12 us per split. At HCA 1M batch 1 this cuts 65 splits of two
    /// tiles (17.4 + 3 + 7.8 us) where `by_cost` cuts 33 of four (26.6 + 3 + 4.0): the A/B run decides.
    pub const V6_FITTED: PlanCosts = PlanCosts {
        prologue: 8.2,
        tile: 4.6,
        combine: 3.0,
        combine_per_split: 0.12,
    };
}

/// Scratch buffers of a call: split partials and (for the baseline) the BF16 staging buffer.
pub struct Workspace {
    shape: DecodeShape,
    plan: SplitPlan,
    part_o: Option<CudaSlice<f32>>,
    part_lse: Option<CudaSlice<f32>>,
    staging: Option<CudaSlice<bf16>>,
    kernels: Kernels,
}

/// The family's entry points, looked up (and given their shared-memory attribute) once per workspace, so a
/// timed call does no module lookups between launches.
struct Kernels {
    gather: CudaFunction,
    decode_fp8: CudaFunction,
    decode_bf16: CudaFunction,
    combine: CudaFunction,
    /// `sparse_attn_combine_v2`, `_h2`, `_h4` (1, 2, 4 heads per thread), indexed by [`combine_v2_variant`].
    combine_v2: [CudaFunction; 3],
}

impl Kernels {
    fn load(gpu: &Gpu) -> Result<Kernels> {
        let with_smem = |name: &str, smem: u32| gpu.function_with_smem(FAMILY, name, smem as usize);
        Ok(Kernels {
            gather: gpu.function(FAMILY, "sparse_attn_gather_bf16")?,
            decode_fp8: with_smem(FP8_KERNEL, FP8_SMEM_BYTES)?,
            decode_bf16: with_smem("sparse_attn_decode_bf16", BF16_SMEM_BYTES)?,
            combine: gpu.function(FAMILY, "sparse_attn_combine")?,
            combine_v2: [
                gpu.function(FAMILY, COMBINE_V2_KERNELS[0])?,
                gpu.function(FAMILY, COMBINE_V2_KERNELS[1])?,
                gpu.function(FAMILY, COMBINE_V2_KERNELS[2])?,
            ],
        })
    }
}

impl Workspace {
    pub fn new(
        gpu: &Gpu,
        shape: &DecodeShape,
        plan: SplitPlan,
        with_staging: bool,
    ) -> Result<Workspace> {
        shape.validate()?;
        ensure!(
            plan.n_splits >= 1 && plan.n_splits <= 65_535,
            "n_splits {} outside 1..=65535",
            plan.n_splits
        );
        ensure!(
            plan.n_splits * plan.tiles_per_split >= shape.tiles(),
            "split plan {plan:?} does not cover {} tiles",
            shape.tiles()
        );
        let (part_o, part_lse) = if plan.n_splits > 1 {
            let rows = shape.batch * plan.n_splits * shape.heads;
            (
                Some(gpu.zeros::<f32>(rows * HEAD_DIM)?),
                Some(gpu.zeros::<f32>(rows)?),
            )
        } else {
            (None, None)
        };
        let staging = if with_staging {
            Some(gpu.zeros::<bf16>(shape.batch * shape.stride * HEAD_DIM)?)
        } else {
            None
        };
        Ok(Workspace {
            shape: *shape,
            plan,
            part_o,
            part_lse,
            staging,
            kernels: Kernels::load(gpu)?,
        })
    }
    pub fn plan(&self) -> SplitPlan {
        self.plan
    }

    /// Fill the split partials (part_o, part_lse) with the byte 0xFF (NaN): tests use it to show that a call
    /// reads only partials it wrote itself. No-op without splits.
    pub fn poison_partials(&mut self, gpu: &Gpu) -> Result<()> {
        if let Some(o) = self.part_o.as_mut() {
            gpu.fill_bytes(o, 0xFF)?;
        }
        if let Some(l) = self.part_lse.as_mut() {
            gpu.fill_bytes(l, 0xFF)?;
        }
        Ok(())
    }
}

/// Entry points of the latency-parallel combine, by heads per thread (1, 2, 4).
const COMBINE_V2_KERNELS: [&str; 3] = [
    "sparse_attn_combine_v2",
    "sparse_attn_combine_v2_h2",
    "sparse_attn_combine_v2_h4",
];

/// Which `sparse_attn_combine_v2` entry merges `n_splits` splits, as (index into `COMBINE_V2_KERNELS`, heads per
/// thread): the most heads per thread with heads * n_splits <= 8 (a thread holds 8 partials' loads at once), so
/// a plan with few splits still keeps 8 loads in flight per thread. Heads are multiples of 64, so every choice
/// divides them.
pub fn combine_v2_variant(n_splits: usize) -> (usize, usize) {
    match n_splits {
        0..=2 => (2, 4),
        3..=4 => (1, 2),
        _ => (0, 1),
    }
}

/// Fewest splits the default path merges with `sparse_attn_combine_v2` (fewer: `sparse_attn_combine`).
///
/// Data (H200, commit 48a7d82, median us, old combine `fp8` vs v2 `fp8_pcombine`, same plan; splits from
/// [`SplitPlan::by_cost`] at 132 SMs). 3+ splits, v2 faster at all 24 points: Flash CSA 64K batch 1 / 2 / 4 / 8
/// (10 splits) 22.9 / 19.7, 22.8 / 19.8, 23.2 / 20.4, 25.1 / 23.0; batch 16 (5) 28.0 / 26.7; batch 32 (4) 33.6 /
/// 33.1 and its ctx sweep 4K..1M (4) -0.5..-3.9; Pro batch 1 / 2 (18) 25.0 / 20.9, 25.7 / 22.2; batch 4 (9)
/// 27.6 / 26.2; batch 8 (6) 32.4 / 30.7; batch 16 (4) 40.0 / 39.4; HCA batch 8 ctx sweep (3, 4, 10, 12, 15
/// splits) -0.8..-5.0; HCA 1M batch 1 / 4 / 16 (33, 33, 8) 44.3 / 35.6, 48.8 / 40.6, 85.3 / 81.0.
/// 2 splits (v2's four-heads-per-thread entry), v2 slower at 6 of 8 points: Pro batch 32 at 64K 56.1 / 58.2 and
/// its ctx sweep 4K / 16K / 64K / 256K 55.8 / 58.3, 56.2 / 57.4, 55.8 / 57.8, 60.2 / 63.5; Flash batch 64 43.8 /
/// 45.9. Exceptions: Pro batch 32 at 1M 66.0 / 63.5 (the same plan and bytes as at 4K, where `fp8` took 55.8: an
/// outlier of the `fp8` sample) and HCA 1M batch 64 (65 tiles per split) 247.1 / 245.6 (0.6%, noise at that
/// size). 1 split: no combine, both paths launch the same kernel. Heads and batch do not separate the winners
/// from the losers (Pro batch 32 loses, Pro batch 16 and Flash batch 32 win; Flash batch 64 loses), the split
/// count does.
pub const PARALLEL_COMBINE_MIN_SPLITS: usize = 3;

/// Which combine kernel merges `n_splits` split partials on `path`: true = `sparse_attn_combine_v2`, false =
/// `sparse_attn_combine` (both bit-identical; only the time differs). `Fp8` routes by
/// [`PARALLEL_COMBINE_MIN_SPLITS`]; the forcing variants always take the one they name. Meaningless for 1 split
/// (no combine runs) and for the baseline (it keeps the old combine).
pub fn fp8_combine(path: Path, n_splits: usize) -> bool {
    match path {
        Path::Fp8 => n_splits >= PARALLEL_COMBINE_MIN_SPLITS,
        Path::Fp8ParallelCombine | Path::Fp8ParallelCombineRefit => true,
        Path::Fp8OldCombine | Path::Bf16Staging => false,
    }
}

/// Which attention kernel reads the KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// `sparse_attn_decode_fp8_v11`: reads the FP8 pool directly, quantizes q per (head, 64-tile) like a KV entry
    /// (codes from `x * 2^-k`, the same values as `x / 2^k`), dequantizes each tile once to a 128B-swizzled BF16
    /// tile (K = V), QK^T and P.V on `wgmma`, the next tile's dequant overlapped with QK^T. Plan
    /// [`SplitPlan::fp8_default`]; when it splits, [`fp8_combine`] picks the merge (`sparse_attn_combine_v2` from
    /// 3 splits, `sparse_attn_combine` at 2). Its epilogue computes the rope once per CTA and stores the finished
    /// output through shared memory (see the module notes). Bench variant `fp8`.
    Fp8,
    /// The default before the session-5 A/B: the same decode kernel, plan [`SplitPlan::by_cost`], every split
    /// merged by `sparse_attn_combine` (one warp per head). Bench variant `fp8_oldcombine`.
    Fp8OldCombine,
    /// [`Path::Fp8OldCombine`]'s decode kernel and plan, with every split merge by `sparse_attn_combine_v2` (one CTA
    /// per (sequence, 1 / 2 / 4 heads), every thread's split loads in flight together; bit-identical to
    /// `sparse_attn_combine`). Bench variant `fp8_pcombine`.
    Fp8ParallelCombine,
    /// [`Path::Fp8ParallelCombine`] with the refitted plan [`SplitPlan::by_cost_v6`]. Bench variant
    /// `fp8_pcombine_refit`.
    Fp8ParallelCombineRefit,
    /// The seeds' path: `sparse_attn_gather_bf16` into the staging buffer, then `sparse_attn_decode_bf16`.
    Bf16Staging,
}

/// Run decode attention (plus the combine kernel when the plan splits) into `out` [batch, heads, 512] BF16.
pub fn decode(
    gpu: &Gpu,
    path: Path,
    shape: &DecodeShape,
    inp: &DecodeInputs,
    ws: &mut Workspace,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    shape.validate()?;
    inp.check(shape)?;
    ensure!(
        ws.shape == *shape,
        "workspace was made for {:?}, call is {shape:?}",
        ws.shape
    );
    ensure!(
        out.len() == shape.batch * shape.heads * HEAD_DIM,
        "out has {} elements, expected {}",
        out.len(),
        shape.batch * shape.heads * HEAD_DIM
    );
    if path == Path::Bf16Staging && ws.staging.is_none() {
        bail!("the BF16 staging path needs a workspace made with with_staging = true");
    }
    let plan = ws.plan;
    let (n_entries, stride, heads) = (
        shape.n_entries as i32,
        shape.stride as i32,
        shape.heads as i32,
    );
    let (tps, n_splits) = (plan.tiles_per_split as i32, plan.n_splits as i32);
    let null: u64 = 0;

    if path == Path::Bf16Staging {
        let f = ws.kernels.gather.clone();
        let staging = ws.staging.as_mut().expect("checked above");
        let mut b = gpu.stream.launch_builder(&f);
        b.arg(staging)
            .arg(inp.pool)
            .arg(&n_entries)
            .arg(inp.candidates)
            .arg(&stride)
            .arg(inp.lengths);
        let grid = (shape.stride.div_ceil(8) as u32, shape.batch as u32, 1);
        unsafe { b.launch(launch_cfg(grid, (256, 1, 1), 0)) }
            .map_err(|e| anyhow!("sparse_attn_gather_bf16: {e:?}"))?;
    }

    let (name, smem, f) = match path {
        Path::Fp8
        | Path::Fp8OldCombine
        | Path::Fp8ParallelCombine
        | Path::Fp8ParallelCombineRefit => {
            (FP8_KERNEL, FP8_SMEM_BYTES, ws.kernels.decode_fp8.clone())
        }
        Path::Bf16Staging => (
            "sparse_attn_decode_bf16",
            BF16_SMEM_BYTES,
            ws.kernels.decode_bf16.clone(),
        ),
    };
    let grid = (
        (shape.heads / HEADS_PER_CTA) as u32,
        plan.n_splits as u32,
        shape.batch as u32,
    );
    {
        let mut b = gpu.stream.launch_builder(&f);
        b.arg(inp.q);
        match path {
            Path::Fp8
            | Path::Fp8OldCombine
            | Path::Fp8ParallelCombine
            | Path::Fp8ParallelCombineRefit => b.arg(inp.pool).arg(&null),
            Path::Bf16Staging => b
                .arg(&null)
                .arg(ws.staging.as_ref().expect("checked above")),
        };
        b.arg(&n_entries)
            .arg(inp.candidates)
            .arg(&stride)
            .arg(inp.lengths)
            .arg(inp.positions);
        b.arg(inp.sinks)
            .arg(inp.freqs)
            .arg(&heads)
            .arg(&tps)
            .arg(&n_splits);
        if plan.n_splits == 1 {
            b.arg(&mut *out).arg(&null).arg(&null);
        } else {
            b.arg(&null)
                .arg(ws.part_o.as_mut().expect("allocated for n_splits > 1"));
            b.arg(ws.part_lse.as_mut().expect("allocated for n_splits > 1"));
        }
        unsafe { b.launch(launch_cfg(grid, (256, 1, 1), smem)) }
            .map_err(|e| anyhow!("{name}: {e:?}"))?;
    }
    if plan.n_splits > 1 {
        // The old combine: one warp per head (grid heads/8 x batch, 256 threads); v2: one CTA per (sequence,
        // 1 / 2 / 4 heads), 128 threads of 4 dims each. Same arguments.
        let parallel = fp8_combine(path, plan.n_splits);
        let (cname, f, grid, block) = if parallel {
            let (k, heads_per_thread) = combine_v2_variant(plan.n_splits);
            (
                COMBINE_V2_KERNELS[k],
                ws.kernels.combine_v2[k].clone(),
                (
                    (shape.heads / heads_per_thread) as u32,
                    shape.batch as u32,
                    1,
                ),
                (128, 1, 1),
            )
        } else {
            (
                "sparse_attn_combine",
                ws.kernels.combine.clone(),
                ((shape.heads / 8) as u32, shape.batch as u32, 1),
                (256, 1, 1),
            )
        };
        let mut b = gpu.stream.launch_builder(&f);
        b.arg(&mut *out)
            .arg(ws.part_o.as_ref().expect("allocated"))
            .arg(ws.part_lse.as_ref().expect("allocated"));
        b.arg(inp.sinks)
            .arg(inp.positions)
            .arg(inp.freqs)
            .arg(&heads)
            .arg(&n_splits);
        unsafe { b.launch(launch_cfg(grid, block, 0)) }.map_err(|e| anyhow!("{cname}: {e:?}"))?;
    }
    Ok(())
}

/// Source vectors for the KV writer.
pub enum KvSource<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<bf16>),
}

/// Quantize `n` new 512-dim vectors into pool entries `dst_index[i]` (bit-exact with
/// [`reference::encode_entry`] for finite inputs). Indices outside the pool are skipped by the kernel; use
/// [`check_write_indices`] on host copies to turn them into errors.
pub fn write_entries(
    gpu: &Gpu,
    pool: &mut CudaSlice<u8>,
    src: KvSource,
    dst_index: &CudaSlice<i32>,
    n: usize,
) -> Result<()> {
    ensure!(
        pool.len().is_multiple_of(ENTRY_BYTES),
        "pool has {} bytes, not a multiple of {ENTRY_BYTES}",
        pool.len()
    );
    let n_entries = pool.len() / ENTRY_BYTES;
    ensure!(
        n_entries <= i32::MAX as usize && n <= i32::MAX as usize,
        "pool or batch too large for i32 indices"
    );
    ensure!(
        dst_index.len() >= n,
        "dst_index has {} elements, need {n}",
        dst_index.len()
    );
    let src_len = match &src {
        KvSource::F32(s) => s.len(),
        KvSource::Bf16(s) => s.len(),
    };
    ensure!(
        src_len >= n * HEAD_DIM,
        "source has {src_len} elements, need {n} x 512"
    );
    if n == 0 {
        return Ok(());
    }
    let (n_entries, n_i) = (n_entries as i32, n as i32);
    let name = match src {
        KvSource::F32(_) => "kv_write_entries_f32",
        KvSource::Bf16(_) => "kv_write_entries_bf16",
    };
    let f = gpu.function(FAMILY, name)?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(pool).arg(&n_entries);
    match src {
        KvSource::F32(s) => b.arg(s),
        KvSource::Bf16(s) => b.arg(s),
    };
    b.arg(dst_index).arg(&n_i);
    let grid = (n.div_ceil(8) as u32, 1, 1); // 8 warps per block, one vector per warp
    unsafe { b.launch(launch_cfg(grid, (256, 1, 1), 0)) }.map_err(|e| anyhow!("{name}: {e:?}"))?;
    Ok(())
}

/// Host-side check of writer destinations: every index in `0..n_entries`, no duplicates.
pub fn check_write_indices(dst_index: &[i32], n_entries: usize) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (i, &d) in dst_index.iter().enumerate() {
        ensure!(
            d >= 0 && (d as usize) < n_entries,
            "write {i}: destination {d} outside the pool (0..{n_entries})"
        );
        ensure!(seen.insert(d), "write {i}: destination {d} written twice");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// Benchmark hook (wired into `megamoe::bench` by the integrator; Row construction lives there)
// ---------------------------------------------------------------------------------------------------------

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

/// Work of one call: bytes (KV entries read once per sequence, q read, output written) and FLOPs
/// (2*H*L*512 for QK^T + 2*H*L*512 for P.V).
pub fn work(batch: usize, heads: usize, cands: usize, path: Path) -> (u64, u64) {
    let (b, h, l) = (batch as u64, heads as u64, cands as u64);
    let io = b * h * HEAD_DIM as u64 * 2 * 2; // q in + out, BF16
    let kv = match path {
        Path::Fp8
        | Path::Fp8OldCombine
        | Path::Fp8ParallelCombine
        | Path::Fp8ParallelCombineRefit => b * l * ENTRY_BYTES as u64,
        // gather reads 584 B, writes 1024 B, the attention kernel reads 1024 B back.
        Path::Bf16Staging => b * l * (ENTRY_BYTES as u64 + 2 * 2 * HEAD_DIM as u64),
    };
    (io + kv, 4 * b * h * l * HEAD_DIM as u64)
}

/// Kernel name of the bench rows; variants `fp8` (this family's kernel `sparse_attn_decode_fp8_v11`, with its own
/// split plan and combine routing) and `bf16_staging` (the baseline). Retired after the H200 A/B runs: `fp8_v3` / `fp8_v4` (v5 became
/// `fp8`), then `fp8_fused` / `fp8_fused_v6` (in-kernel split merge) and `fp8_pdl` (combine launched by PDL), and
/// after the session-4 final run `fp8_v5` (v6 became `fp8`); after the session-7 A/B runs `fp8_compact` (v7),
/// `fp8_compact_split` (v8), `fp8_staged` (v9) and `fp8_compact_staged` (v10) (v11 became `fp8`); in session 8
/// `fp8_v6` (v11 won in two runs).
pub const BENCH_KERNEL: &str = "sparse_attn_decode";
/// Variants in the order they are timed; `bf16_staging` is the baseline of the others. Forcing variants that keep
/// the session-5 A/B measurable: `fp8_oldcombine` ([`Path::Fp8OldCombine`], the previous default),
/// `fp8_pcombine` ([`Path::Fp8ParallelCombine`]) and `fp8_pcombine_refit` ([`Path::Fp8ParallelCombineRefit`]).
pub const BENCH_VARIANTS: [&str; 5] = [
    "fp8",
    "fp8_oldcombine",
    "fp8_pcombine",
    "fp8_pcombine_refit",
    "bf16_staging",
];

/// The path a bench variant name runs.
pub fn bench_path(variant: &str) -> Result<Path> {
    Ok(match variant {
        "fp8" => Path::Fp8,
        "fp8_oldcombine" => Path::Fp8OldCombine,
        "fp8_pcombine" => Path::Fp8ParallelCombine,
        "fp8_pcombine_refit" => Path::Fp8ParallelCombineRefit,
        "bf16_staging" => Path::Bf16Staging,
        other => bail!(
            "sparse_attn: unknown bench variant `{other}` (have: {})",
            BENCH_VARIANTS.join(", ")
        ),
    })
}

/// One sweep point's shape.
#[derive(Debug, Clone, Copy)]
pub struct BenchShape {
    pub kind: LayerKind,
    pub ctx: usize,
    pub batch: usize,
    pub heads: usize,
}

/// Time one variant at one (kind, ctx, batch, heads) point on random data from `seed`: every sequence gets
/// `candidates_per_query` distinct valid entries of a shared pool. Returns one [`Row`] with timing, bytes,
/// flops, batch, ctx and (for the FP8 variants) the baseline name; the runner adds limits and telemetry.
pub fn bench_point(
    gpu: &Gpu,
    variant: &str,
    point: BenchShape,
    plan: TimingPlan,
    seed: u64,
) -> Result<Row> {
    use rand::{Rng, SeedableRng};
    let BenchShape {
        kind,
        ctx,
        batch,
        heads,
    } = point;
    let cands = candidates_per_query(kind, ctx);
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
    let path = bench_path(variant)?;
    let split = SplitPlan::for_path(gpu.info.sm_count as usize, &shape, path);
    let mut out = gpu.zeros::<bf16>(batch * heads * HEAD_DIM)?;
    let mut ws = Workspace::new(gpu, &shape, split, path == Path::Bf16Staging)?;
    let samples = gpu.time_us(plan, || decode(gpu, path, &shape, &inp, &mut ws, &mut out))?;
    let (bytes, flops) = work(batch, heads, cands, path);
    let kind_label = match kind {
        LayerKind::Csa { topk } => format!("csa,topk={topk}"),
        LayerKind::Hca => "hca".to_string(),
    };
    let shape_label = format!(
        "kind={kind_label},heads={heads},batch={batch},ctx={ctx},candidates={cands},splits={}",
        split.n_splits
    );
    let mut row = Row::new(BENCH_KERNEL, variant, &shape_label)
        .with_batch(batch as u64)
        .with_ctx(ctx as u64)
        .with_timing(&Summary::of(&samples)?, samples.len() as u64)
        .with_work(Some(bytes), Some(flops));
    if path != Path::Bf16Staging {
        row = row.with_baseline("bf16_staging");
    }
    Ok(row)
}

/// The runner's entry for this family. `pct_matmul` is taken against the BF16 rate: P.V and the rope part of
/// QK^T (4.5 of every 8 FLOPs) run on BF16 tensor cores, only the nope part of QK^T on FP8.
pub fn bench_kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: BENCH_KERNEL,
        variants: &BENCH_VARIANTS,
        matmul: MatmulKind::Bf16,
        run_point: run_bench_point,
        headline: &[],
        targets: &[],
        params: &[],
        check_point: None,
    }]
}

/// One sweep point: axis `ctx` (params `batch`) or `batch` (params `ctx`); params `kind` ("csa" with `topk`,
/// or "hca") and `heads`.
fn run_bench_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, value: u64) -> Result<Vec<Row>> {
    let kind = match s.param_str("kind")? {
        "csa" => LayerKind::Csa {
            topk: s.param_u64("topk")? as usize,
        },
        "hca" => LayerKind::Hca,
        other => bail!("{}: kind `{other}` is neither `csa` nor `hca`", s.name()),
    };
    let heads = s.param_u64("heads")? as usize;
    let (context, batch) = match s.axis.as_str() {
        "ctx" => (value as usize, s.param_u64("batch")? as usize),
        "batch" => (s.param_u64("ctx")? as usize, value as usize),
        other => bail!("{}: axis `{other}` is neither `ctx` nor `batch`", s.name()),
    };
    let path = bench_path(variant)?;
    let (bytes, _) = work(batch, heads, candidates_per_query(kind, context), path);
    let point = BenchShape {
        kind,
        ctx: context,
        batch,
        heads,
    };
    let mut row = bench_point(ctx.gpu, variant, point, ctx.plan(bytes), ctx.seed)?;
    // The runner pairs variants through identical shape labels.
    row.shape = s.shape_label(value);
    Ok(vec![row])
}
