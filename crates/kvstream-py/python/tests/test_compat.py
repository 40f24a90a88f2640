"""CPU tests of kvstream.compat.flash_attn_with_kvcache (FlashAttention-3's KV-cache call).

Without torch or a GPU: FA3's signature, every argument kvstream cannot honour refused with
NotImplementedError naming it (also where torch cannot be imported), and the argument checks,
on fake tensors. With torch (on the CPU): the mapping from FA3's arguments to kvstream.store_kv
and kvstream.decode, which are replaced here by torch implementations of their documented
semantics, against an FA3 reference (`fa3_reference`, also used by test_compat_gpu.py).
"""

import inspect
import random
import subprocess
import sys

import pytest

import kvstream
from kvstream import compat
from kvstream.compat import flash_attn_with_kvcache

FN = flash_attn_with_kvcache


from fakes import BF16, E4M3, E5M2, F16, F32, I32, I64, FakeDevice, FakeDType, FakeTensor  # noqa: F401


B, S, L, HQ, HKV, D = 2, 1, 256, 16, 2, 128


def good(**over):
    args = dict(
        q=FakeTensor((B, S, HQ, D)),
        k_cache=FakeTensor((B, L, HKV, D)),
        v_cache=FakeTensor((B, L, HKV, D)),
    )
    args.update(over)
    return args


def fails(exc, *words, **over):
    with pytest.raises(exc) as e:
        FN(**good(**over))
    msg = str(e.value)
    assert msg.startswith("kvstream.compat.flash_attn_with_kvcache: "), msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


# FA3's flash_attn_with_kvcache (hopper/flash_attn_interface.py): names and defaults, in order.
FA3_PARAMETERS = [
    ("q", inspect.Parameter.empty),
    ("k_cache", inspect.Parameter.empty),
    ("v_cache", inspect.Parameter.empty),
    ("k", None),
    ("v", None),
    ("qv", None),
    ("rotary_cos", None),
    ("rotary_sin", None),
    ("cache_seqlens", None),
    ("cache_batch_idx", None),
    ("cache_leftpad", None),
    ("page_table", None),
    ("cu_seqlens_q", None),
    ("cu_seqlens_k_new", None),
    ("max_seqlen_q", None),
    ("rotary_seqlens", None),
    ("q_descale", None),
    ("k_descale", None),
    ("v_descale", None),
    ("softmax_scale", None),
    ("causal", False),
    ("window_size", (-1, -1)),
    ("attention_chunk", 0),
    ("softcap", 0.0),
    ("rotary_interleaved", True),
    ("scheduler_metadata", None),
    ("num_splits", 0),
    ("pack_gqa", None),
    ("sm_margin", 0),
    ("return_softmax_lse", False),
]


def test_signature_is_fa3s():
    params = list(inspect.signature(FN).parameters.values())
    assert [(p.name, p.default) for p in params] == FA3_PARAMETERS
    # all positional-or-keyword, as FA3's: positional calls bind the same way
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    assert compat.__all__ == ["flash_attn_with_kvcache"]
    assert "NotImplementedError" in FN.__doc__


def test_import_needs_no_torch():
    code = "import sys, kvstream.compat; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


# Each argument kvstream cannot honour, a value FA3 would take, and the words of the error.
UNSUPPORTED = [
    ("qv", FakeTensor((B, S, HQ, D)), ["qv"]),
    ("q_descale", FakeTensor((B, HKV), F32), ["q_descale"]),
    ("sm_margin", 4, ["sm_margin=4"]),
]


