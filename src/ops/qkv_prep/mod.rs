//! The attention side between the dense linears and the attention / indexer kernels (DSV4 §3.6, §3.8):
//! `kernels/qkv_prep.cu` (design, rounding points and the identities the indexer output rests on at its top).
//! The CPU oracle is `Model::attn_projections` through its per-token steps in `model::reference`
//! ([`q_heads_finish`](crate::model::reference::q_heads_finish),
//! [`window_kv_rope`](crate::model::reference::window_kv_rope),
//! [`indexer_q_rotate`](crate::model::reference::indexer_q_rotate),
//! [`indexer_head_weights`](crate::model::reference::indexer_head_weights)); [`reference`] runs them over rows.
//!
//! For `rows` token rows (a capacity) with positions `positions[rows]` i32 read on the device (a position < 0
//! marks an empty row, which writes nothing):
//! * [`q_lora_norm`]: `qa [rows, q_lora]` BF16 (wq_a out) -> `qr = rms_norm_bf16(qa, q_norm)` as the FP8 1x128
//!   activation wq_b and the indexer's wq_b read (norm_quant's FP8 row kernel; it writes every row).
//! * [`q_heads`]: `q [rows, heads, 512]` BF16 (wq_b out) -> per-head RMS without weight in the official BF16 op
//!   order ([`head_rms_scale_bf16`](crate::model::numerics::head_rms_scale_bf16)), RoPE on dims 448..511, BF16
//!   -> `q_out [rows, heads, 512]` BF16, the layout `sparse_attn::decode` reads; the factor `rstd [rows, heads]`
//!   (a BF16 value stored as f32).
//! * [`kv_entries`]: `kv [rows, 512]` BF16 (wkv out) -> RMSNorm(kv_norm), RoPE, FP8 entry (584 B,
//!   `formats::kv`) at pool entry `seq_base[row / tokens_per_seq] + position % window`; `rstd [rows]` f32.
//! * [`indexer_q`]: `qi [rows, index_heads, 128]` BF16 (indexer wq_b out) and `w [rows, index_heads]` BF16
//!   (weights_proj out) -> the indexer's query: e4m3 codes `[rows, index_heads, 128]` and f32 head weights
//!   `[rows, index_heads]` with the per-head power-of-two q scale folded in (`indexer::QueryBatch` layout).
//!
//! Every launcher takes the stream it enqueues on, allocates nothing (no workspace), and shapes its grid from the
//! row capacity only: a captured call replays with new positions, pool bases and data in the same buffers.

pub mod bench;
pub mod exec;
pub mod reference;

pub use exec::exec_kernels;

use anyhow::{ensure, Result};
use half::bf16;

use crate::gpu::launch::{launch, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
use crate::ops::norm_quant::{self, OutFormat, RowsIn, RowsOut};

/// Kernel family name (kernels/qkv_prep.cu).
pub const FAMILY: &str = "qkv_prep";
/// Dims of a query head and of a KV vector.
pub const HEAD_DIM: usize = 512;
/// Leading dims without RoPE (FP8 in the KV entry).
pub const NOPE_DIM: usize = 448;
/// Trailing dims with RoPE; the kernels take `ROPE_DIM / 2` f64 frequencies (`RopeTable::freqs`).
pub const ROPE_DIM: usize = 64;
/// Dims of an indexer head (its last `ROPE_DIM` carry RoPE).
pub const INDEX_HEAD_DIM: usize = 128;
/// Bytes of one KV cache entry.
pub const ENTRY_BYTES: usize = crate::formats::kv::ENTRY_BYTES;
/// Heads (warps) per CTA of the per-head kernels.
const HEADS_PER_CTA: usize = 8;
/// The grid's y limit: the per-head kernels put rows on y.
pub const MAX_ROWS: usize = 65_535;

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    ensure!(
        got == want,
        "qkv_prep: `{what}` has {got} elements, expected {want}"
    );
    Ok(())
}

