//! `megamoe generate`: one prompt through the chat template and DeepSeek-V4's tokenizer, decoded on the GPU with
//! the sampler's options, the text streamed as it is sampled, and a summary line (stop reason, TTFT, tokens/s).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};

use crate::engine::io::StepShape;
use crate::engine::plan::{resolve_model, PlanRequest};
use crate::engine::run::Engine;
use crate::engine::{free_device_bytes, DeviceWeights, MemoryPlan, WeightSource};
use crate::gpu::Gpu;
use crate::model::chat::build_text_prompt;
use crate::model::checkpoint::Checkpoint;
use crate::model::sampler::{SamplerConfig, StopSet};
use crate::model::tokenizer::Tokenizer;
use crate::ops::sampler::{SamplerParams, STATUS_FAILED, STATUS_MAX_TOKENS, STATUS_STOPPED};
use crate::progress;

/// The arguments of `megamoe generate`.
#[derive(clap::Args, Clone, Debug)]
pub struct GenerateArgs {
    /// The user's message.
    pub prompt: String,
    /// `flash`, `pro`, `small`, or the path of a checkpoint's config.json.
    #[arg(long, default_value = "flash")]
    pub model: String,
    /// A checkpoint directory in the official safetensors layout (its config must match --model); synthetic
    /// weights (seeded by --seed) when absent, which decode gibberish at the speed of the real model.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// A system prompt.
    #[arg(long, default_value = "")]
    pub system: String,
    /// Open the assistant turn with `<think>` (reasoning) instead of `</think>`.
    #[arg(long)]
    pub thinking: bool,
    /// Context capacity (prompt + generated tokens).
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.6)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// > 1 penalizes tokens among the last --penalty-window (prompt included).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 256)]
    pub penalty_window: usize,
    /// Seed of the sampler's draws (and of the synthetic weights).
    #[arg(long, default_value_t = 0x5EED)]
    pub seed: u64,
    /// Prompt tokens per prefill chunk, 1..=1024 (default 1024; 1 = token by token); the TTFT in the summary is the
    /// chunked prefill's.
    #[arg(long, default_value_t = crate::engine::prefill::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Which engine runs the dense linears: `auto` (the default: cuBLASLt's tensor cores where
    /// src/ops/dense/route.rs's measured rule says), `gemv` or `tensor-cores` (see `megamoe decode --help`).
    #[arg(long, default_value = "auto", value_parser = crate::ops::dense::DenseRoute::parse)]
    pub dense_route: crate::ops::dense::DenseRoute,
}

impl GenerateArgs {
    fn sampler(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            repetition_penalty: self.repetition_penalty,
            penalty_window: self.penalty_window,
            seed: self.seed,
        }
    }

    /// Everything checkable without a GPU: the model name, the sampler's options, the tokenized prompt against
    /// the context. Returns the prompt ids.
    pub fn check(&self, tok: &Tokenizer) -> Result<Vec<u32>> {
        resolve_model(&self.model)?;
        self.sampler().validate()?;
        crate::engine::prefill::check_chunk(self.prefill_chunk)?;
        ensure!(
            self.max_new_tokens >= 1,
            "--max-new-tokens must be at least 1"
        );
        let ids = build_text_prompt(tok, &self.system, &self.prompt, self.thinking)?;
        ensure!(
            ids.len() + self.max_new_tokens <= self.context,
            "the prompt is {} tokens; with --max-new-tokens {} it needs a context of {}, --context is {}",
            ids.len(),
            self.max_new_tokens,
            ids.len() + self.max_new_tokens,
            self.context
        );
        Ok(ids)
    }
}

/// Runs `megamoe generate` (`prompt` = the ids [`GenerateArgs::check`] returned).
/// Runs under `--dense-route` (`ops::dense::with_route`: the engine's dense workspaces are carved, and its linears
/// routed, by it).
pub fn run(gpu: &Gpu, args: &GenerateArgs, tok: &Tokenizer, prompt: Vec<u32>) -> Result<()> {
    crate::ops::dense::with_route(args.dense_route, || run_routed(gpu, args, tok, prompt))
}

