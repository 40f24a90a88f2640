"""GPU tests of kvstream.decode (H100 / H200); skipped unless torch sees a CUDA device.

Correctness against torch's scaled_dot_product_attention in fp32 with per-request length
masks, LSE, CUDA graph capture and replay with new lengths, and two streams in flight at once.
If KVSTREAM_PY_GPU_SUMMARY names a file, a JSON summary of every check is written there.
"""

import json
import os
import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

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
    """fp32 out [b, 1, hq, d] and lse [b, hq]; zero-length requests give 0 and -inf."""
    b, _, hq, d = q.shape
    L, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.float().transpose(1, 2)                                  # [b, hq, 1, d]
    kf = k.float().transpose(1, 2).repeat_interleave(g, dim=1)      # [b, hq, L, d]
    vf = v.float().transpose(1, 2).repeat_interleave(g, dim=1)
    pos = torch.arange(L, device=q.device)
    mask = pos[None, :] < lens[:, None].long()                      # [b, L]
    m4 = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=m4, scale=scale)
    scores = (qf @ kf.transpose(-1, -2)).squeeze(2) * scale          # [b, hq, L]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = lens == 0
    out = torch.where(empty[:, None, None, None], torch.zeros_like(out), out)
    return out.transpose(1, 2), lse


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def make(b, hq, hkv, d, L, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float32, generator=gen).to(dtype)  # noqa: E731
    return r(b, 1, hq, d), r(b, L, hkv, d), r(b, L, hkv, d)


def check(q, k, v, lens, out, lse, scale, label):
    ref_out, ref_lse = reference(q, k, v, lens, scale)
    e = rel_err(out, ref_out)
    live = lens > 0
    el = rel_err(lse[live], ref_lse[live]) if bool(live.any()) else 0.0
    dead_ok = bool((out[~live] == 0).all()) and bool(torch.isneginf(lse[~live]).all())
    SUMMARY["cases"].append({"case": label, "rel_err": e, "lse_rel_err": el, "empty_rows_ok": dead_ok})
    assert torch.isfinite(out.float()).all(), label
    assert e <= TOL, f"{label}: rel err {e}"
    assert el <= 1e-3, f"{label}: lse rel err {el}"
    assert dead_ok, f"{label}: zero-length requests must give 0 and -inf"


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
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, hq)
    check(q, k, v, lens, out, lse, scale, f"b{b} hq{hq} hkv{hkv} d{d} L{L} {dtype}")


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
