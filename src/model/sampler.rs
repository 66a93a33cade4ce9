//! Sampling and stopping: temperature, top-k, top-p, greedy, seeded; a repetition penalty over the
//! recent window of the WHOLE sequence (prompt tokens included, seeds Part A2); a stop set of token ids
//! with the reason reported (seeds Part A1); and the generation loop over any logits source.

use super::reference::{DecodeState, Model};
use super::weights::{element_bits, splitmix64};
use anyhow::{bail, Result};
use std::collections::BTreeMap;

/// Sampling parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy (argmax, lower id wins ties).
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Keep the k most likely ids; 0 = off.
    pub top_k: usize,
    /// > 1 penalizes ids seen in the window (logit / p if positive, logit * p if negative); 1 = off.
    pub repetition_penalty: f32,
    /// How many of the most recent tokens (prompt + generated) the penalty looks at.
    pub penalty_window: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    /// The DeepSeek CLI default temperature 0.6 with top-p off, no penalty, 256-token window.
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.6,
            top_p: 1.0,
            top_k: 0,
            repetition_penalty: 1.0,
            penalty_window: 256,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {}", self.top_p);
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            bail!(
                "repetition_penalty must be finite and > 0, got {}",
                self.repetition_penalty
            );
        }
        Ok(())
    }
}

/// Applies the repetition penalty in place to every distinct id among the last `window` entries of
/// `history` (the prompt tokens are part of `history`). Ids outside the logits are ignored.
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32, window: usize) {
    if penalty == 1.0 || window == 0 {
        return;
    }
    let recent = &history[history.len().saturating_sub(window)..];
    let mut seen = std::collections::BTreeSet::new();
    for &id in recent {
        let i = id as usize;
        if i < logits.len() && seen.insert(i) {
            logits[i] = if logits[i] > 0.0 {
                logits[i] / penalty
            } else {
                logits[i] * penalty
            };
        }
    }
}

/// The penalized logits and the (id, probability) pairs of the distribution drawn from.
type Kept = (Vec<f32>, Vec<(u32, f32)>);

/// A seeded sampler. Its n-th draw ([`Sampler::sample`]) is [`Sampler::sample_at`] step n: the draws are a pure
/// function of (seed, step), so a device sampler makes the same ones with no generator state to carry.
pub struct Sampler {
    pub config: SamplerConfig,
    step: u64,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Sampler { config, step: 0 })
    }

    /// The distribution the sampler draws from (after penalty, temperature, top-k, top-p), as
    /// (id, probability) pairs sorted by descending probability (lower id first on ties). Greedy gives
    /// the single argmax with probability 1.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Result<Vec<(u32, f32)>> {
        Ok(self.kept(logits, history)?.1)
    }

    /// The penalized logits and [`Sampler::distribution`].
    fn kept(&self, logits: &[f32], history: &[u32]) -> Result<Kept> {
        if logits.is_empty() {
            bail!("sampling from an empty logit vector");
        }
        if let Some(i) = logits.iter().position(|v| v.is_nan()) {
            bail!("logit {i} is NaN");
        }
        let c = &self.config;
        let mut l = logits.to_vec();
        apply_repetition_penalty(&mut l, history, c.repetition_penalty, c.penalty_window);
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).expect("no NaN").then(a.cmp(&b)));
        if c.temperature == 0.0 {
            return Ok((l, vec![(order[0] as u32, 1.0)]));
        }
        if c.top_k > 0 {
            order.truncate(c.top_k);
        }
        let mx = l[order[0]];
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| (((l[i] - mx) / c.temperature) as f64).exp())
            .collect();
        let z: f64 = probs.iter().sum();
        for p in &mut probs {
            *p /= z;
        }
        if c.top_p < 1.0 {
            // Smallest prefix whose mass reaches top_p (the token that crosses it is kept).
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= c.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            order.truncate(keep);
            let z: f64 = probs.iter().sum();
            for p in &mut probs {
                *p /= z;
            }
        }
        let dist = order
            .iter()
            .zip(&probs)
            .map(|(&i, &p)| (i as u32, p as f32))
            .collect();
        Ok((l, dist))
    }

    /// Draws the next id: [`Sampler::sample_at`] at this sampler's step, then the step advances.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        let id = self.sample_at(logits, history, self.step)?;
        self.step += 1;
        Ok(id)
    }

    /// The id drawn at generation step `step` (the sequence's count of generated tokens): the exponential race
    /// of DeepSeek's own inference code (deepseek-ai/DeepSeek-V3 `inference/generate.py`, `sample`: `argmax(p /
    /// E)` with E ~ Exp(1) per id), a draw from [`Sampler::distribution`] that needs no sort and no running sum.
    /// In the log domain: the id of the largest [`race_key`] over the kept ids (lower id on ties), each id's
    /// Gumbel draw from [`race_bits`]`(seed, step, id)`. Greedy and one-id distributions need no draw.
    pub fn sample_at(&self, logits: &[f32], history: &[u32], step: u64) -> Result<u32> {
        let (l, dist) = self.kept(logits, history)?;
        if dist.len() == 1 {
            return Ok(dist[0].0);
        }
        let (t, seed) = (self.config.temperature, self.config.seed);
        let best = dist
            .iter()
            .map(|&(id, _)| {
                let key = race_key(l[id as usize], t, race_bits(seed, step, id as u64));
                order_key(key, id)
            })
            .max()
            .expect("a non-empty distribution");
        Ok(order_id(best))
    }
}

