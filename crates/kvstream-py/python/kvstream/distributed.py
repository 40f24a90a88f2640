"""Context-parallel decode: the KV cache of every request sharded along the sequence over the
ranks of a ``torch.distributed`` group (NCCL), each rank decoding its shard with the LSE, the
partial states exchanged by one all-gather and merged by :func:`kvstream.merge_states`, so that
every rank gets the output of the whole decode::

    # torchrun --nproc-per-node 4 examples/context_parallel.py
    import torch, torch.distributed as dist, kvstream.distributed as kcp
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    # this rank's chunk of every request: positions [rank * C, (rank + 1) * C)
    k_local = torch.randn(b, C, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_local = torch.randn_like(k_local)
    out = kcp.decode(q, k_local, v_local, cache_seqlens)   # cache_seqlens: global lengths

Two shardings:

- ``"chunks"``: rank ``r`` holds positions ``[r C, (r + 1) C)`` of every request, ``C`` =
  ``chunk_len`` (default: the local contiguous cache's capacity, ``k_cache.shape[1]``).
- ``"pages"``: pages dealt round-robin: the request's page ``j`` (positions ``[j P, (j + 1) P)``,
  ``P`` the pool's page size) lives on rank ``j % world``, and the rank's ``block_table`` lists
  its own pages in order (its local page ``i`` is the request's page ``rank + i * world``).
  Spreads every request over all ranks whatever its length; multi-token decode needs pages of
  at least ``q_len - 1`` positions.

``cache_seqlens`` are the requests' global lengths (the same values on every rank, on the
device); :func:`local_lengths` gives the positions a rank holds, for filling its shard. The
new tokens' causal mask is kept across shards: token ``i`` sees global positions up to
``len - q_len + i``. A rank whose share of a request ends among its last ``q_len - 1``
positions decodes it with the window's right side that maps its local prefix onto that rule
(and rows that see none of those positions from an unbounded decode of the positions before
them), so a multi-token call runs ``q_len`` local decodes, each position read once (at most
twice for the share that straddles the tail). Sinks join the merge once, never the shards.

``scatter_heads=True`` leaves each rank its slice of the query heads instead (one all-to-all
in place of the all-gather: the layout a tensor-parallel output projection takes).

Everything runs on the device without a host synchronisation, so a call can be captured in a
CUDA graph (NCCL collectives are capturable) after one warm-up call with the same shapes.
Windows other than causal are not supported here (they bound positions relative to the
global length).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

import kvstream

__all__ = ["decode", "mla_decode", "local_lengths", "SHARDINGS"]

#: The ways a cache may be spread over the ranks.
SHARDINGS = ("chunks", "pages")


def _group_rank_world(group: Any) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "kvstream.distributed: torch.distributed is not initialised (call "
            "torch.distributed.init_process_group first)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _unit(fn: str, sharding: str, k_cache: Any, block_table: Any, chunk_len: Optional[int]) -> int:
    """The sharding's unit: the chunk length or the page size, checked."""
    if sharding not in SHARDINGS:
        raise ValueError(
            f"kvstream.distributed.{fn}: sharding is {sharding!r}, allowed: "
            f"{', '.join(map(repr, SHARDINGS))}"
        )
    if sharding == "pages":
        if block_table is None:
            raise ValueError(
                f"kvstream.distributed.{fn}: sharding='pages' needs a block_table (the rank's "
                f"pages in order)"
            )
        if chunk_len is not None:
            raise ValueError(
                f"kvstream.distributed.{fn}: chunk_len is {chunk_len} with sharding='pages', "
                f"allowed: None (the pool's page size is the unit)"
            )
        return int(k_cache.shape[1])
    if chunk_len is None:
        if block_table is not None:
            raise ValueError(
                f"kvstream.distributed.{fn}: sharding='chunks' with a block_table needs "
                f"chunk_len (the positions each rank holds per request)"
            )
        return int(k_cache.shape[1])
    if not isinstance(chunk_len, int) or isinstance(chunk_len, bool) or chunk_len < 1:
        raise ValueError(
            f"kvstream.distributed.{fn}: chunk_len is {chunk_len!r}, allowed: a positive int"
        )
    return chunk_len


