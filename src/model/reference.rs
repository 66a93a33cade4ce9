//! The CPU reference of the DeepSeek-V4 forward pass (arch §3, §8): prefill and single-token decode with
//! per-layer traces of every intermediate a GPU driver is compared on.
//!
//! Rounding points (arch §2), named once here and followed everywhere below:
//! * residual streams, sub-layer inputs/outputs, q, kv, norms' outputs: BF16 (`bf16_round`);
//! * FP8 linears (`wq_a`, `wq_b`, `wkv`, `wo_b`, `indexer.wq_b`, shared experts): input quantized to e4m3
//!   per 128 channels with a power-of-two scale, dot with the dequantized weight in f32, output BF16;
//! * FP4 linears (routed experts): the same activation quantization, MXFP4 weight, output BF16;
//! * `wo_a` (grouped): BF16 input x dequantized weight (exactly BF16-representable), f32 dot, BF16 out
//!   (OFF-F applies it as a BF16 einsum after `convert.py` dequantizes it);
//! * compressor projections, router and LM head: f32 inputs and weights, f32 outputs;
//! * KV nope dims FP8-simulated per 64; indexer q/k Hadamard then FP4-simulated per 32;
//! * attention: f32 scores and softmax, probabilities rounded to BF16 before P·V, f32 accumulation;
//! * indexer scores: per-head dot BF16, ×w BF16, head sum BF16; top-k ties go to the lower entry index.
//!
//! Dot products accumulate in f32 (8 partial sums): the reference agrees with any other f32 summation
//! order to ~1e-6 relative, which is why comparisons use cosine / relative tolerances, not bit equality.

use super::config::{LayerKind, ModelConfig};
use super::numerics::{
    bf16_round, bf16_round_slice, dot, fp4_sim_inplace, fp8_act_quant, fp8_sim_inplace,
    hadamard_inplace, head_rms_scale_bf16, inv_rms, par_map, rms_norm_bf16, rms_scale_bf16,
    sigmoid, silu, softplus, RopeTable,
};
use super::weights::Weights;
use anyhow::{bail, Result};

/// mHC pre-mix of one sub-layer (arch §3.4).
#[derive(Clone, Debug, Default)]
pub struct HcPre {
    /// pre_i = sigmoid(..) + eps (hc values)
    pub pre: Vec<f32>,
    /// post_i = 2 sigmoid(..) (hc values)
    pub post: Vec<f32>,
    /// Sinkhorn output C[j][k], row-major hc x hc.
    pub comb: Vec<f32>,
    /// Σ_i pre_i X_i rounded to BF16 (D values): the sub-layer input before its RMSNorm.
    pub mixed: Vec<f32>,
}

/// The keys/values a query attended to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CandidateSet {
    /// Token positions of the window entries, ascending.
    pub window_positions: Vec<usize>,
    /// Compressed entry indices j, ascending (HCA: all visible; CSA: the indexer's top-k).
    pub compressed: Vec<usize>,
}

/// MoE routing of one token in one layer.
#[derive(Clone, Debug, Default)]
pub struct Routing {
    /// sqrt(softplus(gate logits)), all experts (f32).
    pub scores: Vec<f32>,
    /// The chosen experts in selection order (hash layers: tid2eid order; else descending biased score).
    pub experts: Vec<usize>,
    /// Renormalized, route-scaled weights of `experts`.
    pub weights: Vec<f32>,
}

/// Every intermediate of one layer for one token.
#[derive(Clone, Debug, Default)]
pub struct LayerTrace {
    pub layer: usize,
    pub position: usize,
    /// Residual entering the layer (hc x D, BF16).
    pub residual_in: Vec<f32>,
    pub attn_hc: HcPre,
    /// a = RMSNorm(mixed; attn_norm) (D, BF16).
    pub attn_input: Vec<f32>,
    /// qr = RMSNorm(wq_a a; q_norm) (q_lora_rank, BF16).
    pub qr: Vec<f32>,
    /// q after per-head RMS and RoPE (H x head_dim, BF16).
    pub q: Vec<f32>,
    /// This token's window KV (head_dim, BF16; nope dims on the FP8 grid).
    pub kv: Vec<f32>,
    /// The compressed entry this token completed, if any (main compressor).
    pub new_compressed: Option<Vec<f32>>,
    /// The indexer key this token completed, if any (CSA layers).
    pub new_index_key: Option<Vec<f32>>,
    /// Indexer scores of all visible entries (CSA layers; empty otherwise).
    pub index_scores: Vec<f32>,
    pub candidates: CandidateSet,
    /// Attention output after inverse RoPE (H x head_dim, BF16).
    pub attn_heads: Vec<f32>,
    /// Output projection result y (D, BF16).
    pub attn_out: Vec<f32>,
    /// Residual after the attention sub-layer's hc_post (hc x D).
    pub residual_mid: Vec<f32>,
    pub ffn_hc: HcPre,
    /// f = RMSNorm(mixed; ffn_norm) (D, BF16).
    pub ffn_input: Vec<f32>,
    pub routing: Routing,
    /// MoE output (D, BF16).
    pub moe_out: Vec<f32>,
    /// Residual leaving the layer (hc x D, BF16).
    pub residual_out: Vec<f32>,
}

/// Result of one decode step.
#[derive(Clone, Debug)]
pub struct StepOutput {
    pub position: usize,
    /// FP32 logits over the vocabulary.
    pub logits: Vec<f32>,
    pub layers: Vec<LayerTrace>,
}

/// Result of a prefill.
#[derive(Clone, Debug)]
pub struct PrefillOutput {
    /// FP32 logits at the last prompt position.
    pub logits: Vec<f32>,
    /// traces[t][layer] when requested, else empty.
    pub traces: Vec<Vec<LayerTrace>>,
}

/// The FP32 decode-time state of one compressor (arch §3.7): `coff*m` rows of `coff*d` channels.
#[derive(Clone, Debug)]
pub struct CompressorState {
    pub ratio: usize,
    pub overlap: bool,
    pub dim: usize,
    pub kv: Vec<f32>,
    pub score: Vec<f32>,
}