@pytest.mark.parametrize("name,value,words", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_argument_raises_naming_it(name, value, words):
    fails(NotImplementedError, *words, "not supported", **{name: value})
    # refused before anything else is looked at
    with pytest.raises(NotImplementedError, match=words[0]):
        FN(None, None, None, **{name: value})


def test_unsupported_arguments_raise_without_torch():
    # where torch cannot be imported (CI may have it): the same refusals, torch never imported
    block = (
        "import sys\n"
        "class _NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, _NoTorch())\n"
    )
    code = block + (
        "from kvstream.compat import flash_attn_with_kvcache as f\n"
        "names = ['qv', 'q_descale']\n"
        "kw = {n: object() for n in names}\n"
        "kw.update(sm_margin=2)\n"
        "seen = []\n"
        "for n, val in kw.items():\n"
        "    try:\n"
        "        f(None, None, None, **{n: val})\n"
        "    except NotImplementedError as e:\n"
        "        assert n in str(e), e\n"
        "        seen.append(n)\n"
        "print(len(seen), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "3 False", out


def test_unsupported_shapes_and_combinations():
    fails(NotImplementedError, "cache_batch_idx", "page_table[cache_batch_idx]",
          cache_batch_idx=FakeTensor((B,), I32), page_table=FakeTensor((B, 4), I32),
          k_cache=FakeTensor((32, 64, HKV, D)), v_cache=FakeTensor((32, 64, HKV, D)))
    fails(NotImplementedError, "q of dtype torch.float8_e4m3fn",
          q=FakeTensor((B, S, HQ, D), E4M3), k_cache=FakeTensor((B, L, HKV, D), E4M3),
          v_cache=FakeTensor((B, L, HKV, D), E4M3))
    fails(NotImplementedError, "q of dtype torch.float8_e5m2", q=FakeTensor((B, S, HQ, D), E5M2))
    fails(NotImplementedError, "seqlen_q = 9", "1..8", q=FakeTensor((B, 9, HQ, D)))
    fails(NotImplementedError, "headdim 192", q=FakeTensor((B, S, HQ, 192)),
          k_cache=FakeTensor((B, L, HKV, 192)), v_cache=FakeTensor((B, L, HKV, 192)))
    fails(NotImplementedError, "v_cache with headdim 64", v_cache=FakeTensor((B, L, HKV, 64)))
    fails(NotImplementedError, "64 query heads per KV head", q=FakeTensor((B, S, 64, D)),
          k_cache=FakeTensor((B, L, 1, D)), v_cache=FakeTensor((B, L, 1, D)))
    fails(NotImplementedError, "page_table", "page_block_size 3",
          page_table=FakeTensor((B, 4), I32), k_cache=FakeTensor((32, 3, HKV, D)),
          v_cache=FakeTensor((32, 3, HKV, D)))


def test_bad_arguments():
    T = FakeTensor
    fails(ValueError, "q", "[batch, seqlen_q, nheads, headdim]", q=T((B, HQ, D)))
    fails(ValueError, "batch >= 1", q=T((0, S, HQ, D)))
    fails(TypeError, "softmax_scale must be a float or None", softmax_scale="0.1")
    fails(ValueError, "softmax_scale is -0.1", softmax_scale=-0.1)
    fails(TypeError, "q", "torch.float32", q=T((B, S, HQ, D), F32))
    fails(TypeError, "q must be a torch.Tensor", q=[1, 2])
    fails(ValueError, "k_cache / v_cache", "4 dimensions", k_cache=T((B, L, D)))
    fails(ValueError, "v_cache has shape", v_cache=T((B, L - 1, HKV, D)))
    fails(ValueError, "nheads a multiple of nheads_k", q=T((B, S, 15, D)))
    fails(TypeError, "k_cache", "torch.float16", k_cache=T((B, L, HKV, D), F16),
          v_cache=T((B, L, HKV, D), F16))
    fails(ValueError, "batch_size_cache 3", k_cache=T((3, L, HKV, D)), v_cache=T((3, L, HKV, D)))
    fails(ValueError, "page_table", "[2, max_num_blocks_per_seq]", page_table=T((3, 4), I32),
          k_cache=T((32, 16, HKV, D)), v_cache=T((32, 16, HKV, D)))
    # k / v: together, shaped [b, seqlen_new, hkv, d], q's dtype, with cache_seqlens
    lens = T((B,), I32)
    fails(ValueError, "k and v go together", k=T((B, 1, HKV, D)), cache_seqlens=lens)
    fails(ValueError, "k / v have shapes", k=T((B, 1, HQ, D)), v=T((B, 1, HQ, D)),
          cache_seqlens=lens)
    fails(TypeError, "v has dtype", k=T((B, 1, HKV, D)), v=T((B, 1, HKV, D), F16),
          cache_seqlens=lens)
    fails(ValueError, "without cache_seqlens", k=T((B, 1, HKV, D)), v=T((B, 1, HKV, D)))
    # cache_seqlens / cache_batch_idx: int32 [b]
    fails(TypeError, "cache_seqlens", "torch.int64", cache_seqlens=T((B,), I64))
    fails(ValueError, "cache_seqlens", "[2]", cache_seqlens=T((B, 1), I32))
    fails(TypeError, "cache_seqlens must be a torch.Tensor", cache_seqlens=1.5)
    fails(ValueError, "cache_seqlens is 257", "0..256", cache_seqlens=L + 1)
    fails(ValueError, "cache_seqlens is -1", cache_seqlens=-1)
    fails(TypeError, "cache_batch_idx", "torch.int64", cache_batch_idx=T((B,), I64))
    fails(ValueError, "cache_batch_idx", cache_batch_idx=T((B + 1,), I32))
    # rotary: both tables, with k / v, [seqlen_ro, rotary_dim / 2]
    kv = dict(k=T((B, 1, HKV, D)), v=T((B, 1, HKV, D)), cache_seqlens=lens)
    fails(ValueError, "rotary_cos and rotary_sin go together", rotary_cos=T((L, 32)), **kv)
    fails(ValueError, "without k / v", rotary_cos=T((L, 32)), rotary_sin=T((L, 32)))
    fails(ValueError, "rotary_cos / rotary_sin have shapes", rotary_cos=T((L, 32)),
          rotary_sin=T((L, 16)), **kv)
    fails(ValueError, "rotary_dim <= headdim", rotary_cos=T((L, D)), rotary_sin=T((L, D)), **kv)
    fails(TypeError, "rotary_sin has dtype", rotary_cos=T((L, 32)), rotary_sin=T((L, 32), F16),
          **kv)
    # descales belong to fp8 caches, shaped as FA3's [b, hkv] (or kvstream's [1] / [hkv])
    fails(ValueError, "k_descale is given for torch.bfloat16 caches", k_descale=T((B, HKV), F32))
    f8 = dict(k_cache=T((B, L, HKV, D), E4M3), v_cache=T((B, L, HKV, D), E4M3))
    fails(ValueError, "v_descale has shape [3]", v_descale=T((3,), F32), **f8)
    # flags and knobs
    fails(TypeError, "causal must be a bool", causal=1)
    fails(TypeError, "rotary_interleaved must be a bool", rotary_interleaved=None)
    fails(TypeError, "return_softmax_lse must be a bool", return_softmax_lse="yes")
    fails(TypeError, "window_size", window_size=(1, 2, 3))
    fails(TypeError, "window_size", window_size=(1.0, 0))
    fails(ValueError, "window_size", window_size=(2**31, 0))
    fails(TypeError, "softcap must be a float", softcap="30")
    fails(ValueError, "softcap is inf", softcap=float("inf"))
    fails(TypeError, "num_splits must be an int", num_splits=None)
    fails(TypeError, "pack_gqa must be a bool or None", pack_gqa=1)
    fails(TypeError, "attention_chunk must be an int", attention_chunk=None)
    fails(ValueError, "attention_chunk is -8", attention_chunk=-8)
    fails(TypeError, "sm_margin must be an int", sm_margin=0.0)


def test_valid_fake_call_gets_past_the_checks():
    # every check passes: then the call needs torch (absent: ImportError; present: the fake
    # tensors fail in torch or kvstream, never with one of compat's own messages)
    try:
        FN(**good(num_splits=7, pack_gqa=True, causal=True, window_size=(100, -1), softcap=-1.0))
    except Exception as e:  # noqa: BLE001
        assert not str(e).startswith("kvstream.compat"), e


# ---- with torch on the CPU: the mapping onto store_kv and decode ----------------------------


def _rope_reference(x, cos, sin, pos, interleaved):
    """x [b, s, h, d] rotated at positions pos [b, s] through complex products in float32
    (independent of compat's arithmetic), rounded back to x's dtype."""
    import torch

    half = cos.shape[1]
    rd = 2 * half
    at = pos.clamp(0, cos.shape[0] - 1).long()
    rot = torch.complex(cos[at].float(), sin[at].float())[:, :, None, :]   # [b, s, 1, half]
    xr = x[..., :rd].float()
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], half, 2).contiguous())
        y = torch.view_as_real(z * rot).reshape(xr.shape)
    else:
        z = torch.complex(xr[..., :half], xr[..., half:])
        w = z * rot
        y = torch.cat((w.real, w.imag), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., rd:]), dim=-1)


