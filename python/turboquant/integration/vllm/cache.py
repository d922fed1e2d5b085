"""``PagedCompressedKVCache``: paged compressed K/V of every attention layer
on our C++ ``PagedKVCache`` (CPU, torch tensors): ``reshape_and_cache``
(writes by ``slot_mapping``), paged decode (``block_tables``/``seq_lens``)
and the runtime dispatch of vLLM-style batches (decode, prefill, chunked
prefill). It never densifies history and raises where it would have to."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ... import _core
from ..common import IntegrationError, KVQuantConfig
from .attention import AttentionMetadata
from .metadata import MetadataError, validate_metadata
from .registry import is_split_recipe, layer_formats, resolve_cache_dtype


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
class PathCounters:
    decode_rows: int = 0        # (sequence) rows served by compressed paged decode
    prefill_rows: int = 0       # query tokens of prefills served from the compressed pages
    chunked_rows: int = 0       # query tokens of chunked prefills (context > 0) from the compressed pages
    dense_fresh_rows: int = 0   # prefill tokens served by dense attention over this step's own K/V
    tokens_written: int = 0
    calls: int = 0


class PagedCompressedKVCache:
    """Paged compressed K/V for every attention layer, on our
    ``PagedKVCache``. Pages and slots are the caller's (vLLM's) block ids: any
    block table and slot mapping over ``num_blocks`` pages of ``block_size``.

    With recipe metadata for a split recipe (turboquant25/35), each layer's
    and KV head's calibrated high-precision channels are moved to the front
    by a fixed channel permutation before encoding (the library's split codec
    keeps channels [0, head_size/4) at the higher width); queries get the same
    permutation and outputs the inverse, so attention is unchanged.

    ``means={layer: (key_mean, value_mean)}`` (float32 [num_kv_heads,
    head_size] or None; ``calibration.channel_means``) centres a layer's
    writes (PagedKVCache.set_means): the key mean drops out of the softmax,
    the value mean is added back to the output.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, *, num_blocks: int,
                 block_size: int = 16, cache_dtype: str = "tq4", config: Optional[KVQuantConfig] = None,
                 metadata: Optional[Dict[str, Any]] = None, threads: int = 1,
                 means: Optional[Dict[int, Tuple[Any, Any]]] = None):
        preset, config, self.layer_presets = layer_formats(cache_dtype, config, num_layers)
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
        for layer, (km, vm) in (means or {}).items():  # centering means: float32 [num_kv_heads, head_size] or None
            if layer in self._perm:
                raise ValueError(f"means: layer {layer} permutes channels (split-recipe metadata); centering means "
                                 "are not supported with it")
            self._core.set_means(layer, None if km is None else _f32(km, "key_mean").numpy(),
                                 None if vm is None else _f32(vm, "value_mean").numpy())
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
        if not is_split_recipe(self.preset):
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
