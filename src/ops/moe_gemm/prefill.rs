//! Prefill mainloop of the NVFP4 MoE grouped GEMM on Hopper wgmma (kernels/moe_gemm_prefill.cu).
//!
//! Same contract as [`super::launch_partial`] with one K split: it writes the fp32 accumulator
//! `partial[row, n] = sum_k A[row, k] * B[e(row), n, k]` (no global scales) into a [`Workspace`] with
//! `splits == 1`, so the existing finish kernels ([`super::launch_finish_bf16`], [`super::launch_finish_l1`],
//! [`super::launch_finish_l2`]) apply the epilogues unchanged. Contiguous grouping only (prefill: tokens sorted
//! by expert, offsets). CTA tile 128 tokens x 128 or 256 weight rows, K stages of 64: `N % 128 == 0`,
//! `K % 64 == 0`.
//!
//! [`super::launch_partial`] routes here when [`routes_here`] holds (contiguous layout, mean rows per
//! expert >= [`MIN_MEAN_ROWS_PER_EXPERT`], one K split); [`launch_partial_prefill`] forces this path with
//! the 128 x 256 tile when `N % 256 == 0` ([`default_tile_n`]), [`launch_partial_prefill_tile`] with a
//! chosen tile.
//!
//! The CPU mirrors at the bottom ([`sw128_offset`], [`dequant8_like_kernel`], [`sw128_desc`]) restate the
//! device address, dequant and descriptor logic so unit tests can check them without a GPU.

use anyhow::{anyhow, bail, ensure, Result};
use half::bf16;

use super::{
    activation_ptrs, as_i32, ptr, DeviceActivations, DeviceExpertWeights, DeviceGrouping,
    GemmConfig, Workspace, MAX_EXPERTS,
};
use crate::formats::e4m3;
use crate::gpu::{launch_cfg, Gpu, PushKernelArg};

/// Kernel family name (kernels/moe_gemm_prefill.cu).
pub const FAMILY: &str = "moe_gemm_prefill";
/// Tokens per CTA tile (two warp groups of 64 rows: the wgmma M dimension).
pub const TILE_M: usize = 128;
/// Weight rows per CTA tile (the wgmma N dimension): N must be a multiple of it.
pub const TILE_N: usize = 128;
/// K per pipeline stage (one 128-byte BF16 swizzle atom): K must be a multiple of it.
pub const STAGE_K: usize = 64;
const RING: usize = 4;
const THREADS: u32 = 256;
/// Dynamic shared memory: RING BF16 A tiles and 2 BF16 B tiles (16 KiB each), RING raw stages (weights and
/// NVFP4 A: 2 x (4 KiB codes + 512 B scales)), plus 1 KiB so the kernel can align its tiles to 1024 bytes.
/// Must match `kSmemBytes + 1024` in the .cu (a static_assert there pins the number).
pub const SMEM_BYTES: usize = RING * 16384 + 2 * 16384 + RING * 9216 + 1024;
/// Weight rows per CTA tile of the wide variant (`moe_gemm_prefill_partial_n256`, m64n256k16).
pub const TILE_N_WIDE: usize = 256;
/// Dynamic shared memory of the wide variant: B tiles and raw B stages twice as large (`Layout<256>` + 1024).
pub const SMEM_BYTES_N256: usize = RING * 16384 + 2 * 32768 + RING * (9216 + 4608) + 1024;
/// Dynamic shared memory of the warp-specialized wide variant (`moe_gemm_prefill_partial_n256_ws`,
/// `WsLayout` + 1024): 5 A tiles (16 KiB), 2 B tiles (32 KiB), 5 raw stages (13.5 KiB), 9 mbarriers (128 B).
pub const SMEM_BYTES_N256_WS: usize = 5 * 16384 + 2 * 32768 + 5 * (9216 + 4608) + 128 + 1024;
/// ... of `moe_gemm_prefill_partial_n256_ws3b`: 4 A tiles, 3 B tiles, 4 raw stages, 10 mbarriers (128 B).
pub const SMEM_BYTES_N256_WS3B: usize = 4 * 16384 + 3 * 32768 + 4 * (9216 + 4608) + 128 + 1024;
const THREADS_WS: u32 = 384;

