//! Model geometry: the built-in DeepSeek-V4 Flash / Pro shapes, a small CPU-test geometry with the same
//! structure, and the reader for a real checkpoint's `config.json` (HF field names, read as is).

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// What kind of attention a layer runs, derived from its compress ratio.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Sliding window only (compress ratio 0): RoPE θ = `rope_theta`, no YaRN.
    SlidingWindow,
    /// Compressed sparse attention: ratio `m` (4 in the real models), overlapping compressor + indexer top-k.
    Csa { ratio: usize },
    /// Heavily compressed attention: ratio `m` (128 in the real models), every complete entry attended.
    Hca { ratio: usize },
}

impl LayerKind {
    /// The compress ratio `m` (0 for sliding-window-only layers).
    pub fn ratio(self) -> usize {
        match self {
            LayerKind::SlidingWindow => 0,
            LayerKind::Csa { ratio } | LayerKind::Hca { ratio } => ratio,
        }
    }
}

/// YaRN parameters from `rope_scaling` (applied in compressed layers only, see arch §3.1).
#[derive(Clone, Debug, PartialEq)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// The full geometry and hyper-parameters of a DeepSeek-V4 model. Field names follow the inference code;
/// the HF `config.json` name is given where it differs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// A label for reports ("flash", "pro", "small", or "config.json").
    pub name: String,
    pub vocab_size: usize,
    /// `hidden_size`
    pub dim: usize,
    /// `num_hidden_layers` (main layers, MTP excluded)
    pub n_layers: usize,
    /// `num_attention_heads`
    pub n_heads: usize,
    /// 512 in the real models: 448 "nope" + 64 RoPE dims (RoPE dims last).
    pub head_dim: usize,
    /// `qk_rope_head_dim`
    pub rope_head_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    /// `sliding_window`
    pub window_size: usize,
    /// One entry per main layer (0, CSA ratio or HCA ratio). MTP entries are kept in `mtp_compress_ratios`.
    pub compress_ratios: Vec<usize>,
    pub mtp_compress_ratios: Vec<usize>,
    /// The compress ratio that selects the CSA path (overlapping compressor + indexer). 4 in the real models.
    pub csa_ratio: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    /// `num_experts_per_tok`
    pub n_activated_experts: usize,
    /// `moe_intermediate_size`
    pub moe_inter_dim: usize,
    pub num_hash_layers: usize,
    /// `routed_scaling_factor`
    pub route_scale: f32,
    pub swiglu_limit: f32,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    pub yarn: Option<YarnScaling>,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    /// `rms_norm_eps`
    pub norm_eps: f32,
    /// `num_nextn_predict_layers`
    pub n_mtp_layers: usize,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
}

impl ModelConfig {
    /// DeepSeek-V4-Flash (arch doc §1.1).
    pub fn flash() -> Self {
        let mut ratios = vec![0, 0];
        for l in 2..43 {
            ratios.push(if l % 2 == 0 { 4 } else { 128 });
        }
        ModelConfig {
            name: "flash".into(),
            vocab_size: 129280,
            dim: 4096,
            n_layers: 43,
            n_heads: 64,
            head_dim: 512,
            rope_head_dim: 64,
            q_lora_rank: 1024,
            o_groups: 8,
            o_lora_rank: 1024,
            window_size: 128,
            compress_ratios: ratios,
            mtp_compress_ratios: vec![0],
            csa_ratio: 4,
            index_n_heads: 64,
            index_head_dim: 128,
            index_topk: 512,
            n_routed_experts: 256,
            n_shared_experts: 1,
            n_activated_experts: 6,
            moe_inter_dim: 2048,
            num_hash_layers: 3,
            route_scale: 1.5,
            swiglu_limit: 10.0,
            rope_theta: 10000.0,
            compress_rope_theta: 160000.0,
            yarn: Some(YarnScaling::dsv4()),
            hc_mult: 4,
            hc_sinkhorn_iters: 20,
            hc_eps: 1e-6,
            norm_eps: 1e-6,
            n_mtp_layers: 1,
            bos_token_id: 0,
            eos_token_id: 1,
        }
    }

    /// DeepSeek-V4-Pro (arch doc §1.1).
    pub fn pro() -> Self {
        let mut ratios = vec![128, 128];
        for l in 2..61 {
            ratios.push(if l % 2 == 0 { 4 } else { 128 });
        }
        ModelConfig {
            name: "pro".into(),
            dim: 7168,
            n_layers: 61,
            n_heads: 128,
            q_lora_rank: 1536,
            o_groups: 16,
            compress_ratios: ratios,
            index_topk: 1024,
            n_routed_experts: 384,
            moe_inter_dim: 3072,
            route_scale: 2.5,
            ..Self::flash()
        }
    }