/// The 64 random bits of id `id` at step `step` of a sequence seeded `seed`:
/// `element_bits(element_bits(splitmix64(seed), step), id)` (kernels/sampler.cu `race_bits` is its twin).
pub fn race_bits(seed: u64, step: u64, id: u64) -> u64 {
    element_bits(element_bits(splitmix64(seed), step), id)
}

/// Bits of the f32 constants of [`ln_ieee`] (shared with kernels/sampler.cu): 1/3, 1/5, 1/7, 1/9, ln 2, sqrt 2.
const LN_C3: u32 = 0x3EAA_AAAB;
const LN_C5: u32 = 0x3E4C_CCCD;
const LN_C7: u32 = 0x3E12_4925;
const LN_C9: u32 = 0x3DE3_8E39;
const LN_2: u32 = 0x3F31_7218;
const SQRT_2: u32 = 0x3FB5_04F3;

/// ln x for a positive normal f32 from IEEE basic operations and fused multiply-adds only, so that the CPU and the
/// GPU (kernels/sampler.cu `ln_ieee`, the same operations with `__f*_rn`) compute the same bits: x = m 2^e with m
/// in [sqrt(1/2), sqrt 2), ln m = 2 atanh s = 2s (1 + s^2/3 + s^4/5 + s^6/7 + s^8/9), s = (m - 1) / (m + 1) (|s| <=
/// 0.172: the first omitted term is below 2^-28 of the sum), ln x = e ln 2 + ln m. Within a few f32 ulps of ln x;
/// what the draw needs is the agreement, which holds bit for bit.
pub fn ln_ieee(x: f32) -> f32 {
    let b = x.to_bits();
    let mut e = ((b >> 23) & 0xFF) as i32 - 127;
    let mut m = f32::from_bits((b & 0x007F_FFFF) | 0x3F80_0000);
    if m > f32::from_bits(SQRT_2) {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let c = |bits: u32| f32::from_bits(bits);
    let p = s2.mul_add(c(LN_C9), c(LN_C7));
    let p = s2.mul_add(p, c(LN_C5));
    let p = s2.mul_add(p, c(LN_C3));
    let p = p * s2;
    let two_s = s + s;
    let ln_m = two_s.mul_add(p, two_s);
    (e as f32).mul_add(c(LN_2), ln_m)
}

/// The race key of a (penalized) logit `l` at temperature `t` with the id's random bits: `l / t + g`, g = -ln(-ln
/// U) a Gumbel draw, U = ((bits >> 41) + 0.5) / 2^23 in [2^-24, 1 - 2^-24] (exact: 24 significant bits), every
/// operation f32 IEEE. U's 23 bits bound g to [-2.9, 16.7]: an id whose `l / t` is more than ~19.5 below the
/// largest never wins (its probability is below e^-19.5 = 3e-9 each).
pub fn race_key(l: f32, t: f32, bits: u64) -> f32 {
    let u = ((bits >> 41) as f32 + 0.5) * f32::from_bits(0x3400_0000); // 2^-23
    let g = -ln_ieee(-ln_ieee(u));
    l / t + g
}

/// A total order on (value, id) pairs: larger value first, then the lower id; -0 and +0 equal (the CPU's
/// `partial_cmp`). kernels/sampler.cu `make_key` is its twin (ids below 2^17).
pub fn order_key(v: f32, id: u32) -> u64 {
    let mut u = v.to_bits();
    if u == 0x8000_0000 {
        u = 0;
    }
    let ord = if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    };
    ((ord as u64) << 17) | (((1u32 << 17) - 1 - id) as u64)
}

