//! The KV compressors (src/ops/compressor, kernels/compressor.cu) against the CPU model: the GPU state driven side
//! by side with `model::reference::CompressorState::push` over many positions, compared bit for bit after every
//! step (no sum is involved: rows are copies and one f32 add of the position bias); the pooled values of every
//! emission against `push`'s within a few ulps (tolerance below); every emitted entry, decoded with `formats`,
//! exactly `Model::finalize_entry` of the GPU's own pooled values (the finalize is exact, see below); slots not
//! emitted stay poisoned; the capacity error bit; a captured step replayed with new positions; prefill against
//! the same pushes. Weights (ape, norm, RoPE frequencies) are the synthetic small model's real compressor
//! weights; kv and gate are fresh random values.
//!
//! Tolerances. Pooling (`pool_softmax`) is the same sequence of f32 operations on both sides except exp: the
//! kernel rounds the f64 exp to f32, the host calls expf (glibc, < 0.502 ulp); they differ only where the exact
//! value sits within ~0.002 ulp of an f32 rounding boundary, i.e. in a small fraction of the exps. One differing
//! exp (1 ulp) moves num and den by at most 1 ulp of a term each, so a pooled value moves by a few ulps: the bound
//! is 8 ulps, and at most 2% of the pooled channels may differ at all (counted and printed). The finalize
//! (BF16, RMSNorm with the sum of squares in f64 -- exact for BF16 inputs unless the values span more than
//! ~2^18 in magnitude, and even then equal after the f32 rounding of inv except with probability ~2^-29 --,
//! RoPE with the shared f64-angle helper, FP8 / Hadamard + FP4) is compared exactly against the GPU's pooled
//! values, and the entry against the CPU's pooled values where the two pooled vectors are equal.

mod common;

