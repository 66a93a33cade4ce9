//! Sparse FP8 decode attention for DeepSeek-V4 (DSV4 §3.6, §4): each query (H = 64 or 128 heads x 512 dims)
//! attends to its own candidate list of 584-byte FP8 KV entries (sliding window ++ selected compressed
//! entries), with a per-head attention sink and the inverse RoPE on the output. Kernels: `kernels/sparse_attn.cu`
//! (design notes at its top; pieces in `kernels/common/sparse_attn_common.cuh`); CPU reference: [`reference`];
//! measurement hooks and the BF16-staging baseline the targets are measured against: [`bench`]; `megamoe exec`:
//! [`exec`].
//!
//! Data layout
//! * KV pool: `n_entries x 584` bytes, entry layout of `formats::kv` (see [`reference::encode_entry`]).
//!   A sequence's window ring slot `p mod 128` and its compressed entries are pool entries; pages are runs of
//!   entries and need no table of their own, because candidate lists hold pool indices.
//! * Candidate lists: `[batch, stride]` i32 pool indices (-1 = invalid), `lengths[batch]` of them used. `stride`
//!   is a capacity (the longest list the call may see: window + the most compressed candidates per query); the
//!   lengths are read on the device, so a captured call replays with any lengths in `0..=stride`.
//! * q: `[batch, heads, 512]` BF16 with RoPE at the query position already applied to dims 448..512.
//! * Output: `[batch, heads, 512]` BF16, inverse RoPE at the query position applied to dims 448..512.
//!
//! Precision of the FP8 path: q's 448 nope dims are quantized per (head, 64-tile) with a UE8M0 power-of-two
//! scale (the KV entry rule), K nope dims are the cache's FP8 codes times their pow2 tile scale, rope dims
//! BF16; every product is exact and the scores accumulate in f32. The kernel holds q and each KV tile as
//! exact BF16 values and runs both products on BF16 `wgmma` (kernel `sparse_attn_decode_fp8`); softmax in
//! f32, P rounded to BF16 for P.V (denominator unrounded), V = K dequantized exactly to BF16.
//!
//! Graph safety: every launch's grid and arguments come from the [`DecodeShape`] (capacities) and the
//! [`SplitPlan`] cut from it; per-query lengths, positions and candidate indices are read on the device; the
//! split partials and the baseline's staging buffer are a caller-owned [`DecodeWorkspace`] carved from an
//! [`Arena`]. A call captured once in a CUDA graph replays correctly after the device inputs change.

pub mod bench;
pub mod exec;
pub mod reference;

