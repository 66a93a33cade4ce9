//! Fixtures of the router tests (tests/router.rs): seeded random cases at DSV4 shapes, the device run with
//! poisoned outputs, the CPU oracle (the model's routing through `ops::router::reference`) and the comparison.
//!
//! Tolerances, all from one bound. A GPU logit and the CPU model's logit are two f32 sums of the same exact
//! products (BF16 x BF16 is exact in f32), of tree depths `h_gpu = router::logit_sum_depth(D)` and
//! `h_cpu = D / 8 + 8` (`numerics::dot`: 8 partial sums of D / 8 terms, then their sum), so they differ by at most
//! `(gamma(h_gpu) + gamma(h_cpu)) * sum_i |w_i x_i|` with `gamma(n) = n u / (1 - n u)`, u = 2^-24 (checked per logit).
//! The score `s = sqrt(softplus(x))` has `ds/dx = sigmoid(x) / (2 s)`; since `sigmoid^2 <= sigmoid <= softplus`
//! (`ln(1 + y) >= y / (1 + y)`), `|ds| <= 0.5 |dx|` and `|ds| / s = sigmoid / (2 softplus) |dx| <= 0.5 |dx|`; exp,
//! log1p and sqrt add at most 8 ulps of s per side, the bias add half an ulp. So a biased score moves by at most
//! `tau = 0.5 * max_e bound_e + 32 u (|b|max + 1)`: the GPU may order two experts differently from the CPU only
//! where their CPU biased scores are within tau; a weight (a ratio of scores, 5 adds, a divide and a multiply per
//! side) moves by at most `max_e bound_e + 48 u` relative.

use half::bf16;
use megamoe::engine::ExpertMap;
use megamoe::gpu::arena::Arena;
use megamoe::gpu::launch::DeviceBuf;
use megamoe::gpu::Gpu;
use megamoe::model::reference::{route_weights, Routing};
use megamoe::ops::inputs::normalish;
use megamoe::ops::moe_gemm::RoutedBatch;
use megamoe::ops::router::reference::{self as cpu, CpuSelection};
use megamoe::ops::router::{
    logit_sum_depth, route, workspace_bytes, RouterInputs, RouterOutputs, RouterShape,
    RouterWorkspace, Selection, TOPK,
};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub const U: f64 = 1.0 / 16_777_216.0; // 2^-24

/// The seeded RNG of a router test (`ROUTER_SEED` replays a printed seed).
pub fn seeded(test: &str) -> ChaCha8Rng {
    super::seeded(test, "ROUTER_SEED")
}

/// The GPU and the seeded RNG of a router GPU test.
pub fn gpu_test(test: &str) -> (Gpu, ChaCha8Rng) {
    (super::gpu(test), seeded(test))
}

/// One routing problem on the host.
#[derive(Clone)]
pub struct Case {
    pub tokens: usize,
    pub experts: usize,
    pub dim: usize,
    pub x: Vec<bf16>,
    pub gate: Vec<bf16>,
    pub bias: Vec<f32>,
    pub route_scale: f32,
    /// Hash layers: (token ids, tid2eid [vocab, 6], vocab).
    pub hash: Option<(Vec<i32>, Vec<i32>, usize)>,
    /// A slot map: (slot of each logical expert [E], slots); `None` routes expert e to slot e.
    pub slot_map: Option<(Vec<i32>, usize)>,
}

fn to_bf16(v: impl IntoIterator<Item = f32>) -> Vec<bf16> {
    v.into_iter().map(bf16::from_f32).collect()
}

