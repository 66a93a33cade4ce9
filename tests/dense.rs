//! Decode dense linears (ops::dense): CPU tests of the shape rules, the launch plan and the reference glue; GPU tests
//! of every linear at the DSV4-Flash and -Pro shapes against the CPU model's own functions (`Model::fp8_linear`,
//! `Model::expert`, `Weights::matvec` / `matvec_rows` as `Model::out_proj` uses them) on fresh seeds with poisoned
//! outputs, edge shapes, and a graph replay. Tolerance: `ops::dense::reference::tolerance` (its comment derives it:
//! the GPU and the CPU sum the same exact products in different orders, then round once to BF16). The tensor-core
//! route (`ops::dense::route`, the `gpu_routed_*` tests): every routed launcher at 16, 32, 33 and 64 rows on the
//! Flash and small geometries, the route taken asserted, with the tensor-core prefill test's tolerance
//! ([`assert_tensor_core_close`]).

mod common;

use common::dense::{self as fx, DevFp8};
use half::bf16;
use megamoe::formats::fp8::{dequantize_weight_128x128, quantize_weight_128x128};
use megamoe::gpu::arena;
use megamoe::model::config::ModelConfig;
use megamoe::model::numerics::{bf16_round, dot, fp8_act_quant};
use megamoe::model::reference::Model;
use megamoe::ops::dense::prefill::{rows_in_place, Fp8LinearWorkspace};
use megamoe::ops::dense::reference::{
    abs_term_sums, bf16_ulp, fp8_linear_rows, matvec_rows, shared_expert_rows, tolerance, wo_a_rows,
};
use megamoe::ops::dense::{
    bf16_linear, fp8_linear, fp8_linears, fp8_linears_of_bf16, plan, route, shared_expert,
    with_route, wo_a_grouped, workspace_layout, Bf16Job, Bf16Rows, DenseKind, DensePath,
    DenseRoute, DenseShape, DenseWorkspace, Fp8Job, Fp8Rows, SharedExpertScratch, MAX_CALL_ROWS,
    MAX_ROWS, ROUTE_CUBLAS_BYTES,
};
use rand_chacha::ChaCha8Rng;

/// The CSA layer both geometries have at index 2 (compressor with the overlap, indexer).
const LAYER: usize = 2;

fn fp8_names() -> Vec<String> {
    let a = format!("layers.{LAYER}.attn");
    vec![
        format!("{a}.wq_a.weight"),
        format!("{a}.wq_b.weight"),
        format!("{a}.wkv.weight"),
        format!("{a}.wo_b.weight"),
        format!("{a}.indexer.wq_b.weight"),
        format!("layers.{LAYER}.ffn.shared_experts.w1.weight"),
        format!("layers.{LAYER}.ffn.shared_experts.w2.weight"),
    ]
}

fn quantized_rows(x: &[f32], rows: usize) -> Vec<f32> {
    let k = x.len() / rows;
    (0..rows)
        .flat_map(|r| fp8_act_quant(&x[r * k..(r + 1) * k]).unwrap())
        .collect()
}

// ---- CPU ----------------------------------------------------------------------------------------------------

#[test]
fn shape_rules_refuse_what_the_kernels_cannot_take() {
    let err = |s: DenseShape| format!("{:#}", s.check().unwrap_err());
    assert!(err(DenseShape::new(DenseKind::Fp8, 0, 128, 128, 1)).contains("activation rows"));
    assert!(err(DenseShape::new(
        DenseKind::Fp8,
        MAX_CALL_ROWS + 1,
        128,
        128,
        1
    ))
    .contains("activation rows"));
    // A call above the GEMV's rows is a valid shape (tensor cores or GEMV pieces), but no one GEMV launch plans it.
    DenseShape::new(DenseKind::Fp8, MAX_ROWS + 1, 128, 128, 1)
        .check()
        .unwrap();
    let e = format!(
        "{:#}",
        plan(
            &DenseShape::new(DenseKind::Fp8, MAX_ROWS + 1, 128, 128, 1),
            132
        )
        .unwrap_err()
    );
    assert!(e.contains("GEMV launch of 65 rows"), "{e}");
    assert_eq!(
        DenseShape::new(DenseKind::Swiglu, 300, 128, 128, 1)
            .gemv_piece()
            .rows,
        MAX_ROWS
    );
    assert!(err(DenseShape::new(DenseKind::Fp8, 1, 192, 128, 1)).contains("multiples of 128"));
    assert!(err(DenseShape::new(DenseKind::Fp8, 1, 128, 192, 1)).contains("multiples of 128"));
    assert!(err(DenseShape::new(DenseKind::Swiglu, 1, 64, 128, 1)).contains("multiples of 128"));
    assert!(err(DenseShape::new(DenseKind::Bf16, 1, 64, 96, 1)).contains("multiple of 64"));
    assert!(err(DenseShape::new(DenseKind::Fp8Bf16x, 1, 128, 128, 17))
        .contains("weights in one launch"));
    DenseShape::new(DenseKind::Bf16, 1, 1, 64, 1)
        .check()
        .unwrap();
    DenseShape::new(DenseKind::Fp8, 64, 128, 128, 1)
        .check()
        .unwrap();
}

/// Every DSV4 shape at every M: the slices cover K exactly once, are whole granules (or the tail), the staged x
/// fits shared memory, the token groups cover M, and K is split when the row tiles alone leave SMs idle.
#[test]
fn plans_cover_k_and_fit_shared_memory() {
    for cfg in [ModelConfig::flash(), ModelConfig::pro()] {
        let (d, q, r) = (cfg.dim, cfg.q_lora_rank, cfg.o_lora_rank);
        let gw = cfg.heads_per_group() * cfg.head_dim;
        let shapes = [
            (DenseKind::Fp8, q, d, 1),
            (DenseKind::Fp8, cfg.n_heads * cfg.head_dim, q, 1),
            (DenseKind::Fp8, cfg.head_dim, d, 1),
            (DenseKind::Fp8, d, cfg.o_groups * r, 1),
            (DenseKind::Fp8, cfg.index_n_heads * cfg.index_head_dim, q, 1),
            (DenseKind::Fp8, d, cfg.moe_inter_dim, 1),
            (DenseKind::Swiglu, cfg.moe_inter_dim, d, 1),
            (DenseKind::Fp8Bf16x, r, gw, cfg.o_groups),
            (DenseKind::Bf16, 2 * cfg.head_dim, d, 2),
            (DenseKind::Bf16, cfg.index_n_heads, d, 1),
            (DenseKind::Bf16, cfg.vocab_size, d, 1),
        ];
        for (kind, n, k, jobs) in shapes {
            for m in 1..=MAX_ROWS {
                let s = DenseShape::new(kind, m, n, k, jobs);
                let p = plan(&s, 132).unwrap();
                let label = format!("{} {s:?}: {p:?}", cfg.name);
                assert!(
                    p.mt * 8 >= m && p.mt.is_power_of_two() && p.mt <= 8,
                    "{label}"
                );
                assert!(p.kc * p.splits >= k && p.kc * (p.splits - 1) < k, "{label}");
                let gran = if kind == DenseKind::Bf16 { 64 } else { 128 };
                assert!(p.kc.is_multiple_of(gran) || p.kc == k, "{label}");
                assert!(p.smem <= 227 * 1024, "{label}");
                // Split-K whenever the row tiles alone leave SMs idle, K has two granules and the partials
                // (f32, M rows) stay within twice the weight bytes at two splits.
                let esize = if kind == DenseKind::Bf16 { 2 } else { 1 };
                let splittable = k.div_ceil(gran) >= 2 && 2 * k * esize / (4 * m) >= 2;
                if n.div_ceil(128) * jobs < 132 && splittable {
                    assert!(p.splits >= 2, "{label}");
                }
                // Flash's split-K for occupancy never spills into a second wave of its two CTAs per SM. (The LM
                // head's many waves split only to fit two CTAs per SM, see below; Pro's wo_b, 56 tiles of K 16,384,
                // cannot: at the 4 splits of one wave its x slice leaves room for one CTA per SM, so its slices are
                // halved to 8 splits, 1.7 waves of two.)
                if cfg.name == "flash" && n.div_ceil(128) * jobs < 132 {
                    assert!(n.div_ceil(128) * jobs * p.splits <= 2 * 132, "{label}");
                }
            }
        }
    }
}

