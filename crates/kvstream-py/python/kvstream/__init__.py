"""kvstream: decode attention for LLM inference on NVIDIA Hopper (H100 / H200), from PyTorch.

A few new query tokens per request (usually one) attend to a long KV cache, in the layouts of
FlashAttention-3's ``flash_attn_with_kvcache``::

    import torch, kvstream

    b, L, hq, hkv, d = 4, 8192, 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(b, L, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(b, L, hkv, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([8192, 100, 0, 4000], device="cuda", dtype=torch.int32)
    out, lse = kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, return_lse=True)
    # out: [b, 1, hq, d] bf16; lse: [b, 1, hq] float32 (natural log)

``q`` may also be ``[b, hq, d]`` (one token per request; ``out`` is then ``[b, hq, d]`` and
``lse`` ``[b, hq]``), or carry up to 8 new tokens per request, ``[b, q_len, hq, d]``
(speculative-decoding verification, multi-token prediction): token ``i`` of request ``r`` sees
cache positions ``0 .. cache_seqlens[r] - q_len + i`` (the new tokens are the last ``q_len``
positions of the cache, causal among themselves).

Paged caches (vLLM / FlashAttention-3 ``page_table``): pass ``block_table``, int32
``[b, max_pages]``; ``k_cache`` and ``v_cache`` are then pools ``[num_pages, page_size, hkv, d]``
and position ``t`` of request ``r`` lives in page ``block_table[r, t // page_size]``, row
``t % page_size``::

    k_pool = torch.randn(4096, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    # 512 pages of 16 positions per request (capacity 8192), anywhere in the pools
    table = torch.randperm(4096, device="cuda", dtype=torch.int32)[: b * 512].view(b, 512)
    out = kvstream.decode(q, k_pool, v_pool, cache_seqlens=lens, block_table=table)

FP8 caches: ``k_cache`` and ``v_cache`` may be ``torch.float8_e4m3fn`` (contiguous or paged)
with ``q`` in bf16 or fp16; ``k_scale`` / ``v_scale`` are float32 dequantisation scales on the
device, one per cache (``[1]``), per KV head (``[hkv]``) or per request and KV head
(``[batch, hkv]``), read at every call (a graph replay sees new values)::

    k8 = (k_cache / 0.05).to(torch.float8_e4m3fn)
    v8 = (v_cache / 0.05).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.05], device="cuda")
    out = kvstream.decode(q, k8, v8, cache_seqlens=lens, k_scale=scale, v_scale=scale)

Score modifiers, named as in FlashAttention-3: ``window_size=(left, right)`` (a sliding
window, ``-1`` unbounded; the default ``(-1, 0)`` is causal over the whole cache), ``softcap``
(scaled scores ``s`` become ``c * tanh(s / c)``) and ``sinks`` (a float32 ``[hq]`` logit per
query head that joins the softmax denominator and adds no value, gpt-oss's). They, and head
dims 96 and 256, run on the persistent engine::

    sinks = torch.zeros(hq, device="cuda")
    out = kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, window_size=(127, 0),
                          softcap=30.0, sinks=sinks)

New tokens go into a cache with :func:`store_kv` (vLLM's ``reshape_and_cache`` semantics:
``slot_mapping`` int64, slot = page * page_size + offset, -1 skips), quantised for an fp8 cache
with the same scales; :func:`fp8_scales` gives per-KV-head scales (amax / 448) of an existing
bf16 / fp16 cache for converting it.

The decode entry point is :func:`decode`. It launches on PyTorch's current stream and never
synchronises with the host. The first call for a shape creates a decoder (plans, compiles or
loads the kernels, allocates the split workspace; this may take seconds on a cold kernel cache
and synchronises the device once); later calls with the same shape reuse it and allocate
nothing when ``out`` is given (and ``return_lse`` is False). A contiguous cache passed as a view
``cache[:, :n]`` of a longer buffer is read by the decoder of the buffer's capacity rounded to
the power of two above ``n``, so the views of a growing cache share one decoder per power of
two. Decoders live in an LRU (:func:`set_decoder_cache_size`, :func:`clear_cache`).

Partial outputs over disjoint parts of the keys (the shards of a context-parallel cache) merge
by their LSEs with :func:`merge_states`; :mod:`kvstream.distributed` runs a whole
context-parallel decode over ``torch.distributed``.

CUDA graphs: call :func:`decode` once with the same shapes, dtype, ``softmax_scale``,
``window_size``, ``softcap``, ``sinks`` given or not, ``num_splits``, ``reduction`` and
``device_plan`` before capturing (the usual warm-up), then capture; replays may change the
contents of ``cache_seqlens``, ``block_table``, ``q``, the caches, the fp8 scales and the sinks
but not their addresses::

    out = torch.empty_like(q)
    kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, out=out)   # warm-up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, out=out)
    lens.copy_(new_lens); g.replay()

The split count of a decoder is planned from the shapes (the cache capacity), so a graph
replayed with lengths very different from the capacity may leave SMs idle. With
``device_plan=True`` the partition is planned on the GPU from the lengths in ``cache_seqlens``
at every call (and every replay): each request gets splits in proportion to its length.

torch.compile: with torch tensors the calls run as torch custom ops (``torch.ops.kvstream.decode``,
``decode_out`` when ``out`` is given, ``mla_decode``, ``mla_decode_out``, ``store_kv``; see
``kvstream._ops``), registered at the first such call, so ``torch.compile(fullgraph=True)`` and
``torch.export`` trace through them and the profiler names them.

Importing this package needs neither PyTorch nor a GPU; arguments are checked by their
attributes (``shape``, ``dtype``, ``is_cuda``, ``device``, ``stride``, ``is_contiguous``,
``data_ptr``), so errors are reported before anything touches the GPU: ``TypeError`` for a wrong
type or dtype, ``ValueError`` for a wrong shape, layout or device, each naming the argument, the
value and what is allowed. Errors from the library itself are ``ValueError`` (invalid argument)
or ``RuntimeError`` (driver, compiler, no suitable GPU).
"""

from __future__ import annotations

import math
import sys
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from . import _native

__all__ = [
    "decode",
    "mla_decode",
    "store_kv",
    "merge_states",
    "fp8_scales",
    "self_test",
    "clear_cache",
    "set_decoder_cache_size",
    "decoder_cache_info",
    "DEFAULT_DECODER_CACHE_SIZE",
    "SUPPORTED_DTYPES",
    "FP8_KV_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "SPLIT_ENGINE_HEAD_DIMS",
    "MAX_GROUP",
    "MAX_SPLITS",
    "REDUCTIONS",
    "CLUSTER_SPLITS",
    "MAX_Q_LEN",
    "SUPPORTED_PAGE_SIZES",
    "MLA_DIM",
    "MLA_V_DIM",
    "MLA_MAX_HEADS",
    "MAX_MERGE_HEAD_DIM",
]
__version__ = _native.__version__

#: ``str(tensor.dtype)`` of the element types the kernels take, and their native names.
SUPPORTED_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "f16"}
#: ``str(tensor.dtype)`` of the fp8 cache element type, and its native name.
FP8_KV_DTYPES = {"torch.float8_e4m3fn": "fp8_e4m3"}
#: Head dimensions the kernels are built for (K and V of the same head dim).
SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
#: Head dimensions the split engine serves (the persistent engine serves all of
#: ``SUPPORTED_HEAD_DIMS``).
SPLIT_ENGINE_HEAD_DIMS = (64, 128)
#: Largest number of query heads per KV head.
MAX_GROUP = 32
#: Largest forced split count.
MAX_SPLITS = 128
#: Engines ``decode`` accepts for ``engine`` (besides None: chosen by the plan).
ENGINES = ("persistent", "split")
#: Split reduction modes ``decode`` accepts for ``reduction`` (besides None: automatic).
REDUCTIONS = ("kernel", "cluster")
#: Split counts cluster reduction accepts.
CLUSTER_SPLITS = (1, 2, 4, 8, 16)
#: Most new tokens per request (``q.shape[1]`` of a 4-D ``q``).
MAX_Q_LEN = 8
#: Page sizes of a paged cache (``k_cache.shape[1]`` when ``block_table`` is given).
SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Largest bounded side of ``window_size`` (positions); -1 is unbounded.
_MAX_WINDOW = 2**31 - 2