def take(cache, index):
    """cache[index] (pages of a pool; fp8 caches indexed as bytes)."""
    import torch

    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[index.long()].view(cache.dtype)
    return cache[index.long()]


def _quantise(x, scale):
    """x (any float) divided by scale and rounded to e4m3 with saturation (store_kv's)."""
    import torch

    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def fa3_reference(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                  cache_seqlens=None, cache_batch_idx=None, page_table=None, k_descale=None,
                  v_descale=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                  softcap=0.0, rotary_interleaved=True, cache_leftpad=None,
                  rotary_seqlens=None, attention_chunk=0):
    """FlashAttention-3's flash_attn_with_kvcache, written from its documentation and its
    flash_api.cpp, in float64 over the caches it appends to (copies). ``cache_leftpad``: keys
    before it are not attended and the window counts from there (FA3's test reference shifts
    the key positions by it and counts the keys left); the rotary positions stay the cache's.
    ``rotary_seqlens``: the rotary positions count from these instead of cache_seqlens.
    ``attention_chunk``: a query at (shifted) position p sees no key before p - p % chunk.

    Returns (out [b, s_q, h, d] float64, lse [b, h, s_q] float64 (-inf where a row sees
    nothing), live [b, s_q] bool, k_cache, v_cache after the append).
    """
    import torch

    dev = q.device
    b, s_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    kc, vc = k_cache.clone(), v_cache.clone()
    fp8 = kc.dtype == torch.float8_e4m3fn
    paged = page_table is not None
    cap = page_table.shape[1] * kc.shape[1] if paged else kc.shape[1]
    if cache_seqlens is None:
        lens0 = torch.full((b,), cap, dtype=torch.long, device=dev)
    elif isinstance(cache_seqlens, int):
        lens0 = torch.full((b,), cache_seqlens, dtype=torch.long, device=dev)
    else:
        lens0 = cache_seqlens.long()
    s_new = 0 if k is None else k.shape[1]
    # flash_api.cpp: sides that bound nothing dropped, then causal sets the right side to 0;
    # the kernel rotates q at its own positions when causal or local
    left, right = window_size
    left = -1 if left < 0 or left >= cap - 1 else left
    right = -1 if right < 0 or right >= s_q - 1 else right
    if causal:
        right = 0
    own_positions = left >= 0 or right >= 0
    if rotary_cos is not None:
        start = (lens0 if rotary_seqlens is None else rotary_seqlens.long())[:, None]
        steps = torch.arange(s_q, device=dev)
        qpos = start + (steps if own_positions else 0 * steps)
        q = _rope_reference(q, rotary_cos, rotary_sin, qpos, rotary_interleaved)
        k = _rope_reference(k, rotary_cos, rotary_sin, start + torch.arange(s_new, device=dev),
                            rotary_interleaved)

    def scale_of(sc, r):
        if sc is None:
            return torch.ones(hkv, dtype=torch.float32, device=dev)
        return sc[r] if sc.dim() == 2 else sc.float().reshape(-1).expand(hkv)

    for r in range(b):
        row = r if cache_batch_idx is None else int(cache_batch_idx[r])
        for i in range(s_new):
            p = int(lens0[r]) + i
            if paged:
                if p // kc.shape[1] >= page_table.shape[1]:
                    continue
                where = (int(page_table[r, p // kc.shape[1]]), p % kc.shape[1])
            else:
                if p >= kc.shape[1]:
                    continue
                where = (row, p)
            for cache, new, sc in ((kc, k, k_descale), (vc, v, v_descale)):
                if fp8:
                    val = _quantise(new[r, i], scale_of(sc, r)[:, None])
                    cache.view(torch.uint8)[where] = val.view(torch.uint8)
                else:
                    cache[where] = new[r, i]
    seqlen_k = lens0 + s_new
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    outs, lses, lives = [], [], []
    for r in range(b):
        row = r if cache_batch_idx is None else int(cache_batch_idx[r])
        if paged:
            K = take(kc, page_table[r]).reshape(-1, hkv, d)
            V = take(vc, page_table[r]).reshape(-1, hkv, d)
        else:
            K, V = kc[row], vc[row]
        K = K.double() * scale_of(k_descale, r).double()[None, :, None]
        V = V.double() * scale_of(v_descale, r).double()[None, :, None]
        n = K.shape[0]
        qd = q[r].double().reshape(s_q, hkv, g, d)                  # [s, hkv, g, d]
        sc = torch.einsum("shgd,nhd->hgsn", qd, K) * scale          # [hkv, g, s, n]
        if softcap > 0:
            sc = softcap * torch.tanh(sc / softcap)
        j = torch.arange(n, device=dev)[None, :]
        p = (torch.arange(s_q, device=dev) + seqlen_k[r] - s_q)[:, None]   # [s, 1]
        seen = j < seqlen_k[r]
        pad = int(cache_leftpad[r]) if cache_leftpad is not None else 0
        if cache_leftpad is not None:
            seen = seen & (j >= pad)
        if attention_chunk > 0:
            at = p - pad
            seen = seen & (j - pad >= at - at.remainder(attention_chunk))
        if left >= 0:
            seen = seen & (j >= p - left)
        if right >= 0:
            seen = seen & (j <= p + right)
        sc = sc.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)                            # [hkv, g, s]
        shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        o = torch.einsum("hgsn,nhd->shgd", torch.exp(sc - shift[..., None]), V)
        outs.append(o.reshape(s_q, hq, d))
        lses.append(lse.reshape(hq, s_q))
        lives.append(seen.any(dim=-1))
    return torch.stack(outs), torch.stack(lses), torch.stack(lives), kc, vc


def row_errors(got, want, dtype):
    """Relative error of each row (last dimension) of got against float64 want; rows of want
    below dtype's smallest normal (times sqrt(d)) are measured against that floor."""
    import torch

    d = want.shape[-1]
    g = got.double().reshape(-1, d)
    w = want.double().reshape(-1, d)
    floor = torch.finfo(dtype).tiny * d ** 0.5
    return (g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(floor)


def check_against_reference(out, lse, ref, q, label, tol=1e-2):
    """out / lse of flash_attn_with_kvcache against fa3_reference's: each row that sees a
    position within tol (relative), its LSE within 1e-3; each row that sees none 0 and -inf."""
    import torch

    ref_out, ref_lse, live, _, _ = ref
    b, s_q, hq, d = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype, label
    assert bool(torch.isfinite(out.float()).all()), f"{label}: out holds NaN or inf"
    rows = live[:, :, None].expand(b, s_q, hq).reshape(-1)
    rel = row_errors(out, ref_out, q.dtype)
    worst = rel[rows].max().item() if bool(rows.any()) else 0.0
    assert worst <= tol, f"{label}: worst row relative error {worst}"
    dead = ~rows
    assert bool((out.reshape(-1, d)[dead] == 0).all()), f"{label}: rows that see nothing are not 0"
    if lse is not None:
        assert lse.shape == (b, hq, s_q) and lse.dtype == torch.float32, label
        lse_rows = live[:, None, :].expand(b, hq, s_q)
        if bool(lse_rows.any()):
            e = (lse.double() - ref_lse)[lse_rows].abs().max().item()
            assert e <= 1e-3, f"{label}: worst lse error {e}"
        assert bool(torch.isneginf(lse[~lse_rows]).all()), f"{label}: empty rows' lse is not -inf"
    return worst


def check_caches(got, want, rotary, label):
    """A cache after the append against the reference's: the same bytes without rotary; with it
    the appended rows may differ by a rounding step (float32 arithmetic in another order)."""
    import torch

    if not rotary:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{label}: cache differs"
        return
    g, w = got.float(), want.float()
    # one bf16 / fp16 step, or one e4m3 step (3 mantissa bits) for fp8 caches
    rtol = 0.13 if got.dtype == torch.float8_e4m3fn else 2.0 ** -6
    ok = (g - w).abs() <= rtol * w.abs() + 2.0 ** -9
    assert bool(ok.all()), f"{label}: {int((~ok).sum())} cache values differ"


def _kvstream_decode_on_torch(calls):
    """kvstream.decode's documented semantics in torch float64 (contiguous or paged caches,
    window, softcap, fp8 scales); records each call's keyword arguments in `calls`."""
    import torch

    def decode(q, k_cache, v_cache, **kw):
        calls.append(kw)
        allowed = {"cache_seqlens", "block_table", "softmax_scale", "window_size", "softcap",
                   "k_scale", "v_scale", "return_lse"}
        assert set(kw) <= allowed, set(kw) - allowed
        assert q.is_contiguous() and q.dim() == 4
        b, s, hq, d = q.shape
        hkv = k_cache.shape[2]
        table = kw.get("block_table")
        if table is not None:
            assert table.dtype == torch.int32 and table.is_contiguous() and table.shape[0] == b
            K = take(k_cache, table).reshape(b, -1, hkv, d)
            V = take(v_cache, table).reshape(b, -1, hkv, d)
        else:
            assert k_cache.shape[0] == b
            K, V = k_cache, v_cache

        def widen(x, sc):
            x = x.double()
            if sc is None:
                return x
            sc = sc.double()
            if sc.dim() == 2:
                return x * sc[:, None, :, None]
            return x * sc.reshape(-1)[None, None, :, None]

        K, V = widen(K, kw.get("k_scale")), widen(V, kw.get("v_scale"))
        n = K.shape[1]
        lens = kw.get("cache_seqlens")
        if lens is None:
            lens = torch.full((b,), n, dtype=torch.int32)
        assert lens.dtype == torch.int32 and lens.shape == (b,)
        left, right = kw.get("window_size", (-1, 0))
        cap = kw.get("softcap", 0.0)
        scale = kw.get("softmax_scale") or d ** -0.5
        g = hq // hkv
        qd = q.double().reshape(b, s, hkv, g, d)
        sc = torch.einsum("bshgd,bnhd->bhgsn", qd, K) * scale
        if cap:
            sc = cap * torch.tanh(sc / cap)
        t = lens.long()[:, None] - s + torch.arange(s)[None, :]     # [b, s]
        j = torch.arange(n)[None, None, :]
        seen = j < lens.long()[:, None, None]
        if left >= 0:
            seen = seen & (j >= t[:, :, None] - left)
        if right >= 0:
            seen = seen & (j <= t[:, :, None] + right)
        sc = sc.masked_fill(~seen[:, None, None], float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)                             # [b, hkv, g, s]
        shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        o = torch.einsum("bhgsn,bnhd->bshgd", torch.exp(sc - shift[..., None]), V)
        out = o.reshape(b, s, hq, d).to(q.dtype)
        lse = lse.permute(0, 3, 1, 2).reshape(b, s, hq).float()
        return (out, lse) if kw.get("return_lse") else out

    return decode


def _kvstream_store_kv_on_torch(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None,
                                v_scale=None):
    """kvstream.store_kv's documented semantics: token i to block slot // block_size, row
    slot % block_size; slots of -1 or outside the cache skipped; fp8 caches quantised with
    scales [1], [hkv] or [blocks, hkv]."""
    import torch

    assert k.is_contiguous() and k.dim() == 3 and slot_mapping.dtype == torch.int64
    blocks, bs, hkv, d = k_cache.shape
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0 or slot >= blocks * bs:
            continue
        blk, row = divmod(slot, bs)
        for cache, new, sc in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
            if fp8:
                if sc is None:
                    s = torch.ones(hkv)
                else:
                    s = sc[blk] if sc.dim() == 2 else sc.reshape(-1).expand(hkv)
                cache.view(torch.uint8)[blk, row] = _quantise(new[i], s[:, None]).view(torch.uint8)
            else:
                assert sc is None
                cache[blk, row] = new[i]


def _cpu_case(rng, torch):
    """One random combination of FA3's options on small CPU tensors."""
    dtype = rng.choice([torch.bfloat16, torch.float16])
    d = rng.choice([64, 128])
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 2, 4])
    b = rng.choice([1, 2, 3])
    s_q = rng.choice([1, 2, 4])
    s_new = rng.choice([0, 0, 1, s_q, 3])
    layout = rng.choice(["contiguous", "batch_idx", "batch_idx_strided", "paged"])
    fp8 = rng.random() < 0.3
    rotary = rng.choice([None, "interleaved", "neox"]) if s_new else None
    return dict(dtype=dtype, d=d, hkv=hkv, hq=hq, b=b, s_q=s_q, s_new=s_new, layout=layout,
                fp8=fp8, rotary=rotary, rotary_dim=rng.choice([d, d // 2]),
                causal=rng.random() < 0.5,
                window=rng.choice([(-1, -1), (-1, -1), (20, 0), (9, 2), (30, -1), (-1, 1)]),
                softcap=rng.choice([0.0, 0.0, 5.0]), int_lens=rng.random() < 0.2,
                page_size=rng.choice([4, 16]), L=rng.choice([48, 64, 67]),
                scale=rng.choice([None, 0.3]), seed=rng.randrange(1 << 30),
                lse=rng.random() < 0.7, leftpad=rng.random() < 0.3,
                rotary_lens=rng.random() < 0.4, varlen=rng.random() < 0.3,
                varlen_k=rng.random() < 0.3, chunk=rng.choice([0, 0, 0, 8, 21]))


def build_case(c, torch, device):
    """Tensors of one case: (kwargs for flash_attn_with_kvcache, description)."""
    gen = torch.Generator(device=device).manual_seed(c["seed"])

    def rand(*shape, dtype=None):
        return torch.randn(*shape, generator=gen, device=device).to(dtype or c["dtype"])

    b, s_q, hq, hkv, d, s_new = c["b"], c["s_q"], c["hq"], c["hkv"], c["d"], c["s_new"]
    L = c["L"]
    layout = c["layout"]
    if layout == "paged":
        ps = c["page_size"]
        L = -(-L // ps) * ps
    q = rand(b, s_q, hq, d)
    kw = dict(q=q, causal=c["causal"], window_size=c["window"], softcap=c["softcap"],
              softmax_scale=c["scale"], return_softmax_lse=c["lse"])
    # cached lengths that leave room for the new tokens: an empty one, a full one, random
    lens = torch.randint(0, L - s_new + 1, (b,), generator=gen, device=device)
    lens[0] = 0
    if b > 1:
        lens[-1] = L - s_new
    rows = b
    if layout == "paged":
        per = L // ps
        pages = b * per + 3
        k_cache, v_cache = rand(pages, ps, hkv, d), rand(pages, ps, hkv, d)
        perm = torch.randperm(pages, generator=gen, device=device)[: b * per]
        kw["page_table"] = perm.view(b, per).to(torch.int32)
    elif layout == "contiguous":
        k_cache, v_cache = rand(b, L, hkv, d), rand(b, L, hkv, d)
    else:
        rows = b + 2
        if layout == "batch_idx_strided":  # a slice along seqlen of a longer cache
            k_cache, v_cache = rand(rows, L + 8, hkv, d)[:, :L], rand(rows, L + 8, hkv, d)[:, :L]
        else:
            k_cache, v_cache = rand(rows, L, hkv, d), rand(rows, L, hkv, d)
        idx = torch.randperm(rows, generator=gen, device=device)[:b]
        kw["cache_batch_idx"] = idx.to(torch.int32)
    if c["fp8"]:
        # e4m3 codes of about N(0, 50) and per-request descales around 0.02: the new tokens
        # (about N(0, 1)) quantise well inside e4m3's range
        kd = 0.01 + 0.02 * torch.rand(b, hkv, generator=gen, device=device)
        vd = 0.01 + 0.02 * torch.rand(b, hkv, generator=gen, device=device)
        k_cache = _quantise(k_cache, 0.02)
        v_cache = _quantise(v_cache, 0.02)
        if layout == "batch_idx_strided":
            def strided(x):
                wide = torch.empty(rows, L + 16, hkv, d, dtype=x.dtype, device=device)
                return wide[:, :L].copy_(x)

            k_cache, v_cache = strided(k_cache), strided(v_cache)
        kw.update(k_descale=kd.contiguous(), v_descale=vd.contiguous())
    kw.update(k_cache=k_cache, v_cache=v_cache)
    if c["int_lens"]:  # one length for every request, as an int
        kw["cache_seqlens"] = int(torch.randint(0, L - s_new + 1, (1,), generator=gen,
                                                device=device))
    else:
        kw["cache_seqlens"] = lens.to(torch.int32)
    if s_new:
        kw.update(k=rand(b, s_new, hkv, d), v=rand(b, s_new, hkv, d))
    if c["rotary"]:
        rd = c["rotary_dim"]
        ro = L + 4
        inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, device=device).float() / rd))
        ang = torch.arange(ro, device=device).float()[:, None] * inv[None, :]
        kw.update(rotary_cos=ang.cos().to(c["dtype"]), rotary_sin=ang.sin().to(c["dtype"]),
                  rotary_interleaved=c["rotary"] == "interleaved")
    if c.get("leftpad"):  # FA3's test: a start in [0, cached length] per request
        cached = kw["cache_seqlens"]
        cached = cached.long() if not isinstance(cached, int) else torch.full(
            (b,), cached, device=device)
        frac = torch.rand(b, generator=gen, device=device)
        kw["cache_leftpad"] = (frac * (cached + 1)).long().clamp_max(cached).to(torch.int32)
    if c.get("rotary_lens") and c["rotary"]:  # FA3's test: rotary positions from half the length
        cached = kw["cache_seqlens"]
        cached = cached.long() if not isinstance(cached, int) else torch.full(
            (b,), cached, device=device)
        kw["rotary_seqlens"] = (cached // 2).to(torch.int32)
    if c.get("varlen") and s_q > 1:  # FA3's varlen q: 1..s_q queries a request, packed
        n_q = torch.randint(1, s_q + 1, (b,), generator=gen, device=device)
        n_q[0] = s_q
        cu = torch.zeros(b + 1, dtype=torch.int32, device=device)
        cu[1:] = n_q.cumsum(0)
        kw["q"] = torch.cat([q[r, :int(n_q[r])] for r in range(b)])
        kw.update(cu_seqlens_q=cu, max_seqlen_q=s_q)
    if c.get("chunk"):
        kw["attention_chunk"] = c["chunk"]
    if c.get("varlen_k") and s_new:  # FA3's varlen new tokens: 0..s_new a request, packed
        n_new = torch.randint(0, s_new + 1, (b,), generator=gen, device=device)
        n_new[0] = s_new
        cu = torch.zeros(b + 1, dtype=torch.int32, device=device)
        cu[1:] = n_new.cumsum(0)
        for key in ("k", "v"):
            kw[key] = torch.cat([kw[key][r, :int(n_new[r])] for r in range(b)])
        kw["cu_seqlens_k_new"] = cu
    label = " ".join(f"{key}={val}" for key, val in c.items() if key != "seed")
    return kw, label


def varlen_reference(kw):
    """fa3_reference of a call with variable-length queries or new tokens: each request alone
    with its own queries and new tokens (FA3's semantics), the caches carried from one to the
    next; the rows stacked as the call returns them (varlen q: one request of total_q)."""
    import torch

    b = len(kw["cache_batch_idx"]) if "cache_batch_idx" in kw else (
        kw["page_table"].shape[0] if "page_table" in kw else kw["k_cache"].shape[0])
    cu_q = kw["cu_seqlens_q"].tolist() if "cu_seqlens_q" in kw else None
    cu_k = kw["cu_seqlens_k_new"].tolist() if "cu_seqlens_k_new" in kw else None
    args = {key: kw[key] for key in REF_KEYS if key in kw}
    kc, vc = args.pop("k_cache"), args.pop("v_cache")
    outs, lses, lives = [], [], []
    for r in range(b):
        one = dict(args)
        one["q"] = kw["q"][cu_q[r]:cu_q[r + 1]][None] if cu_q else kw["q"][r:r + 1]
        for key in ("k", "v"):
            if key in one:
                one[key] = one[key][cu_k[r]:cu_k[r + 1]][None] if cu_k else one[key][r:r + 1]
        for key in ("page_table", "cache_leftpad", "rotary_seqlens"):
            if key in one:
                one[key] = one[key][r:r + 1]
        if not isinstance(one.get("cache_seqlens"), int) and "cache_seqlens" in one:
            one["cache_seqlens"] = one["cache_seqlens"][r:r + 1]
        for key in ("k_descale", "v_descale"):
            if key in one and one[key].dim() == 2:
                one[key] = one[key][r:r + 1]
        if "page_table" not in one:
            row = int(kw["cache_batch_idx"][r]) if "cache_batch_idx" in kw else r
            one["cache_batch_idx"] = torch.tensor([row], dtype=torch.int32,
                                                  device=kw["q"].device)
        o, lse, live, kc, vc = fa3_reference(k_cache=kc, v_cache=vc, **one)
        outs.append(o[0])
        lses.append(lse[0])
        lives.append(live[0].expand(o.shape[1]))  # ([1] where no row is masked)
    if cu_q:
        return (torch.cat(outs)[None], torch.cat(lses, dim=1)[None], torch.cat(lives)[None],
                kc, vc)
    return torch.stack(outs), torch.stack(lses), torch.stack(lives), kc, vc


REF_KEYS = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
            "cache_batch_idx", "page_table", "k_descale", "v_descale", "softmax_scale", "causal",
            "window_size", "softcap", "rotary_interleaved", "cache_leftpad", "rotary_seqlens",
            "attention_chunk")


def reference(kw):
    """fa3_reference of a case's call (on copies of its caches), varlen calls request by
    request."""
    if "cu_seqlens_q" in kw or "cu_seqlens_k_new" in kw:
        return varlen_reference(kw)
    return fa3_reference(**{key: kw[key] for key in REF_KEYS if key in kw})


def as_reference_rows(kw, out, lse):
    """(q, out, lse) of a call shaped as reference() stacks its rows: a varlen-q call's
    total_q queries as one request."""
    q = kw["q"]
    if "cu_seqlens_q" in kw:
        return q[None], out[None], None if lse is None else lse[None]
    return q, out, lse


def run_case(kw, label, tol=1e-2):
    """flash_attn_with_kvcache on a case against fa3_reference (on copies of its caches)."""
    ref = reference(kw)
    res = FN(**kw)
    out, lse = res if kw.get("return_softmax_lse") else (res, None)
    q, out, lse = as_reference_rows(kw, out, lse)
    err = check_against_reference(out, lse, ref, q, label, tol)
    rotary = kw.get("rotary_cos") is not None
    check_caches(kw["k_cache"], ref[3], rotary, f"{label} k_cache")
    check_caches(kw["v_cache"], ref[4], rotary, f"{label} v_cache")
    return err


CPU_CASES = 60


@pytest.mark.parametrize("i", range(CPU_CASES))
def test_mapping_onto_kvstream_matches_fa3_reference(i, monkeypatch):
    torch = pytest.importorskip("torch")
    calls = []
    monkeypatch.setattr(compat, "decode", _kvstream_decode_on_torch(calls))
    monkeypatch.setattr(compat, "store_kv", _kvstream_store_kv_on_torch)
    c = _cpu_case(random.Random(5000 + i), torch)
    kw, label = build_case(c, torch, "cpu")
    run_case(kw, label, tol=1e-2)
    if c["chunk"]:  # one decode a query row, each from its chunk's start
        assert len(calls) == c["s_q"]
        return
    assert len(calls) == 1
    # FA3's causal flag becomes the right side 0; negative sides -1
    left, right = calls[0]["window_size"]
    assert right == (0 if c["causal"] else max(c["window"][1], -1)), (label, calls[0])
    assert left == max(c["window"][0], -1)


def test_hints_are_accepted_and_not_passed(monkeypatch):
    torch = pytest.importorskip("torch")
    calls = []
    monkeypatch.setattr(compat, "decode", _kvstream_decode_on_torch(calls))
    monkeypatch.setattr(compat, "store_kv", _kvstream_store_kv_on_torch)
    q = torch.randn(2, 1, 4, 64).bfloat16()
    kc, vc = torch.randn(2, 32, 2, 64).bfloat16(), torch.randn(2, 32, 2, 64).bfloat16()
    base = FN(q, kc, vc, cache_seqlens=7)
    for hints in (dict(num_splits=1), dict(num_splits=16), dict(pack_gqa=True),
                  dict(pack_gqa=False), dict(num_splits=0, pack_gqa=None),
                  dict(scheduler_metadata=torch.zeros(64, dtype=torch.int32))):
        assert torch.equal(FN(q, kc, vc, cache_seqlens=7, **hints), base), hints
    assert all("num_splits" not in c and "pack_gqa" not in c and "scheduler_metadata" not in c
               for c in calls)
    # FA3's defaults: non-causal, window (-1, -1), softcap off, lse as [b, h, s_q]
    assert calls[0]["window_size"] == (-1, -1) and calls[0]["softcap"] == 0.0
    out, lse = FN(q, kc, vc, cache_seqlens=7, softcap=-3.0, return_softmax_lse=True)
    assert calls[-1]["softcap"] == 0.0  # FA3: softcap <= 0 is off
    assert lse.shape == (2, 4, 1) and lse.is_contiguous()
    # positional arguments bind as FA3's: k and v fourth and fifth
    kn, vn = torch.randn(2, 1, 2, 64).bfloat16(), torch.randn(2, 1, 2, 64).bfloat16()
    lens = torch.tensor([3, 31], dtype=torch.int32)
    FN(q, kc, vc, kn, vn, None, None, None, lens)
    assert torch.equal(kc[0, 3], kn[0, 0]) and torch.equal(vc[1, 31], vn[1, 0])
    assert torch.equal(calls[-1]["cache_seqlens"], lens + 1)


def test_contiguous_cache_with_batch_idx_is_read_in_place(monkeypatch):
    """A contiguous cache with cache_batch_idx goes to decode as a pool of pages over its own
    storage (no copy), the table naming each batch entry's row; a strided one is gathered."""
    torch = pytest.importorskip("torch")
    calls = []
    seen = {}
    fake = _kvstream_decode_on_torch(calls)

    def decode(q, k_cache, v_cache, **kw):
        seen["k"], seen["v"] = k_cache, v_cache
        return fake(q, k_cache, v_cache, **kw)

    monkeypatch.setattr(compat, "decode", decode)
    monkeypatch.setattr(compat, "store_kv", _kvstream_store_kv_on_torch)
    q = torch.randn(2, 1, 4, 64).half()
    for L, ps in ((1024, 512), (96, 32), (67, 1)):
        kc = torch.randn(5, L, 2, 64).half()
        vc = torch.randn(5, L, 2, 64).half()
        idx = torch.tensor([4, 1], dtype=torch.int32)
        FN(q, kc, vc, cache_seqlens=torch.tensor([L, 3], dtype=torch.int32), cache_batch_idx=idx)
        assert seen["k"].data_ptr() == kc.data_ptr() and seen["k"].shape == (5 * L // ps, ps, 2, 64)
        per = L // ps
        want = torch.stack([torch.arange(per) + 4 * per, torch.arange(per) + per]).int()
        assert torch.equal(calls[-1]["block_table"], want)
    strided = torch.randn(5, 80, 2, 64).half()[:, :64]
    FN(q, strided, strided, cache_seqlens=5,
       cache_batch_idx=torch.tensor([3, 0], dtype=torch.int32))
    assert seen["k"].shape == (2, 64, 2, 64) and torch.equal(seen["k"], strided[[3, 0]])
    assert calls[-1].get("block_table") is None


def test_fp8_append_quantises_with_each_requests_descale(monkeypatch):
    """FA3's per-request descales [b, hkv] quantise the new tokens into whichever block (cache
    row or page) they land in; store_kv gets them as a per-block [blocks, hkv] scale."""
    torch = pytest.importorskip("torch")
    got = {}
    calls = []

    def store(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
        got["k_scale"], got["slots"] = k_scale, slot_mapping.clone()
        _kvstream_store_kv_on_torch(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                                    v_scale=v_scale)

    monkeypatch.setattr(compat, "decode", _kvstream_decode_on_torch(calls))
    monkeypatch.setattr(compat, "store_kv", store)
    b, hkv, d, ps = 2, 2, 64, 4
    q = torch.randn(b, 2, 4, d).bfloat16()
    pool = _quantise(torch.randn(10, ps, hkv, d), 0.01)
    table = torch.tensor([[7, 2, 5], [0, 9, 3]], dtype=torch.int32)
    kd = torch.tensor([[0.5, 2.0], [4.0, 8.0]])
    kn, vn = torch.randn(b, 2, hkv, d).bfloat16(), torch.randn(b, 2, hkv, d).bfloat16()
    lens = torch.tensor([3, 11], dtype=torch.int32)   # request 0 crosses a page; 1 overflows
    FN(q, pool, pool.clone(), kn, vn, cache_seqlens=lens, page_table=table, k_descale=kd,
       v_descale=kd)
    # request 0: positions 3, 4 -> page 7 row 3, page 2 row 0; request 1: 11 -> page 3 row 3,
    # 12 past the capacity (3 pages of 4): skipped
    assert got["slots"].tolist() == [7 * ps + 3, 2 * ps + 0, 3 * ps + 3, -1]
    sc = got["k_scale"]
    assert sc.shape == (10, hkv)
    assert torch.equal(sc[7], kd[0]) and torch.equal(sc[2], kd[0]) and torch.equal(sc[3], kd[1])
    want = _quantise(kn[0, 1], kd[0][:, None])
    assert torch.equal(pool.view(torch.uint8)[2, 0], want.view(torch.uint8))
    # the lengths attended: 3 + 2, and 11 + 2 cut to the capacity
    assert calls[-1]["cache_seqlens"].tolist() == [5, 12]
    assert torch.equal(calls[-1]["k_scale"], kd) and torch.equal(calls[-1]["block_table"], table)


@pytest.mark.parametrize("causal,window,own", [
    (False, (-1, -1), False),
    (False, (70, -1), False),   # left past the capacity (64) bounds nothing
    (False, (63, -1), False),   # left = capacity - 1 bounds nothing either
    (False, (62, -1), True),
    (False, (-1, 3), False),    # right >= seqlen_q - 1 (4 - 1) bounds nothing
    (False, (-1, 2), True),
    (False, (-1, 0), True),     # FA3 takes (-1, 0) as causal
    (True, (-1, -1), True),
    (True, (-1, 7), True),
])
def test_rotary_query_positions_follow_fa3(causal, window, own, monkeypatch):
    """q is rotated at cache_seqlens + i when causal or local (after FA3 drops the window sides
    that bound nothing), else every query token at cache_seqlens."""
    torch = pytest.importorskip("torch")
    seen = {}

    def decode(q, k_cache, v_cache, **kw):
        seen["q"] = q
        return q

    monkeypatch.setattr(compat, "decode", decode)
    monkeypatch.setattr(compat, "store_kv", _kvstream_store_kv_on_torch)
    torch.manual_seed(11)
    b, s_q, h, d, L = 2, 4, 2, 64, 64
    q = torch.randn(b, s_q, h, d).bfloat16()
    kc, vc = torch.zeros(b, L, h, d).bfloat16(), torch.zeros(b, L, h, d).bfloat16()
    kn, vn = torch.randn(b, 1, h, d).bfloat16(), torch.randn(b, 1, h, d).bfloat16()
    ang = torch.arange(L).float()[:, None] * torch.rand(d // 2)[None, :]
    lens = torch.tensor([5, 40], dtype=torch.int32)
    FN(q, kc, vc, kn, vn, rotary_cos=ang.cos().bfloat16(), rotary_sin=ang.sin().bfloat16(),
       cache_seqlens=lens, causal=causal, window_size=window)
    pos = lens.long()[:, None] + (torch.arange(s_q) if own else torch.zeros(s_q, dtype=torch.long))
    want = _rope_reference(q, ang.cos().bfloat16(), ang.sin().bfloat16(), pos, True)
    steps = torch.arange(s_q)
    other = lens.long()[:, None] + (0 * steps if own else steps)
    wrong = _rope_reference(q, ang.cos().bfloat16(), ang.sin().bfloat16(), other, True)
    got = seen["q"].float()
    assert (got - want.float()).abs().max().item() <= 0.05
    assert (got - wrong.float()).abs().max().item() > 0.05
    # the new key at cache_seqlens, whatever the mask
    krot = _rope_reference(kn, ang.cos().bfloat16(), ang.sin().bfloat16(), lens.long()[:, None],
                           True)
    assert (kc[0, 5].float() - krot[0, 0].float()).abs().max().item() <= 0.05
    assert (kc[1, 40].float() - krot[1, 0].float()).abs().max().item() <= 0.05


def test_stub_matches_the_function():
    import ast
    import os

    stub = os.path.join(os.path.dirname(compat.__file__), "compat.pyi")
    if not os.path.exists(stub):
        pytest.skip("installed without the stub")
    tree = ast.parse(open(stub).read())
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert [n.name for n in defs] == ["flash_attn_with_kvcache"] * 2  # the two overloads
    want = [name for name, _ in FA3_PARAMETERS]
    for n in defs:
        a = n.args
        assert [p.arg for p in a.args + a.kwonlyargs] == want
