"""The attention side of vLLM v1 as this layer sees it: the fields of the
attention metadata it reads, and an attention impl with vLLM's signatures
(``do_kv_cache_update``, ``forward``) over one layer of a
``PagedCompressedKVCache``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cache import PagedCompressedKVCache


@dataclass
class AttentionMetadata:
    """The fields of vLLM v1's attention metadata that we read (same names).

    The last three are host integers the device path needs (vLLM's
    FlashAttention and TurboQuant metadata carry them, computed when the
    metadata is built, from host copies): ``max_seq_len`` an upper bound of
    seq_lens, and the leading ``num_decodes`` sequences of the batch, which
    bring one query token each (``num_decode_tokens`` == ``num_decodes``),
    as ``batch.TurboQuantMetadataBuilder`` sets them. The CPU path ignores
    them."""

    num_actual_tokens: int
    query_start_loc: "torch.Tensor"  # int32 [batch + 1]
    seq_lens: "torch.Tensor"         # int32 [batch]: context + new tokens
    block_table: "torch.Tensor"      # int32 [batch, max_blocks]
    slot_mapping: "torch.Tensor"     # int64 [num_tokens]
    max_query_len: int = 0
    max_seq_len: int = 0
    num_decodes: int = 0
    num_decode_tokens: int = 0


class TurboQuantAttentionImpl:
    """An attention impl with vLLM's v1 signatures (``do_kv_cache_update``,
    ``forward``) over one layer of a PagedCompressedKVCache."""

    def __init__(self, store: PagedCompressedKVCache, layer: int, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int, *, prefill: str = "compressed"):
        self.store, self.layer_index = store, layer
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
        self.prefill = prefill

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.store.reshape_and_cache(self.layer_index, key.view(-1, self.num_kv_heads, self.head_size),
                                     value.view(-1, self.num_kv_heads, self.head_size), slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **kwargs):
        q = query.view(-1, self.num_heads, self.head_size)
        k = None if key is None else key.view(-1, self.num_kv_heads, self.head_size)
        v = None if value is None else value.view(-1, self.num_kv_heads, self.head_size)
        res = self.store.attention(self.layer_index, q, attn_metadata, scale=self.scale, key=k, value=v,
                                   prefill=self.prefill)
        if output is None:
            output = torch.zeros(q.shape, dtype=query.dtype)
        output.view(-1, self.num_heads, self.head_size)[: res.shape[0]] = res.to(output.dtype)
        return output
