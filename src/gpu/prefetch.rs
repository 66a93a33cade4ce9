//! L2 prefetch of constant byte ranges (kernels/l2_prefetch.cu): weights a later kernel of the stream will stream,
//! fetched into L2 while the kernels in between leave the memory system idle (a decode step's latency-bound chains).
//!
//! Contract: up to [`MAX_RANGES`] ranges, each 16-byte aligned, of memory no kernel writes while the prefetch may run
//! (weights); each range's length is rounded down to a multiple of 16 (the tail is left to its reader). The launch is
//! PDL-launched and never changes a value: it is a pass-through link of the stream's dependency chain (it waits for
//! the kernel before it before it exits). Grid: one 32-thread CTA per 32 chunks of 16 KB (all ranges' chunks), at most
//! [`MAX_CTAS`], so the requests come from many SMs' bulk-copy units at once; from the ranges' sizes alone
//! (graph-safe).

use anyhow::{ensure, Result};

use super::launch::{launch, KernelArgs, Launch};
use super::{Gpu, Stream};

/// Ranges one launch takes (the kernel's `L2Ranges`).
pub const MAX_RANGES: usize = 8;
/// Bytes one prefetch instruction asks for (the kernel's `kChunk`).
pub const CHUNK_BYTES: usize = 16 << 10;
/// The grid's cap: CTAs of one warp, enough SMs issuing to pull the bytes at the HBM's rate.
pub const MAX_CTAS: usize = 64;

/// The kernel's parameter, by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct L2Ranges {
    addr: [u64; MAX_RANGES],
    bytes: [u64; MAX_RANGES],
    count: i32,
}

/// A byte range of device memory to prefetch: its address and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub addr: u64,
    pub bytes: usize,
}

impl ByteRange {
    /// All of a device buffer.
    pub fn of<T>(b: &impl super::DeviceBuf<T>) -> ByteRange {
        ByteRange {
            addr: b.device_addr(),
            bytes: b.elems() * std::mem::size_of::<T>(),
        }
    }
}

/// The kernel's parameter and grid for `ranges`, checked (before any launch).
fn plan(ranges: &[ByteRange]) -> Result<(L2Ranges, u32)> {
    ensure!(
        ranges.len() <= MAX_RANGES,
        "l2 prefetch: {} ranges, at most {MAX_RANGES} a launch",
        ranges.len()
    );
    let mut p = L2Ranges {
        count: ranges.len() as i32,
        ..L2Ranges::default()
    };
    let mut chunks = 0usize;
    for (i, r) in ranges.iter().enumerate() {
        ensure!(
            r.addr % 16 == 0,
            "l2 prefetch: range {i} at {:#x} is not 16-byte aligned",
            r.addr
        );
        p.addr[i] = r.addr;
        p.bytes[i] = (r.bytes & !15) as u64;
        chunks += (r.bytes & !15).div_ceil(CHUNK_BYTES);
    }
    let ctas = chunks.div_ceil(32).clamp(1, MAX_CTAS);
    Ok((p, ctas as u32))
}

/// Prefetch `ranges` into L2 on `stream` (see the module's contract). Nothing to prefetch launches nothing.
pub fn prefetch_l2(gpu: &Gpu, stream: &Stream, ranges: &[ByteRange]) -> Result<()> {
    let (p, ctas) = plan(ranges)?;
    if ranges.iter().all(|r| r.bytes < 16) {
        return Ok(());
    }
    let k = gpu.kernel("l2_prefetch", "l2_prefetch_ranges")?;
    let mut a = KernelArgs::new();
    a.pod(&p);
    // SAFETY: `l2_prefetch_ranges(const L2Ranges r)`: the struct by value (repr(C): 8 u64 addresses, 8 u64
    // lengths, an int); every range 16-byte aligned with its length a multiple of 16 (checked), so no request passes
    // a range's end.
    unsafe {
        launch(
            stream,
            &k,
            Launch::new((ctas, 1, 1), (32, 1, 1)).pdl(true),
            &mut a,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_checks_ranges_before_any_launch() {
        let r = |addr, bytes| ByteRange { addr, bytes };
        assert!(plan(&[r(0x1008, 64)]).is_err(), "misaligned");
        assert!(plan(&[r(0x1000, 16); MAX_RANGES + 1]).is_err(), "too many");
        let (p, ctas) = plan(&[r(0x1000, 11 << 20), r(0x2000, 100)]).unwrap();
        assert_eq!((p.count, p.bytes[0], p.bytes[1]), (2, 11 << 20, 96));
        // 704 + 1 chunks: 23 CTAs of 32 threads, one chunk a thread.
        assert_eq!(ctas, 23);
        let (_, ctas) = plan(&[r(0x1000, 1 << 30)]).unwrap();
        assert_eq!(ctas as usize, MAX_CTAS);
    }
}
