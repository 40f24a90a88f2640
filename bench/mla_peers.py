"""Times FlashMLA's dense bf16 MLA decode (sm90, paged KV, page 64), a peer of `kvstream mla`.

Same timer as `kvstream demo` and bench/peer_sdpa.py: a rotating pool of
sets = clamp(ceil(512 MiB / KV bytes of one set), 2, 256) independent input sets, one CUDA graph
holding one call per set, 2 warm-up replays, then >= 9 rounds of one replay; per-call latency =
replay time / sets; median and min of rounds.

Two modes, both reported per shape:
  precomputed   (`us`, `us_min`): the scheduling metadata is made once per set outside the graph,
                as a server does once per batch; the graph holds only the decode (split + combine).
  in_graph      (`us_with_metadata`): each captured call starts from a fresh get_mla_metadata(),
                so every replay also runs FlashMLA's scheduler kernel.
Inputs: random bf16 (never zeros) q [b, s_q, h_q, 576] and cache [blocks, 64, 1, 576] with a
shuffled block table, cache_seqlens = L (int32), head_dim_v 512, causal when s_q > 1.
`rel_err` (`rel_err_with_metadata`): set 0's output as the precomputed (in_graph) graph left it,
against a float64 reference of absorbed MLA (scores over all 576 dims x scale, softmax, P @ V with
V = the first 512 dims of the same cache rows; causal bottom-right aligned, as FlashMLA's: query j
of s_q sees keys 0 .. L - s_q + j); the max over (batch, query, head) rows of ||o - ref|| / ||ref||.

    bash bench/flashmla_build.sh   # builds or unpacks FlashMLA into /tmp/flashmla
    python3 bench/mla_peers.py --shapes 16,1,1,131072 128,1,8,32768 16,8,2,131072 --json out.json

Shapes are "hq,sq,b,L" (every request at L). FLASHMLA_PATH overrides where flash_mla is
imported from. With --merge RESULTS (a `kvstream mla --matrix ... --json RESULTS` file) FlashMLA
runs that file's bf16 rows of pages of 64 (ragged ones with their `lens`; skewed ones not) and its
numbers join them (`results.flashmla`, matched by id; the file rewritten).
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.environ.get("FLASHMLA_PATH", "/tmp/flashmla"))
from flash_mla import flash_mla_with_kvcache, get_mla_metadata  # noqa: E402

POOL_BYTES = 512 << 20
PAGE, D, DV = 64, 576, 512


def make_sets(hq, sq, b, L, sets, gen, lens=None):
    """Per set: q, its own KV cache, a shuffled block table and cache_seqlens (every request at
    L, or at `lens`, one length per request, for a ragged row)."""
    nblk = math.ceil(L / PAGE)
    q = torch.randn(sets, b, sq, hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache = torch.randn(sets, b * nblk, PAGE, 1, D, device="cuda", dtype=torch.bfloat16,
                        generator=gen)
    tables = torch.stack([torch.randperm(b * nblk, device="cuda", generator=gen).view(b, nblk)
                          for _ in range(sets)]).to(torch.int32)
    if lens is None:
        seqlens = torch.full((sets, b), L, device="cuda", dtype=torch.int32)
    else:
        seqlens = torch.tensor([lens] * sets, device="cuda", dtype=torch.int32)
    return q, cache, tables, seqlens


def decode(q, cache, table, seqlens, meta, scale):
    # The metadata object is the 6th positional argument and num_splits the 7th in both the
    # current interface (get_mla_metadata -> (FlashMLASchedMeta, None), filled by the first call)
    # and the older one (get_mla_metadata -> (tile_scheduler_metadata, num_splits) tensors).
    return flash_mla_with_kvcache(q, cache, table, seqlens, DV, meta[0], meta[1],
                                  softmax_scale=scale, causal=q.shape[1] > 1)[0]


def new_meta(seqlens, sq, hq):
    # the older interface needs (cache_seqlens, s_q * heads per KV head, KV heads); the current
    # one ignores its arguments and returns an empty object
    return get_mla_metadata(seqlens, sq * hq, 1)


def reference(q, cache, table, seqlens, scale):
    """float64 absorbed MLA for one set: q [b, sq, hq, 576] -> [b, sq, hq, 512]."""
    b, sq, hq, _ = q.shape
    outs = []
    for i in range(b):
        L = int(seqlens[i])
        kv = cache[table[i].long()].reshape(-1, D)[:L].double()          # [L, 576]
        s = torch.einsum("qhd,kd->qhk", q[i].double(), kv) * scale      # [sq, hq, L]
        if sq > 1:  # query j sees keys 0 .. L - sq + j
            keep = torch.ones(sq, L, dtype=torch.bool, device=q.device).tril(L - sq)
            s.masked_fill_(~keep[:, None, :], float("-inf"))
        outs.append(torch.softmax(s, dim=-1) @ kv[:, :DV])              # [sq, hq, 512]
    return torch.stack(outs)


def time_graph(calls, sets, rounds):
    """Graph of one call per set; returns the per-call times (us) of the rounds, sorted, and
    set 0's output as the graph left it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up kernels and allocator outside capture
        for s in range(sets):
            calls(s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [calls(s) for s in range(sets)]  # each call keeps its own output buffer
    for _ in range(2):
        graph.replay()
    times = []
    for _ in range(max(rounds, 9)):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) * 1e3 / sets)
    del graph
    return sorted(times), outs[0]


