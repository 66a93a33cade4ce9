//! The KV compressors (src/ops/compressor, kernels/compressor.cu) against the CPU model: the GPU state driven side
//! by side with `model::reference::CompressorState::push` over many positions, compared bit for bit after every
//! step (no sum is involved: rows are copies and one f32 add of the position bias); the pooled values of every
//! emission against `push`'s within the propagated exp bound (below); every emitted entry, decoded with `formats`,
//! exactly `Model::finalize_entry` of the GPU's own pooled values (the finalize is exact, see below); slots not
//! emitted stay poisoned; the capacity error bit; a captured step replayed with new positions; a chunk (the
//! chunked prefill) against the same tokens' decode steps, bit for bit. Weights (ape, norm, RoPE frequencies) are the synthetic small model's real compressor
//! weights; kv and gate are fresh random values.
//!
//! Tolerances. Pooling (`pool_softmax`) is the same sequence of f32 operations on both sides except exp: the
//! kernel rounds the f64 exp to f32 (correctly rounded but for a band of ~2^-29 ulp), the host calls glibc's expf
//! (a double evaluation with relative error 1.69 * 2^-34 before its final rounding, i.e. within ~2^-11 ulp), so an
//! exp differs (by 1 ulp) only where the exact value sits within ~2^-11 ulp of an f32 rounding midpoint: a
//! fraction ~2^-10 of the exps. Once one e differs, num and den differ by that term's ulp plus one rounding of
//! each later partial sum, each partial bounded by sum_s e_s |kv_s| <= den * max|kv|; so
//! |pooled_gpu - pooled_cpu| <= 2 n 2^-23 max|kv| + 2 ulp(pooled) for n sources (here n = coff*m rows, |kv| <= 1).
//! An absolute bound, not an ulp count: num can cancel (kv of both signs), so a 1-ulp term change can be many
//! ulps of a small pooled value. The channels that differ at all are counted and bounded by n 2^-8 of them (4x
//! the expected n 2^-10): a systematic difference (an FMA contraction, a wrong order) changes most channels.
//! The finalize (BF16, RMSNorm with the sum of squares in f64 -- exact for BF16 inputs unless the values span
//! more than ~2^18 in magnitude, and even then equal after the f32 rounding of inv except with probability
//! ~2^-29 --, RoPE with the shared f64-angle helper, FP8 / Hadamard + FP4) is compared exactly against the GPU's
//! pooled values, and against the CPU's pooled values where the two pooled vectors are equal.

mod common;

use common::{assert_bit_identical, POISON};
use cudarc::driver::CudaSlice;
use megamoe::gpu::{DevBuf, Gpu};
use megamoe::model::reference::CompressorState;
use megamoe::model::{CachePolicy, Model, ModelConfig, Weights};
use megamoe::ops::compressor::reference::{
    decode_stored, entry_bytes_at, expected_stored, host_state, layer_compressor, LayerCompressor,
};
use megamoe::ops::compressor::{
    self as cp, CompressorKind, CompressorWeights, DecodeIo, EntryCache, EntrySlots,
};
use megamoe::ops::indexer::{KeyCacheGpu, KeyFormat};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Layers of ModelConfig::small(): 2 is CSA (m = 4), 3 is HCA (m = 128).
const CSA_LAYER: usize = 2;
const HCA_LAYER: usize = 3;
/// Largest |kv| the tests draw (the pooled tolerance scales with it).
const KV_MAX: f32 = 1.0;

fn small_model(seed: u64) -> Model {
    Model::new(Weights::synthetic(ModelConfig::small(), seed, CachePolicy::All).unwrap()).unwrap()
}

fn ulps(a: f32, b: f32) -> u32 {
    if a == b {
        return 0;
    }
    let key = |x: f32| {
        let i = x.to_bits() as i32;
        if i < 0 {
            i32::MIN - i
        } else {
            i
        }
    };
    (key(a) as i64 - key(b) as i64)
        .unsigned_abs()
        .min(u32::MAX as u64) as u32
}

// ---- CPU: the glue ------------------------------------------------------------------------------------------