_INT32 = "torch.int32"
_TENSOR_ATTRS = ("shape", "dtype", "is_cuda", "device", "stride", "is_contiguous", "data_ptr")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _one_of(values: Tuple[Any, ...]) -> str:
    """``"64, 96, 128 or 256"``."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


def _tensor(name: str, x: Any, fn: str = "decode") -> Tuple[int, ...]:
    """Checks that ``x`` is a CUDA tensor; returns its shape as a tuple of ints."""
    missing = [a for a in _TENSOR_ATTRS if not hasattr(x, a)]
    if missing:
        raise TypeError(
            f"kvstream.{fn}: {name} must be a CUDA torch.Tensor, got {type(x).__name__} "
            f"(no attribute {missing[0]!r})"
        )
    if not x.is_cuda:
        raise ValueError(
            f"kvstream.{fn}: {name} must be on a CUDA device, got a tensor on {x.device}"
        )
    return tuple(int(s) for s in x.shape)


def _rank(name: str, shape: Tuple[int, ...], rank: int, layout: str, fn: str = "decode") -> None:
    if len(shape) != rank:
        raise ValueError(
            f"kvstream.{fn}: {name} must have {rank} dimensions {layout}, "
            f"got shape {list(shape)}"
        )


def _same_device(
    name: str, x: Any, dev: Tuple[str, Optional[int]], q: Any, fn: str = "decode"
) -> None:
    if _device_key(x) != dev:
        raise ValueError(
            f"kvstream.{fn}: {name} is on {x.device}, allowed: {q.device} (the device of q)"
        )


def _dtype(name: str, x: Any, allowed: Tuple[str, ...], fn: str = "decode") -> str:
    d = str(x.dtype)
    if d not in allowed:
        raise TypeError(
            f"kvstream.{fn}: {name} has dtype {d}, allowed: {', '.join(allowed)}"
        )
    return d


def _device_key(x: Any) -> Tuple[str, Optional[int]]:
    dev = x.device
    return (str(getattr(dev, "type", dev)), getattr(dev, "index", None))


def _aligned(name: str, x: Any, fn: str = "decode", fake: bool = False) -> None:
    if fake:  # a fake tensor (torch.compile, export) has no address: checked at run time
        return
    ptr = int(x.data_ptr())
    if ptr % 16 != 0:
        raise ValueError(
            f"kvstream.{fn}: {name} starts at address {ptr:#x}, allowed: 16-byte aligned "
            f"(a tensor view with a storage offset that is not a multiple of 8 elements)"
        )


def _contiguous(name: str, x: Any, shape: Tuple[int, ...], fn: str = "decode") -> None:
    if not x.is_contiguous():
        raise ValueError(
            f"kvstream.{fn}: {name} must be contiguous, got shape {list(shape)} with strides "
            f"{list(x.stride())} (call .contiguous() first)"
        )


def _cache_strides(
    name: str, x: Any, shape: Tuple[int, ...], align: int = 8, fn: str = "decode"
) -> Optional[Tuple[int, int, int]]:
    """None for a contiguous cache; else its (batch, token, head) element strides, checked
    (multiples of ``align`` elements: 16 bytes)."""
    if x.is_contiguous():
        return None
    b, L, hkv, d = shape
    st = [int(s) for s in x.stride()]
    natural = [L * hkv * d, hkv * d, d, 1]
    # Strides of size-1 dimensions are meaningless: use the contiguous ones.
    st = [n if size == 1 else s for s, n, size in zip(st, natural, shape)]
    ok = st[3] == 1 and all(s > 0 and s % align == 0 for s in st[:3])
    if not ok:
        raise ValueError(
            f"kvstream.{fn}: {name} has strides {list(x.stride())} for shape {list(shape)}, "
            f"allowed: a contiguous last dimension and positive batch, token and head strides "
            f"that are multiples of {align} elements (16 bytes) (call .contiguous() first)"
        )
    return (st[0], st[1], st[2])


#: The smallest capacity a view of a longer cache is read with (see :func:`_view_capacity`).
_VIEW_MIN_CAPACITY = 256


def _view_capacity(x: Any, shape: Tuple[int, ...]) -> int:
    """Positions a contiguous cache view ``[b, L, hkv, d]`` may be read with: L rounded up to a
    power of two (at least :data:`_VIEW_MIN_CAPACITY`), as far as the memory behind the view
    reaches with its strides; L itself where that is not known (no torch storage). The views
    ``cache[:, :n]`` of a growing cache then share the decoder of each power of two, whose
    plan is within a factor 2 of their length (the lengths themselves are read on the GPU)."""
    b, L, hkv, d = shape
    storage = getattr(x, "untyped_storage", None)
    if storage is None or L < 1:
        return L
    try:
        avail = storage().nbytes() // x.element_size() - x.storage_offset()
        st = [int(s) for s in x.stride()]
    except (RuntimeError, TypeError, AttributeError):
        return L
    if st[1] <= 0:
        return L
    bucket = max(_VIEW_MIN_CAPACITY, 1 << (L - 1).bit_length())
    fixed = (b - 1) * st[0] + (hkv - 1) * st[2] + d
    reach = (avail - fixed) // st[1] + 1 if avail >= fixed else L
    return max(L, min(bucket, reach))


def _scale(name: str, sc: Any, shapes: Dict[tuple, str], dev: Any, ref: Any,
           fn: str = "decode", fake: bool = False) -> Tuple[int, int]:
    """(pointer, element count) of a float32 scale tensor of one of ``shapes`` (shape ->
    what it means, for the error)."""
    ss = _tensor(name, sc, fn)
    _dtype(name, sc, ("torch.float32",), fn)
    if ss not in shapes and not (ss == () and (1,) in shapes):
        allowed = " or ".join(f"{list(shape)} ({what})" for shape, what in shapes.items())
        raise ValueError(f"kvstream.{fn}: {name} has shape {list(ss)}, allowed: {allowed}")
    _same_device(name, sc, dev, ref, fn)
    _contiguous(name, sc, ss, fn)
    numel = 1
    for n in ss:
        numel *= n
    return (0 if fake else int(sc.data_ptr())), numel


#: Decoders kept at most by default (see :func:`set_decoder_cache_size`).
DEFAULT_DECODER_CACHE_SIZE = 64


class _Cached:
    __slots__ = ("decoder", "stream", "captured")

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self.stream: Any = None  # torch stream of the last eager call
        self.captured = False  # used while a CUDA graph was captured: never dropped by the LRU


# One decoder per distinct (shapes, dtypes, strides, options, device), least recently used
# first. Each holds a plan, its compiled kernels and a device workspace; a graph that captured
# a decoder's launches holds that workspace's address, so such decoders are never dropped
# unless clear_cache(include_captured=True) says so.
_decoders: "OrderedDict[tuple, _Cached]" = OrderedDict()
_capacity = DEFAULT_DECODER_CACHE_SIZE
_lock = threading.Lock()


def _evict_over_capacity(keep_newest: bool) -> List[_Cached]:
    """Under _lock: removes least recently used, uncaptured decoders beyond the capacity; with
    ``keep_newest`` never the most recently used one, whose call is about to run it (where
    every other decoder is captured, a warm-up's decoder must be there for the capture)."""
    dropped: List[_Cached] = []
    for key in list(_decoders)[:-1] if keep_newest else list(_decoders):
        if len(_decoders) <= _capacity:
            break
        if not _decoders[key].captured:
            dropped.append(_decoders.pop(key))
    return dropped


def _release(dropped: List[_Cached]) -> None:
    """Waits for each dropped decoder's last stream: its workspace is freed when it goes, and
    work enqueued there may still read it."""
    for c in dropped:
        if c.stream is not None:
            c.stream.synchronize()


def _decoder_for(key: tuple, make: Any, capturing: bool, fn: str = "decode") -> _Cached:
    with _lock:
        c = _decoders.get(key)
        if c is not None:
            _decoders.move_to_end(key)
            if capturing:
                c.captured = True
            return c
    if capturing:
        raise RuntimeError(
            f"kvstream.{fn}: no decoder for these shapes yet and the current stream is being "
            "captured into a CUDA graph; creating one compiles kernels and allocates memory, "
            "which capture forbids. Call kvstream.decode once with the same shapes, dtype, "
            "softmax_scale, window_size, softcap, sinks given or not, num_splits, reduction, "
            "block_table shape and device_plan before capturing (warm-up)."
        )
    d = make()
    with _lock:
        c = _decoders.setdefault(key, _Cached(d))
        _decoders.move_to_end(key)
        dropped = _evict_over_capacity(keep_newest=True)
    _release(dropped)
    return c


class _Spec:
    """What checking one call's arguments found: what its launch needs besides the tensors.

    ``key`` and ``make(index)`` name and build its decoder (the device index is added at launch,
    where a tensor on ``cuda`` without an index resolves to the current device); ``args`` are
    the arguments it was made from (the torch ops reuse a spec only for the very same ones).
    """

    __slots__ = ("fn", "dev", "key", "make", "out_shape", "lse_shape", "scales", "args",
                 "view_len")

    def __init__(self, fn: str, dev: Tuple[str, Optional[int]], key: tuple, make: Any,
                 out_shape: Tuple[int, ...], lse_shape: Tuple[int, ...], scales: Any,
                 args: tuple, view_len: Optional[int] = None) -> None:
        self.fn = fn
        self.dev = dev
        self.key = key
        self.make = make
        self.out_shape = out_shape
        self.lse_shape = lse_shape
        self.scales = scales
        self.args = args
        # the caches are a view of the first view_len positions of a decoder's capacity
        self.view_len = view_len


def _prepare(spec: _Spec) -> Tuple[Any, Any]:
    """The cached decoder of ``spec`` (made at the first call) and the current stream, ordered
    after the decoder's previous stream: its workspace may still be in use there."""
    import torch  # the tensors are torch tensors: torch is importable here

    dev = spec.dev
    index = dev[1] if dev[1] is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    capturing = torch.cuda.is_current_stream_capturing()
    cached = _decoder_for(spec.key + (index,), lambda: spec.make(index), capturing, spec.fn)
    if not capturing:
        prev = cached.stream
        if prev is not None and prev != stream:
            ev = torch.cuda.Event()
            ev.record(prev)
            stream.wait_event(ev)
        cached.stream = stream
    return cached.decoder, stream


def _stateless_launcher(table: Dict[tuple, Any], spec: _Spec, what: str) -> Tuple[Any, Any]:
    """The ``what`` (a writer, a merger: no workspace, so any stream may use one) of ``spec``
    from ``table``, made at the first call, and the current stream."""
    import torch

    dev = spec.dev
    index = dev[1] if dev[1] is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    key = spec.key + (index,)
    with _lock:
        made = table.get(key)
    if made is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"kvstream.{spec.fn}: no {what} for these shapes yet and the current stream is "
                f"being captured into a CUDA graph; call {spec.fn} once with the same shapes "
                f"before capturing (warm-up)."
            )
        made = spec.make(index)
        with _lock:
            made = table.setdefault(key, made)
    return made, stream


def _torch_ops(x: Any) -> Any:
    """kvstream._ops (the torch custom ops) if ``x`` is a torch tensor, else None (torch not
    imported, or a tensor-like object of another kind). The first such call imports it, which
    registers the ops: ``import kvstream`` needs no torch. (No module global records the
    import: torch.compile may trace the first call, and guards on the globals it reads.)"""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    from . import _ops

    return _ops


