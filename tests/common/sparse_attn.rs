//! Fixtures of the sparse_attn tests: realistic KV vectors and queries, host problems with their device copies,
//! one poisoned decode call, and the assertions against the CPU reference.

use half::bf16;
use megamoe::gpu::Gpu;
use megamoe::ops::sparse_attn::bench::Variant;
use megamoe::ops::sparse_attn::reference::{
    self, decode_attention, encode_entry, rope_freqs, rope_rotate, DecodeProblem, QueryPrecision,
};
use megamoe::ops::sparse_attn::{
    DecodeInputs, DecodeShape, DecodeWorkspace, SplitPlan, ENTRY_BYTES, HEAD_DIM, NOPE_DIM,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::POISON;

/// The variable that replays a GPU test's seed.
pub const REPLAY_VAR: &str = "SPARSE_ATTN_SEED";

/// A fixed-seed RNG (CPU tests whose cases are pinned to one draw).
pub fn fixed_rng(test: &str, seed: u64) -> ChaCha8Rng {
    println!("{test}: seed {seed:#x}");
    ChaCha8Rng::seed_from_u64(seed)
}

/// Standard normal by Box-Muller (rand 0.9 without rand_distr).
pub fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// Realistic KV vectors and queries: a shared direction `u` makes scores spread (some entries align with
/// some heads), per-channel gains give tiles different amax (so the 7 scales differ), q is RMS-normalized per
/// head (DSV4 §3.6), rope dims rotated by the entry's / query's position.
#[derive(Clone)]
pub struct DataGen {
    u: Vec<f32>,
    gain: Vec<f32>,
    pub freqs: [f32; 32],
}

impl DataGen {
    pub fn new(rng: &mut ChaCha8Rng) -> DataGen {
        let u = (0..HEAD_DIM).map(|_| normal(rng)).collect();
        let gain = (0..HEAD_DIM)
            .map(|d| {
                if d % 37 == 5 {
                    6.0
                } else {
                    0.5 + rng.random::<f32>()
                }
            })
            .collect();
        DataGen {
            u,
            gain,
            freqs: rope_freqs(160_000.0, true),
        }
    }
    pub fn kv(&self, rng: &mut ChaCha8Rng, pos: i32) -> Vec<f32> {
        let a: f32 = rng.random_range(0.0..1.5);
        let mut x: Vec<f64> = (0..HEAD_DIM)
            .map(|d| ((normal(rng) + a * self.u[d]) * self.gain[d]) as f64)
            .collect();
        rope_rotate(&mut x[NOPE_DIM..], pos, &self.freqs, false);
        x.iter().map(|&v| v as f32).collect()
    }
    pub fn q_head(&self, rng: &mut ChaCha8Rng, pos: i32) -> Vec<bf16> {
        let b: f32 = rng.random_range(0.0..2.0);
        let x: Vec<f32> = (0..HEAD_DIM).map(|d| normal(rng) + b * self.u[d]).collect();
        let rms = (x.iter().map(|v| (v * v) as f64).sum::<f64>() / HEAD_DIM as f64 + 1e-6).sqrt();
        let mut y: Vec<f64> = x.iter().map(|&v| v as f64 / rms).collect();
        rope_rotate(&mut y[NOPE_DIM..], pos, &self.freqs, false);
        y.iter().map(|&v| bf16::from_f64(v)).collect()
    }
}

/// A host-side problem: pool, per-sequence candidate lists (with some -1 holes), q, sinks.
pub struct HostProblem {
    pub batch: usize,
    pub heads: usize,
    pub stride: usize,
    pub q: Vec<bf16>,
    pub pool: Vec<u8>,
    pub candidates: Vec<i32>,
    pub lengths: Vec<i32>,
    pub positions: Vec<i32>,
    pub sinks: Vec<f32>,
    pub freqs: [f32; 32],
    gen: DataGen,
    holes: bool,
}

impl HostProblem {
    /// Stride = the longest of `lengths` (at least 1).
    pub fn random(
        rng: &mut ChaCha8Rng,
        heads: usize,
        lengths: &[usize],
        holes: bool,
    ) -> HostProblem {
        let stride = lengths.iter().cloned().max().unwrap_or(0).max(1);
        HostProblem::with_stride(rng, heads, stride, lengths, holes)
    }

    /// A problem whose candidate rows are `stride` long (a capacity: lengths may be shorter). The pool holds
    /// max(sum(lengths) / 2, stride / 2, 8) entries, so entries repeat across and within lists.
    pub fn with_stride(
        rng: &mut ChaCha8Rng,
        heads: usize,
        stride: usize,
        lengths: &[usize],
        holes: bool,
    ) -> HostProblem {
        assert!(
            lengths.iter().all(|&l| l <= stride),
            "lengths {lengths:?} above stride {stride}"
        );
        let gen = DataGen::new(rng);
        let n_entries = (lengths.iter().sum::<usize>() / 2).max(stride / 2).max(8);
        let mut pool = Vec::with_capacity(n_entries * ENTRY_BYTES);
        for i in 0..n_entries {
            pool.extend_from_slice(&encode_entry(&gen.kv(rng, i as i32)).unwrap());
        }
        let sinks = (0..heads).map(|_| rng.random_range(-2.0f32..3.0)).collect();
        let mut hp = HostProblem {
            batch: lengths.len(),
            heads,
            stride,
            q: Vec::new(),
            pool,
            candidates: Vec::new(),
            lengths: Vec::new(),
            positions: Vec::new(),
            sinks,
            freqs: gen.freqs,
            gen,
            holes,
        };
        hp.redraw(rng, lengths);
        hp
    }

    /// New candidate lists of `lengths` (same batch and stride; entries past a length are -1), new query
    /// positions and new q over the same pool, sinks and frequencies: what changes between decode steps.
    pub fn redraw(&mut self, rng: &mut ChaCha8Rng, lengths: &[usize]) {
        assert!(
            self.lengths.is_empty() || lengths.len() == self.batch,
            "redraw keeps the batch ({} sequences)",
            self.batch
        );
        assert!(lengths.iter().all(|&l| l <= self.stride));
        let n_entries = self.pool.len() / ENTRY_BYTES;
        let mut candidates = vec![-1i32; self.batch * self.stride];
        for (s, &len) in lengths.iter().enumerate() {
            for j in 0..len {
                // entries may repeat across and within sequences (window and compressed overlap in DSV4)
                let hole = self.holes && (j % 53 == 17 || (len > 2 && j == len / 2));
                candidates[s * self.stride + j] = if hole {
                    -1
                } else {
                    rng.random_range(0..n_entries as i32)
                };
            }
        }
        let positions: Vec<i32> = (0..self.batch)
            .map(|_| rng.random_range(0..1_000_000))
            .collect();
        let mut q = Vec::with_capacity(self.batch * self.heads * HEAD_DIM);
        for &p in positions.iter() {
            for _ in 0..self.heads {
                q.extend(self.gen.q_head(rng, p));
            }
        }
        self.candidates = candidates;
        self.lengths = lengths.iter().map(|&l| l as i32).collect();
        self.positions = positions;
        self.q = q;
    }

    pub fn problem(&self) -> DecodeProblem<'_> {
        DecodeProblem {
            batch: self.batch,
            heads: self.heads,
            q: &self.q,
            pool: &self.pool,
            candidates: &self.candidates,
            stride: self.stride,
            lengths: &self.lengths,
            positions: &self.positions,
            sinks: &self.sinks,
            freqs: &self.freqs,
        }
    }
    pub fn shape(&self) -> DecodeShape {
        DecodeShape {
            batch: self.batch,
            heads: self.heads,
            stride: self.stride,
            n_entries: self.pool.len() / ENTRY_BYTES,
        }
    }
    /// The CPU reference of variant `v` (the FP8 paths quantize q per (head, 64-tile) like a KV entry, the
    /// baseline keeps q in BF16).
    pub fn reference(&self, v: Variant) -> reference::DecodeReference {
        let prec = if v == Variant::Bf16Staging {
            QueryPrecision::Bf16
        } else {
            QueryPrecision::Fp8Tiles
        };
        decode_attention(&self.problem(), prec).unwrap()
    }
}

