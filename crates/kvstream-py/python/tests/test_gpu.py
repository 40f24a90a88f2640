"""GPU tests of kvstream.decode (H100 / H200); skipped unless torch sees a CUDA device.

Correctness against an fp32 torch reference (masked softmax with per-request lengths and the
causal rule among new tokens), LSE, multi-token decode, paged caches (shuffled page pools),
device planning, CUDA graph capture and replay with new lengths, and two streams in flight at
once; the score modifiers (sliding window, softcap, sinks) and head dims 96 and 256 against an
fp64 reference, row by row; the torch custom ops under torch.compile (fullgraph, inductor,
reduce-overhead), in CUDA graphs, in the profiler and through torch.library.opcheck. If
KVSTREAM_PY_GPU_SUMMARY names a file, a JSON summary of every check is written there.
"""

import json
import os
import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

import kvstream  # noqa: E402

TOL = 1e-2
SUMMARY = {"cases": [], "checks": {}}


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    path = os.environ.get("KVSTREAM_PY_GPU_SUMMARY")
    if path:
        SUMMARY["device"] = torch.cuda.get_device_name(0)
        SUMMARY["max_rel_err"] = max((c["rel_err"] for c in SUMMARY["cases"]), default=None)
        with open(path, "w") as f:
            json.dump(SUMMARY, f, indent=1)


def reference(q, k, v, lens, scale):
    """fp32 out (q's shape) and lse ([b, q_len, hq] for q [b, q_len, hq, d], [b, hq] for q
    [b, hq, d]) over contiguous caches [b, L, hkv, d]: plain causal decode, ``reference_mods``
    without modifiers. Token i of request r sees cache positions 0 .. lens[r] - q_len + i; a
    token that sees nothing gives 0 and -inf.
    """
    out, lse, _ = reference_mods(q, k, v, lens, scale)
    return out.float(), lse.float()


def live_rows(q, lens):
    """Which query rows see at least one position: [b, q_len] for a 4-D q, [b] for a 3-D one."""
    s = q.shape[1] if q.dim() == 4 else 1
    seen = lens.long()[:, None] - s + 1 + torch.arange(s, device=lens.device)[None, :]
    live = seen > 0
    return live if q.dim() == 4 else live[:, 0]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def make(b, hq, hkv, d, L, dtype, seed, q_len=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float32, generator=gen).to(dtype)  # noqa: E731
    return r(b, q_len, hq, d), r(b, L, hkv, d), r(b, L, hkv, d)


def check(q, k, v, lens, out, lse, scale, label):
    """out and lse of a call on contiguous caches k, v (or their paged copy) vs the reference."""
    assert out.shape == q.shape and lse.shape == q.shape[:-1], label
    ref_out, ref_lse = reference(q, k, v, lens, scale)
    e = rel_err(out, ref_out)
    live = live_rows(q, lens)
    el = rel_err(lse[live], ref_lse[live]) if bool(live.any()) else 0.0
    dead_ok = bool((out[~live] == 0).all()) and bool(torch.isneginf(lse[~live]).all())
    SUMMARY["cases"].append({"case": label, "rel_err": e, "lse_rel_err": el, "empty_rows_ok": dead_ok})
    assert torch.isfinite(out.float()).all(), label
    assert e <= TOL, f"{label}: rel err {e}"
    assert el <= 1e-3, f"{label}: lse rel err {el}"
    assert dead_ok, f"{label}: rows that see no position must give 0 and -inf"


def cases():
    rng = random.Random(1234)
    out = []
    for g in (1, 2, 5, 8, 16, 32):
        for d in (64, 128):
            dtype = rng.choice([torch.bfloat16, torch.float16])
            hkv = rng.choice([1, 2, 4]) if g <= 8 else rng.choice([1, 2])
            b = rng.choice([1, 2, 3, 4])
            L = rng.choice([1, 64, 1000, 4096, 8192])
            out.append((b, g * hkv, hkv, d, L, dtype))
    return out


@pytest.mark.parametrize("b,hq,hkv,d,L,dtype", cases())
def test_matches_sdpa(b, hq, hkv, d, L, dtype):
    q, k, v = make(b, hq, hkv, d, L, dtype, seed=b * 1000 + hq + L)
    lens = torch.randint(0, L + 1, (b,), device="cuda", dtype=torch.int32)
    lens[0] = 0 if b > 1 else L           # one empty request, and the full cache
    if b > 2:
        lens[-1] = L
    scale = 1.0 / d ** 0.5
    out, lse = kvstream.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, 1, hq)
    check(q, k, v, lens, out, lse, scale, f"b{b} hq{hq} hkv{hkv} d{d} L{L} {dtype}")
    # q as [b, hq, d]: the same call, out [b, hq, d] and lse [b, hq]
    out3, lse3 = kvstream.decode(q[:, 0], k, v, cache_seqlens=lens, return_lse=True)
    assert out3.shape == (b, hq, d) and lse3.shape == (b, hq)
    torch.cuda.synchronize()
    assert torch.equal(out3, out[:, 0]) and torch.equal(lse3, lse[:, 0])


def test_no_seqlens_custom_scale_forced_splits_and_out():
    q, k, v = make(2, 16, 2, 128, 3000, torch.bfloat16, seed=7)
    lens = torch.full((2,), 3000, device="cuda", dtype=torch.int32)
    for splits in (None, 1, 3, 64):
        out = torch.empty_like(q)
        res, lse = kvstream.decode(q, k, v, softmax_scale=0.05, num_splits=splits, out=out, return_lse=True)
        assert res.data_ptr() == out.data_ptr()
        check(q, k, v, lens, out, lse, 0.05, f"splits={splits}")


def test_strided_cache_slice():
    q, kb, vb = make(2, 8, 1, 64, 2048, torch.float16, seed=9)
    k, v = kb[:, :1500], vb[:, :1500]     # batch stride larger than contiguous
    assert not k.is_contiguous()
    lens = torch.tensor([1500, 333], device="cuda", dtype=torch.int32)
    out, lse = kvstream.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    check(q, k.contiguous(), v.contiguous(), lens, out, lse, 1 / 8, "strided cache")


@pytest.mark.parametrize("b", [1, 4])
def test_growing_views_share_one_decoder(b):
    # cache[:, :n] for a growing n: one decoder per power of two, reading the first n positions
    # (the rest of the buffer NaN: never read)
    q, kb, vb = make(b, 32, 8, 128, 4096, torch.bfloat16, seed=12)
    kb[:, 700:] = float("nan")
    vb[:, 700:] = float("nan")
    kvstream.clear_cache()
    held = kvstream.decoder_cache_info()["size"]  # earlier tests' captured decoders
    sizes = []
    for n in (300, 301, 450, 512, 513, 700):
        k, v = kb[:, :n], vb[:, :n]
        out, lse = kvstream.decode(q, k, v, return_lse=True)
        lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
        check(q, k.contiguous(), v.contiguous(), lens, out, lse, 128 ** -0.5, f"view {n}")
        sizes.append(kvstream.decoder_cache_info()["size"] - held)
    assert sizes == [1, 1, 1, 1, 2, 2], sizes
    SUMMARY["checks"][f"growing views b{b}"] = {"decoders": sizes[-1]}


