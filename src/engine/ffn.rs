//! The FFN half of a decode layer (docs/engine.md, "The decode step", steps 12-16): `x_in` -> hc_pre + ffn_norm
//! -> router (logical -> physical expert slots) -> routed experts (moe_gemm L1, L2) + shared expert -> hc_post ->
//! `x_out`.
//!
//! For the B tokens of a step, in stream order on one stream (the shared expert on a second stream beside 13-14
//! measured no gain, results/h100/PERF-LOG.md, and was removed):
//!
//! * 12 `hc_pre_ffn_norm`: `mhc::mhc_pre` with `hc_ffn_*` and `ffn_norm` -> pre / post / comb and `f` BF16 `[B, D]`
//!   (the CPU model's `rms_norm_bf16` output, the router gate's input), and in the same finish kernel
//!   (`mhc::mhc_pre_copies`) `f` quantized twice with norm_quant's BF16-row codec: FP8 1x128 (the shared expert's
//!   input, the CPU's `fp8_act_quant(f)` bit for bit) and NVFP4 with a per-row global scale (the routed experts'
//!   input), the bits of `quantize_bf16_rows` of `f`.
//! * 13 `route`: `router::route` (hash layers: the `tid2eid` row of `io.tokens`; the others: biased top-6), with
//!   `slot_of` = the plan's [`ExpertMap`] table, writing the masked grouping by physical slot: counts (straight into
//!   the moe_gemm grouping's buffer), per-row token and weight, the `[B, 6]` row table. Both launches are
//!   PDL-launched: the logits load their gate rows while hc_pre finishes; the selection stages its bias and slot
//!   tables, then lets the shared expert's GEMV in (its weight prefetch overlaps the selection), then waits.
//! * 15 `shared_expert`: `dense::shared_expert` (FP8 w1 / w3 + SwiGLU + FP8 h, then w2) -> BF16 `[B, D]`. Runs before
//!   14 because its output is 14's combine addend. After the router, not before: run first, it halved the
//!   selection's wall time but lost as much itself, its weight prefetch no longer hidden under the selection (the
//!   A/B's numbers: results/h100/PERF-LOG.md).
//! * 14 `routed_experts`: `router::gather_nvfp4_rows` (f's NVFP4 token rows into the grouping's rows), moe_gemm decode
//!   L1 (`[w1; w3]`, SwiGLU with the clamp, routing weight, NVFP4 h) and L2 (`w2`), the L2 combine adding the shared
//!   expert's output in f32 before the one BF16 rounding (the CPU model's `moe`) -> `moe_out` BF16 `[B, D]`.
//! * 16 `hc_post`: `mhc::mhc_post(moe_out, x_in, post, comb)` -> `x_out`.
//!
//! Numerics against `src/model` (the parity tolerances, tests/engine_ffn.rs): the routed experts read NVFP4
//! activations (f, and h between L1 and L2) with a per-row global scale where the model quantizes both to FP8
//! 1x128, and do not round g, u and each expert's output to BF16 as the model does; mHC mixes and the router's
//! logits are f32 sums in other orders.
//!
//! Prefill chunks of more than `dense::MAX_ROWS` rows ([`FfnHalf::contiguous`]; docs/engine.md "Chunked prefill"):
//! the router still writes its masked grouping by slot (counts into [`ContiguousRows::masked_counts`]), then one
//! glue kernel ([`contiguous_grouping`], kernels/engine_ffn.cu) rewrites it as the contiguous grouping (offsets per
//! slot, the pairs' rows and the rows' weights, `6 C` rows): moe_gemm's launcher then takes its prefill (wgmma)
//! mainloop once the chunk has at least 6 rows per slot on average (C >= slots; `moe_gemm::prefill::routes_here`), one
//! K split, so each resident expert's weights are read once per chunk; the masked layout would need `slots x C`
//! rows. The shared expert runs w1 and w3 as one tensor-core `fp8_linears` launch (BF16 g and u), the fused GEMV's
//! SwiGLU epilogue as a glue kernel ([`swiglu_fp8_rows`]) and w2 on the tensor cores (without f32 weight scales:
//! the fused GEMV in pieces of 64 rows, `dense` module docs). The decode step (at most 64 rows) keeps the masked
//! grouping and the fused GEMV.
//!
//! Idle slots (position < 0): the FFN half reads no position and no cache, so an idle slot's row is computed like
//! any other (its residual row in, its residual row out) and takes rows of the grouping; it changes no other row.

use anyhow::{bail, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::engine::io::{group, LayerIo, StepShape};
use crate::engine::plan::ExpertMap;
use crate::engine::weights::DeviceWeights;
use crate::gpu::arena::{self, Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, KernelArgs, Launch};
use crate::gpu::{DevBuf, DeviceBuf, Gpu, Stream};
use crate::model::weights::StoredDtype;
use crate::model::ModelConfig;
use crate::ops::dense::{
    self, DenseKind, DenseShape, DenseWorkspace, Fp8Job, Fp8Rows, Fp8Weight, SharedExpertScratch,
};
use crate::ops::mhc::{self, MhcPreOutputs, MhcWeights, MhcWorkspace, PriorPost};
use crate::ops::moe_gemm::reference::SWIGLU_LIMIT;
use crate::ops::moe_gemm::{
    self, DeviceActivations, DeviceGrouping, GemmConfig, L1Output, Workspace as MoeWorkspace,
};
use crate::ops::norm_quant::{OutFormat, QuantBufs, QuantView, RowsOut};
use crate::ops::router::{
    self, Nvfp4RowBufs, RouterInputs, RouterOutputs, RouterShape, RouterWorkspace, Selection, TOPK,
};

/// Rows per physical slot of the masked grouping for `tokens` tokens: a token's picks are distinct logical experts
/// (the biased top-6, or a tid2eid row, whose repeats the router drops) and at most
/// [`ExpertMap::experts_per_slot`] owned experts share a slot, so a slot gets at most `min(6, that)` rows per token
/// and no owned pair is ever dropped. The identity map gives `tokens`.
pub fn slot_capacity(tokens: usize, map: &ExpertMap) -> usize {
    tokens * TOPK.min(map.experts_per_slot())
}

/// A hash layer's `tid2eid` as stored (I64 little-endian, `[vocab, 6]`) -> the router's i32 table; an entry outside
/// `0..experts` is an error (the router would route it nowhere).
pub fn tid2eid_i32(bytes: &[u8], experts: usize) -> Result<Vec<i32>> {
    ensure!(
        bytes.len().is_multiple_of(8 * TOPK),
        "tid2eid: {} bytes are not whole rows of {TOPK} I64",
        bytes.len()
    );
    bytes
        .chunks_exact(8)
        .enumerate()
        .map(|(i, b)| {
            let e = i64::from_le_bytes(b.try_into().expect("8 bytes"));
            ensure!(
                (0..experts as i64).contains(&e),
                "tid2eid[{}][{}] = {e} is outside 0..{experts}",
                i / TOPK,
                i % TOPK
            );
            Ok(e as i32)
        })
        .collect()
}

pub use crate::engine::plan::uses_contiguous_grouping;

/// Host twin of `ffn_contiguous_grouping` (kernels/engine_ffn.cu): the router's masked grouping (`counts[slots]`,
/// rows `s * capacity + k`, the pairs' rows `masked_rows[pairs]` with -1 for none, the rows' weights) -> the
/// contiguous one: `(offsets[slots + 1], rows[pairs], weight[pairs])`, slot s owning rows `offsets[s]..offsets[s +
/// 1]` in its masked order, weight 0 on rows no slot owns.
pub fn contiguous_grouping_host(
    counts: &[i32],
    capacity: usize,
    masked_rows: &[i32],
    masked_weight: &[f32],
) -> (Vec<i32>, Vec<i32>, Vec<f32>) {
    let pairs = masked_rows.len();
    let c: Vec<i32> = counts
        .iter()
        .map(|&n| n.clamp(0, capacity as i32))
        .collect();
    let mut offsets = vec![0i32; counts.len() + 1];
    for s in 0..counts.len() {
        offsets[s + 1] = offsets[s] + c[s];
    }
    let mut weight = vec![0f32; pairs];
    let rows = masked_rows
        .iter()
        .map(|&r| {
            if r < 0 {
                return -1;
            }
            let (s, k) = (r as usize / capacity, r as usize % capacity);
            if s < counts.len() && (k as i32) < c[s] && ((offsets[s] as usize + k) < pairs) {
                let out = offsets[s] as usize + k;
                weight[out] = masked_weight[r as usize];
                out as i32
            } else {
                -1
            }
        })
        .collect();
    (offsets, rows, weight)
}

/// The routed experts' grouping of an FFN half of `tokens` rows over an expert map: what [`FfnHalf::new`] allocates
/// outside the step's arena (it depends on the map), and its moe_gemm launch configurations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupingSizes {
    pub tokens: usize,
    /// The contiguous grouping ([`uses_contiguous_grouping`]): one row per pair; else masked, `slots x capacity`.
    pub contiguous: bool,
    /// The router's masked rows per slot ([`slot_capacity`]).
    pub capacity: usize,
    /// The grouping's rows (the gathered activations, h, the partials' rows).
    pub rows: usize,
    pub slots: usize,
    pub logical: usize,
    pub l1: GemmConfig,
    pub l2: GemmConfig,
}

