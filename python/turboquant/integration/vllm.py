"""vLLM-compatible layer over our C++ ``PagedKVCache`` (CPU, torch tensors).

What is here (docs/PYTHON.md, "vLLM-compatible layer"; the recipe metadata
schema is docs/FORMAT.md, "KV recipe metadata"):

* cache-dtype registry: ``tq2``/``tq3``/``tq4``, ``k{K}v{V}``, ``turboquant25``/
  ``turboquant35`` and vLLM's upstream names (``turboquant_k8v4``,
  ``turboquant_4bit_nc``, ``turboquant_k3v4_nc``, ``turboquant_3bit_nc``) mapped
  to our presets; ``page_geometry``;
* recipe metadata JSON: build, validate (errors name the field and the
  accepted values), save/load, discovery next to a local model directory,
  tensor-parallel slicing (per-rank KV-head slices);
* activation calibration (channel energy over prompts, with the prompts'
  SHA-256) choosing each layer's and KV head's high-precision channels;
* ``PagedCompressedKVCache``: ``reshape_and_cache`` (writes by
  ``slot_mapping``), paged decode (``block_tables``/``seq_lens``) and a
  runtime dispatch for vLLM-style batches (decode, prefill, chunked prefill);
  it never densifies history and raises where it would have to;
* ``verify`` (also ``python3 -m turboquant.integration.vllm verify``);
* hooks: ``install_hooks(runner, mode)`` with modes ``off``, ``capture_only``,
  ``hybrid``, ``full_tq`` on a model runner shaped like vLLM's
  (``compilation_config.static_forward_context``, ``impl.forward``,
  ``impl.do_kv_cache_update``, ``kv_caches``), ``free_kv_cache``, ``get_stats``.

vLLM itself is not imported or required: everything is tested against
runner/impl objects with vLLM's attribute names and call signatures built in
the tests, not against vLLM.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .. import _core
from .common import (
    IntegrationError,
    KVQuantConfig,
    OptionalDependencyError,
    ProductionModeError,
    policy_from_config,
)

try:
    import torch
except ImportError as e:  # pragma: no cover
    raise OptionalDependencyError(
        "turboquant.integration.vllm needs torch (./scripts/install-python-deps.sh): " + str(e)) from e

__all__ = [
    "METADATA_FILENAME", "METADATA_VERSION", "MODES", "MetadataError", "PagedCompressedKVCache",
    "TurboQuantAttentionImpl", "UPSTREAM_CACHE_DTYPES", "build_metadata", "cache_dtype_names", "calibrate",
    "channel_energy", "discover_metadata", "free_kv_cache", "get_stats", "install_hooks", "load_metadata",
    "page_geometry", "prompts_sha256", "resolve_cache_dtype", "save_metadata", "slice_metadata_for_tp",
    "uninstall_hooks", "validate_metadata", "verify",
]

# ---------------------------------------------------------------------------
# cache-dtype registry

UPSTREAM_CACHE_DTYPES = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
_SPLIT_RECIPES = ("turboquant25", "turboquant35")
_BITS = (16, 8, 4, 3, 2)


def _registry() -> Dict[str, str]:
    reg = {"tq2": "k2_v2", "tq3": "k3_v3", "tq4": "k4_v4"}
    for k in _BITS:
        for v in _BITS:
            reg[f"k{k}v{v}"] = f"k{k}_v{v}"
    for r in _SPLIT_RECIPES + UPSTREAM_CACHE_DTYPES:
        reg[r] = r
    return reg


_CACHE_DTYPES = _registry()


def cache_dtype_names() -> List[str]:
    """Every accepted kv_cache_dtype string."""
    return list(_CACHE_DTYPES)


def resolve_cache_dtype(name: str) -> str:
    """vLLM ``kv_cache_dtype`` string -> our preset name. Unknown names raise
    ValueError listing the accepted ones (vLLM's own dtypes such as "auto" or
    "fp8" are not ours)."""
    if not isinstance(name, str) or name not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not a turboquant cache dtype; accepted: "
                         + ", ".join(_CACHE_DTYPES))
    return _CACHE_DTYPES[name]


def _is_split(preset: str) -> bool:
    return preset in _SPLIT_RECIPES


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


# ---------------------------------------------------------------------------
# recipe metadata

METADATA_FORMAT = "turboquant-kv-recipe"
METADATA_VERSION = 1
METADATA_FILENAME = "turboquant_kv_recipe.json"
TRANSFORMS = {"block_hadamard": (1,)}
CODEBOOKS = {"lloyd_max_sphere": (1,)}


class MetadataError(ValueError):
    """Malformed recipe metadata; the message names the field and what is accepted."""


def prompts_sha256(prompts: Sequence[Any]) -> str:
    """SHA-256 (hex) of the prompts as canonical JSON (strings or token-id lists)."""
    norm = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    return hashlib.sha256(json.dumps(norm, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()


def _fail(path: str, msg: str):
    raise MetadataError(f"recipe metadata: field '{path}' {msg}")


def _check_int(obj, key, path, lo=None, accepted=None):
    if key not in obj:
        _fail(path, "is missing" + (f"; accepted: {list(accepted)}" if accepted else ""))
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(path, f"must be an integer, got {type(v).__name__} {v!r}")
    if accepted is not None and v not in accepted:
        _fail(path, f"is {v}; accepted: {list(accepted)}")
    if lo is not None and v < lo:
        _fail(path, f"must be >= {lo}, got {v}")
    return v


def _check_channels(lst, path, head_size, count):
    if not isinstance(lst, list):
        _fail(path, f"must be a list of channel indices, got {type(lst).__name__}")
    for i, c in enumerate(lst):
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < head_size:
            _fail(f"{path}[{i}]", f"must be an integer channel in [0, {head_size}), got {c!r}")
        if i and c <= lst[i - 1]:
            _fail(path, "must be strictly ascending (no duplicates)")
    if len(lst) != count:
        _fail(path, f"has {len(lst)} channels; the recipe needs exactly {count} (head_size / 4)"
              if count else f"has {len(lst)} channels; this recipe has no high-precision group: accepted: []")


def validate_metadata(meta: Any) -> Dict[str, Any]:
    """Checks recipe metadata; returns it. Raises MetadataError (a ValueError)
    naming the first bad field and its accepted values."""
    if not isinstance(meta, dict):
        raise MetadataError(f"recipe metadata must be a JSON object, got {type(meta).__name__}")
    if meta.get("format") != METADATA_FORMAT:
        _fail("format", f"is {meta.get('format')!r}; accepted: {METADATA_FORMAT!r}")
    _check_int(meta, "version", "version", accepted=(METADATA_VERSION,))
    recipe = meta.get("recipe")
    if recipe not in _CACHE_DTYPES:
        _fail("recipe", f"is {recipe!r}; accepted: {', '.join(_CACHE_DTYPES)}")
    preset = _CACHE_DTYPES[recipe]
    head_size = _check_int(meta, "head_size", "head_size", lo=1)
    if _is_split(preset) and (head_size % 4 or head_size < 8):
        _fail("head_size", f"is {head_size}; recipe {recipe} needs a multiple of 4, >= 8")
    num_layers = _check_int(meta, "num_layers", "num_layers", lo=1)
    num_kv_heads = _check_int(meta, "num_kv_heads", "num_kv_heads", lo=1)
    for name, table in (("transform", TRANSFORMS), ("codebook", CODEBOOKS)):
        sub = meta.get(name)
        if not isinstance(sub, dict):
            _fail(name, f"must be an object {{'kind', 'version'}}, got {sub!r}")
        if sub.get("kind") not in table:
            _fail(f"{name}.kind", f"is {sub.get('kind')!r}; accepted: {list(table)}")
        _check_int(sub, "version", f"{name}.version", accepted=table[sub["kind"]])
    if "seed" in meta.get("transform", {}):
        _check_int(meta["transform"], "seed", "transform.seed", lo=0)
    layers = meta.get("layers")
    if not isinstance(layers, list) or len(layers) != num_layers:
        _fail("layers", f"must be a list of num_layers = {num_layers} objects, got "
              f"{len(layers) if isinstance(layers, list) else type(layers).__name__}")
    count = head_size // 4 if _is_split(preset) else 0
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            _fail(f"layers[{i}]", "must be an object")
        _check_int(layer, "layer", f"layers[{i}].layer", accepted=(i,))
        for comp in ("key_high_precision_channels", "value_high_precision_channels"):
            per_head = layer.get(comp)
            if not isinstance(per_head, list) or len(per_head) != num_kv_heads:
                _fail(f"layers[{i}].{comp}", f"must be a list of num_kv_heads = {num_kv_heads} channel lists")
            for h, lst in enumerate(per_head):
                _check_channels(lst, f"layers[{i}].{comp}[{h}]", head_size, count)
    cal = meta.get("calibration")
    if cal is not None:
        if not isinstance(cal, dict):
            _fail("calibration", "must be an object or null")
        if cal.get("method") not in ("channel_energy", "default"):
            _fail("calibration.method", f"is {cal.get('method')!r}; accepted: ['channel_energy', 'default']")
        sha = cal.get("prompts_sha256")
        if cal["method"] == "channel_energy":
            if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
                _fail("calibration.prompts_sha256", f"must be 64 lowercase hex digits, got {sha!r}")
            _check_int(cal, "num_prompts", "calibration.num_prompts", lo=1)
            _check_int(cal, "num_tokens", "calibration.num_tokens", lo=1)
    tp = meta.get("tensor_parallel")
    if tp is not None:
        size = _check_int(tp, "size", "tensor_parallel.size", lo=1)
        rank = _check_int(tp, "rank", "tensor_parallel.rank", lo=0)
        if rank >= size:
            _fail("tensor_parallel.rank", f"is {rank}; accepted: 0..{size - 1}")
        heads = tp.get("kv_heads")
        if not (isinstance(heads, list) and len(heads) == num_kv_heads and all(isinstance(x, int) for x in heads)):
            _fail("tensor_parallel.kv_heads", f"must list the {num_kv_heads} global KV-head indices of this rank")
    return meta


def build_metadata(recipe: str, head_size: int, num_layers: int, num_kv_heads: int, *,
                   key_channels: Optional[Sequence[Sequence[Sequence[int]]]] = None,
                   value_channels: Optional[Sequence[Sequence[Sequence[int]]]] = None,
                   calibration: Optional[Dict[str, Any]] = None, seed: int = 0) -> Dict[str, Any]:
    """Recipe metadata; channels[layer][kv_head] = ascending channel indices.
    Split recipes without channels get the library default [0, head_size/4)."""
    preset = resolve_cache_dtype(recipe)
    count = head_size // 4 if _is_split(preset) else 0

    def chans(given, layer):
        if given is not None:
            return [sorted(int(c) for c in h) for h in given[layer]]
        return [list(range(count)) for _ in range(num_kv_heads)]

    meta = {
        "format": METADATA_FORMAT, "version": METADATA_VERSION, "recipe": recipe, "head_size": head_size,
        "num_layers": num_layers, "num_kv_heads": num_kv_heads,
        "transform": {"kind": "block_hadamard", "version": 1, "seed": seed},
        "codebook": {"kind": "lloyd_max_sphere", "version": 1},
        "layers": [{"layer": i, "key_high_precision_channels": chans(key_channels, i),
                    "value_high_precision_channels": chans(value_channels, i)} for i in range(num_layers)],
        "calibration": calibration if calibration is not None else {"method": "default"},
    }
    return validate_metadata(meta)


def save_metadata(meta: Dict[str, Any], path: str) -> None:
    """Validates, then writes atomically (temp file, fsync, rename)."""
    validate_metadata(meta)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tq-recipe-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_metadata(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise MetadataError(f"recipe metadata {path}: not valid JSON ({e})") from e
    return validate_metadata(meta)


def discover_metadata(model_dir: str) -> Optional[Dict[str, Any]]:
    """Loads ``<model_dir>/turboquant_kv_recipe.json`` when present (None when
    absent); a malformed file raises MetadataError."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir!r} does not exist")
    path = os.path.join(model_dir, METADATA_FILENAME)
    return load_metadata(path) if os.path.exists(path) else None


