"""turboquant: Python bindings of the TurboQuant C++ library."""
from ._core import (  # noqa: F401
    Codec,
    KVCache,
    PagedKVCache,
    TurboQuantError,
    active_simd_target,
    preset_bits_per_value,
    preset_bytes_per_token_head,
    preset_names,
)

__all__ = [
    "Codec",
    "KVCache",
    "PagedKVCache",
    "TurboQuantError",
    "active_simd_target",
    "preset_bits_per_value",
    "preset_bytes_per_token_head",
    "preset_names",
]