/// Device copies of a host problem's inputs.
pub struct DeviceProblem {
    pub q: cudarc::driver::CudaSlice<bf16>,
    pub pool: cudarc::driver::CudaSlice<u8>,
    pub candidates: cudarc::driver::CudaSlice<i32>,
    pub lengths: cudarc::driver::CudaSlice<i32>,
    pub positions: cudarc::driver::CudaSlice<i32>,
    pub sinks: cudarc::driver::CudaSlice<f32>,
    pub freqs: cudarc::driver::CudaSlice<f32>,
}

impl DeviceProblem {
    pub fn upload(gpu: &Gpu, hp: &HostProblem) -> DeviceProblem {
        DeviceProblem {
            q: gpu.upload(&hp.q).unwrap(),
            pool: gpu.upload(&hp.pool).unwrap(),
            candidates: gpu.upload(&hp.candidates).unwrap(),
            lengths: gpu.upload(&hp.lengths).unwrap(),
            positions: gpu.upload(&hp.positions).unwrap(),
            sinks: gpu.upload(&hp.sinks).unwrap(),
            freqs: gpu.upload(&hp.freqs).unwrap(),
        }
    }
    /// Copy what [`HostProblem::redraw`] changes (candidates, lengths, positions, q) into the existing device
    /// buffers on `stream`: no allocation, the addresses a captured graph holds stay valid.
    pub fn write_step(
        &mut self,
        gpu: &Gpu,
        stream: &megamoe::gpu::launch::Stream,
        hp: &HostProblem,
    ) {
        gpu.write(stream, &mut self.candidates, &hp.candidates)
            .unwrap();
        gpu.write(stream, &mut self.lengths, &hp.lengths).unwrap();
        gpu.write(stream, &mut self.positions, &hp.positions)
            .unwrap();
        gpu.write(stream, &mut self.q, &hp.q).unwrap();
    }
    pub fn inputs(&self) -> DecodeInputs<'_> {
        DecodeInputs {
            q: &self.q,
            pool: &self.pool,
            candidates: &self.candidates,
            lengths: &self.lengths,
            positions: &self.positions,
            sinks: &self.sinks,
            freqs: &self.freqs,
        }
    }
}

