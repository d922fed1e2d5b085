"""HF production route on CUDA (TurboQuantCache(device="cuda") + attention
"turboquant") on random-weight models: chunked prefill and a second prompt
over the history (paged extend), multi-turn and speculative (assisted)
generation, soft-cap and sliding window through the extend kernel,
centering and per-layer presets. Needs a CUDA device and the package built
with the CUDA backend; skipped otherwise. The left-padded batch on CUDA is
test_hf.py's test_left_padded_batch_matches_one_by_one[cuda-*]; the route's
bookkeeping is also checked on the CPU (test_hf_paged.py)."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from turboquant.integration import hf  # noqa: E402
from turboquant.integration.common import IntegrationError, KVQuantConfig  # noqa: E402
from hf_runs import make_gemma2, run_cuts  # noqa: E402  (tests/hf_runs.py)
from test_cuda import GPU, _model  # noqa: E402  (fp16 Llama: head_dim 128, 8/2 heads)

pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA device and the package built with the CUDA backend")


def _gen_model(seed=0):
    """_model without an end-of-sequence token: generate runs every step asked for."""
    model = _model(seed=seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def _cuda_cache(model, preset="q8", max_len=512, **kw):
    return hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset=preset, **kw), device="cuda",
                              max_cache_len=max_len)


def test_chunked_prefill_and_second_prompt_match_dense():
    """A 300-token prompt in chunks of 160 and 140, 4 decodes, a 60-token
    second prompt, 4 decodes, against DynamicCache (SDPA, fp16): the first
    chunk is exact (SDPA over its own K/V, cosine > 0.9999); every later
    position reads compressed pages through extend or decode: q8 cosine
    >= 0.995 at each, k8_v4 >= 0.98 on average."""
    model = _model()
    ids = torch.randint(0, 512, (1, 400), generator=torch.Generator().manual_seed(5)).cuda()
    cuts = [0, 160, 300, 301, 302, 303, 304, 364, 365, 366, 367, 368]
    model.set_attn_implementation("sdpa")
    ref = run_cuts(model, DynamicCache(), ids, cuts)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    for preset in ("q8", "k8_v4"):
        cache = _cuda_cache(model, preset)
        c = _cos(run_cuts(model, cache, ids, cuts), ref)
        assert c[:160].min().item() > 0.9999, (preset, c[:160].min())
        if preset == "q8":
            assert c[160:].min().item() >= 0.995, c[160:].min()
        else:
            assert c[160:].mean().item() >= 0.98, c[160:].mean()
        st = cache.stats
        assert st.sdpa_prefill_calls == 2 and st.gpu_extend_calls == 2 * 2 and st.gpu_decode_calls == 2 * 8
        assert cache.get_seq_length() == 368 and cache.take_write_errors()["non_finite_inputs"] == 0
        km, vm = cache.core[0].get_means()  # center_keys (the default) from the first chunk; values not centred
        assert km is not None and km.shape == (2, 128) and vm is None


def _generated_logits_vs_dense(model, out, prompt_len):
    """Cosine of generate's per-step logits against the dense model's logits
    on the produced sequence (teacher-forced), and whether each token is the
    argmax of its step's logits."""
    seq = out.sequences
    got = torch.cat(out.logits).float()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dense = model(seq).logits[0, prompt_len - 1:seq.shape[1] - 1].float()
    model.set_attn_implementation(hf.ATTENTION_NAME)
    return _cos(got, dense), torch.equal(got.argmax(-1), seq[0, prompt_len:])


def test_multi_turn_and_assisted_generation():
    model = _gen_model()
    model.set_attn_implementation(hf.ATTENTION_NAME)
    g = torch.Generator().manual_seed(6)
    turn1 = torch.randint(0, 512, (1, 120), generator=g).cuda()
    turn2 = torch.randint(0, 512, (1, 40), generator=g).cuda()
    kw = dict(return_dict_in_generate=True, output_logits=True)
    cache = _cuda_cache(model)
    a = hf.generate(model, turn1, cache, max_new_tokens=8, **kw)
    cos, greedy = _generated_logits_vs_dense(model, a, 120)
    assert greedy and cos.min().item() >= 0.995, cos
    ids2 = torch.cat([a.sequences, turn2], 1)
    b = hf.generate(model, ids2, cache, max_new_tokens=8, **kw)  # the second turn over the history: extend
    cos, greedy = _generated_logits_vs_dense(model, b, ids2.shape[1])
    assert greedy and cos.min().item() >= 0.995, cos
    assert cache.stats.gpu_extend_calls == 2
    # speculative decoding: a different draft model, so drafts are rejected and crop runs
    draft = _gen_model(seed=5)
    draft.set_attn_implementation("sdpa")
    cache = _cuda_cache(model)
    out = model.generate(turn1, **{hf.cache_kwarg(model): cache}, assistant_model=draft, max_new_tokens=16,
                         do_sample=False, **kw)
    assert out.sequences.shape == (1, 136)
    assert cache.stats.cropped_tokens > 0 and cache.stats.gpu_extend_calls > 0
    cos, greedy = _generated_logits_vs_dense(model, out, 120)
    assert greedy and cos.min().item() >= 0.995, cos


