//! The command line as a user meets it: clear errors and non-zero exits (never a panic) without a GPU, for bad
//! configs, missing files and mis-typed tensors; `exec --cpu` round trips through safetensors.

use std::path::{Path, PathBuf};
use std::process::Command;

use megamoe::ops::exec::{read_safetensors, write_safetensors, HostTensor, TensorMap};

mod common;

/// The binary: cargo's build of it, or `$MEGAMOE_BIN` (test executables copied to the GPU machine).
fn bin() -> PathBuf {
    if let Ok(p) = std::env::var("MEGAMOE_BIN") {
        return PathBuf::from(p);
    }
    PathBuf::from(env!("CARGO_BIN_EXE_megamoe"))
}

fn run(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(bin())
        .args(args)
        .output()
        .expect("running megamoe");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("megamoe-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn info_works_with_a_gpu_and_every_gpu_command_fails_clearly_without_one() {
    if megamoe::gpu::probe_error().is_none() {
        let (code, out, err) = run(&["info"]);
        assert_eq!(code, 0, "megamoe info with a GPU: {err}");
        assert!(out.contains("compute cap"), "{out}");
        return;
    }
    for args in [&[][..], &["info"][..], &["limits"][..]] {
        let (code, _out, err) = run(args);
        assert_ne!(code, 0, "megamoe {args:?} must exit non-zero without a GPU");
        assert!(
            !err.contains("panicked"),
            "megamoe {args:?} panicked: {err}"
        );
        assert!(
            err.contains("needs an NVIDIA Hopper GPU"),
            "megamoe {args:?}: unclear error: {err}"
        );
    }
}

#[test]
fn kernels_lists_every_family() {
    let (code, out, err) = run(&["kernels"]);
    assert_eq!(code, 0, "{err}");
    for k in megamoe::gpu::KERNEL_SOURCES {
        assert!(
            out.contains(k.name),
            "kernels output lacks {}: {out}",
            k.name
        );
    }
    assert!(out.contains("nvfp4_quantize_rows_bf16"), "{out}");
}

#[test]
fn bad_config_is_reported_before_touching_the_gpu() {
    let p = tmp("bad.toml");
    std::fs::write(
        &p,
        "[[sweep]]\nkernel = \"copy\"\naxis = \"bytes\"\nvalues = [\n",
    )
    .unwrap();
    let (code, _o, err) = run(&["bench", "--config", p.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(
        err.contains("bad.toml"),
        "error should name the file: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let (code, _o, err) = run(&["bench", "--config", "/nonexistent/x.toml"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/x.toml"), "{err}");
    // --warm-l2 rows must not land among the flushed rows of results/<gpu>: refused without --out, before any GPU.
    let (code, _o, err) = run(&["bench", "--config", "bench-configs/dense.toml", "--warm-l2"]);
    assert_ne!(code, 0);
    assert!(err.contains("--warm-l2") && err.contains("--out"), "{err}");
}

#[test]
fn exec_cpu_round_trip_and_bad_tensors() {
    let rows = 3;
    let cols = 48;
    let x = megamoe::ops::inputs::activation_rows(rows, cols, 7);
    let mut m = TensorMap::new();
    m.insert("x".into(), HostTensor::from_f32(vec![rows, cols], &x));
    let inp = tmp("x.safetensors");
    write_safetensors(&inp, &m).unwrap();
    let q = tmp("q.safetensors");
    let (code, _o, err) = run(&[
        "exec",
        "nvfp4_quantize_rows",
        "--in",
        inp.to_str().unwrap(),
        "--out",
        q.to_str().unwrap(),
        "--cpu",
    ]);
    assert_eq!(code, 0, "{err}");
    let out = read_safetensors(&q).unwrap();
    let expect = megamoe::formats::nvfp4::quantize_rows(&x, rows, cols).unwrap();
    assert_eq!(out["data"].bytes, expect.data);
    assert_eq!(out["scales"].bytes, expect.scales);
    assert_eq!(out["global_scale"].shape, vec![rows]);
    // dequantize the file we just wrote
    let y = tmp("y.safetensors");
    let (code, _o, err) = run(&[
        "exec",
        "nvfp4_dequantize_rows",
        "--in",
        q.to_str().unwrap(),
        "--out",
        y.to_str().unwrap(),
        "--cpu",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(read_safetensors(&y).unwrap()["y"].shape, vec![rows, cols]);

    // wrong name, wrong dtype, wrong shape, missing file, truncated file: clear errors, no output written
    let mut bad = TensorMap::new();
    bad.insert("y".into(), HostTensor::from_f32(vec![rows, cols], &x));
    let p = tmp("bad_name.safetensors");
    write_safetensors(&p, &bad).unwrap();
    assert!(quantize_error(&p, "o1").contains("needs an input tensor `x`"));
    let mut bad = TensorMap::new();
    bad.insert(
        "x".into(),
        HostTensor::from_u8(
            safetensors::Dtype::U8,
            vec![rows, cols],
            vec![1; rows * cols],
        ),
    );
    let p = tmp("bad_dtype.safetensors");
    write_safetensors(&p, &bad).unwrap();
    assert!(quantize_error(&p, "o2").contains("dtype"));
    let mut bad = TensorMap::new();
    bad.insert("x".into(), HostTensor::from_f32(vec![2, 24], &x[..48]));
    let p = tmp("bad_shape.safetensors");
    write_safetensors(&p, &bad).unwrap();
    assert!(quantize_error(&p, "o3").contains("multiple of 16"));
    assert!(quantize_error(Path::new("/nonexistent.safetensors"), "o5").contains("does not exist"));
    let bytes = std::fs::read(&inp).unwrap();
    let p = tmp("truncated.safetensors");
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    assert!(quantize_error(&p, "o4").contains("not a valid safetensors"));
}

/// Runs `exec nvfp4_quantize_rows --cpu` on a bad input file; asserts a failing exit and that no output file
/// `<out>.safetensors` was written, and returns stderr.
fn quantize_error(input: &Path, out: &str) -> String {
    let o = tmp(&format!("{out}.safetensors"));
    let _ = std::fs::remove_file(&o);
    let (code, _o, err) = run(&[
        "exec",
        "nvfp4_quantize_rows",
        "--in",
        input.to_str().unwrap(),
        "--out",
        o.to_str().unwrap(),
        "--cpu",
    ]);
    assert_ne!(code, 0, "{err}");
    assert!(!o.exists(), "no output may be written on error: {err}");
    eprintln!("{err}");
    err
}

/// Runs `megamoe bench` with `args` (plus `--config <file>` holding `toml` when it is non-empty) and asserts it
/// fails before any GPU work: a non-zero exit, no panic, no limits measured and no GPU asked for. Returns stderr.
fn bench_error(name: &str, toml: &str, args: &[&str]) -> String {
    let mut all = vec!["bench".to_string()];
    if !toml.is_empty() {
        let p = tmp(&format!("{name}.toml"));
        std::fs::write(&p, toml).unwrap();
        all.extend(["--config".to_string(), p.to_str().unwrap().to_string()]);
    }
    all.extend(args.iter().map(|a| a.to_string()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let (code, _o, err) = run(&all);
    assert_ne!(code, 0, "{name}: megamoe {all:?} must fail: {err}");
    assert!(!err.contains("panicked"), "{name}: {err}");
    assert!(
        !err.contains("measuring limits") && !err.contains("needs an NVIDIA Hopper GPU"),
        "{name}: the error must come before any GPU work: {err}"
    );
    eprintln!("{name}: {err}");
    err
}

/// A one-sweep config: `kernel` over `axis` = `values`, `extra` lines in the sweep, `params` in [sweep.params].
fn sweep_toml(kernel: &str, extra: &str, axis: &str, values: &str, params: &str) -> String {
    format!(
        "[[sweep]]\nkernel = \"{kernel}\"\n{extra}axis = \"{axis}\"\nvalues = {values}\n[sweep.params]\n{params}\n"
    )
}

/// One bad `megamoe bench` call: its name, the config text ("" for the embedded default suite), extra
/// arguments, and what the error must say (the bad thing and the valid choices).
struct BenchCase {
    name: &'static str,
    toml: String,
    args: &'static [&'static str],
    says: &'static [&'static str],
}

fn assert_bench_errors(cases: &[BenchCase]) {
    for c in cases {
        let err = bench_error(c.name, &c.toml, c.args);
        for s in c.says {
            assert!(
                err.contains(s),
                "{}: the error should say {s:?}: {err}",
                c.name
            );
        }
    }
}

#[test]
fn bench_names_a_bad_kernel_variant_axis_or_parameter_and_the_valid_ones_before_any_gpu_work() {
    let q = "nvfp4_quantize_rows";
    let case = |name, toml, says| BenchCase {
        name,
        toml,
        args: &[],
        says,
    };
    assert_bench_errors(&[
        case(
            "kernel",
            sweep_toml("nvfp4_quantise_rows", "", "rows", "[1]", "cols = 64"),
            &[
                "unknown kernel `nvfp4_quantise_rows`",
                "nvfp4_quantize_rows, nvfp4_dequantize_rows",
            ],
        ),
        case(
            "variant",
            sweep_toml(q, "variants = [\"bf16_inn\"]\n", "rows", "[1]", "cols = 64"),
            &["unknown variant `bf16_inn`", "the kernel has: bf16_in"],
        ),
        case(
            "baseline",
            sweep_toml("copy", "baseline = \"memcpyy\"\n", "bytes", "[1024]", ""),
            &["baseline `memcpyy`", "memcpy, kernel"],
        ),
        case(
            "param",
            sweep_toml(q, "", "rows", "[1]", "cols = 64\ncolz = 64"),
            &["unknown parameter `colz`", "the kernel reads: rows, cols"],
        ),
        case(
            "axis",
            sweep_toml("nvfp4_dequantize_rows", "", "row", "[1]", "cols = 64"),
            &["unknown axis `row`", "the kernel reads: rows, cols"],
        ),
        case(
            "missing_param",
            sweep_toml(q, "", "rows", "[1]", ""),
            &["missing parameter `cols`"],
        ),
        case(
            "bad_shape",
            sweep_toml(q, "", "rows", "[1]", "cols = 24"),
            &["cols = 24 is not a multiple of 16"],
        ),
    ]);
}

#[test]
fn bench_rejects_sizes_no_gpu_can_hold_before_any_gpu_work() {
    let case = |name, toml, says| BenchCase {
        name,
        toml,
        args: &[],
        says,
    };
    assert_bench_errors(&[
        // 2^41 bytes to copy: over the generic 1 TiB size rule.
        case(
            "huge_copy",
            sweep_toml("copy", "", "bytes", "[1024, 2_199_023_255_552]", ""),
            &["`bytes` (the axis) = 2199023255552", "larger than any GPU"],
        ),
        // 2^20 x 2^20 rows: each dimension fits, the 2.5 TB of BF16 + NVFP4 rows do not.
        case(
            "huge_rows",
            sweep_toml(
                "nvfp4_quantize_rows",
                "",
                "rows",
                "[1_048_576]",
                "cols = 1_048_576",
            ),
            &["1048576 x 1048576 rows need", "more than any GPU holds"],
        ),
        // Rows past i32, the kernels' index type.
        case(
            "i32_rows",
            sweep_toml(
                "nvfp4_dequantize_rows",
                "",
                "rows",
                "[3_000_000_000]",
                "cols = 16",
            ),
            &["rows = 3000000000", "must fit in i32"],
        ),
    ]);
}

#[test]
fn bench_rejects_an_unknown_kernel_filter_and_zero_reps_before_any_gpu_work() {
    assert_bench_errors(&[
        BenchCase {
            name: "filter",
            toml: String::new(),
            args: &["--kernel", "nosuchkernel"],
            says: &[
                "--kernel `nosuchkernel`: no such kernel",
                "copy, nvfp4_quantize_rows",
            ],
        },
        // A registered kernel that no sweep of the config runs.
        BenchCase {
            name: "filter_not_swept",
            toml: sweep_toml("copy", "", "bytes", "[1024]", ""),
            args: &["--kernel", "nvfp4_quantize_rows"],
            says: &["no sweep of the config(s) runs it; they sweep: copy"],
        },
        BenchCase {
            name: "reps",
            toml: String::new(),
            args: &["--reps", "0"],
            says: &["--reps must be at least 1"],
        },
    ]);
}

/// `exec nvfp4_quantize_rows --cpu --in <input> --out <output>`: (exit code, stderr).
fn exec_quantize(input: &Path, output: &Path) -> (i32, String) {
    let (code, _o, err) = run(&[
        "exec",
        "nvfp4_quantize_rows",
        "--in",
        input.to_str().unwrap(),
        "--out",
        output.to_str().unwrap(),
        "--cpu",
    ]);
    assert!(!err.contains("panicked"), "{err}");
    (code, err)
}

fn quantize_input(name: &str, extra: &[&str]) -> PathBuf {
    let x = megamoe::ops::inputs::activation_rows(2, 32, 11);
    let mut m = TensorMap::new();
    m.insert("x".into(), HostTensor::from_f32(vec![2, 32], &x));
    for e in extra {
        m.insert(e.to_string(), HostTensor::from_f32(vec![2], &x[..2]));
    }
    let p = tmp(name);
    write_safetensors(&p, &m).unwrap();
    p
}

#[test]
fn exec_refuses_a_directory_input_and_an_output_that_is_the_input() {
    let dir = tmp("a_dir");
    std::fs::create_dir_all(&dir).unwrap();
    let (code, err) = exec_quantize(&dir, &tmp("from_dir.safetensors"));
    assert_ne!(code, 0);
    assert!(err.contains("is a directory"), "{err}");
    assert!(!err.contains("does not exist"), "{err}");

    let inp = quantize_input("same.safetensors", &[]);
    let before = std::fs::read(&inp).unwrap();
    // The same file spelled another way (through `a_dir/..`).
    let same = dir.join("..").join("same.safetensors");
    for out in [inp.clone(), same] {
        let (code, err) = exec_quantize(&inp, &out);
        assert_ne!(code, 0, "--out {} must be refused", out.display());
        assert!(err.contains("would overwrite the input"), "{err}");
        assert_eq!(
            std::fs::read(&inp).unwrap(),
            before,
            "the input was modified"
        );
    }
    let (code, err) = exec_quantize(&inp, &dir);
    assert_ne!(code, 0);
    assert!(err.contains("is a directory"), "{err}");
}

#[test]
fn exec_warns_about_input_tensors_the_kernel_never_reads() {
    let inp = quantize_input("extra.safetensors", &["bias", "x_scale"]);
    let out = tmp("extra_out.safetensors");
    let (code, err) = exec_quantize(&inp, &out);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("warning"), "{err}");
    assert!(err.contains("`bias`, `x_scale`"), "{err}");
    assert!(!err.contains("`x`"), "x is read: {err}");
    // Every tensor read: no warning.
    let inp = quantize_input("exact.safetensors", &[]);
    let (code, err) = exec_quantize(&inp, &out);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("warning"), "{err}");
}

#[test]
#[ignore = "needs an H100/H200"]
fn exec_on_the_gpu_writes_what_the_cpu_reference_writes() {
    let _gpu = common::gpu("exec_on_the_gpu_writes_what_the_cpu_reference_writes");
    let inp = quantize_input("gpu_in.safetensors", &[]);
    let (g, c) = (tmp("gpu_q.safetensors"), tmp("cpu_q.safetensors"));
    for (out, cpu) in [(&g, false), (&c, true)] {
        let mut args = vec![
            "exec",
            "nvfp4_quantize_rows",
            "--in",
            inp.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        if cpu {
            args.push("--cpu");
        }
        let (code, _o, err) = run(&args);
        assert_eq!(code, 0, "{err}");
    }
    assert_eq!(read_safetensors(&g).unwrap(), read_safetensors(&c).unwrap());
}

/// `megamoe decode --ranks N`: bad counts and points are refused before any GPU work; more ranks than the machine has
/// GPUs is a clear error from the parent, which counts the GPUs before it opens any (16 ranks: more GPUs than any lent
/// machine has).
#[test]
fn decode_ranks_are_checked_before_any_gpu_work() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["decode", "--model", "small", "--ranks", "0"],
            "--ranks must be at least 1",
        ),
        (
            &["decode", "--model", "small", "--ranks", "3"],
            "split evenly",
        ),
        (
            &[
                "decode", "--model", "small", "--ranks", "2", "--batch", "1,2",
            ],
            "--ranks runs one point",
        ),
        (
            &["decode", "--model", "small", "--ranks", "2", "--parity"],
            "--ranks runs one point",
        ),
        (
            &["decode", "--model", "small", "--ranks", "16"],
            "--ranks 16 needs 16 GPUs",
        ),
    ];
    for (args, want) in cases {
        let (code, _out, err) = run(args);
        assert_ne!(code, 0, "megamoe {args:?} must fail");
        assert!(
            !err.contains("panicked"),
            "megamoe {args:?} panicked: {err}"
        );
        assert!(
            err.contains(want),
            "megamoe {args:?}: expected {want:?} in: {err}"
        );
    }
}