/// A launch of jobs of different heights plans by the tiles that hold rows (the shorter jobs' tail tiles exit at
/// once). The CSA layers' BF16 launch (the indexer's weights_proj, 64 rows, then both compressors' wkv and wgate,
/// 1,024 and 256 rows) has 21 busy tiles of a 5 x 8 grid: at one row its busy CTAs fill one wave of two per SM,
/// about twice the splits the whole grid's 40 tiles would get.
#[test]
fn mixed_height_launches_plan_by_their_busy_tiles() {
    let cfg = ModelConfig::flash();
    let (w, wi) = (2 * cfg.head_dim, 2 * cfg.index_head_dim);
    let s = DenseShape::of_heights(
        DenseKind::Bf16,
        1,
        cfg.dim,
        [cfg.index_n_heads, w, w, wi, wi],
    );
    assert_eq!((s.n, s.jobs, s.busy_tiles), (1024, 5, 21));
    s.check().unwrap();
    let p = plan(&s, 132).unwrap();
    let whole_grid = plan(&DenseShape::new(DenseKind::Bf16, 1, 1024, cfg.dim, 5), 132).unwrap();
    assert!(p.splits * s.busy_tiles <= 2 * 132, "{p:?}");
    assert!(
        p.splits >= 2 * whole_grid.splits - 1,
        "{p:?} vs {whole_grid:?}"
    );
    // wq_b + the indexer's wq_b (320 busy CTAs, more than one CTA per SM): one split, every CTA streams a whole
    // K row slice (two splits to even out the SMs' shares measured slower).
    let q = cfg.q_lora_rank;
    let both = [
        cfg.n_heads * cfg.head_dim,
        cfg.index_n_heads * cfg.index_head_dim,
    ];
    for m in [1, 8] {
        let pair = plan(&DenseShape::of_heights(DenseKind::Fp8, m, q, both), 132).unwrap();
        assert_eq!(pair.splits, 1, "{pair:?}");
    }
    // Jobs of one height: every tile busy, the same shape as `new`.
    assert_eq!(
        DenseShape::of_heights(DenseKind::Fp8, 8, 4096, [1024, 1024]),
        DenseShape::new(DenseKind::Fp8, 8, 1024, 4096, 2)
    );
    // A busy count outside jobs ..= jobs x tiles is refused.
    for busy in [4, 41] {
        let bad = DenseShape {
            busy_tiles: busy,
            ..s
        };
        assert!(bad.check().is_err(), "{bad:?}");
    }
}

/// The LM head at 1..8 rows keeps two CTAs per SM: its K slice is halved until a CTA needs at most half the shared
/// memory (the partials, 4 bytes x splits x vocab, are far below 1/16 of the weight).
/// From `MIN_SLICE_ROWS` rows every CTA streams a K slice of at least `MIN_SLICE_COLUMNS` columns (still covering K
/// and fitting shared memory); below, wq_a keeps the occupancy rule's shorter slices.
#[test]
fn plans_from_eight_rows_take_wide_slices() {
    use megamoe::ops::dense::{MIN_SLICE_COLUMNS, MIN_SLICE_ROWS};
    let one = plan(&DenseShape::new(DenseKind::Fp8, 1, 1024, 4096, 1), 132).unwrap();
    assert!(one.kc < MIN_SLICE_COLUMNS, "{one:?}");
    for m in [MIN_SLICE_ROWS, 16, 64] {
        for (n, k) in [(1024, 4096), (512, 4096), (4096, 8192)] {
            let p = plan(&DenseShape::new(DenseKind::Fp8, m, n, k, 1), 132).unwrap();
            assert!(
                p.kc >= MIN_SLICE_COLUMNS && p.kc.is_multiple_of(128),
                "{p:?}"
            );
            assert_eq!(p.splits, k.div_ceil(p.kc), "{p:?}");
            assert!(p.smem <= 227 * 1024, "{p:?}");
        }
    }
}

#[test]
fn lm_head_plans_at_small_m_fit_two_ctas_per_sm() {
    for cfg in [ModelConfig::flash(), ModelConfig::pro()] {
        for m in [1, 8] {
            let s = DenseShape::new(DenseKind::Bf16, m, cfg.vocab_size, cfg.dim, 1);
            let p = plan(&s, 132).unwrap();
            assert!(
                p.smem <= 113 * 1024 && p.splits >= 2,
                "{} M={m}: {p:?}",
                cfg.name
            );
        }
    }
}

#[test]
fn bf16_ulp_and_tolerance_are_what_their_docs_say() {
    assert_eq!(bf16_ulp(1.0), 2f64.powi(-7));
    assert_eq!(bf16_ulp(-1.5), 2f64.powi(-7));
    assert_eq!(bf16_ulp(0.75), 2f64.powi(-8));
    assert_eq!(bf16_ulp(300.0), 2.0);
    // Two neighbouring BF16 values from sums that agree exactly are within the bound; twice the ulp is not.
    let t = tolerance(1.0, 0.0, 4096, true);
    assert!(t >= 2f64.powi(-7) && t < 2.0 * 2f64.powi(-7));
    assert_eq!(
        tolerance(1.0, 1.0, 1024, false),
        6.0 * 1024.0 / 16_777_216.0
    );
}

/// The oracle glue calls the model: `fp8_linear_rows` row r equals `Model::fp8_linear` of row r, and the grouped
/// `wo_a_rows` equals `matvec_rows` per group, on the small geometry.
#[test]
fn reference_glue_is_the_models_per_row_call() {
    let mut rng = fx::seeded("reference_glue_is_the_models_per_row_call");
    let m = fx::model(ModelConfig::small(), &mut rng);
    let cfg = m.config().clone();
    let name = format!("layers.{LAYER}.attn.wq_a.weight");
    let x = fx::activations(&mut rng, 3, cfg.dim);
    let y = fp8_linear_rows(&m, &name, &x, 3).unwrap();
    for r in 0..3 {
        let want = m
            .fp8_linear(&name, &x[r * cfg.dim..(r + 1) * cfg.dim])
            .unwrap();
        assert_eq!(
            &y[r * cfg.q_lora_rank..(r + 1) * cfg.q_lora_rank],
            &want[..]
        );
    }
    let gw = cfg.heads_per_group() * cfg.head_dim;
    let o = fx::activations(&mut rng, 2, cfg.o_groups * gw);
    let wo = format!("layers.{LAYER}.attn.wo_a.weight");
    let z = wo_a_rows(&m.weights, &wo, &o, 2, cfg.o_groups, cfg.o_lora_rank).unwrap();
    let g1 = m
        .weights
        .matvec_rows(&wo, cfg.o_lora_rank, cfg.o_lora_rank, &o[gw..2 * gw])
        .unwrap();
    let r = cfg.o_lora_rank;
    for i in 0..r {
        assert_eq!(z[r + i], bf16_round(g1[i]));
    }
}

// ---- GPU ----------------------------------------------------------------------------------------------------

