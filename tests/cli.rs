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

/// A one-sweep config of `nvfp4_quantize_rows` with `extra` lines in the sweep and `params` in [sweep.params].
fn quantize_sweep(kernel: &str, extra: &str, axis: &str, values: &str, params: &str) -> String {
    format!(
        "[[sweep]]\nkernel = \"{kernel}\"\n{extra}axis = \"{axis}\"\nvalues = {values}\n[sweep.params]\n{params}\n"
    )
}

#[test]
fn bench_names_a_bad_kernel_variant_axis_or_parameter_and_the_valid_ones_before_any_gpu_work() {
    let err = bench_error(
        "kernel",
        &quantize_sweep("nvfp4_quantise_rows", "", "rows", "[1]", "cols = 64"),
        &[],
    );
    assert!(
        err.contains("unknown kernel `nvfp4_quantise_rows`"),
        "{err}"
    );
    assert!(
        err.contains("nvfp4_quantize_rows") && err.contains("copy"),
        "{err}"
    );

    let err = bench_error(
        "variant",
        &quantize_sweep(
            "nvfp4_quantize_rows",
            "variants = [\"bf16_inn\"]\n",
            "rows",
            "[1]",
            "cols = 64",
        ),
        &[],
    );
    assert!(
        err.contains("unknown variant `bf16_inn`") && err.contains("bf16_in"),
        "{err}"
    );

    let err = bench_error(
        "baseline",
        &quantize_sweep("copy", "baseline = \"memcpyy\"\n", "bytes", "[1024]", ""),
        &[],
    );
    assert!(
        err.contains("baseline `memcpyy`") && err.contains("memcpy, kernel"),
        "{err}"
    );

    let err = bench_error(
        "param",
        &quantize_sweep(
            "nvfp4_quantize_rows",
            "",
            "rows",
            "[1]",
            "cols = 64\ncolz = 64",
        ),
        &[],
    );
    assert!(err.contains("unknown parameter `colz`"), "{err}");
    assert!(err.contains("rows, cols"), "the valid names: {err}");

    let err = bench_error(
        "axis",
        &quantize_sweep("nvfp4_dequantize_rows", "", "row", "[1]", "cols = 64"),
        &[],
    );
    assert!(
        err.contains("unknown axis `row`") && err.contains("rows, cols"),
        "{err}"
    );

    let err = bench_error(
        "missing_param",
        &quantize_sweep("nvfp4_quantize_rows", "", "rows", "[1]", ""),
        &[],
    );
    assert!(err.contains("missing parameter `cols`"), "{err}");

    let err = bench_error(
        "bad_shape",
        &quantize_sweep("nvfp4_quantize_rows", "", "rows", "[1]", "cols = 24"),
        &[],
    );
    assert!(err.contains("multiple of 16"), "{err}");
}

#[test]
fn bench_rejects_sizes_no_gpu_can_hold_before_any_gpu_work() {
    // 2^41 bytes to copy: over the generic 1 TiB size rule.
    let err = bench_error(
        "huge_copy",
        &quantize_sweep("copy", "", "bytes", "[1024, 2_199_023_255_552]", ""),
        &[],
    );
    assert!(
        err.contains("2199023255552") && err.contains("larger than any GPU"),
        "{err}"
    );
    // 2^20 x 2^20 rows: each dimension fits, the 2.5 TB of BF16 + NVFP4 rows do not.
    let err = bench_error(
        "huge_rows",
        &quantize_sweep(
            "nvfp4_quantize_rows",
            "",
            "rows",
            "[1_048_576]",
            "cols = 1_048_576",
        ),
        &[],
    );
    assert!(err.contains("more than any GPU holds"), "{err}");
    // rows past i32 (the kernels' index type).
    let err = bench_error(
        "i32_rows",
        &quantize_sweep(
            "nvfp4_dequantize_rows",
            "",
            "rows",
            "[3_000_000_000]",
            "cols = 16",
        ),
        &[],
    );
    assert!(err.contains("3000000000") && err.contains("i32"), "{err}");
}

#[test]
fn bench_rejects_an_unknown_kernel_filter_and_zero_reps_before_any_gpu_work() {
    let err = bench_error("filter", "", &["--kernel", "nosuchkernel"]);
    assert!(
        err.contains("--kernel `nosuchkernel`: no such kernel"),
        "{err}"
    );
    assert!(
        err.contains("nvfp4_quantize_rows") && err.contains("copy"),
        "{err}"
    );
    // A registered kernel that no sweep of the config runs.
    let err = bench_error(
        "filter_not_swept",
        &quantize_sweep("copy", "", "bytes", "[1024]", ""),
        &["--kernel", "nvfp4_quantize_rows"],
    );
    assert!(
        err.contains("no sweep of the config(s) runs it") && err.contains("copy"),
        "{err}"
    );
    let err = bench_error("reps", "", &["--reps", "0"]);
    assert!(err.contains("--reps must be at least 1"), "{err}");
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