def self_test(verbose: bool = True) -> bool:
    """Checks in about two seconds that kvstream works here: a small GQA decode and a small MLA
    decode on GPU 0 against an FP32 PyTorch reference.

    Returns True (and prints one line when ``verbose``); raises ``RuntimeError`` saying what is
    missing otherwise: PyTorch, a CUDA device, an sm_90 GPU (H100 / H200), NVRTC 13 (the kernels
    are compiled at the first call) or a right answer.

    Example::

        python -c "import kvstream; kvstream.self_test()"
    """
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(
            "kvstream.self_test: PyTorch is not importable here; kvstream's Python API takes "
            f"torch tensors (pip install torch): {e}"
        ) from None
    if not torch.cuda.is_available():
        raise RuntimeError("kvstream.self_test: torch sees no CUDA device")
    major, minor = torch.cuda.get_device_capability(0)
    name = torch.cuda.get_device_name(0)
    if (major, minor) != (9, 0):
        raise RuntimeError(
            f"kvstream.self_test: GPU 0 ({name}) is sm_{major}{minor}; kvstream's kernels need "
            "sm_90 (H100 / H200)"
        )
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    def attend(q: Any, k: Any, v: Any, n: int, scale: float) -> Any:
        # q [h, dk], k [L, dk], v [L, dv], the first n positions: FP32 softmax(q k^T) v
        w = torch.softmax((q.float() @ k[:n].float().T) * scale, dim=-1)
        return w @ v[:n].float()

    errors = []
    try:
        # GQA: 2 requests, 16 query heads on 2 KV heads, d 128, lengths 1000 and 333
        q, k, v = rand(2, 16, 128), rand(2, 1000, 2, 128), rand(2, 1000, 2, 128)
        lens = torch.tensor([1000, 333], device="cuda", dtype=torch.int32)
        out = decode(q, k, v, cache_seqlens=lens)
        ref = torch.stack([
            torch.cat([attend(q[b, 8 * h:8 * h + 8], k[b, :, h], v[b, :, h], int(lens[b]), 128 ** -0.5)
                       for h in range(2)])
            for b in range(2)
        ])
        errors.append(((out.float() - ref).norm() / ref.norm()).item())
        # MLA: 1 request, 16 heads, 500 cached rows of 576 (V the first 512)
        qm, kv = rand(1, 1, 16, MLA_DIM), rand(1, 500, MLA_DIM)
        lm = torch.tensor([500], device="cuda", dtype=torch.int32)
        om = mla_decode(qm, kv, softmax_scale=192 ** -0.5, cache_seqlens=lm)
        refm = attend(qm[0, 0], kv[0], kv[0, :, :MLA_V_DIM], 500, 192 ** -0.5)
        errors.append(((om[0, 0].float() - refm).norm() / refm.norm()).item())
        torch.cuda.synchronize()
    except Exception as e:  # the library's own errors say what failed (driver, NVRTC, ...)
        raise RuntimeError(f"kvstream.self_test: a decode on GPU 0 ({name}) failed: {e}") from e
    if not all(err <= 1e-2 for err in errors):
        raise RuntimeError(
            f"kvstream.self_test: wrong results on GPU 0 ({name}): relative errors {errors} "
            "(allowed: 1e-2)"
        )
    if verbose:
        print(
            f"kvstream {__version__}: GPU 0 ({name}) ok; GQA and MLA decodes match the FP32 "
            f"reference (relative errors {errors[0]:.1e}, {errors[1]:.1e})"
        )
    return True


def set_decoder_cache_size(size: int) -> None:
    """Sets how many decoders kvstream keeps (default :data:`DEFAULT_DECODER_CACHE_SIZE`).

    A decoder is made at the first call with a new combination of shapes, dtypes, strides and
    options (for a paged cache: the block table's shape, not the lengths) and kept for the next
    calls like it; it holds compiled kernels and a device workspace. Beyond ``size`` the least
    recently used one is dropped, after the work on its last stream is done. Decoders used while
    a CUDA graph was captured are never dropped by this rule (the graph holds their workspace),
    so the cache may hold more than ``size`` of them. Shrinking drops at once what is over.

    Example::

        kvstream.set_decoder_cache_size(256)   # a server that serves many shapes
    """
    global _capacity
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(
            f"kvstream.set_decoder_cache_size: size must be an int, got {size!r} "
            f"({type(size).__name__})"
        )
    if size < 1:
        raise ValueError(f"kvstream.set_decoder_cache_size: size is {size}, allowed: size >= 1")
    with _lock:
        _capacity = size
        dropped = _evict_over_capacity(keep_newest=False)
    _release(dropped)


def clear_cache(include_captured: bool = False) -> None:
    """Drops the cached decoders (and their device workspaces) after the work on their last
    streams is done. The kernels stay compiled in the on-disk cache, so the next call with the
    same shapes only plans and allocates again.

    Decoders used while a CUDA graph was captured are kept unless ``include_captured`` is True:
    pass it only once those graphs are destroyed, as replaying one afterwards would use freed
    memory.
    """
    if not isinstance(include_captured, bool):
        raise TypeError(
            f"kvstream.clear_cache: include_captured must be a bool, got {include_captured!r} "
            f"({type(include_captured).__name__})"
        )
    with _lock:
        keys = [k for k, c in _decoders.items() if include_captured or not c.captured]
        dropped = [_decoders.pop(k) for k in keys]
    _release(dropped)


def decoder_cache_info() -> Dict[str, int]:
    """The decoder cache's state: ``size`` (decoders held), ``captured`` (of them, used while
    a CUDA graph was captured) and ``capacity`` (see :func:`set_decoder_cache_size`)."""
    with _lock:
        return {
            "size": len(_decoders),
            "captured": sum(1 for c in _decoders.values() if c.captured),
            "capacity": _capacity,
        }


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    """TypeError unless `value` is a str, ValueError unless it is one of `allowed`."""
    allowed_text = " or ".join(repr(a) for a in allowed) + " or None"
    if not isinstance(value, str):
        raise TypeError(
            f"kvstream.decode: {name} must be a str or None, got {value!r} "
            f"({type(value).__name__}), allowed: {allowed_text}"
        )
    if value not in allowed:
        raise ValueError(f"kvstream.decode: {name} is {value!r}, allowed: {allowed_text}")


def _device_vector(name: str, x: Any, dtype: str, n: int, meaning: str, dev: Any, ref: Any,
                   fn: str = "decode") -> None:
    """A contiguous CUDA vector of ``n`` ``dtype`` values on ``ref``'s device (``meaning`` says
    what its values are, in the shape error)."""
    shape = _tensor(name, x, fn)
    _dtype(name, x, (dtype,), fn)
    if shape != (n,):
        raise ValueError(
            f"kvstream.{fn}: {name} has shape {list(shape)}, allowed: [{n}] ({meaning})"
        )
    _same_device(name, x, dev, ref, fn)
    _contiguous(name, x, shape, fn)


_WINDOW_ALLOWED = (
    f"a pair (left, right) of ints, each -1 (unbounded) or a number of positions 0..{_MAX_WINDOW}"
)
# float32's largest finite value: the softcap is passed to the kernels as a float32.
_F32_MAX = 3.4028234663852886e38
_SOFTCAP_ALLOWED = "0.0 (off) or a finite positive number (a float32)"


def _window_size(window_size: Any) -> Tuple[int, int]:
    """``window_size`` checked: TypeError unless a tuple or list of two ints, ValueError unless
    each is -1 or 0.._MAX_WINDOW."""
    if not isinstance(window_size, (tuple, list)) or not all(_is_int(w) for w in window_size):
        raise TypeError(
            f"kvstream.decode: window_size must be {_WINDOW_ALLOWED}, got {window_size!r} "
            f"({type(window_size).__name__})"
        )
    if len(window_size) != 2:
        raise ValueError(
            f"kvstream.decode: window_size is {window_size!r} ({len(window_size)} values), "
            f"allowed: {_WINDOW_ALLOWED}"
        )
    left, right = (int(w) for w in window_size)
    for side, w in (("left", left), ("right", right)):
        if not -1 <= w <= _MAX_WINDOW:
            raise ValueError(
                f"kvstream.decode: window_size is ({left}, {right}), its {side} side {w}, "
                f"allowed: {_WINDOW_ALLOWED}"
            )
    return left, right


