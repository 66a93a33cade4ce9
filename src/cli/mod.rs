//! The `megamoe` command line. Every command returns an error (never panics) when something is missing: no
//! GPU, a bad config, a missing or mis-shaped tensor.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

mod decode;
mod generate;
mod trace_diff;

use crate::bench::config::SweepConfig;
use crate::bench::runner::{self, RunOptions};
use crate::bench::{csv_out, probe, Limits, Row};
use crate::gpu::{module, telemetry, Gpu};

#[derive(Parser)]
#[command(
    name = "megamoe",
    version,
    about = "Kernel lab for DeepSeek-V4-class MoE inference on NVIDIA Hopper (H100/H200, sm_90a)",
    long_about = "Kernel lab for DeepSeek-V4-class MoE inference on NVIDIA Hopper (sm_90a).\n\n\
With no command, runs the default benchmark suite on GPU 0: measures the limits (copy bandwidth, BF16/FP8 \
matmul rates), runs every sweep of the embedded bench-configs/default.toml, writes CSV, plots and \
REPORT.md under results/<gpu>/, and ends with a decode report of the whole DSV4-Flash model at batch 1 \
(`megamoe decode`).\n\nExamples:\n  megamoe info\n  megamoe kernels\n  megamoe limits\n  \
megamoe bench --config bench-configs/norm_quant.toml --reps 20\n  megamoe exec nvfp4_quantize_rows --in x.safetensors --out q.safetensors --cpu\n  \
megamoe report --dir results/h200\n  megamoe trace-diff base/timeline-b1-c4096.csv cand/timeline-b1-c4096.csv\n  megamoe decode --model flash --batch 1 --context 4096\n  megamoe generate \"Hello\" --model small"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// GPU ordinal.
    #[arg(long, global = true, default_value_t = 0)]
    gpu: usize,
}

#[derive(Subcommand)]
enum Command {
    /// The main job: limits, every sweep of the embedded default config, report, then a decode report of the
    /// whole Flash model at batch 1 (`megamoe decode` with its defaults).
    Run(BenchArgs),
    /// Device, driver, clocks, power and the kernels embedded in this binary.
    Info,
    /// Each kernel entry point with registers, shared memory and spill bytes (from ptxas; no GPU needed).
    Kernels,
    /// Measure the denominators: HBM copy bandwidth and BF16 / FP8 dense matmul rates (cuBLASLt).
    Limits {
        /// Directory for limits.csv (default: results/<gpu>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Smaller buffers and fewer reps (for a quick look, not for reports).
        #[arg(long)]
        quick: bool,
    },
    /// Run benchmark sweeps from a TOML config (default: the embedded default suite).
    Bench(BenchArgs),
    /// Rebuild plots and REPORT.md from the CSVs of a results directory.
    Report {
        #[arg(long, default_value = "results/h200")]
        dir: PathBuf,
        /// Variants the plots draw: `headline` (each kernel's routed kernel and the baselines its targets
        /// name), `all`, or a comma-separated list. Tables and CSVs always keep every variant.
        #[arg(long, default_value = "headline")]
        variants: crate::bench::report::PlotVariants,
    },
    /// Stress tests: deadlock and edge-size suites, each launch under a host-side watchdog.
    Stress {
        #[command(subcommand)]
        suite: StressSuite,
    },
    /// Decode the whole model on the GPU (synthetic weights) and report TTFT, TPOT p50/p90/p99 and tokens/s
    /// against the byte floor of a step and the copy bandwidth measured in the same run; appends a row to
    /// decode.csv. Bad requests (a prompt longer than the context, caches or experts that do not fit, an unknown
    /// model) fail before any GPU work.
    Decode(decode::DecodeArgs),
    /// Chat with the model on the GPU: the prompt through the chat template and DeepSeek-V4's tokenizer, the
    /// reply streamed as it is sampled (temperature, top-k, top-p, repetition penalty), then the stop reason,
    /// TTFT and tokens/s. Ctrl-C stops after the current token.
    Generate(generate::GenerateArgs),
    /// Compare two traced steps (`timeline-*.csv`, written by `megamoe decode`; e.g. an A/B's baseline and
    /// candidate): each kernel's share of the wall in both (its wall advance: the busy time it added, its own time
    /// less its overlap with earlier kernels, and the idle time before it; the shares add up to the wall), largest
    /// move first; when both steps ran the same launches in the same order, also the launches that moved most.
    /// No GPU needed.
    TraceDiff {
        /// The baseline's timeline CSV.
        base: PathBuf,
        /// The candidate's timeline CSV.
        candidate: PathBuf,
        /// Rows of each table.
        #[arg(long, default_value_t = 20)]
        top: usize,
    },
    /// Run one kernel (or, with --cpu, its CPU reference) on tensors from a safetensors file.
    Exec {
        /// Kernel name; `megamoe exec --list` shows them with their tensor names, dtypes and shapes.
        kernel: Option<String>,
        #[arg(long = "in")]
        input: Option<PathBuf>,
        #[arg(long = "out")]
        output: Option<PathBuf>,
        /// Run the CPU reference instead of the GPU kernel (no GPU needed).
        #[arg(long)]
        cpu: bool,
        /// List the kernels exec knows.
        #[arg(long)]
        list: bool,
    },
}