use anyhow::{bail, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::gpu::arena::{self, Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DevBuf, Kernel, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
pub use reference::{ENTRY_BYTES, HEAD_DIM, NOPE_DIM, ROPE_DIM, WINDOW};

/// Heads per CTA: a 128-head model runs two head-group CTAs per (sequence, split).
pub const HEADS_PER_CTA: usize = 64;
/// Candidates per KV tile (the kernel's inner-loop step).
pub const BLOCK_N: usize = 64;
/// The FP8 decode kernel (reads the FP8 pool directly; QK^T and P.V on wgmma).
const FP8_KERNEL: &str = "sparse_attn_decode_fp8";
/// Dynamic shared memory of `sparse_attn_decode_fp8` (mirrors `sa::kFp8SmemBytes`: the q / K = V / P tiles and
/// the candidate ring (206848 B), the 256-byte rope cos / sin table of its epilogue, and 1024 B of slack the
/// kernel uses to align its wgmma tiles to 1024 bytes).
const FP8_SMEM_BYTES: usize = 208_128;
/// Threads of the decode kernels' CTAs (two warp groups).
const DECODE_THREADS: u32 = 256;
/// The split merge with one warp per head.
const COMBINE_WARP_PER_HEAD: &str = "sparse_attn_combine_warp_per_head";
/// The latency-parallel split merge, by heads per thread (1, 2, 4); see [`heads_per_thread`].
const COMBINE_HEADS_PER_THREAD: [&str; 3] = [
    "sparse_attn_combine_heads_per_thread_1",
    "sparse_attn_combine_heads_per_thread_2",
    "sparse_attn_combine_heads_per_thread_4",
];
pub(crate) const FAMILY: &str = "sparse_attn";

/// Shape of one decode-attention call. Every field is a capacity: the grid and the split plan come from it,
/// never from the per-query lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: usize,
    pub heads: usize,
    /// Row stride of the candidate array = the longest candidate list the call may see (window size + the most
    /// compressed candidates per query).
    pub stride: usize,
    /// Entries in the KV pool.
    pub n_entries: usize,
}

impl DecodeShape {
    /// The capacity shape of a decode step: candidate rows of [`WINDOW`] + `max_compressed` entries (the sliding
    /// window and the most compressed entries a query may select: top-k for CSA, ctx / 128 at the longest context
    /// for HCA). A graph captured at this shape replays with any per-query lengths up to the stride.
    pub fn for_capacity(
        batch: usize,
        heads: usize,
        max_compressed: usize,
        n_entries: usize,
    ) -> DecodeShape {
        DecodeShape {
            batch,
            heads,
            stride: WINDOW + max_compressed,
            n_entries,
        }
    }
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
    /// KV tiles of the longest list (at least one).
    pub fn tiles(&self) -> usize {
        self.stride.div_ceil(BLOCK_N).max(1)
    }
    pub(crate) fn out_elems(&self) -> usize {
        self.batch * self.heads * HEAD_DIM
    }
}

/// Device inputs of a decode-attention call (shapes in the module doc). `lengths[b]` in `0..=stride` (larger
/// values are clamped to `stride` on the device, negative ones read as 0), `positions[b] >= 0` for every row with
/// candidates; a row of length 0 attends to nothing (its output is the empty softmax's zeros, whose inverse RoPE is
/// zeros at any position), which is how the engine's idle slots (position -1) pass through.
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
    pub(crate) fn check(&self, s: &DecodeShape) -> Result<()> {
        let want = |got: usize, exp: usize, what: &str| -> Result<()> {
            ensure!(
                got == exp,
                "{what} has {got} elements, expected {exp} for {s:?}"
            );
            Ok(())
        };
        want(self.q.len(), s.out_elems(), "q")?;
        want(self.pool.len(), s.n_entries * ENTRY_BYTES, "pool (bytes)")?;
        want(self.candidates.len(), s.batch * s.stride, "candidates")?;
        want(self.lengths.len(), s.batch, "lengths")?;
        want(self.positions.len(), s.batch, "positions")?;
        want(self.sinks.len(), s.heads, "sinks")?;
        want(self.freqs.len(), ROPE_DIM / 2, "freqs")?;
        Ok(())
    }
}

/// How a candidate list is cut for split-KV: split `s` takes KV tiles `[s*tps, (s+1)*tps)` of every list
/// (a split past a list's length writes an empty partial that the combine weighs by zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    pub n_splits: usize,
    pub tiles_per_split: usize,
}

impl SplitPlan {
    /// The FP8 kernel's plan: the wave-aware cost model ([`SplitPlan::by_cost`]) with the constants fitted to the
    /// measured kernel and the heads-per-thread combine ([`PlanCosts::FITTED`]) where both it and the model with
    /// the prior estimates ([`PlanCosts::ESTIMATED`]) cut [`HEADS_PER_THREAD_MIN_SPLITS`] or more splits (so both
    /// merge with the heads-per-thread combine, whose cost `FITTED` models); else the estimates' plan.
    ///
    /// Decided by results/h200/archive/session5-ab/sparse_attn_decode.csv (the same decode kernel and combine under both
    /// plans): the plans differ at one measured point, HCA 1M batch 1 (130 tiles): estimates 33 splits x 4 tiles
    /// 35.6 us, fitted 65 x 2 31.8 us; at HCA 1M batch 4 / 16 / 64 and every Flash / Pro batch point the two
    /// plans are equal. Where the fitted model would add a split to a plan of 1 or 2 splits, or cut to 2 splits,
    /// nothing was measured and the 2-split merge is the warp-per-head combine, which `FITTED` does not describe,
    /// so those points keep the estimates' plan.
    pub fn fp8(sm_count: usize, shape: &DecodeShape) -> SplitPlan {
        let estimated = SplitPlan::by_cost(sm_count, shape, &PlanCosts::ESTIMATED);
        let fitted = SplitPlan::by_cost(sm_count, shape, &PlanCosts::FITTED);
        if estimated.n_splits >= HEADS_PER_THREAD_MIN_SPLITS
            && fitted.n_splits >= HEADS_PER_THREAD_MIN_SPLITS
        {
            fitted
        } else {
            estimated
        }
    }

