//! The finish kernels of the grouped GEMM (kernels/moe_gemm.cu): each reads the fp32 partials of a [`Workspace`],
//! adds the K splits in fixed split order and applies one epilogue: plain BF16 ([`launch_finish_bf16`]), the L1
//! SwiGLU + routing weight + NVFP4 quantization of h ([`launch_finish_l1`], [`L1Output`]) or the L2 per-token
//! combine in routing order ([`launch_finish_l2`]). Each family of kernels has a routing rule (the `for_*`
//! functions) and a forced form (`*_with`) for the tests and the forcing bench variants; all forms of one
//! epilogue write bit-identical outputs. Graph-safe: grids come from `rows_total` (capacity x experts in the masked
//! layout) and the token count of `token_rows`, never from device-side counts.

use anyhow::{anyhow, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use super::{DeviceActivations, DeviceExpertWeights, DeviceGrouping, Workspace, FAMILY, THREADS};
use crate::gpu::launch::{launch, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;

/// Block of the per-row L1 finish (`__launch_bounds__(512)`): 4 columns per thread, so I = 2048 is one pass.
const FINISH_L1_THREADS: u32 = 512;

/// Most top-k rows per token the L2 combine resolves per CTA (`kFinishMaxTopk` in the kernel).
pub const FINISH_MAX_TOPK: usize = 32;

/// The token count of an L2 combine over `token_rows` entries of `topk` picks a token (`topk >= 1`), checked to be
/// whole and to fit an output of `out_elems` elements of `n` columns a token.
pub fn l2_tokens(
    what: &str,
    token_rows: usize,
    topk: usize,
    out_elems: usize,
    n: usize,
) -> Result<usize> {
    let tokens = token_rows / topk;
    ensure!(
        token_rows == tokens * topk,
        "{what}: token_rows length {token_rows} is not tokens x {topk}"
    );
    ensure!(
        out_elems >= tokens * n,
        "{what}: output has {out_elems} elements, needs {tokens} x {n}"
    );
    Ok(tokens)
}

/// What every finish kernel needs of its inputs: the workspace carved for this grouping and these weights, with
/// at least one K split and its partial sums' length (the expert-parallel partial finish checks the same).
pub fn check_finish(ws: &Workspace, grp: &DeviceGrouping, w: &DeviceExpertWeights) -> Result<()> {
    ensure!(
        ws.rows_total == grp.rows_total && ws.n == w.n,
        "moe_gemm finish: workspace does not match the grouping/weights"
    );
    ensure!(
        grp.experts == w.experts,
        "moe_gemm finish: grouping has {} experts, weights {}",
        grp.experts,
        w.experts
    );
    ensure!(
        ws.splits >= 1,
        "moe_gemm finish: the workspace has no K split"
    );
    super::check_partial_len(ws)
}

/// The arguments every finish kernel starts with, in order: the split-K partials and their split count, the
/// grouping (group, capacity, experts, rows_total), the output width `n`, the activations' per-row global scales.
fn partial_args(
    ws: &Workspace,
    grp: &DeviceGrouping,
    n: usize,
    a: &DeviceActivations,
) -> KernelArgs {
    let mut args = KernelArgs::new();
    args.buf(&ws.partial)
        .i32(ws.splits as i32)
        .buf(&grp.group)
        .i32(grp.capacity as i32)
        .i32(grp.experts as i32)
        .i32(grp.rows_total as i32)
        .i32(n as i32);
    a.push_gsa(&mut args);
    args
}

/// Plain epilogue: `out[row, n] = bf16(acc * (gsa[row] * gsb[e, n]))`, zeros for rows owned by no expert.
pub fn launch_finish_bf16(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check_finish(ws, grp, w)?;
    ensure!(
        out.len() >= grp.rows_total * w.n,
        "moe_gemm: output has {} elements, needs {} x {}",
        out.len(),
        grp.rows_total,
        w.n
    );
    if grp.rows_total == 0 {
        return Ok(());
    }
    let kern = gpu.kernel(FAMILY, "moe_gemm_finish_bf16")?;
    let mut args = partial_args(ws, grp, w.n, a);
    args.buf(&w.global).buf(out);
    // SAFETY: arguments in the kernel's order; the partials, grouping and output were checked against the shape.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((grp.rows_total as u32, 1, 1), (THREADS, 1, 1)),
            &mut args,
        )
    }
}