#[derive(Subcommand)]
enum StressSuite {
    /// Lightning indexer logits + top-k: every num_valid in 0..=N, random lengths up to 262,144 (1M context),
    /// num_valid around k and multiples of 128, all-equal scores, zero ReLU rows, NaN/-inf policy; every
    /// result compared with the CPU reference. A launch that does not finish within the watchdog is reported
    /// as a hang with its parameters and the process exits (code 3) without waiting on the GPU.
    Indexer {
        /// Write stress-indexer.txt here.
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value_t = 0x1DE7)]
        seed: u64,
        /// Every num_valid in 0..=N (default 4096; 700 with --quick).
        #[arg(long)]
        exhaustive_max: Option<usize>,
        /// How many random lengths (default 24; 3 with --quick).
        #[arg(long)]
        random_cases: Option<usize>,
        /// Largest random length (default 262,144 = 1M context; 80,000 with --quick).
        #[arg(long)]
        random_max: Option<usize>,
        /// Largest end-to-end (logits + top-k) sequence (default 262,144; 40,000 with --quick).
        #[arg(long)]
        e2e_max: Option<usize>,
        /// Watchdog per launch group, milliseconds.
        #[arg(long, default_value_t = 2000)]
        watchdog_ms: u64,
        /// A few-second subset (for sanitizer runs).
        #[arg(long)]
        quick: bool,
    },
}

#[derive(clap::Args, Clone)]
struct BenchArgs {
    /// Sweep config (TOML, schema in bench-configs/default.toml). Default: the embedded default suite.
    #[arg(long)]
    config: Vec<PathBuf>,
    /// Only these kernels (repeatable).
    #[arg(long)]
    kernel: Vec<String>,
    /// Output directory (default: results/<gpu>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Override the timed repetitions of every sweep.
    #[arg(long)]
    reps: Option<u32>,
    /// Seed of the random inputs (printed; rows are reproducible with it).
    #[arg(long, default_value_t = 0x5EED)]
    seed: u64,
    /// Use the embedded default suite plus every bench-configs/*.toml next to the binary or in the repo.
    #[arg(long)]
    all_configs: bool,
    /// Leave L2 warm between repetitions (no sweep flushes it): each point's time with its working set left in L2
    /// by the repetition before, beside a flushed run the most that keeping its bytes in L2 could buy. Needs --out
    /// (the rows carry no mark of it).
    #[arg(long)]
    warm_l2: bool,
}

fn open_gpu(ordinal: usize) -> Result<Gpu> {
    Gpu::open(ordinal).context("this command needs an NVIDIA Hopper GPU")
}

pub fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Run(BenchArgs {
        config: vec![],
        kernel: vec![],
        out: None,
        reps: None,
        seed: 0x5EED,
        all_configs: false,
        warm_l2: false,
    })) {
        Command::Info => info(cli.gpu),
        Command::Kernels => kernels(),
        Command::Limits { out, quick } => {
            let gpu = open_gpu(cli.gpu)?;
            let out = out.unwrap_or_else(|| default_out(&gpu));
            measure_limits(&gpu, &out, quick).map(|_| ())
        }
        Command::Run(args) => {
            let decode = main_job_decode();
            decode.check()?;
            bench(cli.gpu, args.clone())?;
            // The main job ends with the lab's headline: the whole Flash model decoding at batch 1.
            let gpu = open_gpu(cli.gpu)?;
            let out = args.out.clone().unwrap_or_else(|| default_out(&gpu));
            decode::run(&gpu, &decode, out).map(|_| ())
        }
        Command::Bench(args) => bench(cli.gpu, args),
        Command::Stress { suite } => stress(cli.gpu, suite),
        Command::Decode(args) => {
            args.check()?;
            if args.ranks.is_some() {
                return decode::run_ranks(&args, cli.gpu);
            }
            let gpu = open_gpu(cli.gpu)?;
            let out = args.out.clone().unwrap_or_else(|| default_out(&gpu));
            decode::run(&gpu, &args, out).map(|_| ())
        }
        Command::Generate(args) => {
            let tok = crate::model::tokenizer::Tokenizer::dsv4()?;
            let prompt = args.check(&tok)?;
            let gpu = open_gpu(cli.gpu)?;
            generate::run(&gpu, &args, &tok, prompt)
        }
        Command::Report { dir, variants } => {
            let p = crate::bench::report::report_from_csv_dir_with(&dir, &variants)?;
            println!("wrote {}", p.display());
            Ok(())
        }
        Command::TraceDiff {
            base,
            candidate,
            top,
        } => trace_diff::run(&base, &candidate, top),
        Command::Exec {
            kernel,
            input,
            output,
            cpu,
            list,
        } => exec(cli.gpu, kernel, input, output, cpu, list),
    }
}

