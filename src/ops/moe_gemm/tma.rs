//! Session-5 A/B decode mainloop v6 (`moe_gemm_nvfp4_partial_v6_nt*` in kernels/moe_gemm.cu): weights and
//! activations streamed into a shared-memory ring by TMA tensor copies issued from one producer thread, eight
//! consumer warps running v3's mma.sync math on them (bit-identical partials). Selected with
//! [`DecodeMainloop::Tma`](super::DecodeMainloop); the v3 mainloop stays the default.
//!
//! The kernel takes four CUtensorMaps by value (`__grid_constant__`), encoded here per launch with
//! `cuTensorMapEncodeTiled` (a host-only call, no device round trip).
//!
//! Second A/B (`moe_gemm_nvfp4_partial_v6t_nt*`, [`super::launch_partial_mma_tiled`]): the same kernel on weights
//! re-laid once at load by [`tile_weights`] into [`TiledExpertWeights`]: every (expert, 128-row n tile, 256-K
//! stage) is one contiguous [`V6_BLOCK_BYTES`] block that is already the shared-memory image v6's two 2D copies
//! produce (swizzle included), fetched with one 1D bulk copy per stage. [`tile_weights_reference`] is the CPU
//! definition of that layout.

use anyhow::{anyhow, ensure, Result};
use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{
    activation_ptrs, as_i32, check_gemm_shape, ptr, DeviceActivations, DeviceExpertWeights,
    DeviceGrouping, GemmConfig, Workspace, BLOCK_N, FAMILY,
};
use crate::gpu::tma::{encode_tiled, TensorMap};
use crate::gpu::{grid_1d, launch_cfg, Gpu};

/// Consumer warps (8 x 16 weight rows) plus one producer warp.
const V6_THREADS: u32 = 288;
/// K per ring stage (two 128-K chunks).
const V6_STAGE_K: usize = 256;
/// Bytes of one pre-tiled (expert, n tile, K stage) block: 128 rows x 128 B of codes, then 128 rows x 16 B of
/// block scales (`kV6BlockBytes`).
pub const V6_BLOCK_BYTES: usize = BLOCK_N * (V6_STAGE_K / 2 + V6_STAGE_K / 16);
/// K per block of the tiled layout (one v6 ring stage).
pub const V6_TILE_K: usize = V6_STAGE_K;

/// Expert weights in the v6 tiled layout (see [`tile_weights_reference`]), next to the [`DeviceExpertWeights`]
/// they were made from (which still hold the global scales the finish kernels read).
pub struct TiledExpertWeights {
    pub experts: usize,
    pub n: usize,
    pub k: usize,
    /// `E * (N / 128) * (K / 256)` blocks of [`V6_BLOCK_BYTES`], `E * N * K * 9 / 16` bytes.
    pub blocks: CudaSlice<u8>,
}

fn check_tile_shape(experts: usize, n: usize, k: usize) -> Result<()> {
    check_gemm_shape(n, k)?;
    ensure!(experts >= 1, "moe_gemm tiled weights: no expert");
    ensure!(
        k.is_multiple_of(V6_TILE_K),
        "moe_gemm tiled weights: K = {k} must be a multiple of {V6_TILE_K}"
    );
    Ok(())
}

/// CPU definition of the v6 tiled weight layout. Block `b = (e * (N / 128) + n_tile) * (K / 256) + k_stage`
/// occupies bytes `[b * 18432, (b + 1) * 18432)`:
/// * codes: the 2D TMA box of v6 (128 B = codes of K `256 k_stage ..` of each of the 128 rows `e * N + 128 n_tile +
///   r`) as it lands in shared memory with the 128-byte swizzle: row r at `128 r`, and the swizzle XORs address bits
///   4..6 with bits 7..9 of the (1024-byte aligned) destination;
/// * scales: the unswizzled box of 16 scale bytes per row, row r at `16384 + 16 r`.
///
/// Written as a scatter (source -> destination) so that it is independent of the GPU kernel's gather.
pub fn tile_weights_reference(
    codes: &[u8],
    scales: &[u8],
    experts: usize,
    n: usize,
    k: usize,
) -> Result<Vec<u8>> {
    check_tile_shape(experts, n, k)?;
    ensure!(
        codes.len() == experts * n * k / 2 && scales.len() == experts * n * k / 16,
        "moe_gemm tiled weights: codes {} B / scales {} B, expected {} / {} for [{experts}, {n}, {k}]",
        codes.len(),
        scales.len(),
        experts * n * k / 2,
        experts * n * k / 16
    );
    let (n_tiles, k_stages) = (n / BLOCK_N, k / V6_TILE_K);
    let (codes_row, scales_row) = (V6_TILE_K / 2, V6_TILE_K / 16);
    let mut out = vec![0u8; codes.len() + scales.len()];
    for row_tile in 0..experts * n_tiles {
        for ks in 0..k_stages {
            let block = (row_tile * k_stages + ks) * V6_BLOCK_BYTES;
            for r in 0..BLOCK_N {
                let wrow = row_tile * BLOCK_N + r;
                for byte in 0..codes_row {
                    let linear = r * codes_row + byte; // unswizzled box offset
                    let swizzled = linear ^ (((linear >> 7) & 7) << 4);
                    out[block + swizzled] = codes[wrow * (k / 2) + ks * codes_row + byte];
                }
                let sc = block + BLOCK_N * codes_row + r * scales_row;
                let src = wrow * (k / 16) + ks * scales_row;
                out[sc..sc + scales_row].copy_from_slice(&scales[src..src + scales_row]);
            }
        }
    }
    Ok(out)
}

