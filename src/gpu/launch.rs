//! The one way a kernel is launched: a [`Kernel`] resolved once per (family, entry point) and cached on the
//! [`Gpu`](super::Gpu), its parameters pushed into [`KernelArgs`], and [`launch`] on a caller-chosen stream
//! through `cuLaunchKernelEx`, with programmatic dependent launch (PDL) as an option of [`Launch`], chosen by the
//! launchers whose kernels carry their own `griddepcontrol` protocol (the mHC mix / finish pair and the indexer's
//! top-k chain; kernels/mhc.cu and kernels/indexer.cu state each protocol).
//!
//! Device buffers enter a launch through [`DeviceBuf`]: owned `CudaSlice`s, cudarc views, and [`DevBuf`]s carved
//! from a caller-owned [`Arena`](super::arena::Arena) all give a device address and an element count, so a
//! launcher never cares who owns the memory it is handed.

use std::marker::PhantomData;

use anyhow::Result;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceSlice,
};

use super::drv;

/// A stream work is enqueued on. Every launcher takes one, so independent work (the shared expert beside the
/// routed ones, NCCL later) can run on a second stream.
pub type Stream = std::sync::Arc<CudaStream>;

/// A device buffer of `T`, whoever owns it.
pub trait DeviceBuf<T> {
    /// Device address of element 0.
    fn device_addr(&self) -> u64;
    /// Number of `T` elements.
    fn elems(&self) -> usize;
}

impl<T> DeviceBuf<T> for CudaSlice<T> {
    fn device_addr(&self) -> u64 {
        // Event tracking is disabled before the first allocation (Gpu::open): the guard records nothing.
        let (p, _guard) = self.device_ptr(self.stream());
        p
    }
    fn elems(&self) -> usize {
        self.len()
    }
}

impl<T> DeviceBuf<T> for CudaView<'_, T> {
    fn device_addr(&self) -> u64 {
        let (p, _guard) = self.device_ptr(self.stream());
        p
    }
    fn elems(&self) -> usize {
        self.len()
    }
}

impl<T> DeviceBuf<T> for CudaViewMut<'_, T> {
    fn device_addr(&self) -> u64 {
        let (p, _guard) = self.device_ptr(self.stream());
        p
    }
    fn elems(&self) -> usize {
        self.len()
    }
}

/// A typed, non-owning region of device memory: what an [`Arena`](super::arena::Arena) hands out. It is `Copy`;
/// the arena that carved it must outlive every launch that uses it (the arena is freed only when dropped).
pub struct DevBuf<T> {
    addr: u64,
    len: usize,
    _elem: PhantomData<fn() -> T>,
}

impl<T> Clone for DevBuf<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DevBuf<T> {}

impl<T> std::fmt::Debug for DevBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevBuf<{}>({:#x}, {})",
            std::any::type_name::<T>(),
            self.addr,
            self.len
        )
    }
}

impl<T> DevBuf<T> {
    /// # Safety
    /// `addr` must point to `len` elements of `T` of device memory that stay allocated while the buffer is used.
    pub unsafe fn from_raw(addr: u64, len: usize) -> DevBuf<T> {
        DevBuf {
            addr,
            len,
            _elem: PhantomData,
        }
    }
    /// A view of all of `b` (valid while `b`'s memory lives, like every `DevBuf`).
    pub fn of(b: &(impl DeviceBuf<T> + ?Sized)) -> DevBuf<T> {
        DevBuf {
            addr: b.device_addr(),
            len: b.elems(),
            _elem: PhantomData,
        }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
    /// Elements `first..first + len` (panics when the range passes the end: a launcher bug, not bad input).
    pub fn sub(&self, first: usize, len: usize) -> DevBuf<T> {
        assert!(
            first + len <= self.len,
            "DevBuf::sub: {first}+{len} of {}",
            self.len
        );
        DevBuf {
            addr: self.addr + (first * std::mem::size_of::<T>()) as u64,
            len,
            _elem: PhantomData,
        }
    }
}

impl<T> DeviceBuf<T> for DevBuf<T> {
    fn device_addr(&self) -> u64 {
        self.addr
    }
    fn elems(&self) -> usize {
        self.len
    }
}

/// A kernel entry point resolved from its module, with the dynamic shared memory its attribute allows.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub(super) f: CudaFunction,
    pub(super) name: String,
    pub(super) smem_allowed: usize,
    /// The largest shared-memory carveout was asked for (persistent kernels sized for several CTAs per SM).
    pub(super) max_carveout: bool,
}

