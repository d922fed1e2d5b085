"""The CUDA route of ``TurboQuantCache``: each decoder layer's K/V in device
pages (``turboquant.cuda.DevicePagedLayer``) attended by the GPU kernels.

Layout: row b of the batch owns pages ``[b * P, (b + 1) * P)`` of every
layer's pool (P = ceil(max_cache_len / block_size), allocated at
construction); ``block_tables`` [max_batch, P] int32 names them;
``seq_lens`` [num_layers, max_batch] int32 holds each row's stored (real)
tokens per layer. Both live on the device; a step without padding reads
nothing back to the host.

A step (``attend``): the new tokens' K/V are written compressed by the GPU
write kernel (padded positions get slot -1: not written), then

* first chunk of a layer (empty history) without soft-cap: exact attention
  over the chunk's own K/V with torch SDPA (causal, the window and the padding
  as a mask);
* one new real token per row, no soft-cap: the fused paged decode;
* anything else (later chunks of a prompt, a second prompt over the history,
  speculative verification, soft-capped models): the fused paged extend over
  the pages, the chunk included. The extend's query rows are the batch's
  [batch, q_len] grid (cu_seqlens_q = 0, q_len, 2 q_len, ...): a row's leading
  padded queries sit at negative positions and get output 0.

Centering: with ``center_keys`` / ``center_values`` a layer's means are the
per-head means of its first chunk's real tokens, all rows together (one
mean per layer and head: the device layer has no per-sequence means, unlike
the CPU KVCache's per-sequence ones).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .. import _core
from .common import IntegrationError
from .cuda_common import aligned as _aligned
from .cuda_common import check_cuda_presets, gqa_ratio, require_cuda, sum_write_errors
from .hf_masks import ChunkLayout, layout_mask


def _check_capacity(max_cache_len) -> None:
    if not max_cache_len or max_cache_len < 1:
        raise ValueError("TurboQuantCache on CUDA needs max_cache_len (prompt + new tokens, padded positions "
                         "included): the device page pool is allocated once, at construction")


def _rows(x: "torch.Tensor") -> "torch.Tensor":
    """[batch, heads, t, d] -> contiguous, aligned [batch * t, heads, d]."""
    b, h, t, d = x.shape
    return _aligned(x.detach().transpose(1, 2).reshape(b * t, h, d).contiguous())


class PagedRoute:
    """Device pages and kernels serving one ``TurboQuantCache``.

    ``make_layer(layer, num_blocks)`` returns the layer's paged store (a
    ``turboquant.cuda.DevicePagedLayer``, or in tests an object with its
    methods); ``device`` is where block tables, lengths and the step's
    tensors live. ``for_cuda`` builds the real one."""

    def __init__(self, owner, max_cache_len: int, block_size: int, *, device: "torch.device",
                 make_layer: Callable[[int, int], object]):
        _check_capacity(max_cache_len)
        self.owner = owner
        self.device = device
        self.block_size = block_size
        self.blocks_per_seq = -(-max_cache_len // block_size)
        self.capacity = self.blocks_per_seq * block_size  # tokens a row holds (whole pages)
        num_blocks = owner.batch_capacity * self.blocks_per_seq
        self.layers = [make_layer(i, num_blocks) for i in range(owner.num_layers)]
        self.block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device).view(
            owner.batch_capacity, self.blocks_per_seq)
        self.seq_lens = torch.zeros(owner.num_layers, owner.batch_capacity, dtype=torch.int32, device=device)
        self.row_base = torch.arange(owner.batch_capacity, dtype=torch.int64, device=device) * self.capacity
        self.written = [False] * owner.num_layers  # the layer's first write (and means) happened
        self.workspace: Optional[torch.Tensor] = None
        self._plans: Dict[tuple, int] = {}         # (layer, kind, batch, q_len) -> workspace bytes
        self._cu: Dict[tuple, torch.Tensor] = {}   # (batch, q_len) -> cu_seqlens_q

    @classmethod
    def for_cuda(cls, owner, max_cache_len: Optional[int], block_size: int, device: "torch.device",
                 softcap: float) -> "PagedRoute":
        """Checks the backend, every layer's preset and the soft-cap/centering
        combination, then allocates the device pools."""
        from .. import cuda as tqcuda

        _check_capacity(max_cache_len)
        require_cuda()
        gqa = gqa_ratio(owner.num_q_heads, owner.num_kv_heads) if owner.num_q_heads else 1
        check_cuda_presets(owner.layer_presets, owner.head_dim, block_size, gqa)
        if softcap and owner.kv_config.center_keys:
            raise IntegrationError(_SOFTCAP_CENTERING)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cfg = owner.kv_config
        # Host template: formats and codecs only (a pool of one page).
        template = _core.PagedKVCache(owner.num_layers, owner.num_kv_heads, owner.head_dim, num_blocks=1,
                                      block_size=block_size, preset=cfg.preset, seed=cfg.seed,
                                      layer_presets=dict(owner.layer_presets))
        route = cls(owner, max_cache_len, block_size, device=device,
                    make_layer=lambda i, n: tqcuda.DevicePagedLayer(template, i, n, device=device))
        route.template = template
        return route

    # -- bookkeeping ----------------------------------------------------------

    def check_step(self, layer_idx: int, history: int, new_tokens: int, x: "torch.Tensor", name: str) -> None:
        if x.device != self.device:
            raise IntegrationError(f"layer {layer_idx}: {name} is on {x.device}, the cache is on {self.device}")
        if history + new_tokens > self.capacity:
            raise IntegrationError(
                f"layer {layer_idx}: {history + new_tokens} positions exceed the cache's max_cache_len (capacity "
                f"{self.capacity} tokens a row, padded positions included)")

    def crop(self, layer_idx: int, tokens: int) -> None:
        """Drops the last ``tokens`` positions of every row of the layer: the
        stored lengths go down (never below 0); pages keep their bytes and are
        overwritten by the next writes."""
        self.seq_lens[layer_idx].sub_(tokens).clamp_(min=0)

    def reset(self) -> None:
        self.seq_lens.zero_()
        for i, dev in enumerate(self.layers):
            if self.written[i]:
                dev.reset()  # new means may be taken from the next first chunk
        self.written = [False] * len(self.layers)

    def take_write_errors(self) -> Dict[str, int]:
        return sum_write_errors(self.layers)

    def plane_bytes(self) -> int:
        return sum(dev.nbytes for dev in self.layers)

    # -- a step ---------------------------------------------------------------

    def _workspace(self, nbytes: int) -> "torch.Tensor":
        if self.workspace is None or self.workspace.numel() < nbytes:
            self.workspace = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return self.workspace

    def _cu_seqlens(self, b: int, t: int) -> "torch.Tensor":
        cu = self._cu.get((b, t))
        if cu is None:
            cu = torch.arange(b + 1, dtype=torch.int32, device=self.device) * t
            self._cu[(b, t)] = cu
        return cu

    def write(self, layer_idx: int, keys: "torch.Tensor", values: "torch.Tensor", layout: ChunkLayout) -> None:
        """Writes the real new tokens (keys/values [batch, kv_heads, t, d]) at
        each row's next slots; the first write of a layer sets its means."""
        b, h, t, d = keys.shape
        if layout.real_tokens(t) == 0:
            return
        st = self.owner.stats
        dev = self.layers[layer_idx]
        k, v = _rows(keys), _rows(values)
        cfg = self.owner.kv_config
        first = not self.written[layer_idx]
        if first and (cfg.center_keys or cfg.center_values):
            if layout.real is None:
                kr, vr = k, v
            else:
                sel = layout.real.reshape(-1)
                kr, vr = k[sel].contiguous(), v[sel].contiguous()
            dev.set_means_from_chunk(kr, vr, center_keys=cfg.center_keys, center_values=cfg.center_values)
        seq = self.seq_lens[layer_idx, :b]
        base = self.row_base[:b, None] + seq[:, None].to(torch.int64)
        if layout.real is None:
            slots = base + torch.arange(t, dtype=torch.int64, device=self.device)[None, :]
            seq += t
        else:
            real = layout.real
            slots = torch.where(real, base + real.to(torch.int64).cumsum(1) - 1, torch.full_like(base, -1))
            seq += real.sum(1).to(torch.int32)
        dev.write_slots(k, v, slots.reshape(-1).contiguous())
        st.gpu_writes += 1
        self.written[layer_idx] = True
        if first:
            # Once per layer and prompt: rows the write kernel skipped
            # (non-finite input, fp16 scale overflow) raise instead of vanishing.
            errs = dev.take_errors()
            if not errs["ok"]:
                raise IntegrationError(f"layer {layer_idx}: the GPU write kernel skipped rows of the prompt: {errs}")

    def attend(self, layer_idx: int, history: int, query, keys, values, layout: ChunkLayout, mask,
               scale: float, softcap: float, window: int) -> "torch.Tensor":
        """Writes the step's K/V, then attends. query [batch, q_heads, t, d];
        returns [batch, t, q_heads, d] in the query's dtype."""
        b, hq, t, d = query.shape
        st = self.owner.stats
        if query.device != self.device:
            raise IntegrationError(f"query is on {query.device}, the cache is on {self.device}")
        if softcap and self.owner.kv_config.center_keys:
            raise IntegrationError(_SOFTCAP_CENTERING)
        self.write(layer_idx, keys, values, layout)
        dev = self.layers[layer_idx]
        if history == 0 and not softcap:
            # First chunk: exact attention over its own K/V (also in the pages,
            # compressed, for the later steps).
            m = mask if mask is not None else layout_mask(layout, b, t, window, self.device)
            if m is not None and m.dtype != torch.bool:
                m = m == 0
            out = torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, attn_mask=m, is_causal=m is None and t > 1, scale=scale or None,
                enable_gqa=keys.shape[1] != hq)
            out = out.transpose(1, 2)
            if layout.real is not None:  # padded queries see no key: output 0 (SDPA would give NaN)
                out = out.masked_fill(~layout.real[:, :, None, None], 0)
            st.sdpa_prefill_calls += 1
            st.prefill_calls += 1
            return out.contiguous()
        seq = self.seq_lens[layer_idx, :b]
        tables = self.block_tables[:b]
        if t == 1 and layout.all_real and not softcap:
            key = (layer_idx, "decode", b, hq)
            if key not in self._plans:
                self._plans[key] = dev.plan_decode(b, hq, self.capacity)["workspace_bytes"]
            out = dev.paged_decode(_aligned(query[:, :, 0, :].contiguous()), tables, seq, max_seq_len=self.capacity,
                                   workspace=self._workspace(self._plans[key]), scale=scale, window=window)
            st.gpu_decode_calls += 1
            st.decode_calls += 1
            return out.view(b, 1, hq, d)
        key = (layer_idx, "extend", b, hq, t)
        if key not in self._plans:
            self._plans[key] = dev.plan_extend(b, hq, b * t, t, self.capacity)["workspace_bytes"]
        out = dev.paged_extend(_rows(query), self._cu_seqlens(b, t), tables, seq, max_q_len=t,
                               max_seq_len=self.capacity, workspace=self._workspace(self._plans[key]), scale=scale,
                               softcap=softcap, window=window)
        st.gpu_extend_calls += 1
        st.prefill_calls += 1
        return out.view(b, t, hq, d)


_SOFTCAP_CENTERING = (
    "the model soft-caps attention logits, which the GPU kernels cannot combine with centred keys (centring drops "
    "q.mean from every logit: softmax-invariant, not tanh-invariant); build the cache with "
    "KVQuantConfig(center_keys=False) on CUDA")
