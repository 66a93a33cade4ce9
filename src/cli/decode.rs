//! `megamoe decode`: the whole model decoding on one GPU, timed against the bandwidth limit measured in the same
//! run.

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};

use crate::bench::plot::{plot_timeline, TimelineBar};
use crate::bench::stats::percentile_of_sorted;
use crate::bench::{env, probe};
use crate::engine::io::StepShape;
use crate::engine::parity;
use crate::engine::plan::{resolve_model, PlanRequest};
use crate::engine::report::{group_floor_bytes, StepBytes};
use crate::engine::run::Engine;
use crate::engine::{free_device_bytes, DeviceWeights, MemoryPlan, WeightSource};
use crate::gpu::trace::{KernelSpan, Timeline};
use crate::gpu::Gpu;
use crate::model::sampler::SamplerConfig;
use crate::ops::dense::route::DenseRoute;
use crate::ops::sampler::SamplerParams;
use crate::progress::Progress;

/// The arguments of `megamoe decode`.
#[derive(clap::Args, Clone, Debug)]
pub struct DecodeArgs {
    /// `flash`, `pro`, `small`, or the path of a checkpoint's config.json.
    #[arg(long, default_value = "flash")]
    pub model: String,
    /// Sequences decoded together; a comma-separated list sweeps them (one weight load for every point; with a
    /// --context list too, the sweep is L-shaped: see `DecodeArgs::points`).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub batch: Vec<usize>,
    /// Context capacity of every sequence (prompt + generated tokens), which sizes the caches; a comma-separated
    /// list sweeps them.
    #[arg(long, value_delimiter = ',', default_value = "4096")]
    pub context: Vec<usize>,
    /// Time the steps at the end of each context instead of after a prompt: every sequence starts about
    /// `max_new_tokens + 3` positions before the end (so that the profiled and traced steps after the timed ones
    /// run where no compressor emits an entry), with zero KV entries and random indexer keys below it (the steps
    /// read the bytes of a full context and the top-k selects among distinct scores, but the values are not a
    /// real prompt's; no TTFT). How a 128K or 1M context is timed without prefilling it.
    #[arg(long)]
    pub at_context: bool,
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
    /// --max-new-tokens steps, beside the CPU model in the GPU's NVFP4 expert activations and the floor of the
    /// CPU model against itself with one rounding changed; writes parity.csv. The CPU models run every step, so
    /// this is for the small geometry (--model small).
    #[arg(long)]
    pub parity: bool,
    /// With --parity: run it for this many seeds (--seed, --seed + 1, ...; each its own synthetic weights and
    /// prompts) and end with the spread: whether the GPU's distance from CPU4 stays inside the range of the CPU
    /// floor's distances over the same seeds.
    #[arg(long, default_value_t = 1)]
    pub parity_seeds: usize,
    /// Prompt tokens per prefill chunk, 1..=1024 (default 1024, the fewest chunks: each reads every resident expert
    /// and dense weight once): each sequence's prompt goes through the layers in chunks of this many rows (above 64
    /// rows the dense linears on cuBLASLt's tensor cores and the routed experts on moe_gemm's prefill mainloop;
    /// docs/engine.md "Chunked prefill"); 1 = token by token (one prompt-step graph replay per token, the whole
    /// batch at once). decode.csv records it in its `prefill_chunk` column.
    #[arg(long, default_value_t = crate::engine::prefill::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Which engine runs the dense linears (the decode step's and the chunked prefill's): `auto` (the default: the
    /// measured rule of src/ops/dense/route.rs, the BF16 linears on cuBLASLt's tensor cores from 16 rows and the
    /// LM head at every batch, the FP8 linears on cuBLASLt's block-scaled FP8 GEMM from 32 rows), `gemv` (this
    /// family's CUDA-core GEMV for every linear) or `tensor-cores` (every linear that has a tensor-core route, at
    /// any batch). `auto` won its A/B (results/h100/PERF-LOG.md): Flash batch 1 10.54 -> 10.42 ms a token (the LM
    /// head), the 4K-token TTFT 4.40 -> 4.12 s. decode.csv records it in its `dense_route` column.
    #[arg(long, default_value = "auto", value_parser = DenseRoute::parse)]
    pub dense_route: DenseRoute,
    /// Expert parallelism over N GPUs, one process (rank) per GPU (docs/multi-gpu.md): the routed experts split in
    /// contiguous blocks, everything else replicated, one all-gather per layer. N > 1 spawns N copies of this
    /// command with MEGAMOE_RANK, MEGAMOE_WORLD, MEGAMOE_NCCL_ID, CUDA_VISIBLE_DEVICES=rank and NCCL_NVLS_ENABLE=0
    /// (and fails before any GPU work when the machine has fewer GPUs); 1 runs the same code path in this process
    /// without NCCL. One point (one --batch, one --context), a real prompt fed token by token (--prefill-chunk is
    /// not used), eager steps on --dense-route; rank 0 prints the report (no decode.csv row).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// At most N physical expert slots a layer (default: as many as the free memory holds; the logical experts
    /// wrap onto them either way, and the bytes a token reads stay the real model's). Fewer leave device memory
    /// to other work: Nsight Compute's kernel replay saves and restores all of it around every pass.
    #[arg(long, value_name = "N")]
    pub expert_slots: Option<usize>,
}

/// How a prefill of chunk `chunk` runs, for the report.
fn prefill_how(chunk: usize) -> String {
    if chunk <= 1 {
        "token by token through the decode layers (--prefill-chunk 1)".into()
    } else {
        format!(
            "in chunks of {chunk} rows of one sequence through the layers (--prefill-chunk; eager launches)"
        )
    }
}

