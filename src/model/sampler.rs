//! Sampling and stopping: temperature, top-k, top-p, greedy, seeded; a repetition penalty over the
//! recent window of the WHOLE sequence (prompt tokens included, seeds Part A2); a stop set of token ids
//! with the reason reported (seeds Part A1); and the generation loop over any logits source.

use super::reference::{DecodeState, Model};
use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
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

/// A seeded sampler.
pub struct Sampler {
    pub config: SamplerConfig,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Self> {
        config.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        Ok(Sampler { config, rng })
    }

    /// The distribution the sampler draws from (after penalty, temperature, top-k, top-p), as
    /// (id, probability) pairs sorted by descending probability (lower id first on ties). Greedy gives
    /// the single argmax with probability 1.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Result<Vec<(u32, f32)>> {
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
            return Ok(vec![(order[0] as u32, 1.0)]);
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
        Ok(order
            .iter()
            .zip(&probs)
            .map(|(&i, &p)| (i as u32, p as f32))
            .collect())
    }

    /// Draws the next id.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        let dist = self.distribution(logits, history)?;
        if dist.len() == 1 {
            return Ok(dist[0].0);
        }
        let u: f64 = self.rng.random::<f64>();
        Ok(pick(&dist, u))
    }

    /// The id [`Sampler::sample`] chooses when its uniform draw is `u` (in [0, 1)), without touching the
    /// seeded generator: the form whose draws a device sampler can share ([`counter_uniform`]).
    pub fn sample_with_uniform(&self, logits: &[f32], history: &[u32], u: f64) -> Result<u32> {
        Ok(pick(&self.distribution(logits, history)?, u))
    }
}

/// The first id of `dist` (in its order) whose running f64 sum of probabilities exceeds `u`; the last id
/// when none does.
fn pick(dist: &[(u32, f32)], u: f64) -> u32 {
    let mut acc = 0.0f64;
    for &(id, p) in dist {
        acc += p as f64;
        if u < acc {
            return id;
        }
    }
    dist.last().expect("non-empty").0
}

/// A counter-based uniform draw in [0, 1): the 53 high bits of
/// `element_bits(splitmix64(seed), step)` times 2^-53 (exact). Step `n` of a sequence (its n-th generated
/// token) uses `step = n`, so a device sampler computes the same draw from (seed, step) with no generator
/// state to carry (kernels/sampler.cu `counter_uniform` is its twin).
pub fn counter_uniform(seed: u64, step: u64) -> f64 {
    use super::weights::{element_bits, splitmix64};
    (element_bits(splitmix64(seed), step) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
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