/// Which prefill mainloop a launch uses (an A/B option; [`launch_partial_prefill`] uses [`Mainloop::Sync`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mainloop {
    /// `moe_gemm_prefill_partial` / `_n256`: all 256 threads copy, dequantize and issue wgmma, two CTA barriers
    /// per 64-K stage. Tile width [`TILE_N`] or [`TILE_N_WIDE`].
    Sync,
    /// `moe_gemm_prefill_partial_n256_ws`: warp-specialized 128 x 256 tile (one producer/dequant warp group, two
    /// wgmma warp groups, mbarrier handoffs; see the .cu): 5-slot raw ring, prefetch 3, 2 BF16 B tiles. Needs
    /// `N % 256 == 0`. Partial sums bit-identical to the `Sync` 128 x 256 kernel.
    WarpSpecialized,
    /// `moe_gemm_prefill_partial_n256_ws3b`: the same with a 4-slot ring, prefetch 2 and 3 B tiles (the dequant
    /// may run 2 stages ahead of the tensor pipe).
    WarpSpecialized3B,
    /// `moe_gemm_prefill_partial_n256_wsb`: the `WarpSpecialized` rings with the B dequant split: the producer
    /// dequantizes B rows 128..255, each consumer warp group 64 of rows 0..127 (and its A rows) for stage k + 1
    /// while the wgmma of stage k runs.
    WarpSpecializedBalanced,
}

/// [`super::launch_partial`] routes a contiguous grouping here from this mean number of rows per expert
/// (`rows_total / experts`; Flash top-6 of 256 crosses it at ~2730 tokens). Below it most token tiles would be
/// mostly padding and the swap-AB mma.sync kernel wins.
pub const MIN_MEAN_ROWS_PER_EXPERT: usize = 64;

/// `N % 128 == 0`, `K % 64 == 0` (all DSV4 expert shapes qualify).
pub fn check_shape(n: usize, k: usize) -> Result<()> {
    ensure!(
        n > 0 && n.is_multiple_of(TILE_N),
        "moe_gemm prefill: N = {n} must be a positive multiple of {TILE_N}"
    );
    ensure!(
        k > 0 && k.is_multiple_of(STAGE_K),
        "moe_gemm prefill: K = {k} must be a positive multiple of {STAGE_K}"
    );
    Ok(())
}

/// Whether [`super::launch_partial`] sends this launch to the prefill kernel.
pub fn routes_here(w: &DeviceExpertWeights, grp: &DeviceGrouping, cfg: &GemmConfig) -> bool {
    grp.capacity == 0
        && cfg.splits == 1
        && grp.experts >= 1
        && grp.rows_total >= MIN_MEAN_ROWS_PER_EXPERT * grp.experts
        && check_shape(w.n, w.k).is_ok()
}

/// Prefill mainloop: fp32 `A . B^T` per owned row into `ws` (`ws.splits` must be 1). Contiguous grouping only.
/// CTA tile 128 x 256 when `N % 256 == 0` (the routed default: on the H200 it beat 128 x 128 at every prefill
/// point of round 1, e.g. L1 4096 tokens 3724 vs 4822 us), else 128 x 128.
pub fn launch_partial_prefill(
    gpu: &Gpu,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    ws: &mut Workspace,
) -> Result<()> {
    launch_partial_prefill_tile(gpu, w, a, grp, ws, default_tile_n(w.n))
}

/// Tile width [`launch_partial_prefill`] uses for `N` weight rows: [`TILE_N_WIDE`] when it divides N, else
/// [`TILE_N`].
pub fn default_tile_n(n: usize) -> usize {
    if n.is_multiple_of(TILE_N_WIDE) {
        TILE_N_WIDE
    } else {
        TILE_N
    }
}

/// [`launch_partial_prefill`] with a chosen CTA tile width: [`TILE_N`] (128) or [`TILE_N_WIDE`] (256, needs
/// `N % 256 == 0`).
pub fn launch_partial_prefill_tile(
    gpu: &Gpu,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    ws: &mut Workspace,
    tile_n: usize,
) -> Result<()> {
    launch_partial_prefill_with(gpu, w, a, grp, ws, tile_n, Mainloop::Sync)
}