impl CompressorState {
    /// An empty state: `ratio` m, overlapping (CSA) or not, `dim` output channels d_c.
    pub fn new(ratio: usize, overlap: bool, dim: usize) -> Self {
        let coff = if overlap { 2 } else { 1 };
        let n = coff * ratio * coff * dim;
        CompressorState {
            ratio,
            overlap,
            dim,
            kv: vec![0.0; n],
            score: vec![f32::NEG_INFINITY; n],
        }
    }
    fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }
    fn set_row(&mut self, row: usize, kv: &[f32], g: &[f32]) {
        let w = self.width();
        self.kv[row * w..(row + 1) * w].copy_from_slice(kv);
        self.score[row * w..(row + 1) * w].copy_from_slice(g);
    }
    /// Writes token t's projections; returns the pooled (f32) entry when t completes a block.
    pub fn push(&mut self, t: usize, kv: &[f32], g: &[f32]) -> Option<Vec<f32>> {
        let m = self.ratio;
        let w = self.width();
        let row = if self.overlap { m + t % m } else { t % m };
        self.set_row(row, kv, g);
        if !(t + 1).is_multiple_of(m) {
            return None;
        }
        let d = self.dim;
        let pooled = if self.overlap {
            // Rows 0..m: previous block via channel half "a"; rows m..2m: this block via half "b".
            let mut src: Vec<(&[f32], &[f32], usize)> = Vec::with_capacity(2 * m);
            for r in 0..m {
                src.push((
                    &self.kv[r * w..(r + 1) * w],
                    &self.score[r * w..(r + 1) * w],
                    0,
                ));
            }
            for r in m..2 * m {
                src.push((
                    &self.kv[r * w..(r + 1) * w],
                    &self.score[r * w..(r + 1) * w],
                    d,
                ));
            }
            pool_softmax(d, &src)
        } else {
            let src: Vec<(&[f32], &[f32], usize)> = (0..m)
                .map(|r| {
                    (
                        &self.kv[r * w..(r + 1) * w],
                        &self.score[r * w..(r + 1) * w],
                        0,
                    )
                })
                .collect();
            pool_softmax(d, &src)
        };
        // Canonical state after an emission (so two implementations can compare states bit for bit):
        // rows not yet written for the next block hold kv 0 and score -inf. For CSA this block becomes
        // the "previous block" of the next one.
        let keep = if self.overlap {
            self.kv.copy_within(m * w..2 * m * w, 0);
            self.score.copy_within(m * w..2 * m * w, 0);
            m * w
        } else {
            0
        };
        self.kv[keep..].fill(0.0);
        self.score[keep..].fill(f32::NEG_INFINITY);
        Some(pooled)
    }
}

/// Per-channel softmax pooling: out[c] = Σ_s softmax_s(g_s[off_s + c]) kv_s[off_s + c]. Rows with score
/// -inf contribute nothing (CSA's empty "previous block" of block 0).
pub fn pool_softmax(d: usize, sources: &[(&[f32], &[f32], usize)]) -> Vec<f32> {
    let mut out = vec![0f32; d];
    for (c, o) in out.iter_mut().enumerate() {
        let mx = sources
            .iter()
            .map(|(_, g, off)| g[off + c])
            .fold(f32::NEG_INFINITY, f32::max);
        let (mut num, mut den) = (0f32, 0f32);
        for (kv, g, off) in sources {
            let e = (g[off + c] - mx).exp();
            num += e * kv[off + c];
            den += e;
        }
        *o = num / den;
    }
    out
}

/// The cache of one layer.
#[derive(Clone, Debug)]
pub struct LayerCache {
    /// Ring of `window_size` KV vectors, slot = position mod window.
    pub window: Vec<Vec<f32>>,
    /// Main compressed entries, index j.
    pub compressed: Vec<Vec<f32>>,
    pub compressor: Option<CompressorState>,
    /// Indexer keys, index j (CSA layers).
    pub index_keys: Vec<Vec<f32>>,
    pub index_compressor: Option<CompressorState>,
}

/// Per-sequence decode state: the next position and every layer's cache.
#[derive(Clone, Debug)]
pub struct DecodeState {
    pub position: usize,
    pub layers: Vec<LayerCache>,
}

/// Per-token projections of one layer during prefill.
struct Proj {
    pre: HcPre,
    a: Vec<f32>,
    qr: Vec<f32>,
    q: Vec<f32>,
    kv: Vec<f32>,
    indexer: Option<(Vec<f32>, Vec<f32>)>,
    comp: Option<(Vec<f32>, Vec<f32>)>,
    icomp: Option<(Vec<f32>, Vec<f32>)>,
}

impl Proj {
    /// The (kv, gate) compressor inputs of this token for one compressor.
    fn compressor_io(&self, which: Which) -> &(Vec<f32>, Vec<f32>) {
        match which {
            Which::Main => self.comp.as_ref().expect("main compressor inputs"),
            Which::Indexer => self.icomp.as_ref().expect("indexer compressor inputs"),
        }
    }
}

/// Which compressor of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Main,
    Indexer,
}

/// How [`Model::moe`] adds its terms (the routed experts in routing order, then the shared expert).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MoeSum {
    /// The model: every term added in f32, the sum rounded to BF16 once.
    #[default]
    F32,
    /// Each term added into a BF16 accumulator, rounded after every add (a framework that keeps the MoE output
    /// in the activation dtype does this). The same math with one rounding changed: the CPU model against itself
    /// with this on is the noise floor that end-to-end parity is judged by.
    Bf16Accumulator,
}

/// The formats the routed experts compute in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RoutedActivations {
    /// The checkpoint's: `f` as FP8 1x128 (`fp8_act_quant`), g and u rounded to BF16, `h` rounded to BF16 and
    /// quantized to FP8 1x128 for w2 (`Model::expert`).
    #[default]
    Fp8,
    /// moe_gemm's (the GPU's routed-expert kernels): `f` as NVFP4 with a per-row global scale, g and u in f32,
    /// `h = silu(min(g, L)) clamp(u, -L, L) w` in f32 quantized to NVFP4 for w2, w2's output kept in f32. The
    /// shared expert is unchanged (FP8, `dense::shared_expert`'s contract). The GPU is held to this model where
    /// its formats differ from the checkpoint's by design.
    Nvfp4,
}

/// The formats the attention side computes in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionFormats {
    /// The checkpoint's: each head's query in BF16 against the KV entries; the indexer keys as their FP4-simulated
    /// values.
    #[default]
    Model,
    /// The GPU kernels': each head's query through the KV entry codec before its dots (sparse_attn's FP8 path: the
    /// nope dims FP8 per 64 with a UE8M0 scale, the rope dims BF16), and each indexer key through the FP8 key cache's
    /// codec (`formats::indexer_key`: e4m3 codes with one f32 scale per key, off by up to 2^-4 relative from the
    /// FP4-simulated value). The indexer query's FP8 form is exact (kernels/qkv_prep.cu), so it is not modelled.
    Kernels,
}

/// The reference model: weights plus per-layer RoPE tables.
pub struct Model {
    pub weights: Weights,
    ropes: Vec<RopeTable>,
    /// How the MoE output's terms are summed (`MoeSum::F32` is the model; the other is the noise floor).
    pub moe_sum: MoeSum,
    /// The routed experts' formats (`RoutedActivations::Fp8` is the model).
    pub routed_activations: RoutedActivations,
    /// The attention side's formats (`AttentionFormats::Model` is the model).
    pub attention_formats: AttentionFormats,
}

/// `silu(min(g, L)) * clamp(u, -L, L)` with the SwiGLU limit `lim` (no clamp when `lim <= 0`).
fn clamped_swiglu(g: f32, u: f32, lim: f32) -> f32 {
    let (g, u) = if lim > 0.0 {
        (g.min(lim), u.clamp(-lim, lim))
    } else {
        (g, u)
    };
    silu(g) * u
}

/// The activation routed experts in the formats `routed` read: `f` through FP8 1x128 or through NVFP4.
fn routed_input(f: &[f32], routed: RoutedActivations) -> Result<Vec<f32>> {
    match routed {
        RoutedActivations::Fp8 => fp8_act_quant(f),
        RoutedActivations::Nvfp4 => nvfp4_round_trip(f),
    }
}

