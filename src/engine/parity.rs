//! End-to-end parity of the GPU engine with the CPU model (issue #25's "free running" check).
//!
//! The GPU decodes greedily on its own; the CPU models are fed the tokens the GPU chose, so every step compares
//! the logits of the same history. Three CPU models run beside it on the same weights ([`ParityModels`]):
//! * the model itself (the checkpoint's formats);
//! * the model in the GPU's formats (`Model::in_gpu_formats`): the routed experts read NVFP4 activations (f and h),
//!   which moe_gemm does by design where the checkpoint uses FP8 (`RoutedActivations::Nvfp4`), and the attention
//!   side reads each head's query as an FP8 KV entry and the indexer keys through the FP8 key cache's codec
//!   (`AttentionFormats::Kernels`). The GPU's implementation is judged against this one; its distance from the
//!   model is the cost of the formats, measured on the CPU;
//! * the noise floor: the model with one rounding changed (`MoeSum::Bf16Accumulator`, the MoE's terms added
//!   into a BF16 accumulator). Two faithful implementations of this model differ at least that much (a 1-ulp
//!   change flips near-tied router choices and grows layer by layer), so the GPU is judged against the floor,
//!   not against bit equality;
//! * the floor of the GPU's formats: the model in the GPU's formats with that same rounding changed (CPU4'). The
//!   GPU is judged against CPU4, and NVFP4's coarse steps can amplify a 1-ulp change more than FP8's, so the floor
//!   that matches that comparison is cos(CPU4', CPU4).

use crate::engine::run::Engine;
use crate::gpu::Gpu;
use crate::model::numerics::cosine;
use crate::model::sampler::SamplerConfig;
use crate::model::{CachePolicy, Model, ModelConfig, MoeSum, Weights};
use crate::ops::sampler::SamplerParams;
use anyhow::{ensure, Result};

/// The CPU models a parity run compares with (module docs). All three on the same weights.
pub struct ParityModels<'a> {
    pub cpu: &'a Model,
    pub formats: &'a Model,
    pub floor: &'a Model,
    pub formats_floor: &'a Model,
}

impl ParityModels<'_> {
    fn check(&self) -> Result<()> {
        let (c, f, n, nf) = (self.cpu, self.formats, self.floor, self.formats_floor);
        ensure!(
            (c.moe_sum, c.gpu_formats()) == (MoeSum::F32, Some(false)),
            "parity: the CPU model must be the model itself"
        );
        ensure!(
            (f.moe_sum, f.gpu_formats()) == (MoeSum::F32, Some(true)),
            "parity: the formats model must be the model in the GPU's formats"
        );
        ensure!(
            (n.moe_sum, n.gpu_formats()) == (MoeSum::Bf16Accumulator, Some(false)),
            "parity: the floor model must be the model with MoeSum::Bf16Accumulator"
        );
        ensure!(
            (nf.moe_sum, nf.gpu_formats()) == (MoeSum::Bf16Accumulator, Some(true)),
            "parity: the formats' floor model must be the formats model with MoeSum::Bf16Accumulator"
        );
        Ok(())
    }
}

/// The four models of [`ParityModels`], owned, on the synthetic weights of one seed.
pub struct ParityModelSet {
    pub cpu: Model,
    pub formats: Model,
    pub floor: Model,
    pub formats_floor: Model,
}

impl ParityModelSet {
    /// The model, the model in the GPU's formats, and each with the MoE summed in BF16, on `cfg`'s synthetic weights
    /// of `seed` (each regenerated: a `Model` owns its weights).
    pub fn synthetic(cfg: &ModelConfig, seed: u64) -> Result<ParityModelSet> {
        let model = |moe_sum, gpu_formats: bool| -> Result<Model> {
            let mut m = Model::new(Weights::synthetic(cfg.clone(), seed, CachePolicy::All)?)?;
            if gpu_formats {
                m = m.in_gpu_formats();
            }
            m.moe_sum = moe_sum;
            Ok(m)
        };
        Ok(ParityModelSet {
            cpu: model(MoeSum::F32, false)?,
            formats: model(MoeSum::F32, true)?,
            floor: model(MoeSum::Bf16Accumulator, false)?,
            formats_floor: model(MoeSum::Bf16Accumulator, true)?,
        })
    }

    pub fn models(&self) -> ParityModels<'_> {
        ParityModels {
            cpu: &self.cpu,
            formats: &self.formats,
            floor: &self.floor,
            formats_floor: &self.formats_floor,
        }
    }
}

