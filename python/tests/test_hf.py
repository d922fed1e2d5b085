"""HuggingFace integration: production route (TurboQuantCache + attention
"turboquant") and the diagnostic CompressedDynamicCache, on small Llama and
Qwen2 models built from configs with seeded random weights (no downloads)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

import turboquant as tq  # noqa: E402
from turboquant.integration import hf  # noqa: E402
from turboquant.integration.common import (  # noqa: E402
    IntegrationError,
    KVQuantConfig,
    ProductionModeError,
)
from hf_runs import kvcfg, make_gemma2, make_model, padded_vs_alone  # noqa: E402  (tests/hf_runs.py)


def run_steps(model, ids, cache, steps):
    """Prefill ids, then `steps` single-token decodes of fixed tokens; logits [len+steps, vocab]."""
    with torch.no_grad():
        out = [model(ids[:, :-steps], use_cache=True, **{hf.cache_kwarg(model): cache}).logits[0]]
        for i in range(steps, 0, -1):
            tok = ids[:, -i:][:, :1]
            out.append(model(tok, use_cache=True, **{hf.cache_kwarg(model): cache}).logits[0])
    return torch.cat(out)


def dense_logits(model, ids):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model(ids).logits[0]


def cosines(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_production_route_f16_storage_equals_dense(arch):
    # k16_v16 keeps every token as fp16: the compressed-attention plumbing
    # (positions, GQA, causal prefill, decode, biases) must reproduce dense.
    model = make_model(arch)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(1))
    ref = dense_logits(model, ids)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = hf.TurboQuantCache(model.config, kv_config=kvcfg("k16_v16"))
    got = run_steps(model, ids, cache, steps=6)
    assert torch.allclose(got, ref, atol=2e-3 * ref.abs().max().item()), (got - ref).abs().max()
    assert cache.stats.prefill_calls == 2 and cache.stats.decode_calls == 2 * 6
    assert cache.get_seq_length() == 120


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_production_route_quality_by_preset(arch):
    model = make_model(arch)
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    ref = dense_logits(model, ids)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    mean = {}
    for preset in ["k8_v8", "turboquant_k8v4", "k4_v4", "k2_v2"]:
        cache = hf.TurboQuantCache(model.config, kv_config=kvcfg(preset))
        got = run_steps(model, ids, cache, steps=4)
        c = cosines(got, ref)
        mean[preset] = c.mean().item()
        if preset == "k8_v8":  # 8-bit keys and values: every position
            assert c.min().item() >= 0.99, c.min()
        # the history really went through the codec: not identical to dense
        assert (got - ref).abs().max().item() > 1e-4
    # 4-bit values dominate the error on this random 2-layer model
    assert mean["turboquant_k8v4"] >= 0.98, mean
    assert mean["k4_v4"] >= 0.97, mean
    assert mean["k2_v2"] < mean["k4_v4"] < mean["k8_v8"], mean


def test_generation_end_to_end_and_batch():
    model = make_model("llama")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("sdpa")
    dense = hf.generate(model, ids, DynamicCache(), max_new_tokens=10)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = hf.TurboQuantCache(model.config, kv_config=kvcfg("k16_v16"), max_batch_size=2)
    got = hf.generate(model, ids, cache, max_new_tokens=10)
    assert got.shape == (2, 50)
    assert torch.equal(got, dense)  # fp16 storage: greedy tokens identical
    # the last generated token is never fed back, so 49 tokens are cached
    assert cache.get_seq_length() == 49 and cache.core.length(1, 1) == 49
    # compressed preset, batch of 2 == each sequence alone (sequences are independent)
    cfg = kvcfg("k4_v4")
    both = hf.generate(model, ids, hf.TurboQuantCache(model.config, kv_config=cfg, max_batch_size=2),
                       max_new_tokens=6)
    for i in range(2):
        alone = hf.generate(model, ids[i:i + 1], hf.TurboQuantCache(model.config, kv_config=cfg),
                            max_new_tokens=6)
        assert torch.equal(both[i], alone[0])


def test_bytes_held_vs_dense():
    model = make_model("qwen2")  # head_dim 128
    ids = torch.randint(0, 256, (1, 600), generator=torch.Generator().manual_seed(4))
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k4_v4", recent_window=64))
    with torch.no_grad():
        model(ids, **{hf.cache_kwarg(model): cache})
    led = cache.ledger()
    assert led["total"] == cache.nbytes() > 0
    assert led["tokens"] == 2 * 1 * 600  # layers x kv heads x tokens
    dense_f16 = cache.dense_equivalent_bytes(2)
    assert dense_f16 == 2 * 600 * 128 * 2 * 2
    # 4-bit history (+ 4 sinks and a 64..96-token fp16 ring, means and codec tables)
    per_token = tq.preset_bytes_per_token_head("k4_v4", 128)
    assert led["payload"] + led["metadata"] <= 2 * 600 * per_token
    assert cache.nbytes() <= 0.45 * dense_f16, (cache.nbytes(), dense_f16)
    # the model runs in fp32: its dense torch history would be 2x that again
    assert cache.nbytes() <= 0.225 * cache.dense_equivalent_bytes(4)


def test_dense_history_never_materialized(monkeypatch):
    model = make_model("llama")
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(5))
    seen = []
    real = hf.turboquant_attention_forward

    def spy(module, query, key, value, attention_mask, **kw):
        seen.append((query.shape[-2], key.shape[-2], value.shape[-2]))
        return real(module, query, key, value, attention_mask, **kw)

    transformers.AttentionInterface.register(hf.ATTENTION_NAME, spy)
    try:
        model.set_attn_implementation(hf.ATTENTION_NAME)
        cache = hf.TurboQuantCache(model.config, kv_config=kvcfg("k4_v4"))
        out = hf.generate(model, ids, cache, max_new_tokens=8)
    finally:
        hf.register()
    assert out.shape == (1, 72)
    assert len(seen) == 2 * 8  # 2 layers x (prefill + 7 decode steps)
    # the attention function only ever sees this step's new K/V, never history
    assert all(q == k == v for q, k, v in seen), seen
    assert max(k for _, k, _ in seen) == 64
    for layer in cache.layers:
        assert layer.keys is None and layer.values is None
    tensors = [v for layer in cache.layers for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    assert tensors == []
    assert cache.stats.max_kv_tokens_seen == 64


def test_production_route_refuses_to_densify():
    model = make_model("llama")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(6))
    model.set_attn_implementation(hf.ATTENTION_NAME)
    with torch.no_grad():
        with pytest.raises(IntegrationError, match="TurboQuantCache"):
            model(ids, use_cache=True, **{hf.cache_kwarg(model): DynamicCache()})
        with pytest.raises(IntegrationError, match="TurboQuantCache"):
            model(ids, use_cache=False)
        # padding other than left padding is not silently ignored: right
        # padding and a hole after real tokens raise, before anything is stored
        for pad in (slice(13, 16), slice(5, 8)):
            cache = hf.TurboQuantCache(model.config, kv_config=kvcfg("k4_v4"), max_batch_size=2)
            mask = torch.ones(2, 16, dtype=torch.long)
            mask[1, pad] = 0
            with pytest.raises(IntegrationError, match="causal masks .* and left padding only"):
                model(ids.repeat(2, 1), attention_mask=mask, use_cache=True, **{hf.cache_kwarg(model): cache})
            assert cache.core.length(0, 0) == 0 and cache.core.length(0, 1) == 0
        cache = hf.TurboQuantCache(model.config, kv_config=kvcfg("k4_v4"))
        model(ids, **{hf.cache_kwarg(model): cache})
        with pytest.raises(IntegrationError, match="crop"):
            cache.crop(-2)
    with pytest.raises(ProductionModeError):
        hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="kp4_v4", production=True))
    # another attention implementation never stores the K/V: the next step says so
    model.set_attn_implementation("sdpa")
    cache = hf.TurboQuantCache(model.config, kv_config=kvcfg("k4_v4"))
    with torch.no_grad():
        model(ids, **{hf.cache_kwarg(model): cache})
        with pytest.raises(IntegrationError, match="never attended"):
            model(ids[:, :1], **{hf.cache_kwarg(model): cache})


def test_per_layer_policy_from_config():
    model = make_model("llama")
    cfg = KVQuantConfig(preset="k3_v3", dense_first_layers=1, boundary_preset="k8_v8", recent_window=0,
                        sink_tokens=0)
    cache = hf.TurboQuantCache(model.config, kv_config=cfg)
    assert cache.layer_presets == {0: "k8_v8", 1: "k3_v3"}
    assert [cache.core.layer_preset(i) for i in range(2)] == ["k8_v8", "k3_v3"]
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(7))
    model.set_attn_implementation(hf.ATTENTION_NAME)
    with torch.no_grad():
        model(ids, **{hf.cache_kwarg(model): cache})
    kv_heads, d = 2, 64
    expect = 64 * kv_heads * (tq.preset_bytes_per_token_head("k8_v8", d) + tq.preset_bytes_per_token_head("k3_v3", d))
    led = cache.ledger()
    assert led["payload"] + led["metadata"] == expect


def test_diagnostic_compressed_dynamic_cache():
    model = make_model("llama")
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(8))
    ref = dense_logits(model, ids)
    with pytest.warns(UserWarning, match="DIAGNOSTIC"):
        cache = hf.CompressedDynamicCache(head_dim=64, bits=4, seed=1)
    assert cache.route == "diagnostic"
    with torch.no_grad():
        got = model(ids, **{hf.cache_kwarg(model): cache}).logits[0]
    # it holds dequantized dense tensors: that is what makes it diagnostic
    k = cache.layers[0].keys
    assert k.shape == (1, 2, 48, 64)
    c = cosines(got, ref)
    assert 0.95 <= c.mean().item() < 0.99999
    with pytest.warns(UserWarning):
        exact = hf.CompressedDynamicCache(head_dim=64, k_bits=16, v_bits=16)
    with torch.no_grad():
        assert torch.allclose(model(ids, **{hf.cache_kwarg(model): exact}).logits[0], ref, atol=1e-5)
    with pytest.warns(UserWarning):
        per_layer = hf.CompressedDynamicCache(head_dim=64, model_config=KVQuantConfig(
            preset="k2_v2", layer_presets={0: "k8_v8"}), config=model.config)
    assert per_layer.bits_for(0) == (8, 8) and per_layer.bits_for(1) == (2, 2)
    out = hf.generate(model, ids, per_layer, max_new_tokens=4)
    assert out.shape == (1, 52)
    with pytest.raises(ProductionModeError):
        hf.CompressedDynamicCache(head_dim=64, model_config=KVQuantConfig(production=True), num_layers=2)
    with pytest.raises(ValueError, match="bits"):
        hf.CompressedDynamicCache(head_dim=64, bits=9)
    with pytest.raises(ValueError, match="accepted: rht, block, haar"):
        hf.CompressedDynamicCache(head_dim=64, bits=4, rotation_mode="dense")
    with pytest.warns(UserWarning):
        haar = hf.CompressedDynamicCache(head_dim=64, bits=4, rotation_mode="haar")
    with torch.no_grad():
        assert 0.95 <= cosines(model(ids, **{hf.cache_kwarg(model): haar}).logits[0], ref).mean().item() < 0.99999
    with pytest.raises(ValueError, match="k\\{K\\}_v\\{V\\}"):
        hf.CompressedDynamicCache(head_dim=64, model_config=KVQuantConfig(preset="kivi4"), num_layers=2)


def test_softcap_sliding_window_and_scaling_reach_the_kernels():
    """Gemma2: logit soft-cap, alternating sliding-window layers (window 16 <
    60 tokens) and query_pre_attn_scalar scaling; fp16 storage must equal
    eager attention, so each option must reach tq::Prefill/DecodeAttention."""
    model = make_gemma2()
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(9))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(ids).logits[0]
        dense = hf.generate(model, ids[:, :40], DynamicCache(config=model.config), max_new_tokens=20)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = hf.TurboQuantCache(model.config, kv_config=kvcfg("k16_v16"))
    got = run_steps(model, ids, cache, steps=10)
    assert (got - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
    assert torch.equal(hf.generate(model, ids[:, :40], hf.TurboQuantCache(model.config, kv_config=kvcfg("k16_v16")),
                                   max_new_tokens=20), dense)


def test_bf16_model():
    """A bf16 model: K/V and queries are converted to fp32 for our kernels,
    outputs go back to bf16."""
    model = make_model("qwen2").to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(10))
    ref = dense_logits(model, ids).float()
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = hf.TurboQuantCache(model.config, kv_config=kvcfg("k8_v8"))
    got = run_steps(model, ids, cache, steps=4)
    assert got.dtype == torch.bfloat16
    assert cosines(got.float(), ref).min().item() >= 0.99
    out = hf.generate(model, ids[:, :20], hf.TurboQuantCache(model.config, kv_config=kvcfg("k4_v4")), max_new_tokens=5)
    assert out.shape == (1, 25)


def _cuda_ready():
    from turboquant import cuda as tqcuda
    return torch.cuda.is_available() and tqcuda.available()


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_left_padded_batch_matches_one_by_one(device, chunks):
    """4 prompts of different lengths, left-padded, q8: the logits of every
    real position (prefill, in one or two chunks, then 4 decode steps) within
    cosine 0.999 of each prompt run alone (chunked where the batch's chunks
    cut it), and no further from them than DynamicCache's padded batch is
    from its own one-by-one runs, beyond a 1e-5 floor of float noise. With
    two chunks the two short rows are all padding in the first chunk. The
    pads are never stored.

    On CUDA a layer's centering means are those of its first chunk, all rows
    together (one mean per layer and head on the device), so a batch and a
    prompt alone quantize with different key means: their difference is of
    the size of q8's own error (~1e-4 in 1 - cosine), not padding. There the
    DynamicCache comparison runs with center_keys=False, where a row's stored
    bytes do not depend on the other rows."""
    if device == "cuda" and not _cuda_ready():
        pytest.skip("needs a CUDA device and the package built with the CUDA backend")
    model = make_model("llama").to(device)
    g = torch.Generator().manual_seed(11)
    lens = [37, 20, 50, 9]
    prompts = [torch.randint(1, 256, (n,), generator=g) for n in lens]
    steps = 4
    nxt = torch.randint(1, 256, (len(lens), steps), generator=g)
    made = []

    def tq_cache(**kw):
        extra = {"device": "cuda", "max_cache_len": 64} if device == "cuda" else {}

        def make(b):
            made.append(hf.TurboQuantCache(model.config, kv_config=kvcfg("q8", **kw), max_batch_size=b, **extra))
            return made[-1]
        return make

    model.set_attn_implementation(hf.ATTENTION_NAME)
    tq_cos = padded_vs_alone(model, prompts, tq_cache(), nxt, chunks)
    batched = made[0]
    fair_cos = tq_cos if device == "cpu" else padded_vs_alone(model, prompts, tq_cache(center_keys=False), nxt, chunks)
    model.set_attn_implementation("sdpa")
    dyn_cos = padded_vs_alone(model, prompts, lambda b: DynamicCache(), nxt, chunks)
    assert tq_cos.numel() == sum(lens) + len(lens) * steps
    assert tq_cos.min().item() >= 0.999, tq_cos.min()
    assert 1 - fair_cos.min().item() <= max(1 - dyn_cos.min().item(), 1e-5), (fair_cos.min(), dyn_cos.min())
    T = max(lens)
    assert batched.stats.padded_tokens == 2 * sum(T - n for n in lens)  # 2 layers
    assert batched.get_seq_length() == T + steps
    assert batched.ledger()["tokens"] == 2 * 2 * (sum(lens) + len(lens) * steps)  # layers x KV heads x real tokens
    if device == "cpu":
        assert [batched.core.length(1, i) for i in range(4)] == [n + steps for n in lens]


def test_generate_left_padded_batch():
    """model.generate on a left-padded batch (it derives the positions from
    the attention mask): fp16 storage gives DynamicCache's greedy tokens, and
    each row the tokens of its prompt generated alone."""
    from hf_runs import left_pad
    model = make_model("llama")
    model.generation_config.eos_token_id = None  # every step asked for runs
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(1, 256, (n,), generator=g) for n in [37, 20, 50, 9]]
    ids, mask, _ = left_pad(prompts, "cpu")
    model.set_attn_implementation("sdpa")
    dense = hf.generate(model, ids, DynamicCache(), attention_mask=mask, max_new_tokens=8)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = hf.TurboQuantCache(model.config, kv_config=kvcfg("k16_v16"), max_batch_size=4)
    got = hf.generate(model, ids, cache, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(got, dense)
    assert cache.stats.padded_tokens == 2 * sum(50 - len(p) for p in prompts)
    for i, p in enumerate(prompts):
        alone = hf.generate(model, p[None], hf.TurboQuantCache(model.config, kv_config=kvcfg("k16_v16")),
                            max_new_tokens=8)
        assert torch.equal(alone[0, len(p):], got[i, 50:])
