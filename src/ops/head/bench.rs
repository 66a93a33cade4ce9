//! Measurement hooks of the head family at a DSV4 shape: the embedding of T tokens ([`embed_tokens`]) and the
//! final `hc_head` + RMSNorm ([`final_norm`]), each as a captured graph replayed back to back (the decode step's
//! form). The sweep adapter is `bench::kernels::head`.

use anyhow::{anyhow, bail, Result};
use half::bf16;

use super::{embed_tokens, final_norm, EmbedShape, STREAMS};
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;
use crate::ops::inputs;
use crate::ops::mhc::bench::random_mhc_params;
use crate::ops::mhc::{MhcPreOutputs, MhcWeights, MhcWorkspace, HC_HEAD_MIX};
use crate::ops::norm_quant::bench::random_weight;
use crate::ops::norm_quant::reference::RMS_EPS;
use crate::ops::norm_quant::{upload_checked_bf16, OutFormat};

/// Variants of the head sweep.
pub const VARIANTS: &[&str] = &["embed", "final_norm"];

/// One measured point: per-repetition device times and the bytes one call reads plus writes.
pub struct Measured {
    pub samples_us: Vec<f64>,
    pub bytes: u64,
}

/// Bytes of one embedding call: T ids, T table rows read, T x 4 rows written.
pub fn embed_bytes(s: &EmbedShape) -> u64 {
    (4 * s.tokens + 2 * s.tokens * s.dim * (1 + STREAMS)) as u64
}

/// Bytes of one final norm call: X read, hc_head_fn + norm weight read, pre / u / y / rstd written.
pub fn final_norm_bytes(tokens: usize, d: usize) -> u64 {
    (2 * tokens * STREAMS * d + HC_HEAD_MIX * 4 * d * 4 + 2 * d + tokens * (16 + 4 * d + 4)) as u64
}

/// Time `variant` (one of [`VARIANTS`]) on `tokens` seeded tokens of a `vocab` x `dim` model.
pub fn measure(
    gpu: &Gpu,
    plan: TimingPlan,
    variant: &str,
    tokens: usize,
    vocab: usize,
    dim: usize,
    seed: u64,
) -> Result<Measured> {
    let stream = gpu.stream.clone();
    match variant {
        "embed" => {
            let shape = EmbedShape { tokens, vocab, dim };
            shape.check()?;
            // The table's values do not change the time: a byte pattern (0x3C3C = 0.0115 in BF16).
            let table = gpu.poisoned::<bf16>(vocab * dim, 0x3C)?;
            let ids: Vec<i32> = inputs::uniform(tokens, 1.0, seed)
                .iter()
                .map(|u| (((u + 1.0) * 0.5 * vocab as f32) as usize).min(vocab - 1) as i32)
                .collect();
            let ids = gpu.upload(&ids)?;
            let x = gpu.zeros::<bf16>(tokens * STREAMS * dim)?;
            let error = gpu.zeros::<u32>(1)?;
            let run = || embed_tokens(gpu, &stream, &ids, &table, &shape, &x, &error);
            run()?;
            let g = gpu.capture(run)?;
            g.launch()
                .map_err(|e| anyhow!("head graph launch: {e:?}"))?;
            let bytes = embed_bytes(&shape);
            Ok(Measured {
                samples_us: gpu.time_graph_us(&g, plan, 20)?,
                bytes,
            })
        }
        "final_norm" => {
            let hp = random_mhc_params(dim, HC_HEAD_MIX, seed ^ 4);
            let nw = random_weight(dim, seed ^ 5);
            let w =
                MhcWeights::upload_head(gpu, &hp.mix_fn, 0.5, &[0.1, -0.1, 0.2, 0.0], &nw, dim)?;
            let x = upload_checked_bf16(
                gpu,
                "X",
                &inputs::activation_rows(tokens * STREAMS, dim, seed),
            )?;
            let mut arena =
                crate::gpu::arena::Arena::new(gpu, MhcWorkspace::workspace_bytes(tokens, dim))?;
            let ws = MhcWorkspace::carve(&mut arena, tokens, dim)?;
            let mut out = MhcPreOutputs::alloc_poisoned(gpu, OutFormat::Bf16, tokens, dim)?;
            final_norm(gpu, &stream, &x, &w, RMS_EPS, &ws, &mut out)?;
            let g = gpu.capture(|| final_norm(gpu, &stream, &x, &w, RMS_EPS, &ws, &mut out))?;
            g.launch()
                .map_err(|e| anyhow!("head graph launch: {e:?}"))?;
            Ok(Measured {
                samples_us: gpu.time_graph_us(&g, plan, 20)?,
                bytes: final_norm_bytes(tokens, dim),
            })
        }
        v => bail!("head: unknown variant `{v}` (one of {VARIANTS:?})"),
    }
}