fn run_fp8(gpu: &megamoe::gpu::Gpu, model: &Model, name: &str, m: usize, rng: &mut ChaCha8Rng) {
    let w = DevFp8::from_model(gpu, model, name);
    let x = fx::activations(rng, m, w.cols);
    let dx = DevFp8::quantized(gpu, &x, m, w.cols);
    let (_arena, ws) = fx::workspace(
        gpu,
        &[DenseShape::new(DenseKind::Fp8, m, w.rows, w.cols, 1)],
    );
    let y = fx::bf16_out(gpu, m * w.rows);
    fp8_linear(gpu, &gpu.stream, &dx.act(), &w.weight(), &ws, &y).unwrap();
    let got = fx::download_bf16(gpu, &y);
    let want = fp8_linear_rows(model, name, &x, m).unwrap();
    let terms = abs_term_sums(&model.weights, name, 0, w.rows, &quantized_rows(&x, m), m).unwrap();
    fx::assert_close(
        &format!("{} {name} M={m}", model.config().name),
        &got,
        &want,
        &terms,
        w.cols,
        true,
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_fp8_linear_matches_the_model_at_flash_and_pro_shapes() {
    fx::on_flash_and_pro(
        "gpu_fp8_linear_matches_the_model_at_flash_and_pro_shapes",
        |gpu, rng, _cfg, model| {
            for name in fp8_names() {
                for m in [1, 3, 64] {
                    run_fp8(gpu, model, &name, m, rng);
                }
            }
        },
    );
}

/// Several FP8 weights of different heights on the same x in one launch (the engine's wq_a + wkv and wq_b +
/// indexer wq_b): each job's output within the same tolerance as its own call, outputs poisoned first so a job
/// that is not written (or written at another's stride) fails.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_fp8_linears_of_different_heights_match_the_model() {
    fx::on_flash_and_pro(
        "gpu_fp8_linears_of_different_heights_match_the_model",
        |gpu, rng, cfg, model| {
            let a = format!("layers.{LAYER}.attn");
            for names in [
                [format!("{a}.wq_a.weight"), format!("{a}.wkv.weight")],
                [
                    format!("{a}.wq_b.weight"),
                    format!("{a}.indexer.wq_b.weight"),
                ],
            ] {
                let ws_: Vec<DevFp8> = names
                    .iter()
                    .map(|n| DevFp8::from_model(gpu, model, n))
                    .collect();
                let k = ws_[0].cols;
                for m in [1, 3, 64] {
                    let x = fx::activations(rng, m, k);
                    let dx = DevFp8::quantized(gpu, &x, m, k);
                    let ys: Vec<_> = ws_.iter().map(|w| fx::bf16_out(gpu, m * w.rows)).collect();
                    let weights: Vec<_> = ws_.iter().map(|w| w.weight()).collect();
                    let jobs: Vec<Fp8Job> = weights
                        .iter()
                        .zip(&ys)
                        .map(|(w, y)| Fp8Job { w, y })
                        .collect();
                    // The launch's own plan: with heights that differ, fewer tiles are busy than jobs x the tallest.
                    let heights: Vec<usize> = ws_.iter().map(|w| w.rows).collect();
                    let (_arena, dws) = fx::workspace(
                        gpu,
                        &[DenseShape::of_heights(DenseKind::Fp8, m, k, &heights)],
                    );
                    fp8_linears(gpu, &gpu.stream, &dx.act(), &jobs, &dws).unwrap();
                    for ((name, w), y) in names.iter().zip(&ws_).zip(&ys) {
                        let got = fx::download_bf16(gpu, y);
                        let want = fp8_linear_rows(model, name, &x, m).unwrap();
                        let terms = abs_term_sums(
                            &model.weights,
                            name,
                            0,
                            w.rows,
                            &quantized_rows(&x, m),
                            m,
                        )
                        .unwrap();
                        fx::assert_close(
                            &format!(
                                "{} {name} M={m} (one launch with {})",
                                cfg.name,
                                names.join(", ")
                            ),
                            &got,
                            &want,
                            &terms,
                            k,
                            true,
                        );
                    }
                }
            }
        },
    );
}

/// The grouped wo_a against `Model::out_proj`'s per-group rows, at M = 1, 3, 64 and 100 (above the GEMV's 64 rows:
/// two launches of 64 and 36 rows, `dense::row_pieces`).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_wo_a_grouped_matches_out_proj_at_flash_and_pro_shapes() {
    fx::on_flash_and_pro(
        "gpu_wo_a_grouped_matches_out_proj_at_flash_and_pro_shapes",
        |gpu, rng, cfg, model| {
            let name = format!("layers.{LAYER}.attn.wo_a.weight");
            let w = DevFp8::from_model(gpu, model, &name);
            let (groups, r) = (cfg.o_groups, cfg.o_lora_rank);
            let gw = w.cols;
            for m in [1, 3, 64, 100] {
                let o = fx::activations(rng, m, groups * gw);
                let d_o = gpu.upload(&fx::to_bf16(&o)).unwrap();
                let (_arena, ws) = fx::workspace(
                    gpu,
                    &[DenseShape::new(DenseKind::Fp8Bf16x, m, r, gw, groups)],
                );
                let z = fx::bf16_out(gpu, m * groups * r);
                wo_a_grouped(gpu, &gpu.stream, &d_o, m, &w.weight(), groups, &ws, &z).unwrap();
                let got = fx::download_bf16(gpu, &z);
                let want = wo_a_rows(&model.weights, &name, &o, m, groups, r).unwrap();
                let mut terms = vec![0f64; m * groups * r];
                for g in 0..groups {
                    let og: Vec<f32> = (0..m)
                        .flat_map(|row| {
                            o[(row * groups + g) * gw..(row * groups + g + 1) * gw].to_vec()
                        })
                        .collect();
                    let t = abs_term_sums(&model.weights, &name, g * r, r, &og, m).unwrap();
                    for row in 0..m {
                        terms[row * groups * r + g * r..row * groups * r + (g + 1) * r]
                            .copy_from_slice(&t[row * r..(row + 1) * r]);
                    }
                }
                fx::assert_close(
                    &format!("{} wo_a M={m}", cfg.name),
                    &got,
                    &want,
                    &terms,
                    gw,
                    true,
                );
            }
        },
    );
}

/// The shared expert against `Model::expert(prefix, fp8_act_quant(x), 1.0)`. g and u may each round to the
/// neighbouring BF16 value of the CPU's (different summation order), which moves h by ~2^-8 relative and can move an
/// FP8 code of h by one step (2^-3 relative) for the elements near a rounding boundary (about 2^-8 / 2^-4 = 1/16
/// of them): the output's relative L2 error is then about sqrt(1/16) * 2^-4 ~ 1.6e-2 at worst; 3e-2 is allowed. A
/// layout or scale bug gives O(1). M = 100 is above the GEMV's 64 rows: the SwiGLU half in pieces of 64 and 36 rows,
/// w2 on the tensor cores (the weights carry f32 scales).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_shared_expert_matches_the_model_at_flash_and_pro_shapes() {
    fx::on_flash_and_pro(
        "gpu_shared_expert_matches_the_model_at_flash_and_pro_shapes",
        |gpu, rng, cfg, model| {
            let p = format!("layers.{LAYER}.ffn.shared_experts");
            let w1 = DevFp8::from_model(gpu, model, &format!("{p}.w1.weight"));
            let w3 = DevFp8::from_model(gpu, model, &format!("{p}.w3.weight"));
            let w2 = DevFp8::from_model(gpu, model, &format!("{p}.w2.weight"));
            let (d, inter) = (cfg.dim, cfg.moe_inter_dim);
            for m in [1, 3, 64, 100] {
                // Larger inputs so that the clamp at swiglu_limit (10) is reached by some g and u.
                let x: Vec<f32> = fx::activations(rng, m, d)
                    .iter()
                    .map(|v| bf16::from_f32(v * 4.0).to_f32())
                    .collect();
                let dx = DevFp8::quantized(gpu, &x, m, d);
                let (_arena, ws) = fx::workspace(
                    gpu,
                    &[
                        DenseShape::new(DenseKind::Swiglu, m, inter, d, 1),
                        DenseShape::new(DenseKind::Fp8, m, d, inter, 1),
                    ],
                );
                let hc = gpu.poisoned::<u8>(m * inter, common::POISON).unwrap();
                let hs = gpu.poisoned::<u8>(m * inter / 128, common::POISON).unwrap();
                let y = fx::bf16_out(gpu, m * d);
                let scratch = SharedExpertScratch {
                    h_codes: &hc,
                    h_scales: &hs,
                };
                shared_expert(
                    gpu,
                    &gpu.stream,
                    &dx.act(),
                    &w1.weight(),
                    &w3.weight(),
                    &w2.weight(),
                    cfg.swiglu_limit,
                    &ws,
                    &scratch,
                    &y,
                )
                .unwrap();
                let got = fx::download_bf16(gpu, &y);
                let want = shared_expert_rows(model, &p, &x, m).unwrap();
                let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
                common::assert_rel_l2(
                    &format!("{} shared expert M={m}", cfg.name),
                    &got,
                    &want64,
                    3e-2,
                );
                // h itself: no NaN scale or code (every block written).
                let hsc = gpu.download(&hs).unwrap();
                assert!(hsc.iter().all(|&s| s != 0xFF), "an h scale was not written");
            }
        },
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_bf16_linear_matches_matvec_for_compressor_indexer_and_head() {
    fx::on_flash_and_pro(
        "gpu_bf16_linear_matches_matvec_for_compressor_indexer_and_head",
        |gpu, rng, cfg, model| {
            let a = format!("layers.{LAYER}.attn");
            let sets: Vec<(Vec<String>, Vec<usize>)> = vec![
                (
                    vec![
                        format!("{a}.compressor.wkv.weight"),
                        format!("{a}.compressor.wgate.weight"),
                    ],
                    vec![1, 3, 64],
                ),
                (
                    vec![
                        format!("{a}.indexer.compressor.wkv.weight"),
                        format!("{a}.indexer.compressor.wgate.weight"),
                    ],
                    vec![1, 3, 64],
                ),
                (
                    vec![format!("{a}.indexer.weights_proj.weight")],
                    vec![1, 3, 64],
                ),
                (vec!["head.weight".to_string()], vec![1, 3]),
                // Different heights in one launch (each job its own output stride): the CSA layer's BF16
                // linears of `a`.
                (
                    vec![
                        format!("{a}.compressor.wkv.weight"),
                        format!("{a}.indexer.compressor.wkv.weight"),
                        format!("{a}.indexer.weights_proj.weight"),
                    ],
                    vec![1, 3, 64],
                ),
            ];
            let d = cfg.dim;
            for (names, ms) in sets {
                let ns: Vec<usize> = names
                    .iter()
                    .map(|nm| model.weights.spec(nm).unwrap().shape[0])
                    .collect();
                let dws: Vec<_> = names
                    .iter()
                    .map(|nm| {
                        let raw = model.weights.raw(nm).unwrap();
                        let v: Vec<bf16> = raw
                            .chunks_exact(2)
                            .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                            .collect();
                        gpu.upload(&v).unwrap()
                    })
                    .collect();
                for m in ms {
                    let x = fx::activations(rng, m, d);
                    let dx = gpu.upload(&fx::to_bf16(&x)).unwrap();
                    let ys: Vec<_> = ns
                        .iter()
                        .map(|&n| gpu.poisoned::<f32>(m * n, common::POISON).unwrap())
                        .collect();
                    let jobs: Vec<Bf16Job> = dws
                        .iter()
                        .zip(&ys)
                        .zip(&ns)
                        .map(|((w, y), &n)| Bf16Job { w, n, y })
                        .collect();
                    let (_arena, ws) =
                        fx::workspace(gpu, &[DenseShape::of_heights(DenseKind::Bf16, m, d, &ns)]);
                    bf16_linear(gpu, &gpu.stream, &dx, m, d, &jobs, &ws).unwrap();
                    gpu.synchronize().unwrap();
                    for ((nm, y), &n) in names.iter().zip(&ys).zip(&ns) {
                        let got = gpu.download(y).unwrap();
                        let want = matvec_rows(&model.weights, nm, &x, m).unwrap();
                        let terms = abs_term_sums(&model.weights, nm, 0, n, &x, m).unwrap();
                        fx::assert_close(
                            &format!("{} {nm} M={m}", cfg.name),
                            &got,
                            &want,
                            &terms,
                            d,
                            false,
                        );
                    }
                }
            }
        },
    );
}

/// Shapes at the edges of the rules: the smallest FP8 weight (128 x 128), K not a multiple of a split's slice, BF16
/// heights of 1 and 130 (not a multiple of the 128-row tile, 16-row warp tile), K = 64 and 192 (one step, a
/// 64-column tail slice), and M values between the token buckets. Synthetic weights through `formats::fp8` (the checkpoint's
/// rule); oracle: its dequantization and `numerics::dot`.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_edge_shapes_match_the_cpu() {
    let (gpu, mut rng) = fx::gpu_test("gpu_edge_shapes_match_the_cpu");
    for (n, k) in [(128, 128), (384, 640), (256, 1920)] {
        let wv = fx::activations(&mut rng, n, k);
        let wq = quantize_weight_128x128(&wv, n, k).unwrap();
        let wd = dequantize_weight_128x128(&wq);
        let w = DevFp8::from_parts(&gpu, &wq.data, &wq.scales, n, k);
        for m in [1, 9, 33, 64] {
            let x = fx::activations(&mut rng, m, k);
            let xq = quantized_rows(&x, m);
            let dx = DevFp8::quantized(&gpu, &x, m, k);
            let (_arena, ws) = fx::workspace(&gpu, &[DenseShape::new(DenseKind::Fp8, m, n, k, 1)]);
            let y = fx::bf16_out(&gpu, m * n);
            fp8_linear(&gpu, &gpu.stream, &dx.act(), &w.weight(), &ws, &y).unwrap();
            let got = fx::download_bf16(&gpu, &y);
            let (want, terms) = cpu_dense(&wd, &xq, m, n, k, true);
            fx::assert_close(&format!("fp8 {n}x{k} M={m}"), &got, &want, &terms, k, true);
        }
    }
    for (n, k) in [(1, 64), (130, 192), (64, 4096), (130, 4160)] {
        let wv = fx::activations(&mut rng, n, k);
        let dw = gpu.upload(&fx::to_bf16(&wv)).unwrap();
        for m in [1, 9, 64] {
            let x = fx::activations(&mut rng, m, k);
            let dx = gpu.upload(&fx::to_bf16(&x)).unwrap();
            let y = gpu.poisoned::<f32>(m * n, common::POISON).unwrap();
            let (_arena, ws) = fx::workspace(&gpu, &[DenseShape::new(DenseKind::Bf16, m, n, k, 1)]);
            let jobs = [Bf16Job { w: &dw, n, y: &y }];
            bf16_linear(&gpu, &gpu.stream, &dx, m, k, &jobs, &ws).unwrap();
            gpu.synchronize().unwrap();
            let got = gpu.download(&y).unwrap();
            let (want, terms) = cpu_dense(&wv, &x, m, n, k, false);
            fx::assert_close(
                &format!("bf16 {n}x{k} M={m}"),
                &got,
                &want,
                &terms,
                k,
                false,
            );
        }
    }
}