/// How decode.csv writes an on / off column.
fn on_off_name(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

impl DecodeArgs {
    /// The (batch, context) points of the run: one list sweeps it at the other's value; with lists for both the
    /// sweep is L-shaped (every context at the first batch, then every other batch at the first context: the
    /// context sweep at batch 1 and the batch sweep at 4K of one weight load), not a full grid.
    pub fn points(&self) -> Vec<(usize, usize)> {
        let (b0, c0) = (self.batch[0], self.context[0]);
        let mut v: Vec<(usize, usize)> = self.context.iter().map(|&c| (b0, c)).collect();
        v.extend(self.batch.iter().skip(1).map(|&b| (b, c0)));
        v
    }

    /// Checks that need no GPU (run before the GPU is opened).
    pub fn check(&self) -> Result<()> {
        let cfg = resolve_model(&self.model)?;
        if let Some(n) = self.ranks {
            crate::dist::launch::check_ranks(n, cfg.n_routed_experts)?;
            ensure!(
                self.batch.len() == 1 && self.context.len() == 1 && !self.at_context && !self.parity,
                "--ranks runs one point (one --batch, one --context, a real prompt; no --at-context, no --parity)"
            );
        }
        if let Some(n) = self.expert_slots {
            ensure!(
                self.ranks.is_none(),
                "--expert-slots caps one GPU's slots; with --ranks every rank holds its block of the experts"
            );
            crate::engine::plan::check_expert_slots(&cfg, n)?;
        }
        ensure!(
            !self.parity || cfg.dim <= 1024,
            "--parity runs the CPU model every step: use --model small (the {} geometry takes seconds a token \
             on the CPU)",
            cfg.name
        );
        ensure!(
            !self.batch.is_empty() && self.batch.iter().all(|&b| b >= 1),
            "--batch must list sizes of at least 1"
        );
        ensure!(
            !self.parity || (self.batch.len() == 1 && self.context.len() == 1 && !self.at_context),
            "--parity runs one point (one --batch, one --context, a real prompt)"
        );
        ensure!(
            self.parity_seeds >= 1 && (self.parity || self.parity_seeds == 1),
            "--parity-seeds counts the seeds of a --parity run (at least 1)"
        );
        ensure!(self.prompt_len >= 1, "--prompt-len must be at least 1");
        crate::engine::prefill::check_chunk(self.prefill_chunk)?;
        ensure!(
            self.max_new_tokens >= 1,
            "--max-new-tokens must be at least 1"
        );
        // The timed steps plus the profiled and the traced one after them each take a position; --at-context puts
        // those two at the last positions of the context where no compressor emits (quiet_run).
        for &c in &self.context {
            let (first, last) = if self.at_context {
                (1, quiet_run(&cfg, c - 1, STEPS_AFTER_TIMED))
            } else {
                (self.prompt_len, c - STEPS_AFTER_TIMED)
            };
            ensure!(
                first + self.max_new_tokens <= last,
                "a prompt of {first} tokens plus {} new tokens (and the profiled step) does not fit a context of \
                 {c} (raise --context)",
                self.max_new_tokens,
            );
        }
        Ok(())
    }
}

/// `megamoe decode --ranks N` (after [`DecodeArgs::check`]): in a rank process (MEGAMOE_RANK or torchrun's RANK
/// set) that rank's run; with N = 1 the one rank in this process (GPU `gpu`, no NCCL); with N > 1 the parent, which
/// counts the GPUs before any GPU work and spawns the ranks with this process's arguments.
pub fn run_ranks(args: &DecodeArgs, gpu: usize) -> Result<()> {
    let n = args.ranks.context("run_ranks without --ranks")?;
    let run = crate::dist::EpDecodeRun {
        model: args.model.clone(),
        batch: args.batch[0],
        context: args.context[0],
        prompt_len: args.prompt_len,
        max_new_tokens: args.max_new_tokens,
        seed: args.seed,
    };
    use crate::dist::launch::{self, RankEnv};
    // A rank runs its dense linears on the requested route, as the single-GPU run does (every rank the same route:
    // the replicas must compute the same bits).
    let ranked = |env: &RankEnv| {
        crate::ops::dense::with_route(args.dense_route, || crate::dist::run_rank(env, &run))
    };
    match RankEnv::from_env()? {
        Some(env) => {
            ensure!(
                env.world == n,
                "this rank's environment says a world of {}, --ranks says {n}",
                env.world
            );
            let report = ranked(&env)?;
            if env.rank == 0 {
                print!("{}", describe_ranks(&run, env.world, &report));
            }
            Ok(())
        }
        None if n == 1 => {
            let env = RankEnv {
                rank: 0,
                world: 1,
                device: gpu,
                nccl_id: None,
            };
            print!("{}", describe_ranks(&run, 1, &ranked(&env)?));
            Ok(())
        }
        None => {
            let argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
            launch::launch(n, &argv)
        }
    }
}

/// Rank 0's report of an expert-parallel run of `world` ranks: the first (eager) step, the median of the graph
/// replays after it (the bench's percentile rule, `bench::stats`), the tokens per second at that median.
fn describe_ranks(
    run: &crate::dist::EpDecodeRun,
    world: usize,
    r: &crate::dist::EpDecodeReport,
) -> String {
    let mut sorted: Vec<f64> = r.step_ms.iter().skip(1).copied().collect();
    sorted.sort_by(f64::total_cmp);
    let p50 = percentile_of_sorted(&sorted, 0.5).unwrap_or(f64::NAN);
    let first: Vec<String> = r.tokens.iter().map(|t| t[0].to_string()).collect();
    format!(
        "expert-parallel decode: {} on {world} rank(s), {} expert slots a rank, batch {}, context {}, prompt {}\n\
         steps (host-timed, the first eager, the rest one CUDA graph replay each): first {:.2} ms, p50 of the rest \
         {:.2} ms, {:.1} tokens/s\n\
         sequence 0's greedy tokens: {}\n",
        r.model,
        r.slots,
        run.batch,
        run.context,
        run.prompt_len,
        r.step_ms.first().copied().unwrap_or(f64::NAN),
        p50,
        run.batch as f64 * 1e3 / p50,
        first.join(" ")
    )
}

/// What a decode run measured.
pub struct DecodeSummary {
    pub tpot_us: Vec<f64>,
    /// `None` when the run started at the end of the context (no prompt).
    pub ttft_s: Option<f64>,
    pub bytes: StepBytes,
    pub copy_gbps: f64,
    /// Kernels one step launches (the step graph's kernel nodes).
    pub kernels: usize,
    /// One profiled step: (kernel group, us summed over the layers, runs, the group's byte floor in us).
    pub profile: Vec<(String, f64, usize, f64)>,
    /// The position the profiled step decoded (every sequence's); the traced step decoded the next one.
    pub profile_position: usize,
    /// The traced step's kernels in start order ([`Engine::trace_step`]); empty where this machine could not
    /// trace.
    pub trace: Vec<KernelSpan>,
    /// The traced step by the profiled step's kernel groups (each kernel's share of the wall; the groups add up to
    /// the wall), as `profile`; empty without a trace or where the two steps' kernels do not line up.
    pub traced_groups: Vec<(String, f64, usize, f64)>,
    /// The same step by kernel: (entry point, us summed over its launches, launches).
    pub kernel_profile: Vec<(String, f64, usize)>,
    /// After a chunked prefill: one more chunk of sequence 0 profiled (its rows, its first position, the groups
    /// and the kernels as in the step's tables).
    pub prefill_profile: Option<PrefillChunkProfile>,
}

/// One profiled prefill chunk ([`Engine::profile_prefill_chunk`]).
pub struct PrefillChunkProfile {
    pub rows: usize,
    pub position: usize,
    /// Its kernels as CUPTI traced them (empty where this machine could not trace).
    pub trace: Vec<KernelSpan>,
    pub groups: Vec<(String, f64, usize)>,
    pub kernels: Vec<(String, f64, usize)>,
}

impl DecodeSummary {
    /// The `p`-quantile of the step times (the bench's percentile rule, `bench::stats`).
    pub fn tpot_quantile_us(&self, p: f64) -> f64 {
        let mut sorted = self.tpot_us.clone();
        sorted.sort_by(f64::total_cmp);
        percentile_of_sorted(&sorted, p).unwrap_or(f64::NAN)
    }
    pub fn p50_us(&self) -> f64 {
        self.tpot_quantile_us(0.5)
    }
    /// Tokens per second of one sequence at the median step time.
    pub fn tokens_per_s(&self) -> f64 {
        1e6 / self.p50_us()
    }
    /// The step time the byte floor allows: every byte the step must read, at the copy bandwidth.
    pub fn floor_us(&self) -> f64 {
        self.bytes.total() as f64 / (self.copy_gbps * 1e3)
    }
    /// The median step's read rate over the copy bandwidth.
    pub fn roofline_fraction(&self) -> f64 {
        self.bytes.total() as f64 / (self.p50_us() * 1e-6) / (self.copy_gbps * 1e9)
    }
}

/// One point of a run: its shape and what was measured.
pub struct DecodePoint {
    pub batch: usize,
    pub context: usize,
    /// Position of the first timed step.
    pub start: usize,
    pub summary: DecodeSummary,
}

/// Runs `megamoe decode` on `gpu`: every (batch, context) point on one load of the weights (planned for the
/// largest); prints each report and appends a row per point to decode.csv. `--parity` runs its one point instead.
/// The whole run is on this thread under `--dense-route` (`ops::dense::with_route`): every engine's dense
/// workspaces are carved, and so its linears routed, by it.
pub fn run(gpu: &Gpu, args: &DecodeArgs, default_out: PathBuf) -> Result<Vec<DecodePoint>> {
    crate::ops::dense::with_route(args.dense_route, || run_routed(gpu, args, default_out))
}

fn run_routed(gpu: &Gpu, args: &DecodeArgs, default_out: PathBuf) -> Result<Vec<DecodePoint>> {
    let cfg = resolve_model(&args.model)?;
    let free = free_device_bytes(gpu)?;
    // One plan serves every point: the one that leaves the fewest expert slots (the largest caches).
    let mut plan: Option<MemoryPlan> = None;
    for &(batch, context) in &args.points() {
        let req = PlanRequest {
            max_expert_slots: args.expert_slots,
            ..PlanRequest::new(batch, context, args.prompt_len.min(context), free)
        };
        let p = MemoryPlan::new(&cfg, &req).with_context(|| {
            format!(
                "planning {} at batch {batch}, context {context} on {}",
                cfg.name, gpu.info.name
            )
        })?;
        if plan.as_ref().is_none_or(|q| p.map.slots < q.map.slots) {
            plan = Some(p);
        }
    }
    let plan = plan.expect("at least one point");
    eprintln!("{}", plan.map);
    let out = args.out.clone().unwrap_or(default_out);
    if args.parity {
        run_parity_seeds(gpu, &plan, &cfg, args, &out)?;
        return Ok(Vec::new());
    }
    eprintln!("measuring the copy bandwidth ...");
    let copy_gbps = probe::best_copy_gbps(&probe::measure_copy(gpu, 1 << 30, 10)?);
    let weights = DeviceWeights::load(gpu, &plan, &WeightSource::Synthetic { seed: args.seed })?;
    crate::progress::catch_interrupt();
    let mut points = Vec::new();
    for (batch, context) in args.points() {
        if crate::progress::interrupted() {
            return Ok(points);
        }
        let shape = StepShape { batch, context };
        let mut engine = Engine::new(gpu, &weights, shape)?;
        engine.set_prefill_chunk(args.prefill_chunk)?;
        let prompts = crate::engine::run::synthetic_prompts(
            args.seed,
            batch,
            args.prompt_len,
            cfg.vocab_size,
        );
        let point = time_point(gpu, &mut engine, &plan, args, &prompts, copy_gbps)?;
        print_report(gpu, &plan, args, &point);
        append_csv(&out, gpu, &plan, args, &point)?;
        write_timeline(&out, &point, cfg.n_layers)?;
        points.push(point);
    }
    plot_sweeps(&out, &plan.config.name, &gpu.info.name, &points)?;
    Ok(points)
}

/// The sweeps as plots beside decode.csv, each measured line drawn with the byte floor's line: tokens/s (all
/// sequences) against the batch at each context swept over several batches, and the step time against the
/// context at each batch swept over several contexts. A run of fewer than two points along an axis draws
/// nothing for it.
fn plot_sweeps(
    dir: &std::path::Path,
    model: &str,
    gpu_name: &str,
    points: &[DecodePoint],
) -> Result<()> {
    let along = |fixed: &dyn Fn(&DecodePoint) -> usize, x: &dyn Fn(&DecodePoint) -> usize| {
        let mut groups: std::collections::BTreeMap<usize, Vec<&DecodePoint>> = Default::default();
        for p in points {
            groups.entry(fixed(p)).or_default().push(p);
        }
        groups.retain(|_, v| {
            v.sort_by_key(|p| x(p));
            v.dedup_by_key(|p| x(p));
            v.len() >= 2
        });
        groups
    };
    for (context, pts) in along(&|p| p.context, &|p| p.batch) {
        let measured = pts
            .iter()
            .map(|p| (p.batch as f64, p.summary.tokens_per_s() * p.batch as f64))
            .collect();
        let floor = pts
            .iter()
            .map(|p| (p.batch as f64, 1e6 / p.summary.floor_us() * p.batch as f64))
            .collect();
        against_floor(
            &dir.join(format!("decode-{model}-batch-at-{context}")),
            &format!("{model} decode on {gpu_name}: tokens/s against batch, context {context}"),
            ("batch (sequences)", "tokens/s, all sequences"),
            measured,
            floor,
            true,
        )?;
    }
    for (batch, pts) in along(&|p| p.batch, &|p| p.context) {
        let measured = pts
            .iter()
            .map(|p| (p.context as f64, p.summary.p50_us() / 1e3))
            .collect();
        let floor = pts
            .iter()
            .map(|p| (p.context as f64, p.summary.floor_us() / 1e3))
            .collect();
        against_floor(
            &dir.join(format!("decode-{model}-context-at-batch-{batch}")),
            &format!("{model} decode on {gpu_name}: step time against context, batch {batch}"),
            ("context (tokens)", "ms per step"),
            measured,
            floor,
            false,
        )?;
    }
    Ok(())
}

/// One sweep plot: the measured line beside the byte floor's line (log x; log y when `log_y`).
fn against_floor(
    stem: &std::path::Path,
    title: &str,
    (x_label, y_label): (&str, &str),
    measured: Vec<(f64, f64)>,
    floor: Vec<(f64, f64)>,
    log_y: bool,
) -> Result<()> {
    use crate::bench::plot::{plot_series, Series};
    let series = [
        Series {
            name: "measured (median step)".into(),
            points: measured,
        },
        Series {
            name: "byte floor at the copy bandwidth".into(),
            points: floor,
        },
    ];
    let (png, _) = plot_series(stem, title, x_label, y_label, &series, true, log_y)?;
    eprintln!("plot: {}", png.display());
    Ok(())
}

/// After a chunked prefill and the timed steps: one more chunk of sequence 0 (as many rows as the prefill's chunks,
/// tokens from its prompt, cycled) at its next position, profiled like the step, so the report can show where a
/// chunk's time goes. None when the prefill ran token by token or the context has no room left for the chunk.
fn profile_next_chunk(
    gpu: &Gpu,
    engine: &mut Engine,
    prompts: &[Vec<u32>],
) -> Result<Option<PrefillChunkProfile>> {
    let Some(rows) = engine.prefill_state.as_ref().map(|p| p.rows) else {
        return Ok(None);
    };
    let position = gpu.download(&engine.state.positions)?[0].max(0) as usize;
    if rows < 2 || position + rows > engine.state.shape.context {
        eprintln!(
            "prefill chunk profile: skipped ({rows} rows from position {position} in a context of {})",
            engine.state.shape.context
        );
        return Ok(None);
    }
    let p = &prompts[0];
    let toks: Vec<u32> = (0..rows).map(|i| p[i % p.len()]).collect();
    let (prof, spans) = engine.profile_prefill_chunk(gpu, 0, &toks, position)?;
    Ok(Some(PrefillChunkProfile {
        rows,
        position,
        groups: prof.groups,
        kernels: prof.kernels,
        trace: spans_or_say(spans, "the profiled prefill chunk"),
    }))
}

/// Steps a point runs after its timed ones: the profiled step (event marks) and the traced one (CUPTI).
const STEPS_AFTER_TIMED: usize = 2;

/// A trace's kernels, or none with the reason printed (a machine that cannot trace still runs the work).
fn spans_or_say(spans: Result<Vec<KernelSpan>>, what: &str) -> Vec<KernelSpan> {
    spans.unwrap_or_else(|e| {
        eprintln!("{what}: no kernel timeline ({e:#})");
        Vec::new()
    })
}

/// The first of the last `len` consecutive positions `<= last` at which no compressor of `cfg` emits an entry
/// (`(p + 1) % ratio != 0` for every ratio above 1), or `last + 1 - len` when there is no such run within a few
/// positions. Emission positions of the ratios in use (4 and 128, 128 a multiple of 4) are one in four, so a run
/// of up to 3 ends at most two positions below `last`. Saturates at 0.
pub fn quiet_run(cfg: &crate::model::ModelConfig, last: usize, len: usize) -> usize {
    let quiet = |p: usize| {
        cfg.compress_ratios
            .iter()
            .all(|&m| m <= 1 || !(p + 1).is_multiple_of(m))
    };
    let first_of = |end: usize| (end + 1).saturating_sub(len);
    (last.saturating_sub(8)..=last)
        .rev()
        .find(|&end| end + 1 >= len && (first_of(end)..=end).all(quiet))
        .map_or(first_of(last), first_of)
}

/// Which compressor ratios of `cfg` emit an entry at position `p` (ascending, each once).
fn emitting_ratios(cfg: &crate::model::ModelConfig, p: usize) -> Vec<usize> {
    let mut v: Vec<usize> = cfg
        .compress_ratios
        .iter()
        .copied()
        .filter(|&m| m > 1 && (p + 1).is_multiple_of(m))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// One point: prefill (or start at the end of the context), the timed steps, one profiled step, the checks.
fn time_point(
    gpu: &Gpu,
    engine: &mut Engine,
    plan: &MemoryPlan,
    args: &DecodeArgs,
    prompts: &[Vec<u32>],
    copy_gbps: f64,
) -> Result<DecodePoint> {
    let StepShape { batch, context } = engine.state.shape;
    // Every step samples: the first decode step, the timed steps and the profiled one.
    let params = SamplerParams::from_config(&SamplerConfig::greedy(), args.max_new_tokens + 2)?;
    let (start, ttft_s) = if args.at_context {
        // The profiled and the traced step (the last two) run where no compressor emits an entry: the steps most
        // positions are (HCA emits at 1 position in 128, CSA at 1 in 4), not the one where every layer pools.
        let start =
            quiet_run(&plan.config, context - 1, STEPS_AFTER_TIMED) - args.max_new_tokens - 1;
        eprintln!("batch {batch}, context {context}: starting at position {start} (zero KV entries and random indexer keys below it)");
        let first: Vec<u32> = prompts
            .iter()
            .map(|p| p.first().copied().unwrap_or(0))
            .collect();
        engine.start_at(gpu, start, &first, &params)?;
        (start + 1, None)
    } else {
        eprintln!(
            "batch {batch}, context {context}: prefill of {} prompt tokens, {}",
            args.prompt_len,
            prefill_how(args.prefill_chunk)
        );
        // No stop ids: every step of the timed run decodes every sequence.
        let pre = engine.prefill(gpu, prompts, &params, &[])?;
        (args.prompt_len, Some(pre.ttft_s))
    };
    let tpot = engine.timed_decode(gpu, args.max_new_tokens)?;
    let kernels = engine
        .decode_kernel_count()?
        .expect("timed_decode captures the step graph");
    let profile = if crate::progress::interrupted() {
        None
    } else {
        Some(engine.profile_step(gpu)?)
    };
    let (groups, kernel_profile, kernel_groups) = profile.map_or_else(
        || (Vec::new(), Vec::new(), Vec::new()),
        |p| (p.groups, p.kernels, p.kernel_groups),
    );
    let trace = if crate::progress::interrupted() {
        Vec::new()
    } else {
        spans_or_say(engine.trace_step(gpu)?, "the traced step")
    };
    // The traced step by the profiled step's groups (both at quiet positions: the same kernels in the same order).
    let traced_groups = crate::gpu::trace::by_group(&trace, &kernel_groups).unwrap_or_default();
    let prefill_profile = if ttft_s.is_some() && !crate::progress::interrupted() {
        profile_next_chunk(gpu, engine, prompts)?
    } else {
        None
    };
    let err = engine.state.read_error(&gpu.stream)?;
    ensure!(
        err == 0,
        "the decode steps set error bits {err:#x} (engine::step::ERR_*): the report would not be of valid steps"
    );
    // The floor at the median position of the timed steps.
    let mid = start + tpot.len() / 2;
    let profile_position = start + tpot.len();
    let positions = vec![mid; batch];
    Ok(DecodePoint {
        batch,
        context,
        start,
        summary: DecodeSummary {
            tpot_us: tpot,
            ttft_s,
            bytes: StepBytes::of(plan, &positions),
            copy_gbps,
            kernels,
            traced_groups: traced_groups
                .into_iter()
                .map(|(name, us, _)| {
                    let runs = groups.iter().find(|g| g.0 == name).map_or(0, |g| g.2);
                    let floor_us =
                        group_floor_bytes(plan, &name, &positions) as f64 / (copy_gbps * 1e3);
                    (name, us, runs, floor_us)
                })
                .collect(),
            profile: groups
                .into_iter()
                .map(|(name, us, n)| {
                    let floor_us =
                        group_floor_bytes(plan, &name, &positions) as f64 / (copy_gbps * 1e3);
                    (name, us, n, floor_us)
                })
                .collect(),
            kernel_profile,
            profile_position,
            trace,
            prefill_profile,
        },
    })
}

/// `--parity` over `--parity-seeds` seeds: [`run_parity`] for each (its own weights, engine and prompts), then, for
/// more than one, the spread of the distances (1 - mean cosine) over the seeds.
fn run_parity_seeds(
    gpu: &Gpu,
    plan: &MemoryPlan,
    cfg: &crate::model::ModelConfig,
    args: &DecodeArgs,
    out: &std::path::Path,
) -> Result<()> {
    crate::progress::catch_interrupt();
    let (batch, context) = (args.batch[0], args.context[0]);
    let mut summaries = Vec::new();
    for seed in (args.seed..).take(args.parity_seeds) {
        if crate::progress::interrupted() {
            break;
        }
        let weights = DeviceWeights::load(gpu, plan, &WeightSource::Synthetic { seed })?;
        let mut engine = Engine::new(gpu, &weights, StepShape { batch, context })?;
        engine.set_prefill_chunk(args.prefill_chunk)?;
        let prompts =
            crate::engine::run::synthetic_prompts(seed, batch, args.prompt_len, cfg.vocab_size);
        let s = run_parity(gpu, &mut engine, cfg, args, seed, &prompts, out)?;
        summaries.push((seed, s));
    }
    if summaries.len() > 1 {
        print_parity_spread(&summaries);
    }
    Ok(())
}

/// The distances (1 - mean cosine) of each seed's run and their ranges: the implementation (GPU vs CPU4) against
/// its floor (CPU4' vs CPU4) and the model's floor (CPU' vs CPU).
fn print_parity_spread(summaries: &[(u64, parity::ParitySummary)]) {
    let d = |c: f64| 1.0 - c;
    println!(
        "\n== parity over {} seeds: mean distance (1 - mean cosine) per seed ==",
        summaries.len()
    );
    println!(
        "{:>8} {:>14} {:>16} {:>7} {:>14} {:>12} {:>14}",
        "seed", "GPU vs CPU4", "CPU4' vs CPU4", "ratio", "CPU' vs CPU", "agree GPU", "agree floor"
    );
    for (seed, s) in summaries {
        let (g, f) = (d(s.mean_cos_gpu_formats), d(s.mean_cos_formats_floor));
        println!(
            "{seed:>8} {g:>14.3e} {f:>16.3e} {:>7.2} {:>14.3e} {:>9}/{:<2} {:>11}/{:<2}",
            g / f,
            d(s.mean_cos_floor),
            s.agree_gpu_formats,
            s.rows,
            s.agree_formats_floor,
            s.rows
        );
    }
    let range = |f: &dyn Fn(&parity::ParitySummary) -> f64| {
        summaries
            .iter()
            .map(|(_, s)| f(s))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
                (a.min(v), b.max(v))
            })
    };
    let (g0, g1) = range(&|s| d(s.mean_cos_gpu_formats));
    let (f0, f1) = range(&|s| d(s.mean_cos_formats_floor));
    let mean = |f: &dyn Fn(&parity::ParitySummary) -> f64| {
        summaries.iter().map(|(_, s)| f(s)).sum::<f64>() / summaries.len() as f64
    };
    let (gm, fm) = (
        mean(&|s| d(s.mean_cos_gpu_formats)),
        mean(&|s| d(s.mean_cos_formats_floor)),
    );
    println!(
        "GPU vs CPU4: mean distance {gm:.3e} (range {g0:.3e} .. {g1:.3e}); its floor CPU4' vs CPU4: {fm:.3e} \
         ({f0:.3e} .. {f1:.3e}); ratio of the means {:.2}; the GPU's mean {} the floor's range",
        gm / fm,
        if gm <= f1 { "is inside" } else { "is above" }
    );
}