/// Row-count and head-count rules of the per-head kernels: `1 <= rows <= 65535`, `heads >= 1` (and the element
/// counts fit the kernels' index arithmetic).
pub fn check_rows_heads(rows: usize, heads: usize) -> Result<()> {
    ensure!(
        (1..=MAX_ROWS).contains(&rows),
        "qkv_prep: rows = {rows} must be in 1..={MAX_ROWS}"
    );
    ensure!(
        (1..=4096).contains(&heads),
        "qkv_prep: heads = {heads} must be in 1..=4096"
    );
    Ok(())
}

fn check_eps(eps: f32) -> Result<()> {
    ensure!(
        eps.is_finite() && eps > 0.0,
        "qkv_prep: eps must be finite and > 0, got {eps}"
    );
    Ok(())
}

/// `qr = rms_norm_bf16(qa, q_norm)` of `out.rows` rows of `q_lora = out.d` written as FP8 1x128 (e4m3 codes
/// `[rows, q_lora]`, ue8m0 scale codes `[rows, q_lora / 128]`, the rstd `[rows]`): norm_quant's row kernel
/// ([`norm_quant::rmsnorm_quant_into`]), the activation format of the FP8 linears wq_b and indexer wq_b read.
/// Writes every row (positions are not read).
pub fn q_lora_norm(
    gpu: &Gpu,
    stream: &Stream,
    qa: &impl DeviceBuf<bf16>,
    q_norm: &impl DeviceBuf<bf16>,
    eps: f32,
    out: &RowsOut,
) -> Result<()> {
    ensure!(
        out.format == OutFormat::Fp8,
        "qkv_prep: q_lora_norm writes FP8 (the wq_b activation), not {}",
        out.format.name()
    );
    norm_quant::rmsnorm_quant_into(gpu, stream, RowsIn::Bf16(qa), q_norm, eps, out)
}

/// The q-heads part of a [`prep`] launch: `q_in [rows, heads, 512]` BF16 -> `q_out` (same layout, BF16) and the
/// per-head RMS factor `rstd [rows, heads]` f32 ([`q_heads`] has the rule).
#[derive(Clone, Copy)]
pub struct QHeads<'a> {
    pub q_in: &'a dyn DeviceBuf<bf16>,
    pub heads: usize,
    pub q_out: &'a dyn DeviceBuf<bf16>,
    pub rstd: &'a dyn DeviceBuf<f32>,
}

/// The kv-entries part of a [`prep`] launch: `kv_in [rows, 512]` BF16 with `kv_norm [512]` BF16 into the window
/// ring, `rstd [rows]` f32 ([`kv_entries`] has the rule).
#[derive(Clone, Copy)]
pub struct KvEntries<'a> {
    pub kv_in: &'a dyn DeviceBuf<bf16>,
    pub kv_norm: &'a dyn DeviceBuf<bf16>,
    pub ring: &'a WindowRing<'a>,
    pub rstd: &'a dyn DeviceBuf<f32>,
}

/// The indexer-query part of a [`prep`] launch ([`indexer_q`] has the rule).
#[derive(Clone, Copy)]
pub struct IndexerQ<'a> {
    pub qi: &'a dyn DeviceBuf<bf16>,
    pub w_in: &'a dyn DeviceBuf<f32>,
    pub heads: usize,
    pub w_scale: f32,
    pub q_codes: &'a dyn DeviceBuf<u8>,
    pub w_out: &'a dyn DeviceBuf<f32>,
    pub visible: Option<VisibleKeys<'a>>,
}