class _Share:
    """One rank's share of every request (int64 device tensors ``[b]``), the rule of the Rust
    library's ``kvstream::context`` (the tests compare the two): ``held`` positions;
    whether it holds some of the request's last ``q_len - 1`` positions (the run ``[a, e)``),
    the window's right side ``len - e`` that its decode of the request then takes, the first
    query row that decode serves and the length of the unbounded decode that serves the rows
    before it (``before``: the held positions ahead of the run)."""

    def __init__(self, lens: Any, rank: int, world: int, sharding: str, unit: int,
                 q_len: int) -> None:
        n = lens.to(torch.int64)
        if sharding == "chunks":
            start = rank * unit
            held = (n - start).clamp(min=0, max=unit)
            e = start + held
            run_floor = torch.full_like(n, start)
        else:
            full, rem = n // unit, n % unit
            full_here = (full - rank + world - 1).div(world, rounding_mode="floor").clamp(min=0)
            partial_here = (rem > 0) & (full % world == rank)
            held = full_here * unit + torch.where(partial_here, rem, torch.zeros_like(rem))
            last_full_end = (rank + (full_here - 1) * world + 1) * unit
            e = torch.where(partial_here, n, torch.where(full_here > 0, last_full_end, n * 0))
            # the held positions before e are one run back to its page's start (pages of at
            # least q_len - 1 leave the rank's earlier pages before the tail); with one rank
            # every position is held
            if world == 1:
                run_floor = torch.zeros_like(n)
            else:
                run_floor = ((e - 1).clamp(min=0) // unit) * unit
        a = torch.maximum(n - q_len + 1, run_floor)
        self.held = held
        self.has_tail = (held > 0) & (e > a) & (q_len > 1)
        self.right = n - e
        self.first_row = (a + q_len - n - 1).clamp(min=0)
        before = held - (e - a).clamp(min=0)
        self.all_len = torch.where(
            self.has_tail, torch.where(self.first_row > 0, before, torch.zeros_like(before)), held
        )
        self.n, self.a, self.e = n, a, e

    def visible(self, row: int, q_len: int) -> Any:
        """Held positions query row ``row`` sees (its global bound ``len - q_len + row``)."""
        hidden = (self.e - torch.maximum(self.a, self.n - q_len + row + 1)).clamp(min=0)
        return torch.where(self.has_tail, self.held - hidden, self.held)


def local_lengths(cache_seqlens: Any, rank: int, world: int, *, sharding: str = "chunks",
                  unit: int) -> Any:
    """The positions of each request that ``rank`` of ``world`` holds (int32 ``[b]``, on
    ``cache_seqlens``' device): ``unit`` is the chunk length (``"chunks"``) or the page size
    (``"pages"``); ``cache_seqlens`` the global lengths."""
    if sharding not in SHARDINGS:
        raise ValueError(
            f"kvstream.distributed.local_lengths: sharding is {sharding!r}, allowed: "
            f"{', '.join(map(repr, SHARDINGS))}"
        )
    if not 0 <= rank < world:
        raise ValueError(
            f"kvstream.distributed.local_lengths: rank is {rank}, allowed: 0..{world - 1}"
        )
    return _Share(cache_seqlens, rank, world, sharding, unit, 1).held.to(torch.int32)


def _exchange(states: Tuple[Any, Any], group: Any, world: int) -> Tuple[Any, Any]:
    """Every rank's (out, lse), stacked ``[world, ...]``: one all-gather of each."""
    gathered = []
    for x in states:
        x = x.contiguous()
        # concatenated along the first dimension (what every backend takes), then viewed
        buf = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(buf, x, group=group)
        gathered.append(buf.view(world, *x.shape))
    return gathered[0], gathered[1]


def _scatter_heads(states: Tuple[Any, Any], group: Any, world: int) -> Tuple[Any, Any]:
    """Every rank's (out, lse) of this rank's heads (the heads dealt in ``world`` contiguous
    slices, slice r to rank r), stacked ``[world, ..., heads / world(, d)]``: one all-to-all
    of each."""
    out, lse = states
    per = lse.shape[-1] // world
    o = out.unflatten(-2, (world, per)).movedim(-3, 0).contiguous()
    ls = lse.unflatten(-1, (world, per)).movedim(-2, 0).contiguous()
    got_o, got_l = torch.empty_like(o), torch.empty_like(ls)
    dist.all_to_all_single(got_o, o, group=group)
    dist.all_to_all_single(got_l, ls, group=group)
    return got_o, got_l


def _finish(outs: Any, lses: Any, group: Any, world: int, sinks: Any, return_lse: bool,
            out: Any, scatter_heads: bool = False) -> Any:
    """Merges this rank's partial states, exchanges them (all of them, or this rank's heads of
    every rank's), merges every rank's (with sinks)."""
    if outs.shape[0] > 1:
        local, local_lse = kvstream.merge_states(outs, lses)
    else:
        local, local_lse = outs[0], lses[0]
    if scatter_heads:
        per = local_lse.shape[-1] // world
        rank = dist.get_rank(group)
        outs_all, lses_all = _scatter_heads((local, local_lse), group, world)
        sinks = None if sinks is None else sinks[rank * per:(rank + 1) * per].contiguous()
    else:
        outs_all, lses_all = _exchange((local, local_lse), group, world)
    return kvstream.merge_states(outs_all, lses_all, sinks=sinks, out=out, return_lse=return_lse)


def _check_scatter(fn: str, scatter_heads: Any, heads: int, world: int) -> None:
    if not isinstance(scatter_heads, bool):
        raise TypeError(
            f"kvstream.distributed.{fn}: scatter_heads must be a bool, got {scatter_heads!r}"
        )
    if scatter_heads and heads % world != 0:
        raise ValueError(
            f"kvstream.distributed.{fn}: scatter_heads with {heads} query heads over {world} "
            f"ranks, allowed: a head count that is a multiple of the ranks"
        )


def _q_len(fn: str, q: Any) -> int:
    if q.dim() == 4:
        return int(q.shape[1])
    if q.dim() == 3:
        return 1
    raise ValueError(
        f"kvstream.distributed.{fn}: q must have 3 or 4 dimensions, got shape {list(q.shape)}"
    )


def _this_rank(fn: str, q: Any, cache: Any, cache_seqlens: Any, group: Any, sharding: str,
               chunk_len: Optional[int], block_table: Any) -> Tuple[int, int, _Share]:
    """The group's size, the new tokens per request and this rank's share of every request,
    every argument of the sharding checked."""
    rank, world = _group_rank_world(group)
    unit = _unit(fn, sharding, cache, block_table, chunk_len)
    q_len = _q_len(fn, q)
    if sharding == "pages" and world > 1 and q_len > 1 and unit < q_len - 1:
        raise ValueError(
            f"kvstream.distributed.{fn}: pages of {unit} positions with q_len {q_len}, allowed: "
            f"pages of at least q_len - 1 = {q_len - 1} (the new tokens' mask spans at most two "
            f"pages)"
        )
    return world, q_len, _Share(cache_seqlens, rank, world, sharding, unit, q_len)


def decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    *,
    group: Any = None,
    sharding: str = "chunks",
    chunk_len: Optional[int] = None,
    block_table: Any = None,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    sinks: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    return_lse: bool = False,
    out: Any = None,
    scatter_heads: bool = False,
) -> Any:
    """Context-parallel :func:`kvstream.decode` over ``group`` (default: the world).

    ``q`` (the same on every rank), ``k_cache`` / ``v_cache`` (this rank's shard: a contiguous
    ``[b, C, hkv, d]`` cache or a page pool with ``block_table``), ``softmax_scale``,
    ``softcap``, ``k_scale`` / ``v_scale`` as for :func:`kvstream.decode`; ``cache_seqlens``
    int32 ``[b]``: the global lengths. ``sinks`` join the merged softmax once. Returns the
    whole decode's output (and LSE) on every rank; with ``scatter_heads``, this rank's slice
    of the query heads only (``[..., hq / world, d]``, heads ``[rank hq / world, (rank + 1) hq
    / world)``: what a tensor-parallel output projection takes), exchanged by one all-to-all
    of each rank's states instead of an all-gather of all of them.
    """
    world, q_len, share = _this_rank("decode", q, k_cache, cache_seqlens, group, sharding,
                                     chunk_len, block_table)
    _check_scatter("decode", scatter_heads, int(q.shape[-2]), world)
    local = dict(block_table=block_table, softmax_scale=softmax_scale, softcap=softcap,
                 k_scale=k_scale, v_scale=v_scale)
    outs, lses = _gqa_states(q, k_cache, v_cache, share, q_len, local)
    return _finish(outs, lses, group, world, sinks, return_lse, out, scatter_heads)