    /// Wave-aware plan for the FP8 kernel (one CTA per SM): minimizes the estimated time
    /// `waves * (prologue + tps * tile) + [n_splits > 1] * (combine + n_splits * combine_per_split)` over tiles per
    /// split `tps`, where `waves = ceil(CTAs / sm_count)`; a partial second wave costs a whole CTA time, and a floor
    /// of tiles per split would leave most SMs idle at small batch. Ties go to fewer splits.
    pub fn by_cost(sm_count: usize, shape: &DecodeShape, c: &PlanCosts) -> SplitPlan {
        let tiles = shape.tiles();
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
        let tiles = shape.tiles();
        Ok(SplitPlan {
            n_splits: tiles.div_ceil(tiles_per_split),
            tiles_per_split,
        })
    }

    pub(crate) fn check(&self, shape: &DecodeShape) -> Result<()> {
        ensure!(
            self.n_splits >= 1 && self.n_splits <= 65_535,
            "n_splits {} outside 1..=65535",
            self.n_splits
        );
        ensure!(
            self.tiles_per_split >= 1 && self.tiles_per_split <= i32::MAX as usize,
            "tiles_per_split {} outside 1..=i32::MAX",
            self.tiles_per_split
        );
        ensure!(
            self.n_splits * self.tiles_per_split >= shape.tiles(),
            "split plan {self:?} does not cover {} tiles",
            shape.tiles()
        );
        Ok(())
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
    /// Prior estimates: FP8 tile ~3 us at 64 heads, q prologue ~4 us, combine launch ~4 us.
    pub const ESTIMATED: PlanCosts = PlanCosts {
        prologue: 4.0,
        tile: 3.0,
        combine: 4.0,
        combine_per_split: 0.3,
    };
    /// Fitted to ncu durations of the FP8 decode kernel, one wave each (results/h200/archive/session5-start/sparse_attn.log): tiles per
    /// split 1 -> 12.8 us (Flash / Pro batch 1), 3 -> 21.5 (Pro batch 8), 5 -> 31.1 (Flash batch 64), 18 -> 91.2
    /// (Pro batch 64): slope 4.6 us per tile, intercept 8.2 us (residuals <= 0.5 us). The combine is the
    /// heads-per-thread merge: ~3 us (launch + one L2 round trip + the merge math) plus ~1 us (one more L2 round
    /// trip) per further chunk of 8 splits, i.e. ~0.12 us per split.
    pub const FITTED: PlanCosts = PlanCosts {
        prologue: 8.2,
        tile: 4.6,
        combine: 3.0,
        combine_per_split: 0.12,
    };
}

/// Caller-owned scratch of a decode call, carved from an [`Arena`]: the f32 split partials (O/l and lse per
/// (sequence, split, head); only when the plan splits) and, for the baseline, the BF16 staging buffer.
#[derive(Debug, Clone, Copy)]
pub struct DecodeWorkspace {
    shape: DecodeShape,
    plan: SplitPlan,
    part_o: Option<DevBuf<f32>>,
    part_lse: Option<DevBuf<f32>>,
    staging: Option<DevBuf<bf16>>,
}

/// Bytes of a [`DecodeWorkspace`] for a shape and plan (what [`DecodeWorkspace::carve`] takes from an arena):
/// `batch * n_splits * heads * (512 + 1)` f32 when the plan splits, plus `batch * stride * 512` BF16 with
/// `staging` (the baseline).
pub fn workspace_bytes(shape: &DecodeShape, plan: SplitPlan, staging: bool) -> usize {
    workspace_layout(shape, plan, staging).bytes()
}

fn workspace_layout(shape: &DecodeShape, plan: SplitPlan, staging: bool) -> WorkspaceLayout {
    let mut l = WorkspaceLayout::new();
    if plan.n_splits > 1 {
        let rows = shape.batch * plan.n_splits * shape.heads;
        l.add::<f32>(rows * HEAD_DIM).add::<f32>(rows);
    }
    if staging {
        l.add::<bf16>(shape.batch * shape.stride * HEAD_DIM);
    }
    l
}

impl DecodeWorkspace {
    /// Carve the workspace of (`shape`, `plan`) from `arena` (`staging` for the baseline path), in the order
    /// [`workspace_bytes`] counts.
    pub fn carve(
        arena: &mut Arena,
        shape: &DecodeShape,
        plan: SplitPlan,
        staging: bool,
    ) -> Result<DecodeWorkspace> {
        shape.validate()?;
        plan.check(shape)?;
        let (part_o, part_lse) = if plan.n_splits > 1 {
            let rows = shape.batch * plan.n_splits * shape.heads;
            (
                Some(arena.carve::<f32>(rows * HEAD_DIM, "sparse_attn split partials O")?),
                Some(arena.carve::<f32>(rows, "sparse_attn split partials lse")?),
            )
        } else {
            (None, None)
        };
        let staging = if staging {
            Some(arena.carve::<bf16>(
                shape.batch * shape.stride * HEAD_DIM,
                "sparse_attn BF16 staging",
            )?)
        } else {
            None
        };
        Ok(DecodeWorkspace {
            shape: *shape,
            plan,
            part_o,
            part_lse,
            staging,
        })
    }
    /// A workspace in an arena of its own (tests, bench and `exec`; the engine carves from its shared arena).
    pub fn with_arena(
        gpu: &Gpu,
        shape: &DecodeShape,
        plan: SplitPlan,
        staging: bool,
    ) -> Result<(Arena, DecodeWorkspace)> {
        let mut arena = Arena::new(gpu, workspace_bytes(shape, plan, staging))?;
        let ws = DecodeWorkspace::carve(&mut arena, shape, plan, staging)?;
        Ok((arena, ws))
    }
    pub fn plan(&self) -> SplitPlan {
        self.plan
    }
    /// The baseline's BF16 staging buffer (carved with `staging = true`).
    pub(crate) fn staging(&self) -> Option<&DevBuf<bf16>> {
        self.staging.as_ref()
    }
    pub fn shape(&self) -> DecodeShape {
        self.shape
    }
    /// Fill every buffer of the workspace (split partials, staging) with the byte 0xFF (NaN) on `stream`: tests use
    /// it to show that a call reads only what it wrote itself (the baseline's attention kernel reads exactly the
    /// staging rows its gather wrote: valid candidates below the length).
    pub fn poison(&self, stream: &Stream) -> Result<()> {
        if let Some(o) = &self.part_o {
            arena::fill(stream, o, 0xFF)?;
        }
        if let Some(l) = &self.part_lse {
            arena::fill(stream, l, 0xFF)?;
        }
        if let Some(st) = &self.staging {
            arena::fill(stream, st, 0xFF)?;
        }
        Ok(())
    }
}

/// How split partials are merged (both merges are bit-identical: the same operations in the same order per
/// output element; only the time differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    /// `sparse_attn_combine_warp_per_head`: one warp per (sequence, head), 8 heads per CTA of 256 threads.
    WarpPerHead,
    /// `sparse_attn_combine_heads_per_thread_{1,2,4}`: one CTA of 128 threads per (sequence, 1 / 2 / 4 heads),
    /// 4 dims per thread, up to 8 partials' loads in flight per thread ([`heads_per_thread`]).
    HeadsPerThread,
}