/// One `qkv_prep_attn` launch over `rows` rows at `positions` with the layer's RoPE table `freqs` (32 f64): any of
/// the three parts, each a range of the grid's CTAs. The engine's projections run all three in one launch; each
/// part's own launcher ([`q_heads`], [`kv_entries`], [`indexer_q`]) is this with the others absent. Every warp runs
/// the code of its part alone, so a merged launch writes the bits of the separate ones.
#[derive(Clone, Copy)]
pub struct Prep<'a> {
    pub rows: usize,
    pub positions: &'a dyn DeviceBuf<i32>,
    pub freqs: &'a dyn DeviceBuf<f64>,
    pub eps: f32,
    pub q: Option<QHeads<'a>>,
    pub kv: Option<KvEntries<'a>>,
    pub index: Option<IndexerQ<'a>>,
}

impl<'a> Prep<'a> {
    /// A launch over `rows` rows with no part yet (the caller sets `q`, `kv`, `index`).
    pub fn over(
        rows: usize,
        positions: &'a dyn DeviceBuf<i32>,
        freqs: &'a dyn DeviceBuf<f64>,
        eps: f32,
    ) -> Prep<'a> {
        Prep {
            rows,
            positions,
            freqs,
            eps,
            q: None,
            kv: None,
            index: None,
        }
    }
}

/// The kernel's parameter block (`PrepParams` in kernels/qkv_prep.cu, same field order; 168 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PrepParams {
    positions: u64,
    freqs: u64,
    q_in: u64,
    q_out: u64,
    q_rstd: u64,
    kv_in: u64,
    kv_norm: u64,
    seq_base: u64,
    pool: u64,
    kv_rstd: u64,
    qi_in: u64,
    w_in: u64,
    q_codes: u64,
    w_out: u64,
    num_valid: u64,
    rows: i32,
    heads: i32,
    index_heads: i32,
    tokens_per_seq: i32,
    window: i32,
    n_entries: i32,
    ratio: i32,
    eps: f32,
    w_scale: f32,
    q_ctas: i32,
    kv_ctas: i32,
    index_ctas: i32,
}
const _: () = assert!(std::mem::size_of::<PrepParams>() == 168);

fn check_align<T>(what: &str, b: &dyn DeviceBuf<T>, align: u64) -> Result<()> {
    ensure!(
        b.device_addr().is_multiple_of(align),
        "qkv_prep: `{what}` at {:#x} is not {align}-byte aligned",
        b.device_addr()
    );
    Ok(())
}