/// `--parity` for one seed: [`parity::free_running`] against four CPU models on the same synthetic weights; prints
/// a per-step table and the summary, appends its rows to parity.csv.
fn run_parity(
    gpu: &Gpu,
    engine: &mut Engine,
    cfg: &crate::model::ModelConfig,
    args: &DecodeArgs,
    seed: u64,
    prompts: &[Vec<u32>],
    out: &std::path::Path,
) -> Result<parity::ParitySummary> {
    let set = parity::ParityModelSet::synthetic(cfg, seed)?;
    let models = set.models();
    let mut progress = Progress::new("parity", args.max_new_tokens);
    let rows = parity::free_running(gpu, engine, &models, prompts, args.max_new_tokens, |i| {
        progress.tick(&format!("step {}", i + 1))
    })?;
    println!(
        "\n== parity: {} on {} (batch {}, prompt {}, seed {seed}), GPU vs CPU models fed the GPU's tokens ==",
        cfg.name, gpu.info.name, args.batch[0], args.prompt_len
    );
    println!(
        "CPU: the model; CPU4: the model with the routed experts in the GPU's NVFP4 activations; CPU': the \
         model with its MoE summed in BF16 (the noise floor); CPU4': CPU4 with its MoE summed in BF16 (the floor of \
         the GPU-vs-CPU4 comparison)"
    );
    print!("{}", parity::table(&rows));
    let s = parity::ParitySummary::of(&rows);
    let line = |what: &str, min: f64, mean: f64, agree: usize| {
        println!(
            "{what:<44} min cosine {min:.6}, mean {mean:.6}, greedy agreement {agree}/{}",
            s.rows
        )
    };
    line("GPU vs CPU:", s.min_cos_gpu, s.mean_cos_gpu, s.agree_gpu);
    line(
        "GPU vs CPU4 (the implementation):",
        s.min_cos_gpu_formats,
        s.mean_cos_gpu_formats,
        s.agree_gpu_formats,
    );
    line(
        "CPU4 vs CPU (the NVFP4 activations' cost):",
        s.min_cos_formats,
        s.mean_cos_formats,
        s.agree_formats,
    );
    line(
        "CPU' vs CPU (the floor):",
        s.min_cos_floor,
        s.mean_cos_floor,
        s.agree_floor,
    );
    line(
        "CPU4' vs CPU4 (the floor of GPU vs CPU4):",
        s.min_cos_formats_floor,
        s.mean_cos_formats_floor,
        s.agree_formats_floor,
    );
    std::fs::create_dir_all(out)?;
    let path = out.join("parity.csv");
    // Appended: the seeds of a run, and runs, accumulate.
    let mut w = csv_appender(&path)?;
    for r in &rows {
        w.serialize(ParityCsvRow {
            git_commit: env::git_commit(),
            gpu: gpu.info.name.clone(),
            model: cfg.name.clone(),
            seed,
            step: r.step,
            seq: r.seq,
            cos_gpu_cpu: r.cos_gpu,
            cos_gpu_cpu_nvfp4: r.cos_gpu_formats,
            cos_cpu_nvfp4_cpu: r.cos_formats,
            cos_floor_cpu: r.cos_floor,
            gpu_token: r.gpu_token,
            cpu_argmax: r.cpu_token,
            cpu_nvfp4_argmax: r.formats_token,
            floor_argmax: r.floor_token,
            cos_floor_nvfp4: r.cos_formats_floor,
            floor_nvfp4_argmax: r.formats_floor_token,
        })?;
    }
    w.flush()?;
    eprintln!("appended {} rows to {}", rows.len(), path.display());
    Ok(s)
}

