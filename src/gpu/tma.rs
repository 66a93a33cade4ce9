//! Tensor maps for the Tensor Memory Accelerator (TMA, sm_90): `cuTensorMapEncodeTiled` wrapped once for every
//! kernel family. Encoding is host-only work (no device round trip); the 128-byte map is passed to the kernel
//! by value as a `const __grid_constant__ CUtensorMap` parameter.

use anyhow::{ensure, Result};
use cudarc::driver::sys;

/// An encoded tensor map, passed by value as a kernel argument (cudarc's `CUtensorMap` is the 128-byte,
/// 64-byte-aligned opaque blob the driver wants).
#[derive(Clone, Copy)]
pub struct TensorMap(pub sys::CUtensorMap);

// SAFETY: a plain 128-byte POD blob that the driver copies into the kernel's parameter space.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

impl TensorMap {
    /// An all-zero map, for a kernel parameter the kernel does not read on this launch.
    pub fn unused() -> Self {
        TensorMap(sys::CUtensorMap { opaque: [0; 16] })
    }
}

/// Encode a tiled tensor map over `dims` (innermost first) of `elem_bytes`-byte elements of type `dtype` at
/// device address `addr`, with the byte strides of the outer dimensions `strides_bytes` (one fewer than
/// `dims`), box `box_dims`, element strides 1, no interleave, no out-of-bounds NaN fill (zeros), 256-byte L2
/// promotion. The TMA's own rules are checked first with a clear error: base and strides 16-byte aligned, the
/// box's inner extent a multiple of 16 bytes. (A copy must also START 16-byte aligned in the innermost
/// dimension: that depends on the kernel's coordinates, so the kernel states it beside its copies.)
#[allow(clippy::too_many_arguments)]
pub fn encode_tiled(
    what: &str,
    dtype: sys::CUtensorMapDataType,
    elem_bytes: usize,
    addr: u64,
    dims: &[u64],
    strides_bytes: &[u64],
    box_dims: &[u32],
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<TensorMap> {
    ensure!(
        !dims.is_empty()
            && dims.len() <= 5
            && strides_bytes.len() + 1 == dims.len()
            && box_dims.len() == dims.len(),
        "{what}: tensor map rank mismatch (dims {dims:?}, strides {strides_bytes:?}, box {box_dims:?})"
    );
    ensure!(
        dims.iter().all(|&d| d >= 1),
        "{what}: empty tensor map (dims {dims:?})"
    );
    ensure!(
        addr.is_multiple_of(16)
            && strides_bytes.iter().all(|s| s.is_multiple_of(16))
            && (box_dims[0] as usize * elem_bytes).is_multiple_of(16),
        "{what}: tensor map needs 16-byte alignment (base 0x{addr:x}, strides {strides_bytes:?}, inner box \
         {} x {elem_bytes} B)",
        box_dims[0]
    );
    let element_strides = vec![1u32; dims.len()];
    let mut map = TensorMap::unused();
    // SAFETY: every pointer refers to a live local array of the length the rank implies; `map.0` is the
    // driver's 128-byte, aligned output type.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map.0,
            dtype,
            dims.len() as u32,
            addr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides_bytes.as_ptr(),
            box_dims.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    ensure!(
        r == sys::CUresult::CUDA_SUCCESS,
        "{what}: cuTensorMapEncodeTiled failed: {r:?} (dims {dims:?}, box {box_dims:?})"
    );
    Ok(map)
}
