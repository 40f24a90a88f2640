"""Times kvstream next to FlashAttention-3 on the serving rows that FA3 can run on the same data.

* ``skew``: 32/8 heads, d 128, bf16, a paged cache (pages of 64 positions, shuffled) holding one
  request of 1,048,576 positions and fifteen of 2,048. kvstream runs with default options
  (nothing set but the inputs); FA3 gets the same pool, ``page_table`` and
  ``cache_seqlens`` (its own scheduler, ``num_splits=0``). The long request moves between the
  two calls of every replay, so one captured graph sees two different length vectors.
  With ``--fa3-contiguous`` (FA3 wheels built without paged KV), FA3 instead gets the same data
  gathered into a contiguous ``[16, 2^20, 8, 128]`` cache (68 GB for K and V) with the same
  ``cache_seqlens``; both libraries then run one pool set.
* ``ragged``: the ragged rows of bench/serving.json (per-request lengths from the file, rotated
  by one request per pool set as ``kvstream bench`` does), contiguous, or paged with FA3 on a
  contiguous copy under ``--fa3-contiguous``; both libraries get ``cache_seqlens``.
* ``mtp``: multi-token decode, 32/8 d128 L 32768 batch 8, q_len 1, 2, 4, 8 (causal among the new
  tokens in both libraries).

Method as bench/compare.py (docs/benchmarking.md): CUDA graphs of every call over the pool's sets,
warm-up, rounds in alternating order, median per call. Outputs of the two libraries are
compared to each other (relative error of the whole output) next to every timing.
Writes a JSON file in the results format (``--json``); the byte floor of each row comes from
``kvstream bench --matrix bench/serving.json`` (same bytes), joined by id when given
``--floors``.

    python3 bench/serving_peers.py --json bench/results/serving-peers-latest.json \
        --floors bench/results/kvstream-serving-latest.json
"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402  (timer, graph capture and results helpers shared with compare.py)

HQ, HKV, D = 32, 8, 128


def paged_pool(torch, lens, capacity, page=64, seed=7, contiguous=False):
    """Pool pages, per-set tables and lengths (`lens[s]`: set s's lengths, the same total in
    every set). `contiguous`: also the same data gathered per request into
    [sets, batch, capacity, hkv, d]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets, batch = len(lens), len(lens[0])
    pages = sum(-(-n // page) for n in lens[0])
    max_pages = -(-capacity // page)
    k = torch.randn(sets, pages, page, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sets, pages, page, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(sets, batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.zeros(sets, batch, max_pages, device="cuda", dtype=torch.int32)
    for s in range(sets):
        order = torch.randperm(pages, device="cuda", generator=g).to(torch.int32)
        at = 0
        for b, n in enumerate(lens[s]):
            used = -(-n // page)
            tables[s, b, :used] = order[at:at + used]
            at += used
    seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    io = 2 * batch * HQ * D * 2 + 2 * sum(lens[0]) * HKV * D * 2
    pool = dict(q=q, k=k, v=v, table=tables, seqlens=seqlens, io=io, lens=lens)
    if contiguous:
        shape = (sets, batch, capacity, HKV, D)
        pool["k_contig"] = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        pool["v_contig"] = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        for s in range(sets):
            for b, n in enumerate(lens[s]):
                used = -(-n // page)
                pages = tables[s, b, :used].long()
                for src, dst in ((k, "k_contig"), (v, "v_contig")):
                    rows = src[s].index_select(0, pages).reshape(used * page, HKV, D)
                    pool[dst][s, b, :n] = rows[:n]
    return pool


def skew_pool(torch, sets, long_len=1 << 20, short_len=2048, batch=16, contiguous=False):
    """Request s % batch is the long one in set s."""
    lens = [[long_len if b == s % batch else short_len for b in range(batch)] for s in range(sets)]
    return paged_pool(torch, lens, long_len, contiguous=contiguous)


def rotated(lens, sets):
    """A ragged row's lengths in set s: rotated by s requests (kvstream bench does the same)."""
    return [[lens[(b + s) % len(lens)] for b in range(len(lens))] for s in range(sets)]


def ragged_pool(torch, row, sets, seed=13, contiguous=False):
    """A ragged row of bench/serving.json: paged (its page_size) or contiguous [b, L, hkv, d]."""
    lens = rotated(row["lens"], sets)
    if row.get("page_size"):
        return paged_pool(torch, lens, row["L"], page=row["page_size"], seed=seed,
                          contiguous=contiguous)
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, cap = row["batch"], row["L"]
    k = torch.randn(sets, batch, cap, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sets, batch, cap, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(sets, batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    io = 2 * batch * HQ * D * 2 + 2 * sum(lens[0]) * HKV * D * 2
    return dict(q=q, k=k, v=v, table=None, seqlens=seqlens, io=io, lens=lens)


def mtp_pool(torch, sets, q_len, batch=8, length=32768, seed=11):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(sets, batch, length, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sets, batch, length, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(sets, batch, q_len, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    seqlens = torch.full((sets, batch), length, device="cuda", dtype=torch.int32)
    io = 2 * batch * q_len * HQ * D * 2 + 2 * batch * length * HKV * D * 2
    return dict(q=q, k=k, v=v, table=None, seqlens=seqlens, io=io)


def calls(kvstream, fa3, pool):
    import torch

    out = torch.empty_like(pool["q"])
    table = pool["table"]

    def kv(s):
        # default options: nothing set but the inputs
        return kvstream.decode(pool["q"][s], pool["k"][s], pool["v"][s],
                               cache_seqlens=pool["seqlens"][s],
                               block_table=None if table is None else table[s], out=out[s])

    contiguous = "k_contig" in pool

    def fa(s):
        if contiguous:
            return fa3(pool["q"][s], pool["k_contig"][s], pool["v_contig"][s],
                       cache_seqlens=pool["seqlens"][s], causal=True, num_splits=0)
        return fa3(pool["q"][s], pool["k"][s], pool["v"][s], cache_seqlens=pool["seqlens"][s],
                   page_table=None if table is None else table[s], causal=True, num_splits=0)

    return {"kvstream": kv, "fa3": fa}


def measure(row, pool, handles, rounds):
    import torch

    sets = pool["q"].shape[0]
    graphs, outs, results = {}, {}, {}
    for name, call in calls(*handles, pool).items():
        try:
            graph, o = compare.capture(call, sets)
            graphs[name] = (graph, sets)
            outs[name] = o
        except Exception as e:  # a peer that cannot run the row is reported, not fatal
            results[name] = {"error": compare.short_error(e)}
    if graphs:
        times = compare.time_graphs(graphs, rounds)
        for name, t in times.items():
            t = sorted(t)
            med = t[len(t) // 2]
            results[name] = {"us": med, "min_us": t[0], "gbps": pool["io"] / med / 1e3}
    if "kvstream" in outs and "fa3" in outs:
        a = torch.stack([x.float() for x in outs["kvstream"]])
        b = torch.stack([x.float() for x in outs["fa3"]]).reshape(a.shape)
        err = ((a - b).norm() / b.norm()).item()
        results["kvstream"]["rel_err_vs_fa3"] = err
        if not err < 2e-2:
            results["kvstream"]["error"] = f"differs from FA3: rel err {err:.3e}"
    row["results"] = results
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench/results/serving-peers-latest.json")
    ap.add_argument("--floors", help="kvstream bench results of bench/serving.json (floor_us)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--commit", default=os.environ.get("KVSTREAM_COMMIT", "unknown"))
    ap.add_argument("--fa3-contiguous", action="store_true",
                    help="give FA3 the skewed batch as a contiguous cache (one pool set)")
    args = ap.parse_args()
    import torch
    import kvstream
    from fa3_fwd_interface import flash_attn_with_kvcache as fa3

    floors = {}
    if args.floors and os.path.exists(args.floors):
        floors = {r["id"]: r.get("floor_us") for r in json.load(open(args.floors))["rows"]}
    rows = []
    specs = [("skew-b16-L2048-long1048576-p64", dict(batch=16, q_len=1, L=2048, long_len=1 << 20,
                                                      page_size=64),
              lambda: skew_pool(torch, 1 if args.fa3_contiguous else 2,
                                contiguous=args.fa3_contiguous))]
    serving = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "serving.json")))
    for r in serving["shapes"]:
        if r.get("group") != "ragged":
            continue
        # a paged row's FA3 reads a contiguous copy with --fa3-contiguous (one pool set)
        one = bool(r.get("page_size")) and args.fa3_contiguous
        shape = {k: r[k] for k in ("batch", "q_len", "L") if k in r}
        if r.get("page_size"):
            shape["page_size"] = r["page_size"]
        specs.append((r["id"], shape,
                      lambda r=r, one=one: ragged_pool(torch, r, 1 if one else 2, contiguous=one)))
    for q_len in (1, 2, 4, 8):
        specs.append((f"mtp-q{q_len}-b8-L32768", dict(batch=8, q_len=q_len, L=32768),
                      lambda q_len=q_len: mtp_pool(torch, 2, q_len)))
    for rid, shape, make in specs:
        pool = make()
        row = dict(id=rid, hq=HQ, hkv=HKV, d=D, dtype="bf16", io_bytes=pool["io"], **shape)
        row["floor_us"] = floors.get(rid)
        measure(row, pool, (kvstream, fa3), args.rounds)
        res = row["results"]
        k, f = res.get("kvstream", {}).get("us"), res.get("fa3", {}).get("us")
        line = f"{rid:34s} kvstream {k if k is None else round(k, 2)} us, fa3 {f if f is None else round(f, 2)} us"
        if k and f:
            line += f", speedup {f / k:.2f}x"
        if k and row["floor_us"]:
            line += f", kvstream / floor {k / row['floor_us']:.3f}"
        print(line, {n: r.get("error") for n, r in res.items() if r.get("error")} or "", flush=True)
        rows.append(row)
        del pool
        torch.cuda.empty_cache()
    doc = {"date": datetime.date.today().isoformat(), "commit": args.commit,
           "gpu": torch.cuda.get_device_name(), "rows": rows}
    compare.write_json(args.json, doc)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