/// One call of variant `v` on a fresh workspace for `plan` on the GPU's stream, output and workspace poisoned
/// (0xFF = NaN) first, so the result holds only what this call wrote.
pub fn run_poisoned(
    gpu: &Gpu,
    dp: &DeviceProblem,
    shape: &DecodeShape,
    plan: SplitPlan,
    v: Variant,
) -> Vec<bf16> {
    let (_arena, ws) = DecodeWorkspace::with_arena(gpu, shape, plan, v.staging()).unwrap();
    let stream = gpu.stream.clone();
    ws.poison(&stream).unwrap();
    let mut out = gpu
        .poisoned::<bf16>(shape.batch * shape.heads * HEAD_DIM, POISON)
        .unwrap();
    v.run(gpu, &stream, shape, &dp.inputs(), &ws, &mut out)
        .unwrap();
    gpu.download(&out).unwrap()
}

/// Run variant `v` on a host problem (plan: `tiles_per_split`, else the variant's own) and assert every output
/// element within tolerance of the CPU reference. Returns the output (f64) and the reference.
pub fn check_path(
    test: &str,
    gpu: &Gpu,
    hp: &HostProblem,
    v: Variant,
    tiles_per_split: Option<usize>,
) -> (Vec<f64>, reference::DecodeReference) {
    let shape = hp.shape();
    let plan = match tiles_per_split {
        Some(t) => SplitPlan::with_tiles_per_split(&shape, t).unwrap(),
        None => v.plan(gpu.info.sm_count as usize, &shape),
    };
    let dp = DeviceProblem::upload(gpu, hp);
    let got: Vec<f64> = run_poisoned(gpu, &dp, &shape, plan, v)
        .iter()
        .map(|x| x.to_f64())
        .collect();
    let r = hp.reference(v);
    let label = format!(
        "{test}: {v:?} shape {shape:?} lengths {:?} plan {plan:?}",
        hp.lengths
    );
    assert_within_reference(&label, &shape, &got, &r);
    (got, r)
}