#[test]
fn layer_compressors_of_the_small_model() {
    let model = small_model(7);
    let csa = layer_compressor(&model, CSA_LAYER, CompressorKind::CsaMain).unwrap();
    assert_eq!(
        (csa.shape.ratio, csa.ape.len(), csa.norm.len()),
        (4, 4 * 1024, 512)
    );
    let idx =
        layer_compressor(&model, CSA_LAYER, CompressorKind::CsaIndex(KeyFormat::Fp8)).unwrap();
    assert_eq!(
        (idx.shape.ratio, idx.ape.len(), idx.norm.len()),
        (4, 4 * 256, 128)
    );
    let hca = layer_compressor(&model, HCA_LAYER, CompressorKind::HcaMain).unwrap();
    assert_eq!(
        (hca.shape.ratio, hca.ape.len(), hca.freqs.len()),
        (128, 128 * 512, 32)
    );
    assert!(layer_compressor(&model, 0, CompressorKind::HcaMain).is_err());
    assert!(layer_compressor(&model, HCA_LAYER, CompressorKind::CsaMain).is_err());
    assert!(layer_compressor(&model, CSA_LAYER, CompressorKind::HcaMain).is_err());
}

#[test]
fn finalized_entries_survive_their_cache_formats() {
    // finalize_entry's values are exactly representable in the KV entry and the MXFP4 key; the FP8 key is a
    // lossy re-encoding that expected_stored predicts.
    let model = small_model(11);
    let mut rng = common::seeded(
        "finalized_entries_survive_their_cache_formats",
        "COMPRESSOR_SEED",
    );
    for kind in [
        CompressorKind::CsaMain,
        CompressorKind::CsaIndex(KeyFormat::Mxfp4),
        CompressorKind::CsaIndex(KeyFormat::Fp8),
    ] {
        let lc = layer_compressor(&model, CSA_LAYER, kind).unwrap();
        let pooled: Vec<f32> = (0..kind.dim())
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let fin = model
            .finalize_entry(CSA_LAYER, lc.which, 3, &pooled)
            .unwrap();
        let bytes = match kind {
            CompressorKind::CsaIndex(KeyFormat::Fp8) => {
                megamoe::formats::indexer_key::encode_fp8(fin.as_slice().try_into().unwrap())
                    .unwrap()
                    .to_vec()
            }
            CompressorKind::CsaIndex(KeyFormat::Mxfp4) => {
                megamoe::formats::indexer_key::encode_mxfp4(fin.as_slice().try_into().unwrap())
                    .unwrap()
                    .to_vec()
            }
            _ => megamoe::formats::kv::encode_entry(fin.as_slice().try_into().unwrap())
                .unwrap()
                .to_vec(),
        };
        let got = decode_stored(kind, &bytes).unwrap();
        assert_bit_identical(
            kind.name(),
            "stored values",
            &expected_stored(kind, &fin).unwrap(),
            &got,
        );
    }
}

// ---- GPU fixture ----------------------------------------------------------------------------------------------

/// A poisoned entry cache of the compressor's kind: a KV pool or an indexer key cache of `batch * slots` entries.
struct TestCache {
    kind: CompressorKind,
    kv_pool: Option<CudaSlice<u8>>,
    keys: Option<KeyCacheGpu>,
}

impl TestCache {
    fn new(gpu: &Gpu, kind: CompressorKind, batch: usize, slots: usize) -> TestCache {
        let (kv_pool, keys) = match kind {
            CompressorKind::CsaIndex(f) => (
                None,
                Some(KeyCacheGpu::filled(gpu, f, batch, slots, POISON).unwrap()),
            ),
            _ => (
                Some(
                    gpu.poisoned::<u8>(batch * slots * kind.entry_bytes(), POISON)
                        .unwrap(),
                ),
                None,
            ),
        };
        TestCache {
            kind,
            kv_pool,
            keys,
        }
    }

    fn entry_cache(&self) -> EntryCache {
        match (&self.kv_pool, &self.keys) {
            (Some(p), _) => EntryCache::kv(p),
            (None, Some(k)) => EntryCache::index(k),
            _ => unreachable!(),
        }
    }

