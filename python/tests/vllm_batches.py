"""vLLM-shaped mixed batches for the device-cache tests (CPU stand-in and
GPU): sequences given as (cached tokens, new tokens), decode rows first as
vLLM's runner orders them, pages shuffled, block tables as wide as
max_model_len / block_size."""
import torch

from turboquant.integration import vllm as V

# 3 decode rows, a prompt chunk with no history, a chunk over history, and
# the verification of 4 draft tokens (the last accepted token + 4 drafts).
MIXED = [(40, 1), (7, 1), (100, 1), (0, 20), (30, 9), (60, 5)]


def make_mixed(seqs, *, kvh, qh, d, bs, max_model_len, num_blocks, seed, pad_rows=2, device="cpu"):
    """Returns (meta, K/V per sequence [ctx + new, kvh, d] fp32, history
    slots per sequence, q [tokens + pad_rows, qh, d]); meta has num_decodes
    from the builder (vLLM's CommonAttentionMetadata attribute names)."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = -(-max_model_len // bs)
    tables, lens, qsl, slots, hist, kv = [], [], [0], [], [], []
    for ctx, new in seqs:
        n = ctx + new
        pages = [perm.pop() for _ in range(-(-n // bs))]
        tables.append(pages + [0] * (width - len(pages)))
        lens.append(n)
        qsl.append(qsl[-1] + new)
        slot = [pages[t // bs] * bs + t % bs for t in range(n)]
        hist.append(slot[:ctx])
        slots += slot[ctx:]
        kv.append((torch.randn(n, kvh, d, generator=g) + 0.5, torch.randn(n, kvh, d, generator=g)))
    q = torch.randn(qsl[-1] + pad_rows, qh, d, generator=g)
    i32 = dict(dtype=torch.int32, device=device)
    cam = SimpleNamespace(query_start_loc=torch.tensor(qsl, **i32), query_start_loc_cpu=torch.tensor(qsl),
                          seq_lens=torch.tensor(lens, **i32), num_actual_tokens=qsl[-1],
                          max_query_len=max(n for _, n in seqs), max_seq_len=max(lens),
                          block_table_tensor=torch.tensor(tables, **i32),
                          slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device))
    return V.TurboQuantMetadataBuilder().build(0, cam), kv, hist, q


def write_all(cache, layer, seqs, kv, hist, meta, device="cpu", dtype=torch.float32):
    """History of every sequence first (one write each), then the step's new
    tokens in one write by meta.slot_mapping, as vLLM does."""
    for (ctx, _), (k, v), h in zip(seqs, kv, hist):
        if ctx:
            cache.reshape_and_cache(layer, k[:ctx].to(device, dtype), v[:ctx].to(device, dtype),
                                    torch.tensor(h, dtype=torch.int64, device=device))
    newk = torch.cat([k[ctx:] for (ctx, _), (k, _v) in zip(seqs, kv)])
    newv = torch.cat([v[ctx:] for (ctx, _), (_k, v) in zip(seqs, kv)])
    cache.reshape_and_cache(layer, newk.to(device, dtype), newv.to(device, dtype), meta.slot_mapping)


def nmse(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return float(((got - want) ** 2).sum() / (want ** 2).sum())