def test_graph_capture_replay_with_new_lengths():
    b, hq, hkv, d, L = 4, 32, 8, 128, 8192
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=11)
    lens = torch.tensor([8192, 100, 0, 4000], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kvstream.decode(q, k, v, cache_seqlens=lens, out=out)   # warm-up creates the decoder
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kvstream.decode(q, k, v, cache_seqlens=lens, out=out)
    results = []
    for new in ([1, 2, 3, 4], [8192, 0, 8191, 17], [5000, 5000, 5000, 5000]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        g.replay()
        eager = kvstream.decode(q, k, v, cache_seqlens=lens)
        torch.cuda.synchronize()
        same = torch.equal(out, eager)
        results.append(same)
        assert same, f"replay with lengths {new} differs from the eager call"
        ref, _ = reference(q, k, v, lens, 1 / d ** 0.5)
        assert rel_err(out, ref) <= TOL
    SUMMARY["checks"]["graph_replay_equals_eager"] = all(results)


def test_self_test_passes():
    assert kvstream.self_test(verbose=False) is True


def test_decoder_cache_bound_keeps_captured_decoders():
    """With room for two decoders, four shapes in turn stay right, and the decoder a graph
    captured survives both the LRU and clear_cache() while the graph replays."""
    torch.cuda.synchronize()
    kvstream.clear_cache(include_captured=True)  # earlier tests' graphs are gone
    kvstream.set_decoder_cache_size(2)
    try:
        shapes = [(1, 16, 2, 128, 2048 + 512 * i) for i in range(4)]
        data = [make(*sh, torch.bfloat16, seed=40 + i) for i, sh in enumerate(shapes)]
        lens = torch.tensor([2048], device="cuda", dtype=torch.int32)
        q0, k0, v0 = data[0]
        out0 = torch.empty_like(q0)
        kvstream.decode(q0, k0, v0, cache_seqlens=lens, out=out0)  # warm-up
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            kvstream.decode(q0, k0, v0, cache_seqlens=lens, out=out0)
        for rnd in range(2):
            for i, (q, k, v) in enumerate(data):
                out, lse = kvstream.decode(q, k, v, cache_seqlens=lens, return_lse=True)
                check(q, k, v, lens, out, lse, 1 / 128 ** 0.5, f"cache bound, round {rnd}, shape {i}")
            info = kvstream.decoder_cache_info()
            assert info["captured"] == 1 and info["size"] == 2, info  # (the captured one counts)
        kvstream.clear_cache()
        assert kvstream.decoder_cache_info() == {"size": 1, "captured": 1, "capacity": 2}
        q0.copy_(torch.randn_like(q0))
        g.replay()
        torch.cuda.synchronize()
        ref, _ = reference(q0, k0, v0, lens, 1 / 128 ** 0.5)
        assert rel_err(out0, ref) <= TOL
        del g
        SUMMARY["checks"]["decoder_cache_bound"] = True
    finally:
        kvstream.clear_cache(include_captured=True)
        kvstream.set_decoder_cache_size(kvstream.DEFAULT_DECODER_CACHE_SIZE)


def test_two_streams_in_flight():
    a = make(1, 16, 2, 128, 8192, torch.bfloat16, seed=21)
    bb = make(3, 40, 8, 64, 4096, torch.float16, seed=22)
    la = torch.tensor([8192], device="cuda", dtype=torch.int32)
    lb = torch.tensor([4096, 1, 2500], device="cuda", dtype=torch.int32)
    kvstream.decode(*a, cache_seqlens=la)      # warm-up: decoders exist before the race
    kvstream.decode(*bb, cache_seqlens=lb)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    outs = {}
    for _ in range(20):
        with torch.cuda.stream(s1):
            outs["a"] = kvstream.decode(*a, cache_seqlens=la, return_lse=True)
        with torch.cuda.stream(s2):
            outs["b"] = kvstream.decode(*bb, cache_seqlens=lb, return_lse=True)
    torch.cuda.synchronize()
    check(*a, la, *outs["a"], 1 / 128 ** 0.5, "stream 1")
    check(*bb, lb, *outs["b"], 1 / 64 ** 0.5, "stream 2")
    SUMMARY["checks"]["two_streams"] = True


def test_same_shape_on_two_streams_is_ordered():
    x = make(1, 8, 1, 128, 4096, torch.bfloat16, seed=31)
    y = [t.clone().normal_() for t in x]
    lens = torch.tensor([4096], device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        ox = kvstream.decode(*x, cache_seqlens=lens, num_splits=32)
    with torch.cuda.stream(s2):
        oy = kvstream.decode(*y, cache_seqlens=lens, num_splits=32)
    torch.cuda.synchronize()
    assert rel_err(ox, reference(*x, lens, 1 / 128 ** 0.5)[0]) <= TOL
    assert rel_err(oy, reference(*y, lens, 1 / 128 ** 0.5)[0]) <= TOL
    SUMMARY["checks"]["same_shape_two_streams"] = True


@pytest.mark.parametrize(
    "b,hq,hkv,d,L,lens",
    [(3, 16, 2, 128, 3000, [0, 1777, 3000]), (1, 16, 16, 64, 1024, [1024])],
)
def test_cluster_and_kernel_reduction(b, hq, hkv, d, L, lens):
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=41 + b + hkv)
    lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    scale = 1.0 / d ** 0.5
    label = f"b{b} hq{hq} hkv{hkv} d{d} L{L}"
    res = {}
    for mode in ("cluster", "kernel"):
        res[mode] = kvstream.decode(q, k, v, cache_seqlens=lens, num_splits=4, reduction=mode,
                                    return_lse=True)
        check(q, k, v, lens, *res[mode], scale, f"{label} reduction={mode} splits=4")
    (oc, lc), (ok, lk) = res["cluster"], res["kernel"]
    # Both merge in fp32: the outputs differ by at most one bf16 rounding (an ulp, <= 2^-7 of
    # the value), the LSEs by fp32 rounding.
    diff = (oc.float() - ok.float()).abs()
    bound = 2.0 ** -7 * torch.maximum(oc.float().abs(), ok.float().abs()) + 1e-6
    assert bool((diff <= bound).all()), f"{label}: cluster vs kernel max diff {diff.max().item()}"
    torch.testing.assert_close(lc, lk, rtol=1e-5, atol=1e-5)
    # Cluster reduction has no atomics or workspace: a second call is bitwise identical.
    oc2, lc2 = kvstream.decode(q, k, v, cache_seqlens=lens, num_splits=4, reduction="cluster",
                               return_lse=True)
    torch.cuda.synchronize()
    same = torch.equal(oc, oc2) and torch.equal(lc, lc2)
    SUMMARY["checks"][f"cluster_deterministic {label}"] = same
    SUMMARY["checks"][f"cluster_matches_kernel {label}"] = True
    assert same, f"{label}: two cluster-reduction calls differ"
    native = kvstream._native.Decoder(b, hq, hkv, d, L, "bf16", num_splits=4, reduction="cluster")
    assert native.reduction == "cluster" and native.num_splits == 4
    assert "reduction='cluster'" in repr(native)
    kernel = kvstream._native.Decoder(b, hq, hkv, d, L, "bf16", num_splits=4, reduction="kernel")
    assert kernel.reduction == "kernel"


# ---- multi-token decode: q [b, q_len, hq, d], causal among the new tokens ----

MULTI_TOKEN = {  # q_len: (hq, hkv, d, dtype); groups 1-32 and both head dims across q_len 1-8
    1: (16, 2, 128, torch.bfloat16),
    2: (32, 4, 64, torch.float16),
    3: (16, 16, 128, torch.bfloat16),
    4: (32, 8, 128, torch.float16),
    5: (8, 1, 64, torch.bfloat16),
    6: (40, 8, 128, torch.bfloat16),
    7: (32, 1, 64, torch.float16),
    8: (32, 2, 128, torch.bfloat16),
}


@pytest.mark.parametrize("q_len", sorted(MULTI_TOKEN))
def test_multi_token_matches_reference(q_len):
    hq, hkv, d, dtype = MULTI_TOKEN[q_len]
    b, L = 5, 3000
    q, k, v = make(b, hq, hkv, d, L, dtype, seed=500 + q_len, q_len=q_len)
    # the full cache, a long and a short request, one shorter than q_len (its first tokens see
    # nothing), one empty
    lens = torch.tensor([L, 2049, 70, q_len // 2, 0], device="cuda", dtype=torch.int32)
    scale = 1.0 / d ** 0.5
    label = f"q_len{q_len} hq{hq} hkv{hkv} d{d} {dtype}"
    out, lse = kvstream.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    assert out.shape == (b, q_len, hq, d) and out.dtype == dtype and lse.shape == (b, q_len, hq)
    check(q, k, v, lens, out, lse, scale, label)
    # the rows of the request shorter than q_len: the first q_len - len see nothing
    short = q_len // 2
    assert bool((out[3, : q_len - short] == 0).all()), label
    assert bool(torch.isneginf(lse[3, : q_len - short]).all()), label
    # forced splits, both reductions, into a given out
    for splits, mode in ((1, None), (4, "kernel"), (4, "cluster"), (8, None)):
        o = torch.empty_like(q)
        res, lse2 = kvstream.decode(q, k, v, cache_seqlens=lens, num_splits=splits,
                                    reduction=mode, out=o, return_lse=True)
        assert res.data_ptr() == o.data_ptr()
        check(q, k, v, lens, o, lse2, scale, f"{label} splits={splits} reduction={mode}")
    # without cache_seqlens every request has L tokens
    full = torch.full((b,), L, device="cuda", dtype=torch.int32)
    out, lse = kvstream.decode(q, k, v, softmax_scale=0.07, return_lse=True)
    check(q, k, v, full, out, lse, 0.07, f"{label} no cache_seqlens")


def test_multi_token_rows_equal_single_token_calls():
    # Token i of a q_len-token call is a single-token call over the first len - q_len + i + 1
    # positions (another kernel variant, with other query rows per KV head: compare within
    # tolerance).
    b, hq, hkv, d, L, q_len = 2, 16, 2, 128, 1024, 4
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=601, q_len=q_len)
    lens = torch.tensor([1000, 3], device="cuda", dtype=torch.int32)
    out = kvstream.decode(q, k, v, cache_seqlens=lens)
    for i in range(q_len):
        seen = (lens - q_len + i + 1).clamp_min(0).to(torch.int32)
        one = kvstream.decode(q[:, i].contiguous(), k, v, cache_seqlens=seen)
        assert rel_err(out[:, i], one) <= TOL, f"token {i}"


# ---- paged caches: pools [num_pages, page_size, hkv, d] and a block table ----

def poison_past(x, lens):
    """A copy of a contiguous cache with NaN at every position at or past each request's length
    (data the kernels must never use)."""
    y = x.clone()
    pos = torch.arange(x.shape[1], device=x.device)
    y[pos[None, :] >= lens.long()[:, None]] = float("nan")
    return y


def to_pages(k, v, page_size, seed, extra_cols=0, spare=3):
    """Scatters contiguous caches [b, L, hkv, d] (L a multiple of page_size) into shuffled pools
    [num_pages, page_size, hkv, d] with `spare` NaN pages nobody owns. Returns the pools and the
    int32 block table [b, L / page_size + extra_cols]; extra columns name pages of other
    requests (finite data past the capacity of the caches, never reached)."""
    b, L, hkv, d = k.shape
    assert L % page_size == 0
    per = L // page_size
    num_pages = b * per + spare
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_pages, generator=gen).to(k.device)
    table = order[: b * per].view(b, per)
    pools = []
    for x in (k, v):
        # NaN where nobody owns a page (0x7f: e4m3's NaN, for caches viewed as bytes)
        fill = float("nan") if x.dtype.is_floating_point else 0x7F
        pool = torch.full((num_pages, page_size, hkv, d), fill, dtype=x.dtype, device=x.device)
        pool[table.reshape(-1)] = x.reshape(b * per, page_size, hkv, d)
        pools.append(pool)
    if extra_cols:
        junk = order[torch.randint(0, b * per, (b, extra_cols), generator=gen).to(k.device)]
        table = torch.cat([table, junk], dim=1)
    return pools[0], pools[1], table.to(torch.int32).contiguous()


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("q_len", [1, 3])
def test_paged_matches_contiguous_and_reference(page_size, q_len):
    b, hq, hkv, d, L = 3, 16, 2, 128, 2048    # L: a multiple of every page size here
    dtype = torch.bfloat16 if q_len == 1 else torch.float16
    q, k, v = make(b, hq, hkv, d, L, dtype, seed=700 + page_size + q_len, q_len=q_len)
    # lengths ending inside a page, on a page boundary, short, and empty
    lens = torch.tensor([2000, 2 * page_size, 0], device="cuda", dtype=torch.int32)
    kp, vp = poison_past(k, lens), poison_past(v, lens)
    k_pool, v_pool, table = to_pages(kp, vp, page_size, seed=page_size)
    scale = 1.0 / d ** 0.5
    label = f"paged p{page_size} q_len{q_len}"
    for splits, mode in ((None, None), (1, None), (4, "kernel"), (4, "cluster")):
        kw = dict(cache_seqlens=lens, num_splits=splits, reduction=mode, return_lse=True)
        out, lse = kvstream.decode(q, k_pool, v_pool, block_table=table, **kw)
        check(q, k, v, lens, out, lse, scale, f"{label} splits={splits} reduction={mode}")
        if splits is None:
            # the default plan gives a paged cache a full wave of CTAs (more splits than the
            # contiguous plan), so the bits may differ; forced plans below compare bitwise
            continue
        # same problem and plan on the contiguous (equally poisoned) caches: bitwise equal
        out_c, lse_c = kvstream.decode(q, kp, vp, **kw)
        torch.cuda.synchronize()
        same = torch.equal(out, out_c) and torch.equal(lse, lse_c)
        SUMMARY["checks"][f"paged_equals_contiguous {label} splits={splits} {mode}"] = same
        assert same, f"{label} splits={splits} reduction={mode}: paged differs from contiguous"


def test_paged_wide_table_no_seqlens_and_3d_q():
    b, hq, hkv, d, L, page_size = 2, 32, 8, 64, 1024, 16
    q, k, v = make(b, hq, hkv, d, L, torch.float16, seed=801)
    k_pool, v_pool, table = to_pages(k, v, page_size, seed=5, extra_cols=7)
    lens = torch.tensor([L, 333], device="cuda", dtype=torch.int32)
    out, lse = kvstream.decode(q, k_pool, v_pool, block_table=table, cache_seqlens=lens,
                               return_lse=True)
    check(q, k, v, lens, out, lse, 1 / 8, "paged, table wider than the cache")
    # without cache_seqlens every request has max_pages * page_size positions: here the whole
    # table, so give it exactly the cache's pages
    k_pool, v_pool, table = to_pages(k, v, page_size, seed=6)
    out, lse = kvstream.decode(q[:, 0], k_pool, v_pool, block_table=table, return_lse=True)
    full = torch.full((b,), L, device="cuda", dtype=torch.int32)
    check(q[:, 0], k, v, full, out, lse, 1 / 8, "paged, no cache_seqlens, q [b, hq, d]")


# ---- device plan: the split partition planned on the GPU from the device lengths ----

@pytest.mark.parametrize("q_len,paged", [(1, False), (4, False), (2, True)])
def test_device_plan_ragged_lengths(q_len, paged):
    b, hq, hkv, d, L = 10, 32, 8, 128, 16384
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=900 + q_len, q_len=q_len)
    # one long request, many short ones, one empty
    lens = torch.tensor([16384, 37, 1, 0, 100, 64, 500, 9, 129, 2], device="cuda",
                        dtype=torch.int32)
    label = f"device_plan q_len{q_len} paged={paged}"
    if paged:
        k_pool, v_pool, table = to_pages(k, v, 64, seed=9)
        run = lambda **kw: kvstream.decode(q, k_pool, v_pool, block_table=table, **kw)  # noqa: E731
    else:
        run = lambda **kw: kvstream.decode(q, k, v, **kw)  # noqa: E731
    for mode in (None, "kernel"):
        out, lse = run(cache_seqlens=lens, device_plan=True, reduction=mode, return_lse=True)
        check(q, k, v, lens, out, lse, 1.0 / d ** 0.5, f"{label} reduction={mode}")
    full = torch.full((b,), L, device="cuda", dtype=torch.int32)
    out, lse = run(device_plan=True, return_lse=True)
    check(q, k, v, full, out, lse, 1.0 / d ** 0.5, f"{label} no cache_seqlens")


@pytest.mark.parametrize("q_len,paged", [(1, False), (3, True)])
def test_device_plan_graph_replay_with_new_lengths(q_len, paged):
    b, hq, hkv, d, L, page_size = 6, 16, 2, 128, 8192, 64
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=1000 + q_len, q_len=q_len)
    lens = torch.tensor([8192, 10, 0, 300, 1, 64], device="cuda", dtype=torch.int32)
    if paged:
        k_pool, v_pool, table = to_pages(k, v, page_size, seed=10)
        args = (q, k_pool, v_pool)
        extra = dict(block_table=table)
    else:
        args, extra = (q, k, v), {}
    kw = dict(cache_seqlens=lens, device_plan=True, **extra)
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kvstream.decode(*args, out=out, return_lse=True, **kw)   # warm-up creates the decoder
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, lse = kvstream.decode(*args, out=out, return_lse=True, **kw)
    results = []
    for i, new in enumerate(([1, 2, 3, 4, 5, 6], [8192, 0, 8191, 17, 4096, 2],
                             [0, 0, 0, 0, 0, 8192], [5000] * 6)):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        if paged:   # the pages move too: a new shuffle into the same pools and table
            kp2, vp2, t2 = to_pages(k, v, page_size, seed=11 + i)
            k_pool.copy_(kp2)
            v_pool.copy_(vp2)
            table.copy_(t2)
        g.replay()
        eager, eager_lse = kvstream.decode(*args, return_lse=True, **kw)
        torch.cuda.synchronize()
        same = torch.equal(out, eager) and torch.equal(lse, eager_lse)
        results.append(same)
        assert same, f"replay with lengths {new} differs from the eager call"
        check(q, k, v, lens, out, lse, 1 / d ** 0.5, f"device_plan graph q_len{q_len} "
              f"paged={paged} lens={new}")
    SUMMARY["checks"][f"device_plan_graph_replay_equals_eager q_len{q_len} paged={paged}"] = all(results)


