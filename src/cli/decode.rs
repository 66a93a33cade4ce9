//! `megamoe decode`: the whole model decoding on one GPU, timed against the bandwidth limit measured in the same
//! run.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{ensure, Context, Result};

use crate::bench::{env, probe};
use crate::engine::io::StepShape;
use crate::engine::parity;
use crate::engine::plan::{resolve_model, PlanRequest};
use crate::engine::report::{group_floor_bytes, percentile, StepBytes};
use crate::engine::run::Engine;
use crate::engine::{free_device_bytes, DeviceWeights, MemoryPlan, WeightSource};
use crate::gpu::Gpu;
use crate::model::sampler::SamplerConfig;
use crate::model::weights::element_bits;
use crate::model::{CachePolicy, Model, Weights};
use crate::ops::sampler::SamplerParams;
use crate::progress::Progress;

/// The arguments of `megamoe decode`.
#[derive(clap::Args, Clone, Debug)]
pub struct DecodeArgs {
    /// `flash`, `pro`, `small`, or the path of a checkpoint's config.json.
    #[arg(long, default_value = "flash")]
    pub model: String,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Context capacity of every sequence (prompt + generated tokens), which sizes the caches.
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// Prompt tokens per sequence (random ids), run through the layers before the first decode step.
    #[arg(long, default_value_t = 16)]
    pub prompt_len: usize,
    /// Decode steps timed after the prompt.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Seed of the synthetic weights and the prompt ids.
    #[arg(long, default_value_t = 0x5EED)]
    pub seed: u64,
    /// Write decode.csv (one row per run, appended) here (default: results/<gpu>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Instead of timing: end-to-end parity with the CPU model (fed the GPU's greedy tokens) over
    /// --max-new-tokens steps, beside the floor of the CPU model against itself with one rounding order changed;
    /// writes parity.csv. The CPU model runs every step, so this is for the small geometry (--model small).
    #[arg(long)]
    pub parity: bool,
}

impl DecodeArgs {
    /// Checks that need no GPU (run before the GPU is opened).
    pub fn check(&self) -> Result<()> {
        let cfg = resolve_model(&self.model)?;
        ensure!(
            !self.parity || cfg.dim <= 1024,
            "--parity runs the CPU model every step: use --model small (the {} geometry takes seconds a token \
             on the CPU)",
            cfg.name
        );
        ensure!(self.batch >= 1, "--batch must be at least 1");
        ensure!(self.prompt_len >= 1, "--prompt-len must be at least 1");
        ensure!(
            self.max_new_tokens >= 1,
            "--max-new-tokens must be at least 1"
        );
        // The timed steps plus the profiled one after them each take a position.
        ensure!(
            self.prompt_len + self.max_new_tokens < self.context,
            "a prompt of {} tokens plus {} new tokens (and the profiled step) does not fit a context of {} \
             (raise --context)",
            self.prompt_len,
            self.max_new_tokens,
            self.context
        );
        Ok(())
    }
}

/// What a decode run measured.
pub struct DecodeSummary {
    pub tpot_us: Vec<f64>,
    pub ttft_s: f64,
    pub bytes: StepBytes,
    pub copy_gbps: f64,
}

impl DecodeSummary {
    pub fn p50_us(&self) -> f64 {
        percentile(&self.tpot_us, 0.5)
    }
    /// Tokens per second of one sequence at the median step time.
    pub fn tokens_per_s(&self) -> f64 {
        1e6 / self.p50_us()
    }
    /// The median step's read rate over the copy bandwidth.
    pub fn roofline_fraction(&self) -> f64 {
        self.bytes.total() as f64 / (self.p50_us() * 1e-6) / (self.copy_gbps * 1e9)
    }
}