/// One row through NVFP4 with its per-row global scale (`formats::nvfp4`: norm_quant's quantizer and moe_gemm's
/// L1 finish) and back.
fn nvfp4_round_trip(x: &[f32]) -> Result<Vec<f32>> {
    use crate::formats::nvfp4;
    Ok(nvfp4::dequantize_rows(&nvfp4::quantize_rows(
        x,
        1,
        x.len(),
    )?))
}

impl Model {
    pub fn new(weights: Weights) -> Result<Self> {
        let cfg = &weights.config;
        let ropes = (0..cfg.n_layers).map(|l| layer_rope(cfg, l)).collect();
        Ok(Model {
            weights,
            ropes,
            moe_sum: MoeSum::F32,
            routed_activations: RoutedActivations::Fp8,
            attention_formats: AttentionFormats::Model,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    /// This model in the GPU's formats where they differ from the checkpoint's by design: the routed experts'
    /// ([`RoutedActivations::Nvfp4`]) and the attention side's ([`AttentionFormats::Kernels`]).
    pub fn in_gpu_formats(mut self) -> Model {
        self.routed_activations = RoutedActivations::Nvfp4;
        self.attention_formats = AttentionFormats::Kernels;
        self
    }

    /// Whether this model computes in the GPU's formats ([`Model::in_gpu_formats`]) or the checkpoint's; None when
    /// it mixes them.
    pub fn gpu_formats(&self) -> Option<bool> {
        match (self.routed_activations, self.attention_formats) {
            (RoutedActivations::Fp8, AttentionFormats::Model) => Some(false),
            (RoutedActivations::Nvfp4, AttentionFormats::Kernels) => Some(true),
            _ => None,
        }
    }

    /// The RoPE table of a layer.
    pub fn rope(&self, layer: usize) -> &RopeTable {
        &self.ropes[layer]
    }

    /// An empty state (position 0).
    pub fn new_state(&self) -> DecodeState {
        let cfg = self.config();
        let layers = (0..cfg.n_layers)
            .map(|l| {
                let kind = cfg.layer_kind(l);
                let (comp, icomp) = match kind {
                    LayerKind::SlidingWindow => (None, None),
                    LayerKind::Hca { ratio } => {
                        (Some(CompressorState::new(ratio, false, cfg.head_dim)), None)
                    }
                    LayerKind::Csa { ratio } => (
                        Some(CompressorState::new(ratio, true, cfg.head_dim)),
                        Some(CompressorState::new(ratio, true, cfg.index_head_dim)),
                    ),
                };
                LayerCache {
                    window: vec![Vec::new(); cfg.window_size],
                    compressed: Vec::new(),
                    compressor: comp,
                    index_keys: Vec::new(),
                    index_compressor: icomp,
                }
            })
            .collect();
        DecodeState {
            position: 0,
            layers,
        }
    }

    // ---- linears -------------------------------------------------------------------------------

    /// `bf16(W . fp8_act_quant(x))` for an FP8 weight `name` (the GPU oracle of `ops::dense::fp8_linear`).
    pub fn fp8_linear(&self, name: &str, x: &[f32]) -> Result<Vec<f32>> {
        let mut y = self.weights.matvec(name, &fp8_act_quant(x)?)?;
        bf16_round_slice(&mut y);
        Ok(y)
    }

    fn bf16_linear(&self, name: &str, x: &[f32]) -> Result<Vec<f32>> {
        let mut y = self.weights.matvec(name, x)?;
        bf16_round_slice(&mut y);
        Ok(y)
    }

    // ---- mHC -----------------------------------------------------------------------------------

    /// hc_pre (arch §3.4) with the parameters `layers.{l}.hc_{which}_*`.
    pub fn hc_pre(&self, layer: usize, which: &str, x: &[f32]) -> Result<HcPre> {
        let cfg = self.config();
        let (hc, d) = (cfg.hc_mult, cfg.dim);
        let p = format!("layers.{layer}.hc_{which}");
        let scale = self.weights.vector(&format!("{p}_scale"))?;
        let base = self.weights.vector(&format!("{p}_base"))?;
        let rho = inv_rms(x, cfg.norm_eps);
        let mut mix = self.weights.matvec(&format!("{p}_fn"), x)?;
        for v in &mut mix {
            *v *= rho;
        }
        let pre: Vec<f32> = (0..hc)
            .map(|i| sigmoid(mix[i] * scale[0] + base[i]) + cfg.hc_eps)
            .collect();
        let post: Vec<f32> = (0..hc)
            .map(|i| 2.0 * sigmoid(mix[hc + i] * scale[1] + base[hc + i]))
            .collect();
        let logits: Vec<f32> = (0..hc * hc)
            .map(|i| mix[2 * hc + i] * scale[2] + base[2 * hc + i])
            .collect();
        let comb = sinkhorn(&logits, hc, cfg.hc_sinkhorn_iters, cfg.hc_eps);
        let mut mixed = vec![0f32; d];
        for (i, &p_i) in pre.iter().enumerate() {
            for (c, m) in mixed.iter_mut().enumerate() {
                *m += p_i * x[i * d + c];
            }
        }
        bf16_round_slice(&mut mixed);
        Ok(HcPre {
            pre,
            post,
            comb,
            mixed,
        })
    }

    /// hc_post: X'[k] = post_k y + Σ_j C[j][k] X[j], f32 math, BF16 result.
    pub fn hc_post(&self, y: &[f32], x: &[f32], pre: &HcPre) -> Vec<f32> {
        let cfg = self.config();
        let (hc, d) = (cfg.hc_mult, cfg.dim);
        let mut out = vec![0f32; hc * d];
        for k in 0..hc {
            for c in 0..d {
                let mut v = pre.post[k] * y[c];
                for j in 0..hc {
                    v += pre.comb[j * hc + k] * x[j * d + c];
                }
                out[k * d + c] = bf16_round(v);
            }
        }
        out
    }

    /// hc_head + final norm + FP32 logits (arch §3.5).
    pub fn head(&self, x: &[f32]) -> Result<Vec<f32>> {
        let u = self.head_hidden(x)?;
        self.weights.matvec("head.weight", &u)
    }

    /// The head before the LM head matvec: `hc_head` of the 4 streams `x` [hc * dim], then RMSNorm with
    /// `norm.weight` (BF16 values): the row the LM head reads.
    pub fn head_hidden(&self, x: &[f32]) -> Result<Vec<f32>> {
        let cfg = self.config();
        let (hc, d) = (cfg.hc_mult, cfg.dim);
        let scale = self.weights.vector("hc_head_scale")?;
        let base = self.weights.vector("hc_head_base")?;
        let rho = inv_rms(x, cfg.norm_eps);
        let mix = self.weights.matvec("hc_head_fn", x)?;
        let mut u = vec![0f32; d];
        for i in 0..hc {
            let p = sigmoid(mix[i] * rho * scale[0] + base[i]) + cfg.hc_eps;
            for c in 0..d {
                u[c] += p * x[i * d + c];
            }
        }
        bf16_round_slice(&mut u);
        Ok(rms_norm_bf16(
            &u,
            &self.weights.vector("norm.weight")?,
            cfg.norm_eps,
        ))
    }

    // ---- attention pieces ----------------------------------------------------------------------

    /// Query path, window KV and (CSA) indexer query of one token: (qr, q, kv, indexer (q, w)).
    #[allow(clippy::type_complexity)]
    fn attn_projections(
        &self,
        layer: usize,
        t: usize,
        a: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>, Option<(Vec<f32>, Vec<f32>)>)> {
        let cfg = self.config();
        let p = format!("layers.{layer}.attn");
        let (hd, nope) = (cfg.head_dim, cfg.nope_dim());
        let rope = &self.ropes[layer];
        let qa = self.fp8_linear(&format!("{p}.wq_a.weight"), a)?;
        let qr = rms_norm_bf16(
            &qa,
            &self.weights.vector(&format!("{p}.q_norm.weight"))?,
            cfg.norm_eps,
        );
        let mut q = self.fp8_linear(&format!("{p}.wq_b.weight"), &qr)?;
        q_heads_finish(&mut q, hd, nope, rope, t, cfg.norm_eps);
        let kv_raw = self.fp8_linear(&format!("{p}.wkv.weight"), a)?;
        let mut kv = window_kv_rope(
            &kv_raw,
            &self.weights.vector(&format!("{p}.kv_norm.weight"))?,
            nope,
            rope,
            t,
            cfg.norm_eps,
        );
        fp8_sim_inplace(&mut kv[..nope], 64)?;

        let indexer = if matches!(cfg.layer_kind(layer), LayerKind::Csa { .. }) {
            let di = cfg.index_head_dim;
            let rd = cfg.rope_head_dim;
            let mut qi = self.fp8_linear(&format!("{p}.indexer.wq_b.weight"), &qr)?;
            for qh in qi.chunks_exact_mut(di) {
                indexer_q_rotate(qh, rd, rope, t);
                fp4_sim_inplace(qh, 32)?;
            }
            let mut w = self.bf16_linear(&format!("{p}.indexer.weights_proj.weight"), a)?;
            indexer_head_weights(&mut w, indexer_weight_scale(di, cfg.index_n_heads));
            Some((qi, w))
        } else {
            None
        };
        Ok((qr, q, kv, indexer))
    }

    /// The compressor projections of one token: (kv, gate incl. ape row t mod m), both f32.
    pub fn compressor_inputs(
        &self,
        layer: usize,
        which: Which,
        t: usize,
        a: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let cfg = self.config();
        let m = cfg.compress_ratios[layer];
        let p = match which {
            Which::Main => format!("layers.{layer}.attn.compressor"),
            Which::Indexer => format!("layers.{layer}.attn.indexer.compressor"),
        };
        let kv = self.weights.matvec(&format!("{p}.wkv.weight"), a)?;
        let mut g = self.weights.matvec(&format!("{p}.wgate.weight"), a)?;
        let ape = self.weights.vector(&format!("{p}.ape"))?;
        let w = g.len();
        for (c, v) in g.iter_mut().enumerate() {
            *v += ape[(t % m) * w + c];
        }
        Ok((kv, g))
    }

    /// Pooled f32 entry j -> stored entry: BF16, RMSNorm, RoPE at j*m, then FP8 (main) or
    /// Hadamard + FP4 (indexer).
    pub fn finalize_entry(
        &self,
        layer: usize,
        which: Which,
        j: usize,
        pooled: &[f32],
    ) -> Result<Vec<f32>> {
        let cfg = self.config();
        let m = cfg.compress_ratios[layer];
        let p = match which {
            Which::Main => format!("layers.{layer}.attn.compressor"),
            Which::Indexer => format!("layers.{layer}.attn.indexer.compressor"),
        };
        let mut x = pooled.to_vec();
        bf16_round_slice(&mut x);
        let mut k = rms_norm_bf16(
            &x,
            &self.weights.vector(&format!("{p}.norm.weight"))?,
            cfg.norm_eps,
        );
        let dc = k.len();
        let rd = cfg.rope_head_dim;
        self.ropes[layer].apply(&mut k[dc - rd..], j * m, false);
        bf16_round_slice(&mut k[dc - rd..]);
        match which {
            Which::Main => fp8_sim_inplace(&mut k[..cfg.nope_dim()], 64)?,
            Which::Indexer => {
                hadamard_inplace(&mut k);
                bf16_round_slice(&mut k);
                fp4_sim_inplace(&mut k, 32)?;
                if self.attention_formats == AttentionFormats::Kernels {
                    use crate::formats::indexer_key;
                    let x: &[f32; indexer_key::DIMS] = k.as_slice().try_into()?;
                    k = indexer_key::decode_fp8(&indexer_key::encode_fp8(x)?)?.to_vec();
                }
            }
        }
        Ok(k)
    }

    /// Steps 9-10 of a layer for one query: the attention heads `o` over the candidate KV vectors `kvs` (window
    /// entries, then the selected compressed entries) and their projection `y`. Public so a test can rebuild them for
    /// a selection other than the model's own (an indexer near tie on the GPU).
    pub fn attention_over(
        &self,
        layer: usize,
        t: usize,
        q: &[f32],
        kvs: &[&[f32]],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let o = self.attend(layer, t, q, kvs)?;
        let y = self.out_proj(layer, &o)?;
        Ok((o, y))
    }

    /// Attention of one query over the candidate KV vectors (K = V), with the sink; inverse RoPE at t.
    fn attend(&self, layer: usize, t: usize, q: &[f32], kvs: &[&[f32]]) -> Result<Vec<f32>> {
        let cfg = self.config();
        let (hd, nope) = (cfg.head_dim, cfg.nope_dim());
        let sink = self
            .weights
            .vector(&format!("layers.{layer}.attn.attn_sink"))?;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; cfg.n_heads * hd];
        for h in 0..cfg.n_heads {
            let q_entry;
            let qh = match self.attention_formats {
                AttentionFormats::Model => &q[h * hd..(h + 1) * hd],
                AttentionFormats::Kernels => {
                    use crate::formats::kv;
                    q_entry =
                        kv::decode_entry(&kv::encode_entry(q[h * hd..(h + 1) * hd].try_into()?)?)?;
                    &q_entry[..]
                }
            };
            let s: Vec<f32> = kvs.iter().map(|k| dot(qh, k) * scale).collect();
            let mx = s.iter().copied().fold(sink[h], f32::max);
            let e: Vec<f32> = s.iter().map(|&v| (v - mx).exp()).collect();
            // The sink adds exp(sink - max) to the denominator only (its value is zero).
            let z: f32 = e.iter().sum::<f32>() + (sink[h] - mx).exp();
            let oh = &mut out[h * hd..(h + 1) * hd];
            for (ej, k) in e.iter().zip(kvs) {
                let pj = bf16_round(ej / z);
                for (o, &kv) in oh.iter_mut().zip(k.iter()) {
                    *o += pj * kv;
                }
            }
            bf16_round_slice(oh);
            self.ropes[layer].apply(&mut oh[nope..], t, true);
            bf16_round_slice(&mut oh[nope..]);
        }
        Ok(out)
    }

    /// Grouped output projection: z_g = wo_a[g] o_g (BF16 einsum), y = wo_b concat(z) (FP8).
    fn out_proj(&self, layer: usize, o: &[f32]) -> Result<Vec<f32>> {
        let cfg = self.config();
        let p = format!("layers.{layer}.attn");
        let gw = cfg.heads_per_group() * cfg.head_dim;
        let r = cfg.o_lora_rank;
        let mut z = Vec::with_capacity(cfg.o_groups * r);
        for g in 0..cfg.o_groups {
            let mut zg = self.weights.matvec_rows(
                &format!("{p}.wo_a.weight"),
                g * r,
                r,
                &o[g * gw..(g + 1) * gw],
            )?;
            bf16_round_slice(&mut zg);
            z.extend(zg);
        }
        self.fp8_linear(&format!("{p}.wo_b.weight"), &z)
    }

    /// Indexer scores of all given keys and the top-k selection (lower index wins ties).
    fn index_select(&self, qi: &[f32], w: &[f32], keys: &[Vec<f32>]) -> (Vec<f32>, Vec<usize>) {
        let cfg = self.config();
        let di = cfg.index_head_dim;
        let scores: Vec<f32> = keys
            .iter()
            .map(|k| {
                let mut s = 0f32;
                for (h, &wh) in w.iter().enumerate() {
                    let d = bf16_round(dot(&qi[h * di..(h + 1) * di], k)).max(0.0);
                    s += bf16_round(wh * d);
                }
                bf16_round(s)
            })
            .collect();
        let k = cfg.index_topk.min(keys.len());
        (scores.clone(), top_k_lower_index_wins(&scores, k))
    }

    /// Window candidate positions of query t: max(0, t-W+1) ..= t.
    pub fn window_positions(&self, t: usize) -> Vec<usize> {
        let w = self.config().window_size;
        (t.saturating_sub(w - 1)..=t).collect()
    }

    // ---- MoE -----------------------------------------------------------------------------------

    /// Routing (arch §3.9): gate logits (f32 matvec of the gate weight with `f`), then [`route_from_logits`]
    /// with the layer's selection rule (tid2eid row of `token` in the first `num_hash_layers` layers, else the
    /// biased top-k).
    pub fn route(&self, layer: usize, f: &[f32], token: u32) -> Result<Routing> {
        let cfg = self.config();
        let p = format!("layers.{layer}.ffn.gate");
        let logits = self.weights.matvec(&format!("{p}.weight"), f)?;
        let k = cfg.n_activated_experts;
        if cfg.is_hash_layer(layer) {
            if token as usize >= cfg.vocab_size {
                bail!("token {token} outside the vocabulary");
            }
            let experts = self.weights.i64_row(
                &format!("{p}.tid2eid"),
                token as usize,
                cfg.n_routed_experts,
            )?;
            Ok(route_from_logits(
                &logits,
                RouteSelection::Hash(&experts),
                k,
                cfg.route_scale,
            ))
        } else {
            let bias = self.weights.vector(&format!("{p}.bias"))?;
            Ok(route_from_logits(
                &logits,
                RouteSelection::Biased(&bias),
                k,
                cfg.route_scale,
            ))
        }
    }

    /// One SwiGLU expert with the clamp: w2( bf16(weight * silu(min(g, L)) * clamp(u, -L, L)) ).
    pub fn expert(&self, prefix: &str, f_q: &[f32], weight: f32) -> Result<Vec<f32>> {
        let lim = self.config().swiglu_limit;
        let mut g = self.weights.matvec(&format!("{prefix}.w1.weight"), f_q)?;
        let mut u = self.weights.matvec(&format!("{prefix}.w3.weight"), f_q)?;
        bf16_round_slice(&mut g);
        bf16_round_slice(&mut u);
        let h: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| bf16_round(weight * clamped_swiglu(g, u, lim)))
            .collect();
        self.fp8_linear(&format!("{prefix}.w2.weight"), &h)
    }

    /// One routed expert in moe_gemm's formats ([`RoutedActivations::Nvfp4`]): `f_nv` is `f` through NVFP4
    /// ([`Model::routed_input`]); g, u and h in f32, h through NVFP4 before w2, the output unrounded.
    fn expert_nvfp4(&self, prefix: &str, f_nv: &[f32], weight: f32) -> Result<Vec<f32>> {
        let lim = self.config().swiglu_limit;
        let g = self.weights.matvec(&format!("{prefix}.w1.weight"), f_nv)?;
        let u = self.weights.matvec(&format!("{prefix}.w3.weight"), f_nv)?;
        let h: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| clamped_swiglu(g, u, lim) * weight)
            .collect();
        self.weights
            .matvec(&format!("{prefix}.w2.weight"), &nvfp4_round_trip(&h)?)
    }