/// The L1 output: h quantized to NVFP4 with a per-row global scale (the L2 GEMM's A), and optionally h in fp32.
pub struct L1Output {
    pub rows: usize,
    pub i_dim: usize,
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
    pub global: CudaSlice<f32>,
    pub h_f32: Option<CudaSlice<f32>>,
}

impl L1Output {
    /// Output buffers, poisoned (0xFF) so that an unwritten element shows up.
    pub fn new(gpu: &Gpu, rows: usize, i_dim: usize, keep_h_f32: bool) -> Result<L1Output> {
        Ok(L1Output {
            rows,
            i_dim,
            codes: gpu.poisoned::<u8>((rows * i_dim / 2).max(1), 0xFF)?,
            scales: gpu.poisoned::<u8>((rows * i_dim / 16).max(1), 0xFF)?,
            global: gpu.poisoned::<f32>(rows.max(1), 0xFF)?,
            h_f32: if keep_h_f32 {
                Some(gpu.poisoned::<f32>((rows * i_dim).max(1), 0xFF)?)
            } else {
                None
            },
        })
    }

    /// This output as the A operand of the L2 GEMM.
    pub fn as_activations(&self) -> DeviceActivations<'_> {
        DeviceActivations::Nvfp4 {
            rows: self.rows,
            k: self.i_dim,
            codes: &self.codes,
            scales: &self.scales,
            global: &self.global,
        }
    }
}

/// L1 epilogue on a W13 = [w1; w3] GEMM (N = 2I): DSV4 SwiGLU with clamp, times `routing[row]`, quantized to
/// NVFP4 with a per-row global scale. Kernel: [`FinishL1Kernel::for_grouping`].
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l1(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    a: &DeviceActivations,
    routing: &CudaSlice<f32>,
    out: &mut L1Output,
) -> Result<()> {
    launch_finish_l1_with(
        gpu,
        stream,
        ws,
        grp,
        w13,
        a,
        routing,
        out,
        FinishL1Kernel::for_grouping(grp, w13.n / 2),
    )
}

/// Which L1 finish kernel [`launch_finish_l1_with`] runs. Both compute the same h (split sums in split order,
/// SwiGLU with clamp, routing weight), row amax and global scale with the same fp32 operations and quantize with
/// the same rules: bit-identical outputs (h, codes, block scales, global scales; GPU tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishL1Kernel {
    /// `moe_gemm_finish_l1_per_row`: one 512-thread CTA per row (grid = rows_total), h in shared memory, 4
    /// elements per thread in the quantization pass; a row owned by no expert (a padding slot of the masked
    /// layout) writes the all-zero row's bytes directly, with no barrier. The decode finish.
    PerRow,
    /// `moe_gemm_finish_l1_rows_kc{1,2,3,4}`: persistent 256-thread CTAs, each a contiguous range of up to
    /// [`FINISH_L1_ROWS_MAX_ROWS_PER_CTA`] rows; split 0 of the next rows' partials streams through a per-thread
    /// cp.async ring while the current row computes; h in registers, 8 elements of a 16-block per thread, the
    /// division-free e2m1 encoder (falls back to the division where its identities do not hold). The instantiation
    /// is picked by I (`kcK` takes I / 4 <= K * 256; I > 4096 is refused). The prefill finish.
    Rows,
}

