from typing import List, Optional, Tuple

__version__: str

def validate(
    batch: int,
    hq: int,
    hkv: int,
    head_dim: int,
    max_len: int,
    dtype: str,
    softmax_scale: Optional[float] = None,
    num_splits: Optional[int] = None,
    reduction: Optional[str] = None,
    k_strides: Optional[Tuple[int, int, int]] = None,
    v_strides: Optional[Tuple[int, int, int]] = None,
    q_len: int = 1,
    page_size: Optional[int] = None,
    num_pages: Optional[int] = None,
    table_stride: Optional[int] = None,
    device_plan: bool = False,
    engine: Optional[str] = None,
    kv_dtype: Optional[str] = None,
    window_size: Tuple[int, int] = (-1, 0),
    softcap: float = 0.0,
    sinks: bool = False,
) -> str: ...

class Decoder:
    def __init__(
        self,
        batch: int,
        hq: int,
        hkv: int,
        head_dim: int,
        max_len: int,
        dtype: str,
        softmax_scale: Optional[float] = None,
        num_splits: Optional[int] = None,
        reduction: Optional[str] = None,
        device: int = 0,
        k_strides: Optional[Tuple[int, int, int]] = None,
        v_strides: Optional[Tuple[int, int, int]] = None,
        q_len: int = 1,
        page_size: Optional[int] = None,
        num_pages: Optional[int] = None,
        table_stride: Optional[int] = None,
        device_plan: bool = False,
        engine: Optional[str] = None,
        kv_dtype: Optional[str] = None,
        window_size: Tuple[int, int] = (-1, 0),
        softcap: float = 0.0,
        sinks: bool = False,
    ) -> None: ...
    def run(
        self,
        q_ptr: int,
        k_ptr: int,
        v_ptr: int,
        out_ptr: int,
        lse_ptr: Optional[int] = None,
        seqlens_ptr: Optional[int] = None,
        stream: int = 0,
        block_table_ptr: Optional[int] = None,
        k_scale: Optional[Tuple[int, int]] = None,
        v_scale: Optional[Tuple[int, int]] = None,
        sinks_ptr: Optional[int] = None,
        view_len: Optional[int] = None,
    ) -> None: ...
    @property
    def num_splits(self) -> int: ...
    @property
    def reduction(self) -> str: ...
    @property
    def plan(self) -> str: ...
    @property
    def device(self) -> int: ...
    @property
    def q_len(self) -> int: ...
    @property
    def page_size(self) -> Optional[int]: ...
    @property
    def device_plan(self) -> bool: ...
    @property
    def kv_dtype(self) -> str: ...

class KvWriter:
    def __init__(
        self,
        batch: int,
        hkv: int,
        head_dim: int,
        max_len: int,
        dtype: str,
        device: int = 0,
        k_strides: Optional[Tuple[int, int, int]] = None,
        page_size: Optional[int] = None,
        num_pages: Optional[int] = None,
        kv_dtype: Optional[str] = None,
    ) -> None: ...
    def run(
        self,
        tokens: int,
        k_ptr: int,
        v_ptr: int,
        slots_ptr: int,
        k_cache_ptr: int,
        v_cache_ptr: int,
        stream: int = 0,
        k_scale: Optional[Tuple[int, int]] = None,
        v_scale: Optional[Tuple[int, int]] = None,
    ) -> None: ...

class MlaDecoder:
    def __init__(
        self,
        batch: int,
        hq: int,
        q_len: int,
        max_len: int,
        dtype: str,
        softmax_scale: float,
        device: int = 0,
        page_size: Optional[int] = None,
        num_pages: Optional[int] = None,
        table_stride: Optional[int] = None,
        kv_dtype: Optional[str] = None,
    ) -> None: ...
    def run(
        self,
        q_ptr: int,
        kv_ptr: int,
        out_ptr: int,
        lse_ptr: Optional[int] = None,
        seqlens_ptr: Optional[int] = None,
        stream: int = 0,
        block_table_ptr: Optional[int] = None,
        kv_scale: Optional[Tuple[int, int]] = None,
    ) -> None: ...
    @property
    def plan(self) -> str: ...

class StateMerger:
    def __init__(
        self,
        shards: int,
        batch: int,
        q_len: int,
        heads: int,
        head_dim: int,
        dtype: str,
        device: int = 0,
        strides: Optional[Tuple[int, int, int]] = None,
    ) -> None: ...
    def run(
        self,
        parts_ptr: int,
        part_lse_ptr: int,
        out_ptr: int,
        lse_ptr: Optional[int] = None,
        sinks_ptr: Optional[int] = None,
        stream: int = 0,
    ) -> None: ...

def rank_shares(
    lens: List[int], rank: int, world: int, sharding: str, unit: int, q_len: int
) -> List[Tuple[int, int, int, int, int]]: ...