/// Checks every part of `p` (the rules of [`q_heads`], [`kv_entries`], [`indexer_q`]) and launches them as one grid.
pub fn prep(gpu: &Gpu, stream: &Stream, p: &Prep) -> Result<()> {
    let rows = p.rows;
    check_rows_heads(rows, 1)?;
    check_len("positions", p.positions.elems(), rows)?;
    check_len("freqs", p.freqs.elems(), ROPE_DIM / 2)?;
    let mut k = PrepParams {
        positions: p.positions.device_addr(),
        freqs: p.freqs.device_addr(),
        rows: rows as i32,
        eps: p.eps,
        ratio: 1,
        tokens_per_seq: 1,
        window: 1,
        ..Default::default()
    };
    if p.q.is_some() || p.kv.is_some() {
        check_eps(p.eps)?;
    }
    if let Some(q) = &p.q {
        check_rows_heads(rows, q.heads)?;
        check_len("q_in", q.q_in.elems(), rows * q.heads * HEAD_DIM)?;
        check_len("q_out", q.q_out.elems(), rows * q.heads * HEAD_DIM)?;
        check_len("rstd", q.rstd.elems(), rows * q.heads)?;
        check_align("q_in", q.q_in, 16)?;
        check_align("q_out", q.q_out, 16)?;
        k.q_in = q.q_in.device_addr();
        k.q_out = q.q_out.device_addr();
        k.q_rstd = q.rstd.device_addr();
        k.heads = q.heads as i32;
        k.q_ctas = (q.heads.div_ceil(HEADS_PER_CTA) * rows) as i32;
    }
    if let Some(kv) = &p.kv {
        let ring = kv.ring;
        check_len("kv_in", kv.kv_in.elems(), rows * HEAD_DIM)?;
        check_len("kv_norm", kv.kv_norm.elems(), HEAD_DIM)?;
        check_len("kv rstd", kv.rstd.elems(), rows)?;
        check_align("kv_in", kv.kv_in, 16)?;
        check_align("kv_norm", kv.kv_norm, 16)?;
        check_ring(rows, ring.tokens_per_seq, ring.window)?;
        check_len(
            "seq_base",
            ring.seq_base.elems(),
            rows / ring.tokens_per_seq,
        )?;
        let pool_bytes = ring.pool.elems();
        ensure!(
            pool_bytes.is_multiple_of(ENTRY_BYTES),
            "qkv_prep: the pool has {pool_bytes} bytes, not a multiple of {ENTRY_BYTES}"
        );
        let n_entries = pool_bytes / ENTRY_BYTES;
        ensure!(
            n_entries <= i32::MAX as usize,
            "qkv_prep: {n_entries} pool entries do not fit i32 indices"
        );
        check_align("pool", ring.pool, 8)?;
        k.kv_in = kv.kv_in.device_addr();
        k.kv_norm = kv.kv_norm.device_addr();
        k.seq_base = ring.seq_base.device_addr();
        k.pool = ring.pool.device_addr();
        k.kv_rstd = kv.rstd.device_addr();
        k.tokens_per_seq = ring.tokens_per_seq as i32;
        k.window = ring.window as i32;
        k.n_entries = n_entries as i32;
        k.kv_ctas = rows.div_ceil(8) as i32;
    }
    if let Some(ix) = &p.index {
        check_rows_heads(rows, ix.heads)?;
        ensure!(
            ix.w_scale.is_finite() && ix.w_scale > 0.0,
            "qkv_prep: w_scale must be finite and > 0, got {}",
            ix.w_scale
        );
        if let Some(v) = &ix.visible {
            ensure!(
                (1..=i32::MAX as usize).contains(&v.ratio),
                "qkv_prep: the compressor ratio must be at least 1, got {}",
                v.ratio
            );
            ensure!(
                v.num_valid.elems() >= rows,
                "qkv_prep: num_valid holds {} counts for {rows} rows",
                v.num_valid.elems()
            );
            k.ratio = v.ratio as i32;
            k.num_valid = v.num_valid.device_addr();
        }
        check_len("qi", ix.qi.elems(), rows * ix.heads * INDEX_HEAD_DIM)?;
        check_len("w_in", ix.w_in.elems(), rows * ix.heads)?;
        check_len(
            "q_codes",
            ix.q_codes.elems(),
            rows * ix.heads * INDEX_HEAD_DIM,
        )?;
        check_len("w_out", ix.w_out.elems(), rows * ix.heads)?;
        check_align("qi", ix.qi, 8)?;
        check_align("q_codes", ix.q_codes, 4)?;
        k.qi_in = ix.qi.device_addr();
        k.w_in = ix.w_in.device_addr();
        k.q_codes = ix.q_codes.device_addr();
        k.w_out = ix.w_out.device_addr();
        k.w_scale = ix.w_scale;
        k.index_heads = ix.heads as i32;
        k.index_ctas = (ix.heads.div_ceil(HEADS_PER_CTA) * rows) as i32;
    }
    let ctas = k.q_ctas as usize + k.kv_ctas as usize + k.index_ctas as usize;
    ensure!(ctas >= 1, "qkv_prep: a launch with no part");
    ensure!(
        ctas <= i32::MAX as usize,
        "qkv_prep: {ctas} CTAs do not fit one grid"
    );
    let kernel = gpu.kernel(FAMILY, "qkv_prep_attn")?;
    let mut a = KernelArgs::new();
    a.pod(&k);
    // SAFETY: the parameter block of qkv_prep_attn; every buffer holds the element counts checked above, each part's
    // CTAs cover its (heads, rows) or rows, the kernel guards head < heads and row < rows and bounds-checks every
    // pool entry against n_entries; a null num_valid is not written.
    unsafe {
        launch(
            stream,
            &kernel,
            Launch::new((ctas as u32, 1, 1), (32 * HEADS_PER_CTA as u32, 1, 1)),
            &mut a,
        )
    }
}

