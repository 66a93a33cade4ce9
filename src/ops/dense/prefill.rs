//! The FP8 dense linear of DeepSeek-V4 (`wq_a`, `wq_b`, `wkv`, `wo_b`, the indexer's `wq_b`, the shared expert's
//! `w1`/`w3`/`w2`) at any token count, through cuBLASLt's block-scaled FP8 GEMM
//! ([`Blas::fp8_block_scaled_gemm`]); kernels/dense_prefill.cu holds the scale-conversion glue.
//!
//! Contract of [`fp8_linear_prefill`]: `y[m, n] = bf16( x_q[m, k] . dequant(W)[n, k]^T )` with f32 accumulation,
//! where `x_q` is the FP8 e4m3 1x128 activation as norm_quant's `OutFormat::Fp8` writes it (codes `[m, k]`,
//! ue8m0 scale codes `[m, k/128]`) and `W` the checkpoint's e4m3 codes `[n, k]` with ue8m0 128x128 block scales
//! `[n/128, k/128]`, converted once at load to f32 ([`DeviceFp8Weight::upload`], exact). The CPU model's twin is
//! `Model::fp8_linear`: `weights.matvec(name, &fp8_act_quant(x))`, then one BF16 rounding. Every product
//! `e4m3 * 2^a * e4m3 * 2^b` is exact in f32 and the scales are powers of two, so the GPU and the CPU differ only
//! in the order (and, inside the tensor cores, the precision) of the f32 sums before the one BF16 rounding.
//!
//! Design: cuBLASLt's `VEC128_32F` x `BLK128x128_32F` scale modes (cuBLASLt >= 12.9, compute capability 9.0) are
//! exactly DeepSeek's scaling, so the library does the GEMM. Its two layout rules shape the glue:
//! - the activation scales must be f32 with the token index contiguous (`[k/128, m]`): one small kernel,
//!   `dense_prefill_act_scales_f32`, converts norm_quant's ue8m0 `[m, k/128]` codes (exact, 1/128 of the
//!   activation bytes) before the GEMM;
//! - the token count must be a multiple of 4 ([`BLOCK_SCALED_ROW_MULTIPLE`]): the first `m - m % 4` rows run in
//!   place, the last `m % 4` rows (if any) are copied into a 4-row staging tile (zero codes and zero scales below
//!   them), multiplied, and their rows of the result copied back. Decode sizes (m = 1..3) are only the tail.
//!
//! Graph safety: the launcher allocates nothing; the workspace ([`Fp8LinearWorkspace`]) is the caller's; the
//! cuBLASLt plan of a shape is built on its first call (host work, allowed during capture) and cached in the
//! [`Blas`]; the grids depend only on `m`, `n`, `k`. A captured call replays with new activations in the same
//! buffers (the token count is fixed by the capture, as every GEMM's grid is).
//!
//! The decode GEMV family races this same call as its cuBLASLt baseline at m = 1..64.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::formats::ue8m0;
use crate::gpu::arena::{Arena, WorkspaceLayout, ALIGN};
use crate::gpu::blas::{Blas, BlockScaledShape, BLOCK_SCALED_ROW_MULTIPLE};
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::{drv, Gpu};

/// Kernel family name (kernels/dense_prefill.cu).
pub const FAMILY: &str = "dense_prefill";
/// Threads per CTA of the scale converter.
const CONVERT_THREADS: u32 = 256;

/// `m` rounded down to the GEMM's row multiple: the rows multiplied in place.
pub fn rows_in_place(m: usize) -> usize {
    m - m % BLOCK_SCALED_ROW_MULTIPLE
}

/// The weight's ue8m0 128x128 block scales (row-major `[ceil(n/128), k/128]` codes, the checkpoint's `.scale`
/// tensor) as the f32 tensor [`Blas::fp8_block_scaled_gemm`] reads: `[ceil(n/128), L4]`, pad columns 0. Exact:
/// code c is `2^(c - 127)` ([`ue8m0::decode`]).
pub fn weight_scales_f32(codes: &[u8], n: usize, k: usize) -> Result<Vec<f32>> {
    let (nb, kb) = (n.div_ceil(128), k.div_ceil(128));
    if n == 0 || k == 0 {
        bail!("weight scales: empty weight [{n}, {k}]");
    }
    if codes.len() != nb * kb {
        bail!(
            "weight scales: {} codes for a [{n}, {k}] weight (want {nb} x {kb})",
            codes.len()
        );
    }
    let kb4 = kb.div_ceil(4) * 4;
    let mut out = vec![0f32; nb * kb4];
    for (dst, src) in out.chunks_exact_mut(kb4).zip(codes.chunks_exact(kb)) {
        for (d, &c) in dst.iter_mut().zip(src) {
            *d = ue8m0::decode(c);
        }
    }
    Ok(out)
}

