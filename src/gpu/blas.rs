//! cuBLASLt GEMMs used as denominators (the `limits` probe), as baselines, and as the FP8 dense linear of the
//! model: `D[M,N] = A[M,K] . B[N,K]^T`, row-major with both operands K-major ("TN" in cuBLAS's column-major
//! terms, which FP8 requires), fp32 accumulation, BF16 output. A and B are BF16 or FP8 e4m3 (per-tensor fp32
//! scales for FP8, [`Blas::gemm_tn_on`]), or FP8 e4m3 with DeepSeek block scales ([`Blas::fp8_block_scaled_gemm`]:
//! 1x128 f32 scales on the activations, 128x128 f32 scales on the weight), or BF16 with an f32 output
//! ([`Blas::bf16_gemm_f32`]: the decode dense route's BF16 linears, `ops::dense::route`).

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Mutex;

use anyhow::{anyhow, bail, Result};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::DeviceBuf;
use super::{Gpu, Stream};

/// Element type of the GEMM operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmInput {
    Bf16,
    Fp8E4m3,
}

impl GemmInput {
    fn cuda_type(self) -> sys::cudaDataType {
        match self {
            GemmInput::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
            GemmInput::Fp8E4m3 => sys::cudaDataType_t::CUDA_R_8F_E4M3,
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            GemmInput::Bf16 => 2,
            GemmInput::Fp8E4m3 => 1,
        }
    }
}

/// A cuBLASLt handle plus its 32 MiB workspace (for [`Blas::gemm_tn_on`]) and the block-scaled FP8 plans built
/// so far (one per shape).
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    block_scaled_plans: Mutex<HashMap<BlockScaledShape, GemmPlan>>,
    bf16_f32_plans: Mutex<HashMap<Bf16GemmShape, GemmPlan>>,
}

// SAFETY: the cuBLASLt handle may be used from any host thread and by concurrent calls on different streams, each
// with its own workspace (cuBLAS documentation, "Thread Safety"); the only mutable per-call state (the block-scaled
// descriptors' scale pointers) is set and consumed under the plan cache's lock. The plans' raw descriptors are only
// touched behind those locks.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        let plans = std::mem::take(
            self.block_scaled_plans
                .get_mut()
                .unwrap_or_else(|p| p.into_inner()),
        );
        drop(plans);
        let plans = std::mem::take(
            self.bf16_f32_plans
                .get_mut()
                .unwrap_or_else(|p| p.into_inner()),
        );
        drop(plans);
        unsafe {
            let _ = result::destroy_handle(self.handle);
        }
    }
}

fn cb<T>(r: std::result::Result<T, result::CublasError>, what: &str) -> Result<T> {
    r.map_err(|e| anyhow!("cuBLASLt {what}: {e:?}"))
}

impl Blas {
    /// Needs libcublasLt.so.13 on the loader path (the GPU machine: /usr/local/cuda/lib64 or torch's pip wheels).
    pub fn new(gpu: &Gpu) -> Result<Blas> {
        if !unsafe { sys::is_culib_present() } {
            bail!("libcublasLt could not be loaded: add its folder (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH");
        }
        let handle = cb(result::create_handle(), "create handle")?;
        let workspace = gpu.zeros::<u8>(32 << 20)?;
        Ok(Blas {
            handle,
            workspace,
            block_scaled_plans: Mutex::new(HashMap::new()),
            bf16_f32_plans: Mutex::new(HashMap::new()),
        })
    }

