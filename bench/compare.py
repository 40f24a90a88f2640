"""Times kvstream against its decode-attention peers on the benchmark matrix, in one process.

Method (docs/benchmarking.md, kept here so the file stands alone):

* Implementations: ``kvstream`` (the Python binding, default plan), ``cudnn`` and ``sdpa_flash``
  (``F.scaled_dot_product_attention(..., enable_gqa=True)`` under ``sdpa_kernel`` with the cuDNN
  or FlashAttention-2 backend, layout [b, h, s, d]) and ``fa3`` (``flash_attn_with_kvcache`` from
  the ``fa3-fwd`` wheel, ``num_splits=0``, layout [b, s, h, d]). A peer that cannot be imported or
  fails on a shape gets ``{"error": ...}``; the run goes on.
* Inputs: random bf16 values, identical for every implementation, each in its own contiguous
  layout (the SDPA copies are made from the [b, L, hkv, d] pool, outside the timing). A rotating
  pool of ``sets = clamp(ceil(512 MiB / kv_bytes_read_per_set), 2, 256)`` input sets keeps the KV
  read per cycle above the 60 MB L2 (for a windowed row, whose calls read only the window, the
  pool's memory is also capped at 32 GiB, never below 2 sets).
* Timer: one CUDA graph per implementation holding one call per set (every set is called once
  eagerly on a side stream first: the kvstream binding plans and compiles on its first call, the
  peers pick their kernels). 2 warm-up replays, then ``--rounds`` rounds; each round replays every
  implementation's graph once, in alternating order (A B C D, D C B A, ...). Per-call latency =
  replay time (CUDA events) / sets; median and minimum over rounds.
* Correctness next to every timing: after the timed replays, the graph's output for set 0 is
  compared with an fp32 reference (``||o - ref|| / ||ref||``); the outputs are poisoned with NaN
  after capture, so a graph that wrote nothing fails. Above 2e-2 (or NaN) the timing is recorded
  as ``{"error": "wrong result ..."}`` and counts nowhere.
* Byte floor per shape: a streaming-read kernel (cupy.RawKernel, 16-byte loads, grid-stride loop,
  one value written per block) over exactly ``io_bytes`` per set, with its own rotating pool of the
  same number of sets and the same graph timer; best of a few grid sizes. Read ceiling: the same
  kernel over 4 GiB. ``io_bytes`` = Q + K + V + O bytes, each once, K and V over the positions a
  call must read (``min(L, window + q_len)`` per request with a window); GB/s are decimal.

FP8 caches (``--kv-dtype fp8_e4m3``): the same shapes with K and V in e4m3 (values / 1/64,
clamped to +-448; one scale per cache). Implementations: ``kvstream`` (bf16 q, e4m3 caches, the
scales as tensors), ``fa3`` (its fp8 path: q, k and v in e4m3 with ``q/k/v_descale``; q is
quantised too, so its error is checked against ``FA3_FP8_MAX_REL_ERR``), and on the bf16 caches
of the same values ``cudnn`` and ``kvstream_bf16``. kvstream and FA3 are checked against the
fp32 reference on the dequantised caches (what they were given), the bf16 ones against the bf16
reference; each row also records kvstream's error against the bf16 reference (what the
quantisation costs). Byte floors count one byte per K and V element. Outputs
``h200-fp8-latest.json`` / ``h200-fp8-DATE.json``, ``bench/RESULTS-fp8.md``.

Model rows (``--matrix bench/matrix-models.json``, ``"kind": "models"``): rows may carry
``window`` (left window; token t sees positions t - window .. t), ``softcap`` (scaled scores s
become c * tanh(s / c)), ``sinks`` (one float32 logit per query head, uniform in [-3, 3) from a
fixed seed, joining the softmax denominator) and ``q_len`` up to 8 (token i of a request of
length L sees positions up to L - q_len + i). kvstream gets ``window_size=(window, 0)``,
``softcap`` and ``sinks``; FA3 gets ``causal=True`` (bottom-right aligned for several new tokens),
``window_size`` and ``softcap``, and no sink rows; the SDPA peers get only plain single-token rows.
A peer that does not support a row's features is not called: its entry is
``{"error": "unsupported: <features>"}`` (``n/s`` in the tables), and the best peer is the
fastest one that supports the row. The summary adds the rows with no supporting peer, the window
rows' distance to the byte floor of the positions they read (the target: <= 1.10x at batch >=
16) and the cost of sinks and of a softcap (their rows over the plain row of the same shape).
Outputs ``h200-models-latest.json`` / ``h200-models-DATE.json``, ``bench/RESULTS-models.md``,
``plot-models-<group>``: a matrix's ``kind`` and the fp8 mode name the outputs, ``--out-prefix``
(default ``h200``) starts the results files' names, and ``--merge`` orders the rows by the
matrix of the runs' kind.

Outputs: ``bench/results/h200-latest.json`` (the format of docs/benchmarking.md plus ``summary``, ``notes`` and a
few extra keys), a dated copy ``bench/results/h200-YYYY-MM-DD.json``, ``bench/RESULTS.md`` and
``bench/results/plot-<group>.png/.svg``. While running, ``bench/results/h200-partial.json`` is
rewritten after every shape, so a crash (a sticky CUDA error ends the process's GPU use) keeps
what was measured.

Run on the GPU machine, from the repository root (kvstream and the FA3 wheel on PYTHONPATH)::

    KVSTREAM_CACHE_DIR=$PWD/.carry/cache PYTHONPATH=/tmp/kvs-site:/tmp/site \\
        python3 bench/compare.py --matrix bench/matrix.json
    python3 bench/compare.py --matrix bench/matrix-models.json   # model rows (same environment)
    python3 bench/compare.py --quick                      # smoke test: 6 shapes, 5 rounds
    python3 bench/compare.py --ids gqa-d128-L4096,batch-b4-L4096 --impls kvstream,cudnn

Without a GPU (needs only matplotlib)::

    python3 bench/compare.py --plot-only bench/results/h200-latest.json     # plots again
    python3 bench/compare.py --report-only bench/results/h200-latest.json   # RESULTS.md + plots
    python3 bench/compare.py --report-only bench/results/h200-models-latest.json # RESULTS-models.md
    python3 bench/compare.py --merge a.json b.json    # runs of parts of the matrix (--ids) as one
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

IMPLS = ("kvstream", "cudnn", "sdpa_flash", "fa3")
PEERS = ("cudnn", "sdpa_flash", "fa3")
# --kv-dtype fp8_e4m3: kvstream and FA3 on e4m3 caches, cuDNN and kvstream on the bf16 ones
FP8_IMPLS = ("kvstream", "fa3", "cudnn", "kvstream_bf16")
FP8_PEERS = ("fa3", "cudnn")
FP8_SCALE = 1.0 / 64.0      # the caches hold value / FP8_SCALE, clamped to e4m3's range
FA3_FP8_MAX_REL_ERR = 0.1   # FA3's fp8 path quantises q too
GROUPS = ("mqa", "gqa", "mha", "batch")
DTYPE_BYTES = {"bf16": 2, "fp8_e4m3": 1}

POOL_BYTES = 512 << 20  # KV per pool cycle: well above the H200's 60 MB L2
# A windowed row reads a small part of each set's cache: the sets that cover POOL_BYTES of reads
# could need more memory than the GPU has, so its pool stops at this many bytes of cache.
POOL_ALLOC_BYTES = 32 << 30
MIN_SETS, MAX_SETS = 2, 256
WARMUP_REPLAYS = 2
MIN_ROUNDS = 7
QUICK_SHAPES, QUICK_ROUNDS = 6, 5
MAX_REL_ERR = 2e-2
CEILING_BYTES = 4 << 30
READ_THREADS = 512
READ_GRID_PER_SM = (1, 2, 4, 8, 16)  # grid sizes tried for the floor and ceiling, x SM count
BIG_KV_BYTES = 64 << 20  # "large" shapes for the within-1.05x-of-floor count
NEAR_FLOOR = 1.05
SHORT_L, SHORT_US = 4096, 4.0  # batch-1 L <= 4096 shapes should take <= 4 us
ERROR_CHARS = 300
BUSY_CYCLES = 100_000  # ~50 us at the H200's ~2 GHz
SINK_RANGE = 3.0  # sink logits uniform in [-3, 3): the scaled scores' own scale
SINK_SEED = 7     # their own generator: a sink row's q, K and V equal its plain twin's
WINDOW_NEAR_FLOOR, WINDOW_MIN_BATCH = 1.10, 16  # window rows at batch >= 16: <= 1.10x the floor
SDPA_PEERS = ("cudnn", "sdpa_flash")

READ_KERNEL_SRC = r"""
// Streams n 16-byte words through the SMs; the XOR of everything read is written once per block
// so the loads cannot be optimised away. Four independent loads per thread per iteration keep
// enough bytes in flight to reach the HBM ceiling.
extern "C" __global__ void stream_read(const uint4* __restrict__ src, unsigned long long n,
                                       unsigned int* __restrict__ sink) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = __ldg(src + i);
        const uint4 b = __ldg(src + i + stride);
        const uint4 c = __ldg(src + i + 2 * stride);
        const uint4 d = __ldg(src + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
        acc ^= c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = __ldg(src + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ unsigned int warp_acc[32];
    if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int t = 0;
        for (unsigned int w = 0; w < (blockDim.x + 31) / 32; ++w) t ^= warp_acc[w];
        sink[blockIdx.x] = t;
    }
}
"""


# ------------------------------------------------------------------------------------------------
# Shapes and byte counts (pure Python: tested without a GPU)
# ------------------------------------------------------------------------------------------------


def matrix_kind(path):
    """The matrix file's ``kind`` ("models" for bench/matrix-models.json), None without one."""
    return json.loads(Path(path).read_text()).get("kind")


