//! The decode report: the byte floor of a step (what a step must read from HBM at the least) and the summary of a
//! timed run against it.

use crate::engine::io::group;
use crate::engine::plan::{LayerCachePlan, MemoryPlan};
use crate::formats::kv;
use crate::model::LayerKind;

/// Bytes one decode step reads at the least, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepBytes {
    /// Every dense weight once (attention, shared experts, router gates, mHC, norms, LM head), plus one embedding
    /// row per sequence.
    pub dense: u64,
    /// The routed experts the batch selects, each once: `top-k x layers` experts at batch 1; at batch B at most
    /// `B x top-k` distinct experts per layer, capped by the resident slots (the floor assumes they are distinct,
    /// so at batch > 1 it is an upper estimate of the distinct experts and the fraction a lower one).
    pub routed: u64,
    /// KV cache: every sequence's window entries and selected compressed entries (584 B each), and the CSA
    /// indexer keys its indexer scores.
    pub kv: u64,
}

impl StepBytes {
    pub fn total(&self) -> u64 {
        self.dense + self.routed + self.kv
    }

    /// The floor of a step of `plan` whose sequences are at `positions` (each reads the caches of positions
    /// `0..=p`).
    pub fn of(plan: &MemoryPlan, positions: &[usize]) -> StepBytes {
        let cfg = &plan.config;
        let embed = plan
            .dense_tensor("embed.weight")
            .map(|t| t.bytes() as u64)
            .unwrap_or(0);
        let dense_all: u64 = plan.dense.iter().map(|t| t.bytes() as u64).sum();
        let row = embed / cfg.vocab_size.max(1) as u64;
        let dense = dense_all - embed + row * positions.len() as u64;
        let per_expert = plan.experts.bytes_per_expert() as u64;
        let experts_per_layer =
            (positions.len() * cfg.n_activated_experts).min(plan.map.slots) as u64;
        let routed = per_expert * experts_per_layer * cfg.n_layers as u64;
        let key_bytes = plan.request.index_keys.entry_bytes() as u64;
        let kv = positions
            .iter()
            .map(|&p| {
                plan.cache_layers
                    .iter()
                    .map(|l| layer_kv_bytes(l, cfg.window_size, cfg.index_topk, p, key_bytes))
                    .sum::<u64>()
            })
            .sum();
        StepBytes { dense, routed, kv }
    }
}

/// The least bytes kernel group `name` (an [`group`] name) reads in one step of `plan` whose sequences are at
/// `positions`, summed over the layers: the dense tensors it reads once (matched by name), and for the KV and expert
/// groups their part of [`StepBytes`]. Activations are not counted (they are small at decode batch sizes).
pub fn group_floor_bytes(plan: &MemoryPlan, name: &str, positions: &[usize]) -> u64 {
    let tensors = |pats: &[&str]| -> u64 {
        plan.dense
            .iter()
            .filter(|t| pats.iter().any(|p| t.spec.name.contains(p)))
            .map(|t| t.bytes() as u64)
            .sum()
    };
    let steps = StepBytes::of(plan, positions);
    let cfg = &plan.config;
    let key_bytes = plan.request.index_keys.entry_bytes() as u64;
    let entry = kv::ENTRY_BYTES as u64;
    // KV split: the indexer's keys vs the attention's entries.
    let keys: u64 = positions
        .iter()
        .map(|&p| {
            plan.cache_layers
                .iter()
                .map(|l| match l.kind {
                    LayerKind::Csa { ratio } => ((p + 1) / ratio) as u64 * key_bytes,
                    _ => 0,
                })
                .sum::<u64>()
        })
        .sum();
    match name {
        group::EMBED => {
            let e = tensors(&["embed.weight"]);
            e / cfg.vocab_size.max(1) as u64 * positions.len() as u64
        }
        group::ATTN_HC_PRE => tensors(&[".hc_attn_", ".attn_norm."]),
        group::ATTN_PROJECTIONS => tensors(&[
            ".attn.wq_a.",
            ".attn.wkv.",
            ".attn.wq_b.",
            ".attn.q_norm.",
            ".attn.kv_norm.",
            ".attn.indexer.wq_b.",
            ".attn.indexer.weights_proj.",
            ".compressor.wkv.",
            ".compressor.wgate.",
        ]),
        group::ATTN_COMPRESSORS => tensors(&[".compressor.ape", ".compressor.norm."]),
        group::ATTN_INDEXER => keys,
        group::ATTN_SPARSE => (steps.kv - keys).max(entry) + tensors(&[".attn_sink"]),
        group::ATTN_OUTPUT => tensors(&[".attn.wo_a.", ".attn.wo_b."]),
        group::FFN_HC_PRE => tensors(&[".hc_ffn_", ".ffn_norm."]),
        group::FFN_ROUTER => tensors(&[".ffn.gate.weight", ".ffn.gate.bias"]),
        group::FFN_SHARED => tensors(&[".shared_experts."]),
        group::FFN_ROUTED => steps.routed,
        group::HEAD => [
            "head.weight",
            "hc_head_fn",
            "hc_head_scale",
            "hc_head_base",
            "norm.weight",
        ]
        .iter()
        .filter_map(|n| plan.dense_tensor(n))
        .map(|t| t.bytes() as u64)
        .sum(),
        _ => 0,
    }
}