    /// A small geometry with the structure of the real models, decodable in milliseconds per token on 2
    /// cores, and the smallest one every GPU kernel family accepts, so the engine's layer-by-layer parity
    /// runs on it: layers 0-1 sliding-window only, then CSA (m = 4) and HCA (m = 128) alternating; hash
    /// routing in layers 0-2; 4 mHC streams; attention sink; grouped output projection (8 groups of 8
    /// heads). Kept at the real models' values because kernels depend on them: head_dim 512 (448 + 64
    /// RoPE; FP8 tiles of 64), 64 attention heads (sparse_attn's heads per CTA), 64 indexer heads of 128
    /// (the indexer's fixed head count, the Hadamard size), the 128-token window (ring size). Sized for
    /// the kernels' tilings: dim and moe_inter_dim 512 (moe_gemm: N % 256, K % 512). HCA keeps m = 128, so
    /// HCA entries appear at t = 127, 255, ... and CSA entries every 4 tokens; `index_topk` = 8 makes the
    /// indexer actually select (more than 8 CSA entries exist after 32 tokens).
    pub fn small() -> Self {
        ModelConfig {
            name: "small".into(),
            vocab_size: 512,
            dim: 512,
            n_layers: 6,
            n_heads: 64,
            head_dim: 512,
            rope_head_dim: 64,
            q_lora_rank: 128,
            o_groups: 8,
            o_lora_rank: 128,
            window_size: 128,
            compress_ratios: vec![0, 0, 4, 128, 4, 128],
            mtp_compress_ratios: vec![0],
            csa_ratio: 4,
            index_n_heads: 64,
            index_head_dim: 128,
            index_topk: 8,
            n_routed_experts: 16,
            n_shared_experts: 1,
            n_activated_experts: 6,
            moe_inter_dim: 512,
            num_hash_layers: 3,
            route_scale: 1.5,
            swiglu_limit: 10.0,
            rope_theta: 10000.0,
            compress_rope_theta: 160000.0,
            yarn: Some(YarnScaling::dsv4()),
            hc_mult: 4,
            hc_sinkhorn_iters: 20,
            hc_eps: 1e-6,
            norm_eps: 1e-6,
            n_mtp_layers: 1,
            bos_token_id: 0,
            eos_token_id: 1,
        }
    }

    /// A built-in geometry by name: "flash", "pro" or "small".
    pub fn builtin(name: &str) -> Result<Self> {
        match name {
            "flash" => Ok(Self::flash()),
            "pro" => Ok(Self::pro()),
            "small" => Ok(Self::small()),
            other => bail!("unknown built-in model geometry {other:?} (known: flash, pro, small)"),
        }
    }

