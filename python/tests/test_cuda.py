"""CUDA backend from Python (turboquant.cuda) and the HF production route on
CUDA. GPU tests skip cleanly without a CUDA device or without the CUDA
backend in this build; the "unavailable" tests run everywhere else. The
extend tests compare with paged_reference.attention_reference (fp64) on the
pages' own K/V decoded by the host PagedKVCache, whose writes are byte-equal
to the GPU write kernel's; test_cuda_hf.py holds the rest of the HF route's
GPU tests."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import turboquant as tq  # noqa: E402
from turboquant import cuda as tqcuda  # noqa: E402

GPU = torch.cuda.is_available() and tqcuda.available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and the package built with the CUDA backend")


def test_unavailable_raises_clearly():
    if GPU:
        pytest.skip("CUDA is available here")
    assert tqcuda.unavailable_reason()
    host = tq.PagedKVCache(1, 2, 128, num_blocks=1, block_size=16, preset="k4_v4")
    with pytest.raises(tqcuda.CudaUnavailableError, match="CUDA backend unavailable"):
        tqcuda.DevicePagedLayer(host, 0, 4)
    assert tqcuda.is_supported("k4_v4", 128) is tqcuda.built()
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from turboquant.integration import hf
    from turboquant.integration.common import IntegrationError
    with pytest.raises(IntegrationError, match="CUDA backend unavailable"):
        hf.TurboQuantCache(num_layers=1, num_kv_heads=2, head_dim=128, device="cuda", max_cache_len=64)


# ---------------------------------------------------------------------------
# turboquant.cuda on torch tensors


@gpu
def test_is_supported():
    for p in ["k4_v4", "k3_v3", "k2_v2", "k8_v4", "turboquant_k8v4", "q8"]:
        if p in tq.preset_names():
            assert tqcuda.is_supported(p, 128), (p, tqcuda.unsupported_reason(p, 128))
    assert not tqcuda.is_supported("k16_v16", 128)
    assert "supported" in tqcuda.unsupported_reason("k16_v16", 128)
    assert not tqcuda.is_supported("k4_v4", 96)
    with pytest.raises(ValueError):
        tqcuda.check_supported("k16_v16", 128)


def _host_pages(preset, kvh, d, bs, lens, seed):
    """Host paged cache with `lens` random sequences (float32 writes)."""
    host = tq.PagedKVCache(1, kvh, d, num_blocks=64, block_size=bs, preset=preset)
    rng = np.random.default_rng(seed)
    seqs, writes = [], []
    for n in lens:
        s = host.add_sequence()
        slots = np.asarray(host.reserve_slots(s, n), dtype=np.int64)
        k = rng.standard_normal((n, kvh, d), dtype=np.float32)
        v = rng.standard_normal((n, kvh, d), dtype=np.float32)
        host.write_slots(0, k, v, slots)
        seqs.append(s)
        writes.append((k, v, slots))
    max_blocks = max(len(host.block_table(s)) for s in seqs)
    tables = np.zeros((len(lens), max_blocks), np.int32)
    for i, s in enumerate(seqs):
        bt = host.block_table(s)
        tables[i, :len(bt)] = bt
    return host, writes, tables


@gpu
@pytest.mark.parametrize("preset", ["k4_v4", "k8_v4"])
def test_device_write_and_decode_match_host(preset):
    if preset not in tq.preset_names():
        pytest.skip(f"no preset {preset}")
    kvh, qh, d, bs = 2, 8, 128, 16
    lens = [70, 33]
    host, writes, tables = _host_pages(preset, kvh, d, bs, lens, seed=3)
    dev = tqcuda.DevicePagedLayer(host, 0, 64)
    assert dev.nbytes == sum(dev.plane_bytes().values())
    for k, v, slots in writes:  # the same rows, written by the GPU kernel
        dev.write_slots(torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda(), torch.from_numpy(slots).cuda())
    assert dev.take_errors()["ok"]
    q = np.random.default_rng(4).standard_normal((2, qh, d), dtype=np.float32)
    want = host.decode_attention(0, q, tables, np.asarray(lens, np.int32)).reshape(2, qh, d)
    bt = torch.from_numpy(tables).cuda()
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cap = tables.shape[1] * bs
    got = dev.paged_decode(torch.from_numpy(q).cuda(), bt, sl, max_seq_len=cap).cpu().numpy()
    assert np.sum((got - want) ** 2) / np.sum(want ** 2) <= 1e-6
    # fp16 queries and outputs
    got16 = dev.paged_decode(torch.from_numpy(q).cuda().half(), bt, sl, max_seq_len=cap).float().cpu().numpy()
    assert np.sum((got16 - want) ** 2) / np.sum(want ** 2) <= 1e-4


@gpu
def test_device_layer_validates_arguments():
    kvh, d = 2, 128
    host = tq.PagedKVCache(1, kvh, d, num_blocks=1, block_size=16, preset="k4_v4")
    dev = tqcuda.DevicePagedLayer(host, 0, 8)
    k = torch.zeros(4, kvh, d, device="cuda", dtype=torch.float16)
    slots = torch.arange(4, device="cuda", dtype=torch.int64)
    with pytest.raises(ValueError, match="CUDA tensor"):
        dev.write_slots(k.cpu(), k, slots)
    with pytest.raises(ValueError, match="int64"):
        dev.write_slots(k, k, slots.int())
    with pytest.raises(ValueError, match="dtype"):
        dev.write_slots(k.to(torch.int32), k.to(torch.int32), slots)
    with pytest.raises(ValueError, match="same dtype"):
        dev.write_slots(k, k.float(), slots)
    with pytest.raises(ValueError, match="C-contiguous"):
        dev.write_slots(k.transpose(0, 1), k.transpose(0, 1), slots)
    with pytest.raises(ValueError, match=r"\[tokens, 2, 128\]"):
        dev.write_slots(k[:, :1].contiguous(), k[:, :1].contiguous(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        dev.write_slots(k, k, slots[:3])
    # out-of-range slots are counted, not fatal
    dev.write_slots(k, k, torch.full((4,), 10**6, device="cuda", dtype=torch.int64))
    errs = dev.take_errors()
    assert errs["out_of_range_slots"] > 0 and errs["first_bad_token"] == 0 and not errs["ok"]
    assert dev.take_errors()["ok"]  # counters reset
    q = torch.zeros(1, 4, d, device="cuda", dtype=torch.float16)
    bt = torch.zeros(1, 8, device="cuda", dtype=torch.int32)
    sl = torch.ones(1, device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        dev.paged_decode(q, bt.long(), sl, max_seq_len=128)
    with pytest.raises(ValueError, match="workspace"):
        dev.paged_decode(q, bt, sl, max_seq_len=128, workspace=torch.empty(1, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="batch"):
        dev.paged_decode(q, bt, torch.ones(2, device="cuda", dtype=torch.int32), max_seq_len=128)
    with pytest.raises(ValueError):  # 3 query heads over 2 KV heads
        dev.paged_decode(torch.zeros(1, 3, d, device="cuda", dtype=torch.float16), bt, sl, max_seq_len=128)


@gpu
def test_planes_are_torch_allocations():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    host = tq.PagedKVCache(1, 8, 128, num_blocks=1, block_size=16, preset="k4_v4")
    dev = tqcuda.DevicePagedLayer(host, 0, 512)
    grown = torch.cuda.memory_allocated() - before
    assert grown >= dev.nbytes > 0
    assert grown - dev.nbytes <= 4 * 512  # only the allocator's rounding of four tensors
    rows = 512 * 16 * 8  # pages * block_size * KV heads
    assert rows * tq.preset_bytes_per_token_head("k4_v4", 128) <= dev.nbytes <= rows * 144


# ---------------------------------------------------------------------------
# HF production route on CUDA


def _hf():
    pytest.importorskip("transformers")
    from turboquant.integration import hf
    return hf


def _model(layers=2, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128, initializer_range=0.05,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.float16).eval()


def _steps(model, hf, ids, cache, steps):
    kw = {hf.cache_kwarg(model): cache}
    with torch.no_grad():
        out = [model(ids[:, :-steps], use_cache=True, **kw).logits[0, -1:]]
        for i in range(steps, 0, -1):
            out.append(model(ids[:, -i:][:, :1], use_cache=True, **kw).logits[0])
    return torch.cat(out).float()


@gpu
def test_hf_cuda_route_quality_generation_and_errors():
    hf = _hf()
    from transformers import DynamicCache
    from turboquant.integration.common import IntegrationError, KVQuantConfig
    model = _model()
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(5)).cuda()
    steps = 8
    model.set_attn_implementation("sdpa")
    ref = _steps(model, hf, ids, DynamicCache(), steps)
    model.set_attn_implementation(hf.ATTENTION_NAME)
    cos = {}
    for preset in ["q8", "k8_v4", "k4_v4"]:
        cache = hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset=preset), device="cuda",
                                   max_cache_len=400)
        got = _steps(model, hf, ids, cache, steps)
        c = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        # the prompt's last position is exact SDPA over the chunk's own K/V
        assert c[0].item() > 0.9999, c[0]
        cos[preset] = c[1:]
        assert (got[1:] - ref[1:]).abs().max().item() > 1e-4  # decode really read compressed pages
        assert cache.stats.sdpa_prefill_calls == 2 and cache.stats.gpu_decode_calls == 2 * steps
        assert cache.get_seq_length() == 300 and cache.take_write_errors()["non_finite_inputs"] == 0
        # no dense history: the cache's layers hold no tensors
        assert all(getattr(layer, "keys", None) is None for layer in cache.layers)
        # a chunk on top of the history runs the paged extend kernel
        with torch.no_grad():
            more = model(ids[:, :5], use_cache=True, **{hf.cache_kwarg(model): cache}).logits
        assert cache.stats.gpu_extend_calls == 2 and bool(torch.isfinite(more).all())
    # 8-bit keys and values: every decode step; 4-bit values dominate the rest
    # (the CPU route with no recent window measures 0.988 / 0.971 minimum on this model)
    assert cos["q8"].min().item() >= 0.99, cos
    assert cos["k8_v4"].mean().item() >= 0.98, cos
    assert cos["k4_v4"].mean().item() >= 0.95, cos
    # generation end to end (greedy), batch of 2 rows
    cache = hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k8_v4"), device="cuda",
                               max_cache_len=400, max_batch_size=2)
    out = hf.generate(model, ids[:, :100].repeat(2, 1), cache, max_new_tokens=12)
    assert out.shape == (2, 112) and torch.equal(out[:, :100], ids[:, :100].repeat(2, 1))
    assert (out[0] == out[1]).float().mean().item() >= 0.9  # identical rows decode alike
    assert cache.get_seq_length() == 111
    # presets the GPU does not handle, and a missing capacity, raise at construction
    with pytest.raises(IntegrationError, match="not supported by the CUDA backend"):
        hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k16_v16"), device="cuda",
                           max_cache_len=64)
    with pytest.raises(ValueError, match="max_cache_len"):
        hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k4_v4"), device="cuda")
    cache = hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset="k4_v4"), device="cuda",
                               max_cache_len=64)
    with pytest.raises(IntegrationError, match="max_cache_len"):
        with torch.no_grad():
            model(ids[:, :100], use_cache=True, **{hf.cache_kwarg(model): cache})


# ---------------------------------------------------------------------------
# extend, page copies and centering means


def _nmse(got, want):
    return float(((got - want) ** 2).sum() / (want ** 2).sum())


def _ragged(preset, kv_lens, q_lens, seed, *, kvh=2, qh=8, d=128, bs=16, dtype=torch.float32):
    """Host and device pages holding random sequences of kv_lens tokens (the
    same rows written by both), and a ragged query batch whose sequence b
    brings q_lens[b] tokens. Returns (dev, host-decoded K/V per sequence, q,
    cu_seqlens, tables, lens)."""
    host, writes, tables = _host_pages(preset, kvh, d, bs, kv_lens, seed)
    dev = tqcuda.DevicePagedLayer(host, 0, 64)
    for k, v, slots in writes:
        dev.write_slots(torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda(), torch.from_numpy(slots).cuda())
    assert dev.take_errors()["ok"]
    seqs = []
    for b, n in enumerate(kv_lens):
        k, v = host.dequantize_for_diagnostics(0, b)
        seqs.append((torch.from_numpy(k).view(n, kvh, d), torch.from_numpy(v).view(n, kvh, d)))
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), qh, d, generator=g).to(dtype).cuda()
    cu = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32, device="cuda")
    return dev, seqs, q, cu, torch.from_numpy(tables).cuda(), torch.tensor(kv_lens, dtype=torch.int32, device="cuda")


@gpu
@pytest.mark.parametrize("kernel", ["auto", "narrow", "tile"])
@pytest.mark.parametrize("preset", ["k4_v4", "q8"])
def test_extend_matches_fp64_reference(preset, kernel):
    """Ragged batch (a decode row, a chunk over history, a whole prompt, a
    sequence with more queries than keys), GQA 4, with and without window
    and soft-cap, f32 and f16 queries: NMSE <= 1e-5 per sequence against fp64
    attention on the pages' decoded K/V; queries at negative positions give 0."""
    from paged_reference import attention_reference
    kv_lens, q_lens = [70, 33, 37, 5], [1, 9, 37, 8]
    for dtype in (torch.float32, torch.float16):
        dev, seqs, q, cu, tables, lens = _ragged(preset, kv_lens, q_lens, seed=7, dtype=dtype)
        for window, softcap in [(0, 0.0), (24, 0.0), (0, 30.0)]:
            got = dev.paged_extend(q, cu, tables, lens, max_q_len=max(q_lens), max_seq_len=tables.shape[1] * 16,
                                   window=window, softcap=softcap, kernel=kernel)
            want = attention_reference(q.float().cpu(), cu.cpu(), [k for k, _ in seqs], [v for _, v in seqs],
                                       softcap=softcap, window=window)
            got = got.double().cpu()
            c = cu.tolist()
            for b in range(len(kv_lens)):
                assert _nmse(got[c[b]:c[b + 1]], want[c[b]:c[b + 1]]) <= 1e-5, (dtype, window, softcap, b)
            assert torch.all(got[c[3]:c[3] + 3] == 0)  # 8 queries over 5 keys: the first 3 see none
    plan = dev.plan_extend(4, 8, sum(q_lens), max(q_lens), 80, kernel=kernel)
    assert plan["kernel"] in ("narrow", "tile") and plan["workspace_bytes"] > 0
    if kernel != "auto":
        assert plan["kernel"] == kernel
    # every sequence with one query: 'auto' routes to the decode kernels
    assert dev.plan_extend(4, 8, 4, 1, 80)["decode_route"]