impl GroupingSizes {
    pub fn of(cfg: &ModelConfig, tokens: usize, map: &ExpertMap, sm_count: usize) -> GroupingSizes {
        let (d, i) = (cfg.dim, cfg.moe_inter_dim);
        let pairs = tokens * TOPK;
        let contiguous = uses_contiguous_grouping(tokens);
        let capacity = slot_capacity(tokens, map);
        let rows = if contiguous {
            pairs
        } else {
            map.slots * capacity
        };
        let active = map.slots.min(pairs);
        let per_active = pairs as f64 / active.max(1) as f64;
        let mut l1 = GemmConfig::choose(sm_count, per_active, active, 2 * i, d);
        let mut l2 = GemmConfig::choose(sm_count, per_active, active, d, i);
        if contiguous {
            // One K split: what moe_gemm's prefill mainloop takes (`prefill::routes_here`).
            l1.splits = 1;
            l2.splits = 1;
        }
        GroupingSizes {
            tokens,
            contiguous,
            capacity,
            rows,
            slots: map.slots,
            logical: map.logical,
            l1,
            l2,
        }
    }

    /// f32 elements of the partials (L1's, then L2's, in one buffer).
    pub fn partial_floats(&self, cfg: &ModelConfig) -> usize {
        let (d, i) = (cfg.dim, cfg.moe_inter_dim);
        (self.l1.splits * self.rows * 2 * i).max(self.l2.splits * self.rows * d)
    }

    /// Device bytes [`FfnHalf::new`] allocates outside the arena for this grouping: the router's outputs (its masked
    /// tables), the grouping's counts or offsets, the contiguous tables, the gathered NVFP4 rows, the partials, the
    /// prefill mainloop's pre-pass activations (contiguous), h, the MoE output and the slot table.
    pub fn bytes(&self, cfg: &ModelConfig) -> usize {
        let (d, i, b) = (cfg.dim, cfg.moe_inter_dim, self.tokens);
        let pairs = b * TOPK;
        let router = pairs * 12 + self.slots * 4 + self.slots * self.capacity * 8 + 4;
        let group = (self.slots + 1) * 4;
        // The contiguous tables, the pre-pass activations and the shared expert's g and u.
        let contiguous = if self.contiguous {
            self.slots * 4 + pairs * 8 + self.rows * d.max(i) * 2 + 2 * b * i * 2
        } else {
            0
        };
        let gathered = self.rows * (d / 2 + d / 16 + 4);
        let h = self.rows * (i / 2 + i / 16 + 4);
        router
            + group
            + contiguous
            + gathered
            + h
            + self.partial_floats(cfg) * 4
            + b * d * 2
            + self.logical * 4
    }
}

/// The sizes of the FFN half that do not depend on the expert map (what the step's arena holds for it).
#[derive(Clone, Copy, Debug)]
struct ArenaSizes {
    tokens: usize,
    dim: usize,
    inter: usize,
    experts: usize,
}

impl ArenaSizes {
    fn of(cfg: &ModelConfig, shape: &StepShape) -> ArenaSizes {
        ArenaSizes {
            tokens: shape.batch,
            dim: cfg.dim,
            inter: cfg.moe_inter_dim,
            experts: cfg.n_routed_experts,
        }
    }
    /// The shared expert's dense launches: w1/w3 + SwiGLU (the fused GEMV), then w2; above `dense::MAX_ROWS` rows
    /// also w1 and w3 as one `fp8_linears` launch on the tensor cores ([`FfnHalf::shared_expert`]).
    fn shared_shapes(&self) -> Vec<DenseShape> {
        let (b, d, i) = (self.tokens, self.dim, self.inter);
        let mut v = vec![
            DenseShape::new(DenseKind::Swiglu, b, i, d, 1),
            DenseShape::new(DenseKind::Fp8, b, d, i, 1),
        ];
        if uses_contiguous_grouping(b) {
            v.push(DenseShape::new(DenseKind::Fp8, b, i, d, 2));
        }
        v
    }
    /// The router's logits scratch depends on T and E only (not on the slots).
    fn router_logits_shape(&self) -> RouterShape {
        RouterShape::identity(self.tokens, self.experts, self.dim, self.tokens)
    }
}

/// An FP8 weight of the dense pool: e4m3 codes `[n, k]` and ue8m0 128x128 scales.
struct PoolFp8 {
    codes: DevBuf<u8>,
    scales: DevBuf<u8>,
    n: usize,
    k: usize,
    /// The scales as f32 (the dense tensor-core route's: `DeviceWeights::scales_f32`).
    scales_f32: Option<DevBuf<f32>>,
}

