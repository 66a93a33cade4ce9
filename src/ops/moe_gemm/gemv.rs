//! Integer dot-product decode mainloop (kernels/moe_gemm_gemv.cu, session-12 A/B candidate, bench `nvfp4_gemv`):
//! NVFP4 A x NVFP4 B without tensor cores. Each 16-element block product is an exact integer sum of
//! (2 e2m1_a) x (2 e2m1_w) computed with IDP4A, scaled by `sa * sw / 4` (exact in fp32), so the partials differ
//! from the reference only by fp32 summation order (the tolerance of the v3 decode tests).
//!
//! Same contract as [`super::launch_partial_mma`]: fp32 partials `[splits][rows_total][N]` (no global scales) for
//! every owned row, padding rows untouched; the finish kernels are the same. Not routed: [`super::launch_partial`]
//! is unchanged.

use anyhow::{anyhow, bail, Result};

use super::{
    activation_ptrs, as_i32, check_partial_launch, ptr, DeviceActivations, DeviceExpertWeights,
    DeviceGrouping, GemmConfig, Workspace,
};
use crate::gpu::{launch_cfg, Gpu, PushKernelArg};

/// Kernel family name (kernels/moe_gemm_gemv.cu).
pub const FAMILY_GEMV: &str = "moe_gemm_gemv";
/// Weight rows per work item (8 warps x 8 rows): N must be a multiple of it (N % 128 == 0 is).
pub const GEMV_BLOCK_ROWS: usize = 64;
/// K per warp step (one 16-block per lane): K / splits must be a multiple of it (GemmConfig's 512 already is).
pub const GEMV_PASS_K: usize = 512;
const THREADS: u32 = 256;

/// The entry for a grouping: `_t2` (items of <= 2 tokens) when no expert can own more than 2 rows (masked capacity
/// <= 2: the bench's decode points up to ~8 tokens of 6-of-256 routing), else `_t4` (items of <= 4 tokens). Both
/// hold 2 CTAs per SM and are correct for any count (an expert with more rows is several items).
/// Returns (entry name, tokens per item, CTAs per SM).
pub fn gemv_entry(grp: &DeviceGrouping) -> (&'static str, usize, usize) {
    if grp.capacity >= 1 && grp.capacity <= 2 {
        ("moe_gemm_gemv_nvfp4_partial_t2", 2, 2)
    } else {
        ("moe_gemm_gemv_nvfp4_partial_t4", 4, 2)
    }
}

/// Dynamic shared memory of the entry: int8 activations (tokens x K/splits bytes) and sa/4 per block (fp32).
pub fn gemv_smem_bytes(tokens_per_item: usize, k: usize, splits: usize) -> usize {
    let k_split = k / splits.max(1);
    tokens_per_item * (k_split + k_split / 16 * 4)
}

