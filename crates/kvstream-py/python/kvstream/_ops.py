"""kvstream's PyTorch custom operators, behind :func:`kvstream.decode`, :func:`kvstream.mla_decode`
and :func:`kvstream.store_kv` and :func:`kvstream.merge_states`.

Importing this module imports torch and registers, in the ``kvstream`` namespace of
``torch.ops`` (:data:`SCHEMAS` has the exact schemas)::

    decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cache_seqlens=None,
           Tensor? block_table=None, float? softmax_scale=None, int[] window_size=[-1, 0],
           float softcap=0., Tensor? sinks=None, int? num_splits=None, str? reduction=None,
           bool device_plan=False, str? engine=None, Tensor? k_scale=None,
           Tensor? v_scale=None, bool return_lse=False) -> (Tensor out, Tensor lse)
    decode_out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out,
               Tensor(b!)? lse=None, <decode's arguments from cache_seqlens to v_scale>) -> ()
    mla_decode(Tensor q, Tensor kv_cache, float softmax_scale, Tensor? cache_seqlens=None,
               Tensor? block_table=None, Tensor? kv_scale=None, bool return_lse=False)
               -> (Tensor out, Tensor lse)
    mla_decode_out(Tensor q, Tensor kv_cache, float softmax_scale, Tensor(a!) out,
                   Tensor(b!)? lse=None, <mla_decode's cache_seqlens, block_table, kv_scale>)
                   -> ()
    store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping,
             Tensor? k_scale=None, Tensor? v_scale=None) -> ()
    merge_states(Tensor outputs, Tensor lses, Tensor? sinks=None, bool return_lse=True)
                 -> (Tensor out, Tensor lse)
    merge_states_out(Tensor outputs, Tensor lses, Tensor(a!) out, Tensor(b!)? lse=None,
                     Tensor? sinks=None) -> ()

(Custom ops take no keyword-only tensors: every argument may be given by position or name.)
The functional ops return ``lse`` as an empty float32 tensor (shape ``[0]``) unless
``return_lse``. Each op checks its arguments as the Python function does (the same errors) and
launches on the current stream; its fake implementation gives the output shapes without a GPU
(and checks the arguments where the shapes are static), so ``torch.compile(fullgraph=True)``,
``torch.export`` and ``make_fx`` trace through kvstream calls, and the profiler names them
``kvstream::decode`` and so on. The Python functions are the API; the ops are what they call.

``import kvstream`` does not import this module: the first call with torch tensors does (or
:func:`register`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Tuple

import torch

import kvstream as _kv

from . import (
    _check_decode,
    _check_merge,
    _check_mla,
    _check_store,
    _launch_decode,
    _launch_merge,
    _launch_mla,
    _launch_store,
    _softcap,
    _Spec,
    _tensor,
    _window_size,
)

__all__ = ["register", "tracing", "SCHEMAS"]

_DECODE_OPT = (
    "Tensor? cache_seqlens=None, Tensor? block_table=None, float? softmax_scale=None, "
    "int[] window_size=[-1, 0], float softcap=0., Tensor? sinks=None, int? num_splits=None, "
    "str? reduction=None, bool device_plan=False, str? engine=None, Tensor? k_scale=None, "
    "Tensor? v_scale=None"
)
_MLA_OPT = "Tensor? cache_seqlens=None, Tensor? block_table=None, Tensor? kv_scale=None"
#: The schema of each op (``torch.ops.kvstream.NAME``), without its name.
SCHEMAS = {
    "decode": (
        f"(Tensor q, Tensor k_cache, Tensor v_cache, {_DECODE_OPT}, bool return_lse=False) "
        "-> (Tensor, Tensor)"
    ),
    "decode_out": (
        "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, Tensor(b!)? lse=None, "
        f"{_DECODE_OPT}) -> ()"
    ),
    "mla_decode": (
        f"(Tensor q, Tensor kv_cache, float softmax_scale, {_MLA_OPT}, bool return_lse=False) "
        "-> (Tensor, Tensor)"
    ),
    "mla_decode_out": (
        "(Tensor q, Tensor kv_cache, float softmax_scale, Tensor(a!) out, Tensor(b!)? lse=None, "
        f"{_MLA_OPT}) -> ()"
    ),
    "store_kv": (
        "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> ()"
    ),
    "merge_states": (
        "(Tensor outputs, Tensor lses, Tensor? sinks=None, bool return_lse=True) "
        "-> (Tensor, Tensor)"
    ),
    "merge_states_out": (
        "(Tensor outputs, Tensor lses, Tensor(a!) out, Tensor(b!)? lse=None, "
        "Tensor? sinks=None) -> ()"
    ),
}
_MUTATES = {
    "decode": (),
    "decode_out": ("out", "lse"),
    "mla_decode": (),
    "mla_decode_out": ("out", "lse"),
    "store_kv": ("k_cache", "v_cache"),
    "merge_states": (),
    "merge_states_out": ("out", "lse"),
}
# torch.library.register_fake: torch >= 2.4. Older torch runs the launches directly (no op:
# nothing for torch.compile to trace).
_HAVE_OPS = hasattr(torch.library, "register_fake")

try:
    from torch._subclasses.fake_tensor import is_fake as _is_fake
except ImportError:  # pragma: no cover - very old torch
    def _is_fake(x: Any) -> bool:
        return False


def tracing(x: Any) -> bool:
    """True while torch.compile / export / make_fx trace a call: ``x`` has no data, so the call
    goes straight to the op, whose fake implementation checks the arguments."""
    if not _HAVE_OPS:
        return False
    if torch.compiler.is_compiling():
        return True
    # a plain tensor has data; fake and functional tensors are subclasses
    return type(x) is not torch.Tensor and _is_fake(x)


# ---- the checked spec, handed from the Python function to the op it calls ----
#
# kvstream.decode checks its arguments before calling the op (so that every error is raised
# eagerly, with torch or not); the op's implementation checks them too (it may be called
# directly), unless the spec it finds here was made from the very same arguments.

_handoff = threading.local()


def _same(a: tuple, b: tuple) -> bool:
    for x, y in zip(a, b):
        if x is y:
            continue
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return False
        if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
            x, y = tuple(x), tuple(y)
        if type(x) is bool or type(y) is bool:
            if type(x) is not type(y):
                return False
        if x != y:
            return False
    return len(a) == len(b)


def _spec(check: Callable[..., _Spec], args: tuple) -> Tuple[_Spec, bool]:
    """The spec of ``args``: the one handed over if made from them, else checked now. Also
    whether it was handed over."""
    spec = getattr(_handoff, "spec", None)
    if spec is not None:
        _handoff.spec = None
        if _same(spec.args, args):
            return spec, True
    return check(*args), False


def _call(op: Any, spec: Optional[_Spec], *args: Any, **kwargs: Any) -> Any:
    if spec is None or not _HAVE_OPS:
        return op(*args, **kwargs)
    _handoff.spec = spec
    try:
        return op(*args, **kwargs)
    finally:
        _handoff.spec = None


def _check_lse(fn: str, spec: _Spec, lse: Any, ref: Any, fake: bool = False) -> None:
    """An ``lse`` given to an out op: float32, contiguous, of the spec's LSE shape, on q's
    device."""
    shape = _tensor("lse", lse, fn)
    if lse.dtype != torch.float32:
        raise TypeError(f"kvstream.{fn}: lse has dtype {lse.dtype}, allowed: torch.float32")
    if shape != tuple(spec.lse_shape):
        raise ValueError(
            f"kvstream.{fn}: lse has shape {list(shape)}, allowed: {list(spec.lse_shape)}"
        )
    _kv._same_device("lse", lse, spec.dev, ref, fn)
    _kv._contiguous("lse", lse, shape, fn)
    _kv._aligned("lse", lse, fn, fake=fake)


def _static(tensors: Tuple[Any, ...]) -> bool:
    """Whether the fake tensors given have concrete shapes and strides (no symbolic sizes, which
    a check would specialise) and live on a device that is checked (meta tensors: shapes only)."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "meta":
            return False
        if not all(isinstance(s, int) for s in t.shape):
            return False
        if not all(isinstance(s, int) for s in t.stride()):
            return False
    return True


