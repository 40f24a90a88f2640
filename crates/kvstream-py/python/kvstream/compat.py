"""FlashAttention-3's ``flash_attn_with_kvcache`` on kvstream.

Code written against FA3's KV-cache call switches by changing one import::

    # from flash_attn_interface import flash_attn_with_kvcache
    from kvstream.compat import flash_attn_with_kvcache

    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                  cache_seqlens=lens, causal=True)

Same parameters, defaults and semantics as FA3's function (hopper/flash_attn_interface.py);
what kvstream cannot honour raises ``NotImplementedError`` naming the argument, never a silent
difference. The call is built from :func:`kvstream.store_kv` (the append) and
:func:`kvstream.decode` (the attention) plus a few small torch ops (rotary embedding, slots,
lengths) on the current stream; nothing synchronises with the host. Importing this module needs
neither torch nor a GPU (``import kvstream`` does not import it).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

from . import (  # (_F32_MAX, _MAX_WINDOW: the largest softcap and bounded window side)
    _F32_MAX,
    _MAX_WINDOW,
    FP8_KV_DTYPES,
    MAX_GROUP,
    MAX_Q_LEN,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_PAGE_SIZES,
    decode,
    store_kv,
)

__all__ = ["flash_attn_with_kvcache"]

_FN = "kvstream.compat.flash_attn_with_kvcache"
_INT32 = "torch.int32"
_FLOAT32 = "torch.float32"

# FA3 arguments with no kvstream counterpart: refused when given (not None), with the reason.
_UNSUPPORTED_TENSORS = (
    ("qv", "FA3's extra query-value operand (qv) has no kvstream counterpart"),
    ("q_descale", "kvstream keeps q in bf16 / fp16 (an fp8 q is refused); fp8 caches take "
                  "k_descale / v_descale"),
)


def _unsupported(name: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{_FN}: {name} is not supported: {why}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _shape(name: str, x: Any) -> Tuple[int, ...]:
    """The shape of a tensor argument, as ints (TypeError for something else)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{_FN}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return tuple(int(s) for s in x.shape)