impl FinishL1Kernel {
    /// The routed L1 finish: [`FinishL1Kernel::Rows`] for a contiguous grouping (prefill) when an instantiation
    /// takes `i_dim`, else [`FinishL1Kernel::PerRow`] (the masked / decode layout, whose padding rows it writes
    /// directly). Rows won at every contiguous point (results/h200/archive/session9-ab/ and session12-ab3/; the forcing
    /// variant `nvfp4_finish_per_row` keeps the contiguous side measurable).
    pub fn for_grouping(grp: &DeviceGrouping, i_dim: usize) -> FinishL1Kernel {
        if grp.capacity == 0 && FinishL1Kernel::Rows.entry(i_dim).is_some() {
            FinishL1Kernel::Rows
        } else {
            FinishL1Kernel::PerRow
        }
    }

    /// Every L1 finish kernel, PerRow first (the tests check it against the CPU quantizer and Rows against it).
    pub const ALL: &'static [FinishL1Kernel] = &[FinishL1Kernel::PerRow, FinishL1Kernel::Rows];

    /// The kernel's entry point in kernels/moe_gemm.cu for inner dimension `i_dim` (Rows: the instantiation whose
    /// chunks per thread cover I / 4; None when I is larger than every instantiation takes).
    pub fn entry(self, i_dim: usize) -> Option<&'static str> {
        match self {
            FinishL1Kernel::PerRow => Some("moe_gemm_finish_l1_per_row"),
            FinishL1Kernel::Rows => FinishL1RowsKind::for_i_dim(i_dim).map(|k| k.entry),
        }
    }
}

/// Threads of the rows L1 finish (`kFinishL1RowsThreads` in kernels/moe_gemm.cu).
const FINISH_L1_ROWS_THREADS: usize = 256;
/// Most rows one CTA of the rows L1 finish owns (`kFinishL1RowsMaxRowsPerCta`: one metadata row per thread).
pub const FINISH_L1_ROWS_MAX_ROWS_PER_CTA: usize = 256;

/// One instantiation of the rows L1 finish (`MOE_FINISH_L1_ROWS_THR2(KC, STAGES, MINB)` in kernels/moe_gemm.cu;
/// the table below must match it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishL1RowsKind {
    pub entry: &'static str,
    /// Chunks of 4 h columns per thread: takes I / 4 <= chunks_per_thread * 256.
    pub chunks_per_thread: usize,
    /// Rows in the per-thread cp.async ring (stages - 1 rows are prefetched); a ring slot holds
    /// ceil(chunks_per_thread / 2) * 2 units per thread and matrix.
    pub stages: usize,
    /// CTAs per SM the launch bounds, registers and ring allow (the launcher sizes one wave with it; kc3 / kc4: 2,
    /// their 128 registers).
    pub ctas_per_sm: usize,
}

const FINISH_L1_ROWS_KINDS: [FinishL1RowsKind; 4] = [
    FinishL1RowsKind {
        entry: "moe_gemm_finish_l1_rows_kc1",
        chunks_per_thread: 1,
        stages: 4,
        ctas_per_sm: 3,
    },
    FinishL1RowsKind {
        entry: "moe_gemm_finish_l1_rows_kc2",
        chunks_per_thread: 2,
        stages: 4,
        ctas_per_sm: 3,
    },
    FinishL1RowsKind {
        entry: "moe_gemm_finish_l1_rows_kc3",
        chunks_per_thread: 3,
        stages: 2,
        ctas_per_sm: 2,
    },
    FinishL1RowsKind {
        entry: "moe_gemm_finish_l1_rows_kc4",
        chunks_per_thread: 4,
        stages: 2,
        ctas_per_sm: 2,
    },
];

impl FinishL1RowsKind {
    /// The smallest instantiation whose threads cover the I / 4 chunks of a row (Flash I = 2048: kc2, Pro 3072:
    /// kc3); None above I = 4096.
    pub fn for_i_dim(i_dim: usize) -> Option<FinishL1RowsKind> {
        let chunks = i_dim / 4;
        FINISH_L1_ROWS_KINDS
            .iter()
            .copied()
            .find(|k| chunks <= k.chunks_per_thread * FINISH_L1_ROWS_THREADS)
    }