/// The id of an [`order_key`].
pub fn order_id(key: u64) -> u32 {
    (1u32 << 17) - 1 - (key & ((1 << 17) - 1)) as u32
}

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced a member of the stop set (the id and its name in the set).
    StopToken { id: u32, name: String },
    /// `max_new_tokens` reached.
    MaxTokens,
}

/// The ids that end generation, each with a name for reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopSet {
    ids: BTreeMap<u32, String>,
}

impl StopSet {
    pub fn new() -> Self {
        StopSet::default()
    }

    /// The DeepSeek-V4 chat stop set: `eos_token_id`, `<｜end▁of▁sentence｜>` and `<｜User｜>` (the model
    /// opening a new user turn means its own turn is over). Ids come from the tokenizer when given,
    /// else the defaults of arch §6 (1 and 128803).
    pub fn dsv4_chat(eos_token_id: u32, tokenizer: Option<&super::tokenizer::Tokenizer>) -> Self {
        let mut s = StopSet::new();
        s.insert(eos_token_id, "eos_token_id");
        let lookup =
            |text: &str, default: u32| tokenizer.and_then(|t| t.token_id(text)).unwrap_or(default);
        s.insert(
            lookup(super::chat::EOS_TEXT, super::chat::EOS_ID),
            super::chat::EOS_TEXT,
        );
        s.insert(
            lookup(super::chat::USER_TEXT, super::chat::USER_ID),
            super::chat::USER_TEXT,
        );
        s
    }

    /// Adds an id (keeps the first name if already present).
    pub fn insert(&mut self, id: u32, name: &str) {
        self.ids.entry(id).or_insert_with(|| name.to_string());
    }
    pub fn remove(&mut self, id: u32) -> bool {
        self.ids.remove(&id).is_some()
    }
    pub fn contains(&self, id: u32) -> bool {
        self.ids.contains_key(&id)
    }
    pub fn ids(&self) -> Vec<u32> {
        self.ids.keys().copied().collect()
    }
    fn reason(&self, id: u32) -> Option<StopReason> {
        self.ids.get(&id).map(|n| StopReason::StopToken {
            id,
            name: n.clone(),
        })
    }
}

/// Anything that turns a token sequence into next-token logits.
pub trait LogitsSource {
    /// Logits after the whole prompt.
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Logits after appending one token.
    fn step(&mut self, token: u32) -> Result<Vec<f32>>;
}

/// The reference model with its decode state, as a logits source.
pub struct ModelSession<'m> {
    pub model: &'m Model,
    pub state: DecodeState,
}

impl<'m> ModelSession<'m> {
    pub fn new(model: &'m Model) -> Self {
        ModelSession {
            model,
            state: model.new_state(),
        }
    }
}

impl LogitsSource for ModelSession<'_> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(self.model.prefill(&mut self.state, tokens, false)?.logits)
    }
    fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        Ok(self.model.decode_step(&mut self.state, token)?.logits)
    }
}

/// A finished generation: the new tokens (the stop token excluded) and why it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
}

/// Prefill `prompt`, then sample until a stop-set member or `max_new_tokens`. The penalty history is
/// prompt + generated tokens.
pub fn generate(
    source: &mut dyn LogitsSource,
    prompt: &[u32],
    sampler: &mut Sampler,
    stop: &StopSet,
    max_new_tokens: usize,
) -> Result<Generation> {
    if prompt.is_empty() {
        bail!("generate: empty prompt");
    }
    let mut history = prompt.to_vec();
    let mut out = Vec::new();
    let mut logits = source.prefill(prompt)?;
    loop {
        if out.len() >= max_new_tokens {
            return Ok(Generation {
                tokens: out,
                stop: StopReason::MaxTokens,
            });
        }
        let id = sampler.sample(&logits, &history)?;
        if let Some(reason) = stop.reason(id) {
            return Ok(Generation {
                tokens: out,
                stop: reason,
            });
        }
        out.push(id);
        history.push(id);
        logits = source.step(id)?;
    }
}