def run_shape(hq, sq, b, L, scale, rounds, lens=None, name=None):
    kv_set = b * math.ceil(L / PAGE) * PAGE * D * 2
    sets = min(max(math.ceil(POOL_BYTES / kv_set), 2), 256)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, cache, tables, seqlens = make_sets(hq, sq, b, L, sets, gen, lens)

    # precomputed: one metadata per set, filled (current interface) by a call outside the graph
    metas = [new_meta(seqlens[s], sq, hq) for s in range(sets)]
    for s in range(sets):
        decode(q[s], cache[s], tables[s], seqlens[s], metas[s], scale)
    pre, pre_out = time_graph(
        lambda s: decode(q[s], cache[s], tables[s], seqlens[s], metas[s], scale), sets, rounds)
    # in_graph: a fresh metadata object per captured call, so the scheduler runs on every replay
    ing, ing_out = time_graph(lambda s: decode(q[s], cache[s], tables[s], seqlens[s],
                                               new_meta(seqlens[s], sq, hq), scale), sets, rounds)
    ref = reference(q[0], cache[0], tables[0], seqlens[0], scale)
    rel = [((o.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
           for o in (pre_out, ing_out)]
    tokens = b * L if lens is None else sum(lens)
    io = 2 * (tokens * D + b * sq * hq * (D + DV))  # bytes: the KV rows once, q and out
    med = pre[len(pre) // 2]
    return {
        "id": name or f"mla-h{hq}-q{sq}-b{b}-L{L}-p64", "hq": hq, "s_q": sq, "batch": b, "L": L,
        "lens": lens,
        "us": med, "us_min": pre[0],
        "us_with_metadata": ing[len(ing) // 2], "us_with_metadata_min": ing[0],
        "rel_err": rel[0], "rel_err_with_metadata": rel[1], "sets": sets, "gbps": io / med / 1e3,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=[], metavar="HQ,SQ,B,L")
    ap.add_argument("--merge", metavar="RESULTS",
                    help="a `kvstream mla --json` results file: FlashMLA runs its bf16 rows of "
                         "pages of 64 (uniform or ragged lengths, not skewed) and its result joins "
                         "each row as results.flashmla; the file is rewritten")
    ap.add_argument("--scale", type=float, default=0.0722)
    ap.add_argument("--rounds", type=int, default=15, help="timed replays (at least 9)")
    ap.add_argument("--json", metavar="OUT", help="write {peer, rows} here")
    args = ap.parse_args()
    merged = None
    # (hq, sq, b, L, lens or None, id)
    specs = []
    for spec in args.shapes:
        hq, sq, b, L = map(int, spec.split(","))
        specs.append((hq, sq, b, L, None, f"mla-h{hq}-q{sq}-b{b}-L{L}-p64"))
    if args.merge:
        with open(args.merge) as f:
            merged = json.load(f)
        for row in merged["rows"]:
            if row.get("page") == 64 and row.get("kv_dtype") in ("bf16", "as_query") and not row.get("skew"):
                specs.append((row["hq"], row["q_len"], row["batch"], row["L"], row.get("lens"), row["id"]))
    rows = []
    for hq, sq, b, L, lens, name in specs:
        try:
            r = run_shape(hq, sq, b, L, args.scale, args.rounds, lens, name)
            print(f"PEER flashmla {name}: {r['us']:8.2f} us median ({r['us_min']:.2f} min), "
                  f"{r['gbps']:7.1f} GB/s; metadata in graph {r['us_with_metadata']:8.2f} us; "
                  f"rel_err {r['rel_err']:.2e} / {r['rel_err_with_metadata']:.2e}, "
                  f"{r['sets']} sets", flush=True)
        except Exception as e:  # a shape the peer cannot run is reported, not fatal
            r = {"id": name, "hq": hq, "s_q": sq, "batch": b, "L": L, "lens": lens, "us": None, "us_min": None,
                 "us_with_metadata": None, "rel_err": None, "error": f"{type(e).__name__}: {e}"}
            print(f"PEER flashmla {name}: error {r['error']}", flush=True)
        rows.append(r)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peer": "flashmla", "rows": rows}, f, indent=1)
    if merged is not None:
        by_id = {r["id"]: r for r in rows}
        for row in merged["rows"]:
            r = by_id.get(row["id"])
            if r is None or not (row.get("page") == 64 and row.get("kv_dtype") in ("bf16", "as_query")):
                continue
            peer = {"error": r["error"]} if r.get("error") else {
                "us": r["us"], "GBps": row["io_bytes"] / r["us"] / 1e3, "rel_err": r["rel_err"],
                "us_with_metadata": r["us_with_metadata"]}
            row.setdefault("results", {})["flashmla"] = peer
        with open(args.merge, "w") as f:
            json.dump(merged, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