/// A dense FP8 weight on the device as the GEMM reads it: e4m3 codes `[n, k]` and f32 128x128 block scales in
/// the layout of [`BlockScaledShape`] (`[ceil(n/128), L4]`).
pub struct DeviceFp8Weight {
    pub n: usize,
    pub k: usize,
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<f32>,
}

impl DeviceFp8Weight {
    /// Upload a checkpoint weight: `codes` e4m3 `[n, k]`, `scale_codes` ue8m0 `[n/128, k/128]` (converted to f32
    /// on the host, exact: [`weight_scales_f32`]).
    pub fn upload(
        gpu: &Gpu,
        codes: &[u8],
        scale_codes: &[u8],
        n: usize,
        k: usize,
    ) -> Result<DeviceFp8Weight> {
        check_nk(n, k)?;
        if codes.len() != n * k {
            bail!("FP8 weight [{n}, {k}]: {} codes", codes.len());
        }
        let scales = weight_scales_f32(scale_codes, n, k)?;
        Ok(DeviceFp8Weight {
            n,
            k,
            codes: gpu.upload(codes)?,
            scales: gpu.upload(&scales)?,
        })
    }

    /// The non-owning view the launcher takes (valid while `self` lives).
    pub fn view(&self) -> Fp8WeightView {
        // SAFETY: the addresses and lengths are the slices' own; the view is used while `self` lives.
        unsafe {
            Fp8WeightView {
                n: self.n,
                k: self.k,
                codes: DevBuf::from_raw(self.codes.device_addr(), self.codes.len()),
                scales: DevBuf::from_raw(self.scales.device_addr(), self.scales.len()),
            }
        }
    }
}

/// A dense FP8 weight wherever it lives (an owned [`DeviceFp8Weight`], or a region of a weight arena).
#[derive(Debug, Clone, Copy)]
pub struct Fp8WeightView {
    pub n: usize,
    pub k: usize,
    /// e4m3 `[n, k]`.
    pub codes: DevBuf<u8>,
    /// f32 `[ceil(n/128), L4]` ([`weight_scales_f32`]).
    pub scales: DevBuf<f32>,
}

fn check_nk(n: usize, k: usize) -> Result<()> {
    // The GEMM's own rule (n a multiple of 16, k of 128), checked with a token count it accepts.
    BlockScaledShape {
        m: BLOCK_SCALED_ROW_MULTIPLE,
        n,
        k,
    }
    .check()
}

/// The caller-owned scratch of [`fp8_linear_prefill`] for up to `max_m` tokens of one `(n, k)`.
#[derive(Debug, Clone, Copy)]
pub struct Fp8LinearWorkspace {
    pub max_m: usize,
    pub n: usize,
    pub k: usize,
    /// f32 activation scales of the in-place rows, `[k/128, rows_in_place(m)]`.
    act_scales: DevBuf<f32>,
    /// f32 activation scales of the staged tail, `[k/128, 4]`.
    tail_scales: DevBuf<f32>,
    /// The staged tail's codes, `[4, k]`.
    tail_x: DevBuf<u8>,
    /// The staged tail's result, `[4, n]`.
    tail_y: DevBuf<bf16>,
    /// cuBLASLt's workspace.
    cublas: DevBuf<u8>,
}