@gpu
def test_extend_validates_arguments():
    dev, seqs, q, cu, tables, lens = _ragged("k4_v4", [40, 20], [4, 4], seed=3)
    kw = dict(max_q_len=4, max_seq_len=tables.shape[1] * 16)
    assert torch.isfinite(dev.paged_extend(q, cu, tables, lens, **kw)).all()  # the valid call
    with pytest.raises(ValueError, match="cu_seqlens_q: dtype must be int32"):
        dev.paged_extend(q, cu.long(), tables, lens, **kw)
    with pytest.raises(ValueError, match="CUDA tensor"):
        dev.paged_extend(q.cpu(), cu, tables, lens, **kw)
    with pytest.raises(ValueError, match="batch 2"):
        dev.paged_extend(q, cu, tables[:1], lens, **kw)
    with pytest.raises(ValueError, match="head_dim 128"):
        dev.paged_extend(q[..., :64].contiguous(), cu, tables, lens, **kw)
    with pytest.raises(ValueError, match="workspace"):
        dev.paged_extend(q, cu, tables, lens, workspace=torch.empty(16, dtype=torch.uint8, device="cuda"), **kw)
    with pytest.raises(ValueError, match="'auto', 'narrow' or 'tile'"):
        dev.paged_extend(q, cu, tables, lens, kernel="fast", **kw)
    with pytest.raises(ValueError, match="max_q_len"):
        dev.paged_extend(q, cu, tables, lens, max_q_len=0, max_seq_len=kw["max_seq_len"])
    with pytest.raises(ValueError, match="softcap"):
        dev.paged_extend(q, cu, tables, lens, softcap=-1.0, **kw)