/// The main job's closing decode report: the Flash geometry at batch 1, a 4K context, a short prompt and 64
/// timed steps.
fn main_job_decode() -> decode::DecodeArgs {
    decode::DecodeArgs {
        model: "flash".into(),
        batch: vec![1],
        context: vec![4096],
        at_context: false,
        prompt_len: 16,
        max_new_tokens: 64,
        seed: 0x5EED,
        out: None,
        parity: false,
        parity_seeds: 1,
        prefill_chunk: crate::engine::prefill::DEFAULT_PREFILL_CHUNK,
        // The GEMV, `megamoe decode`'s default, until a GPU run has checked and measured the tensor-core route.
        dense_route: crate::ops::dense::route::DEFAULT_ROUTE,
        ranks: None,
        expert_slots: None,
    }
}

fn default_out(gpu: &Gpu) -> PathBuf {
    crate::bench::report::results_dir_for_gpu(Path::new("results"), &gpu.info.name)
}

fn info(ordinal: usize) -> Result<()> {
    let gpu = open_gpu(ordinal)?;
    let i = &gpu.info;
    println!("device        {} (GPU {})", i.name, i.ordinal);
    println!(
        "compute cap   {}.{}",
        i.compute_capability.0, i.compute_capability.1
    );
    println!("SMs           {}", i.sm_count);
    println!(
        "memory        {:.1} GiB",
        i.total_mem_bytes as f64 / (1u64 << 30) as f64
    );
    println!(
        "L2            {:.1} MiB",
        i.l2_bytes as f64 / (1u64 << 20) as f64
    );
    println!(
        "smem/block    {} KiB (opt-in)",
        i.max_smem_per_block_optin / 1024
    );
    if let Some(v) = i.driver_version {
        println!("CUDA driver   {}.{}", v / 1000, (v % 1000) / 10);
    }
    let t = telemetry::Telemetry::new(ordinal as u32);
    if t.available() {
        let r = t.read();
        let f = |v: Option<String>| v.unwrap_or_else(|| "n/a".into());
        println!("driver        {}", f(r.driver));
        println!(
            "SM clock      {} MHz (max {})",
            f(r.sm_clock_mhz.map(|v| v.to_string())),
            f(r.max_sm_clock_mhz.map(|v| v.to_string()))
        );
        println!(
            "mem clock     {} MHz",
            f(r.mem_clock_mhz.map(|v| v.to_string()))
        );
        println!(
            "power         {} W (limit {})",
            f(r.power_w.map(|v| format!("{v:.0}"))),
            f(r.power_limit_w.map(|v| format!("{v:.0}")))
        );
        println!("temperature   {} C", f(r.temp_c.map(|v| v.to_string())));
        println!("throttle      {}", f(r.throttle_reasons));
    } else {
        println!("NVML          not available (no libnvidia-ml.so.1): no clocks/power/temperature");
    }
    println!("git commit    {}", crate::bench::env::git_commit());
    for k in module::KERNEL_SOURCES {
        let how = if k.cubin.is_some() {
            "sm_90a cubin"
        } else {
            "source (NVRTC at run time)"
        };
        // Loading proves the embedded module matches this device and driver.
        let status = match gpu.kernel(k.name, k.functions.first().copied().unwrap_or("")) {
            Ok(_) => "loads".to_string(),
            Err(e) => format!("FAILED to load: {e:#}"),
        };
        println!(
            "kernels       {:<16} {how}, {} entry points, {status}",
            k.name,
            k.functions.len()
        );
    }
    Ok(())
}