/// IDP4A mainloop: fp32 partial sums of `A . B^T` (no global scales) into `ws` for every owned row, K split as
/// `cfg.splits` (the workspace shape of [`super::launch_partial_mma`]). `cfg.token_tile` and `cfg.ctas` are not
/// used: the grid is CTAs-per-SM (of the entry, [`gemv_entry`]) x SMs, persistent, so the launch shape does not
/// depend on device counts (graph-capturable). BF16 A is refused (the identity needs e2m1 activations).
pub fn launch_partial_gemv(
    gpu: &Gpu,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &mut Workspace,
) -> Result<()> {
    if matches!(a, DeviceActivations::Bf16 { .. }) {
        bail!(
            "moe_gemm gemv: A must be NVFP4 (the IDP4A mainloop multiplies e2m1 codes), got BF16"
        );
    }
    check_partial_launch(w, a, grp, cfg, ws)?;
    // check_partial_launch already holds N % 128 == 0 and K % (splits * 512) == 0; restated for this kernel.
    if !w.n.is_multiple_of(GEMV_BLOCK_ROWS) || !(w.k / cfg.splits).is_multiple_of(GEMV_PASS_K) {
        bail!(
            "moe_gemm gemv: N = {} must be a multiple of {GEMV_BLOCK_ROWS}, K / splits = {} of {GEMV_PASS_K}",
            w.n,
            w.k / cfg.splits
        );
    }
    let (name, tok, per_sm) = gemv_entry(grp);
    let smem = gemv_smem_bytes(tok, w.k, cfg.splits);
    // Persistent grid sized for `per_sm` resident CTAs: ask for the largest shared-memory carveout.
    let f = gpu.function_with_max_carveout(FAMILY_GEMV, name, smem)?;
    let (act, act_scales, _) = activation_ptrs(gpu, a);
    let (wc, wsc, grp_p, part) = (
        ptr(gpu, &w.codes),
        ptr(gpu, &w.scales),
        ptr(gpu, &grp.group),
        ptr(gpu, &ws.partial),
    );
    let (n, k) = (as_i32(w.n, "N")?, as_i32(w.k, "K")?);
    let (cap, e, rows, splits) = (
        as_i32(grp.capacity, "capacity")?,
        as_i32(grp.experts, "experts")?,
        as_i32(grp.rows_total, "rows")?,
        as_i32(cfg.splits, "splits")?,
    );
    let ctas = (gpu.info.sm_count.max(1) as usize * per_sm) as u32;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&wc)
        .arg(&wsc)
        .arg(&n)
        .arg(&k)
        .arg(&act)
        .arg(&act_scales);
    b.arg(&grp_p)
        .arg(&cap)
        .arg(&e)
        .arg(&rows)
        .arg(&part)
        .arg(&splits);
    unsafe { b.launch(launch_cfg((ctas, 1, 1), (THREADS, 1, 1), smem as u32)) }
        .map_err(|e| anyhow!("{name}: {e:?}"))?;
    Ok(())
}

/// Rust mirror of the kernel's bit operations (tests): `prmt.b32 d, lo, hi, sel` in the default mode. Result byte
/// i comes from selector nibble i (bits [15:0] only): bits [2:0] pick byte b of the 8 bytes {lo, hi}; bit 3 set
/// replicates the msb (sign) of byte b into all 8 bits.
pub fn prmt(lo: u32, hi: u32, sel: u32) -> u32 {
    let bytes = (((hi as u64) << 32) | lo as u64).to_le_bytes();
    let mut out = 0u32;
    for i in 0..4 {
        let s = (sel >> (4 * i)) & 0xF;
        let b = bytes[(s & 7) as usize];
        let v = if s & 8 != 0 {
            if b & 0x80 != 0 {
                0xFF
            } else {
                0
            }
        } else {
            b
        };
        out |= (v as u32) << (8 * i);
    }
    out
}

/// The magnitude table of the kernel: bytes 0..7 = 2 * |e2m1| = 0, 1, 2, 3, 4, 6, 8, 12.
pub const TBL_LO: u32 = 0x0302_0100;
pub const TBL_HI: u32 = 0x0C08_0604;

/// `__dp4a(a, b, c)` with signed bytes.
pub fn dp4a(a: u32, b: u32, c: i32) -> i32 {
    let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
    c + (0..4)
        .map(|i| a[i] as i8 as i32 * b[i] as i8 as i32)
        .sum::<i32>()
}

/// Mirror of `e2m1x4_to_int8x4` (activation conversion): low 4 nibbles of `codes` -> 4 signed bytes 2 * e2m1.
pub fn e2m1x4_to_int8x4(codes: u32) -> u32 {
    let pos = prmt(TBL_LO, TBL_HI, codes);
    let neg = prmt(TBL_LO, TBL_HI, codes ^ 0x8888);
    pos | (0x8080_8080u32.wrapping_sub(neg) ^ 0x8080_8080)
}

