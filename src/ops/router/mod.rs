//! The MoE router of DeepSeek-V4 decode on the GPU (kernels/router.cu): gate logits, `sqrt(softplus)` scores,
//! top-6 selection (biased score, or the token's tid2eid row in the hash layers), renormalized route-scaled
//! weights, and the masked grouping that `moe_gemm`'s decode launchers read, all on the device.
//!
//! Contract, for T tokens of hidden size D and E experts:
//! * `logits[t, e] = sum_i gate[e, i] * x[t, i]` (BF16 inputs, f32 sums; the tree is stated in kernels/router.cu),
//!   `s = sqrt(softplus(logit))`.
//! * Selection per token: hash layers take `tid2eid[token_id]` in table order; the others take the top-[`TOPK`]
//!   of `s_e + bias_e`, descending, the lower expert index first on equal values (the CPU model's
//!   `top_k_lower_index_wins`). `weights[j] = s_{e_j} / (s_{e_0} + ... + s_{e_5}) * route_scale` (the sum in
//!   selection order). The CPU oracle is `model::reference::route_from_logits` ([`reference`]).
//! * Grouping (masked layout of [`moe_gemm`](crate::ops::moe_gemm)) by physical slot: logical expert e (the
//!   selection above, reported in `topk_experts`) goes to slot `slot_of[e]`, the identity when no map is given
//!   (then `slots == E`). `counts[s]` rows of slot s, its rows `s * capacity + r` in pair order (token t, then
//!   selection position j); `row_token[row]` / `row_weight[row]` (token -1 and weight 0 for an empty row;
//!   `row_weight` is the L1 finish's `routing`), `token_rows[t, j]` (the L2 combine's table) the row of pair
//!   (t, j). Two picks of one token on one slot are two rows of that slot (moe_gemm computes both). A pair whose
//!   rank in its slot reaches `capacity` gets no row (`token_rows` -1, not in `counts`) and is counted in
//!   `dropped`; so is a pair whose `slot_of` value lies outside `0..slots` (the table's values are read on the
//!   device and trusted otherwise). Without a map, a capacity of at least T never drops a biased-selection pair
//!   (with one, `6 T` never does).
//!
//! * For the engine's FFN half: [`route_counts_into`] writes the counts into the moe_gemm grouping's own buffer,
//!   and [`gather_nvfp4_rows`] copies each token's NVFP4 activation row to the grouped rows of its picks (the A
//!   operand of moe_gemm's decode mainloop).
//!
//! Graph-safe: both grids come from T and E (the select kernel's shared memory from T and slots), every output
//! element is written on every call, nothing on the host reads a result, and the one scratch buffer (the logits)
//! is carved by the caller from an [`Arena`](crate::gpu::arena::Arena).
//!
//! Rooms: `reference.rs` (glue to the CPU model), `bench.rs` (measurement hooks).

pub mod bench;
pub mod reference;

use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::gpu::arena::{Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;

/// Kernel family name (kernels/router.cu).
pub const FAMILY: &str = "router";
/// Experts chosen per token (`kTopk`; DSV4 `num_experts_per_tok`).
pub const TOPK: usize = 6;
/// Most experts (`kMaxExperts`: 16 per lane of the selecting warp).
pub const MAX_EXPERTS: usize = 512;
/// Most tokens per call: the select kernel's token masks (E x T / 32 words) stay within 128 KB of shared memory.
pub const MAX_TOKENS: usize = 2048;
/// D must be a multiple of it (`kChunk`: a warp's pass, 32 lanes x 8 BF16).
pub const DIM_MULTIPLE: usize = 256;
/// Tokens per CTA of the logits kernel (`kLogitTokens`).
const LOGIT_TOKENS: usize = 8;
const LOGIT_THREADS: u32 = 256;
/// Warps of a logits CTA (`kLogitWarps`): they take the 256-element chunks of D round-robin.
const LOGIT_WARPS: usize = 8;
const SELECT_THREADS: u32 = 1024;

/// The sizes of one routing call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterShape {
    pub tokens: usize,
    pub experts: usize,
    pub dim: usize,
    /// Rows per physical slot of the masked grouping.
    pub capacity: usize,
    /// Physical expert slots of the grouping (`counts` has `slots` entries): `experts` without a slot map.
    pub slots: usize,
}

