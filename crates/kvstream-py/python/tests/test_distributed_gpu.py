"""GPU tests of kvstream.merge_states and kvstream.distributed (H100 / H200); skipped unless
torch sees a CUDA device.

merge_states against the float64 torch model of test_distributed.py (shards with no key for a
row holding NaN, sinks, an all-gathered buffer with padding), bitwise twice and under a CUDA
graph; a context-parallel decode simulated on one GPU (each rank's shard a separate cache with
NaN in every position it does not hold, the real kernels for every rank's local decodes, the
merges) against the whole decode, for chunks and pages, ragged lengths and multi-token decode,
GQA and MLA; and the real code path through torch.distributed (NCCL, world size 1), eager and
captured in a CUDA graph replayed with new lengths. If KVSTREAM_PY_CP_SUMMARY names a file, a
JSON summary is written there.
"""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_distributed import merge_on_torch, shard_cache  # noqa: E402

import kvstream  # noqa: E402
from kvstream import distributed as kcp  # noqa: E402

SUMMARY = {"checks": {}}


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    path = os.environ.get("KVSTREAM_PY_CP_SUMMARY")
    if path:
        SUMMARY["device"] = torch.cuda.get_device_name(0)
        with open(path, "w") as f:
            json.dump(SUMMARY, f, indent=1)


def note(name, **values):
    SUMMARY["checks"][name] = values


def row_err(got, want):
    """Largest relative error of one row (the last dimension)."""
    g, w = got.double(), want.double()
    return ((g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-6)).max().item()


def lse_err(got, want):
    """Largest LSE difference; a row that sees no key is -inf in both (never NaN)."""
    empty = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), empty), "rows without keys differ"
    assert not torch.isnan(got).any()
    return (got - want)[~empty].abs().max().item() if (~empty).any() else 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,d,n", [((4, 1, 32), 128, 4), ((16, 8), 64, 2), ((3, 2, 16), 512, 8),
                                      ((128, 32), 128, 3), ((1, 1), 8, 1)])
def test_merge_states_matches_model(dtype, rows, d, n):
    gen = torch.Generator(device="cuda").manual_seed(n * d)
    outputs = torch.randn(n, *rows, d, device="cuda", dtype=dtype, generator=gen)
    lses = torch.randn(n, *rows, device="cuda", generator=gen) * 4
    empty = torch.rand(n, *rows, device="cuda", generator=gen) < 0.25
    empty[:, 0] = True  # a row no shard has a key for
    lses = lses.masked_fill(empty, float("-inf"))
    outputs = outputs.masked_fill(empty[..., None], float("nan"))
    sinks = torch.randn(rows[-1], device="cuda", generator=gen)
    for s in (None, sinks):
        out, lse = kvstream.merge_states(outputs, lses, sinks=s)
        want, want_lse = merge_on_torch(outputs, lses, sinks=s)
        assert not torch.isnan(out).any()
        assert row_err(out, want) < 1e-2
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)  # -inf == -inf
        again, again_lse = kvstream.merge_states(outputs, lses, sinks=s)
        assert torch.equal(out.view(torch.int16), again.view(torch.int16))
        assert torch.equal(lse.view(torch.int32), again_lse.view(torch.int32))
    note(f"merge_states {str(dtype)[6:]} rows {rows} d {d} n {n}", ok=True)