def test_softcap_and_sliding_window_through_extend():
    """Gemma2 (soft-cap 1.0, window 16 on layer 0; fp32) in two chunks and
    decodes vs eager DynamicCache; soft-capped, every step runs the extend
    kernel. Soft-cap with centred keys is refused at construction."""
    model = make_gemma2().cuda()
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(9)).cuda()
    cuts = [0, 24, 50, 51, 52, 60]
    model.set_attn_implementation("eager")
    ref = run_cuts(model, DynamicCache(config=model.config), ids, cuts)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = _cuda_cache(model, "q8", max_len=64, center_keys=False)
    c = _cos(run_cuts(model, cache, ids, cuts), ref)
    assert c.min().item() >= 0.995, c.min()
    assert cache.stats.gpu_extend_calls == 2 * 5 and cache.stats.gpu_decode_calls == 0
    with pytest.raises(IntegrationError, match="center_keys=False"):
        _cuda_cache(model, "q8", max_len=64)


def test_per_layer_presets_and_refusals():
    model = _model()
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cache = _cuda_cache(model, "k4_v4", max_len=128, layer_presets={0: "q8"})
    assert cache.layer_presets == {0: "q8", 1: "k4_v4"}
    assert cache.core[0].nbytes > cache.core[1].nbytes
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(7)).cuda()
    with torch.no_grad():
        assert bool(torch.isfinite(model(ids[:1], **{hf.cache_kwarg(model): cache}).logits).all())
    with pytest.raises(IntegrationError, match="not supported by the CUDA backend"):
        _cuda_cache(model, "k4_v4", dense_first_layers=1)  # the boundary preset k16_v16 has no GPU kernels
    with pytest.raises(IntegrationError, match="beam search"):
        cache.reorder_cache(torch.tensor([0], device="cuda"))
    with pytest.raises(IntegrationError, match="negative count"):
        cache.crop(5)
    cache = hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="q8"), device="cuda",
                               max_cache_len=64, max_batch_size=2)
    mask = torch.ones(2, 40, dtype=torch.long, device="cuda")
    mask[1, 20:22] = 0
    with pytest.raises(IntegrationError, match="left padding only"):
        with torch.no_grad():
            model(ids, attention_mask=mask, **{hf.cache_kwarg(model): cache})


def test_32k_continuation_allocates_only_the_workspace():
    """Memory truth of the CUDA route: a 32,768-token continuation (16 chunks
    of 2,048 through the extend kernel, then 16 decode steps) over a 256-token
    prompt. After the first step of each kind (which allocates the
    route's workspace, sized by the plan from batch x q_len x heads, not
    from the history), memory_allocated() never grows, and each step's peak
    above the memory allocated before it (its activations, the chunk's rows,
    the output) is the same at 2K and at 32K tokens of history: nothing
    proportional to the history is allocated. A dense copy of one layer's
    history at 32K tokens would be 32 MiB; the slack allowed is 1 MiB."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128, initializer_range=0.05,
                      max_position_embeddings=34000)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.float16).eval()
    model.set_attn_implementation(hf.ATTENTION_NAME)
    chunk, chunks, decodes = 2048, 16, 16
    total = 256 + chunk * chunks + decodes
    ids = torch.randint(0, 512, (1, total), generator=torch.Generator().manual_seed(3)).cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    cache = _cuda_cache(model, "k4_v4", max_len=total)
    kw = {hf.cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}

    def step(a, b):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            out = model(ids[:, a:b], **kw)
        del out
        torch.cuda.synchronize()
        return before, torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated()

    with torch.no_grad():
        model(ids[:, :256], **kw)
    cuts = [256 + chunk * i for i in range(chunks + 1)]
    ext = [step(a, b) for a, b in zip(cuts, cuts[1:])]
    dec = [step(cuts[-1] + i, cuts[-1] + i + 1) for i in range(decodes)]
    assert cache.get_seq_length() == total and cache.stats.gpu_extend_calls == 2 * chunks
    for steps in (ext, dec):
        settled = steps[0][2]  # after the first step of its kind (workspace allocated)
        assert all(after == settled for _, _, after in steps[1:]), [s[2] - settled for s in steps]
        peaks = [p for _, p, _ in steps[1:]]
        assert max(peaks) - min(peaks) <= 2**20, peaks
    ws = cache._paged.workspace.numel()
    assert dec[-1][2] - ext[0][0] <= ws, (dec[-1][2] - ext[0][0], ws)  # only the workspace was added
    # the ledger and torch's counters agree: what the cache holds (planes, workspace, block tables, lengths)
    # is what was allocated since before its construction, up to the allocator's rounding of the few
    # small index tensors (row offsets, cu_seqlens: < 64 KiB)
    held = dec[-1][2] - base
    led = cache.ledger()
    assert led["total"] <= held <= led["total"] + 2**16, (held, led)
