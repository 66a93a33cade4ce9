//! The model's weights on the device, laid out by a [`MemoryPlan`]: one pool holding every dense tensor as stored
//! (FP8 codes and their UE8M0 scales, BF16, F32, I64) at the plan's offsets, and per layer the routed experts'
//! `plan.map.slots` physical slots in moe_gemm's layout ([`DeviceExpertWeights`]: L1 = `[w1; w3]`, gate rows first,
//! N = 2 x moe_inter_dim, K = dim; L2 = `w2`, N = dim, K = moe_inter_dim), slot `s` holding logical expert `s`.
//!
//! Sources: the synthetic weights, generated on the device (`ops::weights::fill`, bit-identical to
//! `model::weights::synthetic_bytes`), or a checkpoint in the official layout (`model::checkpoint::Checkpoint`,
//! validated against the manifest when opened), copied from its memory map. Either way each expert's MXFP4 tensors
//! pass through one staging buffer, the device converter (`ops::weights::convert`, bit-identical to
//! `formats::mxfp4::to_nvfp4`) and moe_gemm's tiling into its slot. The inexact 16-blocks of the conversion are
//! counted and reported ([`DeviceWeights::inexact_blocks`]); invalid MXFP4 scale codes fail the load.

use std::collections::HashMap;

use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::CudaSlice;

use super::plan::MemoryPlan;
use crate::formats::mxfp4::{ConversionReport, Mxfp4Matrix};
use crate::formats::nvfp4::Nvfp4Rows;
use crate::formats::{mxfp4, nvfp4};
use crate::gpu::arena;
use crate::gpu::launch::{DevBuf, DeviceBuf, Stream};
use crate::gpu::Gpu;
use crate::model::checkpoint::Checkpoint;
use crate::model::weights::{tensor_manifest, StoredDtype, TensorSource, TensorSpec, Weights};
use crate::ops::dense::prefill::weight_scales_f32;
use crate::ops::mhc::{self, reference::MhcParams, MhcWeights};
use crate::ops::moe_gemm::{prefill, DeviceExpertWeights};
use crate::ops::weights::{convert, fill};
use crate::progress::Progress;

/// Where the weights come from.
pub enum WeightSource<'a> {
    /// `model::weights::synthetic_bytes(seed, ..)`, generated on the device.
    Synthetic { seed: u64 },
    /// An opened checkpoint (opened against the same config as the plan).
    Checkpoint(&'a Checkpoint),
}

impl WeightSource<'_> {
    pub fn describe(&self) -> String {
        match self {
            WeightSource::Synthetic { seed } => format!("synthetic weights, seed {seed}"),
            WeightSource::Checkpoint(ck) => ck.describe(),
        }
    }
}

/// One layer's resident routed experts: `slots` experts each of L1 and L2.
pub struct LayerExperts {
    pub l1: DeviceExpertWeights,
    pub l2: DeviceExpertWeights,
}

/// The weights on the device (see the module docs).
pub struct DeviceWeights {
    pub plan: MemoryPlan,
    pool: CudaSlice<u8>,
    /// Dense tensor name -> index into `plan.dense`.
    index: HashMap<String, usize>,
    /// Per layer.
    pub experts: Vec<LayerExperts>,
    /// 16-element NVFP4 blocks of the resident experts that the MXFP4 -> NVFP4 conversion could not represent
    /// exactly (re-rounded onto the finest grid, `formats::mxfp4::to_nvfp4`).
    pub inexact_blocks: u64,
    /// All 16-element blocks converted.
    pub converted_blocks: u64,
    /// Every FP8 dense weight's 128x128 block scales as f32 in the block-scaled GEMM's layout (`[ceil(n/128), L4]`,
    /// `ops::dense::prefill::weight_scales_f32`, exact), one small side allocation (a few KB a weight) built at load:
    /// what the dense linears' tensor-core route reads ([`DeviceWeights::scales_f32`]).
    scales_f32: CudaSlice<f32>,
    /// Weight name (`...weight`) -> (first element, elements) in `scales_f32`.
    scales_f32_index: ScaleIndex,
}

/// The staging buffers one expert GEMM passes through: MXFP4 codes + scales in, NVFP4 codes + scales out (the
/// tiling's input), sized for the larger of L1 and L2.
struct Staging {
    mx_codes: CudaSlice<u8>,
    mx_scales: CudaSlice<u8>,
    nv_codes: CudaSlice<u8>,
    nv_scales: CudaSlice<u8>,
    counters: CudaSlice<u64>,
}

