#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there) from the repository root, with gpu-bundle/ built by gpu-bundle.sh:
# device info, kernel inventory, every test executable with its GPU tests (ignored on CPU machines, so run with
# --include-ignored; a GPU test without a GPU fails, and REQUIRE_GPU=1 makes the older SKIP path fail too) except
# the slow CPU-only runs named `slow_*` (the `model` step runs the one it needs), the limits probe, the benchmark
# sweeps and stress tests; packs everything into one archive under $OUT (or ./gpu-out).
#   usage: scripts/gpu-run.sh [all|tests|bench|stress|model|profile|decode|decode-ab|bench-ab|engine-profile|<several, comma-separated>] [extra args for `megamoe bench`]
#   decode: `megamoe decode` of the small model (report + --parity), `generate` on Flash, Flash's context and
#           batch sweeps, Flash 4K batch 64 with --dense-route gemv (the route's baseline), Flash's TTFT on a
#           4K-token prompt, then REPORT.md
#           (DECODE_FLASH=0 skips the Flash runs, DECODE_TTFT=0 the TTFT run, DECODE_GEMV_BASELINE=0 the batch-64
#           GEMV run; DECODE_CONTEXTS, DECODE_BATCHES,
#           DECODE_TIMEOUT, DECODE_FLASH_TIMEOUT, DECODE_FLASH_AB_TIMEOUT, DECODE_TTFT_TIMEOUT)
#   decode-ab: an engine A/B on one machine: this bundle's megamoe (the candidate) and a baseline binary
#           (AB_BASE, default gpu-bundle-base/ beside this bundle: megamoe or megamoe.xz and COMMIT, from
#           scripts/gpu-baseline.sh), mirrored candidate, baseline, baseline, candidate (a linear drift of the
#           machine cancels in each side's mean), each a Flash sweep at 4K over AB_BATCHES (default 1,8,64); each
#           side's decode.csv rows under ab-<side>/ (AB_TIMEOUT per run). AB_BASE may name several baseline
#           directories (space-separated, e.g. a chain of changes): the sides run in order, then in reverse, and
#           each baseline's rows land under ab-<its commit>/.
#   engine-profile: Nsight Compute (ncu --clock-control none --cache-control none, never changing clocks) on kernels
#           of the engine's own decode step (Flash, 4K, batch ENGINE_NCU_BATCH, default 1), each measured alone:
#           ENGINE_NCU_KERNELS (a regex, default the batch-1 latency kernels: the attention's candidate build, attention
#           and combine, the mHC finishes, the router), ENGINE_NCU_SKIP matching launches skipped (past the prompt and the
#           first steps, default 700), ENGINE_NCU_COUNT profiled (default 21: three layers of every default kernel);
#           ncu-engine.txt (ENGINE_NCU_TIMEOUT, default 240 s). The decode holds ENGINE_NCU_SLOTS expert slots a layer
#           (default 8, `decode --expert-slots`): ncu's kernel replay saves and restores all of the device memory in use
#           around every pass (~40 s a kernel with the ~75 GB of a full H100 plan; application replay reran the ~100 s
#           decode once a pass). PROFILE_SOURCE=1 adds the per-instruction stall page (ncu-engine-hot.txt, as for
#           `profile`). The decode's own CUPTI trace is left off (its library is not on the path), so the two
#           profilers do not meet.
#   bench-ab: a kernel A/B on one machine with the same two binaries: the bench configs AB_CONFIGS (names under
#           bench-configs/, e.g. ab/X), candidate, baseline, candidate, baseline; each run's CSV rows under
#           ab-<side>-<round>/ (BENCH_TIMEOUT per run)
#   Several steps in one call (e.g. tests,stress,bench,profile) pack into ONE archive: the device tool returns only
#   a few files per call, so one call should leave one archive.
#   profile: Nsight Compute (ncu --clock-control none, never changing clocks) on the points in
#            bench-configs/profile/<family>.toml; one text report per family (ncu-<family>.txt).
#   env: TEST_TIMEOUT, STRESS_TIMEOUT, SANITIZER_TIMEOUT, SANITIZER_MAX, SANITIZE_TESTS (stress: extra sanitizer
#        runs of test executables, "exe[:filter] ..."), SANITIZE_TOOLS (their tools, default memcheck),
#        SKIP_INDEXER_STRESS=1 (stress: only the SANITIZE_TESTS runs), BENCH_TIMEOUT (per config), REPS,
#        CONFIGS (bench: space-separated config names to run, e.g. "default indexer"; all top-level configs when
#        unset; an A/B config bench-configs/ab/X.toml runs only when named as "ab/X"),
#        TESTS (tests: space-separated "exe[:filter]" specs, run in that order, "exe:=name" for the one test named
#        exactly so; all executables when unset), PROFILE_TIMEOUT
#        (per family), PROFILES (profile families to run; CONFIGS when unset, all when both are),
#        PROFILE_SOURCE=1 (profile: also export the per-SASS-instruction source page with warp-stall samples,
#        ncu-<family>-hot.txt; scripts/ncu-regions.py splits a kernel's samples from that page into before / inside /
#        after its main loop), NCU_EXTRA (extra ncu arguments, e.g. "--warp-sampling-interval 0" for more stall
#        samples from a short kernel)
set -uo pipefail
B="$(cd "$(dirname "$0")" && pwd)"
[ -x "$B/megamoe" ] || [ -f "$B/executables.tar.xz" ] || B="$(pwd)/gpu-bundle"
what="${1:-all}"; shift || true
# want STEP: STEP is one of the comma-separated steps asked for (all = tests, stress, bench).
want() { [[ ",$what," == *",$1,"* ]] || { [ "$1" != model ] && [ "$1" != profile ] && [ "$1" != decode ] && [ "$1" != decode-ab ] && [ "$1" != bench-ab ] && [ "$1" != engine-profile ] && [[ ",$what," == *",all,"* ]]; }; }
out="${OUT:-$(pwd)/gpu-out}"
work="$(mktemp -d)/h200"
mkdir -p "$work/tests"
export MEGAMOE_BIN="$B/megamoe" REQUIRE_GPU=1 MEGAMOE_GIT_COMMIT="$(head -n1 "$B/COMMIT" 2>/dev/null || echo unknown)"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
py_cublas="$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)"
for d in $(ls -d "$py_cublas"/nvidia/*/lib 2>/dev/null); do export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"; done
# gpu-bundle.sh ships the executables as one xz archive.
if [ -f "$B/executables.tar.xz" ]; then
  tar -C "$B" -xJf "$B/executables.tar.xz" 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$B/executables.tar.xz" "$B" ||
    { echo "cannot unpack $B/executables.tar.xz"; exit 1; }
  rm -f "$B/executables.tar.xz"
fi
# The bundle's own libraries (CUDA 13.0's libcupti for the kernel timeline) come first on the library path; cudarc
# opens "libcupti.so" before the versioned names.
if [ -f "$B/lib/libcupti.so.13" ]; then
  ln -sf libcupti.so.13 "$B/lib/libcupti.so"
  export LD_LIBRARY_PATH="$B/lib:${LD_LIBRARY_PATH:-}"
fi
status=0
# pack: one archive of everything so far. Also run when an outer `timeout` stops the script (TERM), so a call that
# runs past its limit still brings back what finished.
pack() {
  mkdir -p "$out"
  tar czf "$out/results.tar.gz" -C "$(dirname "$work")" h200
  echo "packed $(du -h "$out/results.tar.gz" | cut -f1) -> $out/results.tar.gz (status $status)"
}
trap 'echo "stopped by a signal: packing what finished"; status=124; pack; exit 124' TERM INT
# libtest arguments of every test run: the GPU tests (#[ignore = "needs an H100/H200"]) included, the slow CPU
# runs (tests named slow_*, ignored by design) left out.
test_args=(--test-threads=1 --include-ignored --skip slow_)
step() { echo "=== $*"; }
{ nvidia-smi; nvidia-smi -q -d CLOCK,POWER,PERFORMANCE; } > "$work/nvidia-smi.txt" 2>&1
step info;    "$B/megamoe" info 2>&1 | tee "$work/info.txt" || status=1
step kernels; "$B/megamoe" kernels 2>&1 | tee "$work/kernels.txt"
# Which NCCL this machine could load (the multi-GPU issue's transport), for the record.
{ ldconfig -p 2>/dev/null | grep -i nccl; ls -d "$py_cublas"/nvidia/nccl* 2>/dev/null; ls "$py_cublas"/nvidia/nccl*/lib 2>/dev/null; } \
  > "$work/nccl.txt" 2>&1 || true
