import numpy as np
import pytest

import turboquant as tq


def ref_attention(q, k, v, scale):
    # fp64 reference: q [qh, d], k/v [n, kvh, d], GQA.
    qh, d = q.shape
    kvh = k.shape[1]
    out = np.zeros((qh, d))
    for h in range(qh):
        g = h // (qh // kvh)
        logits = scale * (k[:, g, :].astype(np.float64) @ q[h].astype(np.float64))
        w = np.exp(logits - logits.max())
        out[h] = (w / w.sum()) @ v[:, g, :].astype(np.float64)
    return out


@pytest.mark.parametrize("preset", ["k4_v4", "k3_v3", "k16_v16"])
def test_append_and_decode_attention_match_reference(preset):
    layers, kvh, qh, d, n = 2, 2, 4, 64, 300
    cache = tq.KVCache(layers, kvh, d, preset=preset, max_sequences=2, recent_window=32, sink_tokens=4)
    rng = np.random.default_rng(1)
    for seq in range(2):
        # prefill, then a few single-token decode steps
        cache.append(1, seq, rng.standard_normal((n, kvh, d), dtype=np.float32),
                     rng.standard_normal((n, kvh, d), dtype=np.float32))
        for _ in range(5):
            cache.append(1, seq, rng.standard_normal((1, kvh, d), dtype=np.float32),
                         rng.standard_normal((1, kvh, d), dtype=np.float32))
        assert cache.length(1, seq) == n + 5
    assert cache.length(0, 0) == 0
    q = rng.standard_normal((2, qh, d), dtype=np.float32)
    out = cache.decode_attention(1, [0, 1], q).reshape(2, qh, d)
    for seq in range(2):
        k, v = cache.dequantize_for_diagnostics(1, seq)
        k = k.reshape(-1, kvh, d)
        v = v.reshape(-1, kvh, d)
        ref = ref_attention(q[seq], k, v, 1.0 / np.sqrt(d))
        nmse = np.sum((out[seq] - ref) ** 2) / np.sum(ref ** 2)
        assert nmse <= 1e-6, nmse
    assert cache.allocated_bytes > 0


def test_kv_cache_errors():
    with pytest.raises(ValueError, match="k4_v4"):
        tq.KVCache(1, 1, 64, preset="nope")
    cache = tq.KVCache(1, 2, 64)
    with pytest.raises(ValueError, match="float32"):
        cache.append(0, 0, np.zeros((3, 2, 64)), np.zeros((3, 2, 64)))
    with pytest.raises(ValueError, match="head_dim 64"):
        cache.append(0, 0, np.zeros((3, 2, 32), np.float32), np.zeros((3, 2, 32), np.float32))
    with pytest.raises(ValueError):
        cache.append(0, 5, np.zeros((3, 2, 64), np.float32), np.zeros((3, 2, 64), np.float32))
    assert cache.length(0, 0) == 0


def test_torch_tensors_in_cache():
    torch = pytest.importorskip("torch")
    cache = tq.KVCache(1, 1, 32, preset="k4_v4")
    k = torch.randn(40, 1, 32)
    cache.append(0, 0, k, torch.randn(40, 1, 32))
    out = cache.decode_attention(0, [0], torch.randn(1, 2, 32))
    assert out.shape == (64,) and np.isfinite(out).all()


def causal_ref(q, k, v, scale, query_start):
    # q [n, qh, d] at positions query_start.., k/v [L, kvh, d] -> [n, qh, d] fp64
    out = np.zeros(q.shape)
    for i in range(q.shape[0]):
        pos = query_start + i
        out[i] = ref_attention(q[i], k[: pos + 1], v[: pos + 1], scale)
    return out


@pytest.mark.parametrize("preset", ["k4_v4", "k8_v4", "turboquant35"])
def test_prefill_attention_matches_causal_reference(preset):
    kvh, qh, d, n = 2, 4, 64, 90
    cache = tq.KVCache(1, kvh, d, preset=preset, recent_window=16, sink_tokens=2, compress_chunk=8)
    rng = np.random.default_rng(2)
    k = rng.standard_normal((n, kvh, d), dtype=np.float32)
    v = rng.standard_normal((n, kvh, d), dtype=np.float32)
    cache.append(0, 0, k, v)
    kd, vd = (a.reshape(n, kvh, d) for a in cache.dequantize_for_diagnostics(0, 0))
    # the history really is compressed (decoded keys differ from the inputs)
    assert np.abs(kd[10:60] - k[10:60]).max() > 1e-3
    # whole prefill, then a chunk of the last 30 queries (chunked prefill)
    q = rng.standard_normal((n, qh, d), dtype=np.float32)
    for start in (0, 60):
        qs = np.ascontiguousarray(q[start:])
        out = cache.prefill_attention(0, 0, qs, query_start=start, scale=0.1).reshape(qs.shape)
        ref = causal_ref(qs, kd, vd, 0.1, start)
        assert np.sum((out - ref) ** 2) / np.sum(ref ** 2) <= 1e-6
    with pytest.raises(ValueError):
        cache.prefill_attention(0, 0, np.ascontiguousarray(q[:10]), query_start=n - 5)


def test_layer_presets_and_ledger():
    cache = tq.KVCache(3, 2, 64, preset="k4_v4", dense_first_layers=1, boundary_preset="k8_v8",
                       layer_presets={2: "k3_v3"}, recent_window=0, sink_tokens=0)
    assert [cache.layer_preset(i) for i in range(3)] == ["k8_v8", "k4_v4", "k3_v3"]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 2, 64), dtype=np.float32)
    cache.append(1, 0, x, x)
    led = cache.ledger()
    assert led["tokens"] == 64 * 2 and led["total"] == cache.allocated_bytes
    assert led["fp16_bytes"] == 64 * 2 * 64 * 4
    assert led["payload"] == 64 * 2 * 64 * (4 + 4) // 8
    with pytest.raises(ValueError, match="dense_type"):
        tq.KVCache(1, 1, 64, dense_type="f32")
