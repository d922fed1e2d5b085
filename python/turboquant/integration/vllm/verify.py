"""``verify``: compressed paged attention against dense fp64 attention on
synthetic K/V of a model's shapes, the check behind the CLI's ``verify``."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import torch

from ... import _core
from .cache import PagedCompressedKVCache
from .registry import page_geometry, resolve_cache_dtype


def default_min_cosine(cache_dtype: str, head_size: int) -> float:
    """verify's default bar on the worst output cosine, from the narrower
    component's bits per value b (payload + metadata): b >= 8: 0.995,
    b >= 4: 0.93, b >= 3: 0.75, else 0.2; 0.1 when keys use QJL (prod)
    codes (turboquant25/35: their score variance makes single rows noisy). Measured on verify's synthetic K/V at
    head sizes 64 and 128 over 3 seeds, with margin (docs/PYTHON.md)."""
    lay = _core.preset_row_layout(resolve_cache_dtype(cache_dtype), head_size)
    bits = min(8.0 * (lay[c + "_payload_bytes"] + lay[c + "_meta_bytes"]) / head_size for c in ("key", "value"))
    bars = [(8, 0.995), (4, 0.93), (3, 0.75), (0, 0.2)]
    if "prod" in lay["key_format"]:
        return 0.1
    return next(bar for lo, bar in bars if bits >= lo)


def _synthetic_kv(gen, tokens, h, d):
    scale = torch.exp(0.3 * torch.randn(h, d, generator=gen))
    scale[:, : max(1, d // 32)] *= 3.0  # a few outlier channels, like real keys
    mean = 0.3 * torch.randn(h, d, generator=gen)
    k = torch.randn(tokens, h, d, generator=gen) * scale + mean
    v = torch.randn(tokens, h, d, generator=gen)
    return k, v


def verify(cache_dtype: str, *, num_q_heads: int, num_kv_heads: int, head_size: int,
           seq_lens: Sequence[int] = (1, 33, 300), block_size: int = 16, num_layers: int = 1,
           metadata: Optional[Dict[str, Any]] = None, min_cosine: Optional[float] = None, seed: int = 0,
           prefill_tokens: int = 8) -> Dict[str, Any]:
    """Compares compressed attention (reshape_and_cache into shuffled pages,
    then decode of every sequence and chunked-prefill rows of its last
    ``prefill_tokens`` tokens) with dense fp64 attention on the same K/V
    (synthetic: Gaussian keys with a per-channel scale, a few 4x outlier
    channels and a mean offset; Gaussian values). Returns a report with the
    worst output cosine, the NMSE, bytes of the pages used vs dense fp16, and
    ``passed`` = worst cosine >= min_cosine."""
    if min_cosine is None:
        min_cosine = default_min_cosine(cache_dtype, head_size)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, -(-n // block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    store = PagedCompressedKVCache(num_layers, num_kv_heads, head_size, num_blocks=num_blocks,
                                   block_size=block_size, cache_dtype=cache_dtype, metadata=metadata)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_seq)
    bt = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    o = 0
    for i, nb in enumerate(blocks_per_seq):
        bt[i, :nb] = perm[o:o + nb]
        o += nb
    worst, num, den = 1.0, 0.0, 0.0
    scale = 1.0 / math.sqrt(head_size)
    for layer in range(num_layers):
        kv = []
        for i, n in enumerate(seq_lens):
            k, v = _synthetic_kv(gen, n, num_kv_heads, head_size)
            t = torch.arange(n)
            slots = (bt[i, t // block_size].to(torch.int64) * block_size + t % block_size)
            store.reshape_and_cache(layer, k, v, slots)
            kv.append((k, v))
        rows_q, rows_bt, rows_len, refs = [], [], [], []
        for i, n in enumerate(seq_lens):
            k, v = kv[i]
            for p in range(max(0, n - prefill_tokens), n):
                q = torch.randn(num_q_heads, head_size, generator=gen)
                rows_q.append(q)
                rows_bt.append(bt[i])
                rows_len.append(p + 1)
                refs.append(fp64_attention_row(q, k[: p + 1], v[: p + 1], scale))
        out = store.paged_decode(layer, torch.stack(rows_q), torch.stack(rows_bt),
                                 torch.tensor(rows_len, dtype=torch.int32), scale=scale).to(torch.float64)
        ref = torch.stack(refs)
        cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
        worst = min(worst, float(cos.min()))
        num += float(((out - ref) ** 2).sum())
        den += float((ref ** 2).sum())
    geom = page_geometry(cache_dtype, head_size, num_kv_heads, block_size)
    tokens = sum(seq_lens)
    return {
        "cache_dtype": cache_dtype, "preset": store.preset, "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads, "head_size": head_size, "num_layers": num_layers,
        "seq_lens": list(seq_lens), "block_size": block_size, "rows": len(rows_q) * num_layers,
        "worst_cosine": worst, "nmse": num / den if den else 0.0, "min_cosine": min_cosine,
        "bytes_per_token_head": _core.preset_bytes_per_token_head(store.preset, head_size),
        "page_bytes_used": geom["bytes_per_block"] * num_blocks * num_layers,
        "dense_fp16_bytes": tokens * num_kv_heads * head_size * 4 * num_layers,
        "passed": worst >= min_cosine,
    }


def fp64_attention_row(q, k, v, scale):
    """fp64 dense attention of one query [Hq, d] over k/v [n, Hkv, d] -> [Hq, d]."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, -1)
    return torch.einsum("hn,nhd->hd", w, v)
