//! The DSV4 mHC boundary (kernels/mhc.cu, the tensor-core mix in kernels/mhc_mix_tc.cu): `hc_pre` fused with the
//! sub-layer's RMSNorm + quantization ([`mhc_pre`]), `hc_post` ([`mhc_post`]), `hc_post` fused into the next
//! boundary's `hc_pre` ([`mhc_post_then_pre`]) and the final `hc_head` ([`hc_head`]). The op-by-op chain the
//! fused boundary is measured against is [`bench::mhc_pre_unfused`].
//!
//! [`mhc_pre`] runs a split-K mix kernel and a per-token finish kernel; the launch path is chosen by token count
//! ([`mhc_pre_auto_path`]): a programmatic-dependent-launch pair at decode sizes, two plain launches at middle
//! sizes, the mix on BF16 tensor cores for prefill batches. [`mhc_pre_with`] forces one [`MhcPrePath`].
//!
//! Layouts: residual streams `X` of a token `[4, D]` BF16 stream-major (so `[T, 4, D]` for T tokens); mix weights
//! `F` `[24, 4D]` f32 (head: `[4, 4D]`); pre / post `[T, 4]` f32, comb `[T, 16]` f32 row-major `C[j][k]`, u `[T, D]`
//! BF16; the normalized u in the layouts of `ops::norm_quant`. The same `eps` is used for the residual RMS and
//! the sub-layer RMSNorm (both 1e-6 in DSV4). Shapes: `D % 128 == 0`, `D <= 16384`, any `T >= 1`.
//!
//! Every launcher takes the stream it enqueues on and a caller-owned [`MhcWorkspace`] (the split-K partials,
//! carved from an [`Arena`]); none allocates, and every grid depends only on `(T, D)`, so a captured boundary
//! replays with new data in the same buffers. Batches above [`MHC_LAUNCH_MAX_TOKENS`] (65535, the grid.y cap)
//! run as consecutive launches over token chunks ([`mhc_token_chunks`]), bit-identical to one launch.

pub mod bench;
pub mod exec;
pub mod reference;

pub use exec::exec_kernels;

