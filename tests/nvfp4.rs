//! The nvfp4 family's kernels against the CPU codecs, bit for bit: NVFP4 quantize-rows (per-row global scale,
//! software e2m1 rounding) and NVFP4 -> BF16 dequantize, over every code and over random rows of odd sizes, on
//! the GPU's stream and on a second one; and the 16-byte copy kernel of the limits probe. Every test needs a
//! GPU (ignored on a CPU machine; run with `--include-ignored`).

mod common;

use half::bf16;
use megamoe::formats::nvfp4::{self, Nvfp4Rows};
use megamoe::formats::{e2m1, e4m3};
use megamoe::ops::inputs;
use megamoe::ops::nvfp4::{self as gpu_nvfp4, Nvfp4Device, RowsInput};
use rand::Rng;

/// First index where two byte/word slices differ, with both values, for the failure message.
fn first_diff<T: PartialEq + std::fmt::Debug>(a: &[T], b: &[T]) -> Option<(usize, String)> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .map(|i| (i, format!("gpu {:?} cpu {:?}", a[i], b[i])))
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_dequantize_every_code_bit_exact() {
    let gpu = common::gpu("gpu_dequantize_every_code_bit_exact");
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
#[ignore = "needs an H100/H200"]
fn gpu_quantize_every_e2m1_code_and_scale_bit_exact() {
    let gpu = common::gpu("gpu_quantize_every_e2m1_code_and_scale_bit_exact");
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
#[ignore = "needs an H100/H200"]
fn gpu_quantize_random_rows_odd_sizes_bit_exact() {
    let gpu = common::gpu("gpu_quantize_random_rows_odd_sizes_bit_exact");
    let seed = inputs::fresh_seed("gpu_quantize_random_rows_odd_sizes_bit_exact", "NVFP4_SEED");
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
#[ignore = "needs an H100/H200"]
fn gpu_quantize_rejects_bad_input_before_launch() {
    let gpu = common::gpu("gpu_quantize_rejects_bad_input_before_launch");
    let e = gpu_nvfp4::quantize_rows(&gpu, &[1.0; 24], 1, 24).unwrap_err();
    assert!(format!("{e:#}").contains("multiple of 16"), "{e:#}");
    let mut x = vec![1.0; 32];
    x[5] = f32::NAN;
    let e = gpu_nvfp4::quantize_rows(&gpu, &x, 1, 32).unwrap_err();
    assert!(format!("{e:#}").contains("non-finite"), "{e:#}");
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_launchers_run_on_a_second_stream() {
    let gpu = common::gpu("gpu_launchers_run_on_a_second_stream");
    let stream = gpu.new_stream().unwrap();
    let (rows, cols) = (33, 160);
    let seed = inputs::fresh_seed("gpu_launchers_run_on_a_second_stream", "NVFP4_SEED");
    let x: Vec<bf16> = inputs::activation_rows(rows, cols, seed)
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    let dx = gpu.upload(&x).unwrap();
    let mut q = Nvfp4Device::alloc(&gpu, rows, cols).unwrap();
    let mut y = gpu.poisoned::<bf16>(rows * cols, common::POISON).unwrap();
    // Uploads and poisoning ran on the GPU's own stream: finish them before the second stream reads them.
    gpu.synchronize().unwrap();
    gpu_nvfp4::quantize_rows_into(&gpu, &stream, RowsInput::Bf16(&dx), &mut q).unwrap();
    gpu_nvfp4::dequantize_rows_into(&gpu, &stream, &q, &mut y).unwrap();
    stream.synchronize().unwrap();
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let c = nvfp4::quantize_rows(&xf, rows, cols).unwrap();
    let g = q.download(&gpu).unwrap();
    common::assert_bit_identical("second stream", "block scales", &c.scales, &g.scales);
    common::assert_bit_identical("second stream", "packed codes", &c.data, &g.data);
    common::assert_bit_identical(
        "second stream",
        "global scales",
        &c.global_scale,
        &g.global_scale,
    );
    let cd: Vec<bf16> = nvfp4::dequantize_rows(&c)
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    common::assert_bit_identical(
        "second stream",
        "dequantized",
        &cd,
        &gpu.download(&y).unwrap(),
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_copy_kernel_copies_whole_16_byte_words_only() {
    let gpu = common::gpu("gpu_copy_kernel_copies_whole_16_byte_words_only");
    let mut rng = common::seeded(
        "gpu_copy_kernel_copies_whole_16_byte_words_only",
        "NVFP4_SEED",
    );
    // Empty, one partial word, a few words plus a tail, and more words than the grid's threads (grid-stride).
    let grid_words = gpu.info.sm_count as usize * 8 * 256;
    for n in [0usize, 15, 16, 16 * 5 + 7, 16 * (grid_words + 3) + 9] {
        // At least one byte per buffer (an empty device allocation is not a buffer); the byte of the empty
        // case is not a whole word and must not be copied.
        let src: Vec<u8> = (0..n.max(1)).map(|_| rng.random::<u8>()).collect();
        let dsrc = gpu.upload(&src).unwrap();
        let mut dst = gpu.poisoned::<u8>(n.max(1), common::POISON).unwrap();
        gpu_nvfp4::copy_u128(&gpu, &gpu.stream, &dsrc, &mut dst).unwrap();
        let got = gpu.download(&dst).unwrap();
        let whole = n / 16 * 16;
        common::assert_bit_identical(
            &format!("{n} bytes"),
            "whole words",
            &src[..whole],
            &got[..whole],
        );
        assert!(
            got[whole..].iter().all(|&b| b == common::POISON),
            "{n} bytes: the tail past the last whole word must stay untouched"
        );
    }
}