fn print_report(gpu: &Gpu, plan: &MemoryPlan, args: &DecodeArgs, p: &DecodePoint) {
    let (cfg, s) = (&plan.config, &p.summary);
    let (p50, p90, p99) = (
        s.p50_us(),
        s.tpot_quantile_us(0.9),
        s.tpot_quantile_us(0.99),
    );
    println!(
        "\n== decode: {} on {} (batch {}, context {}, timed steps from position {}) ==",
        cfg.name, gpu.info.name, p.batch, p.context, p.start,
    );
    println!("experts     {}", plan.map);
    println!(
        "dense       --dense-route {} (gemv: the CUDA-core GEMV for every dense linear; auto: cuBLASLt's tensor \
         cores where src/ops/dense/route.rs's rule says)",
        args.dense_route.name()
    );
    match s.ttft_s {
        Some(t) => println!(
            "TTFT        {t:.3} s ({} prompt tokens, {}; cold: module loads and graph capture included)",
            args.prompt_len,
            prefill_how(args.prefill_chunk)
        ),
        None => println!(
            "TTFT        - (started at position {} with synthetic caches: the steps read a full context's \
             bytes, not a real prompt's values)",
            p.start - 1
        ),
    }
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
        s.tokens_per_s() * p.batch as f64
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
        s.floor_us()
    );
    println!(
        "kernels     {} a step ({:.1} a layer over {} layers, with the embedding, head and sampler)",
        s.kernels,
        s.kernels as f64 / cfg.n_layers as f64,
        cfg.n_layers
    );
    let emitting = emitting_ratios(cfg, s.profile_position);
    let emits = if emitting.is_empty() {
        "no compressor emits an entry".to_string()
    } else {
        format!("the compressors of ratio {emitting:?} emit an entry")
    };
    print_profile(
        &format!(
            "one step at position {} ({emits}) by kernel group (a graph replay with an event after each group; {} \
             layers; floor = the group's bytes at the copy bandwidth)",
            s.profile_position, cfg.n_layers
        ),
        &s.profile,
    );
    if s.trace.is_empty() {
        print_kernel_profile("step", &s.kernel_profile);
    } else {
        print_timeline(
            &format!(
                "the next step (position {}) by kernel as the GPU ran it (a CUPTI kernel trace of one graph replay; \
                 nothing between the kernels; the timed steps' p50 is {:.1} us)",
                s.profile_position + 1,
                s.p50_us()
            ),
            &s.trace,
            cfg.n_layers,
        );
        if s.traced_groups.is_empty() {
            println!(
                "(no traced table by kernel group: the traced step's kernels do not line up with the profiled \
                 step's launches)"
            );
        }
        print_profile(
            "the traced step by kernel group (each kernel's share of the wall: the busy time it adds and the idle \
             time before it, so the groups add up to the wall; floor = the group's bytes at the copy bandwidth)",
            &s.traced_groups,
        );
    }
    if let Some(c) = &s.prefill_profile {
        print_chunk_profile(c, cfg.n_layers);
    }
}