use anyhow::{bail, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::gpu::arena::{Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
use crate::ops::norm_quant::{
    check_eps, check_len, check_rows, row_block_threads, upload_checked_bf16, upload_checked_f32,
    NormOutputs, OutFormat, QuantView, RowsOut,
};

/// Kernel family of the FFMA mixes, the finish kernels, hc_post and the op-by-op chain (kernels/mhc.cu).
pub const FAMILY: &str = "mhc";
/// Kernel family of the tensor-core mix (kernels/mhc_mix_tc.cu).
pub const TC_FAMILY: &str = "mhc_mix_tc";
/// Columns of 4D per CTA of the split-K FFMA mix kernels (`MIX_COLS`).
const MIX_COLS: usize = 128;
/// Tokens per CTA tile of the tensor-core mix (`kTileTokens` in kernels/mhc_mix_tc.cu).
const TC_MIX_TILE_TOKENS: usize = 128;
/// Columns of 4D per k-block of the tensor-core mix (`kBlockK`).
const TC_MIX_BLOCK_K: usize = 64;
/// Most K splits of the tensor-core mix (small batches: 1 tile x 64 splits of 4 k-blocks at D 4096).
const TC_MIX_MAX_SPLITS: usize = 64;
/// CTAs the tensor-core mix aims to fill: 2 resident per SM (100 KB of shared memory each) on the H200's 132.
const TC_MIX_TARGET_CTAS: usize = 2 * 132;
/// Dynamic shared memory of `mhc_mix_tc_partial24`: 4 stages x (16 KB X + 9 KB planes) + 1 KB alignment slack.
const TC_MIX_SMEM_BYTES: usize = 4 * (TC_MIX_TILE_TOKENS * 128 + 72 * 128) + 1024;

/// Mixes of a sub-layer boundary and of the head.
pub use reference::{HC_HEAD_MIX, HC_MIX};

/// Largest hidden size of the mHC kernels: the finish kernel uses up to 128 registers per thread, so its
/// D/32 threads must stay <= 512.
pub const MHC_MAX_D: usize = 16384;
/// Most tokens per mHC kernel launch. `mhc_post` and `mhc_unfused_apply` put the token on grid.y, which the
/// hardware caps at 65535; the other mHC kernels (token on grid.x, or token tiles on grid.y) would go further,
/// but every mHC launcher splits a batch into chunks of at most this many tokens ([`mhc_token_chunks`]) so that
/// one rule covers them all. Every mHC kernel is token-major and computes each token independently of the
/// others, so a chunk is the same kernel on pointers advanced by `t0` tokens with `T = n`: the outputs are
/// bit-identical to one launch over the whole batch (the layout of the partials included).
pub const MHC_LAUNCH_MAX_TOKENS: usize = 65535;

/// `(first token, token count)` of each launch chunk of a `tokens`-token batch ([`MHC_LAUNCH_MAX_TOKENS`]).
pub fn mhc_token_chunks(tokens: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..tokens)
        .step_by(MHC_LAUNCH_MAX_TOKENS)
        .map(move |t0| (t0, MHC_LAUNCH_MAX_TOKENS.min(tokens - t0)))
}

/// One mHC boundary's parameters on the device, plus the sub-layer's RMSNorm weight.
pub struct MhcWeights {
    pub d: usize,
    /// 24 for a sub-layer boundary, 4 for the head.
    pub nmix: usize,
    pub mix_fn: CudaSlice<f32>,
    /// The mix weights as three BF16 planes `[f1; f2; f3]`, `[3 nmix, 4D]` ([`mix_fn_bf16_planes`]:
    /// `f1 + f2 + f3 == F` exactly), the B operand of the tensor-core mix ([`MhcPrePath::TensorMix`]); sub-layer
    /// boundaries only (`None` for the head).
    pub mix_planes: Option<CudaSlice<bf16>>,
    pub scale: CudaSlice<f32>,
    pub base: CudaSlice<f32>,
    pub norm_weight: CudaSlice<bf16>,
}

impl MhcWeights {
    /// A sub-layer boundary (`hc_attn_*` / `hc_ffn_*`) and its RMSNorm weight (BF16-rounded on upload).
    pub fn upload(
        gpu: &Gpu,
        p: &reference::MhcParams,
        norm_weight: &[f32],
        d: usize,
    ) -> Result<MhcWeights> {
        check_d(d)?;
        check_len("hc mix fn", p.mix_fn.len(), HC_MIX * 4 * d)?;
        check_len("norm weight", norm_weight.len(), d)?;
        Ok(MhcWeights {
            d,
            nmix: HC_MIX,
            mix_fn: upload_checked_f32(gpu, "hc mix fn", &p.mix_fn)?,
            mix_planes: Some(gpu.upload(&mix_fn_bf16_planes(&p.mix_fn))?),
            scale: upload_checked_f32(gpu, "hc scale", &p.scale)?,
            base: upload_checked_f32(gpu, "hc base", &p.base)?,
            norm_weight: upload_checked_bf16(gpu, "norm weight", norm_weight)?,
        })
    }

    /// The final head (`hc_head_fn` [4, 4D], `hc_head_scale` [1], `hc_head_base` [4]) and `norm.weight`.
    pub fn upload_head(
        gpu: &Gpu,
        head_fn: &[f32],
        scale: f32,
        base: &[f32; 4],
        norm_weight: &[f32],
        d: usize,
    ) -> Result<MhcWeights> {
        check_d(d)?;
        check_len("hc head fn", head_fn.len(), HC_HEAD_MIX * 4 * d)?;
        check_len("norm weight", norm_weight.len(), d)?;
        Ok(MhcWeights {
            d,
            nmix: HC_HEAD_MIX,
            mix_fn: upload_checked_f32(gpu, "hc head fn", head_fn)?,
            mix_planes: None,
            scale: upload_checked_f32(gpu, "hc head scale", &[scale])?,
            base: upload_checked_f32(gpu, "hc head base", base)?,
            norm_weight: upload_checked_bf16(gpu, "norm weight", norm_weight)?,
        })
    }
}

/// Outputs of [`mhc_pre`] / [`hc_head`] for `tokens` tokens.
pub struct MhcPreOutputs {
    pub tokens: usize,
    pub d: usize,
    /// [T, 4]
    pub pre: CudaSlice<f32>,
    /// [T, 4] (unused by the head)
    pub post: CudaSlice<f32>,
    /// [T, 16], row-major C[j][k] (unused by the head)
    pub comb: CudaSlice<f32>,
    /// [T, D] BF16: the sub-layer input before its RMSNorm.
    pub u: CudaSlice<bf16>,
    /// RMSNorm(u; weight) in the requested format, and its rstd.
    pub normed: NormOutputs,
}

impl MhcPreOutputs {
    pub fn alloc_poisoned(
        gpu: &Gpu,
        format: OutFormat,
        tokens: usize,
        d: usize,
    ) -> Result<MhcPreOutputs> {
        check_rows(tokens, d)?;
        check_d(d)?;
        Ok(MhcPreOutputs {
            tokens,
            d,
            pre: gpu.poisoned(tokens * 4, 0xFF)?,
            post: gpu.poisoned(tokens * 4, 0xFF)?,
            comb: gpu.poisoned(tokens * 16, 0xFF)?,
            u: gpu.poisoned(tokens * d, 0xFF)?,
            normed: NormOutputs::alloc_poisoned(gpu, format, tokens, d)?,
        })
    }

    pub fn poison(&mut self, gpu: &Gpu) -> Result<()> {
        gpu.fill_bytes(&mut self.pre, 0xFF)?;
        gpu.fill_bytes(&mut self.post, 0xFF)?;
        gpu.fill_bytes(&mut self.comb, 0xFF)?;
        gpu.fill_bytes(&mut self.u, 0xFF)?;
        self.normed.poison(gpu)
    }
}

/// The caller-owned workspace of every mHC launcher: the split-K partials `[T, nmix+1, S]` f32, sized for up to
/// `tokens` tokens of `d` (24 mixes and `S = `[`mix_splits`]`(d)`, the most any path uses).
///
/// After a launch, entry `[t][j][s]` (the first `T (nmix+1) S` elements, `S = `[`partial_splits`]) is the partial
/// `F_j . x` over the columns of split `s` (`[128 s, 128 s + 128)` of 4D for the FFMA mixes, `[4D s / S, 4D (s+1)
/// / S)` for the tensor-core mix), `j = nmix` the partial sum of squares. Tests reduce them in the finish's order
/// to check the rest exactly.
#[derive(Debug, Clone, Copy)]
pub struct MhcWorkspace {
    pub tokens: usize,
    pub d: usize,
    pub partials: DevBuf<f32>,
}

impl MhcWorkspace {
    fn partial_elems(tokens: usize, d: usize) -> usize {
        mix_splits(d) * tokens * (HC_MIX + 1)
    }

    /// The carves of [`MhcWorkspace::carve`] for up to `tokens` tokens of `d`.
    pub fn layout(tokens: usize, d: usize) -> WorkspaceLayout {
        let mut l = WorkspaceLayout::new();
        l.add::<f32>(Self::partial_elems(tokens, d));
        l
    }

    /// Bytes of the workspace for up to `tokens` tokens of `d`.
    pub fn workspace_bytes(tokens: usize, d: usize) -> usize {
        Self::layout(tokens, d).bytes()
    }

    pub fn carve(arena: &mut Arena, tokens: usize, d: usize) -> Result<MhcWorkspace> {
        check_rows(tokens, d)?;
        check_d(d)?;
        Ok(MhcWorkspace {
            tokens,
            d,
            partials: arena.carve(Self::partial_elems(tokens, d), "mhc split-K partials")?,
        })
    }

    fn check(&self, tokens: usize, d: usize) -> Result<()> {
        if self.d != d || self.tokens < tokens {
            bail!(
                "mhc: the workspace is for up to {} tokens of D = {}, the call is {tokens} tokens of D = {d}",
                self.tokens,
                self.d
            );
        }
        Ok(())
    }
}

/// Split-K CTAs of the FFMA mixes over 4D (`4D / MIX_COLS`).
pub fn mix_splits(d: usize) -> usize {
    4 * d / MIX_COLS
}

/// S (splits per token) of the partials a launch of `path` leaves in the workspace: [`mix_splits`] for the
/// FFMA mixes (and [`hc_head`], [`mhc_post_then_pre`]), [`tc_mix_splits`] for the tensor-core mix.
pub fn partial_splits(path: MhcPrePath, tokens: usize, d: usize) -> usize {
    match path {
        MhcPrePath::TensorMix => tc_mix_splits(tokens, d),
        MhcPrePath::TwoLaunch | MhcPrePath::PdlPair => mix_splits(d),
    }
}

/// Token count from which [`mhc_pre`] takes [`MhcPrePath::TensorMix`] ([`mhc_pre_auto_path`]).
pub const MHC_TENSOR_MIX_MIN_TOKENS: usize = 128;

/// Largest token count for which [`mhc_pre`] launches the PDL pair.
pub const MHC_PDL_MAX_TOKENS: usize = 8;

/// K splits of the tensor-core mix for `tokens` tokens: the largest power of two `S <= 64` with
/// `ceil(tokens / 128) x S <= 264` (two CTAs per SM on 132 SMs; 1 from 33,792 tokens on) that divides the
/// `4D / 64` k-blocks and does not exceed [`mix_splits`] (the workspace is sized for that many).
/// 4096 tokens -> 8, 16384 -> 2, 65536 -> 1; 1..128 tokens -> 64.
pub fn tc_mix_splits(tokens: usize, d: usize) -> usize {
    let tiles = tokens.div_ceil(TC_MIX_TILE_TOKENS).max(1);
    let kblocks = 4 * d / TC_MIX_BLOCK_K;
    let mut s = 1;
    while s * 2 <= TC_MIX_MAX_SPLITS
        && tiles * s * 2 <= TC_MIX_TARGET_CTAS
        && kblocks.is_multiple_of(s * 2)
        && s * 2 <= mix_splits(d)
    {
        s *= 2;
    }
    s
}

/// The three BF16 planes of the mix weights F (`[nmix, 4D]` f32) as one `[3 nmix, 4D]` BF16 matrix
/// `[f1; f2; f3]`: `f1 = bf16_rn(F)`, `f2 = bf16_rn(F - f1)`, `f3 = bf16_rn(F - f1 - f2)`, with
/// `f1 + f2 + f3 == F` exactly for every F with 2^-110 <= |F| < 2^127 (2 - 2^-8) (above, f1 rounds to infinity),
/// and F = 0. Why (F in `[2^e, 2^(e+1))`, a multiple of `2^(e-23)`): `r1 = F - f1` is a multiple of `2^(e-23)` of
/// magnitude `<= 2^(e-8)` (half an 8-bit ulp), so it has <= 16 significant bits and the fp32 subtraction is exact;
/// `r2 = r1 - f2` likewise is a multiple of `2^(e-23)` of magnitude `<= 2^(e-16)`: <= 8 significant bits, exact in
/// fp32 and in BF16, so `f3 = r2`. (Only F so small that r2 falls below BF16's subnormal grid, 2^-133, loses bits.)
pub fn mix_fn_bf16_planes(mix_fn: &[f32]) -> Vec<bf16> {
    let f1: Vec<bf16> = mix_fn.iter().map(|&f| bf16::from_f32(f)).collect();
    let r1: Vec<f32> = mix_fn
        .iter()
        .zip(&f1)
        .map(|(&f, a)| f - a.to_f32())
        .collect();
    let f2: Vec<bf16> = r1.iter().map(|&r| bf16::from_f32(r)).collect();
    let f3 = r1
        .iter()
        .zip(&f2)
        .map(|(&r, b)| bf16::from_f32(r - b.to_f32()));
    f1.iter()
        .copied()
        .chain(f2.iter().copied())
        .chain(f3)
        .collect()
}

/// The mHC hidden-size rule: the row kernels' (`D % 128 == 0`) and `D <= MHC_MAX_D`.
fn check_d(d: usize) -> Result<()> {
    check_rows(1, d)?;
    if d > MHC_MAX_D {
        bail!("mhc: hidden size {d} is above the supported {MHC_MAX_D}");
    }
    Ok(())
}

/// The checks every boundary launcher shares: shape, weights' D and mix count, X's length, eps.
fn check_boundary(
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    eps: f32,
    out: &MhcPreOutputs,
    nmix: usize,
    what: &str,
) -> Result<()> {
    check_d(out.d)?;
    check_rows(out.tokens, out.d)?;
    check_eps(eps)?;
    if w.d != out.d {
        bail!(
            "{what}: weights are for D = {}, outputs for D = {}",
            w.d,
            out.d
        );
    }
    if w.nmix != nmix {
        bail!(
            "{what} needs weights with {nmix} mixes, got {} (sub-layer weights: 24, head weights: 4)",
            w.nmix
        );
    }
    if out.normed.rows != out.tokens || out.normed.d != out.d {
        bail!("{what}: the normalized outputs are not [tokens, D]");
    }
    check_len("X", x.elems(), out.tokens * 4 * out.d)
}

/// How the two kernels of the fused mHC boundary are launched ([`mhc_pre`] picks one by token count,
/// [`mhc_pre_auto_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MhcPrePath {
    /// `mhc_mix_partial24_staged` then `mhc_pre_finish_*`, plain stream-ordered launches.
    TwoLaunch,
    /// `mhc_mix_partial24_pdl` then `mhc_pre_finish_pdl_*`: the same arithmetic (bit-identical outputs), both
    /// launched with programmatic dependent launch (PDL): the finish grid is scheduled while the mix runs and
    /// waits on the device (`griddepcontrol.wait`) for the mix to complete; a following PDL mix stages its weight
    /// tile while the previous finish runs. Needs sm_90 and a driver that captures PDL launches into graphs
    /// (CUDA >= 12.3).
    PdlPair,
    /// `mhc_mix_tc_partial24` (kernels/mhc_mix_tc.cu: the 24 mixes as a BF16 tensor-core GEMM of X against the
    /// three BF16 planes of F, [`MhcWeights::mix_planes`]; [`tc_mix_splits`] K splits) then `mhc_pre_finish_*`,
    /// plain launches. NOT bit-identical to the other paths: the dots are sums of the same exact products in
    /// another order (tensor-core block accumulation, see the kernel header), so pre/post/C/u may differ in the
    /// last bits.
    TensorMix,
}