/// Per-head query finish of `rows` rows of `heads` heads: `q_in [rows, heads, 512]` BF16 -> `q_out` (same
/// layout, BF16) and the per-head RMS factor `rstd [rows, heads]` f32: the BF16 value
/// `r = bf16(rsqrt(bf16(bf16(mean(bf16(q^2))) + eps)))` of the official op order
/// ([`head_rms_scale_bf16`](crate::model::numerics::head_rms_scale_bf16); the mean's sum in f32), and
/// `q_out = bf16(q_in * r)` before RoPE. Rows with `positions[row] < 0` write nothing. `freqs`: the layer's
/// `RopeTable::freqs` (32 f64). `q_in` and `q_out` 16-byte aligned, not overlapping. A [`prep`] launch of this part.
#[allow(clippy::too_many_arguments)]
pub fn q_heads(
    gpu: &Gpu,
    stream: &Stream,
    q_in: &impl DeviceBuf<bf16>,
    positions: &impl DeviceBuf<i32>,
    freqs: &impl DeviceBuf<f64>,
    rows: usize,
    heads: usize,
    eps: f32,
    q_out: &impl DeviceBuf<bf16>,
    rstd: &impl DeviceBuf<f32>,
) -> Result<()> {
    let q = QHeads {
        q_in,
        heads,
        q_out,
        rstd,
    };
    let p = Prep::over(rows, positions, freqs, eps);
    prep(gpu, stream, &Prep { q: Some(q), ..p })
}

/// Where [`kv_entries`] writes: the window ring of each sequence in a pool of 584-byte entries.
#[derive(Clone, Copy)]
pub struct WindowRing<'a> {
    /// The KV pool, `n_entries x 584` bytes.
    pub pool: &'a dyn DeviceBuf<u8>,
    /// Pool index of ring slot 0 of each sequence (`rows / tokens_per_seq` values, read on the device; a
    /// negative base skips the sequence's rows).
    pub seq_base: &'a dyn DeviceBuf<i32>,
    /// Consecutive rows per sequence: row `r` belongs to sequence `r / tokens_per_seq`. Its rows' positions are
    /// distinct and span less than the ring length `window` (consecutive decode / MTP tokens), so no two rows share
    /// a slot. (The engine's prefill chunk passes `tokens_per_seq = 1` with a per-row `seq_base` that repeats one
    /// sequence's base: its C consecutive positions span less than its ring, `engine::plan::ring_entries`.)
    pub tokens_per_seq: usize,
    /// Ring length: row `r` goes to entry `seq_base[seq] + positions[r] % window`. At least the attention window
    /// (DSV4 `window_size`, 128); the engine's rings are `window_size + PREFILL_CHUNK_MAX - 1` long (+ 1023) so a
    /// prefill chunk fits beside the window (`engine::plan::LayerCachePlan::window_entries`).
    pub window: usize,
}

/// Window KV of `rows` rows: `kv_in [rows, 512]` BF16 -> RMSNorm with `kv_norm` (BF16 `[512]`), RoPE on dims
/// 448..511 at the row's position, BF16, FP8 entry into the ring slot ([`WindowRing`]); `rstd [rows]` f32.
/// A row with position < 0, a negative sequence base or an entry outside the pool writes nothing. A [`prep`]
/// launch of this part.
#[allow(clippy::too_many_arguments)]
pub fn kv_entries(
    gpu: &Gpu,
    stream: &Stream,
    kv_in: &impl DeviceBuf<bf16>,
    kv_norm: &impl DeviceBuf<bf16>,
    positions: &impl DeviceBuf<i32>,
    freqs: &impl DeviceBuf<f64>,
    rows: usize,
    eps: f32,
    ring: &WindowRing<'_>,
    rstd: &impl DeviceBuf<f32>,
) -> Result<()> {
    let kv = KvEntries {
        kv_in,
        kv_norm,
        ring,
        rstd,
    };
    let p = Prep::over(rows, positions, freqs, eps);
    prep(gpu, stream, &Prep { kv: Some(kv), ..p })
}