def load_matrix(path, ids=None, quick=False):
    """The matrix's shapes, filtered by ``ids`` (in matrix order), the first few if ``quick``."""
    shapes = json.loads(Path(path).read_text())["shapes"]
    if ids:
        wanted = set(ids)
        unknown = wanted - {s["id"] for s in shapes}
        if unknown:
            raise SystemExit(f"compare.py: unknown shape ids: {', '.join(sorted(unknown))}")
        shapes = [s for s in shapes if s["id"] in wanted]
    for s in shapes:
        if s["dtype"] not in DTYPE_BYTES:
            raise SystemExit(f"compare.py: shape {s['id']}: dtype {s['dtype']} not supported")
        # A malformed feature would otherwise surface only after minutes of GPU time.
        window, softcap = s.get("window", 0), s.get("softcap", 0)
        if not (type(window) is int and window >= 0
                and type(softcap) in (int, float) and softcap >= 0
                and type(s.get("sinks", False)) is bool):
            raise SystemExit(f"compare.py: shape {s['id']}: window must be an int >= 0, softcap "
                             f"a number >= 0, sinks a bool")
    return shapes[:QUICK_SHAPES] if quick else shapes


def group_of(row):
    return row.get("group") or row["id"].split("-")[0]


def kv_dtype(shape):
    return shape.get("kv_dtype", shape["dtype"])


def kv_bytes(shape):
    """K + V bytes of one input set (in the cache dtype kvstream reads)."""
    s = shape
    return 2 * s["batch"] * s["L"] * s["hkv"] * s["d"] * DTYPE_BYTES[kv_dtype(s)]


def window_of(shape):
    """The row's left window (positions before a token's own that it sees), None without one."""
    return shape.get("window")


def softcap_of(shape):
    return float(shape.get("softcap") or 0.0)


def kv_positions(shape):
    """Cache positions one request's call must read: with a window, the new tokens see together
    the last window + q_len positions."""
    w = window_of(shape)
    return shape["L"] if w is None else min(shape["L"], w + shape["q_len"])


def kv_read_bytes(shape):
    """K + V bytes one call must read (kv_bytes without a window)."""
    s = shape
    return 2 * s["batch"] * kv_positions(s) * s["hkv"] * s["d"] * DTYPE_BYTES[kv_dtype(s)]


def io_bytes(shape):
    """Q + K + V + O bytes, each counted once; K and V over the positions a call must read."""
    s = shape
    q_or_o = s["batch"] * s["q_len"] * s["hq"] * s["d"] * DTYPE_BYTES[s["dtype"]]
    return 2 * q_or_o + kv_read_bytes(shape)