impl Kernel {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn function(&self) -> &CudaFunction {
        &self.f
    }
}

/// Kernel parameters for `cuLaunchKernelEx`, in one 8-byte-aligned buffer: each parameter starts at its own
/// 8-byte slot; the driver copies each with the size the kernel's signature gives it (a pointer 8 bytes, an
/// `int`/`float` 4 read from the low bytes, little-endian; a `__grid_constant__ CUtensorMap` its 128 bytes).
#[derive(Default)]
pub struct KernelArgs {
    data: Vec<u64>,
    /// Index in `data` of each parameter's first slot.
    starts: Vec<usize>,
}

impl KernelArgs {
    pub fn new() -> KernelArgs {
        KernelArgs::default()
    }
    /// A device buffer's address.
    pub fn buf<T>(&mut self, b: &impl DeviceBuf<T>) -> &mut Self {
        self.u64(b.device_addr())
    }
    /// The address of element `first` of `b` (a kernel's view from that element on). Panics when `first` passes
    /// the end (a launcher bug).
    pub fn buf_at<T>(&mut self, b: &impl DeviceBuf<T>, first: usize) -> &mut Self {
        assert!(
            first <= b.elems(),
            "KernelArgs::buf_at: element {first} of a {}-element buffer",
            b.elems()
        );
        self.u64(b.device_addr() + (first * std::mem::size_of::<T>()) as u64)
    }
    /// A null pointer (an optional input the kernel checks for).
    pub fn null(&mut self) -> &mut Self {
        self.u64(0)
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.u64(v as u32 as u64)
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.u64(v as u64)
    }
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.u64(v.to_bits() as u64)
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.starts.push(self.data.len());
        self.data.push(v);
        self
    }
    /// A plain-data parameter passed by value (a param struct, a `CUtensorMap`).
    pub fn pod<P: Copy>(&mut self, v: &P) -> &mut Self {
        let first = self.data.len();
        self.starts.push(first);
        self.data
            .resize(first + std::mem::size_of::<P>().div_ceil(8).max(1), 0);
        // SAFETY: `data[first..]` holds at least size_of::<P>() bytes; P is Copy (plain data), copied bytewise.
        unsafe {
            std::ptr::copy_nonoverlapping(
                v as *const P as *const u8,
                self.data[first..].as_mut_ptr() as *mut u8,
                std::mem::size_of::<P>(),
            )
        };
        self
    }
    pub fn len(&self) -> usize {
        self.starts.len()
    }
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }
}

/// Geometry and options of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes; the kernel must have been resolved allowing it
    /// ([`Gpu::kernel_with_smem`](super::Gpu::kernel_with_smem)).
    pub smem: u32,
    /// Programmatic stream serialization: the kernel may start before the previous kernel of the stream ends
    /// and waits (`griddepcontrol.wait`) before reading its outputs.
    pub pdl: bool,
}

impl Launch {
    pub fn new(grid: (u32, u32, u32), block: (u32, u32, u32)) -> Launch {
        Launch {
            grid,
            block,
            smem: 0,
            pdl: false,
        }
    }
    /// A 1-D grid covering `n` items with `block` threads each (at least one CTA).
    pub fn over(n: usize, block: u32) -> Launch {
        Launch::new(((n as u32).div_ceil(block).max(1), 1, 1), (block, 1, 1))
    }
    pub fn smem(mut self, bytes: usize) -> Launch {
        self.smem = bytes as u32;
        self
    }
    pub fn pdl(mut self, on: bool) -> Launch {
        self.pdl = on;
        self
    }
}