/// Assert every output element is within `reference::tolerance` of the CPU reference (NaN, i.e. poison left in
/// place, counts as a mismatch); print the worst error / tolerance ratio, and on failure name the first mismatch.
pub fn assert_within_reference(
    label: &str,
    shape: &DecodeShape,
    got: &[f64],
    r: &reference::DecodeReference,
) {
    assert_eq!(got.len(), r.out.len(), "{label}: output length");
    let (mut worst_ratio, mut worst_i, mut max_abs) = (0f64, 0usize, 0f64);
    for (i, &g) in got.iter().enumerate() {
        let err = (g - r.out[i]).abs();
        let ratio = if g.is_finite() {
            err / reference::tolerance(r.mass[i], r.out[i])
        } else {
            f64::INFINITY
        };
        max_abs = max_abs.max(err);
        if ratio > worst_ratio || ratio.is_nan() {
            worst_ratio = if ratio.is_nan() { f64::INFINITY } else { ratio };
            worst_i = i;
        }
    }
    let (b, h, d) = (
        worst_i / (shape.heads * HEAD_DIM),
        (worst_i / HEAD_DIM) % shape.heads,
        worst_i % HEAD_DIM,
    );
    let first_bad = (0..got.len())
        // NaN (poison left in place) must count as a mismatch, hence "not within" rather than "above".
        .find(|&i| {
            let err = (got[i] - r.out[i]).abs();
            err.is_nan() || err > reference::tolerance(r.mass[i], r.out[i])
        });
    println!(
        "{label}: max abs err {max_abs:.3e}, worst err/tol {worst_ratio:.3} at (b {b}, h {h}, d {d}) gpu {} ref {}",
        got[worst_i], r.out[worst_i]
    );
    if let Some(i) = first_bad {
        panic!(
            "{label}: first mismatch at flat {i} (b {}, h {}, d {}): gpu {} ref {} tol {:.3e} (mass {:.3e})",
            i / (shape.heads * HEAD_DIM),
            (i / HEAD_DIM) % shape.heads,
            i % HEAD_DIM,
            got[i],
            r.out[i],
            reference::tolerance(r.mass[i], r.out[i]),
            r.mass[i]
        );
    }
}

/// [`assert_within_reference`] for a BF16 output.
pub fn assert_bf16_within_reference(
    label: &str,
    shape: &DecodeShape,
    got: &[bf16],
    r: &reference::DecodeReference,
) {
    let got: Vec<f64> = got.iter().map(|v| v.to_f64()).collect();
    assert_within_reference(label, shape, &got, r);
}

/// Assert two BF16 outputs are equal bit for bit; on failure name the first mismatch (b, h, d) with both values
/// and the mismatch count.
pub fn assert_same_bits(label: &str, shape: &DecodeShape, want: &[bf16], got: &[bf16]) {
    assert_eq!(want.len(), got.len(), "{label}: output lengths differ");
    let bad: Vec<usize> = (0..want.len())
        .filter(|&i| want[i].to_bits() != got[i].to_bits())
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{label}: {} of {} outputs differ from the expected bits; first at flat {i} (b {}, h {}, d {}): want {} \
             ({:#06x}) got {} ({:#06x})",
            bad.len(),
            want.len(),
            i / (shape.heads * HEAD_DIM),
            (i / HEAD_DIM) % shape.heads,
            i % HEAD_DIM,
            want[i],
            want[i].to_bits(),
            got[i],
            got[i].to_bits()
        );
    }
}
