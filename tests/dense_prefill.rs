//! The FP8 dense linear through cuBLASLt's block-scaled GEMM (src/ops/dense/prefill.rs, kernels/dense_prefill.cu)
//! against the CPU model's `Model::fp8_linear` math (`weights.matvec(name, &fp8_act_quant(x))`, one BF16
//! rounding) on synthetic DSV4 weights of fresh seeds: the host glue (scale conversions against `formats`, shape
//! rules) on the CPU; on the GPU token counts 1, 3, 6, 128, 130, 4096 and 4097 (the in-place rows plus the staged tail),
//! Flash and Pro shapes, poisoned outputs and workspace, bad input refused before any launch, and a graph
//! replayed with new activations.

mod common;

use common::POISON;
use half::bf16;
use megamoe::formats::{fp8, ue8m0};
use megamoe::gpu::arena::Arena;
use megamoe::gpu::blas::{
    Blas, BlockScaledShape, BLOCK_SCALED_MIN_CUBLASLT, BLOCK_SCALED_ROW_MULTIPLE,
};
use megamoe::gpu::timing::capture_on;
use megamoe::gpu::{fill_bytes_on, Gpu};
use megamoe::model::config::ModelConfig;
use megamoe::model::numerics::{bf16_round_slice, fp8_act_quant, par_map};
use megamoe::model::weights::{CachePolicy, Weights};
use megamoe::ops::dense::prefill::{
    fp8_linear_prefill, rows_in_place, weight_scales_f32, DeviceFp8Weight, Fp8LinearWorkspace,
};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

// ---- host glue ------------------------------------------------------------------------------------------------

#[test]
fn weight_scales_convert_exactly_into_the_padded_k_major_layout() {
    // 3 x 5 blocks: L = 5 pads to L4 = 8. Every code 0..=255 appears (0: the subnormal 2^-127, 0xFF: NaN).
    let (n, k) = (3 * 128, 5 * 128);
    let codes: Vec<u8> = (0..15u32).map(|i| (i * 17 + 3) as u8).collect();
    let mut all = codes.clone();
    all[0] = 0;
    all[1] = 0xFF;
    all[2] = 127;
    let got = weight_scales_f32(&all, n, k).unwrap();
    assert_eq!(got.len(), 3 * 8);
    for nb in 0..3 {
        for kb in 0..8 {
            let g = got[nb * 8 + kb];
            if kb < 5 {
                let want = ue8m0::decode(all[nb * 5 + kb]);
                assert_eq!(g.to_bits(), want.to_bits(), "block ({nb}, {kb})");
            } else {
                assert_eq!(g.to_bits(), 0, "pad column ({nb}, {kb})");
            }
        }
    }
    for c in 0..=255u8 {
        let one = weight_scales_f32(&[c], 128, 128).unwrap();
        assert_eq!(one.len(), 4);
        assert_eq!(one[0].to_bits(), ue8m0::decode(c).to_bits(), "code {c}");
    }
    assert!(weight_scales_f32(&all[..14], n, k).is_err());
    assert!(weight_scales_f32(&[], 0, k).is_err());
}

#[test]
fn the_gemm_shape_rules_and_scale_tensor_sizes() {
    let shape = |m, n, k| BlockScaledShape { m, n, k };
    let ok = shape(8, 512, 4096);
    ok.check().unwrap();
    assert_eq!(
        (ok.k_blocks(), ok.act_scales_len(), ok.weight_scales_len()),
        (32, 32 * 8, 4 * 32)
    );
    // L = 5 pads to L4 = 8 in the weight scales' rows.
    let odd = shape(4, 16, 640);
    odd.check().unwrap();
    assert_eq!((odd.k_blocks_padded(), odd.weight_scales_len()), (8, 8));
    for bad in [
        BlockScaledShape { m: 0, ..ok },
        BlockScaledShape { m: 6, ..ok },
        BlockScaledShape { n: 0, ..ok },
        BlockScaledShape { n: 520, ..ok },
        BlockScaledShape { k: 0, ..ok },
        BlockScaledShape { k: 4160, ..ok },
    ] {
        assert!(bad.check().is_err(), "{bad:?} accepted");
    }
    assert_eq!(BLOCK_SCALED_ROW_MULTIPLE, 4);
    assert_eq!(rows_in_place(1), 0);
    assert_eq!(rows_in_place(4097), 4096);
    assert_eq!(rows_in_place(128), 128);
    assert_eq!(BLOCK_SCALED_MIN_CUBLASLT, 120900);
}

