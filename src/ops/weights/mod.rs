//! Synthetic weights on the GPU (kernels/weights.cu): the stored bytes of elements `[first, first + count)` of
//! one tensor of the synthetic checkpoint, written straight into device memory, so the engine can hold the whole
//! model on one GPU without a host copy of it.
//!
//! Contract: the bytes written equal [`synthetic_bytes`](crate::model::weights::synthetic_bytes)`(seed, spec,
//! first, count)` bit for bit (the CPU oracle; the kernel header states the hash identities and why every float
//! step rounds as on the CPU). The per-tensor key [`tensor_key`] is computed here on the host, so each launch
//! hashes only element indices. [`fill`] checks the range, the output length and the (init, dtype) pair before
//! any launch, runs on the caller's stream and allocates nothing.
//!
//! Rooms: `bench.rs` (the measurement hook), `convert.rs` (MXFP4 -> NVFP4 expert weights on the device).

use anyhow::{bail, Result};

use crate::gpu::launch::{launch, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
use crate::model::weights::{tensor_key, StoredDtype, SyntheticInit, TensorSpec};

pub mod bench;
pub mod convert;

const FAMILY: &str = "weights";
/// Threads per CTA (`kThreads` in kernels/weights.cu, its `__launch_bounds__`).
const THREADS: u32 = 256;
/// Bytes each thread writes per grid-stride step (one 16-byte chunk of the output).
const CHUNK_BYTES: usize = 16;
/// CTAs per SM of the grid-stride loop: 8 x 256 threads = the 2048 resident threads of an SM.
const CTAS_PER_SM: usize = 8;

/// The kernel for a tensor and its init parameters (everything but out, first, count and the key).
#[derive(Clone, Copy, Debug, PartialEq)]
enum FillKernel {
    Fp8Codes,
    Fp4Codes,
    Ue8m0Scale { exp_base: i32 },
    Bf16Uniform { amp: f32, offset: f32 },
    F32Uniform { amp: f32, offset: f32 },
    F32HcBase { hc: u64, amp: f32, diag: f32 },
    I64Tid2eid { k: u64, n_experts: u64 },
}

impl FillKernel {
    /// The entry point that fills `spec`, or why none does: exactly the (init, dtype) pairs
    /// `synthetic_bytes` generates (any other pair panics there).
    fn of(spec: &TensorSpec) -> Result<FillKernel> {
        Ok(match (&spec.init, spec.dtype) {
            (SyntheticInit::Fp8Codes, StoredDtype::F8E4M3) => FillKernel::Fp8Codes,
            (SyntheticInit::Fp4Codes, StoredDtype::I8) => FillKernel::Fp4Codes,
            (SyntheticInit::Scale { exp_base }, StoredDtype::F8E8M0) => FillKernel::Ue8m0Scale {
                exp_base: *exp_base,
            },
            (SyntheticInit::Uniform { amp, offset }, StoredDtype::BF16) => {
                FillKernel::Bf16Uniform {
                    amp: *amp,
                    offset: *offset,
                }
            }
            (SyntheticInit::Uniform { amp, offset }, StoredDtype::F32) => FillKernel::F32Uniform {
                amp: *amp,
                offset: *offset,
            },
            (SyntheticInit::HcBase { hc, amp, diag }, StoredDtype::F32) => {
                if *hc == 0 {
                    bail!("{}: HcBase with hc = 0", spec.name);
                }
                FillKernel::F32HcBase {
                    hc: *hc as u64,
                    amp: *amp,
                    diag: *diag,
                }
            }
            (SyntheticInit::Tid2eid { n_experts }, StoredDtype::I64) => {
                let k = match spec.shape.as_slice() {
                    [_, k] if *k > 0 => *k,
                    s => bail!(
                        "{}: tid2eid needs a [vocab, k] shape with k > 0, not {s:?}",
                        spec.name
                    ),
                };
                if *n_experts == 0 {
                    bail!("{}: tid2eid with 0 experts", spec.name);
                }
                FillKernel::I64Tid2eid {
                    k: k as u64,
                    n_experts: *n_experts as u64,
                }
            }
            (init, dt) => bail!(
                "{}: the synthetic init {init:?} does not apply to dtype {} (no GPU fill for this pair)",
                spec.name,
                dt.safetensors_name()
            ),
        })
    }

    fn entry(self) -> &'static str {
        match self {
            FillKernel::Fp8Codes => "weights_fill_fp8_codes",
            FillKernel::Fp4Codes => "weights_fill_fp4_codes",
            FillKernel::Ue8m0Scale { .. } => "weights_fill_ue8m0_scale",
            FillKernel::Bf16Uniform { .. } => "weights_fill_bf16_uniform",
            FillKernel::F32Uniform { .. } => "weights_fill_f32_uniform",
            FillKernel::F32HcBase { .. } => "weights_fill_f32_hc_base",
            FillKernel::I64Tid2eid { .. } => "weights_fill_i64_tid2eid",
        }
    }

    /// Push the init parameters after (out, first, count, key), in the entry point's order.
    fn push_params(self, args: &mut KernelArgs) {
        match self {
            FillKernel::Fp8Codes | FillKernel::Fp4Codes => {}
            FillKernel::Ue8m0Scale { exp_base } => {
                args.i32(exp_base);
            }
            FillKernel::Bf16Uniform { amp, offset } | FillKernel::F32Uniform { amp, offset } => {
                args.f32(amp).f32(offset);
            }
            FillKernel::F32HcBase { hc, amp, diag } => {
                args.u64(hc).f32(amp).f32(diag);
            }
            FillKernel::I64Tid2eid { k, n_experts } => {
                args.u64(k).u64(n_experts);
            }
        }
    }
}