impl Case {
    /// Hidden vectors ~ N(0, 1) (a normed hidden state), gate rows with logits of spread ~1.5 (weights uniform
    /// with standard deviation 1.5 / sqrt(D)), bias uniform in [-0.1, 0.1): all rounded to BF16 / f32.
    pub fn random(
        rng: &mut impl Rng,
        tokens: usize,
        experts: usize,
        dim: usize,
        route_scale: f32,
    ) -> Case {
        let a = 1.5 * 3f32.sqrt() / (dim as f32).sqrt();
        Case {
            tokens,
            experts,
            dim,
            x: to_bf16((0..tokens * dim).map(|_| normalish(rng))),
            gate: to_bf16((0..experts * dim).map(|_| rng.random_range(-a..a))),
            bias: (0..experts).map(|_| rng.random_range(-0.1..0.1)).collect(),
            route_scale,
            hash: None,
            slot_map: None,
        }
    }
    /// The engine's map onto `slots` physical slots (`ExpertMap::table`: expert e on slot e % slots).
    pub fn with_slots(mut self, slots: usize) -> Case {
        let map = ExpertMap::all(self.experts, slots);
        self.slot_map = Some((map.table(), slots));
        self
    }
    /// Physical slots of the grouping (E without a map).
    pub fn slots(&self) -> usize {
        self.slot_map.as_ref().map_or(self.experts, |m| m.1)
    }
    /// A tid2eid table of `vocab` rows of 6 distinct experts and random token ids.
    pub fn with_hash(mut self, rng: &mut impl Rng, vocab: usize) -> Case {
        let mut table = Vec::with_capacity(vocab * TOPK);
        for _ in 0..vocab {
            let row = rand::seq::index::sample(rng, self.experts, TOPK).into_vec();
            table.extend(row.into_iter().map(|e| e as i32));
        }
        let ids = (0..self.tokens)
            .map(|_| rng.random_range(0..vocab as i32))
            .collect();
        self.hash = Some((ids, table, vocab));
        self
    }
    pub fn shape(&self, capacity: usize) -> RouterShape {
        RouterShape {
            slots: self.slots(),
            ..RouterShape::identity(self.tokens, self.experts, self.dim, capacity)
        }
    }
}

/// Device copies of a case's inputs.
pub struct DevCase {
    pub x: cudarc::driver::CudaSlice<bf16>,
    pub gate: cudarc::driver::CudaSlice<bf16>,
    pub bias: cudarc::driver::CudaSlice<f32>,
    pub ids: cudarc::driver::CudaSlice<i32>,
    pub table: cudarc::driver::CudaSlice<i32>,
    pub slot_of: Option<cudarc::driver::CudaSlice<i32>>,
    pub vocab: usize,
    pub route_scale: f32,
}

impl DevCase {
    pub fn upload(gpu: &Gpu, c: &Case) -> DevCase {
        let (ids, table, vocab) = c.hash.clone().unwrap_or((vec![0], vec![0; TOPK], 1));
        DevCase {
            x: gpu.upload(&c.x).unwrap(),
            gate: gpu.upload(&c.gate).unwrap(),
            bias: gpu.upload(&c.bias).unwrap(),
            ids: gpu.upload(&ids).unwrap(),
            table: gpu.upload(&table).unwrap(),
            slot_of: c.slot_map.as_ref().map(|m| gpu.upload(&m.0).unwrap()),
            vocab,
            route_scale: c.route_scale,
        }
    }
    pub fn inputs(&self, hash: bool) -> RouterInputs<'_> {
        RouterInputs {
            x: &self.x,
            gate: &self.gate,
            selection: if hash {
                Selection::Hash {
                    token_ids: &self.ids,
                    tid2eid: &self.table,
                    vocab: self.vocab,
                }
            } else {
                Selection::Biased { bias: &self.bias }
            },
            route_scale: self.route_scale,
            slot_of: self.slot_of.as_ref().map(|b| b as &dyn DeviceBuf<i32>),
        }
    }
}

/// A workspace with its arena (poisoned) and poisoned outputs for `shape`.
pub struct DevRun {
    _arena: Arena,
    pub ws: RouterWorkspace,
    pub out: RouterOutputs,
}

impl DevRun {
    pub fn new(gpu: &Gpu, shape: &RouterShape) -> DevRun {
        let mut arena = Arena::new(gpu, workspace_bytes(shape)).unwrap();
        let ws = RouterWorkspace::carve(&mut arena, shape).unwrap();
        arena.poison(&gpu.stream, super::POISON).unwrap();
        DevRun {
            _arena: arena,
            ws,
            out: RouterOutputs::alloc(gpu, shape, super::POISON).unwrap(),
        }
    }
    pub fn poison_outputs(&mut self, gpu: &Gpu) {
        let o = &mut self.out;
        gpu.fill_bytes(&mut o.topk_experts, super::POISON).unwrap();
        gpu.fill_bytes(&mut o.topk_weights, super::POISON).unwrap();
        gpu.fill_bytes(&mut o.token_rows, super::POISON).unwrap();
        gpu.fill_bytes(&mut o.counts, super::POISON).unwrap();
        gpu.fill_bytes(&mut o.row_token, super::POISON).unwrap();
        gpu.fill_bytes(&mut o.row_weight, super::POISON).unwrap();
        gpu.fill_bytes(&mut o.dropped, super::POISON).unwrap();
    }
    pub fn download(&self, gpu: &Gpu) -> GpuRouting {
        let d = |b: &cudarc::driver::CudaSlice<i32>| gpu.download(b).unwrap();
        let f = |b: &cudarc::driver::CudaSlice<f32>| gpu.download(b).unwrap();
        GpuRouting {
            logits: super::moe::download(gpu, &self.ws.logits),
            experts: d(&self.out.topk_experts),
            weights: f(&self.out.topk_weights),
            token_rows: d(&self.out.token_rows),
            counts: d(&self.out.counts),
            row_token: d(&self.out.row_token),
            row_weight: f(&self.out.row_weight),
            dropped: d(&self.out.dropped)[0],
        }
    }
}