/// The GPU gets norm_quant's FP8 format (e4m3 codes + ue8m0 1x128 scales, `formats::fp8::quantize_act_1x128`);
/// the oracle gets `fp8_act_quant`. Both are the DSV4 rule: their values must agree bit for bit.
#[test]
fn the_device_activation_format_holds_the_oracles_values() {
    let mut rng = common::seeded("dense_prefill_act_format", "DENSE_PREFILL_SEED");
    let (m, k) = (5, 1024);
    let x = random_activations(&mut rng, m, k);
    let q = fp8::quantize_act_1x128(&x, m, k).unwrap();
    let deq = fp8::dequantize_act_1x128(&q);
    for r in 0..m {
        let want = fp8_act_quant(&x[r * k..(r + 1) * k]).unwrap();
        let got = &deq[r * k..(r + 1) * k];
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "row {r} col {i}");
        }
    }
    assert_eq!(q.scales.len(), m * k / 128);
}

// ---- fixtures ---------------------------------------------------------------------------------------------------

/// Rows of `k` values, each 128-block with its own magnitude (2^-6 .. 2^6) so the 1x128 scales differ.
fn random_activations(rng: &mut ChaCha8Rng, m: usize, k: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(m * k);
    for _ in 0..m * k / 128 {
        let mag = 2f32.powi(rng.random_range(-6..=6));
        for _ in 0..128 {
            x.push(mag * rng.random_range(-1.0f32..1.0));
        }
    }
    x
}

/// One weight of a synthetic checkpoint of a fresh seed, on the host and the device.
struct Case {
    weights: Weights,
    name: String,
    n: usize,
    k: usize,
    dev: DeviceFp8Weight,
}

fn case(gpu: &Gpu, rng: &mut ChaCha8Rng, cfg: ModelConfig, prefix: &str) -> Case {
    let seed: u64 = rng.random();
    let weights = Weights::synthetic(cfg, seed, CachePolicy::DenseOnly).unwrap();
    let name = format!("{prefix}.weight");
    let shape = weights.spec(&name).unwrap().shape.clone();
    let (n, k) = (shape[0], shape[1]);
    let codes = weights.raw(&name).unwrap();
    let scales = weights.raw(&format!("{prefix}.scale")).unwrap();
    let dev = DeviceFp8Weight::upload(gpu, &codes, &scales, n, k).unwrap();
    Case {
        weights,
        name,
        n,
        k,
        dev,
    }
}

/// Activations of `m` tokens: host values, device codes and ue8m0 scale codes (norm_quant's layout).
struct Acts {
    x: Vec<f32>,
    codes: cudarc::driver::CudaSlice<u8>,
    scales: cudarc::driver::CudaSlice<u8>,
}

fn acts(gpu: &Gpu, rng: &mut ChaCha8Rng, m: usize, k: usize) -> Acts {
    let x = random_activations(rng, m, k);
    let q = fp8::quantize_act_1x128(&x, m, k).unwrap();
    Acts {
        x,
        codes: gpu.upload(&q.data).unwrap(),
        scales: gpu.upload(&q.scales).unwrap(),
    }
}

/// The op's scratch for `m` tokens, poisoned.
fn workspace(gpu: &Gpu, blas: &Blas, m: usize, n: usize, k: usize) -> (Arena, Fp8LinearWorkspace) {
    let cub = Fp8LinearWorkspace::cublas_bytes_for(blas, n, k, &[m]).unwrap();
    let mut arena = Arena::for_layout(gpu, &Fp8LinearWorkspace::layout(m, n, k, cub)).unwrap();
    arena.poison(&gpu.stream, POISON).unwrap();
    let ws = Fp8LinearWorkspace::carve(&mut arena, m, n, k, cub).unwrap();
    (arena, ws)
}

