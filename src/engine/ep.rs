//! Expert parallelism (issue #27; docs/multi-gpu.md): the host-side rules of decoding with the routed experts
//! spread over `world` GPUs, one process (rank) per GPU, everything else replicated. No GPU or NCCL call lives
//! here: this module states which rank owns which expert ([`ExpertPartition`]), which (token, pick) pairs a rank
//! computes ([`dispatch_pairs`], and [`ExpertPartition::map_of`], whose table is the router's `slot_of` that makes the
//! existing router compute exactly those pairs on the device), the combine's order ([`combine_partials`]), and a
//! CPU model of `world` ranks built on the CPU oracle's expert math ([`simulate_moe`]).
//!
//! The combine's contract (the one every transport must reproduce): rank `r`'s partial row of token `t` is the
//! f32 sum, from zero and in routing order, of the weighted expert outputs of the token's picks that `r` owns;
//! the MoE output is `bf16( ((partial_0 + partial_1) + ...) + partial_{W-1} + shared )`, elementwise in f32,
//! ranks in ascending order. Every rank computes it from the same W partial rows, so the ranks' residuals stay
//! bit-identical (their routing, and so the dispatch, must agree). With `world == 1` this is [`Model::moe`] bit
//! for bit; with more ranks the routed terms are added in another association (see [`simulate_moe`]).

use std::ops::Range;

use anyhow::{bail, ensure, Result};

use crate::engine::plan::ExpertMap;
use crate::model::numerics::bf16_round_slice;
use crate::model::reference::{Model, Routing};

/// Routed experts partitioned over `world` ranks in contiguous blocks: rank `r` owns logical experts
/// `r * E / W .. (r + 1) * E / W` (DeepSeek's own expert-parallel layout; `E % W == 0` required), and keeps owned
/// expert `e` in its local slot `e - r * E / W`. The same for every MoE layer (hash layers included: ownership
/// is by expert id, whatever chose the expert).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertPartition {
    experts: usize,
    world: usize,
}

impl ExpertPartition {
    /// The partition of `experts` logical experts over `world` ranks; an error for no ranks, more ranks than
    /// experts, or experts that do not divide evenly into the ranks.
    pub fn new(experts: usize, world: usize) -> Result<ExpertPartition> {
        ensure!(
            world >= 1,
            "expert parallelism: world size 0 (need at least one rank)"
        );
        ensure!(
            world <= experts,
            "expert parallelism: {world} ranks for {experts} routed experts (at most one rank per expert)"
        );
        ensure!(
            experts.is_multiple_of(world),
            "expert parallelism: {experts} routed experts do not split evenly over {world} ranks \
             (contiguous blocks need experts % world == 0)"
        );
        Ok(ExpertPartition { experts, world })
    }

    /// Ranks (GPUs, processes).
    pub fn world(&self) -> usize {
        self.world
    }

    /// Logical routed experts of a layer.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Experts each rank owns (`E / W`): the `logical` count of a rank's own expert map.
    pub fn experts_per_rank(&self) -> usize {
        self.experts / self.world
    }

    /// The rank that owns logical expert `e` (`e < experts`, else a panic: routing never yields one).
    pub fn owner(&self, e: usize) -> usize {
        assert!(
            e < self.experts,
            "expert {e} outside 0..{} (routing yields none)",
            self.experts
        );
        e / self.experts_per_rank()
    }

    /// The logical experts rank `rank` owns (`rank < world`).
    pub fn experts_of(&self, rank: usize) -> Range<usize> {
        let n = self.experts_per_rank();
        rank * n..(rank + 1) * n
    }

    /// Where rank `rank` keeps logical expert `e`: `Some(local slot)` when it owns `e`, else `None`.
    pub fn local_slot(&self, rank: usize, e: usize) -> Option<usize> {
        self.experts_of(rank)
            .contains(&e)
            .then(|| e - rank * self.experts_per_rank())
    }

    /// Rank `rank`'s expert map on `slots` resident slots: its own block ([`ExpertPartition::experts_of`]), expert
    /// `e` in slot `local_slot(rank, e) mod slots` (the wrap when the rank's experts do not all fit). Its table
    /// ([`ExpertMap::table`], the router's `slot_of`) gives every other expert -1, so the router gives its pairs no
    /// row: they are not gathered, not computed, and the L2 combine skips them. The router counts them as `dropped`;
    /// under expert parallelism that count is `pairs - owned pairs`, not an error. The weights loaded for this map
    /// (`DeviceWeights::load`) hold the block's experts in slot order.
    pub fn map_of(&self, rank: usize, slots: usize) -> Result<ExpertMap> {
        ensure!(
            rank < self.world,
            "expert parallelism: rank {rank} outside a world of {}",
            self.world
        );
        ensure!(
            (1..=self.experts_per_rank()).contains(&slots),
            "expert parallelism: a rank holds 1..={} expert slots, not {slots}",
            self.experts_per_rank()
        );
        Ok(ExpertMap {
            logical: self.experts,
            slots,
            first: self.experts_of(rank).start,
            owned: self.experts_per_rank(),
        })
    }
}

