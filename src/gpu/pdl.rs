//! Programmatic dependent launch (PDL): a kernel launched with the programmatic-stream-serialization
//! attribute may be scheduled before the previous kernel on the stream completes; the kernel waits
//! (`griddepcontrol.wait`) before reading that kernel's outputs. cudarc's launch builder has no launch
//! attributes, so these launches go through `cuLaunchKernelEx` ([`launch_ex`]) with raw parameter slots.

use anyhow::Result;
use cudarc::driver::CudaSlice;

use super::{drv, Gpu};

/// Kernel parameters for `cuLaunchKernelEx`, one 8-byte slot each. The driver copies each parameter with
/// the size the kernel's signature gives it: 8 bytes for a pointer, 4 for an `int`/`float`, read from the
/// slot's first bytes (little-endian: the low 32 bits hold the value). The slots are not moved between
/// filling and launching (the Vec is only read while `cuLaunchKernelEx` runs).
#[derive(Default)]
pub struct RawArgs {
    slots: Vec<u64>,
}

impl RawArgs {
    pub fn slice<T>(&mut self, gpu: &Gpu, s: &CudaSlice<T>) -> &mut Self {
        use cudarc::driver::DevicePtr;
        // Event tracking is off (Gpu::open), so the guard records nothing.
        let (ptr, _guard) = s.device_ptr(&gpu.stream);
        self.slots.push(ptr);
        self
    }
    /// A pointer to element `first` of `s` (a kernel's view of the buffer from that element on: the mHC
    /// launchers' token chunks). `first` must not pass the end of `s` (checked).
    pub fn slice_from<T>(&mut self, gpu: &Gpu, s: &CudaSlice<T>, first: usize) -> &mut Self {
        use cudarc::driver::DevicePtr;
        assert!(
            first <= s.len(),
            "RawArgs::slice_from: element {first} of a {}-element buffer",
            s.len()
        );
        // Event tracking is off (Gpu::open), so the guard records nothing.
        let (ptr, _guard) = s.device_ptr(&gpu.stream);
        self.slots
            .push(ptr + (first * std::mem::size_of::<T>()) as u64);
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.slots.push(v as u32 as u64);
        self
    }
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.slots.push(v.to_bits() as u64);
        self
    }
}

/// Launch `f` on the Gpu's stream with the programmatic-stream-serialization attribute (PDL): it may start
/// before the previous kernel of the stream completes; the kernel itself waits (`griddepcontrol.wait`)
/// before touching that kernel's outputs. No dynamic shared memory.
pub fn launch_pdl(
    gpu: &Gpu,
    f: &cudarc::driver::CudaFunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: &mut RawArgs,
    what: &str,
) -> Result<()> {
    let opts = LaunchExOpts {
        pdl: true,
        ..Default::default()
    };
    launch_ex(gpu, f, grid, block, opts, args, what)
}

/// Launch options of [`launch_ex`] beyond grid and block.
#[derive(Debug, Clone, Copy, Default)]
pub struct LaunchExOpts {
    /// Dynamic shared memory in bytes (the function's opt-in must already allow it:
    /// [`Gpu::function_with_smem`]).
    pub smem_bytes: u32,
    /// Programmatic stream serialization (PDL), as [`launch_pdl`].
    pub pdl: bool,
}

/// `cuLaunchKernelEx` on the Gpu's stream with dynamic shared memory and, optionally, the PDL launch attribute
/// ([`LaunchExOpts`]). Parameters as [`launch_pdl`].
pub fn launch_ex(
    gpu: &Gpu,
    f: &cudarc::driver::CudaFunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    opts: LaunchExOpts,
    args: &mut RawArgs,
    what: &str,
) -> Result<()> {
    use cudarc::driver::sys;
    let mut params: Vec<*mut std::ffi::c_void> = args
        .slots
        .iter_mut()
        .map(|v| v as *mut u64 as *mut std::ffi::c_void)
        .collect();
    let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
    if opts.pdl {
        // SAFETY: a zeroed CUlaunchAttribute is a valid "no attribute" value; id and value are then set.
        let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a.value.programmaticStreamSerializationAllowed = 1;
        attrs.push(a);
    }
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: opts.smem_bytes,
        hStream: gpu.stream.cu_stream(),
        attrs: if attrs.is_empty() {
            std::ptr::null_mut()
        } else {
            attrs.as_mut_ptr()
        },
        numAttrs: attrs.len() as u32,
    };
    drv(gpu.ctx.bind_to_thread(), "bind context")?;
    // SAFETY: as launch_pdl: one pointer per kernel parameter, in the kernel's order, each to a live 8-byte
    // slot; `attrs` outlives the call; the device buffers outlive the launch.
    let r = unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    drv(r.result(), what)
}
