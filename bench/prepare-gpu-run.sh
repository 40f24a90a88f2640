#!/usr/bin/env bash
# Builds what bench/gpu-run.sh needs into the git-ignored .carry/ folder: the release CLI, the
# GPU test executable, every kernel compiled (cache + raw CUBINs) and the Python wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="$PWD/.nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rm -rf .carry && mkdir -p .carry/bin .carry/wheels
cargo build --release -p kvstream-cli
cp target/release/kvstream .carry/bin/
exe=$(cargo test -p kvstream --release --test gpu --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="gpu": print(m["executable"])')
cp "$exe" .carry/bin/gpu-tests
KVSTREAM_CACHE_DIR="$PWD/.carry/cache" .carry/bin/kvstream kernels --dump .carry/cubins
[ -n "$(ls target/wheels/kvstream-*.whl 2>/dev/null)" ] || bash scripts/test-python.sh
cp target/wheels/kvstream-*.whl .carry/wheels/
du -sh .carry
