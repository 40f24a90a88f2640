#!/usr/bin/env bash
# Everything that needs the GPU, in one command that builds nothing: demos over several shapes,
# the Rust GPU test suite and its summary, compute-sanitizer, SASS facts, the Python GPU tests, a
# split sweep and the SDPA peers. Expects, prepared on a build machine (bench/prepare-gpu-run.sh):
# the release binary and the GPU test executable in .carry/bin, the compiled kernels in
# .carry/cache (or packed, .carry/cache.tar.gz) and .carry/cubins, the Python wheel in .carry/wheels.
# PARTS selects: jit demo sanitize sass gputests models pytests sweep peers bench engines compare compare8 fp8sweep fp8splits storekv cp cpmulti abdemo abctas abwide racediag widencu serving mla mlamatrix mlapeers mlatrace mlancu mlancunarrow mlamerge ab (default:
# demo sanitize sass gputests pytests peers); `ab` runs bench/ab.sh over .carry/ab (see
# prepare-gpu-run.sh's AB_REFS). `bench` runs `kvstream bench` over bench/matrix.json,
# `compare` runs bench/compare.py (kvstream through the binding next to cuDNN, FA2 and FA3; the
# FA3 wheel travels in .whl/); both pack their outputs into $OUT/<part>-results.tar.gz;
# `compare8` is compare.py's FP8 comparison (e4m3 caches, FA3's fp8 path); `fp8sweep` the FP8
# tuning sweep of `kvstream bench` (FP8_IDS, FP8_RINGS); `storekv` times the cache write against
# copies of the same bytes (bench/store_kv_bench.py -> $OUT/store-kv-latest.json); `fp8splits` times
# the split engine's fp8 rows at the plan's split count (FP8_TARGET_CTAS_PER_SM), the 2-byte one and
# twice the plan's (at most 128).
# `trace` runs the rows TRACE_IDS of TRACE_MATRIX (default bench/serving.json; rows without
# score modifiers of bench/matrix-models.json too) with the phase-trace kernels (prepare with TRACE=1;
# TRACE_ARGS, e.g. `--ctas 132`, forces the persistent engine where the plan picks the split one)
# and summarises them with bench/trace.py into $OUT/trace (timings there carry the stamps).
# `serving` runs bench/serving.json (SERVING_ARGS) and bench/serving_peers.py (PEERS_ARGS, e.g.
# --fa3-contiguous: FA3 on a contiguous copy of the skewed batch).
set -u
B=.carry/bin/kvstream
export KVSTREAM_CACHE_DIR=$PWD/.carry/cache
# shellcheck source=bench/run-lib.sh
. "$(dirname "$0")/run-lib.sh"
# (prepare-gpu-run.sh packs it with gzip or, CACHE=xz, with xz; both where both came)
for packed in .carry/cache.tar.gz .carry/cache.tar.xz; do
  [ ! -f "$packed" ] || unpack "$packed" .carry
done
# Every file lands in $O and leaves packed as one $OUT/gpu-run.tar.gz (at exit, whatever ran):
# the GPU machine returns a few files only. BUDGET (seconds, default 570) bounds the whole run:
# each step's timeout is its own cap or what is left, whichever is less.
OUT_DIR=${OUT:-/tmp/out}; mkdir -p "$OUT_DIR"
O=$(mktemp -d)/gpu-run; mkdir -p "$O"
trap 'tar czf "$OUT_DIR/gpu-run.tar.gz" -C "$(dirname "$O")" gpu-run' EXIT
budget_from "${BUDGET:-570}"
# NVRTC from the pip CUDA libraries next to torch: a variant missing from the cache compiles
lib=$(python3 -c 'import os,nvidia;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))' 2>/dev/null) &&
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# the copy of the tree measured here may carry another checkout's git metadata
[ -z "${COMMIT:-}" ] || export KVSTREAM_COMMIT=$COMMIT
PARTS=${PARTS:-demo sanitize sass gputests pytests peers}
want() { [[ " $PARTS " == *" $1 "* ]]; }
run() { echo "== $*"; timeout $(cap 120) "$@"; echo "rc=$?"; }
# results files name the GPU they were measured on (an H100 may stand in for the H200)
gpu_prefix() { nvidia-smi -L | grep -q H100 && echo h100 || echo h200; }
nvidia-smi -L
if want jit; then
  # every kernel variant compiled here, one per core at a time (~10 min on two build cores; under
  # a minute expected on 16, not yet timed there): for a run prepared without the kernel cache
  # (prepare-gpu-run.sh with CACHE=0), which leaves room in the carried files for the FA3 wheel.
  timeout $(cap 300) $B kernels ${RINGS:+--rings "$RINGS"} > $O/jit.txt 2>&1; echo "== jit: rc=$?, $(ls .carry/cache | wc -l) files in the kernel cache"