/// Compare the GPU's BF16 output with the CPU model's `fp8_linear` (reused piece by piece: `fp8_act_quant`, the
/// weights' own `matvec`, one BF16 rounding).
///
/// Tolerance, per element: both sides compute the same exact products (e4m3 x e4m3 x powers of two) and differ
/// only in how they sum them before one BF16 rounding each. The CPU's f32 sums over K terms are within
/// K * 2^-24 * S of the exact sum, S = sum_k |x_k w_k|. The GPU's FP8 tensor cores accumulate each 128-term block
/// with about 14 significant bits (DeepSeek-V3 report, section 3.3.2: "limited accumulation precision ... around
/// 14 bits"), over four 32-deep MMA steps before cuBLASLt promotes the block to f32 with its scales: at most
/// 4 * 2^-13 = 2^-11 of the block's S; the f32 sum over blocks adds K/128 * 2^-24 * S. Bounded together by
/// (2^-10 + 2 K 2^-24) * S, plus one BF16 ulp of the value for the two roundings landing on either side of a
/// tie point. A wrong scale layout or a misplaced row gives errors of the order of the values themselves; the
/// relative L2 error over the whole output must also stay below 1e-2 (the BF16 rounding alone is <= 2^-9 per
/// element).
fn check(label: &str, c: &Case, x: &[f32], m: usize, got: &[bf16]) {
    let (n, k) = (c.n, c.k);
    assert_eq!(got.len(), m * n, "{label}: output length");
    let mat = c.weights.matrix(&c.name).unwrap();
    let per_row = par_map(m, |r| {
        let xq = fp8_act_quant(&x[r * k..(r + 1) * k]).unwrap();
        let mut want = c.weights.matvec(&c.name, &xq).unwrap();
        bf16_round_slice(&mut want);
        let s: Vec<f32> = (0..n)
            .map(|j| mat.row(j).iter().zip(&xq).map(|(w, v)| (w * v).abs()).sum())
            .collect();
        (want, s)
    });
    let got: Vec<f32> = got.iter().map(|v| v.to_f32()).collect();
    common::assert_all_written(label, &got);
    let mut want_all = Vec::with_capacity(m * n);
    let rel = 2f64.powi(-10) + 2.0 * k as f64 * 2f64.powi(-24);
    let mut worst = (0.0f64, 0usize);
    for (r, (want, s)) in per_row.iter().enumerate() {
        for j in 0..n {
            let (g, w) = (got[r * n + j] as f64, want[j] as f64);
            let ulp = if w == 0.0 {
                0.0
            } else {
                2f64.powi(w.abs().log2().floor() as i32 - 7)
            };
            let tol = ulp + rel * s[j] as f64;
            let err = (g - w).abs();
            assert!(
                err <= tol,
                "{label}: y[{r}, {j}] = {g}, the CPU model gives {w} (|diff| {err:.3e} > bound {tol:.3e}, \
                 sum|x w| {})",
                s[j]
            );
            if tol > 0.0 && err / tol > worst.0 {
                worst = (err / tol, r * n + j);
            }
            want_all.push(w);
        }
    }
    println!(
        "{label}: worst error {:.2} of its bound at {}",
        worst.0, worst.1
    );
    common::assert_rel_l2(label, &got, &want_all, 1e-2);
}

fn run(gpu: &Gpu, blas: &Blas, c: &Case, rng: &mut ChaCha8Rng, m: usize, label: &str) {
    let a = acts(gpu, rng, m, c.k);
    let (_arena, ws) = workspace(gpu, blas, m, c.n, c.k);
    let mut y = gpu.zeros::<bf16>(m * c.n).unwrap();
    fill_bytes_on(&gpu.stream, &mut y, POISON).unwrap();
    fp8_linear_prefill(
        gpu,
        &gpu.stream,
        blas,
        m,
        &a.codes,
        &a.scales,
        &c.dev.view(),
        &ws,
        &y,
    )
    .unwrap();
    let got = gpu.download(&y).unwrap();
    check(label, c, &a.x, m, &got);
}

// ---- GPU --------------------------------------------------------------------------------------------------------

/// The GPU, a cuBLASLt handle, the test's fresh RNG and one weight (`prefix` of `cfg`) of a fresh seed.
struct Fixture {
    gpu: Gpu,
    blas: Blas,
    rng: ChaCha8Rng,
    c: Case,
}

fn fixture(test: &str, cfg: ModelConfig, prefix: &str) -> Fixture {
    let gpu = common::gpu(test);
    let blas = Blas::new(&gpu).unwrap();
    let mut rng = common::seeded(test, "DENSE_PREFILL_SEED");
    let c = case(&gpu, &mut rng, cfg, prefix);
    Fixture { gpu, blas, rng, c }
}

