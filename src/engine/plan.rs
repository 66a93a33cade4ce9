//! The memory plan of one engine run, computed on the host before any GPU work (docs/engine.md): every weight
//! tensor's device bytes in the format the kernels read, the KV cache pool, the step workspace budget, and how many
//! physical expert slots per layer fit in what is left ([`ExpertMap`]).
//!
//! Order of the budget: `free = reserve + dense weights + caches + workspace + experts`. The request (batch,
//! context) fixes the caches; the routed experts get what remains, up to every logical expert. A request whose
//! caches leave room for fewer than `n_activated_experts` slots per layer is refused with the numbers.

use std::fmt;
use std::path::Path;

use anyhow::{bail, ensure, Result};

use crate::formats::{indexer_key, kv};
use crate::model::config::{LayerKind, ModelConfig};
use crate::model::weights::{tensor_manifest, TensorSpec};
use crate::ops::moe_gemm::prefill;

/// Alignment of every tensor inside the dense weight pool (the widest vector load any kernel issues is 16 B; 256
/// keeps each tensor at the start of a DRAM burst, as cudaMalloc does).
pub const DENSE_ALIGN: usize = 256;
/// Granule the driver rounds each large allocation to; the plan rounds every expert buffer up to it.
pub const ALLOC_GRANULE: usize = 2 << 20;
/// Device memory kept free of the plan: the CUDA context's own allocations after start-up, graph instantiation,
/// cuBLASLt handles and the module images (measured well under 1 GiB on the H200; the rest is headroom).
pub const RESERVE_BYTES: usize = 1 << 30;
/// Fixed part of the workspace budget: cuBLASLt workspace, routing tables, device counters, sampler scratch.
pub const WORKSPACE_FIXED_BYTES: usize = 256 << 20;
/// Tokens per prefill chunk: the step workspace holds at least this many token rows.
pub const PREFILL_CHUNK: usize = 256;
/// Most rows of one prefill chunk ([`crate::engine::prefill`]). Every window ring is sized for a chunk this long
/// ([`LayerCachePlan::window_entries`]: `window + 1023` entries; Flash: 43 layers x 1151 x 584 B = 28.9 MB a
/// sequence, where a ring of window + 63 would hold 4.8 MB; counted in [`MemoryPlan::cache_bytes`]: +1.5 GB at
/// batch 64). Why 1024: a chunk reads every resident expert once (C x 6 picks cover nearly all of them from C ~ 256
/// on Flash), so the routed experts' bytes of a prompt fall as 1 / C, while their tensor-core work does not; at
/// 1024 rows a chunk's expert work (Flash: 13.3 TFLOP, ~25-30 ms at the prefill mainloop's measured rate) is about
/// its expert bytes' read (73 GB resident on an H100, 138 GB on an H200: 24 / 34 ms at 3.0 / 4.0 TB/s), so longer
/// chunks would save little and cost ring memory at every decode batch. The router groups at most 2,048 tokens a
/// call (`router::MAX_TOKENS`).
pub const PREFILL_CHUNK_MAX: usize = 1024;
/// K splits the MoE decode mainloop may use at most (its fp32 partials are `splits x rows x N`).
pub const MOE_MAX_SPLITS: usize = 8;

/// The format of the CSA lightning-indexer key cache (formats::indexer_key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexKeyFormat {
    /// 128 e4m3 codes + an f32 scale: 132 bytes a key.
    Fp8,
    /// 64 packed e2m1 bytes + 4 ue8m0 scales: 68 bytes a key.
    Mxfp4,
}

impl IndexKeyFormat {
    pub fn entry_bytes(self) -> usize {
        match self {
            IndexKeyFormat::Fp8 => indexer_key::FP8_ENTRY_BYTES,
            IndexKeyFormat::Mxfp4 => indexer_key::MXFP4_ENTRY_BYTES,
        }
    }
}

/// What a run asks for: `batch` sequences of up to `context` tokens each, prompts of `prompt_len` tokens, on a
/// device with `free_bytes` free.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanRequest {
    pub batch: usize,
    pub context: usize,
    pub prompt_len: usize,
    pub free_bytes: usize,
    pub index_keys: IndexKeyFormat,
    /// At most this many physical expert slots a layer (`decode --expert-slots`); `None`: as many as fit.
    pub max_expert_slots: Option<usize>,
}