    /// [`FinishL1RowsKind::for_i_dim`], or the error a launcher reports before any launch.
    fn required(i_dim: usize) -> Result<FinishL1RowsKind> {
        FinishL1RowsKind::for_i_dim(i_dim)
            .ok_or_else(|| anyhow!("moe_gemm L1: the rows finish takes I <= 4096, I = {i_dim}"))
    }

    /// Dynamic shared memory: the ring, stages x 2 ceil(KC / 2) units x (gate, up) x 256 threads x 16 bytes.
    pub fn ring_bytes(&self) -> usize {
        self.stages * self.chunks_per_thread.div_ceil(2) * 2 * 2 * FINISH_L1_ROWS_THREADS * 16
    }

    /// Rows per CTA for `rows` rows on `sm_count` SMs: one wave of resident CTAs (ceil(rows / resident)), at least
    /// 1 and at most [`FINISH_L1_ROWS_MAX_ROWS_PER_CTA`] (more rows than that take more waves).
    pub fn default_rows_per_cta(&self, rows: usize, sm_count: usize) -> usize {
        let resident = (sm_count * self.ctas_per_sm).max(1);
        rows.div_ceil(resident)
            .clamp(1, FINISH_L1_ROWS_MAX_ROWS_PER_CTA)
    }
}

/// [`launch_finish_l1`] with an explicit finish kernel (same checks, same output contract).
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l1_with(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    a: &DeviceActivations,
    routing: &CudaSlice<f32>,
    out: &mut L1Output,
    kernel: FinishL1Kernel,
) -> Result<()> {
    if kernel == FinishL1Kernel::Rows {
        let i_dim = w13.n / 2;
        let kind = FinishL1RowsKind::required(i_dim)?;
        let rows_per_cta = kind.default_rows_per_cta(grp.rows_total, gpu.info.sm_count as usize);
        return launch_finish_l1_rows_with(
            gpu,
            stream,
            ws,
            grp,
            w13,
            a,
            routing,
            out,
            rows_per_cta,
        );
    }
    check_finish_l1(ws, grp, w13, routing, out)?;
    let i_dim = w13.n / 2;
    let smem = (i_dim * 4) as u32;
    ensure!(
        smem as usize <= gpu.info.max_smem_per_block_optin,
        "moe_gemm L1: I = {i_dim} needs {smem} B of shared memory"
    );
    if grp.rows_total == 0 {
        return Ok(());
    }
    // The per-row finish is `__launch_bounds__(512)`: its quantization pass needs the block to be whole warps
    // (lane == chunk % 32), which 512 is, and its one-barrier row amax exactly 16 warps (kFinishL1Threads in
    // kernels/moe_gemm.cu).
    let name = kernel
        .entry(i_dim)
        .ok_or_else(|| anyhow!("moe_gemm L1: no {kernel:?} kernel for I = {i_dim}"))?;
    let kern = gpu.kernel_with_smem(FAMILY, name, smem as usize)?;
    let mut args = finish_l1_args(ws, grp, w13, a, routing, out);
    // SAFETY: arguments in the kernel's order; check_finish_l1 checked every buffer against the shape.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((grp.rows_total as u32, 1, 1), (FINISH_L1_THREADS, 1, 1))
                .smem(smem as usize),
            &mut args,
        )
    }
}