impl RouterShape {
    /// The shape without a slot map (`slots == experts`).
    pub fn identity(tokens: usize, experts: usize, dim: usize, capacity: usize) -> RouterShape {
        RouterShape {
            tokens,
            experts,
            dim,
            capacity,
            slots: experts,
        }
    }
    /// `1 <= T <= MAX_TOKENS`, `TOPK <= E <= MAX_EXPERTS`, `D % 256 == 0`, `capacity >= 1`,
    /// `1 <= slots <= MAX_EXPERTS`, `slots * capacity` an i32.
    pub fn check(&self) -> Result<()> {
        let RouterShape {
            tokens,
            experts,
            dim,
            capacity,
            slots,
        } = *self;
        ensure!(
            (1..=MAX_TOKENS).contains(&tokens),
            "router: {tokens} tokens (1..={MAX_TOKENS})"
        );
        ensure!(
            (TOPK..=MAX_EXPERTS).contains(&experts),
            "router: {experts} experts ({TOPK}..={MAX_EXPERTS})"
        );
        ensure!(
            dim > 0 && dim.is_multiple_of(DIM_MULTIPLE) && dim <= i32::MAX as usize,
            "router: D = {dim} must be a positive multiple of {DIM_MULTIPLE}"
        );
        ensure!(capacity >= 1, "router: capacity must be >= 1");
        ensure!(
            (1..=MAX_EXPERTS).contains(&slots),
            "router: {slots} slots (1..={MAX_EXPERTS})"
        );
        ensure!(
            slots * capacity <= i32::MAX as usize,
            "router: {slots} slots x {capacity} rows exceed the kernels' int index"
        );
        Ok(())
    }
    /// Rows of the masked grouping: `slots * capacity`.
    pub fn rows_total(&self) -> usize {
        self.slots * self.capacity
    }
    /// The select kernel's dynamic shared memory: `slots * ceil(T / 32)` token masks or pair counters, then (used
    /// by the slot-mapped grouping) each slot's total and each pair's slot, then the staged bias and slot tables
    /// (`E` words each; kernels/router.cu, select_group).
    fn select_smem(&self) -> usize {
        (self.slots * self.tokens.div_ceil(32) + self.slots + self.tokens * TOPK + 2 * self.experts)
            * 4
    }
}

/// Depth of the f32 summation tree of one GPU logit for hidden size `dim` (kernels/router.cu): each lane adds
/// 8 products per chunk it owns (at most ceil(chunks / 8) chunks, chunks = D / 256), 5 butterfly levels across the
/// warp, then 7 adds of the 8 warp sums (counted as 8). An f32 sum of depth n is within
/// `n u / (1 - n u) * sum |terms|` of the exact sum (u = 2^-24; the BF16 x BF16 products are exact): the error bound
/// the tests derive their tolerances from.
pub fn logit_sum_depth(dim: usize) -> usize {
    8 * (dim / DIM_MULTIPLE).div_ceil(LOGIT_WARPS) + 5 + 8
}

/// How the experts are chosen.
pub enum Selection<'a> {
    /// Top-6 of `score + bias` (`bias`: f32 `[E]`).
    Biased { bias: &'a dyn DeviceBuf<f32> },
    /// The hash layers: `tid2eid[token_ids[t]]` (`token_ids`: i32 `[T]`; `tid2eid`: i32 `[vocab, 6]`).
    Hash {
        token_ids: &'a dyn DeviceBuf<i32>,
        tid2eid: &'a dyn DeviceBuf<i32>,
        vocab: usize,
    },
}

