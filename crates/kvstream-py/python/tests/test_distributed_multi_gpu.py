"""kvstream.distributed on 2 or more GPUs of one host (NCCL); skipped with fewer.

For N = 2, 4 and 8 ranks (as many as there are GPUs): every rank builds the same global cache
from one seed, keeps its shard (chunks, and pages dealt round-robin), and runs the
context-parallel decode; each rank's output must equal the whole decode run on its own GPU
(bf16 tolerance), for one and for four new tokens, ragged lengths with requests some ranks hold
nothing of, sinks, the heads scattered (each rank its slice), and MLA; then a CUDA graph of the
call, captured once, replayed with new lengths, equal to eager calls.
"""

import os
import socket
import sys

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 or more GPUs", allow_module_level=True)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_distributed import shard_cache  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row_err(got, want):
    g, w = got.double(), want.double()
    return ((g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-6)).max().item()


def shard(cache, lens, sharding, unit, rank, world):
    """This rank's shard, NaN in every row it does not hold (test_distributed.shard_cache)."""
    return shard_cache(cache, lens, sharding, unit, rank, world, float("nan"))


def worker(rank, world, port, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    import kvstream
    import kvstream.distributed as kcp

    dev = torch.device("cuda", rank)
    try:
        for sharding, unit in (("chunks", 4096), ("pages", 64)):
            for q_len in (1, 4):
                torch.manual_seed(7)  # the same global cache on every rank
                b, hq, hkv, d = 6, 32, 8, 128
                L = world * unit if sharding == "chunks" else 9000
                lens_list = [L, 0, 1, 4097 % L, L // 2 + 3, unit + 1][:b]
                q = torch.randn(b, q_len, hq, d, device=dev, dtype=torch.bfloat16)
                k = torch.randn(b, L, hkv, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                sinks = torch.randn(hq, device=dev)
                lens = torch.tensor(lens_list, dtype=torch.int32, device=dev)
                want = kvstream.decode(q, k, v, cache_seqlens=lens, sinks=sinks)
                kl, table = shard(k, lens_list, sharding, unit, rank, world)
                vl, _ = shard(v, lens_list, sharding, unit, rank, world)
                got = kcp.decode(q, kl, vl, lens, sharding=sharding, block_table=table,
                                 chunk_len=unit if table is not None and sharding == "chunks"
                                 else None, sinks=sinks)
                err = row_err(got, want)
                if not err < 2e-2:
                    errors.append(f"rank {rank}/{world} {sharding} q_len {q_len}: {err:.3e}")
                # this rank's heads only, by one all-to-all
                mine = kcp.decode(q, kl, vl, lens, sharding=sharding, block_table=table,
                                  chunk_len=unit if table is not None and sharding == "chunks"
                                  else None, sinks=sinks, scatter_heads=True)
                per = hq // world
                err = row_err(mine, want[..., rank * per:(rank + 1) * per, :])
                if not err < 2e-2:
                    errors.append(f"rank {rank}/{world} {sharding} q_len {q_len} heads: {err:.3e}")
        # MLA, pages of 64, 2 new tokens
        torch.manual_seed(8)
        kv = torch.randn(3, 5000, 576, device=dev, dtype=torch.bfloat16)
        qm = torch.randn(3, 2, 16, 576, device=dev, dtype=torch.bfloat16)
        lens_list = [5000, 65, 0]
        lens = torch.tensor(lens_list, dtype=torch.int32, device=dev)
        want = kvstream.mla_decode(qm, kv, softmax_scale=0.07, cache_seqlens=lens)
        pool, table = shard(kv, lens_list, "pages", 64, rank, world)
        got = kcp.mla_decode(qm, pool, lens, softmax_scale=0.07, sharding="pages",
                             block_table=table)
        err = row_err(got, want)
        if not err < 2e-2:
            errors.append(f"rank {rank}/{world} MLA: {err:.3e}")
        # one graph, new lengths at each replay
        torch.manual_seed(9)
        b, L = 4, world * 2048
        q = torch.randn(b, 1, 32, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, L, 8, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kl, _ = shard(k, [L] * b, "chunks", 2048, rank, world)
        vl, _ = shard(v, [L] * b, "chunks", 2048, rank, world)
        lens = torch.full((b,), L, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        kcp.decode(q, kl, vl, lens, out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            kcp.decode(q, kl, vl, lens, out=out)
        for seed in range(3):
            new = torch.randint(0, L + 1, (b,), generator=torch.Generator().manual_seed(seed),
                                dtype=torch.int32)
            lens.copy_(new.to(dev))
            g.replay()
            want = kvstream.decode(q, k, v, cache_seqlens=lens)
            err = row_err(out, want)
            if not err < 2e-2:
                errors.append(f"rank {rank}/{world} graph replay {seed}: {err:.3e}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_equal_the_whole_decode(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    with mp.Manager() as manager:
        errors = manager.list()
        mp.spawn(worker, args=(world, free_port(), errors), nprocs=world, join=True)
        assert not list(errors), list(errors)