/// The launch path [`mhc_pre`] takes for `tokens` tokens: [`MhcPrePath::PdlPair`] up to [`MHC_PDL_MAX_TOKENS`],
/// [`MhcPrePath::TwoLaunch`] above, [`MhcPrePath::TensorMix`] from [`MHC_TENSOR_MIX_MIN_TOKENS`].
///
/// Decided on the H200 with the forcing variants of `bench::MHC_VARIANTS` (`graph16_fused_pdl_*`,
/// `graph16_fused_twolaunch_*`, `fused_tc_*`, `fused_twolaunch_*`):
/// * PDL pair vs two launches (16 boundaries in one graph, us per boundary, results/h200/mhc.csv): the pair wins
///   at 1 token (D 4096 NVFP4: 7.3 vs 8.3) and ties at 8; from 16 tokens it loses (11.0 vs 10.3; 64: 27.7 vs
///   15.3): the finish grid (two CTAs per token) is resident and waiting while the mix runs and holds the SM
///   resources the mix's CTAs would use.
/// * Tensor-core mix vs the FFMA two-launch path (plain launches, NVFP4, results/h200/archive/session14-ab/mhc-c7c9893.csv):
///   the tensor-core mix wins at every measured token count from 128, the smallest measured (D 4096: 20.5 vs
///   27.3 us at 128 tokens, 2137 vs 7620 at 65536; D 7168 alike; FP8 alike). 64 .. 127 tokens were not measured
///   with it, so the decode-tuned FFMA paths keep them.
pub fn mhc_pre_auto_path(tokens: usize) -> MhcPrePath {
    if tokens <= MHC_PDL_MAX_TOKENS {
        MhcPrePath::PdlPair
    } else if tokens < MHC_TENSOR_MIX_MIN_TOKENS {
        MhcPrePath::TwoLaunch
    } else {
        MhcPrePath::TensorMix
    }
}