    /// MoE output for one token: Σ routed (routing order) + shared, in f32, rounded to BF16 once (with
    /// [`MoeSum::Bf16Accumulator`] rounded after every add: the noise floor's model). The routed experts read
    /// [`Model::routed_input`], the shared expert [`Model::moe_input`].
    pub fn moe(&self, layer: usize, f: &[f32], routing: &Routing) -> Result<Vec<f32>> {
        self.moe_as(layer, f, routing, self.routed_activations)
    }

    /// [`Model::moe`] with the routed experts in the formats `routed` (whatever the model's own setting).
    pub fn moe_as(
        &self,
        layer: usize,
        f: &[f32],
        routing: &Routing,
        routed: RoutedActivations,
    ) -> Result<Vec<f32>> {
        let f_q = self.moe_input(f)?;
        let f_r = routed_input(f, routed)?;
        let mut y = vec![0f32; self.config().dim];
        let round_each = self.moe_sum == MoeSum::Bf16Accumulator;
        for j in 0..routing.experts.len() {
            self.add_routed_pick(layer, &f_r, routing, j, routed, &mut y)?;
            if round_each {
                bf16_round_slice(&mut y);
            }
        }
        self.add_shared_expert(layer, &f_q, &mut y)?;
        bf16_round_slice(&mut y);
        Ok(y)
    }