/// One sequence at one step.
#[derive(Clone, Debug, PartialEq)]
pub struct ParityRow {
    pub step: usize,
    pub seq: usize,
    /// Cosine of the GPU's logits with the CPU model's.
    pub cos_gpu: f64,
    /// Cosine of the GPU's logits with the CPU model in the GPU's formats (the implementation's distance).
    pub cos_gpu_formats: f64,
    /// Cosine of the CPU model in the GPU's formats with the CPU model (the formats' cost).
    pub cos_formats: f64,
    /// Cosine of the CPU model with one rounding changed with the CPU model (the floor).
    pub cos_floor: f64,
    /// Cosine of the formats model with that rounding changed with the formats model (the floor of the GPU's
    /// comparison with the formats model).
    pub cos_formats_floor: f64,
    /// The GPU's greedy token (the history every model continues with).
    pub gpu_token: u32,
    /// The argmax of the CPU model, of the formats model and of the floor model.
    pub cpu_token: u32,
    pub formats_token: u32,
    pub floor_token: u32,
    /// The argmax of the formats model with the rounding changed.
    pub formats_floor_token: u32,
}

/// The rows as a text table, one line per sequence and step, under a header naming the models (CPU, CPU4 the
/// GPU's formats, CPU' the floor: module docs).
pub fn table(rows: &[ParityRow]) -> String {
    let mut t = String::from(
        "step  seq  cos(GPU,CPU)  cos(GPU,CPU4)  cos(CPU4,CPU)  cos(CPU',CPU)  cos(CPU4',CPU4)    GPU   CPU  CPU4  CPU'  CPU4'\n",
    );
    for r in rows {
        t.push_str(&format!(
            "{:>4}  {:>3}  {:>12.6}  {:>13.6}  {:>13.6}  {:>13.6}  {:>15.6}  {:>5} {:>5} {:>5} {:>5} {:>5}\n",
            r.step,
            r.seq,
            r.cos_gpu,
            r.cos_gpu_formats,
            r.cos_formats,
            r.cos_floor,
            r.cos_formats_floor,
            r.gpu_token,
            r.cpu_token,
            r.formats_token,
            r.floor_token,
            r.formats_floor_token
        ));
    }
    t
}

/// Index of the largest value (the lower index on ties, as the greedy sampler).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Prefills `prompts` on the GPU and on the CPU models, then runs `steps` greedy decode steps, comparing after
/// each: one [`ParityRow`] per sequence and step. The CPU models' cost is the bound on what this can afford (the
/// small geometry).
pub fn free_running(
    gpu: &Gpu,
    engine: &mut Engine,
    models: &ParityModels,
    prompts: &[Vec<u32>],
    steps: usize,
    mut on_step: impl FnMut(usize),
) -> Result<Vec<ParityRow>> {
    models.check()?;
    let cpu_models = [
        models.cpu,
        models.formats,
        models.floor,
        models.formats_floor,
    ];
    let vocab = models.cpu.config().vocab_size;
    let params = SamplerParams::from_config(&SamplerConfig::greedy(), steps + 1)?;
    engine.prefill(gpu, prompts, &params, &[])?;
    // Per sequence, per CPU model: its state and its latest logits.
    let mut cpus: Vec<Vec<_>> = prompts
        .iter()
        .map(|p| {
            cpu_models
                .iter()
                .map(|m| -> Result<_> {
                    let mut st = m.new_state();
                    let logits = m.prefill(&mut st, p, false)?.logits;
                    Ok((st, logits))
                })
                .collect::<Result<_>>()
        })
        .collect::<Result<_>>()?;
    let mut rows = Vec::with_capacity(steps * prompts.len());
    for step in 0..steps {
        let g_all = engine.state.read_logits(&gpu.stream)?;
        let sampled = engine.sampled(gpu)?;
        for (b, seq) in cpus.iter_mut().enumerate() {
            let g = &g_all[b * vocab..][..vocab];
            ensure!(
                g.iter().all(|v| v.is_finite()),
                "parity: step {step} sequence {b}: non-finite GPU logits"
            );
            ensure!(
                sampled[b] >= 0,
                "parity: step {step} sequence {b}: the GPU sampled nothing"
            );
            let t = sampled[b] as u32;
            let (cpu, formats, floor, formats_floor) = (&seq[0].1, &seq[1].1, &seq[2].1, &seq[3].1);
            rows.push(ParityRow {
                step,
                seq: b,
                cos_gpu: cosine(g, cpu),
                cos_gpu_formats: cosine(g, formats),
                cos_formats: cosine(formats, cpu),
                cos_floor: cosine(floor, cpu),
                cos_formats_floor: cosine(formats_floor, formats),
                gpu_token: t,
                cpu_token: argmax(cpu) as u32,
                formats_token: argmax(formats) as u32,
                floor_token: argmax(floor) as u32,
                formats_floor_token: argmax(formats_floor) as u32,
            });
            if step + 1 < steps {
                for (m, (st, logits)) in cpu_models.iter().zip(seq.iter_mut()) {
                    *logits = m.decode_step(st, t)?.logits;
                }
            }
        }
        if step + 1 < steps {
            engine.decode_step(gpu)?;
        }
        on_step(step);
    }
    Ok(rows)
}

