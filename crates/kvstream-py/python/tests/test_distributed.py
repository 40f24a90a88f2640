"""CPU tests of kvstream.distributed (context-parallel decode) and of merge_states' math.

kvstream.decode and kvstream.merge_states are replaced by float64 torch implementations of their
documented semantics (test_compat's decode), so these tests check the sharding logic itself:
every rank's share of every request (chunks and round-robin pages, ragged lengths, ranks that
hold nothing, multi-token decode with the new tokens' mask across shard boundaries), the local
decodes and masks, and the merges, against the whole decode; then the real code path through
torch.distributed (gloo on the CPU: one rank, and 2-4 spawned ranks with the all-gather and with
the heads scattered). test_distributed_gpu.py runs the kernels.
"""

import random

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import kvstream  # noqa: E402
from kvstream import distributed as kcp  # noqa: E402

from test_compat import _kvstream_decode_on_torch  # noqa: E402


def merge_on_torch(outputs, lses, *, sinks=None, out=None, return_lse=True):
    """kvstream.merge_states' documented semantics in float64."""
    lse64 = lses.double()
    m = lse64.amax(dim=0)
    live = ~torch.isneginf(m)
    w = torch.where(torch.isneginf(lse64), torch.zeros_like(lse64),
                    torch.exp(lse64 - torch.where(live, m, torch.zeros_like(m))))
    total = w.sum(dim=0)
    o = torch.where(torch.isneginf(lse64)[..., None], torch.zeros_like(outputs.double()),
                    outputs.double())
    merged = (w[..., None] * o).sum(dim=0) / torch.where(live, total, torch.ones_like(total))[..., None]
    lse = torch.where(live, m + torch.log(total), m)
    if sinks is not None:
        s = sinks.double().expand_as(lse)
        joined = torch.logaddexp(lse, s)
        merged = merged * torch.exp(lse - joined)[..., None]
        lse = joined
    merged = merged.to(outputs.dtype)
    if out is not None:
        out.copy_(merged)
        merged = out
    return (merged, lse.float()) if return_lse else merged


@pytest.fixture
def on_torch(monkeypatch):
    monkeypatch.setattr(kvstream, "decode", _kvstream_decode_on_torch([]))
    monkeypatch.setattr(kvstream, "merge_states", merge_on_torch)


