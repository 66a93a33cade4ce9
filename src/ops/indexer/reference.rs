//! CPU reference for the lightning indexer (DSV4 §3.8), written for clarity.
//!
//! * Key writer: 128-point Walsh–Hadamard (Sylvester / natural order, scaled by 1/sqrt(128) in f32), then
//!   one of the two index-key formats (FP8 e4m3 + fp32 scale, 132 B; MXFP4, 68 B). The butterfly order and
//!   every rounding point are the ones the GPU writer uses, so GPU and CPU agree bit for bit.
//! * Logits: `score[row, j] = scale_terms(k_j) . sum_h w[row,h] * relu(q[row,h] . k_j)` in f64 over the
//!   stored (quantized) values; rounded once to f32 at the end.
//! * Top-k: the total order "score descending, index ascending" over the canonical scores
//!   (NaN -> -inf, -0 -> +0), exactly `min(k, num_valid)` indices then `-1` padding.
//!
//! The single-entry codecs are `formats::indexer_key` (132 B / 68 B entries); the cache stores each entry's
//! codes and its 4 scale bytes in two planes (same bytes, split) so the GPU's 16-byte loads stay aligned.

use anyhow::{bail, Result};

use crate::formats::{e2m1, e4m3, indexer_key, ue8m0};

/// Dimension of one index key / query head.
pub const HEAD_DIM: usize = 128;
/// Query heads of the DSV4 indexer.
pub const NUM_HEADS: usize = 64;
/// FP8 entry: 128 e4m3 codes + one fp32 scale.
pub const FP8_CODE_BYTES: usize = 128;
/// MXFP4 entry: 128 e2m1 codes, two per byte (lower dim in the low nibble) + 4 ue8m0 scales (one per 32).
pub const MXFP4_CODE_BYTES: usize = 64;
/// Both formats carry 4 scale bytes per entry (fp32 little-endian, or 4 ue8m0 codes).
pub const SCALE_BYTES: usize = 4;
/// MXFP4 block length along the head dim.
pub const MXFP4_BLOCK: usize = 32;
/// 1/sqrt(128) rounded to f32 (bits 0x3DB504F3). The GPU uses the same bits.
pub const HADAMARD_SCALE_BITS: u32 = 0x3DB5_04F3;

/// The two index-key cache formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyFormat {
    /// 128 e4m3 codes + fp32 scale = 132 B per entry.
    Fp8,
    /// 64 B of packed e2m1 + 4 ue8m0 block scales = 68 B per entry.
    Mxfp4,
}

impl KeyFormat {
    pub fn code_bytes(self) -> usize {
        match self {
            KeyFormat::Fp8 => FP8_CODE_BYTES,
            KeyFormat::Mxfp4 => MXFP4_CODE_BYTES,
        }
    }
    /// Bytes one entry occupies (codes + scales).
    pub fn entry_bytes(self) -> usize {
        self.code_bytes() + SCALE_BYTES
    }
    pub fn name(self) -> &'static str {
        match self {
            KeyFormat::Fp8 => "fp8",
            KeyFormat::Mxfp4 => "mxfp4",
        }
    }
    pub fn parse(s: &str) -> Result<KeyFormat> {
        match s {
            "fp8" => Ok(KeyFormat::Fp8),
            "mxfp4" | "fp4" => Ok(KeyFormat::Mxfp4),
            _ => bail!("unknown index-key format `{s}` (expected fp8 or mxfp4)"),
        }
    }
}

/// 1/sqrt(128) as the f32 both sides use.
pub fn hadamard_scale() -> f32 {
    f32::from_bits(HADAMARD_SCALE_BITS)
}