    /// [`Blas::gemm_tn_on`] on the GPU's own stream.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_tn(
        &self,
        gpu: &Gpu,
        kind: GemmInput,
        m: usize,
        n: usize,
        k: usize,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        d: &mut CudaSlice<bf16>,
        alpha: f32,
    ) -> Result<()> {
        self.gemm_tn_on(&gpu.stream, kind, m, n, k, a, b, d, alpha)
    }

    /// `d[M,N] = alpha * a[M,K] . b[N,K]^T` on `stream`, with `alpha = scale_a * scale_b` applied through
    /// cuBLASLt's per-tensor scale pointers for FP8 (and as alpha for BF16). `a`, `b` hold raw bytes of `kind`.
    /// The handle's workspace is shared by every call: one `Blas` serves one stream at a time.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_tn_on(
        &self,
        stream: &Stream,
        kind: GemmInput,
        m: usize,
        n: usize,
        k: usize,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        d: &mut CudaSlice<bf16>,
        alpha: f32,
    ) -> Result<()> {
        if a.len() < m * k * kind.bytes() || b.len() < n * k * kind.bytes() || d.len() < m * n {
            bail!("gemm_tn: buffers too small for M={m} N={n} K={k}");
        }
        if kind == GemmInput::Fp8E4m3 && !k.is_multiple_of(16) {
            bail!("FP8 cuBLASLt GEMM needs K % 16 == 0 (K={k})");
        }
        unsafe {
            let desc = cb(
                result::create_matmul_desc(
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cudaDataType_t::CUDA_R_32F,
                ),
                "matmul desc",
            )?;
            let t: i32 = 1;
            let nt: i32 = 0;
            let set = |attr, v: *const c_void, sz| {
                cb(
                    result::set_matmul_desc_attribute(desc, attr, v, sz),
                    "desc attribute",
                )
            };
            // Column-major view: D^T[N,M] = B[N,K] (stored K-major -> op T) x A^T[K,M] (op N).
            set(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &t as *const i32 as _,
                size_of::<i32>(),
            )?;
            set(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &nt as *const i32 as _,
                size_of::<i32>(),
            )?;
            let la = cb(
                result::create_matrix_layout(kind.cuda_type(), k as u64, n as u64, k as i64),
                "layout B",
            )?;
            let lb = cb(
                result::create_matrix_layout(kind.cuda_type(), k as u64, m as u64, k as i64),
                "layout A",
            )?;
            let ld = cb(
                result::create_matrix_layout(
                    sys::cudaDataType_t::CUDA_R_16BF,
                    n as u64,
                    m as u64,
                    n as i64,
                ),
                "layout D",
            )?;
            let pref = cb(result::create_matmul_pref(), "pref")?;
            let ws = self.workspace.len();
            cb(
                result::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const usize as _,
                    size_of::<usize>(),
                ),
                "pref workspace",
            )?;
            let heur = cb(
                result::get_matmul_algo_heuristic(self.handle, desc, la, lb, ld, ld, pref),
                "no algorithm for this shape",
            )?;
            let beta = 0.0f32;
            let (pa, _ga) = a.device_ptr(stream);
            let (pb, _gb) = b.device_ptr(stream);
            let (pd, _gd) = d.device_ptr_mut(stream);
            let (pw, _gw) = self.workspace.device_ptr(stream);
            let r = result::matmul(
                self.handle,
                desc,
                &alpha as *const f32 as _,
                &beta as *const f32 as _,
                pb as *const c_void,
                la,
                pa as *const c_void,
                lb,
                pd as *const c_void,
                ld,
                pd as *mut c_void,
                ld,
                &heur.algo,
                pw as *mut c_void,
                ws,
                stream.cu_stream() as _,
            );
            let _ = result::destroy_matmul_pref(pref);
            let _ = result::destroy_matrix_layout(la);
            let _ = result::destroy_matrix_layout(lb);
            let _ = result::destroy_matrix_layout(ld);
            let _ = result::destroy_matmul_desc(desc);
            cb(r, "matmul")
        }
    }
}