/// The rows L1 finish ([`FinishL1Kernel::Rows`]) with an explicit number of rows per CTA (1 ..=
/// [`FINISH_L1_ROWS_MAX_ROWS_PER_CTA`]; [`launch_finish_l1_with`] takes
/// [`FinishL1RowsKind::default_rows_per_cta`]). The tests force small and odd values so that the ring wraps, the
/// expert changes inside a CTA and the last CTA owns fewer rows. Same checks and output contract as
/// [`launch_finish_l1`].
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l1_rows_with(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    a: &DeviceActivations,
    routing: &CudaSlice<f32>,
    out: &mut L1Output,
    rows_per_cta: usize,
) -> Result<()> {
    check_finish_l1(ws, grp, w13, routing, out)?;
    let i_dim = w13.n / 2;
    let kind = FinishL1RowsKind::required(i_dim)?;
    let entry = kind.entry;
    ensure!(
        ws.splits >= 1,
        "moe_gemm L1: the rows finish needs >= 1 K split (it streams split 0)"
    );
    ensure!(
        (1..=FINISH_L1_ROWS_MAX_ROWS_PER_CTA).contains(&rows_per_cta),
        "moe_gemm L1: rows per CTA = {rows_per_cta}, must be 1..={FINISH_L1_ROWS_MAX_ROWS_PER_CTA}"
    );
    if grp.rows_total == 0 {
        return Ok(());
    }
    // Every CTA owns >= 1 row: ceil(rows / rows_per_cta) CTAs.
    let grid = grp.rows_total.div_ceil(rows_per_cta);
    ensure!(
        grid <= u32::MAX as usize,
        "moe_gemm L1: {grid} CTAs exceed the grid"
    );
    let smem = kind.ring_bytes();
    let kern = gpu.kernel_with_smem(FAMILY, entry, smem)?;
    let mut args = finish_l1_args(ws, grp, w13, a, routing, out);
    args.i32(rows_per_cta as i32);
    // SAFETY: arguments in the kernel's order; check_finish_l1 checked every buffer against the shape.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((grid as u32, 1, 1), (FINISH_L1_ROWS_THREADS as u32, 1, 1)).smem(smem),
            &mut args,
        )
    }
}

/// The arguments every L1 finish kernel takes, in order (partial .. h_out; null h_out when h is not kept).
fn finish_l1_args(
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    a: &DeviceActivations,
    routing: &CudaSlice<f32>,
    out: &L1Output,
) -> KernelArgs {
    let mut args = partial_args(ws, grp, w13.n / 2, a);
    args.buf(&w13.global)
        .buf(routing)
        .buf(&out.codes)
        .buf(&out.scales)
        .buf(&out.global);
    match &out.h_f32 {
        Some(h) => args.buf(h),
        None => args.null(),
    };
    args
}

/// The checks every L1 finish launch makes before anything runs (shapes, the output, the routing weights).
fn check_finish_l1(
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    routing: &CudaSlice<f32>,
    out: &L1Output,
) -> Result<()> {
    check_finish(ws, grp, w13)?;
    ensure!(
        w13.n.is_multiple_of(2),
        "moe_gemm L1: N = {} must be 2 * I",
        w13.n
    );
    let i_dim = w13.n / 2;
    ensure!(
        i_dim.is_multiple_of(16),
        "moe_gemm L1: I = {i_dim} must be a multiple of 16"
    );
    ensure!(
        out.rows == grp.rows_total && out.i_dim == i_dim,
        "moe_gemm L1: output is {} x {}, needs {} x {i_dim}",
        out.rows,
        out.i_dim,
        grp.rows_total
    );
    ensure!(
        routing.len() >= grp.rows_total,
        "moe_gemm L1: {} routing weights for {} rows",
        routing.len(),
        grp.rows_total
    );
    ensure!(
        grp.rows_total <= i32::MAX as usize,
        "moe_gemm L1: {} rows exceed the kernels' int row index",
        grp.rows_total
    );
    Ok(())
}