/// `y[m, r] = dot(W[r], x[m])` (rounded to BF16 when `round`) and the sums of |terms|.
fn cpu_dense(
    w: &[f32],
    x: &[f32],
    m: usize,
    n: usize,
    k: usize,
    round: bool,
) -> (Vec<f32>, Vec<f64>) {
    let mut y = Vec::with_capacity(m * n);
    let mut t = Vec::with_capacity(m * n);
    for row in 0..m {
        let xr = &x[row * k..(row + 1) * k];
        for r in 0..n {
            let wr = &w[r * k..(r + 1) * k];
            let v = dot(wr, xr);
            y.push(if round { bf16_round(v) } else { v });
            t.push(
                wr.iter()
                    .zip(xr)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum(),
            );
        }
    }
    (y, t)
}

/// wq_a (split-K: 8 row tiles on 132 SMs) captured once for the 8-row bucket; new x written on the device and the
/// output poisoned between replays, each replay checked against the model, and a plain call bit-identical to the
/// last replay (the split-K sum order does not depend on which CTA arrives last; the counters are reset each call).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_fp8_linear_replays_as_a_graph_with_new_activations() {
    let (gpu, mut rng) = fx::gpu_test("gpu_fp8_linear_replays_as_a_graph_with_new_activations");
    let cfg = ModelConfig::flash();
    let model = fx::model(cfg.clone(), &mut rng);
    let name = format!("layers.{LAYER}.attn.wq_a.weight");
    let w = DevFp8::from_model(&gpu, &model, &name);
    let m = 8;
    let s = DenseShape::new(DenseKind::Fp8, m, w.rows, w.cols, 1);
    assert!(plan(&s, gpu.info.sm_count as usize).unwrap().splits > 1);
    let mut x = fx::activations(&mut rng, m, w.cols);
    let mut dx = DevFp8::quantized(&gpu, &x, m, w.cols);
    let (_arena, ws) = fx::workspace(&gpu, &[s]);
    let mut y = fx::bf16_out(&gpu, m * w.rows);
    // One plain call first: the kernel is resolved (and its shared-memory attribute set) outside the capture.
    fp8_linear(&gpu, &gpu.stream, &dx.act(), &w.weight(), &ws, &y).unwrap();
    gpu.synchronize().unwrap();
    let graph = {
        let (xv, wv) = (dx.act(), w.weight());
        gpu.capture(|| fp8_linear(&gpu, &gpu.stream, &xv, &wv, &ws, &y))
            .unwrap()
    };
    let mut last = Vec::new();
    for replay in 0..3 {
        x = fx::activations(&mut rng, m, w.cols);
        dx.write(&gpu, &x);
        gpu.fill_bytes(&mut y, common::POISON).unwrap();
        graph.launch().unwrap();
        last = fx::download_bf16(&gpu, &y);
        let want = fp8_linear_rows(&model, &name, &x, m).unwrap();
        let terms =
            abs_term_sums(&model.weights, &name, 0, w.rows, &quantized_rows(&x, m), m).unwrap();
        fx::assert_close(
            &format!("replay {replay}"),
            &last,
            &want,
            &terms,
            w.cols,
            true,
        );
    }
    gpu.fill_bytes(&mut y, common::POISON).unwrap();
    fp8_linear(&gpu, &gpu.stream, &dx.act(), &w.weight(), &ws, &y).unwrap();
    let again = fx::download_bf16(&gpu, &y);
    common::assert_bit_identical("graph vs plain call", "y", &last, &again);
}

