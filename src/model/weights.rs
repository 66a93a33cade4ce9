//! Weights: the tensor manifest of a geometry (official names, dtypes, shapes; arch §5), the synthetic
//! source (every stored byte a pure function of (seed, tensor name, element index)), and the `Weights`
//! facade the reference decode reads through (dequantization, optional caching, lazy experts).

use super::codecs::{e2m1, e4m3, ue8m0};
use super::config::{LayerKind, ModelConfig};
use super::numerics::{bf16_round, dot, par_map};
use anyhow::{anyhow, bail, Context, Result};
use half::bf16;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Storage dtypes of the official checkpoint (safetensors names in `Display`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    BF16,
    F32,
    /// FP8 e4m3 weight codes (companion `.scale` tensor holds 128x128 UE8M0 block scales).
    F8E4M3,
    /// UE8M0 scale bytes.
    F8E8M0,
    /// Packed e2m1 pairs (low nibble = even element along K); companion `.scale` = UE8M0 per 32.
    I8,
    I64,
}

impl StoredDtype {
    /// Bytes per stored element (an I8 element is a byte holding two e2m1 values).
    pub fn size(self) -> usize {
        match self {
            StoredDtype::BF16 => 2,
            StoredDtype::F32 => 4,
            StoredDtype::F8E4M3 | StoredDtype::F8E8M0 | StoredDtype::I8 => 1,
            StoredDtype::I64 => 8,
        }
    }

    /// The safetensors dtype string.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            StoredDtype::BF16 => "BF16",
            StoredDtype::F32 => "F32",
            StoredDtype::F8E4M3 => "F8_E4M3",
            StoredDtype::F8E8M0 => "F8_E8M0",
            StoredDtype::I8 => "I8",
            StoredDtype::I64 => "I64",
        }
    }
}

/// How the synthetic source fills a tensor. All draws use u ∈ (-1, 1) from [`synthetic_uniform`].
#[derive(Clone, Debug, PartialEq)]
pub enum SyntheticInit {
    /// value = offset + amp * u (rounded to the stored dtype, BF16 or F32).
    Uniform { amp: f32, offset: f32 },
    /// FP8 codes drawn uniformly over the 256 byte values, the two NaN codes 0x7F / 0xFF replaced by
    /// ±448 (0x7E / 0xFE): code = fp8_code(bits >> 56). No float rounding involved, so a GPU fill is a
    /// hash and a byte store. The scale tensor sets the magnitude.
    Fp8Codes,
    /// FP4 codes uniformly over the 16 nibbles: byte = (bits >> 56) as u8 (two e2m1 codes).
    Fp4Codes,
    /// UE8M0 scale bytes: 2^(exp_base - (h & 1)), i.e. half the blocks at half the scale.
    Scale { exp_base: i32 },
    /// mHC base vector: pre/post entries amp*u, Sinkhorn logits `diag` on the diagonal plus amp*u.
    HcBase { hc: usize, amp: f32, diag: f32 },
    /// tid2eid [V, k]: row r holds (h(r) + c * (E / k)) mod E for c < k: k distinct experts.
    Tid2eid { n_experts: usize },
}

/// One tensor of the checkpoint: official name, dtype, shape, and how the synthetic source fills it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: StoredDtype,
    pub shape: Vec<usize>,
    pub init: SyntheticInit,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

/// The element standard deviation a synthetic linear targets: gain / sqrt(fan_in), so that a unit-RMS
/// input gives a unit-RMS output.
fn linear_std(fan_in: usize) -> f32 {
    1.0 / (fan_in as f32).sqrt()
}

/// The FP8 code of a synthetic byte: NaN codes become ±448.
#[inline]
pub fn fp8_code(byte: u8) -> u8 {
    if byte & 0x7F == 0x7F {
        byte ^ 1
    } else {
        byte
    }
}

/// Root-mean-square value of a code drawn uniformly over all 256 bytes (FP8: via [`fp8_code`]) or all
/// 16 nibbles (FP4).
fn code_rms(fp8: bool) -> f32 {
    let ms: f64 = if fp8 {
        (0..=255u8)
            .map(|b| (e4m3::decode(fp8_code(b)) as f64).powi(2))
            .sum::<f64>()
            / 256.0
    } else {
        (0..16u8)
            .map(|c| (e2m1::decode(c) as f64).powi(2))
            .sum::<f64>()
            / 16.0
    };
    ms.sqrt() as f32
}

