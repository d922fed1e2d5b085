"""Recipe metadata (schema: docs/FORMAT.md, "KV recipe metadata"): build,
validate (errors name the field and the accepted values), save/load,
discovery next to a local model directory, and tensor-parallel slicing
(per-rank KV-head slices)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import Any, Dict, List, Optional, Sequence

from .registry import CACHE_DTYPE_PRESETS, is_split_recipe, resolve_cache_dtype

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
    if not isinstance(recipe, str) or recipe not in CACHE_DTYPE_PRESETS:
        _fail("recipe", f"is {recipe!r}; accepted: {', '.join(CACHE_DTYPE_PRESETS)}")
    preset = CACHE_DTYPE_PRESETS[recipe]
    head_size = _check_int(meta, "head_size", "head_size", lo=1)
    if is_split_recipe(preset) and (head_size % 4 or head_size < 8):
        _fail("head_size", f"is {head_size}; recipe {recipe} needs a multiple of 4, >= 8")
    num_layers = _check_int(meta, "num_layers", "num_layers", lo=1)
    num_kv_heads = _check_int(meta, "num_kv_heads", "num_kv_heads", lo=1)
    for name, table in (("transform", TRANSFORMS), ("codebook", CODEBOOKS)):
        sub = meta.get(name)
        if not isinstance(sub, dict):
            _fail(name, f"must be an object {{'kind', 'version'}}, got {sub!r}")
        if not isinstance(sub.get("kind"), str) or sub.get("kind") not in table:
            _fail(f"{name}.kind", f"is {sub.get('kind')!r}; accepted: {list(table)}")
        _check_int(sub, "version", f"{name}.version", accepted=table[sub["kind"]])
    if "seed" in meta.get("transform", {}):
        _check_int(meta["transform"], "seed", "transform.seed", lo=0)
    layers = meta.get("layers")
    if not isinstance(layers, list) or len(layers) != num_layers:
        _fail("layers", f"must be a list of num_layers = {num_layers} objects, got "
              f"{len(layers) if isinstance(layers, list) else type(layers).__name__}")
    count = head_size // 4 if is_split_recipe(preset) else 0
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
        if not isinstance(tp, dict):
            _fail("tensor_parallel", f"must be an object {{'size', 'rank', 'kv_heads'}}, got {tp!r}")
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
    count = head_size // 4 if is_split_recipe(preset) else 0

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
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise MetadataError(f"recipe metadata {path}: not valid JSON ({e})") from e
    except UnicodeDecodeError as e:
        raise MetadataError(f"recipe metadata {path}: not valid UTF-8 ({e})") from e
    except RecursionError as e:
        raise MetadataError(f"recipe metadata {path}: JSON nested too deeply to read") from e
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