/// The device inputs of one routing call (any [`DeviceBuf`]: owned slices, arena carves, views into a weight pool).
pub struct RouterInputs<'a> {
    /// Hidden vectors, BF16 `[T, D]` (16-byte aligned).
    pub x: &'a dyn DeviceBuf<bf16>,
    /// Gate weight, BF16 `[E, D]` (16-byte aligned).
    pub gate: &'a dyn DeviceBuf<bf16>,
    pub selection: Selection<'a>,
    /// `routed_scaling_factor` (1.5 Flash, 2.5 Pro).
    pub route_scale: f32,
    /// Physical slot of each logical expert, i32 `[E]` (`engine::plan::ExpertMap::table`), values meant to lie in
    /// `0..shape.slots` (one outside routes its pairs nowhere, counted in `dropped`). `None`: slot = expert, and
    /// `shape.slots` must equal E.
    pub slot_of: Option<&'a dyn DeviceBuf<i32>>,
}

/// The caller-owned scratch of a routing call: the logits `[T, E]` f32 (written by the first launch, read by the
/// second; the tests read them too).
#[derive(Debug, Clone, Copy)]
pub struct RouterWorkspace {
    pub tokens: usize,
    pub experts: usize,
    pub logits: DevBuf<f32>,
}

/// Device bytes of the [`RouterWorkspace`] of `shape`.
pub fn workspace_bytes(shape: &RouterShape) -> usize {
    RouterWorkspace::layout(shape).bytes()
}

impl RouterWorkspace {
    pub fn layout(shape: &RouterShape) -> WorkspaceLayout {
        let mut l = WorkspaceLayout::new();
        l.add::<f32>(shape.tokens * shape.experts);
        l
    }
    pub fn carve(arena: &mut Arena, shape: &RouterShape) -> Result<RouterWorkspace> {
        Ok(RouterWorkspace {
            tokens: shape.tokens,
            experts: shape.experts,
            logits: arena.carve::<f32>(shape.tokens * shape.experts, "router logits")?,
        })
    }
}

/// The outputs of a routing call (owned buffers, so the grouping can be handed to `moe_gemm`'s
/// [`DeviceGrouping`](crate::ops::moe_gemm::DeviceGrouping), whose `group` is the `counts` here).
pub struct RouterOutputs {
    pub shape: RouterShape,
    /// Chosen logical experts `[T, 6]` in selection order (-1: a hash pair routed nowhere).
    pub topk_experts: CudaSlice<i32>,
    /// Their weights `[T, 6]` (0 where the expert is -1).
    pub topk_weights: CudaSlice<f32>,
    /// Row of pair (t, j) `[T, 6]`, -1 when it got none (exactly T x 6 long: `moe_gemm`'s L2 combine table).
    pub token_rows: CudaSlice<i32>,
    /// Rows per physical slot `[slots]` (the masked grouping's counts).
    pub counts: CudaSlice<i32>,
    /// Token of each row `[slots * capacity]`, -1 for an empty row (the activation gather's table).
    pub row_token: CudaSlice<i32>,
    /// Routing weight of each row `[slots * capacity]`, 0 for an empty row (the L1 finish's `routing`).
    pub row_weight: CudaSlice<f32>,
    /// Pairs that got no slot `[1]`.
    pub dropped: CudaSlice<i32>,
}

impl RouterOutputs {
    /// Output buffers for `shape`, every byte `poison` (0xFF: NaN and -1), so an unwritten element shows up.
    pub fn alloc(gpu: &Gpu, shape: &RouterShape, poison: u8) -> Result<RouterOutputs> {
        shape.check()?;
        let pairs = shape.tokens * TOPK;
        Ok(RouterOutputs {
            shape: *shape,
            topk_experts: gpu.poisoned(pairs, poison)?,
            topk_weights: gpu.poisoned(pairs, poison)?,
            token_rows: gpu.poisoned(pairs, poison)?,
            counts: gpu.poisoned(shape.slots, poison)?,
            row_token: gpu.poisoned(shape.rows_total(), poison)?,
            row_weight: gpu.poisoned(shape.rows_total(), poison)?,
            dropped: gpu.poisoned(1, poison)?,
        })
    }
}

fn check_len<T>(b: &(impl DeviceBuf<T> + ?Sized), need: usize, what: &str) -> Result<()> {
    ensure!(
        b.elems() >= need,
        "router: {what} has {} elements, needs {need}",
        b.elems()
    );
    Ok(())
}

