//! `megamoe stress indexer`: the indexer at every size that has broken top-k kernels before, each launch
//! under a host-side watchdog.
//!
//! Watchdog: after enqueueing a case, an event is recorded and polled (`cuEventQuery`) until it completes or
//! `watchdog` elapses. A timeout is reported as a failure naming the case and its parameters and the suite
//! stops at once; the caller must then exit the process without synchronizing (a hung kernel cannot be
//! cancelled, and tearing the context down would wait on it). Nothing here ever blocks on the device
//! except after the event reported completion.
//!
//! Paths under test (`StressOptions::topk_paths`): the three-launch top-k chain (histogram -> CTA-aggregated
//! threshold select -> indexer_topk_final: multi-CTA rank by counting, with a one-CTA radix-select /
//! bitonic fallback for threshold buckets above TOPK_BUCKET_CAP) with plain launches and through its PDL entry
//! points, and (quick subset) the routed default [`super::topk`]: every case of (A) runs each listed path against
//! the CPU reference. (B) runs the default [`super::run`] (FP8: TMA-ring wgmma logits; MXFP4: the e4m3 mma.sync
//! kernels) end to end against the reference, then every other listed top-k path on the GPU's own scores, which
//! must give bit-identical indices and scores. The per-branch tests of the final passes are in tests/indexer.rs.
//!
//! Cases: (A) top-k alone on host-made scores: every num_valid in 0..=4096 (batched, many rows per launch),
//! random lengths up to 262,144, k - 1, k, k + 1, multiples of 128 and of 32,768 +- 1, histogram-slice and
//! shared-memory-bucket edges +- 1, and score
//! patterns: distinct random, all equal, all zero, three values (heavy ties), ascending, descending, and
//! NaN / +-inf / -0 sprinkled in. Compared exactly with [`reference::topk`] (the order is total, so exact
//! agreement is the contract, ties included). (B) writer + logits + top-k end to end, both formats,
//! next_n = 1 and 2: the cache the GPU wrote equals the CPU writer's bytes; sampled logits agree with the
//! f64 reference within the FP8 tensor-core accumulation bound; the top-k equals the reference top-k of the
//! GPU's own scores, and every selected entry's reference score is within that bound of the reference
//! k-th score. Rows with all-zero ReLU (q = 0) and sequences of identical keys exercise the tie rule.
//!
//! NaN / Inf policy under test: NaN ranks as -inf, -0 as +0, -inf is the lowest ordinary score;
//! NaN q codes and non-finite w are rejected by [`super::validate_queries`] before any launch.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use cudarc::driver::sys::CUevent_flags;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::reference::{self, IndexerShape, KeyCacheHost, KeyFormat, HEAD_DIM, NUM_HEADS};
use super::{IndexerWorkspace, KeyCacheGpu, QueryBatch, TopkOutput, TopkPath, TopkWorkspace};
use crate::gpu::arena::{self, Arena};
use crate::gpu::Gpu;
use crate::progress::Progress;

/// What to run.
#[derive(Debug, Clone)]
pub struct StressOptions {
    pub seed: u64,
    /// Host-side limit per launch group.
    pub watchdog: Duration,
    /// Every num_valid in 0..=exhaustive_max (the issue asks 4096).
    pub exhaustive_max: usize,
    /// Random lengths in 1..=random_max (262,144 = 1M context at m = 4).
    pub random_cases: usize,
    pub random_max: usize,
    pub ks: Vec<usize>,
    pub formats: Vec<KeyFormat>,
    /// Largest sequence of the end-to-end cases.
    pub e2e_max: usize,
    /// Top-k paths every case of part (A) runs; part (B) runs the default path end to end and compares
    /// every other listed path with it on the GPU's own scores, bit for bit.
    pub topk_paths: Vec<TopkPath>,
}

impl Default for StressOptions {
    fn default() -> Self {
        StressOptions {
            seed: 0x1DE7,
            watchdog: Duration::from_secs(2),
            exhaustive_max: 4096,
            random_cases: 24,
            random_max: 262_144,
            ks: vec![512, 1024, 2048],
            formats: vec![KeyFormat::Fp8, KeyFormat::Mxfp4],
            e2e_max: 262_144,
            // The default is Pdl (k <= 512) or Chain by construction, so the full suite runs both launch modes at
            // every k and length; part (B) runs the default itself.
            topk_paths: vec![TopkPath::Chain, TopkPath::Pdl],
        }
    }
}