def to_fp8(x, per_head):
    """float8_e4m3fn cache of x [b, L, hkv, d] and its float32 scales (amax / 448 per KV head
    and request, or one for the cache), plus the dequantised values the kernels must use."""
    if per_head:
        scale = x.float().abs().amax(dim=(1, 3)).clamp_min(1e-6) / 448.0       # [b, hkv]
        q8 = (x.float() / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        deq = q8.float() * scale[:, None, :, None]
    else:
        scale = (x.float().abs().amax().clamp_min(1e-6) / 448.0).reshape(1)
        q8 = (x.float() / scale).to(torch.float8_e4m3fn)
        deq = q8.float() * scale
    return q8, scale.float().contiguous(), deq


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_len,per_head", [(1, False), (3, True)])
def test_fp8_cache_matches_dequantised_reference(paged, q_len, per_head):
    b, hq, hkv, d, L = 4, 32, 8, 128, 2048
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=808 + q_len, q_len=q_len)
    lens = torch.tensor([L, 1000, 0, 77], device="cuda", dtype=torch.int32)
    k8, ks, kd = to_fp8(k, per_head)
    v8, vs, vd = to_fp8(v, per_head)
    kw = dict(cache_seqlens=lens, k_scale=ks, v_scale=vs, return_lse=True)
    if paged:
        kp, vp, table = to_pages(k8.view(torch.uint8), v8.view(torch.uint8), 16, seed=5)
        args = (q, kp.view(torch.float8_e4m3fn), vp.view(torch.float8_e4m3fn))
        kw["block_table"] = table
    else:
        args = (q, k8, v8)
    out, lse = kvstream.decode(*args, **kw)
    check(q, kd, vd, lens, out, lse, 1 / d ** 0.5,
          f"fp8 paged={paged} q_len{q_len} per_head={per_head}")
    # what quantisation itself costs: against the bf16 cache
    ref_out, _ = reference(q, k, v, lens, 1 / d ** 0.5)
    live = live_rows(q, lens)
    SUMMARY["checks"][f"fp8 rel err vs bf16 cache paged={paged} q_len{q_len} per_head={per_head}"] = \
        rel_err(out[live], ref_out[live])