/// The ring rules of [`kv_entries`]: `1 <= tokens_per_seq <= window`, `rows % tokens_per_seq == 0`,
/// `1 <= window <= 2^30`.
pub fn check_ring(rows: usize, tokens_per_seq: usize, window: usize) -> Result<()> {
    ensure!(
        (1..=1 << 30).contains(&window),
        "qkv_prep: window = {window} must be in 1..=2^30"
    );
    ensure!(
        (1..=window).contains(&tokens_per_seq),
        "qkv_prep: tokens_per_seq = {tokens_per_seq} must be in 1..=window ({window}): more rows of one sequence \
         would share ring slots"
    );
    ensure!(
        rows.is_multiple_of(tokens_per_seq),
        "qkv_prep: rows = {rows} is not a multiple of tokens_per_seq = {tokens_per_seq}"
    );
    Ok(())
}

/// Where [`indexer_q`] also writes each row's visible key count for the indexer: `num_valid[row] = (t + 1) / ratio`
/// for the row's position t >= 0, else 0 (the compressor has emitted `(t + 1) / ratio` keys after this step's
/// update; the host twin is `engine::attn::visible_keys`).
#[derive(Clone, Copy)]
pub struct VisibleKeys<'a> {
    pub ratio: usize,
    pub num_valid: &'a dyn DeviceBuf<i32>,
}

/// Indexer query of `rows` rows of `heads` indexer heads: `qi [rows, heads, 128]` BF16 and `w_in [rows, heads]` f32
/// (weights_proj's output, rounded to BF16 inside as the model's `bf16_linear` rounds it) -> e4m3 codes
/// `q_codes [rows, heads, 128]` and f32 `w_out [rows, heads]` (`indexer::QueryBatch`'s q and w for next_n = 1,
/// rows = sequences; for next_n = 2 the caller orders rows `b * 2 + t`), and with `visible` each row's visible key
/// count. `w_scale` is `model::reference::indexer_weight_scale(128, heads)`. Rows with position < 0 write no q or
/// w (their count is 0). A [`prep`] launch of this part.
#[allow(clippy::too_many_arguments)]
pub fn indexer_q(
    gpu: &Gpu,
    stream: &Stream,
    qi: &impl DeviceBuf<bf16>,
    w_in: &impl DeviceBuf<f32>,
    positions: &impl DeviceBuf<i32>,
    freqs: &impl DeviceBuf<f64>,
    rows: usize,
    heads: usize,
    w_scale: f32,
    q_codes: &impl DeviceBuf<u8>,
    w_out: &impl DeviceBuf<f32>,
    visible: Option<VisibleKeys>,
) -> Result<()> {
    let index = IndexerQ {
        qi,
        w_in,
        heads,
        w_scale,
        q_codes,
        w_out,
        visible,
    };
    // eps is the norms' (not read by this part).
    let p = Prep::over(rows, positions, freqs, 1.0);
    prep(
        gpu,
        stream,
        &Prep {
            index: Some(index),
            ..p
        },
    )
}

/// One empty launch (the bench's launch floor).
pub fn launch_floor(gpu: &Gpu, stream: &Stream) -> Result<()> {
    let k = gpu.kernel(FAMILY, "qkv_prep_launch_floor")?;
    let mut a = KernelArgs::new();
    // SAFETY: the kernel takes no arguments and touches no memory.
    unsafe { launch(stream, &k, Launch::new((1, 1, 1), (32, 1, 1)), &mut a) }
}