impl Blas {
    /// Creates `plan`'s layouts for `y[m, n] = x[m, k] . W[n, k]^T` (row-major, both operands K-major: in cuBLAS's
    /// column-major terms y^T[n, m] = W (op T) x x^T (op N)), operands of type `input`, output `output`, and takes
    /// the heuristic's first algorithm within `cap` bytes of workspace. The heuristic's refusal comes back as the
    /// inner error, for the caller to word.
    ///
    /// # Safety
    /// `plan.desc` is a live descriptor with its transposes and attributes set.
    #[allow(clippy::too_many_arguments)]
    unsafe fn layouts_and_algo(
        &self,
        plan: &mut GemmPlan,
        input: sys::cudaDataType,
        output: sys::cudaDataType,
        (m, n, k): (usize, usize, usize),
        cap: usize,
    ) -> Result<std::result::Result<(), result::CublasError>> {
        plan.layout_w = cb(
            result::create_matrix_layout(input, k as u64, n as u64, k as i64),
            "layout W",
        )?;
        plan.layout_x = cb(
            result::create_matrix_layout(input, k as u64, m as u64, k as i64),
            "layout x",
        )?;
        plan.layout_y = cb(
            result::create_matrix_layout(output, n as u64, m as u64, n as i64),
            "layout y",
        )?;
        let pref = cb(result::create_matmul_pref(), "pref")?;
        let r = result::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &cap as *const usize as *const c_void,
            size_of::<usize>(),
        );
        let heur = r.and_then(|_| {
            result::get_matmul_algo_heuristic(
                self.handle,
                plan.desc,
                plan.layout_w,
                plan.layout_x,
                plan.layout_y,
                plan.layout_y,
                pref,
            )
        });
        let _ = result::destroy_matmul_pref(pref);
        Ok(heur.map(|h| {
            plan.algo = h.algo;
            plan.workspace_bytes = h.workspaceSize;
        }))
    }
}

// ---- block-scaled FP8 (DeepSeek 1x128 x 128x128) --------------------------------------------------------------

/// The oldest cuBLASLt with the 128-element block-scaling modes (`CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`,
/// `..._BLK128x128_32F`): 12.9.0, as `cublasLtGetVersion()` reports it (major * 10000 + minor * 100 + patch).
pub const BLOCK_SCALED_MIN_CUBLASLT: usize = 120900;

/// Largest workspace a block-scaled plan may ask for (the heuristic's preference cap). The plan's own need,
/// [`Blas::fp8_block_scaled_workspace_bytes`], is what a caller carves.
pub const BLOCK_SCALED_MAX_WORKSPACE: usize = 32 << 20;

/// The cuBLASLt documentation (section "Scaling factors layouts" of the 128-element 1D and 128x128 2D block
/// scaling): with these scale modes M and N "must be multiples of 4". Here the GEMM's M is the token count.
pub const BLOCK_SCALED_ROW_MULTIPLE: usize = 4;

/// `cublasLtGetVersion()` of the loaded library (e.g. 130000 for 13.0.0).
pub fn cublaslt_version() -> usize {
    unsafe { sys::cublasLtGetVersion() }
}

fn version_words(v: usize) -> String {
    format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
}

