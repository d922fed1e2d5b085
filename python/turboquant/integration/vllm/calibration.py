"""Activation calibration: channel energy (sum of x^2 over tokens) of the
keys and values written to the cache, over prompts whose SHA-256 is recorded,
choosing each layer's and KV head's high-precision channels for the split
recipes. ``calibration_metadata`` (hooks) does the same from what the
``capture_only`` hook mode recorded. ``channel_means``: per-layer centering
means of the keys and values, for ``PagedCompressedKVCache(means=...)`` and
the device cache."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .metadata import build_metadata, prompts_sha256
from .registry import SPLIT_RECIPES, is_split_recipe, resolve_cache_dtype


def channel_energy(x: "torch.Tensor") -> "torch.Tensor":
    """Sum of x_j^2 over tokens: x [tokens, num_kv_heads, head_size] -> float64 [num_kv_heads, head_size]."""
    if x.dim() != 3:
        raise ValueError(f"activations must be [tokens, num_kv_heads, head_size], got {tuple(x.shape)}")
    x = x.detach().to("cpu", torch.float64)
    return (x * x).sum(0)


def top_channels(energy: "torch.Tensor", count: int) -> List[List[int]]:
    """Per head, the `count` channels of largest energy, ascending (ties: lower
    index first), the rule of tq::ChooseOutlierChannels."""
    out = []
    for row in energy.tolist():
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))
        out.append(sorted(order[:count]))
    return out


def calibrate(recipe: str, activations: Iterable[Tuple[int, "torch.Tensor", "torch.Tensor"]],
              prompts: Sequence[Any], *, num_layers: int, num_kv_heads: int, head_size: int,
              seed: int = 0) -> Dict[str, Any]:
    """Recipe metadata from activations: ``activations`` yields (layer, keys,
    values) with keys/values [tokens, num_kv_heads, head_size] (as written to
    the cache, after RoPE), captured while running ``prompts``. Each layer's
    and head's high-precision channels are those of largest energy."""
    preset = resolve_cache_dtype(recipe)
    if not is_split_recipe(preset):
        raise ValueError(f"calibration chooses high-precision channels: recipe must be one of {SPLIT_RECIPES}")
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    ek = [torch.zeros(num_kv_heads, head_size, dtype=torch.float64) for _ in range(num_layers)]
    ev = [torch.zeros(num_kv_heads, head_size, dtype=torch.float64) for _ in range(num_layers)]
    tokens = [0] * num_layers
    for layer, k, v in activations:
        if not 0 <= layer < num_layers:
            raise ValueError(f"activation layer {layer} outside [0, {num_layers})")
        ek[layer] += channel_energy(k)
        ev[layer] += channel_energy(v)
        tokens[layer] += k.shape[0]
    if min(tokens) == 0:
        raise ValueError(f"no activations for layer {tokens.index(0)}")
    return metadata_from_energy(recipe, ek, ev, head_size=head_size, num_layers=num_layers,
                                num_kv_heads=num_kv_heads, prompts=prompts, num_tokens=tokens[0], seed=seed)


def metadata_from_energy(recipe: str, energy_k: Sequence["torch.Tensor"], energy_v: Sequence["torch.Tensor"], *,
                         head_size: int, num_layers: int, num_kv_heads: int, prompts: Sequence[Any],
                         num_tokens: int, seed: int) -> Dict[str, Any]:
    """Recipe metadata whose high-precision channels are, per layer and KV
    head, the head_size/4 of largest energy (energy_k[layer], energy_v[layer]:
    [num_kv_heads, head_size]), with a channel_energy calibration record."""
    count = head_size // 4
    record = {"method": "channel_energy", "statistic": "sum of x^2 over tokens per (layer, kv head, channel)",
              "num_prompts": len(prompts), "num_tokens": num_tokens, "prompts_sha256": prompts_sha256(prompts)}
    return build_metadata(recipe, head_size, num_layers, num_kv_heads,
                          key_channels=[top_channels(e, count) for e in energy_k],
                          value_channels=[top_channels(e, count) for e in energy_v], calibration=record, seed=seed)


def channel_means(activations: Iterable[Tuple[int, "torch.Tensor", "torch.Tensor"]], *, center_keys: bool = True,
                  center_values: bool = False) -> Dict[int, Tuple[Optional["torch.Tensor"], Optional["torch.Tensor"]]]:
    """Centering means from activations (layer, keys, values), keys/values
    [tokens, num_kv_heads, head_size]: per layer (key_mean, value_mean),
    float32 [num_kv_heads, head_size] (sums in double over every token, then
    divided), None for a component not centred."""
    sums: Dict[int, List[Any]] = {}
    for layer, k, v in activations:
        if k.dim() != 3 or k.shape != v.shape:
            raise ValueError(f"activations must be [tokens, num_kv_heads, head_size] each, got {tuple(k.shape)} / "
                             f"{tuple(v.shape)}")
        k64, v64 = (x.detach().to("cpu", torch.float64) for x in (k, v))
        acc = sums.setdefault(layer, [0, 0, 0])
        acc[0] = acc[0] + k64.sum(0)
        acc[1] = acc[1] + v64.sum(0)
        acc[2] += k.shape[0]
    if not sums:
        raise ValueError("channel_means needs activations")
    out = {}
    for layer, (sk, sv, n) in sums.items():
        if n == 0:
            raise ValueError(f"layer {layer}: no tokens")
        out[layer] = ((sk / n).to(torch.float32) if center_keys else None,
                      (sv / n).to(torch.float32) if center_values else None)
    return out