def _bool(name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{_FN}: {name} must be a bool, got {x!r} ({type(x).__name__})")
    return x


def _index_vector(name: str, x: Any, b: int) -> None:
    """An int32 ``[b]`` tensor (cache_seqlens, cache_batch_idx)."""
    shape = _shape(name, x)
    if str(x.dtype) != _INT32:
        raise TypeError(f"{_FN}: {name} has dtype {x.dtype}, allowed: torch.int32")
    if shape != (b,):
        raise ValueError(f"{_FN}: {name} has shape {list(shape)}, allowed: [{b}] (the batch of q)")


def flash_attn_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    qv: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    cache_seqlens: Optional[Union[int, Any]] = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    page_table: Any = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k_new: Any = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Any = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Any = None,
    num_splits: int = 0,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """FlashAttention-3's ``flash_attn_with_kvcache`` (its signature, defaults and semantics),
    served by :func:`kvstream.store_kv` and :func:`kvstream.decode`.

    If ``k`` and ``v`` are given, they are written *in place* into ``k_cache`` / ``v_cache`` at
    positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1`` of each request (rotated
    first when ``rotary_cos`` / ``rotary_sin`` are given), and the attention then covers
    ``cache_seqlens + seqlen_new`` positions; query token ``i`` sits at position
    ``i + seqlen_k - seqlen_q`` (the causal mask aligned to the bottom right).

    Args:
        q: ``[batch, seqlen_q, nheads, headdim]`` bf16 or fp16 CUDA tensor; ``seqlen_q`` 1..8,
            ``headdim`` 64, 96, 128 or 256, at most 32 query heads per KV head (else
            ``NotImplementedError``). With ``cu_seqlens_q`` (int32 ``[batch + 1]``) and
            ``max_seqlen_q`` (1..8): ``[total_q, nheads, headdim]``, request r's queries rows
            ``cu_seqlens_q[r] ..< cu_seqlens_q[r + 1]``, each request's last query at its last
            position; ``out`` is then ``[total_q, nheads, headdim]`` and the LSE ``[nheads,
            total_q]`` (FA3's varlen shapes).
        k_cache, v_cache: ``[batch_size_cache, seqlen_cache, nheads_k, headdim]``, or page
            pools ``[num_blocks, page_block_size, nheads_k, headdim]`` with ``page_table``
            (page sizes 1, 2, 4, ..., 512); q's dtype, or both ``torch.float8_e4m3fn`` (then
            ``k_descale`` / ``v_descale`` are their dequantisation scales). V's head dim must
            be K's.
        k, v: optional new tokens ``[batch, seqlen_new, nheads_k, headdim]`` of q's dtype
            (quantised with the descales for an fp8 cache); need ``cache_seqlens``. With
            ``cu_seqlens_k_new`` (int32 ``[batch + 1]``): ``[total_new, nheads_k, headdim]``,
            request r's rows ``cu_seqlens_k_new[r] ..< cu_seqlens_k_new[r + 1]``. Slots past
            a request's capacity are skipped and the lengths attended cut to the capacity (FA3
            leaves such calls undefined).
        rotary_cos, rotary_sin: optional ``[seqlen_ro, rotary_dim / 2]`` tables (q's dtype or
            float32), only with ``k`` / ``v``: the new keys are rotated at positions
            ``cache_seqlens[b] + i``; the queries at ``cache_seqlens[b] + i`` if ``causal`` or
            local (a ``window_size`` bounding something), else all at ``cache_seqlens[b]``.
            ``rotary_interleaved``: pairs (0, 1), (2, 3), ... (True) or (j, j + rotary_dim / 2)
            (False, GPT-NeoX). Positions past ``seqlen_ro`` read its last row.
        rotary_seqlens: optional int32 ``[batch]``: the rotary positions count from these
            instead of ``cache_seqlens`` (the keys still go at ``cache_seqlens``).
        cache_seqlens: int, or int32 ``[batch]`` CUDA tensor: each request's cached length
            before the append. None: the whole capacity (not allowed with ``k`` / ``v``).
        cache_batch_idx: optional int32 ``[batch]``: the cache row of each batch entry
            (contiguous caches only). A contiguous cache is read in place through a block
            table over its rows (no copy); a strided one is gathered (a copy of those rows).
        cache_leftpad: optional int32 ``[batch]``: where each request's keys start (the
            positions before are not attended; the mask counts from there, the rotary
            positions stay the cache's). Read in place through a table of one-position pages
            (a strided contiguous cache is copied first); the new tokens still go at
            ``cache_seqlens``.
        page_table: optional int32 ``[batch, max_num_blocks_per_seq]`` (kvstream's
            ``block_table``).
        k_descale, v_descale: fp8 caches only: float32 ``[batch, nheads_k]`` (FA3's; or
            kvstream's ``[1]`` / ``[nheads_k]``) dequantisation scales, also the scales the
            appended tokens are quantised with.
        softmax_scale: default ``1 / sqrt(headdim)``.
        causal: the causal mask (``window_size``'s right side becomes 0).
        window_size: ``(left, right)`` sliding window, negative sides unbounded.
        softcap: scores ``s`` become ``softcap * tanh(s / softcap)`` when above 0.
        num_splits, pack_gqa, scheduler_metadata: FA3's performance hints (the last its
            precomputed schedule); accepted and not used (kvstream plans its own partition on
            the GPU, which changes rounding only).
        return_softmax_lse: also return the natural-log LSE, float32 ``[batch, nheads,
            seqlen_q]``.

    ``attention_chunk`` (Llama 4's chunked attention): a query at (shifted) position p sees no
    key before ``p - p % attention_chunk``; decoded one query row at a time, each from its
    chunk's start.

    Refused with ``NotImplementedError`` (the argument named): ``qv``, ``q_descale`` (either
    given), ``sm_margin`` other than 0, ``cache_batch_idx`` with ``page_table`` (index the table's
    rows instead), an fp8 ``q``, and the shapes above kvstream does not serve.

    Returns:
        ``out`` ``[batch, seqlen_q, nheads, headdim]`` (q's dtype), or ``(out, softmax_lse)``
        with ``return_softmax_lse``. A query row that sees no position gives zeros and an LSE
        of ``-inf`` (FA3 gives ``+inf`` there when it does not split).
    """
    # ---- what kvstream cannot honour: refused before anything else ----
    given = dict(qv=qv, q_descale=q_descale)
    for name, why in _UNSUPPORTED_TENSORS:
        if given[name] is not None:
            raise _unsupported(name, why)
    for name, value in (("attention_chunk", attention_chunk), ("sm_margin", sm_margin)):
        if not _is_int(value):
            raise TypeError(f"{_FN}: {name} must be an int, got {value!r} ({type(value).__name__})")
    if sm_margin != 0:
        raise _unsupported(f"sm_margin={sm_margin}", "kvstream cannot leave SMs free; allowed: 0")
    if attention_chunk < 0:
        raise ValueError(f"{_FN}: attention_chunk is {attention_chunk}, allowed: 0 (off) or a "
                         f"chunk length")
    paged = page_table is not None
    if cache_batch_idx is not None and paged:
        raise _unsupported(
            "cache_batch_idx", "together with page_table (FA3 does not define it either); index "
                               "the table's rows instead: page_table[cache_batch_idx]")

    # ---- the rest of the arguments, checked without torch ----
    qs = _shape("q", q)
    varlen = cu_seqlens_q is not None
    if varlen:
        # variable-length queries [total_q, nheads, headdim]: decoded right-aligned in
        # [batch, max_seqlen_q, ...] rows (query j of a request of n sits in row
        # max_seqlen_q - n + j, where the causal rule gives it FA3's positions)
        cs = _shape("cu_seqlens_q", cu_seqlens_q)
        if len(cs) != 1 or cs[0] < 2 or str(cu_seqlens_q.dtype) != _INT32:
            raise ValueError(f"{_FN}: cu_seqlens_q has shape {list(cs)} and dtype "
                             f"{cu_seqlens_q.dtype}, allowed: int32 [batch + 1], batch >= 1")
        if not _is_int(max_seqlen_q) or not 1 <= max_seqlen_q <= MAX_Q_LEN:
            raise ValueError(f"{_FN}: max_seqlen_q is {max_seqlen_q!r} with cu_seqlens_q, "
                             f"allowed: an int 1..{MAX_Q_LEN} (the longest request's queries)")
        if len(qs) != 3:
            raise ValueError(f"{_FN}: q has shape {list(qs)} with cu_seqlens_q, allowed: "
                             f"[total_q, nheads, headdim]")
        qs = (cs[0] - 1, max_seqlen_q, qs[1], qs[2])
    elif max_seqlen_q is not None:
        raise ValueError(f"{_FN}: max_seqlen_q is given without cu_seqlens_q, allowed: None")
    if len(qs) != 4:
        raise ValueError(
            f"{_FN}: q has shape {list(qs)}, allowed: [batch, seqlen_q, nheads, headdim]")
    b, s_q, hq, d = qs
    if b < 1 or hq < 1:
        raise ValueError(f"{_FN}: q has shape {list(qs)}, allowed: batch >= 1, nheads >= 1")
    qd = str(q.dtype)
    if qd in FP8_KV_DTYPES or "float8" in qd:
        raise _unsupported(f"q of dtype {qd}", "kvstream keeps q in bf16 or fp16 "
                                               "(fp8 caches are fine, with k_descale / v_descale)")
    if qd not in SUPPORTED_DTYPES:
        raise TypeError(f"{_FN}: q has dtype {qd}, allowed: {', '.join(SUPPORTED_DTYPES)}")
    if not 1 <= s_q <= MAX_Q_LEN:
        raise _unsupported(f"q with seqlen_q = {s_q}", f"kvstream decodes 1..{MAX_Q_LEN} query "
                                                        f"tokens per request")
    if d not in SUPPORTED_HEAD_DIMS:
        raise _unsupported(f"q with headdim {d}", "kvstream's head dims are "
                                                  f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    ks = _shape("k_cache", k_cache)
    vs = _shape("v_cache", v_cache)
    if len(ks) != 4 or len(vs) != 4:
        raise ValueError(
            f"{_FN}: k_cache / v_cache have shapes {list(ks)} / {list(vs)}, allowed: 4 "
            f"dimensions [batch_size_cache or num_blocks, seqlen_cache or page_block_size, "
            f"nheads_k, headdim]")
    if vs[-1] != ks[-1]:
        raise _unsupported(f"v_cache with headdim {vs[-1]}",
                           f"V's head dim must be K's ({ks[-1]}) in kvstream")
    if vs != ks:
        raise ValueError(f"{_FN}: v_cache has shape {list(vs)}, allowed: k_cache's {list(ks)}")
    blocks, block_size, hkv = ks[0], ks[1], ks[2]
    if ks[3] != d:
        raise ValueError(f"{_FN}: k_cache has headdim {ks[3]}, allowed: {d} (q's)")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"{_FN}: q has {hq} heads and k_cache {hkv}, allowed: nheads a "
                         f"multiple of nheads_k")
    if hq // hkv > MAX_GROUP:
        raise _unsupported(f"{hq // hkv} query heads per KV head (q, k_cache)",
                           f"kvstream serves at most {MAX_GROUP}")
    kvd = str(k_cache.dtype)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if str(t.dtype) != kvd or kvd not in (qd, *FP8_KV_DTYPES):
            raise TypeError(f"{_FN}: {name} has dtype {t.dtype} (k_cache: {kvd}), allowed: "
                            f"{qd} (q's) or {', '.join(FP8_KV_DTYPES)}, the same for both")
    if paged:
        ts = _shape("page_table", page_table)
        if len(ts) != 2:
            raise ValueError(f"{_FN}: page_table has shape {list(ts)}, allowed: [batch, "
                             f"max_num_blocks_per_seq]")
        if ts[0] != b:
            raise ValueError(f"{_FN}: page_table has shape {list(ts)}, allowed: [{b}, "
                             f"max_num_blocks_per_seq] (the batch of q)")
        if block_size not in SUPPORTED_PAGE_SIZES:
            raise _unsupported(f"page_table with page_block_size {block_size} (k_cache's dim 1)",
                               f"kvstream's page sizes are "
                               f"{', '.join(map(str, SUPPORTED_PAGE_SIZES))}")
        capacity = ts[1] * block_size
    else:
        capacity = block_size
        if cache_batch_idx is None and blocks != b:
            raise ValueError(f"{_FN}: k_cache has batch_size_cache {blocks}, allowed: {b} (the "
                             f"batch of q) without cache_batch_idx")
    fp8 = kvd in FP8_KV_DTYPES
    if (k is None) != (v is None):
        raise ValueError(f"{_FN}: k and v go together: {'k' if k is None else 'v'} is None")
    s_new = 0
    varlen_k = k is not None and cu_seqlens_k_new is not None
    if k is not None:
        kn, vn = _shape("k", k), _shape("v", v)
        if varlen_k:
            # variable-length new tokens [total_new, nheads_k, headdim]: request r's rows
            # cu_seqlens_k_new[r] ..< cu_seqlens_k_new[r + 1]
            cks = _shape("cu_seqlens_k_new", cu_seqlens_k_new)
            if cks != (b + 1,) or str(cu_seqlens_k_new.dtype) != _INT32:
                raise ValueError(f"{_FN}: cu_seqlens_k_new has shape {list(cks)} and dtype "
                                 f"{cu_seqlens_k_new.dtype}, allowed: int32 [{b + 1}]")
            want = (kn[0] if len(kn) == 3 else -1, hkv, d)
            layout = f"[total_new, {hkv}, {d}] (with cu_seqlens_k_new)"
        else:
            want = (b, kn[1] if len(kn) == 4 else -1, hkv, d)
            layout = f"[{b}, seqlen_new, {hkv}, {d}] (q's batch, k_cache's heads and head dim)"
        if kn != want or vn != want:
            raise ValueError(
                f"{_FN}: k / v have shapes {list(kn)} / {list(vn)}, allowed: both {layout}")
        for name, t in (("k", k), ("v", v)):
            if str(t.dtype) != qd:
                raise TypeError(f"{_FN}: {name} has dtype {t.dtype}, allowed: {qd} (q's)")
        if cache_seqlens is None:
            raise ValueError(f"{_FN}: k / v are given without cache_seqlens, allowed: an int or "
                             f"an int32 [{b}] tensor (where the new tokens go)")
        s_new = kn[0] if varlen_k else kn[1]  # (varlen: every request's together)
    if _is_int(cache_seqlens):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"{_FN}: cache_seqlens is {cache_seqlens}, allowed: 0..{capacity} "
                             f"(the cache's capacity)")
    elif cache_seqlens is not None:
        _index_vector("cache_seqlens", cache_seqlens, b)
    if cache_batch_idx is not None:
        _index_vector("cache_batch_idx", cache_batch_idx, b)
    if cache_leftpad is not None:
        _index_vector("cache_leftpad", cache_leftpad, b)
    rotary_dim = 0
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{_FN}: rotary_cos and rotary_sin go together: "
                         f"{'rotary_cos' if rotary_cos is None else 'rotary_sin'} is None")
    if rotary_cos is not None:
        if k is None:
            raise ValueError(f"{_FN}: rotary_cos / rotary_sin are given without k / v (FA3 "
                             f"rotates only with new tokens to append)")
        cs, ss = _shape("rotary_cos", rotary_cos), _shape("rotary_sin", rotary_sin)
        if len(cs) != 2 or cs != ss or cs[0] < 1 or not 1 <= 2 * cs[1] <= d:
            raise ValueError(
                f"{_FN}: rotary_cos / rotary_sin have shapes {list(cs)} / {list(ss)}, allowed: "
                f"both [seqlen_ro >= 1, rotary_dim / 2] with rotary_dim <= headdim ({d})")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if str(t.dtype) not in (qd, _FLOAT32):
                raise TypeError(f"{_FN}: {name} has dtype {t.dtype}, allowed: {qd} (q's) or "
                                f"{_FLOAT32}")
        rotary_dim = 2 * cs[1]
    if rotary_seqlens is not None:
        if rotary_cos is None:
            raise ValueError(f"{_FN}: rotary_seqlens is given without rotary_cos / rotary_sin")
        _index_vector("rotary_seqlens", rotary_seqlens, b)
    for name, sc in (("k_descale", k_descale), ("v_descale", v_descale)):
        if sc is not None and not fp8:
            raise ValueError(
                f"{_FN}: {name} is given for {k_cache.dtype} caches, allowed: None (descales "
                f"belong to {', '.join(FP8_KV_DTYPES)} caches; FA3 ignores them otherwise)")
        if sc is not None and _shape(name, sc) not in ((), (1,), (hkv,), (b, hkv)):
            raise ValueError(f"{_FN}: {name} has shape {list(sc.shape)}, allowed: [{b}, {hkv}] "
                             f"(per request and KV head, FA3's), [{hkv}] or [1]")
    causal = _bool("causal", causal)
    rotary_interleaved = _bool("rotary_interleaved", rotary_interleaved)
    return_softmax_lse = _bool("return_softmax_lse", return_softmax_lse)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(_is_int(w) for w in window_size)):
        raise TypeError(f"{_FN}: window_size must be a pair (left, right) of ints, got "
                        f"{window_size!r}")
    if max(window_size) > _MAX_WINDOW:
        raise ValueError(f"{_FN}: window_size is {tuple(window_size)}, allowed: sides up to "
                         f"{_MAX_WINDOW} (or negative: unbounded)")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{_FN}: softcap must be a float, got {softcap!r} "
                        f"({type(softcap).__name__})")
    if softcap > _F32_MAX:
        raise ValueError(f"{_FN}: softcap is {softcap}, allowed: a finite float32 (<= 0: off)")
    if not _is_int(num_splits):
        raise TypeError(f"{_FN}: num_splits must be an int, got {num_splits!r} "
                        f"({type(num_splits).__name__})")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"{_FN}: pack_gqa must be a bool or None, got {pack_gqa!r} "
                        f"({type(pack_gqa).__name__})")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"{_FN}: softmax_scale must be a float or None, got "
                            f"{softmax_scale!r} ({type(softmax_scale).__name__})")
        if not 0.0 < softmax_scale < float("inf"):
            raise ValueError(f"{_FN}: softmax_scale is {softmax_scale}, allowed: a finite "
                             f"positive number")

    # FA3's mask: negative sides are unbounded; causal bounds the right side at 0.
    left = int(window_size[0]) if window_size[0] >= 0 else -1
    right = 0 if causal else (int(window_size[1]) if window_size[1] >= 0 else -1)
    # FA3 rotates the queries at their own positions when causal or local, after dropping
    # window sides that bound nothing (left past the capacity, right past the last query).
    local_left = left if left < capacity - 1 else -1
    local_right = right if (causal or right < s_q - 1) else -1
    queries_at_own_positions = local_left >= 0 or local_right >= 0
    # softcap <= 0 is off in FA3
    cap = float(softcap) if softcap > 0 else 0.0

    # ---- the work: small torch ops, then store_kv and decode ----
    import torch

    dev = q.device
    lens0 = None  # each request's cached length before the append, int32 [b]
    if _is_int(cache_seqlens):
        lens0 = torch.full((b,), int(cache_seqlens), dtype=torch.int32, device=dev)
    elif cache_seqlens is not None:
        lens0 = cache_seqlens.contiguous()
    idx = None if cache_batch_idx is None else cache_batch_idx.contiguous().long()
    q_rows = None  # varlen: each query's (request, row) in the right-aligned [b, s_q] rows
    if varlen:
        req, j, n_q = _packed_rows(cu_seqlens_q, q.shape[0], b)
        row = (s_q - n_q[req] + j).clamp(0, s_q - 1)
        q_rows = (req, row)
        padded = q.new_zeros(b, s_q, hq, d)
        padded[req, row] = q
        q = padded
    k_scale = None if k_descale is None else k_descale.contiguous()
    v_scale = None if v_descale is None else v_descale.contiguous()

    if rotary_dim:
        assert lens0 is not None  # rotary needs k, which needs cache_seqlens
        # the rotary positions count from rotary_seqlens where given (else the cached length)
        start = (rotary_seqlens if rotary_seqlens is not None else lens0).long()[:, None]
        steps = torch.arange(s_q, device=dev)[None, :]
        if q_rows is not None:  # a right-aligned row's query index: row - (s_q - n)
            steps = (steps - (s_q - n_q[:, None])).clamp_min(0)
        q = _rotate(q, rotary_cos, rotary_sin,
                    start + (steps if queries_at_own_positions else 0 * steps),
                    rotary_interleaved)

    lens = lens0
    if k is not None and s_new > 0:
        assert lens0 is not None
        # the new tokens as one list [tokens, hkv, d]: each one's request and index in it
        if varlen_k:
            kreq, kj, n_new = _packed_rows(cu_seqlens_k_new, s_new, b)
            k_rows, v_rows = k.contiguous(), v.contiguous()
        else:
            kreq = torch.arange(b, device=dev).repeat_interleave(s_new)
            kj = torch.arange(s_new, device=dev).repeat(b)
            n_new = s_new
            k_rows, v_rows = (x.reshape(b * s_new, hkv, d).contiguous() for x in (k, v))
        if rotary_dim:
            k_rows = _rotate(k_rows[None], rotary_cos, rotary_sin, (start[kreq, 0] + kj)[None],
                             rotary_interleaved)[0]
        pos = lens0.long()[kreq] + kj
        if paged:
            table = page_table.long()
            col = torch.div(pos, block_size, rounding_mode="floor")
            valid = (pos >= 0) & (col < table.shape[1])
            page = table[kreq, col.clamp(0, table.shape[1] - 1)]
            slots = page * block_size + pos.remainder(block_size)
        else:
            rows = idx if idx is not None else torch.arange(b, device=dev)
            valid = (pos >= 0) & (pos < block_size)
            slots = rows[kreq] * block_size + pos
        slots = torch.where(valid, slots, torch.full_like(slots, -1))
        store_kv(
            k_rows, v_rows, k_cache, v_cache, slots,
            k_scale=_block_scale(k_scale, slots, valid, kreq, blocks, block_size, b, hkv,
                                 per_request_blocks=not paged and idx is None),
            v_scale=_block_scale(v_scale, slots, valid, kreq, blocks, block_size, b, hkv,
                                 per_request_blocks=not paged and idx is None),
        )
        # lengths past the capacity (FA3 leaves such calls undefined) are cut to it
        lens = (lens0 + n_new).clamp_max(capacity).to(torch.int32)

    kc, vc, table = k_cache, v_cache, page_table
    shifted = cache_leftpad is not None or attention_chunk > 0
    if shifted:
        if lens is None:
            lens = torch.full((b,), capacity, dtype=torch.int32, device=dev)
        # Keys from a start per request (cache_leftpad) or per query (the start of its
        # attention chunk): the request's positions from there, one page of one position each,
        # through a table over the cache (a pool, or the rows of a contiguous cache; a strided
        # one is copied first). FA3 masks in the shifted positions and rotates at the cache's.
        if paged:
            pool_table = page_table.long()
        else:
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
            pool_rows = idx if idx is not None else torch.arange(b, device=dev)
        kc = k_cache.view(blocks * block_size, 1, hkv, d)
        vc = v_cache.view(blocks * block_size, 1, hkv, d)

        def from_start(first: Any) -> Any:
            """The one-position pages of each request's positions from ``first`` [b] on."""
            pos = (first[:, None] + torch.arange(capacity, device=dev)).clamp(0, capacity - 1)
            if paged:
                rows = pool_table.gather(1, torch.div(pos, block_size, rounding_mode="floor"))
                return (rows * block_size + pos.remainder(block_size)).to(torch.int32)
            return (pool_rows[:, None] * block_size + pos).to(torch.int32)

        pad = (cache_leftpad.long() if cache_leftpad is not None
               else torch.zeros(b, dtype=torch.long, device=dev))
        end = lens.long()  # the keys end (exclusive), where the last query sits - 1
    if attention_chunk > 0:
        # FA3's chunked attention: a query at (shifted) position p sees keys from the start of
        # its chunk, p - p % attention_chunk. One decode per query row, each its own start.
        rows_out, rows_lse = [], []
        for i in range(s_q):
            at = end - pad - s_q + i  # the row's shifted position (< 0: it sees nothing)
            first = pad + at.clamp_min(0) - at.clamp_min(0).remainder(attention_chunk)
            # keys up to the row's right bound, `delta` past its position: a one-row decode
            # sees up to its last key, so a left window side grows by delta
            delta = s_q - 1 - i if right < 0 else min(s_q - 1 - i, right)
            res = decode(
                q[:, i:i + 1].contiguous(), kc, vc,
                cache_seqlens=(end - s_q + i + 1 + delta - first).clamp(0, capacity)
                .to(torch.int32),
                block_table=from_start(first), softmax_scale=softmax_scale,
                window_size=(left + delta if left >= 0 else -1, 0), softcap=cap,
                k_scale=k_scale, v_scale=v_scale, return_lse=return_softmax_lse,
            )
            o, ls = res if return_softmax_lse else (res, None)
            rows_out.append(o)
            rows_lse.append(ls)
        out = torch.cat(rows_out, dim=1)
        lse_rows = torch.cat(rows_lse, dim=1) if return_softmax_lse else None
        res = (out, lse_rows) if return_softmax_lse else out
    else:
        if shifted:
            table = from_start(pad)
            lens = (end - pad).clamp_min(0).to(torch.int32)
        elif paged:
            table = page_table.contiguous()
        elif idx is not None:
            if k_cache.is_contiguous() and v_cache.is_contiguous():
                # The rows a batch entry uses, in place: the cache seen as a pool of pages of
                # `ps` positions, request r's pages those of cache row idx[r].
                ps = max(p for p in SUPPORTED_PAGE_SIZES if block_size % p == 0)
                per = block_size // ps
                kc = k_cache.view(blocks * per, ps, hkv, d)
                vc = v_cache.view(blocks * per, ps, hkv, d)
                table = (idx[:, None] * per + torch.arange(per, device=dev)).to(torch.int32)
            else:
                # A strided cache cannot be seen as a pool: its rows are gathered (a copy).
                kc, vc = (_gather_rows(c, idx) for c in (k_cache, v_cache))
        res = decode(
            q.contiguous(), kc, vc, cache_seqlens=lens, block_table=table,
            softmax_scale=softmax_scale, window_size=(left, right), softcap=cap,
            k_scale=k_scale, v_scale=v_scale, return_lse=return_softmax_lse,
        )
    out, lse = res if return_softmax_lse else (res, None)
    if q_rows is not None:  # back to [total_q, ...]; FA3's varlen LSE is [nheads, total_q]
        out = out[q_rows]
        lse = None if lse is None else lse[q_rows].transpose(0, 1).contiguous()
    elif lse is not None:
        lse = lse.transpose(1, 2).contiguous()  # [b, s_q, h] -> FA3's [b, h, s_q]
    return (out, lse) if return_softmax_lse else out