/// Runs `megamoe decode` on `gpu`; prints the report and appends a row to decode.csv.
pub fn run(gpu: &Gpu, args: &DecodeArgs, default_out: PathBuf) -> Result<Option<DecodeSummary>> {
    let cfg = resolve_model(&args.model)?;
    let free = free_device_bytes(gpu)?;
    let req = PlanRequest::new(args.batch, args.context, args.prompt_len, free);
    let plan = MemoryPlan::new(&cfg, &req)
        .with_context(|| format!("planning {} on {}", cfg.name, gpu.info.name))?;
    eprintln!("{}", plan.map);
    eprintln!("measuring the copy bandwidth ...");
    let copy_gbps = probe::best_copy_gbps(&probe::measure_copy(gpu, 1 << 30, 10)?);
    let weights = DeviceWeights::load(gpu, &plan, &WeightSource::Synthetic { seed: args.seed })?;
    let shape = StepShape {
        batch: args.batch,
        context: args.context,
    };
    let mut engine = Engine::new(gpu, weights, shape)?;
    let prompts: Vec<Vec<u32>> = (0..args.batch)
        .map(|b| {
            (0..args.prompt_len as u64)
                .map(|i| {
                    (element_bits(args.seed ^ (0xB0 + b as u64), i) % cfg.vocab_size as u64) as u32
                })
                .collect()
        })
        .collect();
    if args.parity {
        let out = args.out.clone().unwrap_or(default_out);
        return run_parity(gpu, &mut engine, &cfg, args, &prompts, &out).map(|_| None);
    }
    // Every step samples: the prefill's first decode step, the timed steps and the profiled one.
    let params = SamplerParams::from_config(&SamplerConfig::greedy(), args.max_new_tokens + 2)?;
    eprintln!(
        "prefill: {} x {} prompt tokens, token by token through the decode layers",
        args.batch, args.prompt_len
    );
    // No stop ids: every step of the timed run decodes every sequence.
    crate::progress::catch_interrupt();
    let pre = engine.prefill(gpu, &prompts, &params, &[])?;
    let mut progress = Progress::new("decode", args.max_new_tokens);
    let tpot = engine.timed_decode(gpu, args.max_new_tokens, |i, _| {
        progress.tick(&format!("step {}", i + 1));
        Ok(())
    })?;
    let profile = if crate::progress::interrupted() {
        Vec::new()
    } else {
        engine.profile_step(gpu)?
    };
    let err = engine.state.read_error(&gpu.stream)?;
    ensure!(
        err == 0,
        "the decode steps set error bits {err:#x} (engine::step::ERR_*): the report would not be of valid steps"
    );
    // The floor at the median position of the timed steps.
    let mid = args.prompt_len + tpot.len() / 2;
    let bytes = StepBytes::of(&plan, &vec![mid; args.batch]);
    let s = DecodeSummary {
        tpot_us: tpot,
        ttft_s: pre.ttft_s,
        bytes,
        copy_gbps,
    };
    print_report(gpu, &plan, args, &s);
    print_profile(&profile, &plan, &vec![mid; args.batch], s.copy_gbps);
    let out = args.out.clone().unwrap_or(default_out);
    append_csv(&out, gpu, &plan, args, &s)?;
    Ok(Some(s))
}