/// The checks [`fill`] makes before any launch, on the host alone: `spec` has a GPU fill (its (init, dtype)
/// pair is one `synthetic_bytes` generates), `first + count <= numel` and `out_bytes >= count * element size`.
/// Returns the bytes the fill writes.
pub fn check_fill(
    spec: &TensorSpec,
    first: usize,
    count: usize,
    out_bytes: usize,
) -> Result<usize> {
    FillKernel::of(spec)?;
    let numel = spec.numel();
    match first.checked_add(count) {
        Some(end) if end <= numel => {}
        _ => bail!(
            "{}: elements {first}..{first}+{count} beyond its {numel} elements",
            spec.name
        ),
    }
    let bytes = count * spec.dtype.size();
    if out_bytes < bytes {
        bail!(
            "{}: the output holds {out_bytes} bytes, {count} {} elements need {bytes}",
            spec.name,
            spec.dtype.safetensors_name()
        );
    }
    Ok(bytes)
}

/// Write the stored bytes of elements `[first, first + count)` of the synthetic tensor `spec` (seed `seed`) to
/// `out[0 .. count * element size]` on `stream`; bytes of `out` past that are left untouched. `count == 0`
/// launches nothing. Any alignment of `out` is accepted (16-byte aligned outputs get 16-byte stores).
pub fn fill(
    gpu: &Gpu,
    stream: &Stream,
    seed: u64,
    spec: &TensorSpec,
    first: usize,
    count: usize,
    out: &impl DeviceBuf<u8>,
) -> Result<()> {
    check_fill(spec, first, count, out.elems())?;
    let kernel = FillKernel::of(spec)?;
    if count == 0 {
        return Ok(());
    }
    let chunks = (count * spec.dtype.size()).div_ceil(CHUNK_BYTES);
    let blocks = chunks
        .div_ceil(THREADS as usize)
        .clamp(1, gpu.info.sm_count.max(1) as usize * CTAS_PER_SM);
    let mut args = KernelArgs::new();
    args.buf(out)
        .u64(first as u64)
        .u64(count as u64)
        .u64(tensor_key(seed, &spec.name));
    kernel.push_params(&mut args);
    let k = gpu.kernel(FAMILY, kernel.entry())?;
    let l = Launch::new((blocks as u32, 1, 1), (THREADS, 1, 1));
    // SAFETY: the arguments match the entry point's (out, first, count, key, <init parameters>); `out` holds
    // count * element-size bytes and first + count <= numel (checked above).
    unsafe { launch(stream, &k, l, &mut args) }
}

/// Host entry: the bytes of `[first, first + count)` filled on the GPU and copied back (tests and tools).
pub fn fill_to_host(
    gpu: &Gpu,
    seed: u64,
    spec: &TensorSpec,
    first: usize,
    count: usize,
) -> Result<Vec<u8>> {
    let bytes = check_fill(spec, first, count, usize::MAX)?;
    if bytes == 0 {
        return Ok(Vec::new());
    }
    let out = gpu.poisoned::<u8>(bytes, 0xFF)?;
    fill(gpu, &gpu.stream, seed, spec, first, count, &out)?;
    gpu.download(&out)
}
