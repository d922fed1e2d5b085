"""HuggingFace transformers integration.

Two routes:

* **Production** (`TurboQuantCache` + the attention function registered as
  ``"turboquant"``): K/V go to our compressed caches and attention runs over
  them; no dense K/V history is ever built. The cache layers hold no
  ``keys``/``values`` tensors: ``update`` returns the step's new K/V tagged
  with a handle, and the attention function stores them (the real tokens
  only: it is the first to see the attention mask, and so the padding) and
  attends. It raises if handed anything but such a handle.

  - CPU (default): our C++ ``KVCache`` (sinks, compressed history, dense
    recent ring, per-sequence centering), ``tq::PrefillAttention`` for
    multi-token steps (one call per row) and ``tq::DecodeAttention`` for one
    new token a row.
  - CUDA (``device="cuda"``, ``max_cache_len=N``, the package built with the
    CUDA backend): device pages and GPU kernels (``hf_cuda.PagedRoute``).

* **Diagnostic** (`CompressedDynamicCache`, the seed API): wraps transformers'
  ``DynamicCache`` and stores quantized-then-dequantized K/V as dense tensors,
  so that any attention implementation sees the quantization error. It
  materializes dense history by design: a quality probe, refused in
  production mode (``ProductionModeError``).

Masks (``hf_masks``): causal, the model's sliding window, and left padding
(padded positions are never stored nor attended); anything else raises
``IntegrationError``. Multi-token steps over a history (chunked prefill, a
second prompt, speculative verification) are served on both devices.
``crop`` (which transformers' assisted generation needs) works on CUDA and is
refused on the CPU (the CPU cache's compressed history is append-only); beam
search reordering is refused on both.

Written against the transformers 5.x ``Cache``/``CacheLayerMixin``
API (tested with transformers 5.25 and 5.17, torch 2.15 CPU).
"""
from __future__ import annotations

import inspect
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

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
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - exercised only without torch/transformers
    raise OptionalDependencyError(
        "turboquant.integration.hf needs torch and transformers>=5 "
        "(./scripts/install-python-deps.sh installs them from PyPI): " + str(e)) from e

from .hf_masks import ChunkLayout, chunk_layout  # noqa: E402  (needs torch)

ATTENTION_NAME = "turboquant"

__all__ = [
    "ATTENTION_NAME",
    "CompressedDynamicCache",
    "TurboQuantCache",
    "TurboQuantLayer",
    "cache_kwarg",
    "generate",
    "model_shape",
    "register",
    "turboquant_attention_forward",
]


# ---------------------------------------------------------------------------
# helpers