/// Fused mHC boundary: `(pre, post, C, u) = hc_pre(X)`, then `RMSNorm(u; weight)` in `out.normed.format`, on
/// `stream`, with the split-K partials in `ws`. `x` is `[T, 4, D]` with `T = out.tokens`. The launch path is
/// chosen by token count ([`mhc_pre_auto_path`]); the FFMA paths give the same bits, the tensor-core mix sums the
/// same exact products in another order.
pub fn mhc_pre(
    gpu: &Gpu,
    stream: &Stream,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    eps: f32,
    ws: &MhcWorkspace,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    let path = mhc_pre_auto_path(out.tokens);
    mhc_pre_with(gpu, stream, x, w, eps, ws, out, path)
}

/// [`mhc_pre`] with an explicit launch path ([`MhcPrePath`]); outputs are bit-identical across paths, except
/// [`MhcPrePath::TensorMix`] (same exact products summed in another order; see its doc).
#[allow(clippy::too_many_arguments)]
pub fn mhc_pre_with(
    gpu: &Gpu,
    stream: &Stream,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    eps: f32,
    ws: &MhcWorkspace,
    out: &mut MhcPreOutputs,
    path: MhcPrePath,
) -> Result<()> {
    mhc_pre_copies_with(
        gpu,
        stream,
        x,
        w,
        eps,
        ws,
        out,
        NormCopies::NONE,
        None,
        path,
    )
}

