//! Caller-owned device memory for workspaces. An op says how many bytes it needs for a shape (its
//! `workspace_bytes`, summed with a [`WorkspaceLayout`]); the caller allocates one [`Arena`] up front and carves
//! every op's workspace from it. Launchers never allocate on the call path, so a sequence of launches can be
//! captured once in a CUDA graph and replayed: every address it uses stays valid and fixed.
//!
//! Carving is a bump allocator with [`ALIGN`]-byte alignment, and [`WorkspaceLayout`] applies the same rounding,
//! so an arena of `layout.bytes()` always fits the carves that the layout summed, in the same order.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;

use super::launch::{DevBuf, DeviceBuf, Stream};
use super::Gpu;

/// Alignment of every carve: enough for 16-byte vector loads, TMA (16 B) and cp.async.bulk (16 B), and the
/// 128-byte swizzle atoms that a TMA box lands in (256 is a cudaMalloc-like granule).
pub const ALIGN: usize = 256;

fn round_up(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// The byte count of a sequence of carves: what an [`Arena`] must hold for them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkspaceLayout {
    bytes: usize,
}

impl WorkspaceLayout {
    pub fn new() -> WorkspaceLayout {
        WorkspaceLayout::default()
    }
    /// Count a carve of `n` elements of `T`.
    pub fn add<T>(&mut self, n: usize) -> &mut Self {
        self.bytes += round_up(n * std::mem::size_of::<T>());
        self
    }
    /// Count another op's whole workspace (already a sum of rounded carves).
    pub fn add_bytes(&mut self, bytes: usize) -> &mut Self {
        self.bytes += round_up(bytes);
        self
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// One device allocation that workspaces are carved from.
pub struct Arena {
    buf: CudaSlice<u8>,
    used: usize,
}

impl Arena {
    /// Allocate `bytes` (at least one granule) of device memory: an error naming the size when it does not fit.
    pub fn new(gpu: &Gpu, bytes: usize) -> Result<Arena> {
        let bytes = round_up(bytes.max(1));
        let buf = unsafe { gpu.stream.alloc::<u8>(bytes) }.map_err(|e| {
            anyhow::anyhow!(
                "allocating a {:.1} MB workspace arena: {e:?}",
                bytes as f64 / 1e6
            )
        })?;
        Ok(Arena { buf, used: 0 })
    }
    /// An arena sized for `layout`.
    pub fn for_layout(gpu: &Gpu, layout: &WorkspaceLayout) -> Result<Arena> {
        Arena::new(gpu, layout.bytes())
    }
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }
    pub fn used(&self) -> usize {
        self.used
    }
    /// `n` elements of `T`, [`ALIGN`]-aligned; `what` names the buffer in the error when the arena is full.
    pub fn carve<T>(&mut self, n: usize, what: &str) -> Result<DevBuf<T>> {
        let bytes = round_up(n * std::mem::size_of::<T>());
        if self.used + bytes > self.capacity() {
            bail!(
                "workspace arena full: {what} needs {bytes} B, {} of {} B are left (size the arena from the ops' \
                 workspace_bytes)",
                self.capacity() - self.used,
                self.capacity()
            );
        }
        let addr = self.buf.device_addr() + self.used as u64;
        self.used += bytes;
        // SAFETY: [addr, addr + bytes) lies inside `buf`, which lives as long as the arena.
        Ok(unsafe { DevBuf::from_raw(addr, n) })
    }
    /// Forget every carve (the caller must no longer use the buffers it carved).
    pub fn reset(&mut self) {
        self.used = 0;
    }
    /// Fill the whole arena with `pattern` on `stream` (0xFF poisons: NaN in f32/bf16/e4m3), so a test sees
    /// any workspace read before it is written.
    pub fn poison(&mut self, stream: &Stream, pattern: u8) -> Result<()> {
        super::fill_bytes_on(stream, &mut self.buf, pattern)
    }
}

/// Fill a carved buffer's bytes with `pattern` on `stream`.
pub fn fill<T>(stream: &Stream, b: &DevBuf<T>, pattern: u8) -> Result<()> {
    let r = unsafe {
        cudarc::driver::result::memset_d8_async(
            b.device_addr(),
            pattern,
            b.bytes(),
            stream.cu_stream(),
        )
    };
    super::drv(r, "memset of a workspace buffer")
}

/// Copy a carved buffer back to the host (waits for `stream`): what a test or a tool reads a workspace with.
pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
    stream: &Stream,
    b: &DevBuf<T>,
) -> Result<Vec<T>> {
    let mut host = vec![T::default(); b.len()];
    if host.is_empty() {
        return Ok(host);
    }
    let r = unsafe {
        cudarc::driver::result::memcpy_dtoh_async(&mut host, b.device_addr(), stream.cu_stream())
    };
    super::drv(r, "device->host copy of a workspace buffer")?;
    super::drv(stream.synchronize(), "stream synchronize")?;
    Ok(host)
}

/// Copy `host` into the start of a device buffer of any owner, ordered on `stream` (after the work already
/// enqueued there, before any launched later), then wait for the stream. A synchronous `cuMemcpyHtoD` from pageable
/// memory would not do: it may return before its DMA lands and is not ordered with a non-blocking stream, so a
/// kernel launched right after it can read the old bytes.
pub fn upload<T: cudarc::driver::DeviceRepr>(
    stream: &Stream,
    dst: &impl DeviceBuf<T>,
    host: &[T],
) -> Result<()> {
    if host.len() > dst.elems() {
        bail!(
            "uploading {} elements into a {}-element buffer",
            host.len(),
            dst.elems()
        );
    }
    if host.is_empty() {
        return Ok(());
    }
    let r = unsafe {
        cudarc::driver::result::memcpy_htod_async(dst.device_addr(), host, stream.cu_stream())
    };
    super::drv(r, "host->device copy into a device buffer")?;
    super::drv(stream.synchronize(), "stream synchronize")
}
