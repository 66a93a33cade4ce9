//! The command line as a user meets it: clear errors and non-zero exits (never a panic) without a GPU, for bad
//! configs, missing files and mis-typed tensors; `exec --cpu` round trips through safetensors.

use std::path::{Path, PathBuf};
use std::process::Command;

use megamoe::ops::exec::{read_safetensors, write_safetensors, HostTensor, TensorMap};

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
fn without_gpu_main_job_and_info_fail_clearly() {
    if megamoe::gpu::probe_error().is_none() {
        eprintln!("SKIP without_gpu_main_job_and_info_fail_clearly: a GPU is present (this test is for GPU-less machines)");
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
