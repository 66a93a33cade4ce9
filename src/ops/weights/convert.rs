//! MXFP4 -> NVFP4 on the device (`weights_mxfp4_to_nvfp4` in kernels/weights.cu): the checkpoint's routed-expert
//! format (e2m1, ue8m0 scale per 32) into moe_gemm's (e2m1, e4m3 scale per 16, f32 global scale per row), bit for
//! bit [`formats::mxfp4::to_nvfp4`](crate::formats::mxfp4::to_nvfp4) (the oracle; its docs state the rule and when
//! a 16-block is inexact). The kernel counts the inexact 16-blocks and the invalid scale codes (> 252) into
//! caller-owned u64 counters, so a whole model's conversion is checked with one download at the end.

use anyhow::{ensure, Result};

use crate::formats::mxfp4::{self, Mxfp4Matrix};
use crate::formats::nvfp4::{self, Nvfp4Rows};
use crate::gpu::launch::{launch, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;

/// Rows per CTA (`kConvertWarps` in kernels/weights.cu: one warp a row).
const ROWS_PER_CTA: usize = 8;

/// Index of the inexact 16-block count in the counters.
pub const COUNTER_INEXACT: usize = 0;
/// Index of the invalid-scale count (32-blocks whose ue8m0 code exceeds [`mxfp4::MAX_SCALE_CODE`]).
pub const COUNTER_BAD_SCALES: usize = 1;
/// Counters the kernel adds to.
pub const COUNTERS: usize = 2;

/// The shape checks of [`mxfp4_to_nvfp4`]: `cols` a positive multiple of 32, `rows * cols` within an i32 row count.
pub fn check_shape(rows: usize, cols: usize) -> Result<()> {
    ensure!(
        cols > 0 && cols.is_multiple_of(mxfp4::BLOCK),
        "mxfp4 -> nvfp4: cols = {cols} must be a positive multiple of {}",
        mxfp4::BLOCK
    );
    ensure!(
        rows <= i32::MAX as usize && cols <= i32::MAX as usize,
        "mxfp4 -> nvfp4: {rows} x {cols} does not fit i32 sizes"
    );
    Ok(())
}

/// Convert `rows x cols` MXFP4 weights (`mx_codes`: `rows * cols / 2` bytes, `mx_scales`: `rows * cols / 32`
/// ue8m0 codes) into NVFP4 (`nv_codes`: `rows * cols / 2` bytes, `nv_scales`: `rows * cols / 16` e4m3 codes,
/// `global`: `rows` f32) on `stream`, adding the counts to `counters` (`[inexact 16-blocks, invalid scales]`, the
/// caller zeroes them). Both code buffers must be 8-byte aligned. `rows == 0` launches nothing.
#[allow(clippy::too_many_arguments)]
pub fn mxfp4_to_nvfp4(
    gpu: &Gpu,
    stream: &Stream,
    rows: usize,
    cols: usize,
    mx_codes: &impl DeviceBuf<u8>,
    mx_scales: &impl DeviceBuf<u8>,
    nv_codes: &impl DeviceBuf<u8>,
    nv_scales: &impl DeviceBuf<u8>,
    global: &impl DeviceBuf<f32>,
    counters: &impl DeviceBuf<u64>,
) -> Result<()> {
    check_shape(rows, cols)?;
    let n = rows * cols;
    for (what, have, need) in [
        ("MXFP4 codes", mx_codes.elems(), n / 2),
        ("MXFP4 scales", mx_scales.elems(), n / mxfp4::BLOCK),
        ("NVFP4 codes", nv_codes.elems(), n / 2),
        ("NVFP4 scales", nv_scales.elems(), n / nvfp4::BLOCK),
        ("global scales", global.elems(), rows),
        ("counters", counters.elems(), COUNTERS),
    ] {
        ensure!(
            have >= need,
            "mxfp4 -> nvfp4 of {rows} x {cols}: the {what} buffer holds {have} elements, needs {need}"
        );
    }
    for (what, addr) in [
        ("MXFP4 codes", mx_codes.device_addr()),
        ("NVFP4 codes", nv_codes.device_addr()),
    ] {
        ensure!(
            addr.is_multiple_of(8),
            "mxfp4 -> nvfp4: the {what} buffer at {addr:#x} is not 8-byte aligned"
        );
    }
    if rows == 0 {
        return Ok(());
    }
    let k = gpu.kernel(super::FAMILY, "weights_mxfp4_to_nvfp4")?;
    let mut args = KernelArgs::new();
    args.buf(mx_codes)
        .buf(mx_scales)
        .i32(rows as i32)
        .i32(cols as i32)
        .buf(nv_codes)
        .buf(nv_scales)
        .buf(global)
        .buf(counters);
    let l = Launch::new(
        (rows.div_ceil(ROWS_PER_CTA) as u32, 1, 1),
        ((ROWS_PER_CTA * 32) as u32, 1, 1),
    );
    // SAFETY: arguments in the entry point's order; every buffer holds what the shape needs (checked above) and the
    // code buffers are 8-byte aligned.
    unsafe { launch(stream, &k, l, &mut args) }
}

/// Host entry (tests, tools): upload `m`, convert on the GPU's stream, download the NVFP4 rows and the count of
/// inexact 16-blocks. Errors on an invalid `m` (checked on the host first).
pub fn mxfp4_to_nvfp4_host(gpu: &Gpu, m: &Mxfp4Matrix) -> Result<(Nvfp4Rows, u64)> {
    m.validate()?;
    let mx_codes = gpu.upload(&m.data)?;
    let mx_scales = gpu.upload(&m.scales)?;
    let nv_codes = gpu.poisoned::<u8>(m.data.len().max(1), 0xFF)?;
    let nv_scales = gpu.poisoned::<u8>((m.rows * m.cols / nvfp4::BLOCK).max(1), 0xFF)?;
    let global = gpu.poisoned::<f32>(m.rows.max(1), 0xFF)?;
    let counters = gpu.zeros::<u64>(COUNTERS)?;
    mxfp4_to_nvfp4(
        gpu,
        &gpu.stream,
        m.rows,
        m.cols,
        &mx_codes,
        &mx_scales,
        &nv_codes,
        &nv_scales,
        &global,
        &counters,
    )?;
    let mut data = gpu.download(&nv_codes)?;
    let mut scales = gpu.download(&nv_scales)?;
    let mut global_scale = gpu.download(&global)?;
    data.truncate(m.data.len());
    scales.truncate(m.rows * m.cols / nvfp4::BLOCK);
    global_scale.truncate(m.rows);
    let counts = gpu.download(&counters)?;
    ensure!(
        counts[COUNTER_BAD_SCALES] == 0,
        "mxfp4 -> nvfp4: the kernel saw {} invalid scale codes in validated weights",
        counts[COUNTER_BAD_SCALES]
    );
    Ok((
        Nvfp4Rows {
            rows: m.rows,
            cols: m.cols,
            data,
            scales,
            global_scale,
        },
        counts[COUNTER_INEXACT],
    ))
}
