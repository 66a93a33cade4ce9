//! Measurement hook of the weights family: fill one large synthetic tensor on the GPU and return the device
//! times with the bytes written. The tensor has the init of a DSV4-Flash tensor of the chosen kind (e.g. the
//! routed experts' FP4 codes, whose stacks are most of the model's bytes) and `bytes` bytes. The sweep adapter
//! that turns this into CSV rows is `bench::kernels::weights`.

use anyhow::{anyhow, bail, Result};

use super::{check_fill, fill};
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;
use crate::model::weights::{tensor_manifest, StoredDtype, SyntheticInit, TensorSpec};
use crate::model::ModelConfig;

/// One measured point: per-repetition device times and the bytes one fill writes (it reads nothing).
pub struct Measured {
    pub samples_us: Vec<f64>,
    pub bytes: u64,
}

/// The kinds of tensor the bench fills: the bulk (init, dtype) pairs of the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillCase {
    /// MXFP4 expert weights (`experts.*.w1.weight`, I8 e2m1 pairs).
    Fp4Codes,
    /// FP8 e4m3 weights (`attn.wq_b.weight`).
    Fp8Codes,
    /// UE8M0 block scales (`experts.*.w1.scale`).
    Ue8m0Scale,
    /// BF16 matrices (`embed.weight`).
    Bf16Uniform,
    /// F32 tensors (`hc_attn_fn`).
    F32Uniform,
}

impl FillCase {
    /// The variant name of the sweep.
    pub fn name(self) -> &'static str {
        match self {
            FillCase::Fp4Codes => "fp4_codes",
            FillCase::Fp8Codes => "fp8_codes",
            FillCase::Ue8m0Scale => "ue8m0_scale",
            FillCase::Bf16Uniform => "bf16_uniform",
            FillCase::F32Uniform => "f32_uniform",
        }
    }

    pub fn from_name(name: &str) -> Result<FillCase> {
        FillCase::ALL
            .into_iter()
            .find(|c| c.name() == name)
            .ok_or_else(|| anyhow!("weights fill: unknown case `{name}`"))
    }

    pub const ALL: [FillCase; 5] = [
        FillCase::Fp4Codes,
        FillCase::Fp8Codes,
        FillCase::Ue8m0Scale,
        FillCase::Bf16Uniform,
        FillCase::F32Uniform,
    ];

    /// The Flash tensor whose init and dtype the case takes.
    fn model_tensor(self) -> &'static str {
        match self {
            FillCase::Fp4Codes => "layers.0.ffn.experts.0.w1.weight",
            FillCase::Fp8Codes => "layers.0.attn.wq_b.weight",
            FillCase::Ue8m0Scale => "layers.0.ffn.experts.0.w1.scale",
            FillCase::Bf16Uniform => "embed.weight",
            FillCase::F32Uniform => "layers.0.hc_attn_fn",
        }
    }
}

/// A 1-D tensor of `bytes` bytes (rounded down to whole elements, at least one) with the init and dtype of the
/// case's DSV4-Flash tensor.
pub fn bench_tensor(case: FillCase, bytes: u64) -> Result<TensorSpec> {
    let name = case.model_tensor();
    let model = tensor_manifest(&ModelConfig::flash())
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| anyhow!("{name} is not in the DSV4-Flash manifest"))?;
    let numel = (bytes as usize / model.dtype.size()).max(1);
    debug_assert!(matches!(
        (&model.init, model.dtype),
        (SyntheticInit::Fp4Codes, StoredDtype::I8)
            | (SyntheticInit::Fp8Codes, StoredDtype::F8E4M3)
            | (SyntheticInit::Scale { .. }, StoredDtype::F8E8M0)
            | (SyntheticInit::Uniform { .. }, _)
    ));
    Ok(TensorSpec {
        name: format!("bench.{}", case.name()),
        dtype: model.dtype,
        shape: vec![numel],
        init: model.init,
    })
}

/// Fill the whole of [`bench_tensor`]`(case, bytes)` (seed `seed`) into one device buffer, timed on the GPU's
/// stream with the plan for the bytes written.
pub fn fill_tensor(
    gpu: &Gpu,
    plan: impl Fn(u64) -> TimingPlan,
    case: FillCase,
    bytes: u64,
    seed: u64,
) -> Result<Measured> {
    let spec = bench_tensor(case, bytes)?;
    let n = spec.nbytes();
    check_fill(&spec, 0, spec.numel(), n)?;
    if n == 0 {
        bail!("weights fill: empty tensor");
    }
    let out = gpu.zeros::<u8>(n)?;
    let samples_us = gpu.time_us(plan(n as u64), || {
        fill(gpu, &gpu.stream, seed, &spec, 0, spec.numel(), &out)
    })?;
    Ok(Measured {
        samples_us,
        bytes: n as u64,
    })
}