impl PoolFp8 {
    fn of(weights: &DeviceWeights, prefix: &str, n: usize, k: usize) -> Result<PoolFp8> {
        Ok(PoolFp8 {
            codes: weights.typed::<u8>(&format!("{prefix}.weight"))?,
            scales: weights.typed::<u8>(&format!("{prefix}.scale"))?,
            n,
            k,
            scales_f32: weights.scales_f32(&format!("{prefix}.weight")),
        })
    }
    fn weight(&self) -> Fp8Weight<'_> {
        Fp8Weight {
            codes: &self.codes,
            scales: &self.scales,
            n: self.n,
            k: self.k,
            scales_f32: self.scales_f32.as_ref().map(|s| s as &dyn DeviceBuf<f32>),
        }
    }
}

/// How a layer's router picks its experts.
enum LayerSelection {
    /// Top-6 of score + `gate.bias` (a view into the pool).
    Biased { bias: DevBuf<f32> },
    /// The token's `tid2eid` row, uploaded as i32 `[vocab, 6]` at `new`.
    Hash { tid2eid: CudaSlice<i32> },
}

/// One layer's FFN weights: the mHC boundary and ffn_norm (uploaded), the gate (pool view), the selection rule, the
/// shared expert's FP8 weights (pool views; none without a shared expert). The routed experts are
/// `DeviceWeights::experts[layer]`.
struct FfnLayer {
    mhc: MhcWeights,
    gate: DevBuf<bf16>,
    selection: LayerSelection,
    shared: Option<[PoolFp8; 3]>,
}

impl FfnLayer {
    fn new(gpu: &Gpu, weights: &DeviceWeights, layer: usize) -> Result<FfnLayer> {
        let cfg = &weights.plan.config;
        let s = &gpu.stream;
        let p = format!("layers.{layer}");
        let mhc = weights.mhc_boundary(gpu, layer, "ffn")?;
        let f = format!("{p}.ffn");
        let gate = weights.typed::<bf16>(&format!("{f}.gate.weight"))?;
        let selection = if cfg.is_hash_layer(layer) {
            let name = format!("{f}.gate.tid2eid");
            let Some(t) = weights.plan.dense_tensor(&name) else {
                bail!("the model has no tensor {name}")
            };
            ensure!(
                t.spec.dtype == StoredDtype::I64
                    && t.spec.shape == [cfg.vocab_size, cfg.n_activated_experts],
                "{name}: {:?} {:?}, expected I64 [{}, {TOPK}]",
                t.spec.dtype,
                t.spec.shape,
                cfg.vocab_size
            );
            let bytes = arena::download(s, &weights.bytes(&name)?)?;
            let table = tid2eid_i32(&bytes[..8 * t.spec.numel()], cfg.n_routed_experts)?;
            LayerSelection::Hash {
                tid2eid: gpu.upload(&table)?,
            }
        } else {
            LayerSelection::Biased {
                bias: weights.typed::<f32>(&format!("{f}.gate.bias"))?,
            }
        };
        let shared = if cfg.n_shared_experts > 0 {
            let (d, i) = (cfg.dim, cfg.moe_inter_dim);
            let se = format!("{f}.shared_experts");
            Some([
                PoolFp8::of(weights, &format!("{se}.w1"), i, d)?,
                PoolFp8::of(weights, &format!("{se}.w2"), d, i)?,
                PoolFp8::of(weights, &format!("{se}.w3"), i, d)?,
            ])
        } else {
            None
        };
        Ok(FfnLayer {
            mhc,
            gate,
            selection,
            shared,
        })
    }
}

/// The FFN half's per-layer weights (views into the dense pool and the resident experts, plus what the launchers
/// need uploaded) and its workspaces (carved once from the step's arena, shared by every layer), plus the buffers
/// whose size depends on the plan's expert map (allocated once in [`FfnHalf::new`]). The intermediates are public
/// for the parity tests; each holds the last layer run.
pub struct FfnHalf {
    tokens: usize,
    dim: usize,
    vocab: usize,
    eps: f32,
    route_scale: f32,
    swiglu_limit: f32,
    layers: Vec<FfnLayer>,
    /// The plan's expert map and its table on the device (i32 `[logical]`: logical expert -> physical slot).
    pub map: ExpertMap,
    slot_of: CudaSlice<i32>,
    /// The moe_gemm launch configurations of L1 and L2 (fixed at `new` from B and the slots).
    pub l1_config: GemmConfig,
    pub l2_config: GemmConfig,

    // Step 12.
    mhc_ws: MhcWorkspace,
    /// pre / post `[B, 4]`, comb `[B, 16]`, u `[B, D]` and `f` = ffn_norm(u) BF16 `[B, D]` (`hc.normed`).
    pub hc: MhcPreOutputs,
    /// `f` BF16 `[B, D]` (a view of `hc.normed`): the router gate's input.
    pub f: DevBuf<bf16>,
    /// `f` as FP8 1x128 `[B, D]`: the shared expert's input.
    pub f_fp8: RowsOut,
    /// `f` as NVFP4 token rows `[B, D]` with a per-row global scale: the routed experts' input before the gather.
    pub f_nvfp4: RowsOut,

    // Step 13.
    router_ws: RouterWorkspace,
    /// The router's outputs (`route.counts` is not written: the counts go to `grouping.group`).
    pub route: RouterOutputs,
    /// The masked grouping by physical slot (`group` = the per-slot counts the router writes).
    pub grouping: DeviceGrouping,

    /// A prefill chunk's contiguous grouping (more than `dense::MAX_ROWS` rows; module docs); `None` in the decode
    /// step, which reads the router's masked grouping.
    pub contiguous: Option<ContiguousRows>,

    // Step 14.
    /// f's NVFP4 rows gathered into the grouping's rows `[rows_total, D]` (`slots x capacity` masked, `6 B`
    /// contiguous; only owned rows are written).
    pub a_codes: CudaSlice<u8>,
    pub a_scales: CudaSlice<u8>,
    pub a_global: CudaSlice<f32>,
    /// fp32 partials of L1, then of L2 (one buffer: L2's mainloop runs after L1's finish has read it).
    _partials: CudaSlice<f32>,
    /// The prefill mainloop's pre-pass activations (contiguous grouping only; L1's, then L2's); empty otherwise.
    _act_rs: Option<CudaSlice<bf16>>,
    ws_l1: MoeWorkspace,
    ws_l2: MoeWorkspace,
    /// h: L1's output, NVFP4 `[rows_total, I]` (L2's input).
    pub h: L1Output,
    /// The MoE output BF16 `[B, D]`: routed experts + shared expert, rounded once.
    pub moe_out: CudaSlice<bf16>,

    // Step 15.
    dense_ws: DenseWorkspace,
    h_shared_codes: DevBuf<u8>,
    h_shared_scales: DevBuf<u8>,
    /// The shared expert's output BF16 `[B, D]` (the L2 combine's addend).
    pub shared_out: DevBuf<bf16>,
    /// A prefill chunk's (more than `dense::MAX_ROWS` rows) shared-expert g and u, BF16 `[2, B, I]`: w1 and w3 on the
    /// tensor cores, then [`swiglu_fp8_rows`]; `None` in the decode step (the fused GEMV).
    pub shared_gu: Option<CudaSlice<bf16>>,
}