/// One routed pick of one token: `routing[token].experts[pick]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pair {
    pub token: usize,
    pub pick: usize,
}

/// The (token, pick) pairs rank `rank` computes: those whose expert it owns, in (token, pick) order. No
/// communication is needed for it: every rank holds every token's routing (routing runs replicated on identical
/// inputs). Over the ranks the lists partition all pairs. Errors: a rank outside the world, an expert outside the
/// partition.
pub fn dispatch_pairs(
    routing: &[Routing],
    partition: &ExpertPartition,
    rank: usize,
) -> Result<Vec<Pair>> {
    ensure!(
        rank < partition.world(),
        "expert parallelism: rank {rank} outside a world of {}",
        partition.world()
    );
    let mut pairs = Vec::new();
    for (token, r) in routing.iter().enumerate() {
        for (pick, &e) in r.experts.iter().enumerate() {
            if e >= partition.experts() {
                bail!(
                    "token {token} pick {pick}: expert {e} outside the partition's {} experts",
                    partition.experts()
                );
            }
            if partition.owner(e) == rank {
                pairs.push(Pair { token, pick });
            }
        }
    }
    Ok(pairs)
}

/// The deterministic combine (module docs): `partials[r]` is rank `r`'s f32 partial rows `[T, D]`, `shared` the
/// shared expert's f32 rows `[T, D]`; returns `bf16(((p_0 + p_1) + ... + p_{W-1}) + shared)` elementwise, ranks
/// ascending, as f32 values of BF16. Every rank that holds the same W partials gets the same bits. The sum starts
/// from `p_0` itself (not `0 + p_0`, which would turn a `-0.0` into `+0.0`), as the device combine does
/// (kernels/ep_combine.cu, `ops::ep::combine`, its GPU twin).
pub fn combine_partials(partials: &[Vec<f32>], shared: &[f32]) -> Result<Vec<f32>> {
    ensure!(!partials.is_empty(), "combine: no partials (world size 0)");
    for (r, p) in partials.iter().enumerate() {
        ensure!(
            p.len() == shared.len(),
            "combine: rank {r}'s partial has {} values, the shared expert's output {}",
            p.len(),
            shared.len()
        );
    }
    let mut y = partials[0].clone();
    for p in &partials[1..] {
        for (a, b) in y.iter_mut().zip(p) {
            *a += b;
        }
    }
    for (a, b) in y.iter_mut().zip(shared) {
        *a += b;
    }
    bf16_round_slice(&mut y);
    Ok(y)
}

/// Rank `rank`'s partial MoE rows `[T, D]` (f32): per token, [`Model::routed_partial`] over the token's picks in
/// [`dispatch_pairs`] for this rank (routing order); a token with no owned pick gets a zero row. `f_q[t]` is
/// [`Model::routed_input`] of token t's FFN input.
pub fn rank_partials(
    model: &Model,
    layer: usize,
    f_q: &[Vec<f32>],
    routing: &[Routing],
    partition: &ExpertPartition,
    rank: usize,
) -> Result<Vec<f32>> {
    ensure!(
        f_q.len() == routing.len(),
        "{} FFN inputs for {} routings",
        f_q.len(),
        routing.len()
    );
    let pairs = dispatch_pairs(routing, partition, rank)?;
    let mut out = Vec::with_capacity(routing.len() * model.config().dim);
    for (t, (x, r)) in f_q.iter().zip(routing).enumerate() {
        let picks: Vec<usize> = pairs
            .iter()
            .filter(|p| p.token == t)
            .map(|p| p.pick)
            .collect();
        out.extend(model.routed_partial(layer, x, r, &picks)?);
    }
    Ok(out)
}

/// The MoE output of `T` tokens of layer `layer` computed by `partition.world()` simulated ranks: each rank its
/// [`rank_partials`], the shared expert once (it is replicated: every rank computes the same row), then
/// [`combine_partials`]. `f[t]` is token t's FFN input, `routing[t]` its routing (as [`Model::route`] gives it).
/// Returns `[T, D]`.
///
/// Against [`Model::moe`] (routed terms in routing order, then the shared expert): identical bits with one rank;
/// with more, the same seven f32 terms added in another association, so each f32 sum differs by at most
/// `2 * 6 u * sum |terms|` (`u = 2^-24`, recursive summation of 7 terms) before the one BF16 rounding, which can
/// move a value across a rounding boundary: elements differ by that bound plus one BF16 ulp at most, and most
/// are equal.
pub fn simulate_moe(
    model: &Model,
    layer: usize,
    f: &[Vec<f32>],
    routing: &[Routing],
    partition: &ExpertPartition,
) -> Result<Vec<f32>> {
    let f_r: Vec<Vec<f32>> = f
        .iter()
        .map(|x| model.routed_input(x))
        .collect::<Result<_>>()?;
    let partials: Vec<Vec<f32>> = (0..partition.world())
        .map(|rank| rank_partials(model, layer, &f_r, routing, partition, rank))
        .collect::<Result<_>>()?;
    let mut shared = Vec::with_capacity(f.len() * model.config().dim);
    for x in f {
        let x = model.moe_input(x)?;
        shared.extend(model.shared_expert_out(layer, &x)?);
    }
    combine_partials(&partials, &shared)
}

