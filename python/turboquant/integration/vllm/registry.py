"""Cache-dtype registry: the ``kv_cache_dtype`` strings this layer accepts
(``tq2``/``tq3``/``tq4``, ``k{K}v{V}``, ``turboquant25``/``turboquant35`` and
vLLM's upstream names), the preset each maps to, and the page geometry of a
cache dtype in our paged layout."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Dict, List, Optional, Tuple

from ... import _core
from ..common import KVQuantConfig, policy_from_config

UPSTREAM_CACHE_DTYPES = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
SPLIT_RECIPES = ("turboquant25", "turboquant35")
_BITS = (16, 8, 4, 3, 2)


def _registry() -> Dict[str, str]:
    reg = {"tq2": "k2_v2", "tq3": "k3_v3", "tq4": "k4_v4"}
    for k in _BITS:
        for v in _BITS:
            reg[f"k{k}v{v}"] = f"k{k}_v{v}"
    for r in SPLIT_RECIPES + UPSTREAM_CACHE_DTYPES:
        reg[r] = r
    return reg


# kv_cache_dtype -> preset name, in the order error messages list them.
CACHE_DTYPE_PRESETS = MappingProxyType(_registry())


def cache_dtype_names() -> List[str]:
    """Every accepted kv_cache_dtype string."""
    return list(CACHE_DTYPE_PRESETS)


def resolve_cache_dtype(name: str) -> str:
    """vLLM ``kv_cache_dtype`` string -> our preset name. Unknown names raise
    ValueError listing the accepted ones (vLLM's own dtypes such as "auto" or
    "fp8" are not ours)."""
    if not isinstance(name, str) or name not in CACHE_DTYPE_PRESETS:
        raise ValueError(f"kv_cache_dtype {name!r} is not a turboquant cache dtype; accepted: "
                         + ", ".join(CACHE_DTYPE_PRESETS))
    return CACHE_DTYPE_PRESETS[name]


def is_split_recipe(preset: str) -> bool:
    """True for the split recipes, whose high-precision channels metadata chooses."""
    return preset in SPLIT_RECIPES


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def page_geometry(cache_dtype: str, head_size: int, num_kv_heads: int, block_size: int = 16) -> Dict[str, Any]:
    """Bytes of one page (block) of one layer in our paged layout
    (docs/FORMAT.md, "Paged KV layout"): codes planes padded to 16 bytes per
    row, metadata planes unpadded."""
    preset = resolve_cache_dtype(cache_dtype)
    if num_kv_heads < 1 or block_size < 1 or head_size < 1:
        raise ValueError("head_size, num_kv_heads and block_size must be >= 1")
    lay = _core.preset_row_layout(preset, head_size)
    k_stride, v_stride = _round16(lay["key_payload_bytes"]), _round16(lay["value_payload_bytes"])
    slot = k_stride + lay["key_meta_bytes"] + v_stride + lay["value_meta_bytes"]
    return {
        "cache_dtype": cache_dtype, "preset": preset, "head_size": head_size, "num_kv_heads": num_kv_heads,
        "block_size": block_size, "key_format": lay["key_format"], "value_format": lay["value_format"],
        "key_payload_bytes": lay["key_payload_bytes"], "key_payload_stride": k_stride,
        "key_meta_bytes": lay["key_meta_bytes"], "value_payload_bytes": lay["value_payload_bytes"],
        "value_payload_stride": v_stride, "value_meta_bytes": lay["value_meta_bytes"],
        "slot_bytes_per_head": slot, "bytes_per_block": slot * num_kv_heads * block_size,
        "dense_fp16_bytes_per_block": 2 * 2 * head_size * num_kv_heads * block_size,
    }


def layer_formats(cache_dtype: str, config: Optional[KVQuantConfig],
                  num_layers: int) -> Tuple[str, KVQuantConfig, Dict[int, str]]:
    """(preset, config with that preset, {layer: preset}) for a vLLM cache dtype:
    the dtype names the preset, `config` (default KVQuantConfig()) the per-layer rule."""
    preset = resolve_cache_dtype(cache_dtype)
    config = KVQuantConfig(**{**(config or KVQuantConfig()).__dict__, "preset": preset})
    return preset, config, policy_from_config(config, num_layers)