/// Everything a routing call wrote, on the host.
#[derive(Debug, Clone)]
pub struct GpuRouting {
    pub logits: Vec<f32>,
    pub experts: Vec<i32>,
    pub weights: Vec<f32>,
    pub token_rows: Vec<i32>,
    pub counts: Vec<i32>,
    pub row_token: Vec<i32>,
    pub row_weight: Vec<f32>,
    pub dropped: i32,
}

/// Route a case on the GPU (fresh poisoned outputs and workspace) and bring everything back.
pub fn run(gpu: &Gpu, c: &Case, capacity: usize) -> GpuRouting {
    let shape = c.shape(capacity);
    let dc = DevCase::upload(gpu, c);
    let mut r = DevRun::new(gpu, &shape);
    route(
        gpu,
        &gpu.stream,
        &dc.inputs(c.hash.is_some()),
        &r.ws,
        &mut r.out,
    )
    .unwrap();
    gpu.synchronize().unwrap();
    r.download(gpu)
}

/// The CPU model's logits and routing of every token of a case.
pub struct CpuRouting {
    pub logits: Vec<Vec<f32>>,
    pub routings: Vec<Routing>,
    /// Per token: the logit error bound of every expert (module doc).
    pub bounds: Vec<Vec<f64>>,
}

fn gamma(n: usize) -> f64 {
    n as f64 * U / (1.0 - n as f64 * U)
}

pub fn cpu_routing(c: &Case) -> CpuRouting {
    let gate = cpu::widen(&c.gate);
    let g = gamma(logit_sum_depth(c.dim)) + gamma(c.dim / 8 + 8);
    let mut out = CpuRouting {
        logits: vec![],
        routings: vec![],
        bounds: vec![],
    };
    for t in 0..c.tokens {
        let x = cpu::widen(&c.x[t * c.dim..(t + 1) * c.dim]);
        let logits = cpu::logits(&gate, &x);
        let sel = match &c.hash {
            Some((ids, table, _)) => {
                let id = ids[t] as usize;
                CpuSelection::Hash(
                    table[id * TOPK..(id + 1) * TOPK]
                        .iter()
                        .map(|&e| e as usize)
                        .collect(),
                )
            }
            None => CpuSelection::Biased(&c.bias),
        };
        out.routings.push(cpu::route(&logits, &sel, c.route_scale));
        out.bounds.push(
            gate.chunks_exact(c.dim)
                .map(|row| {
                    g * row
                        .iter()
                        .zip(&x)
                        .map(|(w, v)| (*w as f64 * *v as f64).abs())
                        .sum::<f64>()
                })
                .collect(),
        );
        out.logits.push(logits);
    }
    out
}

/// What [`check`] saw.
#[derive(Debug, Default, Clone, Copy)]
pub struct Checked {
    /// Tokens whose GPU selection differs from the CPU's within the tolerance.
    pub reordered_tokens: usize,
    /// The largest logit difference seen relative to its bound.
    pub worst_logit_ratio: f64,
}