/// Heads per thread of the heads-per-thread combine for `n_splits` splits, as (index into its entry points,
/// heads per thread): the most heads per thread with heads * n_splits <= 8 (a thread holds 8 partials' loads at
/// once), so a plan with few splits still keeps 8 loads in flight per thread. Heads are multiples of 64, so
/// every choice divides them.
pub fn heads_per_thread(n_splits: usize) -> (usize, usize) {
    match n_splits {
        0..=2 => (2, 4),
        3..=4 => (1, 2),
        _ => (0, 1),
    }
}

/// Fewest splits the routed path merges with [`Combine::HeadsPerThread`] (fewer: [`Combine::WarpPerHead`]).
///
/// Decided by results/h200/archive/session5-ab/sparse_attn_decode.csv (the same decode kernel and plan, warp-per-head vs
/// heads-per-thread merge): with 3+ splits heads-per-thread was faster at all 24 points (e.g. Flash CSA 64K
/// batch 1, 10 splits, 22.9 vs 19.7 us; HCA 1M batch 1, 33 splits, 44.3 vs 35.6); with 2 splits (its
/// four-heads-per-thread entry) slower at 6 of 8 points (Pro batch 32 at 64K 56.1 vs 58.2, Flash batch 64
/// 43.8 vs 45.9). Heads and batch do not separate winners from losers; the split count does. Re-measured by the
/// forcing variants `fp8_combine_warp_per_head` and `fp8_combine_heads_per_thread`.
pub const HEADS_PER_THREAD_MIN_SPLITS: usize = 3;