/// KV bytes the query at position `p` reads in one layer.
fn layer_kv_bytes(l: &LayerCachePlan, window: usize, topk: usize, p: usize, key_bytes: u64) -> u64 {
    let entry = kv::ENTRY_BYTES as u64;
    let win = (p + 1).min(window).min(l.window.max(1)) as u64;
    let (selected, keys) = match l.kind {
        LayerKind::SlidingWindow => (0, 0),
        LayerKind::Csa { ratio } => {
            let n = (p + 1) / ratio;
            (n.min(topk), n)
        }
        LayerKind::Hca { ratio } => ((p + 1) / ratio, 0),
    };
    (win + selected as u64) * entry + keys as u64 * key_bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::plan::PlanRequest;
    use crate::model::ModelConfig;

    /// The Flash floor at batch 1 is the ~11.4 GB a token reads with NVFP4 experts (issue #25's roofline), and
    /// the KV part grows with the position as the layer kinds say.
    #[test]
    fn flash_floor_at_batch_one() {
        let cfg = ModelConfig::flash();
        let plan = MemoryPlan::new(&cfg, &PlanRequest::new(1, 4096, 16, 139 << 30)).unwrap();
        let b = StepBytes::of(&plan, &[4095]);
        let gb = b.total() as f64 / 1e9;
        assert!((10.0..13.0).contains(&gb), "Flash step floor {gb:.2} GB");
        let early = StepBytes::of(&plan, &[0]);
        assert_eq!(early.dense, b.dense);
        assert_eq!(early.routed, b.routed);
        assert!(early.kv < b.kv);
        // Position 0 reads one window entry per layer.
        assert_eq!(early.kv, (cfg.n_layers * kv::ENTRY_BYTES) as u64);
    }

    /// The groups' floors partition the step's floor: every dense tensor belongs to exactly one group (or is one
    /// the step reads a row of: the embedding and tid2eid), and the KV and expert parts are split, not repeated.
    #[test]
    fn group_floors_add_up_to_the_step_floor() {
        use crate::engine::io::group::*;
        let cfg = ModelConfig::flash();
        let plan = MemoryPlan::new(&cfg, &PlanRequest::new(1, 4096, 16, 139 << 30)).unwrap();
        let pos = [4095];
        let groups = [
            EMBED,
            ATTN_HC_PRE,
            ATTN_PROJECTIONS,
            ATTN_COMPRESSORS,
            ATTN_INDEXER,
            ATTN_SPARSE,
            ATTN_OUTPUT,
            FFN_HC_PRE,
            FFN_ROUTER,
            FFN_SHARED,
            FFN_ROUTED,
            FFN_HC_POST,
            HEAD,
            SAMPLER,
        ];
        let sum: u64 = groups
            .iter()
            .map(|g| group_floor_bytes(&plan, g, &pos))
            .sum();
        let tid2eid: u64 = plan
            .dense
            .iter()
            .filter(|t| t.spec.name.contains("tid2eid"))
            .map(|t| t.bytes() as u64)
            .sum();
        assert_eq!(sum + tid2eid, StepBytes::of(&plan, &pos).total());
    }
}
