//! cuBLASLt GEMMs used as denominators (the `limits` probe) and as baselines: `D[M,N] = A[M,K] . B[N,K]^T`,
//! row-major with both operands K-major ("TN" in cuBLAS's column-major terms, which FP8 requires), fp32
//! accumulation, BF16 output. A and B are BF16 or FP8 e4m3 (per-tensor fp32 scales for FP8).

use std::ffi::c_void;
use std::mem::size_of;

use anyhow::{anyhow, bail, Result};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

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

/// A cuBLASLt handle plus its 32 MiB workspace.
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
}

impl Drop for Blas {
    fn drop(&mut self) {
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
        Ok(Blas { handle, workspace })
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