    /// The activation the shared expert reads (and, with [`RoutedActivations::Fp8`], every expert): `f`
    /// quantized as the model's FP8 activations (`fp8_act_quant`, 1x128 blocks).
    pub fn moe_input(&self, f: &[f32]) -> Result<Vec<f32>> {
        fp8_act_quant(f)
    }

    /// The activation the routed experts read, per [`Model::routed_activations`]: [`Model::moe_input`], or `f`
    /// through NVFP4 with its per-row global scale and back.
    pub fn routed_input(&self, f: &[f32]) -> Result<Vec<f32>> {
        routed_input(f, self.routed_activations)
    }

    /// The f32 sum, unrounded, of the routed picks `picks` (indices into `routing.experts`) of one token, added in
    /// the order given to a zero row: the part of [`Model::moe`]'s sum that those picks contribute. `f_q` is
    /// [`Model::routed_input`] of the token's FFN input. With every pick in routing order this is exactly the
    /// routed sum `moe` adds the shared expert to (with [`MoeSum::F32`]).
    pub fn routed_partial(
        &self,
        layer: usize,
        f_q: &[f32],
        routing: &Routing,
        picks: &[usize],
    ) -> Result<Vec<f32>> {
        let mut y = vec![0f32; self.config().dim];
        for &j in picks {
            self.add_routed_pick(layer, f_q, routing, j, self.routed_activations, &mut y)?;
        }
        Ok(y)
    }

