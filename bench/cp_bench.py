"""Context-parallel costs measured on one GPU: kvstream.merge_states for n = 2..8 partial states
at batch 1..128, and what one rank of an N-way context-parallel decode runs (its local decode
of 1/N of the cache and the merges) for a 1M-token request at 32/8 d128 and for MLA h_q 16,
next to the whole decode: the speedup N GPUs can reach before the all-gather (one NCCL
collective of the outputs, a few KB a request). Also the whole code path through
torch.distributed (NCCL, one rank) against the plain decode: the cost of the sharding logic.

    python3 bench/cp_bench.py --commit $(git rev-parse --short HEAD)   # bench/results/<gpu>-cp-latest.json

Times: median of --rounds CUDA-graph replays, each of --inner calls (us per call).
"""

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist

import kvstream
import kvstream.distributed as kcp
from kvstream import _ops  # noqa: F401  (registers torch.ops.kvstream)
from store_kv_bench import graph_time  # (bench/ is this script's directory)


def timed(fn, rounds, inner):
    """Median us of one of ``inner`` calls of ``fn`` in a replayed CUDA graph."""
    return graph_time([fn] * inner, rounds)


def merge_costs(rounds):
    rows = []
    for heads, d in ((32, 128), (16, 512)):
        for b in (1, 16, 64, 128):
            for n in (2, 4, 8):
                outs = torch.randn(n, b, heads, d, device="cuda", dtype=torch.bfloat16)
                lses = torch.randn(n, b, heads, device="cuda")
                out = torch.empty(b, heads, d, device="cuda", dtype=torch.bfloat16)
                lse = torch.empty(b, heads, device="cuda")
                us = timed(lambda: torch.ops.kvstream.merge_states_out(outs, lses, out, lse),
                           rounds, 20)
                rows.append(dict(n=n, batch=b, heads=heads, d=d, us=round(us, 2)))
                print(f"merge_states n {n} b {b} h {heads} d {d}: {us:.2f} us", flush=True)
    return rows


def shard_decodes(rounds, length):
    rows = []
    torch.manual_seed(0)
    for kind in ("gqa", "mla"):
        if kind == "gqa":
            q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, length, 8, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
        else:
            q = torch.randn(1, 1, 16, 576, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(1, length, 576, device="cuda", dtype=torch.bfloat16)
        for n in (1, 2, 4, 8):
            chunk = length // n
            if kind == "gqa":
                kc, vc = k[:, :chunk].contiguous(), v[:, :chunk].contiguous()
                local = lambda: kvstream.decode(q, kc, vc, return_lse=True)  # noqa: E731
                width, heads = 128, 32
            else:
                kvc = kv[:, :chunk].contiguous()
                local = lambda: kvstream.mla_decode(  # noqa: E731
                    q, kvc, softmax_scale=192 ** -0.5, return_lse=True)
                width, heads = 512, 16
            t_local = timed(local, rounds, 5)
            outs = torch.randn(n, 1, 1, heads, width, device="cuda", dtype=torch.bfloat16)
            lses = torch.randn(n, 1, 1, heads, device="cuda")
            t_merge = timed(lambda: kvstream.merge_states(outs, lses), rounds, 20) if n > 1 else 0.0
            rows.append(dict(kind=kind, length=length, ranks=n, local_decode_us=round(t_local, 2),
                             merge_us=round(t_merge, 2)))
            print(f"{kind} L {length} x{n}: local decode {t_local:.1f} us, merge {t_merge:.2f} us",
                  flush=True)
            del local
        base = rows[-4]["local_decode_us"]
        for r in rows[-4:]:
            r["speedup_before_exchange"] = round(base / (r["local_decode_us"] + r["merge_us"]), 2)
    return rows


def world_of_one(rounds):
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    rows = []
    torch.manual_seed(1)
    for b, L, q_len in ((16, 32768, 1), (16, 32768, 4), (1, 1 << 20, 1)):
        q = torch.randn(b, q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, L, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), L, device="cuda", dtype=torch.int32)
        t_cp = timed(lambda: kcp.decode(q, k, v, lens), rounds, 3)
        t_plain = timed(lambda: kvstream.decode(q, k, v, cache_seqlens=lens), rounds, 3)
        rows.append(dict(batch=b, length=L, q_len=q_len, cp_world1_us=round(t_cp, 1),
                         plain_us=round(t_plain, 1)))
        print(f"world of one b {b} L {L} q_len {q_len}: kcp.decode {t_cp:.1f} us, "
              f"decode {t_plain:.1f} us", flush=True)
        del k, v
    dist.destroy_process_group()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="results file (default: bench/results/<h200 or h100>-cp-latest.json, "
                                  "the GPU's)")
    ap.add_argument("--commit", default=os.environ.get("KVSTREAM_COMMIT", "unknown"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--length", type=int, default=1 << 20)
    args = ap.parse_args()
    result = dict(
        date=datetime.date.today().isoformat(), commit=args.commit,
        device=torch.cuda.get_device_name(0), method=__doc__.strip().split("\n\n")[-1],
    )
    if args.out is None:
        gpu = "h100" if "H100" in torch.cuda.get_device_name(0) else "h200"
        args.out = f"bench/results/{gpu}-cp-latest.json"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for name, part in (("merge_states", lambda: merge_costs(args.rounds)),
                       ("shard_decode", lambda: shard_decodes(args.rounds, args.length)),
                       ("world_of_one", lambda: world_of_one(args.rounds))):
        result[name] = part()
        with open(args.out, "w") as f:  # after each part: a cut-short run keeps what it has
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