def test_fp8_graph_replay_with_new_scales():
    b, hq, hkv, d, L = 8, 32, 8, 128, 4096
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=99)
    lens = torch.full((b,), L, device="cuda", dtype=torch.int32)
    k8, ks, _ = to_fp8(k, True)
    v8, vs, _ = to_fp8(v, True)
    out = torch.empty_like(q)
    kw = dict(cache_seqlens=lens, k_scale=ks, v_scale=vs, out=out, return_lse=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kvstream.decode(q, k8, v8, **kw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, lse = kvstream.decode(q, k8, v8, **kw)
    for i, new in enumerate(([L] * b, [1, 4096, 0, 17, 300, 2048, 4000, 5])):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        ks.mul_(1.5 + i)
        vs.mul_(0.5 + i)
        g.replay()
        eager, eager_lse = kvstream.decode(q, k8, v8, cache_seqlens=lens, k_scale=ks,
                                           v_scale=vs, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(lse, eager_lse), f"replay {i}"
        kd = k8.float() * ks[:, None, :, None]
        vd = v8.float() * vs[:, None, :, None]
        check(q, kd, vd, lens, out, lse, 1 / d ** 0.5, f"fp8 graph replay {i}")
    SUMMARY["checks"]["fp8 graph replay with new scales equals eager"] = True


def test_fp8_bad_scales_are_rejected():
    q, k, v = make(2, 16, 2, 128, 256, torch.bfloat16, seed=3)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale has shape"):
        kvstream.decode(q, k8, v8, k_scale=torch.ones(3, device="cuda"))
    with pytest.raises(TypeError, match="k_scale has dtype"):
        kvstream.decode(q, k8, v8, k_scale=torch.ones(1, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="scales belong to"):
        kvstream.decode(q, k, v, k_scale=torch.ones(1, device="cuda"))
    with pytest.raises(TypeError, match="e5m2"):
        kvstream.decode(q, k.to(torch.float8_e5m2), v.to(torch.float8_e5m2))


@pytest.mark.parametrize("fp8", [True, False])
def test_store_kv_then_decode(fp8):
    """A cache filled by store_kv (a new token per request at shuffled slots, some skipped)
    equals the same cache built by torch, byte for byte, and decodes alike."""
    b, hq, hkv, d, L = 4, 32, 8, 128, 1024
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=4242)
    cdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    ks = kvstream.fp8_scales(k.view(b, L, hkv, d)) if fp8 else None
    vs = kvstream.fp8_scales(v.view(b, L, hkv, d)) if fp8 else None
    k_cache = torch.zeros(b, L, hkv, d, device="cuda", dtype=cdt)
    v_cache = torch.zeros_like(k_cache)
    # every position of every request, in a random order, in chunks of 300 tokens; slot -1
    # entries are skipped
    rows_k = k.reshape(b * L, hkv, d)
    rows_v = v.reshape(b * L, hkv, d)
    order = torch.randperm(b * L, device="cuda")
    for c in range(0, b * L, 300):
        idx = order[c:c + 300]
        slots = idx.clone()
        slots[::7] = -1
        kvstream.store_kv(rows_k[idx], rows_v[idx], k_cache, v_cache, slots, k_scale=ks,
                          v_scale=vs)
        keep = slots >= 0
        missing = idx[~keep]
        kvstream.store_kv(rows_k[missing], rows_v[missing], k_cache, v_cache, missing,
                          k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    if fp8:
        want_k = (k.float() / ks[None, None, :, None]).to(torch.float8_e4m3fn)
        want_v = (v.float() / vs[None, None, :, None]).to(torch.float8_e4m3fn)
    else:
        want_k, want_v = k, v
    same = torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8)) and \
        torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    SUMMARY["checks"][f"store_kv equals torch's cache fp8={fp8}"] = same
    assert same
    lens = torch.tensor([L, 1, 500, 0], device="cuda", dtype=torch.int32)
    out, lse = kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, k_scale=ks, v_scale=vs,
                               return_lse=True)
    kd = k_cache.float() * (ks[None, None, :, None] if fp8 else 1)
    vd = v_cache.float() * (vs[None, None, :, None] if fp8 else 1)
    check(q, kd, vd, lens, out, lse, 1 / d ** 0.5, f"decode of a store_kv cache fp8={fp8}")


# ---- score modifiers (sliding window, softcap, sinks) and head dims 96 and 256 ----------------

def reference_mods(q, k, v, lens, scale, window=(-1, 0), softcap=0.0, sinks=None):
    """float64 out (q's shape), lse and which rows see a position ([b, q_len] for a 4-D q, [b]
    for a 3-D one), over contiguous caches [b, L, hkv, d], with FlashAttention-3's score
    modifiers.

    Token i of request r sits at position t = lens[r] - q_len + i and sees positions
    t - left .. t + right within 0 .. lens[r] - 1 (a side of -1 is unbounded); scaled scores s
    become softcap * tanh(s / softcap); the sink of each query head joins the softmax
    denominator and adds no value, so the LSE includes it and a row that sees no position gives
    0 and LSE = its sink (-inf without sinks).
    """
    three = q.dim() == 3
    q4 = q.unsqueeze(1) if three else q
    b, s, hq, d = q4.shape
    L, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    dev = q.device
    # query head h = kvh * g + j uses KV head kvh: rows (j, token) of KV head kvh
    qf = q4.double().reshape(b, s, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * s, d)
    kf = k.double().transpose(1, 2)                                 # [b, hkv, L, d]
    vf = v.double().transpose(1, 2)
    scores = (qf @ kf.transpose(-1, -2)) * scale                    # [b, hkv, g * s, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    t = lens.long()[:, None] - s + torch.arange(s, device=dev)[None, :]        # [b, s]
    pos = torch.arange(L, device=dev)[None, None, :]
    seen = pos < lens.long()[:, None, None]                         # [b, s, L]
    left, right = window
    if left >= 0:
        seen = seen & (pos >= t[:, :, None] - left)
    if right >= 0:
        seen = seen & (pos <= t[:, :, None] + right)
    mask = seen[:, None].expand(b, g, s, L).reshape(b, 1, g * s, L)
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = scores
    if sinks is not None:
        sink = sinks.double().reshape(1, hkv, g, 1).expand(b, hkv, g, s).reshape(b, hkv, g * s, 1)
        logits = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)                           # [b, hkv, g * s]
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = torch.exp(scores - shift[..., None]) @ vf                 # [b, hkv, g * s, d]
    out = out.reshape(b, hkv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, hq, d)
    lse = lse.reshape(b, hkv, g, s).permute(0, 3, 1, 2).reshape(b, s, hq)
    live = seen.any(dim=-1)                                         # [b, s]
    return (out[:, 0], lse[:, 0], live[:, 0]) if three else (out, lse, live)


