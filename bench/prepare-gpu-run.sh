#!/usr/bin/env bash
# Builds what bench/gpu-run.sh needs into the git-ignored .carry/ folder: the release CLI, the
# GPU test executable, every kernel compiled (cache + raw CUBINs) and the Python wheel.
# AB_REFS="c790eea 1ca18d6" also builds those commits or branches (and this tree) for
# bench/ab.sh into .carry/ab/<ref>/ (slashes as dashes) with every bf16 kernel in their caches
# (ONLY narrows them as below; this tree under its own short commit, `-dirty` when crates/ or
# kernels/ differ from it), packed as .carry/ab.tar.xz.
# RINGS="g2s4,r2" also compiles the persistent variants of those forced rings (bench --rings).
# ONLY="decode_mla stream_read" compiles only the variants whose names contain one of those words
# (for a run of a few parts: a minute instead of ten on two cores; every variant those
# parts load must be among them, as the GPU machine may have no NVRTC on its library path);
# WHEEL=0 skips the Python wheel. CACHE=xz packs the cache (every variant, or ONLY's) as
# .carry/cache.tar.xz (all of it about 20 MB: room for the FA3 wheel beside it, nothing
# compiled there). CACHE=0 ships no compiled kernels: gpu-run.sh's `jit` part
# compiles them on the GPU machine (all its cores: ~10 min on two, under two expected on
# sixteen), which leaves room for the FA3 wheel.
# Carry .carry and .whl (the FA3 wheel) together: about 55 MB (CACHE=0: about 36 MB, and the
# whole kernel cache compiled there); with AB_REFS, .carry alone.
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
# every variant (or ONLY's, and RINGS's) into the cache; raw CUBINs too with DUMP_CUBINS=1
# (gpu-run.sh's `sass` part; CI runs the same SASS checks in tests/nvrtc.rs)
if [ "${CACHE:-1}" != 0 ]; then
  for only in ${ONLY:-""}; do
    KVSTREAM_CACHE_DIR="$PWD/.carry/cache" .carry/bin/kvstream kernels ${only:+--only "$only"} \
      ${RINGS:+--rings "$RINGS"} ${DUMP_CUBINS:+--dump .carry/cubins} > /dev/null
  done
fi
# TRACE=1: the phase-trace builds too (gpu-run.sh's `trace` part; their cache keys differ).
# Any KVSTREAM_TRACE value turns the trace on; `kernels` only compiles, so nothing is written.
if [ -n "${TRACE:-}" ]; then
  for only in ${ONLY:-""}; do
    KVSTREAM_TRACE=/dev/null KVSTREAM_CACHE_DIR="$PWD/.carry/cache" .carry/bin/kvstream kernels ${only:+--only "$only"} > /dev/null
  done
fi
if [ "${WHEEL:-1}" != 0 ]; then
  # always rebuilt: the wheel embeds the kernels and the plan, so an older one would test them
  bash scripts/build-wheel.sh
  cp target/wheels/kvstream-*.whl .carry/wheels/
fi
if [ -n "${AB_REFS:-}" ]; then
  keep() { for f in "$1"/*; do case $(basename "$f") in
    decode.bf16.*|decode_gqa.bf16.*|combine.bf16.*|plan_work.*|stream_read.*|decode_mla.bf16.*) cp "$f" "$2"/ ;; esac; done; }
  head=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates kernels || echo -dirty)
  mkdir -p ".carry/ab/$head/cache" && cp .carry/bin/kvstream ".carry/ab/$head/" && keep .carry/cache ".carry/ab/$head/cache"
  for ref in $AB_REFS; do
    name=${ref//\//-}  # a branch's slashes would nest folders
    wt=$(mktemp -d) && git worktree add -q --detach "$wt" "$ref"
    # (a target folder a ref: one shared by worktrees handed out a stale binary once)
    CARGO_TARGET_DIR="$PWD/target/ab-$name" cargo build --release -q -p kvstream-cli --manifest-path "$wt/Cargo.toml"
    mkdir -p ".carry/ab/$name/cache" && cp "target/ab-$name/release/kvstream" ".carry/ab/$name/"
    tmp=$(mktemp -d)
    for only in ${ONLY:-""}; do
      KVSTREAM_CACHE_DIR="$tmp" ".carry/ab/$name/kvstream" kernels ${only:+--only "$only"} > /dev/null
    done
    keep "$tmp" ".carry/ab/$name/cache" && rm -rf "$tmp"
    git worktree remove --force "$wt"
  done
  # xz: the builds' caches are ~50 MB gzipped, ~20 MB so (ab.sh unpacks either)
  tar cf - -C .carry/ab . | xz -T0 -6 > .carry/ab.tar.xz && rm -rf .carry/ab
fi
# packed last (the A/B build of this tree above copies from it): gzip takes it to a quarter,
# CACHE=xz to about a sixth (gpu-run.sh unpacks either)
if [ -d .carry/cache ] && [ "${CACHE:-1}" = xz ]; then
  tar cf - -C .carry cache | xz -T0 -6 > .carry/cache.tar.xz && rm -rf .carry/cache
elif [ -d .carry/cache ]; then
  tar czf .carry/cache.tar.gz -C .carry cache && rm -rf .carry/cache
fi
du -sh .carry