/// The contiguous grouping of a prefill chunk, written from the router's masked one by [`contiguous_grouping`]
/// (the grouping's offsets are `FfnHalf::grouping.group`).
pub struct ContiguousRows {
    /// The router's per-slot counts `[slots]` (its masked grouping).
    pub masked_counts: CudaSlice<i32>,
    /// Row of pair (t, j) in the contiguous grouping `[T, 6]`, -1 for none (the gather's and the L2 combine's table).
    pub token_rows: CudaSlice<i32>,
    /// Routing weight of each contiguous row `[6 T]` (0 for a row no slot owns; the L1 finish's `routing`).
    pub row_weight: CudaSlice<f32>,
}

impl FfnHalf {
    /// The carves of [`FfnHalf::new`] for `shape`, in its order (none depends on the expert map: what does is
    /// allocated in `new`).
    pub fn layout(
        cfg: &ModelConfig,
        shape: &StepShape,
        sm_count: usize,
    ) -> Result<WorkspaceLayout> {
        let z = ArenaSizes::of(cfg, shape);
        let (b, d, i) = (z.tokens, z.dim, z.inter);
        let mut l = WorkspaceLayout::new();
        for part in [
            MhcWorkspace::layout(b, d),
            RowsOut::layout(OutFormat::Fp8, b, d),
            RowsOut::layout(OutFormat::Nvfp4, b, d),
            RouterWorkspace::layout(&z.router_logits_shape()),
            dense::workspace_layout(&z.shared_shapes(), sm_count)?,
        ] {
            l.add_bytes(part.bytes());
        }
        l.add::<u8>(b * i).add::<u8>(b * i / 128).add::<bf16>(b * d);
        Ok(l)
    }

    pub fn new(
        gpu: &Gpu,
        weights: &DeviceWeights,
        shape: &StepShape,
        arena: &mut Arena,
    ) -> Result<FfnHalf> {
        let cfg = &weights.plan.config;
        let map = weights.plan.map;
        let z = ArenaSizes::of(cfg, shape);
        let (b, d, i) = (z.tokens, z.dim, z.inter);
        let sm_count = gpu.info.sm_count as usize;
        ensure!(
            cfg.n_activated_experts == TOPK,
            "the router picks {TOPK} experts, the model {}",
            cfg.n_activated_experts
        );
        ensure!(
            cfg.swiglu_limit == SWIGLU_LIMIT,
            "moe_gemm's L1 finish clamps at {SWIGLU_LIMIT}, the model's swiglu_limit is {}",
            cfg.swiglu_limit
        );
        ensure!(
            map.logical == cfg.n_routed_experts && (1..=map.logical).contains(&map.slots),
            "expert map {map:?} for {} routed experts",
            cfg.n_routed_experts
        );
        for (l, e) in weights.experts.iter().enumerate() {
            ensure!(
                e.l1.experts == map.slots && e.l2.experts == map.slots,
                "layer {l} holds {} / {} expert slots, the map {}",
                e.l1.experts,
                e.l2.experts,
                map.slots
            );
        }
        let layers = (0..cfg.n_layers)
            .map(|l| FfnLayer::new(gpu, weights, l))
            .collect::<Result<Vec<_>>>()?;

        // The step's arena, in `layout`'s order.
        let mhc_ws = MhcWorkspace::carve(arena, b, d)?;
        let f_fp8 = RowsOut::carve(arena, OutFormat::Fp8, b, d)?;
        let f_nvfp4 = RowsOut::carve(arena, OutFormat::Nvfp4, b, d)?;
        let router_ws = RouterWorkspace::carve(arena, &z.router_logits_shape())?;
        let dense_ws = DenseWorkspace::carve(arena, &gpu.stream, &z.shared_shapes(), sm_count)?;
        dense_ws.prepare(gpu)?;
        let h_shared_codes = arena.carve::<u8>(b * i, "shared expert h codes")?;
        let h_shared_scales = arena.carve::<u8>(b * i / 128, "shared expert h scales")?;
        let shared_out = arena.carve::<bf16>(b * d, "shared expert output")?;

        // What depends on the expert map: the grouping's rows and everything sized by them.
        let capacity = slot_capacity(b, &map);
        let rshape = RouterShape {
            tokens: b,
            experts: map.logical,
            dim: d,
            capacity,
            slots: map.slots,
        };
        rshape.check()?;
        let pairs = b * TOPK;
        let sizes = GroupingSizes::of(cfg, b, &map, sm_count);
        debug_assert_eq!(sizes.capacity, capacity);
        let (contiguous, rows) = (sizes.contiguous, sizes.rows);
        let (l1_config, l2_config) = (sizes.l1, sizes.l2);
        let partials = gpu.poisoned::<f32>(sizes.partial_floats(cfg), 0xFF)?;
        let act_rs = if contiguous {
            Some(gpu.poisoned::<bf16>(rows * d.max(i), 0xFF)?)
        } else {
            None
        };
        let moe_ws = |c: &GemmConfig, n: usize| MoeWorkspace {
            splits: c.splits,
            rows_total: rows,
            n,
            partial: DevBuf::of(&partials),
            act_rs: match &act_rs {
                Some(a) => DevBuf::of(a),
                // SAFETY: an empty view, never dereferenced: the masked grouping never takes the prefill mainloop.
                None => unsafe { DevBuf::from_raw(0, 0) },
            },
        };
        let (ws_l1, ws_l2) = (moe_ws(&l1_config, 2 * i), moe_ws(&l2_config, d));
        let contiguous_rows = if contiguous {
            Some(ContiguousRows {
                masked_counts: gpu.poisoned::<i32>(map.slots, 0xFF)?,
                token_rows: gpu.poisoned::<i32>(pairs, 0xFF)?,
                row_weight: gpu.poisoned::<f32>(pairs, 0xFF)?,
            })
        } else {
            None
        };
        let hc = MhcPreOutputs::alloc_poisoned(gpu, OutFormat::Bf16, b, d)?;
        let QuantBufs::Bf16 { y } = &hc.normed.q else {
            bail!("the FFN boundary's normalized rows must be BF16")
        };
        let f = DevBuf::of(y);
        Ok(FfnHalf {
            tokens: b,
            dim: d,
            vocab: cfg.vocab_size,
            eps: cfg.norm_eps,
            route_scale: cfg.route_scale,
            swiglu_limit: cfg.swiglu_limit,
            layers,
            map,
            slot_of: gpu.upload(&map.table())?,
            l1_config,
            l2_config,
            mhc_ws,
            hc,
            f,
            f_fp8,
            f_nvfp4,
            router_ws,
            route: RouterOutputs::alloc(gpu, &rshape, 0xFF)?,
            grouping: DeviceGrouping {
                capacity: if contiguous { 0 } else { capacity },
                experts: map.slots,
                rows_total: rows,
                // counts [slots] (masked) or offsets [slots + 1] (contiguous).
                group: gpu.poisoned::<i32>(map.slots + usize::from(contiguous), 0xFF)?,
            },
            contiguous: contiguous_rows,
            a_codes: gpu.poisoned::<u8>(rows * d / 2, 0xFF)?,
            a_scales: gpu.poisoned::<u8>(rows * d / 16, 0xFF)?,
            a_global: gpu.poisoned::<f32>(rows, 0xFF)?,
            _partials: partials,
            _act_rs: act_rs,
            ws_l1,
            ws_l2,
            h: L1Output::new(gpu, rows, i, false)?,
            moe_out: gpu.poisoned::<bf16>(b * d, 0xFF)?,
            dense_ws,
            h_shared_codes,
            h_shared_scales,
            shared_out,
            shared_gu: if contiguous && cfg.n_shared_experts > 0 {
                Some(gpu.poisoned::<bf16>(2 * b * i, 0xFF)?)
            } else {
                None
            },
        })
    }