/// Re-lay `w` into the v6 tiled layout on the device (one gather kernel, `moe_gemm_v6_tile_weights`; a weight
/// preparation step done once at load, ~2 x the weight bytes of DRAM traffic: about 2 ms for Flash W13).
pub fn tile_weights(gpu: &Gpu, w: &DeviceExpertWeights) -> Result<TiledExpertWeights> {
    check_tile_shape(w.experts, w.n, w.k)?;
    let blocks = w.experts * (w.n / BLOCK_N) * (w.k / V6_TILE_K);
    let out = gpu.zeros::<u8>(blocks * V6_BLOCK_BYTES)?;
    let f = gpu.function(FAMILY, "moe_gemm_v6_tile_weights")?;
    let (pc, ps, po) = (ptr(gpu, &w.codes), ptr(gpu, &w.scales), ptr(gpu, &out));
    let (nb, n, k) = (blocks as i64, as_i32(w.n, "N")?, as_i32(w.k, "K")?);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&pc).arg(&ps).arg(&nb).arg(&n).arg(&k).arg(&po);
    // Grid-stride: 16-B units = blocks * 1152; 2^20 threads cover it in a few passes.
    unsafe { b.launch(grid_1d((blocks * (V6_BLOCK_BYTES / 16)).min(1 << 20), 256)) }
        .map_err(|e| anyhow!("moe_gemm_v6_tile_weights: {e:?}"))?;
    Ok(TiledExpertWeights {
        experts: w.experts,
        n: w.n,
        k: w.k,
        blocks: out,
    })
}

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

/// The v6 kernel (`tiled`: the v6t entry, same shared memory) for a token tile with its dynamic shared memory set up (opt-in size, and the carveout hint at
/// the maximum so that the planned CTAs fit), the dynamic bytes, and the CTAs per SM the driver reports for it
/// (the planned [`v6_ctas_per_sm`] if the query fails; at least 1).
pub fn v6_function(
    gpu: &Gpu,
    token_tile: usize,
    tiled: bool,
) -> Result<(cudarc::driver::CudaFunction, usize, usize)> {
    let name = v6_name(token_tile, tiled);
    let smem = v6_smem_bytes(token_tile);
    let f = gpu.function_with_max_carveout(FAMILY, &name, smem)?;
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(V6_THREADS, smem, None)
        .map(|b| b as usize)
        .unwrap_or(v6_ctas_per_sm(token_tile))
        .max(1);
    Ok((f, smem, per_sm))
}

/// `moe_gemm_nvfp4_partial_v6_nt*` (2D tensor copies of the weights) or `_v6t_nt*` (pre-tiled weights).
fn v6_name(token_tile: usize, tiled: bool) -> String {
    let v = if tiled { "v6t" } else { "v6" };
    format!("moe_gemm_nvfp4_partial_{v}_nt{}", token_tile / 8)
}

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
) -> Result<TensorMap> {
    encode_tiled(
        "moe_gemm v6",
        dtype,
        elem_bytes,
        base,
        &[inner as u64, rows as u64],
        &[row_bytes as u64],
        &[box_inner, box_rows],
        swizzle,
    )
}

/// The v6 mainloop (same contract and checks as [`super::launch_partial_mma`]; called through
/// [`super::launch_partial_mma_with`], or [`super::launch_partial_mma_tiled`] with `tiled` = the weights in the
/// tiled layout: then the `v6t` entry reads them instead of `w.codes` / `w.scales`). The grid is
/// `min(cfg.ctas, resident CTAs)`: the CTAs are persistent (each walks items with stride gridDim.x), so a grid
/// larger than what fits at once only adds a tail wave.
pub(super) fn launch_partial_v6(
    gpu: &Gpu,
    w: &DeviceExpertWeights,
    tiled: Option<&TiledExpertWeights>,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &mut Workspace,
) -> Result<()> {
    if let Some(t) = tiled {
        ensure!(
            (t.experts, t.n, t.k) == (w.experts, w.n, w.k)
                && t.blocks.len() == w.experts * w.n * w.k / 16 * 9,
            "moe_gemm v6 tiled: tiled weights [{}, {}, {}] ({} B) do not match the weights [{}, {}, {}]",
            t.experts,
            t.n,
            t.k,
            t.blocks.len(),
            w.experts,
            w.n,
            w.k
        );
    }
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
        (m, TensorMap::unused())
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
    let (f, smem, per_sm) = v6_function(gpu, tt, tiled.is_some())?;
    let name = v6_name(tt, tiled.is_some());
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
    let w_tiled = tiled.map(|t| ptr(gpu, &t.blocks)).unwrap_or(0);
    if tiled.is_some() {
        b.arg(&tm_act).arg(&tm_act_scales).arg(&w_tiled);
    } else {
        b.arg(&tm_codes)
            .arg(&tm_scales)
            .arg(&tm_act)
            .arg(&tm_act_scales);
    }
    b.arg(&n).arg(&k_i).arg(&is_nvfp4);
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
