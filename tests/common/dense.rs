//! Fixtures of the dense tests (tests/dense.rs): the synthetic DSV4 model the CPU oracle runs, its weights on the
//! device, seeded activation rows (BF16 values; FP8 1x128 rows with norm_quant's rule), the workspace, and the
//! element-wise comparison against `ops::dense::reference::tolerance`.

use cudarc::driver::CudaSlice;
use half::bf16;
use megamoe::formats::fp8::quantize_act_1x128;
use megamoe::gpu::arena::Arena;
use megamoe::gpu::Gpu;
use megamoe::model::config::ModelConfig;
use megamoe::model::reference::Model;
use megamoe::model::weights::{CachePolicy, Weights};
use megamoe::ops::dense::prefill::weight_scales_f32;
use megamoe::ops::dense::reference::first_outside;
use megamoe::ops::dense::{with_route, DenseRoute, DenseShape, DenseWorkspace, Fp8Rows, Fp8Weight};
use megamoe::ops::inputs::normalish;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::POISON;

/// The seeded RNG of a dense test (`DENSE_SEED` replays a printed seed).
pub fn seeded(test: &str) -> ChaCha8Rng {
    super::seeded(test, "DENSE_SEED")
}

/// The GPU and the seeded RNG of a dense GPU test.
pub fn gpu_test(test: &str) -> (Gpu, ChaCha8Rng) {
    (super::gpu(test), seeded(test))
}

/// The CPU model of `cfg` on synthetic weights of a fresh seed, every dequantized matrix cached (the oracle calls
/// `matvec` once per activation row).
pub fn model(cfg: ModelConfig, rng: &mut ChaCha8Rng) -> Model {
    let seed = rng.random::<u64>();
    println!("{}: weights seed {seed}", cfg.name);
    Model::new(Weights::synthetic(cfg, seed, CachePolicy::All).unwrap()).unwrap()
}

/// `rows x k` BF16 activation values: N(0, 1) times a per-row and per-128-block magnitude of 2^-6 .. 2^6, so the
/// FP8 block scales vary along K and between rows.
pub fn activations(rng: &mut ChaCha8Rng, rows: usize, k: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * k);
    for _ in 0..rows {
        let row_scale = 2f32.powi(rng.random_range(-3..=3));
        let mut block_scale = 1.0;
        for c in 0..k {
            if c % 128 == 0 {
                block_scale = 2f32.powi(rng.random_range(-3..=3));
            }
            v.push(bf16::from_f32(normalish(rng) * row_scale * block_scale).to_f32());
        }
    }
    v
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// FP8 codes + ue8m0 scales on the device: a weight (`[rows, cols]` codes, 128x128-block scales) or activation rows
/// (`[rows, cols]` codes, 1x128 scales), viewed as the launcher's [`Fp8Weight`] or [`Fp8Rows`].
pub struct DevFp8 {
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
    pub rows: usize,
    pub cols: usize,
    /// A weight's scales as f32 in the block-scaled GEMM's layout (`prefill::weight_scales_f32`): what the dense
    /// tensor-core route reads; None for activation rows.
    pub scales_f32: Option<CudaSlice<f32>>,
}

