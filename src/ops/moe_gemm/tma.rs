//! Session-5 A/B decode mainloop v6 (`moe_gemm_nvfp4_partial_v6_nt*` in kernels/moe_gemm.cu): weights and
//! activations streamed into a shared-memory ring by TMA tensor copies issued from one producer thread, eight
//! consumer warps running v3's mma.sync math on them (bit-identical partials). Selected with
//! [`DecodeMainloop::Tma`](super::DecodeMainloop); the v3 mainloop stays the default.
//!
//! The kernel takes four CUtensorMaps by value (`__grid_constant__`), encoded here per launch with
//! `cuTensorMapEncodeTiled` (a host-only call, no device round trip).

use anyhow::{anyhow, ensure, Result};
use cudarc::driver::sys;
use cudarc::driver::{DeviceRepr, PushKernelArg};

use super::{
    activation_ptrs, as_i32, ptr, DeviceActivations, DeviceExpertWeights, DeviceGrouping,
    GemmConfig, Workspace, BLOCK_N, FAMILY,
};
use crate::gpu::{launch_cfg, Gpu};

/// Consumer warps (8 x 16 weight rows) plus one producer warp.
const V6_THREADS: u32 = 288;
/// K per ring stage (two 128-K chunks).
const V6_STAGE_K: usize = 256;
/// Ring slots per token tile of 8 / 16 / 32 / 64 (`V6Cfg<NT>::kStages`).
fn v6_stages(token_tile: usize) -> usize {
    match token_tile {
        8 => 4,
        16 | 32 => 3,
        _ => 2,
    }
}
/// CTAs per SM the kernel is built for (`V6Cfg<NT>::kMinBlocks`, what the shared memory allows).
pub fn v6_ctas_per_sm(token_tile: usize) -> usize {
    if token_tile <= 16 {
        2
    } else {
        1
    }
}

/// Dynamic shared memory of `moe_gemm_nvfp4_partial_v6_nt*` (mirror of `V6Layout<NT>::kSmemBytes`): 1 KB alignment
/// slack, the ring slots (codes 16 KB + scales 2 KB + raw activations token_tile x 512 B + 64 B header, rounded up
/// to 1 KB) and three permuted BF16 activation tiles (token_tile x 512 B each).
pub fn v6_smem_bytes(token_tile: usize) -> usize {
    let raw = token_tile * V6_STAGE_K * 2;
    let slot = (BLOCK_N * (V6_STAGE_K / 2 + V6_STAGE_K / 16) + raw + 64).div_ceil(1024) * 1024;
    1024 + v6_stages(token_tile) * slot + 3 * raw
}

/// The v6 kernel for a token tile with its dynamic shared memory set up (opt-in size, and the carveout hint at
/// the maximum so that the planned CTAs fit), the dynamic bytes, and the CTAs per SM the driver reports for it
/// (the planned [`v6_ctas_per_sm`] if the query fails; at least 1).
pub fn v6_function(
    gpu: &Gpu,
    token_tile: usize,
) -> Result<(cudarc::driver::CudaFunction, usize, usize)> {
    let name = format!("moe_gemm_nvfp4_partial_v6_nt{}", token_tile / 8);
    let smem = v6_smem_bytes(token_tile);
    let f = gpu.function_with_smem(FAMILY, &name, smem)?;
    f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        100,
    )
    .map_err(|e| anyhow!("{name}: shared-memory carveout: {e:?}"))?;
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(V6_THREADS, smem, None)
        .map(|b| b as usize)
        .unwrap_or(v6_ctas_per_sm(token_tile))
        .max(1);
    Ok((f, smem, per_sm))
}

/// An encoded CUtensorMap: 128 opaque bytes, 64-byte aligned as the driver requires.
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub struct TmaDesc([u64; 16]);

// SAFETY: plain bytes, passed by value as the kernel's `TmaDesc` (same size; the kernel's alignment is 64).
unsafe impl DeviceRepr for TmaDesc {}

