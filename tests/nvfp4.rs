//! The foundation's GPU smoke kernels against the CPU codecs, bit for bit: NVFP4 quantize-rows (per-row global
//! scale, software e2m1 rounding) and NVFP4 -> BF16 dequantize, over every code and over random rows of odd
//! sizes. Without a GPU these print SKIP (REQUIRE_GPU=1 makes that a failure).

use half::bf16;
use megamoe::formats::nvfp4::{self, Nvfp4Rows};
use megamoe::formats::{e2m1, e4m3};
use megamoe::gpu::gpu_for_test;
use megamoe::ops::{inputs, nvfp4 as gpu_nvfp4};

/// First index where two byte/word slices differ, with both values, for the failure message.
fn first_diff<T: PartialEq + std::fmt::Debug>(a: &[T], b: &[T]) -> Option<(usize, String)> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .map(|i| (i, format!("gpu {:?} cpu {:?}", a[i], b[i])))
}

#[test]
fn gpu_dequantize_every_code_bit_exact() {
    let Some(gpu) = gpu_for_test("gpu_dequantize_every_code_bit_exact") else {
        return;
    };
    // One row per e4m3 scale code (all 256, NaN codes included: the GPU must reproduce the CPU's NaN too),
    // each row holding all 16 e2m1 codes twice (32 columns = 2 blocks with the same scale).
    let rows = 256;
    let cols = 32;
    let mut data = Vec::with_capacity(rows * cols / 2);
    let mut scales = Vec::with_capacity(rows * 2);
    let mut gs = Vec::with_capacity(rows);
    for s in 0..rows {
        for pair in 0..cols / 2 {
            let lo = (2 * pair % 16) as u8;
            data.push(e2m1::pack(lo, lo + 1));
        }
        scales.extend([s as u8, s as u8]);
        gs.push(if s % 3 == 0 {
            1.0
        } else {
            0.37 * (s as f32 + 1.0).recip()
        });
    }
    let q = Nvfp4Rows {
        rows,
        cols,
        data,
        scales,
        global_scale: gs,
    };
    let gpu_out = gpu_nvfp4::dequantize_rows(&gpu, &q).unwrap();
    let cpu_out: Vec<bf16> = nvfp4::dequantize_rows(&q)
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    let g: Vec<u16> = gpu_out.iter().map(|v| v.to_bits()).collect();
    let c: Vec<u16> = cpu_out.iter().map(|v| v.to_bits()).collect();
    // NaN payloads may differ between the two; compare NaN-ness there and bits elsewhere.
    for i in 0..g.len() {
        let (gv, cv) = (gpu_out[i].to_f32(), cpu_out[i].to_f32());
        if cv.is_nan() {
            assert!(gv.is_nan(), "element {i}: cpu NaN, gpu {gv}");
        } else {
            assert_eq!(
                g[i],
                c[i],
                "element {i} (scale code {:#x}): gpu {gv} cpu {cv}",
                i / cols
            );
        }
    }
    assert!(e4m3::decode(0x7F).is_nan());
}

#[test]
fn gpu_quantize_every_e2m1_code_and_scale_bit_exact() {
    let Some(gpu) = gpu_for_test("gpu_quantize_every_e2m1_code_and_scale_bit_exact") else {
        return;
    };
    // Rows built from exact NVFP4 values: every e2m1 code times a range of block magnitudes, plus midpoints
    // between neighbouring codes (ties) to exercise round-to-nearest-even.
    let cols = 64;
    let mut x = Vec::new();
    for s in 0..120u32 {
        let scale = (2.0f32).powi(s as i32 / 4 - 15) * [1.0, 1.25, 1.5, 1.75][s as usize % 4];
        for c in 0..cols {
            let code = (c % 16) as u8;
            let v = e2m1::decode(code) * scale;
            // odd columns: the midpoint towards the next magnitude
            let next = e2m1::decode(((code & 7) + 1).min(7) | (code & 8)) * scale;
            x.push(if c % 2 == 1 { (v + next) / 2.0 } else { v });
        }
    }
    let rows = x.len() / cols;
    let g = gpu_nvfp4::quantize_rows(&gpu, &x, rows, cols).unwrap();
    let c = nvfp4::quantize_rows(&x, rows, cols).unwrap();
    assert_eq!(
        g.global_scale
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        c.global_scale
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        "global scales"
    );
    if let Some((i, m)) = first_diff(&g.scales, &c.scales) {
        panic!("block scale {i} (row {}): {m}", i / (cols / 16));
    }
    if let Some((i, m)) = first_diff(&g.data, &c.data) {
        panic!(
            "packed byte {i} (row {}, cols {}..{}): {m}",
            i / (cols / 2),
            2 * (i % (cols / 2)),
            2 * (i % (cols / 2)) + 1
        );
    }
}

#[test]
fn gpu_quantize_random_rows_odd_sizes_bit_exact() {
    let Some(gpu) = gpu_for_test("gpu_quantize_random_rows_odd_sizes_bit_exact") else {
        return;
    };
    let seed = 0xC0DE_0001u64 ^ std::process::id() as u64;
    eprintln!("seed {seed:#x}");
    for (i, &(rows, cols)) in [
        (1, 16),
        (3, 48),
        (127, 4096),
        (129, 7168),
        (7, 16 * 129),
        (1000, 272),
    ]
    .iter()
    .enumerate()
    {
        let x = inputs::activation_rows(rows, cols, seed + i as u64);
        let g = gpu_nvfp4::quantize_rows(&gpu, &x, rows, cols).unwrap();
        let c = nvfp4::quantize_rows(&x, rows, cols).unwrap();
        for r in 0..rows {
            assert_eq!(
                g.global_scale[r].to_bits(),
                c.global_scale[r].to_bits(),
                "{rows}x{cols} row {r} global scale: gpu {} cpu {}",
                g.global_scale[r],
                c.global_scale[r]
            );
        }
        if let Some((j, m)) = first_diff(&g.scales, &c.scales) {
            panic!("{rows}x{cols}: block scale {j}: {m}");
        }
        if let Some((j, m)) = first_diff(&g.data, &c.data) {
            panic!(
                "{rows}x{cols}: packed byte {j} (row {}): {m}",
                j / (cols / 2)
            );
        }
        // And the round trip through the GPU dequantizer equals the CPU one bit for bit.
        let gd = gpu_nvfp4::dequantize_rows(&gpu, &g).unwrap();
        let cd: Vec<bf16> = nvfp4::dequantize_rows(&c)
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        if let Some((j, m)) = first_diff(&gd, &cd) {
            panic!("{rows}x{cols}: dequantized element {j}: {m}");
        }
    }
}

#[test]
fn gpu_quantize_rejects_bad_input_before_launch() {
    let Some(gpu) = gpu_for_test("gpu_quantize_rejects_bad_input_before_launch") else {
        return;
    };
    let e = gpu_nvfp4::quantize_rows(&gpu, &[1.0; 24], 1, 24).unwrap_err();
    assert!(format!("{e:#}").contains("multiple of 16"), "{e:#}");
    let mut x = vec![1.0; 32];
    x[5] = f32::NAN;
    let e = gpu_nvfp4::quantize_rows(&gpu, &x, 1, 32).unwrap_err();
    assert!(format!("{e:#}").contains("non-finite"), "{e:#}");
}