impl Fp8LinearWorkspace {
    /// Bytes of cuBLASLt workspace the calls with token counts `ms` need (the largest of their plans; builds and
    /// caches those plans). Host-only.
    pub fn cublas_bytes_for(blas: &Blas, n: usize, k: usize, ms: &[usize]) -> Result<usize> {
        check_nk(n, k)?;
        let mut bytes = 0;
        for &m in ms {
            if m == 0 {
                bail!("fp8_linear_prefill: m = 0");
            }
            let main = rows_in_place(m);
            if main > 0 {
                bytes = bytes.max(blas.fp8_block_scaled_workspace_bytes(BlockScaledShape {
                    m: main,
                    n,
                    k,
                })?);
            }
            if m % BLOCK_SCALED_ROW_MULTIPLE != 0 {
                bytes = bytes.max(blas.fp8_block_scaled_workspace_bytes(BlockScaledShape {
                    m: BLOCK_SCALED_ROW_MULTIPLE,
                    n,
                    k,
                })?);
            }
        }
        Ok(bytes)
    }

    /// The carves of [`Fp8LinearWorkspace::carve`].
    pub fn layout(max_m: usize, n: usize, k: usize, cublas_bytes: usize) -> WorkspaceLayout {
        let (l, r) = (k / 128, BLOCK_SCALED_ROW_MULTIPLE);
        let mut w = WorkspaceLayout::new();
        w.add::<f32>(l * rows_in_place(max_m).max(r))
            .add::<f32>(l * r)
            .add::<u8>(r * k)
            .add::<bf16>(r * n)
            .add::<u8>(cublas_bytes);
        w
    }

    /// [`Fp8LinearWorkspace::carve`]'s buffers laid out in `region` (in [`Fp8LinearWorkspace::layout`]'s order and
    /// rounding: it must hold `layout(max_m, n, k, cublas_bytes).bytes()` bytes from a 256-byte aligned start), for
    /// a caller that keeps one byte region for the calls of several shapes in stream order (the decode route's
    /// `DenseWorkspace`). `n` is the tallest weight the calls take.
    pub fn within(
        region: &DevBuf<u8>,
        max_m: usize,
        n: usize,
        k: usize,
        cublas_bytes: usize,
    ) -> Result<Fp8LinearWorkspace> {
        check_nk(n, k)?;
        if max_m == 0 {
            bail!("Fp8LinearWorkspace: max_m = 0");
        }
        let need = Self::layout(max_m, n, k, cublas_bytes).bytes();
        if region.len() < need || !region.device_addr().is_multiple_of(ALIGN as u64) {
            bail!(
                "Fp8LinearWorkspace for m <= {max_m}, [{n}, {k}]: a region of {} bytes at {:#x}, needs {need} bytes \
                 {ALIGN}-byte aligned",
                region.len(),
                region.device_addr()
            );
        }
        let (l, r) = (k / 128, BLOCK_SCALED_ROW_MULTIPLE);
        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let addr = region.device_addr() + at as u64;
            at += bytes.div_ceil(ALIGN) * ALIGN;
            addr
        };
        let act_len = l * rows_in_place(max_m).max(r);
        // SAFETY: each view lies inside `region` (the layout's byte count was checked above), which the caller keeps
        // allocated while the workspace is used.
        unsafe {
            Ok(Fp8LinearWorkspace {
                max_m,
                n,
                k,
                act_scales: DevBuf::from_raw(take(4 * act_len), act_len),
                tail_scales: DevBuf::from_raw(take(4 * l * r), l * r),
                tail_x: DevBuf::from_raw(take(r * k), r * k),
                tail_y: DevBuf::from_raw(take(2 * r * n), r * n),
                cublas: DevBuf::from_raw(take(cublas_bytes), cublas_bytes),
            })
        }
    }

    /// Scratch for up to `max_m` tokens of an `[n, k]` weight with `cublas_bytes` of cuBLASLt workspace
    /// ([`Fp8LinearWorkspace::cublas_bytes_for`]).
    pub fn carve(
        arena: &mut Arena,
        max_m: usize,
        n: usize,
        k: usize,
        cublas_bytes: usize,
    ) -> Result<Fp8LinearWorkspace> {
        check_nk(n, k)?;
        if max_m == 0 {
            bail!("Fp8LinearWorkspace: max_m = 0");
        }
        let (l, r) = (k / 128, BLOCK_SCALED_ROW_MULTIPLE);
        Ok(Fp8LinearWorkspace {
            max_m,
            n,
            k,
            act_scales: arena.carve(l * rows_in_place(max_m).max(r), "f32 activation scales")?,
            tail_scales: arena.carve(l * r, "f32 activation scales of the tail rows")?,
            tail_x: arena.carve(r * k, "staged tail activations")?,
            tail_y: arena.carve(r * n, "staged tail output")?,
            cublas: arena.carve(cublas_bytes, "cuBLASLt workspace")?,
        })
    }
}