/// The shape of one block-scaled FP8 GEMM `y[m, n] = x[m, k] . W[n, k]^T` and the scale tensors it reads.
///
/// Layouts (row-major, our names; cuBLAS's column-major operand A is `W`, B is `x`):
/// - `x`: e4m3 `[m, k]`; its scales f32 `[k/128, m]` with the token index contiguous ([`Self::act_scales_len`]):
///   cuBLASLt's `VEC128_32F` on operand B, "N-major with shape N x L".
/// - `W`: e4m3 `[n, k]`; its scales f32 `[ceil(n/128), L4]` with `L4 = k/128` rounded up to a multiple of 4, the
///   pad columns ignored ([`Self::weight_scales_len`]): `BLK128x128_32F` on operand A, "K-major, the stride
///   between consecutive columns a multiple of 4, shape L4 x ceil(M/128)".
/// - `y`: BF16 `[m, n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockScaledShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl BlockScaledShape {
    /// `m` a positive multiple of [`BLOCK_SCALED_ROW_MULTIPLE`], `n` a positive multiple of 16 (16-byte rows of
    /// the FP8 operand and of the output), `k` a positive multiple of 128 (whole scale blocks).
    pub fn check(&self) -> Result<()> {
        let BlockScaledShape { m, n, k } = *self;
        if m == 0 || !m.is_multiple_of(BLOCK_SCALED_ROW_MULTIPLE) {
            bail!(
                "block-scaled FP8 GEMM: m = {m} must be a positive multiple of {BLOCK_SCALED_ROW_MULTIPLE} (pad the \
                 token rows; ops::dense::prefill does)"
            );
        }
        if n == 0 || !n.is_multiple_of(16) {
            bail!("block-scaled FP8 GEMM: n = {n} must be a positive multiple of 16");
        }
        if k == 0 || !k.is_multiple_of(128) {
            bail!("block-scaled FP8 GEMM: k = {k} must be a positive multiple of 128 (whole 1x128 scale blocks)");
        }
        if m > i32::MAX as usize || n > i32::MAX as usize || k > i32::MAX as usize {
            bail!("block-scaled FP8 GEMM: {self:?} is too large");
        }
        Ok(())
    }
    /// `L = k / 128`, scale blocks along K.
    pub fn k_blocks(&self) -> usize {
        self.k / 128
    }
    /// `L4`: `L` rounded up to a multiple of 4, the row stride of the weight scales.
    pub fn k_blocks_padded(&self) -> usize {
        self.k_blocks().div_ceil(4) * 4
    }
    /// f32 elements of the activation scales: `L * m`.
    pub fn act_scales_len(&self) -> usize {
        self.k_blocks() * self.m
    }
    /// f32 elements of the weight scales: `ceil(n / 128) * L4`.
    pub fn weight_scales_len(&self) -> usize {
        self.n.div_ceil(128) * self.k_blocks_padded()
    }
}

/// One GEMM shape's matmul descriptor, layouts and algorithm (built once, reused by every call of that shape):
/// the block-scaled FP8 plans and the BF16 -> f32 plans.
struct GemmPlan {
    desc: sys::cublasLtMatmulDesc_t,
    layout_w: sys::cublasLtMatrixLayout_t,
    layout_x: sys::cublasLtMatrixLayout_t,
    layout_y: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    workspace_bytes: usize,
}

impl GemmPlan {
    /// A plan owning `desc` and nothing else yet (every object created later is destroyed with it).
    fn owning(desc: sys::cublasLtMatmulDesc_t) -> GemmPlan {
        GemmPlan {
            desc,
            layout_w: std::ptr::null_mut(),
            layout_x: std::ptr::null_mut(),
            layout_y: std::ptr::null_mut(),
            // SAFETY: a plain C struct of integers; overwritten by the heuristic's pick before any use.
            algo: unsafe { std::mem::zeroed() },
            workspace_bytes: 0,
        }
    }
}

impl GemmPlan {
    /// Enqueues `y = x . W^T` (alpha 1, beta 0) on `stream` with this plan's descriptor, layouts and algorithm.
    ///
    /// # Safety
    /// The addresses are device buffers of the plan's shape (checked by the caller); the workspace holds at least
    /// `workspace_bytes`.
    unsafe fn run(
        &self,
        handle: sys::cublasLtHandle_t,
        stream: &Stream,
        x: u64,
        w: u64,
        (workspace, workspace_len): (u64, usize),
        y: u64,
    ) -> std::result::Result<(), result::CublasError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let py = y as *mut c_void;
        result::matmul(
            handle,
            self.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            w as *const c_void,
            self.layout_w,
            x as *const c_void,
            self.layout_x,
            py as *const c_void,
            self.layout_y,
            py,
            self.layout_y,
            &self.algo,
            workspace as *mut c_void,
            workspace_len,
            stream.cu_stream() as _,
        )
    }
}

impl Drop for GemmPlan {
    fn drop(&mut self) {
        unsafe {
            for l in [self.layout_w, self.layout_x, self.layout_y] {
                if !l.is_null() {
                    let _ = result::destroy_matrix_layout(l);
                }
            }
            let _ = result::destroy_matmul_desc(self.desc);
        }
    }
}

