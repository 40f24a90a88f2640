"""GPU tests of kvstream.compat.flash_attn_with_kvcache (H100 / H200); skipped unless torch
sees a CUDA device.

A seeded random grid over FlashAttention-3's options (new tokens appended or not, cache_batch_idx
on contiguous and strided caches, rotary embedding interleaved or not, paged caches, causal,
sliding windows, softcap, the LSE, fp8 caches with per-request descales) against the float64
FA3 reference of test_compat.py, row by row, and the caches after the append against the
reference's; where FlashAttention-3 itself is installed, the same calls against it. If
KVSTREAM_PY_COMPAT_SUMMARY names a file, a JSON summary of every case is written there.
"""

import importlib
import json
import os
import random
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_compat import (  # noqa: E402
    as_reference_rows,
    build_case,
    check_against_reference,
    check_caches,
    reference,
    run_case,
)

from kvstream.compat import flash_attn_with_kvcache  # noqa: E402

SUMMARY = {"cases": []}


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    path = os.environ.get("KVSTREAM_PY_COMPAT_SUMMARY")
    if path:
        SUMMARY["device"] = torch.cuda.get_device_name(0)
        SUMMARY["max_rel_err"] = max((c["rel_err"] for c in SUMMARY["cases"]), default=None)
        with open(path, "w") as f:
            json.dump(SUMMARY, f, indent=1)