/// `y[m, n] = bf16(x_q . dequant(W)^T)` (the module's contract) for `m >= 1` tokens on `stream`. `x` holds the
/// e4m3 codes `[m, k]` and `x_scales` the ue8m0 codes `[m, k/128]` (norm_quant's FP8 output); `y` is BF16
/// `[m, n]`. Every check (shape, sizes, alignment, workspace, the cuBLASLt plans and version) comes before the
/// first launch.
#[allow(clippy::too_many_arguments)]
pub fn fp8_linear_prefill(
    gpu: &Gpu,
    stream: &Stream,
    blas: &Blas,
    m: usize,
    x: &impl DeviceBuf<u8>,
    x_scales: &impl DeviceBuf<u8>,
    w: &Fp8WeightView,
    ws: &Fp8LinearWorkspace,
    y: &impl DeviceBuf<bf16>,
) -> Result<()> {
    // SAFETY: a view of the caller's buffer, used during this call only.
    let y = unsafe { DevBuf::<bf16>::from_raw(y.device_addr(), y.elems()) };
    fp8_linears_prefill(
        gpu,
        stream,
        blas,
        m,
        x,
        x_scales,
        &[Fp8PrefillJob { w: *w, y }],
        ws,
    )
}

/// One weight of [`fp8_linears_prefill`] and its BF16 output `[m, w.n]`.
#[derive(Debug, Clone, Copy)]
pub struct Fp8PrefillJob {
    pub w: Fp8WeightView,
    pub y: DevBuf<bf16>,
}

