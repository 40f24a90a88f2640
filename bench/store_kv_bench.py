"""Times ``kvstream.store_kv`` (the cache write) against copies of the same bytes, on the GPU.

For each number of new tokens (default 1, 64, 4096; 8 KV heads of d 128, pages of 16) and each
cache dtype (e4m3 with per-head scales: quantising; bf16: copying), one CUDA graph holds one
call per input set (a rotating pool of ``sets`` inputs, slots into a 1 GiB-class page pool in
a random order, so every call writes other rows and reads other inputs than the last); per-call
latency = replay time (CUDA events) / sets, median of ``--rounds`` replays. Beside it, in the
same graphs' way:

* ``copy``: ``dst.copy_(src)`` of the new K and V rows into a scratch tensor of the same dtype as
  the inputs (reads and writes 2 bytes per element: more bytes than an e4m3 write, as many as a
  bf16 one), two launches as store_kv is one;
* ``index_copy``: the cache write a torch user writes for a bf16 cache
  (``cache.view(-1, hkv, d).index_copy_(0, slots, k)``, K and V), without the -1 skip.

Bytes counted for GB/s: what store_kv moves (new rows read, cache rows written, slots read).
Writes ``--json`` (default bench/results/store-kv-latest.json) and prints a table.

    KVSTREAM_CACHE_DIR=$PWD/.carry/cache PYTHONPATH=/tmp/kvs-site python3 bench/store_kv_bench.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch

import kvstream

REPO = Path(__file__).resolve().parent.parent
POOL_BYTES = 256 << 20  # new-token inputs per cycle, above the 60 MB L2


def graph_time(calls, rounds: int) -> float:
    """Median per-call microseconds of a CUDA graph holding every call in ``calls``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:  # warm-up: compiles, picks kernels
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(2):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def run_row(tokens: int, hkv: int, d: int, page: int, cache_dtype: str, rounds: int) -> dict:
    dev = "cuda"
    in_bytes = tokens * hkv * d * 2 * 2  # K and V rows, bf16
    sets = max(2, min(256, -(-POOL_BYTES // in_bytes)))
    slots_total = tokens * sets
    pages = -(-slots_total // page) + 1
    fp8 = cache_dtype == "fp8_e4m3"
    cdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k_cache = torch.zeros(pages, page, hkv, d, device=dev, dtype=cdt)
    v_cache = torch.zeros_like(k_cache)
    ks = [torch.randn(tokens, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    vs = [torch.randn_like(k) for k in ks]
    perm = torch.randperm(pages * page, device=dev)[:slots_total].view(sets, tokens)
    slot_sets = [perm[i].contiguous() for i in range(sets)]
    scale = (torch.rand(hkv, device=dev) * 0.01 + 0.02) if fp8 else None
    scales = {"k_scale": scale, "v_scale": scale} if fp8 else {}

    store = [lambda i=i: kvstream.store_kv(ks[i], vs[i], k_cache, v_cache, slot_sets[i], **scales)
             for i in range(sets)]
    dst_k = [torch.empty_like(k) for k in ks]
    dst_v = [torch.empty_like(v) for v in vs]

    def copy(i):
        dst_k[i].copy_(ks[i])
        dst_v[i].copy_(vs[i])

    row = {
        "id": f"store-t{tokens}-hkv{hkv}-d{d}-p{page}-{cache_dtype}",
        "tokens": tokens, "hkv": hkv, "head_dim": d, "page_size": page,
        "cache_dtype": cache_dtype, "sets": sets,
        # what store_kv moves: the new rows, the cache rows written, the slots
        "bytes": in_bytes + tokens * hkv * d * 2 * (1 if fp8 else 2) + tokens * 8,
    }
    row["store_kv_us"] = graph_time(store, rounds)
    row["copy_us"] = graph_time([lambda i=i: copy(i) for i in range(sets)], rounds)
    if not fp8:
        kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)

        def index_copy(i):
            kf.index_copy_(0, slot_sets[i], ks[i])
            vf.index_copy_(0, slot_sets[i], vs[i])

        row["index_copy_us"] = graph_time([lambda i=i: index_copy(i) for i in range(sets)], rounds)
    row["store_kv_gbs"] = row["bytes"] / row["store_kv_us"] / 1e3
    # correctness of the last set written: read back, dequantise, compare
    torch.cuda.synchronize()
    i = sets - 1
    blk, off = slot_sets[i] // page, slot_sets[i] % page
    got_k = k_cache[blk, off].float()
    want_k = ks[i].float()
    if fp8:
        got_k = got_k * scale.view(1, hkv, 1)
        tol = 0.07 * want_k.abs() + 0.5 * scale.view(1, hkv, 1) * 2.0**-9
        ok = bool(((got_k - want_k).abs() <= tol + 1e-6).all())
    else:
        ok = bool(torch.equal(got_k, want_k))
    row["read_back_ok"] = ok
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,4096")
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--json", default=str(REPO / "bench/results/store-kv-latest.json"))
    a = ap.parse_args()
    rows = []
    for cache_dtype in ("fp8_e4m3", "bf16"):
        for t in (int(x) for x in a.tokens.split(",")):
            r = run_row(t, a.hkv, a.head_dim, a.page_size, cache_dtype, a.rounds)
            rows.append(r)
            extra = f" index_copy {r['index_copy_us']:8.2f}" if "index_copy_us" in r else ""
            print(f"{r['id']:36s} store_kv {r['store_kv_us']:8.2f} us ({r['store_kv_gbs']:6.0f} GB/s)"
                  f"  copy {r['copy_us']:8.2f}{extra}  read-back {'ok' if r['read_back_ok'] else 'WRONG'}",
                  flush=True)
    doc = {"gpu": torch.cuda.get_device_name(), "commit": a.commit,
           "date": datetime.date.today().isoformat(), "rows": rows}
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