def held_positions(sharding, unit, rank, world, n):
    return [g for g in range(n)
            if (g // unit == rank if sharding == "chunks" else (g // unit) % world == rank)]


def shard_cache(cache, lens, sharding, unit, rank, world, fill=1e3, table=None):
    """This rank's shard of a [b, L, ...] cache: a contiguous [b, C, ...] chunk cache, or a pool
    with a block table listing the rank's pages (made here, reversed, or the one given: K's for
    V). Rows the rank does not hold are ``fill``: 1e3 for the float64 decode here (it masks
    scores, not values: NaN would poison it; a read of these would show), NaN for the kernels
    (a read would reach the output)."""
    b, L = cache.shape[:2]
    rest, dev = cache.shape[2:], cache.device
    if sharding == "chunks":
        local = torch.full((b, unit, *rest), fill, dtype=cache.dtype, device=dev)
        for r in range(b):
            pos = torch.tensor(held_positions(sharding, unit, rank, world, lens[r]),
                               dtype=torch.long, device=dev)
            local[r, :len(pos)] = cache[r, pos]
        return local, None
    pages = -(-L // unit) // world + 1
    pool = torch.full((b * pages, unit, *rest), fill, dtype=cache.dtype, device=dev)
    if table is None:
        table = torch.arange(b * pages, dtype=torch.int32, device=dev).reshape(b, pages)
        table = table.flip(1).contiguous()
    for r in range(b):
        pos = torch.tensor(held_positions(sharding, unit, rank, world, lens[r]),
                           dtype=torch.long, device=dev)
        local = torch.arange(len(pos), device=dev)
        pool[table[r].long()[local // unit], local % unit] = cache[r, pos]
    return pool, table


CASES = [
    # (sharding, unit, world, q_len, lens)
    ("chunks", 24, 2, 1, [40, 0, 7, 48]),
    ("pages", 4, 4, 1, [33, 1, 0, 16]),
    ("chunks", 11, 3, 3, [33, 12, 22, 2, 23, 10]),
    ("pages", 3, 2, 4, [30, 13, 14, 15, 3, 0]),
    ("pages", 8, 3, 4, [47, 24, 25, 9, 1]),
    ("chunks", 64, 1, 2, [19, 2]),
    ("pages", 7, 4, 8, [57, 29, 8, 5, 56, 55]),
    ("pages", 5, 1, 6, [23, 4, 0]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_shards_merge_into_the_whole_decode(case, on_torch):
    sharding, unit, world, q_len, lens = CASES[case]
    gen = torch.Generator().manual_seed(case)
    b, hq, hkv, d = len(lens), 8, 2, 16
    L = world * unit if sharding == "chunks" else max(lens) + 1
    q = torch.randn(b, q_len, hq, d, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(b, L, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, L, hkv, d, generator=gen, dtype=torch.float64)
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64).float()
    seqlens = torch.tensor(lens, dtype=torch.int32)
    mods = dict(softmax_scale=0.3, softcap=5.0)
    o, l_ = kvstream.decode(q, k, v, cache_seqlens=seqlens, return_lse=True, **mods)
    want, want_lse = merge_on_torch(o.unsqueeze(0), l_.unsqueeze(0), sinks=sinks)
    outs, lses = [], []
    for rank in range(world):
        kl, table = shard_cache(k, lens, sharding, unit, rank, world)
        vl, _ = shard_cache(v, lens, sharding, unit, rank, world)
        share = kcp._Share(seqlens, rank, world, sharding, unit, q_len)
        held = [len(held_positions(sharding, unit, rank, world, n)) for n in lens]
        assert share.held.tolist() == held
        assert kcp.local_lengths(seqlens, rank, world, sharding=sharding, unit=unit).tolist() == held
        o_r, l_r = kcp._gqa_states(q, kl, vl, share, q_len, dict(block_table=table, **mods))
        assert o_r.shape[0] == q_len
        local, local_lse = merge_on_torch(o_r, l_r)
        outs.append(local)
        lses.append(local_lse)
    got, got_lse = merge_on_torch(torch.stack(outs), torch.stack(lses), sinks=sinks)
    # (the decode here returns float32 LSEs: the weights carry their rounding)
    assert torch.allclose(got, want, rtol=0, atol=2e-6), (got - want).abs().max()
    assert torch.allclose(got_lse, want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_token_sees_its_own_prefix(case):
    # what the MLA path decodes per new token: the held positions up to len - q_len + i
    sharding, unit, world, q_len, lens = CASES[case]
    seqlens = torch.tensor(lens, dtype=torch.int32)
    for rank in range(world):
        share = kcp._Share(seqlens, rank, world, sharding, unit, q_len)
        for i in range(q_len):
            want = [sum(1 for g in held_positions(sharding, unit, rank, world, n)
                        if g <= n - q_len + i) for n in lens]
            assert share.visible(i, q_len).tolist() == want, (rank, i)


def test_random_shares_follow_the_rule_and_rust_agrees():
    # the rule as kvstream.distributed runs it (torch, on the device) against the positions and
    # against the Rust library's closed form (kvstream::context, through the binding)
    from kvstream import _native

    rng = random.Random(7)
    for _ in range(300):
        world = rng.randint(1, 8)
        q_len = rng.randint(1, 8)
        sharding = rng.choice(kcp.SHARDINGS)
        unit = rng.randint(max(1, q_len - 1), 20)
        if sharding == "chunks":
            lens = [rng.randint(0, world * unit) for _ in range(6)]
        else:
            lens = [rng.randint(0, 200) for _ in range(6)]
        seqlens = torch.tensor(lens, dtype=torch.int32)
        rank = rng.randrange(world)
        share = kcp._Share(seqlens, rank, world, sharding, unit, q_len)
        for i in range(q_len):
            want = [sum(1 for g in held_positions(sharding, unit, rank, world, n)
                        if g <= n - q_len + i) for n in lens]
            assert share.visible(i, q_len).tolist() == want
        rust = _native.rank_shares(lens, rank, world, sharding, unit, q_len)
        ours = [(h, a, r if t else -1, f if t else 0)
                for h, a, t, r, f in zip(share.held.tolist(), share.all_len.tolist(),
                                         share.has_tail.tolist(), share.right.tolist(),
                                         share.first_row.tolist())]
        assert ours == [x[:4] for x in rust], (sharding, unit, rank, world, q_len, lens)


@pytest.fixture
def world_of_one():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("q_len", [1, 3])
def test_world_of_one_runs_the_real_code_path(q_len, on_torch, world_of_one):
    gen = torch.Generator().manual_seed(3)
    b, L, hq, hkv, d = 3, 40, 4, 2, 16
    q = torch.randn(b, q_len, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, L, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, L, hkv, d, generator=gen, dtype=torch.float64)
    lens = torch.tensor([40, 0, 17], dtype=torch.int32)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = kcp.decode(q, k, v, lens, sinks=sinks, return_lse=True)
    o, l_ = kvstream.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    want, want_lse = merge_on_torch(o.unsqueeze(0), l_.unsqueeze(0), sinks=sinks)
    assert torch.allclose(out, want, rtol=0, atol=2e-6)
    assert torch.allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    given = torch.empty_like(want)
    assert kcp.decode(q, k, v, lens, out=given) is given


def test_errors_name_the_argument(on_torch, world_of_one):
    q = torch.zeros(2, 4, 4, 16, dtype=torch.float64)
    k = torch.zeros(2, 32, 2, 16, dtype=torch.float64)
    pool = torch.zeros(16, 2, 2, 16, dtype=torch.float64)
    lens = torch.tensor([5, 6], dtype=torch.int32)
    table = torch.zeros(2, 8, dtype=torch.int32)
    cases = [
        ("sharding is 'rows', allowed: 'chunks', 'pages'",
         lambda: kcp.decode(q, k, k, lens, sharding="rows")),
        ("sharding='pages' needs a block_table",
         lambda: kcp.decode(q, k, k, lens, sharding="pages")),
        ("chunk_len is 8 with sharding='pages'",
         lambda: kcp.decode(q, pool, pool, lens, sharding="pages", block_table=table,
                            chunk_len=8)),
        ("with a block_table needs chunk_len",
         lambda: kcp.decode(q, pool, pool, lens, block_table=table)),
        ("chunk_len is 0, allowed: a positive int",
         lambda: kcp.decode(q, k, k, lens, chunk_len=0)),
        ("q must have 3 or 4 dimensions",
         lambda: kcp.decode(q[0, 0], k, k, lens)),
        ("rank is 3, allowed: 0..1",
         lambda: kcp.local_lengths(lens, 3, 2, unit=4)),
    ]
    for text, call in cases:
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            call()


def test_pages_shorter_than_the_new_tokens_are_refused(monkeypatch, on_torch):
    monkeypatch.setattr(kcp, "_group_rank_world", lambda group: (0, 2))
    q = torch.zeros(2, 4, 4, 16, dtype=torch.float64)
    pool = torch.zeros(16, 2, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="pages of 2 positions with q_len 4, allowed: pages of "
                                         "at least q_len - 1 = 3"):
        kcp.decode(q, pool, pool, torch.tensor([5, 6], dtype=torch.int32), sharding="pages",
                   block_table=torch.zeros(2, 8, dtype=torch.int32))


def test_needs_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        kcp.decode(torch.zeros(1, 4, 16), torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 16),
                   torch.tensor([3], dtype=torch.int32))


def _cpu_rank(rank, world, port, sharding, unit, q_len, scatter, results):
    """One rank of a gloo group on the CPU: the real kvstream.distributed code path (all-gather
    or all-to-all, the merges) with the float64 torch decode and merge standing in for the
    kernels."""
    import os

    import torch.distributed as dist_

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist_.init_process_group("gloo", rank=rank, world_size=world)
    try:
        kvstream.decode = _kvstream_decode_on_torch([])
        kvstream.merge_states = merge_on_torch
        gen = torch.Generator().manual_seed(11)  # the same global cache on every rank
        lens = [world * unit if sharding == "chunks" else 61, 0, 1, unit + 1, 2 * unit - 1]
        b, hq, hkv, d = len(lens), 8, 2, 16
        L = world * unit if sharding == "chunks" else max(lens) + 1
        q = torch.randn(b, q_len, hq, d, generator=gen, dtype=torch.float64)
        k = torch.randn(b, L, hkv, d, generator=gen, dtype=torch.float64)
        v = torch.randn(b, L, hkv, d, generator=gen, dtype=torch.float64)
        sinks = torch.randn(hq, generator=gen, dtype=torch.float64).float()
        seqlens = torch.tensor(lens, dtype=torch.int32)
        o, l_ = kvstream.decode(q, k, v, cache_seqlens=seqlens, return_lse=True)
        want, want_lse = merge_on_torch(o.unsqueeze(0), l_.unsqueeze(0), sinks=sinks)
        kl, table = shard_cache(k, lens, sharding, unit, rank, world)
        vl, _ = shard_cache(v, lens, sharding, unit, rank, world)
        got, lse = kcp.decode(q, kl, vl, seqlens, sharding=sharding, block_table=table,
                              chunk_len=unit if table is not None and sharding == "chunks"
                              else None, sinks=sinks, return_lse=True, scatter_heads=scatter)
        if scatter:
            per = hq // world
            want = want[..., rank * per:(rank + 1) * per, :]
            want_lse = want_lse[..., rank * per:(rank + 1) * per]
        results[rank] = (float((got - want).abs().max()), float((lse - want_lse).abs().max()),
                         tuple(got.shape) == tuple(want.shape))
    finally:
        dist_.destroy_process_group()


@pytest.mark.parametrize("sharding,unit,world,q_len,scatter", [
    ("chunks", 16, 2, 1, False),
    ("pages", 4, 4, 3, False),
    ("pages", 8, 2, 4, True),
    ("chunks", 12, 4, 2, True),
])
def test_ranks_on_the_cpu_equal_the_whole_decode(sharding, unit, world, q_len, scatter,
                                                 monkeypatch):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_cpu_rank, args=(world, port, sharding, unit, q_len, scatter, results),
                 nprocs=world, join=True)
        got = dict(results)
    assert sorted(got) == list(range(world))
    for rank, (err, lse_err, same_shape) in got.items():
        assert same_shape, rank
        assert err < 2e-6 and lse_err < 1e-5, (rank, err, lse_err)


def test_scatter_heads_needs_heads_divisible_by_ranks(monkeypatch, on_torch):
    monkeypatch.setattr(kcp, "_group_rank_world", lambda group: (0, 3))
    q = torch.zeros(2, 1, 4, 16, dtype=torch.float64)
    k = torch.zeros(2, 8, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="scatter_heads with 4 query heads over 3 ranks"):
        kcp.decode(q, k, k, torch.tensor([5, 6], dtype=torch.int32), scatter_heads=True)
    with pytest.raises(TypeError, match="scatter_heads must be a bool"):
        kcp.decode(q, k, k, torch.tensor([5, 6], dtype=torch.int32), scatter_heads=1)