/// [`launch_partial_prefill_tile`] with a chosen mainloop: [`Mainloop::WarpSpecialized`] needs
/// `tile_n == TILE_N_WIDE`.
pub fn launch_partial_prefill_with(
    gpu: &Gpu,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    ws: &mut Workspace,
    tile_n: usize,
    mainloop: Mainloop,
) -> Result<()> {
    check_shape(w.n, w.k)?;
    let (name, smem, threads) = match (tile_n, mainloop) {
        (TILE_N, Mainloop::Sync) => ("moe_gemm_prefill_partial", SMEM_BYTES, THREADS),
        (TILE_N_WIDE, Mainloop::Sync) => ("moe_gemm_prefill_partial_n256", SMEM_BYTES_N256, THREADS),
        (TILE_N_WIDE, Mainloop::WarpSpecialized) => (
            "moe_gemm_prefill_partial_n256_ws",
            SMEM_BYTES_N256_WS,
            THREADS_WS,
        ),
        (TILE_N_WIDE, Mainloop::WarpSpecialized3B) => (
            "moe_gemm_prefill_partial_n256_ws3b",
            SMEM_BYTES_N256_WS3B,
            THREADS_WS,
        ),
        (TILE_N_WIDE, Mainloop::WarpSpecializedBalanced) => (
            "moe_gemm_prefill_partial_n256_wsb",
            SMEM_BYTES_N256_WS,
            THREADS_WS,
        ),
        (other, Mainloop::Sync) => {
            bail!("moe_gemm prefill: tile width {other} (known: {TILE_N}, {TILE_N_WIDE})")
        }
        (
            other,
            Mainloop::WarpSpecialized
            | Mainloop::WarpSpecialized3B
            | Mainloop::WarpSpecializedBalanced,
        ) => bail!(
            "moe_gemm prefill: tile width {other} with the warp-specialized mainloop (known: {TILE_N_WIDE})"
        ),
    };
    ensure!(
        w.n.is_multiple_of(tile_n),
        "moe_gemm prefill: N = {} must be a multiple of the tile width {tile_n}",
        w.n
    );
    a.check()?;
    let (a_rows, a_k) = a.rows_k();
    ensure!(
        a_k == w.k,
        "moe_gemm prefill: A has K = {a_k}, weights K = {}",
        w.k
    );
    ensure!(
        a_rows >= grp.rows_total,
        "moe_gemm prefill: A has {a_rows} rows, the grouping spans {}",
        grp.rows_total
    );
    ensure!(
        grp.capacity == 0,
        "moe_gemm prefill: needs the contiguous grouping (got masked, capacity {})",
        grp.capacity
    );
    ensure!(
        grp.experts == w.experts && grp.experts >= 1 && grp.experts <= MAX_EXPERTS,
        "moe_gemm prefill: grouping has {} experts, weights {} (1..={MAX_EXPERTS})",
        grp.experts,
        w.experts
    );
    ensure!(
        ws.splits == 1 && ws.rows_total == grp.rows_total && ws.n == w.n,
        "moe_gemm prefill: workspace is [{}, {}, {}], needs [1, {}, {}]",
        ws.splits,
        ws.rows_total,
        ws.n,
        grp.rows_total,
        w.n
    );
    ensure!(
        smem + 4096 <= gpu.info.max_smem_per_block_optin,
        "moe_gemm prefill: needs {smem} B of dynamic shared memory, the device allows {}",
        gpu.info.max_smem_per_block_optin
    );
    if grp.rows_total == 0 {
        return Ok(());
    }
    let f = gpu.function_with_smem(FAMILY, name, smem)?;
    let (act, act_scales, is_nvfp4) = activation_ptrs(gpu, a);
    let (wc, wsc, grp_p, part) = (
        ptr(gpu, &w.codes),
        ptr(gpu, &w.scales),
        ptr(gpu, &grp.group),
        ptr(gpu, &ws.partial),
    );
    let (n, k) = (as_i32(w.n, "N")?, as_i32(w.k, "K")?);
    let (e, rows) = (
        as_i32(grp.experts, "experts")?,
        as_i32(grp.rows_total, "rows")?,
    );
    // Persistent grid: one CTA per SM (136 / 187 KB of shared memory each), never more than the most work items
    // any grouping of these rows can produce (sum_e ceil(c_e / 128) <= rows / 128 + experts).
    let max_items = (grp.rows_total / TILE_M + grp.experts) * (w.n / tile_n);
    let ctas = (gpu.info.sm_count as usize).clamp(1, max_items.max(1)) as u32;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&wc)
        .arg(&wsc)
        .arg(&n)
        .arg(&k)
        .arg(&act)
        .arg(&act_scales)
        .arg(&is_nvfp4);
    b.arg(&grp_p).arg(&e).arg(&rows).arg(&part);
    unsafe { b.launch(launch_cfg((ctas, 1, 1), (threads, 1, 1), smem as u32)) }
        .map_err(|e| anyhow!("{name}: {e:?}"))?;
    Ok(())
}