    /// The shared expert's output row (f32, as [`Model::moe`] adds it; zeros without a shared expert).
    pub fn shared_expert_out(&self, layer: usize, f_q: &[f32]) -> Result<Vec<f32>> {
        let mut y = vec![0f32; self.config().dim];
        self.add_shared_expert(layer, f_q, &mut y)?;
        Ok(y)
    }

    /// `y += expert(routing.experts[j], weight routing.weights[j])` in the formats `routed`, elementwise in f32;
    /// `f_q` is the routed input in those formats.
    fn add_routed_pick(
        &self,
        layer: usize,
        f_q: &[f32],
        routing: &Routing,
        j: usize,
        routed: RoutedActivations,
        y: &mut [f32],
    ) -> Result<()> {
        let (e, w) = (routing.experts[j], routing.weights[j]);
        let prefix = format!("layers.{layer}.ffn.experts.{e}");
        let ye = match routed {
            RoutedActivations::Fp8 => self.expert(&prefix, f_q, w)?,
            RoutedActivations::Nvfp4 => self.expert_nvfp4(&prefix, f_q, w)?,
        };
        for (a, b) in y.iter_mut().zip(&ye) {
            *a += b;
        }
        Ok(())
    }

    /// `y += shared expert(f_q)`, elementwise in f32 (nothing without a shared expert).
    fn add_shared_expert(&self, layer: usize, f_q: &[f32], y: &mut [f32]) -> Result<()> {
        if self.config().n_shared_experts == 0 {
            return Ok(());
        }
        let ys = self.expert(&format!("layers.{layer}.ffn.shared_experts"), f_q, 1.0)?;
        for (a, b) in y.iter_mut().zip(&ys) {
            *a += b;
        }
        Ok(())
    }

    /// The FFN half of a layer: hc_pre, norm, routing, MoE, hc_post.
    fn ffn_sublayer(
        &self,
        layer: usize,
        token: u32,
        x: &[f32],
        tr: &mut LayerTrace,
    ) -> Result<Vec<f32>> {
        let cfg = self.config();
        let pre = self.hc_pre(layer, "ffn", x)?;
        let f = rms_norm_bf16(
            &pre.mixed,
            &self
                .weights
                .vector(&format!("layers.{layer}.ffn_norm.weight"))?,
            cfg.norm_eps,
        );
        let routing = self.route(layer, &f, token)?;
        let y = self.moe(layer, &f, &routing)?;
        let out = self.hc_post(&y, x, &pre);
        tr.ffn_hc = pre;
        tr.ffn_input = f;
        tr.routing = routing;
        tr.moe_out = y;
        tr.residual_out = out.clone();
        Ok(out)
    }

    /// The residual streams of one token: its `embed.weight` row (BF16 values) repeated `hc_mult` times.
    pub fn embed(&self, token: u32) -> Result<Vec<f32>> {
        let row = self.weights.embedding_row(token)?;
        Ok(row.repeat(self.config().hc_mult))
    }

    // ---- decode --------------------------------------------------------------------------------