/// A profiled run's groups of kernels (summed over the layers), in run order, each beside its byte floor at the copy
/// bandwidth of this run (a floor of 0, a group that reads no counted bytes or a run without floors, prints "-").
fn print_profile(title: &str, groups: &[(String, f64, usize, f64)]) {
    if groups.is_empty() {
        return;
    }
    let total: f64 = groups.iter().map(|g| g.1).sum();
    println!("\n{title}:");
    println!(
        "{:<74} {:>9} {:>5} {:>6} {:>9} {:>7}",
        "group", "us", "runs", "%", "floor us", "x floor"
    );
    for (name, us, n, floor) in groups {
        let (us, n, floor) = (*us, *n, *floor);
        let (floor, ratio) = if floor > 0.0 {
            (format!("{floor:.1}"), format!("{:.1}", us / floor))
        } else {
            ("-".into(), "-".into())
        };
        println!(
            "{name:<74} {us:>9.1} {n:>5} {:>5.1}% {floor:>9} {ratio:>7}",
            100.0 * us / total
        );
    }
    println!("{:<74} {total:>9.1}", "sum of groups");
}

/// The profiled prefill chunk: its groups in order without byte floors (a chunk's weight bytes are the step's, its
/// KV traffic is not), then its kernels.
fn print_chunk_profile(c: &PrefillChunkProfile, layers: usize) {
    let groups: Vec<(String, f64, usize, f64)> = c
        .groups
        .iter()
        .map(|(g, us, n)| (g.clone(), *us, *n, 0.0))
        .collect();
    print_profile(
        &format!(
            "one prefill chunk of {} rows of sequence 0 from position {} by kernel group (eager launches with an \
             event after each group; {layers} layers; run after the timed steps)",
            c.rows, c.position
        ),
        &groups,
    );
    if c.trace.is_empty() {
        print_kernel_profile("chunk", &c.kernels);
    } else {
        print_timeline(
            "the same chunk by kernel as the GPU ran it (a CUPTI kernel trace; its idle time includes the events \
             between the groups and the kernels)",
            &c.trace,
            layers,
        );
    }
}