/// Quantized copies of the BF16 `RMSNorm(u)` that the finish kernel of [`mhc_pre_copies`] writes beside it, from
/// the BF16 values it has just stored: `fp8` (FP8 1x128, ue8m0 scales) and `nvfp4` (NVFP4 with a per-row global
/// scale), each `[T, D]` in the layouts of `ops::norm_quant`, and each bit for bit what
/// [`crate::ops::norm_quant::quantize_bf16_rows`] writes from that BF16 output (one codec: common/norm_row.cuh's
/// `quant_row_fp8` / `quant_row_nvfp4`). Their `rstd` is not written (as `quantize_bf16_rows` leaves it).
#[derive(Debug, Clone, Copy, Default)]
pub struct NormCopies<'a> {
    pub fp8: Option<&'a RowsOut>,
    pub nvfp4: Option<&'a RowsOut>,
}

impl NormCopies<'_> {
    /// No copies: [`mhc_pre_with`].
    pub const NONE: NormCopies<'static> = NormCopies {
        fp8: None,
        nvfp4: None,
    };

    /// The finish kernel's name suffix: `""`, `"_q8"`, `"_q4"` or `"_q8q4"`.
    fn suffix(&self) -> &'static str {
        match (self.fp8.is_some(), self.nvfp4.is_some()) {
            (false, false) => "",
            (true, false) => "_q8",
            (false, true) => "_q4",
            (true, true) => "_q8q4",
        }
    }

    /// Each copy is `[tokens, d]` in its own format, and copies need the BF16 output.
    fn check(&self, out: &MhcPreOutputs) -> Result<()> {
        if self.suffix().is_empty() {
            return Ok(());
        }
        if out.normed.format != OutFormat::Bf16 {
            bail!(
                "mhc_pre: quantized copies are of the BF16 RMSNorm(u); the outputs are {}",
                out.normed.format.name()
            );
        }
        for (what, copy, format) in [
            ("fp8", self.fp8, OutFormat::Fp8),
            ("nvfp4", self.nvfp4, OutFormat::Nvfp4),
        ] {
            let Some(c) = copy else { continue };
            if c.format != format || c.rows != out.tokens || c.d != out.d {
                bail!(
                    "mhc_pre: the {what} copy is {} [{}, {}], the call needs {} [{}, {}]",
                    c.format.name(),
                    c.rows,
                    c.d,
                    format.name(),
                    out.tokens,
                    out.d
                );
            }
        }
        Ok(())
    }

    /// The copy parameters from row `t0` on: `(q8, s8, q4, s4, g4)`, null where absent.
    fn push(&self, a: &mut KernelArgs, t0: usize) {
        if self.suffix().is_empty() {
            return;
        }
        match self.fp8 {
            Some(c) => c.push(a, t0, false),
            None => {
                a.null().null();
            }
        }
        match self.nvfp4 {
            Some(c) => c.push(a, t0, false),
            None => {
                a.null().null().null();
            }
        }
    }
}

/// [`mhc_pre`] (the automatic launch path) that also writes `copies` of the BF16 `RMSNorm(u)` in its finish kernel
/// (`mhc_pre_finish[_pdl]_bf16_{q8,q4,q8q4}`): one launch instead of `mhc_pre` + one [`quantize_bf16_rows`]
/// per copy, with the same bits. `out` must be BF16.
///
/// [`quantize_bf16_rows`]: crate::ops::norm_quant::quantize_bf16_rows
#[allow(clippy::too_many_arguments)]
pub fn mhc_pre_copies(
    gpu: &Gpu,
    stream: &Stream,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    eps: f32,
    ws: &MhcWorkspace,
    out: &mut MhcPreOutputs,
    copies: NormCopies,
    prior: Option<&PriorPost>,
) -> Result<()> {
    let path = mhc_pre_auto_path(out.tokens);
    mhc_pre_copies_with(gpu, stream, x, w, eps, ws, out, copies, prior, path)
}

/// The previous sub-layer's `hc_post`, left to the next boundary: with it, [`mhc_pre_copies`] first writes its
/// `x` as `post (x) y + comb^T x_prev` (as [`mhc_post`], bit for bit). On the FFMA mix paths that happens inside
/// the mix kernel (`mhc_post_mix_partial24[_pdl]`, which mixes the values it stores: one launch and one read of X
/// fewer); on the tensor-core path [`mhc_post`] runs first. `y` `[T, D]`, `x_prev` `[T, 4, D]`, `post` `[T, 4]`,
/// `comb` `[T, 16]` (the previous boundary's).
#[derive(Clone, Copy, Debug)]
pub struct PriorPost {
    pub y: DevBuf<bf16>,
    pub x_prev: DevBuf<bf16>,
    pub post: DevBuf<f32>,
    pub comb: DevBuf<f32>,
}

