#!/usr/bin/env bash
# Install the pinned CUDA 13.0 compiler (nvcc/ptxas 13.0.88, the GPU machine's version) from PyPI into a
# git-ignored folder, for machines without a CUDA toolkit (dev boxes, CI). Prints the nvcc path last.
#   usage: scripts/install-nvcc.sh            -> .tools/cuda/bin/nvcc
#          export NVCC=$(scripts/install-nvcc.sh | tail -n1)
#          scripts/install-nvcc.sh --sass-tools  -> also cuobjdump + nvdisasm (13.5.37: PyPI has no 13.0 build; a
#            newer disassembler reads 13.0 sm_90a cubins) under .tools/pip-sass/, to read the SASS of a kernel
#            without a GPU: cuobjdump -sass target/debug/build/megamoe-*/out/<family>.sm_90a.cubin
#          scripts/install-nvcc.sh --cupti  -> also CUPTI 13.0.85 (libcupti.so.13, the kernel timelines of
#            src/gpu/trace.rs) under .tools/pip-cupti/; prints its path first (gpu-bundle.sh ships it)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = --cupti ]; then
  cupti="$root/.tools/pip-cupti"
  if [ ! -f "$cupti/.installed-13.0.85" ]; then
    echo "installing CUPTI 13.0.85 into $cupti ..." >&2
    python3 -m pip install -q --disable-pip-version-check --no-deps --target "$cupti" "nvidia-cuda-cupti==13.0.85" >&2
    touch "$cupti/.installed-13.0.85"
  fi
  find "$cupti" -name libcupti.so.13 -type f -print | head -n1
fi
if [ "${1:-}" = --sass-tools ]; then
  sass="$root/.tools/pip-sass"
  if [ ! -f "$sass/.installed-13.5.37" ]; then
    echo "installing cuobjdump + nvdisasm 13.5.37 into $sass ..." >&2
    python3 -m pip install -q --disable-pip-version-check --target "$sass" \
      "nvidia-cuda-cuobjdump==13.5.37" "nvidia-cuda-nvdisasm==13.5.37" >&2
    touch "$sass/.installed-13.5.37"
  fi
  find "$sass" -path '*/bin/*' -type f \( -name cuobjdump -o -name nvdisasm \) -exec chmod +x {} \; -print
fi
dest="$root/.tools/pip-cuda"
pin="cuda-toolkit[nvcc,cccl]==13.0.3.0"
stamp="$dest/.installed-13.0.3.0"
if [ ! -f "$stamp" ]; then
  echo "installing $pin into $dest ..." >&2
  python3 -m pip install -q --disable-pip-version-check --target "$dest" "$pin" >&2
  touch "$stamp"
fi
nvcc="$(find "$dest" -path '*/bin/nvcc' -type f | head -n1)"
if [ -z "$nvcc" ]; then
  echo "error: nvcc not found under $dest after install" >&2
  exit 1
fi
chmod +x "$nvcc" "$(dirname "$nvcc")"/* 2>/dev/null || true
cuda_home="$(dirname "$(dirname "$nvcc")")"
# nvcc looks for its include/ and nvvm/ relative to itself; the pip layout keeps them together.
"$nvcc" --version | tail -n2 >&2
echo "CUDA_HOME=$cuda_home" >&2
echo "$nvcc"