// ------------------------------------------------------------------------------------ CPU mirrors of the device

/// Byte offset of (row, 16-byte chunk) in a 128B-swizzled K-major BF16 tile (64 elements = 128 B per row):
/// `row * 128 + ((chunk ^ (row % 8)) * 16)`. Mirror of `sw128_offset` in the .cu.
pub fn sw128_offset(row: u32, chunk: u32) -> u32 {
    row * 128 + ((chunk ^ (row & 7)) << 4)
}

/// The 128B swizzle as the hardware applies it to a logical (unswizzled) byte address inside a 1024-aligned
/// tile: address bits [4, 7) XOR bits [7, 10) (cute `Swizzle<3, 4, 3>`). Used to check [`sw128_offset`] and
/// the descriptor's K advance (+32 B per K = 16 slice) against the documented pattern.
pub fn sw128_hw(logical: u32) -> u32 {
    logical ^ (((logical >> 7) & 7) << 4)
}

/// Mirror of `sw128_desc` in the .cu: start address >> 4 in bits 0-13, LBO = 1 (unused) in bits 16-29,
/// SBO = 1024 B >> 4 in bits 32-45, base offset 0, swizzle mode 1 (128B) in bits 62-63.
pub fn sw128_desc(smem_addr: u32) -> u64 {
    ((smem_addr & 0x3FFFF) >> 4) as u64 | (1u64 << 16) | ((1024u64 >> 4) << 32) | (1u64 << 62)
}

/// `prmt.b32` / `__byte_perm(x, y, s)` without the sign-extension modes: byte i of the result is byte
/// `(s >> 4i) & 7` of the 8-byte value `y:x`.
pub fn byte_perm(x: u32, y: u32, s: u32) -> u32 {
    let v = ((y as u64) << 32) | x as u64;
    (0..4).fold(0u32, |r, i| {
        let sel = (s >> (4 * i)) & 7;
        r | ((((v >> (8 * sel)) & 0xFF) as u32) << (8 * i))
    })
}

