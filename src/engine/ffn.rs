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
//!   the moe_gemm grouping's buffer), per-row token and weight, the `[B, 6]` row table.
//! * 15 `shared_expert`: `dense::shared_expert` (FP8 w1 / w3 + SwiGLU + FP8 h, then w2) -> BF16 `[B, D]`. Runs before
//!   14 because its output is 14's combine addend.
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
//! Idle slots (position < 0): the FFN half reads no position and no cache, so an idle slot's row is computed like
//! any other (its residual row in, its residual row out) and takes rows of the grouping; it changes no other row.

use anyhow::{bail, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::engine::io::{group, LayerIo, StepShape};
use crate::engine::plan::ExpertMap;
use crate::engine::weights::DeviceWeights;
use crate::gpu::arena::{self, Arena, WorkspaceLayout};
use crate::gpu::{DevBuf, DeviceBuf, Gpu, Stream};
use crate::model::weights::StoredDtype;
use crate::model::ModelConfig;
use crate::ops::compressor::dev;
use crate::ops::dense::{
    self, DenseKind, DenseShape, DenseWorkspace, Fp8Rows, Fp8Weight, SharedExpertScratch,
};
use crate::ops::mhc::{self, MhcPreOutputs, MhcWeights, MhcWorkspace};
use crate::ops::moe_gemm::reference::SWIGLU_LIMIT;
use crate::ops::moe_gemm::{
    self, DeviceActivations, DeviceGrouping, GemmConfig, L1Output, Workspace as MoeWorkspace,
};
use crate::ops::norm_quant::{OutFormat, QuantBufs, QuantView, RowsOut};
use crate::ops::router::{
    self, Nvfp4RowBufs, RouterInputs, RouterOutputs, RouterShape, RouterWorkspace, Selection, TOPK,
};

/// Rows per physical slot of the masked grouping for `tokens` tokens: a token's picks are distinct logical experts
/// (the biased top-6, or a tid2eid row, whose repeats the router drops) and at most `ceil(logical / slots)` logical
/// experts share a slot (`e mod slots`), so a slot gets at most `min(6, ceil(logical / slots))` rows per token and
/// no pair is ever dropped. The identity map gives `tokens`.
pub fn slot_capacity(tokens: usize, map: &ExpertMap) -> usize {
    tokens * TOPK.min(map.logical.div_ceil(map.slots.max(1)))
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
    /// The shared expert's two dense launches (w1/w3 + SwiGLU, then w2).
    fn shared_shapes(&self) -> [DenseShape; 2] {
        let (b, d, i) = (self.tokens, self.dim, self.inter);
        [
            DenseShape {
                kind: DenseKind::Swiglu,
                rows: b,
                n: i,
                k: d,
                jobs: 1,
            },
            DenseShape {
                kind: DenseKind::Fp8,
                rows: b,
                n: d,
                k: i,
                jobs: 1,
            },
        ]
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

    // Step 14.
    /// f's NVFP4 rows gathered into the grouping's rows `[slots x capacity, D]` (only owned rows are written).
    pub a_codes: CudaSlice<u8>,
    pub a_scales: CudaSlice<u8>,
    pub a_global: CudaSlice<f32>,
    /// fp32 partials of L1, then of L2 (one buffer: L2's mainloop runs after L1's finish has read it).
    _partials: CudaSlice<f32>,
    ws_l1: MoeWorkspace,
    ws_l2: MoeWorkspace,
    /// h: L1's output, NVFP4 `[slots x capacity, I]` (L2's input).
    pub h: L1Output,
    /// The MoE output BF16 `[B, D]`: routed experts + shared expert, rounded once.
    pub moe_out: CudaSlice<bf16>,

    // Step 15.
    dense_ws: DenseWorkspace,
    h_shared_codes: DevBuf<u8>,
    h_shared_scales: DevBuf<u8>,
    /// The shared expert's output BF16 `[B, D]` (the L2 combine's addend).
    pub shared_out: DevBuf<bf16>,
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
        let rows = rshape.rows_total();
        let pairs = b * TOPK;
        let active = map.slots.min(pairs);
        let per_active = pairs as f64 / active as f64;
        let l1_config = GemmConfig::choose(sm_count, per_active, active, 2 * i, d);
        let l2_config = GemmConfig::choose(sm_count, per_active, active, d, i);
        let partials = gpu.poisoned::<f32>(
            (l1_config.splits * rows * 2 * i).max(l2_config.splits * rows * d),
            0xFF,
        )?;
        let moe_ws = |c: &GemmConfig, n: usize| MoeWorkspace {
            splits: c.splits,
            rows_total: rows,
            n,
            partial: dev(&partials),
            // SAFETY: an empty view, never dereferenced: the masked grouping never takes the prefill mainloop.
            act_rs: unsafe { DevBuf::from_raw(0, 0) },
        };
        let (ws_l1, ws_l2) = (moe_ws(&l1_config, 2 * i), moe_ws(&l2_config, d));
        let hc = MhcPreOutputs::alloc_poisoned(gpu, OutFormat::Bf16, b, d)?;
        let QuantBufs::Bf16 { y } = &hc.normed.q else {
            bail!("the FFN boundary's normalized rows must be BF16")
        };
        let f = dev(y);
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
                capacity,
                experts: map.slots,
                rows_total: rows,
                group: gpu.poisoned::<i32>(map.slots, 0xFF)?,
            },
            a_codes: gpu.poisoned::<u8>(rows * d / 2, 0xFF)?,
            a_scales: gpu.poisoned::<u8>(rows * d / 16, 0xFF)?,
            a_global: gpu.poisoned::<f32>(rows, 0xFF)?,
            _partials: partials,
            ws_l1,
            ws_l2,
            h: L1Output::new(gpu, rows, i, false)?,
            moe_out: gpu.poisoned::<bf16>(b * d, 0xFF)?,
            dense_ws,
            h_shared_codes,
            h_shared_scales,
            shared_out,
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
        io.mark(stream, group::FFN_SHARED)?;
        self.routed_experts(gpu, stream, weights, layer)?;
        io.mark(stream, group::FFN_ROUTED)?;
        self.hc_post(gpu, stream, io)?;
        io.mark(stream, group::FFN_HC_POST)
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
        )
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
        router::route_counts_into(
            gpu,
            stream,
            &inputs,
            &self.router_ws,
            &mut self.route,
            &self.grouping.group,
        )
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

    /// Step 14: f's NVFP4 token rows gathered into the grouping's rows, L1 (gate + up, SwiGLU with the clamp, the
    /// routing weight, NVFP4 h), L2 (down) and the combine over each token's rows in routing order plus the shared
    /// expert's output (when the model has one), rounded once to BF16 -> `moe_out`.
    fn routed_experts(
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
            &self.route.token_rows,
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
            &self.route.row_weight,
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
        let addend = self.layers[layer]
            .shared
            .as_ref()
            .map(|_| &self.shared_out as &dyn DeviceBuf<bf16>);
        moe_gemm::launch_finish_l2(
            gpu,
            stream,
            &self.ws_l2,
            grp,
            &experts.l2,
            &h,
            &self.route.token_rows,
            TOPK,
            addend,
            &mut self.moe_out,
        )
    }

    /// Step 16: `x_out = post (x) moe_out + comb^T x_in`.
    fn hc_post(&self, gpu: &Gpu, stream: &Stream, io: &LayerIo) -> Result<()> {
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
        gpu.fill_bytes(&mut self.a_codes, 0xFF)?;
        gpu.fill_bytes(&mut self.a_scales, 0xFF)?;
        gpu.fill_bytes(&mut self.a_global, 0xFF)?;
        arena::fill(s, &self.ws_l1.partial, 0xFF)?;
        gpu.fill_bytes(&mut self.h.codes, 0xFF)?;
        gpu.fill_bytes(&mut self.h.scales, 0xFF)?;
        gpu.fill_bytes(&mut self.h.global, 0xFF)?;
        gpu.fill_bytes(&mut self.moe_out, 0xFF)?;
        arena::fill(s, &self.h_shared_codes, 0xFF)?;
        arena::fill(s, &self.h_shared_scales, 0xFF)?;
        arena::fill(s, &self.shared_out, 0xFF)
    }
}