/// What to say when cuBLASLt refuses the block-scaled configuration.
fn block_scaled_refusal(what: &str, e: result::CublasError) -> anyhow::Error {
    let v = cublaslt_version();
    anyhow!(
        "cuBLASLt {what}: {e:?}. Block-scaled FP8 (1x128 x 128x128 f32 scales) needs cuBLASLt >= {} on a \
         compute-capability 9.0 GPU; the loaded cuBLASLt is {} ({v})",
        version_words(BLOCK_SCALED_MIN_CUBLASLT),
        version_words(v)
    )
}

impl Blas {
    fn block_scaled_plan(&self, shape: BlockScaledShape) -> Result<GemmPlan> {
        shape.check()?;
        let v = cublaslt_version();
        if v < BLOCK_SCALED_MIN_CUBLASLT {
            bail!(
                "block-scaled FP8 GEMM needs cuBLASLt >= {} (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F / \
                 BLK128x128_32F); the loaded cuBLASLt is {} ({v})",
                version_words(BLOCK_SCALED_MIN_CUBLASLT),
                version_words(v)
            );
        }
        let BlockScaledShape { m, n, k } = shape;
        let e4m3 = sys::cudaDataType_t::CUDA_R_8F_E4M3;
        unsafe {
            let desc = cb(
                result::create_matmul_desc(
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cudaDataType_t::CUDA_R_32F,
                ),
                "matmul desc",
            )?;
            // From here every created object is owned by `plan` (destroyed on any early return).
            let mut plan = GemmPlan::owning(desc);
            let set_i32 = |attr, v: i32, what: &str| {
                result::set_matmul_desc_attribute(
                    desc,
                    attr,
                    &v as *const i32 as *const c_void,
                    size_of::<i32>(),
                )
                .map_err(|e| block_scaled_refusal(what, e))
            };
            use sys::cublasLtMatmulDescAttributes_t as A;
            use sys::cublasLtMatmulMatrixScale_t as S;
            // Column-major view: y^T[n, m] = W[n, k] (stored K-major -> op T) x x^T[k, m] (op N): cuBLAS's A is the
            // weight, B the activations.
            set_i32(A::CUBLASLT_MATMUL_DESC_TRANSA, 1, "TRANSA")?;
            set_i32(A::CUBLASLT_MATMUL_DESC_TRANSB, 0, "TRANSB")?;
            set_i32(
                A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                S::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as i32,
                "A_SCALE_MODE = BLK128x128_32F",
            )?;
            set_i32(
                A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                S::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as i32,
                "B_SCALE_MODE = VEC128_32F",
            )?;
            // The heuristic refuses a block scale mode whose scale pointer is unset ("requires a custom pointer"):
            // stand-in pointers for the query (a live device allocation, never read by the heuristic); every call
            // sets its own before its matmul.
            let stand_in = self.workspace.device_addr() as *const c_void;
            for attr in [
                A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            ] {
                result::set_matmul_desc_attribute(
                    desc,
                    attr,
                    &stand_in as *const *const c_void as *const c_void,
                    size_of::<*const c_void>(),
                )
                .map_err(|e| block_scaled_refusal("scale pointer", e))?;
            }
            self.layouts_and_algo(
                &mut plan,
                e4m3,
                sys::cudaDataType_t::CUDA_R_16BF,
                (m, n, k),
                BLOCK_SCALED_MAX_WORKSPACE,
            )?
            .map_err(|e| block_scaled_refusal(&format!("no algorithm for m={m} n={n} k={k}"), e))?;
            Ok(plan)
        }
    }