/// In-place 128-point Walsh–Hadamard transform in natural (Sylvester) order, then `* 1/sqrt(128)`.
///
/// Stage `h` (1, 2, 4, ..., 64) replaces each pair `(x[j], x[j+h])` with bit `h` of `j` clear by
/// `(x[j] + x[j+h], x[j] - x[j+h])` in f32. The GPU does the same adds per stage (f32 addition is
/// commutative, so which side issues it does not matter), hence identical bits.
pub fn hadamard_128(x: &mut [f32; HEAD_DIM]) {
    let mut h = 1;
    while h < HEAD_DIM {
        for j in 0..HEAD_DIM {
            if j & h == 0 {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = hadamard_scale();
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// FP8 index key via [`indexer_key::encode_fp8`]: `scale = max(amax, 1e-4) / 448` (one f32 division),
/// `code = e4m3(x / scale)`. Split into the two planes the cache stores. Errors on non-finite input.
pub fn quantize_key_fp8(x: &[f32; HEAD_DIM]) -> Result<([u8; FP8_CODE_BYTES], f32)> {
    let e = indexer_key::encode_fp8(x)?;
    let mut codes = [0u8; FP8_CODE_BYTES];
    codes.copy_from_slice(&e[..FP8_CODE_BYTES]);
    Ok((codes, f32::from_le_bytes([e[128], e[129], e[130], e[131]])))
}

/// MXFP4 index key via [`indexer_key::encode_mxfp4`]: per 32-block `s = 2^ceil(log2(max(amax, 6*2^-126)
/// / 6))` (ue8m0), `code = e2m1(x / s)`, dim 2i in the low nibble. Errors on non-finite input.
pub fn quantize_key_mxfp4(
    x: &[f32; HEAD_DIM],
) -> Result<([u8; MXFP4_CODE_BYTES], [u8; SCALE_BYTES])> {
    let e = indexer_key::encode_mxfp4(x)?;
    let mut packed = [0u8; MXFP4_CODE_BYTES];
    let mut scales = [0u8; SCALE_BYTES];
    packed.copy_from_slice(&e[..MXFP4_CODE_BYTES]);
    scales.copy_from_slice(&e[MXFP4_CODE_BYTES..]);
    Ok((packed, scales))
}

/// Dequantized value of dim `d` of an FP8 entry (f64, exact).
pub fn fp8_value(codes: &[u8], scale: f32, d: usize) -> f64 {
    e4m3::decode(codes[d]) as f64 * scale as f64
}

/// Dequantized value of dim `d` of an MXFP4 entry (f64, exact).
pub fn mxfp4_value(packed: &[u8], scales: &[u8], d: usize) -> f64 {
    let (lo, hi) = e2m1::unpack(packed[d / 2]);
    let code = if d.is_multiple_of(2) { lo } else { hi };
    e2m1::decode(code) as f64 * ue8m0::decode(scales[d / MXFP4_BLOCK]) as f64
}

/// A host copy of an index-key cache: `batch` sequences x `capacity` entries, structure-of-arrays:
/// `codes[(b * capacity + j) * code_bytes ..]` and `scales[(b * capacity + j) * 4 ..]` (FP8: the fp32 scale
/// little-endian; MXFP4: 4 ue8m0 codes). The GPU uses the same two planes, so 16-byte loads stay aligned.
#[derive(Debug, Clone)]
pub struct KeyCacheHost {
    pub format: KeyFormat,
    pub batch: usize,
    pub capacity: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<u8>,
}

impl KeyCacheHost {
    /// An all-zero cache (codes 0, scales 0 bytes).
    pub fn new(format: KeyFormat, batch: usize, capacity: usize) -> KeyCacheHost {
        KeyCacheHost {
            format,
            batch,
            capacity,
            codes: vec![0; batch * capacity * format.code_bytes()],
            scales: vec![0; batch * capacity * SCALE_BYTES],
        }
    }

    /// Entry slot of (sequence `b`, position `j`).
    pub fn slot(&self, b: usize, j: usize) -> usize {
        b * self.capacity + j
    }

    /// Hadamard-transform and quantize `x` into `slot` (the CPU twin of the GPU writer). Errors on a
    /// non-finite key or a slot outside the cache.
    pub fn write_key(&mut self, slot: usize, raw: &[f32; HEAD_DIM]) -> Result<()> {
        if slot >= self.batch * self.capacity {
            bail!(
                "slot {slot} outside the cache ({} entries)",
                self.batch * self.capacity
            );
        }
        let mut x = *raw;
        hadamard_128(&mut x);
        let cb = self.format.code_bytes();
        match self.format {
            KeyFormat::Fp8 => {
                let (codes, scale) = quantize_key_fp8(&x)?;
                self.codes[slot * cb..(slot + 1) * cb].copy_from_slice(&codes);
                self.scales[slot * 4..slot * 4 + 4].copy_from_slice(&scale.to_le_bytes());
            }
            KeyFormat::Mxfp4 => {
                let (packed, scales) = quantize_key_mxfp4(&x)?;
                self.codes[slot * cb..(slot + 1) * cb].copy_from_slice(&packed);
                self.scales[slot * 4..slot * 4 + 4].copy_from_slice(&scales);
            }
        }
        Ok(())
    }

    /// The dequantized key at `slot` in f64 (exact: every stored value is a dyadic rational in f64 range).
    pub fn key_f64(&self, slot: usize) -> [f64; HEAD_DIM] {
        let cb = self.format.code_bytes();
        let codes = &self.codes[slot * cb..(slot + 1) * cb];
        let sc = &self.scales[slot * 4..slot * 4 + 4];
        let mut out = [0.0f64; HEAD_DIM];
        for (d, o) in out.iter_mut().enumerate() {
            *o = match self.format {
                KeyFormat::Fp8 => {
                    fp8_value(codes, f32::from_le_bytes([sc[0], sc[1], sc[2], sc[3]]), d)
                }
                KeyFormat::Mxfp4 => mxfp4_value(codes, sc, d),
            };
        }
        out
    }
}

/// Shapes of one indexer call: `batch` sequences, `next_n` query tokens each (rows = batch * next_n),
/// per-row visible entry counts.
#[derive(Debug, Clone)]
pub struct IndexerShape {
    pub batch: usize,
    pub next_n: usize,
    pub num_valid: Vec<i32>,
}

/// ReLU with IEEE maxNum semantics (NaN -> 0), as `fmaxf(x, 0)` on the GPU.
pub fn relu(x: f64) -> f64 {
    x.max(0.0)
}

/// Reference logits: `scores[row][j]` for `j < num_valid[row]`, row = b * next_n + t.
/// `q_codes`: e4m3 `[rows, 64, 128]`; `w`: f32 `[rows, 64]` (the per-token q scale already folded in).
/// The sum runs in f64 over the stored quantized values and starts at +0 (so an all-zero row is +0).
pub fn logits(
    shape: &IndexerShape,
    q_codes: &[u8],
    w: &[f32],
    cache: &KeyCacheHost,
) -> Vec<Vec<f32>> {
    let rows = shape.batch * shape.next_n;
    let mut out = Vec::with_capacity(rows);
    for row in 0..rows {
        let b = row / shape.next_n;
        let n = shape.num_valid[row].max(0) as usize;
        let q: Vec<f64> = q_codes[row * NUM_HEADS * HEAD_DIM..(row + 1) * NUM_HEADS * HEAD_DIM]
            .iter()
            .map(|&c| e4m3::decode(c) as f64)
            .collect();
        let mut scores = Vec::with_capacity(n);
        for j in 0..n {
            let k = cache.key_f64(cache.slot(b, j));
            let mut s = 0.0f64;
            for h in 0..NUM_HEADS {
                let dot: f64 = (0..HEAD_DIM).map(|d| q[h * HEAD_DIM + d] * k[d]).sum();
                s += w[row * NUM_HEADS + h] as f64 * relu(dot);
            }
            scores.push(s as f32);
        }
        out.push(scores);
    }
    out
}

/// An upper bound on `|sum_h w_h relu(q_h . k_j)|`'s rounding error scale: `sum_h |w_h| sum_d |q_hd k_jd|`.
pub fn logit_magnitude(
    shape: &IndexerShape,
    q_codes: &[u8],
    w: &[f32],
    cache: &KeyCacheHost,
    row: usize,
    j: usize,
) -> f64 {
    let b = row / shape.next_n;
    let k = cache.key_f64(cache.slot(b, j));
    let mut m = 0.0;
    for h in 0..NUM_HEADS {
        let mut a = 0.0;
        for (d, kd) in k.iter().enumerate() {
            a += (e4m3::decode(q_codes[(row * NUM_HEADS + h) * HEAD_DIM + d]) as f64 * kd).abs();
        }
        m += (w[row * NUM_HEADS + h] as f64).abs() * a;
    }
    m
}

/// Canonical score for ranking: NaN ranks as -inf and -0 as +0 (the GPU's key transform does the same).
pub fn canonical_score(s: f32) -> f32 {
    if s.is_nan() {
        f32::NEG_INFINITY
    } else if s == 0.0 {
        0.0
    } else {
        s
    }
}

/// Monotone map of a canonical f32 to u32: `a > b` (as floats) iff `key(a) > key(b)`.
pub fn order_key(s: f32) -> u32 {
    let bits = canonical_score(s).to_bits();
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// Reference top-k: the first `min(k, scores.len())` indices in the order (score desc, index asc) over
/// canonical scores, then `-1` up to `k`.
pub fn topk(scores: &[f32], k: usize) -> Vec<i32> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| {
        order_key(scores[b])
            .cmp(&order_key(scores[a]))
            .then(a.cmp(&b))
    });
    let mut out: Vec<i32> = idx.iter().take(k).map(|&i| i as i32).collect();
    out.resize(k, -1);
    out
}

/// Check a GPU top-k row against scores it was computed from. Returns a description of the first violation:
/// exact equality with the reference order when `exact`, which is the contract (the order is total).
pub fn check_topk_exact(scores: &[f32], k: usize, got: &[i32]) -> std::result::Result<(), String> {
    let want = topk(scores, k);
    if got.len() != k {
        return Err(format!("got {} indices, want {k}", got.len()));
    }
    if let Some(p) = (0..k).find(|&p| got[p] != want[p]) {
        let sc = |i: i32| {
            if i >= 0 && (i as usize) < scores.len() {
                scores[i as usize]
            } else {
                f32::NAN
            }
        };
        return Err(format!(
            "position {p}: got index {} (score {:e}), want {} (score {:e}); n = {}, k = {k}",
            got[p],
            sc(got[p]),
            want[p],
            sc(want[p]),
            scores.len()
        ));
    }
    Ok(())
}

/// A random non-NaN e4m3 code from a value in [-4, 4) (a realistic q / test distribution, never all zero).
pub fn random_e4m3<R: rand::Rng>(rng: &mut R) -> u8 {
    e4m3::encode_rne(rng.random_range(-4.0f32..4.0))
}