    /// Steps 12-16 of layer `layer`: reads `io.x_in` and `io.tokens` (hash layers), writes `io.x_out`.
    pub fn run(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
        io: &LayerIo,
    ) -> Result<()> {
        self.before_routed(gpu, stream, layer, io)?;
        self.routed_experts(gpu, stream, weights, layer)?;
        io.mark(stream, group::FFN_ROUTED)?;
        self.hc_post(gpu, stream, io)?;
        io.mark(stream, group::FFN_HC_POST)
    }

    /// Steps 12, 13 and 15 of layer `layer` (hc_pre + norm, the router, the shared expert), each group marked: what
    /// the single-GPU half and the expert-parallel one run before their routed experts.
    fn before_routed(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        layer: usize,
        io: &LayerIo,
    ) -> Result<()> {
        ensure!(
            layer < self.layers.len(),
            "layer {layer} of {}",
            self.layers.len()
        );
        self.hc_pre_ffn_norm(gpu, stream, layer, io)?;
        io.mark(stream, group::FFN_HC_PRE)?;
        self.route(gpu, stream, layer, io)?;
        io.mark(stream, group::FFN_ROUTER)?;
        self.shared_expert(gpu, stream, layer)?;
        io.mark(stream, group::FFN_SHARED)
    }

    /// Step 12: hc_pre (`hc_ffn_*`) + ffn_norm -> pre / post / comb and `f` BF16; `f` -> FP8 1x128 and NVFP4.
    fn hc_pre_ffn_norm(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        layer: usize,
        io: &LayerIo,
    ) -> Result<()> {
        let w = &self.layers[layer].mhc;
        // One finish kernel writes `f` BF16 and both copies (the bits of quantize_bf16_rows of `f`).
        let copies = mhc::NormCopies {
            fp8: Some(&self.f_fp8),
            nvfp4: Some(&self.f_nvfp4),
        };
        mhc::mhc_pre_copies(
            gpu,
            stream,
            io.x_in,
            w,
            self.eps,
            &self.mhc_ws,
            &mut self.hc,
            copies,
            io.prior_post.as_ref(),
        )
    }

    /// The hc_post this half leaves to the next half's hc_pre when `io.defer_post` (`x_in` is this half's input):
    /// `x_out = post (x) moe_out + comb^T x_in`.
    pub fn pending_post(&self, x_in: &impl DeviceBuf<bf16>) -> PriorPost {
        PriorPost {
            y: DevBuf::of(&self.moe_out),
            x_prev: DevBuf::of(x_in),
            post: DevBuf::of(&self.hc.post),
            comb: DevBuf::of(&self.hc.comb),
        }
    }

    /// Step 13: gate logits of `f`, top-6 (biased) or the token's tid2eid row (hash layers), weights, and the masked
    /// grouping by physical slot (`slot_of` = the expert map's table).
    fn route(&mut self, gpu: &Gpu, stream: &Stream, layer: usize, io: &LayerIo) -> Result<()> {
        let l = &self.layers[layer];
        let selection = match &l.selection {
            LayerSelection::Biased { bias } => Selection::Biased { bias },
            LayerSelection::Hash { tid2eid } => Selection::Hash {
                token_ids: &io.tokens,
                tid2eid,
                vocab: self.vocab,
            },
        };
        let inputs = RouterInputs {
            x: &self.f,
            gate: &l.gate,
            selection,
            route_scale: self.route_scale,
            slot_of: Some(&self.slot_of as &dyn DeviceBuf<i32>),
        };
        let Some(c) = &mut self.contiguous else {
            return router::route_counts_into(
                gpu,
                stream,
                &inputs,
                &self.router_ws,
                &mut self.route,
                &self.grouping.group,
            );
        };
        router::route_counts_into(
            gpu,
            stream,
            &inputs,
            &self.router_ws,
            &mut self.route,
            &c.masked_counts,
        )?;
        contiguous_grouping(gpu, stream, &self.route, c, &self.grouping)
    }

    /// Step 15: the shared expert on the FP8 `f` -> `shared_out` BF16 (`Model::expert(shared, f_q, 1.0)`).
    fn shared_expert(&self, gpu: &Gpu, stream: &Stream, layer: usize) -> Result<()> {
        let Some([w1, w2, w3]) = &self.layers[layer].shared else {
            return Ok(());
        };
        let QuantView::Fp8 { data, scales } = self.f_fp8.q else {
            bail!("the shared expert's input must be FP8 rows")
        };
        let x = Fp8Rows {
            codes: &data,
            scales: &scales,
            rows: self.tokens,
            k: self.dim,
        };
        if let Some(gu) = &self.shared_gu {
            if w1.scales_f32.is_some() && w3.scales_f32.is_some() {
                // A prefill chunk: w1 and w3 on the tensor cores (one fp8_linears launch, BF16 g and u), the SwiGLU and
                // h's FP8 1x128 quantization as the fused GEMV's epilogue does them, w2 on the tensor cores.
                let (b, i) = (self.tokens, w1.n);
                let (g, u) = (
                    DevBuf::of(gu).sub(0, b * i),
                    DevBuf::of(gu).sub(b * i, b * i),
                );
                let (w1w, w3w) = (w1.weight(), w3.weight());
                let jobs = [Fp8Job { w: &w1w, y: &g }, Fp8Job { w: &w3w, y: &u }];
                dense::fp8_linears(gpu, stream, &x, &jobs, &self.dense_ws)?;
                swiglu_fp8_rows(
                    gpu,
                    stream,
                    &g,
                    &u,
                    b,
                    i,
                    self.swiglu_limit,
                    &self.h_shared_codes,
                    &self.h_shared_scales,
                )?;
                let h = Fp8Rows {
                    codes: &self.h_shared_codes,
                    scales: &self.h_shared_scales,
                    rows: b,
                    k: i,
                };
                return dense::fp8_linear(
                    gpu,
                    stream,
                    &h,
                    &w2.weight(),
                    &self.dense_ws,
                    &self.shared_out,
                );
            }
        }
        let scratch = SharedExpertScratch {
            h_codes: &self.h_shared_codes,
            h_scales: &self.h_shared_scales,
        };
        dense::shared_expert(
            gpu,
            stream,
            &x,
            &w1.weight(),
            &w3.weight(),
            &w2.weight(),
            self.swiglu_limit,
            &self.dense_ws,
            &scratch,
            &self.shared_out,
        )
    }