/// The checks of [`route`] (every buffer against `out.shape`), before any launch.
fn check_route(inputs: &RouterInputs, ws: &RouterWorkspace, out: &RouterOutputs) -> Result<()> {
    let s = out.shape;
    s.check()?;
    check_len(inputs.x, s.tokens * s.dim, "x [T, D]")?;
    check_len(inputs.gate, s.experts * s.dim, "gate [E, D]")?;
    for (what, addr) in [
        ("x", inputs.x.device_addr()),
        ("gate", inputs.gate.device_addr()),
    ] {
        ensure!(
            addr.is_multiple_of(16),
            "router: {what} at {addr:#x} is not 16-byte aligned (the logits kernel loads 16 bytes at a time)"
        );
    }
    ensure!(
        inputs.route_scale.is_finite(),
        "router: route_scale {} is not finite",
        inputs.route_scale
    );
    match &inputs.selection {
        Selection::Biased { bias } => check_len(*bias, s.experts, "bias [E]")?,
        Selection::Hash {
            token_ids,
            tid2eid,
            vocab,
        } => {
            ensure!(
                (1..=i32::MAX as usize / TOPK).contains(vocab),
                "router: vocab = {vocab}"
            );
            check_len(*token_ids, s.tokens, "token_ids [T]")?;
            check_len(*tid2eid, vocab * TOPK, "tid2eid [vocab, 6]")?;
        }
    }
    match inputs.slot_of {
        None => ensure!(
            s.slots == s.experts,
            "router: without a slot map slots ({}) must equal the experts ({})",
            s.slots,
            s.experts
        ),
        Some(t) => ensure!(
            t.elems() == s.experts,
            "router: slot_of has {} elements, must be exactly E = {}",
            t.elems(),
            s.experts
        ),
    }
    ensure!(
        ws.tokens == s.tokens && ws.experts == s.experts,
        "router: workspace is for {} tokens x {} experts, the call is {} x {}",
        ws.tokens,
        ws.experts,
        s.tokens,
        s.experts
    );
    check_len(&ws.logits, s.tokens * s.experts, "workspace logits")?;
    let pairs = s.tokens * TOPK;
    ensure!(
        out.token_rows.len() == pairs,
        "router: token_rows has {} elements, must be exactly T x {TOPK} = {pairs} (the L2 combine reads T from it)",
        out.token_rows.len()
    );
    check_len(&out.topk_experts, pairs, "topk_experts")?;
    check_len(&out.topk_weights, pairs, "topk_weights")?;
    check_len(&out.counts, s.slots, "counts")?;
    check_len(&out.row_token, s.rows_total(), "row_token")?;
    check_len(&out.row_weight, s.rows_total(), "row_weight")?;
    check_len(&out.dropped, 1, "dropped")?;
    Ok(())
}

/// Route `out.shape.tokens` tokens on `stream`: the logits launch (grid E x ceil(T / 8)) into `ws`, then the
/// one-CTA select-and-group launch into `out` (`router_select_group`, or `router_select_group_slots` with
/// `inputs.slot_of`), both PDL-launched (each stages its weights or tables while the kernel before it runs).
/// Every check runs before the first launch.
pub fn route(
    gpu: &Gpu,
    stream: &Stream,
    inputs: &RouterInputs,
    ws: &RouterWorkspace,
    out: &mut RouterOutputs,
) -> Result<()> {
    check_route(inputs, ws, out)?;
    launch_route(gpu, stream, inputs, ws, out, out.counts.device_addr())
}

/// [`route`] with the per-slot counts written to `counts` (`[slots]` i32) instead of `out.counts` (left
/// untouched): for a caller whose moe_gemm grouping owns the counts buffer (`DeviceGrouping::group`), so that the
/// router writes the counts where the grouped GEMM reads them.
pub fn route_counts_into(
    gpu: &Gpu,
    stream: &Stream,
    inputs: &RouterInputs,
    ws: &RouterWorkspace,
    out: &mut RouterOutputs,
    counts: &dyn DeviceBuf<i32>,
) -> Result<()> {
    check_route(inputs, ws, out)?;
    check_len(counts, out.shape.slots, "counts")?;
    launch_route(gpu, stream, inputs, ws, out, counts.device_addr())
}

