//! Fixtures and checks of the RMSNorm + quantization and mHC tests (tests/norm_quant.rs, tests/mhc.rs): the
//! reference encoding of one row, the exact row check given the GPU's rstd, the mHC workspace, downloads of
//! workspace buffers.

use megamoe::formats::bf16;
use megamoe::gpu::arena::{self, Arena};
use megamoe::gpu::launch::DevBuf;
use megamoe::gpu::Gpu;
use megamoe::ops::mhc::MhcWorkspace;
use megamoe::ops::norm_quant::reference as r;
use megamoe::ops::norm_quant::{self as nq, HostQuant, OutFormat};

/// Hidden sizes of the GPU tests (DSV4: 4096 Flash, 7168 Pro).
pub const DS: &[usize] = &[4096, 7168];
/// Row (and token) counts of the GPU tests: one row; partial 32-token mix tiles at 1, 2, 3, 7, 127, 129; full
/// tiles at 64; a prefill-sized 4096.
pub const ROWS: &[usize] = &[1, 2, 3, 7, 64, 127, 129, 4096];
pub const FORMATS: [OutFormat; 3] = [OutFormat::Nvfp4, OutFormat::Fp8, OutFormat::Bf16];

/// Xorshift64 (13, 7, 17) from `seed | 1`: the cheap, reproducible bit stream of the exhaustive encoder sweeps
/// and the synthetic rows (any seed works; `| 1` keeps the state non-zero).
pub fn xorshift64(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

/// One row's outputs as the reference encodes them from BF16-rounded `y`.
pub fn encode_row(format: OutFormat, y: &[f32]) -> (Vec<u8>, Vec<u8>, f32) {
    let d = y.len();
    match format {
        OutFormat::Nvfp4 => {
            let (mut data, mut scales) = (vec![0; d / 2], vec![0; d / 16]);
            let gs = r::quantize_nvfp4_row(y, &mut data, &mut scales);
            (data, scales, gs)
        }
        OutFormat::Fp8 => {
            let (mut data, mut scales) = (vec![0; d], vec![0; d / 128]);
            r::quantize_fp8_row(y, &mut data, &mut scales);
            (data, scales, 0.0)
        }
        OutFormat::Bf16 => (
            y.iter()
                .flat_map(|v| bf16::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            vec![],
            0.0,
        ),
    }
}

/// The GPU's outputs of one row, in the same shape as [`encode_row`].
pub fn gpu_row(q: &HostQuant, row: usize, d: usize) -> (Vec<u8>, Vec<u8>, f32) {
    match q {
        HostQuant::Nvfp4(n) => (
            n.data[row * d / 2..(row + 1) * d / 2].to_vec(),
            n.scales[row * d / 16..(row + 1) * d / 16].to_vec(),
            n.global_scale[row],
        ),
        HostQuant::Fp8(f) => (
            f.data[row * d..(row + 1) * d].to_vec(),
            f.scales[row * d / 128..(row + 1) * d / 128].to_vec(),
            0.0,
        ),
        HostQuant::Bf16(y) => (
            y[row * d..(row + 1) * d]
                .iter()
                .flat_map(|v| bf16::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            vec![],
            0.0,
        ),
    }
}

pub fn first_diff(a: &[u8], b: &[u8]) -> Option<(usize, u8, u8)> {
    a.iter()
        .zip(b)
        .enumerate()
        .find(|(_, (x, y))| x != y)
        .map(|(i, (x, y))| (i, *x, *y))
}

/// Check RMSNorm(+quant) outputs of `rows` rows of `x` (f32 values; BF16-representable when the input was
/// BF16). Exact equality given the GPU's rstd; the GPU rstd within 4 ulp of the reference; code
/// differences against the all-CPU reference only in rows whose rstd differs (counted, printed).
pub fn check_norm_outputs(
    label: &str,
    x: &[f32],
    w: &[f32],
    rows: usize,
    d: usize,
    format: OutFormat,
    got: &nq::HostNormOutputs,
) {
    let mut rstd_diff_rows = 0;
    let mut max_ulps = 0;
    let mut code_diffs_cpu_rstd = 0usize;
    for row in 0..rows {
        let xr = &x[row * d..(row + 1) * d];
        let rg = got.rstd[row];
        assert!(rg.is_finite(), "{label}: rstd[{row}] not written ({rg})");
        let rc = r::row_rstd(xr, r::RMS_EPS);
        let ulps = r::ulp_distance(rg, rc);
        max_ulps = max_ulps.max(ulps);
        assert!(
            ulps <= 4,
            "{label}: rstd[{row}] GPU {rg:e} vs CPU {rc:e} ({ulps} ulp)"
        );
        let want = encode_row(format, &r::rmsnorm_row_with_rstd(xr, w, rg));
        let have = gpu_row(&got.q, row, d);
        if let Some((i, a, b)) = first_diff(&have.0, &want.0) {
            panic!("{label}: row {row} data byte {i}: GPU {a:#04x} vs reference {b:#04x} (same rstd {rg:e})");
        }
        if let Some((i, a, b)) = first_diff(&have.1, &want.1) {
            panic!("{label}: row {row} scale {i}: GPU {a:#04x} vs reference {b:#04x}");
        }
        assert_eq!(
            have.2.to_bits(),
            want.2.to_bits(),
            "{label}: row {row} global scale GPU {} vs {}",
            have.2,
            want.2
        );
        if ulps != 0 {
            rstd_diff_rows += 1;
            let cpu = encode_row(format, &r::rmsnorm_row_with_rstd(xr, w, rc));
            code_diffs_cpu_rstd += have.0.iter().zip(&cpu.0).filter(|(a, b)| a != b).count();
            code_diffs_cpu_rstd += have.1.iter().zip(&cpu.1).filter(|(a, b)| a != b).count();
        }
    }
    eprintln!(
        "{label}: exact given GPU rstd; rstd differs from the CPU in {rstd_diff_rows}/{rows} rows (max {max_ulps} ulp), \
         {code_diffs_cpu_rstd} output bytes differ from the all-CPU reference (all in those rows)"
    );
    // A 1-ulp rstd change (a relative 2^-23 move of every value) changes an output byte only where a value sits
    // that close to a rounding boundary (rare: 1% of a row is generous), or where a block's amax sits that close to
    // a scale boundary: then the block's scale moves one step and every code of the block may be re-rounded
    // (NVFP4: 8 code bytes + 1 scale byte per 16 values; FP8: 128 code bytes + 1 scale). Allow one such block
    // flip per row beside the 1%, and a second one (the two scale boundaries nearest the row's largest blocks).
    let block_bytes = match format {
        OutFormat::Nvfp4 => 9,
        OutFormat::Fp8 => 129,
        OutFormat::Bf16 => 0,
    };
    assert!(
        code_diffs_cpu_rstd <= rstd_diff_rows * (d / 100 + 8 + 2 * block_bytes),
        "{label}: too many differences vs the CPU rstd"
    );
}

/// Row `row` of a downloaded output as a one-row output (for the CPU reference check).
pub fn one_row(got: &nq::HostNormOutputs, row: usize, d: usize) -> nq::HostNormOutputs {
    nq::HostNormOutputs {
        rstd: vec![got.rstd[row]],
        q: match &got.q {
            HostQuant::Nvfp4(g) => HostQuant::Nvfp4(r::Nvfp4Rows {
                rows: 1,
                cols: d,
                data: g.data[row * d / 2..(row + 1) * d / 2].to_vec(),
                scales: g.scales[row * d / 16..(row + 1) * d / 16].to_vec(),
                global_scale: vec![g.global_scale[row]],
            }),
            HostQuant::Fp8(g) => HostQuant::Fp8(r::Fp8Rows {
                rows: 1,
                cols: d,
                data: g.data[row * d..(row + 1) * d].to_vec(),
                scales: g.scales[row * d / 128..(row + 1) * d / 128].to_vec(),
            }),
            HostQuant::Bf16(_) => unreachable!("row outputs here are nvfp4 / fp8"),
        },
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> (f32, usize) {
    a.iter()
        .zip(b)
        .enumerate()
        .fold((0f32, 0), |(m, mi), (i, (x, y))| {
            let e = (x - y).abs();
            if e > m || e.is_nan() {
                (if e.is_nan() { f32::INFINITY } else { e }, i)
            } else {
                (m, mi)
            }
        })
}

/// A workspace arena and the mHC workspace carved from it for up to `tokens` tokens of `d` (keep the arena alive
/// while the workspace is used).
pub fn mhc_ws(gpu: &Gpu, tokens: usize, d: usize) -> (Arena, MhcWorkspace) {
    let mut a = Arena::for_layout(gpu, &MhcWorkspace::layout(tokens, d)).unwrap();
    let ws = MhcWorkspace::carve(&mut a, tokens, d).unwrap();
    (a, ws)
}

/// Fill the split-K partials with NaN (0xFF bytes): a finish that read them before the mixes wrote them would
/// turn its outputs into NaN, and a partial the mixes failed to write stays NaN.
pub fn poison_partials(gpu: &Gpu, ws: &MhcWorkspace) {
    arena::fill(&gpu.stream, &ws.partials, 0xFF).unwrap();
}

/// Download a workspace buffer (waits for the stream).
pub fn download_dev<T: Copy + Default + cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    b: &DevBuf<T>,
) -> Vec<T> {
    arena::download(&gpu.stream, b).unwrap()
}

/// A device f32 buffer downloaded.
pub fn download_f32(gpu: &Gpu, s: &cudarc::driver::CudaSlice<f32>) -> Vec<f32> {
    gpu.download(s).unwrap()
}

/// A device BF16 buffer downloaded and widened to f32.
pub fn download_bf16(gpu: &Gpu, s: &cudarc::driver::CudaSlice<half::bf16>) -> Vec<f32> {
    gpu.download(s)
        .unwrap()
        .iter()
        .map(|v| v.to_f32())
        .collect()
}
