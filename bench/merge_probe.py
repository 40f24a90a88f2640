"""Times the cut-unit merge alone (bench/merge_probe.cu): why does an MLA merge slice of ~32 KB a
CTA take 12-16 us inside the decode at batch 1 (bench/NOTES.md), and what will the GQA decode's
slice merge (two units of 66 pieces, 8 rows of 128 dims at gqa-d128-L131072) take?

Each configuration runs the probe kernel (one CTA per SM, the pieces of one or two units)
--launches times after two warm-up launches and reports, per step, the median over launches of
the median CTA's duration in microseconds (%globaltimer): stream, write (the partials and the
park), wait (until every piece has parked), merge (the slice, all threads), count (the last
arrival's reset), and the launch's event time. The configurations vary one thing each against
`base` (the MLA decode's case: KV streamed through L2 first, 32 KB slots, ld.global.cg, the
epilogue's store pattern):

  no-stream   nothing streamed first (L2 holds only the partials)
  padded      slots 32 KB + 256 B apart (a power-of-two stride aliasing in L2 or DRAM?)
  ld-ca       plain loads instead of .cg
  old-data    no writes: the slots hold the previous launch's partials
  old-data+no-stream   neither: L2 hits at their plainest
  vec-write   the partials written as float4 rows
  split-1     one thread a head-dim group (every piece's load in one thread's queue)
  rows-16     16 rows (h16) instead of 12
  transposed  the partials group-major (a unit's pieces of one group side by side): contiguous loads
  gqa         the GQA decode's case: two units, 8 rows of 128 dims, 4 KB slots (and `gqa-padded`)

    python3 bench/merge_probe.py [--launches 15] [--json out.json]
"""

import argparse
import json
import os
import statistics

FLAG_STREAM, FLAG_WRITE, FLAG_LOAD_CA, FLAG_VEC_WRITE, FLAG_TRANSPOSED = 1, 2, 4, 8, 16
STAMPS = 6
MAX_FLOATS = 16 * 512 + 64  # the largest slot below


def configs():
    slot = 16 * 512  # GROUP_PAD (16) rows of 512 floats: the MLA decode's slot
    base = dict(flags=FLAG_STREAM | FLAG_WRITE, rows=12, dim=512, units=1, slot=slot, split=32)
    out = [("base", base)]
    out.append(("no-stream", dict(base, flags=FLAG_WRITE)))
    out.append(("padded", dict(base, slot=slot + 64)))
    out.append(("ld-ca", dict(base, flags=base["flags"] | FLAG_LOAD_CA)))
    out.append(("old-data", dict(base, flags=FLAG_STREAM)))
    out.append(("old-data+no-stream", dict(base, flags=0)))
    out.append(("vec-write", dict(base, flags=base["flags"] | FLAG_VEC_WRITE)))
    out.append(("split-1", dict(base, split=1)))
    out.append(("rows-16", dict(base, rows=16)))
    out.append(("transposed", dict(base, flags=base["flags"] | FLAG_TRANSPOSED)))
    out.append(("padded+no-stream", dict(base, flags=FLAG_WRITE, slot=slot + 64)))
    gqa = dict(base, rows=8, dim=128, units=2, slot=8 * 128)
    out.append(("gqa", gqa))
    out.append(("gqa-padded", dict(gqa, slot=8 * 128 + 64)))
    return out


def check(got, c, pieces):
    """Every unit's merged rows against what the epilogue-pattern writes left in its slots
    (float64)."""
    import numpy as np

    rows, dim = c["rows"], c["dim"]
    i = np.arange(pieces)[:, None, None]
    r = np.arange(rows, dtype=np.float64)[None, :, None]
    g = (np.arange(dim) // 8).astype(np.float64)[None, None, :]
    o = (np.float32(0.001) * i.astype(np.float32)).astype(np.float64) + r + g  # [piece, row, dim]
    m = 0.5 * (np.arange(pieces) % 7)
    w = np.exp2(m - m.max())[:, None, None]
    l = (1.0 + np.arange(rows))[None, :, None]
    want = (w * o).sum(0) / (w * l).sum(0)
    for u in range(c["units"]):
        unit = got[u * rows * dim:(u + 1) * rows * dim].reshape(rows, dim)
        err = np.abs(unit - want).max() / np.abs(want).max()
        assert err < 1e-5, f"unit {u}: merged rows off by {err:.2e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=15)
    ap.add_argument("--stream-mib", type=int, default=144, help="bytes streamed first (the decode's KV)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import cupy as cp

    src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "merge_probe.cu")).read()
    kernel = cp.RawKernel(src, "merge_probe", options=("-std=c++17",))
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    gpu = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    # one CTA an SM: more dynamic shared memory than two CTAs fit
    smem = 120 * 1024
    kernel.max_dynamic_shared_size_bytes = smem
    stream_vec4 = args.stream_mib * 2**20 // 16
    stream = cp.random.random(stream_vec4 * 4, dtype=cp.float32)
    o_part = cp.zeros(sms * MAX_FLOATS, dtype=cp.float32)
    ml_part = cp.zeros(sms * 16 * 2, dtype=cp.float32)
    counters = cp.zeros(2 * 2, dtype=cp.int32)  # two a unit
    out = cp.zeros(2 * 16 * 512, dtype=cp.float32)
    stamps = cp.zeros(sms * STAMPS, dtype=cp.uint64)
    sink = cp.zeros(sms, dtype=cp.float32)
    start, end = cp.cuda.Event(), cp.cuda.Event()

    def launch(c):
        kernel((sms,), (256,), (stream, cp.int64(stream_vec4), o_part, ml_part, counters, out, stamps, sink,
                                cp.int32(c["rows"]), cp.int32(c["dim"]), cp.int32(c["units"]),
                                cp.int64(c["slot"]), cp.int32(c["flags"]), cp.int32(c["split"])), shared_mem=smem)

    rows_out = []
    print(f"{sms} SMs, {args.launches} launches a configuration; us, median CTA, median launch")
    print(f"{'config':18s} {'stream':>7s} {'write':>7s} {'wait':>7s} {'merge':>7s} {'count':>7s} {'kernel':>8s}")
    for name, c in configs():
        pieces = sms // c["units"]
        assert c["units"] * pieces * c["slot"] <= sms * MAX_FLOATS
        # old-data reads what a writing launch left
        launch(dict(c, flags=c["flags"] | FLAG_WRITE))
        launch(c)
        steps = {"stream": [], "write": [], "wait": [], "merge": [], "count": [], "kernel": []}
        for _ in range(args.launches):
            start.record()
            launch(c)
            end.record()
            end.synchronize()
            s = stamps.get().reshape(sms, STAMPS).astype("int64")[: c["units"] * pieces]
            for key, a, b in (("stream", 0, 1), ("write", 1, 2), ("wait", 2, 3), ("merge", 3, 4), ("count", 4, 5)):
                steps[key].append(statistics.median((s[:, b] - s[:, a]).tolist()) / 1000.0)
            steps["kernel"].append(cp.cuda.get_elapsed_time(start, end) * 1000.0)
        assert int(counters.get().sum()) == 0, "the last CTA resets both counters"
        if not c["flags"] & FLAG_VEC_WRITE:
            check(out.get(), c, pieces)
        med = {k: statistics.median(v) for k, v in steps.items()}
        print(f"{name:18s} {med['stream']:7.2f} {med['write']:7.2f} {med['wait']:7.2f} {med['merge']:7.2f} {med['count']:7.2f} "
              f"{med['kernel']:8.2f}")
        rows_out.append(dict(config=name, **c, **med))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "sms": sms, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