/// [`fp8_linear_prefill`] of several weights of the same `k` that read the same activation rows (the decode
/// route's `fp8_linears`): the activation scales are converted (and a tail staged) once, then one GEMM per job in
/// order. The workspace must be for `k` and at least the tallest job's `n`. Every check comes before the first
/// launch.
#[allow(clippy::too_many_arguments)]
pub fn fp8_linears_prefill(
    gpu: &Gpu,
    stream: &Stream,
    blas: &Blas,
    m: usize,
    x: &impl DeviceBuf<u8>,
    x_scales: &impl DeviceBuf<u8>,
    jobs: &[Fp8PrefillJob],
    ws: &Fp8LinearWorkspace,
) -> Result<()> {
    if jobs.is_empty() {
        bail!("fp8_linear_prefill: no weight");
    }
    let k = jobs[0].w.k;
    let l = k / 128;
    let r = BLOCK_SCALED_ROW_MULTIPLE;
    if m == 0 || m > ws.max_m {
        bail!(
            "fp8_linear_prefill: m = {m} tokens (the workspace holds 1..={})",
            ws.max_m
        );
    }
    let main = rows_in_place(m);
    let tail = m - main;
    for (what, have, need) in [
        ("x", x.elems(), m * k),
        ("x scales", x_scales.elems(), m * l),
    ] {
        if have < need {
            bail!("fp8_linear_prefill m={m} k={k}: {what} holds {have} elements, needs {need}");
        }
    }
    if !x.device_addr().is_multiple_of(16) {
        bail!(
            "fp8_linear_prefill: x at {:#x} is not 16-byte aligned",
            x.device_addr()
        );
    }
    for (j, job) in jobs.iter().enumerate() {
        let (w, y) = (&job.w, &job.y);
        let n = w.n;
        check_nk(n, k)?;
        if w.k != k {
            bail!(
                "fp8_linear_prefill: weight {j} has {} columns, weight 0 {k}",
                w.k
            );
        }
        if n > ws.n || k != ws.k {
            bail!(
                "fp8_linear_prefill: the workspace is for [{}, {}], weight {j} is [{n}, {k}]",
                ws.n,
                ws.k
            );
        }
        let shape_w = BlockScaledShape { m: r, n, k };
        for (what, have, need) in [
            ("y", y.elems(), m * n),
            ("W codes", w.codes.elems(), n * k),
            ("W scales", w.scales.elems(), shape_w.weight_scales_len()),
        ] {
            if have < need {
                bail!(
                    "fp8_linear_prefill m={m} n={n} k={k}: {what} of job {j} holds {have} elements, needs {need}"
                );
            }
        }
        for (what, addr) in [
            ("y", y.device_addr()),
            ("W codes", w.codes.device_addr()),
            ("W scales", w.scales.device_addr()),
        ] {
            if !addr.is_multiple_of(16) {
                bail!("fp8_linear_prefill: {what} of job {j} at {addr:#x} is not 16-byte aligned");
            }
        }
        // The plans (and so the cuBLASLt version and configuration) and their workspace needs, before any launch.
        let need = Fp8LinearWorkspace::cublas_bytes_for(blas, n, k, &[m])?;
        if ws.cublas.elems() < need {
            bail!(
                "fp8_linear_prefill m={m} n={n} k={k}: the cuBLASLt workspace holds {} bytes, needs {need} \
                 (Fp8LinearWorkspace::cublas_bytes_for)",
                ws.cublas.elems()
            );
        }
    }
    let convert = gpu.kernel(FAMILY, "dense_prefill_act_scales_f32")?;
    let convert_scales = |codes_addr: u64, rows: usize, rows_pad: usize, out: &DevBuf<f32>| {
        // SAFETY: `codes_addr` points at `rows * l` codes inside `x_scales` (checked above).
        let codes = unsafe { DevBuf::<u8>::from_raw(codes_addr, rows * l) };
        let mut a = KernelArgs::new();
        a.buf(&codes)
            .buf(out)
            .i32(rows as i32)
            .i32(rows_pad as i32)
            .i32(l as i32);
        // SAFETY: the arguments match the kernel's (codes, out, m, m_pad, k_blocks); `out` holds
        // `l * rows_pad` f32 (the workspace was carved for max_m >= m).
        unsafe {
            launch(
                stream,
                &convert,
                Launch::over(l * rows_pad, CONVERT_THREADS),
                &mut a,
            )
        }
    };
    if main > 0 {
        let act = ws.act_scales.sub(0, l * main);
        convert_scales(x_scales.device_addr(), main, main, &act)?;
        for job in jobs {
            blas.fp8_block_scaled_gemm(
                stream,
                BlockScaledShape {
                    m: main,
                    n: job.w.n,
                    k,
                },
                x,
                &act,
                &job.w.codes,
                &job.w.scales,
                &ws.cublas,
                &job.y,
            )?;
        }
    }
    if tail > 0 {
        let cs = stream.cu_stream();
        let x_src = x.device_addr() + (main * k) as u64;
        // SAFETY: rows main..m of x (in bounds, checked above) into the first `tail` rows of the [4, k] staging
        // tile; the rows below get code 0 (and scale 0 from the converter), so their products are exact zeros.
        unsafe {
            drv(
                cudarc::driver::result::memcpy_dtod_async(
                    ws.tail_x.device_addr(),
                    x_src,
                    tail * k,
                    cs,
                ),
                "copy of the tail activation rows",
            )?;
            drv(
                cudarc::driver::result::memset_d8_async(
                    ws.tail_x.device_addr() + (tail * k) as u64,
                    0,
                    (r - tail) * k,
                    cs,
                ),
                "zeroing the staging rows",
            )?;
        }
        convert_scales(
            x_scales.device_addr() + (main * l) as u64,
            tail,
            r,
            &ws.tail_scales,
        )?;
        for job in jobs {
            let n = job.w.n;
            let tail_y = ws.tail_y.sub(0, r * n);
            blas.fp8_block_scaled_gemm(
                stream,
                BlockScaledShape { m: r, n, k },
                &ws.tail_x,
                &ws.tail_scales,
                &job.w.codes,
                &job.w.scales,
                &ws.cublas,
                &tail_y,
            )?;
            // SAFETY: the first `tail` rows of the staged result into rows main..m of y (in bounds, checked above).
            unsafe {
                drv(
                    cudarc::driver::result::memcpy_dtod_async(
                        job.y.device_addr() + (main * n * 2) as u64,
                        tail_y.device_addr(),
                        tail * n * 2,
                        cs,
                    ),
                    "copy of the tail output rows",
                )?;
            }
        }
    }
    Ok(())
}