/// The profiled step by kernel, the most time first: each entry point's time (from the end of the kernel before
/// it, so the launch gap counts) summed over its launches.
fn print_kernel_profile(what: &str, kernels: &[(String, f64, usize)]) {
    if kernels.is_empty() {
        return;
    }
    let total: f64 = kernels.iter().map(|k| k.1).sum();
    let mut sorted: Vec<&(String, f64, usize)> = kernels.iter().collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!(
        "\nthe same {what} by kernel (an event after every kernel; a kernel's time runs from the end of the one \
         before it, so the gap between them counts; the event nodes' own cost inflates both tables):"
    );
    println!(
        "{:<52} {:>9} {:>8} {:>10} {:>6}",
        "kernel", "us", "launches", "us/launch", "%"
    );
    for (name, us, n) in sorted {
        println!(
            "{name:<52} {us:>9.1} {n:>8} {:>10.2} {:>5.1}%",
            us / *n as f64,
            100.0 * us / total
        );
    }
    println!(
        "{:<52} {total:>9.1} {:>8}",
        format!("{what} (sum of kernels)"),
        kernels.iter().map(|k| k.2).sum::<usize>()
    );
}

/// A trace by kernel name: each kernel's own time as the GPU ran it, the idle time before its launches and the
/// time it overlapped earlier kernels, under the wall, busy and idle time of the whole.
fn print_timeline(title: &str, spans: &[KernelSpan], layers: usize) {
    let t = Timeline::of(spans);
    println!("\n{title}:");
    println!(
        "wall {:.1} us: kernels busy {:.1} us, idle {:.1} us ({:.2} us a launch over {} kernels, {:.1} a layer \
         over {layers} layers)",
        t.wall_us,
        t.busy_us,
        t.idle_us,
        t.idle_us / t.kernels.max(1) as f64,
        t.kernels,
        t.kernels as f64 / layers.max(1) as f64,
    );
    let mut rows: Vec<_> = t.by_name.iter().collect();
    rows.sort_by(|a, b| b.share_us().total_cmp(&a.share_us()));
    println!(
        "{:<52} {:>8} {:>9} {:>9} {:>9} {:>9} {:>6}",
        "kernel", "launches", "own us", "us/launch", "idle us", "overlap", "% wall"
    );
    for n in rows {
        let name: String = n.name.chars().take(52).collect();
        println!(
            "{name:<52} {:>8} {:>9.1} {:>9.2} {:>9.1} {:>9.1} {:>5.1}%",
            n.launches,
            n.own_us,
            n.own_us / n.launches as f64,
            n.idle_before_us,
            n.overlap_us,
            100.0 * n.share_us() / t.wall_us.max(1e-9)
        );
    }
}

/// The traced step's kernels as `timeline-b<batch>-c<context>.csv` beside decode.csv (gpu::trace::spans_csv), and
/// the profiled prefill chunk's as `timeline-prefill-b<batch>-c<context>.csv`, for each the run traced; each with a
/// plot (`.png` / `.svg`) of about two layers of it.
fn write_timeline(dir: &std::path::Path, p: &DecodePoint, layers: usize) -> Result<()> {
    let chunk = p.summary.prefill_profile.as_ref().map(|c| &c.trace[..]);
    for (what, spans) in [
        ("", &p.summary.trace[..]),
        ("prefill-", chunk.unwrap_or(&[])),
    ] {
        if spans.is_empty() {
            continue;
        }
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("timeline-{what}b{}-c{}.csv", p.batch, p.context));
        std::fs::write(&path, crate::gpu::trace::spans_csv(spans))
            .with_context(|| format!("writing {}", path.display()))?;
        // About two layers from the middle of the run, drawn: the gaps and overlaps the tables sum up.
        let per_layer = spans.len().div_ceil(layers.max(1));
        let k0 = (spans.len() / 2).saturating_sub(per_layer);
        let k1 = (k0 + 2 * per_layer).min(spans.len());
        let t0 = spans[k0].start_ns;
        let bars: Vec<TimelineBar> = spans[k0..k1]
            .iter()
            .map(|s| TimelineBar {
                group: kernel_family(&s.name).to_string(),
                start_us: (s.start_ns - t0) as f64 / 1e3,
                end_us: s.end_ns.saturating_sub(t0) as f64 / 1e3,
            })
            .collect();
        let (png, _) = plot_timeline(
            &dir.join(format!("timeline-{what}b{}-c{}", p.batch, p.context)),
            &format!(
                "{}batch {}, context {}: kernels {k0}..{k1} of {} (about two layers) as the GPU ran them",
                if what.is_empty() { "decode step, " } else { "prefill chunk, " },
                p.batch,
                p.context,
                spans.len()
            ),
            &bars,
        )?;
        println!(
            "wrote a kernel timeline to {} and {}",
            path.display(),
            png.display()
        );
    }
    Ok(())
}