/// `trace-diff` without a GPU: two timelines of the same launches give the wall move, the kernel that moved and the
/// launch-by-launch table; a file that is not a timeline, or one that is missing, is a clear error.
#[test]
fn trace_diff_compares_two_timelines_and_refuses_what_is_not_one() {
    let header = "index,name,stream,start_us,end_us,duration_us,idle_before_us\n";
    let base = tmp("trace-base.csv");
    let cand = tmp("trace-cand.csv");
    std::fs::write(
        &base,
        format!("{header}0,gemv,7,0.000,10.000,10.000,0.000\n1,norm,7,10.000,12.000,2.000,0.000\n"),
    )
    .unwrap();
    std::fs::write(
        &cand,
        format!("{header}0,gemv,7,0.000,7.000,7.000,0.000\n1,norm,7,7.000,9.000,2.000,0.000\n"),
    )
    .unwrap();
    let (code, out, err) = run(&["trace-diff", base.to_str().unwrap(), cand.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("wall 12.0 -> 9.0 us (-3.0)"), "{out}");
    assert!(
        out.contains("the launches whose advance moved most"),
        "{out}"
    );
    let gemv = out.lines().find(|l| l.starts_with("gemv")).unwrap();
    assert!(gemv.contains("-3.0"), "{gemv}");
    let bad = tmp("trace-bad.csv");
    std::fs::write(&bad, "kernel,us\ngemv,10\n").unwrap();
    let (code, _, err) = run(&["trace-diff", base.to_str().unwrap(), bad.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("not a kernel timeline"), "{err}");
    let (code, _, err) = run(&["trace-diff", base.to_str().unwrap(), "/nonexistent/t.csv"]);
    assert_ne!(code, 0);
    assert!(err.contains("reading /nonexistent/t.csv"), "{err}");
}
