//! Expert parallelism's combine kernel (kernels/ep_combine.cu `ep_combine`, `ops::ep::combine`) against its CPU twin
//! `engine::ep::combine_partials`, bit for bit, with W = 1, 2 and 4 partial sets on one GPU (the kernel needs no
//! communication: it is fed the `[W, elems]` buffer an all-gather would leave).
//!
//! Exact equality holds because both evaluate the same f32 expression in the same order: `((p_0 + p_1) + ...) +
//! shared`, each add rounded to nearest, then one round-to-nearest-even BF16 rounding. The inputs mix magnitudes over
//! ~20 binades (so the order matters, and a kernel that summed in another order would fail) and contain BF16 ties
//! built so that the rank order decides the rounding.

mod common;

use common::{assert_bit_identical, gpu, seeded, POISON};
use half::bf16;
use megamoe::engine::ep::combine_partials;
use megamoe::gpu::DeviceBuf;
use megamoe::ops::ep;
use rand::Rng;

#[test]
#[ignore = "needs an H100/H200"]
fn combine_matches_its_cpu_twin_bit_for_bit() {
    let gpu = gpu("ep_combine");
    let mut rng = seeded("ep_combine", "MEGAMOE_SEED");
    // 3 tokens of D = 512, plus an odd tail so the grid-stride loop's last block is partial.
    let elems = 3 * 512 + 37;
    for world in [1usize, 2, 4] {
        for with_shared in [true, false] {
            let mut partials: Vec<Vec<f32>> = (0..world)
                .map(|_| {
                    (0..elems)
                        .map(|_| {
                            let m: f32 = rng.random_range(-1.0..1.0);
                            m * 2f32.powi(rng.random_range(-12..8))
                        })
                        .collect()
                })
                .collect();
            // Order-sensitive ties (ep.rs's unit test): p_0 = 1 + 2^-8 sits on a BF16 tie; two 2^-24 added one at a
            // time leave it there (rounds to 1), added together first push it up.
            if world >= 2 {
                for i in (0..elems).step_by(97) {
                    partials[0][i] = 1.0 + 2f32.powi(-8);
                    for p in partials.iter_mut().skip(1) {
                        p[i] = 2f32.powi(-24);
                    }
                }
            }
            // A token with no owned pair on some rank: a zero row.
            for v in &mut partials[world - 1][..512] {
                *v = 0.0;
            }
            let shared: Vec<bf16> = (0..elems)
                .map(|_| bf16::from_f32(rng.random_range(-4.0f32..4.0)))
                .collect();
            let shared_f32: Vec<f32> = if with_shared {
                shared.iter().map(|v| v.to_f32()).collect()
            } else {
                vec![0.0; elems]
            };
            let want: Vec<bf16> = combine_partials(&partials, &shared_f32)
                .unwrap()
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect();

            let flat: Vec<f32> = partials.concat();
            let d_partials = gpu.upload(&flat).unwrap();
            let d_shared = gpu.upload(&shared).unwrap();
            let d_out = gpu.poisoned::<bf16>(elems, POISON).unwrap();
            let shared_arg = with_shared.then_some(&d_shared as &dyn DeviceBuf<bf16>);
            ep::combine(
                &gpu,
                &gpu.stream,
                &d_partials,
                world,
                elems,
                shared_arg,
                &d_out,
            )
            .unwrap();
            let got = gpu.download(&d_out).unwrap();
            let label = format!("W = {world}, shared expert {with_shared}");
            let differ = want
                .iter()
                .zip(&got)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            println!("{label}: {elems} elements, {differ} differ from the CPU twin");
            assert_bit_identical(&label, "combine output vs combine_partials", &want, &got);
        }
    }
    // The launcher refuses buffers too small for the shape.
    let small = gpu.upload(&[0f32; 10]).unwrap();
    let out = gpu.poisoned::<bf16>(10, POISON).unwrap();
    assert!(ep::combine(&gpu, &gpu.stream, &small, 2, 10, None, &out).is_err());
}