fn expert_name(layer: usize, e: usize, w: &str) -> String {
    format!("layers.{layer}.ffn.experts.{e}.{w}")
}

fn scale_name(weight: &str) -> String {
    format!(
        "{}.scale",
        weight.strip_suffix(".weight").expect("a .weight name")
    )
}

impl DeviceWeights {
    /// Allocate every buffer of `plan` and fill it from `source` on the GPU's stream, with progress on stderr. The
    /// routed-expert slot `s` holds logical expert `plan.map.first + s` (all experts from 0 on one GPU; a rank's
    /// contiguous block under expert parallelism, docs/multi-gpu.md). Every dense tensor is loaded whole (replicated).
    pub fn load(gpu: &Gpu, plan: &MemoryPlan, source: &WeightSource<'_>) -> Result<DeviceWeights> {
        let cfg = &plan.config;
        let first_expert = plan.map.first;
        ensure!(
            first_expert + plan.map.slots <= cfg.n_routed_experts,
            "expert slots {first_expert}..{} outside the {} routed experts",
            first_expert + plan.map.slots,
            cfg.n_routed_experts
        );
        let stream = gpu.stream.clone();
        let mut progress = Progress::new("weights", cfg.n_layers + 1);
        progress.println(&format!(
            "loading {} onto the GPU; {}",
            source.describe(),
            plan.map
        ));
        let pool = gpu
            .zeros::<u8>(plan.dense_bytes.max(1))
            .with_context(|| format!("allocating the {} B dense weight pool", plan.dense_bytes))?;
        let mut index = HashMap::new();
        for (i, t) in plan.dense.iter().enumerate() {
            index.insert(t.spec.name.clone(), i);
            let dst = Self::view(&pool, t.offset, t.bytes());
            write_tensor(gpu, &stream, source, &t.spec, &dst)?;
        }
        let (scales_f32, scales_f32_index) = fp8_scales_f32(gpu, &stream, &pool, plan)?;
        progress.tick("dense weights");

        let (l1, l2) = (plan.experts.l1, plan.experts.l2);
        let slots = plan.map.slots;
        let most = |f: &dyn Fn(&super::plan::ExpertGemm) -> usize| f(&l1).max(f(&l2));
        let staging = Staging {
            mx_codes: gpu.zeros::<u8>(most(&|g| g.n * g.k / 2))?,
            mx_scales: gpu.zeros::<u8>(most(&|g| g.n * g.k / mxfp4::BLOCK))?,
            nv_codes: gpu.zeros::<u8>(most(&|g| g.n * g.k / 2))?,
            nv_scales: gpu.zeros::<u8>(most(&|g| g.n * g.k / nvfp4::BLOCK))?,
            counters: gpu.zeros::<u64>(convert::COUNTERS)?,
        };
        let specs: HashMap<String, TensorSpec> = tensor_manifest(cfg)
            .into_iter()
            .filter(|s| super::plan::is_routed_expert(&s.name))
            .map(|s| (s.name.clone(), s))
            .collect();
        let spec = |name: &str| {
            specs
                .get(name)
                .ok_or_else(|| anyhow!("{name} is not in the {} manifest", cfg.name))
        };
        let mut experts = Vec::with_capacity(cfg.n_layers);
        for layer in 0..cfg.n_layers {
            let alloc = |g: super::plan::ExpertGemm| -> Result<DeviceExpertWeights> {
                Ok(DeviceExpertWeights {
                    experts: slots,
                    n: g.n,
                    k: g.k,
                    tiled: gpu.zeros::<u8>(g.tiled_bytes() * slots)?,
                    global: gpu.zeros::<f32>(g.n * slots)?,
                })
            };
            let le = LayerExperts {
                l1: alloc(l1)?,
                l2: alloc(l2)?,
            };
            for e in 0..slots {
                let w1 = expert_name(layer, first_expert + e, "w1.weight");
                let w3 = expert_name(layer, first_expert + e, "w3.weight");
                let w2 = expert_name(layer, first_expert + e, "w2.weight");
                let parts1 = [spec(&w1)?, spec(&w3)?];
                let scales1 = [spec(&scale_name(&w1))?, spec(&scale_name(&w3))?];
                convert_expert(gpu, &stream, source, &staging, &parts1, &scales1, &le.l1, e)?;
                let parts2 = [spec(&w2)?];
                let scales2 = [spec(&scale_name(&w2))?];
                convert_expert(gpu, &stream, source, &staging, &parts2, &scales2, &le.l2, e)?;
            }
            experts.push(le);
            progress.tick(&format!("layer {layer} experts"));
        }
        let counts = gpu.download(&staging.counters)?;
        if counts[convert::COUNTER_BAD_SCALES] != 0 {
            bail!(
                "{}: {} routed-expert MXFP4 scale codes exceed {:#04x} (NaN, or 6 x scale overflows f32)",
                source.describe(),
                counts[convert::COUNTER_BAD_SCALES],
                mxfp4::MAX_SCALE_CODE
            );
        }
        let per_layer_blocks = (l1.n * l1.k + l2.n * l2.k) / nvfp4::BLOCK;
        let w = DeviceWeights {
            plan: plan.clone(),
            pool,
            index,
            experts,
            inexact_blocks: counts[convert::COUNTER_INEXACT],
            converted_blocks: (per_layer_blocks * slots * cfg.n_layers) as u64,
            scales_f32,
            scales_f32_index,
        };
        progress.println(&w.conversion_summary());
        Ok(w)
    }

