"""Torch fp64 references of the CUDA paged layer (turboquant.cuda.DevicePagedLayer).

``attention_reference``: the extend/decode kernels' contract on given K/V
(include/tq/cuda.h, ExtendArgs): query i of sequence b, which brings q_len_b
queries and has kv_len_b tokens, sits at position kv_len_b - q_len_b + i and
attends to the keys at positions <= its own (window W > 0: the last W of
them); a query at a negative position sees no key and outputs 0; GQA maps
query head j to KV head j // (num_q_heads / num_kv_heads); soft-cap applies
softcap * tanh(logit / softcap) to the scaled logits.

``ReferencePagedLayer``: DevicePagedLayer's methods over dense fp64 pages
(no quantization) on any torch device, so the HF CUDA route's bookkeeping
(slots, lengths, block tables, cu_seqlens, padding, crop, means) runs and is
checked on the CPU: with exact pages the route must reproduce dense
attention.
"""
from __future__ import annotations

import math

import torch


def attention_reference(q, cu_seqlens, seq_k, seq_v, *, scale=0.0, softcap=0.0, window=0):
    """q [total_q, num_q_heads, d]; cu_seqlens [batch + 1] (ints or a tensor);
    seq_k[b], seq_v[b]: [kv_len_b, num_kv_heads, d]. Returns fp64 [total_q,
    num_q_heads, d] on q's device."""
    cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    total_q, hq, d = q.shape
    out = torch.zeros(total_q, hq, d, dtype=torch.float64, device=q.device)
    s = scale if scale > 0 else 1.0 / math.sqrt(d)
    for b in range(len(cu) - 1):
        q_len = cu[b + 1] - cu[b]
        k = seq_k[b].to(device=q.device, dtype=torch.float64)
        v = seq_v[b].to(device=q.device, dtype=torch.float64)
        kv_len, h = k.shape[0], k.shape[1]
        if q_len == 0:
            continue
        group = hq // h
        qb = q[cu[b]:cu[b + 1]].to(torch.float64)                        # [q_len, hq, d]
        kk = k.repeat_interleave(group, dim=1)                            # [kv_len, hq, d]
        vv = v.repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", qb, kk) * s
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        pos = kv_len - q_len + torch.arange(q_len, device=q.device)
        key = torch.arange(kv_len, device=q.device)
        allowed = key[None, :] <= pos[:, None]
        if window > 0:
            allowed &= key[None, :] > pos[:, None] - window
        logits = logits.masked_fill(~allowed[None], float("-inf"))
        p = torch.softmax(logits, dim=-1).nan_to_num(0.0)                 # rows with no key: 0
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", p, vv)
    return out