def _fake_check(check: Callable[..., _Spec], args: tuple) -> Optional[_Spec]:
    if _static(tuple(a for a in args if isinstance(a, torch.Tensor))):
        return check(*args, fake=True)
    return None


# ---- decode ----
#
# The implementations take the ops' arguments in schema order; ``opts`` are decode's keyword
# arguments from ``cache_seqlens`` to ``v_scale`` (the schema's optional arguments), in order.

def _decode_check_args(q: Any, k_cache: Any, v_cache: Any, opts: tuple, return_lse: bool,
                       out: Any) -> tuple:
    """The arguments of kvstream._check_decode (decode's parameters in order)."""
    return (q, k_cache, v_cache, *opts, return_lse, out)


def _decode_impl(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                 softmax_scale=None, window_size=(-1, 0), softcap=0.0, sinks=None,
                 num_splits=None, reduction=None, device_plan=False, engine=None, k_scale=None,
                 v_scale=None, return_lse=False):
    opts = (cache_seqlens, block_table, softmax_scale, window_size, softcap, sinks, num_splits,
            reduction, device_plan, engine, k_scale, v_scale)
    spec, _ = _spec(_check_decode, _decode_check_args(q, k_cache, v_cache, opts, return_lse, None))
    out = torch.empty(spec.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(spec.lse_shape if return_lse else (0,), dtype=torch.float32,
                      device=q.device)
    _launch_decode(spec, q, k_cache, v_cache, cache_seqlens, block_table, sinks, out,
                   lse if return_lse else None)
    return out, lse


def _decode_fake(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                 softmax_scale=None, window_size=(-1, 0), softcap=0.0, sinks=None,
                 num_splits=None, reduction=None, device_plan=False, engine=None, k_scale=None,
                 v_scale=None, return_lse=False):
    opts = (cache_seqlens, block_table, softmax_scale, window_size, softcap, sinks, num_splits,
            reduction, device_plan, engine, k_scale, v_scale)
    _fake_check(_check_decode, _decode_check_args(q, k_cache, v_cache, opts, return_lse, None))
    lse_shape = q.shape[:-1] if return_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _decode_out_impl(q, k_cache, v_cache, out, lse=None, cache_seqlens=None, block_table=None,
                     softmax_scale=None, window_size=(-1, 0), softcap=0.0, sinks=None,
                     num_splits=None, reduction=None, device_plan=False, engine=None,
                     k_scale=None, v_scale=None):
    opts = (cache_seqlens, block_table, softmax_scale, window_size, softcap, sinks, num_splits,
            reduction, device_plan, engine, k_scale, v_scale)
    spec, handed = _spec(_check_decode,
                         _decode_check_args(q, k_cache, v_cache, opts, lse is not None, out))
    if lse is not None and not handed:
        _check_lse("decode", spec, lse, q)
    _launch_decode(spec, q, k_cache, v_cache, cache_seqlens, block_table, sinks, out, lse)


def _decode_out_fake(q, k_cache, v_cache, out, lse=None, cache_seqlens=None, block_table=None,
                     softmax_scale=None, window_size=(-1, 0), softcap=0.0, sinks=None,
                     num_splits=None, reduction=None, device_plan=False, engine=None,
                     k_scale=None, v_scale=None):
    opts = (cache_seqlens, block_table, softmax_scale, window_size, softcap, sinks, num_splits,
            reduction, device_plan, engine, k_scale, v_scale)
    spec = _fake_check(_check_decode,
                       _decode_check_args(q, k_cache, v_cache, opts, lse is not None, out))
    if spec is not None and lse is not None:
        _check_lse("decode", spec, lse, q, fake=True)


def decode(args: tuple, spec: Optional[_Spec]) -> Any:
    """kvstream.decode with torch tensors: ``args`` as decode's parameters, ``spec`` their
    check (None while tracing: the op's fake implementation checks them)."""
    (q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, window_size, softcap,
     sinks, num_splits, reduction, device_plan, engine, k_scale, v_scale, return_lse,
     out) = args
    if spec is None:  # tracing: the scalars the schema types take, checked by our rules
        window_size = _window_size(window_size)
        softcap = _softcap(softcap)
        if softcap == 0.0:
            # a constant: torch.compile(dynamic=True) makes a float default a graph input
            softcap = 0.0
    if not _HAVE_OPS:
        if spec is None:
            spec = _check_decode(*args)
        if out is None:
            out = torch.empty(spec.out_shape, dtype=q.dtype, device=q.device)
        lse = q.new_empty(spec.lse_shape, dtype=torch.float32) if return_lse else None
        _launch_decode(spec, q, k_cache, v_cache, cache_seqlens, block_table, sinks, out, lse)
        return (out, lse) if return_lse else out
    # positional arguments: the op parses them faster than keywords
    opts = (cache_seqlens, block_table, softmax_scale, window_size, softcap, sinks, num_splits,
            reduction, device_plan, engine, k_scale, v_scale)
    if out is None:
        res, lse = _call(torch.ops.kvstream.decode.default, spec, q, k_cache, v_cache, *opts,
                         return_lse)
        return (res, lse) if return_lse else res
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if return_lse else None
    _call(torch.ops.kvstream.decode_out.default, spec, q, k_cache, v_cache, out, lse, *opts)
    return (out, lse) if return_lse else out


# ---- MLA decode ----

def _mla_impl(q, kv_cache, softmax_scale, cache_seqlens=None, block_table=None, kv_scale=None,
              return_lse=False):
    args = (q, kv_cache, softmax_scale, cache_seqlens, block_table, kv_scale, return_lse, None)
    spec, _ = _spec(_check_mla, args)
    out = torch.empty(spec.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(spec.lse_shape if return_lse else (0,), dtype=torch.float32,
                      device=q.device)
    _launch_mla(spec, q, kv_cache, cache_seqlens, block_table, out, lse if return_lse else None)
    return out, lse


def _mla_fake(q, kv_cache, softmax_scale, cache_seqlens=None, block_table=None, kv_scale=None,
              return_lse=False):
    _fake_check(_check_mla, (q, kv_cache, softmax_scale, cache_seqlens, block_table, kv_scale,
                             return_lse, None))
    out = q.new_empty((*q.shape[:-1], _kv.MLA_V_DIM))
    lse = q.new_empty(q.shape[:-1] if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _mla_out_impl(q, kv_cache, softmax_scale, out, lse=None, cache_seqlens=None,
                  block_table=None, kv_scale=None):
    args = (q, kv_cache, softmax_scale, cache_seqlens, block_table, kv_scale, lse is not None,
            out)
    spec, handed = _spec(_check_mla, args)
    if lse is not None and not handed:
        _check_lse("mla_decode", spec, lse, q)
    _launch_mla(spec, q, kv_cache, cache_seqlens, block_table, out, lse)


def _mla_out_fake(q, kv_cache, softmax_scale, out, lse=None, cache_seqlens=None,
                  block_table=None, kv_scale=None):
    spec = _fake_check(_check_mla, (q, kv_cache, softmax_scale, cache_seqlens, block_table,
                                    kv_scale, lse is not None, out))
    if spec is not None and lse is not None:
        _check_lse("mla_decode", spec, lse, q, fake=True)


def mla_decode(args: tuple, spec: Optional[_Spec]) -> Any:
    """kvstream.mla_decode with torch tensors (see :func:`decode`)."""
    q, kv_cache, softmax_scale, cache_seqlens, block_table, kv_scale, return_lse, out = args
    if not _HAVE_OPS:
        if spec is None:
            spec = _check_mla(*args)
        if out is None:
            out = torch.empty(spec.out_shape, dtype=q.dtype, device=q.device)
        lse = q.new_empty(spec.lse_shape, dtype=torch.float32) if return_lse else None
        _launch_mla(spec, q, kv_cache, cache_seqlens, block_table, out, lse)
        return (out, lse) if return_lse else out
    if out is None:
        res, lse = _call(torch.ops.kvstream.mla_decode.default, spec, q, kv_cache, softmax_scale,
                         cache_seqlens, block_table, kv_scale, return_lse)
        return (res, lse) if return_lse else res
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if return_lse else None
    _call(torch.ops.kvstream.mla_decode_out.default, spec, q, kv_cache, softmax_scale, out, lse,
          cache_seqlens, block_table, kv_scale)
    return (out, lse) if return_lse else out


# ---- store_kv ----

def _store_impl(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    spec, _ = _spec(_check_store, (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale))
    _launch_store(spec, k, v, k_cache, v_cache, slot_mapping)


def _store_fake(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    _fake_check(_check_store, (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale))


def store_kv(args: tuple, spec: Optional[_Spec]) -> None:
    """kvstream.store_kv with torch tensors (see :func:`decode`)."""
    k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale = args
    if not _HAVE_OPS:
        _launch_store(spec if spec is not None else _check_store(*args), k, v, k_cache, v_cache,
                      slot_mapping)
        return None
    _call(torch.ops.kvstream.store_kv.default, spec, k, v, k_cache, v_cache, slot_mapping,
          k_scale, v_scale)
    return None


# ---- merge_states ----

def _merge_impl(outputs, lses, sinks=None, return_lse=True):
    spec, _ = _spec(_check_merge, (outputs, lses, sinks, return_lse, None))
    out = torch.empty(spec.out_shape, dtype=outputs.dtype, device=outputs.device)
    lse = torch.empty(spec.lse_shape if return_lse else (0,), dtype=torch.float32,
                      device=outputs.device)
    _launch_merge(spec, outputs, lses, sinks, out, lse if return_lse else None)
    return out, lse


def _merge_fake(outputs, lses, sinks=None, return_lse=True):
    _fake_check(_check_merge, (outputs, lses, sinks, return_lse, None))
    out = outputs.new_empty(outputs.shape[1:])
    lse = outputs.new_empty(outputs.shape[1:-1] if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _merge_out_impl(outputs, lses, out, lse=None, sinks=None):
    spec, handed = _spec(_check_merge, (outputs, lses, sinks, lse is not None, out))
    if lse is not None and not handed:
        _check_lse("merge_states", spec, lse, outputs)
    _launch_merge(spec, outputs, lses, sinks, out, lse)


def _merge_out_fake(outputs, lses, out, lse=None, sinks=None):
    spec = _fake_check(_check_merge, (outputs, lses, sinks, lse is not None, out))
    if spec is not None and lse is not None:
        _check_lse("merge_states", spec, lse, outputs, fake=True)


def merge_states(args: tuple, spec: Optional[_Spec]) -> Any:
    """kvstream.merge_states with torch tensors (see :func:`decode`)."""
    outputs, lses, sinks, return_lse, out = args
    if not _HAVE_OPS:
        if spec is None:
            spec = _check_merge(*args)
        if out is None:
            out = torch.empty(spec.out_shape, dtype=outputs.dtype, device=outputs.device)
        lse = outputs.new_empty(spec.lse_shape, dtype=torch.float32) if return_lse else None
        _launch_merge(spec, outputs, lses, sinks, out, lse)
        return (out, lse) if return_lse else out
    if out is None:
        res, lse = _call(torch.ops.kvstream.merge_states.default, spec, outputs, lses, sinks,
                         return_lse)
        return (res, lse) if return_lse else res
    lse = outputs.new_empty(outputs.shape[1:-1], dtype=torch.float32) if return_lse else None
    _call(torch.ops.kvstream.merge_states_out.default, spec, outputs, lses, out, lse, sinks)
    return (out, lse) if return_lse else out


# ---- registration ----

_IMPLS = {
    "decode": (_decode_impl, _decode_fake),
    "decode_out": (_decode_out_impl, _decode_out_fake),
    "mla_decode": (_mla_impl, _mla_fake),
    "mla_decode_out": (_mla_out_impl, _mla_out_fake),
    "store_kv": (_store_impl, _store_fake),
    "merge_states": (_merge_impl, _merge_fake),
    "merge_states_out": (_merge_out_impl, _merge_out_fake),
}
def _register() -> None:
    # The Library holding the ops lives on the package: dropping it would remove them, and a
    # reload of this module must not register them twice.
    if getattr(_kv, "_torch_library", None) is not None:
        return
    # torch.library.Library rather than torch.library.custom_op: the same op for torch.compile,
    # for a few microseconds less per eager call (custom_op adds Python autograd and checking
    # layers around the implementation).
    tags = tuple(getattr(torch.Tag, t) for t in ("pt2_compliant_tag", "needs_fixed_stride_order")
                 if hasattr(torch.Tag, t))
    lib = torch.library.Library("kvstream", "FRAGMENT")
    for name, (impl, fake) in _IMPLS.items():
        lib.define(name + SCHEMAS[name], tags=tags)
        # CompositeExplicitAutograd: one implementation for every device, so that a CPU tensor
        # gets kvstream's error ("must be on a CUDA device"), not a missing-kernel one.
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"kvstream::{name}", fake, lib=lib)
    _kv._torch_library = lib


def register() -> Any:
    """Registers the ops (done when this module is imported; idempotent) and returns their
    namespace, ``torch.ops.kvstream``. Without torch >= 2.4 (``torch.library.register_fake``):
    RuntimeError."""
    if not _HAVE_OPS:
        raise RuntimeError(
            f"kvstream: torch {torch.__version__} has no torch.library.register_fake (torch >= "
            "2.4 has); kvstream.decode works, without an op for torch.compile to trace"
        )
    return torch.ops.kvstream


if _HAVE_OPS:
    _register()