/// `megamoe exec dense_fp8_linear --cpu` on a checkpoint tensor of the small geometry gives the model's
/// `fp8_linear` bit for bit (the same dequantized values summed by the same `dot`); a misshapen scale is a clear
/// error. `dense_bf16_linear --cpu` gives `Weights::matvec`.
#[test]
fn exec_entries_run_the_model_math_on_the_cpu() {
    use megamoe::ops::exec::{HostTensor, TensorMap};
    use safetensors::Dtype;
    let mut rng = fx::seeded("exec_entries_run_the_model_math_on_the_cpu");
    let model = fx::model(ModelConfig::small(), &mut rng);
    let kernels = megamoe::ops::registry::exec_kernels();
    let find = |n: &str| kernels.iter().find(|k| k.name == n).unwrap();
    let name = format!("layers.{LAYER}.attn.wq_a.weight");
    let spec = model.weights.spec(&name).unwrap().clone();
    let (n, k) = (spec.shape[0], spec.shape[1]);
    let m = 3;
    let x = fx::activations(&mut rng, m, k);
    let mut inp = TensorMap::new();
    inp.insert(
        "x".into(),
        HostTensor::from_bf16(vec![m, k], &fx::to_bf16(&x)),
    );
    inp.insert(
        "w".into(),
        HostTensor::from_u8(
            Dtype::F8_E4M3,
            vec![n, k],
            model.weights.raw(&name).unwrap(),
        ),
    );
    let scale = format!("layers.{LAYER}.attn.wq_a.scale");
    let sbytes = model.weights.raw(&scale).unwrap();
    inp.insert(
        "w_scale".into(),
        HostTensor::from_u8(Dtype::F8_E8M0, vec![n / 128, k / 128], sbytes.clone()),
    );
    let out = (find("dense_fp8_linear").run)(&inp, None).unwrap();
    let want = fp8_linear_rows(&model, &name, &x, m).unwrap();
    assert_eq!(out["y"].to_f32().unwrap(), want);
    inp.insert(
        "w_scale".into(),
        HostTensor::from_u8(
            Dtype::U8,
            vec![n / 128 + 1, k / 128],
            vec![127; (n / 128 + 1) * (k / 128)],
        ),
    );
    let err = format!(
        "{:#}",
        (find("dense_fp8_linear").run)(&inp, None).unwrap_err()
    );
    assert!(err.contains("w_scale"), "{err}");

    let bname = format!("layers.{LAYER}.attn.indexer.weights_proj.weight");
    let bspec = model.weights.spec(&bname).unwrap().clone();
    let raw = model.weights.raw(&bname).unwrap();
    let wb: Vec<bf16> = raw
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]))
        .collect();
    let xb = fx::activations(&mut rng, m, bspec.shape[1]);
    let mut inp = TensorMap::new();
    inp.insert(
        "x".into(),
        HostTensor::from_bf16(vec![m, bspec.shape[1]], &fx::to_bf16(&xb)),
    );
    inp.insert("w".into(), HostTensor::from_bf16(bspec.shape.clone(), &wb));
    let out = (find("dense_bf16_linear").run)(&inp, None).unwrap();
    assert_eq!(
        out["y"].to_f32().unwrap(),
        matvec_rows(&model.weights, &bname, &xb, m).unwrap()
    );
}

/// Every sweep of bench-configs/dense.toml names the `dense` kernel with a shape its launcher accepts.
#[test]
fn bench_config_points_are_shapes_the_launchers_take() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-configs/dense.toml");
    let cfg = megamoe::bench::config::SweepConfig::from_path(&path).unwrap();
    let kernels = megamoe::bench::kernels::all();
    let k = kernels.iter().find(|k| k.name == "dense").unwrap();
    assert!(cfg.sweeps.len() >= 22);
    for s in &cfg.sweeps {
        assert_eq!(s.kernel, "dense");
        s.variants_from(k.variants).unwrap();
        for &v in &s.values {
            (k.check_point.unwrap())(s, v).unwrap();
        }
    }
    // cuBLASLt's block-scaled GEMM needs FP8 activations: a wo_a sweep that runs every variant is refused before
    // any GPU work, with the way out in the message.
    let wo_a = megamoe::bench::config::SweepConfig::from_toml_str(
        "[[sweep]]\nkernel = \"dense\"\naxis = \"rows\"\nvalues = [1]\n\
         [sweep.params]\nlinear = \"wo_a\"\ngroups = 8\nn = 1024\nk = 4096\n",
    )
    .unwrap();
    let err = (k.check_point.unwrap())(&wo_a.sweeps[0], 1).unwrap_err();
    assert!(
        format!("{err:#}").contains("cublaslt_block_scaled"),
        "{err:#}"
    );
}

// ---- the tensor-core route (ops::dense::route) --------------------------------------------------------------------

/// The rows of the routed GPU tests: 16 (the BF16 threshold), 32 (the FP8 threshold; a multiple of 4, so no tail),
/// 33 (32 rows in place plus the block-scaled GEMM's staged 4-row tail), 64 (the most).
const ROUTED_ROWS: [usize; 4] = [16, 32, 33, 64];

/// The tolerance of the tensor-core prefill test (tests/dense_prefill.rs, `check`), per element:
/// `|got - want| <= ulp + (2^-10 + 2 K 2^-24) * S`, `S = sum_k |x_k w_k|`, plus a relative L2 error below 1e-2 over
/// the output. Why: both sides compute the same exact products (e4m3 x e4m3 x powers of two; BF16 x BF16) and differ
/// only in how they sum them. The CPU's f32 sums over K terms are within K 2^-24 S of the exact sum; cuBLASLt's FP8
/// tensor cores accumulate each 128-term block with about 14 significant bits (DeepSeek-V3 report, 3.3.2) before
/// the f32 promotion with the scales, at most 2^-11 S per block's share, and the f32 sums over blocks (and any split
/// K) add K 2^-24 S: together within (2^-10 + 2 K 2^-24) S. The BF16 GEMM accumulates in f32 and is well inside the
/// same bound. `ulp`: one BF16 ulp of the value when the output is BF16 (the two sums may round to neighbouring BF16
/// values), 0 for the f32 outputs. A wrong layout, scale or row gives errors of the order of the values.
fn assert_tensor_core_close(
    label: &str,
    got: &[f32],
    want: &[f32],
    abs_terms: &[f64],
    k: usize,
    bf16_out: bool,
) {
    assert_eq!(got.len(), want.len(), "{label}: lengths differ");
    common::assert_all_written(label, got);
    let rel = 2f64.powi(-10) + 2.0 * k as f64 * 2f64.powi(-24);
    let mut worst = (0.0f64, 0usize);
    for i in 0..want.len() {
        let (g, w) = (got[i] as f64, want[i] as f64);
        let ulp = if bf16_out && w != 0.0 {
            bf16_ulp(want[i])
        } else {
            0.0
        };
        let tol = ulp + rel * abs_terms[i];
        let err = (g - w).abs();
        assert!(
            err <= tol,
            "{label}: element {i}: got {g}, the CPU model gives {w} (|diff| {err:.3e} > bound {tol:.3e}, \
             sum|x w| {:.3e})",
            abs_terms[i]
        );
        if tol > 0.0 && err / tol > worst.0 {
            worst = (err / tol, i);
        }
    }
    println!(
        "{label}: worst error {:.2} of its bound at {}",
        worst.0, worst.1
    );
    let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    common::assert_rel_l2(label, got, &want64, 1e-2);
}

/// The route a launch of `shape` on `ws` takes is `want`, and the measured rule (`DenseRoute::Auto`) sends the
/// shape where its table says (ops::dense::route: FP8 from 32 rows, BF16 from 16 rows or with 2^28 elements).
fn assert_route(label: &str, ws: &DenseWorkspace, shape: &DenseShape, want: DensePath) {
    assert_eq!(ws.path(shape, true), want, "{label}: the route taken");
    let auto = match shape.kind {
        DenseKind::Fp8 => shape.rows >= route::FP8_TC_MIN_ROWS,
        DenseKind::Bf16 => {
            shape.rows >= route::BF16_TC_MIN_ROWS
                || shape.n * shape.k >= route::BF16_TC_ALWAYS_ELEMENTS
        }
        _ => false,
    };
    let auto = if auto {
        DensePath::TensorCores
    } else {
        DensePath::Gemv
    };
    assert_eq!(route::auto_path(shape), auto, "{label}: the rule's table");
}

/// Evidence that the GEMV did not run a launch of `shape` on the freshly poisoned `ws`: when its plan splits K, its
/// partials would have been written; they are still the poison.
fn assert_gemv_untouched(
    gpu: &megamoe::gpu::Gpu,
    label: &str,
    ws: &DenseWorkspace,
    shape: &DenseShape,
) {
    let p = plan(shape, gpu.info.sm_count as usize).unwrap();
    if p.splits > 1 {
        let part = arena::download(&gpu.stream, &ws.part.sub(0, p.partial_floats(shape))).unwrap();
        assert!(
            part.iter().all(|v| v.to_bits() == u32::MAX),
            "{label}: the GEMV's split-K partials were written: the launch took the GEMV"
        );
    }
}

/// Evidence that the FP8 tensor-core route ran a launch of `m` rows of K = `k` on the freshly poisoned `ws`: the f32
/// activation scales it converts (the first region of `ws.tc`, `Fp8LinearWorkspace::within`) are written.
fn assert_fp8_route_ran(
    gpu: &megamoe::gpu::Gpu,
    label: &str,
    ws: &DenseWorkspace,
    m: usize,
    k: usize,
) {
    let n = (k / 128) * rows_in_place(m).max(4);
    let bytes = arena::download(&gpu.stream, &ws.tc.sub(0, 4 * n)).unwrap();
    let bad = bytes
        .chunks_exact(4)
        .filter(|b| !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite())
        .count();
    assert_eq!(
        bad, 0,
        "{label}: {bad} of {n} f32 activation scales of the tensor-core route are unwritten"
    );
}