    /// The stored bytes of every slot.
    fn entries(&self, gpu: &Gpu) -> Vec<Vec<u8>> {
        let (codes, scales) = match (&self.kv_pool, &self.keys) {
            (Some(p), _) => (gpu.download(p).unwrap(), Vec::new()),
            (None, Some(k)) => (
                gpu.download(&k.codes).unwrap(),
                gpu.download(&k.scales).unwrap(),
            ),
            _ => unreachable!(),
        };
        let n = codes.len() / (self.kind.entry_bytes() - if self.keys.is_some() { 4 } else { 0 });
        (0..n)
            .map(|s| entry_bytes_at(self.kind, &codes, &scales, s))
            .collect()
    }

    /// Every slot not in `written` is still all poison.
    fn check_poisoned_except(&self, gpu: &Gpu, label: &str, written: &[usize]) {
        for (s, e) in self.entries(gpu).iter().enumerate() {
            if !written.contains(&s) {
                assert!(e.iter().all(|&x| x == POISON), "{label}: slot {s} written");
            }
        }
    }
}

/// The score row of token t (Model::compressor_inputs: the gate plus the position bias row t mod m).
fn score_row(lc: &LayerCompressor, gate: &[f32], t: usize) -> Vec<f32> {
    let (w, m) = (lc.shape.width(), lc.shape.ratio);
    (0..w).map(|c| gate[c] + lc.ape[(t % m) * w + c]).collect()
}

/// Pooled channels of entry j over `n` sources: within the propagated exp bound of the CPU's (module docs);
/// returns how many differ at all.
fn compare_pooled(label: &str, j: usize, n: usize, cpu: &[f32], gpu: &[f32]) -> usize {
    let abs_tol = 2.0 * n as f32 * KV_MAX * f32::EPSILON;
    let mut differ = 0;
    for (c, (&a, &b)) in cpu.iter().zip(gpu).enumerate() {
        assert!(
            (a - b).abs() <= abs_tol || ulps(a, b) <= 2,
            "{label}: entry {j} pooled[{c}] cpu {a} gpu {b} (tolerance {abs_tol} + 2 ulps)"
        );
        differ += (a.to_bits() != b.to_bits()) as usize;
    }
    differ
}

/// The stored entry j decodes to finalize_entry of the GPU's pooled values (and of the CPU's, when equal).
fn check_entry(
    label: &str,
    model: &Model,
    layer: usize,
    lc: &LayerCompressor,
    j: usize,
    pooled: (&[f32], &[f32]),
    stored: &[u8],
) {
    let (cpu, gpu) = pooled;
    let kind = lc.shape.kind;
    let fin = model.finalize_entry(layer, lc.which, j, gpu).unwrap();
    let got = decode_stored(kind, stored).unwrap();
    assert_bit_identical(
        label,
        &format!("entry {j}"),
        &expected_stored(kind, &fin).unwrap(),
        &got,
    );
    if cpu == gpu {
        assert_eq!(
            model.finalize_entry(layer, lc.which, j, cpu).unwrap(),
            fin,
            "{label}: entry {j}"
        );
    }
}

fn assert_pooled_fraction(label: &str, n: usize, differ: usize, compared: usize) {
    println!(
        "{label}: {differ} of {compared} pooled channels differ from the CPU ({n} sources each)"
    );
    let allowed = (n as f64 / 256.0).min(1.0);
    assert!(
        differ as f64 <= allowed * compared as f64,
        "{label}: {differ} of {compared} pooled channels differ (allowed fraction {allowed})"
    );
}

/// The device side of `batch` sequences of one compressor, with the CPU states beside it.
struct Rig {
    model: Model,
    layer: usize,
    lc: LayerCompressor,
    w: CompressorWeights,
    batch: usize,
    /// Entry slots per sequence in the cache (base[b] = b * slots_per_seq).
    slots_per_seq: usize,
    kv: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    positions: CudaSlice<i32>,
    state: CudaSlice<f32>,
    base: CudaSlice<i32>,
    capacity: CudaSlice<i32>,
    caps: Vec<i32>,
    pooled: CudaSlice<f32>,
    error: CudaSlice<u32>,
    cache: TestCache,
    cpu: Vec<CompressorState>,
    /// Sequences whose state was poisoned and must stay so (always at position -1).
    idle: Vec<bool>,
    /// Slots of every entry emitted within capacity.
    written: Vec<usize>,
    pooled_compared: usize,
    pooled_differ: usize,
}

