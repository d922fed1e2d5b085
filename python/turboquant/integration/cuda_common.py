"""Pieces shared by the integrations' CUDA routes (the HF route in
``hf_cuda`` and the vLLM-compatible device cache in ``vllm.device``): the
backend check, the per-layer preset check against the GPU kernels, and the
16-byte row alignment the kernels take."""
from __future__ import annotations

from typing import Dict, Iterable, Mapping

import torch

from .common import IntegrationError


def aligned(t: "torch.Tensor") -> "torch.Tensor":
    """The GPU kernels take 16-byte aligned rows: a view at an odd offset is copied."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def require_cuda() -> None:
    """Raises IntegrationError (with the reason) unless the CUDA backend is
    built into this package and a device is usable."""
    from .. import cuda as tqcuda

    try:
        tqcuda.require()
    except tqcuda.CudaUnavailableError as e:
        raise IntegrationError(str(e)) from e


def gqa_ratio(num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head; ValueError unless num_q_heads is a multiple of num_kv_heads."""
    if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a positive multiple of num_kv_heads {num_kv_heads}")
    return num_q_heads // num_kv_heads


def check_cuda_presets(layer_presets: Mapping[int, str], head_dim: int, block_size: int, gqa: int) -> None:
    """IntegrationError naming the first layer whose preset the GPU kernels do
    not handle at this geometry, with the kernels' reason (which lists what is
    supported)."""
    from .. import cuda as tqcuda

    for layer, preset in layer_presets.items():
        why = tqcuda.unsupported_reason(preset, head_dim, block_size=block_size, gqa_ratio=gqa)
        if why is not None:
            raise IntegrationError(
                f"layer {layer}: preset '{preset}' (head_dim {head_dim}, block_size {block_size}, GQA "
                f"{gqa}) is not supported by the CUDA backend: {why}")


# The write kernel's row counters that HF and vLLM callers sum over layers.
WRITE_ERROR_KEYS = ("out_of_range_slots", "non_finite_inputs", "scale_overflows")


def sum_write_errors(layers: Iterable) -> Dict[str, int]:
    """Synchronizes; rows the write kernel skipped since the last call, summed over `layers`."""
    tot = dict.fromkeys(WRITE_ERROR_KEYS, 0)
    for dev in layers:
        e = dev.take_errors()
        for k in tot:
            tot[k] += e[k]
    return tot
