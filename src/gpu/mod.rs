//! The GPU runtime: device discovery (an error, never a panic, when there is no driver or GPU), one
//! context and one explicit stream, the registry of embedded kernel modules, typed launch helpers,
//! CUDA-event timing, CUDA-graph capture and replay, CUPTI kernel timelines, an L2 flush, NVML telemetry and
//! cuBLASLt GEMMs.
//!
//! Everything runs on a single non-default stream with cudarc's event tracking disabled (it is disabled
//! before the first allocation), so launches carry no hidden waits and graph capture sees only our work.

pub mod arena;
pub mod blas;
pub mod launch;
pub mod marks;
pub mod module;
pub mod telemetry;
pub mod timing;
pub mod tma;
pub mod trace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits,
};

pub use arena::{Arena, WorkspaceLayout};
pub use cudarc::driver::PushKernelArg;
pub use launch::{DevBuf, DeviceBuf, Kernel, KernelArgs, Launch, Stream};
pub use module::{KernelSource, KERNEL_SOURCES};

/// What a `Gpu` knows about its device.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: i32,
    pub l2_bytes: usize,
    pub total_mem_bytes: usize,
    pub max_smem_per_block_optin: usize,
    pub driver_version: Option<i32>,
}

/// One device, one context, one stream, and the kernel modules loaded so far.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Resolved entry points by family, then name (looked up with `&str`s: no allocation on the launch path), with
    /// the largest dynamic shared memory allowed so far.
    kernels: Mutex<HashMap<String, HashMap<String, Arc<Kernel>>>>,
    /// The cuBLASLt handle of the launchers' tensor-core routes ([`Gpu::blas`]), created on first use.
    blas: std::sync::OnceLock<blas::Blas>,
}

/// Why no GPU could be opened, in words a user can act on.
pub fn probe_error() -> Option<String> {
    // cudarc panics on the first driver call when libcuda cannot be loaded: check first.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("no CUDA driver: libcuda.so could not be loaded (is this a machine with an NVIDIA GPU and driver?)".into());
    }
    match CudaContext::device_count() {
        Ok(n) if n >= 1 => None,
        Ok(_) => Some("the CUDA driver is present but reports no GPU".into()),
        Err(e) => Some(format!(
            "the CUDA driver is present but cuInit/cuDeviceGetCount failed: {e:?}"
        )),
    }
}