def pool_sets(shape):
    sets = min(max(math.ceil(POOL_BYTES / kv_read_bytes(shape)), MIN_SETS), MAX_SETS)
    return min(sets, max(POOL_ALLOC_BYTES // kv_bytes(shape), MIN_SETS))


def row_features(row):
    """What a row asks beyond plain single-token decode, as short names ("window 128",
    "softcap 50", "sinks", "q_len 8"); empty for a plain row."""
    out = []
    if window_of(row) is not None:
        out.append(f"window {window_of(row)}")
    if softcap_of(row):
        out.append(f"softcap {softcap_of(row):g}")
    if row.get("sinks"):
        out.append("sinks")
    if row.get("q_len", 1) > 1:
        out.append(f"q_len {row['q_len']}")
    return out


def unsupported(name, shape):
    """The row's features a peer lacks, joined ("window, sinks"), or None if it runs the row.

    FA3 has windows, softcap and bottom-right causal multi-token decode, but no sinks. Torch SDPA
    has none of them: its is_causal aligns the mask top-left, which is not decode's rule when
    the new tokens are fewer than the cache positions."""
    lacking = []
    if name == "fa3" and shape.get("sinks"):
        lacking = ["sinks"]
    elif name in SDPA_PEERS:
        lacking = [f.split()[0] for f in row_features(shape)]
        lacking = ["multi-token" if f == "q_len" else f for f in lacking]
    return ", ".join(lacking) or None


def parse_plan(plan):
    """(splits, mode) from a kvstream plan string (``format!("{plan:?}")`` of ``Plan``): the split
    engine's split count and reduction, or ``(None, "persistent")``."""
    if plan.lstrip().startswith("Persistent"):
        return None, "persistent"
    m = re.search(r"\bnum_splits:\s*(\d+)", plan)
    if not m:
        raise ValueError(f"no num_splits in plan {plan[:200]!r}")
    splits = int(m.group(1))
    pdl = re.findall(r"\bpdl:\s*(true|false)", plan)
    # `pdl` and `reduction` are DecodePlan's last fields: the last matches are the plan's own.
    with_pdl = not pdl or pdl[-1] == "true"
    reduction = re.findall(r"\breduction:\s*(Kernel|Cluster)", plan)
    mode = "cluster" if reduction and reduction[-1] == "Cluster" else "kernel"
    if splits <= 1:
        return splits, "single"
    return splits, f"{mode}+pdl" if with_pdl else mode


def short_error(e):
    text = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else str(e)
    text = " ".join(text.split())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def timing_entry(times_us, io, rel_err, max_rel_err=MAX_REL_ERR):
    """Results entry of one implementation on one shape from its per-call round times."""
    med = statistics.median(times_us)
    entry = {
        "us": round(med, 3),
        "min_us": round(min(times_us), 3),
        "GBps": round(io / med / 1e3, 1),
        "rel_err": float(f"{rel_err:.3g}") if math.isfinite(rel_err) else None,
    }
    if not (math.isfinite(rel_err) and rel_err <= max_rel_err):
        # A wrong output's timing must not be read as a result: no "us" key.
        return {
            "error": f"wrong result: rel_err {rel_err:.3g} > {max_rel_err:g} "
            f"(timing {med:.2f} us not counted)",
            "rel_err": entry["rel_err"],
            "unverified_us": entry["us"],
        }
    return entry


# ------------------------------------------------------------------------------------------------
# Summary, markdown and plots (pure Python: tested on a fake results dict)
# ------------------------------------------------------------------------------------------------


def ok_us(entry):
    """Latency of a valid entry, else None."""
    if not entry or "error" in entry or entry.get("us") is None:
        return None
    return entry["us"]


def best_peer(row):
    """(name, us) of the fastest valid peer, or (None, None)."""
    valid = [(ok_us(row["results"].get(p)), p) for p in PEERS]
    valid = [(us, p) for us, p in valid if us is not None]
    if not valid:
        return None, None
    us, name = min(valid)
    return name, us


def row_kv_bytes(row):
    """K + V bytes a call on the row reads (results files of older runs have no fp8 entry)."""
    return 2 * row["batch"] * kv_positions(row) * row["hkv"] * row["d"] * \
        DTYPE_BYTES.get(kv_dtype(row), 2)


def is_unsupported(entry):
    return bool(entry) and str(entry.get("error", "")).startswith("unsupported")


def twin_key(row):
    """Rows with the same key differ only in their features."""
    return tuple(row.get(k) for k in ("group", "batch", "q_len", "hq", "hkv", "d", "L", "dtype",
                                      "kv_dtype"))


def feature_costs(rows):
    """(feature, row id, kvstream ratio, fa3 ratio or None) of every row whose features add work
    without reading fewer bytes (sinks, softcap), over its plain twin: the row of the same group
    and shape without features. Window rows are judged against their byte floor instead."""
    plain = {twin_key(r): r for r in rows if not row_features(r)}
    out = []
    for r in rows:
        feats = row_features(r)
        base = plain.get(twin_key(r))
        if not feats or base is None or window_of(r) is not None:
            continue
        k, k0 = ok_us(r["results"].get("kvstream")), ok_us(base["results"].get("kvstream"))
        if k is None or k0 is None:
            continue
        f, f0 = ok_us(r["results"].get("fa3")), ok_us(base["results"].get("fa3"))
        fa3 = round(f / f0, 3) if f is not None and f0 is not None else None
        out.append((", ".join(feats), r["id"], round(k / k0, 3), fa3))
    return out


def summarize_models(rows):
    """The model matrix's figures: rows no peer supports, window rows over their byte floor,
    feature costs."""
    peerless = sum(1 for r in rows
                   if all(is_unsupported(r["results"].get(p)) for p in PEERS))
    window_floor, judged = [], []
    for r in rows:
        if window_of(r) is None:
            continue
        k, floor = ok_us(r["results"].get("kvstream")), r.get("floor_us")
        ratio = round(k / floor, 3) if k is not None and floor else None
        window_floor.append([r["id"], ratio])
        if r["batch"] >= WINDOW_MIN_BATCH:
            judged.append((ratio, r["id"]))
    measured = [(x, i) for x, i in judged if x is not None]  # a failed row counts as missed
    worst = max(measured, default=(None, None))
    return {
        "shapes_without_supporting_peer": peerless,
        "window_shapes_b16": len(judged),
        "window_b16_within_1.10x_floor": sum(1 for x, _ in measured if x <= WINDOW_NEAR_FLOOR),
        "window_b16_worst_floor_ratio": worst[0],
        "window_b16_worst_shape": worst[1],
        "window_floor_ratio": window_floor,
        "feature_cost": [{"feature": f, "shape": i, "kvstream": k, "fa3": fa3}
                         for f, i, k, fa3 in feature_costs(rows)],
    }


def summarize(rows):
    """Headline figures: speedups (peer us / kvstream us) and distances to the floor."""
    vs_best, vs_fa3 = [], []
    near_floor, big = 0, 0
    fast_short, short = 0, 0
    for row in rows:
        k = ok_us(row["results"].get("kvstream"))
        name, peer_us = best_peer(row)
        if k is not None and peer_us is not None:
            vs_best.append((peer_us / k, row["id"]))
        fa3 = ok_us(row["results"].get("fa3"))
        if k is not None and fa3 is not None:
            vs_fa3.append(fa3 / k)
        if row_kv_bytes(row) >= BIG_KV_BYTES:
            big += 1
            floor = row.get("floor_us")
            if k is not None and floor and k <= NEAR_FLOOR * floor:
                near_floor += 1
        if row["batch"] == 1 and row["L"] <= SHORT_L:
            short += 1
            if k is not None and k <= SHORT_US:
                fast_short += 1
    out = {
        "shapes": len(rows),
        "shapes_compared": len(vs_best),
        "median_speedup_vs_best_peer": None,
        "min_speedup_vs_best_peer": None,
        "min_speedup_shape": None,
        "kvstream_fastest_shapes": sum(1 for s, _ in vs_best if s > 1.0),
        "median_speedup_vs_fa3": round(statistics.median(vs_fa3), 3) if vs_fa3 else None,
        "shapes_compared_fa3": len(vs_fa3),
        "big_kv_within_1.05x_floor": near_floor,
        "big_kv_shapes": big,
        "b1_short_within_4us": fast_short,
        "b1_short_shapes": short,
    }
    if vs_best:
        out["median_speedup_vs_best_peer"] = round(statistics.median(s for s, _ in vs_best), 3)
        low, low_id = min(vs_best)
        out["min_speedup_vs_best_peer"] = round(low, 3)
        out["min_speedup_shape"] = low_id
    if any(row_features(r) for r in rows):  # the model matrix: plain matrices keep their summary
        out.update(summarize_models(rows))
    return out


def summary_lines(summary):
    s = summary

    def x(v):
        return "n/a" if v is None else f"{v:.2f}x"

    lines = [
        f"median speedup vs best peer: {x(s['median_speedup_vs_best_peer'])} over "
        f"{s['shapes_compared']} of {s['shapes']} shapes "
        f"(kvstream fastest on {s['kvstream_fastest_shapes']})",
        f"min speedup vs best peer: {x(s['min_speedup_vs_best_peer'])} "
        f"({s['min_speedup_shape'] or 'n/a'})",
        f"median speedup vs fa3: {x(s['median_speedup_vs_fa3'])} over "
        f"{s['shapes_compared_fa3']} shapes",
        f"shapes with >= 64 MiB of KV within {NEAR_FLOOR}x of the byte floor: "
        f"{s['big_kv_within_1.05x_floor']} of {s['big_kv_shapes']}",
        f"batch-1 shapes with L <= {SHORT_L} at <= {SHORT_US:g} us: "
        f"{s['b1_short_within_4us']} of {s['b1_short_shapes']}",
    ]
    if "shapes_without_supporting_peer" not in s:
        return lines
    # Speedups above are over the fastest peer that supports the row (supported, no error).
    lines.append(f"shapes no peer supports (every peer n/s): "
                 f"{s['shapes_without_supporting_peer']} of {s['shapes']}")
    lines.append(f"window shapes at batch >= {WINDOW_MIN_BATCH} within {WINDOW_NEAR_FLOOR:.2f}x "
                 f"of the byte floor of the positions they read: "
                 f"{s['window_b16_within_1.10x_floor']} of {s['window_shapes_b16']} (worst "
                 f"{x(s['window_b16_worst_floor_ratio'])}, {s['window_b16_worst_shape'] or 'n/a'})")
    if s["window_floor_ratio"]:
        lines.append("window shapes, kvstream / floor: " + ", ".join(
            f"{i} {'-' if r is None else f'{r:.2f}'}" for i, r in s["window_floor_ratio"]))
    for c in s["feature_cost"]:
        fa3 = f", fa3 {c['fa3']:.2f}x" if c["fa3"] is not None else ""
        lines.append(f"cost of {c['feature']} ({c['shape']} / its plain twin): kvstream "
                     f"{c['kvstream']:.2f}x{fa3}")
    if not s["feature_cost"]:
        lines.append("cost of sinks / softcap: n/a (no measured row next to a plain twin)")
    return lines


def fmt_us(entry):
    if not entry:
        return "-"
    if "error" in entry:
        if is_unsupported(entry):
            return "n/s"
        return "wrong" if entry["error"].startswith("wrong result") else "error"
    return f"{entry['us']:.2f}"


def group_heading(group, rows):
    heads = sorted({(r["hq"], r["hkv"]) for r in rows})
    batches = sorted({r["batch"] for r in rows})
    hs = ", ".join(f"{a}/{b}" for a, b in heads)
    bs = f"batch {batches[0]}" if len(batches) == 1 else f"batch {batches[0]}..{batches[-1]}"
    # the seed's groups name their head dims in the shape ids, the model groups do not
    dims = "/".join(str(d) for d in sorted({r["d"] for r in rows}))
    ds = "" if group in GROUPS else f", d {dims}"
    return f"## {group.upper()} ({bs}, hq/hkv {hs}{ds}, bf16)"


def output_tag(kind, fp8):
    """Suffix of a run's output names: "", "-fp8", "-models", "-models-fp8"."""
    return (f"-{kind}" if kind else "") + ("-fp8" if fp8 else "")


def doc_tag(doc):
    return output_tag(doc.get("kind"), any(kv_dtype(r) == "fp8_e4m3" for r in doc["rows"]))


def gpu_prefix(gpu_name):
    """Results files name the GPU they measured: "h100" for an H100 (a stand-in, whose files
    must not replace the H200's), "h200" otherwise."""
    return "h100" if gpu_name and "H100" in gpu_name else "h200"


def markdown(doc, prefix=None):
    """bench/RESULTS.md from a results document; ``prefix`` names its results files."""
    ceiling = doc.get("read_ceiling_GBps")
    fp8 = any(kv_dtype(r) == "fp8_e4m3" for r in doc["rows"])
    kind = doc.get("kind")
    prefix = prefix or f"{gpu_prefix(doc.get('gpu'))}{doc_tag(doc)}"
    flags = (f" --matrix bench/matrix-{kind}.json" if kind else "") + \
        (" --kv-dtype fp8_e4m3" if fp8 else "")
    unsupported_any = any(is_unsupported(e) for r in doc["rows"] for e in r["results"].values())
    lines = [
        f"# kvstream vs peers{', model rows' if kind == 'models' else ''}"
        f"{', FP8 (e4m3) caches' if fp8 else ''}: {doc.get('gpu', '?')}",
        "",
        f"Date {doc.get('date')}, commit `{doc.get('commit')}`, GPU {doc.get('gpu')}, read "
        f"ceiling {ceiling if ceiling is not None else 'n/a'} GB/s. Produced by "
        f"`bench/compare.py{flags}` (method in its docstring and "
        f"docs/benchmarking.md); raw numbers in "
        f"`bench/results/{prefix}-latest.json`.",
        "",
        "Latencies are medians of graph-replay rounds, per call, in us. Speedup = best peer "
        "latency / kvstream latency (> 1: kvstream faster). floor = streaming read of the same "
        "bytes (Q + K + V + O) with the same timer; kvstream / floor >= 1 always, 1.00 is the "
        "physical limit. `wrong` = output failed the fp32 check, `error` = the peer did not run.",
    ]
    if unsupported_any:
        lines += [
            "",
            "`n/s` = the peer does not support the row's features and was not called (FA3: "
            "sinks; the SDPA peers: windows, softcap, sinks, several new tokens); the best peer is "
            "the fastest one that supports the row. A window row's bytes count only the positions "
            "its calls read, min(L, window + q_len) per request."]
    lines += [
        "",
        "## Summary",
        "",
    ]
    lines += [f"- {ln}" for ln in summary_lines(doc.get("summary") or summarize(doc["rows"]))]
    for note in doc.get("notes", []):
        lines.append(f"- note: {note}")
    if fp8:
        lines += accuracy_lines(doc["rows"])
    for group in ordered_groups(doc["rows"]):
        rows = [r for r in doc["rows"] if group_of(r) == group]
        lines += ["", group_heading(group, rows), ""]
        header = ["shape", "kvstream us", "GB/s (% ceil)", "splits"] + [f"{p} us" for p in PEERS]
        header += ["best peer", "speedup", "kvstream / floor", "floor us"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        errors = []
        for row in rows:
            res = row["results"]
            kv = res.get("kvstream") or {}
            k_us = ok_us(kv)
            name, peer_us = best_peer(row)
            floor = row.get("floor_us")
            if k_us is not None and ceiling:
                bw = f"{kv['GBps']:.0f} ({100 * kv['GBps'] / ceiling:.0f}%)"
            else:
                bw = "-" if k_us is None else f"{kv['GBps']:.0f}"
            cells = [row["id"], fmt_us(kv), bw, str(kv.get("splits", "-"))]
            cells += [fmt_us(res.get(p)) for p in PEERS]
            cells.append(name or "-")
            cells.append(f"{peer_us / k_us:.2f}x" if k_us and peer_us else "-")
            cells.append(f"{k_us / floor:.2f}" if k_us and floor else "-")
            cells.append(f"{floor:.2f}" if floor else "-")
            lines.append("| " + " | ".join(cells) + " |")
            for impl in IMPLS:
                e = res.get(impl) or {}
                if "error" in e and not is_unsupported(e):
                    errors.append(f"{row['id']} {impl}: {e['error']}")
        if errors:
            lines += ["", "Errors:", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


def accuracy_lines(rows):
    """The FP8 report's accuracy section: each fp8 implementation's relative error against the
    reference on the dequantised cache (what it was given) and against the original bf16 cache
    (what the quantisation itself costs), median and largest over the rows it ran right."""
    lines = ["", "## Accuracy (fp8 rows)", "",
             "Relative error of the output (`||out - ref|| / ||ref||`, fp32 reference) against the "
             "dequantised cache the kernel was given and against the original bf16 cache (the "
             "quantisation's own cost; FA3's fp8 path quantises q as well).", "",
             "| implementation | rows | vs dequantised: median / max | vs bf16 cache: median / "
             "max |", "|---|---|---|---|"]
    for impl in ("kvstream", "fa3"):
        got = [(e["rel_err"], e["rel_err_vs_bf16_cache"]) for r in rows
               for e in [r["results"].get(impl) or {}]
               if "rel_err" in e and "rel_err_vs_bf16_cache" in e and "error" not in e]
        if not got:
            continue
        deq = sorted(g[0] for g in got)
        orig = sorted(g[1] for g in got)
        mid = len(got) // 2
        lines.append(f"| {impl} | {len(got)} | {deq[mid]:.2e} / {deq[-1]:.2e} | "
                     f"{orig[mid]:.2e} / {orig[-1]:.2e} |")
    return lines


def ordered_groups(rows):
    present = []
    for r in rows:
        g = group_of(r)
        if g not in present:
            present.append(g)
    return [g for g in GROUPS if g in present] + [g for g in present if g not in GROUPS]


def x_param(group, rows=()):
    """The parameter that varies along a group's x axis: batch where the group varies it (the
    model groups vary L too: one panel per L), else L."""
    return "batch" if group == "batch" or len({r["batch"] for r in rows}) > 1 else "L"


def tick_label(param, value):
    if param == "batch":
        return f"b{value}"
    return f"{value // 1024}K" if value % 1024 == 0 else str(value)


def plot_results(doc, out_dir):
    """plot-<group>.png/.svg: effective TB/s per shape for every implementation and the floor."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the GPU machine or in CI
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ceiling = doc.get("read_ceiling_GBps")
    written = []
    styles = {"kvstream": ("C3", "o"), "cudnn": ("C0", "s"), "sdpa_flash": ("C2", "^"),
              "fa3": ("C1", "D"), "kvstream_bf16": ("C4", "v")}
    tag = doc_tag(doc)[1:] + "-" if doc_tag(doc) else ""
    if gpu_prefix(doc.get("gpu")) != "h200":
        tag = f"{gpu_prefix(doc.get('gpu'))}-{tag}"
    for group in ordered_groups(doc["rows"]):
        rows = [r for r in doc["rows"] if group_of(r) == group]
        param = x_param(group, rows)
        # One panel per combination of the parameters that do not vary along x (d, heads, L,
        # the features).
        panels = {}
        for r in rows:
            key = tuple((k, r[k]) for k in ("hq", "hkv", "d", "L", "batch") if k != param)
            panels.setdefault(key + tuple(row_features(r)), []).append(r)
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        for ax, (key, prs) in zip(axes[0], panels.items()):
            prs = sorted(prs, key=lambda r: r[param])
            xs = list(range(len(prs)))  # equally spaced samples, not a linear scale
            for impl in IMPLS:
                ys = [tbps(r["results"].get(impl)) for r in prs]
                if any(y is not None for y in ys):
                    color, marker = styles[impl]
                    ax.plot(xs, [float("nan") if y is None else y for y in ys], marker=marker,
                            color=color, label=impl, linewidth=2 if impl == "kvstream" else 1.2)
            floor = [r["io_bytes"] / r["floor_us"] / 1e6 if r.get("floor_us") else float("nan")
                     for r in prs]
            ax.plot(xs, floor, linestyle="--", color="k", label="byte floor")
            if ceiling:
                ax.axhline(ceiling / 1e3, linestyle=":", color="0.5", label="read ceiling")
            ax.set_xticks(xs, [tick_label(param, r[param]) for r in prs])
            ax.set_xlabel("batch" if param == "batch" else "L (KV length)")
            ax.set_ylabel("effective TB/s (Q+K+V+O / latency)")
            ax.set_ylim(bottom=0)
            d = dict(kv for kv in key if isinstance(kv, tuple))
            parts = [f"hq/hkv {d['hq']}/{d['hkv']}", f"d {d['d']}"]
            parts.append(f"L {d['L']}" if "L" in d else f"batch {d['batch']}")
            parts += [f for f in key if isinstance(f, str)]
            small = {"fontsize": 10} if len(parts) > 3 else {}  # the features lengthen it
            ax.set_title(f"{group.upper()}: " + ", ".join(parts), **small)
            ax.grid(True, alpha=0.3)
        # one legend for the figure: a peer may run only in some panels (n/s in the others)
        handles, labels = axes[0][0].get_legend_handles_labels()
        for ax in axes[0][1:]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        axes[0][0].legend(handles, labels, loc="best", fontsize=8)
        fig.suptitle(f"{doc.get('gpu', '')} {doc.get('date', '')} {doc.get('commit', '')}",
                     fontsize=9)
        fig.tight_layout()
        for ext in ("png", "svg"):
            path = out_dir / f"plot-{tag}{group}.{ext}"
            fig.savefig(path, dpi=150)
            written.append(path)
        plt.close(fig)
    return written


def tbps(entry):
    return entry["GBps"] / 1e3 if ok_us(entry) is not None and entry.get("GBps") else None


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


def git_commit():
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_json(path, doc):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file


def write_outputs(doc, results_dir, md_path, prefix="h200"):
    """Latest and dated JSON, RESULTS.md and the plots; returns the paths written."""
    results_dir = Path(results_dir)
    latest = results_dir / f"{prefix}-latest.json"
    dated = results_dir / f"{prefix}-{doc['date']}.json"
    write_json(latest, doc)
    write_json(dated, doc)
    Path(md_path).write_text(markdown(doc, prefix))
    paths = [latest, dated, Path(md_path)]
    try:
        paths += plot_results(doc, results_dir)
    except Exception as e:  # plots are a convenience: the numbers are already written
        print(f"plotting failed: {short_error(e)}", file=sys.stderr)
    return paths


# ------------------------------------------------------------------------------------------------
# GPU: inputs, reference, implementations, graph timer
# ------------------------------------------------------------------------------------------------


def make_pool(shape, sets, seed=1):
    """Input sets: q [sets,b,q_len,hq,d] and k, v [sets,b,L,hkv,d] bf16, random (never zeros);
    for fp8 rows also their e4m3 copies k8, v8 (value / FP8_SCALE, clamped), q8 for FA3's fp8
    path, the scale tensors and FA3's descales; for sink rows the float32 [hq] sink logits (one
    tensor: every set's calls take the same)."""
    import torch

    s = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.empty(sets, s["batch"], s["q_len"], s["hq"], s["d"], **kw)
    k = torch.empty(sets, s["batch"], s["L"], s["hkv"], s["d"], **kw)
    v = torch.empty_like(k)
    for i in range(sets):  # one set at a time: no fp32 temporaries the size of the pool
        q[i].normal_(generator=gen)
        k[i].normal_(generator=gen)
        v[i].normal_(generator=gen)
    pool = {"q": q, "k": k, "v": v}
    if s.get("sinks"):
        sink_gen = torch.Generator(device="cuda").manual_seed(SINK_SEED)
        pool["sinks"] = (torch.rand(s["hq"], generator=sink_gen, device="cuda",
                                    dtype=torch.float32) * 2 - 1) * SINK_RANGE
    if kv_dtype(s) == "fp8_e4m3":
        f8 = torch.float8_e4m3fn
        pool["k8"] = torch.empty(k.shape, device="cuda", dtype=f8)
        pool["v8"] = torch.empty(k.shape, device="cuda", dtype=f8)
        for i in range(sets):  # a request at a time: fp32 temporaries of one request's cache
            for src, dst in ((k, pool["k8"]), (v, pool["v8"])):
                for j in range(s["batch"]):
                    dst[i, j] = (src[i, j].float() / FP8_SCALE).clamp_(-448.0, 448.0).to(f8)
        pool["q8"] = q.to(f8)
        pool["scale"] = torch.full((1,), FP8_SCALE, device="cuda", dtype=torch.float32)
        pool["descale"] = torch.full((s["batch"], s["hkv"]), FP8_SCALE, device="cuda",
                                     dtype=torch.float32)
        pool["q_descale"] = torch.ones(s["batch"], s["hkv"], device="cuda", dtype=torch.float32)
    return pool


def sdpa_layout(pool):
    """[b, h, s, d] copies of the pool for torch SDPA (made once, outside any timing)."""
    return {
        "q": pool["q"].transpose(2, 3).contiguous(),  # [sets, b, hq, 1, d]
        "k": pool["k"].transpose(2, 3).contiguous(),  # [sets, b, hkv, L, d]
        "v": pool["v"].transpose(2, 3).contiguous(),
    }


def widen(x, scale=1.0):
    """One request's cache as fp32, times its dequantisation scale (e4m3 caches)."""
    x = x.float()
    return x * scale if scale != 1.0 else x


def reference(q, k, v, window=None, softcap=0.0, sinks=None, kv_scale=1.0):
    """fp32 attention of q [b,q_len,hq,d] over k, v [b,L,hkv,d] (times kv_scale: e4m3 caches):
    [b, hq, d] for one token without score modifiers, else [b, q_len, hq, d] (reference_mods).

    One request at a time, so the fp32 upcast of the largest shape (batch 128, 16 GiB of bf16 KV;
    its e4m3 copy next to it on an 80 GB GPU) needs only one request's worth of memory."""
    import torch

    if q.shape[1] > 1 or window is not None or softcap or sinks is not None:
        return reference_mods(q, k, v, window, softcap, sinks, kv_scale)
    b, _, hq, d = q.shape
    group = hq // k.shape[2]
    out = torch.empty(b, hq, d, device=q.device, dtype=torch.float32)
    for i in range(b):
        qi = q[i, 0].float().unsqueeze(1)  # [hq, 1, d]
        ki = widen(k[i], kv_scale).transpose(0, 1).repeat_interleave(group, dim=0)  # [hq, L, d]
        vi = widen(v[i], kv_scale).transpose(0, 1).repeat_interleave(group, dim=0)
        p = torch.softmax(qi @ ki.transpose(1, 2) / math.sqrt(d), dim=-1)
        out[i] = (p @ vi).squeeze(1)
        del ki, vi, p
    return out


def reference_mods(q, k, v, window, softcap, sinks, kv_scale=1.0):
    """fp32 decode attention with score modifiers: [b, q_len, hq, d].

    Token i of a request of length L sees positions 0 .. L - q_len + i, with a window only those
    >= (L - q_len + i) - window; the scaled scores s become softcap * tanh(s / softcap), then the
    head's sink logit joins the softmax denominator (it adds no value). The rows of one KV head
    (its query heads times the new tokens) go through one matmul: no K / V copy per query head."""
    import torch

    b, q_len, hq, d = q.shape
    L, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    rows = group * q_len  # row r of a KV head: query head r // q_len of the group, token r % q_len
    pos = torch.arange(L, device=q.device)
    last = L - q_len + torch.arange(q_len, device=q.device)  # each new token's own position
    hidden = pos[None, :] > last[:, None]  # [q_len, L]
    if window is not None:
        hidden |= pos[None, :] < (last - window)[:, None]
    hidden = hidden.repeat(group, 1)  # [rows, L]
    sink = None
    if sinks is not None:
        sink = sinks.float().view(hkv, group, 1).expand(hkv, group, q_len).reshape(hkv, rows, 1)
    out = torch.empty(b, q_len, hq, d, device=q.device, dtype=torch.float32)
    for i in range(b):
        qi = q[i].float().permute(1, 0, 2).reshape(hkv, rows, d)
        ki = widen(k[i], kv_scale).transpose(0, 1)  # [hkv, L, d]
        vi = widen(v[i], kv_scale).transpose(0, 1)
        sc = qi @ ki.transpose(1, 2) / math.sqrt(d)  # [hkv, rows, L]
        if softcap:
            sc = softcap * torch.tanh(sc / softcap)
        sc.masked_fill_(hidden, float("-inf"))
        if sink is not None:
            sc = torch.cat([sc, sink], dim=-1)
        p = torch.softmax(sc, dim=-1)[..., :L]
        out[i] = (p @ vi).reshape(hq, q_len, d).transpose(0, 1)
        del ki, vi, sc, p
    return out


def ref_mods(shape, pool):
    """reference()'s score-modifier arguments for a row."""
    return {"window": window_of(shape), "softcap": softcap_of(shape),
            "sinks": pool.get("sinks")}


def rel_err(out, ref):
    import torch

    o = out.float().reshape(ref.shape)
    r = ((o - ref).norm() / ref.norm()).item()
    return r if not torch.isnan(o).any().item() else float("nan")


def load_impls(names):
    """name -> (module-ish handle, None) or (None, error string) for every wanted implementation."""
    handles = {}
    for name in names:
        try:
            if name == "kvstream":
                import kvstream

                handles[name] = (kvstream, None)
            elif name == "kvstream_bf16":
                import kvstream

                handles[name] = (kvstream, None)
            elif name == "fa3":
                from fa3_fwd_interface import flash_attn_with_kvcache

                handles[name] = (flash_attn_with_kvcache, None)
            else:
                from torch.nn.attention import SDPBackend

                backend = {"cudnn": SDPBackend.CUDNN_ATTENTION,
                           "sdpa_flash": SDPBackend.FLASH_ATTENTION}[name]
                handles[name] = (backend, None)
        except Exception as e:  # a missing peer is reported on every shape, not fatal
            handles[name] = (None, f"import failed: {short_error(e)}")
    return handles


def kvstream_mods(shape, pool):
    """kvstream.decode's score-modifier arguments for a row (none for a plain row)."""
    mods = {}
    if window_of(shape) is not None:
        mods["window_size"] = (window_of(shape), 0)
    if softcap_of(shape):
        mods["softcap"] = softcap_of(shape)
    if shape.get("sinks"):
        mods["sinks"] = pool["sinks"]
    return mods


def fa3_mods(shape):
    """flash_attn_with_kvcache's arguments for a row's features (none for a plain single-token
    row: the call stays the main matrix's). causal=True aligns the mask bottom-right, which is
    decode's rule for several new tokens; FA3 makes a window's right side 0 under it."""
    mods = {}
    if shape["q_len"] > 1 or window_of(shape) is not None:
        mods["causal"] = True
        mods["window_size"] = (window_of(shape), 0) if window_of(shape) is not None else (-1, -1)
    if softcap_of(shape):
        mods["softcap"] = softcap_of(shape)
    return mods


def make_call(name, handle, pool, sdpa, shape=None):
    """call(s) -> output tensor of set s, for one implementation in its native layout, with the
    row's features (``shape``; None: a plain row)."""
    import torch
    import torch.nn.functional as F

    fp8 = "k8" in pool
    kmods = kvstream_mods(shape, pool) if shape else {}
    fmods = fa3_mods(shape) if shape else {}
    if name == "kvstream" and fp8:
        outs = torch.empty_like(pool["q"])

        def call(s):
            return handle.decode(pool["q"][s], pool["k8"][s], pool["v8"][s], out=outs[s],
                                 k_scale=pool["scale"], v_scale=pool["scale"], **kmods)

    elif name in ("kvstream", "kvstream_bf16"):
        outs = torch.empty_like(pool["q"])  # preallocated: the binding then allocates nothing

        def call(s):
            return handle.decode(pool["q"][s], pool["k"][s], pool["v"][s], out=outs[s], **kmods)

    elif name == "fa3" and fp8:

        def call(s):
            return handle(pool["q8"][s], pool["k8"][s], pool["v8"][s], num_splits=0,
                          q_descale=pool["q_descale"], k_descale=pool["descale"],
                          v_descale=pool["descale"], **fmods)

    elif name == "fa3":

        def call(s):
            # cache_seqlens not passed: every request uses all L positions (uniform matrix).
            return handle(pool["q"][s], pool["k"][s], pool["v"][s], num_splits=0, **fmods)

    else:
        from torch.nn.attention import sdpa_kernel

        def call(s):
            with sdpa_kernel([handle]):
                return F.scaled_dot_product_attention(sdpa["q"][s], sdpa["k"][s], sdpa["v"][s],
                                                      enable_gqa=True)

    return call


def capture(call, sets):
    """A CUDA graph of call(0..sets-1) and the outputs it writes.

    Every set is called eagerly first on a side stream (as torch.cuda.graph's docs advise): the
    kvstream binding creates its decoder on the first call, cuDNN builds its plan, and lazy
    allocations happen outside capture."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in range(sets):
            call(s)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call(s) for s in range(sets)]
    torch.cuda.synchronize()
    return graph, outs


def time_graphs(graphs, rounds):
    """name -> per-call us of each round; graphs is name -> (graph, calls per replay).

    Rounds replay every graph once in alternating order, so slow drifts of a shared machine
    (clocks, neighbours) hit every implementation alike."""
    import torch

    names = list(graphs)
    for name in names:
        for _ in range(WARMUP_REPLAYS):
            graphs[name][0].replay()
    torch.cuda.synchronize()
    times = {name: [] for name in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        events = []
        busy_gpu()
        for name in order:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name][0].replay()
            end.record()
            events.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in events:
            times[name].append(start.elapsed_time(end) * 1e3 / graphs[name][1])
    return times


def busy_gpu():
    """Keeps the GPU busy (~50 us) while the host enqueues a round, so the first replay's start
    event does not also time the host's graph launch on an idle GPU."""
    import torch

    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(BUSY_CYCLES)


def kvstream_plan(kvstream, shape):
    """(splits, mode) of the plan the binding runs for the shape: a decoder's own, which on the
    GPU merges by kernel where the heuristic's clusters would not all be resident at once
    (docs/tuning.md, "Cluster waves"); the GPU-less validate() would name the clusters."""
    import torch

    s = shape
    fp8 = kv_dtype(s) if kv_dtype(s) != s["dtype"] else None
    # only what differs from the defaults: a plain row's call is the one the main matrix makes
    extra = {}
    if s["q_len"] > 1:
        extra["q_len"] = s["q_len"]
    if window_of(s) is not None:
        extra["window_size"] = (window_of(s), 0)
    if softcap_of(s):
        extra["softcap"] = softcap_of(s)
    if s.get("sinks"):
        extra["sinks"] = True
    decoder = kvstream._native.Decoder(s["batch"], s["hq"], s["hkv"], s["d"], s["L"], s["dtype"],
                                       device=torch.cuda.current_device(), kv_dtype=fp8, **extra)
    return parse_plan(decoder.plan)


def measure_attention(shape, handles, rounds):
    """results dict (implementation -> entry) for one shape."""
    import torch

    results = {name: {"error": err} for name, (h, err) in handles.items() if err}
    live = [name for name, (h, err) in handles.items() if not err]
    for name in list(live):  # a peer without the row's features is not called
        lacking = unsupported(name, shape)
        if lacking:
            results[name] = {"error": f"unsupported: {lacking}"}
            live.remove(name)
    if not live:
        return {name: results[name] for name in handles if name in results}
    sets = pool_sets(shape)
    io = io_bytes(shape)
    pool = sdpa = ref = ref8 = mods = None
    graphs, outs = {}, {}
    call = graph = out = None
    try:
        pool = make_pool(shape, sets)
        if any(n in SDPA_PEERS for n in live):
            sdpa = sdpa_layout(pool)
        mods = ref_mods(shape, pool)
        ref = reference(pool["q"][0], pool["k"][0], pool["v"][0], **mods)
        # fp8 rows: what kvstream and FA3 were given, dequantised
        ref8 = None if "k8" not in pool else reference(
            pool["q"][0], pool["k8"][0], pool["v8"][0], kv_scale=FP8_SCALE, **mods)
        for name in live:
            try:
                call = make_call(name, handles[name][0], pool, sdpa, shape)
                graph, out = capture(call, sets)
                for o in out:  # a graph that writes nothing must fail the check
                    o.fill_(float("nan"))
                graphs[name], outs[name] = (graph, sets), out
            except Exception as e:
                results[name] = {"error": f"capture: {short_error(e)}"}
                torch.cuda.synchronize()
        times = time_graphs(graphs, rounds) if graphs else {}
        for name in graphs:
            try:
                on_fp8 = ref8 is not None and name in ("kvstream", "fa3")
                # GB/s of the bytes each one read: the bf16 caches beside an fp8 row hold twice
                moved = io if on_fp8 or ref8 is None else io_bytes(dict(shape, kv_dtype=shape["dtype"]))
                entry = timing_entry(times[name], moved, rel_err(outs[name][0], ref8 if on_fp8 else ref),
                                     FA3_FP8_MAX_REL_ERR if on_fp8 and name == "fa3" else MAX_REL_ERR)
                if on_fp8 and "error" not in entry:  # what the quantisation costs
                    entry["rel_err_vs_bf16_cache"] = round(rel_err(outs[name][0], ref), 6)
                results[name] = entry
            except Exception as e:
                results[name] = {"error": f"check: {short_error(e)}"}
    except Exception as e:  # pool, reference or replay (out of memory, ...): the rest fail
        for name in live:
            results.setdefault(name, {"error": f"shape setup: {short_error(e)}"})
    finally:
        # The closures and graphs hold the pool: drop every reference before emptying the cache.
        call = graph = out = mods = None
        del graphs, outs, pool, sdpa, ref, ref8, call, graph, out, mods
        gc.collect()
        torch.cuda.empty_cache()
    if "kvstream" in results and "error" not in results["kvstream"]:
        try:
            splits, mode = kvstream_plan(handles["kvstream"][0], shape)
            results["kvstream"].update(mode=mode, splits=splits)
        except Exception as e:
            results["kvstream"]["plan_error"] = short_error(e)
    return {name: results[name] for name in handles if name in results}


# ------------------------------------------------------------------------------------------------
# GPU: streaming-read floor and ceiling
# ------------------------------------------------------------------------------------------------


class StreamRead:
    """The streaming-read kernel, launched on torch's current stream (graph-capturable)."""

    def __init__(self, sm_count):
        import torch

        self.grids = [sm_count * k for k in READ_GRID_PER_SM]
        self.sink = torch.empty(max(self.grids), dtype=torch.int32, device="cuda")
        self.cupy_error = None
        try:
            import cupy
            import numpy

            self.cupy, self.np = cupy, numpy
            self.kernel = cupy.RawKernel(READ_KERNEL_SRC, "stream_read")
            if hasattr(self.kernel, "compile"):  # cupy >= 10: compile now, not at first launch
                self.kernel.compile()
        except Exception as e:
            # Without cupy the floor falls back to a torch reduction (a note says so).
            self.kernel = None
            self.cupy_error = short_error(e)

    def variants(self):
        return self.grids if self.kernel is not None else ["torch.amax"]

    def launcher(self, variant, buf, stride, nbytes):
        """call(s) reading nbytes at buf + s * stride with one grid size."""
        import torch

        if self.kernel is None:
            words = buf.view(torch.int32)
            sink = self.sink[:1]

            def call(s):
                lo = s * stride // 4
                torch.amax(words[lo: lo + nbytes // 4], dim=0, keepdim=True, out=sink)
                return sink

            return call
        base = buf.data_ptr()
        n16 = self.np.uint64(nbytes // 16)
        sink = self.np.uint64(self.sink.data_ptr())

        def call(s):
            stream = self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            with stream:
                self.kernel((variant,), (READ_THREADS,),
                            (self.np.uint64(base + s * stride), n16, sink))
            return self.sink

        return call

    def time_pool(self, nbytes, sets, rounds, notes):
        """Best over variants of the median per-call us reading nbytes from each of `sets`
        buffers; the graph timer, or back-to-back launches if capturing cupy launches fails."""
        import torch

        stride = (nbytes + 255) // 256 * 256  # every set 256-byte aligned
        buf = torch.empty(sets * stride, dtype=torch.uint8, device="cuda")
        buf.view(torch.bfloat16).normal_()  # real data: no chance of a compressed/zero page path
        graphs, best = {}, None
        try:
            calls = {v: self.launcher(v, buf, stride, nbytes) for v in self.variants()}
            try:
                for v, call in calls.items():
                    graphs[v] = (capture(call, sets)[0], sets)
                times = time_graphs(graphs, rounds)
            except Exception as e:
                note = f"read kernel not graph-captured ({short_error(e)}): floor and ceiling " \
                       f"from back-to-back launches of the whole pool"
                if note not in notes:
                    notes.append(note)
                torch.cuda.synchronize()
                graphs.clear()
                times = {v: time_eager(call, sets, rounds) for v, call in calls.items()}
            best = min(statistics.median(t) for t in times.values())
        finally:
            del graphs, buf
            gc.collect()
            torch.cuda.empty_cache()
        return best


def time_eager(call, sets, rounds):
    """Per-call us of rounds of back-to-back eager calls over the pool (fallback timer)."""
    import torch

    for s in range(sets):
        call(s)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s in range(sets):
            call(s)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / sets)
    return times


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def versions(handles):
    import torch

    v = {"python": sys.version.split()[0], "torch": torch.__version__,
         "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    for mod in ("kvstream", "cupy", "fa3_fwd_interface"):
        m = sys.modules.get(mod)
        if m is not None:
            v[mod] = getattr(m, "__version__", "?")
    return v


def progress_line(i, n, row, elapsed):
    res = row["results"]
    k = ok_us(res.get("kvstream"))
    name, peer_us = best_peer(row)
    ks = f"{k:8.2f} us" if k is not None else f"{fmt_us(res.get('kvstream')):>8}   "
    ps = f"{name:<10} {peer_us:8.2f} us" if name else f"{'-':<10} {'-':>8}   "
    sp = f"x{peer_us / k:5.2f}" if k and peer_us else "  -   "
    fl = f"floor {row['floor_us']:7.2f} us" if row.get("floor_us") else "floor    -"
    return f"[{i:2d}/{n}] {row['id']:<22} kvstream {ks} | best peer {ps} | {sp} | {fl} | " \
           f"{elapsed:5.0f} s"


def final_table(doc):
    lines = [f"{'shape':<22} {'kvstream':>9} " + " ".join(f"{p:>10}" for p in PEERS)
             + f" {'speedup':>8} {'/floor':>7}"]
    for row in doc["rows"]:
        res = row["results"]
        k = ok_us(res.get("kvstream"))
        _, peer_us = best_peer(row)
        sp = f"{peer_us / k:.2f}x" if k and peer_us else "-"
        fl = f"{k / row['floor_us']:.2f}" if k and row.get("floor_us") else "-"
        lines.append(f"{row['id']:<22} {fmt_us(res.get('kvstream')):>9} "
                     + " ".join(f"{fmt_us(res.get(p)):>10}" for p in PEERS)
                     + f" {sp:>8} {fl:>7}")
    return "\n".join(lines)


def run_gpu(args, shapes, impls, rounds):
    import torch

    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    notes = []
    handles = load_impls(impls)
    for name, (h, err) in handles.items():
        if err:
            print(f"{name}: {err}")
    reader = StreamRead(props.multi_processor_count)
    if reader.cupy_error:
        notes.append(f"cupy unavailable ({reader.cupy_error}): floor and ceiling from "
                     f"torch.amax over the same bytes (a reduction, slower than a pure read)")
    ceiling_us = reader.time_pool(CEILING_BYTES, 1, rounds, notes)
    doc = {
        "date": datetime.date.today().isoformat(),
        "commit": args.commit or git_commit(),
        **({"kind": args.kind} if args.kind else {}),
        "gpu": torch.cuda.get_device_name(0),
        "read_ceiling_GBps": round(CEILING_BYTES / ceiling_us / 1e3, 1),
        "rows": [],
        "notes": notes,
        "method": {"rounds": rounds, "warmup_replays": WARMUP_REPLAYS, "pool_bytes": POOL_BYTES,
                   "read_grids": reader.variants(), "read_threads": READ_THREADS,
                   "max_rel_err": MAX_REL_ERR, "sm_count": props.multi_processor_count},
        "versions": versions(handles),
    }
    print(f"{doc['gpu']}: read ceiling {doc['read_ceiling_GBps']:.0f} GB/s "
          f"({time.time() - t0:.1f} s)")
    partial = Path(args.results_dir) / f"{args.prefix}-partial.json"
    for i, shape in enumerate(shapes, 1):
        sets = pool_sets(shape)
        row = {k: shape[k] for k in ("id", "group", "batch", "q_len", "hq", "hkv", "d", "L",
                                     "dtype", "kv_dtype", "window", "softcap", "sinks")
               if k in shape}
        row["io_bytes"] = io_bytes(shape)
        row["sets"] = sets
        try:
            row["floor_us"] = round(reader.time_pool(row["io_bytes"], sets, rounds, notes), 3)
        except Exception as e:
            row["floor_us"] = None
            row["floor_error"] = short_error(e)
        row["results"] = measure_attention(shape, handles, rounds)
        doc["rows"].append(row)
        print(progress_line(i, len(shapes), row, time.time() - t0), flush=True)
        write_json(partial, doc)
    doc["summary"] = summarize(doc["rows"])
    doc["elapsed_s"] = round(time.time() - t0, 1)
    return doc


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the method.")
    ap.add_argument("--matrix",
                    help="matrix JSON (default: bench/matrix.json; with --merge, the matrix of "
                         "the runs' kind)")
    ap.add_argument("--ids", type=lambda s: [x for x in s.split(",") if x],
                    help="comma-separated shape ids to run (default: all)")
    ap.add_argument("--impls", type=lambda s: [x for x in s.split(",") if x],
                    help=f"comma-separated subset of {','.join(IMPLS)} (--kv-dtype fp8_e4m3: of "
                         f"{','.join(FP8_IMPLS)}); default: all")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test: first {QUICK_SHAPES} shapes, {QUICK_ROUNDS} rounds")
    ap.add_argument("--rounds", type=int, default=9, help=f"timed rounds (>= {MIN_ROUNDS})")
    ap.add_argument("--commit", help="commit of the measured code (default: git rev-parse)")
    ap.add_argument("--results-dir", default=str(REPO / "bench" / "results"))
    ap.add_argument("--md",
                    help="markdown report path (default: bench/RESULTS.md; RESULTS-fp8.md with "
                         "--kv-dtype fp8_e4m3, RESULTS-<kind>[-fp8].md for a matrix with a kind "
                         "such as bench/matrix-models.json)")
    ap.add_argument("--out-prefix",
                    help="start of the results files' names (default: the GPU's, h200 or h100): "
                         "<prefix>[-<kind>][-fp8]-latest.json, -DATE.json, -partial.json; "
                         "the report of another prefix than h200 is RESULTS-<prefix>....md")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8_e4m3"), default="bf16",
                    help="cache dtype: fp8_e4m3 runs the FP8 comparison (see the docstring)")
    ap.add_argument("--plot-only", metavar="JSON",
                    help="only draw the plots of an existing results file (next to it)")
    ap.add_argument("--report-only", metavar="JSON",
                    help="only rewrite --md and the plots from an existing results file")
    ap.add_argument("--merge", metavar="JSON", nargs="+",
                    help="combine results files of the same commit run over parts of the matrix "
                         "(each shape once, in --matrix order) into the latest and dated files, "
                         "--md and the plots")
    args = ap.parse_args(argv)
    if args.kv_dtype == "fp8_e4m3":
        use_fp8_impls()
    if args.out_prefix is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", args.out_prefix):
        ap.error("--out-prefix must be a plain file-name part")
    if args.impls is None:
        args.impls = list(IMPLS)
    bad = [x for x in args.impls if x not in IMPLS]
    if bad:
        ap.error(f"unknown --impls {','.join(bad)}; allowed: {','.join(IMPLS)}")
    if "kvstream" not in args.impls:
        ap.error("--impls must include kvstream (speedups are relative to it)")
    if not args.quick and args.rounds < MIN_ROUNDS:
        ap.error(f"--rounds must be >= {MIN_ROUNDS} (docs/benchmarking.md); use --quick for a smoke test")
    if sum(bool(x) for x in (args.plot_only, args.report_only, args.merge)) > 1:
        ap.error("--plot-only, --report-only and --merge exclude each other")
    return args


def resolve_outputs(args, kind, fp8, gpu_name):
    """args.prefix (results files) and args.md for a run or document of this matrix kind and
    cache dtype on this GPU: "h200", "h200-fp8", "h200-models", ... and
    bench/RESULTS<same suffix>.md; on an H100 "h100..." and bench/RESULTS-h100<suffix>.md."""
    tag = output_tag(kind, fp8)
    gpu = args.out_prefix or gpu_prefix(gpu_name)
    args.prefix = f"{gpu}{tag}"
    if args.md is None:
        args.md = str(REPO / "bench" / (f"RESULTS{tag}.md" if gpu == "h200" else f"RESULTS-{gpu}{tag}.md"))


def use_fp8_impls():
    """The FP8 comparison's implementations and peers, for every function of this module."""
    global IMPLS, PEERS
    IMPLS, PEERS = FP8_IMPLS, FP8_PEERS


def shown(path):
    """A path as printed: relative to the repository when inside it."""
    try:
        return Path(path).resolve().relative_to(REPO)
    except ValueError:
        return path


def merge_docs(docs, matrix_ids):
    """One results document from runs over parts of the matrix: the first run's header, every
    shape once (a shape in two runs is an error), rows in matrix order, notes of all runs."""
    commits = {d.get("commit") for d in docs}
    if len(commits) != 1:
        raise SystemExit(f"compare.py --merge: runs of different commits {sorted(map(str, commits))}")
    rows, notes = {}, []
    for d in docs:
        for r in d["rows"]:
            if r["id"] in rows:
                raise SystemExit(f"compare.py --merge: shape {r['id']} is in two runs")
            rows[r["id"]] = r
        notes += [n for n in d.get("notes", []) if n not in notes]
    order = {i: k for k, i in enumerate(matrix_ids)}
    doc = dict(docs[0])
    doc["rows"] = sorted(rows.values(), key=lambda r: order.get(r["id"], len(order)))
    doc["notes"] = notes + [f"merged from {len(docs)} runs over parts of the matrix"]
    doc["summary"] = summarize(doc["rows"])
    doc["elapsed_s"] = round(sum(d.get("elapsed_s", 0) for d in docs), 1)
    return doc


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        docs = [json.loads(Path(p).read_text()) for p in args.merge]
        kind = docs[0].get("kind")
        matrix = args.matrix or REPO / "bench" / (f"matrix-{kind}.json" if kind else "matrix.json")
        ids = [s["id"] for s in json.loads(Path(matrix).read_text())["shapes"]]
        doc = merge_docs(docs, ids)
        fp8 = any(kv_dtype(r) == "fp8_e4m3" for r in doc["rows"])
        if fp8:
            use_fp8_impls()
        resolve_outputs(args, kind, fp8, doc.get("gpu"))
        for line in summary_lines(doc["summary"]):
            print(line)
        for p in write_outputs(doc, args.results_dir, args.md, args.prefix):
            print(f"wrote {shown(p)}")
        return 0
    if args.plot_only or args.report_only:
        path = Path(args.plot_only or args.report_only)
        doc = json.loads(path.read_text())
        fp8 = any(kv_dtype(r) == "fp8_e4m3" for r in doc["rows"])
        if fp8:
            use_fp8_impls()
        resolve_outputs(args, doc.get("kind"), fp8, doc.get("gpu"))
        if args.report_only:
            doc.setdefault("summary", summarize(doc["rows"]))
            Path(args.md).write_text(markdown(doc, args.prefix))
            print(f"wrote {shown(args.md)}")
        for p in plot_results(doc, path.parent):
            print(f"wrote {shown(p)}")
        return 0
    args.matrix = args.matrix or str(REPO / "bench" / "matrix.json")
    args.kind = matrix_kind(args.matrix)
    import torch

    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    resolve_outputs(args, args.kind, args.kv_dtype != "bf16", gpu_name)
    shapes = load_matrix(args.matrix, args.ids, args.quick)
    if args.kv_dtype != "bf16":
        shapes = [dict(s, kv_dtype=args.kv_dtype) for s in shapes]
    rounds = QUICK_ROUNDS if args.quick else args.rounds
    impls = [i for i in IMPLS if i in args.impls]
    doc = run_gpu(args, shapes, impls, rounds)
    if args.quick:
        doc["notes"].append(f"--quick smoke run: {len(shapes)} shapes, {rounds} rounds")
    print()
    print(final_table(doc))
    print()
    for line in summary_lines(doc["summary"]):
        print(line)
    for p in write_outputs(doc, args.results_dir, args.md, args.prefix):
        print(f"wrote {shown(p)}")
    print(f"total {doc['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