impl PlanRequest {
    /// A request with FP8 indexer keys (132 B a key; the indexer kernels read both formats).
    pub fn new(batch: usize, context: usize, prompt_len: usize, free_bytes: usize) -> PlanRequest {
        PlanRequest {
            batch,
            context,
            prompt_len,
            free_bytes,
            index_keys: IndexKeyFormat::Fp8,
            max_expert_slots: None,
        }
    }
}

/// A cap on the physical expert slots a layer (`decode --expert-slots`): from the experts a token reads to every
/// routed expert.
pub fn check_expert_slots(cfg: &ModelConfig, slots: usize) -> Result<()> {
    let min = cfg.n_activated_experts.max(1);
    ensure!(
        (min..=cfg.n_routed_experts).contains(&slots),
        "--expert-slots {slots}: {} takes {min} (the experts a token reads) to {} (every routed expert)",
        cfg.name,
        cfg.n_routed_experts
    );
    Ok(())
}

/// A model geometry by the name a command takes: `flash`, `pro`, `small`, or the path of a `config.json` (a file
/// that exists, or any name ending in `.json`).
pub fn resolve_model(name: &str) -> Result<ModelConfig> {
    match name {
        "flash" | "pro" | "small" => ModelConfig::builtin(name),
        path if path.ends_with(".json") || Path::new(path).is_file() => {
            ModelConfig::from_config_json(Path::new(path))
        }
        other => bail!(
            "unknown model {other:?}: use flash, pro, small, or the path of a checkpoint's config.json"
        ),
    }
}

/// One non-expert tensor in the dense weight pool: stored bytes as in the checkpoint (FP8 codes and their UE8M0
/// scales, BF16, F32, I64), at `offset` ([`DENSE_ALIGN`]-aligned).
#[derive(Clone, Debug, PartialEq)]
pub struct DenseTensor {
    pub spec: TensorSpec,
    pub offset: usize,
}

impl DenseTensor {
    pub fn bytes(&self) -> usize {
        self.spec.nbytes()
    }
}

/// One grouped GEMM's weights per expert in moe_gemm's layout (`DeviceExpertWeights`): NVFP4 codes and e4m3
/// scales tiled per 256-row tile and 128-K stage (`prefill::tiled_bytes`), and one f32 global scale per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertGemm {
    /// Weight rows: 2 x moe_inter_dim for L1 (`[w1; w3]`, gate rows first), dim for L2 (`w2`).
    pub n: usize,
    /// Reduction length: dim for L1, moe_inter_dim for L2.
    pub k: usize,
}

impl ExpertGemm {
    /// Tiled codes + scales of one expert (= n * k / 2 + n * k / 16).
    pub fn tiled_bytes(&self) -> usize {
        prefill::tiled_bytes(1, self.n, self.k)
    }
    /// Global scales of one expert (f32 per row).
    pub fn global_bytes(&self) -> usize {
        self.n * 4
    }
    /// What one expert of this GEMM occupies and what a kernel streams for it.
    pub fn bytes(&self) -> usize {
        self.tiled_bytes() + self.global_bytes()
    }
}

/// The routed experts' device shapes of one layer (the same for every layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShapes {
    pub l1: ExpertGemm,
    pub l2: ExpertGemm,
}

impl ExpertShapes {
    /// The moe_gemm shapes of `cfg`'s experts; an error when the weights' tiling cannot hold them.
    pub fn of(cfg: &ModelConfig) -> Result<ExpertShapes> {
        let s = ExpertShapes {
            l1: ExpertGemm {
                n: 2 * cfg.moe_inter_dim,
                k: cfg.dim,
            },
            l2: ExpertGemm {
                n: cfg.dim,
                k: cfg.moe_inter_dim,
            },
        };
        for (what, g) in [("L1 (w1, w3)", s.l1), ("L2 (w2)", s.l2)] {
            prefill::check_shape(g.n, g.k).map_err(|e| {
                anyhow::anyhow!("model {}: routed expert {what} weights: {e:#}", cfg.name)
            })?;
        }
        Ok(s)
    }
    /// Device bytes of one expert (both GEMMs).
    pub fn bytes_per_expert(&self) -> usize {
        self.l1.bytes() + self.l2.bytes()
    }
}