fn run_fp8_routed(
    gpu: &megamoe::gpu::Gpu,
    model: &Model,
    name: &str,
    m: usize,
    rng: &mut ChaCha8Rng,
) {
    let label = format!("{} {name} M={m} tensor cores", model.config().name);
    let w = DevFp8::from_model(gpu, model, name);
    let x = fx::activations(rng, m, w.cols);
    let dx = DevFp8::quantized(gpu, &x, m, w.cols);
    let s = DenseShape::new(DenseKind::Fp8, m, w.rows, w.cols, 1);
    let (_arena, ws) = fx::workspace_on(gpu, &[s], DenseRoute::TensorCores);
    assert_route(&label, &ws, &s, DensePath::TensorCores);
    let y = fx::bf16_out(gpu, m * w.rows);
    fp8_linear(gpu, &gpu.stream, &dx.act(), &w.weight(), &ws, &y).unwrap();
    let got = fx::download_bf16(gpu, &y);
    assert_gemv_untouched(gpu, &label, &ws, &s);
    assert_fp8_route_ran(gpu, &label, &ws, m, w.cols);
    let want = fp8_linear_rows(model, name, &x, m).unwrap();
    let terms = abs_term_sums(&model.weights, name, 0, w.rows, &quantized_rows(&x, m), m).unwrap();
    assert_tensor_core_close(&label, &got, &want, &terms, w.cols, true);
}

/// `fp8_linears_of_bf16` (BF16 x made FP8 1x128 rows by the GEMV as it stages it) against norm_quant's kernel
/// then `fp8_linear` on its FP8 rows, bit for bit (the same rule and the same plan, so the same sums), both ways:
/// quantized (`Bf16Rows::Quantize` against `quantize_bf16_rows`) and normalized with a random norm weight
/// (`Bf16Rows::NormQuantize` against `rmsnorm_quant_into`; x scaled so that rstd is far from 1). For every FP8
/// linear of the geometry at 1, 3, 8, 17, 64 and 100 rows (two GEMV pieces), outputs poisoned first. On the GEMV
/// route the caller's `prepare` must not run and the FP8 scratch must stay poisoned; on the tensor-core route
/// (forced, from 16 rows) it must run, and the result is `fp8_linear`'s on the rows it wrote.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_fp8_linears_of_bf16_equal_norm_quant_then_fp8_linear() {
    use megamoe::ops::norm_quant::{self as nq, OutFormat, QuantBufs, RowsIn};
    // The FP8 rows of an output, borrowed (a CudaSlice clone would be a device copy).
    fn rows_of(o: &nq::NormOutputs) -> Fp8Rows<'_> {
        let QuantBufs::Fp8 { data, scales } = &o.q else {
            unreachable!("FP8 rows were allocated")
        };
        Fp8Rows {
            codes: data,
            scales,
            rows: o.rows,
            k: o.d,
        }
    }
    on_flash_and_small(
        "gpu_fp8_linears_of_bf16_equal_norm_quant_then_fp8_linear",
        |gpu, rng, cfg, model| {
            let eps = cfg.norm_eps;
            for name in fp8_names() {
                if name.contains("shared_experts.w1") {
                    continue; // w1 runs in the SwiGLU half
                }
                let w = DevFp8::from_model(gpu, model, &name);
                // A norm weight of K values.
                let nw: Vec<bf16> = fx::to_bf16(&fx::activations(rng, 1, w.cols));
                let dnw = gpu.upload(&nw).unwrap();
                for m in [1usize, 3, 8, 17, 64, 100] {
                    let x: Vec<f32> = fx::activations(rng, m, w.cols)
                        .iter()
                        .map(|v| v * 7.5)
                        .collect();
                    let dz = gpu.upload(&fx::to_bf16(&x)).unwrap();
                    for normalize in [false, true] {
                        for route in [DenseRoute::Gemv, DenseRoute::TensorCores] {
                            if route == DenseRoute::TensorCores && m < 16 {
                                continue;
                            }
                            let label =
                                format!("{} {name} M={m} norm {normalize} {route:?}", cfg.name);
                            let s = DenseShape::new(DenseKind::Fp8, m, w.rows, w.cols, 1);
                            let (_arena, ws) = fx::workspace_on(gpu, &[s], route);
                            // norm_quant's kernel into `q`.
                            let prep = |q: &nq::NormOutputs| {
                                if normalize {
                                    nq::rmsnorm_quant_into(
                                        gpu,
                                        &gpu.stream,
                                        RowsIn::Bf16(&dz),
                                        &dnw,
                                        eps,
                                        &q.view(),
                                    )
                                } else {
                                    nq::quantize_bf16_rows(gpu, &gpu.stream, &dz, &q.view())
                                }
                            };
                            let q = nq::NormOutputs::alloc_poisoned(gpu, OutFormat::Fp8, m, w.cols)
                                .unwrap();
                            prep(&q).unwrap();
                            let rows = rows_of(&q);
                            let want_y = fx::bf16_out(gpu, m * w.rows);
                            fp8_linear(gpu, &gpu.stream, &rows, &w.weight(), &ws, &want_y).unwrap();
                            let want = fx::download_bf16(gpu, &want_y);
                            // Under test, with a poisoned scratch and a `prepare` that records that it ran.
                            let scratch =
                                nq::NormOutputs::alloc_poisoned(gpu, OutFormat::Fp8, m, w.cols)
                                    .unwrap();
                            let srows = rows_of(&scratch);
                            let how = if normalize {
                                Bf16Rows::NormQuantize { weight: &dnw, eps }
                            } else {
                                Bf16Rows::Quantize
                            };
                            let ran = std::cell::Cell::new(false);
                            let y = fx::bf16_out(gpu, m * w.rows);
                            let wt = w.weight();
                            fp8_linears_of_bf16(
                                gpu,
                                &gpu.stream,
                                &dz,
                                how,
                                &srows,
                                || {
                                    ran.set(true);
                                    prep(&scratch)
                                },
                                &[Fp8Job { w: &wt, y: &y }],
                                &ws,
                            )
                            .unwrap();
                            let got = fx::download_bf16(gpu, &y);
                            let differ = common::differing_bits(&got, &want);
                            assert_eq!(
                                differ,
                                0,
                                "{label}: {differ} of {} outputs differ",
                                got.len()
                            );
                            // The path the launcher takes: above the GEMV's 64 rows the tensor cores take the
                            // call under either route (route.rs), and then the FP8 rows must be prepared.
                            let gemv = ws.path(&s, wt.scales_f32.is_some()) == DensePath::Gemv;
                            assert_eq!(ran.get(), !gemv, "{label}: prepare ran: {}", ran.get());
                            if gemv {
                                let QuantBufs::Fp8 { data, .. } = &scratch.q else {
                                    unreachable!("FP8 rows were allocated")
                                };
                                let codes = gpu.download(data).unwrap();
                                assert!(
                                    codes.iter().all(|&b| b == common::POISON),
                                    "{label}: the GEMV route wrote the FP8 scratch"
                                );
                            }
                        }
                    }
                }
            }
        },
    );
}

/// The DSV4-Flash and small geometries, each with its CPU model on fresh synthetic weights.
fn on_flash_and_small(
    test: &str,
    mut body: impl FnMut(&megamoe::gpu::Gpu, &mut ChaCha8Rng, &ModelConfig, &Model),
) {
    let (gpu, mut rng) = fx::gpu_test(test);
    for cfg in [ModelConfig::flash(), ModelConfig::small()] {
        let m = fx::model(cfg.clone(), &mut rng);
        body(&gpu, &mut rng, &cfg, &m);
    }
}

/// `fp8_linear` on the tensor-core route (forced, so that 16 rows run it too) for every FP8 linear the route takes
/// (wq_a, wq_b, wkv, wo_b, the indexer's wq_b, the shared expert's w2) at 16, 32, 33 and 64 rows, against
/// `Model::fp8_linear`, outputs and workspace poisoned first; the route taken is asserted (and evidenced: the GEMV's
/// partials untouched, the route's activation scales written).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_routed_fp8_linear_matches_the_model_on_the_tensor_cores() {
    on_flash_and_small(
        "gpu_routed_fp8_linear_matches_the_model_on_the_tensor_cores",
        |gpu, rng, _cfg, model| {
            for name in fp8_names() {
                if name.contains("shared_experts.w1") {
                    // w1 runs in the SwiGLU half, which stays on the GEMV.
                    continue;
                }
                for m in ROUTED_ROWS {
                    run_fp8_routed(gpu, model, &name, m, rng);
                }
            }
        },
    );
}

