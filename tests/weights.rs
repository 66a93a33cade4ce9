//! The weights family: synthetic checkpoint tensors written on the GPU (kernels/weights.cu) against the CPU
//! oracle `model::weights::synthetic_bytes`, byte for byte. CPU tests: the launcher's checks (ranges, output
//! length, (init, dtype) pairs), that every tensor of the DSV4 manifests has a GPU fill, the kernel's float
//! identity, and the bench tensors. GPU tests (ignored on a CPU machine; run with `--include-ignored`): random
//! slices of one representative tensor per (tensor role, dtype, init, layer kind) of DSV4-Flash into poisoned,
//! deliberately misaligned outputs, and one 1 GiB fill checked at random sample points.

mod common;

use std::collections::BTreeMap;

use megamoe::model::weights::{
    synthetic_bytes, synthetic_uniform, tensor_manifest, StoredDtype, SyntheticInit, TensorSpec,
};
use megamoe::model::ModelConfig;
use megamoe::ops::weights::bench::{bench_tensor, FillCase};
use megamoe::ops::weights::{check_fill, fill, fill_to_host};
use rand::Rng;

fn spec(dtype: StoredDtype, shape: Vec<usize>, init: SyntheticInit) -> TensorSpec {
    TensorSpec {
        name: "test.tensor".into(),
        dtype,
        shape,
        init,
    }
}

fn uniform() -> SyntheticInit {
    SyntheticInit::Uniform {
        amp: 1.0,
        offset: 0.0,
    }
}

// ---------------------------------------------------------------------------------------------------
// Launcher checks (no GPU).

#[test]
fn check_fill_accepts_in_range_slices_and_returns_bytes_written() {
    let s = spec(StoredDtype::BF16, vec![3, 5], uniform());
    assert_eq!(check_fill(&s, 0, 15, 30).unwrap(), 30);
    assert_eq!(check_fill(&s, 14, 1, 2).unwrap(), 2);
    assert_eq!(
        check_fill(&s, 15, 0, 0).unwrap(),
        0,
        "an empty slice at the end"
    );
    assert_eq!(
        check_fill(&s, 4, 3, 100).unwrap(),
        6,
        "a larger output is fine"
    );
}

#[test]
fn check_fill_rejects_ranges_past_the_tensor() {
    let s = spec(StoredDtype::F32, vec![10], uniform());
    let e = check_fill(&s, 5, 6, 1 << 20).unwrap_err().to_string();
    assert!(e.contains("beyond its 10 elements"), "{e}");
    let e = check_fill(&s, 11, 0, 1 << 20).unwrap_err().to_string();
    assert!(e.contains("beyond"), "{e}");
    let e = check_fill(&s, usize::MAX, 2, usize::MAX)
        .unwrap_err()
        .to_string();
    assert!(e.contains("beyond"), "overflowing first + count: {e}");
}

#[test]
fn check_fill_rejects_a_short_output() {
    let s = spec(
        StoredDtype::I64,
        vec![4, 6],
        SyntheticInit::Tid2eid { n_experts: 256 },
    );
    let e = check_fill(&s, 0, 3, 23).unwrap_err().to_string();
    assert!(e.contains("holds 23 bytes") && e.contains("need 24"), "{e}");
}

#[test]
fn check_fill_rejects_pairs_the_oracle_does_not_generate() {
    for (dtype, init) in [
        (StoredDtype::BF16, SyntheticInit::Fp8Codes),
        (StoredDtype::F8E4M3, uniform()),
        (StoredDtype::I8, SyntheticInit::Fp8Codes),
        (StoredDtype::F8E8M0, SyntheticInit::Fp4Codes),
        (StoredDtype::BF16, SyntheticInit::Scale { exp_base: -3 }),
        (
            StoredDtype::BF16,
            SyntheticInit::HcBase {
                hc: 4,
                amp: 0.2,
                diag: 1.0,
            },
        ),
        (StoredDtype::F32, SyntheticInit::Tid2eid { n_experts: 8 }),
    ] {
        let s = spec(dtype, vec![64, 2], init.clone());
        let e = check_fill(&s, 0, 1, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("does not apply"), "{dtype:?} {init:?}: {e}");
    }
}

#[test]
fn check_fill_rejects_degenerate_init_parameters() {
    let bad = [
        spec(
            StoredDtype::I64,
            vec![24],
            SyntheticInit::Tid2eid { n_experts: 8 },
        ),
        spec(
            StoredDtype::I64,
            vec![4, 0],
            SyntheticInit::Tid2eid { n_experts: 8 },
        ),
        spec(
            StoredDtype::I64,
            vec![4, 6],
            SyntheticInit::Tid2eid { n_experts: 0 },
        ),
        spec(
            StoredDtype::F32,
            vec![24],
            SyntheticInit::HcBase {
                hc: 0,
                amp: 0.2,
                diag: 1.0,
            },
        ),
    ];
    for s in bad {
        assert!(check_fill(&s, 0, 0, 0).is_err(), "{s:?}");
    }
}

