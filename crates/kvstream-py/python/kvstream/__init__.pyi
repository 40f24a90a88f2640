from typing import Any, Dict, Literal, Optional, Tuple, overload

__version__: str
SUPPORTED_DTYPES: Dict[str, str]
FP8_KV_DTYPES: Dict[str, str]
SUPPORTED_HEAD_DIMS: Tuple[int, ...]
SPLIT_ENGINE_HEAD_DIMS: Tuple[int, ...]
MAX_GROUP: int
MAX_SPLITS: int
REDUCTIONS: Tuple[str, ...]
CLUSTER_SPLITS: Tuple[int, ...]
MAX_Q_LEN: int
SUPPORTED_PAGE_SIZES: Tuple[int, ...]
MLA_DIM: int
MAX_MERGE_HEAD_DIM: int
MLA_V_DIM: int
MLA_MAX_HEADS: int
DEFAULT_DECODER_CACHE_SIZE: int

def self_test(verbose: bool = ...) -> bool: ...
def clear_cache(include_captured: bool = ...) -> None: ...
def set_decoder_cache_size(size: int) -> None: ...
def decoder_cache_info() -> Dict[str, int]: ...

@overload
def decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Optional[Any] = ...,
    block_table: Optional[Any] = ...,
    softmax_scale: Optional[float] = ...,
    window_size: Tuple[int, int] = ...,
    softcap: float = ...,
    sinks: Optional[Any] = ...,
    num_splits: Optional[int] = ...,
    reduction: Optional[str] = ...,
    device_plan: bool = ...,
    engine: Optional[str] = ...,
    k_scale: Optional[Any] = ...,
    v_scale: Optional[Any] = ...,
    return_lse: Literal[False] = ...,
    out: Optional[Any] = ...,
) -> Any: ...
@overload
def decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Optional[Any] = ...,
    block_table: Optional[Any] = ...,
    softmax_scale: Optional[float] = ...,
    window_size: Tuple[int, int] = ...,
    softcap: float = ...,
    sinks: Optional[Any] = ...,
    num_splits: Optional[int] = ...,
    reduction: Optional[str] = ...,
    device_plan: bool = ...,
    engine: Optional[str] = ...,
    k_scale: Optional[Any] = ...,
    v_scale: Optional[Any] = ...,
    return_lse: Literal[True],
    out: Optional[Any] = ...,
) -> Tuple[Any, Any]: ...

def store_kv(
    k: Any,
    v: Any,
    k_cache: Any,
    v_cache: Any,
    slot_mapping: Any,
    *,
    k_scale: Optional[Any] = ...,
    v_scale: Optional[Any] = ...,
) -> None: ...
def fp8_scales(cache: Any, per_head: bool = ...) -> Any: ...
def merge_states(
    outputs: Any,
    lses: Any,
    *,
    sinks: Optional[Any] = ...,
    out: Optional[Any] = ...,
    return_lse: bool = ...,
) -> Any: ...
@overload
def mla_decode(
    q: Any,
    kv_cache: Any,
    *,
    softmax_scale: float,
    cache_seqlens: Optional[Any] = ...,
    block_table: Optional[Any] = ...,
    kv_scale: Optional[Any] = ...,
    return_lse: Literal[False] = ...,
    out: Optional[Any] = ...,
) -> Any: ...
@overload
def mla_decode(
    q: Any,
    kv_cache: Any,
    *,
    softmax_scale: float,
    cache_seqlens: Optional[Any] = ...,
    block_table: Optional[Any] = ...,
    kv_scale: Optional[Any] = ...,
    return_lse: Literal[True],
    out: Optional[Any] = ...,
) -> Tuple[Any, Any]: ...