/// `--parity`: [`parity::free_running`] against two CPU models on the same synthetic weights; prints a per-step
/// table and the summary, writes parity.csv.
fn run_parity(
    gpu: &Gpu,
    engine: &mut Engine,
    cfg: &crate::model::ModelConfig,
    args: &DecodeArgs,
    prompts: &[Vec<u32>],
    out: &std::path::Path,
) -> Result<()> {
    let cpu = Model::new(Weights::synthetic(
        cfg.clone(),
        args.seed,
        CachePolicy::All,
    )?)?;
    let mut floor = Model::new(Weights::synthetic(
        cfg.clone(),
        args.seed,
        CachePolicy::All,
    )?)?;
    floor.reverse_expert_sum = true;
    let mut progress = Progress::new("parity", args.max_new_tokens);
    let rows = parity::free_running(
        gpu,
        engine,
        &cpu,
        &floor,
        prompts,
        args.max_new_tokens,
        |i| progress.tick(&format!("step {}", i + 1)),
    )?;
    println!(
        "\n== parity: {} on {} (batch {}, prompt {}), GPU vs CPU model fed the GPU's tokens ==",
        cfg.name, gpu.info.name, args.batch, args.prompt_len
    );
    println!("step  seq  cos(GPU, CPU)  cos(CPU', CPU)  GPU token  CPU argmax  CPU' argmax");
    for r in &rows {
        println!(
            "{:>4}  {:>3}  {:>13.6}  {:>14.6}  {:>9}  {:>10}  {:>11}",
            r.step, r.seq, r.cos_gpu, r.cos_floor, r.gpu_token, r.cpu_token, r.floor_token
        );
    }
    let s = parity::ParitySummary::of(&rows);
    println!(
        "GPU vs CPU: min cosine {:.6}, mean {:.6}, greedy agreement {}/{}; floor (CPU' vs CPU): min {:.6}, mean \
         {:.6}, agreement {}/{}",
        s.min_cos_gpu,
        s.mean_cos_gpu,
        s.agree_gpu,
        s.rows,
        s.min_cos_floor,
        s.mean_cos_floor,
        s.agree_floor,
        s.rows
    );
    std::fs::create_dir_all(out)?;
    let path = out.join("parity.csv");
    let mut f =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    writeln!(
        f,
        "git_commit,gpu,model,seed,step,seq,cos_gpu_cpu,cos_floor_cpu,gpu_token,cpu_argmax,floor_argmax"
    )?;
    for r in &rows {
        writeln!(
            f,
            "{},{},{},{},{},{},{:.8},{:.8},{},{},{}",
            env::git_commit(),
            gpu.info.name.replace(',', " "),
            cfg.name,
            args.seed,
            r.step,
            r.seq,
            r.cos_gpu,
            r.cos_floor,
            r.gpu_token,
            r.cpu_token,
            r.floor_token
        )?;
    }
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn print_report(gpu: &Gpu, plan: &MemoryPlan, args: &DecodeArgs, s: &DecodeSummary) {
    let cfg = &plan.config;
    let (p50, p90, p99) = (
        s.p50_us(),
        percentile(&s.tpot_us, 0.9),
        percentile(&s.tpot_us, 0.99),
    );
    println!(
        "\n== decode: {} on {} (batch {}, context {}, prompt {}) ==",
        cfg.name, gpu.info.name, args.batch, args.context, args.prompt_len
    );
    println!("experts     {}", plan.map);
    println!(
        "TTFT        {:.3} s ({} prompt tokens, token by token; cold: module loads and graph capture included)",
        s.ttft_s, args.prompt_len
    );
    println!(
        "TPOT        p50 {:.1} us  p90 {:.1} us  p99 {:.1} us  ({} steps, one graph replay each, event timing)",
        p50,
        p90,
        p99,
        s.tpot_us.len()
    );
    println!(
        "tokens/s    {:.1} per sequence, {:.1} aggregate",
        s.tokens_per_s(),
        s.tokens_per_s() * args.batch as f64
    );
    println!(
        "bytes/step  {:.2} GB floor (dense {:.2}, routed experts {:.2}, KV {:.3})",
        s.bytes.total() as f64 / 1e9,
        s.bytes.dense as f64 / 1e9,
        s.bytes.routed as f64 / 1e9,
        s.bytes.kv as f64 / 1e9
    );
    println!(
        "roofline    {:.1}% of the copy bandwidth measured in this run ({:.0} GB/s): floor {:.1} us a step",
        100.0 * s.roofline_fraction(),
        s.copy_gbps,
        s.bytes.total() as f64 / (s.copy_gbps * 1e9) * 1e6
    );
}

/// The profiled step: device time per group of kernels (summed over the layers), in step order, beside the
/// group's byte floor at the copy bandwidth of this run.
fn print_profile(
    groups: &[(&'static str, f64, usize)],
    plan: &MemoryPlan,
    positions: &[usize],
    copy_gbps: f64,
) {
    if groups.is_empty() {
        return;
    }
    let total: f64 = groups.iter().map(|g| g.1).sum();
    println!(
        "\none step by kernel group (a graph replay with an event after each group; {} layers; floor = the group's \
         bytes at the copy bandwidth):",
        plan.config.n_layers
    );
    println!(
        "{:<74} {:>9} {:>5} {:>6} {:>9} {:>7}",
        "group", "us", "runs", "%", "floor us", "x floor"
    );
    for (name, us, n) in groups {
        let floor = group_floor_bytes(plan, name, positions) as f64 / (copy_gbps * 1e3);
        let ratio = if floor > 0.0 {
            format!("{:.1}", us / floor)
        } else {
            "-".into()
        };
        println!(
            "{name:<74} {us:>9.1} {n:>5} {:>5.1}% {floor:>9.1} {ratio:>7}",
            100.0 * us / total
        );
    }
    println!("{:<74} {total:>9.1}", "step (sum of groups)");
}

const CSV_HEADER: &str = "timestamp,git_commit,gpu,model,batch,context,prompt_len,steps,ttft_s,tpot_p50_us,tpot_p90_us,tpot_p99_us,tokens_per_s_seq,tokens_per_s_total,floor_bytes,dense_bytes,routed_bytes,kv_bytes,copy_gbps,pct_copy_bw,expert_slots,logical_experts";

fn append_csv(
    dir: &std::path::Path,
    gpu: &Gpu,
    plan: &MemoryPlan,
    args: &DecodeArgs,
    s: &DecodeSummary,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("decode.csv");
    let new = !path.exists();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    if new {
        writeln!(f, "{CSV_HEADER}")?;
    }
    let cfg = &plan.config;
    writeln!(
        f,
        "{},{},{},{},{},{},{},{},{:.4},{:.2},{:.2},{:.2},{:.2},{:.2},{},{},{},{},{:.1},{:.2},{},{}",
        env::timestamp_utc(),
        env::git_commit(),
        gpu.info.name.replace(',', " "),
        cfg.name,
        args.batch,
        args.context,
        args.prompt_len,
        s.tpot_us.len(),
        s.ttft_s,
        s.p50_us(),
        percentile(&s.tpot_us, 0.9),
        percentile(&s.tpot_us, 0.99),
        s.tokens_per_s(),
        s.tokens_per_s() * args.batch as f64,
        s.bytes.total(),
        s.bytes.dense,
        s.bytes.routed,
        s.bytes.kv,
        s.copy_gbps,
        100.0 * s.roofline_fraction(),
        plan.map.slots,
        plan.map.logical,
    )?;
    eprintln!("appended a row to {}", path.display());
    Ok(())
}
