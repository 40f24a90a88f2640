"""kvstream as a Hugging Face transformers (5.x) attention implementation.

::

    import kvstream.integrations.transformers as kvt
    from transformers import AutoModelForCausalLM

    name = kvt.register()                      # "kvstream"; idempotent
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name,
                                                 dtype=torch.bfloat16).cuda()
    out = model.generate(ids, max_new_tokens=256, cache_implementation="static")

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
:func:`build_mask` (transformers' sdpa mask, with a padding check) to its
``AttentionMaskInterface`` under the name ``"kvstream"``, so any model whose attention layers
dispatch through ``ALL_ATTENTION_FUNCTIONS`` (the tests use Llama-, Qwen2- and gpt-oss-style
models) accepts ``attn_implementation="kvstream"`` (also
``model.set_attn_implementation("kvstream")``).

Decode steps run on :func:`kvstream.decode`: one to eight new tokens per request over a cache of
fixed capacity, read in place (a ``StaticCache`` layer ``[b, hkv, max_len, d]`` is passed as the
strided view ``[b, max_len, hkv, d]``, no copy). The cache lengths come from the boolean mask
transformers builds for the step (the last position each request sees, plus one), on the GPU,
with no host synchronisation (the attention traces into one graph under ``torch.compile``). The
module's ``scaling`` becomes ``softmax_scale``, a layer's ``sliding_window`` W (a token sees
itself and the W - 1 before it) becomes ``window_size=(W - 1, 0)``, ``softcap`` (Gemma 2's
``attn_logit_softcapping``) ``softcap`` and gpt-oss's ``s_aux`` (the module's ``sinks``)
``sinks``.

Everything else runs on transformers' own functions: ``sdpa`` (``sdpa_attention_forward``), or,
for layers with sinks or a softcap (which sdpa lacks), the model's own ``eager`` attention.
That covers the prefill (more than 8 query tokens, or a step whose mask transformers skipped:
the first chunk of a prompt), caches whose length grows every step (``DynamicCache``: there
transformers passes no mask for one-token steps, and a new cache length would plan a new
decoder at every step), continuous batching (``generate_batch``: packed variable-length
batches), training and autograd, CPU tensors, dtypes other than bf16 / fp16, head dims other
than 64, 96, 128 and 256, more than 32 query heads per KV head, position biases and
non-causal attention.

Padding: kvstream reads positions ``0 .. len - 1`` of each request, so a left-padded batch (a
2-D ``attention_mask`` with zeros) cannot run on it. :func:`build_mask` checks the 2-D mask at
each forward (one device-to-host read of one flag, skipped while tracing or capturing) and,
when it has zeros, hands the layers the additive float mask instead of the boolean one, which
sends the whole step to sdpa / eager: padded batches are right, not fast. Under
``torch.compile`` or CUDA-graph capture the check cannot read the mask; compiled decoding
needs batches without padding (equal-length prompts, or one request per batch).

Importing this module imports neither torch nor transformers; :func:`register` does.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional, Tuple

import kvstream as _kvs

__all__ = ["NAME", "register", "attention_forward", "build_mask", "fallback_reason"]

#: The ``attn_implementation`` name :func:`register` registers.
NAME = "kvstream"

# kvstream.decode takes CUDA tensors only; the CPU tests switch this off together with a
# stand-in for kvstream.decode, to run the routing on the CPU.
_REQUIRE_CUDA = True
# Keyword arguments of continuous batching (transformers' paged cache, generate_batch): packed
# variable-length batches, which kvstream does not take.
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "block_table", "read_index", "write_index")
_PADDING_WARNING = (
    "kvstream: the attention_mask has padding (zeros); kvstream reads every position up to each "
    "request's length, so this batch runs on sdpa / eager attention instead (padded batches are "
    "right, not fast). Batch prompts of equal length for kvstream decode steps."
)


def _transformers_major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def register() -> str:
    """Registers kvstream with transformers under :data:`NAME` (``"kvstream"``) and returns it.

    Adds :func:`attention_forward` to ``transformers.AttentionInterface`` and :func:`build_mask`
    to ``transformers.AttentionMaskInterface`` (their global mappings, seen by every model);
    then ``from_pretrained(..., attn_implementation="kvstream")``, ``from_config(cfg,
    attn_implementation="kvstream")`` and ``model.set_attn_implementation("kvstream")`` select
    it. Calling it again changes nothing. Raises ``ImportError`` when torch or transformers 5.x
    is not importable.
    """
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        raise ImportError(
            "kvstream.integrations.transformers.register needs torch and transformers >= 5 "
            f"(pip install 'transformers>=5,<6'): {e}"
        ) from None
    version = getattr(transformers, "__version__", "0")
    if _transformers_major(version) < 5:
        raise ImportError(
            f"kvstream.integrations.transformers.register needs transformers >= 5, found "
            f"{version} (pip install 'transformers>=5,<6')"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if AttentionInterface._global_mapping.get(NAME) is not attention_forward:
        AttentionInterface.register(NAME, attention_forward)
    if AttentionMaskInterface._global_mapping.get(NAME) is not build_mask:
        AttentionMaskInterface.register(NAME, build_mask)
    return NAME


# ---- the mask ----


def _is_tracing(x: Any) -> bool:
    """True while torch.compile / export / jit trace or a CUDA graph is being captured (the
    mask's values cannot be read then)."""
    try:
        from transformers.utils.import_utils import is_tracing
    except ImportError:  # pragma: no cover (older layouts)
        import torch

        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        return bool(torch.compiler.is_compiling() or torch.jit.is_tracing() or capturing)
    return bool(is_tracing(x))


def build_mask(*args: Any, **kwargs: Any) -> Any:
    """The ``AttentionMaskInterface`` entry of ``"kvstream"``: transformers' sdpa mask (a
    boolean ``[b, 1, q_len, kv_len]`` tensor, or None where sdpa would skip it), the one the
    decode steps read the cache lengths from.

    When the 2-D ``attention_mask`` it is given has zeros (padding) and a cache is in use
    (``kv_length > q_length``), the mask is returned as the additive float mask of transformers'
    eager attention (0 where seen, the dtype's minimum elsewhere): :func:`attention_forward`
    then runs every layer of the step on sdpa / eager, which handle padding. Reading the 2-D mask
    costs one device-to-host copy per forward, skipped while tracing or capturing.
    """
    import torch
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    padding = kwargs.get("attention_mask")
    q_length = kwargs.get("q_length")
    kv_length = kwargs.get("kv_length")
    padded = False
    if (
        isinstance(padding, torch.Tensor)
        and padding.dim() == 2
        and isinstance(q_length, int)
        and isinstance(kv_length, int)
        and kv_length > q_length
        and not _is_tracing(padding)
    ):
        padded = not bool(padding.all())
    if not padded:
        return sdpa_mask(*args, **kwargs)
    warnings.warn(_PADDING_WARNING, stacklevel=2)
    kwargs["allow_is_causal_skip"] = False
    mask = sdpa_mask(*args, **kwargs)
    dtype = kwargs.get("dtype") or torch.float32
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype),
                       torch.finfo(dtype).min)