/// `fp8_linears` of two weights of different heights on one x (wq_a + wkv, wq_b + the indexer's wq_b) on the
/// tensor-core route: one GEMM per job on the scales converted once, each job within the tolerance, every output
/// poisoned first (a job written at another's height fails).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_routed_fp8_linears_of_different_heights_match_the_model() {
    on_flash_and_small(
        "gpu_routed_fp8_linears_of_different_heights_match_the_model",
        |gpu, rng, cfg, model| {
            let a = format!("layers.{LAYER}.attn");
            for names in [
                [format!("{a}.wq_a.weight"), format!("{a}.wkv.weight")],
                [
                    format!("{a}.wq_b.weight"),
                    format!("{a}.indexer.wq_b.weight"),
                ],
            ] {
                let ws_: Vec<DevFp8> = names
                    .iter()
                    .map(|n| DevFp8::from_model(gpu, model, n))
                    .collect();
                let k = ws_[0].cols;
                let n_max = ws_.iter().map(|w| w.rows).max().unwrap();
                for m in ROUTED_ROWS {
                    let label = format!("{} {} M={m} tensor cores", cfg.name, names.join(" + "));
                    let x = fx::activations(rng, m, k);
                    let dx = DevFp8::quantized(gpu, &x, m, k);
                    let ys: Vec<_> = ws_.iter().map(|w| fx::bf16_out(gpu, m * w.rows)).collect();
                    let weights: Vec<_> = ws_.iter().map(|w| w.weight()).collect();
                    let jobs: Vec<Fp8Job> = weights
                        .iter()
                        .zip(&ys)
                        .map(|(w, y)| Fp8Job { w, y })
                        .collect();
                    let s = DenseShape::new(DenseKind::Fp8, m, n_max, k, jobs.len());
                    let (_arena, dws) = fx::workspace_on(gpu, &[s], DenseRoute::TensorCores);
                    assert_route(&label, &dws, &s, DensePath::TensorCores);
                    fp8_linears(gpu, &gpu.stream, &dx.act(), &jobs, &dws).unwrap();
                    gpu.synchronize().unwrap();
                    assert_gemv_untouched(gpu, &label, &dws, &s);
                    assert_fp8_route_ran(gpu, &label, &dws, m, k);
                    for ((name, w), y) in names.iter().zip(&ws_).zip(&ys) {
                        let got = fx::download_bf16(gpu, y);
                        let want = fp8_linear_rows(model, name, &x, m).unwrap();
                        let terms = abs_term_sums(
                            &model.weights,
                            name,
                            0,
                            w.rows,
                            &quantized_rows(&x, m),
                            m,
                        )
                        .unwrap();
                        assert_tensor_core_close(
                            &format!("{label}: {name}"),
                            &got,
                            &want,
                            &terms,
                            k,
                            true,
                        );
                    }
                }
            }
        },
    );
}

/// Under the measured rule (`DenseRoute::Auto`) an FP8 launch below 32 rows stays on the GEMV and one of 32 or more
/// takes the tensor cores; a weight without f32 scales stays on the GEMV whatever the route (and its result is the
/// GEMV's, within the GEMV's own tolerance).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_auto_route_follows_the_rule_and_needs_f32_scales() {
    let (gpu, mut rng) = fx::gpu_test("gpu_auto_route_follows_the_rule_and_needs_f32_scales");
    let model = fx::model(ModelConfig::small(), &mut rng);
    let name = format!("layers.{LAYER}.attn.wq_a.weight");
    let w = DevFp8::from_model(&gpu, &model, &name);
    for m in ROUTED_ROWS {
        let s = DenseShape::new(DenseKind::Fp8, m, w.rows, w.cols, 1);
        let want = if m >= route::FP8_TC_MIN_ROWS {
            DensePath::TensorCores
        } else {
            DensePath::Gemv
        };
        let (_arena, ws) = fx::workspace_on(&gpu, &[s], DenseRoute::Auto);
        assert_route(&format!("auto M={m}"), &ws, &s, want);
        assert_eq!(
            ws.path(&s, false),
            DensePath::Gemv,
            "no f32 scales: the GEMV"
        );
        assert_eq!(
            ws.tc.is_empty(),
            want == DensePath::Gemv,
            "the route's scratch"
        );
        // Without f32 scales the launch is the GEMV's, on the same workspace.
        let bare = DevFp8::from_parts(
            &gpu,
            &gpu.download(&w.codes).unwrap(),
            &gpu.download(&w.scales).unwrap(),
            w.rows,
            w.cols,
        );
        let x = fx::activations(&mut rng, m, w.cols);
        let dx = DevFp8::quantized(&gpu, &x, m, w.cols);
        let y = fx::bf16_out(&gpu, m * w.rows);
        fp8_linear(&gpu, &gpu.stream, &dx.act(), &bare.weight(), &ws, &y).unwrap();
        let got = fx::download_bf16(&gpu, &y);
        let want = fp8_linear_rows(&model, &name, &x, m).unwrap();
        let terms =
            abs_term_sums(&model.weights, &name, 0, w.rows, &quantized_rows(&x, m), m).unwrap();
        fx::assert_close(
            &format!("auto M={m}, no f32 scales (GEMV)"),
            &got,
            &want,
            &terms,
            w.cols,
            true,
        );
    }
}

/// `bf16_linear` on the tensor-core route (forced at 16..64 rows; the LM head, which the rule sends there at every M,
/// also at 1 row): the compressors' wkv + wgate (two jobs), the indexer compressor's, weights_proj, three jobs of
/// different heights, and the LM head (at 1 and 16 rows: its CPU oracle is 0.5 G multiply-adds a row), each job one
/// cuBLASLt GEMM with an f32 output, against `Weights::matvec`.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_routed_bf16_linear_matches_matvec_on_the_tensor_cores() {
    on_flash_and_small(
        "gpu_routed_bf16_linear_matches_matvec_on_the_tensor_cores",
        |gpu, rng, cfg, model| {
            let a = format!("layers.{LAYER}.attn");
            let sets: Vec<(Vec<String>, Vec<usize>)> = vec![
                (
                    vec![
                        format!("{a}.compressor.wkv.weight"),
                        format!("{a}.compressor.wgate.weight"),
                    ],
                    ROUTED_ROWS.to_vec(),
                ),
                (
                    vec![
                        format!("{a}.indexer.compressor.wkv.weight"),
                        format!("{a}.indexer.compressor.wgate.weight"),
                    ],
                    ROUTED_ROWS.to_vec(),
                ),
                (
                    vec![format!("{a}.indexer.weights_proj.weight")],
                    ROUTED_ROWS.to_vec(),
                ),
                (
                    vec![
                        format!("{a}.compressor.wkv.weight"),
                        format!("{a}.indexer.compressor.wkv.weight"),
                        format!("{a}.indexer.weights_proj.weight"),
                    ],
                    ROUTED_ROWS.to_vec(),
                ),
                (vec!["head.weight".to_string()], vec![1, 16]),
            ];
            let d = cfg.dim;
            for (names, ms) in sets {
                let ns: Vec<usize> = names
                    .iter()
                    .map(|nm| model.weights.spec(nm).unwrap().shape[0])
                    .collect();
                let n_max = *ns.iter().max().unwrap();
                let dws: Vec<_> = names
                    .iter()
                    .map(|nm| {
                        let raw = model.weights.raw(nm).unwrap();
                        let v: Vec<bf16> = raw
                            .chunks_exact(2)
                            .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                            .collect();
                        gpu.upload(&v).unwrap()
                    })
                    .collect();
                for m in ms {
                    let label = format!("{} {} M={m} tensor cores", cfg.name, names.join(" + "));
                    let x = fx::activations(rng, m, d);
                    let dx = gpu.upload(&fx::to_bf16(&x)).unwrap();
                    let ys: Vec<_> = ns
                        .iter()
                        .map(|&n| gpu.poisoned::<f32>(m * n, common::POISON).unwrap())
                        .collect();
                    let jobs: Vec<Bf16Job> = dws
                        .iter()
                        .zip(&ys)
                        .zip(&ns)
                        .map(|((w, y), &n)| Bf16Job { w, n, y })
                        .collect();
                    let s = DenseShape::new(DenseKind::Bf16, m, n_max, d, names.len());
                    let (_arena, ws) = fx::workspace_on(gpu, &[s], DenseRoute::TensorCores);
                    assert_route(&label, &ws, &s, DensePath::TensorCores);
                    bf16_linear(gpu, &gpu.stream, &dx, m, d, &jobs, &ws).unwrap();
                    gpu.synchronize().unwrap();
                    assert_gemv_untouched(gpu, &label, &ws, &s);
                    for ((nm, y), &n) in names.iter().zip(&ys).zip(&ns) {
                        let got = gpu.download(y).unwrap();
                        let want = matvec_rows(&model.weights, nm, &x, m).unwrap();
                        let terms = abs_term_sums(&model.weights, nm, 0, n, &x, m).unwrap();
                        assert_tensor_core_close(
                            &format!("{label}: {nm}"),
                            &got,
                            &want,
                            &terms,
                            d,
                            false,
                        );
                    }
                }
            }
        },
    );
}