def _rotate(x: Any, cos: Any, sin: Any, pos: Any, interleaved: bool) -> Any:
    """``x`` ``[b, s, h, d]`` with its first ``rotary_dim`` channels rotated by the rows ``pos``
    ``[b, s]`` of ``cos`` / ``sin`` ``[seqlen_ro, rotary_dim / 2]``, in float32, rounded back to
    x's dtype (FA3's arithmetic)."""
    import torch

    b, s = pos.shape
    half = cos.shape[1]
    at = pos.clamp(0, cos.shape[0] - 1).reshape(-1)
    c = cos.index_select(0, at).float().view(b, s, 1, half)
    sn = sin.index_select(0, at).float().view(b, s, 1, half)
    xr = x[..., : 2 * half].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * sn, x1 * sn + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * sn, x1 * sn + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _block_scale(scale: Any, slots: Any, valid: Any, req: Any, blocks: int, block_size: int,
                 b: int, hkv: int, per_request_blocks: bool) -> Any:
    """The scale :func:`kvstream.store_kv` quantises with (``slots``, ``valid`` and ``req``:
    each new token's slot, whether it is written, its request). FA3's per-request ``[b, hkv]``
    descale becomes a ``[blocks, hkv]`` one whose blocks (cache rows or pages) receiving request
    r's new tokens hold r's scales; other shapes ([1], [hkv]) and a contiguous cache whose
    blocks are the requests take it as it is."""
    if scale is None or per_request_blocks or tuple(scale.shape) != (b, hkv):
        return scale
    import torch

    block = torch.div(slots, block_size, rounding_mode="floor")
    block = torch.where(valid, block, torch.full_like(block, blocks))  # skipped: a spare row
    per_block = torch.ones(blocks + 1, hkv, dtype=scale.dtype, device=scale.device)
    per_block[block] = scale[req]
    return per_block[:blocks]


def _packed_rows(cu_seqlens: Any, total: int, b: int) -> Tuple[Any, Any, Any]:
    """A packed variable-length list of ``total`` rows (request r's rows ``cu_seqlens[r] ..<
    cu_seqlens[r + 1]``): each row's request and index within it, and each request's count."""
    import torch

    cu = cu_seqlens.long()
    t = torch.arange(total, device=cu.device)
    req = torch.searchsorted(cu[1:], t, right=True).clamp_max(b - 1)
    return req, t - cu[req], cu[1:] - cu[:-1]


def _gather_rows(cache: Any, idx: Any) -> Any:
    """``cache[idx]`` as a new contiguous tensor (fp8 caches gathered as bytes)."""
    import torch

    if str(cache.dtype) in FP8_KV_DTYPES:
        return cache.view(torch.uint8).index_select(0, idx).view(cache.dtype)
    return cache.index_select(0, idx)
