//! Compiles every `kernels/*.cu` to an sm_90a cubin with nvcc when nvcc can be found, and embeds it with its
//! ptxas report. Without nvcc it warns once and embeds only the sources (compiled with NVRTC at run time).
//! `REQUIRE_CUBIN=1` turns a missing nvcc or a compile error into a build failure (CI and GPU bundles).
//!
//! Generated: `$OUT_DIR/kernels.rs` with one `KernelSource` per .cu file (see src/gpu/module.rs).

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn find_nvcc() -> Option<PathBuf> {
    if let Ok(p) = env::var("NVCC") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
    }
    if let Ok(home) = env::var("CUDA_HOME") {
        let p = Path::new(&home).join("bin/nvcc");
        if p.is_file() {
            return Some(p);
        }
    }
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}

/// Inline local `#include "x.cuh"` lines (relative to kernels/ and kernels/common/) so the NVRTC fallback
/// needs no include path for the project's own headers.
fn inline_includes(src: &str, dir: &Path, depth: usize, seen: &mut Vec<PathBuf>) -> String {
    let mut out = String::new();
    for line in src.lines() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("#include \"") {
            let name = rest.trim_end_matches('"');
            let path = dir.join(name);
            if depth < 8 && path.is_file() {
                let canon = path.canonicalize().unwrap_or(path.clone());
                if !seen.contains(&canon) {
                    seen.push(canon);
                    let inner = fs::read_to_string(&path).unwrap_or_default();
                    let inner_dir = path.parent().unwrap_or(dir).to_path_buf();
                    out.push_str(&inline_includes(&inner, &inner_dir, depth + 1, seen));
                }
                continue;
            }
        }
        if t.starts_with("#pragma once") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// A hex digest of everything that decides a cubin: the inlined source, the compiler and its arguments.
fn cache_key(inlined: &str, cmd: &Command) -> String {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    inlined.hash(&mut h);
    cmd.get_program().hash(&mut h);
    for a in cmd.get_args() {
        a.hash(&mut h);
    }
    format!("{:016x}", h.finish())
}

fn main() {
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let kdir = manifest.join("kernels");
    println!("cargo::rerun-if-changed=kernels");
    for v in [
        "NVCC",
        "CUDA_HOME",
        "PATH",
        "REQUIRE_CUBIN",
        "MEGAMOE_NVCC_FLAGS",
        "MEGAMOE_CUBIN_CACHE",
    ] {
        println!("cargo::rerun-if-env-changed={v}");
    }
    println!("cargo::rustc-check-cfg=cfg(has_cubins)");
    let require = env::var("REQUIRE_CUBIN").map(|v| v == "1").unwrap_or(false);

    let mut cus: Vec<PathBuf> = fs::read_dir(&kdir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    cus.retain(|p| p.extension().is_some_and(|e| e == "cu"));
    cus.sort();
    for entry in walk(&kdir) {
        println!("cargo::rerun-if-changed={}", entry.display());
    }

    let nvcc = find_nvcc();
    if nvcc.is_none() {
        if require {
            panic!("REQUIRE_CUBIN=1 but nvcc was not found ($NVCC, $CUDA_HOME/bin, PATH). Run scripts/install-nvcc.sh and export NVCC.");
        }
        println!("cargo::warning=nvcc not found: embedding CUDA sources only (NVRTC compiles them at run time). Run scripts/install-nvcc.sh for cubins.");
    }

    let mut gen = String::new();
    let mut all_ok = nvcc.is_some();
    for cu in &cus {
        let stem = cu.file_stem().unwrap().to_string_lossy().to_string();
        let src = fs::read_to_string(cu).unwrap();
        let mut seen = Vec::new();
        let inlined = inline_includes(&src, &kdir, 0, &mut seen);
        let src_path = out_dir.join(format!("{stem}.inlined.cu"));
        fs::write(&src_path, &inlined).unwrap();
        let mut cubin_expr = "None".to_string();
        let mut report = String::from("no nvcc at build time");
        // The report file below is rewritten by every build: one without nvcc (or a failed compile) must not leave a
        // key that would make a later build with nvcc take its report for the cubin's.
        let key_path = out_dir.join(format!("{stem}.key"));
        if nvcc.is_none() {
            let _ = fs::remove_file(&key_path);
        }
        if let Some(nvcc) = &nvcc {
            let cubin = out_dir.join(format!("{stem}.sm_90a.cubin"));
            let mut cmd = Command::new(nvcc);
            cmd.args([
                "-gencode",
                "arch=compute_90a,code=sm_90a",
                "-cubin",
                "-O3",
                "-std=c++17",
                "-lineinfo",
                "-Xptxas",
                "-v",
            ])
            .arg(format!("-I{}", kdir.display()))
            .arg(format!("-I{}", kdir.join("common").display()));
            if let Ok(extra) = env::var("MEGAMOE_NVCC_FLAGS") {
                cmd.args(extra.split_whitespace());
            }
            cmd.arg("-o").arg(&cubin).arg(cu);
            // Skip nvcc when this exact input was already compiled into this OUT_DIR: the key covers the
            // source with every include inlined, the nvcc path and the full argument list, so any change
            // that could change the cubin recompiles it, and an edit to one family leaves the others alone.
            let key = cache_key(&inlined, &cmd);
            let rep_path = out_dir.join(format!("{stem}.ptxas.txt"));
            // A shared cache (MEGAMOE_CUBIN_CACHE, a directory) lets several checkouts of the project reuse
            // each other's cubins: an entry is named by the same key, so it is used only for identical input.
            let shared = env::var_os("MEGAMOE_CUBIN_CACHE").map(PathBuf::from);
            if let Some(dir) = &shared {
                let (c, r) = (
                    dir.join(format!("{key}.cubin")),
                    dir.join(format!("{key}.ptxas.txt")),
                );
                if c.exists()
                    && r.exists()
                    && fs::copy(&c, &cubin).is_ok()
                    && fs::copy(&r, &rep_path).is_ok()
                {
                    fs::write(&key_path, &key).unwrap();
                }
            }
            let cached = fs::read_to_string(&key_path).is_ok_and(|k| k == key) && cubin.exists();
            let cached_report = cached.then(|| fs::read_to_string(&rep_path).ok()).flatten();
            if cached_report.is_none() {
                let _ = fs::remove_file(&key_path);
            }
            let fresh = cached_report.is_none();
            match cached_report.map(|r| Ok(Ok(r))).unwrap_or_else(|| {
                cmd.output().map(|o| {
                    if o.status.success() {
                        Ok(String::from_utf8_lossy(&o.stderr).to_string())
                    } else {
                        Err(o)
                    }
                })
            }) {
                Ok(Ok(ptxas)) => {
                    fs::write(&key_path, &key).unwrap();
                    // Only nvcc's own output goes to the shared cache (never a report read back from it).
                    if let (true, Some(dir)) = (fresh, &shared) {
                        let _ = fs::create_dir_all(dir);
                        let _ = fs::copy(&cubin, dir.join(format!("{key}.cubin")));
                        let _ = fs::write(dir.join(format!("{key}.ptxas.txt")), &ptxas);
                    }
                    report = ptxas;
                    cubin_expr = format!("Some(include_bytes!({:?}))", cubin.display().to_string());
                }
                Ok(Err(o)) => {
                    all_ok = false;
                    let msg = String::from_utf8_lossy(&o.stderr);
                    if require {
                        panic!("nvcc failed on {}:\n{msg}", cu.display());
                    }
                    for l in msg.lines().take(40) {
                        println!("cargo::warning={stem}.cu: {l}");
                    }
                    report = format!("nvcc failed:\n{msg}");
                }
                Err(e) => {
                    all_ok = false;
                    if require {
                        panic!("could not run nvcc {}: {e}", nvcc.display());
                    }
                    println!("cargo::warning=could not run nvcc: {e}");
                }
            }
        }
        // Entry points: the names ptxas compiled (exact, macro-generated ones included) when nvcc ran,
        // else those declared literally in the source (names built with ## are skipped).
        let mut functions: Vec<String> = report
            .lines()
            .filter_map(|l| l.split("Compiling entry function '").nth(1))
            .filter_map(|r| r.split('\'').next())
            .map(str::to_string)
            .collect();
        if functions.is_empty() {
            functions = kernel_functions(&src)
                .into_iter()
                .filter(|n| !n.contains('#'))
                .collect();
        }
        let rep_path = out_dir.join(format!("{stem}.ptxas.txt"));
        fs::write(&rep_path, &report).unwrap();
        writeln!(
            gen,
            "KernelSource {{ name: {stem:?}, functions: &{functions:?}, source: include_str!({:?}), cubin: {cubin_expr}, ptxas_report: include_str!({:?}) }},",
            src_path.display().to_string(),
            rep_path.display().to_string()
        )
        .unwrap();
    }
    if all_ok && !cus.is_empty() {
        println!("cargo::rustc-cfg=has_cubins");
    }
    let body = format!("/// Every kernel family compiled by build.rs.\npub static KERNEL_SOURCES: &[KernelSource] = &[\n{gen}];\n");
    fs::write(out_dir.join("kernels.rs"), body).unwrap();
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                v.extend(walk(&p));
            } else {
                v.push(p);
            }
        }
    }
    v
}

/// Names of the `extern "C" __global__` functions of a .cu file (the entry points a module exports).
fn kernel_functions(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    let flat: String = src.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut rest = flat.as_str();
    while let Some(i) = rest.find("extern \"C\" __global__") {
        rest = &rest[i + 22..];
        // skip attributes like __launch_bounds__(...) and the return type up to the name before '('
        if let Some(paren) = find_name_paren(rest) {
            let before = &rest[..paren];
            if let Some(name) = before.split_whitespace().last() {
                names.push(name.trim_start_matches('*').to_string());
            }
        }
    }
    names
}

/// Index of the '(' that opens the parameter list: the first '(' not belonging to `__launch_bounds__`.
fn find_name_paren(s: &str) -> Option<usize> {
    let mut i = 0;
    let b = s.as_bytes();
    while i < b.len() {
        if s[i..].starts_with("__launch_bounds__") || s[i..].starts_with("__maxnreg__") {
            let open = s[i..].find('(')? + i;
            let close = s[open..].find(')')? + open;
            i = close + 1;
            continue;
        }
        if b[i] == b'(' {
            return Some(i);
        }
        i += 1;
    }
    None
}