/// Which merge `path` uses for `n_splits` split partials (meaningless for 1 split: no combine runs).
pub fn combine_for(path: Path, n_splits: usize) -> Combine {
    match path {
        Path::Fp8 if n_splits >= HEADS_PER_THREAD_MIN_SPLITS => Combine::HeadsPerThread,
        Path::Fp8HeadsPerThreadCombine => Combine::HeadsPerThread,
        Path::Fp8 | Path::Fp8WarpPerHeadCombine => Combine::WarpPerHead,
    }
}

/// Which kernels a call runs (the BF16-staging baseline is [`bench::decode_bf16_staging`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// The routed path: `sparse_attn_decode_fp8` reads the FP8 pool directly, quantizes q per (head, 64-tile)
    /// like a KV entry, dequantizes each tile once to a 128B-swizzled BF16 tile (K = V), QK^T and P.V on `wgmma`,
    /// the next tile's dequant overlapped with QK^T. Plan [`SplitPlan::fp8`]; when it splits, [`combine_for`]
    /// picks the merge by [`HEADS_PER_THREAD_MIN_SPLITS`]. Bench variant `fp8`.
    Fp8,
    /// Forcing variant of the combine rule: [`Path::Fp8`] with every split merged by [`Combine::WarpPerHead`].
    /// Bench variant `fp8_combine_warp_per_head`.
    Fp8WarpPerHeadCombine,
    /// Forcing variant of the combine rule: [`Path::Fp8`] with every split merged by [`Combine::HeadsPerThread`].
    /// Bench variant `fp8_combine_heads_per_thread`.
    Fp8HeadsPerThreadCombine,
}

impl Path {
    /// (family, entry point, dynamic shared memory, threads per CTA) of the path's attention kernel.
    fn attention_kernel(self) -> (&'static str, &'static str, usize, u32) {
        match self {
            Path::Fp8 | Path::Fp8WarpPerHeadCombine | Path::Fp8HeadsPerThreadCombine => {
                (FAMILY, FP8_KERNEL, FP8_SMEM_BYTES, DECODE_THREADS)
            }
        }
    }
}