/// L2 epilogue: `out[t, n] = bf16(sum_j acc(rows[t, j], n) * gsa * gsb [+ addend[t, n]])` in routing order
/// (deterministic): the routed terms summed in f32 (`y = fma(acc_j, fl(gsa * gsb), y)` from +0.0 over the valid j),
/// then, with an addend (BF16 `[tokens, N]`, 4-byte aligned; the shared expert's output),
/// `y = fl(y + f32(addend[t, n]))` once, then the one BF16 rounding (the CPU model's `Model::moe`: routed sum, then
/// the shared expert, then BF16). Without an addend nothing is added (the routed-only bits). `token_rows` is
/// `[tokens, topk]`, -1 where a token has fewer routed rows; topk <= [`FINISH_MAX_TOPK`]. The
/// combine kernel is [`FinishL2Kernel::for_tokens`]: RowWarps up to [`L2_ROWWARPS_MAX_TOKENS`] tokens, Cols2 above,
/// Cols2Tok from [`L2_COLS2TOK_MIN_TOKENS`]; all give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l2(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w2: &DeviceExpertWeights,
    a: &DeviceActivations,
    token_rows: &CudaSlice<i32>,
    topk: usize,
    addend: Option<&dyn DeviceBuf<bf16>>,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    launch_finish_l2_with(
        gpu,
        stream,
        ws,
        grp,
        w2,
        a,
        token_rows,
        topk,
        addend,
        out,
        FinishL2Kernel::for_tokens(token_rows.len() / topk.max(1)),
    )
}

/// Which L2 combine kernel [`launch_finish_l2_with`] runs (bit-identical outputs). [`launch_finish_l2`] takes
/// [`FinishL2Kernel::for_tokens`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishL2Kernel {
    /// `moe_gemm_finish_l2_combine_rowwarps`: grid `tokens x ceil(N / 32)`, one warp per routed row (slot) and
    /// 32 columns per CTA, each warp's split loads in flight together, then warp 0 combines the slots in routing
    /// order. The default up to [`L2_ROWWARPS_MAX_TOKENS`] tokens (bench variant `nvfp4_l2rowwarps` forces it).
    RowWarps,
    /// `moe_gemm_finish_l2_combine_cols2`: 2 columns per thread (float2 loads), the token's valid slots compacted
    /// by warp 0, every load of a pass unconditional. Needs N % 2 == 0 (every N the GEMM takes; checked before the
    /// launch). The default
    /// above [`L2_ROWWARPS_MAX_TOKENS`] and below [`L2_COLS2TOK_MIN_TOKENS`] tokens (bench variant `nvfp4_l2cols2`
    /// forces it).
    Cols2,
    /// `moe_gemm_finish_l2_combine_cols2_tok`: Cols2's per-column code with one CTA per token over all N columns,
    /// so the token's slot table (a chain of dependent loads) is built once per token instead of once per 512
    /// columns. Needs N % 2 == 0. The default from [`L2_COLS2TOK_MIN_TOKENS`] tokens (bench variant
    /// `nvfp4_l2cols2tok` forces it).
    Cols2Tok,
}

/// Fewest tokens for which [`FinishL2Kernel::for_tokens`] picks [`FinishL2Kernel::Cols2Tok`] over Cols2: the fewest
/// measured tokens where Cols2Tok won (Flash and Pro L2; results/h200/archive/session11-ab/, variants `nvfp4_l2cols2` and
/// `nvfp4_l2cols2tok`); between 64 and 512 tokens nothing was measured, so Cols2 stays there.
pub const L2_COLS2TOK_MIN_TOKENS: usize = 512;

/// Most tokens for which [`FinishL2Kernel::for_tokens`] picks [`FinishL2Kernel::RowWarps`]: the largest measured
/// count where RowWarps won (results/h200/archive/session8-ab/, variant `nvfp4_l2rowwarps`); above it its two barriers and
/// serial slot combine per 32 columns cost more than its parallel split loads save.
pub const L2_ROWWARPS_MAX_TOKENS: usize = 8;