impl Rig {
    fn new(
        gpu: &Gpu,
        model: Model,
        layer: usize,
        kind: CompressorKind,
        caps: &[i32],
        idle: &[bool],
    ) -> Rig {
        let lc = layer_compressor(&model, layer, kind).unwrap();
        let shape = lc.shape;
        let w =
            CompressorWeights::upload(gpu, &shape, &lc.ape, &lc.norm, &lc.freqs, lc.eps).unwrap();
        let batch = caps.len();
        let slots_per_seq = *caps.iter().max().unwrap() as usize + 1;
        let cpu: Vec<CompressorState> = (0..batch)
            .map(|_| CompressorState::new(shape.ratio, kind.overlap(), kind.dim()))
            .collect();
        let mut st = Vec::with_capacity(batch * shape.state_floats());
        for (b, s) in cpu.iter().enumerate() {
            if idle[b] {
                st.extend(std::iter::repeat_n(
                    f32::from_bits(0xFFFF_FFFF),
                    shape.state_floats(),
                ));
            } else {
                st.extend(host_state(s));
            }
        }
        Rig {
            layer,
            w,
            batch,
            slots_per_seq,
            kv: gpu.poisoned(batch * shape.width(), POISON).unwrap(),
            gate: gpu.poisoned(batch * shape.width(), POISON).unwrap(),
            positions: gpu.poisoned(batch, POISON).unwrap(),
            state: gpu.upload(&st).unwrap(),
            base: gpu
                .upload(
                    &(0..batch)
                        .map(|b| (b * slots_per_seq) as i32)
                        .collect::<Vec<_>>(),
                )
                .unwrap(),
            capacity: gpu.upload(caps).unwrap(),
            caps: caps.to_vec(),
            pooled: gpu.poisoned(batch * shape.dim(), POISON).unwrap(),
            error: gpu.poisoned(1, 0).unwrap(),
            cache: TestCache::new(gpu, kind, batch, slots_per_seq),
            cpu,
            idle: idle.to_vec(),
            written: Vec::new(),
            pooled_compared: 0,
            pooled_differ: 0,
            model,
            lc,
        }
    }

    /// (W, m, d, state floats per sequence).
    fn dims(&self) -> (usize, usize, usize, usize) {
        let s = self.lc.shape;
        (s.width(), s.ratio, s.dim(), s.state_floats())
    }

    fn io(&self) -> DecodeIo {
        DecodeIo {
            batch: self.batch,
            kv: DevBuf::of(&self.kv),
            gate: DevBuf::of(&self.gate),
            positions: DevBuf::of(&self.positions),
            state: DevBuf::of(&self.state),
            slots: EntrySlots {
                base: DevBuf::of(&self.base),
                capacity: DevBuf::of(&self.capacity),
            },
            cache: self.cache.entry_cache(),
            pooled: Some(DevBuf::of(&self.pooled)),
            error: DevBuf::of(&self.error),
        }
    }

    /// Fresh kv / gate rows and the positions, written into the device buffers on the GPU's stream; returns them.
    fn write_inputs(
        &mut self,
        gpu: &Gpu,
        rng: &mut ChaCha8Rng,
        pos: &[i32],
    ) -> (Vec<f32>, Vec<f32>) {
        let n = self.batch * self.lc.shape.width();
        let kv: Vec<f32> = (0..n).map(|_| rng.random_range(-KV_MAX..KV_MAX)).collect();
        let gate: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        gpu.write(&gpu.stream, &mut self.kv, &kv).unwrap();
        gpu.write(&gpu.stream, &mut self.gate, &gate).unwrap();
        gpu.write(&gpu.stream, &mut self.positions, pos).unwrap();
        (kv, gate)
    }