    /// Run `f` with the plan of `shape` (built on first use; later calls only look it up).
    fn with_block_scaled_plan<R>(
        &self,
        shape: BlockScaledShape,
        f: impl FnOnce(&GemmPlan) -> Result<R>,
    ) -> Result<R> {
        let mut plans = self
            .block_scaled_plans
            .lock()
            .map_err(|_| anyhow!("cuBLASLt plan cache poisoned by an earlier panic"))?;
        let plan = match plans.entry(shape) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.block_scaled_plan(shape)?)
            }
        };
        f(plan)
    }

    /// Workspace bytes the block-scaled GEMM of `shape` needs (the algorithm cuBLASLt's heuristic picked, at most
    /// [`BLOCK_SCALED_MAX_WORKSPACE`]); builds and caches the shape's plan. Host-only: may run before a capture.
    pub fn fp8_block_scaled_workspace_bytes(&self, shape: BlockScaledShape) -> Result<usize> {
        self.with_block_scaled_plan(shape, |p| Ok(p.workspace_bytes))
    }

    /// `y[m, n] = bf16( sum_kb xs[kb, i] * ws[j / 128, kb] * sum_{k in kb} x[i, k] * W[j, k] )` on `stream`: one
    /// cuBLASLt matmul with operand scale modes `BLK128x128_32F` (W) and `VEC128_32F` (x), fp32 accumulation,
    /// BF16 output (layouts: [`BlockScaledShape`]). `workspace` is the caller's (at least
    /// [`Blas::fp8_block_scaled_workspace_bytes`], 256-byte aligned); nothing is allocated, so the call can be
    /// captured in a CUDA graph and replayed with new contents in the same buffers. The plan of a shape is built
    /// on its first call (host work only, allowed inside a capture) and cached. Errors (shape, sizes, alignment,
    /// a cuBLASLt without the scale modes, naming its version) come before anything is enqueued.
    #[allow(clippy::too_many_arguments)]
    pub fn fp8_block_scaled_gemm(
        &self,
        stream: &Stream,
        shape: BlockScaledShape,
        x: &impl DeviceBuf<u8>,
        x_scales: &impl DeviceBuf<f32>,
        w: &impl DeviceBuf<u8>,
        w_scales: &impl DeviceBuf<f32>,
        workspace: &impl DeviceBuf<u8>,
        y: &impl DeviceBuf<bf16>,
    ) -> Result<()> {
        shape.check()?;
        let BlockScaledShape { m, n, k } = shape;
        for (what, have, need) in [
            ("x", x.elems(), m * k),
            ("x scales", x_scales.elems(), shape.act_scales_len()),
            ("W", w.elems(), n * k),
            ("W scales", w_scales.elems(), shape.weight_scales_len()),
            ("y", y.elems(), m * n),
        ] {
            if have < need {
                bail!("block-scaled FP8 GEMM m={m} n={n} k={k}: {what} holds {have} elements, needs {need}");
            }
        }
        for (what, addr) in [
            ("x", x.device_addr()),
            ("x scales", x_scales.device_addr()),
            ("W", w.device_addr()),
            ("W scales", w_scales.device_addr()),
            ("y", y.device_addr()),
        ] {
            if !addr.is_multiple_of(16) {
                bail!("block-scaled FP8 GEMM: {what} at {addr:#x} is not 16-byte aligned");
            }
        }
        if !workspace.device_addr().is_multiple_of(256) {
            bail!(
                "block-scaled FP8 GEMM: the workspace at {:#x} is not 256-byte aligned",
                workspace.device_addr()
            );
        }
        self.with_block_scaled_plan(shape, |plan| {
            if workspace.elems() < plan.workspace_bytes {
                bail!(
                    "block-scaled FP8 GEMM m={m} n={n} k={k}: the workspace holds {} bytes, the algorithm needs {} \
                     (Blas::fp8_block_scaled_workspace_bytes)",
                    workspace.elems(),
                    plan.workspace_bytes
                );
            }
            unsafe {
                // The scale pointers are the call's: set on the cached descriptor (the plan cache's lock is held,
                // so no other call changes them before this matmul is enqueued).
                use sys::cublasLtMatmulDescAttributes_t as A;
                for (attr, addr, what) in [
                    (A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, w_scales.device_addr(), "A_SCALE_POINTER"),
                    (A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, x_scales.device_addr(), "B_SCALE_POINTER"),
                ] {
                    let p = addr as *const c_void;
                    result::set_matmul_desc_attribute(
                        plan.desc,
                        attr,
                        &p as *const *const c_void as *const c_void,
                        size_of::<*const c_void>(),
                    )
                    .map_err(|e| block_scaled_refusal(what, e))?;
                }
                plan.run(
                    self.handle,
                    stream,
                    x.device_addr(),
                    w.device_addr(),
                    (workspace.device_addr(), workspace.elems()),
                    y.device_addr(),
                )
                    .map_err(|e| block_scaled_refusal("block-scaled matmul", e))?;
            }
            super::launch::mark_library_launch(stream)
        })
    }
}