use common::{assert_bit_identical, POISON};
use cudarc::driver::CudaSlice;
use megamoe::gpu::Gpu;
use megamoe::model::reference::CompressorState;
use megamoe::model::{CachePolicy, Model, ModelConfig, Weights};
use megamoe::ops::compressor::reference::{
    decode_stored, entry_bytes_at, expected_stored, host_state, layer_compressor, LayerCompressor,
};
use megamoe::ops::compressor::{
    self as cp, dev, CompressorKind, CompressorWeights, DecodeIo, EntryCache, EntrySlots, PrefillIo,
};
use megamoe::ops::indexer::{KeyCacheGpu, KeyFormat};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Layers of ModelConfig::small(): 2 is CSA (m = 4), 3 is HCA (m = 128).
const CSA_LAYER: usize = 2;
const HCA_LAYER: usize = 3;
const POOLED_ULPS: u32 = 8;
const POOLED_DIFF_FRACTION: f64 = 0.02;

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
    kv_pool: Option<CudaSlice<u8>>,
    keys: Option<KeyCacheGpu>,
    cpu: Vec<CompressorState>,
    /// Sequences whose state was poisoned and must stay so (always at position -1).
    idle: Vec<bool>,
    /// (sequence, j) of every entry emitted within capacity.
    emitted: Vec<(usize, usize)>,
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
        let (kv_pool, keys) = match kind {
            CompressorKind::CsaIndex(f) => (
                None,
                Some(KeyCacheGpu::filled(gpu, f, batch, slots_per_seq, POISON).unwrap()),
            ),
            _ => (
                Some(
                    gpu.poisoned::<u8>(batch * slots_per_seq * kind.entry_bytes(), POISON)
                        .unwrap(),
                ),
                None,
            ),
        };
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
            kv_pool,
            keys,
            cpu,
            idle: idle.to_vec(),
            emitted: Vec::new(),
            pooled_compared: 0,
            pooled_differ: 0,
            model,
            lc,
        }
    }

    fn cache(&self) -> EntryCache {
        match (&self.kv_pool, &self.keys) {
            (Some(p), _) => EntryCache::kv(p),
            (None, Some(k)) => EntryCache::index(k),
            _ => unreachable!(),
        }
    }

    fn io(&self) -> DecodeIo {
        DecodeIo {
            batch: self.batch,
            kv: dev(&self.kv),
            gate: dev(&self.gate),
            positions: dev(&self.positions),
            state: dev(&self.state),
            slots: EntrySlots {
                base: dev(&self.base),
                capacity: dev(&self.capacity),
            },
            cache: self.cache(),
            pooled: Some(dev(&self.pooled)),
            error: dev(&self.error),
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
        let kv: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
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
        let (w, m, d) = (shape.width(), shape.ratio, shape.dim());
        let state = gpu.download(&self.state).unwrap();
        let pooled = gpu.download(&self.pooled).unwrap();
        let mut err_want = err_before;
        for b in 0..self.batch {
            let t = pos[b];
            let sf = shape.state_floats();
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
                // The score is the gate plus the position bias row t mod m (Model::compressor_inputs).
                let g: Vec<f32> = (0..w)
                    .map(|c| gate[b * w + c] + self.lc.ape[(t % m) * w + c])
                    .collect();
                if let Some(cpu_pooled) = self.cpu[b].push(t, &kv[b * w..(b + 1) * w], &g) {
                    let j = (t + 1) / m - 1;
                    let gp = &pooled[b * d..(b + 1) * d];
                    let mut differ = 0;
                    for c in 0..d {
                        let u = ulps(cpu_pooled[c], gp[c]);
                        assert!(
                            u <= POOLED_ULPS,
                            "{label}: seq {b} t {t} pooled[{c}] cpu {} gpu {} ({u} ulps)",
                            cpu_pooled[c],
                            gp[c]
                        );
                        differ += (u > 0) as usize;
                    }
                    self.pooled_compared += d;
                    self.pooled_differ += differ;
                    if j < self.caps[b] as usize {
                        self.emitted.push((b, j));
                        let fin = self
                            .model
                            .finalize_entry(self.layer, self.lc.which, j, gp)
                            .unwrap();
                        let want = expected_stored(shape.kind, &fin).unwrap();
                        let got =
                            decode_stored(shape.kind, &self.entry(gpu, b * self.slots_per_seq + j))
                                .unwrap();
                        assert_bit_identical(label, &format!("seq {b} entry {j}"), &want, &got);
                        if differ == 0 {
                            let fin_cpu = self
                                .model
                                .finalize_entry(self.layer, self.lc.which, j, &cpu_pooled)
                                .unwrap();
                            assert_eq!(fin_cpu, fin);
                        }
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

    fn entry(&self, gpu: &Gpu, slot: usize) -> Vec<u8> {
        let kind = self.lc.shape.kind;
        match (&self.kv_pool, &self.keys) {
            (Some(p), _) => entry_bytes_at(kind, &gpu.download(p).unwrap(), &[], slot),
            (None, Some(k)) => entry_bytes_at(
                kind,
                &gpu.download(&k.codes).unwrap(),
                &gpu.download(&k.scales).unwrap(),
                slot,
            ),
            _ => unreachable!(),
        }
    }

    /// Every slot no emission wrote is still all poison.
    fn check_unwritten_poisoned(&self, gpu: &Gpu, label: &str) {
        for b in 0..self.batch {
            for j in 0..self.slots_per_seq {
                if self.emitted.contains(&(b, j)) {
                    continue;
                }
                let e = self.entry(gpu, b * self.slots_per_seq + j);
                assert!(
                    e.iter().all(|&x| x == POISON),
                    "{label}: slot of seq {b} entry {j} written"
                );
            }
        }
    }

    fn check_pooled_fraction(&self, label: &str) {
        let frac = self.pooled_differ as f64 / self.pooled_compared.max(1) as f64;
        println!(
            "{label}: {} of {} pooled channels differ from the CPU (<= {POOLED_ULPS} ulps)",
            self.pooled_differ, self.pooled_compared
        );
        assert!(self.pooled_compared > 0, "{label}: nothing emitted");
        assert!(
            frac <= POOLED_DIFF_FRACTION,
            "{label}: {frac} of the pooled channels differ"
        );
    }
}

/// Drive `steps` decode steps: sequence b is at position step - start[b] (negative: an empty row), idle
/// sequences always at -1. With `graph`, one step is captured and replayed with the new inputs and positions.
fn run_decode(
    label: &str,
    layer: usize,
    kind: CompressorKind,
    caps: &[i32],
    start: &[i32],
    steps: i32,
    graph: bool,
) {
    let gpu = common::gpu(label);
    let mut rng = common::seeded(label, "COMPRESSOR_SEED");
    let idle: Vec<bool> = start.iter().map(|&s| s == i32::MAX).collect();
    let mut rig = Rig::new(&gpu, small_model(rng.random()), layer, kind, caps, &idle);
    let shape = rig.lc.shape;
    let positions_at = |step: i32| -> Vec<i32> {
        start
            .iter()
            .map(|&s| {
                if s == i32::MAX {
                    -1
                } else {
                    (step - s).max(-1)
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
    let mut err = 0;
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
    rig.check_unwritten_poisoned(&gpu, label);
    rig.check_pooled_fraction(label);
}

// ---- GPU: decode ------------------------------------------------------------------------------------------------

/// CSA (m = 4): sequence 0 covers t = 0 ..= 4m-1 (four emissions, capacity 4) from step 0; sequence 1 starts 2
/// steps later (empty rows first) with capacity 2, so its third entry sets the error bit and writes nothing;
/// sequence 2 stays idle with a poisoned state.
const CSA_CAPS: [i32; 3] = [4, 2, 3];
const CSA_START: [i32; 3] = [0, 2, i32::MAX];
const CSA_STEPS: i32 = 4 * 4;

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_csa_main_matches_cpu_state_and_entries() {
    run_decode(
        "gpu_decode_csa_main",
        CSA_LAYER,
        CompressorKind::CsaMain,
        &CSA_CAPS,
        &CSA_START,
        CSA_STEPS,
        false,
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_csa_index_fp8_matches_cpu_state_and_keys() {
    run_decode(
        "gpu_decode_csa_index_fp8",
        CSA_LAYER,
        CompressorKind::CsaIndex(KeyFormat::Fp8),
        &CSA_CAPS,
        &CSA_START,
        CSA_STEPS,
        false,
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_csa_index_mxfp4_matches_cpu_state_and_keys() {
    run_decode(
        "gpu_decode_csa_index_mxfp4",
        CSA_LAYER,
        CompressorKind::CsaIndex(KeyFormat::Mxfp4),
        &CSA_CAPS,
        &CSA_START,
        CSA_STEPS,
        false,
    );
}

/// HCA (m = 128) across two emissions and one token past them: t = 0 ..= 2m + 1 for sequence 0; sequence 1
/// starts 5 steps later with capacity 1 (its second emission is refused).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_hca_main_matches_cpu_across_two_emissions() {
    run_decode(
        "gpu_decode_hca_main",
        HCA_LAYER,
        CompressorKind::HcaMain,
        &[2, 1],
        &[0, 5],
        2 * 128 + 2 + 5,
        false,
    );
}

/// One captured decode step replayed with new kv / gate / positions written between replays.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_graph_replays_with_new_positions() {
    run_decode(
        "gpu_decode_graph",
        CSA_LAYER,
        CompressorKind::CsaMain,
        &CSA_CAPS,
        &CSA_START,
        CSA_STEPS,
        true,
    );
}

// ---- GPU: prefill -------------------------------------------------------------------------------------------------

/// Prefill of n tokens against n CPU pushes (Model::prefill's state equals n decode steps'): every block's entry
/// and pooled values, the seeded state, the error bit past capacity, unwritten slots poisoned.
fn run_prefill(label: &str, layer: usize, kind: CompressorKind, n: usize, cap: usize) {
    let gpu = common::gpu(label);
    let mut rng = common::seeded(label, "COMPRESSOR_SEED");
    let model = small_model(rng.random());
    let lc = layer_compressor(&model, layer, kind).unwrap();
    let shape = lc.shape;
    let (w, m, d) = (shape.width(), shape.ratio, shape.dim());
    let wts =
        CompressorWeights::upload(&gpu, &shape, &lc.ape, &lc.norm, &lc.freqs, lc.eps).unwrap();
    let max_tokens = n + m; // a token capacity above n: the device count decides
    let kv: Vec<f32> = (0..max_tokens * w)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let gate: Vec<f32> = (0..max_tokens * w)
        .map(|_| rng.random_range(-3.0f32..3.0))
        .collect();
    let blocks_cap = max_tokens / m;
    let slots = blocks_cap + 1;
    let (kv_pool, keys) = match kind {
        CompressorKind::CsaIndex(f) => (
            None,
            Some(KeyCacheGpu::filled(&gpu, f, 1, slots, POISON).unwrap()),
        ),
        _ => (
            Some(
                gpu.poisoned::<u8>(slots * kind.entry_bytes(), POISON)
                    .unwrap(),
            ),
            None,
        ),
    };
    let cache = match (&kv_pool, &keys) {
        (Some(p), _) => EntryCache::kv(p),
        (None, Some(k)) => EntryCache::index(k),
        _ => unreachable!(),
    };
    let kv_d = gpu.upload(&kv).unwrap();
    let gate_d = gpu.upload(&gate).unwrap();
    let n_d = gpu.upload(&[n as i32]).unwrap();
    let state = gpu.poisoned::<f32>(shape.state_floats(), POISON).unwrap();
    let base = gpu.upload(&[1i32]).unwrap(); // entries from slot 1: slot 0 must stay poisoned
    let capacity = gpu.upload(&[cap as i32]).unwrap();
    let pooled = gpu.poisoned::<f32>(blocks_cap * d, POISON).unwrap();
    let error = gpu.poisoned::<u32>(1, 0).unwrap();
    let io = PrefillIo {
        max_tokens,
        kv: dev(&kv_d),
        gate: dev(&gate_d),
        n_tokens: dev(&n_d),
        state: dev(&state),
        slots: EntrySlots {
            base: dev(&base),
            capacity: dev(&capacity),
        },
        cache,
        pooled: Some(dev(&pooled)),
        error: dev(&error),
    };
    cp::prefill(&gpu, &gpu.stream, &shape, &wts, &io).unwrap();
    gpu.synchronize().unwrap();

    let mut cpu = CompressorState::new(m, kind.overlap(), d);
    let mut cpu_pooled = Vec::new();
    for t in 0..n {
        let g: Vec<f32> = (0..w)
            .map(|c| gate[t * w + c] + lc.ape[(t % m) * w + c])
            .collect();
        if let Some(p) = cpu.push(t, &kv[t * w..(t + 1) * w], &g) {
            cpu_pooled.push(p);
        }
    }
    assert_eq!(cpu_pooled.len(), n / m);
    assert_bit_identical(
        label,
        "seeded state",
        &host_state(&cpu),
        &gpu.download(&state).unwrap(),
    );
    let gp = gpu.download(&pooled).unwrap();
    let (codes, scales) = match (&kv_pool, &keys) {
        (Some(p), _) => (gpu.download(p).unwrap(), Vec::new()),
        (None, Some(k)) => (
            gpu.download(&k.codes).unwrap(),
            gpu.download(&k.scales).unwrap(),
        ),
        _ => unreachable!(),
    };
    let (mut differ, mut compared) = (0usize, 0usize);
    for (j, cp_j) in cpu_pooled.iter().enumerate() {
        let g = &gp[j * d..(j + 1) * d];
        for c in 0..d {
            let u = ulps(cp_j[c], g[c]);
            assert!(
                u <= POOLED_ULPS,
                "{label}: block {j} pooled[{c}] cpu {} gpu {}",
                cp_j[c],
                g[c]
            );
            differ += (u > 0) as usize;
        }
        compared += d;
        if j < cap {
            let fin = model.finalize_entry(layer, lc.which, j, g).unwrap();
            let got = decode_stored(kind, &entry_bytes_at(kind, &codes, &scales, 1 + j)).unwrap();
            assert_bit_identical(
                label,
                &format!("entry {j}"),
                &expected_stored(kind, &fin).unwrap(),
                &got,
            );
        }
    }
    println!("{label}: {differ} of {compared} pooled channels differ from the CPU");
    assert!(differ as f64 <= POOLED_DIFF_FRACTION * compared as f64);
    let written: Vec<usize> = (0..cpu_pooled.len().min(cap)).map(|j| 1 + j).collect();
    for s in 0..slots {
        if !written.contains(&s) {
            let e = entry_bytes_at(kind, &codes, &scales, s);
            assert!(e.iter().all(|&x| x == POISON), "{label}: slot {s} written");
        }
    }
    let err = gpu.download(&error).unwrap()[0];
    assert_eq!(err, (n / m > cap) as u32, "{label}: error word");
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_prefill_csa_main_matches_cpu() {
    // 5 blocks and 3 tokens of a sixth; capacity 4 refuses the fifth entry.
    run_prefill(
        "gpu_prefill_csa_main",
        CSA_LAYER,
        CompressorKind::CsaMain,
        23,
        4,
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_prefill_csa_index_matches_cpu() {
    run_prefill(
        "gpu_prefill_csa_index_fp8",
        CSA_LAYER,
        CompressorKind::CsaIndex(KeyFormat::Fp8),
        22,
        8,
    );
    run_prefill(
        "gpu_prefill_csa_index_mxfp4",
        CSA_LAYER,
        CompressorKind::CsaIndex(KeyFormat::Mxfp4),
        20,
        8,
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_prefill_hca_main_matches_cpu() {
    run_prefill(
        "gpu_prefill_hca_main",
        HCA_LAYER,
        CompressorKind::HcaMain,
        2 * 128 + 5,
        2,
    );
    // Fewer tokens than one block: no entry, the state holds the tokens.
    run_prefill(
        "gpu_prefill_hca_main_short",
        HCA_LAYER,
        CompressorKind::HcaMain,
        100,
        2,
    );
}