/// Logical routed experts onto the physical slots that fit: every layer keeps `slots` physical experts. The GPU
/// holds the weights of the logical experts `first .. first + owned` (all of them on one GPU; one rank's block under
/// expert parallelism, [`crate::engine::ep::ExpertPartition::map_of`]), expert `first + i` in slot `i % slots`. When
/// the owned experts do not all fit, routing still chooses among all of them and each choice reads one full
/// expert's bytes, so the bytes read per token are those of the real model (two choices of one token that land on
/// one slot read it once: with 256 experts on 226 slots, ~1.4% of a token's layers). An expert outside the owned
/// block has no slot: the router gives its picks no row. `slots == owned == logical` is the identity (the whole
/// model resident).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertMap {
    pub logical: usize,
    pub slots: usize,
    /// The first owned logical expert.
    pub first: usize,
    /// How many logical experts, from `first`, this GPU owns.
    pub owned: usize,
}

impl ExpertMap {
    /// One GPU owning every one of `logical` experts on `slots` slots.
    pub fn all(logical: usize, slots: usize) -> ExpertMap {
        ExpertMap {
            logical,
            slots,
            first: 0,
            owned: logical,
        }
    }
    /// The physical slot logical expert `e` reads, or None when this GPU does not own `e`.
    pub fn physical(&self, e: usize) -> Option<usize> {
        (self.first..self.first + self.owned)
            .contains(&e)
            .then(|| (e - self.first) % self.slots)
    }
    /// Every logical expert's slot, `[logical]`, -1 for one not owned (what a routing kernel reads on the device).
    pub fn table(&self) -> Vec<i32> {
        (0..self.logical)
            .map(|e| self.physical(e).map_or(-1, |s| s as i32))
            .collect()
    }
    /// Whether every logical expert has its own slot.
    pub fn is_identity(&self) -> bool {
        self.owned == self.logical && self.slots >= self.logical
    }
    /// At most how many owned experts share one slot.
    pub fn experts_per_slot(&self) -> usize {
        self.owned.div_ceil(self.slots.max(1))
    }
}

impl fmt::Display for ExpertMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.owned < self.logical {
            write!(
                f,
                "expert mapping: experts {}..={} of {} per layer on this rank, {} slots (expert e reads slot (e - {}) \
                 mod {}); the rest have no slot here",
                self.first,
                self.first + self.owned - 1,
                self.logical,
                self.slots,
                self.first,
                self.slots
            )
        } else if self.is_identity() {
            write!(
                f,
                "expert mapping: all {} routed experts resident per layer (identity)",
                self.logical
            )
        } else {
            let wrapped = (self.logical - self.slots).min(self.slots);
            write!(
                f,
                "expert mapping: {} logical experts per layer on {} physical slots, expert e reads slot e mod {} \
                 (experts {}..={} wrap onto the weights of slots 0..={}); routing chooses among all {}, bytes read \
                 per token are the real model's",
                self.logical,
                self.slots,
                self.slots,
                self.slots,
                self.logical - 1,
                wrapped - 1,
                self.logical
            )
        }
    }
}

/// The caches of one layer for one sequence of `context` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerCachePlan {
    pub kind: LayerKind,
    /// The attention window: a query at position `q` attends to positions `max(0, q + 1 - window) ..= q` of the
    /// ring (`min(window_size, context)`).
    pub window: usize,
    /// Ring of 584-byte KV entries: `min(context, window_size + PREFILL_CHUNK_MAX - 1)` (position `p` in slot
    /// `p mod window_entries`). Longer than the window so that a prefill chunk of up to [`PREFILL_CHUNK_MAX`]
    /// tokens can write all its entries before its attention without overwriting a position its earliest query
    /// still reads: the chunk's last position `p0 + C - 1` shares a slot with `p0 + C - 1 - R`, which is below
    /// the earliest query's window start `p0 + 1 - window` exactly when `R >= window + C - 1`. Decode reads only
    /// the last `window` positions of the ring.
    pub window_entries: usize,
    /// Compressed 584-byte entries: `context / ratio` (0 for sliding-window layers).
    pub compressed_entries: usize,
    /// Indexer keys (CSA layers): one per compressed entry.
    pub index_keys: usize,
    /// f32 values of the main compressor's state (`CompressorState`: kv and score rows): CSA `2 x (2 ratio) x
    /// (2 head_dim)`, HCA `2 x ratio x head_dim`, 0 for sliding-window layers.
    pub compressor_floats: usize,
    /// f32 values of the indexer compressor's state (CSA): `2 x (2 ratio) x (2 index_head_dim)`.
    pub index_compressor_floats: usize,
}

