"""Mixed batches in vLLM v1's metadata vocabulary: the split of a batch into
its leading decode rows and the rest, and a metadata builder shaped like
vLLM's ``AttentionMetadataBuilder`` (``build(common_prefix_len,
common_attn_metadata)``) that does the split on host copies, so the
attention call itself never reads the device.

vLLM's model runner reorders a batch so that sequences whose query length is
at most the builder's ``reorder_batch_threshold`` come first (1 here: decode
rows), then the chunks of prefills and speculative verifications; the split
is the count of leading one-token sequences."""
from __future__ import annotations

from typing import Any, Sequence, Tuple, Union

import torch

from .attention import AttentionMetadata
from .vllm_bases import AttentionMetadataBuilder


def split_decodes(query_start_loc_cpu: Union["torch.Tensor", Sequence[int]]) -> Tuple[int, int]:
    """(num_decodes, num_decode_tokens): the leading sequences of the batch
    that bring exactly one query token. query_start_loc_cpu: [batch + 1]
    cumulative query starts on the host (a CPU tensor or a sequence). A
    one-token sequence after a longer one is left to the extend rows (correct
    there, only slower)."""
    if torch.is_tensor(query_start_loc_cpu):
        if query_start_loc_cpu.device.type != "cpu":
            raise ValueError("split_decodes needs the host copy of query_start_loc (vLLM's query_start_loc_cpu), "
                             f"got a tensor on {query_start_loc_cpu.device}")
        starts = [int(x) for x in query_start_loc_cpu.tolist()]
    else:
        starts = [int(x) for x in query_start_loc_cpu]
    if len(starts) < 1 or starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"query_start_loc must start at 0 and never decrease, got {starts[:8]}...")
    n = 0
    while n + 1 < len(starts) and starts[n + 1] - starts[n] == 1:
        n += 1
    return n, n


class TurboQuantMetadataBuilder(AttentionMetadataBuilder):
    """Builds ``AttentionMetadata`` from vLLM's ``CommonAttentionMetadata``
    (attributes ``query_start_loc``, ``query_start_loc_cpu``, ``seq_lens``,
    ``num_actual_tokens``, ``max_query_len``, ``max_seq_len``,
    ``block_table_tensor``, ``slot_mapping``). The constructor takes vLLM's
    builder arguments (kv_cache_spec, layer_names, vllm_config, device) and
    keeps them; ``reorder_batch_threshold`` = 1 asks vLLM's runner to put the
    decode rows first."""

    reorder_batch_threshold = 1

    def __init__(self, kv_cache_spec: Any = None, layer_names: Any = None, vllm_config: Any = None,
                 device: Any = None):
        self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (kv_cache_spec, layer_names,
                                                                             vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> AttentionMetadata:
        if common_prefix_len:
            raise ValueError(f"common_prefix_len must be 0 (cascade attention is not supported), got "
                             f"{common_prefix_len}")
        cam = common_attn_metadata
        nd, ndt = split_decodes(cam.query_start_loc_cpu)
        return AttentionMetadata(num_actual_tokens=int(cam.num_actual_tokens), query_start_loc=cam.query_start_loc,
                                 seq_lens=cam.seq_lens, block_table=cam.block_table_tensor,
                                 slot_mapping=cam.slot_mapping, max_query_len=int(cam.max_query_len),
                                 max_seq_len=int(cam.max_seq_len), num_decodes=nd, num_decode_tokens=ndt)

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> AttentionMetadata:
        return self.build(0, common_attn_metadata)
