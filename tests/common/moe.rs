//! Fixtures of the moe_gemm tests (tests/moe_gemm.rs, tests/moe_gemm_prefill.rs): seeded random rows, quantized
//! expert weights, gathered activations in either A format and their device copies, and a test-owned workspace.

use half::bf16;
use megamoe::gpu::arena::{self, Arena};
use megamoe::gpu::launch::{DevBuf, DeviceBuf};
use megamoe::gpu::Gpu;
use megamoe::ops::moe_gemm::reference::{quantize_rows_nvfp4, Activations, ExpertWeights};
use megamoe::ops::moe_gemm::{
    workspace_bytes, DeviceActivations, DeviceExpertWeights, DeviceGrouping, GemmConfig,
    RoutedBatch, Workspace, WorkspaceShape,
};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub const U: f64 = 1.0 / 16_777_216.0; // 2^-24

/// The seeded RNG of a moe_gemm test (`MOE_GEMM_SEED` replays a printed seed).
pub fn seeded(test: &str) -> ChaCha8Rng {
    super::seeded(test, "MOE_GEMM_SEED")
}

/// A [`Workspace`] with the arena it was carved from (dereferences to the workspace).
pub struct Ws {
    _arena: Arena,
    ws: Workspace,
}

impl std::ops::Deref for Ws {
    type Target = Workspace;
    fn deref(&self) -> &Workspace {
        &self.ws
    }
}

impl Ws {
    /// The workspace of `shape`, every byte poisoned (NaN partials: an element a kernel should have written and
    /// did not shows up).
    pub fn of(gpu: &Gpu, shape: &WorkspaceShape) -> Ws {
        let mut arena = Arena::new(gpu, workspace_bytes(shape)).unwrap();
        let ws = Workspace::carve(&mut arena, shape).unwrap();
        arena.poison(&gpu.stream, super::POISON).unwrap();
        Ws { _arena: arena, ws }
    }
    /// Partials `[splits, rows, n]` only (decode launches and finish kernels).
    pub fn new(gpu: &Gpu, splits: usize, rows: usize, n: usize) -> Ws {
        Ws::of(
            gpu,
            &WorkspaceShape {
                splits,
                rows_total: rows,
                n,
                prepass_k: 0,
            },
        )
    }
    /// Partials of one split plus the prefill pre-pass scratch for `k` columns.
    pub fn prefill(gpu: &Gpu, rows: usize, n: usize, k: usize) -> Ws {
        Ws::of(
            gpu,
            &WorkspaceShape {
                splits: 1,
                rows_total: rows,
                n,
                prepass_k: k,
            },
        )
    }
    /// What a launch of `w` over `grp` with `cfg` needs (the pre-pass scratch for a contiguous one-split launch).
    pub fn for_launch(
        gpu: &Gpu,
        w: &DeviceExpertWeights,
        grp: &DeviceGrouping,
        cfg: &GemmConfig,
    ) -> Ws {
        Ws::of(gpu, &WorkspaceShape::for_launch(w, grp, cfg))
    }
    /// Poison the partials again (0xFF: NaN).
    pub fn poison(&self, gpu: &Gpu) {
        arena::fill(&gpu.stream, &self.ws.partial, super::POISON).unwrap();
    }
    /// The partials, `[splits, rows, n]` (waits for the stream).
    pub fn partial_host(&self, gpu: &Gpu) -> Vec<f32> {
        download(gpu, &self.ws.partial)
    }
    /// Overwrite the first `host.len()` partials (the finish-kernel tests' constructed inputs).
    pub fn write_partial(&self, gpu: &Gpu, host: &[f32]) {
        upload_into(gpu, &self.ws.partial, host);
    }
}

/// Copy a device buffer of any owner back to the host, ordered on the GPU's stream.
pub fn download<T: Copy + Default + cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    b: &impl DeviceBuf<T>,
) -> Vec<T> {
    // SAFETY: `b` stays allocated; the view is only read by the copy, which waits for the stream.
    let view: DevBuf<T> = unsafe { DevBuf::from_raw(b.device_addr(), b.elems()) };
    arena::download(&gpu.stream, &view).unwrap()
}