impl LayerCachePlan {
    pub fn of(cfg: &ModelConfig, layer: usize, context: usize) -> LayerCachePlan {
        let kind = cfg.layer_kind(layer);
        // CompressorState::new: kv and score arrays of coff * ratio rows x coff * dim.
        let state = |ratio: usize, overlap: bool, dim: usize| {
            let coff = if overlap { 2 } else { 1 };
            2 * coff * ratio * coff * dim
        };
        let (compressed, keys, comp, icomp) = match kind {
            LayerKind::SlidingWindow => (0, 0, 0, 0),
            LayerKind::Csa { ratio } => (
                context / ratio,
                context / ratio,
                state(ratio, true, cfg.head_dim),
                state(ratio, true, cfg.index_head_dim),
            ),
            LayerKind::Hca { ratio } => (context / ratio, 0, state(ratio, false, cfg.head_dim), 0),
        };
        LayerCachePlan {
            kind,
            window: cfg.window_size.min(context),
            window_entries: ring_entries(cfg.window_size, context),
            compressed_entries: compressed,
            index_keys: keys,
            compressor_floats: comp,
            index_compressor_floats: icomp,
        }
    }

    /// Bytes per sequence.
    pub fn bytes(&self, keys: IndexKeyFormat) -> usize {
        (self.window_entries + self.compressed_entries) * kv::ENTRY_BYTES
            + self.index_keys * keys.entry_bytes()
            + (self.compressor_floats + self.index_compressor_floats) * 4
    }
}

/// The window ring length of a layer with attention window `window_size` in a context of `context` tokens
/// ([`LayerCachePlan::window_entries`]).
pub fn ring_entries(window_size: usize, context: usize) -> usize {
    (window_size + PREFILL_CHUNK_MAX - 1).min(context)
}

/// The whole memory plan (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    pub config: ModelConfig,
    pub request: PlanRequest,
    /// Every non-expert tensor, in manifest order, with its pool offset.
    pub dense: Vec<DenseTensor>,
    /// Size of the dense pool (the last tensor's end, rounded to [`DENSE_ALIGN`]).
    pub dense_bytes: usize,
    pub experts: ExpertShapes,
    pub map: ExpertMap,
    /// Per layer, per sequence.
    pub cache_layers: Vec<LayerCachePlan>,
    pub workspace_bytes: usize,
    pub reserve_bytes: usize,
}