thread_local! {
    /// Marks every launch of this thread records into, while [`with_launch_marks`] runs.
    static LAUNCH_MARKS: std::cell::RefCell<Option<std::rc::Rc<super::marks::EventMarks>>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `work` with an event recorded after every kernel this thread launches through [`launch`], named by the
/// kernel's entry point: captured into a graph, a replay then gives each kernel's time from the end of the one
/// before it (its launch gap included). Launches outside [`launch`] (cuBLASLt) fall into the next kernel's time.
pub fn with_launch_marks<R>(
    marks: std::rc::Rc<super::marks::EventMarks>,
    work: impl FnOnce() -> R,
) -> R {
    let before = LAUNCH_MARKS.with(|m| m.borrow_mut().replace(marks));
    let r = work();
    LAUNCH_MARKS.with(|m| *m.borrow_mut() = before);
    r
}

/// The name a library call (cuBLASLt) records under [`with_launch_marks`]: its kernels are not launched through
/// [`launch`], so a traced step's spans of other names between two marked kernels belong to this mark.
pub const LIBRARY_MARK: &str = "library call";

/// Records [`LIBRARY_MARK`] after a library call enqueued on `stream`, while [`with_launch_marks`] runs.
pub fn mark_library_launch(stream: &Stream) -> Result<()> {
    let marks = LAUNCH_MARKS.with(|m| m.borrow().clone());
    match marks {
        Some(m) => m.mark(stream, LIBRARY_MARK),
        None => Ok(()),
    }
}

/// Launch `k` on `stream`. Errors name the kernel. Checks that the dynamic shared memory was allowed and that
/// no grid dimension is zero (a zero grid is a launcher bug that the driver reports only as "invalid value").
///
/// # Safety
/// `args` must match the kernel's parameter list, and every buffer must be large enough for the launch
/// geometry and outlive the kernel's execution: launchers check shapes before calling this.
pub unsafe fn launch(stream: &Stream, k: &Kernel, l: Launch, args: &mut KernelArgs) -> Result<()> {
    use cudarc::driver::sys;
    anyhow::ensure!(
        l.grid.0 >= 1 && l.grid.1 >= 1 && l.grid.2 >= 1,
        "launching {}: empty grid {:?}",
        k.name,
        l.grid
    );
    anyhow::ensure!(
        l.smem as usize <= k.smem_allowed,
        "launching {}: {} B of dynamic shared memory, the kernel was resolved for {}",
        k.name,
        l.smem,
        k.smem_allowed
    );
    // Pointers into `args.data`, taken after every push (the buffer no longer moves).
    let base = args.data.as_mut_ptr();
    let mut params: Vec<*mut std::ffi::c_void> = args
        .starts
        .iter()
        .map(|&i| base.add(i) as *mut std::ffi::c_void)
        .collect();
    let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(1);
    if l.pdl {
        // SAFETY: a zeroed CUlaunchAttribute is a valid "no attribute" value; id and value are then set.
        let mut a: sys::CUlaunchAttribute = std::mem::zeroed();
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a.value.programmaticStreamSerializationAllowed = 1;
        attrs.push(a);
    }
    let cfg = sys::CUlaunchConfig {
        gridDimX: l.grid.0,
        gridDimY: l.grid.1,
        gridDimZ: l.grid.2,
        blockDimX: l.block.0,
        blockDimY: l.block.1,
        blockDimZ: l.block.2,
        sharedMemBytes: l.smem,
        hStream: stream.cu_stream(),
        attrs: if attrs.is_empty() {
            std::ptr::null_mut()
        } else {
            attrs.as_mut_ptr()
        },
        numAttrs: attrs.len() as u32,
    };
    drv(stream.context().bind_to_thread(), "bind context")?;
    let r = sys::cuLaunchKernelEx(
        &cfg,
        k.f.cu_function(),
        params.as_mut_ptr(),
        std::ptr::null_mut(),
    );
    drv(r.result(), &format!("launching {}", k.name))?;
    let marks = LAUNCH_MARKS.with(|m| m.borrow().clone());
    match marks {
        Some(m) => m.mark(stream, k.name.as_str()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::KernelArgs;

    /// Each parameter starts on its own 8-byte slot: scalars in the low bytes, a by-value struct over as many
    /// slots as it needs, in push order.
    #[test]
    fn kernel_args_lay_out_one_slot_per_scalar_and_whole_slots_per_struct() {
        #[derive(Clone, Copy)]
        #[repr(C)]
        struct Three {
            a: u64,
            b: u32,
            c: u16,
        }
        let mut a = KernelArgs::new();
        a.i32(-1)
            .pod(&Three { a: 7, b: 9, c: 3 })
            .f32(1.5)
            .u64(u64::MAX);
        assert_eq!(a.len(), 4);
        assert_eq!(a.starts, vec![0, 1, 3, 4]);
        assert_eq!(a.data[0], 0xFFFF_FFFF);
        assert_eq!(a.data[1], 7);
        assert_eq!(a.data[2], 9 | 3 << 32);
        assert_eq!(a.data[3], 1.5f32.to_bits() as u64);
        assert_eq!(a.data[4], u64::MAX);
    }
}