/// The linear `prefix` of `cfg` at each token count of `ms`, fresh activations each.
fn check_token_counts(test: &str, cfg: ModelConfig, prefix: &str, ms: &[usize]) {
    let mut f = fixture(test, cfg, prefix);
    for &m in ms {
        run(
            &f.gpu,
            &f.blas,
            &f.c,
            &mut f.rng,
            m,
            &format!("{test} m={m}"),
        );
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn flash_wq_a_at_decode_and_small_token_counts() {
    // 1 and 3: only the staged tail; 6: in place + tail; 128: in place.
    check_token_counts(
        "flash_wq_a_at_decode_and_small_token_counts",
        ModelConfig::flash(),
        "layers.0.attn.wq_a",
        &[1, 3, 6, 128],
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn flash_wkv_at_prefill_token_counts() {
    check_token_counts(
        "flash_wkv_at_prefill_token_counts",
        ModelConfig::flash(),
        "layers.0.attn.wkv",
        &[4096, 4097],
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn pro_shared_expert_w2_at_130_tokens() {
    check_token_counts(
        "pro_shared_expert_w2_at_130_tokens",
        ModelConfig::pro(),
        "layers.0.ffn.shared_experts.w2",
        &[130],
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn bad_input_is_refused_before_any_launch() {
    let Fixture {
        gpu,
        blas,
        mut rng,
        c,
    } = fixture(
        "bad_input_is_refused_before_any_launch",
        ModelConfig::flash(),
        "layers.0.attn.wq_a",
    );
    let m = 8;
    let a = acts(&gpu, &mut rng, m, c.k);
    let (_arena, ws) = workspace(&gpu, &blas, m, c.n, c.k);
    let mut y = gpu.zeros::<bf16>(m * c.n).unwrap();
    fill_bytes_on(&gpu.stream, &mut y, POISON).unwrap();
    let w = c.dev.view();
    let short_y = gpu.zeros::<bf16>(m * c.n - 1).unwrap();
    let short_scales = gpu.zeros::<u8>(m * c.k / 128 - 1).unwrap();
    let call =
        |m: usize, scales: &cudarc::driver::CudaSlice<u8>, y: &cudarc::driver::CudaSlice<bf16>| {
            fp8_linear_prefill(&gpu, &gpu.stream, &blas, m, &a.codes, scales, &w, &ws, y)
        };
    for (what, r) in [
        ("m = 0", call(0, &a.scales, &y)),
        ("m beyond the workspace", call(m + 1, &a.scales, &y)),
        ("short y", call(m, &a.scales, &short_y)),
        ("short scales", call(m, &short_scales, &y)),
    ] {
        assert!(r.is_err(), "{what} accepted");
        println!("{what}: {:#}", r.unwrap_err());
    }
    // Nothing was written.
    let got = gpu.download(&y).unwrap();
    assert!(
        got.iter().all(|v| v.to_bits() == 0xFFFF),
        "a refused call wrote y"
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn a_captured_graph_replays_with_new_activations() {
    let Fixture {
        gpu,
        blas,
        mut rng,
        c,
    } = fixture(
        "a_captured_graph_replays_with_new_activations",
        ModelConfig::flash(),
        "layers.0.attn.wq_a",
    );
    // 5 tokens: one in-place GEMM of 4 rows and the staged tail, every piece of the launcher in the graph.
    let m = 5;
    let stream = gpu.new_stream().unwrap();
    let first = acts(&gpu, &mut rng, m, c.k);
    let (_arena, ws) = workspace(&gpu, &blas, m, c.n, c.k);
    let mut x = gpu.zeros::<u8>(m * c.k).unwrap();
    let mut xs = gpu.zeros::<u8>(m * c.k / 128).unwrap();
    let mut y = gpu.zeros::<bf16>(m * c.n).unwrap();
    gpu.synchronize().unwrap();
    let w = c.dev.view();
    // One call before the capture: loads the converter's module (no module load inside the capture).
    fp8_linear_prefill(&gpu, &stream, &blas, m, &x, &xs, &w, &ws, &y).unwrap();
    stream.synchronize().unwrap();
    let graph = capture_on(&stream, || {
        fp8_linear_prefill(&gpu, &stream, &blas, m, &x, &xs, &w, &ws, &y)
    })
    .unwrap();
    for (round, a) in [first, acts(&gpu, &mut rng, m, c.k)]
        .into_iter()
        .enumerate()
    {
        let hx = gpu.download(&a.codes).unwrap();
        let hs = gpu.download(&a.scales).unwrap();
        gpu.write(&stream, &mut x, &hx).unwrap();
        gpu.write(&stream, &mut xs, &hs).unwrap();
        fill_bytes_on(&stream, &mut y, POISON).unwrap();
        graph.launch().unwrap();
        stream.synchronize().unwrap();
        let got = gpu.download(&y).unwrap();
        check(&format!("graph replay {round}"), &c, &a.x, m, &got);
    }
}
