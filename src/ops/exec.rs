//! `megamoe exec`: run one kernel (or its CPU reference) on tensors the user provides in a safetensors
//! file, and write its outputs to another. Each kernel documents the tensor names, dtypes and shapes it
//! expects (`ops::registry::exec_kernels`); a missing, mis-typed or mis-shaped tensor is a clear error before any launch.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};

use crate::gpu::Gpu;

/// A tensor in host memory: dtype, shape, little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

pub type TensorMap = BTreeMap<String, HostTensor>;

impl HostTensor {
    pub fn from_f32(shape: Vec<usize>, v: &[f32]) -> HostTensor {
        HostTensor {
            dtype: Dtype::F32,
            shape,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    pub fn from_bf16(shape: Vec<usize>, v: &[half::bf16]) -> HostTensor {
        HostTensor {
            dtype: Dtype::BF16,
            shape,
            bytes: v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        }
    }
    pub fn from_u8(dtype: Dtype, shape: Vec<usize>, v: Vec<u8>) -> HostTensor {
        HostTensor {
            dtype,
            shape,
            bytes: v,
        }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        match self.dtype {
            Dtype::F32 => Ok(self
                .bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            Dtype::BF16 => Ok(self
                .bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect()),
            d => bail!("expected F32 or BF16, found {d:?}"),
        }
    }
}

/// Read every tensor of a safetensors file.
pub fn read_safetensors(path: &Path) -> Result<TensorMap> {
    let buf = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let st = SafeTensors::deserialize(&buf)
        .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file: {e}", path.display()))?;
    let mut map = TensorMap::new();
    for (name, view) in st.tensors() {
        map.insert(
            name,
            HostTensor {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                bytes: view.data().to_vec(),
            },
        );
    }
    Ok(map)
}

/// Write tensors to a safetensors file (to a temporary name first, then renamed: no half-written outputs).
pub fn write_safetensors(path: &Path, tensors: &TensorMap) -> Result<()> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t)| {
            Ok((
                n.clone(),
                safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes)?,
            ))
        })
        .collect::<Result<_, safetensors::SafeTensorError>>()
        .map_err(|e| anyhow::anyhow!("building output tensors: {e}"))?;
    let tmp = path.with_extension("safetensors.partial");
    safetensors::serialize_to_file(views, None, &tmp)
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

thread_local! {
    /// The input names fetched through [`input`] on this thread while [`recording_reads`] runs.
    static READS: RefCell<Option<BTreeSet<String>>> = const { RefCell::new(None) };
}

/// Run `f` and return, beside its result, the names of the input tensors it fetched through [`input`] on this
/// thread: what lets the registry warn about tensors of a file that an entry never read, with no help from
/// the entry.
pub fn recording_reads<R>(f: impl FnOnce() -> R) -> (R, BTreeSet<String>) {
    let outer = READS.with(|r| r.replace(Some(BTreeSet::new())));
    let result = f();
    let read = READS.with(|r| r.replace(outer)).unwrap_or_default();
    (result, read)
}

/// Fetch an input by name with a dtype check and a shape check (`None` in `shape` = any size on that axis).
pub fn input<'a>(
    inputs: &'a TensorMap,
    kernel: &str,
    name: &str,
    dtypes: &[Dtype],
    shape: &[Option<usize>],
) -> Result<&'a HostTensor> {
    READS.with(|r| {
        if let Some(set) = r.borrow_mut().as_mut() {
            set.insert(name.to_string());
        }
    });
    let t = inputs.get(name).with_context(|| {
        format!(
            "`{kernel}` needs an input tensor `{name}`; the file has: {}",
            inputs.keys().cloned().collect::<Vec<_>>().join(", ")
        )
    })?;
    if !dtypes.contains(&t.dtype) {
        bail!(
            "`{kernel}`: tensor `{name}` has dtype {:?}, expected one of {dtypes:?}",
            t.dtype
        );
    }
    if t.shape.len() != shape.len()
        || t.shape
            .iter()
            .zip(shape)
            .any(|(a, b)| b.is_some_and(|b| b != *a))
    {
        let want: Vec<String> = shape
            .iter()
            .map(|d| d.map_or("*".into(), |d| d.to_string()))
            .collect();
        bail!(
            "`{kernel}`: tensor `{name}` has shape {:?}, expected [{}]",
            t.shape,
            want.join(", ")
        );
    }
    Ok(t)
}

/// One kernel callable through `megamoe exec`.
pub struct ExecKernel {
    pub name: &'static str,
    /// Inputs and outputs, for `--help` and error messages.
    pub doc: &'static str,
    /// `gpu` is `None` for `--cpu` (the CPU reference).
    pub run: fn(&TensorMap, Option<&Gpu>) -> Result<TensorMap>,
}