    /// One decode step: token `token` at position `state.position`; updates the caches.
    pub fn decode_step(&self, state: &mut DecodeState, token: u32) -> Result<StepOutput> {
        let cfg = self.config().clone();
        let t = state.position;
        let mut x = self.embed(token)?;
        let mut traces = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let mut tr = LayerTrace {
                layer: l,
                position: t,
                residual_in: x.clone(),
                ..Default::default()
            };
            let pre = self.hc_pre(l, "attn", &x)?;
            let a = rms_norm_bf16(
                &pre.mixed,
                &self
                    .weights
                    .vector(&format!("layers.{l}.attn_norm.weight"))?,
                cfg.norm_eps,
            );
            let (qr, q, kv, indexer) = self.attn_projections(l, t, &a)?;
            let kind = cfg.layer_kind(l);
            let cache = &mut state.layers[l];
            let mut compressed_sel: Vec<usize> = Vec::new();
            if let LayerKind::Csa { .. } = kind {
                let (ikv, ig) = self.compressor_inputs(l, Which::Indexer, t, &a)?;
                let st = cache
                    .index_compressor
                    .as_mut()
                    .expect("CSA layer has an indexer compressor");
                if let Some(pooled) = st.push(t, &ikv, &ig) {
                    let j = cache.index_keys.len();
                    let key = self.finalize_entry(l, Which::Indexer, j, &pooled)?;
                    tr.new_index_key = Some(key.clone());
                    cache.index_keys.push(key);
                }
                let (qi, w) = indexer.as_ref().expect("CSA layer has an indexer query");
                let (scores, sel) = self.index_select(qi, w, &cache.index_keys);
                tr.index_scores = scores;
                compressed_sel = sel;
            }
            cache.window[t % cfg.window_size] = kv.clone();
            if kind.ratio() > 0 {
                let (ckv, cg) = self.compressor_inputs(l, Which::Main, t, &a)?;
                let st = cache
                    .compressor
                    .as_mut()
                    .expect("compressed layer has a compressor");
                if let Some(pooled) = st.push(t, &ckv, &cg) {
                    let j = cache.compressed.len();
                    let e = self.finalize_entry(l, Which::Main, j, &pooled)?;
                    tr.new_compressed = Some(e.clone());
                    cache.compressed.push(e);
                }
                if let LayerKind::Hca { .. } = kind {
                    compressed_sel = (0..cache.compressed.len()).collect();
                }
            }
            compressed_sel.sort_unstable();
            let wpos = self.window_positions(t);
            let mut kvs: Vec<&[f32]> = wpos
                .iter()
                .map(|&p| cache.window[p % cfg.window_size].as_slice())
                .collect();
            kvs.extend(
                compressed_sel
                    .iter()
                    .map(|&j| cache.compressed[j].as_slice()),
            );
            let (o, y) = self.attention_over(l, t, &q, &kvs)?;
            let xm = self.hc_post(&y, &x, &pre);
            tr.attn_hc = pre;
            tr.attn_input = a;
            tr.qr = qr;
            tr.q = q;
            tr.kv = kv;
            tr.candidates = CandidateSet {
                window_positions: wpos,
                compressed: compressed_sel,
            };
            tr.attn_heads = o;
            tr.attn_out = y;
            tr.residual_mid = xm.clone();
            x = self.ffn_sublayer(l, token, &xm, &mut tr)?;
            traces.push(tr);
        }
        let logits = self.head(&x)?;
        state.position += 1;
        Ok(StepOutput {
            position: t,
            logits,
            layers: traces,
        })
    }

    /// Prefill of `tokens` from an empty state, layer by layer over all tokens (blockwise compressors,
    /// causal candidate sets), leaving the state exactly as `tokens.len()` decode steps would.
    pub fn prefill(
        &self,
        state: &mut DecodeState,
        tokens: &[u32],
        keep_traces: bool,
    ) -> Result<PrefillOutput> {
        if state.position != 0 {
            bail!(
                "prefill needs an empty state (position 0, got {}); use decode_step to extend",
                state.position
            );
        }
        if tokens.is_empty() {
            bail!("prefill of zero tokens");
        }
        let cfg = self.config().clone();
        let n = tokens.len();
        let mut xs: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&tk| self.embed(tk))
            .collect::<Result<_>>()?;
        let mut traces: Vec<Vec<LayerTrace>> = vec![Vec::new(); if keep_traces { n } else { 0 }];
        for l in 0..cfg.n_layers {
            let kind = cfg.layer_kind(l);
            let m = kind.ratio();
            // 1. Per-token projections (parallel over tokens).
            let projs: Vec<Proj> = par_map(n, |t| -> Result<Proj> {
                let pre = self.hc_pre(l, "attn", &xs[t])?;
                let a = rms_norm_bf16(
                    &pre.mixed,
                    &self
                        .weights
                        .vector(&format!("layers.{l}.attn_norm.weight"))?,
                    cfg.norm_eps,
                );
                let (qr, q, kv, indexer) = self.attn_projections(l, t, &a)?;
                let comp = if m > 0 {
                    Some(self.compressor_inputs(l, Which::Main, t, &a)?)
                } else {
                    None
                };
                let icomp = if matches!(kind, LayerKind::Csa { .. }) {
                    Some(self.compressor_inputs(l, Which::Indexer, t, &a)?)
                } else {
                    None
                };
                Ok(Proj {
                    pre,
                    a,
                    qr,
                    q,
                    kv,
                    indexer,
                    comp,
                    icomp,
                })
            })
            .into_iter()
            .collect::<Result<_>>()?;

            // 2. Blockwise compression of every complete block.
            let n_blocks = n.checked_div(m).unwrap_or(0);
            let overlap = matches!(kind, LayerKind::Csa { .. });
            let block_entries = |which: Which| -> Result<Vec<Vec<f32>>> {
                par_map(n_blocks, |j| {
                    let mut src: Vec<(&[f32], &[f32], usize)> = Vec::new();
                    let d = if overlap {
                        projs[0].compressor_io(which).0.len() / 2
                    } else {
                        projs[0].compressor_io(which).0.len()
                    };
                    if overlap && j > 0 {
                        for p in &projs[(j - 1) * m..j * m] {
                            let (kv, g) = p.compressor_io(which);
                            src.push((kv, g, 0));
                        }
                    }
                    for p in &projs[j * m..(j + 1) * m] {
                        let (kv, g) = p.compressor_io(which);
                        src.push((kv, g, if overlap { d } else { 0 }));
                    }
                    self.finalize_entry(l, which, j, &pool_softmax(d, &src))
                })
                .into_iter()
                .collect()
            };
            let compressed = if m > 0 {
                block_entries(Which::Main)?
            } else {
                Vec::new()
            };
            let index_keys = if overlap {
                block_entries(Which::Indexer)?
            } else {
                Vec::new()
            };

            // 3. Attention + FFN per token (parallel over tokens).
            let outs: Vec<(Vec<f32>, LayerTrace)> =
                par_map(n, |t| -> Result<(Vec<f32>, LayerTrace)> {
                    let p = &projs[t];
                    let mut tr = LayerTrace {
                        layer: l,
                        position: t,
                        residual_in: xs[t].clone(),
                        ..Default::default()
                    };
                    let visible = (t + 1).checked_div(m).unwrap_or(0);
                    let mut sel: Vec<usize> = match kind {
                        LayerKind::SlidingWindow => Vec::new(),
                        LayerKind::Hca { .. } => (0..visible).collect(),
                        LayerKind::Csa { .. } => {
                            let (qi, w) = p.indexer.as_ref().expect("CSA indexer query");
                            let (scores, sel) = self.index_select(qi, w, &index_keys[..visible]);
                            tr.index_scores = scores;
                            sel
                        }
                    };
                    sel.sort_unstable();
                    let wpos = self.window_positions(t);
                    let mut kvs: Vec<&[f32]> =
                        wpos.iter().map(|&s| projs[s].kv.as_slice()).collect();
                    kvs.extend(sel.iter().map(|&j| compressed[j].as_slice()));
                    let (o, y) = self.attention_over(l, t, &p.q, &kvs)?;
                    let xm = self.hc_post(&y, &xs[t], &p.pre);
                    if m > 0 && (t + 1).is_multiple_of(m) {
                        tr.new_compressed = Some(compressed[(t + 1) / m - 1].clone());
                        if overlap {
                            tr.new_index_key = Some(index_keys[(t + 1) / m - 1].clone());
                        }
                    }
                    tr.attn_hc = p.pre.clone();
                    tr.attn_input = p.a.clone();
                    tr.qr = p.qr.clone();
                    tr.q = p.q.clone();
                    tr.kv = p.kv.clone();
                    tr.candidates = CandidateSet {
                        window_positions: wpos,
                        compressed: sel,
                    };
                    tr.attn_heads = o;
                    tr.attn_out = y;
                    tr.residual_mid = xm.clone();
                    let out = self.ffn_sublayer(l, tokens[t], &xm, &mut tr)?;
                    Ok((out, tr))
                })
                .into_iter()
                .collect::<Result<_>>()?;

            // 4. Seed the decode state exactly as n decode steps would leave it.
            let cache = &mut state.layers[l];
            for (t, p) in projs
                .iter()
                .enumerate()
                .skip(n.saturating_sub(cfg.window_size))
            {
                cache.window[t % cfg.window_size] = p.kv.clone();
            }
            let seed_state = |st: &mut CompressorState, which: Which| {
                let done = n_blocks * m;
                if st.overlap && n_blocks > 0 {
                    for (r, p) in projs[done - m..done].iter().enumerate() {
                        let (kv, g) = p.compressor_io(which);
                        st.set_row(r, kv, g);
                    }
                }
                for (t, p) in projs.iter().enumerate().skip(done) {
                    let (kv, g) = p.compressor_io(which);
                    let row = if st.overlap { m + t % m } else { t % m };
                    st.set_row(row, kv, g);
                }
            };
            if let Some(st) = cache.compressor.as_mut() {
                seed_state(st, Which::Main);
            }
            if let Some(st) = cache.index_compressor.as_mut() {
                seed_state(st, Which::Indexer);
            }
            cache.compressed = compressed;
            cache.index_keys = index_keys;

            for (t, (out, tr)) in outs.into_iter().enumerate() {
                xs[t] = out;
                if keep_traces {
                    traces[t].push(tr);
                }
            }
        }
        state.position = n;
        let logits = self.head(&xs[n - 1])?;
        Ok(PrefillOutput { logits, traces })
    }
}