/// Copy `host` into the start of a device buffer of any owner, ordered on the GPU's stream (a synchronous
/// `cuMemcpyHtoD` from pageable memory may return before its DMA lands and is not ordered with that non-blocking
/// stream, so a kernel launched right after it could read stale bytes).
pub fn upload_into<T: Copy + cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    b: &impl DeviceBuf<T>,
    host: &[T],
) {
    arena::upload(&gpu.stream, b, host).unwrap();
}

/// Roughly normal values with a per-row magnitude spread of 10^[-2, 2] (exercises per-row global scales and
/// small e4m3 block scales) and a few outliers per row (exercises block-scale spread within a row).
pub fn random_rows(rng: &mut impl Rng, rows: usize, cols: usize, base: f32) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let mag = base * 10f32.powf(rng.random_range(-2.0..2.0));
        for _ in 0..cols {
            // One 32-bit draw per value: the sum of two 15-bit uniforms (triangular on [-1, 1)), and a 1-in-64 outlier.
            let r: u32 = rng.random();
            let tri = ((r & 0x7FFF) as f32 + ((r >> 15) & 0x7FFF) as f32) / 32768.0 - 1.0;
            let v = tri * mag;
            x.push(if r >> 26 == 0 { v * 30.0 } else { v });
        }
    }
    x
}

/// A row per routed (token, expert) pair gathered from token activations, in the chosen A format.
pub fn gathered_activations(
    rng: &mut impl Rng,
    rb: &RoutedBatch,
    k: usize,
    nvfp4: bool,
) -> Activations {
    let xf = random_rows(rng, rb.tokens, k, 1.0);
    let rows = rb.grouping.rows_total();
    let mut g = Vec::with_capacity(rows * k);
    for r in 0..rows {
        let t = rb.row_token[r];
        for kk in 0..k {
            // Padding slots hold garbage the kernel must not read into any owned row.
            g.push(if t >= 0 { xf[t as usize * k + kk] } else { 1e3 });
        }
    }
    if nvfp4 {
        Activations::Nvfp4(quantize_rows_nvfp4(&g, rows, k).unwrap())
    } else {
        Activations::Bf16 {
            rows,
            k,
            data: g.iter().map(|v| bf16::from_f32(*v)).collect(),
        }
    }
}

pub struct DevA {
    bf: Option<cudarc::driver::CudaSlice<bf16>>,
    codes: Option<cudarc::driver::CudaSlice<u8>>,
    scales: Option<cudarc::driver::CudaSlice<u8>>,
    global: Option<cudarc::driver::CudaSlice<f32>>,
    rows: usize,
    k: usize,
}

impl DevA {
    pub fn upload(gpu: &Gpu, a: &Activations) -> DevA {
        match a {
            Activations::Bf16 { rows, k, data } => DevA {
                bf: Some(gpu.upload(data).unwrap()),
                codes: None,
                scales: None,
                global: None,
                rows: *rows,
                k: *k,
            },
            Activations::Nvfp4(q) => DevA {
                bf: None,
                codes: Some(gpu.upload(&q.codes).unwrap()),
                scales: Some(gpu.upload(&q.scales).unwrap()),
                global: Some(gpu.upload(&q.global).unwrap()),
                rows: q.rows,
                k: q.cols,
            },
        }
    }
    pub fn view(&self) -> DeviceActivations<'_> {
        match &self.bf {
            Some(data) => DeviceActivations::Bf16 {
                rows: self.rows,
                k: self.k,
                data,
            },
            None => DeviceActivations::Nvfp4 {
                rows: self.rows,
                k: self.k,
                codes: self.codes.as_ref().unwrap(),
                scales: self.scales.as_ref().unwrap(),
                global: self.global.as_ref().unwrap(),
            },
        }
    }
}

pub fn quantized_weights(rng: &mut impl Rng, e: usize, n: usize, k: usize) -> ExpertWeights {
    ExpertWeights::quantize_per_row(&random_rows(rng, e * n, k, 0.05), e, n, k).unwrap()
}