def _gqa_states(q: Any, k_cache: Any, v_cache: Any, share: _Share, q_len: int,
                local: dict) -> Tuple[Any, Any]:
    """This rank's partial states ``[decodes, ...]`` of a GQA decode: one decode of the held
    positions for a single new token; else one unbounded decode and one per right side, the
    rows another decode serves masked (LSE -inf)."""
    if q_len == 1:
        o, l_ = kvstream.decode(q, k_cache, v_cache, cache_seqlens=share.held.to(torch.int32),
                                return_lse=True, **local)
        return o.unsqueeze(0), l_.unsqueeze(0)
    rows = torch.arange(q_len, device=q.device)
    # [b, q_len]: the rows the run's decode serves
    served = rows.unsqueeze(0) >= share.first_row.unsqueeze(1)
    neg_inf = float("-inf")
    o, l_ = kvstream.decode(q, k_cache, v_cache, cache_seqlens=share.all_len.to(torch.int32),
                            window_size=(-1, -1), return_lse=True, **local)
    outs = [o]
    lses = [l_.masked_fill((share.has_tail.unsqueeze(1) & served).unsqueeze(-1), neg_inf)]
    for right in range(q_len - 1):
        mine = share.has_tail & (share.right == right)
        lens = torch.where(mine, share.held, torch.zeros_like(share.held)).to(torch.int32)
        o, l_ = kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens,
                                window_size=(-1, right), return_lse=True, **local)
        outs.append(o)
        lses.append(l_.masked_fill((~served).unsqueeze(-1), neg_inf))
    return torch.stack(outs), torch.stack(lses)