def row_errors(got, want, dtype):
    """Relative error of each row (the last dimension) of ``got`` against float64 ``want``;
    rows of ``want`` whose norm is below dtype's smallest normal (times sqrt(d)) are measured
    against that floor instead."""
    d = want.shape[-1]
    g = got.double().reshape(-1, d)
    w = want.double().reshape(-1, d)
    floor = torch.finfo(dtype).tiny * d ** 0.5
    return (g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(floor)


def check_rows(q, out, lse, ref, sinks, label):
    """out and lse of a call vs reference_mods' ``ref`` row by row: each row that sees a
    position within TOL (relative; rows of tiny norm against the dtype's smallest normal) with
    its LSE within 1e-3; each row that sees none exactly 0 with LSE -inf (without sinks) or its
    sink (within 1e-3)."""
    ref_out, ref_lse, live = ref
    d = q.shape[-1]
    assert out.shape == q.shape and out.dtype == q.dtype, label
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32, label
    assert bool(torch.isfinite(out.float()).all()), f"{label}: out holds NaN or inf"
    rows_live = live[..., None].expand(lse.shape).reshape(-1)
    o = out.double().reshape(-1, d)
    rel = row_errors(out, ref_out, q.dtype)
    got_lse = lse.double().reshape(-1)
    want_lse = ref_lse.reshape(-1)
    any_live = bool(rows_live.any())
    worst = rel[rows_live].max().item() if any_live else 0.0
    worst_lse = (got_lse - want_lse).abs()[rows_live].max().item() if any_live else 0.0
    dead = ~rows_live
    dead_ok = bool((o[dead] == 0).all())
    if sinks is None:
        dead_ok = dead_ok and bool(torch.isneginf(got_lse[dead]).all())
    else:
        dead_ok = dead_ok and bool(((got_lse[dead] - want_lse[dead]).abs() <= 1e-3).all())
    SUMMARY["cases"].append({"case": label, "rel_err": worst, "lse_err": worst_lse,
                             "empty_rows": int(dead.sum()), "empty_rows_ok": dead_ok})
    assert worst <= TOL, f"{label}: worst row relative error {worst}"
    assert worst_lse <= 1e-3, f"{label}: worst row lse error {worst_lse}"
    assert dead_ok, f"{label}: rows that see no position must give 0 and lse -inf / their sink"


def make_sinks(hq, seed):
    """float32 [hq] sink logits on the scale of the tests' scores (scale 3 / sqrt(d): row
    LSEs of about 3..15), so that a sink takes anything from a small share of its row to
    nearly all of it."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (8.0 + 2.0 * torch.randn(hq, device="cuda", generator=gen)).contiguous()


SCORE_MOD_CASES = [
    # d, q_len, hq, hkv, dtype, window_size, softcap, sinks, page_size, fp8 scales
    (96, 1, 32, 4, torch.bfloat16, (128, 0), 30.0, True, None, None),
    (96, 4, 16, 2, torch.float16, (128, 0), 30.0, True, 16, None),
    (256, 1, 16, 2, torch.bfloat16, (128, 0), 30.0, True, 64, None),
    (256, 4, 8, 1, torch.bfloat16, (128, 0), 30.0, True, None, None),
    (96, 4, 32, 8, torch.bfloat16, (128, 0), 0.0, True, None, None),
    (256, 1, 32, 2, torch.float16, (-1, 0), 30.0, False, None, None),
    (128, 4, 16, 2, torch.bfloat16, (-1, -1), 0.0, True, None, None),
    (64, 3, 16, 4, torch.float16, (37, 1), 30.0, False, 1, None),
    (128, 4, 32, 4, torch.bfloat16, (128, 0), 30.0, True, 16, "per_head"),
    (256, 1, 16, 2, torch.bfloat16, (128, 0), 30.0, True, None, "per_cache"),
    (96, 2, 16, 2, torch.float16, (128, 0), 30.0, True, 64, "per_head"),
]


@pytest.mark.parametrize("d,q_len,hq,hkv,dtype,window,softcap,sinks,page_size,fp8",
                         SCORE_MOD_CASES)
def test_score_mods_match_reference(d, q_len, hq, hkv, dtype, window, softcap, sinks,
                                    page_size, fp8):
    b, L = 6, 1024
    q, k, v = make(b, hq, hkv, d, L, dtype, seed=1100 + d + 10 * q_len + hq, q_len=q_len)
    # the full cache, empty, shorter than q_len (its first tokens see nothing), shorter than
    # the window, one past the window, longer
    lens = torch.tensor([L, 0, 2, 50, 129, 700], device="cuda", dtype=torch.int32)
    scale = 3.0 / d ** 0.5   # scores of a few units: a softcap of 30 bends the largest ones
    sk = make_sinks(hq, seed=d + q_len) if sinks else None
    label = (f"mods d{d} q_len{q_len} hq{hq} hkv{hkv} {dtype} window{window} softcap{softcap} "
             f"sinks={sinks} page {page_size} fp8 {fp8}")
    kw = dict(cache_seqlens=lens, softmax_scale=scale, window_size=window, softcap=softcap,
              sinks=sk, return_lse=True)
    kr, vr = k, v    # what the reference attends to
    if fp8 is not None:
        k8, ks, kr = to_fp8(k, fp8 == "per_head")
        v8, vs, vr = to_fp8(v, fp8 == "per_head")
        kw.update(k_scale=ks, v_scale=vs)
        if page_size is not None:
            kp, vp, table = to_pages(k8.view(torch.uint8), v8.view(torch.uint8), page_size,
                                     seed=page_size)
            caches = (kp.view(torch.float8_e4m3fn), vp.view(torch.float8_e4m3fn))
            kw["block_table"] = table
        else:
            caches = (k8, v8)
    elif page_size is not None:
        kp, vp, table = to_pages(poison_past(k, lens), poison_past(v, lens), page_size,
                                 seed=page_size)
        caches = (kp, vp)
        kw["block_table"] = table
    else:
        caches = (k, v)
    ref = reference_mods(q, kr, vr, lens, scale, window, softcap, sk)
    # the case exercises what it names: without any one of its modifiers, some row moves
    # past the tolerance
    mods = dict(window=window, softcap=softcap, sinks=sk)
    on = [("window", (-1, 0))] if window != (-1, 0) else []
    on += [("softcap", 0.0)] if softcap else []
    on += [("sinks", None)] if sk is not None else []
    for name, off in on:
        other = reference_mods(q, kr, vr, lens, scale, **{**mods, name: off})
        moved = row_errors(other[0], ref[0], dtype).max().item()
        assert moved > 2 * TOL, f"{label}: without {name}, no row moves ({moved})"
    out, lse = kvstream.decode(q, *caches, **kw)
    check_rows(q, out, lse, ref, sk, label)
    # the same call again, into a given out: the same bits
    o2 = torch.empty_like(q)
    res, lse2 = kvstream.decode(q, *caches, out=o2, **kw)
    torch.cuda.synchronize()
    assert res.data_ptr() == o2.data_ptr()
    assert torch.equal(o2, out) and torch.equal(lse2, lse), f"{label}: a second call differs"
    if q_len == 1:
        # q as [b, hq, d]: out [b, hq, d], lse [b, hq], the same rows
        out3, lse3 = kvstream.decode(q[:, 0], *caches, **kw)
        check_rows(q[:, 0], out3, lse3, reference_mods(q[:, 0], kr, vr, lens, scale, window,
                                                       softcap, sk), sk, f"{label} 3-D q")


def test_score_mods_are_part_of_the_decoder_key():
    """Shapes alike, modifiers not: one decoder each (window, softcap, sinks given or not), each
    right; new sink values reuse their decoder; a window that bounds nothing is the default's;
    the split engine's knobs are refused with any of them."""
    b, hq, hkv, d, L = 3, 16, 2, 128, 2048
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=1200)
    lens = torch.tensor([2048, 0, 300], device="cuda", dtype=torch.int32)
    scale = 3.0 / d ** 0.5
    sk = make_sinks(hq, seed=1201)
    kvstream.clear_cache()
    base = kvstream.decoder_cache_info()["captured"]
    variants = [dict(), dict(window_size=(255, 0)), dict(softcap=30.0), dict(sinks=sk),
                dict(window_size=(255, 0), softcap=30.0, sinks=sk)]
    try:
        for i, mods in enumerate(variants):
            out, lse = kvstream.decode(q, k, v, cache_seqlens=lens, softmax_scale=scale,
                                       return_lse=True, **mods)
            ref = reference_mods(q, k, v, lens, scale, mods.get("window_size", (-1, 0)),
                                 mods.get("softcap", 0.0), mods.get("sinks"))
            check_rows(q, out, lse, ref, mods.get("sinks"), f"decoder key {sorted(mods)}")
            assert kvstream.decoder_cache_info()["size"] == base + i + 1, mods
        # new sink values: the same decoder, new results
        sk2 = sk - 3.0
        out, lse = kvstream.decode(q, k, v, cache_seqlens=lens, softmax_scale=scale, sinks=sk2,
                                   return_lse=True)
        check_rows(q, out, lse, reference_mods(q, k, v, lens, scale, sinks=sk2), sk2,
                   "decoder key, new sinks")
        # one new token: window_size (-1, -1) and a left side past the capacity are the default's
        for window in ((-1, -1), (L - 1, 0), (10 * L, 5)):
            out, lse = kvstream.decode(q, k, v, cache_seqlens=lens, softmax_scale=scale,
                                       window_size=window, return_lse=True)
            check_rows(q, out, lse, reference_mods(q, k, v, lens, scale), None,
                       f"decoder key, window {window}")
        assert kvstream.decoder_cache_info()["size"] == base + len(variants)
        for mods in variants[1:]:
            for knob in (dict(engine="split"), dict(num_splits=4), dict(device_plan=True)):
                with pytest.raises(ValueError, match="persistent engine"):
                    kvstream.decode(q, k, v, cache_seqlens=lens, **mods, **knob)
        SUMMARY["checks"]["score mods in the decoder key"] = True
    finally:
        kvstream.clear_cache()