    /// The CPU side of the step just run on the GPU, and every comparison.
    fn check_step(
        &mut self,
        gpu: &Gpu,
        label: &str,
        pos: &[i32],
        kv: &[f32],
        gate: &[f32],
        err_before: u32,
    ) {
        let shape = self.lc.shape;
        let (w, m, d, sf) = self.dims();
        let state = gpu.download(&self.state).unwrap();
        let pooled = gpu.download(&self.pooled).unwrap();
        let entries = self.cache.entries(gpu);
        let mut err_want = err_before;
        for (b, &t) in pos.iter().enumerate() {
            let got_state = &state[b * sf..(b + 1) * sf];
            if self.idle[b] {
                assert!(t < 0);
                assert!(
                    got_state.iter().all(|v| v.to_bits() == 0xFFFF_FFFF),
                    "{label}: idle state written"
                );
                continue;
            }
            if t >= 0 {
                let t = t as usize;
                let g = score_row(&self.lc, &gate[b * w..(b + 1) * w], t);
                if let Some(cpu_pooled) = self.cpu[b].push(t, &kv[b * w..(b + 1) * w], &g) {
                    let j = (t + 1) / m - 1;
                    let gp = &pooled[b * d..(b + 1) * d];
                    let label = format!("{label} seq {b}");
                    self.pooled_differ += compare_pooled(&label, j, shape.rows(), &cpu_pooled, gp);
                    self.pooled_compared += d;
                    if j < self.caps[b] as usize {
                        let slot = b * self.slots_per_seq + j;
                        self.written.push(slot);
                        check_entry(
                            &label,
                            &self.model,
                            self.layer,
                            &self.lc,
                            j,
                            (&cpu_pooled, gp),
                            &entries[slot],
                        );
                    } else {
                        err_want = 1;
                    }
                }
            }
            assert_bit_identical(
                label,
                &format!("seq {b} state after t {t}"),
                &host_state(&self.cpu[b]),
                got_state,
            );
        }
        let err = gpu.download(&self.error).unwrap()[0];
        assert_eq!(err, err_want, "{label}: error word");
    }
}

/// Drive `steps` decode steps: sequence b, given as (start step, capacity), is at position step - start (before its
/// start: an empty row, -1; start `i32::MAX`: idle, always -1, its state poisoned). With `graph`, one step is captured and
/// replayed with the new inputs and positions written between replays.
fn run_decode(
    label: &str,
    layer: usize,
    kind: CompressorKind,
    seqs: &[(i32, i32)],
    steps: i32,
    graph: bool,
) {
    let gpu = common::gpu(label);
    let mut rng = common::seeded(label, "COMPRESSOR_SEED");
    let caps: Vec<i32> = seqs.iter().map(|s| s.1).collect();
    let idle: Vec<bool> = seqs.iter().map(|s| s.0 == i32::MAX).collect();
    let mut rig = Rig::new(&gpu, small_model(rng.random()), layer, kind, &caps, &idle);
    let shape = rig.lc.shape;
    let positions_at = |step: i32| -> Vec<i32> {
        seqs.iter()
            .map(|&(s, _)| {
                if s == i32::MAX {
                    -1
                } else {
                    let t = step - s;
                    if t < 0 {
                        -1
                    } else {
                        t
                    }
                }
            })
            .collect()
    };
    let cuda_graph = if graph {
        // Resolve the kernel with a plain call on empty rows first (nothing changes), then capture.
        let pos = vec![-1; rig.batch];
        rig.write_inputs(&gpu, &mut rng, &pos);
        cp::decode_step(&gpu, &gpu.stream, &shape, &rig.w, &rig.io()).unwrap();
        let io = rig.io();
        let w = &rig.w;
        Some(
            gpu.capture(|| cp::decode_step(&gpu, &gpu.stream, &shape, w, &io))
                .unwrap(),
        )
    } else {
        None
    };
    let mut err = gpu.download(&rig.error).unwrap()[0];
    for step in 0..steps {
        let pos = positions_at(step);
        let (kv, gate) = rig.write_inputs(&gpu, &mut rng, &pos);
        match &cuda_graph {
            Some(g) => g.launch().unwrap(),
            None => cp::decode_step(&gpu, &gpu.stream, &shape, &rig.w, &rig.io()).unwrap(),
        }
        gpu.synchronize().unwrap();
        rig.check_step(&gpu, &format!("{label} step {step}"), &pos, &kv, &gate, err);
        err = gpu.download(&rig.error).unwrap()[0];
    }
    rig.cache.check_poisoned_except(&gpu, label, &rig.written);
    assert_pooled_fraction(label, shape.rows(), rig.pooled_differ, rig.pooled_compared);
}

