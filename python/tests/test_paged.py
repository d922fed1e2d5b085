import numpy as np
import pytest

import turboquant as tq
from test_kv_cache import ref_attention


def test_paged_write_slots_and_decode_match_reference():
    kvh, qh, d, bs = 2, 4, 64, 16
    cache = tq.PagedKVCache(1, kvh, d, num_blocks=64, block_size=bs, preset="k4_v4")
    rng = np.random.default_rng(2)
    lens = [70, 33]
    seqs = [cache.add_sequence() for _ in lens]
    for s, n in zip(seqs, lens):
        slots = np.asarray(cache.reserve_slots(s, n), dtype=np.int64)
        cache.write_slots(0, rng.standard_normal((n, kvh, d), dtype=np.float32),
                          rng.standard_normal((n, kvh, d), dtype=np.float32), slots)
        assert cache.sequence_length(s) == n
    max_blocks = max(len(cache.block_table(s)) for s in seqs)
    tables = np.zeros((2, max_blocks), np.int32)
    for i, s in enumerate(seqs):
        bt = cache.block_table(s)
        tables[i, :len(bt)] = bt
    q = rng.standard_normal((2, qh, d), dtype=np.float32)
    out = cache.decode_attention(0, q, tables, np.asarray(lens, np.int32)).reshape(2, qh, d)
    for i, s in enumerate(seqs):
        k, v = cache.dequantize_for_diagnostics(0, s)
        ref = ref_attention(q[i], k.reshape(-1, kvh, d), v.reshape(-1, kvh, d), 1.0 / np.sqrt(d))
        assert np.sum((out[i] - ref) ** 2) / np.sum(ref ** 2) <= 1e-6
    with pytest.raises(ValueError, match="int64"):
        cache.write_slots(0, np.zeros((1, kvh, d), np.float32), np.zeros((1, kvh, d), np.float32),
                          np.zeros(1, np.int32))
    with pytest.raises(ValueError):
        cache.write_slots(0, np.zeros((1, kvh, d), np.float32), np.zeros((1, kvh, d), np.float32),
                          np.asarray([cache.capacity_slots], np.int64))