fn kernels() -> Result<()> {
    println!(
        "{:<16} {:<44} {:>5} {:>8} {:>7} {:>7}  source",
        "family", "entry point", "regs", "smem B", "stack", "spill"
    );
    let mut any_spill = false;
    for (k, fns) in module::inventory() {
        let how = if k.cubin.is_some() { "cubin" } else { "nvrtc" };
        for name in k.functions {
            let p = fns.iter().find(|f| f.name == *name);
            let s = |v: Option<u32>| v.map_or("-".into(), |v| v.to_string());
            let spill =
                p.map(|p| p.spill_store_bytes.unwrap_or(0) + p.spill_load_bytes.unwrap_or(0));
            any_spill |= spill.unwrap_or(0) > 0;
            println!(
                "{:<16} {:<44} {:>5} {:>8} {:>7} {:>7}  {how}",
                k.name,
                name,
                s(p.and_then(|p| p.registers)),
                s(p.and_then(|p| p.smem_bytes)),
                s(p.and_then(|p| p.stack_bytes)),
                s(spill)
            );
        }
    }
    if module::KERNEL_SOURCES.iter().any(|k| k.cubin.is_none()) {
        println!("(built without nvcc: resources unknown; run scripts/install-nvcc.sh and rebuild with NVCC set)");
    }
    if any_spill {
        println!("warning: some kernels spill registers to local memory");
    }
    Ok(())
}

/// Measure and record the limits (limits.csv, same schema as every sweep).
pub fn measure_limits(gpu: &Gpu, out: &Path, quick: bool) -> Result<Limits> {
    let cfg = if quick {
        probe::ProbeConfig {
            copy_bytes: 256 << 20,
            gemm_mnk: 4096,
            reps: 5,
        }
    } else {
        probe::ProbeConfig::default()
    };
    eprintln!(
        "measuring limits (copy {} MiB, GEMM {}^3, {} reps) ...",
        cfg.copy_bytes >> 20,
        cfg.gemm_mnk,
        cfg.reps
    );
    let (limits, results) = probe::measure(gpu, cfg, 0x11A175)?;
    let nvml = telemetry::Telemetry::new(gpu.info.ordinal as u32).read();
    let tel = crate::bench::Telemetry {
        gpu: gpu.info.name.clone(),
        sm_clock_mhz: nvml.sm_clock_mhz,
        mem_clock_mhz: nvml.mem_clock_mhz,
        power_w: nvml.power_w,
        temp_c: nvml.temp_c,
    };
    let mut rows: Vec<Row> = Vec::new();
    for r in &results {
        println!(
            "{:<12} {:>10.1} {:<7} median {:>9.1} us (p10 {:.1}, p90 {:.1})  {}",
            r.name, r.value, r.unit, r.us.median, r.us.p10, r.us.p90, r.method
        );
        let mut row = Row::new("limits", r.name, &r.method)
            .with_timing(&r.us, cfg.reps as u64)
            .with_telemetry(&tel);
        row = row.with_limits(&limits, crate::bench::MatmulKind::NotMatmul);
        if r.unit == "GB/s" {
            row.gbps = Some(r.value);
            row.bytes = Some(2 * cfg.copy_bytes as u64);
        } else {
            row.tflops = Some(r.value);
            row.flops = Some(2 * (cfg.gemm_mnk as u64).pow(3));
        }
        row.git_commit = crate::bench::env::git_commit();
        row.timestamp = crate::bench::env::timestamp_utc();
        rows.push(row);
    }
    std::fs::create_dir_all(out)?;
    csv_out::write_rows(&out.join("limits.csv"), &rows)?;
    Ok(limits)
}