@pytest.mark.parametrize("d,paged", [(256, True), (96, False)])
def test_score_mods_graph_replay_with_new_lengths_and_sinks(d, paged):
    """A graph captured once with a window, a softcap and sinks replays with new lengths and new
    sink values (read on the device) like eager calls, and matches the reference."""
    b, L, q_len, page_size = 4, 2048, 2, 64
    hq, hkv = (16, 8) if d == 256 else (32, 16)
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=1300 + d, q_len=q_len)
    lens = torch.tensor([2048, 1, 0, 700], device="cuda", dtype=torch.int32)
    sk = make_sinks(hq, seed=1301)
    scale = 3.0 / d ** 0.5
    if paged:
        k_pool, v_pool, table = to_pages(k, v, page_size, seed=13)
        args, extra = (q, k_pool, v_pool), dict(block_table=table)
    else:
        args, extra = (q, k, v), {}
    kw = dict(cache_seqlens=lens, softmax_scale=scale, window_size=(300, 0), softcap=30.0,
              sinks=sk, **extra)
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kvstream.decode(*args, out=out, return_lse=True, **kw)   # warm-up creates the decoder
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, lse = kvstream.decode(*args, out=out, return_lse=True, **kw)
    for i, new in enumerate(([5, 2048, 301, 0], [0, 0, 0, 0], [2048] * 4)):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        sk.copy_(make_sinks(hq, seed=1400 + i))
        q.copy_(torch.randn_like(q))
        g.replay()
        eager, eager_lse = kvstream.decode(*args, return_lse=True, **kw)
        torch.cuda.synchronize()
        same = torch.equal(out, eager) and torch.equal(lse, eager_lse)
        assert same, f"d{d} replay with lengths {new} differs from the eager call"
        ref = reference_mods(q, k, v, lens, scale, (300, 0), 30.0, sk)
        check_rows(q, out, lse, ref, sk, f"mods graph d{d} paged={paged} lens={new}")
    SUMMARY["checks"][f"score mods graph replay equals eager d{d} paged={paged}"] = True


