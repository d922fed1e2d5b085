"""turboquant: Python bindings of the TurboQuant C++ library."""
import importlib.util as _ilu

# Load torch (when installed) before our extension. On the H200 machine
# (torch 2.11+cu130) importing torch *after* a CUDA-enabled turboquant._core
# crashed in torch's own import (a subprocess of the vLLM `verify` test); the
# other order works. Cause not established; this keeps the working order.
if _ilu.find_spec("torch") is not None:
    import torch as _torch  # noqa: F401

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