if want tests; then
  # TESTS="exe[:filter] ...": those executables in that order (a libtest name filter after the colon); every
  # executable when unset.
  specs="${TESTS:-$(cd "$B/tests" && ls)}"
  for spec in $specs; do
    n="${spec%%:*}"; filter=""; [[ "$spec" == *:* ]] && filter="${spec#*:}"
    # `exe:=name`: only the test called exactly `name` (libtest --exact).
    tag="${filter#=}"; [[ "$filter" == =* ]] && filter="--exact $tag"
    t="$B/tests/$n"
    [ -x "$t" ] || { echo "FAILED: no test executable $n in the bundle"; status=1; continue; }
    step "test $n ${filter}"
    # One log per spec: two filters of one executable keep both logs.
    log="$work/tests/$n${tag:+-$tag}.log"
    # shellcheck disable=SC2086
    timeout "${TEST_TIMEOUT:-600}" "$t" "${test_args[@]}" $filter > "$log" 2>&1; rc=$?
    tail -n 3 "$log"
    [ $rc -eq 0 ] || { echo "FAILED: $n (rc $rc)"; status=1; grep -E "panicked|FAILED|failed|SKIP" "$log" | head -20; }
  done
fi
if want stress && "$B/megamoe" stress --help >/dev/null 2>&1; then
  san="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  if [ -z "${SKIP_INDEXER_STRESS:-}" ]; then
    step "stress indexer"
    timeout "${STRESS_TIMEOUT:-900}" "$B/megamoe" stress indexer --out "$work" 2>&1 | tail -n 20; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
  if [ -x "$san" ]; then
    for tool in memcheck racecheck synccheck; do
      [ -n "${SKIP_INDEXER_STRESS:-}" ] && break
      step "compute-sanitizer --tool $tool (indexer stress, quick subset)"
      timeout "${SANITIZER_TIMEOUT:-420}" "$san" --tool "$tool" --error-exitcode 9 "$B/megamoe" stress indexer --quick \
        --exhaustive-max "${SANITIZER_MAX:-300}" --random-cases 1 --random-max 40000 --e2e-max 40000 --watchdog-ms 300000 \
        > "$work/sanitizer-$tool.txt" 2>&1; rc=$?
      tail -n 4 "$work/sanitizer-$tool.txt"; [ $rc -eq 0 ] || { echo "sanitizer $tool: rc $rc"; status=1; }
    done
    # Kernels outside the indexer (e.g. ones with cross-CTA counters or shared-memory staging) under the sanitizer
    # tools SANITIZE_TOOLS (default memcheck) through their own GPU tests: SANITIZE_TESTS="exe[:filter] ..."
    # (filter = a libtest name filter; the whole executable when omitted; GPU tests included, slow_* left out).
    for spec in ${SANITIZE_TESTS:-}; do
      exe="${spec%%:*}"; filter=""; [[ "$spec" == *:* ]] && filter="${spec#*:}"
      for tool in ${SANITIZE_TOOLS:-memcheck}; do
        step "compute-sanitizer --tool $tool tests/$exe ${filter}"
        # shellcheck disable=SC2086
        timeout "${SANITIZER_TIMEOUT:-420}" "$san" --tool "$tool" --error-exitcode 9 "$B/tests/$exe" "${test_args[@]}" $filter \
          > "$work/sanitizer-$tool-$exe.txt" 2>&1; rc=$?
        tail -n 4 "$work/sanitizer-$tool-$exe.txt"; [ $rc -eq 0 ] || { echo "sanitizer $tool $exe: rc $rc"; status=1; }
      done
    done
  fi