// ---- BF16 x BF16 -> f32 (the decode dense route's BF16 linears) ----------------------------------------------

/// Largest workspace a BF16 -> f32 plan may ask for (the heuristic's preference cap; the same cap as the
/// block-scaled plans, so a caller that carves [`BLOCK_SCALED_MAX_WORKSPACE`] bytes serves both).
pub const BF16_F32_MAX_WORKSPACE: usize = BLOCK_SCALED_MAX_WORKSPACE;

/// The shape of one `y[m, n] = x[m, k] . W[n, k]^T` with BF16 `x` and `W` (row-major, K contiguous) and an f32 `y`
/// (row-major `[m, n]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bf16GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl Bf16GemmShape {
    /// Positive sizes; `k` a multiple of 8 (16-byte BF16 rows, cuBLASLt's alignment for the tensor-core
    /// kernels); `n` any (the f32 output rows are `4 n` bytes apart: `n` a multiple of 4 keeps them 16-byte
    /// aligned, which cuBLASLt's heuristic takes into account, not a requirement).
    pub fn check(&self) -> Result<()> {
        let Bf16GemmShape { m, n, k } = *self;
        if m == 0 || n == 0 || k == 0 {
            bail!("BF16 GEMM: empty shape m={m} n={n} k={k}");
        }
        if !k.is_multiple_of(8) {
            bail!("BF16 GEMM: k = {k} must be a multiple of 8 (16-byte rows)");
        }
        if m > i32::MAX as usize || n > i32::MAX as usize || k > i32::MAX as usize {
            bail!("BF16 GEMM: {self:?} is too large");
        }
        Ok(())
    }
}

impl Blas {
    fn bf16_f32_plan(&self, shape: Bf16GemmShape) -> Result<GemmPlan> {
        shape.check()?;
        let Bf16GemmShape { m, n, k } = shape;
        let bf = sys::cudaDataType_t::CUDA_R_16BF;
        unsafe {
            let desc = cb(
                result::create_matmul_desc(
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cudaDataType_t::CUDA_R_32F,
                ),
                "matmul desc",
            )?;
            // From here every created object is owned by `plan` (destroyed on any early return).
            let mut plan = GemmPlan::owning(desc);
            let set_i32 = |attr, v: i32, what: &str| {
                cb(
                    result::set_matmul_desc_attribute(
                        desc,
                        attr,
                        &v as *const i32 as *const c_void,
                        size_of::<i32>(),
                    ),
                    what,
                )
            };
            use sys::cublasLtMatmulDescAttributes_t as A;
            // Column-major view: y^T[n, m] = W[n, k] (stored K-major -> op T) x x^T[k, m] (op N).
            set_i32(A::CUBLASLT_MATMUL_DESC_TRANSA, 1, "TRANSA")?;
            set_i32(A::CUBLASLT_MATMUL_DESC_TRANSB, 0, "TRANSB")?;
            let r = self.layouts_and_algo(
                &mut plan,
                bf,
                sys::cudaDataType_t::CUDA_R_32F,
                (m, n, k),
                BF16_F32_MAX_WORKSPACE,
            )?;
            cb(
                r,
                &format!("no BF16 -> f32 algorithm for m={m} n={n} k={k}"),
            )?;
            Ok(plan)
        }
    }