impl Gpu {
    /// Open device `ordinal`: an `Err` with the reason when there is no driver, no device, or it is not Hopper-class.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        if let Some(why) = probe_error() {
            bail!(why);
        }
        let n = CudaContext::device_count().map_err(|e| anyhow!("{e:?}"))? as usize;
        if ordinal >= n {
            bail!("GPU {ordinal} requested but only {n} GPU(s) are visible");
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| anyhow!("creating a CUDA context on GPU {ordinal}: {e:?}"))?;
        // Before any allocation: no per-slice events, no implicit cross-stream waits (docs/measurement.md, graph capture).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow!("creating a stream: {e:?}"))?;
        let attr = |a| {
            ctx.attribute(a)
                .map_err(|e| anyhow!("device attribute {a:?}: {e:?}"))
        };
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(|e| anyhow!("{e:?}"))?,
            compute_capability: ctx.compute_capability().map_err(|e| anyhow!("{e:?}"))?,
            sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
            total_mem_bytes: ctx.total_mem().map_err(|e| anyhow!("{e:?}"))?,
            max_smem_per_block_optin: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as usize,
            driver_version: driver_version(),
        };
        if info.compute_capability.0 < 9 {
            bail!(
                "{} has compute capability {}.{}: megamoe's kernels are built for sm_90a (Hopper)",
                info.name,
                info.compute_capability.0,
                info.compute_capability.1
            );
        }
        Ok(Gpu {
            ctx,
            stream,
            info,
            modules: Mutex::new(HashMap::new()),
            kernels: Mutex::new(HashMap::new()),
            blas: std::sync::OnceLock::new(),
        })
    }

    /// The cuBLASLt handle the launchers' tensor-core routes share (`ops::dense`'s route: one handle per GPU; each
    /// concurrent call brings its own workspace, carved from its caller's arena), created on the first call. The
    /// creation allocates (the handle's own workspace, used by [`blas::Blas::gemm_tn`] only), so the first call must
    /// come before any graph capture: the dense launchers' callers make it when they carve a workspace with a
    /// tensor-core region (`DenseWorkspace::prepare`), and an eager call precedes every capture anyway.
    pub fn blas(&self) -> Result<&blas::Blas> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        let b = blas::Blas::new(self)?;
        // Another thread may have won the race: its handle is kept, this one dropped.
        Ok(self.blas.get_or_init(|| b))
    }

    /// A kernel entry point of a kernel family (`kernels/<family>.cu`), loading the module on first use:
    /// the embedded sm_90a cubin when build.rs had nvcc, else the source compiled by NVRTC. Launchers use the
    /// cached [`Gpu::kernel`] instead.
    fn function(&self, family: &str, name: &str) -> Result<CudaFunction> {
        let module = self.module(family)?;
        module
            .load_function(name)
            .map_err(|e| anyhow!("kernel `{name}` not found in module `{family}`: {e:?}"))
    }

    /// A kernel entry point, resolved once and cached (no dynamic shared memory beyond the default 48 KB).
    pub fn kernel(&self, family: &str, name: &str) -> Result<Arc<Kernel>> {
        self.kernel_with_smem(family, name, 0)
    }

    /// A kernel entry point allowed `smem_bytes` of dynamic shared memory: a clear error, before any launch, when
    /// the device cannot give that much on top of the kernel's static shared memory; the opt-in attribute is set
    /// when static + dynamic passes the 48 KB every kernel gets without asking (the limit applies to the sum).
    /// Resolved once per (family, name); the attribute is raised only when a larger request comes.
    pub fn kernel_with_smem(
        &self,
        family: &str,
        name: &str,
        smem_bytes: usize,
    ) -> Result<Arc<Kernel>> {
        self.resolve(family, name, smem_bytes, false)
    }

    /// [`Gpu::kernel_with_smem`] for a persistent kernel whose grid assumes several resident CTAs per SM: also asks
    /// for the largest shared-memory carveout (the default is a driver heuristic that may hold fewer CTAs).
    pub fn kernel_with_max_carveout(
        &self,
        family: &str,
        name: &str,
        smem_bytes: usize,
    ) -> Result<Arc<Kernel>> {
        self.resolve(family, name, smem_bytes, true)
    }

    fn resolve(
        &self,
        family: &str,
        name: &str,
        smem_bytes: usize,
        max_carveout: bool,
    ) -> Result<Arc<Kernel>> {
        use cudarc::driver::sys::CUfunction_attribute as A;
        let mut map = self.kernels.lock().unwrap();
        // The launch path: found, allowing enough shared memory and the carveout asked for. No allocation, no
        // driver call.
        let cached = map.get(family).and_then(|m| m.get(name));
        if let Some(k) = cached {
            if k.smem_allowed >= smem_bytes && (k.max_carveout || !max_carveout) {
                return Ok(k.clone());
            }
        }
        let (f, allowed_before, carveout_before) = match cached {
            Some(k) => (k.f.clone(), k.smem_allowed, k.max_carveout),
            None => (self.function(family, name)?, 0, false),
        };
        let static_bytes = f
            .shared_size_bytes()
            .map_err(|e| anyhow!("{name}: reading its static shared memory: {e:?}"))?
            as usize;
        let total = static_bytes + smem_bytes;
        if total > self.info.max_smem_per_block_optin {
            bail!(
                "kernel `{name}` needs {smem_bytes} B of dynamic + {static_bytes} B of static shared memory, \
                 the device allows {} in all",
                self.info.max_smem_per_block_optin
            );
        }
        let allowed = allowed_before.max(smem_bytes);
        if static_bytes + allowed > 48 * 1024 {
            f.set_attribute(
                A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                allowed as i32,
            )
            .map_err(|e| anyhow!("{name}: allowing {allowed} B of dynamic shared memory: {e:?}"))?;
        }
        let max_carveout = max_carveout || carveout_before;
        if max_carveout && !carveout_before {
            f.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                .map_err(|e| anyhow!("{name}: setting the shared-memory carveout: {e:?}"))?;
        }
        let k = Arc::new(Kernel {
            f,
            name: name.to_string(),
            smem_allowed: allowed.max(48 * 1024 - static_bytes.min(48 * 1024)),
            max_carveout,
        });
        map.entry(family.to_string())
            .or_default()
            .insert(name.to_string(), k.clone());
        Ok(k)
    }

    /// A new non-blocking stream on this GPU's context (a second stream for independent work).
    pub fn new_stream(&self) -> Result<Stream> {
        self.ctx
            .new_stream()
            .map_err(|e| anyhow!("creating a stream: {e:?}"))
    }

    fn module(&self, family: &str) -> Result<Arc<CudaModule>> {
        let src = module::find(family)?;
        let mut map = self.modules.lock().unwrap();
        if let Some(m) = map.get(src.name) {
            return Ok(m.clone());
        }
        let m = module::load(&self.ctx, src)
            .with_context(|| format!("loading kernel module `{family}`"))?;
        map.insert(src.name, m.clone());
        Ok(m)
    }

    /// Copy a host slice to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(host)
            .map_err(|e| anyhow!("host->device copy of {} elements: {e:?}", host.len()))
    }

    /// Copy a device buffer back (waits for the stream).
    pub fn download<T: DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream
            .clone_dtoh(dev)
            .map_err(|e| anyhow!("device->host copy: {e:?}"))
    }

    /// A zero-filled device buffer.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(n)
            .map_err(|e| anyhow!("allocating {n} elements: {e:?}"))
    }

    /// A device buffer filled with the byte `pattern` (use 0xFF to poison outputs: NaN in f32/bf16/e4m3).
    pub fn poisoned<T: DeviceRepr>(&self, n: usize, pattern: u8) -> Result<CudaSlice<T>> {
        let mut s = unsafe { self.stream.alloc::<T>(n) }
            .map_err(|e| anyhow!("allocating {n} elements: {e:?}"))?;
        self.fill_bytes(&mut s, pattern)?;
        Ok(s)
    }

    /// Fill a buffer's bytes with `pattern` (cuMemsetD8Async on our stream).
    pub fn fill_bytes<T: DeviceRepr>(&self, s: &mut CudaSlice<T>, pattern: u8) -> Result<()> {
        fill_bytes_on(&self.stream, s, pattern)
    }

    /// Copy `host` into the start of an existing device buffer on `stream` (no allocation: what a test or the
    /// engine uses to change the device-side counts a captured graph reads between replays).
    pub fn write<T: DeviceRepr>(
        &self,
        stream: &Stream,
        dst: &mut CudaSlice<T>,
        host: &[T],
    ) -> Result<()> {
        ensure!(
            host.len() <= dst.len(),
            "writing {} elements into a {}-element buffer",
            host.len(),
            dst.len()
        );
        let mut view = dst.slice_mut(0..host.len());
        stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| anyhow!("host->device copy of {} elements: {e:?}", host.len()))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("stream synchronize (a kernel failed?): {e:?}"))
    }
}

/// Fill a buffer's bytes with `pattern` on `stream`.
pub fn fill_bytes_on<T: DeviceRepr>(
    stream: &Stream,
    s: &mut CudaSlice<T>,
    pattern: u8,
) -> Result<()> {
    use cudarc::driver::DevicePtrMut;
    let bytes = s.num_bytes();
    let (ptr, _guard) = s.device_ptr_mut(stream);
    unsafe { cudarc::driver::result::memset_d8_async(ptr, pattern, bytes, stream.cu_stream()) }
        .map_err(|e| anyhow!("memset: {e:?}"))
}

fn driver_version() -> Option<i32> {
    let mut v = 0i32;
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(v)
}

/// Map a cudarc driver error (which is not `std::error::Error`-friendly everywhere) into anyhow.
pub fn drv<T>(r: std::result::Result<T, cudarc::driver::DriverError>, what: &str) -> Result<T> {
    r.map_err(|e| anyhow!("{what}: {e:?}"))
}