/// Compare a GPU routing with the CPU model's: logits within their bound, the selection exact (hash: always;
/// biased: except an order the bound allows, counted), weights within the bound of the selection the GPU made
/// (the CPU's weights when the selections agree, the oracle's `route_weights` of the GPU's selection otherwise),
/// and the whole grouping exactly equal to the layout of the GPU's selection (`cpu::grouping`, or
/// `cpu::grouping_by_slot` with the case's slot map; `capacity` at least every count: nothing dropped).
pub fn check(label: &str, c: &Case, g: &GpuRouting, want: &CpuRouting, capacity: usize) -> Checked {
    let (t_n, e_n) = (c.tokens, c.experts);
    let mut seen = Checked::default();
    assert_eq!(g.logits.len(), t_n * e_n, "{label}: logits length");
    for t in 0..t_n {
        for e in 0..e_n {
            let (gl, cl, b) = (g.logits[t * e_n + e], want.logits[t][e], want.bounds[t][e]);
            let d = (gl as f64 - cl as f64).abs();
            assert!(
                d <= b,
                "{label}: logit [{t}, {e}] GPU {gl} CPU {cl}: |diff| {d:.3e} > bound {b:.3e}"
            );
            seen.worst_logit_ratio = seen.worst_logit_ratio.max(d / b.max(f64::MIN_POSITIVE));
        }
    }
    let mut choices = Vec::with_capacity(t_n);
    for t in 0..t_n {
        let r = &want.routings[t];
        let ge: Vec<i32> = g.experts[t * TOPK..(t + 1) * TOPK].to_vec();
        let gw = &g.weights[t * TOPK..(t + 1) * TOPK];
        assert!(
            ge.iter().all(|&e| e >= 0 && (e as usize) < e_n),
            "{label}: token {t}: GPU experts {ge:?} (poison or out of range)"
        );
        let gsel: Vec<usize> = ge.iter().map(|&e| e as usize).collect();
        let max_bound = want.bounds[t].iter().cloned().fold(0.0, f64::max);
        let expected_w = if gsel == r.experts {
            r.weights.clone()
        } else {
            assert!(
                c.hash.is_none(),
                "{label}: token {t}: hash selection GPU {gsel:?} != tid2eid row {:?}",
                r.experts
            );
            let mut distinct = gsel.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(
                distinct.len(),
                TOPK,
                "{label}: token {t}: repeated expert in {gsel:?}"
            );
            let biased = |e: usize| r.scores[e] as f64 + c.bias[e] as f64;
            let top = r
                .experts
                .iter()
                .map(|&e| biased(e).abs())
                .fold(0.0, f64::max);
            let tau = 0.5 * max_bound + 32.0 * U * (top + 1.0);
            for j in 0..TOPK {
                let d = (biased(gsel[j]) - biased(r.experts[j])).abs();
                assert!(
                    d <= tau,
                    "{label}: token {t}: GPU {gsel:?} vs CPU {:?}: position {j} biased scores differ by {d:.3e} > \
                     tau {tau:.3e}",
                    r.experts
                );
            }
            seen.reordered_tokens += 1;
            route_weights(&r.scores, &gsel, c.route_scale)
        };
        let rel_tol = max_bound + 48.0 * U;
        for j in 0..TOPK {
            let (a, b) = (gw[j] as f64, expected_w[j] as f64);
            assert!(
                (a - b).abs() <= rel_tol * b.abs(),
                "{label}: token {t}: weight {j} GPU {a} want {b} (rel tol {rel_tol:.2e})"
            );
        }
        choices.push(Routing {
            experts: gsel,
            weights: vec![],
            scores: vec![],
        });
    }
    let rb = match &c.slot_map {
        None => cpu::grouping(&choices, e_n, capacity).unwrap(),
        Some((table, slots)) => {
            let slot_of: Vec<usize> = table.iter().map(|&s| s as usize).collect();
            cpu::grouping_by_slot(&choices, &slot_of, *slots, capacity).unwrap()
        }
    };
    check_grouping(label, g, &rb);
    seen
}

/// The grouping a routing call wrote equals `rb` (the layout of the GPU's own selection) exactly; each slot's
/// weight is the GPU weight of its pair, bit for bit; nothing dropped.
pub fn check_grouping(label: &str, g: &GpuRouting, rb: &RoutedBatch) {
    let counts = match &rb.grouping {
        megamoe::ops::moe_gemm::reference::Grouping::Masked { counts, .. } => counts.clone(),
        _ => unreachable!(),
    };
    assert_eq!(g.counts, counts, "{label}: counts");
    assert_eq!(g.token_rows, rb.token_rows, "{label}: token_rows");
    assert_eq!(g.row_token, rb.row_token, "{label}: row_token");
    let mut want_w = vec![0f32; rb.row_token.len()];
    for p in 0..rb.tokens * TOPK {
        want_w[rb.token_rows[p] as usize] = g.weights[p];
    }
    super::assert_bit_identical(label, "row_weight", &want_w, &g.row_weight);
    assert_eq!(g.dropped, 0, "{label}: dropped pairs");
}

/// Route `c` on the GPU with `capacity` (at least every count) and [`check`] it against the CPU model.
pub fn route_and_check(gpu: &Gpu, label: &str, c: &Case, capacity: usize) -> Checked {
    let want = cpu_routing(c);
    let got = run(gpu, c, capacity);
    check(label, c, &got, &want, capacity)
}

/// The largest count of the CPU's selections (a capacity that drops nothing).
pub fn most_rows(want: &CpuRouting, experts: usize) -> usize {
    let mut n = vec![0usize; experts];
    for r in &want.routings {
        for &e in &r.experts {
            n[e] += 1;
        }
    }
    n.into_iter().max().unwrap_or(0)
}
