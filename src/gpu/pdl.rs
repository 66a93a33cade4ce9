//! Programmatic dependent launch (PDL): a kernel launched with the programmatic-stream-serialization
//! attribute may be scheduled before the previous kernel on the stream completes; the kernel waits
//! (`griddepcontrol.wait`) before reading that kernel's outputs. cudarc's launch builder has no launch
//! attributes, so these launches go through `cuLaunchKernelEx` with raw parameter slots. The same raw-slot
//! launch also carries the thread-block-cluster dimension attribute ([`launch_cluster`]).

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
    use cudarc::driver::sys;
    let mut params: Vec<*mut std::ffi::c_void> = args
        .slots
        .iter_mut()
        .map(|v| v as *mut u64 as *mut std::ffi::c_void)
        .collect();
    // SAFETY: a zeroed CUlaunchAttribute is a valid "no attribute" value; id and value are then set.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: 0,
        hStream: gpu.stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    drv(gpu.ctx.bind_to_thread(), "bind context")?;
    // SAFETY: `params` holds one pointer per kernel parameter, in the order of the kernel's signature (the
    // callers mirror their kernels' entry points), each to a live 8-byte slot; the device
    // buffers outlive the launch (owned by the caller, freed only after stream synchronization).
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

/// The `CUlaunchConfig` of a launch on the Gpu's stream with a thread-block cluster shape `cluster` (grid
/// dimensions must be multiples of it) and `smem_bytes` of dynamic shared memory. `attr` must outlive every
/// use of the returned config (it points at it).
fn cluster_config(
    gpu: &Gpu,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    cluster: (u32, u32, u32),
    smem_bytes: u32,
    attr: &mut cudarc::driver::sys::CUlaunchAttribute,
) -> cudarc::driver::sys::CUlaunchConfig {
    use cudarc::driver::sys;
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
        x: cluster.0,
        y: cluster.1,
        z: cluster.2,
    };
    sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem_bytes,
        hStream: gpu.stream.cu_stream(),
        attrs: attr as *mut sys::CUlaunchAttribute,
        numAttrs: 1,
    }
}

/// Allow clusters above the portable size of 8 CTAs for `f` (CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED;
/// Hopper supports 16). Whether such a cluster fits the device is then asked with [`max_active_clusters`].
pub fn allow_non_portable_cluster(f: &cudarc::driver::CudaFunction, what: &str) -> Result<()> {
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
        1,
    )
    .map_err(|e| anyhow::anyhow!("{what}: allowing non-portable cluster sizes: {e:?}"))
}

/// How many clusters of shape `cluster` (with this block and dynamic shared memory) can be resident at once
/// (cuOccupancyMaxActiveClusters); 0 means such a launch cannot run on this device.
pub fn max_active_clusters(
    gpu: &Gpu,
    f: &cudarc::driver::CudaFunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    cluster: (u32, u32, u32),
    smem_bytes: u32,
    what: &str,
) -> Result<i32> {
    use cudarc::driver::sys;
    // SAFETY: a zeroed CUlaunchAttribute is a valid "no attribute" value; cluster_config sets id and value.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    let cfg = cluster_config(gpu, grid, block, cluster, smem_bytes, &mut attr);
    drv(gpu.ctx.bind_to_thread(), "bind context")?;
    let mut n: std::ffi::c_int = 0;
    // SAFETY: cfg and the attribute it points to are live for the call; n is a valid out pointer.
    let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &cfg) };
    drv(r.result(), what)?;
    Ok(n)
}

/// Launch `f` on the Gpu's stream as thread-block clusters of shape `cluster` (the cluster-dimension launch
/// attribute of `cuLaunchKernelEx`; cudarc's launch builder has no launch attributes) with `smem_bytes` of
/// dynamic shared memory. Every grid dimension must be a multiple of the cluster's (the driver rejects the
/// launch otherwise). Clusters above 8 CTAs need [`allow_non_portable_cluster`] first.
#[allow(clippy::too_many_arguments)]
pub fn launch_cluster(
    gpu: &Gpu,
    f: &cudarc::driver::CudaFunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    cluster: (u32, u32, u32),
    smem_bytes: u32,
    args: &mut RawArgs,
    what: &str,
) -> Result<()> {
    use cudarc::driver::sys;
    let mut params: Vec<*mut std::ffi::c_void> = args
        .slots
        .iter_mut()
        .map(|v| v as *mut u64 as *mut std::ffi::c_void)
        .collect();
    // SAFETY: a zeroed CUlaunchAttribute is a valid "no attribute" value; cluster_config sets id and value.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    let cfg = cluster_config(gpu, grid, block, cluster, smem_bytes, &mut attr);
    drv(gpu.ctx.bind_to_thread(), "bind context")?;
    // SAFETY: as launch_pdl: one pointer per kernel parameter in signature order, each to a live 8-byte slot;
    // the device buffers outlive the launch; cfg and its attribute are live for the call.
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