    /// Step 14 up to its finish: f's NVFP4 token rows gathered into the grouping's rows, L1 (gate + up, SwiGLU with
    /// the clamp, the routing weight, NVFP4 h) and the L2 (down) mainloop into `ws_l2`'s partial sums.
    fn routed_mainloops(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
    ) -> Result<()> {
        let experts = &weights.experts[layer];
        let (b, d, rows) = (self.tokens, self.dim, self.grouping.rows_total);
        let QuantView::Nvfp4 {
            data,
            scales,
            global_scale,
        } = self.f_nvfp4.q
        else {
            bail!("the routed experts' input must be NVFP4 rows")
        };
        let (token_rows, row_weight) = pair_tables(&self.contiguous, &self.route);
        router::gather_nvfp4_rows(
            gpu,
            stream,
            &Nvfp4RowBufs {
                rows: b,
                dim: d,
                codes: &data,
                scales: &scales,
                global: &global_scale,
            },
            token_rows,
            &Nvfp4RowBufs {
                rows,
                dim: d,
                codes: &self.a_codes,
                scales: &self.a_scales,
                global: &self.a_global,
            },
        )?;
        let a = DeviceActivations::Nvfp4 {
            rows,
            k: d,
            codes: &self.a_codes,
            scales: &self.a_scales,
            global: &self.a_global,
        };
        let grp = &self.grouping;
        moe_gemm::launch_partial(
            gpu,
            stream,
            &experts.l1,
            &a,
            grp,
            &self.l1_config,
            &self.ws_l1,
        )?;
        moe_gemm::launch_finish_l1(
            gpu,
            stream,
            &self.ws_l1,
            grp,
            &experts.l1,
            &a,
            row_weight,
            &mut self.h,
        )?;
        let h = self.h.as_activations();
        moe_gemm::launch_partial(
            gpu,
            stream,
            &experts.l2,
            &h,
            grp,
            &self.l2_config,
            &self.ws_l2,
        )?;
        Ok(())
    }

    /// Step 14: [`FfnHalf::routed_mainloops`], then the combine over each token's rows in routing order plus the
    /// shared expert's output (when the model has one), rounded once to BF16 -> `moe_out`.
    fn routed_experts(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
    ) -> Result<()> {
        self.routed_mainloops(gpu, stream, weights, layer)?;
        let h = self.h.as_activations();
        let (token_rows, _) = pair_tables(&self.contiguous, &self.route);
        let addend = self
            .has_shared_expert(layer)
            .then_some(&self.shared_out as &dyn DeviceBuf<bf16>);
        moe_gemm::launch_finish_l2(
            gpu,
            stream,
            &self.ws_l2,
            &self.grouping,
            &weights.experts[layer].l2,
            &h,
            token_rows,
            TOPK,
            addend,
            &mut self.moe_out,
        )
    }

    /// Step 16: `x_out = post (x) moe_out + comb^T x_in`.
    fn hc_post(&self, gpu: &Gpu, stream: &Stream, io: &LayerIo) -> Result<()> {
        if io.defer_post {
            return Ok(());
        }
        mhc::mhc_post(
            gpu,
            stream,
            &self.moe_out,
            io.x_in,
            &self.hc.post,
            &self.hc.comb,
            self.tokens,
            self.dim,
            io.x_out,
        )
    }

    /// Fills every output and intermediate of the half with 0xFF (NaN in f32 / BF16 / e4m3, -1 in i32) on the GPU's
    /// stream, so that a test sees any element a run failed to write. The shared expert's dense workspace is left
    /// alone (its tile counters must stay zero between calls).
    pub fn poison(&mut self, gpu: &Gpu) -> Result<()> {
        self.hc.poison(gpu)?;
        let s = &gpu.stream;
        for v in [&self.f_fp8, &self.f_nvfp4] {
            poison_rows(s, v)?;
        }
        arena::fill(s, &self.router_ws.logits, 0xFF)?;
        let r = &mut self.route;
        gpu.fill_bytes(&mut r.topk_experts, 0xFF)?;
        gpu.fill_bytes(&mut r.topk_weights, 0xFF)?;
        gpu.fill_bytes(&mut r.token_rows, 0xFF)?;
        gpu.fill_bytes(&mut r.row_token, 0xFF)?;
        gpu.fill_bytes(&mut r.row_weight, 0xFF)?;
        gpu.fill_bytes(&mut r.dropped, 0xFF)?;
        gpu.fill_bytes(&mut self.grouping.group, 0xFF)?;
        if let Some(c) = &mut self.contiguous {
            gpu.fill_bytes(&mut c.masked_counts, 0xFF)?;
            gpu.fill_bytes(&mut c.token_rows, 0xFF)?;
            gpu.fill_bytes(&mut c.row_weight, 0xFF)?;
        }
        gpu.fill_bytes(&mut self.a_codes, 0xFF)?;
        gpu.fill_bytes(&mut self.a_scales, 0xFF)?;
        gpu.fill_bytes(&mut self.a_global, 0xFF)?;
        arena::fill(s, &self.ws_l1.partial, 0xFF)?;
        gpu.fill_bytes(&mut self.h.codes, 0xFF)?;
        gpu.fill_bytes(&mut self.h.scales, 0xFF)?;
        gpu.fill_bytes(&mut self.h.global, 0xFF)?;
        gpu.fill_bytes(&mut self.moe_out, 0xFF)?;
        if let Some(gu) = &mut self.shared_gu {
            gpu.fill_bytes(gu, 0xFF)?;
        }
        arena::fill(s, &self.h_shared_codes, 0xFF)?;
        arena::fill(s, &self.h_shared_scales, 0xFF)?;
        arena::fill(s, &self.shared_out, 0xFF)
    }
}

/// Kernel family of the FFN half's glue (kernels/engine_ffn.cu).
pub const FAMILY: &str = "engine_ffn";

