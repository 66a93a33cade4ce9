//! The registry of `megamoe exec`: every kernel entry a family offers, and running one on a safetensors file.
//! Kept apart from `exec` (the tensor types and file IO the families use) so that no family module imports a
//! module that imports it back.

use std::path::Path;

use anyhow::{bail, Context, Result};

use super::exec::{read_safetensors, write_safetensors, ExecKernel};
use crate::gpu::Gpu;

/// Every kernel `exec` knows. A kernel family adds its entries here.
pub fn exec_kernels() -> Vec<ExecKernel> {
    let mut v = Vec::new();
    v.extend(crate::ops::nvfp4::exec::exec_kernels());
    v.extend(crate::ops::norm_quant::exec_kernels());
    v.extend(crate::ops::moe_gemm::exec_kernels());
    v.extend(crate::ops::sparse_attn::exec::exec_kernels());
    v.extend(crate::ops::indexer::exec_kernels());
    v
}

/// Run `kernel` on the tensors of `in_path`, writing `out_path`. `gpu` is `None` for the CPU reference.
pub fn run_exec(kernel: &str, in_path: &Path, out_path: &Path, gpu: Option<&Gpu>) -> Result<()> {
    let all = exec_kernels();
    let Some(k) = all.iter().find(|k| k.name == kernel) else {
        let names: Vec<_> = all.iter().map(|k| k.name).collect();
        bail!(
            "unknown kernel `{kernel}` for exec (known: {})",
            names.join(", ")
        );
    };
    let inputs = read_safetensors(in_path)?;
    let outputs = (k.run)(&inputs, gpu).with_context(|| format!("exec {kernel}"))?;
    write_safetensors(out_path, &outputs)
}
