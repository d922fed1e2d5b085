"""Hooks on a model runner shaped like vLLM's
(``compilation_config.static_forward_context``, ``impl.forward``,
``impl.do_kv_cache_update``, ``kv_caches``): ``install_hooks(runner, mode)``
with modes ``off``, ``capture_only``, ``hybrid``, ``full_tq``;
``uninstall_hooks``, ``free_kv_cache``, ``get_stats``, and
``calibration_metadata`` from what ``capture_only`` recorded."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..common import IntegrationError, KVQuantConfig, ProductionModeError
from .attention import TurboQuantAttentionImpl
from .cache import PagedCompressedKVCache
from .calibration import channel_energy, metadata_from_energy
from .registry import SPLIT_RECIPES, is_split_recipe, resolve_cache_dtype

MODES = ("off", "capture_only", "hybrid", "full_tq")
_STATE = "_turboquant_hooks"  # the runner's attribute holding its _HookState (None once uninstalled)


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
    if not is_split_recipe(preset):
        raise ValueError(f"recipe must be one of {SPLIT_RECIPES}")
    n = len(state.layers)
    missing = [i for i in range(n) if i not in state.energy_k]
    if missing:
        raise IntegrationError(f"layers {missing} captured nothing")
    h, d = state.energy_k[0].shape
    return metadata_from_energy(recipe, [state.energy_k[i] for i in range(n)], [state.energy_v[i] for i in range(n)],
                                head_size=d, num_layers=n, num_kv_heads=h, prompts=prompts,
                                num_tokens=state.stats["captured_tokens"], seed=seed)
