"""``DevicePagedCompressedKVCache``: the vLLM-compatible layer on CUDA
tensors, one ``turboquant.cuda.DevicePagedLayer`` a layer (pages on the
GPU, written and attended by the GPU kernels).

* ``reshape_and_cache(layer, key, value, slot_mapping)``: the GPU write
  kernel, by vLLM's slot mapping (slot = page * block_size + offset; < 0
  skipped);
* ``attention(layer, query, meta, out=...)``: one entry point for a mixed
  batch in vLLM's metadata vocabulary (``AttentionMetadata``: query_start_loc,
  seq_lens, block_table, max_query_len, and the host counts num_decodes /
  num_decode_tokens of ``batch.TurboQuantMetadataBuilder``). The leading
  ``num_decodes`` one-token sequences run the paged decode kernel; the other
  sequences (prefills, chunks over history, speculative verifications) run
  the paged extend kernel, causal within each chunk. The call reads nothing
  back from the device and allocates nothing when ``out`` is given: the
  workspace and the extend's cu_seqlens buffer come from the plan made at
  construction for the maximum sizes (``max_num_seqs``,
  ``max_num_batched_tokens``, ``max_model_len``), and every kernel gets
  max_seq_len = ``max_model_len`` (so a captured CUDA graph stays valid as
  sequences grow). It can therefore be captured in a CUDA graph.

Per-layer formats follow ``KVQuantConfig`` (``policy_from_config``, as the
CPU ``PagedCompressedKVCache``); every layer's preset must be one the GPU
kernels handle (IntegrationError otherwise, naming the layer). Centering
means (``means={layer: (key_mean, value_mean)}``, float32 [num_kv_heads,
head_size] or None, e.g. from ``calibration.channel_means``) are set on each
device layer before its first write, as on the CPU cache.

``make_layer(layer, num_blocks)`` builds a layer's store; the default is the
GPU layer, tests pass a stand-in with its methods (tests/paged_reference.py).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ... import _core
from ..common import IntegrationError, KVQuantConfig
from ..cuda_common import aligned, check_cuda_presets, gqa_ratio, require_cuda, sum_write_errors
from .attention import AttentionMetadata
from .registry import layer_formats

Means = Dict[int, Tuple[Optional["torch.Tensor"], Optional["torch.Tensor"]]]


def _spec_lengths(max_tokens: int):
    """Query lengths the workspace sweep tries: 1..8 (decode, speculative
    verification), the powers of two and max_tokens itself."""
    out = set(range(1, min(8, max_tokens) + 1)) | {max_tokens}
    q = 16
    while q < max_tokens:
        out.add(q)
        q *= 2
    return sorted(out)


class DevicePagedCompressedKVCache:
    """Paged compressed K/V of every attention layer on a CUDA device; see
    the module doc. ``num_q_heads`` plans the kernels (GQA 1..8);
    ``max_num_seqs`` / ``max_num_batched_tokens`` / ``max_model_len`` bound
    every batch (vLLM's scheduler limits of the same names)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, num_q_heads: int, *, num_blocks: int,
                 block_size: int = 16, cache_dtype: str = "tq4", config: Optional[KVQuantConfig] = None,
                 means: Optional[Means] = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int = 8192, device: Any = "cuda",
                 make_layer: Optional[Callable[[int, int], Any]] = None):
        preset, config, self.layer_presets = layer_formats(cache_dtype, config, num_layers)
        self.cache_dtype, self.preset, self.config = cache_dtype, preset, config
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.num_q_heads, self.block_size, self.num_blocks = num_q_heads, block_size, num_blocks
        gqa = gqa_ratio(num_q_heads, num_kv_heads)
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len), ("num_blocks", num_blocks)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.max_num_seqs, self.max_num_batched_tokens = int(max_num_seqs), int(max_num_batched_tokens)
        self.max_model_len = int(max_model_len)
        dev = torch.device(device)
        if make_layer is None:
            if dev.type != "cuda":
                raise IntegrationError(f"DevicePagedCompressedKVCache needs a CUDA device, got {dev} (the CPU "
                                       "layer is PagedCompressedKVCache)")
            require_cuda()
            check_cuda_presets(self.layer_presets, head_size, block_size, gqa)
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            make_layer = self._gpu_layers(dev)
        self.device = dev
        self.layers = [make_layer(i, num_blocks) for i in range(num_layers)]
        self.means: Means = {}
        for layer, (km, vm) in (means or {}).items():
            self._set_means(layer, km, vm)
        self._plan()
        self.tokens_written = 0

    def _gpu_layers(self, dev: "torch.device") -> Callable[[int, int], Any]:
        from ... import cuda as tqcuda

        # Host template: formats and codecs only (a pool of one page).
        self.template = _core.PagedKVCache(self.num_layers, self.num_kv_heads, self.head_size, num_blocks=1,
                                           block_size=self.block_size, preset=self.preset, seed=self.config.seed,
                                           layer_presets=dict(self.layer_presets))
        return lambda i, n: tqcuda.DevicePagedLayer(self.template, i, n, device=dev)

    def _set_means(self, layer: int, km, vm) -> None:
        """A one-token chunk equal to the means: the layer's mean rule (sum in
        double / tokens, rounded to float) gives them back exactly."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"means: layer {layer} outside [0, {self.num_layers})")
        shape = (self.num_kv_heads, self.head_size)
        got = []
        for name, m in (("key_mean", km), ("value_mean", vm)):
            if m is not None:
                m = torch.as_tensor(m, dtype=torch.float32)
                if tuple(m.shape) != shape:
                    raise ValueError(f"means[{layer}].{name} must be [{shape[0]}, {shape[1]}], got {tuple(m.shape)}")
            got.append(m)
        if got[0] is None and got[1] is None:
            return
        k, v = (torch.zeros(shape) if m is None else m for m in got)
        self.layers[layer].set_means_from_chunk(aligned(k[None].to(self.device).contiguous()),
                                                aligned(v[None].to(self.device).contiguous()),
                                                center_keys=got[0] is not None, center_values=got[1] is not None)
        self.means[layer] = (got[0], got[1])

    def _plan(self) -> None:
        """Workspace bytes: the largest any batch within the bounds needs,
        over each distinct preset's decode plans (1..max_num_seqs sequences)
        and extend plans (sequences x query lengths of _spec_lengths, fewest
        and most tokens); the call checks its own shape's need against it."""
        hq, cap, mt = self.num_q_heads, self.max_model_len, self.max_num_batched_tokens
        need, seen = 1, set()
        for i, dev in enumerate(self.layers):
            if self.layer_presets[i] in seen:
                continue
            seen.add(self.layer_presets[i])
            for b in range(1, self.max_num_seqs + 1):
                need = max(need, dev.plan_decode(b, hq, cap)["workspace_bytes"])
                for q in _spec_lengths(min(mt, cap)):
                    for total in {q, min(b * q, mt)}:
                        if q <= total <= b * q:
                            need = max(need, dev.plan_extend(b, hq, total, q, cap)["workspace_bytes"])
        self.workspace = torch.empty(need, dtype=torch.uint8, device=self.device)
        self.cu_seqlens = torch.zeros(self.max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self._need: Dict[tuple, int] = {}  # (layer preset, kind, batch, total_q, max_q_len) -> bytes

    def _check_workspace(self, layer: int, kind: str, b: int, total: int, q: int) -> None:
        key = (self.layer_presets[layer], kind, b, total, q)
        n = self._need.get(key)
        if n is None:
            dev = self.layers[layer]
            plan = (dev.plan_decode(b, self.num_q_heads, self.max_model_len) if kind == "decode"
                    else dev.plan_extend(b, self.num_q_heads, total, q, self.max_model_len))
            n = self._need[key] = plan["workspace_bytes"]
        if n > self.workspace.numel():
            raise IntegrationError(f"layer {layer}: a {kind} of {b} sequences / {total} tokens (longest {q}) needs "
                                   f"{n} workspace bytes, the plan holds {self.workspace.numel()}")

    # -- vLLM-style ops --------------------------------------------------------

    def _check_device(self, t: "torch.Tensor", name: str) -> None:
        if not torch.is_tensor(t) or t.device != self.device:
            where = t.device if torch.is_tensor(t) else type(t).__name__
            raise IntegrationError(f"{name} is on {where}, the device cache is on {self.device} (nothing is "
                                   "copied between devices)")

    def reshape_and_cache(self, layer: int, key, value, slot_mapping) -> None:
        """key, value: [num_tokens, num_kv_heads, head_size] (or [num_tokens,
        num_kv_heads * head_size]) f16/bf16/f32 on the cache's device;
        slot_mapping int64 [n <= num_tokens]: token t < n goes to its slot
        (< 0: skipped), tokens beyond n are vLLM's padding. A strided key or
        value (a view into a fused QKV tensor) is copied to contiguous rows."""
        for t, name in ((key, "key"), (value, "value"), (slot_mapping, "slot_mapping")):
            self._check_device(t, name)
        h, d = self.num_kv_heads, self.head_size
        n = slot_mapping.shape[0]
        if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
            raise ValueError(f"slot_mapping must be 1-D int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
        if key.shape[0] < n or key.shape != value.shape or key[0].numel() != h * d:
            raise ValueError(f"key/value must be [num_tokens >= {n}, {h}, {d}], got {tuple(key.shape)} / "
                             f"{tuple(value.shape)}")
        if n == 0:
            return
        k = aligned(key[:n].reshape(n, h, d).contiguous())
        v = aligned(value[:n].reshape(n, h, d).contiguous())
        self.layers[layer].write_slots(k, v, slot_mapping)
        self.tokens_written += n

    def attention(self, layer: int, query, meta: AttentionMetadata, *, out=None, scale: float = 0.0,
                  window: int = 0, softcap: float = 0.0) -> "torch.Tensor":
        """query [num_tokens, num_q_heads, head_size] (or [num_tokens,
        num_q_heads * head_size]) f16/bf16/f32, num_tokens >= num_actual_tokens
        (rows beyond are vLLM's padding); K/V of this step already written
        (reshape_and_cache). Returns ``out`` (like query; allocated only when
        None) with rows [0, num_actual_tokens) attended and padded rows zeroed.
        scale 0: 1/sqrt(head_size); window > 0: the last ``window`` keys;
        softcap > 0: extend only (decode rows then go to the extend kernel)."""
        hq, d = self.num_q_heads, self.head_size
        self._check_device(query, "query")
        for t, name in ((meta.query_start_loc, "query_start_loc"), (meta.seq_lens, "seq_lens"),
                        (meta.block_table, "block_table")):
            self._check_device(t, name)
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        T = query.shape[0]
        q = query.view(T, hq, d)
        if out is None:
            out = torch.empty(q.shape, dtype=query.dtype, device=query.device)
        o = out.view(T, hq, d)
        n = int(meta.num_actual_tokens)
        nr = meta.query_start_loc.shape[0] - 1
        nd = 0 if softcap else int(meta.num_decodes)
        if not (0 <= n <= T and 0 <= nd <= nr <= self.max_num_seqs and n <= self.max_num_batched_tokens):
            raise ValueError(f"batch out of bounds: num_actual_tokens {n} (query rows {T}, plan "
                             f"{self.max_num_batched_tokens}), sequences {nr} (plan {self.max_num_seqs}), "
                             f"num_decodes {nd}")
        if nd and int(meta.num_decode_tokens) != nd:
            raise ValueError(f"num_decode_tokens ({meta.num_decode_tokens}) must equal num_decodes ({nd}): decode "
                             "rows bring one query token each")
        if meta.seq_lens.shape[0] < nr or meta.block_table.shape[0] < nr:
            raise ValueError(f"seq_lens / block_table must have a row per sequence ({nr}), got "
                             f"{tuple(meta.seq_lens.shape)} / {tuple(meta.block_table.shape)}")
        if meta.block_table.shape[1] * self.block_size < self.max_model_len:
            raise ValueError(f"block_table has {meta.block_table.shape[1]} pages a sequence: fewer than "
                             f"max_model_len {self.max_model_len} / block_size {self.block_size} (vLLM's tables "
                             "are that wide)")
        if meta.max_seq_len > self.max_model_len:
            raise ValueError(f"max_seq_len {meta.max_seq_len} exceeds the plan's max_model_len {self.max_model_len}")
        if softcap and self.means.get(layer, (None, None))[0] is not None:
            raise IntegrationError(f"layer {layer}: soft-capped logits with centred keys: the GPU kernels cannot "
                                   "combine them (centring drops q.mean from every logit: softmax-invariant, not "
                                   "tanh-invariant); give this layer no key mean")
        dev = self.layers[layer]
        cap = self.max_model_len
        if nd:
            self._check_workspace(layer, "decode", nd, nd, 1)
            dev.paged_decode(q[:nd], meta.block_table[:nd], meta.seq_lens[:nd], max_seq_len=cap,
                             workspace=self.workspace, out=o[:nd], scale=scale, window=window)
        ne, te = nr - nd, n - nd
        if ne > 0 and te > 0:
            mq = min(max(int(meta.max_query_len), 1), te)
            self._check_workspace(layer, "extend", ne, te, mq)
            cu = self.cu_seqlens[:ne + 1]
            torch.sub(meta.query_start_loc[nd:nr + 1], meta.query_start_loc[nd], out=cu)
            dev.paged_extend(q[nd:n], cu, meta.block_table[nd:nr], meta.seq_lens[nd:nr], max_q_len=mq,
                             max_seq_len=cap, workspace=self.workspace, out=o[nd:n], scale=scale, softcap=softcap,
                             window=window)
        if n < T:
            o[n:].zero_()
        return out

    # -- accounting --------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's page planes (plus the plan's workspace: ``workspace_bytes``)."""
        return sum(dev.nbytes for dev in self.layers)

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.numel() + self.cu_seqlens.numel() * 4

    def take_write_errors(self) -> Dict[str, int]:
        """Synchronizes; rows the write kernel skipped since the last call, summed over layers."""
        return sum_write_errors(self.layers)