/// Run decode attention (plus the combine kernel when the plan splits) on `stream` into `out` [batch, heads, 512]
/// BF16. `ws` must have been carved for this shape; its plan cuts the lists ([`SplitPlan::fp8`] is the routed
/// one). Allocates nothing and reads no device data on the host: graph-capturable.
pub fn decode(
    gpu: &Gpu,
    stream: &Stream,
    path: Path,
    shape: &DecodeShape,
    inp: &DecodeInputs,
    ws: &DecodeWorkspace,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check_call(shape, inp, ws, out)?;
    let (family, name, smem, threads) = path.attention_kernel();
    let attn = gpu.kernel_with_smem(family, name, smem)?;
    let merge = match ws.plan.n_splits {
        1 => None,
        n => Some(combine_kernel(gpu, combine_for(path, n), shape, n)?),
    };
    launch_attention(stream, &attn, (smem, threads), shape, inp, None, ws, out)?;
    if let Some((k, l)) = merge {
        launch_combine(stream, &k, l, shape, inp, ws, out)?;
    }
    Ok(())
}

/// The checks of a decode call, before any launch: shape, inputs against it, the workspace carved for it
/// (partials present when the plan splits), the output's length.
pub(crate) fn check_call(
    shape: &DecodeShape,
    inp: &DecodeInputs,
    ws: &DecodeWorkspace,
    out: &CudaSlice<bf16>,
) -> Result<()> {
    shape.validate()?;
    inp.check(shape)?;
    ensure!(
        ws.shape == *shape,
        "workspace was carved for {:?}, call is {shape:?}",
        ws.shape
    );
    ensure!(
        ws.plan.n_splits == 1 || (ws.part_o.is_some() && ws.part_lse.is_some()),
        "workspace for {:?} has no split partials",
        ws.plan
    );
    ensure!(
        out.len() == shape.out_elems(),
        "out has {} elements, expected {}",
        out.len(),
        shape.out_elems()
    );
    Ok(())
}

/// The merge kernel `c` for `n_splits` splits and its launch geometry.
pub(crate) fn combine_kernel(
    gpu: &Gpu,
    c: Combine,
    shape: &DecodeShape,
    n_splits: usize,
) -> Result<(std::sync::Arc<Kernel>, Launch)> {
    let batch = shape.batch as u32;
    Ok(match c {
        // One warp per head, 8 heads per CTA.
        Combine::WarpPerHead => (
            gpu.kernel(FAMILY, COMBINE_WARP_PER_HEAD)?,
            Launch::new(((shape.heads / 8) as u32, batch, 1), (256, 1, 1)),
        ),
        Combine::HeadsPerThread => {
            let (k, hpt) = heads_per_thread(n_splits);
            (
                gpu.kernel(FAMILY, COMBINE_HEADS_PER_THREAD[k])?,
                Launch::new(((shape.heads / hpt) as u32, batch, 1), (128, 1, 1)),
            )
        }
    })
}

/// Launch an attention kernel of the `SA_DECODE_PARAMS` signature (grid: head groups x splits x batch; `block` =
/// (dynamic shared memory, threads per CTA)): it reads the FP8 pool, or with `staging` the BF16 staging buffer. One
/// split writes `out`, more write the workspace's partials. The call was checked by [`check_call`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_attention(
    stream: &Stream,
    k: &Kernel,
    (smem, threads): (usize, u32),
    shape: &DecodeShape,
    inp: &DecodeInputs,
    staging: Option<&DevBuf<bf16>>,
    ws: &DecodeWorkspace,
    out: &CudaSlice<bf16>,
) -> Result<()> {
    let plan = ws.plan;
    let mut a = KernelArgs::new();
    a.buf(inp.q);
    match staging {
        None => a.buf(inp.pool).null(),
        Some(st) => a.null().buf(st),
    };
    a.i32(shape.n_entries as i32)
        .buf(inp.candidates)
        .i32(shape.stride as i32)
        .buf(inp.lengths)
        .buf(inp.positions)
        .buf(inp.sinks)
        .buf(inp.freqs)
        .i32(shape.heads as i32)
        .i32(plan.tiles_per_split as i32)
        .i32(plan.n_splits as i32);
    match (plan.n_splits, &ws.part_o, &ws.part_lse) {
        (1, _, _) => a.buf(out).null().null(),
        (_, Some(o), Some(l)) => a.null().buf(o).buf(l),
        _ => bail!("workspace for {plan:?} has no split partials"),
    };
    let l = Launch::new(
        (
            (shape.heads / HEADS_PER_CTA) as u32,
            plan.n_splits as u32,
            shape.batch as u32,
        ),
        (threads, 1, 1),
    )
    .smem(smem);
    // SAFETY: SA_DECODE_PARAMS of kernels/sparse_attn.cu; every buffer
    // checked against the shape and plan by check_call (partials hold batch * n_splits * heads rows, staging
    // batch * stride rows).
    unsafe { launch(stream, k, l, &mut a) }
}