// ---- GPU: decode ------------------------------------------------------------------------------------------------

/// CSA (m = 4), (start step, capacity) per sequence: sequence 0 covers t = 0 ..= 4m-1 (four emissions, capacity
/// 4); sequence 1 starts 2 steps later (empty rows first) with capacity 2, so its third entry sets the error bit
/// and writes nothing; sequence 2 stays idle with a poisoned state.
const CSA_SEQS: [(i32, i32); 3] = [(0, 4), (2, 2), (i32::MAX, 3)];
const CSA_STEPS: i32 = 4 * 4;

fn csa_decode(label: &str, kind: CompressorKind, graph: bool) {
    run_decode(label, CSA_LAYER, kind, &CSA_SEQS, CSA_STEPS, graph);
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_csa_main_matches_cpu_state_and_entries() {
    csa_decode("gpu_decode_csa_main", CompressorKind::CsaMain, false);
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_csa_index_fp8_matches_cpu_state_and_keys() {
    csa_decode(
        "gpu_decode_csa_index_fp8",
        CompressorKind::CsaIndex(KeyFormat::Fp8),
        false,
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_csa_index_mxfp4_matches_cpu_state_and_keys() {
    csa_decode(
        "gpu_decode_csa_index_mxfp4",
        CompressorKind::CsaIndex(KeyFormat::Mxfp4),
        false,
    );
}

/// HCA (m = 128) across two emissions and one token past them: t = 0 ..= 2m + 6 for sequence 0 (capacity 2);
/// sequence 1 starts 5 steps later with capacity 1 (its second emission is refused).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_hca_main_matches_cpu_across_two_emissions() {
    run_decode(
        "gpu_decode_hca_main",
        HCA_LAYER,
        CompressorKind::HcaMain,
        &[(0, 2), (5, 1)],
        2 * 128 + 7,
        false,
    );
}

/// One captured decode step replayed with new kv / gate / positions written between replays.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_graph_replays_with_new_positions() {
    csa_decode("gpu_decode_graph", CompressorKind::CsaMain, true);
}

/// The cluster decode kernel (`decode_step`: d / 64 CTAs per sequence, rank 0 finalizes) against the former
/// one-CTA kernel (`DecodeGrid::OneCta`), bit for bit: two rigs with the same model and the same inputs at every
/// step, compared after every step on the whole state, the pooled probe, every cache slot and the error word.
/// Exact equality is the criterion: the cluster kernel does pool_channel's f32 operations in pool_channel's order
/// (kernels/compressor.cu, decode_body), and the finalize is the same code on the same pooled row. Sequences: five
/// at staggered starts (so emissions of different sequences land on different steps and a step mixes emitting and
/// updating sequences), one idle (position -1, poisoned state), one whose capacity refuses its later entries. Every
/// kind; CSA over 6 blocks, HCA over two emissions and a few tokens past them.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_cluster_equals_one_cta_kernel_bitwise() {
    let label = "gpu_decode_cluster_equals_one_cta_kernel_bitwise";
    let gpu = common::gpu(label);
    let mut rng = common::seeded(label, "COMPRESSOR_SEED");
    let model_seed: u64 = rng.random();
    let seqs: [(i32, i32); 6] = [(0, 8), (1, 1), (2, 8), (3, 8), (i32::MAX, 2), (5, 8)];
    let caps: Vec<i32> = seqs.iter().map(|s| s.1).collect();
    let idle: Vec<bool> = seqs.iter().map(|s| s.0 == i32::MAX).collect();
    for (layer, kind, steps) in [
        (CSA_LAYER, CompressorKind::CsaMain, 6 * 4 + 5),
        (
            CSA_LAYER,
            CompressorKind::CsaIndex(KeyFormat::Fp8),
            6 * 4 + 5,
        ),
        (
            CSA_LAYER,
            CompressorKind::CsaIndex(KeyFormat::Mxfp4),
            6 * 4 + 5,
        ),
        (HCA_LAYER, CompressorKind::HcaMain, 2 * 128 + 7),
    ] {
        let label = format!("{label} {kind:?}");
        let mut a = Rig::new(&gpu, small_model(model_seed), layer, kind, &caps, &idle);
        let mut b = Rig::new(&gpu, small_model(model_seed), layer, kind, &caps, &idle);
        let shape = a.lc.shape;
        let mut emitted = 0usize;
        for step in 0..steps {
            let pos: Vec<i32> = seqs
                .iter()
                .map(|&(s, _)| {
                    if s == i32::MAX || step < s {
                        -1
                    } else {
                        step - s
                    }
                })
                .collect();
            let (kv, gate) = a.write_inputs(&gpu, &mut rng, &pos);
            gpu.write(&gpu.stream, &mut b.kv, &kv).unwrap();
            gpu.write(&gpu.stream, &mut b.gate, &gate).unwrap();
            gpu.write(&gpu.stream, &mut b.positions, &pos).unwrap();
            cp::decode_step(&gpu, &gpu.stream, &shape, &a.w, &a.io()).unwrap();
            cp::decode_step_with(
                &gpu,
                &gpu.stream,
                &shape,
                &b.w,
                &b.io(),
                cp::DecodeGrid::OneCta,
            )
            .unwrap();
            gpu.synchronize().unwrap();
            let at = format!("step {step}");
            let (sa, sb) = (
                gpu.download(&a.state).unwrap(),
                gpu.download(&b.state).unwrap(),
            );
            assert_bit_identical(&label, &format!("{at} state"), &sb, &sa);
            let (pa, pb) = (
                gpu.download(&a.pooled).unwrap(),
                gpu.download(&b.pooled).unwrap(),
            );
            assert_bit_identical(&label, &format!("{at} pooled"), &pb, &pa);
            let (ea, eb) = (a.cache.entries(&gpu), b.cache.entries(&gpu));
            for (slot, (x, y)) in ea.iter().zip(&eb).enumerate() {
                assert_bit_identical(&label, &format!("{at} slot {slot}"), y, x);
            }
            let (era, erb) = (
                gpu.download(&a.error).unwrap()[0],
                gpu.download(&b.error).unwrap()[0],
            );
            assert_eq!(era, erb, "{label}: {at} error word");
            emitted += pos
                .iter()
                .filter(|&&t| t >= 0 && (t as usize + 1).is_multiple_of(shape.ratio))
                .count();
        }
        assert!(emitted > 0, "{label}: no emission was compared");
        eprintln!(
            "{label}: {steps} steps, {emitted} emissions, bit-identical to the one-CTA kernel"
        );
    }
}

// ---- GPU: a chunk continuing a sequence (the engine's chunked prefill) ------------------------------------------

/// `compressor::chunk` against the decode step, bit for bit: one sequence driven token by token through
/// `decode_step` (rig a) and through chunks of random lengths (rig b, 1 ..= 2m + 5 tokens for CSA, 1 ..= 150 for HCA:
/// chunks inside one block, ending on a block edge, spanning several) at the same positions with the same inputs;
/// after every chunk the states, every cache slot and the error words equal exactly (the chunk's contract: the same
/// pooling in the same order, copies for the state). Unwritten slots stay poisoned on both sides.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_chunk_equals_decode_steps_bitwise() {
    let label = "gpu_chunk_equals_decode_steps_bitwise";
    let gpu = common::gpu(label);
    let mut rng = common::seeded(label, "COMPRESSOR_SEED");
    let model_seed: u64 = rng.random();
    for (layer, kind, tokens, longest) in [
        (CSA_LAYER, CompressorKind::CsaMain, 4 * 13 + 3, 13),
        (
            CSA_LAYER,
            CompressorKind::CsaIndex(KeyFormat::Fp8),
            4 * 13 + 3,
            13,
        ),
        (
            CSA_LAYER,
            CompressorKind::CsaIndex(KeyFormat::Mxfp4),
            4 * 13 + 3,
            13,
        ),
        (HCA_LAYER, CompressorKind::HcaMain, 3 * 128 + 37, 150),
    ] {
        let label = format!("{label} {kind:?}");
        let caps = [(tokens / 4 + 2) as i32];
        let mut a = Rig::new(&gpu, small_model(model_seed), layer, kind, &caps, &[false]);
        let b = Rig::new(&gpu, small_model(model_seed), layer, kind, &caps, &[false]);
        let shape = a.lc.shape;
        let w = shape.width();
        let mut p0 = 0usize;
        let mut chunks = 0usize;
        while p0 < tokens {
            let n = rng.random_range(1..=longest).min(tokens - p0);
            let kv: Vec<f32> = (0..n * w)
                .map(|_| rng.random_range(-KV_MAX..KV_MAX))
                .collect();
            let gate: Vec<f32> = (0..n * w).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            for i in 0..n {
                gpu.write(&gpu.stream, &mut a.kv, &kv[i * w..(i + 1) * w])
                    .unwrap();
                gpu.write(&gpu.stream, &mut a.gate, &gate[i * w..(i + 1) * w])
                    .unwrap();
                gpu.write(&gpu.stream, &mut a.positions, &[(p0 + i) as i32])
                    .unwrap();
                cp::decode_step(&gpu, &gpu.stream, &shape, &a.w, &a.io()).unwrap();
            }
            // The chunk's inputs, padded with poisoned rows that it must not read.
            let rows = n + 3;
            let mut ckv = gpu.poisoned::<f32>(rows * w, POISON).unwrap();
            let mut cgate = gpu.poisoned::<f32>(rows * w, POISON).unwrap();
            gpu.write(&gpu.stream, &mut ckv, &kv).unwrap();
            gpu.write(&gpu.stream, &mut cgate, &gate).unwrap();
            let pos: Vec<i32> = (0..rows).map(|i| (p0 + i.min(n - 1)) as i32).collect();
            let cpos = gpu.upload(&pos).unwrap();
            let io = cp::ChunkIo {
                n,
                kv: DevBuf::of(&ckv),
                gate: DevBuf::of(&cgate),
                positions: DevBuf::of(&cpos),
                state: DevBuf::of(&b.state),
                slots: EntrySlots {
                    base: DevBuf::of(&b.base),
                    capacity: DevBuf::of(&b.capacity),
                },
                cache: b.cache.entry_cache(),
                error: DevBuf::of(&b.error),
            };
            cp::chunk(&gpu, &gpu.stream, &shape, &b.w, &io).unwrap();
            gpu.synchronize().unwrap();
            let at = format!("chunk {chunks} ({p0}+{n})");
            let (sa, sb) = (
                gpu.download(&a.state).unwrap(),
                gpu.download(&b.state).unwrap(),
            );
            assert_bit_identical(&label, &format!("{at} state"), &sb, &sa);
            let (ea, eb) = (a.cache.entries(&gpu), b.cache.entries(&gpu));
            for (slot, (x, y)) in ea.iter().zip(&eb).enumerate() {
                assert_bit_identical(&label, &format!("{at} slot {slot}"), y, x);
            }
            assert_eq!(
                gpu.download(&a.error).unwrap()[0],
                gpu.download(&b.error).unwrap()[0],
                "{label}: {at} error word"
            );
            p0 += n;
            chunks += 1;
        }
        eprintln!(
            "{label}: {tokens} tokens in {chunks} chunks, {} entries: states and caches bit-identical to the decode \
             steps'",
            tokens / shape.ratio
        );
    }
}

/// The routed decode grid: clusters while `batch x d / 64` CTAs fit in one wave of the SMs, one CTA a sequence
/// beyond (132 SMs: the main compressors, d = 512, take clusters up to batch 16; the indexer's, d = 128, up to 66).
#[test]
fn decode_grid_takes_clusters_while_they_fit_one_wave() {
    use megamoe::ops::compressor::DecodeGrid;
    assert_eq!(DecodeGrid::for_batch(1, 512, 132), DecodeGrid::Cluster);
    assert_eq!(DecodeGrid::for_batch(8, 512, 132), DecodeGrid::Cluster);
    assert_eq!(DecodeGrid::for_batch(16, 512, 132), DecodeGrid::Cluster);
    assert_eq!(DecodeGrid::for_batch(17, 512, 132), DecodeGrid::OneCta);
    assert_eq!(DecodeGrid::for_batch(64, 512, 132), DecodeGrid::OneCta);
    assert_eq!(DecodeGrid::for_batch(64, 128, 132), DecodeGrid::Cluster);
    assert_eq!(DecodeGrid::for_batch(67, 128, 132), DecodeGrid::OneCta);
}