/// The family a kernel's entry point belongs to, for a timeline's colours: our kernels by the prefix of their
/// family (kernels/<family>.cu), cuBLASLt's mangled C++ names as one.
fn kernel_family(name: &str) -> &str {
    const FAMILIES: [&str; 16] = [
        "dense",
        "moe_gemm",
        "mhc",
        "router",
        "sparse_attn",
        "attn",
        "qkv_prep",
        "compressor",
        "indexer",
        "rmsnorm",
        "quant",
        "sampler",
        "head",
        "ffn",
        "ep",
        "norm",
    ];
    if name.starts_with("_Z") || name.contains("xmma") || name.contains("cublas") {
        return "cuBLASLt";
    }
    FAMILIES
        .iter()
        .copied()
        .find(|f| name.starts_with(f))
        .unwrap_or_else(|| name.split('_').next().unwrap_or(name))
}

/// A CSV writer appending to `path`, the header written only into a new (or empty) file.
fn csv_appender(path: &std::path::Path) -> Result<csv::Writer<std::fs::File>> {
    let new = std::fs::metadata(path).map_or(true, |m| m.len() == 0);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    Ok(csv::WriterBuilder::new().has_headers(new).from_writer(file))
}

/// One row of parity.csv.
#[derive(serde::Serialize)]
struct ParityCsvRow {
    git_commit: String,
    gpu: String,
    model: String,
    seed: u64,
    step: usize,
    seq: usize,
    cos_gpu_cpu: f64,
    cos_gpu_cpu_nvfp4: f64,
    cos_cpu_nvfp4_cpu: f64,
    cos_floor_cpu: f64,
    gpu_token: u32,
    cpu_argmax: u32,
    cpu_nvfp4_argmax: u32,
    floor_argmax: u32,
    /// cos(CPU4', CPU4): the floor of the GPU-vs-CPU4 comparison (empty in rows from before it existed).
    cos_floor_nvfp4: f64,
    floor_nvfp4_argmax: u32,
}

/// The columns added at the end of decode.csv after its first rows were committed, in order.
const LATER_COLUMNS: [&str; 4] = ["pdl", "overlap_shared", "prefill_chunk", "dense_route"];

/// A decode.csv written before some of [`LATER_COLUMNS`] existed gets them, empty in its rows, so the rows appended
/// now line up with its header.
fn add_missing_columns(path: &std::path::Path) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let header = text.lines().next().unwrap_or("");
    if header.is_empty() {
        return Ok(());
    }
    let cols: Vec<&str> = header.split(',').collect();
    // How many of the later columns the header already ends with.
    let have = (0..=LATER_COLUMNS.len())
        .rev()
        .find(|&j| cols.ends_with(&LATER_COLUMNS[..j]))
        .unwrap_or(0);
    let missing = &LATER_COLUMNS[have..];
    if missing.is_empty() {
        return Ok(());
    }
    let empty = ",".repeat(missing.len());
    let mut out = String::with_capacity(text.len() + text.lines().count() * missing.len() + 32);
    for (i, line) in text.lines().enumerate() {
        out.push_str(line);
        if i == 0 {
            out.push(',');
            out.push_str(&missing.join(","));
        } else {
            out.push_str(&empty);
        }
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("adding columns to {}", path.display()))?;
    eprintln!(
        "{}: added the columns {} (empty in its earlier rows)",
        path.display(),
        missing.join(", ")
    );
    Ok(())
}

/// One row of decode.csv (one point of a run).
#[derive(serde::Serialize)]
struct DecodeCsvRow {
    timestamp: String,
    git_commit: String,
    gpu: String,
    model: String,
    batch: usize,
    context: usize,
    start_position: usize,
    prompt_len: usize,
    steps: usize,
    ttft_s: Option<f64>,
    tpot_p50_us: f64,
    tpot_p90_us: f64,
    tpot_p99_us: f64,
    tokens_per_s_seq: f64,
    tokens_per_s_total: f64,
    floor_bytes: u64,
    dense_bytes: u64,
    routed_bytes: u64,
    kv_bytes: u64,
    copy_gbps: f64,
    pct_copy_bw: f64,
    kernels_per_step: usize,
    expert_slots: usize,
    logical_experts: usize,
    /// `on` / `off`: programmatic dependent launch of every kernel. The variant lost its A/B and was removed, so
    /// new rows say `off`; the column stays for the rows that measured it (empty in rows from before it existed).
    pdl: &'static str,
    /// `on` / `off`: the shared expert on a second stream. The variant lost its A/B and was removed, so new rows
    /// say `off`; the column stays for the rows that measured it (and is empty in rows from before it existed).
    overlap_shared: &'static str,
    /// Prompt tokens per prefill chunk (`--prefill-chunk`; 1 = token by token); empty without a prompt
    /// (`--at-context`) and in rows written before the column existed (token by token then).
    prefill_chunk: Option<usize>,
    /// `gemv` / `auto` / `tensor-cores`: the dense linears' route (`--dense-route`); empty in rows written before the
    /// column existed (the GEMV then).
    dense_route: &'static str,
}