def _softcap(softcap: Any) -> float:
    """``softcap`` checked: TypeError unless an int or float, ValueError unless 0 or a finite
    positive number."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(
            f"kvstream.decode: softcap must be a float, got {softcap!r} "
            f"({type(softcap).__name__}), allowed: {_SOFTCAP_ALLOWED}"
        )
    try:
        c = float(softcap)
    except OverflowError:  # an int past any float
        c = float("inf")
    if not (c == 0.0 or 0.0 < c <= _F32_MAX):  # NaN and inf fail both
        raise ValueError(f"kvstream.decode: softcap is {c}, allowed: {_SOFTCAP_ALLOWED}")
    return c


def decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any = None,
    block_table: Any = None,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, 0),
    softcap: float = 0.0,
    sinks: Any = None,
    num_splits: Optional[int] = None,
    reduction: Optional[str] = None,
    device_plan: bool = False,
    engine: Optional[str] = None,
    k_scale: Any = None,
    v_scale: Any = None,
    return_lse: bool = False,
    out: Any = None,
) -> Any:
    """Decode attention of a few new query tokens per request over a KV cache (grouped-query).

    Args:
        q: ``[batch, q_len, hq, d]`` bf16 or fp16 CUDA tensor, contiguous: ``q_len`` new tokens
            per request, 1..8 (``seqlen_q`` of FlashAttention-3); or ``[batch, hq, d]`` for one
            token per request. Token ``i`` of request ``r`` sits at cache position
            ``t = len_r - q_len + i`` (the new tokens are the last ``q_len`` positions of the
            cache) and attends to positions ``0 .. t`` (causal among the new tokens), or to
            those ``window_size`` gives; a token that sees no position gets an output of zeros
            and an LSE of ``-inf`` (its sink with ``sinks``).
        k_cache, v_cache: without ``block_table``: ``[batch, L, hkv, d]`` tensors of q's dtype,
            or both ``torch.float8_e4m3fn`` (see ``k_scale``), on q's device; the last
            dimension contiguous, other strides multiples of 16 bytes (a slice of a larger
            cache along ``batch`` or ``L`` is fine). With ``block_table``:
            contiguous page pools ``[num_pages, page_size, hkv, d]``, ``page_size`` one of
            ``SUPPORTED_PAGE_SIZES`` (1, 2, 4, ..., 512). ``hq`` must be a multiple of ``hkv``
            with at most 32 query heads per KV head; ``d`` is 64, 96, 128 or 256 (96 and 256
            on the persistent engine only).
        cache_seqlens: optional int32 ``[batch]`` CUDA tensor: request ``r`` has
            ``cache_seqlens[r]`` positions in its cache, the new tokens included (values in
            ``0..=L``, or ``0..=max_pages * page_size`` when paged; a length of 0 gives an
            output of zeros and an LSE of ``-inf``). Default: every request uses all ``L``
            (``max_pages * page_size``) positions. Its values are read on the device only (no
            host sync).
        block_table: optional int32 ``[batch, max_pages]`` contiguous CUDA tensor (FA3's
            ``page_table``): the cache is paged, and position ``t`` of request ``r`` lives in
            page ``block_table[r, t // page_size]`` of the pools, row ``t % page_size``. The
            cache capacity is ``max_pages * page_size``. Every entry a request's length reaches
            must be a page id in ``0..num_pages - 1``; pages may sit anywhere in the pools, in
            any order. Its values are read on the device only.
        softmax_scale: scale of ``q @ k^T`` before the softmax; default ``1 / sqrt(d)``.
        window_size: ``(left, right)``, FlashAttention-3's sliding window: the token at cache
            position ``t`` sees positions ``t - left .. t + right`` of its request (within
            ``0 .. len_r - 1``); ``-1`` leaves that side unbounded. ``right`` only reaches the
            later new tokens of a multi-token ``q``. The default ``(-1, 0)`` is causal over the
            whole cache; ``(-1, -1)`` lets the new tokens see each other (not causal among
            themselves); ``(w - 1, 0)`` is a window of ``w`` positions ending at the token's
            own. Values: ``-1`` or ``0 .. 2^31 - 2``. A side that bounds nothing
            (``left >= capacity - 1``; ``right >= q_len - 1``, or any ``right`` when ``q_len``
            is 1) is taken as the default's.
        softcap: logit softcap ``c`` (Gemma 2): scaled scores ``s`` become
            ``c * tanh(s / c)`` before the softmax. ``0.0`` (default): off; else a finite
            positive number.
        sinks: optional float32 ``[hq]`` contiguous CUDA tensor on q's device (gpt-oss's
            sinks, vLLM's ``s_aux``): one logit per query head, on the scale of the scaled
            (and capped) scores, that joins each row's softmax denominator and contributes no
            value: ``out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``. The LSE returned
            includes it (``log(exp(sink) + sum_j exp(s_j))``), and a row that sees no position
            gives zeros and an LSE equal to its sink. Its values are read on the device at
            every call (a graph replay sees new values).
        The score modifiers (a ``window_size`` other than ``(-1, 0)``, ``softcap``, ``sinks``)
            and head dims 96 and 256 run on the persistent engine only: with ``engine="split"``
            or any of ``num_splits``, ``reduction`` and ``device_plan`` they raise
            ``ValueError``.
        With none of ``num_splits``, ``reduction`` and ``device_plan`` given, batches that fill
            the GPU run on the persistent engine, which partitions the work on the device from
            ``cache_seqlens`` at every call (balanced in a replayed CUDA graph whatever the
            lengths); smaller batches, and any call that gives one of the three, on the split
            engine they configure.
        num_splits: force this many KV splits per (request, KV head), 1..128 (one of 1, 2, 4,
            8, 16 with ``reduction="cluster"``); default: chosen for the GPU (enough splits to
            fill every SM).
        reduction: how the splits of one (request, KV head) are merged (irrelevant with one
            split). ``None`` (default): chosen by the planner: cluster reduction for 2, 4 or 8
            splits of at most two tiles each, kernel reduction otherwise. ``"kernel"``: each
            split writes FP32 partials to a workspace and a combine kernel merges them.
            ``"cluster"``: the splits of one (request, KV head) form a thread-block cluster and
            merge through distributed shared memory: one launch, no workspace, deterministic.
        engine: ``"persistent"`` or ``"split"`` forces the engine (``None``: as above);
            ``"persistent"`` takes none of ``num_splits``, ``reduction`` and ``device_plan``.
        device_plan: plan the split partition on the GPU at every call from the lengths in
            ``cache_seqlens`` (a small planner kernel ahead of the decode): each request gets
            splits in proportion to its length, so ragged batches and CUDA graphs replayed with
            new lengths stay balanced; ``num_splits`` must be ``None``. With
            ``reduction="cluster"`` a request longer than its fair share runs one cluster per KV
            head (a fixed size, up to 16 CTAs) and the others one CTA per KV head.
        k_scale, v_scale: fp8 caches only: float32 CUDA tensors of dequantisation scales (the
            cache's values times its scale are the K and V attended to): shape ``[1]`` (or
            ``[]``) for the whole cache (vLLM's), ``[hkv]`` per KV head, or ``[batch, hkv]``
            per request and KV head (FA3's ``descale_k`` / ``descale_v``). ``None``: 1. Read
            on the device at every call.
        return_lse: also return the log-sum-exp (natural log) of the scaled (and capped)
            scores each row sees, float32: ``[batch, q_len, hq]`` for a 4-D ``q``,
            ``[batch, hq]`` for a 3-D one; with ``sinks`` it includes the row's sink.
        out: optional contiguous output tensor of q's shape and dtype.

    Returns:
        ``out`` (q's shape and dtype), or ``(out, lse)`` if ``return_lse``.

    Example::

        >>> import torch, kvstream                                   # doctest: +SKIP
        >>> q = torch.randn(2, 1, 16, 128, device="cuda", dtype=torch.float16)
        >>> k = torch.randn(2, 4096, 2, 128, device="cuda", dtype=torch.float16)
        >>> v = torch.randn_like(k)
        >>> lens = torch.tensor([4096, 17], device="cuda", dtype=torch.int32)
        >>> out = kvstream.decode(q, k, v, cache_seqlens=lens)
        >>> out.shape
        torch.Size([2, 1, 16, 128])
        >>> q4 = torch.randn(2, 4, 16, 128, device="cuda", dtype=torch.float16)  # 4 new tokens
        >>> out4, lse4 = kvstream.decode(q4, k, v, cache_seqlens=lens, return_lse=True)
        >>> lse4.shape
        torch.Size([2, 4, 16])
        >>> # a sliding window of 128 positions and a sink per query head (gpt-oss's layers)
        >>> sinks = torch.randn(16, device="cuda", dtype=torch.float32)
        >>> out = kvstream.decode(q, k, v, cache_seqlens=lens, window_size=(127, 0), sinks=sinks)

    The call is asynchronous on ``torch.cuda.current_stream()``. Decoders are cached per
    (shapes, q_len, paging, dtype, softmax_scale, window_size, softcap, whether sinks are
    given, num_splits, reduction, device_plan, device);
    a cached decoder owns one workspace, so when the same shapes are used from a different
    stream than the previous call, the new stream first waits (on the device, through an
    event) for the previous stream. See the package docs for CUDA graph capture (warm up once
    before capturing).

    With torch tensors the work is the custom op ``torch.ops.kvstream.decode`` (with ``out``:
    ``kvstream.decode_out``), so ``torch.compile(fullgraph=True)`` traces through this call and
    the profiler shows it by that name.
    """
    args = (q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, window_size, softcap,
            sinks, num_splits, reduction, device_plan, engine, k_scale, v_scale, return_lse, out)
    ops = _torch_ops(q)
    if ops is not None and ops.tracing(q):
        # torch.compile, export, make_fx: the op's fake implementation checks the arguments
        return ops.decode(args, None)
    spec = _check_decode(*args)  # everything checked before touching the GPU
    if ops is not None:
        return ops.decode(args, spec)
    # tensor-like objects that are not torch tensors: launched here (torch is needed)
    import torch

    if out is None:
        out = torch.empty(spec.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(spec.lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    _launch_decode(spec, q, k_cache, v_cache, cache_seqlens, block_table, sinks, out, lse)
    return (out, lse) if return_lse else out


def _check_decode(
    q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any,
    softmax_scale: Any, window_size: Any, softcap: Any, sinks: Any, num_splits: Any,
    reduction: Any, device_plan: Any, engine: Any, k_scale: Any, v_scale: Any,
    return_lse: Any, out: Any, fake: bool = False,
) -> _Spec:
    """:func:`decode`'s arguments checked, in pure Python (no torch, no GPU), raising what
    :func:`decode` documents; ``fake``: tensors without addresses (torch.compile's), whose
    alignment is checked at run time."""
    args = (q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, window_size, softcap,
            sinks, num_splits, reduction, device_plan, engine, k_scale, v_scale, return_lse, out)
    qs = _tensor("q", q)
    ks = _tensor("k_cache", k_cache)
    vs = _tensor("v_cache", v_cache)
    paged = block_table is not None
    if len(qs) not in (3, 4):
        raise ValueError(
            f"kvstream.decode: q must have 3 dimensions [batch, hq, head_dim] or 4 dimensions "
            f"[batch, q_len, hq, head_dim], got shape {list(qs)}"
        )
    cache_layout = (
        "[num_pages, page_size, hkv, head_dim] (a page pool: block_table is given)"
        if paged
        else "[batch, L, hkv, head_dim]"
    )
    _rank("k_cache", ks, 4, cache_layout)
    _rank("v_cache", vs, 4, cache_layout)
    allowed = tuple(SUPPORTED_DTYPES)
    qd = _dtype("q", q, allowed)
    kvd = str(k_cache.dtype)
    fp8 = kvd in FP8_KV_DTYPES
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if str(t.dtype) not in (qd, *FP8_KV_DTYPES) or str(t.dtype) != kvd:
            raise TypeError(
                f"kvstream.decode: {name} has dtype {t.dtype} (k_cache: {kvd}), allowed: {qd} "
                f"(the dtype of q) or {', '.join(FP8_KV_DTYPES)}, the same for both caches "
                f"(e5m2 caches are not supported)"
            )
    scales = []
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None:
            scales.append(None)
            continue
        if not fp8:
            raise ValueError(
                f"kvstream.decode: {name} is given for {kvd} caches, allowed: None (scales "
                f"belong to {', '.join(FP8_KV_DTYPES)} caches)"
            )
        scales.append(sc)
    if len(qs) == 4:
        b, q_len, hq, d = qs
        if not 1 <= q_len <= MAX_Q_LEN:
            raise ValueError(
                f"kvstream.decode: q has q_len = {q_len} new tokens per request (shape "
                f"{list(qs)} = [batch, q_len, hq, head_dim]), allowed: 1..{MAX_Q_LEN}"
            )
    else:
        b, hq, d = qs
        q_len = 1
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"kvstream.decode: q has head_dim {d}, allowed: {_one_of(SUPPORTED_HEAD_DIMS)}"
        )
    if b < 1 or hq < 1:
        raise ValueError(f"kvstream.decode: q has shape {list(qs)}, allowed: batch >= 1, hq >= 1")
    if ks != vs:
        raise ValueError(
            f"kvstream.decode: v_cache has shape {list(vs)}, allowed: the shape of k_cache "
            f"{list(ks)}"
        )
    kb, L, hkv, kd = ks
    if paged:
        num_pages, page_size = kb, L
        if num_pages < 1:
            raise ValueError(
                f"kvstream.decode: k_cache has num_pages = {num_pages} (shape {list(ks)} = "
                f"[num_pages, page_size, hkv, head_dim]), allowed: num_pages >= 1"
            )
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(
                f"kvstream.decode: k_cache has page_size = {page_size} (shape {list(ks)} = "
                f"[num_pages, page_size, hkv, head_dim]: a page pool, as block_table is given), "
                f"allowed: {', '.join(map(str, SUPPORTED_PAGE_SIZES))}"
            )
    elif kb != b:
        raise ValueError(
            f"kvstream.decode: k_cache has batch {kb}, allowed: {b} (the batch of q)"
        )
    if kd != d:
        raise ValueError(
            f"kvstream.decode: k_cache has head_dim {kd}, allowed: {d} (the head_dim of q)"
        )
    if not paged and L < 1:
        raise ValueError(f"kvstream.decode: k_cache has L = {L}, allowed: L >= 1")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(
            f"kvstream.decode: q has hq = {hq} heads and k_cache hkv = {hkv}, allowed: hq a "
            f"multiple of hkv"
        )
    if hq // hkv > MAX_GROUP:
        raise ValueError(
            f"kvstream.decode: hq / hkv = {hq // hkv} query heads per KV head (q, k_cache), "
            f"allowed: 1..{MAX_GROUP}"
        )
    dev = _device_key(q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _same_device(name, t, dev, q)
    _contiguous("q", q, qs)
    _aligned("q", q, fake=fake)
    if paged:
        # The pools are addressed page by page: contiguous, no strides to pass.
        _contiguous("k_cache", k_cache, ks)
        _contiguous("v_cache", v_cache, vs)
        k_strides = v_strides = None
    else:
        align = 16 if fp8 else 8
        k_strides = _cache_strides("k_cache", k_cache, ks, align)
        v_strides = _cache_strides("v_cache", v_cache, vs, align)
    view_len = None
    if not paged and not fake:
        capacity = min(_view_capacity(k_cache, ks), _view_capacity(v_cache, vs))
        if capacity > L:
            # a view of a longer cache: the decoder of the capacity's bucket reads its first L
            # positions, so the views of a growing cache share one decoder. One request's
            # batch stride means nothing: the capacity's (None where the rest is contiguous),
            # the same for every view and for the whole bucket read as it is.
            if b == 1:
                k_strides, v_strides = (None if st is None else (capacity * hkv * d, *st[1:])
                                        for st in (k_strides, v_strides))
            else:
                natural = (L * hkv * d, hkv * d, d)
                k_strides, v_strides = (natural if st is None else st
                                        for st in (k_strides, v_strides))
            view_len, L = L, capacity
    _aligned("k_cache", k_cache, fake=fake)
    _aligned("v_cache", v_cache, fake=fake)
    paging: Optional[Tuple[int, int, int]] = None
    if paged:
        ts = _tensor("block_table", block_table)
        _dtype("block_table", block_table, (_INT32,))
        _rank("block_table", ts, 2, "[batch, max_pages]")
        if ts[0] != b or ts[1] < 1:
            raise ValueError(
                f"kvstream.decode: block_table has shape {list(ts)}, allowed: [{b}, max_pages] "
                f"with max_pages >= 1 (one row of page ids per request)"
            )
        _same_device("block_table", block_table, dev, q)
        _contiguous("block_table", block_table, ts)
        max_pages = ts[1]
        L = max_pages * page_size
        if L > 2**31 - 1:
            raise ValueError(
                f"kvstream.decode: block_table has {max_pages} pages of {page_size} positions "
                f"per request, a capacity of {L}, allowed: at most 2^31-1 positions"
            )
        paging = (page_size, num_pages, max_pages)
    if cache_seqlens is not None:
        _device_vector("cache_seqlens", cache_seqlens, _INT32, b, "one length per request", dev, q)
    if out is not None:
        os_ = _tensor("out", out)
        if str(out.dtype) != qd:
            raise TypeError(
                f"kvstream.decode: out has dtype {out.dtype}, allowed: {qd} (the dtype of q)"
            )
        if os_ != qs:
            raise ValueError(
                f"kvstream.decode: out has shape {list(os_)}, allowed: {list(qs)} (the shape of q)"
            )
        _same_device("out", out, dev, q)
        _contiguous("out", out, os_)
        _aligned("out", out, fake=fake)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(
                f"kvstream.decode: softmax_scale must be a float or None, got "
                f"{type(softmax_scale).__name__}"
            )
        softmax_scale = float(softmax_scale)
        if not (softmax_scale > 0.0 and softmax_scale != float("inf")):
            raise ValueError(
                f"kvstream.decode: softmax_scale is {softmax_scale}, allowed: a finite positive "
                f"number"
            )
    if num_splits is not None:
        if not _is_int(num_splits):
            raise TypeError(
                f"kvstream.decode: num_splits must be an int or None, got "
                f"{type(num_splits).__name__}"
            )
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(
                f"kvstream.decode: num_splits is {num_splits}, allowed: 1..{MAX_SPLITS} or None"
            )
    if reduction is not None:
        _check_choice("reduction", reduction, REDUCTIONS)
        if reduction == "cluster" and num_splits is not None and num_splits not in CLUSTER_SPLITS:
            raise ValueError(
                f"kvstream.decode: num_splits is {num_splits} with reduction='cluster', allowed: "
                f"{', '.join(map(str, CLUSTER_SPLITS))} or None"
            )
    if not isinstance(device_plan, bool):
        raise TypeError(
            f"kvstream.decode: device_plan must be a bool, got {device_plan!r} "
            f"({type(device_plan).__name__})"
        )
    if device_plan and num_splits is not None:
        raise ValueError(
            f"kvstream.decode: num_splits is {num_splits} with device_plan=True, allowed: None "
            f"(the device plan chooses each request's splits from its length)"
        )
    if engine is not None:
        _check_choice("engine", engine, ENGINES)
        if engine == "persistent" and (
            num_splits is not None or reduction is not None or device_plan
        ):
            raise ValueError(
                "kvstream.decode: engine is 'persistent' with num_splits, reduction or "
                "device_plan given, allowed: those only with engine='split' or None (they "
                "configure the split engine)"
            )
    # ---- score modifiers ----
    window = _window_size(window_size)
    softcap = _softcap(softcap)
    if sinks is not None:
        _device_vector("sinks", sinks, "torch.float32", hq,
                       "one float32 logit per query head of q", dev, q)
    # A window that bounds nothing is the default's (the same decoder and plan): a left side
    # reaching position 0 from the last position of the capacity; a right side reaching the
    # last new token from the first (with one new token, any right side).
    left, right = window
    if left >= L - 1:
        left = -1
    if q_len == 1:
        right = 0
    elif right >= q_len - 1:
        right = -1
    window = (left, right)
    split_knobs = [
        text
        for text, given in (
            ("engine='split'", engine == "split"),
            (f"num_splits={num_splits}", num_splits is not None),
            (f"reduction={reduction!r}", reduction is not None),
            ("device_plan=True", device_plan),
        )
        if given
    ]
    if split_knobs:
        knobs = ", ".join(split_knobs)
        why = (
            "head dims 96 and 256, window_size, softcap and sinks run on the persistent engine "
            "only (engine=None or 'persistent', without num_splits, reduction and device_plan)"
        )
        if d not in SPLIT_ENGINE_HEAD_DIMS:
            raise ValueError(
                f"kvstream.decode: q has head_dim {d} with {knobs} (the split engine), "
                f"allowed: {_one_of(SPLIT_ENGINE_HEAD_DIMS)} there; {why}"
            )
        if window != (-1, 0):
            raise ValueError(
                f"kvstream.decode: window_size is {tuple(window_size)} with {knobs} (the split "
                f"engine), allowed: (-1, 0) there; {why}"
            )
        if softcap != 0.0:
            raise ValueError(
                f"kvstream.decode: softcap is {softcap} with {knobs} (the split engine), "
                f"allowed: 0.0 there; {why}"
            )
        if sinks is not None:
            raise ValueError(
                f"kvstream.decode: sinks is given with {knobs} (the split engine), allowed: "
                f"None there; {why}"
            )
    scale_shapes = {(1,): "per cache", (hkv,): "per KV head", (b, hkv): "per request and KV head"}
    scale_args = [None if sc is None else _scale(name, sc, scale_shapes, dev, q, fake=fake)
                  for name, sc in zip(("k_scale", "v_scale"), scales)]
    if not isinstance(return_lse, bool):
        raise TypeError(
            f"kvstream.decode: return_lse must be a bool, got {type(return_lse).__name__}"
        )

    dtype_name = SUPPORTED_DTYPES[qd]
    # The sinks' values are read on the device at every call: only whether they are given is
    # part of the decoder.
    has_sinks = sinks is not None
    key = (
        b, hq, hkv, d, L, dtype_name, softmax_scale, num_splits, reduction,
        k_strides, v_strides, q_len, paging, device_plan, engine, fp8, window, softcap,
        has_sinks,
    )

    def make(index: int) -> Any:
        page_size_, num_pages_, table_stride_ = paging if paging is not None else (None,) * 3
        return _native.Decoder(
            b, hq, hkv, d, L, dtype_name, softmax_scale, num_splits,
            reduction=reduction, device=index, k_strides=k_strides, v_strides=v_strides,
            q_len=q_len, page_size=page_size_, num_pages=num_pages_,
            table_stride=table_stride_, device_plan=device_plan, engine=engine,
            kv_dtype=FP8_KV_DTYPES[kvd] if fp8 else None, window_size=window,
            softcap=softcap, sinks=has_sinks,
        )

    lse_shape = (b, q_len, hq) if len(qs) == 4 else (b, hq)
    return _Spec("decode", dev, key, make, qs, lse_shape, scale_args, args, view_len)


def _launch_decode(spec: _Spec, q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any,
                   block_table: Any, sinks: Any, out: Any, lse: Any) -> None:
    """Launches a checked decode on the current stream (``lse`` None: not written)."""
    decoder, stream = _prepare(spec)
    decoder.run(
        int(q.data_ptr()),
        int(k_cache.data_ptr()),
        int(v_cache.data_ptr()),
        int(out.data_ptr()),
        None if lse is None else int(lse.data_ptr()),
        None if cache_seqlens is None else int(cache_seqlens.data_ptr()),
        int(stream.cuda_stream),
        block_table_ptr=None if block_table is None else int(block_table.data_ptr()),
        k_scale=spec.scales[0],
        v_scale=spec.scales[1],
        sinks_ptr=None if sinks is None else int(sinks.data_ptr()),
        view_len=spec.view_len,
    )


#: Width of an MLA cache row and query row (latent 512 + rope 64), and of an MLA output row.
MLA_DIM = 576
MLA_V_DIM = 512
#: Most query heads of an MLA decode.
MLA_MAX_HEADS = 128


def mla_decode(
    q: Any,
    kv_cache: Any,
    *,
    softmax_scale: float,
    cache_seqlens: Any = None,
    block_table: Any = None,
    kv_scale: Any = None,
    return_lse: bool = False,
    out: Any = None,
) -> Any:
    """MLA decode (DeepSeek-V2/V3/R1, Kimi-K2 class) in the absorbed form: every query head
    attends to one latent cache whose rows are ``[c_kv (512) | k_pe (64)]``; the scores use all
    576 columns, the values are the first 512 columns of the same rows.

    Args:
        q: ``[batch, q_len, hq, 576]`` bf16 or fp16 CUDA tensor, contiguous, ``q_len`` 1..8
            (token ``i`` sees cache positions ``0 .. len - q_len + i``), ``hq`` 1..128; or
            ``[batch, hq, 576]``.
        kv_cache: without ``block_table``: ``[batch, L, 576]`` (or ``[batch, L, 1, 576]``);
            with it, a page pool ``[num_pages, page_size, 576]`` (or FlashMLA's
            ``[num_pages, page_size, 1, 576]``); contiguous, q's dtype or
            ``torch.float8_e4m3fn`` (then ``kv_scale`` is required).
        softmax_scale: required (DeepSeek-V3: ``1 / sqrt(192)`` times its YaRN factor, not
            ``1 / sqrt(576)``).
        cache_seqlens: optional int32 ``[batch]`` lengths on the device (default: all ``L``).
        block_table: optional int32 ``[batch, max_pages]`` page ids (the cache is then paged).
        kv_scale: fp8 caches only: float32 ``[1]`` (per cache) or ``[batch]`` (per request)
            dequantisation scale on the device, read at every call.
        return_lse: also return the natural-log LSE, float32 ``[batch, q_len, hq]`` (or
            ``[batch, hq]`` for a 3-D ``q``).
        out: optional contiguous output ``[batch, q_len, hq, 512]`` (or ``[batch, hq, 512]``)
            of q's dtype.

    Returns:
        ``out``, or ``(out, lse)`` if ``return_lse``.

    Example::

        >>> q = torch.randn(4, 1, 16, 576, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> pool = torch.randn(4 * 2048, 64, 576, device="cuda", dtype=torch.bfloat16)
        >>> table = torch.arange(4 * 2048, device="cuda", dtype=torch.int32).view(4, 2048)
        >>> lens = torch.tensor([131072, 9, 70000, 0], device="cuda", dtype=torch.int32)
        >>> out = kvstream.mla_decode(q, pool, softmax_scale=0.0722, cache_seqlens=lens,
        ...                           block_table=table)
        >>> out.shape
        torch.Size([4, 1, 16, 512])

    Asynchronous on the current stream; decoders cached per shapes as :func:`decode`'s, so a
    CUDA graph captured after one warm-up call replays with new lengths, tables and scales,
    balanced on the device whatever the lengths. With torch tensors the work is the custom op
    ``torch.ops.kvstream.mla_decode`` (with ``out``: ``kvstream.mla_decode_out``).
    """
    args = (q, kv_cache, softmax_scale, cache_seqlens, block_table, kv_scale, return_lse, out)
    ops = _torch_ops(q)
    if ops is not None and ops.tracing(q):
        return ops.mla_decode(args, None)
    spec = _check_mla(*args)
    if ops is not None:
        return ops.mla_decode(args, spec)
    import torch

    if out is None:
        out = torch.empty(spec.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(spec.lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    _launch_mla(spec, q, kv_cache, cache_seqlens, block_table, out, lse)
    return (out, lse) if return_lse else out


def _check_mla(q: Any, kv_cache: Any, softmax_scale: Any, cache_seqlens: Any, block_table: Any,
               kv_scale: Any, return_lse: Any, out: Any, fake: bool = False) -> _Spec:
    """:func:`mla_decode`'s arguments checked in pure Python (see :func:`_check_decode`)."""
    args = (q, kv_cache, softmax_scale, cache_seqlens, block_table, kv_scale, return_lse, out)
    fn = "mla_decode"
    qs = _tensor("q", q, fn)
    cs = _tensor("kv_cache", kv_cache, fn)
    paged = block_table is not None
    if len(qs) not in (3, 4) or qs[-1] != MLA_DIM:
        raise ValueError(
            f"kvstream.mla_decode: q has shape {list(qs)}, allowed: [batch, q_len, hq, {MLA_DIM}] "
            f"or [batch, hq, {MLA_DIM}] (latent 512 + rope 64)"
        )
    if len(qs) == 4:
        b, q_len, hq, _ = qs
    else:
        b, hq, _ = qs
        q_len = 1
    if not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(
            f"kvstream.mla_decode: q has q_len = {q_len}, allowed: 1..{MAX_Q_LEN}"
        )
    if b < 1 or not 1 <= hq <= MLA_MAX_HEADS:
        raise ValueError(
            f"kvstream.mla_decode: q has shape {list(qs)}, allowed: batch >= 1, hq 1..{MLA_MAX_HEADS}"
        )
    qd = _dtype("q", q, tuple(SUPPORTED_DTYPES), fn)
    kvd = str(kv_cache.dtype)
    fp8 = kvd in FP8_KV_DTYPES
    if kvd != qd and not fp8:
        raise TypeError(
            f"kvstream.mla_decode: kv_cache has dtype {kvd}, allowed: {qd} (the dtype of q) or "
            f"{', '.join(FP8_KV_DTYPES)}"
        )
    layout = "[num_pages, page_size, 576] (a page pool: block_table is given)" if paged else "[batch, L, 576]"
    if not (len(cs) == 3 or (len(cs) == 4 and cs[2] == 1)) or cs[-1] != MLA_DIM:
        raise ValueError(
            f"kvstream.mla_decode: kv_cache has shape {list(cs)}, allowed: {layout} (or with a "
            f"head axis of 1 before the last)"
        )
    n0, n1 = cs[0], cs[1]
    if paged:
        if n1 not in SUPPORTED_PAGE_SIZES or (fp8 and n1 == 1):
            allowed = SUPPORTED_PAGE_SIZES[1:] if fp8 else SUPPORTED_PAGE_SIZES
            raise ValueError(
                f"kvstream.mla_decode: kv_cache has page_size = {n1} (shape {list(cs)}), "
                f"allowed: {', '.join(map(str, allowed))}"
            )
        if n0 < 1:
            raise ValueError(f"kvstream.mla_decode: kv_cache has no pages (shape {list(cs)})")
    elif n0 != b or n1 < 1:
        raise ValueError(
            f"kvstream.mla_decode: kv_cache has shape {list(cs)}, allowed: [{b}, L >= 1, 576] "
            f"(the batch of q)"
        )
    dev = _device_key(q)
    _same_device("kv_cache", kv_cache, dev, q, fn)
    _contiguous("q", q, qs, fn)
    _aligned("q", q, fn, fake=fake)
    _contiguous("kv_cache", kv_cache, cs, fn)
    _aligned("kv_cache", kv_cache, fn, fake=fake)
    L = n1
    paging: Optional[Tuple[int, int, int]] = None
    if paged:
        ts = _tensor("block_table", block_table, fn)
        _dtype("block_table", block_table, (_INT32,), fn)
        _rank("block_table", ts, 2, "[batch, max_pages]", fn)
        if ts[0] != b or ts[1] < 1:
            raise ValueError(
                f"kvstream.mla_decode: block_table has shape {list(ts)}, allowed: [{b}, max_pages]"
                f" with max_pages >= 1"
            )
        _same_device("block_table", block_table, dev, q, fn)
        _contiguous("block_table", block_table, ts, fn)
        L = ts[1] * n1
        if L > 2**31 - 1:
            raise ValueError(
                f"kvstream.mla_decode: block_table gives a capacity of {L} positions, allowed: at "
                f"most 2^31-1"
            )
        paging = (n1, n0, ts[1])
    if cache_seqlens is not None:
        ss = _tensor("cache_seqlens", cache_seqlens, fn)
        _dtype("cache_seqlens", cache_seqlens, (_INT32,), fn)
        if ss != (b,):
            raise ValueError(
                f"kvstream.mla_decode: cache_seqlens has shape {list(ss)}, allowed: [{b}]"
            )
        _same_device("cache_seqlens", cache_seqlens, dev, q, fn)
        _contiguous("cache_seqlens", cache_seqlens, ss, fn)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"kvstream.mla_decode: softmax_scale must be a float (it is required), got "
            f"{type(softmax_scale).__name__}"
        )
    softmax_scale = float(softmax_scale)
    if not (softmax_scale > 0.0 and softmax_scale != float("inf")):
        raise ValueError(
            f"kvstream.mla_decode: softmax_scale is {softmax_scale}, allowed: a finite positive "
            f"number"
        )
    scale_arg = None
    if kv_scale is not None:
        if not fp8:
            raise ValueError(
                f"kvstream.mla_decode: kv_scale is given for a {kvd} cache, allowed: None "
                f"(scales belong to {', '.join(FP8_KV_DTYPES)} caches)"
            )
        scale_arg = _scale("kv_scale", kv_scale, {(1,): "per cache", (b,): "per request"}, dev, q,
                           fn, fake=fake)
    elif fp8:
        raise ValueError(
            f"kvstream.mla_decode: kv_scale is None for a {kvd} cache, allowed: a float32 CUDA "
            f"tensor [1] (per cache) or [{b}] (per request)"
        )
    out_shape = qs[:-1] + (MLA_V_DIM,)
    if out is not None:
        os_ = _tensor("out", out, fn)
        if str(out.dtype) != qd:
            raise TypeError(f"kvstream.mla_decode: out has dtype {out.dtype}, allowed: {qd}")
        if os_ != out_shape:
            raise ValueError(
                f"kvstream.mla_decode: out has shape {list(os_)}, allowed: {list(out_shape)}"
            )
        _same_device("out", out, dev, q, fn)
        _contiguous("out", out, os_, fn)
        _aligned("out", out, fn, fake=fake)
    if not isinstance(return_lse, bool):
        raise TypeError(
            f"kvstream.mla_decode: return_lse must be a bool, got {type(return_lse).__name__}"
        )

    dtype_name = SUPPORTED_DTYPES[qd]
    key = ("mla", b, hq, q_len, L, dtype_name, softmax_scale, paging, fp8)

    def make(index: int) -> Any:
        page_size_, num_pages_, table_stride_ = paging if paging is not None else (None,) * 3
        return _native.MlaDecoder(
            b, hq, q_len, L, dtype_name, softmax_scale, device=index, page_size=page_size_,
            num_pages=num_pages_, table_stride=table_stride_,
            kv_dtype=FP8_KV_DTYPES[kvd] if fp8 else None,
        )

    return _Spec(fn, dev, key, make, out_shape, qs[:-1], scale_arg, args)


def _launch_mla(spec: _Spec, q: Any, kv_cache: Any, cache_seqlens: Any, block_table: Any,
                out: Any, lse: Any) -> None:
    """Launches a checked MLA decode on the current stream (``lse`` None: not written)."""
    decoder, stream = _prepare(spec)
    decoder.run(
        int(q.data_ptr()),
        int(kv_cache.data_ptr()),
        int(out.data_ptr()),
        None if lse is None else int(lse.data_ptr()),
        None if cache_seqlens is None else int(cache_seqlens.data_ptr()),
        int(stream.cuda_stream),
        block_table_ptr=None if block_table is None else int(block_table.data_ptr()),
        kv_scale=spec.scales,
    )


_writers: Dict[tuple, Any] = {}


def store_kv(
    k: Any,
    v: Any,
    k_cache: Any,
    v_cache: Any,
    slot_mapping: Any,
    *,
    k_scale: Any = None,
    v_scale: Any = None,
) -> None:
    """Writes new tokens' K and V rows into a KV cache, quantising them for an fp8 cache.

    Args:
        k, v: ``[tokens, hkv, d]`` bf16 or fp16 contiguous CUDA tensors.
        k_cache, v_cache: ``[blocks, block_size, hkv, d]``: a page pool (blocks = pages) or a
            contiguous cache ``[batch, L, hkv, d]`` (blocks = requests, block_size = L, strides
            as :func:`decode` takes them, the same for both); k's dtype, or
            ``torch.float8_e4m3fn``.
        slot_mapping: int64 ``[tokens]`` CUDA tensor: token ``i`` goes to block
            ``slot // block_size``, row ``slot % block_size``; a slot of -1 (or outside the
            cache) is skipped. Read on the device only.
        k_scale, v_scale: fp8 caches only: float32 scales the values are divided by before
            rounding to e4m3 (saturating at +-448), the ones :func:`decode` multiplies by:
            ``[1]``, ``[hkv]``, or ``[blocks, hkv]`` (per request of a contiguous cache).
            ``None``: 1.

    Asynchronous on ``torch.cuda.current_stream()``, no host synchronisation; capturable in a
    CUDA graph after one warm-up call per cache shape (replays may change the slots, rows and
    scales, not their addresses). With torch tensors the work is the custom op
    ``torch.ops.kvstream.store_kv``, which mutates ``k_cache`` and ``v_cache``.
    """
    args = (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    ops = _torch_ops(k)
    if ops is not None and ops.tracing(k):
        return ops.store_kv(args, None)
    spec = _check_store(*args)
    if ops is not None:
        return ops.store_kv(args, spec)
    _launch_store(spec, k, v, k_cache, v_cache, slot_mapping)
    return None


def _check_store(k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, k_scale: Any,
                 v_scale: Any, fake: bool = False) -> _Spec:
    """:func:`store_kv`'s arguments checked in pure Python (see :func:`_check_decode`); the
    spec's ``make(index)`` builds its writer."""
    args = (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    ks = _tensor("k", k, fn="store_kv")
    vs = _tensor("v", v, fn="store_kv")
    kcs = _tensor("k_cache", k_cache, fn="store_kv")
    vcs = _tensor("v_cache", v_cache, fn="store_kv")
    _rank("k", ks, 3, "[tokens, hkv, head_dim]", fn="store_kv")
    _rank("v", vs, 3, "[tokens, hkv, head_dim]", fn="store_kv")
    _rank("k_cache", kcs, 4, "[blocks, block_size, hkv, head_dim]", fn="store_kv")
    _rank("v_cache", vcs, 4, "[blocks, block_size, hkv, head_dim]", fn="store_kv")
    kd = _dtype("k", k, tuple(SUPPORTED_DTYPES), fn="store_kv")
    if str(v.dtype) != kd:
        raise TypeError(f"kvstream.store_kv: v has dtype {v.dtype}, allowed: {kd} (the dtype of k)")
    if vs != ks:
        raise ValueError(f"kvstream.store_kv: v has shape {list(vs)}, allowed: {list(ks)} (k's)")
    tokens, hkv, d = ks
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"kvstream.store_kv: k has head_dim {d}, allowed: {_one_of(SUPPORTED_HEAD_DIMS)}"
        )
    if vcs != kcs or tuple(kcs[2:]) != (hkv, d):
        raise ValueError(
            f"kvstream.store_kv: k_cache / v_cache have shapes {list(kcs)} / {list(vcs)}, "
            f"allowed: both [blocks, block_size, {hkv}, {d}] (k's heads and head_dim)"
        )
    kvd = str(k_cache.dtype)
    fp8 = kvd in FP8_KV_DTYPES
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if str(t.dtype) not in (kd, *FP8_KV_DTYPES) or str(t.dtype) != kvd:
            raise TypeError(
                f"kvstream.store_kv: {name} has dtype {t.dtype} (k_cache: {kvd}), allowed: {kd} "
                f"(the dtype of k) or {', '.join(FP8_KV_DTYPES)}, the same for both caches"
            )
    dev = _device_key(k)
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slot_mapping", slot_mapping)):
        _tensor(name, t, fn="store_kv")
        _same_device(name, t, dev, k, fn="store_kv")
    for name, t, sh in (("k", k, ks), ("v", v, vs)):
        _contiguous(name, t, sh, fn="store_kv")
        _aligned(name, t, fn="store_kv", fake=fake)
    align = 16 if fp8 else 8
    k_strides = _cache_strides("k_cache", k_cache, kcs, align, fn="store_kv")
    v_strides = _cache_strides("v_cache", v_cache, vcs, align, fn="store_kv")
    if k_strides != v_strides:
        raise ValueError(
            f"kvstream.store_kv: v_cache has strides {list(v_cache.stride())}, allowed: "
            f"k_cache's {list(k_cache.stride())} (one layout for both)"
        )
    _aligned("k_cache", k_cache, fn="store_kv", fake=fake)
    _aligned("v_cache", v_cache, fn="store_kv", fake=fake)
    ss = _tensor("slot_mapping", slot_mapping, fn="store_kv")
    _dtype("slot_mapping", slot_mapping, ("torch.int64",), fn="store_kv")
    if ss != (tokens,):
        raise ValueError(
            f"kvstream.store_kv: slot_mapping has shape {list(ss)}, allowed: [{tokens}] (one "
            f"slot per token of k)"
        )
    _contiguous("slot_mapping", slot_mapping, ss, fn="store_kv")
    scale_args = []
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None:
            scale_args.append(None)
            continue
        if not fp8:
            raise ValueError(
                f"kvstream.store_kv: {name} is given for {kvd} caches, allowed: None (scales "
                f"belong to {', '.join(FP8_KV_DTYPES)} caches)"
            )
        shapes = {(1,): "per cache", (hkv,): "per KV head",
                  (kcs[0], hkv): "per request of a contiguous cache"}
        scale_args.append(_scale(name, sc, shapes, dev, k, fn="store_kv", fake=fake))

    key = (kcs[0], kcs[1], hkv, d, kd, fp8, k_strides)

    def make(index: int) -> Any:
        return _native.KvWriter(
            kcs[0], hkv, d, kcs[1], SUPPORTED_DTYPES[kd], device=index, k_strides=k_strides,
            kv_dtype=FP8_KV_DTYPES[kvd] if fp8 else None,
        )

    return _Spec("store_kv", dev, key, make, kcs, (), scale_args, args)


def _launch_store(spec: _Spec, k: Any, v: Any, k_cache: Any, v_cache: Any,
                  slot_mapping: Any) -> None:
    """Launches a checked store_kv on the current stream."""
    w, stream = _stateless_launcher(_writers, spec, "writer")
    w.run(
        int(k.shape[0]), int(k.data_ptr()), int(v.data_ptr()), int(slot_mapping.data_ptr()),
        int(k_cache.data_ptr()), int(v_cache.data_ptr()), int(stream.cuda_stream),
        k_scale=spec.scales[0], v_scale=spec.scales[1],
    )


def fp8_scales(cache: Any, per_head: bool = True) -> Any:
    """float32 scales that map a bf16 / fp16 cache ``[blocks, block_size, hkv, d]`` onto e4m3's
    range: amax / 448 per KV head (``[hkv]``), or for the whole cache (``[1]``); 1 where the
    cache is all zeros. For converting an existing cache with :func:`store_kv`."""
    shape = _tensor("cache", cache, fn="fp8_scales")
    _rank("cache", shape, 4, "[blocks, block_size, hkv, head_dim]", fn="fp8_scales")
    _dtype("cache", cache, tuple(SUPPORTED_DTYPES), fn="fp8_scales")
    amax = cache.abs().amax(dim=(0, 1, 3)) if per_head else cache.abs().amax().reshape(1)
    amax = amax.float()
    return (amax / 448.0).where(amax > 0, amax.new_ones(()))


# ---- merging partial states (context parallelism) ----

#: Most elements of one row :func:`merge_states` merges.
MAX_MERGE_HEAD_DIM = 1024
_mergers: Dict[tuple, Any] = {}


def merge_states(
    outputs: Any,
    lses: Any,
    *,
    sinks: Any = None,
    out: Any = None,
    return_lse: bool = True,
) -> Any:
    """Merges partial attention outputs over disjoint parts of the keys (the shards of a
    context-parallel cache, say) into the output over all keys, by their log-sum-exps.

    For each row, with ``m = max_s lses[s]``: ``out = sum_s exp(lses[s] - m) outputs[s] /
    sum_s exp(lses[s] - m)`` and ``lse = m + log(sum_s exp(lses[s] - m))``, in float32, shards
    summed in index order (bitwise deterministic). A shard whose LSE is ``-inf`` has no key for
    the row and its output is not read (it may hold anything); a row no shard has keys for gives
    zeros and ``-inf``. ``sinks`` join every row's denominator once, after the merge (decode the
    shards without sinks and give them here): ``lse' = logaddexp(lse, sink)``, ``out' = out *
    exp(lse - lse')``, as :func:`decode` with ``sinks`` does::

        # two halves of one cache, decoded apart and merged
        o1, l1 = kvstream.decode(q, k[:, :half], v[:, :half], return_lse=True)
        o2, l2 = kvstream.decode(q, k[:, half:], v[:, half:], return_lse=True)
        out, lse = kvstream.merge_states(torch.stack([o1, o2]), torch.stack([l1, l2]))

    Args:
        outputs: ``[n, ..., heads, d]`` bf16 or fp16 CUDA tensor: n partial outputs of the same
            rows (``[n, b, q_len, hq, d]`` or ``[n, b, hq, d]`` from :func:`decode`, ``d`` up to
            1024 and a multiple of 8); the last dimension contiguous and the rows evenly spaced
            (an all-gathered buffer, a stack or slices of one), 16-byte aligned.
        lses: float32 ``[n, ..., heads]`` (``outputs``' shape without ``d``), each shard's rows
            contiguous; natural log, ``-inf`` for a row the shard has no key for.
        sinks: optional float32 ``[heads]`` logits (gpt-oss's attention sinks).
        out: optional contiguous ``[..., heads, d]`` tensor of ``outputs``' dtype to write.
        return_lse: also return the merged LSE ``[..., heads]`` float32.

    Returns ``out`` (and the LSE); asynchronous on the current stream, graph-capturable after
    one call with the same shapes. With torch tensors it runs as the op
    ``torch.ops.kvstream.merge_states`` (``merge_states_out`` when ``out`` is given).
    """
    args = (outputs, lses, sinks, return_lse, out)
    ops = _torch_ops(outputs)
    if ops is not None and ops.tracing(outputs):
        return ops.merge_states(args, None)
    spec = _check_merge(*args)
    if ops is not None:
        return ops.merge_states(args, spec)
    if out is None:
        raise TypeError("kvstream.merge_states: outputs must be a torch.Tensor to allocate out")
    _launch_merge(spec, outputs, lses, sinks, out, None)
    return out


def _row_stride(name: str, x: Any, shape: Tuple[int, ...], fn: str) -> int:
    """The one element stride between consecutive rows of ``x[s]`` (its dimensions between the
    first and the last flattened), checked; the last dimension must be contiguous."""
    st = [int(s) for s in x.stride()]
    row, expect = None, None
    for size, stride in zip(reversed(shape[1:-1]), reversed(st[1:-1])):
        if size == 1:
            continue
        if row is None:
            row, expect = stride, stride * size
        elif stride != expect:
            row = -1
            break
        else:
            expect = stride * size
    if row is None:
        row = shape[-1]
    if st[-1] != 1 and shape[-1] != 1 or row < shape[-1] or row % 8 != 0:
        raise ValueError(
            f"kvstream.{fn}: {name} has strides {st} for shape {list(shape)}, allowed: a "
            f"contiguous last dimension and rows (the dimensions between the first and the last) "
            f"evenly spaced by a multiple of 8 elements (16 bytes), at least the row's "
            f"{shape[-1]} elements apart (call .contiguous() first)"
        )
    return row


def _check_merge(outputs: Any, lses: Any, sinks: Any, return_lse: Any, out: Any,
                 fake: bool = False) -> _Spec:
    """:func:`merge_states`' arguments checked in pure Python; the spec's ``make(index)``
    builds its merger."""
    fn = "merge_states"
    args = (outputs, lses, sinks, return_lse, out)
    os_ = _tensor("outputs", outputs, fn)
    if len(os_) < 3:
        raise ValueError(
            f"kvstream.{fn}: outputs must have at least 3 dimensions [n, ..., heads, d], got "
            f"shape {list(os_)}"
        )
    od = _dtype("outputs", outputs, tuple(SUPPORTED_DTYPES), fn)
    n, heads, d = os_[0], os_[-2], os_[-1]
    if n < 1 or d < 8 or d % 8 != 0 or d > MAX_MERGE_HEAD_DIM:
        raise ValueError(
            f"kvstream.{fn}: outputs has shape {list(os_)}, allowed: at least one shard and a "
            f"last dimension that is a multiple of 8 up to {MAX_MERGE_HEAD_DIM}"
        )
    dev = _device_key(outputs)
    ls = _tensor("lses", lses, fn)
    _same_device("lses", lses, dev, outputs, fn)
    _dtype("lses", lses, ("torch.float32",), fn)
    if ls != os_[:-1]:
        raise ValueError(
            f"kvstream.{fn}: lses has shape {list(ls)}, allowed: {list(os_[:-1])} (outputs' "
            f"shape without its last dimension)"
        )
    rows = math.prod(os_[1:-1])
    if rows == 0:
        raise ValueError(f"kvstream.{fn}: outputs has shape {list(os_)}, allowed: no empty dimension")
    row_stride = _row_stride("outputs", outputs, os_, fn)
    if not lses[0].is_contiguous():
        raise ValueError(
            f"kvstream.{fn}: lses has strides {list(lses.stride())} for shape {list(ls)}, "
            f"allowed: each shard's rows contiguous (call .contiguous() first)"
        )
    shard_stride = int(outputs.stride()[0]) if n > 1 else rows * row_stride
    lse_shard_stride = int(lses.stride()[0]) if n > 1 else rows
    if shard_stride % 8 != 0 or shard_stride < 0:
        raise ValueError(
            f"kvstream.{fn}: outputs has a shard stride of {shard_stride} elements, allowed: a "
            f"non-negative multiple of 8 (16 bytes)"
        )
    _aligned("outputs", outputs, fn, fake=fake)
    if sinks is not None:
        _device_vector("sinks", sinks, "torch.float32", heads,
                       "one float32 logit per head (outputs' dimension -2)", dev, outputs, fn)
    if not isinstance(return_lse, bool):
        raise TypeError(f"kvstream.{fn}: return_lse must be a bool, got {type(return_lse).__name__}")
    out_shape = tuple(os_[1:])
    if out is not None:
        oss = _tensor("out", out, fn)
        _same_device("out", out, dev, outputs, fn)
        if str(out.dtype) != od:
            raise TypeError(f"kvstream.{fn}: out has dtype {out.dtype}, allowed: {od} (outputs')")
        if oss != out_shape:
            raise ValueError(
                f"kvstream.{fn}: out has shape {list(oss)}, allowed: {list(out_shape)}"
            )
        _contiguous("out", out, oss, fn)
        _aligned("out", out, fn, fake=fake)
    strides = (shard_stride, row_stride, lse_shard_stride)
    key = ("merge", n, rows // heads, heads, d, od, strides)

    def make(index: int) -> Any:
        return _native.StateMerger(n, rows // heads, 1, heads, d, SUPPORTED_DTYPES[od],
                                   device=index, strides=strides)

    return _Spec(fn, dev, key, make, out_shape, tuple(os_[1:-1]), None, args)


def _launch_merge(spec: _Spec, outputs: Any, lses: Any, sinks: Any, out: Any, lse: Any) -> None:
    """Launches a checked merge on the current stream (``lse`` None: not written)."""
    m, stream = _stateless_launcher(_mergers, spec, "merger")
    m.run(
        int(outputs.data_ptr()), int(lses.data_ptr()), int(out.data_ptr()),
        lse_ptr=None if lse is None else int(lse.data_ptr()),
        sinks_ptr=None if sinks is None else int(sinks.data_ptr()),
        stream=int(stream.cuda_stream),
    )