    /// One line for reports: how many converted blocks were exact.
    pub fn conversion_summary(&self) -> String {
        format!(
            "MXFP4 -> NVFP4: {} of {} 16-element expert blocks inexact (re-rounded), the rest bit-exact",
            self.inexact_blocks, self.converted_blocks
        )
    }

    fn view(pool: &CudaSlice<u8>, offset: usize, bytes: usize) -> DevBuf<u8> {
        assert!(offset + bytes <= pool.len(), "dense tensor past the pool");
        // SAFETY: [offset, offset + bytes) lies inside the pool, which lives as long as `self`.
        unsafe { DevBuf::from_raw(pool.device_addr() + offset as u64, bytes) }
    }

    /// The stored bytes of dense tensor `name` on the device (valid while `self` lives).
    pub fn bytes(&self, name: &str) -> Result<DevBuf<u8>> {
        let t = &self.plan.dense[*self.index.get(name).ok_or_else(|| {
            anyhow!(
                "{name} is not a dense tensor of the {} plan (routed experts live in `experts`)",
                self.plan.config.name
            )
        })?];
        Ok(Self::view(&self.pool, t.offset, t.bytes()))
    }

    /// Dense tensor `name` as elements of `T` (`T`'s size must be the stored dtype's; e.g. `half::bf16` for BF16,
    /// `f32`, `u8` for FP8 codes and UE8M0 scales, `i64` for tid2eid).
    pub fn typed<T>(&self, name: &str) -> Result<DevBuf<T>> {
        let t = &self.plan.dense[*self
            .index
            .get(name)
            .ok_or_else(|| anyhow!("{name} is not a dense tensor"))?];
        ensure!(
            std::mem::size_of::<T>() == t.spec.dtype.size(),
            "{name} is {} ({} bytes an element), not {}",
            t.spec.dtype.safetensors_name(),
            t.spec.dtype.size(),
            std::any::type_name::<T>()
        );
        // SAFETY: inside the pool (as `bytes`), DENSE_ALIGN-aligned, whole elements of the stored size.
        Ok(unsafe { DevBuf::from_raw(self.pool.device_addr() + t.offset as u64, t.spec.numel()) })
    }

    /// Dense tensor `name` as f32 on the host (F32 or BF16 storage), read back from the pool (set-up only: it
    /// waits for `stream`).
    pub fn host_f32(&self, stream: &Stream, name: &str) -> Result<Vec<f32>> {
        let Some(t) = self.plan.dense_tensor(name) else {
            bail!("the model has no tensor {name}")
        };
        let n = t.spec.numel();
        let bytes = arena::download(stream, &self.bytes(name)?)?;
        Ok(match t.spec.dtype {
            StoredDtype::F32 => bytes[..4 * n]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            StoredDtype::BF16 => bytes[..2 * n]
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            d => bail!("{name} is stored as {d:?}, expected F32 or BF16"),
        })
    }