/// The summary of a parity run: the worst and mean cosines and the greedy agreements.
#[derive(Clone, Copy, Debug)]
pub struct ParitySummary {
    pub min_cos_gpu: f64,
    pub mean_cos_gpu: f64,
    pub min_cos_gpu_formats: f64,
    pub mean_cos_gpu_formats: f64,
    pub min_cos_formats: f64,
    pub mean_cos_formats: f64,
    pub min_cos_floor: f64,
    pub mean_cos_floor: f64,
    pub min_cos_formats_floor: f64,
    pub mean_cos_formats_floor: f64,
    /// Rows where the GPU's token is the CPU model's argmax, the formats model's argmax; where the formats
    /// model's and the floor model's argmax are the CPU model's; where the formats' floor model's is the formats
    /// model's.
    pub agree_gpu: usize,
    pub agree_gpu_formats: usize,
    pub agree_formats: usize,
    pub agree_floor: usize,
    pub agree_formats_floor: usize,
    pub rows: usize,
}

impl ParitySummary {
    pub fn of(rows: &[ParityRow]) -> ParitySummary {
        let n = rows.len().max(1) as f64;
        let min = |f: fn(&ParityRow) -> f64| rows.iter().map(f).fold(1.0, f64::min);
        let mean = |f: fn(&ParityRow) -> f64| rows.iter().map(f).sum::<f64>() / n;
        let count = |f: fn(&ParityRow) -> bool| rows.iter().filter(|r| f(r)).count();
        ParitySummary {
            min_cos_gpu: min(|r| r.cos_gpu),
            mean_cos_gpu: mean(|r| r.cos_gpu),
            min_cos_gpu_formats: min(|r| r.cos_gpu_formats),
            mean_cos_gpu_formats: mean(|r| r.cos_gpu_formats),
            min_cos_formats: min(|r| r.cos_formats),
            mean_cos_formats: mean(|r| r.cos_formats),
            min_cos_floor: min(|r| r.cos_floor),
            mean_cos_floor: mean(|r| r.cos_floor),
            min_cos_formats_floor: min(|r| r.cos_formats_floor),
            mean_cos_formats_floor: mean(|r| r.cos_formats_floor),
            agree_gpu: count(|r| r.cpu_token == r.gpu_token),
            agree_gpu_formats: count(|r| r.formats_token == r.gpu_token),
            agree_formats: count(|r| r.formats_token == r.cpu_token),
            agree_floor: count(|r| r.floor_token == r.cpu_token),
            agree_formats_floor: count(|r| r.formats_floor_token == r.formats_token),
            rows: rows.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RoutedActivations;

    #[test]
    fn argmax_takes_the_lower_index_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[5.0]), 0);
    }

    /// The attention side's kernel formats (`AttentionFormats::Kernels`: the query as an FP8 KV entry, the indexer
    /// keys through the FP8 key codec) take effect and stay close: with the routed experts in NVFP4 either way, the
    /// logits move but keep cosine > 0.99 after a short prompt.
    #[test]
    fn kernel_attention_formats_stay_close_and_differ() {
        let cfg = ModelConfig::small();
        let mk =
            || Model::new(Weights::synthetic(cfg.clone(), 11, CachePolicy::All).unwrap()).unwrap();
        let mut a = mk();
        a.routed_activations = RoutedActivations::Nvfp4;
        let b = mk().in_gpu_formats();
        assert_eq!((a.gpu_formats(), b.gpu_formats()), (None, Some(true)));
        let toks = [3u32, 17, 99, 234, 5, 411, 8, 60];
        let la = a.prefill(&mut a.new_state(), &toks, false).unwrap().logits;
        let lb = b.prefill(&mut b.new_state(), &toks, false).unwrap().logits;
        let c = cosine(&la, &lb);
        println!(
            "cosine of the kernel attention formats with the model's after {} tokens: {c:.8}",
            toks.len()
        );
        assert!(c > 0.99, "the attention formats diverge: cosine {c}");
        assert!(la != lb, "the attention formats changed nothing");
    }

    /// The floor model computes the same model with one rounding changed: on a short history its logits stay
    /// close to the CPU model's, yet not bit-equal (a floor of exactly 1.0 would measure nothing: the rounding
    /// it changes must take effect).
    #[test]
    fn bf16_accumulated_moe_stays_close_and_differs() {
        let cfg = ModelConfig::small();
        let w = Weights::synthetic(cfg.clone(), 7, CachePolicy::All).unwrap();
        let a = Model::new(w).unwrap();
        let mut b = Model::new(Weights::synthetic(cfg, 7, CachePolicy::All).unwrap()).unwrap();
        b.moe_sum = MoeSum::Bf16Accumulator;
        let toks = [3u32, 17, 99, 234, 5, 411, 8, 60];
        let (mut sa, mut sb) = (a.new_state(), b.new_state());
        let la = a.prefill(&mut sa, &toks, false).unwrap().logits;
        let lb = b.prefill(&mut sb, &toks, false).unwrap().logits;
        let c = cosine(&la, &lb);
        println!(
            "cosine of the floor model with the CPU model after {} tokens: {c:.8}",
            toks.len()
        );
        assert!(c > 0.99, "the floor models diverge: cosine {c}");
        assert!(la != lb, "the floor model's rounding changed nothing");
    }
}
