//! Embedded kernel modules: build.rs writes one `KernelSource` per `kernels/<family>.cu` with its sm_90a
//! cubin (when nvcc was available at build time), its NVRTC-ready source (local includes inlined) and
//! its ptxas report (registers, shared memory, spills per function).

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::Ptx;

/// One kernel family as embedded by build.rs.
#[derive(Debug)]
pub struct KernelSource {
    pub name: &'static str,
    pub functions: &'static [&'static str],
    pub source: &'static str,
    pub cubin: Option<&'static [u8]>,
    pub ptxas_report: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The family named `family`, or an error listing the known ones.
pub fn find(family: &str) -> Result<&'static KernelSource> {
    KERNEL_SOURCES
        .iter()
        .find(|k| k.name == family)
        .ok_or_else(|| {
            let names: Vec<_> = KERNEL_SOURCES.iter().map(|k| k.name).collect();
            anyhow!("no kernel family `{family}` (known: {})", names.join(", "))
        })
}

/// Load a family into the context: the cubin if embedded, else NVRTC (needs libnvrtc and CUDA headers).
pub fn load(ctx: &Arc<CudaContext>, src: &KernelSource) -> Result<Arc<CudaModule>> {
    if let Some(cubin) = src.cubin {
        return ctx
            .load_module(Ptx::from_binary(cubin.to_vec()))
            .map_err(|e| anyhow!("loading the embedded sm_90a cubin of `{}`: {e:?}", src.name));
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!(
            "`{}` has no embedded cubin (built without nvcc) and libnvrtc is not loadable: rebuild with scripts/install-nvcc.sh and REQUIRE_CUBIN=1",
            src.name
        );
    }
    let home = std::env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".into());
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some("sm_90a"),
        include_paths: vec![format!("{home}/include"), format!("{home}/include/cccl")],
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src.source, opts)
        .map_err(|e| anyhow!("NVRTC failed on `{}`: {e:?}", src.name))?;
    ctx.load_module(ptx)
        .map_err(|e| anyhow!("loading NVRTC output of `{}`: {e:?}", src.name))
}

/// Per-function resources read from a ptxas report (`-Xptxas -v`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PtxasFunction {
    pub name: String,
    pub registers: Option<u32>,
    pub smem_bytes: Option<u32>,
    pub stack_bytes: Option<u32>,
    pub spill_store_bytes: Option<u32>,
    pub spill_load_bytes: Option<u32>,
}

/// Parse ptxas `-v` output: "Compiling entry function 'f'", "N bytes stack frame, N bytes spill stores, N
/// bytes spill loads", "Used N registers, ... N bytes smem".
pub fn parse_ptxas(report: &str) -> Vec<PtxasFunction> {
    let mut out: Vec<PtxasFunction> = Vec::new();
    for line in report.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + 26..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(PtxasFunction {
                name,
                ..Default::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        let num_before = |s: &str, key: &str| -> Option<u32> {
            let i = s.find(key)?;
            s[..i]
                .split(|c: char| !c.is_ascii_digit())
                .rfind(|t| !t.is_empty())?
                .parse()
                .ok()
        };
        if line.contains("stack frame") {
            cur.stack_bytes = num_before(line, "bytes stack frame");
            cur.spill_store_bytes = num_before(line, "bytes spill stores");
            cur.spill_load_bytes = num_before(line, "bytes spill loads");
        }
        if line.contains("Used") && line.contains("registers") {
            cur.registers = num_before(line, "registers");
            cur.smem_bytes = num_before(line, "bytes smem").or(Some(0));
        }
    }
    out
}

/// Mangled-name-free check: the functions of every family, with their ptxas resources (None when built
/// without nvcc).
pub fn inventory() -> Vec<(&'static KernelSource, Vec<PtxasFunction>)> {
    KERNEL_SOURCES
        .iter()
        .map(|k| (k, parse_ptxas(k.ptxas_report)))
        .collect()
}