impl FinishL2Kernel {
    /// Every L2 combine kernel, RowWarps first (the tests compare the others against it bit for bit).
    pub const ALL: &'static [FinishL2Kernel] = &[
        FinishL2Kernel::RowWarps,
        FinishL2Kernel::Cols2,
        FinishL2Kernel::Cols2Tok,
    ];

    /// The kernel [`launch_finish_l2`] runs for `tokens` tokens: RowWarps up to [`L2_ROWWARPS_MAX_TOKENS`] tokens,
    /// Cols2 above, Cols2Tok from [`L2_COLS2TOK_MIN_TOKENS`].
    pub fn for_tokens(tokens: usize) -> FinishL2Kernel {
        if tokens <= L2_ROWWARPS_MAX_TOKENS {
            FinishL2Kernel::RowWarps
        } else if tokens >= L2_COLS2TOK_MIN_TOKENS {
            FinishL2Kernel::Cols2Tok
        } else {
            FinishL2Kernel::Cols2
        }
    }

    /// The kernel's entry point in kernels/moe_gemm.cu.
    pub fn entry(self) -> &'static str {
        match self {
            FinishL2Kernel::RowWarps => "moe_gemm_finish_l2_combine_rowwarps",
            FinishL2Kernel::Cols2 => "moe_gemm_finish_l2_combine_cols2",
            FinishL2Kernel::Cols2Tok => "moe_gemm_finish_l2_combine_cols2_tok",
        }
    }
}

/// [`launch_finish_l2`] with an explicit combine kernel (same checks, same output contract).
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l2_with(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w2: &DeviceExpertWeights,
    a: &DeviceActivations,
    token_rows: &CudaSlice<i32>,
    topk: usize,
    addend: Option<&dyn DeviceBuf<bf16>>,
    out: &mut CudaSlice<bf16>,
    kernel: FinishL2Kernel,
) -> Result<()> {
    check_finish(ws, grp, w2)?;
    ensure!(topk >= 1, "moe_gemm L2: topk must be >= 1");
    let tokens = l2_tokens("moe_gemm L2", token_rows.len(), topk, out.len(), w2.n)?;
    if let Some(add) = addend {
        ensure!(
            add.elems() >= tokens * w2.n,
            "moe_gemm L2: addend has {} elements, needs {tokens} x {}",
            add.elems(),
            w2.n
        );
        // Cols2 / Cols2Tok read it as bf16x2 at even columns of even-N rows.
        ensure!(
            add.device_addr().is_multiple_of(4),
            "moe_gemm L2: addend address {:#x} is not 4-byte aligned",
            add.device_addr()
        );
    }
    if tokens == 0 {
        return Ok(());
    }
    ensure!(
        topk <= FINISH_MAX_TOPK,
        "moe_gemm L2: topk = {topk} > {FINISH_MAX_TOPK} (combine kernel limit)"
    );
    ensure!(
        tokens <= u32::MAX as usize,
        "moe_gemm L2: {tokens} tokens exceed the grid"
    );
    let name = kernel.entry();
    // Columns and threads per CTA: RowWarps one per lane of each slot warp (32 of 256 threads), Cols2 2 per thread
    // (512 of 256 threads), Cols2Tok all N (N % 2 == 0 for their float2 rows).
    if matches!(kernel, FinishL2Kernel::Cols2 | FinishL2Kernel::Cols2Tok) {
        ensure!(
            w2.n.is_multiple_of(2),
            "moe_gemm L2: {name} needs N % 2 == 0 (float2 rows), N = {}",
            w2.n
        );
    }
    let (cols_per_cta, block) = match kernel {
        FinishL2Kernel::RowWarps => (32, THREADS),
        FinishL2Kernel::Cols2 => (512, THREADS),
        FinishL2Kernel::Cols2Tok => (w2.n.max(1), THREADS),
    };
    let grid = (tokens as u32, w2.n.div_ceil(cols_per_cta) as u32, 1);
    let kern = gpu.kernel(FAMILY, name)?;
    let mut args = partial_args(ws, grp, w2.n, a);
    args.buf(&w2.global).buf(token_rows).i32(topk as i32);
    match addend {
        Some(add) => args.u64(add.device_addr()),
        None => args.null(),
    };
    args.buf(out);
    // SAFETY: arguments in the kernel's order; the partials, token_rows, addend and output were checked against the
    // shape (the addend's alignment too).
    unsafe { launch(stream, &kern, Launch::new(grid, (block, 1, 1)), &mut args) }
}