/// `ffn_contiguous_grouping` (kernels/engine_ffn.cu; host twin [`contiguous_grouping_host`]): the router's masked
/// grouping in `route` (counts in `c.masked_counts`) -> the contiguous grouping: offsets `[slots + 1]` into
/// `grp.group`, the pairs' rows into `c.token_rows`, the rows' weights into `c.row_weight`. One CTA of 1024 threads
/// (graph-safe: the grid is fixed, every count is read on the device).
pub fn contiguous_grouping(
    gpu: &Gpu,
    stream: &Stream,
    route: &RouterOutputs,
    c: &ContiguousRows,
    grp: &DeviceGrouping,
) -> Result<()> {
    let s = route.shape;
    let pairs = s.tokens * TOPK;
    ensure!(
        grp.capacity == 0 && grp.experts == s.slots && grp.rows_total == pairs,
        "contiguous grouping: a grouping of {} slots x capacity {} over {} rows for {} slots and {pairs} pairs",
        grp.experts,
        grp.capacity,
        grp.rows_total,
        s.slots
    );
    ensure!(
        (1..=router::MAX_EXPERTS).contains(&s.slots) && s.capacity >= 1,
        "contiguous grouping: {} slots (1..={}), capacity {}",
        s.slots,
        router::MAX_EXPERTS,
        s.capacity
    );
    ensure!(
        c.masked_counts.len() >= s.slots
            && route.token_rows.len() == pairs
            && route.row_weight.len() >= s.rows_total()
            && grp.group.len() > s.slots
            && c.token_rows.len() == pairs
            && c.row_weight.len() >= pairs
            && pairs <= i32::MAX as usize,
        "contiguous grouping: buffers do not match {} tokens x {TOPK} picks on {} slots",
        s.tokens,
        s.slots
    );
    let k = gpu.kernel(FAMILY, "ffn_contiguous_grouping")?;
    let mut a = KernelArgs::new();
    a.buf(&c.masked_counts)
        .i32(s.slots as i32)
        .i32(s.capacity as i32)
        .buf(&route.token_rows)
        .buf(&route.row_weight)
        .i32(pairs as i32)
        .buf(&grp.group)
        .buf(&c.token_rows)
        .buf(&c.row_weight);
    // SAFETY: arguments in the kernel's order; counts hold `slots` values, the masked tables `pairs` and `slots x
    // capacity`, the outputs `slots + 1` and `pairs` (checked above); the kernel bounds every row it writes by `pairs`.
    unsafe { launch(stream, &k, Launch::new((1, 1, 1), (1024, 1, 1)), &mut a) }
}

/// `ffn_swiglu_fp8_rows` (kernels/engine_ffn.cu): `h = bf16(silu(min(g, L)) * clamp(u, -L, L))` (no clamp when L
/// <= 0) from BF16 g and u `[rows, inter]`, written as FP8 1x128 rows (codes `[rows, inter]`, ue8m0 scales `[rows,
/// inter / 128]`): the fused GEMV's epilogue (`dense::swiglu_fp8`) on the same g and u. One warp per 128-block.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_fp8_rows(
    gpu: &Gpu,
    stream: &Stream,
    g: &DevBuf<bf16>,
    u: &DevBuf<bf16>,
    rows: usize,
    inter: usize,
    limit: f32,
    codes: &DevBuf<u8>,
    scales: &DevBuf<u8>,
) -> Result<()> {
    ensure!(
        inter.is_multiple_of(128) && rows >= 1 && rows * inter <= i32::MAX as usize,
        "swiglu rows: {rows} x {inter} (I a multiple of 128)"
    );
    ensure!(limit.is_finite(), "swiglu rows: limit {limit}");
    ensure!(
        g.len() >= rows * inter
            && u.len() >= rows * inter
            && codes.len() >= rows * inter
            && scales.len() >= rows * inter / 128,
        "swiglu rows: buffers shorter than {rows} x {inter}"
    );
    let warps = rows * inter / 128;
    let k = gpu.kernel(FAMILY, "ffn_swiglu_fp8_rows")?;
    let mut a = KernelArgs::new();
    a.buf(g)
        .buf(u)
        .i32(rows as i32)
        .i32(inter as i32)
        .f32(limit)
        .buf(codes)
        .buf(scales);
    // SAFETY: arguments in the kernel's order; every buffer holds rows x inter (scales rows x inter / 128) elements
    // and the kernel's warps past rows x inter / 128 return.
    unsafe {
        launch(
            stream,
            &k,
            Launch::new((warps.div_ceil(8) as u32, 1, 1), (256, 1, 1)),
            &mut a,
        )
    }
}

/// Expert parallelism (docs/multi-gpu.md; `dist` drives these, the single-GPU [`FfnHalf::run`] does not use them):
/// the FFN half split at the combine, so that a rank's routed sum can be exchanged between steps 14 and 16.
/// [`FfnHalf::run_to_partial`] runs steps 12, 13, 15 and 14 with an L2 finish that writes this rank's routed sum in
/// f32 (`moe_gemm::finish::launch_finish_l2_partial`: no addend, no rounding); the caller gathers every rank's partial and combines
/// them with [`FfnHalf::shared_out`] into [`FfnHalf::moe_out`] (`ops::ep::combine`), then runs
/// [`FfnHalf::run_post`] (step 16).
impl FfnHalf {
    /// Replaces the router's logical expert -> slot table (i32 `[logical]`), which the half otherwise takes from its
    /// expert map ([`ExpertMap::table`]): an entry outside `0..slots` (-1) gives that expert's pairs no row (another
    /// rank computes them). For tests that emulate a world of ranks on one GPU holding every expert; set-up only (a
    /// host upload), not inside a step.
    pub fn set_slot_table(&mut self, gpu: &Gpu, table: &[i32]) -> Result<()> {
        ensure!(
            table.len() == self.map.logical,
            "slot table of {} entries for {} logical experts",
            table.len(),
            self.map.logical
        );
        let slots = self.map.slots as i32;
        if let Some((e, &s)) = table.iter().enumerate().find(|(_, &s)| s >= slots) {
            bail!("slot table: expert {e} -> slot {s}, the half has {slots} slots");
        }
        self.slot_of = gpu.upload(table)?;
        Ok(())
    }

    /// Whether layer `layer` has a shared expert (then [`FfnHalf::shared_out`] is the combine's addend).
    pub fn has_shared_expert(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(|l| l.shared.is_some())
    }

    /// Steps 12, 13, 15 and 14 of layer `layer` as in [`FfnHalf::run`], except that the routed experts' L2 finish
    /// writes `partial` (f32 `[B, D]`): the sum, in routing order and unrounded, of the weighted outputs of the pairs
    /// whose expert the slot table maps to a slot (`+0.0` for a token with none). `shared_out` holds the shared
    /// expert's output. `moe_out` and `io.x_out` are not written.
    pub fn run_to_partial(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
        io: &LayerIo,
        partial: &dyn DeviceBuf<f32>,
    ) -> Result<()> {
        ensure!(
            partial.elems() >= self.tokens * self.dim,
            "routed partial of {} values for [{}, {}]",
            partial.elems(),
            self.tokens,
            self.dim
        );
        self.before_routed(gpu, stream, layer, io)?;
        self.routed_experts_partial(gpu, stream, weights, layer, partial)?;
        io.mark(stream, group::FFN_ROUTED)
    }

    /// Step 16 after the combine wrote `moe_out`: `x_out = post (x) moe_out + comb^T x_in`.
    pub fn run_post(&self, gpu: &Gpu, stream: &Stream, io: &LayerIo) -> Result<()> {
        self.hc_post(gpu, stream, io)?;
        io.mark(stream, group::FFN_HC_POST)
    }

    /// Step 14 of [`FfnHalf::run_to_partial`]: [`FfnHalf::routed_mainloops`], then the f32 finish into `partial`.
    fn routed_experts_partial(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
        partial: &dyn DeviceBuf<f32>,
    ) -> Result<()> {
        self.routed_mainloops(gpu, stream, weights, layer)?;
        let h = self.h.as_activations();
        let (token_rows, _) = pair_tables(&self.contiguous, &self.route);
        crate::ops::moe_gemm::finish::launch_finish_l2_partial(
            gpu,
            stream,
            &self.ws_l2,
            &self.grouping,
            &weights.experts[layer].l2,
            &h,
            token_rows,
            TOPK,
            partial,
        )
    }
}

