//! Split-K fixup inside the mainloop kernel (session-4 A/B against mainloop + separate finish kernel).
//!
//! `moe_gemm_nvfp4_l{1,2}_fixup_v3_nt*` (kernels/moe_gemm.cu, the block after the finish kernels) run the unchanged
//! v3 mma.sync mainloop, then every CTA arrives on an atomic counter per output tile for the work items it computed;
//! the CTA that arrives last runs that tile's epilogue from the fp32 partials (still in L2):
//! * L1: per expert token tile (its gate AND up columns, the whole rows, because the NVFP4 global scale needs the
//!   row amax): DSV4 SwiGLU with clamp, routing weight, NVFP4 quant; rows owned by no expert get the finish kernel's
//!   zero rows (codes 0, scales 0, global scale 1).
//! * L2: per 128-column tile: the per-token combine over the top-k rows for every token.
//!
//! The outputs are bit-identical to [`launch_partial_mma`] + [`launch_finish_l1`] / [`launch_finish_l2`] (same
//! partials, same split order, same fp32 operations). The counters are reset by the last arriver, so repeated calls
//! and graph replays need no memset; one [`ArrivalCounters`] must not be used by two launches at the same time
//! (e.g. on two streams). The protocol and its memory-ordering argument are in the .cu comment.
//!
//! This path always uses the mma.sync mainloop (never the wgmma prefill kernel): it is meant for decode shapes.

use anyhow::{anyhow, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use super::*;

/// Arrival counters of the fixup kernels (u32, zero between launches; see the module doc).
pub struct ArrivalCounters {
    pub counters: CudaSlice<u32>,
}

impl ArrivalCounters {
    /// Counters for L1 launches on `grp`: one per expert token tile; `rows_total + experts` bounds the tile count
    /// (sum over experts of ceil(rows / tile) <= rows + experts) for every token tile.
    pub fn for_l1(gpu: &Gpu, grp: &DeviceGrouping) -> Result<ArrivalCounters> {
        Self::with_len(gpu, l1_counters_needed(grp))
    }

    /// Counters for L2 launches with output width `n`: one per 128-column tile.
    pub fn for_l2(gpu: &Gpu, n: usize) -> Result<ArrivalCounters> {
        Self::with_len(gpu, n / BLOCK_N)
    }

    /// `len` zeroed counters.
    pub fn with_len(gpu: &Gpu, len: usize) -> Result<ArrivalCounters> {
        ensure!(
            len <= i32::MAX as usize,
            "moe_gemm fixup: {len} counters do not fit an i32"
        );
        Ok(ArrivalCounters {
            counters: gpu.zeros::<u32>(len.max(1))?,
        })
    }
}

fn l1_counters_needed(grp: &DeviceGrouping) -> usize {
    grp.rows_total + grp.experts
}

/// The checks of [`launch_partial_mma`] (shapes, workspace), shared by both fixup launchers.
fn check_mainloop(
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &Workspace,
) -> Result<()> {
    cfg.check(w.k)?;
    a.check()?;
    let (a_rows, a_k) = a.rows_k();
    ensure!(a_k == w.k, "moe_gemm: A has K = {a_k}, weights K = {}", w.k);
    ensure!(
        a_rows >= grp.rows_total,
        "moe_gemm: A has {a_rows} rows, the grouping spans {}",
        grp.rows_total
    );
    ensure!(
        ws.splits == cfg.splits,
        "moe_gemm fixup: workspace has {} splits, the config {}",
        ws.splits,
        cfg.splits
    );
    check_finish(ws, grp, w)
}

/// The 13 mainloop arguments of every fixup entry, in kernel order, as raw values.
struct MainloopArgs {
    wc: u64,
    wsc: u64,
    n: i32,
    k: i32,
    act: u64,
    act_scales: u64,
    is_nvfp4: i32,
    grp: u64,
    cap: i32,
    experts: i32,
    rows: i32,
    part: u64,
    splits: i32,
}

impl MainloopArgs {
    fn new(
        gpu: &Gpu,
        w: &DeviceExpertWeights,
        a: &DeviceActivations,
        grp: &DeviceGrouping,
        cfg: &GemmConfig,
        ws: &Workspace,
    ) -> Result<MainloopArgs> {
        let (act, act_scales, is_nvfp4) = activation_ptrs(gpu, a);
        Ok(MainloopArgs {
            wc: ptr(gpu, &w.codes),
            wsc: ptr(gpu, &w.scales),
            n: as_i32(w.n, "N")?,
            k: as_i32(w.k, "K")?,
            act,
            act_scales,
            is_nvfp4,
            grp: ptr(gpu, &grp.group),
            cap: as_i32(grp.capacity, "capacity")?,
            experts: as_i32(grp.experts, "experts")?,
            rows: as_i32(grp.rows_total, "rows")?,
            part: ptr(gpu, &ws.partial),
            splits: as_i32(cfg.splits, "splits")?,
        })
    }
}

/// Dynamic shared memory of the mainloop (as [`launch_partial_mma`]): the permuted BF16 tile + the raw tile.
fn mainloop_smem(cfg: &GemmConfig) -> usize {
    2 * cfg.token_tile * STAGE_K * 2
}

/// L1 in one launch: W13 mainloop + in-kernel SwiGLU / routing weight / NVFP4 quant (what [`launch_partial_mma`]
/// followed by [`launch_finish_l1`] computes, bit for bit). `counters` from [`ArrivalCounters::for_l1`].
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_l1_fixup(
    gpu: &Gpu,
    w13: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &mut Workspace,
    counters: &mut ArrivalCounters,
    routing: &CudaSlice<f32>,
    out: &mut L1Output,
) -> Result<()> {
    check_mainloop(w13, a, grp, cfg, ws)?;
    let i_dim = w13.n / 2;
    ensure!(
        w13.n.is_multiple_of(2) && i_dim.is_multiple_of(16),
        "moe_gemm L1 fixup: N = {} must be 2 * I with I % 16 == 0",
        w13.n
    );
    ensure!(
        out.rows == grp.rows_total && out.i_dim == i_dim,
        "moe_gemm L1 fixup: output is {} x {}, needs {} x {i_dim}",
        out.rows,
        out.i_dim,
        grp.rows_total
    );
    ensure!(
        routing.len() >= grp.rows_total,
        "moe_gemm L1 fixup: {} routing weights for {} rows",
        routing.len(),
        grp.rows_total
    );
    let needed = l1_counters_needed(grp);
    ensure!(
        counters.counters.len() >= needed,
        "moe_gemm L1 fixup: {} arrival counters, the grouping needs {needed}",
        counters.counters.len()
    );
    if grp.rows_total == 0 {
        return Ok(());
    }
    let name = format!("moe_gemm_nvfp4_l1_fixup_v3_nt{}", cfg.token_tile / 8);
    let smem = mainloop_smem(cfg);
    let f = gpu.function_with_smem(FAMILY, &name, smem)?;
    let m = MainloopArgs::new(gpu, w13, a, grp, cfg, ws)?;
    let (cnt, cnt_len) = (
        ptr(gpu, &counters.counters),
        as_i32(counters.counters.len(), "counters")?,
    );
    let (gsa, gsb, rw) = (a.gsa_ptr(gpu), ptr(gpu, &w13.global), ptr(gpu, routing));
    let (hc, hs, hg) = (
        ptr(gpu, &out.codes),
        ptr(gpu, &out.scales),
        ptr(gpu, &out.global),
    );
    let hf = out.h_f32.as_ref().map(|h| ptr(gpu, h)).unwrap_or(0);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&m.wc)
        .arg(&m.wsc)
        .arg(&m.n)
        .arg(&m.k)
        .arg(&m.act)
        .arg(&m.act_scales)
        .arg(&m.is_nvfp4);
    b.arg(&m.grp)
        .arg(&m.cap)
        .arg(&m.experts)
        .arg(&m.rows)
        .arg(&m.part)
        .arg(&m.splits);
    b.arg(&cnt).arg(&cnt_len).arg(&gsa).arg(&gsb).arg(&rw);
    b.arg(&hc).arg(&hs).arg(&hg).arg(&hf);
    unsafe { b.launch(launch_cfg((cfg.ctas, 1, 1), (THREADS, 1, 1), smem as u32)) }
        .map_err(|e| anyhow!("{name}: {e:?}"))?;
    Ok(())
}