/// Every tensor of both DSV4 geometries has a GPU fill, over its whole range.
#[test]
fn every_manifest_tensor_has_a_gpu_fill() {
    for cfg in [ModelConfig::flash(), ModelConfig::pro()] {
        for s in tensor_manifest(&cfg) {
            check_fill(&s, 0, s.numel(), s.nbytes())
                .unwrap_or_else(|e| panic!("{}: {}: {e:#}", cfg.name, s.name));
        }
    }
}

/// The kernel computes synthetic_uniform as ((x + 0.5) * 2^-23) - 1 with separately rounded f32 steps, in
/// place of the CPU's division by 2^23: equal for every one of the 2^24 values of x = bits >> 40.
#[test]
fn uniform_by_power_of_two_product_equals_the_cpu_division() {
    for x in 0u64..1 << 24 {
        let want = synthetic_uniform(x << 40);
        let got = ((x as f32 + 0.5) * (1.0 / 8_388_608.0)) - 1.0;
        assert_eq!(want.to_bits(), got.to_bits(), "x = {x}");
    }
}

#[test]
fn bench_tensors_take_the_flash_init_and_the_requested_size() {
    for case in FillCase::ALL {
        assert_eq!(FillCase::from_name(case.name()).unwrap(), case);
        let t = bench_tensor(case, 1 << 20).unwrap();
        assert_eq!(t.nbytes(), 1 << 20, "{case:?}");
        let want = match case {
            FillCase::Fp4Codes => StoredDtype::I8,
            FillCase::Fp8Codes => StoredDtype::F8E4M3,
            FillCase::Ue8m0Scale => StoredDtype::F8E8M0,
            FillCase::Bf16Uniform => StoredDtype::BF16,
            FillCase::F32Uniform => StoredDtype::F32,
        };
        assert_eq!(t.dtype, want, "{case:?}");
        check_fill(&t, 0, t.numel(), t.nbytes()).unwrap();
    }
    assert!(FillCase::from_name("fp16").is_err());
}

// ---------------------------------------------------------------------------------------------------
// GPU against the CPU oracle.

/// The role of a tensor: its name with the layer and expert indices replaced by `*`.
fn role(name: &str) -> String {
    let mut out = Vec::new();
    let parts: Vec<&str> = name.split('.').collect();
    for (i, p) in parts.iter().enumerate() {
        let indexed = i > 0 && matches!(parts[i - 1], "layers" | "experts");
        out.push(if indexed && p.parse::<usize>().is_ok() {
            "*"
        } else {
            p
        });
    }
    out.join(".")
}