    /// Layer `layer`'s mHC boundary `which` (`"attn"` or `"ffn"`) in the launchers' form: `hc_{which}_fn`,
    /// `_scale`, `_base` and the sub-layer's `{which}_norm.weight`, read back from the pool and uploaded (set-up
    /// only: it waits for the GPU's stream).
    pub fn mhc_boundary(&self, gpu: &Gpu, layer: usize, which: &str) -> Result<MhcWeights> {
        let s = &gpu.stream;
        let p = format!("layers.{layer}");
        let hc = |what: &str| self.host_f32(s, &format!("{p}.hc_{which}_{what}"));
        let (scale, base) = (hc("scale")?, hc("base")?);
        let params = MhcParams {
            mix_fn: hc("fn")?,
            scale: scale.as_slice().try_into().map_err(|_| {
                anyhow!(
                    "{p}.hc_{which}_scale has {} values, expected 3",
                    scale.len()
                )
            })?,
            base: base.as_slice().try_into().map_err(|_| {
                anyhow!(
                    "{p}.hc_{which}_base has {} values, expected {}",
                    base.len(),
                    mhc::HC_MIX
                )
            })?,
        };
        let norm = self.host_f32(s, &format!("{p}.{which}_norm.weight"))?;
        MhcWeights::upload(gpu, &params, &norm, self.plan.config.dim)
    }

    /// The f32 block scales of the FP8 dense weight `weight` (its `...weight` name) in the block-scaled GEMM's layout
    /// `[ceil(n/128), L4]` (valid while `self` lives); None for a tensor that is not an FP8 weight with a `.scale`.
    pub fn scales_f32(&self, weight: &str) -> Option<DevBuf<f32>> {
        let &(first, len) = self.scales_f32_index.get(weight)?;
        assert!(
            first + len <= self.scales_f32.len(),
            "f32 scales past their buffer"
        );
        // SAFETY: inside `scales_f32`, which lives as long as `self`; 256-byte aligned (see `fp8_scales_f32`).
        Some(unsafe { DevBuf::from_raw(self.scales_f32.device_addr() + (first * 4) as u64, len) })
    }

    /// The whole dense pool (tests compare it byte for byte).
    pub fn pool(&self) -> &CudaSlice<u8> {
        &self.pool
    }
}

/// Weight name -> (first element, elements) of its f32 block scales in [`DeviceWeights`]' side allocation.
type ScaleIndex = HashMap<String, (usize, usize)>;

/// Every FP8 dense weight of `plan` with a `.scale` companion: its ue8m0 codes read back from the pool (set-up only:
/// each read waits for `stream`), converted on the host (`weight_scales_f32`, exact) and uploaded together, each
/// weight's at a 256-byte aligned offset. Returns the buffer and the weight name -> (first element, elements) map.
fn fp8_scales_f32(
    gpu: &Gpu,
    stream: &Stream,
    pool: &CudaSlice<u8>,
    plan: &MemoryPlan,
) -> Result<(CudaSlice<f32>, ScaleIndex)> {
    const ALIGN_ELEMS: usize = 64;
    let mut host: Vec<f32> = Vec::new();
    let mut index = HashMap::new();
    for t in &plan.dense {
        if t.spec.dtype != StoredDtype::F8E4M3 || t.spec.shape.len() != 2 {
            continue;
        }
        let Some(prefix) = t.spec.name.strip_suffix(".weight") else {
            continue;
        };
        let Some(st) = plan.dense_tensor(&format!("{prefix}.scale")) else {
            continue;
        };
        let (n, k) = (t.spec.shape[0], t.spec.shape[1]);
        let codes = arena::download(stream, &DeviceWeights::view(pool, st.offset, st.bytes()))?;
        let f = weight_scales_f32(&codes[..st.spec.numel().min(codes.len())], n, k)
            .with_context(|| format!("{}: f32 block scales", t.spec.name))?;
        let first = host.len();
        index.insert(t.spec.name.clone(), (first, f.len()));
        host.extend_from_slice(&f);
        host.resize(host.len().div_ceil(ALIGN_ELEMS) * ALIGN_ELEMS, 0.0);
    }
    if host.is_empty() {
        host.push(0.0);
    }
    Ok((gpu.upload(&host)?, index))
}

/// Write tensor `spec`'s stored bytes to `dst` (exactly `spec.nbytes()` bytes) on `stream`.
fn write_tensor(
    gpu: &Gpu,
    stream: &Stream,
    source: &WeightSource<'_>,
    spec: &TensorSpec,
    dst: &DevBuf<u8>,
) -> Result<()> {
    match source {
        WeightSource::Synthetic { seed } => fill(gpu, stream, *seed, spec, 0, spec.numel(), dst),
        WeightSource::Checkpoint(ck) => {
            let bytes = ck.read_elements(spec, 0, spec.numel())?;
            ensure!(
                bytes.len() == spec.nbytes() && dst.elems() >= bytes.len(),
                "{}: {} bytes read for {} expected",
                spec.name,
                bytes.len(),
                spec.nbytes()
            );
            arena::upload(stream, dst, &bytes)
        }
    }
}