class ReferencePagedLayer:
    """DevicePagedLayer's interface on dense fp64 pages; see the module doc.

    Pages: ``num_blocks`` of ``block_size`` slots (slot = page * block_size +
    offset), each [num_kv_heads, head_dim]. Means: like the GPU layer, set
    once from a chunk before the first write (``set_means_from_chunk``
    afterwards raises, as the C++ layer does), subtracted on write, the value
    mean added back on read; ``mean_chunks`` records the token count of each
    chunk the means came from."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, device="cpu"):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = torch.device(device)
        n = num_blocks * block_size
        self.k = torch.zeros(n, num_kv_heads, head_dim, dtype=torch.float64, device=self.device)
        self.v = torch.zeros_like(self.k)
        self.reset()
        self.calls = {"write": 0, "decode": 0, "extend": 0, "copy": 0}

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * 8

    def reset(self):
        self.k_mean = self.v_mean = None
        self.written = False
        self.mean_chunks = []

    def plane_bytes(self):
        return {"k_codes": self.k.numel() * 8, "k_meta": 0, "v_codes": self.v.numel() * 8, "v_meta": 0}

    def take_errors(self):
        return {"out_of_range_slots": 0, "non_finite_inputs": 0, "scale_overflows": 0, "first_bad_token": -1,
                "bad_page_pairs": 0, "ok": True}

    def set_means_from_chunk(self, k, v, *, center_keys=True, center_values=False):
        if self.written:
            raise RuntimeError("SetMeansFromChunk: pages were already written without these means")
        self.k_mean = k.to(torch.float64).mean(0) if center_keys else None
        self.v_mean = v.to(torch.float64).mean(0) if center_values else None
        self.mean_chunks.append(k.shape[0])

    def write_slots(self, k, v, slot_mapping):
        assert k.shape == v.shape and k.shape[1:] == (self.num_kv_heads, self.head_dim), k.shape
        assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],)
        self.written = True
        self.calls["write"] += 1
        ok = (slot_mapping >= 0) & (slot_mapping < self.k.shape[0])
        kk, vv = k[ok].to(torch.float64), v[ok].to(torch.float64)
        if self.k_mean is not None:
            kk = kk - self.k_mean
        if self.v_mean is not None:
            vv = vv - self.v_mean
        self.k[slot_mapping[ok]] = kk
        self.v[slot_mapping[ok]] = vv

    def copy_blocks(self, pairs):
        self.calls["copy"] += 1
        bs = self.block_size
        for src, dst in pairs.tolist():
            self.k[dst * bs:(dst + 1) * bs] = self.k[src * bs:(src + 1) * bs]
            self.v[dst * bs:(dst + 1) * bs] = self.v[src * bs:(src + 1) * bs]

    def sequence(self, table, length):
        """fp64 K, V [length, num_kv_heads, head_dim] of a sequence, means added back."""
        tok = torch.arange(length, device=self.device)
        slots = table.to(self.device).long()[tok // self.block_size] * self.block_size + tok % self.block_size
        k, v = self.k[slots], self.v[slots]
        if self.k_mean is not None:
            k = k + self.k_mean
        if self.v_mean is not None:
            v = v + self.v_mean
        return k, v

    def plan_decode(self, batch, num_q_heads, max_seq_len):
        return {"splits": 1, "tokens_per_split": max_seq_len, "workspace_bytes": 0}

    def plan_extend(self, batch, num_q_heads, total_q, max_q_len, max_seq_len, *, kernel="auto"):
        assert 1 <= max_q_len <= max_seq_len and max_q_len <= total_q <= batch * max_q_len
        return {"decode_route": False, "kernel": "tile", "rows_per_cta": 64, "q_tiles": 1, "splits": 1,
                "tokens_per_split": max_seq_len, "workspace_bytes": 0}

    def _attend(self, q, cu, block_tables, seq_lens, max_seq_len, scale, softcap, window):
        lens = [int(x) for x in seq_lens.tolist()]
        assert max(lens) <= max_seq_len <= block_tables.shape[1] * self.block_size
        if softcap and self.k_mean is not None:
            raise RuntimeError("PagedExtend: soft-cap with key means is not supported")
        kv = [self.sequence(block_tables[b], n) for b, n in enumerate(lens)]
        out = attention_reference(q, cu, [k for k, _ in kv], [v for _, v in kv], scale=scale, softcap=softcap,
                                  window=window)
        return out.to(q.dtype)

    def paged_decode(self, q, block_tables, seq_lens, *, max_seq_len, workspace=None, out=None, scale=0.0,
                     window=0):
        self.calls["decode"] += 1
        b = q.shape[0]
        return _into(out, self._attend(q, list(range(b + 1)), block_tables, seq_lens, max_seq_len, scale, 0.0,
                                       window))

    def paged_extend(self, q, cu_seqlens_q, block_tables, seq_lens, *, max_q_len, max_seq_len, workspace=None,
                     out=None, scale=0.0, softcap=0.0, window=0, kernel="auto"):
        self.calls["extend"] += 1
        cu = cu_seqlens_q.tolist()
        assert cu[0] == 0 and cu[-1] == q.shape[0] and max(b - a for a, b in zip(cu, cu[1:])) <= max_q_len
        return _into(out, self._attend(q, cu, block_tables, seq_lens, max_seq_len, scale, softcap, window))


def _into(out, res):
    """Like the GPU layer: the result lands in ``out`` when one is given."""
    if out is None:
        return res
    assert out.shape == res.shape, (out.shape, res.shape)
    return out.copy_(res)
