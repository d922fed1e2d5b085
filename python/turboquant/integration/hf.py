"""HuggingFace transformers integration.

Two routes:

* **Production** (`TurboQuantCache` + the attention function registered as
  ``"turboquant"``): K/V are appended to our C++ ``KVCache`` (sinks, compressed
  history, dense recent ring) and attention runs over the compressed cache
  with ``tq::PrefillAttention`` (prompt / chunked prefill) and
  ``tq::DecodeAttention`` (one new token). No dense K/V history is ever built:
  the cache layers hold no ``keys``/``values`` tensors, and the attention
  function only ever receives the current step's new K/V (as a handle to the
  cache) and raises if it is handed anything else.
* **Diagnostic** (`CompressedDynamicCache`, the seed API): wraps transformers'
  ``DynamicCache`` and stores quantized-then-dequantized K/V as dense tensors,
  so that any attention implementation sees the quantization error. It
  materializes dense history by design: a quality probe, refused in
  production mode (``ProductionModeError``).

CPU only: CUDA tensors raise ``IntegrationError`` (the package has no CUDA
backend). Written against the transformers 5.x ``Cache``/``CacheLayerMixin``
API (tested with transformers 5.24 and 5.17, torch 2.15 CPU).
"""
from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

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


def _cpu_f32(t: "torch.Tensor", what: str) -> "torch.Tensor":
    if t.device.type != "cpu":
        raise IntegrationError(
            f"{what} is on {t.device}: the turboquant Python package has no CUDA backend; "
            "run the model on the CPU (or use the diagnostic CompressedDynamicCache)")
    return t.detach().to(torch.float32).contiguous()