def test_merge_states_padded_gather_and_graph():
    n, b, h, d = 4, 8, 16, 128
    flat = torch.randn(n, b * h * d + 64, device="cuda", dtype=torch.bfloat16)
    outputs = flat[:, : b * h * d].view(n, b, h, d)
    lses = torch.randn(n, b, h, device="cuda")
    out = torch.empty(b, h, d, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(b, h, device="cuda")
    kvstream.merge_states(outputs, lses, out=out)   # warm-up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kvstream.merge_states(outputs, lses, out=out)
    for seed in range(3):
        torch.manual_seed(seed)
        outputs.copy_(torch.randn_like(outputs))
        lses.copy_(torch.randn_like(lses).masked_fill(torch.rand_like(lses) < 0.3, float("-inf")))
        out.fill_(float("nan"))
        g.replay()
        want, _ = merge_on_torch(outputs, lses)
        assert row_err(out, want) < 1e-2
    note("merge_states graph replay", ok=True)


def shard_gpu(cache, lens, sharding, unit, rank, world, table=None):
    """This rank's shard, NaN in every row it does not hold (test_distributed.shard_cache)."""
    return shard_cache(cache, lens, sharding, unit, rank, world, float("nan"), table)


GPU_CASES = [
    # (sharding, unit, world, q_len, lens): lengths whose new tokens straddle a chunk or page
    # boundary, ranks that hold nothing, zero lengths
    ("chunks", 384, 2, 1, [640, 0, 112, 768]),
    ("pages", 4, 4, 1, [528, 16, 0, 256]),
    ("chunks", 176, 3, 3, [528, 177, 353, 32, 368, 175]),
    ("pages", 4, 2, 4, [480, 209, 210, 211, 3, 0]),
    ("pages", 8, 3, 4, [752, 385, 386, 137, 1]),
    ("chunks", 1024, 1, 2, [304, 2]),
    ("pages", 8, 4, 8, [912, 465, 129, 5, 900, 899]),
    ("pages", 16, 1, 6, [368, 65, 0]),
    ("chunks", 4096, 4, 4, [16384, 9000, 4098, 4095, 1, 0]),
    ("pages", 64, 8, 8, [20000, 640, 1000, 63, 65]),
]


@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_sharded_decode_equals_whole(case):
    sharding, unit, world, q_len, lens = GPU_CASES[case]
    torch.manual_seed(case)
    b, hq, hkv, d = len(lens), 16, 2, 128
    L = world * unit if sharding == "chunks" else max(lens) + 1
    q = torch.randn(b, q_len, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, L, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, L, hkv, d, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(hq, device="cuda")
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    want, want_lse = kvstream.decode(q, k, v, cache_seqlens=seqlens, sinks=sinks,
                                     softcap=20.0, return_lse=True)
    outs, lses = [], []
    for rank in range(world):
        kl, table = shard_gpu(k, lens, sharding, unit, rank, world)
        vl, _ = shard_gpu(v, lens, sharding, unit, rank, world, table)
        share = kcp._Share(seqlens, rank, world, sharding, unit, q_len)
        o, l_ = kcp._gqa_states(q, kl, vl, share, q_len, dict(block_table=table, softcap=20.0))
        local, local_lse = kvstream.merge_states(o, l_)
        outs.append(local)
        lses.append(local_lse)
    got, got_lse = kvstream.merge_states(torch.stack(outs), torch.stack(lses), sinks=sinks)
    assert not torch.isnan(got).any()
    err = row_err(got, want)
    assert err < 2e-2, err
    assert lse_err(got_lse, want_lse) < 1e-3
    note(f"sharded decode {sharding} {unit} x{world} q_len {q_len}", max_row_rel_err=err)


def test_sharded_mla_decode_equals_whole():
    torch.manual_seed(5)
    b, hq, q_len, unit, world = 4, 16, 4, 64, 4
    lens = [3000, 700, 64, 1]
    L = max(lens) + 1
    q = torch.randn(b, q_len, hq, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(b, L, 576, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = 192 ** -0.5
    want, want_lse = kvstream.mla_decode(q, kv, softmax_scale=scale, cache_seqlens=seqlens,
                                         return_lse=True)
    outs, lses = [], []
    for rank in range(world):
        pool, table = shard_gpu(kv, lens, "pages", unit, rank, world)
        share = kcp._Share(seqlens, rank, world, "pages", unit, q_len)
        o, l_ = kcp._mla_states(q, pool, share, q_len,
                                dict(softmax_scale=scale, block_table=table))
        outs.append(o[0])
        lses.append(l_[0])
    got, got_lse = kvstream.merge_states(torch.stack(outs), torch.stack(lses))
    err = row_err(got, want)
    assert err < 2e-2, err
    assert lse_err(got_lse, want_lse) < 1e-3
    note("sharded MLA decode pages 64 x4 q_len 4", max_row_rel_err=err)


@pytest.fixture(scope="module")
def nccl_world_of_one():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_nccl_world_of_one_eager_and_graph(nccl_world_of_one):
    torch.manual_seed(9)
    b, L, hq, hkv, d, q_len = 8, 4096, 32, 8, 128, 2
    q = torch.randn(b, q_len, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, L, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sinks = torch.randn(hq, device="cuda")
    lens = torch.randint(0, L + 1, (b,), device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    kcp.decode(q, k, v, lens, sinks=sinks, out=out)
    want = kvstream.decode(q, k, v, cache_seqlens=lens, sinks=sinks)
    assert row_err(out, want) < 2e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kcp.decode(q, k, v, lens, sinks=sinks, out=out)
    errs = []
    for seed in range(3):
        lens.copy_(torch.randint(0, L + 1, (b,), device="cuda", dtype=torch.int32,
                                 generator=torch.Generator(device="cuda").manual_seed(seed)))
        out.fill_(float("nan"))
        g.replay()
        want = kvstream.decode(q, k, v, cache_seqlens=lens, sinks=sinks)
        errs.append(row_err(out, want))
    assert max(errs) < 2e-2, errs
    note("nccl world of one, graph replays with new lengths", max_row_rel_err=max(errs))
