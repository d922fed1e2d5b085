"""The attention masks the "turboquant" attention function accepts, and what
a step's mask says about its new tokens.

Accepted: causal masks (query at position p sees the keys at positions <= p;
with a sliding window W only those > p - W), optionally with left padding.
Positions are HF's: the cache's length (``get_seq_length``) counts padded
positions, and a step's queries sit at ``history .. history + q_len - 1``.

Left padding: in row b the first ``pads[b]`` positions are padding, every
later position is a real token. Padded positions are never stored and never
attended; a query at a padded position gets an output row of 0. A padded
position after a real token of its row (right padding, holes, a mask that
hides stored tokens) is refused with ``IntegrationError``, as is any other
mask: nothing is silently ignored.

Because padding only precedes a row's real tokens, a real token's position in
its row's storage is its HF position minus ``pads[b]``, and a sliding window
counted in HF positions covers the same real tokens as one counted in stored
positions: the kernels get the window unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .common import IntegrationError


@dataclass
class ChunkLayout:
    """Which of a step's q_len new tokens are real, per row."""

    lead: List[int]                 # [batch]: padded positions at the start of this step's tokens
    pads: List[int]                 # [batch]: padded positions of the row after this step (pads before + lead)
    real: Optional[torch.Tensor]    # [batch, q_len] bool on the mask's device; None when every new token is real

    @property
    def all_real(self) -> bool:
        return self.real is None

    def real_tokens(self, q_len: int) -> int:
        return sum(q_len - n for n in self.lead)


def _refuse(detail: str) -> IntegrationError:
    return IntegrationError(
        "attention 'turboquant' supports causal masks (with the model's sliding window) and left padding only: "
        + detail)


def chunk_layout(mask, batch: int, q_len: int, history: int, window: int, pads: Sequence[int]) -> ChunkLayout:
    """Checks ``mask`` ([batch or 1, heads or 1, q_len, history + q_len], bool
    True = attend, or additive float 0 = attend) against the causal/window
    pattern with left padding, given ``pads`` (each row's padded positions
    before this step, all among the first ``history``). None = causal, every
    new token real. Raises IntegrationError naming what does not fit.

    One host synchronization when a mask is given (its check and the
    per-row counts come back together)."""
    if len(pads) != batch:
        raise IntegrationError(f"padding state has {len(pads)} rows, the step has {batch}")
    if mask is None:
        return ChunkLayout(lead=[0] * batch, pads=list(pads), real=None)
    kv_len = history + q_len
    if (not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[0] not in (1, batch)
            or mask.shape[-2] != q_len or mask.shape[-1] != kv_len):
        raise _refuse(f"got {type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}, expected a tensor "
                      f"[{batch}, 1, {q_len}, {kv_len}]")
    allowed = mask if mask.dtype == torch.bool else (mask == 0)
    dev = allowed.device
    heads = allowed.shape[1]
    allowed = allowed.expand(batch, heads, q_len, kv_len)
    i = torch.arange(q_len, device=dev)
    # A new token is real iff its own query may attend to it (the diagonal):
    # causal and window always allow it, only padding removes it.
    diag = allowed[:, 0, i, history + i]                       # [batch, q_len]
    lead = (diag.to(torch.int32).cumsum(1) == 0).sum(1)        # leading padded tokens of each row
    new_pads = torch.tensor(list(pads), dtype=torch.int64).to(dev, non_blocking=True) + lead
    pos = history + i                                          # [q_len] query positions
    kv = torch.arange(kv_len, device=dev)
    expect = (kv[None, None, :] <= pos[None, :, None]) & (kv[None, None, :] >= new_pads[:, None, None])
    if window:
        expect &= kv[None, None, :] > pos[None, :, None] - window
    ok = (allowed == expect[:, None]).all()
    got = torch.cat([ok.view(1).to(torch.int64), lead.to(torch.int64)]).cpu().tolist()  # the one sync
    if not got[0]:
        raise _refuse("the mask differs from the causal pattern with each row's padding before its first real "
                      "token (right padding, padding after real tokens, or a custom mask)")
    lead_list = [int(n) for n in got[1:]]
    if any(p < history and n > 0 for p, n in zip(pads, lead_list)):
        raise _refuse("a row that already holds real tokens gets padded positions (padding must precede a row's "
                      "first real token)")
    if not any(lead_list):
        return ChunkLayout(lead=lead_list, pads=list(pads), real=None)
    real = i[None, :] >= lead.to(dev)[:, None]
    return ChunkLayout(lead=lead_list, pads=[p + n for p, n in zip(pads, lead_list)], real=real)


def layout_mask(layout: ChunkLayout, batch: int, q_len: int, window: int, device) -> Optional[torch.Tensor]:
    """The bool mask [batch, 1, q_len, q_len] of a first chunk (empty history)
    over its own keys under ``layout``; None when plain causal (is_causal)
    serves: every token real and no window shorter than the chunk."""
    if layout.all_real and not (window and window < q_len):
        return None
    i = torch.arange(q_len, device=device)
    m = i[None, :] <= i[:, None]
    if window:
        m &= i[None, :] > i[:, None] - window
    m = m[None, None].expand(batch, 1, q_len, q_len)
    if layout.real is not None:
        m = m & layout.real.to(device)[:, None, None, :]
    return m