/// Scale exponent making the synthetic codes (RMS [`code_rms`]) have standard deviation ≈ `std`.
fn scale_exp_for(std: f32, fp8: bool) -> i32 {
    // The hashed block scales are 2^e or 2^(e-1) with equal odds: their root-mean-square is
    // 2^e * sqrt(5/8) = 2^(e - 0.34), hence the +0.34 before rounding (std lands within 2^±0.5 of target).
    ((std / code_rms(fp8)).log2() + 0.34).round() as i32
}

/// The complete tensor list of a geometry (main layers; MTP tensors are not part of the reference).
pub fn tensor_manifest(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    let d = cfg.dim;
    let bf16_vec = |name: String, n: usize, amp: f32, offset: f32| TensorSpec {
        name,
        dtype: StoredDtype::BF16,
        shape: vec![n],
        init: SyntheticInit::Uniform { amp, offset },
    };
    let f32_t = |name: String, shape: Vec<usize>, amp: f32, offset: f32| TensorSpec {
        name,
        dtype: StoredDtype::F32,
        shape,
        init: SyntheticInit::Uniform { amp, offset },
    };
    let bf16_mat = |name: String, rows: usize, cols: usize| TensorSpec {
        name,
        dtype: StoredDtype::BF16,
        shape: vec![rows, cols],
        init: SyntheticInit::Uniform {
            amp: linear_std(cols) * 3f32.sqrt(),
            offset: 0.0,
        },
    };
    let fp8_mat = |out: &mut Vec<TensorSpec>, prefix: String, rows: usize, cols: usize| {
        out.push(TensorSpec {
            name: format!("{prefix}.weight"),
            dtype: StoredDtype::F8E4M3,
            shape: vec![rows, cols],
            init: SyntheticInit::Fp8Codes,
        });
        out.push(TensorSpec {
            name: format!("{prefix}.scale"),
            dtype: StoredDtype::F8E8M0,
            shape: vec![rows.div_ceil(128), cols.div_ceil(128)],
            init: SyntheticInit::Scale {
                exp_base: scale_exp_for(linear_std(cols), true),
            },
        });
    };
    let fp4_mat = |out: &mut Vec<TensorSpec>, prefix: String, rows: usize, cols: usize| {
        out.push(TensorSpec {
            name: format!("{prefix}.weight"),
            dtype: StoredDtype::I8,
            shape: vec![rows, cols / 2],
            init: SyntheticInit::Fp4Codes,
        });
        out.push(TensorSpec {
            name: format!("{prefix}.scale"),
            dtype: StoredDtype::F8E8M0,
            shape: vec![rows, cols / 32],
            init: SyntheticInit::Scale {
                exp_base: scale_exp_for(linear_std(cols), false),
            },
        });
    };

    // Embedding rows have unit RMS so the first layer sees the same scale as later ones.
    out.push(TensorSpec {
        name: "embed.weight".into(),
        dtype: StoredDtype::BF16,
        shape: vec![cfg.vocab_size, d],
        init: SyntheticInit::Uniform {
            amp: 3f32.sqrt(),
            offset: 0.0,
        },
    });
    let hc = cfg.hc_mult;
    let hcd = cfg.hc_dim();
    let mix = cfg.hc_mix_rows();
    for l in 0..cfg.n_layers {
        let p = format!("layers.{l}");
        out.push(bf16_vec(format!("{p}.attn_norm.weight"), d, 0.1, 1.0));
        out.push(bf16_vec(format!("{p}.ffn_norm.weight"), d, 0.1, 1.0));
        for which in ["attn", "ffn"] {
            // F · x̃ with x̃ of unit RMS: entries of std 1/sqrt(4D) give mixes of std ~1.
            out.push(f32_t(
                format!("{p}.hc_{which}_fn"),
                vec![mix, hcd],
                linear_std(hcd) * 3f32.sqrt(),
                0.0,
            ));
            out.push(TensorSpec {
                name: format!("{p}.hc_{which}_base"),
                dtype: StoredDtype::F32,
                shape: vec![mix],
                init: SyntheticInit::HcBase {
                    hc,
                    amp: 0.2,
                    diag: 1.0,
                },
            });
            out.push(f32_t(format!("{p}.hc_{which}_scale"), vec![3], 0.2, 0.5));
        }
        let hd = cfg.head_dim;
        let a = format!("{p}.attn");
        fp8_mat(&mut out, format!("{a}.wq_a"), cfg.q_lora_rank, d);
        out.push(bf16_vec(
            format!("{a}.q_norm.weight"),
            cfg.q_lora_rank,
            0.1,
            1.0,
        ));
        fp8_mat(
            &mut out,
            format!("{a}.wq_b"),
            cfg.n_heads * hd,
            cfg.q_lora_rank,
        );
        fp8_mat(&mut out, format!("{a}.wkv"), hd, d);
        out.push(bf16_vec(format!("{a}.kv_norm.weight"), hd, 0.1, 1.0));
        fp8_mat(
            &mut out,
            format!("{a}.wo_a"),
            cfg.o_groups * cfg.o_lora_rank,
            cfg.heads_per_group() * hd,
        );
        fp8_mat(
            &mut out,
            format!("{a}.wo_b"),
            d,
            cfg.o_groups * cfg.o_lora_rank,
        );
        out.push(f32_t(format!("{a}.attn_sink"), vec![cfg.n_heads], 1.0, 0.0));
        let kind = cfg.layer_kind(l);
        let m = kind.ratio();
        if m > 0 {
            let coff = if matches!(kind, LayerKind::Csa { .. }) {
                2
            } else {
                1
            };
            let c = format!("{a}.compressor");
            out.push(bf16_mat(format!("{c}.wkv.weight"), coff * hd, d));
            out.push(bf16_mat(format!("{c}.wgate.weight"), coff * hd, d));
            out.push(f32_t(format!("{c}.ape"), vec![m, coff * hd], 0.5, 0.0));
            out.push(bf16_vec(format!("{c}.norm.weight"), hd, 0.1, 1.0));
        }
        if matches!(kind, LayerKind::Csa { .. }) {
            let ix = format!("{a}.indexer");
            let di = cfg.index_head_dim;
            fp8_mat(
                &mut out,
                format!("{ix}.wq_b"),
                cfg.index_n_heads * di,
                cfg.q_lora_rank,
            );
            out.push(bf16_mat(
                format!("{ix}.weights_proj.weight"),
                cfg.index_n_heads,
                d,
            ));
            out.push(bf16_mat(format!("{ix}.compressor.wkv.weight"), 2 * di, d));
            out.push(bf16_mat(format!("{ix}.compressor.wgate.weight"), 2 * di, d));
            out.push(f32_t(
                format!("{ix}.compressor.ape"),
                vec![m, 2 * di],
                0.5,
                0.0,
            ));
            out.push(bf16_vec(
                format!("{ix}.compressor.norm.weight"),
                di,
                0.1,
                1.0,
            ));
        }
        let f = format!("{p}.ffn");
        out.push(bf16_mat(
            format!("{f}.gate.weight"),
            cfg.n_routed_experts,
            d,
        ));
        if cfg.is_hash_layer(l) {
            out.push(TensorSpec {
                name: format!("{f}.gate.tid2eid"),
                dtype: StoredDtype::I64,
                shape: vec![cfg.vocab_size, cfg.n_activated_experts],
                init: SyntheticInit::Tid2eid {
                    n_experts: cfg.n_routed_experts,
                },
            });
        } else {
            out.push(f32_t(
                format!("{f}.gate.bias"),
                vec![cfg.n_routed_experts],
                0.1,
                0.0,
            ));
        }
        let inter = cfg.moe_inter_dim;
        for e in 0..cfg.n_routed_experts {
            fp4_mat(&mut out, format!("{f}.experts.{e}.w1"), inter, d);
            fp4_mat(&mut out, format!("{f}.experts.{e}.w2"), d, inter);
            fp4_mat(&mut out, format!("{f}.experts.{e}.w3"), inter, d);
        }
        if cfg.n_shared_experts > 0 {
            fp8_mat(&mut out, format!("{f}.shared_experts.w1"), inter, d);
            fp8_mat(&mut out, format!("{f}.shared_experts.w2"), d, inter);
            fp8_mat(&mut out, format!("{f}.shared_experts.w3"), inter, d);
        }
    }
    out.push(bf16_vec("norm.weight".into(), d, 0.1, 1.0));
    out.push(bf16_mat("head.weight".into(), cfg.vocab_size, d));
    out.push(f32_t(
        "hc_head_fn".into(),
        vec![hc, hcd],
        linear_std(hcd) * 3f32.sqrt(),
        0.0,
    ));
    out.push(f32_t("hc_head_base".into(), vec![hc], 0.2, 0.0));
    out.push(f32_t("hc_head_scale".into(), vec![1], 0.2, 0.5));
    out
}

