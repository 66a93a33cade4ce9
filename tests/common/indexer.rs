//! Indexer fixtures: random keys, caches and queries, the FP8 logits tolerance and its f64 reference, and the
//! launch-wait-check helpers of the top-k and of whole indexer calls (poisoned outputs, a host watchdog on every
//! wait, exact comparison with the CPU reference).

use std::time::Duration;

use megamoe::formats::e4m3;
use megamoe::gpu::arena::{self, Arena};
use megamoe::gpu::Gpu;
use megamoe::ops::indexer::reference::{self, KeyCacheHost, KeyFormat, HEAD_DIM, NUM_HEADS};
use megamoe::ops::indexer::{
    self, stress, IndexerWorkspace, KeyCacheGpu, QueryBatch, TopkOutput, TopkPath, TopkWorkspace,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::POISON;

/// How long a watched wait gives one launch group before the test fails as hung.
pub const WATCHDOG: Duration = Duration::from_secs(5);

/// A fresh seed (printed; replay with SEED=<seed>) and its RNG.
pub fn seeded(test: &str) -> (u64, ChaCha8Rng) {
    let seed = megamoe::ops::inputs::fresh_seed(test, "SEED");
    (seed, ChaCha8Rng::seed_from_u64(seed))
}

pub fn random_key(rng: &mut ChaCha8Rng, amp: f32) -> [f32; HEAD_DIM] {
    std::array::from_fn(|_| rng.random_range(-amp..amp))
}

/// Random q codes (no NaN) and weights in [-1, 1) for `rows` query rows.
pub fn random_queries(rng: &mut ChaCha8Rng, rows: usize) -> (Vec<u8>, Vec<f32>) {
    let q = (0..rows * NUM_HEADS * HEAD_DIM)
        .map(|_| reference::random_e4m3(rng))
        .collect();
    let w = (0..rows * NUM_HEADS)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    (q, w)
}

/// A cache of `format` whose first `lens[b]` entries of sequence b are writer-made random keys (amplitudes 0.05,
/// 1 or 20); the rest stay zero.
pub fn written_cache(
    rng: &mut ChaCha8Rng,
    format: KeyFormat,
    lens: &[usize],
    cap: usize,
) -> KeyCacheHost {
    let mut host = KeyCacheHost::new(format, lens.len(), cap);
    for (b, &n) in lens.iter().enumerate() {
        for j in 0..n {
            let amp = [0.05f32, 1.0, 20.0][rng.random_range(0..3)];
            host.write_key(host.slot(b, j), &random_key(rng, amp))
                .unwrap();
        }
    }
    host
}

/// A key cache with arbitrary non-NaN e4m3 codes (the whole code range, subnormals included) and positive fp32
/// scales spread over 2^-12 .. 2^4.
pub fn random_fp8_cache(rng: &mut ChaCha8Rng, batch: usize, cap: usize) -> KeyCacheHost {
    let mut host = KeyCacheHost::new(KeyFormat::Fp8, batch, cap);
    for c in host.codes.iter_mut() {
        *c = loop {
            let v: u8 = rng.random();
            if v & 0x7F != 0x7F {
                break v;
            }
        };
    }
    for s in host.scales.chunks_exact_mut(4) {
        let v = f32::powf(2.0, rng.random_range(-12.0f32..4.0));
        s.copy_from_slice(&v.to_le_bytes());
    }
    host
}

/// Fill every cache slot at or past `lens[b]` of sequence b with NaN codes and NaN scales (0xFF bytes): the FP8
/// logits copy whole 64-row tiles, so the rows past num_valid they load must never reach a stored score.
pub fn poison_cache_tails(host: &mut KeyCacheHost, lens: &[usize]) {
    let cb = host.format.code_bytes();
    for (b, &n) in lens.iter().enumerate() {
        for j in n..host.capacity {
            let s = host.slot(b, j);
            host.codes[s * cb..(s + 1) * cb].fill(0xFF);
            host.scales[s * 4..s * 4 + 4].fill(0xFF);
        }
    }
}

/// num_valid per row: row `b * next_n + t` sees `lens[b] - (next_n - 1 - t)` entries (the earlier token one
/// fewer, as in the model), so the longest row of sequence b sees `lens[b]`.
pub fn model_num_valid(lens: &[usize], next_n: usize) -> Vec<i32> {
    (0..lens.len() * next_n)
        .map(|r| (lens[r / next_n] as i32 - (next_n - 1 - r % next_n) as i32).max(0))
        .collect()
}

/// The longest visible range of sequence `b` (what the logits write for each of its rows).
pub fn seq_len(nv: &[i32], next_n: usize, b: usize, capacity: usize) -> usize {
    (0..next_n)
        .map(|t| nv[b * next_n + t].max(0) as usize)
        .max()
        .unwrap()
        .min(capacity)
}

/// Tolerance of the tensor-core logits against the f64 reference, as a fraction of
/// `mag = sum_h |w_h| sum_d |q_hd k_jd|`. Products of two e4m3 values are exact. The FP8 tensor core's
/// accumulation is not documented; the measured behaviour (DeepSeek-V3 on H800: ~14 significant bits) is
/// modelled as: per k32 step, the 32 products and the accumulator are aligned to the largest exponent and
/// everything below ~2^-13 of the largest term is dropped. Worst case that is 33 x 2^-13 of the largest term per
/// step (products of one sign whose dropped tails all add up); with independent signs (all test data) the dropped
/// tails partly cancel, ~sqrt(33) x 2^-13 of the largest term, so over 4 steps ~2^-9.5 of max |term| <= 2^-9.5 of
/// sum_d |q_hd k_jd|, and in practice far less. relu is 1-Lipschitz; the fp32 epilogue (per row: 4 lanes x 2
/// chains of 8 fma, 3 adds, the scale multiply) adds < 20 x 2^-24 of mag. The tests allow 2^-9 x mag and print
/// the largest observed err / mag so the margin is visible.
pub const LOGITS_TOL: f64 = 1.0 / 512.0;

/// The f64 score of key `slot` for query row `row` and its error scale `mag` (see [`LOGITS_TOL`]).
pub fn ref_score(
    q_f64: &[f64],
    w: &[f32],
    host: &KeyCacheHost,
    row: usize,
    slot: usize,
) -> (f64, f64) {
    let k = host.key_f64(slot);
    let (mut s, mut mag) = (0.0f64, 0.0f64);
    for h in 0..NUM_HEADS {
        let qh = &q_f64[(row * NUM_HEADS + h) * HEAD_DIM..(row * NUM_HEADS + h + 1) * HEAD_DIM];
        let (mut dot, mut abs) = (0.0f64, 0.0f64);
        for d in 0..HEAD_DIM {
            dot += qh[d] * k[d];
            abs += (qh[d] * k[d]).abs();
        }
        let wh = w[row * NUM_HEADS + h] as f64;
        s += wh * reference::relu(dot);
        mag += wh.abs() * abs;
    }
    (s, mag)
}

pub fn decode_q(q: &[u8]) -> Vec<f64> {
    q.iter().map(|&c| e4m3::decode(c) as f64).collect()
}

/// Wait for the stream's work under the watchdog; panics naming `what` when it hangs or faults.
pub fn wait(gpu: &Gpu, what: &str) {
    match stress::wait_watched(gpu, WATCHDOG) {
        Ok(true) => {}
        Ok(false) => panic!("{what}: did not finish within {WATCHDOG:?}"),
        Err(e) => panic!("{what}: failed on the device: {e:#}"),
    }
}

/// [`indexer::logits`] into a fresh buffer poisoned with 0xFF, `stride` = capacity rounded up + 4 (so the
/// columns past the capacity must stay poisoned too); waits under the watchdog. Returns (scores, stride).
pub fn logits_poisoned(
    gpu: &Gpu,
    label: &str,
    qb: &QueryBatch,
    cache: &KeyCacheGpu,
) -> (Vec<f32>, usize) {
    let stride = cache.capacity.next_multiple_of(4) + 4;
    let out = gpu.poisoned::<f32>(qb.rows() * stride, POISON).unwrap();
    indexer::logits(gpu, &gpu.stream, qb, cache, &out, stride)
        .unwrap_or_else(|e| panic!("{label}: logits launch: {e:#}"));
    wait(gpu, label);
    (gpu.download(&out).unwrap(), stride)
}

/// Check logits rows against the f64 reference within [`LOGITS_TOL`] at every `ref_step`-th visible entry and
/// every tile edge, and that nothing at or past n_seq(b) (up to `stride`) was written. Returns the largest
/// err / mag seen.
#[allow(clippy::too_many_arguments)]
pub fn check_logits_rows(
    label: &str,
    got: &[f32],
    stride: usize,
    host: &KeyCacheHost,
    q: &[u8],
    w: &[f32],
    next_n: usize,
    nv: &[i32],
    ref_step: usize,
) -> f64 {
    let q_f64 = decode_q(q);
    let mut worst = 0.0f64;
    for b in 0..host.batch {
        let n_seq = seq_len(nv, next_n, b, host.capacity);
        for t in 0..next_n {
            let row = b * next_n + t;
            for j in 0..stride {
                let g = got[row * stride + j];
                if j >= n_seq {
                    assert_eq!(
                        g.to_bits(),
                        u32::MAX,
                        "{label} row {row} (n_seq {n_seq}) j {j}: wrote {g:e} past the visible entries"
                    );
                    continue;
                }
                let edge = j % 64 == 0 || j % 64 == 63 || j + 1 == n_seq;
                if !(edge || j % ref_step == 0) {
                    continue;
                }
                let (r, mag) = ref_score(&q_f64, w, host, row, host.slot(b, j));
                let err = (g as f64 - r).abs();
                assert!(
                    g.is_finite() && err <= LOGITS_TOL * mag + 1e-30,
                    "{label} row {row} (n_seq {n_seq}) j {j}: gpu {g:e} ref {r:e} err {err:e} = {:.3e} x mag \
                     (mag {mag:e}, tol {LOGITS_TOL:e} x mag)",
                    err / mag.max(1e-300)
                );
                if mag > 0.0 {
                    worst = worst.max(err / mag);
                }
            }
        }
    }
    println!("{label}: max |gpu - ref| / mag = {worst:.3e}");
    worst
}

/// Assert one top-k row: indices exactly the reference top-k of `scores` (ties to the lower index, -1
/// padding), scores the canonical score of each selected entry (-inf on padding), bit for bit.
pub fn assert_topk_row(label: &str, scores: &[f32], k: usize, idx: &[i32], sc: &[f32]) {
    let want = reference::topk(scores, k);
    for (j, &wi) in want.iter().enumerate() {
        let ws = if wi >= 0 {
            reference::canonical_score(scores[wi as usize])
        } else {
            f32::NEG_INFINITY
        };
        assert!(
            idx[j] == wi && sc[j].to_bits() == ws.to_bits(),
            "{label} position {j}: got ({}, {:e} = {:#010x}) want ({wi}, {ws:e} = {:#010x})",
            idx[j],
            sc[j],
            sc[j].to_bits(),
            ws.to_bits()
        );
    }
}

/// Assert two top-k results are the same indices and the same score bits.
pub fn assert_same_topk(
    label: &str,
    k: usize,
    got: &(Vec<i32>, Vec<f32>),
    want: &(Vec<i32>, Vec<f32>),
) {
    if let Some(p) = (0..got.0.len())
        .find(|&p| got.0[p] != want.0[p] || got.1[p].to_bits() != want.1[p].to_bits())
    {
        panic!(
            "{label}: row {} rank {}: ({}, {:#010x}) vs ({}, {:#010x})",
            p / k,
            p % k,
            got.0[p],
            got.1[p].to_bits(),
            want.0[p],
            want.1[p].to_bits()
        );
    }
}

/// An arena of `bytes` filled with [`POISON`] (carves that a kernel reads before writing show up).
fn poisoned_arena(gpu: &Gpu, bytes: usize) -> Arena {
    let mut arena = Arena::new(gpu, bytes).unwrap();
    arena.poison(&gpu.stream, POISON).unwrap();
    arena
}

/// Panic naming `what` if enqueueing failed, else wait for it under the watchdog.
fn launched(gpu: &Gpu, what: &str, enqueued: anyhow::Result<()>) {
    if let Err(e) = enqueued {
        panic!("{what}: launch: {e:#}");
    }
    wait(gpu, what);
}

/// Host score rows packed `stride` apart (NaN between rows: never read), uploaded with their num_valid.
pub struct ScoreRows {
    pub stride: usize,
    pub flat: Vec<f32>,
    pub nv: Vec<i32>,
    pub dev: cudarc::driver::CudaSlice<f32>,
    pub nv_dev: cudarc::driver::CudaSlice<i32>,
}

impl ScoreRows {
    /// Rows of different lengths; `stride` = the longest rounded up to 4 (or `min_stride` if larger).
    pub fn upload(gpu: &Gpu, rows: &[&[f32]], min_stride: usize) -> ScoreRows {
        let stride = rows
            .iter()
            .map(|r| r.len())
            .max()
            .unwrap()
            .next_multiple_of(4)
            .max(4)
            .max(min_stride);
        let mut flat = vec![f32::NAN; rows.len() * stride];
        for (r, v) in rows.iter().enumerate() {
            flat[r * stride..r * stride + v.len()].copy_from_slice(v);
        }
        let nv: Vec<i32> = rows.iter().map(|r| r.len() as i32).collect();
        let dev = gpu.upload(&flat).unwrap();
        let nv_dev = gpu.upload(&nv).unwrap();
        ScoreRows {
            stride,
            flat,
            nv,
            dev,
            nv_dev,
        }
    }
    pub fn row(&self, r: usize) -> &[f32] {
        &self.flat[r * self.stride..r * self.stride + self.nv[r] as usize]
    }
}

/// A top-k workspace (own arena) and poisoned outputs for `rows` rows of `stride` scores.
pub struct TopkRig {
    _arena: Arena,
    pub ws: TopkWorkspace,
    pub out: TopkOutput,
}

impl TopkRig {
    pub fn new(gpu: &Gpu, rows: usize, k: usize, stride: usize) -> TopkRig {
        let mut arena = poisoned_arena(gpu, TopkWorkspace::workspace_bytes(rows, k, stride));
        let ws = TopkWorkspace::carve(&mut arena, &gpu.stream, rows, k, stride).unwrap();
        TopkRig {
            _arena: arena,
            ws,
            out: TopkOutput::new(gpu, rows, k).unwrap(),
        }
    }
    /// Poison the outputs, run the top-k along `path`, wait under the watchdog, download.
    pub fn run(
        &mut self,
        gpu: &Gpu,
        label: &str,
        path: TopkPath,
        s: &ScoreRows,
    ) -> (Vec<i32>, Vec<f32>) {
        self.out.fill(&gpu.stream, POISON).unwrap();
        let ws = self.ws;
        let r = indexer::topk_with(
            gpu,
            &gpu.stream,
            path,
            &s.dev,
            &s.nv_dev,
            &ws,
            &self.out.idx,
            &self.out.score,
        );
        launched(gpu, &format!("{label}: top-k ({path:?})"), r);
        self.out.download(gpu).unwrap()
    }
}

/// An indexer workspace (own arena, poisoned before carving) and poisoned outputs for one call shape.
pub struct IndexerRig {
    pub arena: Arena,
    pub ws: IndexerWorkspace,
    pub out: TopkOutput,
}

impl IndexerRig {
    pub fn new(gpu: &Gpu, rows: usize, capacity: usize, k: usize) -> IndexerRig {
        let mut arena = poisoned_arena(gpu, IndexerWorkspace::workspace_bytes(rows, capacity, k));
        let ws = IndexerWorkspace::carve(&mut arena, &gpu.stream, rows, capacity, k).unwrap();
        IndexerRig {
            arena,
            ws,
            out: TopkOutput::new(gpu, rows, k).unwrap(),
        }
    }
    /// Poison the scores and outputs, run the whole call along `path`, wait, download (scores, (idx, sc)).
    pub fn run(
        &mut self,
        gpu: &Gpu,
        label: &str,
        path: TopkPath,
        qb: &QueryBatch,
        cache: &KeyCacheGpu,
    ) -> (Vec<f32>, (Vec<i32>, Vec<f32>)) {
        self.poison(gpu);
        let r = indexer::run_with(
            gpu,
            &gpu.stream,
            path,
            qb,
            cache,
            &self.ws,
            &self.out.idx,
            &self.out.score,
        );
        launched(gpu, &format!("{label}: indexer run ({path:?})"), r);
        self.download(gpu)
    }
    pub fn poison(&mut self, gpu: &Gpu) {
        arena::fill(&gpu.stream, &self.ws.scores, POISON).unwrap();
        self.out.fill(&gpu.stream, POISON).unwrap();
    }
    pub fn download(&self, gpu: &Gpu) -> (Vec<f32>, (Vec<i32>, Vec<f32>)) {
        (
            arena::download(&gpu.stream, &self.ws.scores).unwrap(),
            self.out.download(gpu).unwrap(),
        )
    }
}

/// Check a whole call's top-k: every row exact against the reference top-k of the GPU's own scores (the
/// top-k contract), indices and score bits.
pub fn check_topk_of_scores(
    label: &str,
    scores: &[f32],
    stride: usize,
    nv: &[i32],
    k: usize,
    topk: &(Vec<i32>, Vec<f32>),
) {
    for (r, &n) in nv.iter().enumerate() {
        let n = (n.max(0) as usize).min(stride);
        assert_topk_row(
            &format!("{label} row {r} (num_valid {n})"),
            &scores[r * stride..r * stride + n],
            k,
            &topk.0[r * k..(r + 1) * k],
            &topk.1[r * k..(r + 1) * k],
        );
    }
}