@gpu
def test_copy_blocks_and_centering_means():
    kvh, d, bs = 2, 128, 16
    host = tq.PagedKVCache(1, kvh, d, num_blocks=1, block_size=bs, preset="k4_v4")
    dev = tqcuda.DevicePagedLayer(host, 0, 16)
    g = torch.Generator().manual_seed(5)
    k = (torch.randn(40, kvh, d, generator=g) + 3.0).cuda()  # a key bias the means remove
    v = torch.randn(40, kvh, d, generator=g).cuda()
    dev.set_means_from_chunk(k, v, center_keys=True, center_values=True)
    km, vm = dev.get_means()
    want_k = k.double().cpu().sum(0) / 40
    assert km.shape == (kvh, d) and np.abs(km - want_k.float().numpy()).max() <= 1e-6
    assert np.abs(vm - (v.double().cpu().sum(0) / 40).float().numpy()).max() <= 1e-6
    dev.write_slots(k, v, torch.arange(40, dtype=torch.int64, device="cuda"))  # pages 0, 1, 2
    assert dev.take_errors()["ok"]
    with pytest.raises(Exception, match="before the first WriteSlots"):
        dev.set_means_from_chunk(k, v)
    # the same rows on the host with the device's means: the same bytes, so the same decoded K/V
    ref_host = tq.PagedKVCache(1, kvh, d, num_blocks=16, block_size=bs, preset="k4_v4")
    ref_host.set_means(0, km, vm)
    s = ref_host.add_sequence()
    slots = np.asarray(ref_host.reserve_slots(s, 40), dtype=np.int64)
    ref_host.write_slots(0, k.cpu().numpy(), v.cpu().numpy(), slots)
    hk, hv = ref_host.dequantize_for_diagnostics(0, s)
    from paged_reference import attention_reference
    q = torch.randn(3, 8, d, generator=g).cuda()
    cu = torch.tensor([0, 3], dtype=torch.int32, device="cuda")
    tables = torch.tensor([[0, 1, 2, 0]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([40], dtype=torch.int32, device="cuda")
    got = dev.paged_extend(q, cu, tables, lens, max_q_len=3, max_seq_len=64).double().cpu()
    want = attention_reference(q.cpu(), [0, 3], [torch.from_numpy(hk).view(40, kvh, d)],
                               [torch.from_numpy(hv).view(40, kvh, d)])
    assert _nmse(got, want) <= 1e-5
    # page copies: pages 0..2 -> 5..7; the copy attends like the original
    dev.copy_blocks(torch.tensor([[0, 5], [1, 6], [2, 7]], dtype=torch.int32, device="cuda"))
    copied = dev.paged_extend(q, cu, torch.tensor([[5, 6, 7, 0]], dtype=torch.int32, device="cuda"), lens,
                              max_q_len=3, max_seq_len=64).double().cpu()
    assert torch.equal(copied, got.to(copied.dtype))
    dev.copy_blocks(torch.tensor([[0, 99]], dtype=torch.int32, device="cuda"))  # outside the pool of 16
    assert dev.take_errors()["bad_page_pairs"] == 1
    with pytest.raises(ValueError, match=r"\[n, 2\]"):
        dev.copy_blocks(torch.zeros(3, dtype=torch.int32, device="cuda").view(1, 3))
    # soft-cap with centred keys: refused by the kernel, with the reason
    with pytest.raises(Exception, match="soft-cap with key means"):
        dev.paged_extend(q, cu, tables, lens, max_q_len=3, max_seq_len=64, softcap=30.0)
    # reset: a fresh layer over the same planes takes new means
    dev.reset()
    assert dev.get_means() == (None, None)
    dev.set_means_from_chunk(k, v, center_keys=True, center_values=False)
    assert dev.get_means()[1] is None