def gpu_case(rng, **over):
    """One random combination of FA3's options at decode sizes (keys as test_compat's cases)."""
    d = rng.choice([64, 128, 128, 96, 256])
    hkv = rng.choice([1, 2, 4, 8])
    s_q = rng.choice([1, 1, 2, 4, 8])
    s_new = rng.choice([0, 1, s_q, s_q, 5])
    c = dict(
        dtype=rng.choice([torch.bfloat16, torch.float16]), d=d, hkv=hkv,
        hq=hkv * rng.choice([1, 2, 4, 8]), b=rng.choice([1, 2, 3, 4, 6]), s_q=s_q, s_new=s_new,
        layout=rng.choice(["contiguous", "batch_idx", "batch_idx_strided", "paged"]),
        fp8=rng.random() < 0.3,
        rotary=rng.choice([None, "interleaved", "neox"]) if s_new else None,
        rotary_dim=rng.choice([d, d // 2]), causal=rng.random() < 0.5,
        window=rng.choice([(-1, -1), (-1, -1), (127, 0), (64, 3), (300, -1), (-1, 2)]),
        softcap=rng.choice([0.0, 0.0, 30.0]), int_lens=rng.random() < 0.2,
        page_size=rng.choice([1, 16, 64]), L=rng.choice([512, 1000, 2048, 777]),
        scale=rng.choice([None, 3.0 / d ** 0.5]), seed=rng.randrange(1 << 30),
        lse=rng.random() < 0.7, leftpad=rng.random() < 0.15, rotary_lens=rng.random() < 0.2,
        varlen=rng.random() < 0.15, varlen_k=rng.random() < 0.15,
        chunk=rng.choice([0] * 8 + [128, 333]),
    )
    c.update(over)
    return c


def record(label, err):
    SUMMARY["cases"].append({"case": label, "rel_err": err})


GPU_CASES = 64


@pytest.mark.parametrize("i", range(GPU_CASES))
def test_random_options_match_fa3_reference(i):
    c = gpu_case(random.Random(9000 + i))
    kw, label = build_case(c, torch, "cuda")
    record(label, run_case(kw, label))


# Cases the grid may miss: each names what it pins down.
FIXED = {
    # fp8 cache, cache_batch_idx, an odd capacity: read in place as a pool of 1-position pages
    "fp8 batch_idx odd capacity": dict(fp8=True, layout="batch_idx", L=777, s_new=2, s_q=2,
                                       rotary="neox", causal=True),
    # fp8, a strided cache with cache_batch_idx: gathered
    "fp8 batch_idx strided": dict(fp8=True, layout="batch_idx_strided", L=1000, s_new=1, s_q=1,
                                  rotary="interleaved", window=(127, 0)),
    # a batch that fills the GPU (the persistent engine) with the usual decode step
    "full batch decode step": dict(b=48, hq=32, hkv=8, d=128, L=4096, s_q=1, s_new=1,
                                   layout="contiguous", rotary="neox", rotary_dim=128,
                                   causal=True, fp8=False, window=(-1, -1)),
    # eight new tokens appended and attended, causal, in a window, paged
    "eight tokens paged window": dict(s_q=8, s_new=8, layout="paged", page_size=16,
                                      causal=True, window=(200, 0), fp8=False),
    # non-causal multi-token: the new tokens see each other; q at a fixed rotary position
    "non-causal multi-token rotary": dict(s_q=4, s_new=4, layout="contiguous", causal=False,
                                          window=(-1, -1), rotary="interleaved", fp8=False),
    # fp8 paged with per-request descales and softcap
    "fp8 paged softcap": dict(fp8=True, layout="paged", page_size=64, softcap=30.0,
                              scale=3.0 / 128 ** 0.5, d=128, s_new=3, s_q=2),
    # no append, the whole capacity (cache_seqlens None is the default's)
    "no append int lengths": dict(s_new=0, int_lens=True, rotary=None, layout="batch_idx"),
    # keys from a start per request (one-position pages over a pool), a window on top
    "leftpad paged window": dict(leftpad=True, layout="paged", page_size=16, s_new=2, s_q=2,
                                 causal=True, window=(127, 0), chunk=0, varlen=False,
                                 varlen_k=False),
    # SGLang's call: packed queries and new tokens of varying counts
    "varlen q and k": dict(varlen=True, varlen_k=True, layout="batch_idx", s_q=4, s_new=4,
                           causal=True, rotary="neox", chunk=0, leftpad=False),
    # Llama 4's chunked attention over a few chunks, fp8, paged
    "chunked attention": dict(chunk=256, s_q=4, s_new=4, layout="paged", page_size=64,
                              causal=True, fp8=True, L=2048, varlen=False, varlen_k=False),
    # rotary positions from rotary_seqlens
    "rotary_seqlens": dict(rotary="interleaved", rotary_lens=True, s_new=1, s_q=1, chunk=0),
}


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_cases_match_fa3_reference(name):
    c = gpu_case(random.Random(sum(map(ord, name))), **FIXED[name])
    kw, label = build_case(c, torch, "cuda")
    record(f"{name}: {label}", run_case(kw, f"{name}: {label}"))


def test_whole_capacity_without_cache_seqlens():
    """cache_seqlens None and no new tokens: every request attends to its whole cache row."""
    c = gpu_case(random.Random(77), s_new=0, rotary=None, layout="batch_idx", fp8=False)
    kw, label = build_case(c, torch, "cuda")
    kw.pop("cache_seqlens")
    record(f"no cache_seqlens: {label}", run_case(kw, f"no cache_seqlens: {label}"))


def test_graph_capture_replays_append_and_decode():
    """The whole call (rotary, slots, store_kv, decode) captured once after a warm-up and
    replayed with new lengths, new tokens and new queries: each replay equals the eager call."""
    b, s, hq, hkv, d, L = 4, 1, 32, 8, 128, 2048
    gen = torch.Generator(device="cuda").manual_seed(3)
    r = lambda *sh: torch.randn(*sh, device="cuda", generator=gen).bfloat16()  # noqa: E731
    q, kn, vn = r(b, s, hq, d), r(b, s, hkv, d), r(b, s, hkv, d)
    kc, vc = r(b, L, hkv, d), r(b, L, hkv, d)
    ang = torch.arange(L + 8, device="cuda").float()[:, None] / (
        10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))[None, :]
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    lens = torch.tensor([0, 100, 2000, 1500], device="cuda", dtype=torch.int32)
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, causal=True,
              rotary_interleaved=False)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, **kw)  # warm-up
    torch.cuda.current_stream().wait_stream(st)
    kg, vg = kc.clone(), vc.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flash_attn_with_kvcache(q, kg, vg, kn, vn, **kw)
    for new in ([1, 2, 3, 4], [2047, 0, 17, 1000]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(r(b, s, hq, d))
        kn.copy_(r(b, s, hkv, d))
        vn.copy_(r(b, s, hkv, d))
        ke, ve = kg.clone(), vg.clone()
        g.replay()
        eager = flash_attn_with_kvcache(q, ke, ve, kn, vn, **kw)
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(kg, ke) and torch.equal(vg, ve), new


# ---- against FlashAttention-3 itself, where it is installed -----------------------------------

def _fa3():
    for module in ("flash_attn_interface", "fa3_fwd_interface"):
        try:
            return importlib.import_module(module).flash_attn_with_kvcache
        except Exception:  # noqa: BLE001 (absent, or built for another torch)
            continue
    return None


FA3 = _fa3()


@pytest.mark.skipif(FA3 is None, reason="FlashAttention-3 is not installed")
@pytest.mark.parametrize("i", range(24))
def test_same_call_as_flashattention3(i):
    """The same call through FA3 and through kvstream.compat: outputs, LSEs of the rows that see
    a position and the appended caches agree (bf16 caches, no attention chunks: the options
    every FA3 build has; the fa3-fwd wheel is built without local attention)."""
    rng = random.Random(12000 + i)
    c = gpu_case(rng, dtype=torch.bfloat16, fp8=False, window=(-1, -1), chunk=0,
                 layout=rng.choice(["contiguous", "batch_idx", "batch_idx_strided"]))
    kw, label = build_case(c, torch, "cuda")

    def copy(cache):  # the same values in the same layout (a strided slice stays one)
        if cache.is_contiguous():
            return cache.clone()
        return torch.empty_like(cache._base)[:, : cache.shape[1]].copy_(cache)

    fa_kw = dict(kw, k_cache=copy(kw["k_cache"]), v_cache=copy(kw["v_cache"]))
    assert fa_kw["k_cache"].stride() == kw["k_cache"].stride()
    ref = reference(kw)
    theirs = FA3(**fa_kw)
    ours = flash_attn_with_kvcache(**kw)
    if kw["return_softmax_lse"]:
        (fa_out, fa_lse), (out, lse) = theirs[:2], ours
    else:
        fa_out, fa_lse, out, lse = theirs, None, ours, None
    q, out, lse = as_reference_rows(kw, out, lse)
    _, fa_out, fa_lse = as_reference_rows(kw, fa_out, fa_lse)
    err = check_against_reference(out, lse, ref, q, f"kvstream {label}")
    # FA3 against the same reference (which checks the reference too); FA3 gives +inf as the
    # LSE of a row that sees nothing, so only the live rows' LSEs are compared
    live = ref[2]
    fa_lse_live = None if fa_lse is None else torch.where(live[:, None, :], fa_lse,
                                                          torch.full_like(fa_lse, float("-inf")))
    fa_err = check_against_reference(fa_out, fa_lse_live, ref, q, f"FA3 {label}")
    rotary = kw.get("rotary_cos") is not None
    check_caches(kw["k_cache"], fa_kw["k_cache"], rotary, f"{label} k_cache vs FA3")
    check_caches(kw["v_cache"], fa_kw["v_cache"], rotary, f"{label} v_cache vs FA3")
    record(f"vs FA3: {label}", err)
    SUMMARY["cases"][-1]["fa3_rel_err"] = fa_err