/// Bytes of one layer's combine per rank, for `batch` tokens of hidden size `dim` on `world` ranks (docs/multi-gpu.md
/// weighs them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineBytes {
    /// All-gather of every rank's f32 partial rows: each rank receives `(W - 1) B D 4` bytes (one NCCL call).
    pub all_gather_f32: usize,
    /// The same sum by hand: each rank sends the column slices it does not own (`(W - 1) / W` of `B D 4`), sums the
    /// W slices of its own columns in rank order, adds the shared expert, rounds, and all-gathers BF16 (`(W - 1) /
    /// W` of `B D 2`): two NCCL calls, the bits of `all_gather_f32`.
    pub scatter_sum_gather: usize,
    /// NCCL all-reduce (sum) of the f32 partials by ring: `2 (W - 1) / W` of `B D 4` per rank; order unspecified.
    pub all_reduce_f32: usize,
    /// All-to-all dispatch and combine (what a token-sharded design moves): every pair whose expert is remote
    /// sends its NVFP4 activation row (`D / 2 + D / 16 + 4` bytes) out and gets its BF16 output row (`2 D`) back;
    /// `(W - 1) / W` of the `6 B` pairs under uniform routing.
    pub all_to_all: usize,
}

impl CombineBytes {
    pub fn of(batch: usize, dim: usize, topk: usize, world: usize) -> CombineBytes {
        let (b, d, w) = (batch, dim, world);
        let remote = |x: usize| x * (w - 1) / w;
        CombineBytes {
            all_gather_f32: (w - 1) * b * d * 4,
            scatter_sum_gather: remote(b * d * 4) + remote(b * d * 2),
            all_reduce_f32: 2 * remote(b * d * 4),
            all_to_all: remote(topk * b * (d / 2 + d / 16 + 4 + 2 * d)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_local_slots() {
        let p = ExpertPartition::new(256, 4).unwrap();
        assert_eq!(p.experts_per_rank(), 64);
        assert_eq!(p.owner(0), 0);
        assert_eq!(p.owner(63), 0);
        assert_eq!(p.owner(64), 1);
        assert_eq!(p.owner(255), 3);
        assert_eq!(p.local_slot(1, 64), Some(0));
        assert_eq!(p.local_slot(1, 63), None);
        let t = p.map_of(2, 40).unwrap().table();
        assert_eq!(t[128], 0);
        assert_eq!(t[128 + 45], 5, "local slot 45 wraps onto slot 5 of 40");
        assert_eq!(t[0], -1);
        assert!(p.map_of(4, 64).is_err());
        assert!(
            p.map_of(0, 65).is_err(),
            "more slots than the rank's experts"
        );
    }

    #[test]
    fn combine_is_rank_ordered_and_rounds_once() {
        // p0 = 1 + 2^-8 is a BF16 tie (between 1 and 1 + 2^-7). In rank order, p0 + 2^-24 + 2^-24 stays p0 (each
        // half-ulp addition ties to even) and rounds to even: 1. In the reverse order the two 2^-24 make 2^-23
        // first, the f32 sum lies above the tie and rounds up: the order is observable and followed.
        let (p0, tiny) = (1.0 + 2f32.powi(-8), 2f32.powi(-24));
        let y = combine_partials(&[vec![p0], vec![tiny], vec![tiny]], &[0.0]).unwrap();
        assert_eq!(y, vec![1.0]);
        let y = combine_partials(&[vec![tiny], vec![tiny], vec![p0]], &[0.0]).unwrap();
        assert_eq!(y, vec![1.0 + 2f32.powi(-7)]);
        // The sum starts from p_0 itself, as the device combine does: a -0.0 partial plus a -0.0 shared output
        // stays -0.0 (the fused single-GPU epilogue's bits), where 0 + p_0 would give +0.0.
        let y = combine_partials(&[vec![-0.0]], &[-0.0]).unwrap();
        assert_eq!(y[0].to_bits(), (-0.0f32).to_bits());
        assert!(combine_partials(&[], &[0.0]).is_err());
        assert!(combine_partials(&[vec![0.0, 1.0]], &[0.0]).is_err());
    }
}