# ---- the attention function ----


def _cache_view_ok(t: Any) -> bool:
    """A ``[b, hkv, L, d]`` tensor whose view ``[b, L, hkv, d]`` kvstream reads in place: the
    head dim contiguous, the other strides positive multiples of 16 bytes (size-1 dims aside)."""
    if t.stride(-1) != 1:
        return False
    item = t.element_size()
    return all(s > 0 and (s * item) % 16 == 0
               for s, n in zip(t.stride()[:3], t.shape[:3]) if n != 1)


def fallback_reason(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    **kwargs: Any,
) -> Optional[str]:
    """Why :func:`attention_forward` would not run this call on kvstream (None: it would).

    The arguments are those transformers passes to an attention function: ``query``
    ``[b, hq, q_len, d]``, ``key`` / ``value`` as the cache returns them ``[b, hkv, kv_len, d]``,
    the mask :func:`build_mask` made, and the layer's keyword arguments.
    """
    import torch

    if any(kwargs.get(k) is not None for k in _VARLEN_KWARGS):
        return "continuous batching (packed variable-length batch)"
    if _REQUIRE_CUDA and not (query.is_cuda and key.is_cuda and value.is_cuda):
        return "tensors not on a CUDA device"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "query / key / value not 4-D"
    b, hq, q_len, d = (int(s) for s in query.shape)
    kb, hkv, kv_len, kd = (int(s) for s in key.shape)
    if q_len > _kvs.MAX_Q_LEN:
        return f"prefill: {q_len} query tokens (kvstream decodes 1..{_kvs.MAX_Q_LEN})"
    if attention_mask is None:
        return ("no mask: a step whose mask transformers skipped (a prompt's first chunk, or "
                "a one-token step over a cache that grows: DynamicCache)")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        return "a mask that is not boolean (padding, or a custom mask)"
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or tuple(
        attention_mask.shape[2:]
    ) != (q_len, kv_len) or attention_mask.shape[0] not in (1, b):
        return (f"mask of shape {list(attention_mask.shape)} (allowed: [{b} or 1, 1, {q_len}, "
                f"{kv_len}])")
    if kv_len <= q_len:
        return "no cached positions before the new tokens"
    if module is not None and getattr(module, "training", False) and dropout:
        return "training with attention dropout"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad):
        return "autograd (kvstream has no backward)"
    if kwargs.get("position_bias") is not None:
        return "a position bias"
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        return "non-causal attention"
    dtypes = (torch.bfloat16, torch.float16)
    if query.dtype not in dtypes or key.dtype != query.dtype or value.dtype != query.dtype:
        return (f"dtypes {query.dtype} / {key.dtype} / {value.dtype} (allowed: bf16 or fp16, "
                f"the same for query, key and value)")
    if d not in _kvs.SUPPORTED_HEAD_DIMS or kd != d or tuple(value.shape) != (kb, hkv, kv_len, d):
        return (f"head dims {d} / {kd} / {int(value.shape[-1])} (allowed: one of "
                f"{', '.join(map(str, _kvs.SUPPORTED_HEAD_DIMS))} for all three)")
    if kb != b or hkv < 1 or hq % hkv != 0 or hq // hkv > _kvs.MAX_GROUP:
        return (f"{hq} query heads on {hkv} KV heads, batch {b} / {kb} (allowed: a multiple, at "
                f"most {_kvs.MAX_GROUP} per KV head, one batch)")
    if not (_cache_view_ok(key) and _cache_view_ok(value)):
        return f"cache strides {list(key.stride())} / {list(value.stride())}"
    window = kwargs.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or window < 1):
        return f"sliding_window {window!r} (allowed: a positive int or None)"
    softcap = kwargs.get("softcap")
    if softcap is not None and not (isinstance(softcap, (int, float))
                                    and not isinstance(softcap, bool) and softcap >= 0):
        return f"softcap {softcap!r} (allowed: a non-negative number or None)"
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, torch.Tensor)
                              or tuple(sinks.shape) != (hq,) or sinks.device != query.device):
        return f"sinks (s_aux) of shape {list(getattr(sinks, 'shape', []))} (allowed: [{hq}])"
    return None


