#!/usr/bin/env bash
# Build everything a GPU run needs into gpu-bundle/ (git-ignored; the device call carries it):
# the release `megamoe` binary and every test executable, all with REQUIRE_CUBIN=1 (every kernel compiled to an
# sm_90a cubin and embedded), plus gpu-run.sh, the commit id and the bench configs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
NVCC="$(scripts/install-nvcc.sh | tail -n1)"
export NVCC REQUIRE_CUBIN=1
out="$root/gpu-bundle"
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
        shutil.copy(m["executable"], os.path.join(out, "tests", name))
        print("test executable:", name)
' "$out"
strip "$out/megamoe" "$out"/tests/* 2>/dev/null || true
# Compressed: a device call carries at most 64 MiB, and the stripped executables shrink about 3x; gpu-run.sh
# unpacks them on the GPU machine.
gzip -9 "$out"/tests/* "$out/megamoe"
cp scripts/gpu-run.sh scripts/ncu-hot.py "$out/"
cp -r bench-configs "$out/"
git rev-parse --short HEAD > "$out/COMMIT"
if ! git diff --quiet HEAD -- src kernels build.rs Cargo.toml tests; then echo "+dirty" >> "$out/COMMIT"; fi
du -sh "$out"