@dataclass
class CacheStats:
    """Counters of the production route (what ran, never estimates)."""

    appended_tokens: int = 0          # (layer, sequence) tokens appended
    prefill_calls: int = 0            # tq::PrefillAttention calls (one per sequence)
    decode_calls: int = 0             # tq::DecodeAttention calls (one per batch)
    max_kv_tokens_seen: int = 0       # most K/V tokens handed to the attention function in one call
    kernel_calls_by_layer: Dict[int, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# production route


class _KVHandle:
    """What a TurboQuantLayer.update returns in place of dense history."""

    __slots__ = ("layer", "new_tokens")

    def __init__(self, layer: "TurboQuantLayer", new_tokens: int):
        self.layer = layer
        self.new_tokens = new_tokens


class TurboQuantLayer(CacheLayerMixin):
    """One decoder layer of a TurboQuantCache. Holds no dense tensors:
    ``keys`` and ``values`` stay None; the tokens live in the C++ cache."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: "TurboQuantCache", layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        self.batch_size = None
        self.dtype = None
        self.device = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch_size = key_states.shape[0]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states/value_states: [batch, num_kv_heads, new_tokens, head_dim].
        Appends them to the compressed cache; returns the new-token tensors
        tagged with a handle (never the history)."""
        owner = self._owner
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
        k = _cpu_f32(key_states, "key_states")
        v = _cpu_f32(value_states, "value_states")
        for i in range(b):
            owner._tq.append(self.layer_idx, i, k[i].transpose(0, 1).contiguous(),
                             v[i].transpose(0, 1).contiguous())
        owner.stats.appended_tokens += b * t
        handle = _KVHandle(self, t)
        key_states._tq_handle = handle
        value_states._tq_handle = handle
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self._owner._tq.length(self.layer_idx, 0) if self.is_initialized else 0

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

    def crop(self, tokens_to_remove: int) -> None:
        raise IntegrationError("TurboQuantCache cannot crop (compressed history is append-only)")

    def reorder_cache(self, beam_idx) -> None:
        raise IntegrationError("TurboQuantCache does not support beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise IntegrationError("TurboQuantCache does not support batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        raise IntegrationError("TurboQuantCache does not support batch_select_indices")


class TurboQuantCache(Cache):
    """Production transformers cache over our C++ ``KVCache``.

    ``TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k4_v4"), max_batch_size=1)``;
    use it with a model whose attention implementation is ``"turboquant"``
    (``register()`` is called on import of this module)::

        model = LlamaForCausalLM(cfg, attn_implementation="turboquant")  # or model.set_attn_implementation
        cache = TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k8_v4"))
        out = generate(model, input_ids, cache, max_new_tokens=32)

    Per-layer presets follow ``policy_from_config(kv_config, num_layers)``.
    """

    def __init__(self, config=None, *, kv_config: Optional[KVQuantConfig] = None,
                 preset: Optional[str] = None, max_batch_size: int = 1, threads: int = 1,
                 num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None):
        if config is not None:
            shape = model_shape(config)
            num_layers = num_layers or shape["num_layers"]
            num_kv_heads = num_kv_heads or shape["num_kv_heads"]
            head_dim = head_dim or shape["head_dim"]
        if not (num_layers and num_kv_heads and head_dim):
            raise ValueError("give a model config, or num_layers, num_kv_heads and head_dim")
        kv_config = kv_config or KVQuantConfig()
        if preset is not None:
            kv_config = KVQuantConfig(**{**kv_config.__dict__, "preset": preset})
        self.kv_config = kv_config
        self.layer_presets = policy_from_config(kv_config, num_layers)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.batch_capacity = max_batch_size  # (Cache.max_batch_size is a read-only property in some 5.x)
        self.threads = threads
        self.stats = CacheStats()
        self._tq = _core.KVCache(
            num_layers, num_kv_heads, head_dim, preset=kv_config.preset, max_sequences=max_batch_size,
            recent_window=kv_config.recent_window, sink_tokens=kv_config.sink_tokens,
            compress_chunk=kv_config.compress_chunk, center_keys=kv_config.center_keys,
            center_values=kv_config.center_values, seed=kv_config.seed, dense_type=kv_config.dense_type,
            layer_presets=dict(self.layer_presets))
        super().__init__(layers=[TurboQuantLayer(self, i) for i in range(num_layers)])

    route = "production"

    @property
    def core(self):
        """The underlying turboquant.KVCache."""
        return self._tq

    def reset(self):
        for seq in range(self.batch_capacity):
            self._tq.free(seq)
        for layer in self.layers:
            layer.reset()

    def ledger(self) -> Dict[str, int]:
        """Exact bytes held by the C++ cache, by content (tq::KVLedger)."""
        return self._tq.ledger()

    def nbytes(self) -> int:
        return self._tq.allocated_bytes

    def dense_equivalent_bytes(self, element_size: int = 2) -> int:
        """Bytes a dense cache of the same tokens would take (K and V, element_size bytes each)."""
        led = self._tq.ledger()
        return led["tokens"] * led["head_dim"] * 2 * element_size


def turboquant_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                 **kwargs):
    """transformers attention function (registered as ``"turboquant"``).

    query: [batch, num_q_heads, q_len, head_dim]; key/value must be the handles
    returned by ``TurboQuantLayer.update``. Returns ([batch, q_len, num_q_heads, head_dim], None).
    """
    handle = getattr(key, "_tq_handle", None)
    if handle is None:
        raise IntegrationError(
            "attention 'turboquant' got dense K/V instead of a TurboQuantCache handle: pass "
            "cache=TurboQuantCache(model.config, ...) (generate(..., cache) does) and keep use_cache on; "
            "it never densifies a cache")
    layer: TurboQuantLayer = handle.layer
    owner = layer._owner
    if dropout and module.training:
        raise IntegrationError("attention 'turboquant' is inference-only (dropout > 0 in training mode)")
    b, hq, q_len, d = query.shape
    if q_len != handle.new_tokens:
        raise IntegrationError(f"query length {q_len} != new K/V tokens {handle.new_tokens}")
    length = layer.get_seq_length()
    query_start = length - q_len
    scale = float(scaling) if scaling is not None else 0.0
    softcap = float(kwargs.get("softcap") or getattr(getattr(module, "config", None), "attn_logit_softcapping", None) or 0.0)
    window = int(kwargs.get("sliding_window") or 0)
    if attention_mask is not None:
        _check_causal_mask(attention_mask, b, q_len, length, query_start, window)
    q = _cpu_f32(query, "query")
    st = owner.stats
    st.max_kv_tokens_seen = max(st.max_kv_tokens_seen, key.shape[-2])
    st.kernel_calls_by_layer[layer.layer_idx] = st.kernel_calls_by_layer.get(layer.layer_idx, 0) + 1
    if q_len == 1:
        flat = owner._tq.decode_attention(layer.layer_idx, list(range(b)), q[:, :, 0, :].contiguous(),
                                          scale=scale, softcap=softcap, window=window, threads=owner.threads)
        out = torch.from_numpy(flat).view(b, 1, hq, d)
        st.decode_calls += 1
    else:
        outs = []
        for i in range(b):
            flat = owner._tq.prefill_attention(layer.layer_idx, i, q[i].transpose(0, 1).contiguous(),
                                               query_start=query_start, scale=scale, softcap=softcap,
                                               window=window, threads=owner.threads)
            outs.append(torch.from_numpy(flat).view(q_len, hq, d))
            st.prefill_calls += 1
        out = torch.stack(outs)
    return out.to(device=query.device, dtype=query.dtype), None


def _check_causal_mask(mask, b, q_len, kv_len, query_start, window=0):
    """Accepts only the causal mask our kernels compute (with a sliding
    window W: keys in (pos - W, pos]); padding or custom masks raise instead
    of being ignored."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] != kv_len or mask.shape[-2] != q_len:
        raise IntegrationError(
            f"attention 'turboquant' supports causal masks only; got {type(mask).__name__} "
            f"{tuple(getattr(mask, 'shape', ()))} (expected [batch, 1, {q_len}, {kv_len}])")
    pos = torch.arange(q_len).unsqueeze(1) + query_start
    keys = torch.arange(kv_len).unsqueeze(0)
    causal = keys <= pos
    if window:
        causal &= keys > pos - window
    allowed = mask if mask.dtype == torch.bool else (mask == 0)
    if not torch.equal(allowed.to("cpu").expand(b, allowed.shape[1], q_len, kv_len),
                       causal.expand(b, allowed.shape[1], q_len, kv_len)):
        raise IntegrationError(
            "attention 'turboquant' supports causal masks only (no padding): run batch items of equal "
            "length, or one at a time")


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