def _cache_seqlens(mask: Any, batch: int) -> Any:
    """int32 ``[batch]``: one past the last position the last query row of each request sees
    (the cache length, new tokens included), computed on the device."""
    import torch

    row = mask[:, 0, -1, :]
    kv_len = row.shape[-1]
    pos = torch.arange(1, kv_len + 1, device=row.device, dtype=torch.int32)
    lens = torch.where(row, pos, torch.zeros((), device=row.device, dtype=torch.int32))
    lens = lens.amax(dim=-1)
    if lens.shape[0] != batch:
        lens = lens.expand(batch)
    return lens.contiguous()


def attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> Tuple[Any, None]:
    """The ``AttentionInterface`` entry of ``"kvstream"`` (transformers' attention-function
    signature): ``query`` ``[b, hq, q_len, d]``, ``key`` / ``value`` ``[b, hkv, kv_len, d]``
    (the cache's buffers), the mask of :func:`build_mask`, ``scaling`` and the layer's keywords
    (``sliding_window``, ``softcap``, ``s_aux``, ...). Returns ``(out, None)``, ``out``
    ``[b, q_len, hq, d]``.

    Runs on :func:`kvstream.decode` when :func:`fallback_reason` finds nothing against it, else
    on transformers' sdpa attention (the model's eager attention for layers with sinks or a
    softcap).
    """
    if fallback_reason(module, query, key, value, attention_mask, dropout, **kwargs) is not None:
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    q = query.transpose(1, 2)
    if not q.is_contiguous():
        q = q.contiguous()
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    out = _kvs.decode(
        q,
        key.transpose(1, 2),
        value.transpose(1, 2),
        cache_seqlens=_cache_seqlens(attention_mask, q.shape[0]),
        softmax_scale=None if scaling is None else float(scaling),
        window_size=(-1, 0) if window is None else (window - 1, 0),
        softcap=float(softcap) if softcap else 0.0,
        sinks=sinks,
    )
    return out, None


# ---- the fallback: transformers' own attention ----


def _additive(mask: Any, dtype: Any) -> Any:
    import torch

    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype),
                       torch.finfo(dtype).min)


def _eager(module: Any, query: Any, key: Any, value: Any, mask: Any, dropout: float,
           scaling: Optional[float], softcap: Any, sinks: Any) -> Tuple[Any, Any]:
    """Plain attention with an additive mask, softcap and sinks (for models whose modeling file
    has no ``eager_attention_forward``)."""
    import torch

    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    s = torch.matmul(query, k.transpose(2, 3)).float() * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s + mask.float()
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    p = torch.nn.functional.dropout(p, p=dropout, training=bool(getattr(module, "training", False)))
    out = torch.matmul(p.to(value.dtype), v)
    return out.transpose(1, 2).contiguous(), p


def _fallback(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float,
              scaling: Optional[float], kwargs: dict) -> Tuple[Any, Any]:
    """transformers' sdpa attention; for layers with sinks or a softcap (sdpa has neither) the
    model's eager attention with the mask made additive."""
    sinks = kwargs.get("s_aux")
    softcap = kwargs.get("softcap")
    if sinks is None and softcap is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    import torch

    mask = attention_mask
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is None and q_len > 1:
        # A skipped sdpa mask means sdpa's is_causal (upper-left aligned: the prompt's first
        # chunk, the rest of a static cache unused); eager needs it spelled out.
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
        mask = mask[None, None]
    mask = _additive(mask, query.dtype)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is not None:
        return eager(module, query, key, value, mask, dropout=dropout,
                     scaling=query.shape[-1] ** -0.5 if scaling is None else scaling, **kwargs)
    return _eager(module, query, key, value, mask, dropout, scaling, softcap, sinks)