impl DevFp8 {
    pub fn from_parts(gpu: &Gpu, codes: &[u8], scales: &[u8], rows: usize, cols: usize) -> DevFp8 {
        DevFp8 {
            codes: gpu.upload(codes).unwrap(),
            scales: gpu.upload(scales).unwrap(),
            rows,
            cols,
            scales_f32: None,
        }
    }
    /// A weight (`[rows, cols]` codes, 128x128-block scale codes) with its f32 scales for the tensor-core route.
    pub fn weight_from_parts(
        gpu: &Gpu,
        codes: &[u8],
        scales: &[u8],
        rows: usize,
        cols: usize,
    ) -> DevFp8 {
        let f = weight_scales_f32(scales, rows, cols).unwrap();
        DevFp8 {
            scales_f32: Some(gpu.upload(&f).unwrap()),
            ..Self::from_parts(gpu, codes, scales, rows, cols)
        }
    }
    /// The checkpoint weight `name` (`...weight`) and its `.scale` companion.
    pub fn from_model(gpu: &Gpu, m: &Model, name: &str) -> DevFp8 {
        let spec = m.weights.spec(name).unwrap();
        let scale = name.strip_suffix(".weight").unwrap().to_string() + ".scale";
        let (codes, scales) = (m.weights.raw(name).unwrap(), m.weights.raw(&scale).unwrap());
        Self::weight_from_parts(gpu, &codes, &scales, spec.shape[0], spec.shape[1])
    }
    /// Activation rows quantized on the host with the DSV4 rule norm_quant's FP8 output uses
    /// (`formats::fp8::quantize_act_1x128`).
    pub fn quantized(gpu: &Gpu, x: &[f32], rows: usize, cols: usize) -> DevFp8 {
        let q = quantize_act_1x128(x, rows, cols).unwrap();
        Self::from_parts(gpu, &q.data, &q.scales, rows, cols)
    }
    /// New activation values into the same buffers (graph replays), ordered on the GPU's stream.
    pub fn write(&mut self, gpu: &Gpu, x: &[f32]) {
        let q = quantize_act_1x128(x, self.rows, self.cols).unwrap();
        gpu.write(&gpu.stream, &mut self.codes, &q.data).unwrap();
        gpu.write(&gpu.stream, &mut self.scales, &q.scales).unwrap();
    }
    pub fn weight(&self) -> Fp8Weight<'_> {
        Fp8Weight {
            codes: &self.codes,
            scales: &self.scales,
            n: self.rows,
            k: self.cols,
            scales_f32: self
                .scales_f32
                .as_ref()
                .map(|s| s as &dyn megamoe::gpu::DeviceBuf<f32>),
        }
    }
    pub fn act(&self) -> Fp8Rows<'_> {
        Fp8Rows {
            codes: &self.codes,
            scales: &self.scales,
            rows: self.rows,
            k: self.cols,
        }
    }
}

/// Runs `body` on the GPU for DSV4-Flash and -Pro, each with its CPU model on fresh synthetic weights.
pub fn on_flash_and_pro(
    test: &str,
    mut body: impl FnMut(&Gpu, &mut ChaCha8Rng, &ModelConfig, &Model),
) {
    let (gpu, mut rng) = gpu_test(test);
    for cfg in [ModelConfig::flash(), ModelConfig::pro()] {
        let m = model(cfg.clone(), &mut rng);
        body(&gpu, &mut rng, &cfg, &m);
    }
}

/// A workspace for `shapes` (counters zeroed); the arena must outlive every call.
pub fn workspace(gpu: &Gpu, shapes: &[DenseShape]) -> (Arena, DenseWorkspace) {
    let sms = gpu.info.sm_count as usize;
    let layout = megamoe::ops::dense::workspace_layout(shapes, sms).unwrap();
    let mut arena = Arena::for_layout(gpu, &layout).unwrap();
    // Poison the partials: a split that is summed without being written shows up as NaN.
    arena.poison(&gpu.stream, POISON).unwrap();
    let ws = DenseWorkspace::carve(&mut arena, &gpu.stream, shapes, sms).unwrap();
    (arena, ws)
}

/// [`workspace`] laid out and carved under `route` (`ops::dense::with_route`): the route its launches take.
pub fn workspace_on(
    gpu: &Gpu,
    shapes: &[DenseShape],
    route: DenseRoute,
) -> (Arena, DenseWorkspace) {
    let (arena, ws) = with_route(route, || workspace(gpu, shapes));
    ws.prepare(gpu).unwrap();
    (arena, ws)
}

pub fn bf16_out(gpu: &Gpu, n: usize) -> CudaSlice<bf16> {
    gpu.poisoned::<bf16>(n, POISON).unwrap()
}

pub fn download_bf16(gpu: &Gpu, y: &CudaSlice<bf16>) -> Vec<f32> {
    gpu.synchronize().unwrap();
    gpu.download(y)
        .unwrap()
        .iter()
        .map(|v| v.to_f32())
        .collect()
}

/// Every element within `reference::tolerance` of the CPU model's (K summed terms; `bf16_out`: BF16-rounded).
pub fn assert_close(
    label: &str,
    got: &[f32],
    want: &[f32],
    abs_terms: &[f64],
    k: usize,
    bf16_out: bool,
) {
    assert_eq!(got.len(), want.len(), "{label}: lengths differ");
    super::assert_all_written(label, got);
    if let Some((i, g, w, tol)) = first_outside(got, want, abs_terms, k, bf16_out) {
        panic!(
            "{label}: element {i}: got {g}, want {w}, |diff| {} > bound {tol:.3e}",
            (g - w).abs()
        );
    }
    let exact = got.iter().zip(want).filter(|(a, b)| a == b).count();
    println!(
        "{label}: {exact} of {} equal to the CPU model's, all within the bound",
        got.len()
    );
}