/// The pair tables of step 14: the contiguous grouping's (a prefill chunk above 64 rows) or the router's masked
/// one: (each pair's row, each row's routing weight). A free function over the two fields, so the caller may borrow
/// other fields of the half mutably beside them.
fn pair_tables<'a>(
    contiguous: &'a Option<ContiguousRows>,
    route: &'a RouterOutputs,
) -> (&'a CudaSlice<i32>, &'a CudaSlice<f32>) {
    match contiguous {
        Some(c) => (&c.token_rows, &c.row_weight),
        None => (&route.token_rows, &route.row_weight),
    }
}

fn poison_rows(s: &Stream, v: &RowsOut) -> Result<()> {
    match v.q {
        QuantView::Nvfp4 {
            data,
            scales,
            global_scale,
        } => {
            arena::fill(s, &data, 0xFF)?;
            arena::fill(s, &scales, 0xFF)?;
            arena::fill(s, &global_scale, 0xFF)?;
        }
        QuantView::Fp8 { data, scales } => {
            arena::fill(s, &data, 0xFF)?;
            arena::fill(s, &scales, 0xFF)?;
        }
        QuantView::Bf16 { y } => arena::fill(s, &y, 0xFF)?,
    }
    arena::fill(s, &v.rstd, 0xFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_capacity_covers_every_pick_of_a_slot() {
        let id = ExpertMap::all(16, 16);
        assert_eq!(slot_capacity(8, &id), 8);
        // 16 on 11: slots 0..=4 hold experts s and s + 11, so a token may put two rows on one slot.
        let wrap = ExpertMap::all(16, 11);
        assert_eq!(slot_capacity(8, &wrap), 16);
        // Flash on an H200: 256 on 226 slots.
        let flash = ExpertMap::all(256, 226);
        assert_eq!(slot_capacity(64, &flash), 128);
        // Never more than the 6 picks of a token.
        let few = ExpertMap::all(256, 6);
        assert_eq!(slot_capacity(3, &few), 18);
        // Exhaustively on a small map: the most picks of one token on one slot never pass the capacity of 1 token.
        for slots in 1..=16 {
            let m = ExpertMap::all(16, slots);
            let per_slot = (0..slots)
                .map(|s| {
                    (0..16)
                        .filter(|&e| m.physical(e) == Some(s))
                        .count()
                        .min(TOPK)
                })
                .max()
                .unwrap();
            assert_eq!(slot_capacity(1, &m), per_slot, "{slots} slots");
        }
    }

    /// The host twin of `ffn_contiguous_grouping` on router-like masked groupings (pairs in order, each slot's rows
    /// in pair order, -1 for a pair with no row): the contiguous grouping is the stable sort of the pairs by slot,
    /// i.e. slot s's rows are `offsets[s]..offsets[s + 1]` in pair order, every owned row is one pair's, weights
    /// follow their rows and the rows no slot owns weigh 0.
    #[test]
    fn contiguous_grouping_is_the_stable_sort_by_slot() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for (tokens, logical, slots) in [
            (1, 16, 16),
            (7, 16, 11),
            (300, 16, 16),
            (512, 256, 226),
            (65, 6, 6),
        ] {
            let map = ExpertMap::all(logical, slots);
            let cap = slot_capacity(tokens, &map);
            let pairs = tokens * TOPK;
            let mut counts = vec![0i32; slots];
            let mut masked_rows = vec![-1i32; pairs];
            let mut masked_weight = vec![f32::NAN; slots * cap];
            let mut pair_slot = vec![usize::MAX; pairs];
            for t in 0..tokens {
                // 6 distinct logical experts; a hash layer's repeat (every 5th token) leaves its pair without a row.
                let mut picks: Vec<usize> = Vec::new();
                while picks.len() < TOPK {
                    let e = (next() % logical as u64) as usize;
                    if !picks.contains(&e) {
                        picks.push(e);
                    }
                }
                for (j, &e) in picks.iter().enumerate() {
                    let i = t * TOPK + j;
                    if t % 5 == 4 && j == 5 {
                        continue;
                    }
                    let s = map.physical(e).expect("one GPU owns every expert");
                    let rank = counts[s] as usize;
                    assert!(rank < cap, "slot_capacity holds every pick");
                    counts[s] += 1;
                    masked_rows[i] = (s * cap + rank) as i32;
                    masked_weight[s * cap + rank] = i as f32 + 0.5;
                    pair_slot[i] = s;
                }
            }
            let (offsets, rows, weight) =
                contiguous_grouping_host(&counts, cap, &masked_rows, &masked_weight);
            assert_eq!(offsets.len(), slots + 1);
            assert_eq!(offsets[0], 0);
            for s in 0..slots {
                assert_eq!(offsets[s + 1] - offsets[s], counts[s]);
            }
            let owned = offsets[slots] as usize;
            assert!(owned <= pairs);
            // The stable sort of the owned pairs by slot.
            let mut want: Vec<usize> = (0..pairs).filter(|&i| masked_rows[i] >= 0).collect();
            want.sort_by_key(|&i| pair_slot[i]);
            assert_eq!(want.len(), owned);
            let mut seen = vec![false; owned];
            for (row, &i) in want.iter().enumerate() {
                assert_eq!(
                    rows[i] as usize, row,
                    "{tokens} tokens on {slots} slots: pair {i}"
                );
                assert!(!seen[row]);
                seen[row] = true;
                assert_eq!(weight[row], i as f32 + 0.5);
            }
            for i in 0..pairs {
                if masked_rows[i] < 0 {
                    assert_eq!(rows[i], -1);
                }
            }
            assert!(weight[owned..].iter().all(|&w| w == 0.0));
        }
        // A count above the capacity is clamped; a row past its slot's count gets none.
        let (off, rows, _) = contiguous_grouping_host(&[5, 1], 2, &[0, 1, 2, 3], &[1.0; 4]);
        assert_eq!(off, vec![0, 2, 3]);
        assert_eq!(rows, vec![0, 1, 2, -1]);
        assert!(uses_contiguous_grouping(65) && !uses_contiguous_grouping(64));
    }

    #[test]
    fn tid2eid_converts_rows_and_refuses_out_of_range_entries() {
        let rows: Vec<i64> = vec![0, 1, 2, 3, 4, 5, 15, 14, 13, 12, 11, 10];
        let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(
            tid2eid_i32(&bytes, 16).unwrap(),
            rows.iter().map(|&v| v as i32).collect::<Vec<_>>()
        );
        let err = format!("{:#}", tid2eid_i32(&bytes, 15).unwrap_err());
        assert!(err.contains("tid2eid[1][0] = 15"), "{err}");
        let neg: Vec<u8> = [0i64, 1, 2, 3, -1, 5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert!(tid2eid_i32(&neg, 16).is_err());
        assert!(tid2eid_i32(&bytes[..40], 16).is_err());
    }
}