/// The two launches of [`route`] (checked by the caller), the counts written at `counts`.
fn launch_route(
    gpu: &Gpu,
    stream: &Stream,
    inputs: &RouterInputs,
    ws: &RouterWorkspace,
    out: &RouterOutputs,
    counts: u64,
) -> Result<()> {
    let s = out.shape;
    let smem = s.select_smem();
    let k_logits = gpu.kernel(FAMILY, "router_logits")?;
    let select_name = if inputs.slot_of.is_some() {
        "router_select_group_slots"
    } else {
        "router_select_group"
    };
    let k_select = gpu.kernel_with_smem(FAMILY, select_name, smem)?;

    let mut args = KernelArgs::new();
    args.u64(inputs.x.device_addr())
        .u64(inputs.gate.device_addr())
        .i32(s.tokens as i32)
        .i32(s.experts as i32)
        .i32(s.dim as i32)
        .buf(&ws.logits);
    let grid = (s.experts as u32, s.tokens.div_ceil(LOGIT_TOKENS) as u32, 1);
    // SAFETY: arguments in the kernel's order (x, gate, tokens, experts, dim, logits); x, gate and the logits
    // were checked against [T, D], [E, D] and [T, E], x and gate to be 16-byte aligned; D % 256 == 0, so every
    // 16-byte load is aligned.
    unsafe {
        launch(
            stream,
            &k_logits,
            Launch::new(grid, (LOGIT_THREADS, 1, 1)).pdl(true),
            &mut args,
        )?
    };

    let mut args = KernelArgs::new();
    args.buf(&ws.logits);
    match &inputs.selection {
        Selection::Biased { bias } => {
            args.u64(bias.device_addr()).null().null().i32(0).i32(0);
        }
        Selection::Hash {
            token_ids,
            tid2eid,
            vocab,
        } => {
            args.null()
                .u64(token_ids.device_addr())
                .u64(tid2eid.device_addr())
                .i32(*vocab as i32)
                .i32(1);
        }
    }
    if let Some(t) = inputs.slot_of {
        args.u64(t.device_addr()).i32(s.slots as i32);
    }
    args.i32(s.tokens as i32)
        .i32(s.experts as i32)
        .i32(s.capacity as i32)
        .f32(inputs.route_scale)
        .buf(&out.topk_experts)
        .buf(&out.topk_weights)
        .buf(&out.token_rows)
        .u64(counts)
        .buf(&out.row_token)
        .buf(&out.row_weight)
        .buf(&out.dropped);
    // SAFETY: arguments in the kernel's order (logits, bias, token_ids, tid2eid, vocab, hash, [slot_of, slots,]
    // tokens, experts, capacity, route_scale, outputs...); every buffer was checked against the shape (slot_of: E
    // entries; counts: slots); the dynamic shared memory holds the slots x ceil(T / 32) words and the kernel was
    // resolved for it.
    unsafe {
        launch(
            stream,
            &k_select,
            Launch::new((1, 1, 1), (SELECT_THREADS, 1, 1))
                .smem(smem)
                .pdl(true),
            &mut args,
        )
    }
}

/// NVFP4 activation rows on the device in norm_quant's layout: e2m1 codes `[rows, D/2]`, e4m3 block scales
/// `[rows, D/16]`, an f32 global scale per row `[rows]`.
pub struct Nvfp4RowBufs<'a> {
    pub rows: usize,
    pub dim: usize,
    pub codes: &'a dyn DeviceBuf<u8>,
    pub scales: &'a dyn DeviceBuf<u8>,
    pub global: &'a dyn DeviceBuf<f32>,
}

