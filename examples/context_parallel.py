"""Context-parallel decode over the GPUs of one node, with kvstream.distributed.

    torchrun --nproc-per-node 4 examples/context_parallel.py --len 1048576
    torchrun --nproc-per-node 2 examples/context_parallel.py --batch 16 --ragged --sharding pages
    torchrun --nproc-per-node 4 examples/context_parallel.py --mla --hq 16 --len 1048576

Every rank fills its own shard of the cache (chunks of positions, or pages dealt round-robin;
the whole cache never exists on one GPU) and runs the context-parallel decode: its local decode
with the LSE, one all-gather, the merge. Rank 0 reports the median time of a CUDA-graph replay
(--rounds) of the whole call and of the local decode alone: their difference is what the
exchange and the merges cost. Run it with --nproc-per-node 1 for the one-GPU baseline.
(Correctness is the test suite's: tests/test_distributed*.py.)
"""

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

import kvstream
import kvstream.distributed as kcp


def timed(fn, rounds):
    """Median time (us) of a CUDA-graph replay of fn."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(rounds):
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--len", type=int, default=1 << 20, help="positions per request")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-len", type=int, default=1)
    ap.add_argument("--sharding", choices=kcp.SHARDINGS, default="chunks")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--ragged", action="store_true", help="random lengths up to --len")
    ap.add_argument("--mla", action="store_true", help="MLA decode (576-wide latent rows)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", help="append rank 0's numbers to this file as one JSON line")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    b, L, s = args.batch, args.len, args.q_len
    width = 576 if args.mla else args.head_dim
    heads = 1 if args.mla else args.hkv
    lens = (torch.randint(1, L + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
            if args.ragged else torch.full((b,), L, device=dev, dtype=torch.int32))
    q = torch.randn(b, s, args.hq, width, device=dev, generator=gen, dtype=torch.bfloat16)
    unit = -(-L // world) if args.sharding == "chunks" else args.page_size

    # this rank's shard, made directly (the whole cache never exists on a rank)
    def shard(seed):
        g = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)
        if args.sharding == "chunks":
            return torch.randn(b, unit, heads, width, device=dev, generator=g,
                               dtype=torch.bfloat16), None
        pages = -(-L // unit) // world + 1
        pool = torch.randn(b * pages, unit, heads, width, device=dev, generator=g,
                           dtype=torch.bfloat16)
        table = torch.arange(b * pages, device=dev, dtype=torch.int32).view(b, pages)
        return pool, table

    k, table = shard(1)
    v = None if args.mla else shard(2)[0]  # MLA reads its one latent cache as K and as V
    extra = dict(sharding=args.sharding, block_table=table,
                 chunk_len=unit if args.sharding == "chunks" and table is not None else None)
    if args.mla:
        kv = k.squeeze(2)
        run = lambda: kcp.mla_decode(q, kv, lens, softmax_scale=192 ** -0.5, **extra)  # noqa: E731
        local = lambda: kvstream.mla_decode(  # noqa: E731
            q, kv, softmax_scale=192 ** -0.5, block_table=table,
            cache_seqlens=kcp.local_lengths(lens, rank, world, sharding=args.sharding, unit=unit))
    else:
        run = lambda: kcp.decode(q, k, v, lens, **extra)  # noqa: E731
        local = lambda: kvstream.decode(  # noqa: E731
            q, k, v, block_table=table,
            cache_seqlens=kcp.local_lengths(lens, rank, world, sharding=args.sharding, unit=unit))
    t_cp = timed(run, args.rounds)
    t_local = timed(local, args.rounds)
    if rank == 0:
        kind = f"MLA h{args.hq}" if args.mla else f"{args.hq}/{args.hkv} d{args.head_dim}"
        print(f"{kind} b{b} L{L} q_len {s} {args.sharding} x{world}: context-parallel "
              f"{t_cp:.1f} us, local decode alone {t_local:.1f} us, exchange and merge "
              f"{t_cp - t_local:.1f} us")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(
                    kind="mla" if args.mla else "gqa", hq=args.hq, hkv=heads,
                    head_dim=width, batch=b, length=L, ragged=args.ragged, q_len=s,
                    sharding=args.sharding, ranks=world, cp_us=round(t_cp, 1),
                    local_us=round(t_local, 1), device=torch.cuda.get_device_name())) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