fn gb(bytes: usize) -> f64 {
    bytes as f64 / 1e9
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Whether a manifest tensor is a routed expert's (placed by the expert plan, not the dense pool).
pub fn is_routed_expert(name: &str) -> bool {
    name.contains(".ffn.experts.")
}

impl MemoryPlan {
    /// The plan of `req` for `cfg`; errors (before any GPU work) for an empty batch or context, a context shorter
    /// than the prompt, expert shapes moe_gemm cannot tile, or caches that leave no room for the experts.
    pub fn new(cfg: &ModelConfig, req: &PlanRequest) -> Result<MemoryPlan> {
        cfg.validate()?;
        ensure!(req.batch >= 1, "batch must be at least 1");
        ensure!(req.context >= 1, "context must be at least 1 token");
        ensure!(
            req.prompt_len <= req.context,
            "the prompt ({} tokens) is longer than the context ({} tokens)",
            req.prompt_len,
            req.context
        );
        let experts = ExpertShapes::of(cfg)?;
        let mut dense = Vec::new();
        let mut end = 0usize;
        for spec in tensor_manifest(cfg) {
            if is_routed_expert(&spec.name) {
                continue;
            }
            let offset = round_up(end, DENSE_ALIGN);
            end = offset + spec.nbytes();
            dense.push(DenseTensor { spec, offset });
        }
        let cache_layers: Vec<LayerCachePlan> = (0..cfg.n_layers)
            .map(|l| LayerCachePlan::of(cfg, l, req.context))
            .collect();
        let mut plan = MemoryPlan {
            config: cfg.clone(),
            request: req.clone(),
            dense,
            dense_bytes: round_up(end, DENSE_ALIGN),
            experts,
            map: ExpertMap::all(cfg.n_routed_experts, cfg.n_routed_experts),
            cache_layers,
            workspace_bytes: workspace_budget(cfg, req),
            reserve_bytes: RESERVE_BYTES,
        };
        let fixed = plan.fixed_bytes();
        let per_slot = plan.experts.bytes_per_expert();
        let min_slots = cfg.n_activated_experts.max(1);
        if let Some(cap) = req.max_expert_slots {
            check_expert_slots(cfg, cap)?;
        }
        let min_need = fixed + plan.expert_layer_bytes(min_slots) * cfg.n_layers;
        if min_need > req.free_bytes {
            bail!(
                "batch {} x context {} does not fit: the caches need {:.2} GB; with the dense weights ({:.2} GB), \
                 the step workspace ({:.2} GB), the reserve ({:.2} GB) and the fewest routed experts a token \
                 needs ({min_slots} slots x {} layers, {:.2} GB) that is {:.2} GB, and {:.2} GB are free",
                req.batch,
                req.context,
                gb(plan.cache_bytes()),
                gb(plan.dense_bytes),
                gb(plan.workspace_bytes),
                gb(plan.reserve_bytes),
                cfg.n_layers,
                gb(plan.expert_layer_bytes(min_slots) * cfg.n_layers),
                gb(min_need),
                gb(req.free_bytes)
            );
        }
        // The largest slot count whose granule-rounded buffers fit (expert_layer_bytes is monotone in slots;
        // start from the unrounded estimate and step down past the rounding).
        let room = req.free_bytes - fixed;
        let mut slots = (room / cfg.n_layers / per_slot.max(1))
            .min(cfg.n_routed_experts)
            .min(req.max_expert_slots.unwrap_or(usize::MAX));
        while slots > min_slots && plan.expert_layer_bytes(slots) * cfg.n_layers > room {
            slots -= 1;
        }
        plan.map.slots = slots;
        Ok(plan)
    }

    /// Device bytes of one layer's expert buffers holding `slots` experts: the L1 and L2 tiled codes and their
    /// global scales, four allocations each rounded up to [`ALLOC_GRANULE`].
    pub fn expert_layer_bytes(&self, slots: usize) -> usize {
        let e = &self.experts;
        [
            e.l1.tiled_bytes(),
            e.l1.global_bytes(),
            e.l2.tiled_bytes(),
            e.l2.global_bytes(),
        ]
        .iter()
        .map(|b| round_up(b * slots, ALLOC_GRANULE))
        .sum()
    }

    /// All resident routed-expert bytes (every layer, `map.slots` slots).
    pub fn expert_bytes(&self) -> usize {
        self.expert_layer_bytes(self.map.slots) * self.config.n_layers
    }

    /// The routed-expert bytes of the real model (every logical expert): what one device would need for it all.
    pub fn full_expert_bytes(&self) -> usize {
        self.experts.bytes_per_expert() * self.map.logical * self.config.n_layers
    }

    /// Routed-expert bytes one token reads per step (top-k experts of every layer).
    pub fn routed_bytes_per_token(&self) -> usize {
        self.experts.bytes_per_expert() * self.config.n_activated_experts * self.config.n_layers
    }

    /// Cache bytes of one sequence (every layer).
    pub fn cache_bytes_per_sequence(&self) -> usize {
        self.cache_layers
            .iter()
            .map(|l| l.bytes(self.request.index_keys))
            .sum()
    }

    /// Cache bytes of the whole batch.
    pub fn cache_bytes(&self) -> usize {
        self.cache_bytes_per_sequence() * self.request.batch
    }

    /// Everything but the experts: reserve + dense pool + caches + workspace.
    pub fn fixed_bytes(&self) -> usize {
        self.reserve_bytes + self.dense_bytes + self.cache_bytes() + self.workspace_bytes
    }

    /// Everything the plan allocates or keeps free.
    pub fn total_bytes(&self) -> usize {
        self.fixed_bytes() + self.expert_bytes()
    }

    /// The dense tensor `name`.
    pub fn dense_tensor(&self, name: &str) -> Option<&DenseTensor> {
        self.dense.iter().find(|t| t.spec.name == name)
    }
}

/// The step workspace budget (what the decode and prefill steps carve from their one arena): the fixed part plus
/// `rows` token rows of the largest per-row intermediates, `rows = max(batch, min(batch * prompt_len,
/// PREFILL_CHUNK))` for the decode step, plus `min(prompt_len, PREFILL_CHUNK_MAX)` rows for the chunked prefill's
/// own state ([`crate::engine::prefill::PrefillState`], which also keeps its own launcher copies). Per row: the mHC
/// streams in and out (f32), q in f32 and BF16, the attention output (f32), the grouped o_lora output (f32), the
/// logits (f32), the MoE fp32 partials of L1 and L2 for each of the top-k rows (decode rows: at [`MOE_MAX_SPLITS`]
/// splits; prefill rows, above 64 a chunk: one split, the contiguous grouping, plus the prefill mainloop's BF16
/// pre-pass and the shared expert's g and u), and the indexer scores over the CSA entries (f32, two copies for
/// top-k); and the launchers' per-layer parameter copies ([`launcher_copy_bytes`]). The step plan checks its carves
/// against this budget.
pub fn workspace_budget(cfg: &ModelConfig, req: &PlanRequest) -> usize {
    let chunk = req.prompt_len.min(PREFILL_CHUNK_MAX);
    let rows = req
        .batch
        .max((req.batch * req.prompt_len).min(PREFILL_CHUNK));
    let copies = if chunk > 1 { 2 } else { 1 };
    let q = cfg.n_heads * cfg.head_dim;
    let (d, i) = (cfg.dim, cfg.moe_inter_dim);
    let k = cfg.n_activated_experts;
    let index = 2 * req.context / cfg.csa_ratio.max(1);
    let common = 2 * cfg.hc_dim() * 4
        + q * 6
        + q * 4
        + cfg.o_groups * cfg.o_lora_rank * 4
        + cfg.vocab_size * 4
        + index * 4;
    let moe_decode = k * MOE_MAX_SPLITS * (2 * i + d) * 4;
    let moe_prefill = k * ((2 * i).max(d) * 4 + d.max(i) * 2) + 2 * i * 2;
    let per_chunk_row = common
        + if uses_contiguous_grouping(chunk) {
            moe_prefill
        } else {
            moe_decode
        };
    WORKSPACE_FIXED_BYTES
        + rows * (common + moe_decode)
        + chunk * per_chunk_row
        + copies * launcher_copy_bytes(cfg)
}

/// Device copies of per-layer parameters in the forms the launchers take, made once when a decode state is built:
/// each layer's two mHC boundaries (`mhc::MhcWeights`: the f32 mix weights `[24, 4D]` and their three BF16 planes,
/// 960 D bytes), plus 1 MiB a layer for the smaller ones (RoPE tables, sinks, compressor `ape` and norms).
pub fn launcher_copy_bytes(cfg: &ModelConfig) -> usize {
    cfg.n_layers * (2 * 960 * cfg.dim + (1 << 20))
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.request;
        let c = &self.config;
        writeln!(
            f,
            "memory plan: model {} ({} layers), batch {} x context {} (prompt {}), {:.2} GB free",
            c.name,
            c.n_layers,
            r.batch,
            r.context,
            r.prompt_len,
            gb(r.free_bytes)
        )?;
        writeln!(
            f,
            "  dense weights   {:>9.3} GB  ({} tensors, FP8 + scales / BF16 / F32 as stored)",
            gb(self.dense_bytes),
            self.dense.len()
        )?;
        writeln!(
            f,
            "  routed experts  {:>9.3} GB  ({} slots x {} layers x {:.2} MB NVFP4; the full model needs {:.2} GB)",
            gb(self.expert_bytes()),
            self.map.slots,
            c.n_layers,
            self.experts.bytes_per_expert() as f64 / 1e6,
            gb(self.full_expert_bytes())
        )?;
        writeln!(
            f,
            "  KV caches       {:>9.3} GB  ({:.2} MB per sequence; indexer keys {:?})",
            gb(self.cache_bytes()),
            self.cache_bytes_per_sequence() as f64 / 1e6,
            r.index_keys
        )?;
        writeln!(f, "  workspace       {:>9.3} GB", gb(self.workspace_bytes))?;
        writeln!(f, "  reserve         {:>9.3} GB", gb(self.reserve_bytes))?;
        writeln!(
            f,
            "  total           {:>9.3} GB of {:.2} GB free",
            gb(self.total_bytes()),
            gb(r.free_bytes)
        )?;
        write!(f, "  {}", self.map)
    }
}

/// Whether the FFN half of `tokens` rows routes through the contiguous grouping (prefill chunks above the decode
/// step's 64 rows; engine::ffn's module docs): the memory plan and the half's buffers follow the same rule.
pub fn uses_contiguous_grouping(tokens: usize) -> bool {
    tokens > crate::ops::dense::MAX_ROWS
}
