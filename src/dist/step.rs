//! The expert-parallel decode step of one rank (docs/multi-gpu.md, "The per-layer step on each rank"): the engine's
//! [`DecodeState`] runs the replicated parts unchanged (embedding, the attention half, the head, the sampler); the
//! FFN half runs split at the combine: [`FfnHalf::run_to_partial`] with the rank's slot table (only its own experts'
//! pairs get rows), the combine ([`Combine`]: all-gather of every rank's f32 partial, the rank-ordered sum plus the
//! shared expert, one BF16 rounding, into `moe_out`), then [`FfnHalf::run_post`] (hc_post).
//!
//! With a world of one rank the slot table is the plan's expert map's, the gather is the partial itself, and the step
//! computes the single-GPU step's bits (tests/dist_ep.rs): the f32 finish is moe_gemm's L2 epilogue without the
//! addend, and the combine adds the shared expert to it and rounds as that epilogue does.
//!
//! The step runs on the GPU's stream (the communicator's) with no host sync inside, so [`EpStep::capture_decode_step`]
//! captures it into one CUDA graph that replays with no host work, as the engine's step does (NCCL calls are
//! captured as graph nodes from NCCL 2.9 on).
//!
//! [`FfnHalf::run_to_partial`]: crate::engine::ffn::FfnHalf::run_to_partial
//! [`FfnHalf::run_post`]: crate::engine::ffn::FfnHalf::run_post

use anyhow::{ensure, Result};
use half::bf16;

use crate::dist::comm::{Combine, Communicator};
use crate::engine::ep::ExpertPartition;
use crate::engine::step::{DecodeState, Half};
use crate::engine::weights::DeviceWeights;
use crate::gpu::{DeviceBuf, Gpu, Stream};

/// One rank's expert-parallel machinery over a [`DecodeState`] (module docs).
pub struct EpStep {
    pub comm: Communicator,
    pub partition: ExpertPartition,
    pub combine: Combine,
}

impl EpStep {
    /// Sets `state` up for rank `comm.rank` of `comm.world`: its FFN half must already route by the rank's expert map
    /// ([`ExpertPartition::map_of`], which the plan of the weights it was built on carries: the router's slot table
    /// and the loaded experts both follow it), and the combine's buffers are allocated.
    pub fn new(gpu: &Gpu, state: &mut DecodeState, comm: Communicator) -> Result<EpStep> {
        let cfg = &state.config;
        let partition = ExpertPartition::new(cfg.n_routed_experts, comm.world)?;
        let map = state.ffn.map;
        ensure!(
            map == partition.map_of(comm.rank, map.slots)?,
            "rank {} of {}: the FFN half routes by {map}, not by the rank's block of experts",
            comm.rank,
            comm.world
        );
        let combine = Combine::new(gpu, comm.world, state.shape.batch * cfg.dim)?;
        Ok(EpStep {
            comm,
            partition,
            combine,
        })
    }

    /// The FFN half of `layer` (`x_mid -> x`), expert-parallel.
    pub fn ffn_half(
        &mut self,
        state: &mut DecodeState,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
    ) -> Result<()> {
        let (io, _, ffn) = state.layer_parts(Half::Ffn, layer)?;
        ffn.run_to_partial(gpu, stream, weights, layer, &io, &self.combine.partial)?;
        let shared = ffn
            .has_shared_expert(layer)
            .then_some(&ffn.shared_out as &dyn DeviceBuf<bf16>);
        self.combine
            .run(gpu, stream, &self.comm, shared, &ffn.moe_out)?;
        ffn.run_post(gpu, stream, &io)
    }

    /// [`DecodeState::decode_step`] with the expert-parallel FFN halves: embedding, every layer, head, sampling,
    /// positions advanced (the engine's one step loop, [`DecodeState::decode_step_with`]).
    pub fn decode_step(
        &mut self,
        state: &mut DecodeState,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
    ) -> Result<()> {
        state.decode_step_with(gpu, stream, weights, &mut |st: &mut DecodeState, layer| {
            self.ffn_half(st, gpu, stream, weights, layer)
        })
    }

    /// [`DecodeState::prompt_step`] with the expert-parallel FFN halves: embedding and every layer, positions
    /// advanced, no head.
    pub fn prompt_step(
        &mut self,
        state: &mut DecodeState,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
    ) -> Result<()> {
        state.prompt_step_with(gpu, stream, weights, &mut |st: &mut DecodeState, layer| {
            self.ffn_half(st, gpu, stream, weights, layer)
        })
    }

    /// One decode step ([`EpStep::decode_step`]) captured into a CUDA graph on `stream` (nothing runs until the graph
    /// is launched); each launch is one more step, reading the tokens, positions and counts the previous step left on
    /// the device. Capture after the first eager step, so that every lazily built plan and loaded kernel exists.
    pub fn capture_decode_step(
        &mut self,
        state: &mut DecodeState,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
    ) -> Result<cudarc::driver::CudaGraph> {
        crate::gpu::timing::capture_on(stream, || self.decode_step(state, gpu, stream, weights))
    }
}