def test_store_kv_new_head_dims():
    """store_kv at d 96 and 256 writes what torch writes, byte for byte (2-byte and e4m3)."""
    for d in (96, 256):
        for fp8 in (False, True):
            b, hkv, L, tokens = 2, 4, 64, 50
            gen = torch.Generator(device="cuda").manual_seed(d + fp8)
            k = torch.randn(tokens, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
            v = torch.randn(tokens, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
            cdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
            k_cache = torch.zeros(b, L, hkv, d, device="cuda", dtype=cdt)
            v_cache = torch.zeros_like(k_cache)
            slots = torch.randperm(b * L, device="cuda")[:tokens]
            scale = torch.full((hkv,), 0.02, device="cuda") if fp8 else None
            kvstream.store_kv(k, v, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
            torch.cuda.synchronize()
            for name, rows, cache in (("k", k, k_cache), ("v", v, v_cache)):
                new = (rows.float() / 0.02).to(cdt) if fp8 else rows
                # built as bytes: [b * L, hkv, bytes per head] (index_put on bytes only)
                want = torch.zeros_like(cache).view(torch.uint8).reshape(b * L, hkv, -1)
                want[slots] = new.view(torch.uint8)
                got = cache.view(torch.uint8).reshape(b * L, hkv, -1)
                assert torch.equal(got, want), f"store_kv {name} d{d} fp8={fp8}"
    SUMMARY["checks"]["store_kv d96 and d256 equal torch's cache"] = True


# ---- MLA decode ------------------------------------------------------------------------------

def mla_reference(q, kv, lens, scale):
    """fp32 out [b, q_len, hq, 512] and lse [b, q_len, hq] of absorbed MLA over a contiguous
    latent cache kv [b, L, 576]: the decode reference with one KV head of 576 dims and V = K,
    keeping the first 512 output columns."""
    out, lse = reference(q, kv[:, :, None, :], kv[:, :, None, :], lens, scale)
    return out[..., :512], lse


@pytest.mark.parametrize(
    "b,hq,q_len,L,page,fp8",
    [(2, 16, 1, 5000, None, False), (3, 12, 2, 3000, 64, False), (2, 128, 1, 700, None, False),
     (4, 16, 8, 2000, 32, True), (1, 16, 1, 40000, None, True), (2, 8, 3, 1000, 1, False)],
)
def test_mla_matches_reference(b, hq, q_len, L, page, fp8):
    gen = torch.Generator(device="cuda").manual_seed(576 + hq + L)
    q = torch.randn(b, q_len, hq, 576, device="cuda", generator=gen).to(torch.bfloat16)
    kv = torch.randn(b, L, 576, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.tensor([L] + [int(x) for x in torch.randint(0, L + 1, (b - 1,))], device="cuda",
                        dtype=torch.int32)
    if b > 2:
        lens[1] = 0
    kw = {}
    ref_kv = kv.float()
    cache = kv
    if fp8:
        scale = torch.tensor([0.05], device="cuda")
        cache = (kv.float() / 0.05).to(torch.float8_e4m3fn)
        ref_kv = cache.float() * 0.05
        kw["kv_scale"] = scale
    if page is not None:
        pages = L // page + 1
        perm = torch.randperm(b * pages, device="cuda")
        pool = torch.zeros(b * pages, page, 576, device="cuda", dtype=cache.dtype)
        padded = torch.zeros(b, pages * page, 576, device="cuda", dtype=cache.dtype)
        padded[:, :L] = cache
        pool[perm] = padded.view(b * pages, page, 576)
        kw["block_table"] = perm.view(b, pages).to(torch.int32)
        cache = pool
    scale = 0.0722
    out, lse = kvstream.mla_decode(q, cache, softmax_scale=scale, cache_seqlens=lens,
                                   return_lse=True, **kw)
    again = kvstream.mla_decode(q, cache, softmax_scale=scale, cache_seqlens=lens, **kw)
    torch.cuda.synchronize()
    assert torch.equal(out, again), "two calls differ"
    ref_out, ref_lse = mla_reference(q, ref_kv, lens, scale)
    live = live_rows(q, lens)
    e = rel_err(out[live], ref_out[live])
    el = rel_err(lse[live], ref_lse[live])
    label = f"mla b{b} h{hq} q{q_len} L{L} page {page} fp8 {fp8}"
    SUMMARY["cases"].append({"case": label, "rel_err": e, "lse_rel_err": el})
    assert e <= TOL and el <= 1e-3, f"{label}: rel err {e}, lse rel err {el}"
    assert bool((out[~live] == 0).all()) and bool(torch.isneginf(lse[~live]).all()), label


def test_mla_graph_replay_with_skewed_lengths():
    b, hq, L = 8, 16, 16384
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, 1, hq, 576, device="cuda", generator=gen).to(torch.bfloat16)
    kv = torch.randn(b, L, 576, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.full((b,), L, device="cuda", dtype=torch.int32)
    out = torch.empty(b, 1, hq, 512, device="cuda", dtype=torch.bfloat16)
    kvstream.mla_decode(q, kv, softmax_scale=0.07, cache_seqlens=lens, out=out)  # warm-up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kvstream.mla_decode(q, kv, softmax_scale=0.07, cache_seqlens=lens, out=out)
    for i, new in enumerate(([L] + [64] * (b - 1), [0] * b, [5, L, 300, 0, 9000, 1, 2, 16000])):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        g.replay()
        eager = kvstream.mla_decode(q, kv, softmax_scale=0.07, cache_seqlens=lens)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {i}"
        ref_out, _ = mla_reference(q, kv.float(), lens, 0.07)
        live = live_rows(q, lens)
        if bool(live.any()):
            assert rel_err(out[live], ref_out[live]) <= TOL, f"replay {i}"
    SUMMARY["checks"]["MLA graph replay with skewed lengths equals eager"] = True


# ---- the torch custom ops: torch.compile, CUDA graphs, the profiler -----------------------------

def op_inputs(seed):
    """A small decode step: GQA caches with a store_kv append, and an MLA cache."""
    b, hq, hkv, d, L = 4, 32, 8, 128, 2048
    q, k, v = make(b, hq, hkv, d, L, torch.bfloat16, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    k_new = torch.randn(b, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
    v_new = torch.randn(b, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.tensor([2048, 1, 700, 1500], device="cuda", dtype=torch.int32)
    slots = (torch.arange(b, device="cuda") * L + lens.long() - 1)  # each request's last row
    qm = torch.randn(b, 1, 16, 576, device="cuda", generator=gen).to(torch.bfloat16)
    kv = torch.randn(b, 1024, 576, device="cuda", generator=gen).to(torch.bfloat16)
    return dict(q=q, k_cache=k, v_cache=v, k_new=k_new, v_new=v_new, slots=slots, lens=lens,
                out=torch.empty_like(q), qm=qm, kv=kv)


def decode_step(q, k_cache, v_cache, k_new, v_new, slots, lens, out, qm, kv):
    kvstream.store_kv(k_new, v_new, k_cache, v_cache, slots)
    o, lse = kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, return_lse=True)
    kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, window_size=(255, 0), out=out)
    m = kvstream.mla_decode(qm, kv, softmax_scale=0.07, cache_seqlens=lens.clamp(max=1024))
    return o.float() * 2, lse, out.clone(), m


def test_torch_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True)  # inductor
    for rnd, new_lens in enumerate(([2048, 1, 700, 1500], [5, 2048, 0, 1000])):
        a, b = op_inputs(77), op_inputs(77)
        a["lens"].copy_(torch.tensor(new_lens, dtype=torch.int32))
        b["lens"].copy_(a["lens"])
        want = decode_step(**a)
        got = compiled(**b)
        torch.cuda.synchronize()
        for i, (w, g) in enumerate(zip(want, got)):
            assert torch.equal(w, g), f"round {rnd}: output {i} of the compiled step differs"
        # the append went into the caches, in place, as in eager
        assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])
        assert torch.equal(a["out"], b["out"])
    ref, _ = reference(b["q"], b["k_cache"], b["v_cache"], b["lens"], 1 / 128 ** 0.5)
    assert rel_err(got[0] / 2, ref) <= TOL
    SUMMARY["checks"]["torch.compile(fullgraph) equals eager"] = True


def test_torch_compile_reduce_overhead_replays_with_new_lengths():
    # inductor's CUDA graphs (warm-up, capture, replays): each call equals the eager one
    torch._dynamo.reset()
    x = op_inputs(78)

    def step(q, k_cache, v_cache, lens):
        out, lse = kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, return_lse=True)
        return out * 1, lse

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for new_lens in ([2048, 1, 700, 1500], [1, 2, 3, 4], [2048, 0, 2047, 17], [9, 9, 9, 9]):
        x["lens"].copy_(torch.tensor(new_lens, dtype=torch.int32))
        x["q"].normal_()
        got = [t.clone() for t in compiled(x["q"], x["k_cache"], x["v_cache"], x["lens"])]
        want = step(x["q"], x["k_cache"], x["v_cache"], x["lens"])
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), new_lens
    SUMMARY["checks"]["torch.compile(reduce-overhead) replays equal eager"] = True