/// Expert parallelism (docs/multi-gpu.md; `dist` drives these, the single-GPU [`FfnHalf::run`] does not use them):
/// the FFN half split at the combine, so that a rank's routed sum can be exchanged between steps 14 and 16.
/// [`FfnHalf::run_to_partial`] runs steps 12, 13, 15 and 14 with an L2 finish that writes this rank's routed sum in
/// f32 (`ops::ep::finish_l2_partial`: no addend, no rounding); the caller gathers every rank's partial and combines
/// them with [`FfnHalf::shared_out`] into [`FfnHalf::moe_out`] (`ops::ep::combine`), then runs
/// [`FfnHalf::run_post`] (step 16).
impl FfnHalf {
    /// Replaces the router's logical expert -> slot table (i32 `[logical]`; `ExpertPartition::slot_table` of the
    /// rank): an entry outside `0..slots` (-1) gives that expert's pairs no row (another rank computes them). Set-up
    /// only (a host upload), not inside a step.
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
            layer < self.layers.len(),
            "layer {layer} of {}",
            self.layers.len()
        );
        ensure!(
            partial.elems() >= self.tokens * self.dim,
            "routed partial of {} values for [{}, {}]",
            partial.elems(),
            self.tokens,
            self.dim
        );
        self.hc_pre_ffn_norm(gpu, stream, layer, io)?;
        io.mark(stream, group::FFN_HC_PRE)?;
        self.route(gpu, stream, layer, io)?;
        io.mark(stream, group::FFN_ROUTER)?;
        self.shared_expert(gpu, stream, layer)?;
        io.mark(stream, group::FFN_SHARED)?;
        self.routed_experts_partial(gpu, stream, weights, layer, partial)?;
        io.mark(stream, group::FFN_ROUTED)
    }

    /// Step 16 after the combine wrote `moe_out`: `x_out = post (x) moe_out + comb^T x_in`.
    pub fn run_post(&self, gpu: &Gpu, stream: &Stream, io: &LayerIo) -> Result<()> {
        self.hc_post(gpu, stream, io)?;
        io.mark(stream, group::FFN_HC_POST)
    }

    /// Step 14 of [`FfnHalf::run_to_partial`]: [`FfnHalf::routed_experts`]' gather, L1 and L2 mainloop, then the f32
    /// finish into `partial`.
    fn routed_experts_partial(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
        partial: &dyn DeviceBuf<f32>,
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
            &self.route.token_rows,
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
            &self.route.row_weight,
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
        crate::ops::ep::finish_l2_partial(
            gpu,
            stream,
            &self.ws_l2,
            grp,
            &experts.l2,
            &h,
            &self.route.token_rows,
            TOPK,
            partial,
        )
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
        let id = ExpertMap {
            logical: 16,
            slots: 16,
        };
        assert_eq!(slot_capacity(8, &id), 8);
        // 16 on 11: slots 0..=4 hold experts s and s + 11, so a token may put two rows on one slot.
        let wrap = ExpertMap {
            logical: 16,
            slots: 11,
        };
        assert_eq!(slot_capacity(8, &wrap), 16);
        // Flash on an H200: 256 on 226 slots.
        let flash = ExpertMap {
            logical: 256,
            slots: 226,
        };
        assert_eq!(slot_capacity(64, &flash), 128);
        // Never more than the 6 picks of a token.
        let few = ExpertMap {
            logical: 256,
            slots: 6,
        };
        assert_eq!(slot_capacity(3, &few), 18);
        // Exhaustively on a small map: the most picks of one token on one slot never pass the capacity of 1 token.
        for slots in 1..=16 {
            let m = ExpertMap { logical: 16, slots };
            let per_slot = (0..slots)
                .map(|s| (0..16).filter(|&e| m.physical(e) == s).count().min(TOPK))
                .max()
                .unwrap();
            assert_eq!(slot_capacity(1, &m), per_slot, "{slots} slots");
        }
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
