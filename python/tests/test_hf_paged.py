"""The HF CUDA route's bookkeeping (turboquant.integration.hf_cuda.PagedRoute:
slots, lengths, block tables, cu_seqlens, padding, crop, means, the choice
of SDPA / decode / extend) run on the CPU with ReferencePagedLayer (exact
fp64 pages, the kernels' contract in torch) in place of the GPU layers. With
exact pages the route must reproduce dense attention; the GPU kernels
themselves are checked against the same reference in test_cuda.py."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from turboquant.integration import hf  # noqa: E402
from turboquant.integration.common import IntegrationError, KVQuantConfig  # noqa: E402
from turboquant.integration.hf_cuda import PagedRoute  # noqa: E402
from hf_runs import make_gemma2, make_model, padded_vs_alone, run_cuts  # noqa: E402  (tests/hf_runs.py)
from paged_reference import ReferencePagedLayer  # noqa: E402  (tests/paged_reference.py)


def paged_cache(model, cfg=None, batch=1, max_len=128, block_size=16):
    """A TurboQuantCache served by PagedRoute over ReferencePagedLayer pages on the CPU."""
    cache = hf.TurboQuantCache(model.config, kv_config=cfg or KVQuantConfig(preset="k4_v4"), max_batch_size=batch)
    shape = hf.model_shape(model.config)
    cache._serve_with(PagedRoute(
        cache, max_len, block_size, device=torch.device("cpu"),
        make_layer=lambda i, n: ReferencePagedLayer(n, block_size, shape["num_kv_heads"], shape["head_dim"])))
    return cache


def test_chunked_prefill_decode_and_second_prompt_match_dense():
    model = make_model("llama")
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(1))
    # prompt in chunks of 30 and 25 tokens, 3 decodes, a 30-token second prompt, 3 decodes
    cuts = [0, 30, 55, 56, 57, 58, 88, 89, 90, 91]
    model.set_attn_implementation("sdpa")
    ref = run_cuts(model, DynamicCache(), ids, cuts)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    for center_values in (False, True):
        cache = paged_cache(model, KVQuantConfig(preset="k4_v4", center_values=center_values))
        got = run_cuts(model, cache, ids, cuts)
        assert torch.allclose(got, ref, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()
        st = cache.stats
        # 2 layers: SDPA for the first chunk, extend for the second chunk and the second prompt
        assert st.sdpa_prefill_calls == 2 and st.gpu_extend_calls == 2 * 2 and st.gpu_decode_calls == 2 * 6
        assert cache.get_seq_length() == 91 and cache.ledger()["tokens"] == 2 * 2 * 91
        lay = cache.core[0]
        assert lay.mean_chunks == [30]  # means from the first chunk, once
        assert (lay.v_mean is not None) == center_values and lay.k_mean is not None
        assert lay.calls["write"] == len(cuts) - 1  # one write per forward


@pytest.mark.parametrize("chunks", [1, 2])
def test_left_padding_matches_one_by_one(chunks):
    model = make_model("llama")
    model.set_attn_implementation(hf.ATTENTION_NAME)
    g = torch.Generator().manual_seed(11)
    lens = [37, 20, 50, 9]
    prompts = [torch.randint(1, 256, (n,), generator=g) for n in lens]
    nxt = torch.randint(1, 256, (4, 3), generator=g)
    made = []

    def make(b):
        made.append(paged_cache(model, batch=b, max_len=64))
        return made[-1]

    cos = padded_vs_alone(model, prompts, make, nxt, chunks)
    assert cos.min().item() >= 0.99999, cos.min()
    batched = made[0]
    # the means come from the real tokens of the first chunk only (all rows together)
    T = 50
    first = T // chunks
    assert batched.core[0].mean_chunks == [sum(max(0, n - (T - first)) for n in lens)]
    assert batched.stats.padded_tokens == 2 * sum(T - n for n in lens)
    if chunks == 2:  # rows 1 and 3 are all padding in the first chunk: extend rows at negative positions
        assert batched.stats.gpu_extend_calls == 2


def test_crop_and_assisted_generation():
    """transformers' assisted generation verifies the draft's tokens in one
    multi-token forward (extend) and crops the rejected ones; the draft is a
    different model, so most are rejected and crop runs."""
    model = make_model("llama")
    draft = make_model("llama", seed=5)
    for m in (model, draft):  # no end-of-sequence token: every step asked for runs
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    draft.set_attn_implementation("sdpa")
    model.set_attn_implementation(hf.ATTENTION_NAME)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = paged_cache(model, max_len=96)
    out = model.generate(ids, **{hf.cache_kwarg(model): cache}, assistant_model=draft, max_new_tokens=16,
                         do_sample=False, return_dict_in_generate=True, output_logits=True)
    seq = out.sequences
    assert seq.shape == (1, 56)
    assert cache.stats.cropped_tokens > 0 and cache.stats.gpu_extend_calls > 0
    # every generated token is the target model's greedy choice on the sequence so far
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dense = model(seq).logits[0, 39:55]
    got = torch.cat(out.logits).float()
    assert torch.nn.functional.cosine_similarity(got, dense, dim=-1).min().item() >= 0.99999
    assert torch.equal(got.argmax(-1), seq[0, 40:])
    # crop: transformers' convention only
    with pytest.raises(IntegrationError, match="negative count"):
        cache.crop(3)
    n = cache.get_seq_length()
    cache.crop(-5)
    assert cache.get_seq_length() == n - 5 and cache.ledger()["tokens"] == 2 * 2 * (n - 5)
    # the CPU route cannot crop: assisted generation is refused, by transformers
    # (5.25 checks is_croppable: ValueError) or by our crop (5.17 just calls it)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    with pytest.raises((ValueError, IntegrationError), match="can be cropped|cannot crop"):
        model.generate(ids, **{hf.cache_kwarg(model): hf.TurboQuantCache(model.config)}, assistant_model=draft,
                       max_new_tokens=4, do_sample=False)
    with pytest.raises(IntegrationError, match="cannot crop"):
        hf.TurboQuantCache(model.config).crop(-1)


def test_multi_turn_generation_matches_dense():
    model = make_model("llama")
    g = torch.Generator().manual_seed(3)
    turn1 = torch.randint(0, 256, (1, 30), generator=g)
    turn2 = torch.randint(0, 256, (1, 12), generator=g)

    def chat(cache):
        a = hf.generate(model, turn1, cache, max_new_tokens=6)
        return hf.generate(model, torch.cat([a, turn2], 1), cache, max_new_tokens=6)

    model.set_attn_implementation("sdpa")
    dense = chat(DynamicCache())
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = paged_cache(model, max_len=64)
    assert torch.equal(chat(cache), dense)
    assert cache.stats.gpu_extend_calls == 2  # the second turn's prompt over the history, 2 layers
    # a new conversation on the same cache: reset drops the pages and the means
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.core[0].mean_chunks == []
    assert torch.equal(chat(cache), dense)


def test_softcap_and_sliding_window_reach_the_kernels():
    """Gemma2 (soft-cap 1.0, sliding window 16 on layer 0) in two chunks and
    decodes: equal to eager attention, so both options reach extend/decode;
    soft-cap with centred keys is refused (the GPU kernels cannot do it)."""
    model = make_gemma2()
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(9))
    cuts = [0, 24, 50, 51, 52, 60]
    model.set_attn_implementation("eager")
    ref = run_cuts(model, DynamicCache(config=model.config), ids, cuts)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = paged_cache(model, KVQuantConfig(preset="k4_v4", center_keys=False))
    got = run_cuts(model, cache, ids, cuts)
    assert (got - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
    # soft-capped: every step runs extend (the decode kernel has no soft-cap)
    assert cache.stats.gpu_extend_calls == 2 * 5 and cache.stats.gpu_decode_calls == 0
    with pytest.raises(IntegrationError, match="center_keys=False"):
        with torch.no_grad():
            model(ids[:, :8], **{hf.cache_kwarg(model): paged_cache(model)})


def test_refusals_leave_the_cache_usable():
    model = make_model("llama")
    model.set_attn_implementation(hf.ATTENTION_NAME)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    cache = paged_cache(model, batch=2, max_len=32)
    kw = {hf.cache_kwarg(model): cache, "use_cache": True}
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 10:12] = 0  # a hole after real tokens
    with torch.no_grad():
        with pytest.raises(IntegrationError, match="left padding only"):
            model(ids, attention_mask=mask, **kw)
        assert cache.get_seq_length() == 0 and cache.core[0].calls["write"] == 0
        model(ids, **kw)
        with pytest.raises(IntegrationError, match="max_cache_len"):
            model(ids, **kw)  # 40 positions > 32
    with pytest.raises(IntegrationError, match="beam search"):
        cache.reorder_cache(torch.tensor([1, 0]))