fi
if want demo; then
  run $B demo
  run $B demo --len 131072
  run $B demo --hq 32 --hkv 1 --head-dim 64 --len 1000 --dtype f16 --splits 7
  run $B demo --batch 3 --hq 12 --hkv 2 --len 65 --splits 1
  run $B demo --batch 2 --hq 10 --hkv 2 --head-dim 64 --len 4097 --dtype bf16
  run $B demo --batch 128 --hq 32 --hkv 8 --len 4096
  run $B demo --batch 8 --hq 32 --hkv 8 --len 32768 --q-len 4 --page-size 16
  run $B demo --batch 16 --hq 32 --hkv 8 --len 8192 --device-plan --page-size 64
fi
if want sanitize; then
  for tool in memcheck racecheck synccheck; do
    echo "== $tool"; timeout $(cap 300) compute-sanitizer --tool $tool $B demo --len 1000 --rounds 0 2>&1 | tail -3
  done
fi
if want sass; then
  [ -d .carry/cubins ] || echo "== sass: no .carry/cubins (prepare with DUMP_CUBINS=1)"
  for f in .carry/cubins/*.cubin; do
    [ -e "$f" ] || continue
    s=$(cuobjdump -sass "$f")
    printf "%-44s HMMA=%s LDL/STL=%s UBLKCP=%s\n" "$(basename "$f")" "$(grep -c HMMA <<<"$s")" \
      "$(grep -cE 'LDL|STL' <<<"$s")" "$(grep -c UBLKCP <<<"$s")"
  done
fi
if want sweep; then
  # forced split counts per shape: the data behind plan.rs's heuristic
  for shape in "--len 1024" "--len 4096" "--len 16384" "--len 131072" \
               "--hq 16 --hkv 1 --head-dim 64 --len 4096" "--hq 16 --hkv 1 --head-dim 64 --len 32768" \
               "--hq 16 --hkv 16 --len 32768" "--batch 4 --hq 32 --hkv 8 --len 32768" "--len 65536" \
               "--hq 16 --hkv 1 --len 1024" "--hq 16 --hkv 1 --len 131072" "--hq 16 --hkv 16 --len 4096"; do
    for s in 1 2 4 8 16 24 32 48 64 96 128; do
      timeout $(cap 60) $B demo $shape --splits $s --rounds 9 | grep RESULT | tee -a $O/sweep.txt
    done
  done
fi
if want gputests; then
  G=.carry/bin/gpu-tests
  # GPU_TESTS narrows the suite (test-name filters, e.g. the tests a change touched, first)
  KVSTREAM_GPU_SUMMARY=$O/gpu-summary.json timeout $(cap 400) $G --ignored --test-threads=1 ${GPU_TESTS:-} 2>&1 | tee $O/gpu-tests.log | tail -25
  for tool in ${SUITE_SANITIZERS-memcheck racecheck}; do  # SUITE_SANITIZERS= skips them, SANITIZE_TESTS narrows them
    echo "== $tool on the GPU suite (24 random cases, graphs, zero lengths, cluster reduction, paged, multi-token, device plan, fp8, store_kv, paired heads, lanes, wide columns, two CTAs an SM)"
    KVSTREAM_GPU_CASES=24 KVSTREAM_GPU_SERIALISED=1 timeout $(cap 400) compute-sanitizer --tool $tool $G --ignored --test-threads=1 \
      ${SANITIZE_TESTS:-random_cases graph_capture zero_length cluster_reduction paged_cache multi_token device_plan resident fp8 store_kv paired_heads score_mods column_lanes wide_columns two_ctas} > $O/$tool.txt 2>&1
    grep -E '^test |SUMMARY' $O/$tool.txt | tail -30
  done
fi
if want pytests; then
  # the suite in two calls, each bounded and each with its own log: the transformers models
  # (generation, torch.compile) take the longest
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvs-site .carry/wheels/*.whl
  export KVSTREAM_PY_GPU_SUMMARY=$O/py-gpu-summary.json KVSTREAM_PY_CP_SUMMARY=$O/py-cp-summary.json \
    KVSTREAM_PY_COMPAT_SUMMARY=$O/py-compat-summary.json
  PYTHONPATH=/tmp/kvs-site timeout $(cap 300) python3 -m pytest -q -p no:cacheprovider crates/kvstream-py/python/tests \
    --ignore=crates/kvstream-py/python/tests/test_transformers_gpu.py 2>&1 | tee $O/py-tests.txt | tail -8
  KVSTREAM_PY_INTEGRATION_SUMMARY=$O/integration-latest.json PYTHONPATH=/tmp/kvs-site timeout $(cap 300) \
    python3 -m pytest -q -p no:cacheprovider crates/kvstream-py/python/tests/test_transformers_gpu.py 2>&1 \
    | tee $O/py-transformers.txt | tail -8
fi
if want bench; then
  timeout $(cap 300) $B bench ${BENCH_ARGS:---modes} --json bench/results/kvstream-bench-latest.json \
    --plots bench/results 2>&1 | tee $O/kvstream-bench.txt | tail -70
  tar czf $O/bench-results.tar.gz bench/results/kvstream-bench-latest.json bench/results/*.svg bench/results/*.png 2>/dev/null
fi
# `engines`: the engine choice (`--modes`: the persistent and split engines forced next to the
# default plan) over the batch-1 and batch-4 rows of bench/matrix.json and the batch-1 rows of
# bench/matrix-models.json without score modifiers -> $O/engines-<matrix>.{json,txt}
if want engines; then
  for m in bench/matrix.json bench/matrix-models.json; do
    # (`kvstream bench` refuses rows with score modifiers: they are left out)
    ids=$(python3 -c 'import json, sys; print(",".join(r["id"] for r in json.load(open(sys.argv[1]))["shapes"]
      if r.get("batch", 1) in (1, 4) and not {"window", "sinks", "softcap"} & set(r)))' "$m")
    name=engines-$(basename "$m" .json)
    timeout $(cap 300) $B bench --matrix "$m" --ids "$ids" --modes --rounds ${ENGINE_ROUNDS:-7} --no-plots \
      --json $O/$name.json > $O/$name.txt 2>&1; echo "== $name: rc=$?"; tail -5 $O/$name.txt
  done
fi
if want compare; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvs-site .carry/wheels/*.whl .whl/*.whl
  KVSTREAM_CACHE_DIR=$PWD/.carry/cache PYTHONPATH=/tmp/kvs-site PYTHONUNBUFFERED=1 timeout $(cap 560) \
    python3 bench/compare.py --matrix bench/matrix.json --commit "${COMMIT:-unknown}" ${COMPARE_ARGS:-} \
    2>&1 | tee $O/compare.txt | tail -80
  tar czf $O/compare-results.tar.gz bench/results bench/RESULTS*.md 2>/dev/null
fi
if want models; then
  # the model matrix (bench/matrix-models.json: head dims 96 / 256, windows, softcap, sinks,
  # large multi-token groups) against FA3 and cuDNN where they support a row; MODELS_ARGS e.g.
  # `--ids a,b --rounds 7`
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvs-site .carry/wheels/*.whl .whl/*.whl
  KVSTREAM_CACHE_DIR=$PWD/.carry/cache PYTHONPATH=/tmp/kvs-site PYTHONUNBUFFERED=1 timeout $(cap 560) \
    python3 bench/compare.py --matrix bench/matrix-models.json --impls kvstream,fa3,cudnn --commit "${COMMIT:-unknown}" \
    --results-dir $O/models --md $O/models/RESULTS-models.md ${MODELS_ARGS:-} 2>&1 | tee $O/models.txt | tail -40
fi
if want compare8; then
  # the FP8 comparison (bench/compare.py --kv-dtype fp8_e4m3): <gpu>-fp8-latest.json, RESULTS[-h100]-fp8.md
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvs-site .carry/wheels/*.whl .whl/*.whl
  KVSTREAM_CACHE_DIR=$PWD/.carry/cache PYTHONPATH=/tmp/kvs-site PYTHONUNBUFFERED=1 timeout $(cap 560) \
    python3 bench/compare.py --kv-dtype fp8_e4m3 --matrix bench/matrix.json --commit "${COMMIT:-unknown}" ${COMPARE_ARGS:-} \
    2>&1 | tee $O/compare-fp8.txt | tail -80
  tar czf $O/compare-fp8-results.tar.gz bench/results/*fp8-* bench/RESULTS*fp8*.md 2>/dev/null
fi
if want fp8sweep; then
  # FP8 tuning sweep: rings (paired softmax steps r2, 128-position tiles), grid and fewest tiles
  # per CTA on the rows that decide the FP8 plan (FP8_IDS)
  timeout $(cap 500) $B bench --kv-dtype fp8_e4m3 --ids "${FP8_IDS:-gqa-d128-L131072,mha-d64-L131072,mha-d128-L65536,batch-b16-L32768,batch-b128-L4096}" \
    --rings "${FP8_RINGS:-g2s4,r2,g2s2p128r2,g2s2p128,g1s4p128r2}" --min-tiles 4,16 --ctas 66 --no-plots \
    --json $O/fp8-sweep.json 2>&1 | tee $O/fp8-sweep.txt | tail -40
fi
if want fp8splits; then
  # (shape, the 2-byte target's split count): the default plan, then that count forced
  for row in "--batch 4 --hq 32 --hkv 8 --len 32768:2" "--batch 1 --hq 32 --hkv 8 --len 32768:8" \
             "--len 131072:33" "--hq 16 --hkv 16 --head-dim 64 --len 131072:4" \
             "--head-dim 64 --len 131072:33"; do
    shape=${row%:*}
    timeout $(cap 60) $B demo $shape --kv-dtype fp8_e4m3 --rounds 9 | grep -E 'plan|RESULT' | tee -a $O/fp8-splits.txt
    n=${row##*:}
    # the 2-byte count, and twice the plan's (a second CTA per SM; the kernel reduction takes <= 128)
    for s in $n $((4 * n > 128 ? 128 : 4 * n)); do
      timeout $(cap 60) $B demo $shape --kv-dtype fp8_e4m3 --rounds 9 --splits $s | grep RESULT | tee -a $O/fp8-splits.txt
    done
  done
fi
if want cp; then
  # context parallelism on one GPU (bench/cp_bench.py): merge_states cost, a rank's share of a
  # 1M-token decode, the torch.distributed path at world size 1
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvs-site .carry/wheels/*.whl
  KVSTREAM_CACHE_DIR=$PWD/.carry/cache PYTHONPATH=/tmp/kvs-site timeout $(cap 200) \
    python3 bench/cp_bench.py --commit "${COMMIT:-unknown}" --out $O/$(gpu_prefix)-cp-latest.json 2>&1 | tail -40
fi
if want cpmulti; then
  # context parallelism over this host's GPUs (2+): the multi-GPU tests, then N = 1, 2, 4, 8
  # ranks of examples/context_parallel.py on the issue's rows, one JSON line a run
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvs-site .carry/wheels/*.whl
  export PYTHONPATH=/tmp/kvs-site KVSTREAM_CACHE_DIR=$PWD/.carry/cache
  timeout $(cap 400) python3 -m pytest -q -p no:cacheprovider crates/kvstream-py/python/tests/test_distributed_multi_gpu.py 2>&1 | tail -5
  gpus=$(nvidia-smi -L | wc -l)
  for n in 1 2 4 8; do
    [ "$n" -le "$gpus" ] || break
    for a in "--len 1048576" "--mla --hq 16 --len 1048576" "--batch 16 --ragged --len 131072 --sharding pages"; do
      timeout $(cap 120) torchrun --nproc-per-node $n examples/context_parallel.py $a --json $O/cp-multi.jsonl 2>&1 | tail -2
    done
  done
fi
if want abdemo; then
  # A/Bs of the defaults against their options off: column lanes on large multi-token groups
  # (b16: the persistent engine), paired heads (`--ring h1`: off) on Phi-3-like d 96 MHA rows
  # and gpt-oss's window of 128 at batch (two KV heads a unit halve the units' fixed costs)
  # (each pair twice; the batch-16 and -64 rows build and check caches of several GB on the
  # host: 30 s was too short for them)
  for a in "--batch 16 --hq 64 --hkv 8 --q-len 8 --len 4096" "--batch 16 --hq 32 --hkv 2 --q-len 8 --len 32768"; do
    for o in "" "--column-lanes false" "" "--column-lanes false"; do echo "== $a $o"; timeout $(cap 90) $B demo $a $o --rounds 9 | grep -E 'plan:|check|time:|RESULT'; done
  done 2>&1 | tee $O/abdemo.txt
  for a in "--batch 16 --hq 32 --hkv 32 --head-dim 96 --len 32768" "--batch 1 --hq 32 --hkv 32 --head-dim 96 --len 32768" \
           "--batch 64 --hq 64 --hkv 8 --head-dim 64 --len 32768 --window 127 --sinks"; do
    for o in "" "--ring h1" "" "--ring h1"; do echo "== $a $o"; timeout $(cap 90) $B demo $a $o --rounds 9 | grep -E 'plan:|check|time:|RESULT'; done
  done 2>&1 | tee -a $O/abdemo.txt
fi
if want abctas; then
  # two persistent CTAs per SM (a forced grid of 264) against one, on the batch rows where the
  # engine trails cuDNN by 2-4% (bench/NOTES.md, "Open leads": b16 L32768 ~-2% predicted)
  for a in "--batch 16 --hq 32 --hkv 8 --len 32768" "--batch 128 --hq 32 --hkv 8 --len 4096" \
           "--batch 16 --hq 32 --hkv 8 --head-dim 64 --len 32768" "--batch 32 --hq 32 --hkv 8 --len 32768 --page-size 16"; do
    for o in "" "--ctas 264" "" "--ctas 264"; do echo "== $a $o"; timeout $(cap 90) $B demo $a $o --rounds 9 | grep -E 'plan:|check|time:|RESULT'; done
  done 2>&1 | tee -a $O/abctas.txt
  # e4m3 at batch (1.04-1.14x of the fp8 floor): its default ring (g2s8, 128 KB) leaves no room
  # for a second CTA; shallower rings that do, two an SM
  for a in "--batch 16 --hq 32 --hkv 8 --len 32768 --kv-dtype fp8_e4m3" "--batch 128 --hq 32 --hkv 8 --len 4096 --kv-dtype fp8_e4m3"; do
    for o in "" "--ring g1s4 --ctas 264" "--ring g1s4" "" "--ring g1s4 --ctas 264"; do
      echo "== $a $o"; timeout $(cap 90) $B demo $a $o --rounds 9 | grep -E 'plan:|check|time:|RESULT'
    done
  done 2>&1 | tee -a $O/abctas.txt
  # one-tile units (gpt-oss's window of 128): one consumer group a CTA and two CTAs an SM (one
  # CTA's epilogue under the other's tile), or 64-position tiles (both groups on every unit)
  for a in "--batch 64 --hq 64 --hkv 8 --head-dim 64 --len 32768 --window 127 --sinks" \
           "--batch 16 --hq 64 --hkv 8 --head-dim 64 --len 4096 --window 127 --sinks"; do
    for o in "" "--ring g1s2 --ctas 264" "--ring p64" "--ctas 264" "" "--ring g1s2 --ctas 264" "--ring p64"; do
      echo "== $a $o"; timeout $(cap 90) $B demo $a $o --rounds 9 | grep -E 'plan:|check|time:|RESULT'
    done
  done 2>&1 | tee -a $O/abctas.txt
  # ragged batches (short pieces: one CTA's epilogue under the other's tiles) and pools of 1,
  # as `kvstream bench` times them under one replayed graph, default grid against 264 CTAs
  timeout $(cap 200) $B bench --matrix bench/serving.json --no-plots --ctas 264 \
    --ids ragged-b128-L4096,ragged-b64-L32768,contig-d128-b32-L32768,paged1-d128-b32-L32768 \
    --json $O/abctas-serving.json 2>&1 | tail -14 | tee -a $O/abctas.txt
fi
if want abwide; then
  # the wide consumer's blocks of 128 rows (both warpgroups on every tile, each tile read once)
  # against two blocks of 64 in two lanes (the default), on 128 and 256 rows a KV head
  ab() { for o in "${@:2}"; do echo "== $1 $o"; timeout $(cap 90) $B demo $1 $o --rounds 9 2>&1 | grep -E 'plan:|check|time:|RESULT|rror'; done; }
  {
    r128="--wide-rows 128"
    ab "--batch 16 --hq 32 --hkv 2 --q-len 8 --len 4096" "" "$r128" "" "$r128"
    ab "--batch 16 --hq 32 --hkv 2 --q-len 8 --len 32768" "" "$r128"
    ab "--batch 16 --hq 32 --hkv 1 --q-len 8 --len 16384" "" "$r128"
    ab "--batch 16 --hq 32 --hkv 2 --head-dim 64 --q-len 8 --len 32768" "" "$r128"
    ab "--batch 16 --hq 32 --hkv 2 --q-len 8 --len 32768 --kv-dtype fp8_e4m3" "" "$r128"
  } 2>&1 | tee -a $O/abwide.txt
fi
if want racediag; then
  # racecheck's hazards on the wide consumer: the report with thread and block ids on small
  # wide demos (2-byte and e4m3), and the same shape on a narrow two-group ring (256 consumer
  # threads on the same named barriers, no warpgroup MMA) for comparison
  # (the narrow consumer takes two groups for at most 16 rows a block: one new token there)
  shape="--batch 2 --hq 32 --hkv 2 --len 1000 --engine persistent --rounds 0"
  for o in "--q-len 8 --wide-columns true" "--q-len 8 --wide-columns true --kv-dtype fp8_e4m3" "--ring g2s4"; do
    echo "== racecheck demo $shape $o"
    timeout $(cap 150) compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 30 \
      $B demo $shape $o > "$O/racediag-${o//[ -]/_}.txt" 2>&1
    grep -E 'check vs|RACECHECK SUMMARY|ERROR SUMMARY' "$O/racediag-${o//[ -]/_}.txt" | tail -3
  done
  # memcheck's warpgroup-MMA checks (operand and accumulator use around wgmma) on the wide
  # consumer's two forms
  for o in "" "--wide-rows 128"; do
    echo "== memcheck --check-warpgroup-mma demo $shape --q-len 8 $o"
    timeout $(cap 150) compute-sanitizer --tool memcheck --check-warpgroup-mma yes $B demo $shape --q-len 8 $o \
      > "$O/wgmma-check-${o//[ -]/_}.txt" 2>&1
    grep -E 'check vs|ERROR SUMMARY|rror' "$O/wgmma-check-${o//[ -]/_}.txt" | head -4
  done
fi
if want storekv; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvs-site .carry/wheels/*.whl
  KVSTREAM_CACHE_DIR=$PWD/.carry/cache PYTHONPATH=/tmp/kvs-site timeout $(cap 200) \
    python3 bench/store_kv_bench.py --commit "${COMMIT:-unknown}" --json $O/store-kv-latest.json 2>&1 | tail -12
fi
if want trace; then
  mkdir -p $O/trace
  KVSTREAM_TRACE=$O/trace timeout $(cap 300) $B bench --matrix ${TRACE_MATRIX:-bench/serving.json} \
    --ids "${TRACE_IDS:-contig-d128-b1-L4096,paged16-d128-b1-L4096,paged64-d128-b1-L4096}" ${TRACE_ARGS:-} --no-plots \
    --json $O/trace/bench-traced.json 2>&1 | tail -12
  python3 bench/trace.py $O/trace --json $O/trace/summary.json | tee $O/trace/summary.txt
fi
if want serving; then
  # serving rows (skew under one graph with the device plan, paged vs contiguous, multi-token)
  timeout $(cap 200) $B bench --matrix bench/serving.json ${SERVING_ARGS:-} --no-plots \
    --json bench/results/kvstream-serving-latest.json 2>&1 | tee $O/kvstream-serving.txt | tail -40
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvs-site .carry/wheels/*.whl .whl/*.whl
  KVSTREAM_CACHE_DIR=$PWD/.carry/cache PYTHONPATH=/tmp/kvs-site PYTHONUNBUFFERED=1 timeout $(cap 150) \
    python3 bench/serving_peers.py --json bench/results/serving-peers-latest.json \
    --floors bench/results/kvstream-serving-latest.json --commit "${COMMIT:-unknown}" ${PEERS_ARGS:-} 2>&1 | tee $O/serving-peers.txt | tail -20
  tar czf $O/serving-results.tar.gz bench/results/kvstream-serving-latest.json bench/results/serving-peers-latest.json 2>/dev/null
fi
if want mla; then
  # MLA decode: the GPU tests, memcheck and racecheck on a short run, then timed shapes next to
  # their byte floors (MLA_SHAPES: one `kvstream mla` argument list per line)
  G=.carry/bin/gpu-tests
  timeout $(cap 300) $G --ignored --test-threads=1 --nocapture mla_ 2>&1 | tee $O/mla-tests.log | grep -E "MLA|test result|panicked|FAIL" | tail -30
  for tool in ${MLA_SANITIZERS-memcheck racecheck}; do
    echo "== $tool on the MLA tests (short run)"
    KVSTREAM_GPU_CASES=8 KVSTREAM_GPU_SERIALISED=1 timeout $(cap 300) compute-sanitizer --tool $tool $G --ignored --test-threads=1 \
      mla_cases mla_bad > $O/mla-$tool.txt 2>&1
    tail -4 $O/mla-$tool.txt
    # the distinct hazards: kind, source line, and the other access's line
    grep -E "^========= +(Error|Warning|Race|.*hazard)|at .*decode_mla|Write|Read" $O/mla-$tool.txt | sort | uniq -c | sort -rn | head -12
  done
  while read -r shape; do
    [ -n "$shape" ] || continue
    timeout $(cap 120) $B mla $shape --rounds 9 2>&1 | grep -E "plan|check|time|RESULT|error" | tee -a $O/mla-shapes.txt
  done <<< "${MLA_SHAPES:---hq 16 --len 131072
--hq 16 --len 131072 --kv-dtype fp8_e4m3
--hq 12 --len 131072
--batch 4 --hq 16 --len 131072 --page-size 64
--batch 16 --hq 16 --len 32768 --page-size 32 --kv-dtype fp8_e4m3
--batch 16 --hq 16 --len 1048576 --skew 4096 --kv-dtype fp8_e4m3 --page-size 64
--hq 16 --len 1048576
--batch 8 --hq 12 --len 131072 --page-size 32
--batch 2 --hq 16 --q-len 8 --len 131072
--batch 8 --hq 128 --len 32768}"
fi
if want mlamatrix; then
  # bench/matrix-mla.json (MLA_IDS: a comma-separated filter of ids) with byte floors, then
  # FlashMLA on its bf16 rows of pages of 64 in the same file -> $OUT/h200-mla-latest.json
  timeout $(cap 420) $B mla --matrix bench/matrix-mla.json ${MLA_IDS:+--ids "$MLA_IDS"} --rounds 9 \
    --json $O/h200-mla-latest.json 2>&1 | grep -E "^==|RESULT|error" | tee $O/mla-matrix.txt | tail -40
  bash bench/flashmla_build.sh 2>&1 | tail -2
  PYTHONPATH=/tmp/flashmla timeout $(cap 240) python3 bench/mla_peers.py --merge $O/h200-mla-latest.json 2>&1 | tail -20
fi
if want mlapeers; then
  # FlashMLA's dense bf16 decode (pages of 64) on MLA shapes "hq,s_q,b,L" (bench/mla_peers.py;
  # the build is bench/flashmla_build.sh from a carried .peers/ folder)
  bash bench/flashmla_build.sh 2>&1 | tail -3
  PYTHONPATH=/tmp/flashmla timeout $(cap 300) python3 bench/mla_peers.py --shapes ${MLA_PEER_SHAPES:-16,1,1,131072 \
    12,1,1,131072 16,1,4,131072 16,1,16,32768 12,1,8,131072 16,8,2,131072 128,1,8,32768} \
    --json $O/mla-peers.json 2>&1 | tail -12
fi
if want mlatrace; then
  # the MLA kernel's phase trace on MLA_TRACE_SHAPE (prepare: TRACE=1 compiles the traced builds)
  mkdir -p $O/trace
  KVSTREAM_TRACE=$O/trace timeout $(cap 200) $B mla ${MLA_TRACE_SHAPE:---hq 16 --len 131072} --rounds 7 2>&1 | grep -E "RESULT|trace"
  python3 bench/trace.py $O/trace > $O/trace/summary.txt 2>&1; cat $O/trace/summary.txt | head -30
fi
# ncu on one launch of kernel regex $2 inside the timed graph of `kvstream "${@:3}"`: the full
# section set and the per-instruction source page (warp stall samples by SASS line: where the
# warps wait, summarised by bench/ncu_stalls.py) -> $OUT/$1-ncu.*
ncu_part() {
  local name=$1 kernel=$2; shift 2
  timeout $(cap 400) ncu --kernel-name "regex:$kernel" --launch-skip 3 --launch-count 1 --set full \
    --import-source yes --export $O/$name-ncu -f $B "$@" > $O/$name-ncu.log 2>&1; echo "ncu rc=$?"
  ncu --import $O/$name-ncu.ncu-rep --page details --csv > $O/$name-ncu-details.csv 2>&1
  ncu --import $O/$name-ncu.ncu-rep --page source --csv --print-source sass > $O/$name-ncu-source.csv 2>&1
  grep -E "Compute \(SM\) Throughput|Memory Throughput|Tensor|Shared|Issue Slots|L2 Hit" $O/$name-ncu-details.csv | head -20
  python3 bench/ncu_stalls.py $O/$name-ncu-source.csv --json $O/$name-ncu-stalls.json | tee $O/$name-ncu-stalls.txt | head -50
}
# the GQA wide consumer at WIDE_NCU_SHAPE (default the multi-token row that trails FA3 most,
# 32/2 heads q 8 b16 L4096)
if want widencu; then
  ncu_part wide '^kvs_decode$' demo ${WIDE_NCU_SHAPE:---batch 16 --hq 32 --hkv 2 --q-len 8 --len 4096} --rounds 3
fi
# the MLA decode at MLA_NCU_SHAPE (default the wide h128 b64 row)
if want mlancu; then
  ncu_part mla '^kvs_decode_mla$' mla ${MLA_NCU_SHAPE:---batch 64 --hq 128 --len 32768} --rounds 7
fi
# the narrow MLA consumer (16 rows: h16 q1 b16 L128K, pages of 64) on an e4m3 cache and on a
# bf16 one, side by side: where the e4m3 loop waits, which issues at most half the time
if want mlancunarrow; then
  narrow="--batch 16 --hq 16 --len 131072 --page-size 64 --rounds 7"
  ncu_part mla-narrow-e4m3 '^kvs_decode_mla$' mla $narrow --kv-dtype fp8_e4m3
  ncu_part mla-narrow-bf16 '^kvs_decode_mla$' mla $narrow
fi
# the MLA cut-unit merge in the decode: the seed's batch-1 row (one unit cut by every CTA) with the
# request cut in fewer pieces and without PDL (the default first and last: the run's drift), then
# ncu's stall samples of that launch
if want mlamerge; then
  seed="--hq 12 --len 131072 --page-size 64 --rounds 9"
  for extra in "" "--ctas 66" "--ctas 33" "--no-pdl" ""; do
    echo "== mla $seed $extra"; timeout $(cap 60) $B mla $seed $extra 2>&1 | grep -E "plan:|check|time:"
  done | tee $O/mla-merge.txt
  ncu_part mlaseed '^kvs_decode_mla$' mla $seed
fi
if want ab; then
  AB_BUDGET=$(cap 86400) OUT=$O bash bench/ab.sh  # (its rows packed with the rest, within the budget)
fi
if want peers; then
  timeout $(cap 300) python3 bench/peer_sdpa.py --shape 1,16,2,128,4096 --shape 1,16,2,128,131072
fi