/// The shared expert with its w2 on the tensor-core route (the SwiGLU half stays on the GEMV) at 16, 32, 33 and 64
/// rows, against `Model::expert`, with the GEMV test's tolerance (relative L2 3e-2: its comment derives it from h's
/// FP8 codes moving by one step near rounding boundaries; the tensor cores' block sums move g, u and y by less).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_routed_shared_expert_matches_the_model() {
    on_flash_and_small(
        "gpu_routed_shared_expert_matches_the_model",
        |gpu, rng, cfg, model| {
            let p = format!("layers.{LAYER}.ffn.shared_experts");
            let w1 = DevFp8::from_model(gpu, model, &format!("{p}.w1.weight"));
            let w3 = DevFp8::from_model(gpu, model, &format!("{p}.w3.weight"));
            let w2 = DevFp8::from_model(gpu, model, &format!("{p}.w2.weight"));
            let (d, inter) = (cfg.dim, cfg.moe_inter_dim);
            for m in ROUTED_ROWS {
                let label = format!("{} shared expert M={m}, w2 on the tensor cores", cfg.name);
                let x: Vec<f32> = fx::activations(rng, m, d)
                    .iter()
                    .map(|v| bf16::from_f32(v * 4.0).to_f32())
                    .collect();
                let dx = DevFp8::quantized(gpu, &x, m, d);
                let shapes = [
                    DenseShape::new(DenseKind::Swiglu, m, inter, d, 1),
                    DenseShape::new(DenseKind::Fp8, m, d, inter, 1),
                ];
                let (_arena, ws) = fx::workspace_on(gpu, &shapes, DenseRoute::TensorCores);
                assert_route(&label, &ws, &shapes[0], DensePath::Gemv);
                assert_route(&label, &ws, &shapes[1], DensePath::TensorCores);
                let hc = gpu.poisoned::<u8>(m * inter, common::POISON).unwrap();
                let hs = gpu.poisoned::<u8>(m * inter / 128, common::POISON).unwrap();
                let y = fx::bf16_out(gpu, m * d);
                let scratch = SharedExpertScratch {
                    h_codes: &hc,
                    h_scales: &hs,
                };
                shared_expert(
                    gpu,
                    &gpu.stream,
                    &dx.act(),
                    &w1.weight(),
                    &w3.weight(),
                    &w2.weight(),
                    cfg.swiglu_limit,
                    &ws,
                    &scratch,
                    &y,
                )
                .unwrap();
                let got = fx::download_bf16(gpu, &y);
                assert_fp8_route_ran(gpu, &label, &ws, m, inter);
                let want = shared_expert_rows(model, &p, &x, m).unwrap();
                let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
                common::assert_rel_l2(&label, &got, &want64, 3e-2);
            }
        },
    );
}

/// The tensor-core route inside a CUDA graph: wq_a at 33 rows (in place + staged tail: the scale converter, two
/// GEMMs, the tail copies) and weights_proj at 33 rows (a BF16 GEMM) captured once after one eager call (which
/// creates the cuBLASLt plans and loads the converter's module outside the capture), replayed with new activations
/// and poisoned outputs, each replay checked against the model, and a plain call bit-identical to the last replay.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_routed_linears_replay_as_a_graph_with_new_activations() {
    let (gpu, mut rng) = fx::gpu_test("gpu_routed_linears_replay_as_a_graph_with_new_activations");
    let cfg = ModelConfig::flash();
    let model = fx::model(cfg.clone(), &mut rng);
    let fname = format!("layers.{LAYER}.attn.wq_a.weight");
    let bname = format!("layers.{LAYER}.attn.indexer.weights_proj.weight");
    let w = DevFp8::from_model(&gpu, &model, &fname);
    let bn = model.weights.spec(&bname).unwrap().shape[0];
    let raw = model.weights.raw(&bname).unwrap();
    let bw: Vec<bf16> = raw
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]))
        .collect();
    let dbw = gpu.upload(&bw).unwrap();
    let (m, d) = (33, cfg.dim);
    let shapes = [
        DenseShape::new(DenseKind::Fp8, m, w.rows, w.cols, 1),
        DenseShape::new(DenseKind::Bf16, m, bn, d, 1),
    ];
    let (_arena, ws) = fx::workspace_on(&gpu, &shapes, DenseRoute::Auto);
    assert_route("graph fp8", &ws, &shapes[0], DensePath::TensorCores);
    assert_route("graph bf16", &ws, &shapes[1], DensePath::TensorCores);
    let mut x = fx::activations(&mut rng, m, w.cols);
    let mut dx = DevFp8::quantized(&gpu, &x, m, w.cols);
    let mut xb = fx::activations(&mut rng, m, d);
    let mut dxb = gpu.upload(&fx::to_bf16(&xb)).unwrap();
    let mut y = fx::bf16_out(&gpu, m * w.rows);
    let mut yb = gpu.poisoned::<f32>(m * bn, common::POISON).unwrap();
    let work = |dx: &DevFp8,
                dxb: &cudarc::driver::CudaSlice<bf16>,
                y: &cudarc::driver::CudaSlice<bf16>,
                yb: &cudarc::driver::CudaSlice<f32>| {
        fp8_linear(&gpu, &gpu.stream, &dx.act(), &w.weight(), &ws, y)?;
        bf16_linear(
            &gpu,
            &gpu.stream,
            dxb,
            m,
            d,
            &[Bf16Job {
                w: &dbw,
                n: bn,
                y: yb,
            }],
            &ws,
        )
    };
    work(&dx, &dxb, &y, &yb).unwrap();
    gpu.synchronize().unwrap();
    let graph = gpu.capture(|| work(&dx, &dxb, &y, &yb)).unwrap();
    let (mut last, mut last_b) = (Vec::new(), Vec::new());
    for replay in 0..3 {
        x = fx::activations(&mut rng, m, w.cols);
        dx.write(&gpu, &x);
        xb = fx::activations(&mut rng, m, d);
        gpu.write(&gpu.stream, &mut dxb, &fx::to_bf16(&xb)).unwrap();
        gpu.fill_bytes(&mut y, common::POISON).unwrap();
        gpu.fill_bytes(&mut yb, common::POISON).unwrap();
        graph.launch().unwrap();
        last = fx::download_bf16(&gpu, &y);
        last_b = gpu.download(&yb).unwrap();
        let want = fp8_linear_rows(&model, &fname, &x, m).unwrap();
        let terms =
            abs_term_sums(&model.weights, &fname, 0, w.rows, &quantized_rows(&x, m), m).unwrap();
        assert_tensor_core_close(
            &format!("replay {replay}: wq_a"),
            &last,
            &want,
            &terms,
            w.cols,
            true,
        );
        let want_b = matvec_rows(&model.weights, &bname, &xb, m).unwrap();
        let terms_b = abs_term_sums(&model.weights, &bname, 0, bn, &xb, m).unwrap();
        assert_tensor_core_close(
            &format!("replay {replay}: weights_proj"),
            &last_b,
            &want_b,
            &terms_b,
            d,
            false,
        );
    }
    gpu.fill_bytes(&mut y, common::POISON).unwrap();
    gpu.fill_bytes(&mut yb, common::POISON).unwrap();
    work(&dx, &dxb, &y, &yb).unwrap();
    let again = fx::download_bf16(&gpu, &y);
    let again_b = gpu.download(&yb).unwrap();
    common::assert_bit_identical("graph vs plain call", "wq_a y", &last, &again);
    common::assert_bit_identical("graph vs plain call", "weights_proj y", &last_b, &again_b);
}

/// The workspace layout follows the route in force: the GEMV's (the default) has no tensor-core region, so the
/// engine's arenas are unchanged by default; the measured rule adds one only where a shape takes the tensor cores
/// (cuBLASLt's workspace cap, plus the FP8 route's scales and tail staging).
#[test]
fn workspace_layouts_carry_the_tensor_core_region_only_on_that_route() {
    let sms = 132;
    let gemv_only = [DenseShape::new(DenseKind::Fp8, 8, 1024, 4096, 2)];
    let fp8_64 = [DenseShape::new(DenseKind::Fp8, 64, 1024, 4096, 2)];
    let head = [DenseShape::new(DenseKind::Bf16, 1, 129280, 4096, 1)];
    let bytes =
        |route, s: &[DenseShape]| with_route(route, || workspace_layout(s, sms).unwrap().bytes());
    for s in [&gemv_only[..], &fp8_64[..], &head[..]] {
        assert_eq!(
            bytes(DenseRoute::Gemv, s),
            workspace_layout(s, sms).unwrap().bytes()
        );
    }
    assert_eq!(
        bytes(DenseRoute::Auto, &gemv_only),
        bytes(DenseRoute::Gemv, &gemv_only)
    );
    let fp8_extra = bytes(DenseRoute::Auto, &fp8_64) - bytes(DenseRoute::Gemv, &fp8_64);
    assert_eq!(
        fp8_extra,
        Fp8LinearWorkspace::layout(64, 1024, 4096, ROUTE_CUBLAS_BYTES).bytes()
    );
    let head_extra = bytes(DenseRoute::Auto, &head) - bytes(DenseRoute::Gemv, &head);
    assert_eq!(head_extra, ROUTE_CUBLAS_BYTES);
    // Forced, the 8-row FP8 launch takes the tensor cores too.
    assert!(bytes(DenseRoute::TensorCores, &gemv_only) > bytes(DenseRoute::Gemv, &gemv_only));
}