/// A 2D row-major tensor map: `rows` rows of `inner` elements, `row_bytes` apart, box `box_inner x box_rows`.
#[allow(clippy::too_many_arguments)]
fn encode_2d(
    base: u64,
    dtype: sys::CUtensorMapDataType,
    elem_bytes: usize,
    inner: usize,
    rows: usize,
    row_bytes: usize,
    box_inner: u32,
    box_rows: u32,
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<TmaDesc> {
    ensure!(
        base.is_multiple_of(16)
            && row_bytes.is_multiple_of(16)
            && (box_inner as usize * elem_bytes).is_multiple_of(16),
        "moe_gemm v6: tensor map needs 16-byte alignment (base {base:#x}, row {row_bytes} B)"
    );
    ensure!(rows >= 1 && inner >= 1, "moe_gemm v6: empty tensor map");
    let mut d = TmaDesc([0; 16]);
    let dims = [inner as u64, rows as u64];
    let strides = [row_bytes as u64];
    let boxes = [box_inner, box_rows];
    let elem_strides = [1u32, 1];
    // SAFETY: every pointer refers to a live local array of the rank the call is told; `d` is 128 bytes, aligned.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut d as *mut TmaDesc as *mut sys::CUtensorMap,
            dtype,
            2,
            base as *mut core::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    ensure!(
        r == sys::CUresult::CUDA_SUCCESS,
        "moe_gemm v6: cuTensorMapEncodeTiled({inner} x {rows}, box {box_inner} x {box_rows}) failed: {r:?}"
    );
    Ok(d)
}

/// The v6 mainloop (same contract and checks as [`super::launch_partial_mma`]; called through
/// [`super::launch_partial_mma_with`]). The grid is `min(cfg.ctas, resident CTAs)`: the CTAs are persistent
/// (each walks items with stride gridDim.x), so a grid larger than what fits at once only adds a tail wave.
pub(super) fn launch_partial_v6(
    gpu: &Gpu,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &mut Workspace,
) -> Result<()> {
    let tt = cfg.token_tile;
    let (a_rows, k) = a.rows_k();
    if grp.rows_total == 0 {
        return Ok(()); // no work item (v3 would launch CTAs that exit at once)
    }
    let u8t = sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8;
    let no_swizzle = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE;
    ensure!(
        w.experts * w.n <= i32::MAX as usize,
        "moe_gemm v6: E * N = {} weight rows do not fit an i32 TMA coordinate",
        w.experts * w.n
    );
    // Stages one CTA runs fit an i32 (at most all stages of all work items).
    let max_tiles = grp.rows_total / tt + grp.experts;
    ensure!(
        (max_tiles as u128) * (w.n / BLOCK_N) as u128 * (k / V6_STAGE_K) as u128
            <= i32::MAX as u128,
        "moe_gemm v6: too many pipeline stages for an i32 counter"
    );
    let rows = w.experts * w.n;
    let tm_codes = encode_2d(
        ptr(gpu, &w.codes),
        u8t,
        1,
        k / 2,
        rows,
        k / 2,
        (V6_STAGE_K / 2) as u32,
        BLOCK_N as u32,
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )?;
    let tm_scales = encode_2d(
        ptr(gpu, &w.scales),
        u8t,
        1,
        k / 16,
        rows,
        k / 16,
        (V6_STAGE_K / 16) as u32,
        BLOCK_N as u32,
        no_swizzle,
    )?;
    let a_rows_map = a_rows.max(1);
    let (act, act_scales, is_nvfp4) = activation_ptrs(gpu, a);
    let (tm_act, tm_act_scales) = if is_nvfp4 == 0 {
        let m = encode_2d(
            act,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            2,
            k,
            a_rows_map,
            k * 2,
            V6_STAGE_K as u32,
            tt as u32,
            no_swizzle,
        )?;
        (m, TmaDesc([0; 16]))
    } else {
        (
            encode_2d(
                act,
                u8t,
                1,
                k / 2,
                a_rows_map,
                k / 2,
                (V6_STAGE_K / 2) as u32,
                tt as u32,
                no_swizzle,
            )?,
            encode_2d(
                act_scales,
                u8t,
                1,
                k / 16,
                a_rows_map,
                k / 16,
                (V6_STAGE_K / 16) as u32,
                tt as u32,
                no_swizzle,
            )?,
        )
    };
    let (f, smem, per_sm) = v6_function(gpu, tt)?;
    let name = format!("moe_gemm_nvfp4_partial_v6_nt{}", tt / 8);
    let resident = (gpu.info.sm_count.max(1) as usize * per_sm) as u32;
    let ctas = cfg.ctas.min(resident).max(1);
    let grp_p = ptr(gpu, &grp.group);
    let part = ptr(gpu, &ws.partial);
    let (n, k_i) = (as_i32(w.n, "N")?, as_i32(k, "K")?);
    let (cap, e, rows_total, splits) = (
        as_i32(grp.capacity, "capacity")?,
        as_i32(grp.experts, "experts")?,
        as_i32(grp.rows_total, "rows")?,
        cfg.splits as i32,
    );
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&tm_codes)
        .arg(&tm_scales)
        .arg(&tm_act)
        .arg(&tm_act_scales)
        .arg(&n)
        .arg(&k_i)
        .arg(&is_nvfp4);
    b.arg(&grp_p)
        .arg(&cap)
        .arg(&e)
        .arg(&rows_total)
        .arg(&part)
        .arg(&splits);
    unsafe { b.launch(launch_cfg((ctas, 1, 1), (V6_THREADS, 1, 1), smem as u32)) }
        .map_err(|e| anyhow!("{name}: {e:?}"))?;
    Ok(())
}