/// L2 in one launch: W2 mainloop + in-kernel per-token combine (what [`launch_partial_mma`] followed by
/// [`launch_finish_l2`] computes, bit for bit). `token_rows` is `[tokens, topk]` (-1 = no row), topk <=
/// [`FINISH_MAX_TOPK`]; `counters` from [`ArrivalCounters::for_l2`].
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_l2_fixup(
    gpu: &Gpu,
    w2: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &mut Workspace,
    counters: &mut ArrivalCounters,
    token_rows: &CudaSlice<i32>,
    topk: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check_mainloop(w2, a, grp, cfg, ws)?;
    ensure!(
        (1..=FINISH_MAX_TOPK).contains(&topk),
        "moe_gemm L2 fixup: topk = {topk} must be in 1..={FINISH_MAX_TOPK}"
    );
    let tokens = token_rows.len() / topk;
    ensure!(
        token_rows.len() == tokens * topk,
        "moe_gemm L2 fixup: token_rows length {} is not tokens x {topk}",
        token_rows.len()
    );
    ensure!(
        out.len() >= tokens * w2.n,
        "moe_gemm L2 fixup: output has {} elements, needs {tokens} x {}",
        out.len(),
        w2.n
    );
    let needed = w2.n / BLOCK_N;
    ensure!(
        counters.counters.len() >= needed,
        "moe_gemm L2 fixup: {} arrival counters, N = {} needs {needed}",
        counters.counters.len(),
        w2.n
    );
    if tokens == 0 {
        return Ok(());
    }
    let name = format!("moe_gemm_nvfp4_l2_fixup_v3_nt{}", cfg.token_tile / 8);
    let smem = mainloop_smem(cfg);
    let f = gpu.function_with_smem(FAMILY, &name, smem)?;
    let m = MainloopArgs::new(gpu, w2, a, grp, cfg, ws)?;
    let (cnt, cnt_len) = (
        ptr(gpu, &counters.counters),
        as_i32(counters.counters.len(), "counters")?,
    );
    let (gsa, gsb, tr, o) = (
        a.gsa_ptr(gpu),
        ptr(gpu, &w2.global),
        ptr(gpu, token_rows),
        ptr(gpu, out),
    );
    let (tok, k) = (as_i32(tokens, "tokens")?, topk as i32);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&m.wc)
        .arg(&m.wsc)
        .arg(&m.n)
        .arg(&m.k)
        .arg(&m.act)
        .arg(&m.act_scales)
        .arg(&m.is_nvfp4);
    b.arg(&m.grp)
        .arg(&m.cap)
        .arg(&m.experts)
        .arg(&m.rows)
        .arg(&m.part)
        .arg(&m.splits);
    b.arg(&cnt).arg(&cnt_len).arg(&gsa).arg(&gsb);
    b.arg(&tr).arg(&tok).arg(&k).arg(&o);
    unsafe { b.launch(launch_cfg((cfg.ctas, 1, 1), (THREADS, 1, 1), smem as u32)) }
        .map_err(|e| anyhow!("{name}: {e:?}"))?;
    Ok(())
}