    /// Reads a real checkpoint's `config.json` (HF names). Unknown fields are ignored; a missing required
    /// field is an error naming it.
    pub fn from_config_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading model config {}", path.display()))?;
        Self::from_json_str(&text)
            .with_context(|| format!("parsing model config {}", path.display()))
    }

    /// As [`ModelConfig::from_config_json`], from the JSON text.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).context("config.json is not valid JSON")?;
        let obj = v
            .as_object()
            .ok_or_else(|| anyhow!("config.json is not a JSON object"))?;
        let get = |key: &str| -> Result<&Value> {
            obj.get(key)
                .ok_or_else(|| anyhow!("config.json: missing required field `{key}`"))
        };
        let usize_of = |key: &str| -> Result<usize> {
            let x = get(key)?;
            x.as_u64().map(|u| u as usize).ok_or_else(|| {
                anyhow!("config.json: field `{key}` must be a non-negative integer, got {x}")
            })
        };
        let f64_of = |key: &str| -> Result<f64> {
            let x = get(key)?;
            x.as_f64()
                .ok_or_else(|| anyhow!("config.json: field `{key}` must be a number, got {x}"))
        };
        let opt_usize = |key: &str, default: usize| -> Result<usize> {
            if obj.contains_key(key) {
                usize_of(key)
            } else {
                Ok(default)
            }
        };
        let opt_f64 = |key: &str, default: f64| -> Result<f64> {
            if obj.contains_key(key) {
                f64_of(key)
            } else {
                Ok(default)
            }
        };

        let n_layers = usize_of("num_hidden_layers")?;
        let n_mtp_layers = opt_usize("num_nextn_predict_layers", 0)?;
        let ratios_v = get("compress_ratios")?
            .as_array()
            .ok_or_else(|| anyhow!("config.json: `compress_ratios` must be an array"))?;
        let mut ratios = Vec::with_capacity(ratios_v.len());
        for (i, r) in ratios_v.iter().enumerate() {
            ratios.push(r.as_u64().ok_or_else(|| {
                anyhow!("config.json: compress_ratios[{i}] is not an integer: {r}")
            })? as usize);
        }
        if ratios.len() < n_layers {
            bail!(
                "config.json: compress_ratios has {} entries, fewer than num_hidden_layers = {n_layers}",
                ratios.len()
            );
        }
        let mtp_ratios = ratios.split_off(n_layers);

        let yarn = match obj.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(rs) => {
                let rs = rs
                    .as_object()
                    .ok_or_else(|| anyhow!("config.json: `rope_scaling` must be an object"))?;
                let kind = rs
                    .get("type")
                    .or_else(|| rs.get("rope_type"))
                    .and_then(|t| t.as_str());
                if kind != Some("yarn") {
                    bail!(
                        "config.json: rope_scaling type {kind:?} is not supported (only \"yarn\")"
                    );
                }
                let num = |k: &str| -> Result<f64> {
                    rs.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
                        anyhow!("config.json: rope_scaling.{k} missing or not a number")
                    })
                };
                Some(YarnScaling {
                    factor: num("factor")?,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                    beta_fast: num("beta_fast")?,
                    beta_slow: num("beta_slow")?,
                })
            }
        };
        if let Some(s) = obj.get("scoring_func").and_then(|x| x.as_str()) {
            if s != "sqrtsoftplus" {
                bail!("config.json: scoring_func {s:?} is not supported (DeepSeek-V4 uses sqrtsoftplus)");
            }
        }
        let eos = get("eos_token_id")?;
        let eos_token_id = match eos {
            Value::Array(a) => a.first().and_then(|x| x.as_u64()),
            other => other.as_u64(),
        }
        .ok_or_else(|| {
            anyhow!("config.json: eos_token_id must be an integer (or a list of them)")
        })? as u32;

        let cfg = ModelConfig {
            name: "config.json".into(),
            vocab_size: usize_of("vocab_size")?,
            dim: usize_of("hidden_size")?,
            n_layers,
            n_heads: usize_of("num_attention_heads")?,
            head_dim: usize_of("head_dim")?,
            rope_head_dim: usize_of("qk_rope_head_dim")?,
            q_lora_rank: usize_of("q_lora_rank")?,
            o_groups: usize_of("o_groups")?,
            o_lora_rank: usize_of("o_lora_rank")?,
            window_size: usize_of("sliding_window")?,
            compress_ratios: ratios,
            mtp_compress_ratios: mtp_ratios,
            csa_ratio: 4,
            index_n_heads: usize_of("index_n_heads")?,
            index_head_dim: usize_of("index_head_dim")?,
            index_topk: usize_of("index_topk")?,
            n_routed_experts: usize_of("n_routed_experts")?,
            n_shared_experts: opt_usize("n_shared_experts", 1)?,
            n_activated_experts: usize_of("num_experts_per_tok")?,
            moe_inter_dim: usize_of("moe_intermediate_size")?,
            num_hash_layers: opt_usize("num_hash_layers", 0)?,
            route_scale: opt_f64("routed_scaling_factor", 1.0)? as f32,
            swiglu_limit: opt_f64("swiglu_limit", 0.0)? as f32,
            rope_theta: f64_of("rope_theta")?,
            compress_rope_theta: opt_f64("compress_rope_theta", f64_of("rope_theta")?)?,
            yarn,
            hc_mult: usize_of("hc_mult")?,
            hc_sinkhorn_iters: usize_of("hc_sinkhorn_iters")?,
            hc_eps: f64_of("hc_eps")? as f32,
            norm_eps: f64_of("rms_norm_eps")? as f32,
            n_mtp_layers,
            bos_token_id: opt_usize("bos_token_id", 0)? as u32,
            eos_token_id,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the structural constraints the reference decode relies on; a clear error otherwise.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        let pos = |name: &str, v: usize| -> Result<()> {
            if v == 0 {
                bail!("model config {}: `{name}` must be > 0", c.name);
            }
            Ok(())
        };
        for (n, v) in [
            ("vocab_size", c.vocab_size),
            ("dim", c.dim),
            ("n_layers", c.n_layers),
            ("n_heads", c.n_heads),
            ("q_lora_rank", c.q_lora_rank),
            ("o_groups", c.o_groups),
            ("o_lora_rank", c.o_lora_rank),
            ("window_size", c.window_size),
            ("n_routed_experts", c.n_routed_experts),
            ("n_activated_experts", c.n_activated_experts),
            ("moe_inter_dim", c.moe_inter_dim),
            ("hc_mult", c.hc_mult),
            ("index_head_dim", c.index_head_dim),
        ] {
            pos(n, v)?;
        }
        if c.compress_ratios.len() != c.n_layers {
            bail!(
                "model config {}: {} compress ratios for {} layers",
                c.name,
                c.compress_ratios.len(),
                c.n_layers
            );
        }
        if c.rope_head_dim == 0
            || !c.rope_head_dim.is_multiple_of(2)
            || c.rope_head_dim > c.head_dim
        {
            bail!(
                "model config {}: rope_head_dim {} must be even and <= head_dim {}",
                c.name,
                c.rope_head_dim,
                c.head_dim
            );
        }
        if c.rope_head_dim > c.index_head_dim {
            bail!(
                "model config {}: index_head_dim {} < rope_head_dim {}",
                c.name,
                c.index_head_dim,
                c.rope_head_dim
            );
        }
        if !c.n_heads.is_multiple_of(c.o_groups) {
            bail!(
                "model config {}: n_heads {} not divisible by o_groups {}",
                c.name,
                c.n_heads,
                c.o_groups
            );
        }
        // FP8 sim of the KV nope part is per 64 channels; the Hadamard needs a power of two.
        if !(c.head_dim - c.rope_head_dim).is_multiple_of(64) {
            bail!(
                "model config {}: nope dims {} not a multiple of 64",
                c.name,
                c.head_dim - c.rope_head_dim
            );
        }
        // Activations are FP8-quantized per 128 channels at every FP8/FP4 linear input.
        for (n, v) in [
            ("dim", c.dim),
            ("q_lora_rank", c.q_lora_rank),
            ("moe_inter_dim", c.moe_inter_dim),
            ("o_groups * o_lora_rank", c.o_groups * c.o_lora_rank),
            ("head_dim", c.head_dim),
        ] {
            if !v.is_multiple_of(128) {
                bail!(
                    "model config {}: {n} = {v} is not a multiple of 128 (FP8 activation blocks)",
                    c.name
                );
            }
        }
        if !c.index_head_dim.is_power_of_two() || !c.index_head_dim.is_multiple_of(32) {
            bail!(
                "model config {}: index_head_dim {} must be a power of two >= 32",
                c.name,
                c.index_head_dim
            );
        }
        if c.n_activated_experts > c.n_routed_experts {
            bail!(
                "model config {}: num_experts_per_tok {} > n_routed_experts {}",
                c.name,
                c.n_activated_experts,
                c.n_routed_experts
            );
        }
        if c.n_shared_experts > 1 {
            bail!(
                "model config {}: n_shared_experts {} unsupported (1 or 0)",
                c.name,
                c.n_shared_experts
            );
        }
        for (l, &m) in c.compress_ratios.iter().enumerate() {
            if m != 0 && m < 2 {
                bail!(
                    "model config {}: layer {l} compress ratio {m} unsupported",
                    c.name
                );
            }
        }
        if c.hc_sinkhorn_iters == 0 {
            bail!("model config {}: hc_sinkhorn_iters must be >= 1", c.name);
        }
        Ok(())
    }

    /// The attention kind of main layer `layer`.
    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        match self.compress_ratios[layer] {
            0 => LayerKind::SlidingWindow,
            m if m == self.csa_ratio => LayerKind::Csa { ratio: m },
            m => LayerKind::Hca { ratio: m },
        }
    }

    /// Whether layer `layer` routes by token id (`tid2eid`) rather than by scores.
    pub fn is_hash_layer(&self, layer: usize) -> bool {
        layer < self.num_hash_layers
    }

    /// 448 in the real models: the head dims that carry no RoPE.
    pub fn nope_dim(&self) -> usize {
        self.head_dim - self.rope_head_dim
    }

    /// Heads per output-projection group (8 in the real models).
    pub fn heads_per_group(&self) -> usize {
        self.n_heads / self.o_groups
    }

    /// Width of the 4 mHC streams flattened: hc_mult * dim.
    pub fn hc_dim(&self) -> usize {
        self.hc_mult * self.dim
    }

    /// Rows of the mHC mixing matrix: (2 + hc_mult) * hc_mult (24 for 4 streams).
    pub fn hc_mix_rows(&self) -> usize {
        (2 + self.hc_mult) * self.hc_mult
    }
}

impl YarnScaling {
    /// The DeepSeek-V4 `rope_scaling`: factor 16, original 65536, beta 32 / 1.
    pub fn dsv4() -> Self {
        YarnScaling {
            factor: 16.0,
            original_max_position_embeddings: 65536.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }
    }
}