fi
if want bench; then
  # One `megamoe bench` per config, each under its own time limit (CSVs are written after every sweep, so a
  # config stopped by its limit keeps what it measured); every config measures its limits in its own run.
  # A/B configs (bench-configs/ab/X.toml) run only when CONFIGS names them as ab/X.
  for c in default "$B"/bench-configs/*.toml "$B"/bench-configs/ab/*.toml; do
    [ "$c" = "$B/bench-configs/default.toml" ] && continue
    [ -e "$c" ] || [ "$c" = default ] || continue
    if [ "$c" = default ]; then args=(); name=default; else args=(--config "$c"); name="$(basename "$c" .toml)"; fi
    [[ "$c" == */ab/* ]] && name="ab/$name"
    if [[ "$name" == ab/* || -n "${CONFIGS:-}" ]] && ! [[ " ${CONFIGS:-} " == *" $name "* ]]; then continue; fi
    step "bench $name"
    timeout "${BENCH_TIMEOUT:-600}" "$B/megamoe" bench "${args[@]}" --reps "${REPS:-15}" --out "$work" "$@" \
      > "$work/bench-${name//\//-}.log" 2>&1; rc=$?
    tail -n 2 "$work/bench-${name//\//-}.log"; [ $rc -eq 0 ] || { echo "bench $name: rc $rc"; status=1; }
  done
  "$B/megamoe" report --dir "$work" 2>&1 | tail -n 1
fi
if want decode; then
  # The engine: the small model's decode report and its end-to-end parity with the CPU model, then the Flash
  # decode report at batch 1 (DECODE_FLASH=0 skips it: filling Flash's synthetic experts takes minutes),
  # each under its own limit; decode.csv and parity.csv land beside the logs.
  step "decode: small"
  small_ok=1
  timeout "${DECODE_TIMEOUT:-120}" "$B/megamoe" decode --model small --context 256 --prompt-len 16 \
    --max-new-tokens 64 --out "$work" > "$work/decode-small.log" 2>&1 || { echo "decode small failed"; status=1; small_ok=0; }
  tail -n 30 "$work/decode-small.log"
  # PARITY_SEEDS (default 3) seeds, each its own weights and prompts: the run ends with the spread of the GPU's
  # distance from CPU4 against its floor's over the seeds.
  step "decode: small parity (${PARITY_SEEDS:-3} seeds)"
  timeout "${PARITY_TIMEOUT:-300}" "$B/megamoe" decode --model small --context 256 --prompt-len 8 \
    --max-new-tokens 48 --parity --parity-seeds "${PARITY_SEEDS:-3}" --out "$work" > "$work/parity-small.log" 2>&1 \
    || { echo "parity failed"; status=1; }
  tail -n 8 "$work/parity-small.log"
  # Flash's weight fill takes minutes: spend them only once the small model decodes.
  if [ "${DECODE_FLASH:-1}" != 0 ] && [ "$small_ok" = 1 ]; then
    # `megamoe generate` end to end on Flash (the real tokenizer's ids need the real vocabulary; the small model's
    # 512 refuses them before any GPU work): chat template, tokenizer, streamed reply, stop reason, TTFT (synthetic
    # weights: the text is gibberish; what is checked is that it runs and reports).
    step "generate: flash"
    MEGAMOE_TOKENIZER="$B/tokenizer.json" timeout "${DECODE_TIMEOUT:-120}" "$B/megamoe" generate --model flash \
      --context 512 --max-new-tokens 24 --temperature 0 "Explain mixture-of-experts decoding in one sentence." \
      > "$work/generate-flash.log" 2>&1 || { echo "generate flash failed"; status=1; }
    tail -n 3 "$work/generate-flash.log"
    # One weight load for the issue's sweeps: contexts 4K..1M at batch 1, batches 1..64 at 4K, each point timed
    # at the end of its context (--at-context: zero-filled caches below the timed positions).
    step "decode: flash sweeps (context at batch 1, batch at 4K)"
    timeout "${DECODE_FLASH_TIMEOUT:-540}" "$B/megamoe" decode --model flash --at-context \
      --context "${DECODE_CONTEXTS:-4096,32768,131072,524288,1048576}" --batch "${DECODE_BATCHES:-1,2,4,8,16,32,64}" \
      --max-new-tokens 32 --out "$work" > "$work/decode-flash.log" 2>&1 || { echo "decode flash failed"; status=1; }
    grep -E "^== decode|^tokens/s|^roofline|^TPOT" "$work/decode-flash.log" | head -n 60
    # The dense route's baseline: the batch sweep's last point (4K, batch 64) with --dense-route gemv (the CUDA-core
    # GEMV for every linear) beside the sweep's default auto row (src/ops/dense/route.rs); decode.csv's dense_route
    # column tells them apart.
    # DECODE_GEMV_BASELINE=0 skips it.
    if [ "${DECODE_GEMV_BASELINE:-1}" != 0 ]; then
      step "decode: flash 4K batch 64, dense linears on the GEMV (--dense-route gemv; the baseline of the sweep's batch-64 point)"
      timeout "${DECODE_FLASH_AB_TIMEOUT:-${DECODE_FLASH_TIMEOUT:-540}}" "$B/megamoe" decode --model flash --at-context \
        --context 4096 --batch 64 --dense-route gemv --max-new-tokens 32 --out "$work" \
        > "$work/decode-flash-dense-gemv.log" 2>&1 || { echo "decode flash --dense-route gemv failed"; status=1; }
      grep -E "^== decode|^tokens/s|^roofline|^TPOT|^dense" "$work/decode-flash-dense-gemv.log" | head -n 8
    fi
    # TTFT on a real prompt (the issue's 4K-token prompt at batch 1): prefill runs in chunks of 1024 prompt tokens
    # (--prefill-chunk 1024, the default and the maximum: 4 chunks, eager launches; above 64 rows the dense linears
    # on cuBLASLt and the routed experts on moe_gemm's prefill mainloop; decode.csv's prefill_chunk column), then
    # the baseline at 64 (the decode kernels' paths, the phase-1 number) on the same machine; --prefill-chunk 1 would
    # be token by token through the prompt step's graph (~4096 steps, ~45 s). DECODE_TTFT=0 skips both,
    # DECODE_TTFT_BASELINE=0 the baseline.
    if [ "${DECODE_TTFT:-1}" != 0 ]; then
      step "decode: flash TTFT, 4K-token prompt, batch 1, --prefill-chunk 1024"
      timeout "${DECODE_TTFT_TIMEOUT:-150}" "$B/megamoe" decode --model flash --context 8192 --batch 1 \
        --prompt-len 4096 --prefill-chunk 1024 --max-new-tokens 16 --out "$work" > "$work/decode-flash-ttft.log" 2>&1 \
        || { echo "decode flash TTFT failed"; status=1; }
      grep -E "^== decode|^TTFT|^TPOT" "$work/decode-flash-ttft.log" | head -n 4
      if [ "${DECODE_TTFT_BASELINE:-1}" != 0 ]; then
        step "decode: flash TTFT, 4K-token prompt, batch 1, --prefill-chunk 64 (the baseline)"
        timeout "${DECODE_TTFT_TIMEOUT:-150}" "$B/megamoe" decode --model flash --context 8192 --batch 1 \
          --prompt-len 4096 --prefill-chunk 64 --max-new-tokens 16 --out "$work" \
          > "$work/decode-flash-ttft-64.log" 2>&1 || { echo "decode flash TTFT (chunk 64) failed"; status=1; }
        grep -E "^== decode|^TTFT|^TPOT" "$work/decode-flash-ttft-64.log" | head -n 4
      fi
    fi
  fi
  # REPORT.md of this run's directory (its decode section, and any bench rows beside it).
  "$B/megamoe" report --dir "$work" 2>&1 | tail -n 1
fi
# The baseline binaries of the A/B steps: AB_BASE (default gpu-bundle-base/ beside this bundle; decode-ab takes
# several, bench-ab the first), each unpacked once.
read -ra bases <<< "${AB_BASE:-$(dirname "$B")/gpu-bundle-base}"
for d in "${bases[@]}"; do
  if { want decode-ab || want bench-ab; } && [ -f "$d/megamoe.xz" ]; then
    xz -d -f "$d/megamoe.xz" && chmod +x "$d/megamoe"
  fi
done
base="${bases[0]}"
base_commit="$(head -n1 "$base/COMMIT" 2>/dev/null || echo unknown)"
if want bench-ab; then
  if [ -x "$base/megamoe" ]; then
    for round in 1 2; do
      for side in candidate baseline; do
        if [ "$side" = candidate ]; then bin="$B/megamoe"; c="$MEGAMOE_GIT_COMMIT"; else bin="$base/megamoe"; c="$base_commit"; fi
        for name in ${AB_CONFIGS:?bench-ab needs AB_CONFIGS (bench config names under bench-configs/, e.g. ab/X)}; do
          step "bench-ab: $side ($c), round $round, $name"
          log="$work/ab-$side-${name//\//-}-$round.log"
          # One directory a round: a bench run rewrites its CSVs, so a shared one would keep only the last round.
          MEGAMOE_GIT_COMMIT="$c" timeout "${BENCH_TIMEOUT:-600}" "$bin" bench --config "$B/bench-configs/$name.toml" \
            --out "$work/ab-$side-$round" > "$log" 2>&1 || { echo "bench-ab $side $name round $round failed"; status=1; }
          tail -n 1 "$log"
        done
      done
    done
  else
    echo "bench-ab: no baseline binary in $base (scripts/gpu-baseline.sh COMMIT builds one)"; status=1
  fi
fi
if want decode-ab; then
  # Sides: the candidate, then each baseline (named "baseline" when there is one, by its commit when several).
  sides=("$B/megamoe|$MEGAMOE_GIT_COMMIT|candidate")
  missing=0
  for d in "${bases[@]}"; do
    [ -x "$d/megamoe" ] || { echo "decode-ab: no baseline binary in $d (scripts/gpu-baseline.sh COMMIT builds one)"; missing=1; }
    c="$(head -n1 "$d/COMMIT" 2>/dev/null || echo unknown)"
    if [ "${#bases[@]}" -eq 1 ]; then name=baseline; else name="$c"; fi
    sides+=("$d/megamoe|$c|$name")
  done
  if [ "$missing" -eq 0 ]; then
    for round in 1 2; do
      order=("${sides[@]}")
      if [ "$round" -eq 2 ]; then order=(); for ((i = ${#sides[@]} - 1; i >= 0; i--)); do order+=("${sides[$i]}"); done; fi
      for side in "${order[@]}"; do
        IFS='|' read -r bin c name <<< "$side"
        step "decode-ab: $name ($c), round $round, Flash 4K, batches ${AB_BATCHES:-1,8,64}"
        MEGAMOE_GIT_COMMIT="$c" timeout "${AB_TIMEOUT:-150}" "$bin" decode --model flash --at-context --context 4096 \
          --batch "${AB_BATCHES:-1,8,64}" --max-new-tokens 32 --out "$work/ab-$name" > "$work/ab-$name-$round.log" 2>&1 \
          || { echo "decode-ab $name round $round failed"; status=1; }
        grep -E "^== decode|^TPOT" "$work/ab-$name-$round.log" | paste - - | sed -E 's/ +/ /g' | cut -c1-160
      done
    done
  else
    status=1
  fi
fi
# With PROFILE_SOURCE=1, after an ncu run that saved $work/ncu-NAME.ncu-rep: its details appended to ncu-NAME.txt,
# its per-SASS-instruction page (warp-stall samples per instruction: which load a warp waits on) exported as
# ncu-NAME-source.csv.gz and summarized by ncu-hot.py into ncu-NAME-hot.txt; the report itself deleted.
ncu_source_page() {
  local name="$1"
  [ -f "$work/ncu-$name.ncu-rep" ] || return 0
  "$ncu" -i "$work/ncu-$name.ncu-rep" >> "$work/ncu-$name.txt" 2>&1
  timeout 120 "$ncu" -i "$work/ncu-$name.ncu-rep" --page source --print-source sass --csv \
    > "$work/ncu-$name-source.csv" 2>&1 || echo "ncu $name: source export failed (see ncu-$name-source.csv)"
  rm -f "$work/ncu-$name.ncu-rep"
  python3 "$B/ncu-hot.py" "$work/ncu-$name-source.csv" 40 > "$work/ncu-$name-hot.txt" 2>&1 \
    && gzip -f "$work/ncu-$name-source.csv"
}
if want engine-profile; then
  ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
  rep=(); [ -n "${PROFILE_SOURCE:-}" ] && rep=(-o "$work/ncu-engine" -f)
  re="${ENGINE_NCU_KERNELS:-attn_candidates|sparse_attn_decode_fp8|sparse_attn_combine|mhc_pre_finish_pdl|router_logits|router_select}"
  step "engine-profile: ncu on the Flash decode step, batch ${ENGINE_NCU_BATCH:-1} ($re)"
  # shellcheck disable=SC2001
  LD_LIBRARY_PATH="$(echo "$LD_LIBRARY_PATH" | sed "s|$B/lib:||")" timeout "${ENGINE_NCU_TIMEOUT:-240}" "$ncu" \
    --clock-control none --cache-control none -k "regex:$re" --launch-skip "${ENGINE_NCU_SKIP:-700}" \
    --launch-count "${ENGINE_NCU_COUNT:-21}" --section SpeedOfLight --section LaunchStats --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    "${rep[@]}" "$B/megamoe" decode --model flash --context 4096 --batch "${ENGINE_NCU_BATCH:-1}" --prompt-len 16 \
    --expert-slots "${ENGINE_NCU_SLOTS:-8}" \
    --max-new-tokens 12 --out "$work/engine-profile" > "$work/ncu-engine.txt" 2>&1 || { echo "engine-profile failed"; status=1; }
  [ -n "${PROFILE_SOURCE:-}" ] && ncu_source_page engine
  grep -E "^  [a-z_0-9]+ \(|Duration" "$work/ncu-engine.txt" | paste - - | sed -E 's/ +/ /g' | cut -c1-150 | head -n 40
fi
if want model && [ -x "$B/tests/model_reference" ]; then
  # The CPU reference model's Flash one-token decode, timed on this machine's cores (test executable added
  # to the bundle by hand: it has no GPU tests).
  step "model: Flash one-token CPU decode"
  timeout 300 "$B/tests/model_reference" --ignored --exact slow_flash_one_token_decode_timing --nocapture \
    > "$work/tests/model_reference_flash_timing.log" 2>&1 || status=1
  tail -n 4 "$work/tests/model_reference_flash_timing.log"
fi
if want profile; then
  ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
  sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
  sections="$sections --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats"
  sections="$sections --section InstructionStats --section SourceCounters"
  # The section bodies (pipe utilization per unit: tensor / ALU / FMA / shared) when this ncu can print them.
  details=(); "$ncu" --help 2>/dev/null | grep -q -- "--print-details" && details=(--print-details all)
  for c in "$B"/bench-configs/profile/*.toml; do
    name="$(basename "$c" .toml)"
    sel="${PROFILES:-${CONFIGS:-}}"
    if [ -n "$sel" ] && ! [[ " $sel " == *" $name "* ]]; then continue; fi
    re="$(sed -n 's/^# ncu-kernels: //p' "$c")"; launches="$(sed -n 's/^# ncu-launches: //p' "$c")"
    step "ncu $name ($re, ${launches:-8} launches)"
    # PROFILE_SOURCE=1 also keeps the report and exports its per-SASS-instruction page (warp-stall samples per
    # instruction: which load a warp waits on) as ncu-<family>-source.csv.gz, summarized by ncu-hot.py into ncu-<family>-hot.txt.
    rep=(); [ -n "${PROFILE_SOURCE:-}" ] && rep=(-o "$work/ncu-$name" -f)
    # shellcheck disable=SC2086
    timeout "${PROFILE_TIMEOUT:-200}" "$ncu" --clock-control none $sections ${NCU_EXTRA:-} "${details[@]}" -k "regex:$re" "${rep[@]}" \
      --launch-count "${launches:-8}" "$B/megamoe" bench --config "$c" --out "$work/profile-bench" \
      > "$work/ncu-$name.txt" 2>&1 || { echo "ncu $name failed"; status=1; }
    [ -n "${PROFILE_SOURCE:-}" ] && ncu_source_page "$name"
    grep -E "^  [a-z_0-9]+ \(|Duration|DRAM Throughput" "$work/ncu-$name.txt" | paste - - - | head -n 20
  done
  rm -rf "$work/profile-bench"
fi
pack
exit $status