/// [`mhc_pre_copies`] with an explicit launch path.
#[allow(clippy::too_many_arguments)]
pub fn mhc_pre_copies_with(
    gpu: &Gpu,
    stream: &Stream,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    eps: f32,
    ws: &MhcWorkspace,
    out: &mut MhcPreOutputs,
    copies: NormCopies,
    prior: Option<&PriorPost>,
    path: MhcPrePath,
) -> Result<()> {
    check_boundary(x, w, eps, out, HC_MIX, "mhc_pre")?;
    ws.check(out.tokens, out.d)?;
    copies.check(out)?;
    let (tokens, d) = (out.tokens, out.d);
    if let Some(p) = prior {
        check_post_lens(&p.y, x, &p.post, &p.comb, tokens, d)?;
        check_len("X of the prior hc_post", p.x_prev.elems(), tokens * 4 * d)?;
        ensure!(
            p.x_prev.device_addr() != x.device_addr(),
            "mhc_pre: the prior hc_post's X and its output must be different buffers"
        );
        if path == MhcPrePath::TensorMix {
            mhc_post(gpu, stream, &p.y, &p.x_prev, &p.post, &p.comb, tokens, d, x)?;
        }
    }
    let splits = partial_splits(path, tokens, d);
    // Per chunk (one chunk up to MHC_LAUNCH_MAX_TOKENS tokens): the mix, then the finish on its partials.
    // PDL pair: each kernel may start before its predecessor completes and waits on the device
    // (griddepcontrol.wait) before reading it; a chunk's mix writes only its own tokens' partials, which the
    // previous chunk's finish does not read. Tensor-core mix: one S for the whole batch (so the partials are one
    // [T, 25, S] array): S only depends on the tile count below 33,792 tokens and is 1 above, so every chunk of
    // a split batch fills the GPU.
    let (finish, pdl) = match path {
        MhcPrePath::TwoLaunch | MhcPrePath::TensorMix => ("mhc_pre_finish", false),
        MhcPrePath::PdlPair => ("mhc_pre_finish_pdl", true),
    };
    let finish = gpu.kernel(
        FAMILY,
        &format!("{finish}_{}{}", out.normed.format.name(), copies.suffix()),
    )?;
    let normed = out.normed.view();
    for chunk in mhc_token_chunks(tokens) {
        match (path, prior) {
            (MhcPrePath::TwoLaunch, Some(p)) => launch_mix(
                gpu,
                stream,
                "mhc_post_mix_partial24",
                Some(p),
                x,
                w,
                ws,
                chunk,
                false,
            )?,
            (MhcPrePath::PdlPair, Some(p)) => launch_mix(
                gpu,
                stream,
                "mhc_post_mix_partial24_pdl",
                Some(p),
                x,
                w,
                ws,
                chunk,
                true,
            )?,
            (MhcPrePath::TensorMix, _) => launch_tc_mix(gpu, stream, x, w, ws, splits, chunk)?,
            (MhcPrePath::TwoLaunch, None) => launch_mix(
                gpu,
                stream,
                "mhc_mix_partial24_staged",
                None,
                x,
                w,
                ws,
                chunk,
                false,
            )?,
            (MhcPrePath::PdlPair, None) => launch_mix(
                gpu,
                stream,
                "mhc_mix_partial24_pdl",
                None,
                x,
                w,
                ws,
                chunk,
                true,
            )?,
        }
        let mut a = KernelArgs::new();
        finish_args(&mut a, x, w, eps, ws, splits, out, chunk);
        normed.push(&mut a, chunk.0, true);
        copies.push(&mut a, chunk.0);
        let l = Launch::new((chunk.1 as u32, 2, 1), (row_block_threads(d), 1, 1)).pdl(pdl);
        unsafe { launch(stream, &finish, l, &mut a) }?;
    }
    Ok(())
}

/// One split-K FFMA mix kernel (`name`: `mhc_mix_partial4` for the head's 4 mixes, `mhc_mix_partial24_staged` /
/// `_pdl` for a boundary's 24; with a `prior`, `mhc_post_mix_partial24[_pdl]`, which first writes X' into `x`) over
/// tokens `[t0, t0 + n)`: parameters `(X, F, part, T, 4D)` (with a prior `(y, X_prev, post, comb, X', F, part, T,
/// D)`), grid `[S, ceil(n/32)]`, block 128. `part` is the `[T, nmix+1, S]` array of the whole batch.
#[allow(clippy::too_many_arguments)]
fn launch_mix(
    gpu: &Gpu,
    stream: &Stream,
    name: &str,
    prior: Option<&PriorPost>,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    ws: &MhcWorkspace,
    (t0, n): (usize, usize),
    pdl: bool,
) -> Result<()> {
    let (d, splits) = (w.d, mix_splits(w.d));
    let k = gpu.kernel(FAMILY, name)?;
    let mut a = KernelArgs::new();
    match prior {
        // (y, X, post, comb, Xout, F, part, T, D): X' is written into `x`.
        Some(p) => post_args(&mut a, &p.y, &p.x_prev, &p.post, &p.comb, x, t0, d),
        // (X, F, part, T, 4D)
        None => a.buf_at(x, t0 * 4 * d),
    }
    .buf(&w.mix_fn)
    .buf_at(&ws.partials, t0 * (w.nmix + 1) * splits)
    .i32(n as i32)
    .i32(if prior.is_some() { d } else { 4 * d } as i32);
    let l = Launch::new((splits as u32, n.div_ceil(32) as u32, 1), (128, 1, 1)).pdl(pdl);
    // SAFETY: the lengths were checked by the callers (check_boundary, and check_post_lens with a prior); the
    // parameter lists and grid are the kernels' (kernels/mhc.cu).
    unsafe { launch(stream, &k, l, &mut a) }
}

