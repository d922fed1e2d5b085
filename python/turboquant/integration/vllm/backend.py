"""An attention backend shaped like vLLM v1's (``vllm.v1.attention.backend``:
``AttentionBackend``, ``AttentionImpl``) over ``DevicePagedCompressedKVCache``.

With vLLM installed the classes subclass vLLM's own (``vllm_bases``) and
inherit its defaults; either way they carry the attributes and static
methods vLLM's backend selector and model runner read (``get_name``,
``get_impl_cls``, ``get_builder_cls``, ``supported_dtypes``,
``supported_kv_cache_dtypes``, ``get_supported_kernel_block_sizes``,
``forward_includes_kv_cache_update`` = False: vLLM calls
``do_kv_cache_update`` before ``forward``; ``accept_output_buffer``), and the
impl takes vLLM's constructor and call signatures. The compressed pages are
the device cache's own tensors, not the ``kv_cache`` tensor vLLM allocates,
which this impl never reads: ``attach(store, layer_index)`` binds each impl to
its layer of a device cache before the first call (``plugin`` says how this
is registered with vLLM).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from ..common import IntegrationError
from .batch import TurboQuantMetadataBuilder
from .registry import UPSTREAM_CACHE_DTYPES, cache_dtype_names
from .vllm_bases import AttentionBackend, AttentionImpl


class TurboQuantDeviceImpl(AttentionImpl):
    """vLLM's ``AttentionImpl`` signatures over one layer of a
    ``DevicePagedCompressedKVCache`` (``attach`` binds it)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[List[float]] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "tq4", logits_soft_cap: Optional[float] = None, attn_type: str = "decoder",
                 kv_sharing_target_layer_name: Optional[str] = None, **kwargs: Any):
        if alibi_slopes is not None:
            raise IntegrationError("ALiBi slopes are not supported by the turboquant backend")
        if str(attn_type).lower() != "decoder":
            raise IntegrationError(f"attn_type {attn_type!r}: the turboquant backend serves decoder attention only")
        if kv_sharing_target_layer_name is not None:
            raise IntegrationError("KV sharing between layers is not supported by the turboquant backend")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.window = int(sliding_window or 0)
        self.softcap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.store = None
        self.layer_index = -1

    def attach(self, store, layer_index: int) -> "TurboQuantDeviceImpl":
        if (store.num_q_heads, store.num_kv_heads, store.head_size) != (self.num_heads, self.num_kv_heads,
                                                                         self.head_size):
            raise IntegrationError(f"attach: the store has {store.num_q_heads}/{store.num_kv_heads} heads of "
                                   f"{store.head_size}, this layer {self.num_heads}/{self.num_kv_heads} of "
                                   f"{self.head_size}")
        if not 0 <= layer_index < store.num_layers:
            raise IntegrationError(f"attach: layer_index {layer_index} outside [0, {store.num_layers})")
        self.store, self.layer_index = store, int(layer_index)
        return self

    def _store(self):
        if self.store is None:
            raise IntegrationError("turboquant impl not attached to a device cache: call attach(store, layer_index)")
        return self.store

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self._store().reshape_and_cache(self.layer_index, key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None, **kwargs):
        if output_scale is not None or output_block_scale is not None:
            raise IntegrationError("fused output quantization (output_scale) is not supported by the turboquant "
                                   "backend")
        store = self._store()
        if attn_metadata is None:  # vLLM's profiling run
            return output.zero_() if output is not None else torch.zeros_like(query)
        return store.attention(self.layer_index, query, attn_metadata, out=output, scale=self.scale,
                               window=self.window, softcap=self.softcap)


class TurboQuantBackend(AttentionBackend):
    """vLLM ``AttentionBackend`` shape (class attributes and static methods)."""

    accept_output_buffer = True
    forward_includes_kv_cache_update = False
    supported_dtypes = [torch.float16, torch.bfloat16]
    # vLLM's config accepts its own upstream names; the others need
    # registering as custom cache dtypes with vLLM first.
    supported_kv_cache_dtypes = list(cache_dtype_names())
    upstream_kv_cache_dtypes = list(UPSTREAM_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return TurboQuantDeviceImpl

    @staticmethod
    def get_builder_cls():
        return TurboQuantMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> List[int]:
        return [16, 32, 64, 128]

    @classmethod
    def get_supported_head_sizes(cls) -> List[int]:
        return [64, 128, 256]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in cls.get_supported_head_sizes()

    @classmethod
    def supports_dtype(cls, dtype: "torch.dtype") -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Optional[str]) -> bool:
        return kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def full_cls_name(cls):
        return (cls.__module__, cls.__qualname__)
