#!/usr/bin/env bash
# Build the baseline side of an engine A/B: the release `megamoe` of COMMIT (a worktree of it, its own target
# directory) into gpu-bundle-base/ (git-ignored) as megamoe.xz + COMMIT. A device call carries it beside
# gpu-bundle/ (carry ["gpu-bundle", "gpu-bundle-base"]); `gpu-run.sh decode-ab` runs both on one machine.
#   usage: scripts/gpu-baseline.sh COMMIT
set -euo pipefail
commit="${1:?usage: scripts/gpu-baseline.sh COMMIT (the baseline of an engine A/B)}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
short="$(git rev-parse --short "$commit^{commit}")"
NVCC="$(scripts/install-nvcc.sh | tail -n1)"
export NVCC REQUIRE_CUBIN=1
wt="$(mktemp -d)/baseline"
git worktree add --detach "$wt" "$short" >/dev/null
trap 'git worktree remove --force "$wt"' EXIT
# The baseline's own target directory: its build never evicts the candidate's.
(cd "$wt" && CARGO_TARGET_DIR="$root/target-baseline" cargo build --release --bin megamoe)
out="$root/gpu-bundle-base"
rm -rf "$out"
mkdir -p "$out"
strip -o "$out/megamoe" "$root/target-baseline/release/megamoe" 2>/dev/null || cp "$root/target-baseline/release/megamoe" "$out/"
xz -9 -T2 "$out/megamoe"
echo "$short" > "$out/COMMIT"
du -sh "$out"