/// The tensor-core mix (`mhc_mix_tc_partial24`) over tokens `[t0, t0 + n)`: parameters `(X, planes, part, T,
/// 4D)`, grid `[splits, ceil(n/128)]`, 256 threads, [`TC_MIX_SMEM_BYTES`] of dynamic shared memory. `part` is the
/// `[T, 25, splits]` array of the whole batch.
fn launch_tc_mix(
    gpu: &Gpu,
    stream: &Stream,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    ws: &MhcWorkspace,
    splits: usize,
    (t0, n): (usize, usize),
) -> Result<()> {
    let d = w.d;
    let Some(planes) = &w.mix_planes else {
        bail!("mhc tensor-core mix: the weights have no BF16 planes (head weights?)");
    };
    let kblocks = 4 * d / TC_MIX_BLOCK_K;
    if splits == 0
        || !(4 * d).is_multiple_of(TC_MIX_BLOCK_K)
        || !kblocks.is_multiple_of(splits)
        || splits > mix_splits(d)
    {
        bail!(
            "mhc tensor-core mix: {splits} splits do not divide the {kblocks} k-blocks of 4D = {}",
            4 * d
        );
    }
    let k = gpu.kernel_with_smem(TC_FAMILY, "mhc_mix_tc_partial24", TC_MIX_SMEM_BYTES)?;
    let mut a = KernelArgs::new();
    a.buf_at(x, t0 * 4 * d)
        .buf(planes)
        .buf_at(&ws.partials, t0 * (HC_MIX + 1) * splits)
        .i32(n as i32)
        .i32((4 * d) as i32);
    let grid = (splits as u32, n.div_ceil(TC_MIX_TILE_TOKENS) as u32, 1);
    let l = Launch::new(grid, (256, 1, 1)).smem(TC_MIX_SMEM_BYTES);
    unsafe { launch(stream, &k, l, &mut a) }
}

/// The finish kernels' parameters before the normalized rows, from token `t0` on: `(X, part, S, T, D, hc_scale,
/// hc_base, w, eps, pre, post, comb, u)`.
#[allow(clippy::too_many_arguments)]
fn finish_args(
    a: &mut KernelArgs,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    eps: f32,
    ws: &MhcWorkspace,
    splits: usize,
    out: &MhcPreOutputs,
    (t0, n): (usize, usize),
) {
    let d = out.d;
    a.buf_at(x, t0 * 4 * d)
        .buf_at(&ws.partials, t0 * (HC_MIX + 1) * splits)
        .i32(splits as i32)
        .i32(n as i32)
        .i32(d as i32)
        .buf(&w.scale)
        .buf(&w.base)
        .buf(&w.norm_weight)
        .f32(eps)
        .buf_at(&out.pre, t0 * 4)
        .buf_at(&out.post, t0 * 4)
        .buf_at(&out.comb, t0 * 16)
        .buf_at(&out.u, t0 * d);
}

/// `hc_post` of one sub-layer fused with `hc_pre` of the next, on the two-launch path: `x_out = post (x) y +
/// comb^T x` (as [`mhc_post`], bit for bit) is computed inside the split-K mix kernel (`mhc_post_mix_partial24`),
/// which feeds it to the next boundary's dots; then the two-launch finish kernel of [`mhc_pre`] (reading `x_out`).
/// Two launches instead of three, and X' is not re-read for the mixes. `post`/`comb` are the previous boundary's;
/// `y` `[T, D]`, `x` / `x_out` `[T, 4, D]`, `post` `[T, 4]`, `comb` `[T, 16]`. [`mhc_pre_copies`] with a
/// [`PriorPost`] is the same on the automatic path, with copies.
#[allow(clippy::too_many_arguments)]
pub fn mhc_post_then_pre(
    gpu: &Gpu,
    stream: &Stream,
    y: &impl DeviceBuf<bf16>,
    x: &impl DeviceBuf<bf16>,
    post: &impl DeviceBuf<f32>,
    comb: &impl DeviceBuf<f32>,
    w: &MhcWeights,
    eps: f32,
    ws: &MhcWorkspace,
    x_out: &impl DeviceBuf<bf16>,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    let prior = PriorPost {
        y: DevBuf::of(y),
        x_prev: DevBuf::of(x),
        post: DevBuf::of(post),
        comb: DevBuf::of(comb),
    };
    mhc_pre_copies_with(
        gpu,
        stream,
        x_out,
        w,
        eps,
        ws,
        out,
        NormCopies::NONE,
        Some(&prior),
        MhcPrePath::TwoLaunch,
    )
}