def tp_kv_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> List[int]:
    """Global KV heads held by one rank, as vLLM shards them: contiguous
    slices when tp_size divides the heads, replicated heads when the heads
    divide tp_size."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, tp_size) with tp_size >= 1, got rank {tp_rank}, size {tp_size}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"num_kv_heads {total_kv_heads} is not divisible by tp_size {tp_size}")
        per = total_kv_heads // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % total_kv_heads:
        raise ValueError(f"tp_size {tp_size} is not a multiple of num_kv_heads {total_kv_heads}")
    return [tp_rank * total_kv_heads // tp_size]


def slice_metadata_for_tp(meta: Dict[str, Any], tp_size: int, tp_rank: int) -> Dict[str, Any]:
    """The metadata one tensor-parallel rank needs: its KV heads' channel
    lists, num_kv_heads of the rank, and a ``tensor_parallel`` record."""
    validate_metadata(meta)
    if meta.get("tensor_parallel"):
        raise ValueError("metadata is already sliced for tensor parallelism")
    heads = tp_kv_heads(meta["num_kv_heads"], tp_size, tp_rank)
    out = json.loads(json.dumps(meta))
    out["num_kv_heads"] = len(heads)
    for layer in out["layers"]:
        for comp in ("key_high_precision_channels", "value_high_precision_channels"):
            layer[comp] = [layer[comp][h] for h in heads]
    out["tensor_parallel"] = {"size": tp_size, "rank": tp_rank, "kv_heads": heads}
    return validate_metadata(out)


# ---------------------------------------------------------------------------
# calibration


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
    if not _is_split(preset):
        raise ValueError(f"calibration chooses high-precision channels: recipe must be one of {_SPLIT_RECIPES}")
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
    count = head_size // 4
    record = {"method": "channel_energy", "statistic": "sum of x^2 over tokens per (layer, kv head, channel)",
              "num_prompts": len(prompts), "num_tokens": tokens[0], "prompts_sha256": prompts_sha256(prompts)}
    return build_metadata(recipe, head_size, num_layers, num_kv_heads,
                          key_channels=[top_channels(e, count) for e in ek],
                          value_channels=[top_channels(e, count) for e in ev], calibration=record, seed=seed)


# ---------------------------------------------------------------------------
# paged cache


def _f32(t, what: str) -> "torch.Tensor":
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.device.type != "cpu":
        raise IntegrationError(f"{what} is on {t.device}: the turboquant package has no CUDA backend")
    if not t.is_floating_point():
        raise ValueError(f"{what}: must be a floating-point tensor, got {t.dtype}")
    return t.detach().to(torch.float32).contiguous()


def _ints(t, dtype, what: str) -> "torch.Tensor":
    t = torch.as_tensor(t)
    if t.device.type != "cpu":
        raise IntegrationError(f"{what} is on {t.device}: the turboquant package has no CUDA backend")
    if t.is_floating_point():
        raise ValueError(f"{what}: must be an integer tensor, got {t.dtype}")
    return t.to(dtype).contiguous()


@dataclass
class AttentionMetadata:
    """The fields of vLLM v1's attention metadata that we read (same names)."""

    num_actual_tokens: int
    query_start_loc: "torch.Tensor"  # int32 [batch + 1]
    seq_lens: "torch.Tensor"         # int32 [batch]: context + new tokens
    block_table: "torch.Tensor"      # int32 [batch, max_blocks]
    slot_mapping: "torch.Tensor"     # int64 [num_tokens]
    max_query_len: int = 0