/// Mirror of the kernel's `dequant8`: the 8 codes of `word` (nibble i = element i) times block scale
/// `scale_code`, as the 8 BF16 values the kernel stores in natural K order, times 2^9 (the kernel's accumulator
/// restore), i.e. what the tensor core multiplies. `mul.rn.bf16x2` is modelled as the exact f32 product
/// rounded to bf16.
pub fn dequant8_like_kernel(word: u32, scale_code: u8) -> [f32; 8] {
    let s = bf16::from_f32(e4m3::decode(scale_code) * f32::powi(2.0, 117));
    let mul2 = |bits: u32| -> u32 {
        let lo = bf16::from_bits(bits as u16).to_f32() * s.to_f32();
        let hi = bf16::from_bits((bits >> 16) as u16).to_f32() * s.to_f32();
        bf16::from_f32(lo).to_bits() as u32 | ((bf16::from_f32(hi).to_bits() as u32) << 16)
    };
    let pair = |i: u32| -> u32 {
        let v = word << (12 - 4 * i);
        mul2((v & 0x8000_8000) | ((v >> 6) & 0x01C0_01C0))
    };
    let (p0, p1, p2, p3) = (pair(0), pair(1), pair(2), pair(3));
    let out = [
        byte_perm(p0, p1, 0x5410),
        byte_perm(p2, p3, 0x5410),
        byte_perm(p0, p1, 0x7632),
        byte_perm(p2, p3, 0x7632),
    ];
    let mut v = [0f32; 8];
    for (j, w) in out.iter().enumerate() {
        v[2 * j] = bf16::from_bits(*w as u16).to_f32() * 512.0;
        v[2 * j + 1] = bf16::from_bits((*w >> 16) as u16).to_f32() * 512.0;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::e2m1;

    #[test]
    fn sw128_offset_is_a_bijection_on_the_tile_and_matches_the_hardware_pattern() {
        // 128 rows x 8 chunks of 16 B cover [0, 16 KiB) exactly once.
        let mut seen = vec![false; 128 * 8];
        for row in 0..128u32 {
            for chunk in 0..8u32 {
                let off = sw128_offset(row, chunk);
                assert_eq!(off % 16, 0);
                assert!(off < 16384, "row {row} chunk {chunk}: offset {off}");
                let u = (off / 16) as usize;
                assert!(!seen[u], "row {row} chunk {chunk}: offset {off} used twice");
                seen[u] = true;
                // Stored where the hardware looks for logical (row, chunk): row-major 128 B rows, swizzled.
                assert_eq!(off, sw128_hw(row * 128 + chunk * 16));
                // The k-th K = 16 slice read through a descriptor whose start address is +32k bytes.
                for k in 0..4u32 {
                    for half in 0..2u32 {
                        if chunk == 2 * k + half {
                            assert_eq!(sw128_hw(32 * k + row * 128 + half * 16), off);
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn sw128_stores_of_the_dequant_mapping_are_bank_conflict_free() {
        // A warp's 16-byte stores are served 8 lanes at a time; lanes 8p..8p+8 (rows 4p'..4p'+4, halves 0/1)
        // store chunk 4h + j at the same time and must hit 8 distinct 16-byte bank groups.
        for warp in 0..8u32 {
            for phase in 0..4u32 {
                for j in 0..4u32 {
                    let mut groups: Vec<u32> = (0..8u32)
                        .map(|l| {
                            let t = warp * 32 + phase * 8 + l;
                            (sw128_offset(t >> 1, 4 * (t & 1) + j) / 16) % 8
                        })
                        .collect();
                    groups.sort();
                    groups.dedup();
                    assert_eq!(groups.len(), 8, "warp {warp} phase {phase} j {j}");
                }
            }
        }
    }

    #[test]
    fn descriptor_fields_sit_where_the_ptx_isa_puts_them() {
        let d = sw128_desc(0x1_2400);
        assert_eq!(d & 0x3FFF, 0x1_2400 >> 4);
        assert_eq!((d >> 16) & 0x3FFF, 1);
        assert_eq!((d >> 32) & 0x3FFF, 64);
        assert_eq!((d >> 49) & 7, 0);
        assert_eq!(d >> 62, 1);
        // The K advance adds 2 per 32 bytes without carrying out of the address field.
        assert_eq!((d + 6) & 0x3FFF, (0x1_2400 + 96) >> 4);
    }

    #[test]
    fn byte_perm_model_matches_the_selectors_the_kernel_uses() {
        let (x, y) = (0x4433_2211u32, 0x8877_6655u32);
        assert_eq!(byte_perm(x, y, 0x5410), 0x6655_2211);
        assert_eq!(byte_perm(x, y, 0x7632), 0x8877_4433);
    }

    #[test]
    fn natural_order_dequant_is_exact_for_every_code_position_and_scale() {
        // Every non-NaN e4m3 scale; words whose nibbles take all 16 codes at every position (x over all 16-bit
        // values, the high half a different permutation of the same codes).
        for scale_code in (0..=255u8).filter(|c| c & 0x7F != 0x7F) {
            let s = e4m3::decode(scale_code);
            for x in (0..=0xFFFFu32).step_by(7).chain(0..16) {
                let word = x | ((x ^ 0xA5C3).rotate_left(5) & 0xFFFF) << 16;
                let got = dequant8_like_kernel(word, scale_code);
                for (i, g) in got.iter().enumerate() {
                    let code = ((word >> (4 * i)) & 0xF) as u8;
                    let want = e2m1::decode(code) * s;
                    assert!(
                        g.to_bits() == want.to_bits() || (*g == 0.0 && want == 0.0),
                        "word {word:#010x} element {i} scale {scale_code:#04x}: got {g} want {want}"
                    );
                }
            }
        }
    }

    // ---------------------------------------------------------------- model of the warp-specialized handoffs

    /// Ring sizes of the warp-specialized entries (WsLayout532 / WsLayout423 in the .cu): (R, P, B), and whether
    /// the B dequant is shared with the consumers (`_wsb`).
    const WS_PIPELINES: [((usize, usize, usize), bool); 3] =
        [((5, 3, 2), false), ((4, 2, 3), false), ((5, 3, 2), true)];

    /// An mbarrier as the PTX ISA defines it: a phase completes when `expected` arrivals are in;
    /// `try_wait.parity p` succeeds once the phase of parity p has completed, i.e. when the current phase's
    /// parity differs from p.
    struct MBar {
        phase: u32,
        pending: u32,
        expected: u32,
    }

    #[derive(Clone, Copy, Debug)]
    enum Op {
        /// Named barrier (`bar.sync`) of group g: arrive, then wait for the generation to complete.
        BarArrive(usize),
        BarWait(usize),
        Wait(usize, u32),
        Arrive(usize),
        /// Producer thread writes its share of raw slot s with stage k (cp.async).
        WriteRaw(usize, usize),
        /// A thread writes its share of B slot b / A tile of ring slot s with stage k (dequant).
        WriteB(usize, usize),
        WriteA(usize, usize),
        /// A dequantizer reads raw stage k (every share must hold it).
        ReadRaw(usize),
        /// Consumer thread reads stage k's wgmma operands (raw slot, B slot, A tile shares must all hold k).
        Read(usize),
        /// Consumer thread's wgmma of stage k retired (wait_group): same check, then counted as retired.
        Retire(usize),
    }

    struct Barriers {
        slot_empty: usize,
        raw_full: usize,
        b_full: usize,
        b_empty: usize,
        count: usize,
    }

    fn ws_barriers((r, _, b): (usize, usize, usize), balanced: bool) -> Barriers {
        if balanced {
            Barriers {
                slot_empty: 0,
                raw_full: r,
                b_full: 2 * r,
                b_empty: 2 * r + b,
                count: 2 * r + 2 * b,
            }
        } else {
            Barriers {
                slot_empty: 0,
                raw_full: usize::MAX,
                b_full: r,
                b_empty: r + b,
                count: r + 2 * b,
            }
        }
    }

    /// The per-thread programs of the .cu (producer threads first, then consumer warp group 0, then 1).
    fn ws_programs(
        (r, p, b): (usize, usize, usize),
        balanced: bool,
        producers: usize,
        consumers_per_wg: usize,
        items: usize,
        stages: usize,
    ) -> Vec<Vec<Op>> {
        let total = items * stages;
        let bars = ws_barriers((r, p, b), balanced);
        let parity = |k: usize, n: usize| ((k / n) & 1) as u32;
        let mut progs = Vec::new();
        for _ in 0..producers {
            let mut ops = Vec::new();
            let issue = |ops: &mut Vec<Op>, k: usize| {
                if k < total {
                    ops.push(Op::Wait(bars.slot_empty + k % r, parity(k, r) ^ 1));
                    ops.push(Op::WriteRaw(k % r, k));
                }
            };
            for k in 0..p {
                issue(&mut ops, k);
            }
            for k in 0..total {
                if balanced {
                    ops.push(Op::Arrive(bars.raw_full + k % r));
                    ops.push(Op::Wait(bars.raw_full + k % r, parity(k, r)));
                } else {
                    ops.push(Op::BarArrive(0));
                    ops.push(Op::BarWait(0));
                }
                ops.push(Op::ReadRaw(k));
                ops.push(Op::Wait(bars.b_empty + k % b, parity(k, b) ^ 1));
                ops.push(Op::WriteB(k % b, k));
                ops.push(Op::Arrive(bars.b_full + k % b));
                issue(&mut ops, k + p);
            }
            progs.push(ops);
        }
        for wg in 0..2 {
            for _ in 0..consumers_per_wg {
                let mut ops = Vec::new();
                let prepare = |ops: &mut Vec<Op>, j: usize| {
                    ops.push(Op::Wait(bars.raw_full + j % r, parity(j, r)));
                    ops.push(Op::ReadRaw(j));
                    ops.push(Op::Wait(bars.b_empty + j % b, parity(j, b) ^ 1));
                    ops.push(Op::WriteA(j % r, j));
                    ops.push(Op::WriteB(j % b, j));
                    ops.push(Op::Arrive(bars.b_full + j % b));
                };
                let mut k = 0;
                if balanced && total > 0 {
                    prepare(&mut ops, 0);
                }
                for _ in 0..items {
                    for st in 0..stages {
                        ops.push(Op::Wait(bars.b_full + k % b, parity(k, b)));
                        if !balanced {
                            // The A dequant of stage k into its own rows, then the warp group's named barrier.
                            ops.push(Op::ReadRaw(k));
                            ops.push(Op::WriteA(k % r, k));
                            ops.push(Op::BarArrive(1 + wg));
                            ops.push(Op::BarWait(1 + wg));
                        }
                        ops.push(Op::Read(k));
                        if st > 0 {
                            ops.push(Op::Retire(k - 1));
                            ops.push(Op::Arrive(bars.b_empty + (k - 1) % b));
                            ops.push(Op::Arrive(bars.slot_empty + (k - 1) % r));
                        }
                        if balanced && k + 1 < total {
                            prepare(&mut ops, k + 1);
                        }
                        k += 1;
                    }
                    ops.push(Op::Retire(k - 1));
                    ops.push(Op::Arrive(bars.b_empty + (k - 1) % b));
                    ops.push(Op::Arrive(bars.slot_empty + (k - 1) % r));
                }
                progs.push(ops);
            }
        }
        progs
    }

    /// Run the programs under a random interleaving; Err on a deadlock or on a read / overwrite of the wrong
    /// stage (a slot overwritten while a consumer may still read it, or read before every share was written).
    /// A-tile shares are per warp group in the .cu (each group reads only its own rows): modelled per group.
    fn ws_simulate(
        cfg: (usize, usize, usize),
        balanced: bool,
        producers: usize,
        consumers_per_wg: usize,
        items: usize,
        stages: usize,
        rng: &mut impl rand::Rng,
    ) -> std::result::Result<(), String> {
        let (r, _, b) = cfg;
        let consumers = 2 * consumers_per_wg;
        let agents = producers + consumers;
        let progs = ws_programs(cfg, balanced, producers, consumers_per_wg, items, stages);
        let bars_at = ws_barriers(cfg, balanced);
        let b_writers = if balanced { agents } else { producers };
        let mut bars: Vec<MBar> = (0..bars_at.count)
            .map(|i| {
                let expected = if (bars_at.b_full..bars_at.b_full + b).contains(&i) {
                    b_writers
                } else if balanced && (bars_at.raw_full..bars_at.raw_full + r).contains(&i) {
                    producers
                } else {
                    consumers
                } as u32;
                MBar {
                    phase: 0,
                    pending: expected,
                    expected,
                }
            })
            .collect();
        let group_size = [producers, consumers_per_wg, consumers_per_wg];
        let (mut bar_count, mut bar_gen) = ([0usize; 3], [0usize; 3]);
        let mut waiting_gen = vec![0usize; agents];
        // Stage held by each writer's share (None: never written). Raw: producers; B: producers (+ consumers);
        // A: consumers, indexed by agent - producers.
        let mut raw: Vec<Vec<Option<usize>>> = vec![vec![None; producers]; r];
        let mut bt: Vec<Vec<Option<usize>>> = vec![vec![None; b_writers]; b];
        let mut at: Vec<Vec<Option<usize>>> = vec![vec![None; consumers]; r];
        let total = items * stages;
        let mut retired = vec![0usize; total];
        let mut pc = vec![0usize; agents];
        loop {
            let runnable: Vec<usize> = (0..agents)
                .filter(|&a| {
                    pc[a] < progs[a].len()
                        && match progs[a][pc[a]] {
                            Op::Wait(i, par) => (bars[i].phase & 1) != par,
                            Op::BarWait(g) => bar_gen[g] > waiting_gen[a],
                            _ => true,
                        }
                })
                .collect();
            if runnable.is_empty() {
                if (0..agents).all(|a| pc[a] == progs[a].len()) {
                    return Ok(());
                }
                let stuck: Vec<String> = (0..agents)
                    .filter(|&a| pc[a] < progs[a].len())
                    .map(|a| format!("agent {a} at {:?}", progs[a][pc[a]]))
                    .collect();
                return Err(format!("deadlock: {}", stuck.join(", ")));
            }
            let a = runnable[rng.random_range(0..runnable.len())];
            let op = progs[a][pc[a]];
            let early = |k: usize,
                         lag: usize,
                         what: &str,
                         retired: &[usize]|
             -> std::result::Result<(), String> {
                if k >= lag && retired[k - lag] != consumers {
                    Err(format!(
                        "agent {a}: {what} overwritten with stage {k} before stage {} retired",
                        k - lag
                    ))
                } else {
                    Ok(())
                }
            };
            match op {
                Op::BarArrive(g) => {
                    waiting_gen[a] = bar_gen[g];
                    bar_count[g] += 1;
                    if bar_count[g] == group_size[g] {
                        bar_count[g] = 0;
                        bar_gen[g] += 1;
                    }
                }
                Op::BarWait(_) | Op::Wait(..) => {}
                Op::Arrive(i) => {
                    let m = &mut bars[i];
                    m.pending -= 1;
                    if m.pending == 0 {
                        m.phase += 1;
                        m.pending = m.expected;
                    }
                }
                Op::WriteRaw(s, k) => {
                    early(k, r, "raw slot", &retired)?;
                    raw[s][a] = Some(k);
                }
                Op::WriteB(s, k) => {
                    early(k, b, "B slot", &retired)?;
                    bt[s][a] = Some(k);
                }
                Op::WriteA(s, k) => {
                    early(k, r, "A tile", &retired)?;
                    at[s][a - producers] = Some(k);
                }
                Op::ReadRaw(k) => {
                    if !raw[k % r].iter().all(|&x| x == Some(k)) {
                        return Err(format!("agent {a} {op:?}: raw slot holds {:?}", raw[k % r]));
                    }
                }
                Op::Read(k) | Op::Retire(k) => {
                    let group = (a - producers) / consumers_per_wg;
                    let a_shares =
                        &at[k % r][group * consumers_per_wg..(group + 1) * consumers_per_wg];
                    let ok = raw[k % r].iter().all(|&x| x == Some(k))
                        && bt[k % b].iter().all(|&x| x == Some(k))
                        && a_shares.iter().all(|&x| x == Some(k));
                    if !ok {
                        return Err(format!(
                            "agent {a} {op:?}: raw slot {:?}, B slot {:?}, A tile {a_shares:?}",
                            raw[k % r],
                            bt[k % b]
                        ));
                    }
                    if let Op::Retire(_) = op {
                        retired[k] += 1;
                    }
                }
            }
            pc[a] += 1;
        }
    }

    #[test]
    fn ws_mbarrier_protocol_never_deadlocks_and_never_exposes_a_wrong_stage() {
        use rand::SeedableRng;
        let seed = crate::ops::inputs::fresh_seed("ws_mbarrier_protocol", "MOE_GEMM_SEED");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for (cfg, balanced) in WS_PIPELINES {
            assert!(
                cfg.0 > cfg.1 && cfg.2 >= 2,
                "{cfg:?} breaks the deadlock argument in the .cu"
            );
            for (items, stages) in [(1, 1), (1, 2), (3, 1), (2, 3), (3, 8), (2, 17)] {
                for trial in 0..40 {
                    ws_simulate(cfg, balanced, 2, 2, items, stages, &mut rng).unwrap_or_else(|e| {
                        panic!(
                            "seed {seed} (R, P, B) {cfg:?} balanced {balanced} items {items} stages {stages} \
                             trial {trial}: {e}"
                        )
                    });
                }
            }
        }
        // The model does catch broken rings: R = P deadlocks (the producer's issue of stage k + P waits for stage k
        // to retire, which needs b_full of k + 1, arrived only after that issue), and a single B tile deadlocks too.
        for balanced in [false, true] {
            for broken in [(3, 3, 2), (4, 2, 1)] {
                let err = ws_simulate(broken, balanced, 2, 2, 2, 8, &mut rng).unwrap_err();
                assert!(
                    err.contains("deadlock"),
                    "seed {seed} {broken:?} balanced {balanced}: {err}"
                );
            }
        }
    }
}