def model_shape(config) -> Dict[str, int]:
    """(num_layers, num_q_heads, num_kv_heads, head_dim) of a transformers text config."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    try:
        num_layers = int(config.num_hidden_layers)
        num_q = int(config.num_attention_heads)
    except AttributeError as e:
        raise ValueError(f"model config lacks {e.name}: need num_hidden_layers and num_attention_heads") from e
    num_kv = int(getattr(config, "num_key_value_heads", None) or num_q)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q
    return {"num_layers": num_layers, "num_q_heads": num_q, "num_kv_heads": num_kv, "head_dim": int(head_dim)}


def _softcap_of(config) -> float:
    if config is None:
        return 0.0
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return float(getattr(config, "attn_logit_softcapping", None) or 0.0)


def _cpu_f32(t: "torch.Tensor", what: str) -> "torch.Tensor":
    if t.device.type != "cpu":
        raise IntegrationError(
            f"{what} is on {t.device} but this TurboQuantCache was built for the CPU: build it with "
            "device='cuda' and max_cache_len=... (CUDA backend), or run the model on the CPU")
    return t.detach().to(torch.float32).contiguous()


@dataclass
class CacheStats:
    """Counters of the production route (what ran, never estimates)."""

    appended_tokens: int = 0          # (layer, row) real tokens stored
    padded_tokens: int = 0            # (layer, row) padded positions seen and not stored
    prefill_calls: int = 0            # multi-token attention calls (CPU: one per row; CUDA: SDPA or extend)
    decode_calls: int = 0             # one-token-a-row attention calls (one per batch)
    max_kv_tokens_seen: int = 0       # most K/V tokens handed to the attention function in one call
    cropped_tokens: int = 0           # positions removed by crop (per layer)
    gpu_writes: int = 0               # CUDA: write-kernel launches (one per layer update)
    gpu_decode_calls: int = 0         # CUDA: fused paged decode launches
    gpu_extend_calls: int = 0         # CUDA: fused paged extend launches
    sdpa_prefill_calls: int = 0       # CUDA: exact SDPA over a first prompt chunk (one per layer)
    kernel_calls_by_layer: Dict[int, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# production route


class _KVHandle:
    """What a TurboQuantLayer.update returns in place of dense history: the
    step's new K/V ([batch, kv_heads, new_tokens, head_dim]), stored by the
    attention function once the mask says which of them are real."""

    __slots__ = ("layer", "new_tokens", "history", "keys", "values")

    def __init__(self, layer: "TurboQuantLayer", keys, values, history: int):
        self.layer = layer
        self.new_tokens = keys.shape[-2]
        self.history = history  # positions cached before this update (padded ones included)
        self.keys = keys
        self.values = values


class TurboQuantLayer(CacheLayerMixin):
    """One decoder layer of a TurboQuantCache. Holds no dense tensors:
    ``keys`` and ``values`` stay None; the tokens live in the C++ cache or
    the device pages. Its length (``get_seq_length``) counts positions as
    transformers does, padded ones included."""

    is_sliding = False
    is_compileable = False
    supports_early_init = False

    def __init__(self, owner: "TurboQuantCache", layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        self.batch_size = None
        self.dtype = None
        self.device = None
        self._pending: Optional[_KVHandle] = None  # an update not yet attended
        self._length = 0                           # positions, padded ones included
        self._pads: List[int] = []                 # per row: padded positions (all before its first real token)

    @property
    def is_croppable(self) -> bool:  # transformers' assisted generation asks this
        return self._owner._paged is not None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch_size = key_states.shape[0]
        self._pads = [0] * self.batch_size
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states/value_states: [batch, num_kv_heads, new_tokens, head_dim].
        Returns them tagged with a handle (never the history); the attention
        function stores them."""
        owner = self._owner
        if self._pending is not None:
            raise IntegrationError(
                f"layer {self.layer_idx}: the previous update was never attended: TurboQuantCache stores K/V in "
                "the 'turboquant' attention function (it needs the mask), so the model must use it; if that "
                "attention raised, reset() the cache")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, t, d = key_states.shape
        if h != owner.num_kv_heads or d != owner.head_dim:
            raise ValueError(
                f"layer {self.layer_idx}: key_states shape {tuple(key_states.shape)} does not match the cache "
                f"(num_kv_heads={owner.num_kv_heads}, head_dim={owner.head_dim})")
        if b != self.batch_size:
            raise IntegrationError(
                f"layer {self.layer_idx}: batch size changed from {self.batch_size} to {b} "
                "(beam search / batch reordering is not supported by TurboQuantCache)")
        if b > owner.batch_capacity:
            raise ValueError(f"batch size {b} exceeds the cache's max_batch_size={owner.batch_capacity}")
        if owner._paged is not None:
            owner._paged.check_step(self.layer_idx, self._length, t, key_states, "key_states")
            owner._paged.check_step(self.layer_idx, self._length, t, value_states, "value_states")
        else:
            for name, x in (("key_states", key_states), ("value_states", value_states)):
                if x.device.type != "cpu":
                    _cpu_f32(x, name)  # raises, naming the device
        handle = _KVHandle(self, key_states, value_states, self._length)
        self._pending = handle
        key_states._tq_handle = handle
        value_states._tq_handle = handle
        return key_states, value_states

    def _commit(self, handle: _KVHandle, layout: ChunkLayout) -> None:
        self._length = handle.history + handle.new_tokens
        self._pads = layout.pads
        self._pending = None
        handle.keys = handle.values = None

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name in transformers < 5.2x
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.is_initialized = False
        self.batch_size = None
        self._pending = None
        self._length = 0
        self._pads = []

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` positions (transformers'
        convention: a negative count; 0 is a no-op). CUDA only."""
        owner = self._owner
        if owner._paged is None:
            raise IntegrationError(
                "TurboQuantCache on the CPU cannot crop (its compressed history is append-only); assisted "
                "generation and other rollbacks need TurboQuantCache(device='cuda', ...)")
        tokens_to_remove = int(tokens_to_remove)  # transformers may pass a 0-d tensor
        if tokens_to_remove > 0:
            raise IntegrationError(
                f"crop({tokens_to_remove}): pass a negative count of positions to remove (or 0), as transformers "
                "does; an absolute target length is not accepted")
        n = min(-tokens_to_remove, self._length)
        if n == 0 or not self.is_initialized:
            return
        owner._paged.crop(self.layer_idx, n)
        self._length -= n
        self._pads = [min(p, self._length) for p in self._pads]
        owner.stats.cropped_tokens += n

    def reorder_cache(self, beam_idx) -> None:
        raise IntegrationError("TurboQuantCache does not support beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise IntegrationError("TurboQuantCache does not support batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        raise IntegrationError("TurboQuantCache does not support batch_select_indices")


class TurboQuantCache(Cache):
    """Production transformers cache over our compressed caches.

    ``TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k4_v4"), max_batch_size=1)``;
    use it with a model whose attention implementation is ``"turboquant"``
    (``register()`` is called on import of this module)::

        model = LlamaForCausalLM(cfg, attn_implementation="turboquant")  # or model.set_attn_implementation
        cache = TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k8_v4"))
        out = generate(model, input_ids, cache, max_new_tokens=32)

    CPU (default): our ``KVCache`` (sinks, compressed history, dense recent
    ring, per-sequence centering). CUDA (``device="cuda"``, ``max_cache_len``
    required, padded positions included): one
    ``turboquant.cuda.DevicePagedLayer`` per layer, pages of ``block_size``
    tokens, a pool of ``max_batch_size * ceil(max_cache_len / block_size)``
    pages allocated here (torch uint8 tensors); every token is stored
    compressed, so recent_window, sink_tokens, compress_chunk and dense_type
    do not apply; center_keys / center_values do (means of each layer's first
    chunk, all rows together). Every layer's preset must pass
    ``turboquant.cuda.is_supported`` (IntegrationError otherwise).

    Per-layer presets follow ``policy_from_config(kv_config, num_layers)``.
    """

    def __init__(self, config=None, *, kv_config: Optional[KVQuantConfig] = None,
                 preset: Optional[str] = None, max_batch_size: int = 1, threads: int = 1,
                 num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, device=None, max_cache_len: Optional[int] = None,
                 block_size: int = 16, num_q_heads: Optional[int] = None):
        if config is not None:
            shape = model_shape(config)
            num_layers = num_layers or shape["num_layers"]
            num_kv_heads = num_kv_heads or shape["num_kv_heads"]
            head_dim = head_dim or shape["head_dim"]
            num_q_heads = num_q_heads or shape["num_q_heads"]
        if not (num_layers and num_kv_heads and head_dim):
            raise ValueError("give a model config, or num_layers, num_kv_heads and head_dim")
        kv_config = kv_config or KVQuantConfig()
        if preset is not None:
            kv_config = KVQuantConfig(**{**kv_config.__dict__, "preset": preset})
        self.kv_config = kv_config
        self.layer_presets = policy_from_config(kv_config, num_layers)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_q_heads = num_q_heads
        self.batch_capacity = max_batch_size  # (Cache.max_batch_size is a read-only property in some 5.x)
        self.threads = threads
        self.stats = CacheStats()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.on_cuda = self.device.type == "cuda"
        self._paged = None
        self._tq = None
        self._mask_memo: Optional[tuple] = None
        if self.on_cuda:
            from .hf_cuda import PagedRoute

            self._paged = PagedRoute.for_cuda(self, max_cache_len, block_size, self.device, _softcap_of(config))
            self.device = self._paged.device
        else:
            if self.device.type != "cpu":
                raise IntegrationError(f"TurboQuantCache runs on the CPU or CUDA, not on {self.device}")
            self._tq = _core.KVCache(
                num_layers, num_kv_heads, head_dim, preset=kv_config.preset, max_sequences=max_batch_size,
                recent_window=kv_config.recent_window, sink_tokens=kv_config.sink_tokens,
                compress_chunk=kv_config.compress_chunk, center_keys=kv_config.center_keys,
                center_values=kv_config.center_values, seed=kv_config.seed, dense_type=kv_config.dense_type,
                layer_presets=dict(self.layer_presets))
        super().__init__(layers=[TurboQuantLayer(self, i) for i in range(num_layers)])

    route = "production"

    def _serve_with(self, paged) -> None:
        """Serves this cache through ``paged`` (an ``hf_cuda.PagedRoute``)
        instead of the CPU KVCache; tests pass one whose layers are a torch
        reference on the CPU. Only before the first update."""
        if any(layer.is_initialized for layer in self.layers):
            raise IntegrationError("_serve_with: the cache already holds tokens")
        self._paged, self._tq = paged, None
        self.device = paged.device

    # -- a step ---------------------------------------------------------------

    def _layout(self, mask, layer: TurboQuantLayer, b: int, q_len: int, history: int, window: int) -> ChunkLayout:
        """chunk_layout, computed once per mask object and state: every layer
        of a forward gets the same mask tensor."""
        key = (history, q_len, window, tuple(layer._pads))
        memo = self._mask_memo
        if memo is not None and mask is not None and memo[0]() is mask and memo[1] == key:
            return memo[2]
        layout = chunk_layout(mask, b, q_len, history, window, layer._pads)
        if mask is not None:  # a weak reference: the cache never keeps a step's mask alive
            self._mask_memo = (weakref.ref(mask), key, layout)
        return layout

    def _attend(self, handle: _KVHandle, query, mask, scale: float, softcap: float, window: int):
        """Stores the handle's real tokens and attends; [batch, q_len, q_heads, head_dim]."""
        layer = handle.layer
        b, hq, t, d = query.shape
        try:
            layout = self._layout(mask, layer, b, t, handle.history, window)
        except IntegrationError:
            layer._pending = None  # refused before anything was stored: the cache is as before the step
            raise
        st = self.stats
        if self._paged is not None:
            out = self._paged.attend(layer.layer_idx, handle.history, query, handle.keys, handle.values, layout,
                                     mask, scale, softcap, window)
        else:
            out = self._cpu_attend(layer.layer_idx, query, handle, layout, scale, softcap, window)
        real = layout.real_tokens(t)
        st.appended_tokens += real
        st.padded_tokens += b * t - real
        layer._commit(handle, layout)
        return out

    def _cpu_attend(self, idx: int, query, handle: _KVHandle, layout: ChunkLayout, scale: float, softcap: float,
                    window: int):
        q = _cpu_f32(query, "query")
        k = _cpu_f32(handle.keys, "key_states")
        v = _cpu_f32(handle.values, "value_states")
        b, hq, t, d = q.shape
        lead = layout.lead
        stored = [self._tq.length(idx, i) for i in range(b)]  # real tokens before this step
        for i in range(b):
            if lead[i] < t:
                self._tq.append(idx, i, k[i, :, lead[i]:].transpose(0, 1).contiguous(),
                                v[i, :, lead[i]:].transpose(0, 1).contiguous())
        st = self.stats
        if t == 1 and layout.all_real:
            flat = self._tq.decode_attention(idx, list(range(b)), q[:, :, 0, :].contiguous(), scale=scale,
                                             softcap=softcap, window=window, threads=self.threads)
            st.decode_calls += 1
            return torch.from_numpy(flat).view(b, 1, hq, d)
        out = torch.zeros(b, t, hq, d)
        for i in range(b):
            n = t - lead[i]
            if n == 0:  # only padded positions in this row: outputs stay 0
                continue
            flat = self._tq.prefill_attention(idx, i, q[i, :, lead[i]:].transpose(0, 1).contiguous(),
                                              query_start=stored[i], scale=scale, softcap=softcap, window=window,
                                              threads=self.threads)
            out[i, lead[i]:] = torch.from_numpy(flat).view(n, hq, d)
            st.prefill_calls += 1
        return out

    def take_write_errors(self) -> Dict[str, int]:
        """CUDA: synchronizes and sums the write kernel's error counters over the
        layers since the last call (all zero when every row was written)."""
        if self._paged is None:
            return {"out_of_range_slots": 0, "non_finite_inputs": 0, "scale_overflows": 0}
        return self._paged.take_write_errors()

    # -------------------------------------------------------------------------

    @property
    def core(self):
        """The underlying turboquant.KVCache (CPU) or the list of DevicePagedLayer (CUDA)."""
        return self._paged.layers if self._paged is not None else self._tq

    def reset(self):
        if self._paged is not None:
            self._paged.reset()
        else:
            for seq in range(self.batch_capacity):
                self._tq.free(seq)
        for layer in self.layers:
            layer.reset()
        self._mask_memo = None

    def stored_tokens(self) -> int:
        """Real tokens held, summed over layers and rows (padded positions excluded)."""
        return sum(layer._length * len(layer._pads) - sum(layer._pads)
                   for layer in self.layers if layer.is_initialized)

    def ledger(self) -> Dict[str, int]:
        """Exact bytes held by the C++ cache, by content (tq::KVLedger). CUDA:
        the device planes (allocated for max_cache_len), the shared attention
        workspace, the block tables and lengths, and the tokens stored."""
        if self._paged is not None:
            p = self._paged
            planes = p.plane_bytes()
            ws = p.workspace.numel() if p.workspace is not None else 0
            tables = p.block_tables.numel() * 4 + p.seq_lens.numel() * 4
            tokens = self.stored_tokens() * self.num_kv_heads
            return {"planes": planes, "workspace": ws, "tables": tables, "tokens": tokens,
                    "head_dim": self.head_dim, "total": planes + ws + tables}
        return self._tq.ledger()

    def nbytes(self) -> int:
        return self.ledger()["total"] if self._paged is not None else self._tq.allocated_bytes

    def dense_equivalent_bytes(self, element_size: int = 2) -> int:
        """Bytes a dense cache of the same tokens would take (K and V, element_size bytes each)."""
        led = self.ledger()
        return led["tokens"] * led["head_dim"] * 2 * element_size


def turboquant_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                 **kwargs):
    """transformers attention function (registered as ``"turboquant"``).

    query: [batch, num_q_heads, q_len, head_dim]; key/value must be the handles
    returned by ``TurboQuantLayer.update``. Stores the step's real tokens,
    then attends. Returns ([batch, q_len, num_q_heads, head_dim], None).
    """
    handle = getattr(key, "_tq_handle", None)
    if handle is None:
        raise IntegrationError(
            "attention 'turboquant' got dense K/V instead of a TurboQuantCache handle: pass "
            "cache=TurboQuantCache(model.config, ...) (generate(..., cache) does) and keep use_cache on; "
            "it never densifies a cache")
    layer: TurboQuantLayer = handle.layer
    owner: TurboQuantCache = layer._owner
    if layer._pending is not handle:
        raise IntegrationError(f"layer {layer.layer_idx}: these K/V were already attended (or the cache was reset)")
    if dropout and module.training:
        raise IntegrationError("attention 'turboquant' is inference-only (dropout > 0 in training mode)")
    b, hq, q_len, d = query.shape
    if q_len != handle.new_tokens:
        raise IntegrationError(f"query length {q_len} != new K/V tokens {handle.new_tokens}")
    scale = float(scaling) if scaling is not None else 0.0
    softcap = float(kwargs.get("softcap") or getattr(getattr(module, "config", None), "attn_logit_softcapping", None) or 0.0)
    window = int(kwargs.get("sliding_window") or 0)
    st = owner.stats
    st.max_kv_tokens_seen = max(st.max_kv_tokens_seen, key.shape[-2])
    st.kernel_calls_by_layer[layer.layer_idx] = st.kernel_calls_by_layer.get(layer.layer_idx, 0) + 1
    out = owner._attend(handle, query, attention_mask, scale, softcap, window)
    return out.to(device=query.device, dtype=query.dtype), None


_registered = False


def register(name: str = ATTENTION_NAME) -> str:
    """Registers the attention function (and the sdpa mask builder, which
    returns None for plain causal masks) under ``name``. Idempotent."""
    global _registered
    AttentionInterface.register(name, turboquant_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    _registered = True
    return name


register()


def cache_kwarg(model) -> str:
    """The name under which this transformers version's ``forward`` takes the
    cache: ``cache`` (recent 5.x) or ``past_key_values`` (earlier)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def generate(model, input_ids, cache: Cache, **kwargs):
    """``model.generate`` (greedy unless told otherwise) with ``cache`` passed
    under the name this transformers version expects."""
    kwargs.setdefault("do_sample", False)
    return model.generate(input_ids, **{cache_kwarg(model): cache}, **kwargs)


# ---------------------------------------------------------------------------
# diagnostic route (the seed API)

_PRESET_BITS = re.compile(r"^k(\d+)_v(\d+)$")


class _DiagnosticLayer(DynamicLayer):
    """DynamicLayer whose stored K/V are TurboQuant-MSE encoded then decoded."""

    def __init__(self, owner: "CompressedDynamicCache", layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx

    def update(self, key_states, value_states, *args, **kwargs):
        k = self._owner._roundtrip(key_states, self.layer_idx, "key")
        v = self._owner._roundtrip(value_states, self.layer_idx, "value")
        return super().update(k, v, *args, **kwargs)


class CompressedDynamicCache(DynamicCache):
    """DIAGNOSTIC route (seed API): a transformers ``DynamicCache`` whose K/V
    are quantized with TurboQuant-MSE and immediately dequantized, so that the
    history is held as dense tensors of the model's dtype. Use it to measure
    the quality effect of a bit width with any attention implementation; it
    saves no memory. Production: ``TurboQuantCache`` + attention "turboquant".

    bits (or k_bits/v_bits): TurboQuant-MSE bits, 1..8, or 16 = kept as is.
    model_config: a ``KVQuantConfig``; its per-layer presets (policy_from_config)
    of the form ``k{K}_v{V}`` give each layer's bits (needs num_layers).
    """

    route = "diagnostic"

    def __init__(self, head_dim: int, bits: Optional[int] = None, *, k_bits: Optional[int] = None,
                 v_bits: Optional[int] = None, seed: int = 0, rotation_mode: str = "block",
                 model_config: Optional[KVQuantConfig] = None, num_layers: Optional[int] = None,
                 config=None):
        if model_config is not None and model_config.production:
            raise ProductionModeError(
                "CompressedDynamicCache dequantizes into dense tensors (diagnostic route); "
                "production mode requires TurboQuantCache with attention 'turboquant'")
        if bits is not None and (k_bits is not None or v_bits is not None):
            raise ValueError("give bits, or k_bits and v_bits, not both")
        if model_config is None and bits is None and (k_bits is None or v_bits is None):
            raise ValueError("give bits, k_bits and v_bits, or model_config")
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        self.head_dim = head_dim
        self.seed = seed
        self.rotation_mode = rotation_mode
        self._layer_bits: Dict[int, tuple] = {}
        if model_config is not None:
            if num_layers is None and config is not None:
                num_layers = model_shape(config)["num_layers"]
            if num_layers is None:
                raise ValueError("model_config needs num_layers (or the model's config=)")
            for layer, preset in policy_from_config(model_config, num_layers).items():
                m = _PRESET_BITS.match(preset)
                if not m:
                    raise ValueError(
                        f"layer {layer}: preset '{preset}' is not of the form k{{K}}_v{{V}}; the diagnostic "
                        "route quantizes with TurboQuant-MSE at K/V bits only")
                self._layer_bits[layer] = (int(m.group(1)), int(m.group(2)))
            self._default_bits = None
        else:
            kb = bits if bits is not None else k_bits
            vb = bits if bits is not None else v_bits
            self._default_bits = (kb, vb)
        for kb, vb in list(self._layer_bits.values()) + ([self._default_bits] if self._default_bits else []):
            for b in (kb, vb):
                if not (1 <= b <= 8 or b == 16):
                    raise ValueError(f"bits must be 1..8 or 16, got {b}")
        self._codecs: Dict[tuple, Any] = {}
        _core.Codec(head_dim, 2, rotation=rotation_mode)  # ValueError now, naming the accepted rotations
        warnings.warn("CompressedDynamicCache is the DIAGNOSTIC route: it holds dequantized dense K/V "
                      "(no memory saving)", stacklevel=2)
        super().__init__()
        self.layer_class_to_replicate = None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(_DiagnosticLayer(self, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def bits_for(self, layer_idx: int):
        if self._default_bits is not None:
            return self._default_bits
        if layer_idx not in self._layer_bits:
            raise ValueError(f"layer {layer_idx} is outside the model_config's {len(self._layer_bits)} layers")
        return self._layer_bits[layer_idx]

    def _codec(self, bits: int, layer: int, head: int, role: str):
        key = (bits, layer, head, role)
        c = self._codecs.get(key)
        if c is None:
            c = _core.Codec(self.head_dim, bits, rotation=self.rotation_mode, seed=self.seed, layer=layer,
                            head=head, role=role)
            self._codecs[key] = c
        return c

    def _roundtrip(self, x, layer_idx: int, role: str):
        kb, vb = self.bits_for(layer_idx)
        bits = kb if role == "key" else vb
        if bits == 16:
            return x
        b, h, t, d = x.shape
        if d != self.head_dim:
            raise ValueError(f"head_dim of the states is {d}, the cache was built for {self.head_dim}")
        xf = x.detach().to("cpu", torch.float32)
        out = torch.empty_like(xf)
        for head in range(h):
            c = self._codec(bits, layer_idx, head, role)
            rows = xf[:, head].reshape(-1, d).contiguous()
            out[:, head] = torch.from_numpy(c.decode(c.encode(rows))).view(b, t, d)
        return out.to(device=x.device, dtype=x.dtype)