/// Launch a merge (`SA_COMBINE_PARAMS`, both merges take the same arguments) of the workspace's partials into
/// `out`. The call was checked by [`check_call`] and the plan splits.
pub(crate) fn launch_combine(
    stream: &Stream,
    k: &Kernel,
    l: Launch,
    shape: &DecodeShape,
    inp: &DecodeInputs,
    ws: &DecodeWorkspace,
    out: &CudaSlice<bf16>,
) -> Result<()> {
    let (Some(o), Some(lse)) = (&ws.part_o, &ws.part_lse) else {
        bail!("workspace for {:?} has no split partials", ws.plan);
    };
    let mut a = KernelArgs::new();
    a.buf(out)
        .buf(o)
        .buf(lse)
        .buf(inp.sinks)
        .buf(inp.positions)
        .buf(inp.freqs)
        .i32(shape.heads as i32)
        .i32(ws.plan.n_splits as i32);
    // SAFETY: SA_COMBINE_PARAMS; buffers checked by check_call.
    unsafe { launch(stream, k, l, &mut a) }
}

/// Source vectors for the KV writer.
pub enum KvSource<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<bf16>),
}

/// Quantize up to `slots` new 512-dim vectors on `stream`: vector `i` goes to pool entry `dst_index[i]` (bit-exact
/// with [`reference::encode_entry`] for finite inputs). `slots` is a capacity (the grid); the destinations are
/// read on the device, and a destination outside `0..n_entries` (e.g. -1 for an unused slot) skips its vector,
/// so a captured writer replays with any set of slots. Use [`check_write_indices`] on host copies to turn bad
/// destinations into errors.
pub fn write_entries(
    gpu: &Gpu,
    stream: &Stream,
    pool: &mut CudaSlice<u8>,
    src: KvSource,
    dst_index: &CudaSlice<i32>,
    slots: usize,
) -> Result<()> {
    ensure!(
        pool.len().is_multiple_of(ENTRY_BYTES),
        "pool has {} bytes, not a multiple of {ENTRY_BYTES}",
        pool.len()
    );
    let n_entries = pool.len() / ENTRY_BYTES;
    ensure!(
        n_entries <= i32::MAX as usize && slots <= i32::MAX as usize,
        "pool or slot count too large for i32 indices"
    );
    ensure!(
        dst_index.len() >= slots,
        "dst_index has {} elements, need {slots}",
        dst_index.len()
    );
    let src_len = match &src {
        KvSource::F32(s) => s.len(),
        KvSource::Bf16(s) => s.len(),
    };
    ensure!(
        src_len >= slots * HEAD_DIM,
        "source has {src_len} elements, need {slots} x 512"
    );
    if slots == 0 {
        return Ok(());
    }
    let name = match src {
        KvSource::F32(_) => "kv_write_entries_f32",
        KvSource::Bf16(_) => "kv_write_entries_bf16",
    };
    let k = gpu.kernel(FAMILY, name)?;
    let mut a = KernelArgs::new();
    a.buf(pool).i32(n_entries as i32);
    match src {
        KvSource::F32(s) => a.buf(s),
        KvSource::Bf16(s) => a.buf(s),
    };
    a.buf(dst_index).i32(slots as i32);
    // 8 warps per CTA, one vector per warp.
    let l = Launch::new((slots.div_ceil(8) as u32, 1, 1), (256, 1, 1));
    // SAFETY: argument list of kv_write_entries_*; src holds slots x 512 values, dst_index slots indices, and the
    // kernel bounds-checks every destination against n_entries.
    unsafe { launch(stream, &k, l, &mut a) }
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