/// The L2 epilogue without the addend and without the BF16 rounding, for expert parallelism's rank partial
/// (docs/multi-gpu.md): `out[t, n] = y`, f32 `[tokens, N]`, the routed sum of [`launch_finish_l2`] (the RowWarps
/// kernel's fp32 operations, to which the other kernels are bit-identical; `moe_gemm_finish_l2_partial_rowwarps`),
/// so `bf16(out)` is `launch_finish_l2`'s output without an addend and `bf16(out + addend)` its output with one, bit
/// for bit. A pair whose row is `-1` in `token_rows` (under expert parallelism: a pair another rank computes) adds
/// nothing; a token with no owned pair gets `+0.0`.
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l2_partial(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w2: &DeviceExpertWeights,
    a: &DeviceActivations,
    token_rows: &CudaSlice<i32>,
    topk: usize,
    out: &dyn DeviceBuf<f32>,
) -> Result<()> {
    check_finish(ws, grp, w2)?;
    ensure!(
        (1..=FINISH_MAX_TOPK).contains(&topk),
        "moe_gemm L2 partial: topk = {topk} outside 1..={FINISH_MAX_TOPK}"
    );
    let tokens = l2_tokens(
        "moe_gemm L2 partial",
        token_rows.len(),
        topk,
        out.elems(),
        w2.n,
    )?;
    ensure!(
        tokens <= u32::MAX as usize,
        "moe_gemm L2 partial: {tokens} tokens exceed the grid"
    );
    if tokens == 0 {
        return Ok(());
    }
    let kern = gpu.kernel(FAMILY, "moe_gemm_finish_l2_partial_rowwarps")?;
    let mut args = partial_args(ws, grp, w2.n, a);
    args.buf(&w2.global)
        .buf(token_rows)
        .i32(topk as i32)
        .u64(out.device_addr());
    // RowWarps' grid: 32 columns per CTA of 256 threads.
    let grid = (tokens as u32, w2.n.div_ceil(32) as u32, 1);
    // SAFETY: arguments in the kernel's order; the partials, token_rows and the output were checked against the shape.
    unsafe { launch(stream, &kern, Launch::new(grid, (THREADS, 1, 1)), &mut args) }
}

#[cfg(test)]
mod finish_l1_rows_kind_tests {
    use super::*;

    /// Each rows-finish ring plus its static shared memory (s_meta 4 KB + s_red 64 B) and the 1 KB the driver
    /// reserves per CTA fit its CTAs per SM into the H200's 228 KB of shared memory per SM, and every ring fits one
    /// CTA's opt-in limit (227 KB): otherwise the launcher's one-wave rows per CTA would assume CTAs that cannot be
    /// resident.
    #[test]
    fn rows_rings_fit_their_ctas_per_sm() {
        for k in FINISH_L1_ROWS_KINDS {
            let per_cta = k.ring_bytes() + 4096 + 64 + 1024;
            assert!(k.ring_bytes() <= 227 * 1024, "{k:?}");
            assert!(k.ctas_per_sm * per_cta <= 228 * 1024, "{k:?}");
        }
        assert_eq!(
            FinishL1Kernel::Rows.entry(2048),
            Some("moe_gemm_finish_l1_rows_kc2")
        );
        assert_eq!(
            FinishL1Kernel::Rows.entry(3072),
            Some("moe_gemm_finish_l1_rows_kc3")
        );
        assert_eq!(FinishL1Kernel::Rows.entry(4112), None);
    }
}
