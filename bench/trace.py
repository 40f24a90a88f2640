#!/usr/bin/env python3
"""Summarises the decode kernels' phase trace (`KVS_TRACE` in decode_gqa.cu, decode.cu and
decode_mla.cu).

    KVSTREAM_TRACE=<dir> kvstream bench --ids ...   # writes <dir>/<shape>.<key>.<variant>.csv
    python3 bench/trace.py <dir> [--json out.json] [--perfetto trace.json]

One CSV line per CTA. CTAs are grouped into calls by the moment their PDL wait returned (a call's
CTAs are released together when the kernel before them completes; calls are microseconds apart).
Per call, times are taken from that release (the earliest `waited` of the call): for each trace
point the median over the call's CTAs and the latest CTA; then the median of those over calls.
`period` is the release-to-release time of consecutive calls (one decode plus its combine: the
per-call latency the graph timer sees), `tail` is what of it lies after the call's last CTA has
left (the combine and the next call's release), `early` how long before the release the
call's first CTA entered the kernel (what PDL overlaps).

`--perfetto` also writes the records as a Chrome trace-event file (open it in ui.perfetto.dev or
chrome://tracing; docs/benchmarking.md says how to read it): a process per CSV (shape and
kernel variant), a track per SM, and per CTA one span from each trace point it stamped to the
next, named after the two ("first_tile -> first_loop"), with the CTA's block, tile and piece
counts as arguments; times in microseconds from the earliest stamp of all files.
"""
import argparse
import csv
import json
import os
import statistics
import sys

CALL_GAP_NS = 1500  # releases of one call lie closer than this; calls lie further apart


def calls_of(rows):
    rows = sorted(rows, key=lambda r: r["waited_ns"])
    calls, cur = [], []
    for r in rows:
        if cur and r["waited_ns"] - cur[-1]["waited_ns"] > CALL_GAP_NS:
            calls.append(cur)
            cur = []
        cur.append(r)
    if cur:
        calls.append(cur)
    return calls


def summarise(path):
    # the trace points, in the kernel's order, from the header the bench wrote
    points, rows = read_rows(path)
    calls = calls_of(rows)
    # a call's CTA count is the grid's; keep only complete calls
    size = statistics.mode(len(c) for c in calls)
    calls = [c for c in calls if len(c) == size]
    per_call = []
    for i, c in enumerate(calls):
        release = min(r["waited_ns"] for r in c)
        d = {"ctas": len(c)}
        for p in points:
            vals = [r[p + "_ns"] - release for r in c if r[p + "_ns"]]
            if vals:
                d[p + "_med"] = statistics.median(vals)
                d[p + "_max"] = max(vals)
        d["early"] = -min(r["entry_ns"] - release for r in c)
        if i + 1 < len(calls):
            nxt = min(r["waited_ns"] for r in calls[i + 1])
            d["period"] = nxt - release
            d["tail"] = nxt - (release + d["exit_max"])
        per_call.append(d)
    keys = sorted({k for d in per_call for k in d})
    med = {k: statistics.median(d[k] for d in per_call if k in d) for k in keys}
    # a CTA's own durations (per CTA, then the median over all CTAs)
    own = {}
    for a, b in [("waited", "producer_waited"), ("producer_waited", "released"), ("released", "planned"),
                 ("planned", "producer_ready"), ("producer_ready", "ids_ready"), ("ids_ready", "first_issue"),
                 ("producer_waited", "producer_ready"),
                 ("producer_ready", "first_issue"), ("first_issue", "first_tile"),
                 ("waited", "q_issued"), ("q_issued", "q_staged"), ("first_tile", "second_tile"),
                 ("first_tile", "last_tile"), ("last_tile", "loop_done"), ("loop_done", "merged"),
                 ("merged", "exit"), ("waited", "exit"),
                 # the persistent kernel's points (decode.cu)
                 ("waited", "scheduled"), ("scheduled", "first_tile"), ("first_tile", "first_loop"),
                 ("first_loop", "parked"), ("parked", "merged"),
                 # the MLA kernel's (decode_mla.cu): the wait for a cut unit's pieces, its merge
                 ("last_loop", "parked"), ("parked", "all_parked"), ("all_parked", "merged"),
                 ("all_parked", "merge_start"), ("merge_start", "merge_done"),
                 ("merge_done", "merge_synced"), ("merge_synced", "merged")]:
        vals = [r[b + "_ns"] - r[a + "_ns"] for c in calls for r in c if r.get(a + "_ns") and r.get(b + "_ns")]
        if vals:
            own[f"{a}->{b}"] = statistics.median(vals)
    return {"file": os.path.basename(path), "points": points, "calls": len(per_call), "ctas_per_call": size,
            "tiles": statistics.median(r["tiles"] for r in rows), "median_over_calls": med,
            "cta_durations_median": own}


def read_rows(path):
    with open(path) as f:
        reader = csv.DictReader(f)
        rows = [{k: int(v) for k, v in r.items()} for r in reader]
    return [c[:-3] for c in reader.fieldnames if c.endswith("_ns")], rows


def perfetto_events(files):
    """Trace events ("X" spans, "M" names) of the CSV files [(name, points, rows)]."""
    starts = [r[p + "_ns"] for _, points, rows in files for r in rows for p in points if r[p + "_ns"]]
    t0 = min(starts) if starts else 0
    events = []
    for pid, (name, points, rows) in enumerate(files, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for sm in sorted({r["sm"] for r in rows}):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": sm, "args": {"name": f"SM {sm}"}})
        for r in rows:
            stamps = sorted((r[p + "_ns"], p) for p in points if r[p + "_ns"])
            args = {k: r[k] for k in ("seq", "block_x", "block_y", "block_z", "tiles") if k in r}
            for extra in ("pieces", "splits", "range_tiles", "len"):
                if extra in r:
                    args[extra] = r[extra]
            for (ta, a), (tb, b) in zip(stamps, stamps[1:]):
                events.append({"ph": "X", "name": f"{a} -> {b}", "pid": pid, "tid": r["sm"],
                               "ts": (ta - t0) / 1e3, "dur": (tb - ta) / 1e3, "args": args})
    return events


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--json")
    ap.add_argument("--perfetto", help="also write the records as a Chrome trace-event file")
    a = ap.parse_args()
    names = [f for f in sorted(os.listdir(a.dir)) if f.endswith(".csv")]
    if a.perfetto:
        files = [(f[:-4], *read_rows(os.path.join(a.dir, f))) for f in names]
        with open(a.perfetto, "w") as f:
            json.dump({"traceEvents": perfetto_events(files), "displayTimeUnit": "ns"}, f)
        print(f"{a.perfetto}: open in ui.perfetto.dev")
    out = [summarise(os.path.join(a.dir, f)) for f in names]
    for s in out:
        m = s["median_over_calls"]
        print(f"\n{s['file']}: {s['calls']} calls x {s['ctas_per_call']} CTAs, {s['tiles']:.0f} tiles per CTA")
        print(f"  period {m.get('period', 0) / 1e3:.2f} us, tail {m.get('tail', 0) / 1e3:.2f} us, "
              f"first CTA entered {m['early'] / 1e3:.2f} us before the release")
        print("  from the release, us (median CTA, latest CTA; medians over calls):")
        for p in s["points"]:
            if p + "_med" in m:
                print(f"    {p:<16} {m[p + '_med'] / 1e3:7.2f} {m[p + '_max'] / 1e3:7.2f}")
        print("  per CTA, us (median over CTAs):")
        for k, v in s["cta_durations_median"].items():
            print(f"    {k:<34} {v / 1e3:7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
