//! The CPU reference of the router: glue that hands the GPU's BF16 inputs to the CPU model's routing
//! (`model::reference::route_from_logits`, the function `Model::route` uses) and its grouping to `moe_gemm`'s
//! [`RoutedBatch::from_choices`]. No routing arithmetic lives here.

use anyhow::Result;
use half::bf16;

use super::TOPK;
use crate::model::numerics::dot;
use crate::model::reference::{route_from_logits, RouteSelection, Routing};
use crate::ops::moe_gemm::RoutedBatch;

/// BF16 values widened to f32 (exact).
pub fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|b| b.to_f32()).collect()
}

/// Gate logits of one token as the CPU model computes them (`Weights::matvec`: `numerics::dot` of each gate row
/// with the hidden vector, f32): `gate` is `[E, D]` widened to f32, `x` the token's D values.
pub fn logits(gate: &[f32], x: &[f32]) -> Vec<f32> {
    gate.chunks_exact(x.len()).map(|row| dot(row, x)).collect()
}

/// The selection rule of one token on the CPU.
pub enum CpuSelection<'a> {
    Biased(&'a [f32]),
    /// The token's tid2eid row.
    Hash(Vec<usize>),
}

/// The CPU model's routing of one token from its logits.
pub fn route(logits: &[f32], selection: &CpuSelection<'_>, route_scale: f32) -> Routing {
    let sel = match selection {
        CpuSelection::Biased(b) => RouteSelection::Biased(b),
        CpuSelection::Hash(e) => RouteSelection::Hash(e),
    };
    route_from_logits(logits, sel, TOPK, route_scale)
}

/// The masked grouping of the CPU's selections (`experts` in selection order per token), the layout the GPU's
/// grouping must equal: slots of an expert in token order (an error when an expert gets more than `capacity`).
pub fn grouping(routings: &[Routing], experts: usize, capacity: usize) -> Result<RoutedBatch> {
    let choices: Vec<usize> = routings.iter().flat_map(|r| r.experts.clone()).collect();
    RoutedBatch::from_choices(routings.len(), experts, TOPK, choices, Some(capacity))
}

/// The masked grouping by physical slot (the layout `router_select_group_slots` writes): pair (t, j) of logical
/// expert `e` goes to slot `slot_of[e]`, one row per pair in pair order (two picks of one token on one slot are two
/// rows). `slot_of` has one entry per logical expert, each below `slots`; `slots >= TOPK` (the layout builder's
/// rule); an error when a slot gets more than `capacity` rows.
pub fn grouping_by_slot(
    routings: &[Routing],
    slot_of: &[usize],
    slots: usize,
    capacity: usize,
) -> Result<RoutedBatch> {
    let choices: Vec<usize> = routings
        .iter()
        .flat_map(|r| r.experts.iter().map(|&e| slot_of[e]))
        .collect();
    RoutedBatch::from_choices(routings.len(), slots, TOPK, choices, Some(capacity))
}

/// CPU twin of [`super::gather_nvfp4_rows`] on any row type: `dst[token_rows[t * 6 + j]] = src[t]` for every pair
/// with a row in `0..dst.len() / row_len`; other rows of `dst` untouched. `src` holds `T` rows of `row_len`
/// elements, `token_rows` `T x 6` entries.
pub fn gather_rows<T: Copy>(src: &[T], row_len: usize, token_rows: &[i32], dst: &mut [T]) {
    let rows_total = dst.len() / row_len;
    for (p, &r) in token_rows.iter().enumerate() {
        if r < 0 || r as usize >= rows_total {
            continue;
        }
        let (t, r) = (p / TOPK, r as usize);
        dst[r * row_len..(r + 1) * row_len].copy_from_slice(&src[t * row_len..(t + 1) * row_len]);
    }
}
