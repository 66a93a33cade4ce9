//! The engine: the whole DeepSeek-V4 model on one GPU (issue #25; docs/engine.md). A layer between the commands and
//! the ops: `cli -> engine -> ops -> (formats, gpu)`, using `model` for geometries, manifests and checkpoints.
//!
//! * [`plan`]: the memory plan of a run, pure host arithmetic checked before any GPU work: dense weights as stored,
//!   routed experts in moe_gemm's NVFP4 layout, the KV cache pool, the step workspace budget, and the mapping of
//!   logical experts onto the physical slots that fit ([`plan::ExpertMap`]).
//! * [`weights`]: the weights on the device per the plan, from the GPU generator or a checkpoint, with the routed
//!   experts converted MXFP4 -> NVFP4 on the device.
//! * [`prefill`]: chunked prefill: a prompt chunk of one sequence (up to 1024 tokens) as C rows of the layer
//!   halves, over the decode state's caches through per-row tables.
//! * [`ep`]: expert parallelism's host rules (docs/multi-gpu.md): which rank owns which routed expert, the pairs a
//!   rank computes, the deterministic combine, and a CPU model of several ranks.

pub mod attn;
pub mod cache;
pub mod ep;
pub mod ffn;
pub mod io;
pub mod parity;
pub mod plan;
pub mod prefill;
pub mod report;
pub mod run;
pub mod step;
pub mod weights;

pub use plan::{resolve_model, ExpertMap, IndexKeyFormat, MemoryPlan, PlanRequest};
pub use weights::{DeviceWeights, WeightSource};

use crate::gpu::Gpu;
use anyhow::{anyhow, Result};

/// Free device memory now (what a [`PlanRequest`] is built with).
pub fn free_device_bytes(gpu: &Gpu) -> Result<usize> {
    let (free, _total) = gpu
        .stream
        .context()
        .mem_get_info()
        .map_err(|e| anyhow!("querying free device memory: {e:?}"))?;
    Ok(free)
}