    /// Run `f` with the BF16 -> f32 plan of `shape` (built on first use; later calls only look it up).
    fn with_bf16_f32_plan<R>(
        &self,
        shape: Bf16GemmShape,
        f: impl FnOnce(&GemmPlan) -> Result<R>,
    ) -> Result<R> {
        let mut plans = self
            .bf16_f32_plans
            .lock()
            .map_err(|_| anyhow!("cuBLASLt plan cache poisoned by an earlier panic"))?;
        let plan = match plans.entry(shape) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.bf16_f32_plan(shape)?),
        };
        f(plan)
    }

    /// Workspace bytes the BF16 -> f32 GEMM of `shape` needs (at most [`BF16_F32_MAX_WORKSPACE`]); builds and
    /// caches the shape's plan. Host-only: may run before a capture.
    pub fn bf16_f32_workspace_bytes(&self, shape: Bf16GemmShape) -> Result<usize> {
        self.with_bf16_f32_plan(shape, |p| Ok(p.workspace_bytes))
    }

    /// `y[m, n] = sum_k x[m, k] * W[n, k]` on `stream`: BF16 operands, f32 accumulation (BF16 products are exact in
    /// f32; the tensor cores accumulate BF16 MMAs in f32), f32 output, one cuBLASLt matmul (layouts:
    /// [`Bf16GemmShape`]; `x`, `W` and `y` 256-byte aligned). `workspace` is the caller's (at least
    /// [`Blas::bf16_f32_workspace_bytes`], 256-byte aligned): nothing is allocated, so the call can be captured in a CUDA graph; the plan of a shape is built on
    /// its first call (host work only) and cached. Every check comes before anything is enqueued.
    #[allow(clippy::too_many_arguments)]
    pub fn bf16_gemm_f32(
        &self,
        stream: &Stream,
        shape: Bf16GemmShape,
        x: &dyn DeviceBuf<bf16>,
        w: &dyn DeviceBuf<bf16>,
        workspace: &dyn DeviceBuf<u8>,
        y: &dyn DeviceBuf<f32>,
    ) -> Result<()> {
        shape.check()?;
        let Bf16GemmShape { m, n, k } = shape;
        for (what, have, need) in [
            ("x", x.elems(), m * k),
            ("W", w.elems(), n * k),
            ("y", y.elems(), m * n),
        ] {
            if have < need {
                bail!("BF16 GEMM m={m} n={n} k={k}: {what} holds {have} elements, needs {need}");
            }
        }
        // The plans are chosen with the heuristic's default minimum operand alignment (256 bytes, as the bench's
        // cuBLASLt baselines were), so the operands must be that aligned: every allocation and arena carve is.
        for (what, addr) in [
            ("x", x.device_addr()),
            ("W", w.device_addr()),
            ("y", y.device_addr()),
        ] {
            if !addr.is_multiple_of(256) {
                bail!(
                    "BF16 GEMM: {what} at {addr:#x} is not 256-byte aligned (the plans assume it)"
                );
            }
        }
        if !workspace.device_addr().is_multiple_of(256) {
            bail!(
                "BF16 GEMM: the workspace at {:#x} is not 256-byte aligned",
                workspace.device_addr()
            );
        }
        self.with_bf16_f32_plan(shape, |plan| {
            if workspace.elems() < plan.workspace_bytes {
                bail!(
                    "BF16 GEMM m={m} n={n} k={k}: the workspace holds {} bytes, the algorithm needs {} \
                     (Blas::bf16_f32_workspace_bytes)",
                    workspace.elems(),
                    plan.workspace_bytes
                );
            }
            unsafe {
                cb(
                    plan.run(
                    self.handle,
                    stream,
                    x.device_addr(),
                    w.device_addr(),
                    (workspace.device_addr(), workspace.elems()),
                    y.device_addr(),
                ),
                    "BF16 -> f32 matmul",
                )?
            }
            super::launch::mark_library_launch(stream)
        })
    }
}