fn append_csv(
    dir: &std::path::Path,
    gpu: &Gpu,
    plan: &MemoryPlan,
    args: &DecodeArgs,
    p: &DecodePoint,
) -> Result<()> {
    let s = &p.summary;
    std::fs::create_dir_all(dir)?;
    let path = dir.join("decode.csv");
    if path.exists() {
        add_missing_columns(&path)?;
    }
    let mut w = csv_appender(&path)?;
    w.serialize(DecodeCsvRow {
        timestamp: env::timestamp_utc(),
        git_commit: env::git_commit(),
        gpu: gpu.info.name.clone(),
        model: plan.config.name.clone(),
        batch: p.batch,
        context: p.context,
        start_position: p.start,
        prompt_len: if s.ttft_s.is_some() {
            args.prompt_len
        } else {
            0
        },
        steps: s.tpot_us.len(),
        ttft_s: s.ttft_s,
        tpot_p50_us: s.p50_us(),
        tpot_p90_us: s.tpot_quantile_us(0.9),
        tpot_p99_us: s.tpot_quantile_us(0.99),
        tokens_per_s_seq: s.tokens_per_s(),
        tokens_per_s_total: s.tokens_per_s() * p.batch as f64,
        floor_bytes: s.bytes.total(),
        dense_bytes: s.bytes.dense,
        routed_bytes: s.bytes.routed,
        kv_bytes: s.bytes.kv,
        copy_gbps: s.copy_gbps,
        pct_copy_bw: 100.0 * s.roofline_fraction(),
        kernels_per_step: s.kernels,
        expert_slots: plan.map.slots,
        logical_experts: plan.map.logical,
        pdl: on_off_name(false),
        overlap_shared: on_off_name(false),
        prefill_chunk: s.ttft_s.map(|_| args.prefill_chunk),
        dense_route: args.dense_route.name(),
    })?;
    w.flush()?;
    eprintln!("appended a row to {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(batch: &[usize], context: &[usize]) -> DecodeArgs {
        DecodeArgs {
            model: "small".into(),
            batch: batch.to_vec(),
            context: context.to_vec(),
            at_context: true,
            prompt_len: 16,
            max_new_tokens: 8,
            seed: 1,
            out: None,
            parity: false,
            parity_seeds: 1,
            prefill_chunk: 64,
            dense_route: DenseRoute::Gemv,
            ranks: None,
            expert_slots: None,
        }
    }

    /// `--dense-route` takes gemv / auto / tensor-cores, auto by default.
    #[test]
    fn dense_route_defaults_to_auto() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            decode: DecodeArgs,
        }
        let parse =
            |a: &[&str]| Cli::try_parse_from(std::iter::once("decode").chain(a.iter().copied()));
        assert_eq!(parse(&[]).unwrap().decode.dense_route, DenseRoute::Auto);
        assert_eq!(
            parse(&["--dense-route", "auto"])
                .unwrap()
                .decode
                .dense_route,
            DenseRoute::Auto
        );
        assert_eq!(
            parse(&["--dense-route", "gemv"])
                .unwrap()
                .decode
                .dense_route,
            DenseRoute::Gemv
        );
        assert!(parse(&["--dense-route", "fast"]).is_err());
    }

    /// A decode.csv from before the later columns gets them (empty in the old rows); one with them is left alone.
    #[test]
    fn an_old_decode_csv_gets_the_later_columns() {
        let dir = std::env::temp_dir().join(format!("megamoe-decode-csv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("decode.csv");
        std::fs::write(&path, "a,b\n1,2\n3,\n").unwrap();
        add_missing_columns(&path).unwrap();
        let want = "a,b,pdl,overlap_shared,prefill_chunk,dense_route\n1,2,,,,\n3,,,,,\n";
        assert_eq!(std::fs::read_to_string(&path).unwrap(), want);
        add_missing_columns(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), want);
        // A file that has the first later column gets only the others.
        std::fs::write(&path, "a,pdl\n1,on\n").unwrap();
        add_missing_columns(&path).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "a,pdl,overlap_shared,prefill_chunk,dense_route\n1,on,,,\n"
        );
        // One written before the dense route's column gets that one only.
        std::fs::write(&path, "a,pdl,overlap_shared,prefill_chunk\n1,on,off,64\n").unwrap();
        add_missing_columns(&path).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "a,pdl,overlap_shared,prefill_chunk,dense_route\n1,on,off,64,\n"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The profiled and traced steps of an --at-context run land where no compressor emits: Flash's ratios are 4
    /// and 128, so at the end of a 4K context position 4095 (4096 = 32 x 128) emits in every compressed layer and
    /// 4092..=4094 in none.
    #[test]
    fn the_steps_after_the_timed_ones_avoid_emission_positions() {
        let cfg = crate::model::ModelConfig::flash();
        assert_eq!(emitting_ratios(&cfg, 4095), vec![4, 128]);
        assert_eq!(emitting_ratios(&cfg, 4091), vec![4]);
        assert!(emitting_ratios(&cfg, 4094).is_empty());
        assert_eq!(quiet_run(&cfg, 4095, 1), 4094);
        assert_eq!(quiet_run(&cfg, 4095, 2), 4093);
        assert_eq!(quiet_run(&cfg, 4095, 3), 4092);
        assert_eq!(quiet_run(&cfg, 4094, 2), 4093);
        // 4091 emits: the run of two ending at or below 4092 is 4089..=4090.
        assert_eq!(quiet_run(&cfg, 4092, 2), 4089);
        // Every context finds its run ending at most two positions below its last.
        for c in [4096usize, 32768, 131072, 1 << 20, 4097, 4099] {
            let p = quiet_run(&cfg, c - 1, STEPS_AFTER_TIMED);
            assert!(
                p + STEPS_AFTER_TIMED + 2 >= c && p + STEPS_AFTER_TIMED <= c,
                "context {c}: {p}"
            );
            for q in p..p + STEPS_AFTER_TIMED {
                assert!(emitting_ratios(&cfg, q).is_empty(), "context {c}: {q}");
            }
        }
        // A geometry without compressors: the last positions themselves; a context too short for the run: 0.
        let mut swa = cfg.clone();
        swa.compress_ratios.iter_mut().for_each(|m| *m = 0);
        assert_eq!(quiet_run(&swa, 4095, 2), 4094);
        assert_eq!(quiet_run(&swa, 0, 2), 0);
        // --at-context with the timed steps ending right before the run fits; one more step does not.
        let mut a = args(&[1], &[64]);
        a.max_new_tokens =
            quiet_run(&crate::model::ModelConfig::small(), 63, STEPS_AFTER_TIMED) - 1;
        assert!(a.check().is_ok());
        a.max_new_tokens += 1;
        assert!(a.check().is_err());
    }

    /// --expert-slots takes the activated experts up to every routed one, and not beside --ranks.
    #[test]
    fn expert_slots_are_checked_before_any_gpu_work() {
        let small = crate::model::ModelConfig::small();
        let mut a = args(&[1], &[256]);
        for (n, ok) in [
            (small.n_activated_experts - 1, false),
            (small.n_activated_experts, true),
            (small.n_routed_experts, true),
            (small.n_routed_experts + 1, false),
        ] {
            a.expert_slots = Some(n);
            assert_eq!(a.check().is_ok(), ok, "--expert-slots {n}");
        }
        a.expert_slots = Some(small.n_activated_experts);
        a.ranks = Some(2);
        a.at_context = false;
        assert!(a.check().is_err(), "--expert-slots with --ranks");
    }

    /// --parity-seeds belongs to --parity and counts at least one seed.
    #[test]
    fn parity_seeds_need_parity() {
        let mut a = args(&[1], &[256]);
        a.parity_seeds = 3;
        assert!(a.check().is_err(), "--parity-seeds without --parity");
        a.parity = true;
        a.at_context = false;
        assert!(a.check().is_ok());
        a.parity_seeds = 0;
        assert!(a.check().is_err());
    }

    #[test]
    fn kernels_fall_into_their_families() {
        for (name, family) in [
            ("dense_fp8_m8", "dense"),
            ("moe_gemm_decode_f16_operands_nt1", "moe_gemm"),
            ("mhc_post_mix_partial24_pdl", "mhc"),
            ("attn_candidates", "attn"),
            ("sparse_attn_decode_fp8", "sparse_attn"),
            ("_ZN8cublasLt19splitKreduce_kernelILi32E", "cuBLASLt"),
            ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n", "cuBLASLt"),
            ("weights_fill_fp8_codes", "weights"),
        ] {
            assert_eq!(kernel_family(name), family, "{name}");
        }
    }

    #[test]
    fn sweeps_are_l_shaped() {
        assert_eq!(args(&[1], &[4096]).points(), vec![(1, 4096)]);
        assert_eq!(
            args(&[1], &[4096, 32768]).points(),
            vec![(1, 4096), (1, 32768)]
        );
        assert_eq!(
            args(&[1, 8, 64], &[4096, 131072]).points(),
            vec![(1, 4096), (1, 131072), (8, 4096), (64, 4096)]
        );
    }

    /// At the end of a context the run takes max_new_tokens + 2 positions (the start step, the timed steps, the
    /// profiled one): 8 new tokens need a context of 10.
    #[test]
    fn every_context_must_hold_the_timed_steps() {
        // --at-context, 8 timed steps: the first decode step, the timed ones, then the profiled and traced steps at
        // two quiet positions (small's ratios are 4 and 128: 9..=10 for a context of 11; 10 has none late enough).
        assert!(args(&[1], &[4096, 10]).check().is_err());
        assert!(args(&[1], &[4096, 11]).check().is_ok());
        let mut prompt = args(&[1], &[26]);
        prompt.at_context = false;
        // A prompt of 16 + 8 timed steps + the profiled and traced ones: 26 positions.
        assert!(prompt.check().is_ok());
        prompt.context = vec![25];
        assert!(prompt.check().is_err());
    }
}