fn run_routed(gpu: &Gpu, args: &GenerateArgs, tok: &Tokenizer, prompt: Vec<u32>) -> Result<()> {
    let cfg = resolve_model(&args.model)?;
    let checkpoint = match &args.checkpoint {
        Some(dir) => Some(Checkpoint::open(dir, &cfg)?),
        None => None,
    };
    let free = free_device_bytes(gpu)?;
    let plan = MemoryPlan::new(&cfg, &PlanRequest::new(1, args.context, prompt.len(), free))
        .with_context(|| format!("planning {} on {}", cfg.name, gpu.info.name))?;
    let source = match &checkpoint {
        Some(ck) => WeightSource::Checkpoint(ck),
        None => WeightSource::Synthetic { seed: args.seed },
    };
    let weights = DeviceWeights::load(gpu, &plan, &source)?;
    let mut engine = Engine::new(
        gpu,
        &weights,
        StepShape {
            batch: 1,
            context: args.context,
        },
    )?;
    engine.set_prefill_chunk(args.prefill_chunk)?;
    let stop = StopSet::dsv4_chat(cfg.eos_token_id, Some(tok));
    let params = SamplerParams::from_config(&args.sampler(), args.max_new_tokens)?;
    progress::catch_interrupt();
    let t0 = Instant::now();
    let pre = engine.prefill(gpu, std::slice::from_ref(&prompt), &params, &stop.ids())?;
    let mut generated: Vec<u32> = Vec::new();
    let mut printed = 0usize;
    let mut out = std::io::stdout();
    let mut stream_text = |ids: &[u32]| -> Result<()> {
        let text = tok.decode(ids)?;
        // Print only whole characters that will not change with the next token (a trailing U+FFFD is a
        // partial UTF-8 sequence).
        let stable = text.trim_end_matches('\u{FFFD}');
        if stable.len() > printed {
            write!(out, "{}", &stable[printed..])?;
            out.flush()?;
            printed = stable.len();
        }
        Ok(())
    };
    let first = engine.sampled(gpu)?[0];
    if first >= 0 {
        generated.push(first as u32);
        stream_text(&generated)?;
    }
    let decode_start = Instant::now();
    let mut interrupted = false;
    while engine.any_running(gpu)? {
        if progress::interrupted() {
            interrupted = true;
            break;
        }
        engine.decode_step(gpu)?;
        let id = engine.sampled(gpu)?[0];
        if id >= 0 && engine.status(gpu)?[0] != STATUS_STOPPED {
            generated.push(id as u32);
            stream_text(&generated)?;
        }
    }
    let decode_s = decode_start.elapsed().as_secs_f64();
    println!();
    let status = engine.status(gpu)?[0];
    let reason = if interrupted {
        "interrupted (Ctrl-C)".to_string()
    } else {
        match status {
            STATUS_STOPPED => {
                let id = engine.sampled(gpu)?[0];
                format!(
                    "stop token {id} ({})",
                    tok.decode(&[id as u32]).unwrap_or_default()
                )
            }
            STATUS_MAX_TOKENS => format!("max new tokens ({})", args.max_new_tokens),
            STATUS_FAILED => bail!(
                "the sampler failed (error word {:#x}: NaN logits or bad parameters)",
                engine.sampler_error(gpu)?
            ),
            s => format!("status {s}"),
        }
    };
    let after_first = generated.len().saturating_sub(1);
    eprintln!(
        "[{} | {} prompt tokens, {} generated | stop: {reason} | TTFT {:.3} s (prefill chunk {}) | {:.1} tokens/s after the first | {:.1} s total]",
        cfg.name,
        prompt.len(),
        generated.len(),
        pre.ttft_s,
        args.prefill_chunk,
        if decode_s > 0.0 { after_first as f64 / decode_s } else { 0.0 },
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