def test_out_op_in_cuda_graph_replays_with_new_lengths():
    x = op_inputs(79)
    q, k, v, lens, out = x["q"], x["k_cache"], x["v_cache"], x["lens"], x["out"]
    lse = torch.empty(q.shape[:-1], device="cuda", dtype=torch.float32)
    op = torch.ops.kvstream.decode_out
    op(q, k, v, out, lse, cache_seqlens=lens)  # warm-up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(q, k, v, out, lse, cache_seqlens=lens)
        # through the function, out= given: the same op, allocation-free
        kvstream.decode(q, k, v, cache_seqlens=lens, out=x["out"])
    for new in ([1, 2, 3, 4], [2048, 0, 2047, 17]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        g.replay()
        want, want_lse = kvstream.decode(q, k, v, cache_seqlens=lens, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse), new
    SUMMARY["checks"]["decode_out op in a CUDA graph replays"] = True


def test_profiler_names_the_ops():
    x = op_inputs(80)
    decode_step(**x)  # warm-up (decoders, writers)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        decode_step(**x)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    for op in ("kvstream::decode", "kvstream::decode_out", "kvstream::mla_decode",
               "kvstream::store_kv"):
        assert op in names, (op, sorted(n for n in names if "kvstream" in n))
    SUMMARY["checks"]["profiler names the ops"] = True


def test_opcheck():
    x = op_inputs(81)
    q, k, v, lens = x["q"], x["k_cache"], x["v_cache"], x["lens"]
    lse = torch.empty(q.shape[:-1], device="cuda", dtype=torch.float32)
    cases = [
        (torch.ops.kvstream.decode.default, (q, k, v), dict(cache_seqlens=lens, return_lse=True)),
        (torch.ops.kvstream.decode.default, (q[:, 0], k, v), dict(cache_seqlens=lens)),
        (torch.ops.kvstream.decode_out.default, (q, k, v, x["out"], lse), dict(cache_seqlens=lens)),
        (torch.ops.kvstream.mla_decode.default, (x["qm"], x["kv"], 0.07), dict(return_lse=True)),
        (torch.ops.kvstream.mla_decode_out.default,
         (x["qm"], x["kv"], 0.07, torch.empty(4, 1, 16, 512, device="cuda", dtype=torch.bfloat16)),
         {}),
        (torch.ops.kvstream.store_kv.default, (x["k_new"], x["v_new"], k, v, x["slots"]), {}),
    ]
    for op, args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs,
                              test_utils=("test_schema", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))
    SUMMARY["checks"]["opcheck"] = True


def test_function_checks_once_and_the_op_alone_checks(monkeypatch):
    from kvstream import _ops

    x = op_inputs(82)
    q, k, v, lens = x["q"], x["k_cache"], x["v_cache"], x["lens"]
    counts = {"function": 0, "op": 0}

    def counting(where, fn):
        def check(*a, **kw):
            counts[where] += 1
            return fn(*a, **kw)
        return check

    monkeypatch.setattr(kvstream, "_check_decode", counting("function", kvstream._check_decode))
    monkeypatch.setattr(_ops, "_check_decode", counting("op", _ops._check_decode))
    want = kvstream.decode(q, k, v, cache_seqlens=lens)
    assert counts == {"function": 1, "op": 0}  # the op took the function's check
    got, _ = torch.ops.kvstream.decode(q, k, v, lens)
    assert counts == {"function": 1, "op": 1}
    torch.cuda.synchronize()
    assert torch.equal(want, got)
    # the op called directly checks its arguments as the function does
    with pytest.raises(ValueError, match="kvstream.decode: cache_seqlens has shape"):
        torch.ops.kvstream.decode(q, k, v, lens[:3])