@dataclass
class PathCounters:
    decode_rows: int = 0        # (sequence) rows served by compressed paged decode
    prefill_rows: int = 0       # query tokens of prefills served from the compressed pages
    chunked_rows: int = 0       # query tokens of chunked prefills (context > 0) from the compressed pages
    dense_fresh_rows: int = 0   # prefill tokens served by dense attention over this step's own K/V
    tokens_written: int = 0
    calls: int = 0


class PagedCompressedKVCache:
    """Paged compressed K/V for every attention layer (seed name), on our
    ``PagedKVCache``. Pages and slots are the caller's (vLLM's) block ids: any
    block table and slot mapping over ``num_blocks`` pages of ``block_size``.

    With recipe metadata for a split recipe (turboquant25/35), each layer's
    and KV head's calibrated high-precision channels are moved to the front
    by a fixed channel permutation before encoding (the library's split codec
    keeps channels [0, head_size/4) at the higher width); queries get the same
    permutation and outputs the inverse, so attention is unchanged.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, *, num_blocks: int,
                 block_size: int = 16, cache_dtype: str = "tq4", config: Optional[KVQuantConfig] = None,
                 metadata: Optional[Dict[str, Any]] = None, threads: int = 1):
        preset = resolve_cache_dtype(cache_dtype)
        config = config or KVQuantConfig()
        config = KVQuantConfig(**{**config.__dict__, "preset": preset})
        self.layer_presets = policy_from_config(config, num_layers)
        self.cache_dtype, self.preset, self.config = cache_dtype, preset, config
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.block_size, self.num_blocks, self.threads = block_size, num_blocks, threads
        self._perm: Dict[int, Tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"]] = {}
        self.metadata = None
        if metadata is not None:
            self._apply_metadata(validate_metadata(metadata))
        self._core = _core.PagedKVCache(num_layers, num_kv_heads, head_size, num_blocks=num_blocks,
                                        block_size=block_size, preset=preset, seed=config.seed,
                                        layer_presets=dict(self.layer_presets))
        self.counters = PathCounters()

    def _apply_metadata(self, meta):
        for field_, want in (("head_size", self.head_size), ("num_layers", self.num_layers),
                             ("num_kv_heads", self.num_kv_heads)):
            if meta[field_] != want:
                raise MetadataError(f"recipe metadata: field '{field_}' is {meta[field_]}, the model has {want}")
        if resolve_cache_dtype(meta["recipe"]) != self.preset:
            raise MetadataError(f"recipe metadata: field 'recipe' is {meta['recipe']!r}, the cache dtype is "
                                f"{self.cache_dtype!r} (preset {self.preset})")
        if meta["transform"].get("seed", 0) != self.config.seed:
            raise MetadataError(f"recipe metadata: field 'transform.seed' is {meta['transform'].get('seed', 0)}, "
                                f"the cache uses seed {self.config.seed}")
        self.metadata = meta
        if not _is_split(self.preset):
            return
        d = self.head_size
        for layer in meta["layers"]:
            if self.layer_presets[layer["layer"]] != self.preset:
                continue  # boundary / override layers do not use the split recipe
            perms = []
            for comp in ("key_high_precision_channels", "value_high_precision_channels"):
                p = torch.tensor([hi + [c for c in range(d) if c not in set(hi)] for hi in layer[comp]],
                                 dtype=torch.long)
                perms += [p, torch.argsort(p, dim=1)]
            if any(not torch.equal(p, torch.arange(d).expand_as(p)) for p in perms[::2]):
                self._perm[layer["layer"]] = tuple(perms)

    # -- internals --
    @property
    def core(self):
        return self._core

    def _permute(self, x, layer, which):
        """x [..., num_kv_heads or num_q_heads, head_size]; which: 0 key-fwd, 2 value-fwd, 3 value-inverse."""
        perms = self._perm.get(layer)
        if perms is None:
            return x
        p = perms[which]
        h = x.shape[-2]
        if h != p.shape[0]:  # query heads: head g uses KV head g // group
            p = p.repeat_interleave(h // p.shape[0], dim=0)
        return torch.gather(x, -1, p.expand(x.shape))

    # -- vLLM-style ops --
    def reshape_and_cache(self, layer: int, key, value, slot_mapping) -> None:
        """key, value: [num_tokens, num_kv_heads, head_size] (any float dtype);
        slot_mapping: int64 [num_tokens]; slot < 0 = padding, skipped."""
        k, v = _f32(key, "key"), _f32(value, "value")
        slots = _ints(slot_mapping, torch.int64, "slot_mapping")
        if k.dim() != 3 or k.shape[1:] != (self.num_kv_heads, self.head_size) or k.shape != v.shape:
            raise ValueError(f"key/value must be [num_tokens, {self.num_kv_heads}, {self.head_size}], got "
                             f"{tuple(k.shape)} / {tuple(v.shape)}")
        if slots.dim() != 1 or slots.shape[0] > k.shape[0]:
            raise ValueError(f"slot_mapping must be 1-D with at most num_tokens = {k.shape[0]} entries, got "
                             f"{tuple(slots.shape)}")
        n = slots.shape[0]  # vLLM pads key/value beyond the slot mapping's tokens
        k = self._permute(k[:n], layer, 0).contiguous()
        v = self._permute(v[:n], layer, 2).contiguous()
        self._core.write_slots(layer, k, v, slots)
        self.counters.tokens_written += int((slots >= 0).sum())

    def paged_decode(self, layer: int, query, block_tables, seq_lens, *, scale: Optional[float] = None,
                     out_dtype=None) -> "torch.Tensor":
        """query [rows, num_q_heads, head_size]; block_tables int32 [rows,
        max_blocks]; seq_lens int32 [rows] -> [rows, num_q_heads, head_size].
        Row r attends to tokens [0, seq_lens[r]) of its block table."""
        q = _f32(query, "query")
        if q.dim() != 3 or q.shape[-1] != self.head_size:
            raise ValueError(f"query must be [rows, num_q_heads, {self.head_size}], got {tuple(q.shape)}")
        bt = _ints(block_tables, torch.int32, "block_tables")
        sl = _ints(seq_lens, torch.int32, "seq_lens")
        qp = self._permute(q, layer, 0).contiguous()
        flat = self._core.decode_attention(layer, qp, bt, sl, scale=float(scale or 0.0), threads=self.threads)
        out = torch.from_numpy(flat).view(q.shape)
        out = self._permute(out, layer, 3)
        return out.to(out_dtype or query.dtype)

    def attention(self, layer: int, query, meta: AttentionMetadata, *, scale: Optional[float] = None,
                  key=None, value=None, prefill: str = "compressed") -> "torch.Tensor":
        """Runtime dispatch for a vLLM-style batch (K/V already written by
        reshape_and_cache). query [num_tokens, num_q_heads, head_size] ->
        same shape. Per sequence: one query token = decode; new tokens with no
        cached context = prefill; with context = chunked prefill. Every row is
        served from the compressed pages (a query at position p is a paged
        decode row of length p + 1), except prefills under
        prefill="dense_fresh", which attend densely over this step's own K/V
        (exact; no history exists). A chunked prefill under "dense_fresh"
        would need the history dense: it raises IntegrationError."""
        if prefill not in ("compressed", "dense_fresh"):
            raise ValueError(f"prefill must be 'compressed' or 'dense_fresh', got {prefill!r}")
        qsl = _ints(meta.query_start_loc, torch.int64, "query_start_loc")
        seq_lens = _ints(meta.seq_lens, torch.int64, "seq_lens")
        bt = _ints(meta.block_table, torch.int32, "block_table")
        n = int(meta.num_actual_tokens)
        if qsl.dim() != 1 or qsl.shape[0] != seq_lens.shape[0] + 1 or int(qsl[-1]) != n:
            raise ValueError("query_start_loc must be [batch + 1] ending at num_actual_tokens")
        qlens = qsl[1:] - qsl[:-1]
        ctx = seq_lens - qlens
        if (ctx < 0).any():
            raise ValueError("seq_lens must be >= the query lengths")
        q = query[:n]
        rows_seq = torch.repeat_interleave(torch.arange(len(qlens)), qlens)
        # position of every query token = ctx + index within its sequence
        pos = ctx[rows_seq] + (torch.arange(n) - qsl[:-1][rows_seq])
        paged = torch.ones(n, dtype=torch.bool)
        out = torch.empty(q.shape, dtype=query.dtype)
        if prefill == "dense_fresh":
            for s in range(len(qlens)):  # check every sequence before doing any work
                if qlens[s] > 1 and ctx[s] > 0:
                    raise IntegrationError(
                        f"sequence {s}: chunked prefill ({int(ctx[s])} cached tokens) with prefill='dense_fresh' "
                        "would need the compressed history dense; use prefill='compressed'")
            if (qlens > 1).any() and (key is None or value is None):
                raise IntegrationError("prefill='dense_fresh' needs this step's key and value")
            for s in range(len(qlens)):
                if qlens[s] > 1:
                    a, b = int(qsl[s]), int(qsl[s + 1])
                    out[a:b] = _dense_causal(q[a:b], key[a:b], value[a:b], scale).to(query.dtype)
                    paged[a:b] = False
                    self.counters.dense_fresh_rows += b - a
        idx = paged.nonzero().flatten()
        if len(idx):
            res = self.paged_decode(layer, q[idx], bt[rows_seq[idx]], (pos[idx] + 1).to(torch.int32), scale=scale,
                                    out_dtype=query.dtype)
            out[idx] = res
            kinds = torch.where(qlens[rows_seq[idx]] == 1, 0, torch.where(ctx[rows_seq[idx]] > 0, 2, 1))
            self.counters.decode_rows += int((kinds == 0).sum())
            self.counters.prefill_rows += int((kinds == 1).sum())
            self.counters.chunked_rows += int((kinds == 2).sum())
        self.counters.calls += 1
        return out

    def ledger(self) -> Dict[str, int]:
        return self._core.ledger()

    @property
    def nbytes(self) -> int:
        return self._core.allocated_bytes


def _dense_causal(q, k, v, scale):
    """Dense causal attention of one sequence's own tokens (fp32): q [n, Hq, d], k/v [n, Hkv, d]."""
    q, k, v = (t.to(torch.float32) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = scale if scale else 1.0 / math.sqrt(q.shape[-1])
    logits = torch.einsum("qhd,khd->hqk", q, k) * s
    n = q.shape[0]
    logits = logits.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), v)


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