/// Stage the MXFP4 row blocks `parts` (stacked in order: `[w1; w3]` or `[w2]`) with their `scales`, convert them
/// and tile them into slot `slot` of `out`.
#[allow(clippy::too_many_arguments)]
fn convert_expert(
    gpu: &Gpu,
    stream: &Stream,
    source: &WeightSource<'_>,
    st: &Staging,
    parts: &[&TensorSpec],
    scales: &[&TensorSpec],
    out: &DeviceExpertWeights,
    slot: usize,
) -> Result<()> {
    let (n, k) = (out.n, out.k);
    let (mut code_at, mut scale_at) = (0usize, 0usize);
    for (p, s) in parts.iter().zip(scales) {
        let dst = st.mx_codes.sub_buf(code_at, p.nbytes());
        write_tensor(gpu, stream, source, p, &dst)?;
        let dst = st.mx_scales.sub_buf(scale_at, s.nbytes());
        write_tensor(gpu, stream, source, s, &dst)?;
        code_at += p.nbytes();
        scale_at += s.nbytes();
    }
    ensure!(
        code_at == n * k / 2 && scale_at == n * k / mxfp4::BLOCK,
        "expert slot {slot}: staged {code_at} code and {scale_at} scale bytes for {n} x {k} weights"
    );
    let global = out.global.sub_buf(slot * n, n);
    convert::mxfp4_to_nvfp4(
        gpu,
        stream,
        n,
        k,
        &st.mx_codes,
        &st.mx_scales,
        &st.nv_codes,
        &st.nv_scales,
        &global,
        &st.counters,
    )?;
    let per = prefill::tiled_bytes(1, n, k);
    let tiled = out.tiled.sub_buf(slot * per, per);
    prefill::tile_weights_into(gpu, stream, &st.nv_codes, &st.nv_scales, 1, n, k, &tiled)
}

/// A non-owning sub-range of a device slice.
trait SubBuf<T> {
    fn sub_buf(&self, first: usize, len: usize) -> DevBuf<T>;
}

impl<T> SubBuf<T> for CudaSlice<T> {
    fn sub_buf(&self, first: usize, len: usize) -> DevBuf<T> {
        assert!(first + len <= self.len(), "sub-range past the buffer");
        // SAFETY: inside the slice, which outlives every launch of the load (all on its stream).
        unsafe {
            DevBuf::from_raw(
                self.device_addr() + (first * std::mem::size_of::<T>()) as u64,
                len,
            )
        }
    }
}

/// One expert's moe_gemm rows on the CPU: the MXFP4 rows of `[w1; w3]` (L1, gate rows first) or `w2` (L2) of
/// logical expert `expert` in `layer`, read through `weights`, converted by `formats::mxfp4::to_nvfp4` (what the
/// device converter must equal bit for bit), with the conversion's report.
pub fn expert_nvfp4(
    weights: &Weights,
    layer: usize,
    expert: usize,
    l1: bool,
) -> Result<(Nvfp4Rows, ConversionReport)> {
    let names: &[&str] = if l1 {
        &["w1.weight", "w3.weight"]
    } else {
        &["w2.weight"]
    };
    let (mut data, mut scales, mut rows, mut cols) = (Vec::new(), Vec::new(), 0, 0);
    for w in names {
        let name = expert_name(layer, expert, w);
        let spec = weights.spec(&name)?;
        rows += spec.shape[0];
        cols = spec.shape[1] * 2;
        data.extend(weights.raw(&name)?);
        scales.extend(weights.raw(&scale_name(&name))?);
    }
    let m = Mxfp4Matrix::from_parts(rows, cols, data, scales)?;
    Ok(mxfp4::to_nvfp4(&m))
}

/// CPU twin of one resident expert slot (tests): slot `slot` of `layer` holds logical expert `slot`, i.e.
/// [`expert_nvfp4`] tiled by `prefill::tile_weights_like_kernel`. Returns (tiled bytes, global scales, inexact
/// 16-blocks).
pub fn expected_expert(
    weights: &Weights,
    layer: usize,
    slot: usize,
    l1: bool,
) -> Result<(Vec<u8>, Vec<f32>, usize)> {
    let (q, report) = expert_nvfp4(weights, layer, slot, l1)?;
    let tiled = prefill::tile_weights_like_kernel(&q.data, &q.scales, 1, q.rows, q.cols);
    Ok((tiled, q.global_scale, report.inexact_blocks.len()))
}