/// `hc_head`: pre = sigmoid mixes (no Sinkhorn), u = sum pre_i X_i (BF16), then RMSNorm(u; norm.weight) as BF16
/// into `out.normed` (which must be BF16). `post` and `comb` are not written. Kernels: `mhc_mix_partial4` (the
/// broadcast-load mix, lane = token) and `mhc_head_finish_bf16`.
pub fn hc_head(
    gpu: &Gpu,
    stream: &Stream,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    eps: f32,
    ws: &MhcWorkspace,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    check_boundary(x, w, eps, out, HC_HEAD_MIX, "hc_head")?;
    ws.check(out.tokens, out.d)?;
    let (tokens, d) = (out.tokens, out.d);
    let normed = out.normed.view();
    let QuantView::Bf16 { y } = normed.q else {
        bail!("hc_head writes BF16: allocate the outputs with OutFormat::Bf16")
    };
    let splits = mix_splits(d);
    let finish = gpu.kernel(FAMILY, "mhc_head_finish_bf16")?;
    for (t0, n) in mhc_token_chunks(tokens) {
        launch_mix(
            gpu,
            stream,
            "mhc_mix_partial4",
            None,
            x,
            w,
            ws,
            (t0, n),
            false,
        )?;
        // (X, part, S, T, D, hc_scale, hc_base, w, eps, pre, u, y, rstd)
        let mut a = KernelArgs::new();
        a.buf_at(x, t0 * 4 * d)
            .buf_at(&ws.partials, t0 * (HC_HEAD_MIX + 1) * splits)
            .i32(splits as i32)
            .i32(n as i32)
            .i32(d as i32)
            .buf(&w.scale)
            .buf(&w.base)
            .buf(&w.norm_weight)
            .f32(eps)
            .buf_at(&out.pre, t0 * 4)
            .buf_at(&out.u, t0 * d)
            .buf_at(&y, t0 * d)
            .buf_at(&normed.rstd, t0);
        let l = Launch::new((n as u32, 1, 1), (row_block_threads(d), 1, 1));
        unsafe { launch(stream, &finish, l, &mut a) }?;
    }
    Ok(())
}

/// The lengths of hc_post's inputs besides X: y [T, D], X out [T, 4, D], post [T, 4], comb [T, 16].
fn check_post_lens(
    y: &impl DeviceBuf<bf16>,
    x_out: &impl DeviceBuf<bf16>,
    post: &impl DeviceBuf<f32>,
    comb: &impl DeviceBuf<f32>,
    tokens: usize,
    d: usize,
) -> Result<()> {
    check_len("y", y.elems(), tokens * d)?;
    check_len("X out", x_out.elems(), tokens * 4 * d)?;
    check_len("post", post.elems(), tokens * 4)?;
    check_len("comb", comb.elems(), tokens * 16)
}

/// hc_post's first five kernel parameters from token t0 on: y, X, post, comb, X out.
#[allow(clippy::too_many_arguments)]
fn post_args<'a>(
    a: &'a mut KernelArgs,
    y: &impl DeviceBuf<bf16>,
    x: &impl DeviceBuf<bf16>,
    post: &impl DeviceBuf<f32>,
    comb: &impl DeviceBuf<f32>,
    x_out: &impl DeviceBuf<bf16>,
    t0: usize,
    d: usize,
) -> &'a mut KernelArgs {
    a.buf_at(y, t0 * d)
        .buf_at(x, t0 * 4 * d)
        .buf_at(post, t0 * 4)
        .buf_at(comb, t0 * 16)
        .buf_at(x_out, t0 * 4 * d)
}

/// `hc_post`: `x_out[t][k] = post[t][k] y[t] + sum_j comb[t][j][k] x[t][j]` (fp32, BF16 store), kernel
/// `mhc_post`. `y` [T, D], `x`/`x_out` [T, 4, D], `post` [T, 4], `comb` [T, 16].
#[allow(clippy::too_many_arguments)]
pub fn mhc_post(
    gpu: &Gpu,
    stream: &Stream,
    y: &impl DeviceBuf<bf16>,
    x: &impl DeviceBuf<bf16>,
    post: &impl DeviceBuf<f32>,
    comb: &impl DeviceBuf<f32>,
    tokens: usize,
    d: usize,
    x_out: &impl DeviceBuf<bf16>,
) -> Result<()> {
    check_rows(tokens, d)?;
    check_len("X", x.elems(), tokens * 4 * d)?;
    check_post_lens(y, x_out, post, comb, tokens, d)?;
    let k = gpu.kernel(FAMILY, "mhc_post")?;
    // (y, X, post, comb, Xout, D); grid [D/8/64, n]: the token on grid.y (at most 65535 per launch).
    for (t0, n) in mhc_token_chunks(tokens) {
        let mut a = KernelArgs::new();
        post_args(&mut a, y, x, post, comb, x_out, t0, d).i32(d as i32);
        let l = Launch::new(((d / 8).div_ceil(64) as u32, n as u32, 1), (64, 1, 1));
        unsafe { launch(stream, &k, l, &mut a) }?;
    }
    Ok(())
}
