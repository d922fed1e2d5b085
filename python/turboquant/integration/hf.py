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

CUDA (``TurboQuantCache(..., device="cuda", max_cache_len=N)``, needs the
package built with the CUDA backend): each layer's K/V live in device pages
(``turboquant.cuda.DevicePagedLayer``, torch uint8 planes; one sequence per
batch row, block tables on the device). A prompt on an empty cache is
attended exactly with torch SDPA (causal) over the chunk's own K/V, which are
then written compressed by the GPU write kernel; decode steps (one new token)
run the fused GPU paged decode over the compressed pages. No dense history is
stored on either device. Not on CUDA (raises ``IntegrationError``): chunked
prefill on top of existing history (no GPU prefill kernel yet), soft-capping,
presets the GPU kernels do not handle (``turboquant.cuda.is_supported``).

Written against the transformers 5.x ``Cache``/``CacheLayerMixin``
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
            f"{what} is on {t.device} but this TurboQuantCache was built for the CPU: build it with "
            "device='cuda' and max_cache_len=... (CUDA backend), or run the model on the CPU")
    return t.detach().to(torch.float32).contiguous()


def _aligned(t: "torch.Tensor") -> "torch.Tensor":
    """The GPU kernels take 16-byte aligned rows: a view at an odd offset is copied."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


@dataclass
class CacheStats:
    """Counters of the production route (what ran, never estimates)."""

    appended_tokens: int = 0          # (layer, sequence) tokens appended
    prefill_calls: int = 0            # tq::PrefillAttention calls (one per sequence)
    decode_calls: int = 0             # tq::DecodeAttention calls (one per batch)
    max_kv_tokens_seen: int = 0       # most K/V tokens handed to the attention function in one call
    gpu_writes: int = 0               # CUDA: write-kernel launches (one per layer update)
    gpu_decode_calls: int = 0         # CUDA: fused paged decode launches (one per layer step)
    sdpa_prefill_calls: int = 0       # CUDA: exact SDPA over a first prompt chunk (one per layer)
    kernel_calls_by_layer: Dict[int, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# production route


class _KVHandle:
    """What a TurboQuantLayer.update returns in place of dense history."""

    __slots__ = ("layer", "new_tokens", "history")

    def __init__(self, layer: "TurboQuantLayer", new_tokens: int, history: int = 0):
        self.layer = layer
        self.new_tokens = new_tokens
        self.history = history  # tokens cached before this update


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
        if owner.on_cuda:
            return owner._cuda_update(self, key_states, value_states)
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
        if not self.is_initialized:
            return 0
        if self._owner.on_cuda:
            return self._owner._cuda_lengths[self.layer_idx]
        return self._owner._tq.length(self.layer_idx, 0)

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
    """Production transformers cache over our C++ caches.

    ``TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k4_v4"), max_batch_size=1)``;
    use it with a model whose attention implementation is ``"turboquant"``
    (``register()`` is called on import of this module)::

        model = LlamaForCausalLM(cfg, attn_implementation="turboquant")  # or model.set_attn_implementation
        cache = TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k8_v4"))
        out = generate(model, input_ids, cache, max_new_tokens=32)

    CPU (default): our ``KVCache`` (sinks, compressed history, dense recent
    ring, centering). CUDA (``device="cuda"``, ``max_cache_len`` required):
    one ``turboquant.cuda.DevicePagedLayer`` per layer, pages of
    ``block_size`` tokens, a pool of ``max_batch_size * ceil(max_cache_len /
    block_size)`` pages allocated here (torch uint8 tensors); every token is
    stored compressed (PagedKVCache semantics: the KVQuantConfig fields
    recent_window, sink_tokens, compress_chunk, center_keys, center_values and
    dense_type do not apply). Every layer's preset must pass
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
        if self.on_cuda:
            self._tq = None
            self._cuda_init(max_cache_len, block_size)
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

    # -- CUDA backend ---------------------------------------------------------

    def _cuda_init(self, max_cache_len: Optional[int], block_size: int) -> None:
        from .. import cuda as tqcuda

        if not max_cache_len or max_cache_len < 1:
            raise ValueError("TurboQuantCache on CUDA needs max_cache_len (prompt + new tokens): the device "
                             "page pool is allocated once, at construction")
        try:
            tqcuda.require()
        except tqcuda.CudaUnavailableError as e:
            raise IntegrationError(str(e)) from e
        gqa = 1
        if self.num_q_heads:
            if self.num_q_heads % self.num_kv_heads:
                raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
            gqa = self.num_q_heads // self.num_kv_heads
        for layer, preset in self.layer_presets.items():
            why = tqcuda.unsupported_reason(preset, self.head_dim, block_size=block_size, gqa_ratio=gqa)
            if why is not None:
                raise IntegrationError(
                    f"layer {layer}: preset '{preset}' (head_dim {self.head_dim}, block_size {block_size}, GQA "
                    f"{gqa}) is not supported by the CUDA backend: {why}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.block_size = block_size
        self.blocks_per_seq = -(-max_cache_len // block_size)
        self.capacity = self.blocks_per_seq * block_size  # tokens per sequence (whole pages)
        num_blocks = self.batch_capacity * self.blocks_per_seq
        # Host template: formats, codecs and means only (a pool of one page).
        self._host_template = _core.PagedKVCache(
            self.num_layers, self.num_kv_heads, self.head_dim, num_blocks=1, block_size=block_size,
            preset=self.kv_config.preset, seed=self.kv_config.seed, layer_presets=dict(self.layer_presets))
        self._dev_layers = [tqcuda.DevicePagedLayer(self._host_template, i, num_blocks, device=self.device)
                            for i in range(self.num_layers)]
        # Sequence i owns pages [i * blocks_per_seq, (i + 1) * blocks_per_seq).
        self._block_tables = torch.arange(num_blocks, dtype=torch.int32, device=self.device).view(
            self.batch_capacity, self.blocks_per_seq)
        self._seq_lens = torch.zeros(self.num_layers, self.batch_capacity, dtype=torch.int32, device=self.device)
        self._cuda_lengths = [0] * self.num_layers
        self._workspace = None
        self._workspace_key = None

    def _cuda_update(self, layer: "TurboQuantLayer", key_states, value_states):
        b, h, t, d = key_states.shape
        idx = layer.layer_idx
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if x.device != self.device:
                raise IntegrationError(f"layer {idx}: {name} is on {x.device}, the cache is on {self.device}")
        history = self._cuda_lengths[idx]
        if history > 0 and t > 1:
            raise IntegrationError(
                f"layer {idx}: chunked prefill on top of existing history ({history} cached tokens, {t} new) is "
                "not supported on CUDA: the GPU backend has no prefill kernel yet. Prefill the whole prompt in "
                "one forward on an empty cache, then decode one token per step (or use the CPU route)")
        if history + t > self.capacity:
            raise IntegrationError(
                f"layer {idx}: {history + t} tokens exceed the cache's max_cache_len (capacity {self.capacity})")
        dev = self._dev_layers[idx]
        pos = torch.arange(history, history + t, dtype=torch.int64, device=self.device)
        rows = torch.arange(b, dtype=torch.int64, device=self.device) * self.capacity
        slots = (rows[:, None] + pos[None, :]).reshape(-1)
        k = _aligned(key_states.detach().transpose(1, 2).reshape(b * t, h, d).contiguous())
        v = _aligned(value_states.detach().transpose(1, 2).reshape(b * t, h, d).contiguous())
        dev.write_slots(k, v, slots)
        self.stats.gpu_writes += 1
        self._cuda_lengths[idx] = history + t
        self._seq_lens[idx].fill_(history + t)
        if history == 0:
            # Once per layer per prompt: surface rows the write kernel skipped
            # (non-finite input, fp16 scale overflow) instead of dropping them.
            errs = dev.take_errors()
            if not errs["ok"]:
                raise IntegrationError(f"layer {idx}: the GPU write kernel skipped rows of the prompt: {errs}")
        self.stats.appended_tokens += b * t
        handle = _KVHandle(layer, t, history)
        key_states._tq_handle = handle
        value_states._tq_handle = handle
        return key_states, value_states

    def _cuda_attention(self, module, layer: "TurboQuantLayer", handle: _KVHandle, query, key, value,
                        attention_mask, scale: float, softcap: float, window: int):
        b, hq, q_len, d = query.shape
        idx = layer.layer_idx
        if softcap:
            raise IntegrationError("attention 'turboquant' on CUDA does not support logit soft-capping")
        if query.device != self.device:
            raise IntegrationError(f"query is on {query.device}, the cache is on {self.device}")
        length = handle.history + q_len
        if attention_mask is not None:
            _check_causal_mask(attention_mask, b, q_len, length, handle.history, window)
        if handle.history == 0:
            # First prompt chunk: exact causal attention over the chunk's own K/V
            # (they are also in the pages, compressed, for the decode steps).
            if window and window < q_len:
                raise IntegrationError("attention 'turboquant' on CUDA: sliding window shorter than the prompt")
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, is_causal=q_len > 1, scale=scale or None, enable_gqa=key.shape[1] != hq)
            self.stats.sdpa_prefill_calls += 1
            self.stats.prefill_calls += 1
            return out.transpose(1, 2).contiguous()
        if q_len != 1:  # (update() already refused this)
            raise IntegrationError("attention 'turboquant' on CUDA: only one new token per step after the prompt")
        q = _aligned(query[:, :, 0, :].contiguous())
        key_ws = (b, hq)
        if self._workspace_key != key_ws:
            self._workspace = self._dev_layers[idx].new_workspace(b, hq, self.capacity)
            self._workspace_key = key_ws
        out = self._dev_layers[idx].paged_decode(
            q, self._block_tables[:b], self._seq_lens[idx, :b], max_seq_len=self.capacity,
            workspace=self._workspace, scale=scale, window=window)
        self.stats.gpu_decode_calls += 1
        self.stats.decode_calls += 1
        return out.view(b, 1, hq, d)

    def take_write_errors(self) -> Dict[str, int]:
        """CUDA: synchronizes and sums the write kernel's error counters over the
        layers since the last call (all zero when every row was written)."""
        tot = {"out_of_range_slots": 0, "non_finite_inputs": 0, "scale_overflows": 0}
        for dev in self._dev_layers if self.on_cuda else ():
            e = dev.take_errors()
            for k in tot:
                tot[k] += e[k]
        return tot

    # -------------------------------------------------------------------------

    @property
    def core(self):
        """The underlying turboquant.KVCache (CPU) or the list of DevicePagedLayer (CUDA)."""
        return self._dev_layers if self.on_cuda else self._tq

    def reset(self):
        if self.on_cuda:
            self._cuda_lengths = [0] * self.num_layers
            self._seq_lens.zero_()
        else:
            for seq in range(self.batch_capacity):
                self._tq.free(seq)
        for layer in self.layers:
            layer.reset()

    def ledger(self) -> Dict[str, int]:
        """Exact bytes held by the C++ cache, by content (tq::KVLedger). CUDA:
        the device planes (allocated for max_cache_len), the decode workspace,
        and the tokens stored."""
        if self.on_cuda:
            planes = sum(dev.nbytes for dev in self._dev_layers)
            ws = self._workspace.numel() if self._workspace is not None else 0
            tokens = sum(self._cuda_lengths) * (self.layers[0].batch_size or 0) * self.num_kv_heads
            tables = self._block_tables.numel() * 4 + self._seq_lens.numel() * 4
            return {"planes": planes, "workspace": ws, "tables": tables, "tokens": tokens,
                    "head_dim": self.head_dim, "total": planes + ws + tables}
        return self._tq.ledger()

    def nbytes(self) -> int:
        return self.ledger()["total"] if self.on_cuda else self._tq.allocated_bytes

    def dense_equivalent_bytes(self, element_size: int = 2) -> int:
        """Bytes a dense cache of the same tokens would take (K and V, element_size bytes each)."""
        led = self.ledger()
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
    st = owner.stats
    if owner.on_cuda:
        st.max_kv_tokens_seen = max(st.max_kv_tokens_seen, key.shape[-2])
        st.kernel_calls_by_layer[layer.layer_idx] = st.kernel_calls_by_layer.get(layer.layer_idx, 0) + 1
        return owner._cuda_attention(module, layer, handle, query, key, value, attention_mask, scale, softcap,
                                     window), None
    if attention_mask is not None:
        _check_causal_mask(attention_mask, b, q_len, length, query_start, window)
    q = _cpu_f32(query, "query")
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