// ---------------------------------------------------------------------------------------------------
// Synthetic source: the hash.

/// SplitMix64 finalizer (a bijection on u64 with full avalanche).
#[inline]
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a 64-bit of the tensor name's UTF-8 bytes.
pub fn fnv1a64(s: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for &b in s.as_bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// The per-tensor key: splitmix64(seed ^ fnv1a64(name)).
pub fn tensor_key(seed: u64, name: &str) -> u64 {
    splitmix64(seed ^ fnv1a64(name))
}

/// The 64 random bits of element `index` of a tensor: splitmix64(key + index * golden). GPU recipe: two
/// 64-bit multiplies, shifts and xors per element.
#[inline]
pub fn element_bits(key: u64, index: u64) -> u64 {
    splitmix64(key.wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
}

/// Uniform in (-1, 1) from the top 24 bits: ((bits >> 40) + 0.5) / 2^23 - 1, exact in f32.
#[inline]
pub fn synthetic_uniform(bits: u64) -> f32 {
    ((bits >> 40) as f32 + 0.5) / 8_388_608.0 - 1.0
}

/// The stored bytes of elements [first, first + count) of a synthetic tensor, little-endian.
pub fn synthetic_bytes(seed: u64, spec: &TensorSpec, first: usize, count: usize) -> Vec<u8> {
    let key = tensor_key(seed, &spec.name);
    let range = first as u64..(first + count) as u64;
    // Fast paths for the bulk formats (same values as the general loop below would give).
    match (&spec.init, spec.dtype) {
        (SyntheticInit::Fp8Codes, StoredDtype::F8E4M3) => {
            return range
                .map(|i| fp8_code((element_bits(key, i) >> 56) as u8))
                .collect()
        }
        (SyntheticInit::Fp4Codes, StoredDtype::I8) => {
            return range.map(|i| (element_bits(key, i) >> 56) as u8).collect()
        }
        _ => {}
    }
    let mut out = Vec::with_capacity(count * spec.dtype.size());
    for i in first..first + count {
        let bits = element_bits(key, i as u64);
        match (&spec.init, spec.dtype) {
            (SyntheticInit::Uniform { amp, offset }, StoredDtype::BF16) => out.extend_from_slice(
                &bf16::from_f32(offset + amp * synthetic_uniform(bits)).to_le_bytes(),
            ),
            (SyntheticInit::Uniform { amp, offset }, StoredDtype::F32) => {
                out.extend_from_slice(&(offset + amp * synthetic_uniform(bits)).to_le_bytes())
            }
            (SyntheticInit::HcBase { hc, amp, diag }, StoredDtype::F32) => {
                let mut v = amp * synthetic_uniform(bits);
                if i >= 2 * hc {
                    let r = i - 2 * hc;
                    if r / hc == r % hc {
                        v += diag;
                    }
                }
                out.extend_from_slice(&v.to_le_bytes())
            }
            (SyntheticInit::Scale { exp_base }, StoredDtype::F8E8M0) => {
                let e = exp_base - (bits & 1) as i32;
                out.push((e.clamp(-127, 127) + 127) as u8)
            }
            (SyntheticInit::Tid2eid { n_experts }, StoredDtype::I64) => {
                let k = spec.shape[1];
                let (row, col) = (i / k, i % k);
                let row_bits = element_bits(key, (row * k) as u64);
                let step = (n_experts / k).max(1);
                let e = ((row_bits % *n_experts as u64) as usize + col * step) % n_experts;
                out.extend_from_slice(&(e as i64).to_le_bytes())
            }
            (init, dt) => panic!(
                "synthetic init {init:?} does not apply to dtype {dt:?} ({})",
                spec.name
            ),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------------
// Sources and the Weights facade.

/// Where stored tensor bytes come from: synthetic generation or a memory-mapped checkpoint.
pub trait TensorSource: Send + Sync {
    /// Bytes of elements [first, first + count) of the tensor `spec` (already validated against the
    /// manifest), in the stored little-endian layout.
    fn read_elements(&self, spec: &TensorSpec, first: usize, count: usize)
        -> Result<Cow<'_, [u8]>>;
    /// A short description for reports.
    fn describe(&self) -> String;
}

/// The synthetic source (see [`synthetic_bytes`]).
pub struct SyntheticSource {
    pub seed: u64,
}

impl TensorSource for SyntheticSource {
    fn read_elements(
        &self,
        spec: &TensorSpec,
        first: usize,
        count: usize,
    ) -> Result<Cow<'_, [u8]>> {
        if first + count > spec.numel() {
            bail!(
                "{}: element range {first}+{count} beyond {} elements",
                spec.name,
                spec.numel()
            );
        }
        Ok(Cow::Owned(synthetic_bytes(self.seed, spec, first, count)))
    }
    fn describe(&self) -> String {
        format!("synthetic weights, seed {}", self.seed)
    }
}

/// A dequantized row-major matrix (f32 values exactly equal to the stored quantized values).
#[derive(Clone, Debug)]
pub struct DenseMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl DenseMatrix {
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// Which tensors the facade keeps dequantized in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachePolicy {
    /// Everything (small geometries).
    All,
    /// Everything except routed experts and the embedding/head (large geometries on a big host).
    DenseOnly,
    /// Nothing: every use regenerates/re-reads and dequantizes (lowest memory).
    Nothing,
}

/// The model's weights as the reference reads them: names resolved against the manifest, values
/// dequantized on demand (FP8 x 128x128 scale, MXFP4 x per-32 scale, BF16, F32), cached per policy.
pub struct Weights {
    pub config: ModelConfig,
    specs: HashMap<String, TensorSpec>,
    source: Box<dyn TensorSource>,
    policy: CachePolicy,
    cache: Mutex<HashMap<String, Arc<DenseMatrix>>>,
}

impl Weights {
    /// Wraps a source; the config is validated and the manifest built.
    pub fn new(
        config: ModelConfig,
        source: Box<dyn TensorSource>,
        policy: CachePolicy,
    ) -> Result<Self> {
        config.validate()?;
        let specs = tensor_manifest(&config)
            .into_iter()
            .map(|s| (s.name.clone(), s))
            .collect();
        Ok(Weights {
            config,
            specs,
            source,
            policy,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Synthetic weights for `config` with `seed`.
    pub fn synthetic(config: ModelConfig, seed: u64, policy: CachePolicy) -> Result<Self> {
        Self::new(config, Box::new(SyntheticSource { seed }), policy)
    }

    pub fn describe(&self) -> String {
        format!("{} ({})", self.source.describe(), self.config.name)
    }

    pub fn spec(&self, name: &str) -> Result<&TensorSpec> {
        self.specs.get(name).ok_or_else(|| {
            anyhow!(
                "tensor `{name}` is not part of the {} manifest",
                self.config.name
            )
        })
    }

    /// Raw stored bytes of a whole tensor.
    pub fn raw(&self, name: &str) -> Result<Vec<u8>> {
        let spec = self.spec(name)?;
        Ok(self
            .source
            .read_elements(spec, 0, spec.numel())?
            .into_owned())
    }

    /// A BF16 or F32 vector (any shape, flattened) as f32.
    pub fn vector(&self, name: &str) -> Result<Vec<f32>> {
        let spec = self.spec(name)?;
        let bytes = self.source.read_elements(spec, 0, spec.numel())?;
        decode_plain(spec, &bytes)
    }

    /// Row `row` of a 2-D I64 tensor (tid2eid) as expert indices, each checked against `bound`.
    pub fn i64_row(&self, name: &str, row: usize, bound: usize) -> Result<Vec<usize>> {
        let spec = self.spec(name)?;
        if spec.dtype != StoredDtype::I64 || spec.shape.len() != 2 || row >= spec.shape[0] {
            bail!("{name}: not an I64 matrix with row {row}");
        }
        let k = spec.shape[1];
        let bytes = self.source.read_elements(spec, row * k, k)?;
        bytes
            .chunks_exact(8)
            .map(|c| {
                let v = i64::from_le_bytes(c.try_into().expect("8 bytes"));
                if v < 0 || v as usize >= bound {
                    bail!("{name}[{row}] holds {v}, outside 0..{bound}");
                }
                Ok(v as usize)
            })
            .collect()
    }

    /// Dequantized rows [r0, r0 + n) of a 2-D weight named `name` (for FP8 / FP4 weights: the `.weight`
    /// tensor; its `.scale` companion is found by name).
    pub fn dequant_rows(&self, name: &str, r0: usize, n: usize) -> Result<DenseMatrix> {
        let spec = self.spec(name)?;
        if spec.shape.len() != 2 {
            bail!("{name}: expected a matrix, shape {:?}", spec.shape);
        }
        let (rows, stored_cols) = (spec.shape[0], spec.shape[1]);
        if r0 + n > rows {
            bail!("{name}: rows {r0}..{} beyond {rows}", r0 + n);
        }
        let bytes = self
            .source
            .read_elements(spec, r0 * stored_cols, n * stored_cols)?;
        match spec.dtype {
            StoredDtype::BF16 | StoredDtype::F32 => Ok(DenseMatrix {
                rows: n,
                cols: stored_cols,
                data: decode_plain(spec, &bytes)?,
            }),
            StoredDtype::F8E4M3 => {
                let cols = stored_cols;
                let sname = scale_name(name)?;
                let sspec = self.spec(&sname)?;
                let scols = sspec.shape[1];
                let br0 = r0 / 128;
                let br1 = (r0 + n).div_ceil(128);
                let sbytes = self
                    .source
                    .read_elements(sspec, br0 * scols, (br1 - br0) * scols)?;
                let lut = E4M3_LUT.get_or_init(e4m3_table);
                let mut data = vec![0f32; n * cols];
                for r in 0..n {
                    let srow = &sbytes[((r0 + r) / 128 - br0) * scols..][..scols];
                    for c in 0..cols {
                        data[r * cols + c] =
                            lut[bytes[r * cols + c] as usize] * ue8m0::decode(srow[c / 128]);
                    }
                }
                Ok(DenseMatrix {
                    rows: n,
                    cols,
                    data,
                })
            }
            StoredDtype::I8 => {
                let cols = stored_cols * 2;
                let sname = scale_name(name)?;
                let sspec = self.spec(&sname)?;
                let scols = sspec.shape[1];
                let sbytes = self.source.read_elements(sspec, r0 * scols, n * scols)?;
                let mut data = vec![0f32; n * cols];
                for r in 0..n {
                    for pc in 0..stored_cols {
                        let b = bytes[r * stored_cols + pc];
                        let s = ue8m0::decode(sbytes[r * scols + (2 * pc) / 32]);
                        // Low nibble = element 2i along K, high nibble = element 2i+1 (arch §5.1).
                        data[r * cols + 2 * pc] = e2m1::decode(b & 0xF) * s;
                        data[r * cols + 2 * pc + 1] = e2m1::decode(b >> 4) * s;
                    }
                }
                Ok(DenseMatrix {
                    rows: n,
                    cols,
                    data,
                })
            }
            dt => bail!("{name}: dtype {dt:?} is not a matrix weight"),
        }
    }

    /// The whole dequantized matrix, from the cache when the policy keeps it.
    pub fn matrix(&self, name: &str) -> Result<Arc<DenseMatrix>> {
        if let Some(m) = self.cache.lock().expect("cache lock").get(name) {
            return Ok(m.clone());
        }
        let spec = self.spec(name)?;
        let rows = spec.shape[0];
        // Dequantize in parallel row chunks.
        let chunk = 256usize;
        let nchunks = rows.div_ceil(chunk);
        let parts = par_map(nchunks, |i| {
            self.dequant_rows(name, i * chunk, chunk.min(rows - i * chunk))
        });
        let mut data = Vec::new();
        let mut cols = 0;
        for p in parts {
            let p = p?;
            cols = p.cols;
            data.extend_from_slice(&p.data);
        }
        let m = Arc::new(DenseMatrix { rows, cols, data });
        if self.keeps(name) {
            self.cache
                .lock()
                .expect("cache lock")
                .insert(name.to_string(), m.clone());
        }
        Ok(m)
    }

    fn keeps(&self, name: &str) -> bool {
        match self.policy {
            CachePolicy::All => true,
            CachePolicy::DenseOnly => {
                !(name.contains(".experts.") || name == "embed.weight" || name == "head.weight")
            }
            CachePolicy::Nothing => false,
        }
    }

    /// y = W x with W the dequantized matrix `name` and f32 accumulation; rows split over threads. Large
    /// uncached matrices are streamed in row chunks (never fully materialized).
    pub fn matvec(&self, name: &str, x: &[f32]) -> Result<Vec<f32>> {
        let rows = self.spec(name)?.shape[0];
        self.matvec_rows(name, 0, rows, x)
    }

    /// Rows [r0, r0 + n) of W times x (the grouped output projection uses one row range per group).
    pub fn matvec_rows(&self, name: &str, r0: usize, n: usize, x: &[f32]) -> Result<Vec<f32>> {
        let rows = self.spec(name)?.shape[0];
        if r0 + n > rows {
            bail!("{name}: rows {r0}..{} beyond {rows}", r0 + n);
        }
        let cached = self.cache.lock().expect("cache lock").get(name).cloned();
        let m = match cached {
            Some(m) => Some(m),
            None if self.keeps(name) => Some(self.matrix(name)?),
            None => None,
        };
        let chunk = 64usize;
        if let Some(m) = m {
            if m.cols != x.len() {
                bail!(
                    "{name}: matvec with {} inputs, matrix has {} columns",
                    x.len(),
                    m.cols
                );
            }
            let parts = par_map(n.div_ceil(chunk), |i| {
                (r0 + i * chunk..r0 + ((i + 1) * chunk).min(n))
                    .map(|r| dot(m.row(r), x))
                    .collect::<Vec<f32>>()
            });
            return Ok(parts.concat());
        }
        let parts = par_map(n.div_ceil(chunk), |i| -> Result<Vec<f32>> {
            let a = r0 + i * chunk;
            let blk = self.dequant_rows(name, a, chunk.min(r0 + n - a))?;
            if blk.cols != x.len() {
                bail!(
                    "{name}: matvec with {} inputs, matrix has {} columns",
                    x.len(),
                    blk.cols
                );
            }
            Ok((0..blk.rows).map(|r| dot(blk.row(r), x)).collect())
        });
        let mut y = Vec::with_capacity(n);
        for p in parts {
            y.extend(p?);
        }
        Ok(y)
    }

    /// One embedding row as f32 (BF16 values).
    pub fn embedding_row(&self, token: u32) -> Result<Vec<f32>> {
        let t = token as usize;
        if t >= self.config.vocab_size {
            bail!(
                "token id {token} outside the vocabulary (0..{})",
                self.config.vocab_size
            );
        }
        Ok(self.dequant_rows("embed.weight", t, 1)?.data)
    }
}

static E4M3_LUT: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();

/// All 256 e4m3 values (decode through a table: the hot loop of dequantization).
fn e4m3_table() -> [f32; 256] {
    std::array::from_fn(|b| e4m3::decode(b as u8))
}

/// `prefix.weight` -> `prefix.scale`.
fn scale_name(weight: &str) -> Result<String> {
    weight
        .strip_suffix(".weight")
        .map(|p| format!("{p}.scale"))
        .ok_or_else(|| anyhow!("{weight}: quantized weight names end with `.weight`"))
}

/// Decodes BF16 / F32 bytes to f32.
fn decode_plain(spec: &TensorSpec, bytes: &[u8]) -> Result<Vec<f32>> {
    match spec.dtype {
        StoredDtype::BF16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()),
        StoredDtype::F32 => Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()),
        dt => Err(anyhow!(
            "{}: dtype {dt:?} is not a plain float tensor",
            spec.name
        )),
    }
    .context("decoding tensor")
}

/// The value a BF16 synthetic element has (used by tests to check the generator independent of I/O).
pub fn synthetic_bf16_value(seed: u64, name: &str, index: u64, amp: f32, offset: f32) -> f32 {
    bf16_round(offset + amp * synthetic_uniform(element_bits(tensor_key(seed, name), index)))
}