fn bench(ordinal: usize, args: BenchArgs) -> Result<()> {
    // Each config with the name its errors give it.
    let mut configs: Vec<(String, SweepConfig)> = Vec::new();
    if args.config.is_empty() || args.all_configs {
        configs.push((
            "the embedded bench-configs/default.toml".into(),
            crate::bench::config::default_config()?,
        ));
    }
    for p in &args.config {
        configs.push((p.display().to_string(), SweepConfig::from_path(p)?));
    }
    if args.all_configs {
        for dir in [
            PathBuf::from("bench-configs"),
            std::env::current_exe()?.with_file_name("bench-configs"),
        ] {
            if let Ok(rd) = std::fs::read_dir(&dir) {
                let mut files: Vec<PathBuf> = rd
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.extension().is_some_and(|e| e == "toml") && !p.ends_with("default.toml")
                    })
                    .collect();
                files.sort();
                for f in files {
                    configs.push((f.display().to_string(), SweepConfig::from_path(&f)?));
                }
                break;
            }
        }
    }
    let mut opts = RunOptions {
        out_dir: args.out.clone().unwrap_or_default(),
        kernels: args.kernel.clone(),
        reps: args.reps,
        seed: args.seed,
        warm_l2: args.warm_l2,
        out_named: args.out.is_some(),
    };
    // Every config error (file, schema, kernel, variant, parameter, size, options) before the GPU is touched.
    runner::check(&configs, &opts)?;
    let gpu = open_gpu(ordinal)?;
    let out = args.out.clone().unwrap_or_else(|| default_out(&gpu));
    opts.out_dir = out.clone();
    let limits = measure_limits(&gpu, &out, false)?;
    eprintln!("seed {:#x}; results -> {}", args.seed, out.display());
    let mut result = Ok(());
    for (_, c) in &configs {
        if let Err(e) = runner::run(&gpu, c, &limits, &opts) {
            eprintln!("error: {e:#}");
            result = Err(e);
        }
    }
    let report = runner::report_dir(&out)?;
    println!("report: {}", report.display());
    result
}

fn exec(
    ordinal: usize,
    kernel: Option<String>,
    input: Option<PathBuf>,
    output: Option<PathBuf>,
    cpu: bool,
    list: bool,
) -> Result<()> {
    let all = crate::ops::registry::exec_kernels();
    if list || kernel.is_none() {
        println!("kernels for `megamoe exec <kernel> --in IN.safetensors --out OUT.safetensors [--cpu]`:\n");
        for k in &all {
            println!("  {}\n      {}\n", k.name, k.doc);
        }
        if kernel.is_none() && !list {
            bail!("no kernel given");
        }
        return Ok(());
    }
    let kernel = kernel.unwrap();
    let input = input.context("--in IN.safetensors is required")?;
    let output = output.context("--out OUT.safetensors is required")?;
    // Name and path errors before the GPU is opened.
    crate::ops::registry::find(&kernel)?;
    crate::ops::registry::check_paths(&input, &output)?;
    let gpu = if cpu { None } else { Some(open_gpu(ordinal)?) };
    let unread = crate::ops::registry::run_exec(&kernel, &input, &output, gpu.as_ref())?;
    if !unread.is_empty() {
        eprintln!(
            "warning: `{kernel}` did not read {} tensor(s) of {}: {} (misnamed? `megamoe exec --list` shows what it reads)",
            unread.len(),
            input.display(),
            unread
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    println!(
        "wrote {} ({})",
        output.display(),
        if cpu { "CPU reference" } else { "GPU" }
    );
    Ok(())
}

fn stress(ordinal: usize, suite: StressSuite) -> Result<()> {
    use crate::ops::indexer::stress::{run_stress, StressOptions};
    let StressSuite::Indexer {
        out,
        seed,
        exhaustive_max,
        random_cases,
        random_max,
        e2e_max,
        watchdog_ms,
        quick,
    } = suite;
    let mut opts = if quick {
        StressOptions::quick(seed)
    } else {
        StressOptions {
            seed,
            ..Default::default()
        }
    };
    opts.exhaustive_max = exhaustive_max.unwrap_or(opts.exhaustive_max);
    opts.random_cases = random_cases.unwrap_or(opts.random_cases);
    opts.random_max = random_max.unwrap_or(opts.random_max);
    opts.e2e_max = e2e_max.unwrap_or(opts.e2e_max);
    opts.watchdog = std::time::Duration::from_millis(watchdog_ms);
    let gpu = open_gpu(ordinal)?;
    eprintln!(
        "indexer stress: num_valid 0..={}, {} random up to {}, k {:?}, watchdog {} ms",
        opts.exhaustive_max, opts.random_cases, opts.random_max, opts.ks, watchdog_ms
    );
    let report = run_stress(&gpu, &opts)?;
    let text = report.summary();
    print!("{text}");
    if let Some(dir) = out {
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("stress-indexer.txt"), &text)?;
    }
    if report.hung.is_some() {
        // The GPU may still be running the hung kernel: synchronizing (or dropping the context) would block.
        eprintln!("error: a launch exceeded the watchdog; exiting without waiting for the GPU");
        std::process::exit(3);
    }
    if !report.passed() {
        bail!("indexer stress: {} failure(s)", report.failures.len());
    }
    Ok(())
}
