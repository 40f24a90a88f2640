#!/usr/bin/env bash
# Same-run A/B of several kvstream builds (docs/benchmarking.md: ratios from one run, not absolute
# times from different runs). Each build is a folder under $AB_DIR (default .carry/ab) holding
# `kvstream` and its kernel cache `cache/`; every build times the same shapes, in alternating
# order over PASSES passes, and bench/ab_table.py prints shape x key x build; the results files
# are written under $OUT/ab and travel back packed too, as $OUT/ab-results.tar.gz.
# SERVING_IDS adds rows of bench/serving.json (paged, multi-token), timed by the builds named in
# SERVING_BUILDS (default: all; builds from before paged caches cannot run them) with
# AB_SERVING_ARGS (e.g. `--splits 1,4,16`). MLA_IDS adds rows of bench/matrix-mla.json (`kvstream
# mla --matrix`, each checked against the f64 reference); IDS= (empty) skips the GQA rows;
# AB_BENCH_ARGS adds `kvstream bench` options to the GQA rows (e.g. `--ctas 132`: the persistent
# engine forced next to the default, key `kvstream/c132`).
# DEMO_SHAPES adds `kvstream demo` problems, `;`-separated argument lists (multi-token rows, which
# `kvstream bench` does not take; e.g. "--hq 32 --hkv 2 --q-len 8 --len 32768 --ctas 132"), each
# checked against the f64 reference and keyed by its arguments.
#   AB_DIR=.carry/ab IDS=mqa-d128-L1024,gqa-d64-L1024 PASSES=2 bash bench/ab.sh
set -u
# shellcheck source=bench/run-lib.sh
. "$(dirname "$0")/run-lib.sh"
AB_DIR=${AB_DIR:-.carry/ab}
# the builds come packed (prepare-gpu-run.sh writes xz, older runs gzip)
for packed in "$AB_DIR.tar.xz" "$AB_DIR.tar.gz"; do
  if [ ! -d "$AB_DIR" ] && [ -f "$packed" ]; then mkdir -p "$AB_DIR" && unpack "$packed" "$AB_DIR"; fi
done
IDS=${IDS-mqa-d128-L1024,gqa-d64-L1024,gqa-d128-L4096,mqa-d64-L4096,batch-b16-L4096}
PASSES=${PASSES:-2}
# AB_BUDGET (seconds; gpu-run.sh passes what is left of its BUDGET) bounds every step: each
# timeout is its own cap or what is left, so a long run stops in time to pack its rows
budget_from "${AB_BUDGET:-86400}"
O=${OUT:-/tmp/out}/ab; mkdir -p "$O"  # (in $OUT as they are written: a run cut short keeps its rows)
builds=$(ls "$AB_DIR" | tr '\n' ' ')
for pass in $(seq 1 "$PASSES"); do
  order=$builds; [ $((pass % 2)) = 0 ] && order=$(tr ' ' '\n' <<<"$builds" | tac)
  for b in $order; do
    # builds from before the cluster reduction have one mode and no --modes
    modes=$("$AB_DIR/$b/kvstream" bench --help | grep -q -- --modes && echo --modes)
    # (builds before KVSTREAM_COMMIT existed write this checkout's commit into their files)
    if [ -n "$IDS" ]; then
      KVSTREAM_COMMIT=$b KVSTREAM_CACHE_DIR="$AB_DIR/$b/cache" timeout $(cap 120) "$AB_DIR/$b/kvstream" bench --ids "$IDS" \
        $modes ${AB_BENCH_ARGS:-} --rounds 7 --no-plots --json "$O/$b-$pass.json" > "$O/$b-$pass.txt" 2>&1
      echo "$b pass $pass rc=$?"
    fi
    if [ -n "${MLA_IDS:-}" ]; then
      KVSTREAM_COMMIT=$b KVSTREAM_CACHE_DIR="$AB_DIR/$b/cache" timeout $(cap 300) "$AB_DIR/$b/kvstream" mla \
        --matrix bench/matrix-mla.json --ids "$MLA_IDS" --rounds 9 --json "$O/$b-m$pass.json" > "$O/$b-m$pass.txt" 2>&1
      echo "$b mla pass $pass rc=$? $(grep -c RESULT "$O/$b-m$pass.txt") rows, $(grep -ci error "$O/$b-m$pass.txt") errors"
    fi
    if [ -n "${DEMO_SHAPES:-}" ]; then
      IFS=';' read -ra demos <<<"$DEMO_SHAPES"
      for d in "${demos[@]}"; do
        echo "== $d"
        # (word splitting of $d is the point: it is an argument list)
        # shellcheck disable=SC2086
        KVSTREAM_CACHE_DIR="$AB_DIR/$b/cache" timeout $(cap 120) "$AB_DIR/$b/kvstream" demo $d --rounds 9 2>&1 | grep -E "plan:|check|RESULT"
      done > "$O/$b-demo$pass.log"
      echo "$b demo pass $pass: $(grep -c RESULT "$O/$b-demo$pass.log") of ${#demos[@]} rows"
    fi
    if [ -n "${SERVING_IDS:-}" ] && [[ " ${SERVING_BUILDS:-$builds} " == *" $b "* ]]; then
      KVSTREAM_COMMIT=$b KVSTREAM_CACHE_DIR="$AB_DIR/$b/cache" timeout $(cap 300) "$AB_DIR/$b/kvstream" bench \
        --matrix bench/serving.json --ids "$SERVING_IDS" ${AB_SERVING_ARGS:-} --rounds 7 --no-plots \
        --json "$O/$b-s$pass.json" > "$O/$b-s$pass.txt" 2>&1
      echo "$b serving pass $pass rc=$?"
    fi
  done
done
python3 "$(dirname "$0")/ab_table.py" $(ls "$O"/*.json "$O"/*.log 2>/dev/null) | tee "$O/table.txt"
tar czf "${OUT:-/tmp/out}/ab-results.tar.gz" -C "$O" .