impl StressOptions {
    /// A few-second subset for `cargo test` on a GPU machine.
    pub fn quick(seed: u64) -> StressOptions {
        StressOptions {
            seed,
            exhaustive_max: 700,
            random_cases: 3,
            random_max: 80_000,
            ks: vec![512, 2048],
            e2e_max: 40_000,
            // The sanitizers run this subset: every path, the routed default and the PDL entry points included.
            topk_paths: vec![TopkPath::Default, TopkPath::Chain, TopkPath::Pdl],
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone)]
pub struct StressFailure {
    pub case: String,
    pub detail: String,
}

#[derive(Debug, Clone, Default)]
pub struct StressReport {
    pub seed: u64,
    pub cases: usize,
    pub launch_groups: usize,
    pub failures: Vec<StressFailure>,
    /// Set when a launch group exceeded the watchdog: the suite stopped there. Exit the process.
    pub hung: Option<String>,
    pub elapsed_s: f64,
}

impl StressReport {
    pub fn passed(&self) -> bool {
        self.failures.is_empty() && self.hung.is_none()
    }
    pub fn summary(&self) -> String {
        let mut s = format!(
            "indexer stress (seed {:#x}): {} cases in {} watched launch groups, {} failures, {:.1} s\n\
             policy: NaN score ranks as -inf, -0 as +0, ties -> lower index; NaN q / non-finite w rejected before launch\n",
            self.seed,
            self.cases,
            self.launch_groups,
            self.failures.len(),
            self.elapsed_s
        );
        if let Some(h) = &self.hung {
            s += &format!("HANG: {h}\n");
        }
        for f in self.failures.iter().take(20) {
            s += &format!("FAIL {}: {}\n", f.case, f.detail);
        }
        s
    }
}

/// Enqueued work must finish within `timeout`; polls an event, never blocks on the device.
pub fn wait_watched(gpu: &Gpu, timeout: Duration) -> Result<bool> {
    let ev = gpu
        .ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(|e| anyhow!("event: {e:?}"))?;
    ev.record(&gpu.stream)
        .map_err(|e| anyhow!("event record: {e:?}"))?;
    let start = Instant::now();
    loop {
        if ev
            .try_is_complete()
            .map_err(|e| anyhow!("a launch failed (cuEventQuery): {e:?}"))?
        {
            return Ok(true);
        }
        if start.elapsed() > timeout {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

struct Ctx<'a> {
    gpu: &'a Gpu,
    opts: &'a StressOptions,
    rep: StressReport,
    rng: ChaCha8Rng,
}

impl Ctx<'_> {
    fn fail(&mut self, case: &str, detail: String) {
        self.rep.failures.push(StressFailure {
            case: case.to_string(),
            detail,
        });
    }
    /// Wait for the group; false = hung (recorded; the caller stops).
    fn watch(&mut self, what: &str) -> Result<bool> {
        self.rep.launch_groups += 1;
        if wait_watched(self.gpu, self.opts.watchdog)? {
            Ok(true)
        } else {
            self.rep.hung = Some(format!(
                "{what}: no completion within {:?}",
                self.opts.watchdog
            ));
            Ok(false)
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Pattern {
    Random,
    AllEqual,
    AllZero,
    ThreeValues,
    Ascending,
    Descending,
    Specials,
}
const PATTERNS: [Pattern; 7] = [
    Pattern::Random,
    Pattern::AllEqual,
    Pattern::AllZero,
    Pattern::ThreeValues,
    Pattern::Ascending,
    Pattern::Descending,
    Pattern::Specials,
];

fn make_scores(rng: &mut ChaCha8Rng, n: usize, p: Pattern) -> Vec<f32> {
    match p {
        Pattern::Random => (0..n).map(|_| rng.random_range(-10.0f32..10.0)).collect(),
        Pattern::AllEqual => vec![1.25; n],
        Pattern::AllZero => (0..n)
            .map(|i| if i % 3 == 0 { -0.0 } else { 0.0 })
            .collect(),
        Pattern::ThreeValues => (0..n)
            .map(|_| [0.0f32, 1.0, 2.0][rng.random_range(0..3)])
            .collect(),
        Pattern::Ascending => (0..n).map(|i| i as f32 * 0.5).collect(),
        Pattern::Descending => (0..n).map(|i| -(i as f32)).collect(),
        Pattern::Specials => (0..n)
            .map(|_| match rng.random_range(0..10) {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 => f32::INFINITY,
                3 => -0.0,
                _ => rng.random_range(-1.0f32..1.0),
            })
            .collect(),
    }
}

/// Check a downloaded top-k row: indices exactly as the reference, scores = canonical scores, -inf padding.
fn check_row(scores: &[f32], k: usize, idx: &[i32], sc: &[f32]) -> std::result::Result<(), String> {
    reference::check_topk_exact(scores, k, idx)?;
    for j in 0..k {
        let want = if idx[j] >= 0 {
            reference::canonical_score(scores[idx[j] as usize])
        } else {
            f32::NEG_INFINITY
        };
        if sc[j].to_bits() != want.to_bits() {
            return Err(format!(
                "score at position {j}: got {:e}, want {:e}",
                sc[j], want
            ));
        }
    }
    Ok(())
}

/// Run top-k over host rows (all in one launch group) and check every row.
fn topk_group(cx: &mut Ctx, label: &str, rows: &[Vec<f32>], k: usize) -> Result<bool> {
    let gpu = cx.gpu;
    let max_n = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let stride = max_n.next_multiple_of(4).max(4);
    let mut flat = vec![f32::NAN; rows.len() * stride];
    for (r, row) in rows.iter().enumerate() {
        flat[r * stride..r * stride + row.len()].copy_from_slice(row);
    }
    let nv: Vec<i32> = rows.iter().map(|r| r.len() as i32).collect();
    let scores = gpu.upload(&flat)?;
    let nv_dev = gpu.upload(&nv)?;
    let stream = &gpu.stream;
    let mut arena = Arena::new(gpu, TopkWorkspace::workspace_bytes(rows.len(), k, stride))?;
    let ws = TopkWorkspace::carve(&mut arena, stream, rows.len(), k, stride)?;
    let mut out = TopkOutput::new(gpu, rows.len(), k)?;
    for path in cx.opts.topk_paths.clone() {
        // Poisoned outputs: a position a path fails to write cannot pass on the previous path's answer.
        out.fill(stream, 0xFF)?;
        if let Err(e) = super::topk_with(
            gpu, stream, path, &scores, &nv_dev, &ws, &out.idx, &out.score,
        ) {
            // A launch a path refuses is a failure of that path; the other paths are still tested.
            cx.fail(&format!("{label} {path:?} k={k} launch"), format!("{e:#}"));
            continue;
        }
        let what = format!(
            "{label}: top-k ({path:?}) k={k}, {} rows, num_valid {}..={}",
            rows.len(),
            nv.iter().min().unwrap_or(&0),
            max_n
        );
        if !cx.watch(&what)? {
            return Ok(false);
        }
        let (idx, sc) = out.download(gpu)?;
        for (r, row) in rows.iter().enumerate() {
            cx.rep.cases += 1;
            if let Err(e) = check_row(row, k, &idx[r * k..(r + 1) * k], &sc[r * k..(r + 1) * k]) {
                cx.fail(
                    &format!("{label} {path:?} k={k} num_valid={} row={r}", row.len()),
                    e,
                );
            }
        }
    }
    Ok(true)
}

fn special_lengths(k: usize, max: usize) -> Vec<usize> {
    // Powers of two and their neighbours (32,768 = 2^15 and multiples): block and chunk boundaries of any top-k.
    let c = 32_768;
    let mut v = vec![
        k - 1,
        k,
        k + 1,
        2 * k + 1,
        // Slice edges of the histogram / select CTAs (4096 entries), and 16,384 composites (the all-equal
        // pattern puts a whole row in the threshold bucket: far past the final pass's shared-memory bucket).
        4095,
        4097,
        8191,
        8193,
        16_384,
        16_385,
        c - 1,
        c,
        c + 1,
        2 * c - 1,
        2 * c + 1,
        8 * c,
        8 * c + 1,
        131_071,
        131_073,
        max,
    ];
    v.retain(|&n| n <= max && n > 0);
    v
}

/// Part A: top-k alone.
fn stress_topk(cx: &mut Ctx) -> Result<bool> {
    let ks = cx.opts.ks.clone();
    for &k in &ks {
        // Every num_valid in 0..=exhaustive_max, 256 rows per launch, patterns cycling.
        let mut n = 0usize;
        let mut pi = 0usize;
        while n <= cx.opts.exhaustive_max {
            let hi = (n + 256).min(cx.opts.exhaustive_max + 1);
            let rows: Vec<Vec<f32>> = (n..hi)
                .map(|len| {
                    pi += 1;
                    make_scores(&mut cx.rng, len, PATTERNS[pi % PATTERNS.len()])
                })
                .collect();
            if !topk_group(cx, "exhaustive", &rows, k)? {
                return Ok(false);
            }
            n = hi;
        }
        // Edge lengths around k and the chunk size, every pattern.
        for len in special_lengths(k, cx.opts.random_max) {
            let rows: Vec<Vec<f32>> = PATTERNS
                .iter()
                .map(|&p| make_scores(&mut cx.rng, len, p))
                .collect();
            if !topk_group(cx, "edge", &rows, k)? {
                return Ok(false);
            }
        }
        // Random lengths up to random_max, mixed in one launch (rows of different lengths and chunk counts).
        let lens: Vec<usize> = (0..cx.opts.random_cases)
            .map(|_| cx.rng.random_range(1..=cx.opts.random_max))
            .collect();
        let rows: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| make_scores(&mut cx.rng, l, PATTERNS[i % PATTERNS.len()]))
            .collect();
        if !topk_group(cx, "random", &rows, k)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Part B: writer + logits + top-k end to end.
fn stress_e2e(cx: &mut Ctx, format: KeyFormat, next_n: usize, k: usize) -> Result<bool> {
    let gpu = cx.gpu;
    let big = cx.opts.e2e_max;
    // Sequences: edge lengths, one long one, one of identical keys, one with all-zero ReLU (q = 0).
    let mut lens = vec![0usize, 1, 127, 128, 129, k - 1, k, k + 1, 4095, 4096, big];
    lens.push(cx.rng.random_range(1..=big));
    let identical_seq = lens.len();
    lens.push(3000);
    let zero_q_seq = lens.len();
    lens.push(2500);
    let batch = lens.len();
    let capacity = lens.iter().copied().max().unwrap().max(1);
    let label = format!("e2e {} next_n={next_n} k={k}", format.name());

    // Raw keys -> GPU writer -> compare with the CPU writer, byte for byte.
    let mut host = KeyCacheHost::new(format, batch, capacity);
    let mut raw = Vec::new();
    let mut slots = Vec::new();
    let same_key: Vec<f32> = (0..HEAD_DIM)
        .map(|_| cx.rng.random_range(-3.0f32..3.0))
        .collect();
    for (b, &n) in lens.iter().enumerate() {
        for j in 0..n {
            let key: Vec<f32> = if b == identical_seq {
                same_key.clone()
            } else {
                let amp = [0.01f32, 1.0, 40.0][cx.rng.random_range(0..3)];
                (0..HEAD_DIM)
                    .map(|_| cx.rng.random_range(-amp..amp))
                    .collect()
            };
            host.write_key(host.slot(b, j), key.as_slice().try_into()?)?;
            raw.extend_from_slice(&key);
            slots.push(host.slot(b, j) as i32);
        }
    }
    let mut cache = KeyCacheGpu::filled(gpu, format, batch, capacity, 0xFF)?;
    let raw_dev = gpu.upload(&raw)?;
    let slots_dev = cache.upload_slots(gpu, &slots)?;
    super::write_keys(gpu, &gpu.stream, &mut cache, &raw_dev, &slots_dev)?;
    if !cx.watch(&format!("{label}: key writer, {} keys", slots.len()))? {
        return Ok(false);
    }
    let got = cache.download(gpu)?;
    let cb = format.code_bytes();
    cx.rep.cases += 1;
    for &s in &slots {
        let s = s as usize;
        if got.codes[s * cb..(s + 1) * cb] != host.codes[s * cb..(s + 1) * cb]
            || got.scales[s * 4..s * 4 + 4] != host.scales[s * 4..s * 4 + 4]
        {
            let d = (0..cb).find(|&d| got.codes[s * cb + d] != host.codes[s * cb + d]);
            cx.fail(&format!("{label} writer slot {s}"), format!("GPU entry differs from the CPU writer (first code byte {d:?}; scales {:?} vs {:?})", &got.scales[s * 4..s * 4 + 4], &host.scales[s * 4..s * 4 + 4]));
            break;
        }
    }

    // Queries: row b*next_n + t sees lens[b] - (next_n - 1 - t) entries (the earlier token sees one fewer).
    let rows = batch * next_n;
    let mut q_codes: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
        .map(|_| reference::random_e4m3(&mut cx.rng))
        .collect();
    for t in 0..next_n {
        let r = zero_q_seq * next_n + t;
        q_codes[r * NUM_HEADS * HEAD_DIM..(r + 1) * NUM_HEADS * HEAD_DIM].fill(0);
    }
    let w: Vec<f32> = (0..rows * NUM_HEADS)
        .map(|_| cx.rng.random_range(-1.0f32..1.0))
        .collect();
    let nv: Vec<i32> = (0..rows)
        .map(|r| (lens[r / next_n] as i64 - (next_n - 1 - r % next_n) as i64).max(0) as i32)
        .collect();
    let q = QueryBatch::upload(gpu, batch, next_n, &q_codes, &w, &nv)?;
    let stream = &gpu.stream;
    let mut arena = Arena::new(gpu, IndexerWorkspace::workspace_bytes(rows, capacity, k))?;
    let ws = IndexerWorkspace::carve(&mut arena, stream, rows, capacity, k)?;
    let mut out = TopkOutput::new(gpu, rows, k)?;
    super::run(gpu, stream, &q, &cache, &ws, &out.idx, &out.score)?;
    if !cx.watch(&format!("{label}: logits + top-k, num_valid {nv:?}"))? {
        return Ok(false);
    }
    let scores = arena::download(stream, &ws.scores)?;
    let (idx, tsc) = out.download(gpu)?;
    let stride = ws.score_stride;
    let shape = IndexerShape {
        batch,
        next_n,
        num_valid: nv.clone(),
    };
    // Tolerance: e4m3 products are exact in fp32; the tensor core accumulates with a reduced-precision
    // fp32 adder (~2^-13 relative to the running magnitude on Hopper FP8) over 4 k-steps plus our fp32
    // epilogue, so |gpu - ref| <= 2^-9 * sum_h |w_h| sum_d |q_hd k_d| leaves a 4x margin on that.
    let tol_rel = f64::powi(2.0, -9);
    for r in 0..rows {
        let n = nv[r] as usize;
        let row_scores = &scores[r * stride..r * stride + n];
        cx.rep.cases += 1;
        let case = format!("{label} row={r} num_valid={n}");
        // Sampled logits vs the f64 reference (all of them for short rows).
        let samples: Vec<usize> = if n <= 256 {
            (0..n).collect()
        } else {
            (0..256).map(|_| cx.rng.random_range(0..n)).collect()
        };
        let mut worst: Option<(usize, f32, f64, f64)> = None;
        for &j in &samples {
            let want = reference_logit(&shape, &q_codes, &w, &host, r, j);
            let mag = reference::logit_magnitude(&shape, &q_codes, &w, &host, r, j);
            let err = (row_scores[j] as f64 - want).abs();
            // NaN errors count as failures too.
            let within = err <= tol_rel * mag + 1e-30;
            if !within && worst.is_none_or(|(_, _, _, e)| err > e) {
                worst = Some((j, row_scores[j], want, err));
            }
        }
        if let Some((j, g, wv, e)) = worst {
            cx.fail(
                &case,
                format!("logit j={j}: gpu {g:e} vs ref {wv:e} (abs err {e:e})"),
            );
        }
        if r / next_n == zero_q_seq && row_scores.iter().any(|&s| s.to_bits() != 0) {
            cx.fail(&case, "all-zero ReLU row: a score is not exactly +0".into());
        }
        if let Err(e) = check_row(
            row_scores,
            k,
            &idx[r * k..(r + 1) * k],
            &tsc[r * k..(r + 1) * k],
        ) {
            cx.fail(
                &case,
                format!("top-k vs reference top-k of the GPU scores: {e}"),
            );
        }
    }

    // Every other listed top-k path on the same scores: bit-identical to the default path (indices and scores).
    let default_idx = idx;
    let default_sc = tsc;
    for path in cx.opts.topk_paths.clone() {
        if path == TopkPath::Default {
            continue;
        }
        out.fill(stream, 0xFF)?;
        if let Err(e) = super::topk_with(
            gpu,
            stream,
            path,
            &ws.scores,
            &q.num_valid,
            &ws.topk,
            &out.idx,
            &out.score,
        ) {
            cx.fail(&format!("{label} {path:?} top-k launch"), format!("{e:#}"));
            continue;
        }
        if !cx.watch(&format!("{label}: {path:?} top-k on the GPU scores"))? {
            return Ok(false);
        }
        let (idx, tsc) = out.download(gpu)?;
        cx.rep.cases += 1;
        if let Some(p) = (0..rows * k)
            .find(|&p| idx[p] != default_idx[p] || tsc[p].to_bits() != default_sc[p].to_bits())
        {
            cx.fail(
                &format!("{label} {path:?} top-k row={} position={}", p / k, p % k),
                format!(
                    "got ({}, {:e}), default path ({}, {:e})",
                    idx[p], tsc[p], default_idx[p], default_sc[p]
                ),
            );
        }
    }
    Ok(true)
}

fn reference_logit(
    shape: &IndexerShape,
    q_codes: &[u8],
    w: &[f32],
    cache: &KeyCacheHost,
    row: usize,
    j: usize,
) -> f64 {
    let b = row / shape.next_n;
    let k = cache.key_f64(cache.slot(b, j));
    let mut s = 0.0;
    for h in 0..NUM_HEADS {
        let base = (row * NUM_HEADS + h) * HEAD_DIM;
        let dot: f64 = (0..HEAD_DIM)
            .map(|d| crate::formats::e4m3::decode(q_codes[base + d]) as f64 * k[d])
            .sum();
        s += w[row * NUM_HEADS + h] as f64 * reference::relu(dot);
    }
    s
}

/// The stress suite; see the module docs. Stops at the first hang (`report.hung`).
pub fn run_stress(gpu: &Gpu, opts: &StressOptions) -> Result<StressReport> {
    let start = Instant::now();
    let mut cx = Ctx {
        gpu,
        opts,
        rep: StressReport {
            seed: opts.seed,
            ..Default::default()
        },
        rng: ChaCha8Rng::seed_from_u64(opts.seed),
    };
    // The input policy (no GPU involved): NaN q codes and non-finite w never reach a launch.
    let q_nan = vec![0x7Fu8; NUM_HEADS * HEAD_DIM];
    cx.rep.cases += 2;
    if super::validate_queries(1, 1, &q_nan, &[1.0; NUM_HEADS], &[1]).is_ok() {
        cx.fail("policy", "a NaN q code was accepted".into());
    }
    if super::validate_queries(
        1,
        1,
        &vec![0x38u8; NUM_HEADS * HEAD_DIM],
        &[f32::INFINITY; NUM_HEADS],
        &[1],
    )
    .is_ok()
    {
        cx.fail("policy", "an infinite w was accepted".into());
    }
    let mut progress = Progress::new("indexer stress", 1 + opts.formats.len() * 2 * opts.ks.len());
    let mut alive = stress_topk(&mut cx)?;
    progress.tick("top-k alone");
    'e2e: for &format in &opts.formats {
        for next_n in [1usize, 2] {
            for &k in &opts.ks {
                if !alive {
                    break 'e2e;
                }
                alive = stress_e2e(&mut cx, format, next_n, k)?;
                progress.tick(&format!(
                    "end to end {} next_n={next_n} k={k}",
                    format.name()
                ));
            }
        }
    }
    cx.rep.elapsed_s = start.elapsed().as_secs_f64();
    Ok(cx.rep)
}