/// Sinkhorn-Knopp of arch §3.4: row softmax + eps, column normalize, then (iters - 1) x (row, column).
pub fn sinkhorn(logits: &[f32], n: usize, iters: usize, eps: f32) -> Vec<f32> {
    let mut c = vec![0f32; n * n];
    for j in 0..n {
        let row = &logits[j * n..(j + 1) * n];
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = row.iter().map(|&v| (v - mx).exp()).sum();
        for k in 0..n {
            c[j * n + k] = (row[k] - mx).exp() / s + eps;
        }
    }
    let col_norm = |c: &mut Vec<f32>| {
        for k in 0..n {
            let s: f32 = (0..n).map(|j| c[j * n + k]).sum::<f32>() + eps;
            for j in 0..n {
                c[j * n + k] /= s;
            }
        }
    };
    let row_norm = |c: &mut Vec<f32>| {
        for j in 0..n {
            let s: f32 = c[j * n..(j + 1) * n].iter().sum::<f32>() + eps;
            for k in 0..n {
                c[j * n + k] /= s;
            }
        }
    };
    col_norm(&mut c);
    for _ in 1..iters {
        row_norm(&mut c);
        col_norm(&mut c);
    }
    c
}

/// Indices of the k largest values, descending by value; equal values: the lower index first. NaN
/// sorts below every number.
/// How a layer picks its experts from the scores (arch §3.9).
#[derive(Clone, Copy, Debug)]
pub enum RouteSelection<'a> {
    /// The token's tid2eid row, in table order (hash layers).
    Hash(&'a [usize]),
    /// The top-k of `score + bias[e]`, descending, the lower expert index first on equal values (a NaN sorts
    /// as -inf); the bias only selects, it never enters the weights.
    Biased(&'a [f32]),
}

/// Routing of one token from its gate logits: `scores = sqrt(softplus(logit))` (f32), the experts of
/// `selection` (top-`k` for [`RouteSelection::Biased`]), and `weights[j] = scores[e_j] / sum * route_scale` where
/// `sum` adds the chosen experts' scores in selection order (f32).
pub fn route_from_logits(
    logits: &[f32],
    selection: RouteSelection<'_>,
    k: usize,
    route_scale: f32,
) -> Routing {
    let scores: Vec<f32> = logits.iter().map(|&x| softplus(x).sqrt()).collect();
    let experts = match selection {
        RouteSelection::Hash(e) => e.to_vec(),
        RouteSelection::Biased(bias) => {
            let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            top_k_lower_index_wins(&biased, k)
        }
    };
    let weights = route_weights(&scores, &experts, route_scale);
    Routing {
        scores,
        experts,
        weights,
    }
}

/// `scores[e_j] / sum * route_scale` for the chosen `experts`, `sum` their scores added in selection order (f32).
pub fn route_weights(scores: &[f32], experts: &[usize], route_scale: f32) -> Vec<f32> {
    let sum: f32 = experts.iter().map(|&e| scores[e]).sum();
    experts
        .iter()
        .map(|&e| scores[e] / sum * route_scale)
        .collect()
}

pub fn top_k_lower_index_wins(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| {
        let (va, vb) = (values[a], values[b]);
        let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
        key(vb)
            .partial_cmp(&key(va))
            .expect("no NaN after mapping")
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// The RoPE table of layer `layer` (arch §3.1): θ = `rope_theta` without YaRN on sliding-window-only layers,
/// `compress_rope_theta` with the YaRN blend on the compressed ones.
pub fn layer_rope(cfg: &ModelConfig, layer: usize) -> RopeTable {
    match cfg.layer_kind(layer) {
        LayerKind::SlidingWindow => RopeTable::new(cfg.rope_head_dim, cfg.rope_theta, None),
        _ => RopeTable::new(
            cfg.rope_head_dim,
            cfg.compress_rope_theta,
            cfg.yarn.as_ref(),
        ),
    }
}

// ---- attention-side per-token steps after the dense linears (arch §3.6, §3.8) -----------------------------------
// `Model::attn_projections` runs these; the GPU kernels of src/ops/qkv_prep are checked against them.

/// Per-head query finish of one token (arch §3.6, after `wq_b`): for every head of `head_dim` values, RMS
/// normalization without weight over all its dims in the official BF16 operation order (factor
/// [`head_rms_scale_bf16`]: squares, mean, `+ eps` and rsqrt each rounded to BF16), then [`q_head_scale_rope`].
pub fn q_heads_finish(
    q: &mut [f32],
    head_dim: usize,
    nope: usize,
    rope: &RopeTable,
    t: usize,
    eps: f32,
) {
    for qh in q.chunks_exact_mut(head_dim) {
        let r = head_rms_scale_bf16(qh, eps);
        q_head_scale_rope(qh, nope, r, rope, t);
    }
}

/// One query head given its RMS factor `inv`: every value `bf16(q * inv)` (one f32 product, exact when `inv` is
/// a BF16 value such as [`head_rms_scale_bf16`]'s), RoPE at `t` on dims `nope..`, those rounded to BF16 again.
pub fn q_head_scale_rope(qh: &mut [f32], nope: usize, inv: f32, rope: &RopeTable, t: usize) {
    for v in qh.iter_mut() {
        *v = bf16_round(*v * inv);
    }
    rope.apply(&mut qh[nope..], t, false);
    bf16_round_slice(&mut qh[nope..]);
}

/// The window KV vector of one token before its FP8 storage (arch §3.6): `rms_norm_bf16(kv_raw, kv_norm)`,
/// RoPE at `t` on dims `nope..`, those rounded to BF16. The caller FP8-simulates dims `..nope` per 64.
pub fn window_kv_rope(
    kv_raw: &[f32],
    kv_norm: &[f32],
    nope: usize,
    rope: &RopeTable,
    t: usize,
    eps: f32,
) -> Vec<f32> {
    window_kv_rope_with(kv_raw, kv_norm, inv_rms(kv_raw, eps), nope, rope, t)
}

/// [`window_kv_rope`] with the RMS factor `inv` given ([`rms_scale_bf16`]).
pub fn window_kv_rope_with(
    kv_raw: &[f32],
    kv_norm: &[f32],
    inv: f32,
    nope: usize,
    rope: &RopeTable,
    t: usize,
) -> Vec<f32> {
    let mut kv = rms_scale_bf16(kv_raw, kv_norm, inv);
    rope.apply(&mut kv[nope..], t, false);
    bf16_round_slice(&mut kv[nope..]);
    kv
}

/// One indexer query head before its FP4 simulation (arch §3.8): RoPE at `t` on the last `rope_dims` dims,
/// those rounded to BF16, the orthonormal Hadamard over the head ([`hadamard_inplace`]), all rounded to BF16.
/// The caller then FP4-simulates the head per 32.
pub fn indexer_q_rotate(qh: &mut [f32], rope_dims: usize, rope: &RopeTable, t: usize) {
    let n = qh.len();
    rope.apply(&mut qh[n - rope_dims..], t, false);
    bf16_round_slice(&mut qh[n - rope_dims..]);
    hadamard_inplace(qh);
    bf16_round_slice(qh);
}

/// The indexer head-weight scale `1 / sqrt(index_head_dim * index_n_heads)` in f32 (arch §3.8).
pub fn indexer_weight_scale(head_dim: usize, n_heads: usize) -> f32 {
    1.0 / ((head_dim * n_heads) as f32).sqrt()
}

/// The indexer head weights from the `weights_proj` output: `bf16(w * scale)` (one f32 product).
pub fn indexer_head_weights(w: &mut [f32], scale: f32) {
    for v in w {
        *v = bf16_round(*v * scale);
    }
}