# ---------------------------------------------------------------------------
# hooks

MODES = ("off", "capture_only", "hybrid", "full_tq")
_STATE = "_turboquant_hooks"


@dataclass
class _HookState:
    mode: str
    layers: List[str]
    originals: Dict[str, Tuple[Any, Any]]
    store: Optional[PagedCompressedKVCache]
    stats: Dict[str, Any] = field(default_factory=dict)
    energy_k: Dict[int, "torch.Tensor"] = field(default_factory=dict)
    energy_v: Dict[int, "torch.Tensor"] = field(default_factory=dict)
    freed_bytes: int = 0


def _attention_layers(runner) -> Dict[str, Any]:
    try:
        ctx = runner.compilation_config.static_forward_context
    except AttributeError as e:
        raise IntegrationError("runner has no compilation_config.static_forward_context (not a vLLM-shaped "
                               "model runner)") from e
    layers = {name: l for name, l in ctx.items() if hasattr(l, "impl") and hasattr(l.impl, "forward")}
    if not layers:
        raise IntegrationError("static_forward_context holds no attention layers (objects with impl.forward)")
    return layers


def install_hooks(runner, mode: str = "full_tq", *, cache_dtype: str = "tq4",
                  config: Optional[KVQuantConfig] = None, metadata: Optional[Dict[str, Any]] = None,
                  prefill: str = "compressed", num_blocks: Optional[int] = None,
                  block_size: Optional[int] = None, threads: int = 1) -> None:
    """Hooks every attention layer of a vLLM-shaped runner.

    Modes: ``off`` (original backend, calls counted), ``capture_only``
    (original backend; K/V channel energy captured for calibration),
    ``hybrid`` (both caches written; batches with prefill tokens run the
    original backend, pure-decode batches run TurboQuant), ``full_tq`` (only
    the compressed cache is written and every batch runs TurboQuant; the dense
    cache can then be released with ``free_kv_cache``).

    Layer order (= the cache's layer index) is static_forward_context's order.
    num_blocks/block_size default to the shape of each layer's dense
    ``kv_cache`` ([2, num_blocks, block_size, num_kv_heads, head_size]).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if getattr(runner, _STATE, None) is not None:
        raise IntegrationError("hooks already installed on this runner; call uninstall_hooks first")
    config = config or KVQuantConfig()
    if config.production and mode == "hybrid":
        raise ProductionModeError("mode 'hybrid' keeps and reads the dense cache (an A/B mode); "
                                  "production mode allows 'off', 'capture_only' or 'full_tq'")
    layers = _attention_layers(runner)
    names = list(layers)
    first = layers[names[0]]
    impl = first.impl
    for name, l in layers.items():
        if (l.impl.num_kv_heads, l.impl.head_size) != (impl.num_kv_heads, impl.head_size):
            raise IntegrationError(f"layer {name}: KV heads/head size differ from layer {names[0]}'s")
    store = None
    if mode in ("hybrid", "full_tq"):
        if num_blocks is None or block_size is None:
            shape = _dense_cache(first).shape
            num_blocks = num_blocks or shape[1]
            block_size = block_size or shape[2]
        store = PagedCompressedKVCache(len(names), impl.num_kv_heads, impl.head_size, num_blocks=num_blocks,
                                       block_size=block_size, cache_dtype=cache_dtype, config=config,
                                       metadata=metadata, threads=threads)
    state = _HookState(mode=mode, layers=names, originals={}, store=store,
                       stats={"dense_forward_calls": 0, "dense_kv_updates": 0, "tq_forward_calls": 0,
                              "tq_kv_updates": 0, "captured_tokens": 0, "fallbacks": 0})
    for index, name in enumerate(names):
        layer = layers[name]
        orig_update = getattr(layer.impl, "do_kv_cache_update", None)
        orig_forward = layer.impl.forward
        if orig_update is None:
            raise IntegrationError(f"layer {name}: impl has no do_kv_cache_update (vLLM >= 0.11 layout expected)")
        own = vars(layer.impl) if hasattr(layer.impl, "__dict__") else {}
        # what to restore: instance attributes as they were, class methods by deleting ours
        state.originals[name] = (own.get("do_kv_cache_update"), own.get("forward"))
        tq_impl = None
        if store is not None:
            tq_impl = TurboQuantAttentionImpl(store, index, layer.impl.num_heads, layer.impl.head_size,
                                              layer.impl.scale, layer.impl.num_kv_heads, prefill=prefill)
        layer.impl.do_kv_cache_update = _make_update(state, index, orig_update, tq_impl)
        layer.impl.forward = _make_forward(state, index, orig_forward, tq_impl)
    setattr(runner, _STATE, state)


def _dense_cache(layer):
    kv = layer.kv_cache
    return kv[0] if isinstance(kv, (list, tuple)) else kv


def _make_update(state: _HookState, index: int, orig, tq_impl):
    st = state.stats

    def update(layer, key, value, kv_cache, slot_mapping):
        mode = state.mode
        if mode in ("off", "capture_only", "hybrid"):
            orig(layer, key, value, kv_cache, slot_mapping)
            st["dense_kv_updates"] += 1
        if mode == "capture_only":
            slots = torch.as_tensor(slot_mapping)
            keep = slots >= 0  # padded tokens (slot -1, or beyond the slot mapping) are not captured
            n = int(keep.sum())
            h, d = layer.impl.num_kv_heads, layer.impl.head_size
            k = key.reshape(-1, h, d)[: slots.shape[0]][keep]
            v = value.reshape(-1, h, d)[: slots.shape[0]][keep]
            state.energy_k[index] = state.energy_k.get(index, 0) + channel_energy(k)
            state.energy_v[index] = state.energy_v.get(index, 0) + channel_energy(v)
            if index == 0:
                st["captured_tokens"] += n
        if mode in ("hybrid", "full_tq"):
            tq_impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            st["tq_kv_updates"] += 1
    return update


def _make_forward(state: _HookState, index: int, orig, tq_impl):
    st = state.stats

    def forward(layer, query, key, value, kv_cache, attn_metadata, output=None, **kwargs):
        mode = state.mode
        use_tq = mode == "full_tq" or (mode == "hybrid" and int(attn_metadata.max_query_len) <= 1)
        if use_tq:
            st["tq_forward_calls"] += 1
            return tq_impl.forward(layer, query, key, value, kv_cache, attn_metadata, output=output, **kwargs)
        if state.freed_bytes:
            raise IntegrationError("the dense KV cache was freed (free_kv_cache): the original backend cannot run")
        st["dense_forward_calls"] += 1
        return orig(layer, query, key, value, kv_cache, attn_metadata, output=output, **kwargs)
    return forward


def _state(runner) -> _HookState:
    state = getattr(runner, _STATE, None)
    if state is None:
        raise IntegrationError("no turboquant hooks installed on this runner (install_hooks first)")
    return state


def uninstall_hooks(runner) -> None:
    """Restores every layer's original do_kv_cache_update and forward."""
    state = _state(runner)
    layers = _attention_layers(runner)
    for name, saved in state.originals.items():
        impl = layers[name].impl
        for attr, value in zip(("do_kv_cache_update", "forward"), saved):
            if value is None:
                delattr(impl, attr)
            else:
                setattr(impl, attr, value)
    setattr(runner, _STATE, None)