/// Mirror of one code word of `compute_step`: 8 activation int8 (a0 = elements 0..3, a1 = 4..7) against the 8
/// weight codes of `w` (nibble i = element i): dp4a(a, P) - dp4a(a, M) over both halves.
pub fn word_dot(a0: u32, a1: u32, w: u32) -> i32 {
    let x = w ^ 0x8888_8888;
    let (p0, p1) = (prmt(TBL_LO, TBL_HI, w), prmt(TBL_LO, TBL_HI, w >> 16));
    let (m0, m1) = (prmt(TBL_LO, TBL_HI, x), prmt(TBL_LO, TBL_HI, x >> 16));
    let pos = dp4a(a1, p1, dp4a(a0, p0, 0));
    let neg = dp4a(a1, m1, dp4a(a0, m0, 0));
    pos - neg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::e2m1;

    fn twice(code: u8) -> i32 {
        let v = e2m1::decode(code) * 2.0;
        assert_eq!(v, v.trunc());
        v as i32
    }

    /// P / M of every code byte (2 nibbles) against the doubled e2m1 values, incl. -0 (code 8) -> 0.
    #[test]
    fn prmt_identity_all_code_bytes() {
        for byte in 0u32..256 {
            let lo_code = (byte & 0xF) as u8;
            let hi_code = (byte >> 4) as u8;
            let p = prmt(TBL_LO, TBL_HI, byte);
            let m = prmt(TBL_LO, TBL_HI, byte ^ 0x88);
            for (i, code) in [lo_code, hi_code].into_iter().enumerate() {
                let (pb, mb) = ((p >> (8 * i)) as u8 as i32, (m >> (8 * i)) as u8 as i32);
                assert_eq!(pb - mb, twice(code), "byte {byte:#04x} nibble {i}");
                assert!(pb == 0 || mb == 0, "byte {byte:#04x}: P and M both set");
            }
            // Activation side: signed bytes.
            let s = e2m1x4_to_int8x4(byte);
            assert_eq!(s.to_le_bytes()[0] as i8 as i32, twice(lo_code));
            assert_eq!(s.to_le_bytes()[1] as i8 as i32, twice(hi_code));
            assert_eq!(s >> 16, 0);
        }
    }

    /// Word dot products equal 4 x the exact e2m1 dot product for every (activation code, weight code) pair in
    /// every position, and for words of mixed codes.
    #[test]
    fn dp4a_word_dot_exact() {
        for ca in 0u32..16 {
            for cw in 0u32..16 {
                for pos in 0..8 {
                    let a_word = ca << (4 * pos);
                    let w_word = cw << (4 * pos);
                    let (a0, a1) = (e2m1x4_to_int8x4(a_word), e2m1x4_to_int8x4(a_word >> 16));
                    assert_eq!(
                        word_dot(a0, a1, w_word),
                        twice(ca as u8) * twice(cw as u8),
                        "a {ca} w {cw} pos {pos}"
                    );
                }
            }
        }
        let mut s = 0x1234_5678u32;
        for _ in 0..10_000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let a = s;
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let w = s;
            let expect: i32 = (0..8)
                .map(|i| twice(((a >> (4 * i)) & 0xF) as u8) * twice(((w >> (4 * i)) & 0xF) as u8))
                .sum();
            let (a0, a1) = (e2m1x4_to_int8x4(a), e2m1x4_to_int8x4(a >> 16));
            assert_eq!(word_dot(a0, a1, w), expect, "a {a:#x} w {w:#x}");
        }
    }

    #[test]
    fn prmt_sign_replicate() {
        // Bit 3 replicates the msb of the picked byte; bits [15:0] only.
        assert_eq!(prmt(0x8000_0000, 0, 0x000B), 0x0000_00FF);
        assert_eq!(prmt(0x8000_0000, 0, 0x0003), 0x0000_0080);
        assert_eq!(prmt(0x0000_0000, 0x0000_0042, 0xFFFF_0004), 0x0000_0042);
    }
}