def mla_decode(
    q: Any,
    kv_cache: Any,
    cache_seqlens: Any,
    *,
    softmax_scale: float,
    group: Any = None,
    sharding: str = "chunks",
    chunk_len: Optional[int] = None,
    block_table: Any = None,
    kv_scale: Any = None,
    return_lse: bool = False,
    out: Any = None,
    scatter_heads: bool = False,
) -> Any:
    """Context-parallel :func:`kvstream.mla_decode` over ``group``: ``kv_cache`` this rank's
    shard, ``cache_seqlens`` the global lengths, ``scatter_heads`` as for :func:`decode`, the
    rest as for :func:`kvstream.mla_decode`. Multi-token decode runs one local decode per new
    token (each sees its own prefix of the shard)."""
    world, q_len, share = _this_rank("mla_decode", q, kv_cache, cache_seqlens, group, sharding,
                                     chunk_len, block_table)
    _check_scatter("mla_decode", scatter_heads, int(q.shape[-2]), world)
    local = dict(softmax_scale=softmax_scale, block_table=block_table, kv_scale=kv_scale)
    outs, lses = _mla_states(q, kv_cache, share, q_len, local)
    return _finish(outs, lses, group, world, None, return_lse, out, scatter_heads)


def _mla_states(q: Any, kv_cache: Any, share: _Share, q_len: int, local: dict) -> Tuple[Any, Any]:
    """This rank's partial state ``[1, ...]`` of an MLA decode: one decode per new token (the
    MLA kernel's mask is causal only), concatenated along the tokens."""
    if q_len == 1:
        o, l_ = kvstream.mla_decode(q, kv_cache, cache_seqlens=share.held.to(torch.int32),
                                    return_lse=True, **local)
        return o.unsqueeze(0), l_.unsqueeze(0)
    parts = [kvstream.mla_decode(q[:, i:i + 1].contiguous(), kv_cache,
                                 cache_seqlens=share.visible(i, q_len).to(torch.int32),
                                 return_lse=True, **local)
             for i in range(q_len)]
    o = torch.cat([p[0] for p in parts], dim=1)
    l_ = torch.cat([p[1] for p in parts], dim=1)
    return o.unsqueeze(0), l_.unsqueeze(0)