def free_kv_cache(runner) -> int:
    """full_tq only: releases the runner's dense KV cache tensors (each
    layer's ``kv_cache`` and ``runner.kv_caches``), returns the bytes freed."""
    state = _state(runner)
    if state.mode != "full_tq":
        raise IntegrationError(f"free_kv_cache: mode {state.mode!r} still uses the dense cache; only 'full_tq' "
                               "can free it")
    freed = 0
    seen = set()
    for name, layer in _attention_layers(runner).items():
        kv = layer.kv_cache
        items = kv if isinstance(kv, list) else [kv]
        for i, t in enumerate(items):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                freed += t.numel() * t.element_size()
            items[i] = torch.empty(0)
        if not isinstance(kv, list):
            layer.kv_cache = items[0]
    caches = getattr(runner, "kv_caches", None)
    if isinstance(caches, list):
        for i, t in enumerate(caches):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                freed += t.numel() * t.element_size()
            caches[i] = torch.empty(0)
    elif isinstance(caches, dict):
        for k, t in caches.items():
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                freed += t.numel() * t.element_size()
            caches[k] = torch.empty(0)
    state.freed_bytes += freed
    return freed


def get_stats(runner) -> Dict[str, Any]:
    """Mode, per-path call counts, rows by dispatch path, bytes (compressed
    pool, dense freed), fallbacks (always 0: nothing falls back silently)."""
    state = _state(runner)
    out = {"mode": state.mode, "layers": list(state.layers), **state.stats, "dense_freed_bytes": state.freed_bytes}
    if state.store is not None:
        c = state.store.counters
        out.update({"cache_dtype": state.store.cache_dtype, "preset": state.store.preset,
                    "tq_bytes": state.store.nbytes, "tq_tokens_written": c.tokens_written,
                    "tq_decode_rows": c.decode_rows, "tq_prefill_rows": c.prefill_rows,
                    "tq_chunked_prefill_rows": c.chunked_rows, "dense_fresh_rows": c.dense_fresh_rows})
    return out