/// The kind of layer a tensor belongs to (attention kind and whether routing is hashed), or "global".
fn layer_kind(cfg: &ModelConfig, name: &str) -> String {
    match name
        .strip_prefix("layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|l| l.parse::<usize>().ok())
    {
        Some(l) => format!("{:?} hash={}", cfg.layer_kind(l), cfg.is_hash_layer(l)),
        None => "global".into(),
    }
}

/// One tensor per (role, dtype, init kind, layer kind) of a manifest: every kind of tensor the model has.
fn representatives(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let mut seen = BTreeMap::new();
    for s in tensor_manifest(cfg) {
        let init = format!("{:?}", s.init);
        let init_kind = init.split([' ', '{']).next().unwrap_or("").to_string();
        let key = (
            role(&s.name),
            s.dtype.safetensors_name(),
            init_kind,
            layer_kind(cfg, &s.name),
        );
        seen.entry(key).or_insert(s);
    }
    seen.into_values().collect()
}

/// Slices of a tensor: whole (when small), count 1 at random and at the last element, a random run ending at
/// the last element, runs crossing a row boundary and (for 2-D tensors of 128+ rows) a 128-row block boundary,
/// and random slices.
fn slices(rng: &mut impl Rng, s: &TensorSpec) -> Vec<(usize, usize)> {
    let n = s.numel();
    let cols = *s.shape.last().unwrap();
    let mut v = vec![(rng.random_range(0..n), 1), (n - 1, 1)];
    if n <= 1 << 16 {
        v.push((0, n));
    }
    let r = rng.random_range(1..=n.min(5000));
    v.push((n - r, r));
    if s.shape.len() >= 2 && n > cols {
        let rows = n / cols;
        let row = rng.random_range(1..rows);
        let a = rng.random_range(1..=cols.min(300));
        let b = rng.random_range(1..=cols.min(300));
        v.push((row * cols - a, a + b));
        if rows > 128 {
            let a = rng.random_range(1..=cols.min(40));
            v.push((128 * cols - a, 2 * a));
        }
    }
    for _ in 0..4 {
        let count = rng.random_range(1..=n.min(70_000));
        v.push((rng.random_range(0..=n - count), count));
    }
    v
}

/// The GPU, the test's seeded RNG (replay with WEIGHTS_SEED) and a synthetic-weights seed drawn from it.
fn gpu_rng_and_seed(test: &str) -> (megamoe::gpu::Gpu, impl Rng, u64) {
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, "WEIGHTS_SEED");
    let seed: u64 = rng.random();
    (gpu, rng, seed)
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_every_flash_tensor_kind_matches_the_cpu_oracle() {
    let test = "gpu_every_flash_tensor_kind_matches_the_cpu_oracle";
    let (gpu, mut rng, seed) = gpu_rng_and_seed(test);
    let cfg = ModelConfig::flash();
    let reps = representatives(&cfg);
    let mut pairs = std::collections::BTreeSet::new();
    let mut checked = 0usize;
    for s in &reps {
        pairs.insert((s.dtype.safetensors_name(), format!("{:?}", s.init)));
        for (first, count) in slices(&mut rng, s) {
            let want = synthetic_bytes(seed, s, first, count);
            // A misaligned window of a poisoned buffer: bytes before and after must stay poison.
            let off = rng.random_range(0..16usize);
            let pad = 37;
            let out = gpu
                .poisoned::<u8>(off + want.len() + pad, common::POISON)
                .unwrap();
            let window = out.slice(off..off + want.len());
            fill(&gpu, &gpu.stream, seed, s, first, count, &window).unwrap();
            let got = gpu.download(&out).unwrap();
            let label = format!("{} [{first}, +{count}) at offset {off}", s.name);
            assert!(
                got[..off]
                    .iter()
                    .chain(&got[off + want.len()..])
                    .all(|&b| b == common::POISON),
                "{label}: bytes outside the slice were written"
            );
            common::assert_bit_identical(
                &label,
                "stored bytes",
                &want,
                &got[off..off + want.len()],
            );
            checked += 1;
        }
    }
    // Every (dtype, init) pair the oracle generates was among them.
    for pair in ["F8_E4M3", "I8", "F8_E8M0", "BF16", "F32", "I64"] {
        assert!(
            pairs.iter().any(|(d, _)| *d == pair),
            "no {pair} tensor checked"
        );
    }
    assert!(pairs.iter().any(|(_, i)| i.starts_with("HcBase")));
    assert!(pairs.iter().any(|(_, i)| i.starts_with("Tid2eid")));
    println!("{test}: {} tensors, {checked} slices bit-exact", reps.len());

    // An empty slice writes nothing.
    let s = &reps[0];
    let out = gpu.poisoned::<u8>(64, common::POISON).unwrap();
    fill(&gpu, &gpu.stream, seed, s, 0, 0, &out).unwrap();
    assert!(gpu
        .download(&out)
        .unwrap()
        .iter()
        .all(|&b| b == common::POISON));
    assert!(fill_to_host(&gpu, seed, s, 1, 0).unwrap().is_empty());
}

/// The whole DSV4-Flash embedding (129280 x 4096 BF16, 1 GiB) filled in one launch, checked at random elements,
/// random runs and both ends.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_one_gib_fill_matches_the_cpu_oracle_at_sample_points() {
    let test = "gpu_one_gib_fill_matches_the_cpu_oracle_at_sample_points";
    let (gpu, mut rng, seed) = gpu_rng_and_seed(test);
    let s = tensor_manifest(&ModelConfig::flash())
        .into_iter()
        .find(|s| s.name == "embed.weight")
        .unwrap();
    let (n, size) = (s.numel(), s.dtype.size());
    let got = fill_to_host(&gpu, seed, &s, 0, n).unwrap();
    assert_eq!(got.len(), s.nbytes());
    let mut points: Vec<(usize, usize)> = vec![(0, 64), (n - 64, 64)];
    for _ in 0..20_000 {
        points.push((rng.random_range(0..n), 1));
    }
    for _ in 0..200 {
        let count = rng.random_range(1..=4096);
        points.push((rng.random_range(0..=n - count), count));
    }
    for (first, count) in points {
        let want = synthetic_bytes(seed, &s, first, count);
        common::assert_bit_identical(
            &format!("{} [{first}, +{count})", s.name),
            "stored bytes",
            &want,
            &got[first * size..(first + count) * size],
        );
    }
}
