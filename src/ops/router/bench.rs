//! Measurement hooks of the router family: one routing call (logits + select-and-group) of T tokens at a DSV4
//! shape, timed as plain launches on the GPU's stream or as a captured graph replayed back to back (the decode
//! step's form). The sweep adapter is `bench::kernels::router`.

use anyhow::{anyhow, Result};
use half::bf16;

use super::{
    route, workspace_bytes, RouterInputs, RouterOutputs, RouterShape, RouterWorkspace, Selection,
    TOPK,
};
use crate::gpu::arena::Arena;
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;
use crate::ops::inputs;

/// How a routing call is launched for timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterLaunch {
    /// The two launches enqueued on the stream each repetition.
    Stream,
    /// Both launches captured once in a CUDA graph; each sample is one replay (20 back to back per event pair).
    Graph,
}

/// One measured point: per-repetition device times and the bytes one call reads plus writes.
pub struct Measured {
    pub samples_us: Vec<f64>,
    pub bytes: u64,
}

/// Bytes one call moves: the gate weight and the hidden vectors read, the logits written and read back, the
/// outputs written (pairs: expert, weight, row; slots: token, weight; counts).
pub fn route_bytes(s: &RouterShape) -> u64 {
    let (t, e, d) = (s.tokens, s.experts, s.dim);
    (2 * e * d
        + 2 * t * d
        + 2 * 4 * t * e
        + 3 * 4 * t * TOPK
        + 2 * 4 * s.rows_total()
        + 4 * e
        + 4 * e) as u64
}

/// Route `tokens` seeded activation-like tokens through a seeded gate (biased selection, route scale 1.5), with
/// capacity = tokens (no pair is ever dropped).
pub fn route_tokens(
    gpu: &Gpu,
    plan: impl Fn(u64) -> TimingPlan,
    how: RouterLaunch,
    tokens: usize,
    experts: usize,
    dim: usize,
    seed: u64,
) -> Result<Measured> {
    let shape = RouterShape::identity(tokens, experts, dim, tokens);
    shape.check()?;
    let to_bf16 = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let x = gpu.upload(&to_bf16(inputs::activation_rows(tokens, dim, seed)))?;
    let gate_scale = 1.0 / (dim as f32).sqrt();
    let gate = gpu.upload(&to_bf16(inputs::uniform(
        experts * dim,
        gate_scale,
        seed ^ 1,
    )))?;
    let bias = gpu.upload(&inputs::uniform(experts, 0.1, seed ^ 2))?;
    let inp = RouterInputs {
        x: &x,
        gate: &gate,
        selection: Selection::Biased { bias: &bias },
        route_scale: 1.5,
        slot_of: None,
    };
    let mut arena = Arena::new(gpu, workspace_bytes(&shape))?;
    let ws = RouterWorkspace::carve(&mut arena, &shape)?;
    let mut out = RouterOutputs::alloc(gpu, &shape, 0)?;
    let bytes = route_bytes(&shape);
    let samples_us = match how {
        RouterLaunch::Stream => {
            gpu.time_us(plan(bytes), || route(gpu, &gpu.stream, &inp, &ws, &mut out))?
        }
        RouterLaunch::Graph => {
            // One plain call first: the kernels are resolved outside the capture.
            route(gpu, &gpu.stream, &inp, &ws, &mut out)?;
            let graph = gpu.capture(|| route(gpu, &gpu.stream, &inp, &ws, &mut out))?;
            graph
                .launch()
                .map_err(|e| anyhow!("router graph launch: {e:?}"))?;
            gpu.time_graph_us(&graph, plan(bytes), 20)?
        }
    };
    Ok(Measured { samples_us, bytes })
}