def calibration_metadata(runner, recipe: str, prompts: Sequence[Any], *, seed: int = 0) -> Dict[str, Any]:
    """Recipe metadata from what capture_only mode recorded while ``prompts`` ran."""
    state = _state(runner)
    if not state.energy_k:
        raise IntegrationError("nothing captured: run prompts in mode 'capture_only' first")
    preset = resolve_cache_dtype(recipe)
    if not _is_split(preset):
        raise ValueError(f"recipe must be one of {_SPLIT_RECIPES}")
    n = len(state.layers)
    missing = [i for i in range(n) if i not in state.energy_k]
    if missing:
        raise IntegrationError(f"layers {missing} captured nothing")
    h, d = state.energy_k[0].shape
    record = {"method": "channel_energy", "statistic": "sum of x^2 over tokens per (layer, kv head, channel)",
              "num_prompts": len(prompts), "num_tokens": state.stats["captured_tokens"],
              "prompts_sha256": prompts_sha256(prompts)}
    return build_metadata(recipe, d, n, h, key_channels=[top_channels(state.energy_k[i], d // 4) for i in range(n)],
                          value_channels=[top_channels(state.energy_v[i], d // 4) for i in range(n)],
                          calibration=record, seed=seed)


# ---------------------------------------------------------------------------
# verify


def default_min_cosine(cache_dtype: str, head_size: int) -> float:
    """verify's default bar on the worst output cosine, from the narrower
    component's bits per value b (payload + metadata): b >= 8: 0.995,
    b >= 4: 0.93, b >= 3: 0.75, else 0.2; 0.1 when keys use QJL (prod)
    codes (turboquant25/35: their score variance makes single rows noisy). Measured on verify's synthetic K/V at
    head sizes 64 and 128 over 3 seeds, with margin (docs/PYTHON.md)."""
    lay = _core.preset_row_layout(resolve_cache_dtype(cache_dtype), head_size)
    bits = min(8.0 * (lay[c + "_payload_bytes"] + lay[c + "_meta_bytes"]) / head_size for c in ("key", "value"))
    bars = [(8, 0.995), (4, 0.93), (3, 0.75), (0, 0.2)]
    if "prod" in lay["key_format"]:
        return 0.1
    return next(bar for lo, bar in bars if bits >= lo)


def _synthetic_kv(gen, tokens, h, d):
    scale = torch.exp(0.3 * torch.randn(h, d, generator=gen))
    scale[:, : max(1, d // 32)] *= 3.0  # a few outlier channels, like real keys
    mean = 0.3 * torch.randn(h, d, generator=gen)
    k = torch.randn(tokens, h, d, generator=gen) * scale + mean
    v = torch.randn(tokens, h, d, generator=gen)
    return k, v


def verify(cache_dtype: str, *, num_q_heads: int, num_kv_heads: int, head_size: int,
           seq_lens: Sequence[int] = (1, 33, 300), block_size: int = 16, num_layers: int = 1,
           metadata: Optional[Dict[str, Any]] = None, min_cosine: Optional[float] = None, seed: int = 0,
           prefill_tokens: int = 8) -> Dict[str, Any]:
    """Compares compressed attention (reshape_and_cache into shuffled pages,
    then decode of every sequence and chunked-prefill rows of its last
    ``prefill_tokens`` tokens) with dense fp64 attention on the same K/V
    (synthetic: Gaussian keys with a per-channel scale, a few 4x outlier
    channels and a mean offset; Gaussian values). Returns a report with the
    worst output cosine, the NMSE, bytes of the pages used vs dense fp16, and
    ``passed`` = worst cosine >= min_cosine."""
    if min_cosine is None:
        min_cosine = default_min_cosine(cache_dtype, head_size)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, -(-n // block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    store = PagedCompressedKVCache(num_layers, num_kv_heads, head_size, num_blocks=num_blocks,
                                   block_size=block_size, cache_dtype=cache_dtype, metadata=metadata)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_seq)
    bt = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    o = 0
    for i, nb in enumerate(blocks_per_seq):
        bt[i, :nb] = perm[o:o + nb]
        o += nb
    worst, num, den = 1.0, 0.0, 0.0
    scale = 1.0 / math.sqrt(head_size)
    for layer in range(num_layers):
        kv = []
        for i, n in enumerate(seq_lens):
            k, v = _synthetic_kv(gen, n, num_kv_heads, head_size)
            t = torch.arange(n)
            slots = (bt[i, t // block_size].to(torch.int64) * block_size + t % block_size)
            store.reshape_and_cache(layer, k, v, slots)
            kv.append((k, v))
        rows_q, rows_bt, rows_len, refs = [], [], [], []
        for i, n in enumerate(seq_lens):
            k, v = kv[i]
            for p in range(max(0, n - prefill_tokens), n):
                q = torch.randn(num_q_heads, head_size, generator=gen)
                rows_q.append(q)
                rows_bt.append(bt[i])
                rows_len.append(p + 1)
                refs.append(_ref_row(q, k[: p + 1], v[: p + 1], scale))
        out = store.paged_decode(layer, torch.stack(rows_q), torch.stack(rows_bt),
                                 torch.tensor(rows_len, dtype=torch.int32), scale=scale).to(torch.float64)
        ref = torch.stack(refs)
        cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
        worst = min(worst, float(cos.min()))
        num += float(((out - ref) ** 2).sum())
        den += float((ref ** 2).sum())
    geom = page_geometry(cache_dtype, head_size, num_kv_heads, block_size)
    tokens = sum(seq_lens)
    return {
        "cache_dtype": cache_dtype, "preset": store.preset, "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads, "head_size": head_size, "num_layers": num_layers,
        "seq_lens": list(seq_lens), "block_size": block_size, "rows": len(rows_q) * num_layers,
        "worst_cosine": worst, "nmse": num / den if den else 0.0, "min_cosine": min_cosine,
        "bytes_per_token_head": _core.preset_bytes_per_token_head(store.preset, head_size),
        "page_bytes_used": geom["bytes_per_block"] * num_blocks * num_layers,
        "dense_fp16_bytes": tokens * num_kv_heads * head_size * 4 * num_layers,
        "passed": worst >= min_cosine,
    }


def _ref_row(q, k, v, scale):
    """fp64 dense attention of one query [Hq, d] over k/v [n, Hkv, d] -> [Hq, d]."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, -1)
    return torch.einsum("hn,nhd->hd", w, v)


def _model_shapes(model_dir: str) -> Dict[str, int]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"{path} not found")
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    try:
        q = int(cfg["num_attention_heads"])
        return {"num_q_heads": q, "num_kv_heads": int(cfg.get("num_key_value_heads") or q),
                "head_size": int(cfg.get("head_dim") or cfg["hidden_size"] // q),
                "num_layers": int(cfg["num_hidden_layers"])}
    except KeyError as e:
        raise ValueError(f"{path}: missing {e.args[0]}") from e


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m turboquant.integration.vllm")
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="compare compressed and dense attention on a model's shapes")
    v.add_argument("--cache-dtype", default="tq4", help="one of: " + ", ".join(_CACHE_DTYPES))
    v.add_argument("--model-dir", help="local model directory: shapes from config.json, recipe metadata "
                   f"from {METADATA_FILENAME} when present")
    v.add_argument("--num-q-heads", type=int)
    v.add_argument("--num-kv-heads", type=int)
    v.add_argument("--head-size", type=int)
    v.add_argument("--num-layers", type=int, help="layers to check (default 1, or the model's up to 4)")
    v.add_argument("--seq-lens", default="1,33,300")
    v.add_argument("--block-size", type=int, default=16)
    v.add_argument("--min-cosine", type=float, help="bar on the worst output cosine (default: by bits per value)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        shapes = {"num_layers": 1}
        meta = None
        if a.model_dir:
            shapes = _model_shapes(a.model_dir)
            shapes["num_layers"] = min(shapes["num_layers"], 4)
            meta = discover_metadata(a.model_dir)
        for k in ("num_q_heads", "num_kv_heads", "head_size", "num_layers"):
            if getattr(a, k) is not None:
                shapes[k] = getattr(a, k)
        missing = [k for k in ("num_q_heads", "num_kv_heads", "head_size") if k not in shapes]
        if missing:
            ap.error("give --model-dir or " + ", ".join("--" + m.replace("_", "-") for m in missing))
        if meta is not None and meta["num_layers"] != shapes["num_layers"]:
            layers = meta["layers"][: shapes["num_layers"]]
            meta = {**meta, "num_layers": len(layers), "layers": layers}
        if meta is not None and meta["recipe"] != a.cache_dtype:
            meta = None if resolve_cache_dtype(meta["recipe"]) != resolve_cache_dtype(a.cache_dtype) else meta
        rep = verify(a.cache_dtype, seq_lens=[int(s) for s in a.seq_lens.split(",")], block_size=a.block_size,
                     metadata=meta, min_cosine=a.min_cosine, seed=a.seed, **shapes)
        rep["metadata"] = "used" if meta is not None else "none"
    except (ValueError, IntegrationError) as e:
        print(f"verify: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rep, indent=1))
    else:
        print(f"{rep['cache_dtype']} ({rep['preset']}): worst cosine {rep['worst_cosine']:.5f} "
              f"(bar {rep['min_cosine']}), NMSE {rep['nmse']:.3e}, {rep['rows']} rows; pages "
              f"{rep['page_bytes_used']} B vs dense fp16 {rep['dense_fp16_bytes']} B; "
              + ("PASS" if rep["passed"] else "FAIL"))
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
