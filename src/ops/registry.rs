//! The registry of `megamoe exec`: every kernel entry a family offers, and running one on a safetensors file.
//! Kept apart from `exec` (the tensor types and file IO the families use) so that no family module imports a
//! module that imports it back.

use std::path::Path;

use anyhow::{bail, Context, Result};

use super::exec::{read_safetensors, recording_reads, write_safetensors, ExecKernel};
use crate::gpu::Gpu;

/// Every kernel `exec` knows. A kernel family adds its entries here.
pub fn exec_kernels() -> Vec<ExecKernel> {
    let mut v = Vec::new();
    v.extend(crate::ops::nvfp4::exec::exec_kernels());
    v.extend(crate::ops::norm_quant::exec_kernels());
    v.extend(crate::ops::mhc::exec_kernels());
    v.extend(crate::ops::moe_gemm::exec_kernels());
    v.extend(crate::ops::sparse_attn::exec::exec_kernels());
    v.extend(crate::ops::indexer::exec_kernels());
    v.extend(crate::ops::head::exec_kernels());
    v.extend(crate::ops::qkv_prep::exec_kernels());
    v.extend(crate::ops::dense::exec::exec_kernels());
    v
}

/// The exec entry named `kernel`, or an error listing every name.
pub fn find(kernel: &str) -> Result<ExecKernel> {
    let all = exec_kernels();
    let names: Vec<_> = all.iter().map(|k| k.name).collect();
    let names = names.join(", ");
    all.into_iter()
        .find(|k| k.name == kernel)
        .with_context(|| format!("unknown kernel `{kernel}` for exec; the kernels are: {names}"))
}

/// The input must be an existing file, the output must not be a directory, and the two must not be the same
/// file (after following links and `..`): the output is written over its path, which would replace the input.
pub fn check_paths(in_path: &Path, out_path: &Path) -> Result<()> {
    if in_path.is_dir() {
        bail!(
            "input {} is a directory; --in takes a safetensors file",
            in_path.display()
        );
    }
    if !in_path.is_file() {
        bail!("input file {} does not exist", in_path.display());
    }
    if out_path.is_dir() {
        bail!(
            "output {} is a directory; --out takes the path of the safetensors file to write",
            out_path.display()
        );
    }
    if out_path.exists() {
        let a = in_path
            .canonicalize()
            .with_context(|| format!("resolving {}", in_path.display()))?;
        let b = out_path
            .canonicalize()
            .with_context(|| format!("resolving {}", out_path.display()))?;
        if a == b {
            bail!(
                "--out {} is the input file {}: writing it would overwrite the input; choose another output path",
                out_path.display(),
                in_path.display()
            );
        }
    }
    Ok(())
}

/// Run `kernel` on the tensors of `in_path`, writing `out_path`. `gpu` is `None` for the CPU reference.
/// Returns the names of the input tensors the kernel never read through [`input`](super::exec::input) (an
/// extra or misnamed tensor the caller should hear about), in name order.
pub fn run_exec(
    kernel: &str,
    in_path: &Path,
    out_path: &Path,
    gpu: Option<&Gpu>,
) -> Result<Vec<String>> {
    let k = find(kernel)?;
    check_paths(in_path, out_path)?;
    let inputs = read_safetensors(in_path)?;
    let (outputs, read) = recording_reads(|| (k.run)(&inputs, gpu));
    let outputs = outputs.with_context(|| format!("exec {kernel}"))?;
    write_safetensors(out_path, &outputs)?;
    Ok(inputs
        .keys()
        .filter(|n| !read.contains(*n))
        .cloned()
        .collect())
}
