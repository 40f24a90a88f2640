from typing import Any, Optional, Tuple

__all__ = ["NAME", "register", "attention_forward", "build_mask", "fallback_reason"]

NAME: str

def register() -> str: ...
def build_mask(*args: Any, **kwargs: Any) -> Any: ...
def fallback_reason(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = ...,
    **kwargs: Any,
) -> Optional[str]: ...
def attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = ...,
    scaling: Optional[float] = ...,
    **kwargs: Any,
) -> Tuple[Any, None]: ...
