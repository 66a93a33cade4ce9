//! A few criterion regression benches (the sweeps live in `megamoe bench`): NVFP4 quantize/dequantize of a
//! 4096 x 4096 BF16 matrix, timed with CUDA events through `iter_custom`. Without a GPU they print SKIP.
//! Run on the GPU machine with `--bench` (without it criterion only smoke-tests each bench once).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use megamoe::gpu::timing::TimingPlan;
use megamoe::gpu::Gpu;
use megamoe::ops::inputs;
use megamoe::ops::nvfp4::{dequantize_rows_into, quantize_rows_into, Nvfp4Device, RowsInput};

fn nvfp4(c: &mut Criterion) {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIP benches/regress: {e:#}");
            return;
        }
    };
    let (rows, cols) = (4096, 4096);
    let x: Vec<bf16> = inputs::activation_rows(rows, cols, 1)
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    let dx = gpu.upload(&x).unwrap();
    let mut q = Nvfp4Device::alloc(&gpu, rows, cols).unwrap();
    let mut y = gpu.zeros::<bf16>(rows * cols).unwrap();
    let mut g = c.benchmark_group("nvfp4_4096x4096");
    g.throughput(Throughput::Bytes(
        (rows * cols * 2 + Nvfp4Device::bytes(rows, cols)) as u64,
    ));
    g.sample_size(20);
    g.bench_function("quantize_bf16", |b| {
        b.iter_custom(|iters| {
            let plan = TimingPlan {
                warmup: 1,
                reps: 1,
                flush_l2: false,
            };
            let us = gpu
                .time_us(plan, || {
                    for _ in 0..iters {
                        quantize_rows_into(&gpu, &gpu.stream, RowsInput::Bf16(&dx), &mut q)?;
                    }
                    Ok(())
                })
                .unwrap();
            Duration::from_secs_f64(us[0] * 1e-6)
        })
    });
    g.bench_function("dequantize_bf16", |b| {
        b.iter_custom(|iters| {
            let plan = TimingPlan {
                warmup: 1,
                reps: 1,
                flush_l2: false,
            };
            let us = gpu
                .time_us(plan, || {
                    for _ in 0..iters {
                        dequantize_rows_into(&gpu, &gpu.stream, &q, &mut y)?;
                    }
                    Ok(())
                })
                .unwrap();
            Duration::from_secs_f64(us[0] * 1e-6)
        })
    });
    g.finish();
}

criterion_group!(benches, nvfp4);
criterion_main!(benches);