impl Nvfp4RowBufs<'_> {
    fn check(&self, what: &str) -> Result<()> {
        let (r, d) = (self.rows, self.dim);
        check_len(self.codes, r * d / 2, &format!("{what} codes"))?;
        check_len(self.scales, r * d / 16, &format!("{what} scales"))?;
        check_len(self.global, r, &format!("{what} global scales"))?;
        for addr in [self.codes.device_addr(), self.scales.device_addr()] {
            ensure!(
                addr.is_multiple_of(16),
                "router gather: {what} at {addr:#x} is not 16-byte aligned"
            );
        }
        Ok(())
    }
}

/// The routed experts' activation gather (`router_gather_nvfp4_rows`): token `t`'s NVFP4 row of `tokens`
/// (`[T, D]`) is copied to row `token_rows[t, j]` of `rows` (`[rows_total, D]`, the masked grouping's rows) for
/// every pick `j` that got a row; rows no pair owns are left as they are (moe_gemm reads only owned rows).
/// `token_rows` is the router's `[T, 6]` table (`RouterOutputs::token_rows`). `D % 128 == 0`. One launch of
/// `T x 6` CTAs (graph-safe: the grid comes from T). CPU twin: [`reference::gather_rows`].
pub fn gather_nvfp4_rows(
    gpu: &Gpu,
    stream: &Stream,
    tokens: &Nvfp4RowBufs,
    token_rows: &CudaSlice<i32>,
    rows: &Nvfp4RowBufs,
) -> Result<()> {
    let d = tokens.dim;
    ensure!(
        d > 0 && d.is_multiple_of(128) && rows.dim == d,
        "router gather: D = {d} (rows D = {}) must be a positive multiple of 128",
        rows.dim
    );
    ensure!(
        (1..=MAX_TOKENS).contains(&tokens.rows),
        "router gather: {} tokens (1..={MAX_TOKENS})",
        tokens.rows
    );
    ensure!(
        token_rows.len() == tokens.rows * TOPK,
        "router gather: token_rows has {} entries, needs T x {TOPK} = {}",
        token_rows.len(),
        tokens.rows * TOPK
    );
    ensure!(
        rows.rows <= i32::MAX as usize && d <= i32::MAX as usize,
        "router gather: {} rows of {d} exceed the kernel's int indices",
        rows.rows
    );
    tokens.check("token rows")?;
    rows.check("grouped rows")?;
    let k = gpu.kernel(FAMILY, "router_gather_nvfp4_rows")?;
    let mut a = KernelArgs::new();
    a.u64(tokens.codes.device_addr())
        .u64(tokens.scales.device_addr())
        .u64(tokens.global.device_addr())
        .buf(token_rows)
        .i32(rows.rows as i32)
        .i32(d as i32)
        .u64(rows.codes.device_addr())
        .u64(rows.scales.device_addr())
        .u64(rows.global.device_addr());
    let grid = ((tokens.rows * TOPK) as u32, 1, 1);
    // SAFETY: arguments in the kernel's order; both row sets were checked against their [rows, D] extents and
    // 16-byte alignment, token_rows against T x 6; the kernel writes only rows in [0, rows_total).
    unsafe { launch(stream, &k, Launch::new(grid, (128, 1, 1)), &mut a) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_masks_fit_the_shared_memory_the_launcher_allows() {
        let s = RouterShape::identity(MAX_TOKENS, MAX_EXPERTS, 256, 1);
        // 128 KiB of masks + 2 KiB of slot totals + 48 KiB of pair slots + 4 KiB of staged bias and slot tables,
        // within the 227 KiB an H100/H200 CTA may opt into.
        assert_eq!(
            s.select_smem(),
            128 * 1024 + 2 * 1024 + 48 * 1024 + 4 * 1024
        );
        assert!(s.select_smem() <= 227 * 1024);
    }

    #[test]
    fn logit_sum_depth_counts_lane_chunks_butterfly_and_warp_sums() {
        // Flash D = 4096: 16 chunks, 2 per warp (16 products per lane); Pro D = 7168: 28 chunks, up to 4 per warp.
        assert_eq!(logit_sum_depth(4096), 16 + 5 + 8);
        assert_eq!(logit_sum_depth(7168), 32 + 5 + 8);
        assert_eq!(logit_sum_depth(256), 8 + 5 + 8);
    }
}
