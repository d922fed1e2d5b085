"""The vLLM-compatible device cache (turboquant.integration.vllm.device) and
its vLLM-shaped backend, run on the CPU with ReferencePagedLayer (exact fp64
pages, the GPU layer's contract in torch) in place of the GPU layers: the
split of a mixed batch, the decode / extend dispatch, cu_seqlens, slots,
means, the workspace plan, and that the attention call neither reads the
device back nor allocates. test_cuda_vllm.py runs the same batches on a GPU
against the CPU layer."""
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from turboquant.integration import vllm as V  # noqa: E402
from turboquant.integration.common import IntegrationError, KVQuantConfig, OptionalDependencyError  # noqa: E402
from paged_reference import ReferencePagedLayer, attention_reference  # noqa: E402
from vllm_batches import MIXED, make_mixed, nmse, write_all  # noqa: E402

KVH, QH, D, BS, MAXLEN, BLOCKS = 2, 8, 64, 16, 160, 64


def stand_in_cache(num_layers=1, means=None, **kw):
    return V.DevicePagedCompressedKVCache(
        num_layers, KVH, D, QH, num_blocks=BLOCKS, block_size=BS, cache_dtype="tq4", means=means, max_num_seqs=8,
        max_num_batched_tokens=64, max_model_len=MAXLEN, device="cpu",
        make_layer=lambda i, n: ReferencePagedLayer(n, BS, KVH, D), **kw)


def test_split_decodes_and_builder():
    assert V.split_decodes([0, 1, 2, 3, 23, 28]) == (3, 3)
    assert V.split_decodes(torch.tensor([0, 5, 6, 7])) == (0, 0)  # a one-token row after a chunk: extend
    assert V.split_decodes([0, 1, 2]) == (2, 2) and V.split_decodes([0]) == (0, 0)
    with pytest.raises(ValueError, match="never decrease"):
        V.split_decodes([0, 3, 2])
    meta, *_ = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN, num_blocks=BLOCKS, seed=1)
    assert (meta.num_decodes, meta.num_decode_tokens, meta.num_actual_tokens) == (3, 3, 37)
    assert meta.max_query_len == 20 and meta.max_seq_len == 101 and meta.block_table.shape == (6, 10)
    with pytest.raises(ValueError, match="common_prefix_len"):
        V.TurboQuantMetadataBuilder().build(16, None)


@pytest.mark.parametrize("window", [0, 24])
def test_mixed_batch_matches_fp64_attention(window):
    """Decode rows, a prompt, a chunk over history and a 4-draft verification
    in one call, with key and value means: exact pages reproduce fp64
    attention on the original K/V; decode rows go to the decode kernel, the
    rest to one extend call; padded rows are zeroed."""
    meta, kv, hist, q = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN, num_blocks=BLOCKS,
                                   seed=2)
    means = V.channel_means([(0, kv[0][0], kv[0][1])], center_keys=True, center_values=True)
    cache = stand_in_cache(means=means)
    lay = cache.layers[0]
    assert lay.mean_chunks == [1] and torch.allclose(lay.k_mean, means[0][0].double())
    write_all(cache, 0, MIXED, kv, hist, meta)
    assert cache.tokens_written == sum(c + n for c, n in MIXED)
    out = torch.full_like(q, 7.0)
    got = cache.attention(0, q, meta, out=out, scale=0.1, window=window)
    assert got is out and torch.all(out[37:] == 0)
    cu = meta.query_start_loc.tolist()
    want = attention_reference(q[:37], cu, [k for k, _ in kv], [v for _, v in kv], scale=0.1, window=window)
    assert nmse(out[:37], want) <= 1e-12
    assert lay.calls["decode"] == 1 and lay.calls["extend"] == 1
    assert cache.cu_seqlens[:4].tolist() == [0, 20, 29, 34]  # the extend rows' own cu_seqlens
    # softcap: refused with centred keys; without them every row goes through
    # extend (the decode kernel has none)
    with pytest.raises(IntegrationError, match="soft-capped"):
        cache.attention(0, q, meta, out=out, softcap=5.0)
    plain = stand_in_cache()
    write_all(plain, 0, MIXED, kv, hist, meta)
    got = plain.attention(0, q, meta, softcap=5.0, window=window)
    want_cap = attention_reference(q[:37], cu, [k for k, _ in kv], [v for _, v in kv], softcap=5.0, window=window)
    assert nmse(got[:37], want_cap) <= 1e-12
    assert plain.layers[0].calls["decode"] == 0 and plain.layers[0].calls["extend"] == 1
    # a batch of decode rows only: no extend call
    dec = V.AttentionMetadata(num_actual_tokens=3, query_start_loc=meta.query_start_loc[:4],
                              seq_lens=meta.seq_lens[:3], block_table=meta.block_table[:3],
                              slot_mapping=meta.slot_mapping[:3], max_query_len=1, max_seq_len=101,
                              num_decodes=3, num_decode_tokens=3)
    got = cache.attention(0, q[:3], dec, scale=0.1, window=window)
    assert lay.calls["decode"] == 2 and lay.calls["extend"] == 1 and nmse(got, want[:3]) <= 1e-12


class _NoSyncNoAlloc(TorchDispatchMode):
    """Fails on any read of a tensor value by the host (aten._local_scalar_dense:
    .item(), .tolist(), bool()) and on any op that allocates a tensor."""

    ALLOC = ("empty", "zeros", "ones", "full", "empty_strided", "new_empty", "new_zeros", "clone", "arange",
             "scalar_tensor", "_to_copy", "cat")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            raise AssertionError("the attention call read a device value on the host")
        if name in self.ALLOC or (name in ("sub", "add", "mul") and "out" not in (kwargs or {})):
            raise AssertionError(f"the attention call allocated: {func}")
        return func(*args, **(kwargs or {}))


class _RecordingLayer(ReferencePagedLayer):
    """Records the kernels' arguments (views of the caller's tensors) and computes nothing."""

    def __init__(self, *a):
        super().__init__(*a)
        self.seen = []

    def plan_decode(self, batch, num_q_heads, max_seq_len):
        return {"workspace_bytes": 100 * batch}

    def plan_extend(self, batch, num_q_heads, total_q, max_q_len, max_seq_len, *, kernel="auto"):
        return {"workspace_bytes": 10 * total_q + batch}

    def paged_decode(self, q, block_tables, seq_lens, **kw):
        self.seen.append(("decode", q, block_tables, seq_lens, kw))
        return kw["out"]

    def paged_extend(self, q, cu_seqlens_q, block_tables, seq_lens, **kw):
        self.seen.append(("extend", q, cu_seqlens_q, block_tables, seq_lens, kw))
        return kw["out"]


def test_entry_point_reads_nothing_back_and_allocates_nothing():
    meta, kv, hist, q = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN, num_blocks=BLOCKS,
                                   seed=3)
    cache = V.DevicePagedCompressedKVCache(1, KVH, D, QH, num_blocks=BLOCKS, block_size=BS, max_num_seqs=8,
                                           max_num_batched_tokens=64, max_model_len=MAXLEN, device="cpu",
                                           make_layer=lambda i, n: _RecordingLayer(n, BS, KVH, D))
    # the plan's workspace: the largest need of the swept shapes (8 x 64 tokens: 10 * 64 + 8)
    assert cache.workspace.numel() == 800 and cache.cu_seqlens.shape == (9,)
    out = torch.empty_like(q)
    cache.attention(0, q, meta, out=out)  # shapes seen once: the per-shape need is cached on the host
    lay = cache.layers[0]
    lay.seen.clear()
    with _NoSyncNoAlloc():
        cache.attention(0, q.view(q.shape[0], -1), meta, out=out.view(q.shape[0], -1), scale=0.1)
    (dk, dq, dbt, dsl, dkw), (ek, eq, ecu, ebt, esl, ekw) = lay.seen
    assert dk == "decode" and ek == "extend"
    assert dq.data_ptr() == q.data_ptr() and dq.shape == (3, QH, D) and dkw["out"].data_ptr() == out.data_ptr()
    assert dbt.shape == (3, 10) and dsl.tolist() == [41, 8, 101] and dkw["max_seq_len"] == MAXLEN
    assert eq.shape == (34, QH, D) and ekw["out"].data_ptr() == out[3].data_ptr()
    assert ecu.data_ptr() == cache.cu_seqlens.data_ptr() and ecu.tolist() == [0, 20, 29, 34]
    assert esl.tolist() == [20, 39, 65] and ebt.data_ptr() == meta.block_table[3].data_ptr()
    assert ekw["max_q_len"] == 20 and ekw["max_seq_len"] == MAXLEN and ekw["workspace"] is cache.workspace
    # a shape beyond the plan: refused by name
    cache.workspace = cache.workspace[:10]
    with pytest.raises(IntegrationError, match="workspace bytes"):
        cache.attention(0, q, meta, out=out)


def test_argument_errors():
    cache = stand_in_cache()
    meta, kv, hist, q = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN, num_blocks=BLOCKS,
                                   seed=4)
    bad = dict(meta.__dict__)
    with pytest.raises(ValueError, match="num_decode_tokens"):
        cache.attention(0, q, V.AttentionMetadata(**{**bad, "num_decode_tokens": 5}))
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        cache.attention(0, q, V.AttentionMetadata(**{**bad, "query_start_loc": meta.query_start_loc.long()}))
    with pytest.raises(ValueError, match="pages a sequence"):
        cache.attention(0, q, V.AttentionMetadata(**{**bad, "block_table": meta.block_table[:, :4]}))
    with pytest.raises(ValueError, match="out of bounds"):
        cache.attention(0, q[:10], meta)
    with pytest.raises(IntegrationError, match="on meta"):
        cache.attention(0, q.to("meta"), meta)
    with pytest.raises(ValueError, match="int64"):
        cache.reshape_and_cache(0, kv[0][0], kv[0][1], torch.arange(41, dtype=torch.int32))
    with pytest.raises(ValueError, match="means"):
        stand_in_cache(means={0: (torch.zeros(3, D), None)})
    # without make_layer: a CUDA device and the CUDA backend, never the CPU path
    with pytest.raises(IntegrationError, match="needs a CUDA device"):
        V.DevicePagedCompressedKVCache(1, KVH, D, QH, num_blocks=4, device="cpu")
    from turboquant import cuda as tqcuda
    if not tqcuda.available():
        with pytest.raises(IntegrationError, match="CUDA backend unavailable"):
            V.DevicePagedCompressedKVCache(1, KVH, D, QH, num_blocks=4, device="cuda")


def test_backend_impl_and_plugin():
    B = V.TurboQuantBackend
    assert B.get_impl_cls() is V.TurboQuantDeviceImpl and B.get_builder_cls() is V.TurboQuantMetadataBuilder
    assert B.forward_includes_kv_cache_update is False and B.accept_output_buffer is True
    assert B.supports_kv_cache_dtype("turboquant_k8v4") and B.supports_kv_cache_dtype("tq4")
    assert not B.supports_kv_cache_dtype("fp8") and B.supports_head_size(128) and not B.supports_head_size(96)
    impl = B.get_impl_cls()(QH, D, 0.1, KVH, None, 24, "tq4", None, "decoder", None)
    meta, kv, hist, q = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN, num_blocks=BLOCKS,
                                   seed=5)
    with pytest.raises(IntegrationError, match="not attached"):
        impl.forward(None, q, None, None, None, meta, output=torch.empty_like(q))
    cache = stand_in_cache()
    impl.attach(cache, 0)
    class ThroughImpl:  # write_all's reshape_and_cache, through vLLM's do_kv_cache_update
        def reshape_and_cache(self, layer, k, v, slots):
            impl.do_kv_cache_update(None, k.view(k.shape[0], -1), v.view(v.shape[0], -1), torch.empty(0), slots)

    write_all(ThroughImpl(), 0, MIXED, kv, hist, meta)
    assert cache.tokens_written == sum(c + n for c, n in MIXED)
    out = impl.forward(None, q.view(q.shape[0], -1), None, None, torch.empty(0), meta,
                       output=torch.empty(q.shape[0], QH * D))
    want = attention_reference(q[:37], meta.query_start_loc, [k for k, _ in kv], [v for _, v in kv], scale=0.1,
                               window=24)
    assert nmse(out.view_as(q)[:37], want) <= 1e-12
    assert torch.all(impl.forward(None, q, None, None, None, None, output=torch.ones_like(q)) == 0)
    with pytest.raises(IntegrationError, match="heads"):
        V.TurboQuantDeviceImpl(4, D, 0.1, KVH).attach(cache, 0)
    with pytest.raises(IntegrationError, match="ALiBi"):
        V.TurboQuantDeviceImpl(QH, D, 0.1, KVH, alibi_slopes=[1.0])
    from turboquant.integration.vllm import plugin
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(OptionalDependencyError, match="needs vllm"):
            plugin.register()
    from importlib.metadata import entry_points
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "turboquant"]
    assert [ep.value for ep in eps] == ["turboquant.integration.vllm.plugin:register"]


def test_cpu_layer_means_remove_a_key_bias():
    """Centering means on the CPU layer: keys with a large common offset
    quantize worse uncentred; the means from channel_means recover it."""
    g = torch.Generator().manual_seed(6)
    n = 64
    k = torch.randn(n, KVH, D, generator=g) + 6.0
    v = torch.randn(n, KVH, D, generator=g) + 2.0
    q = torch.randn(1, QH, D, generator=g)
    want = attention_reference(q, [0, 1], [k], [v])
    means = V.channel_means([(0, k, v)], center_keys=True, center_values=True)
    assert torch.allclose(means[0][0], k.double().mean(0).float())
    errs = []
    for m in (None, means):
        cache = V.PagedCompressedKVCache(1, KVH, D, num_blocks=8, block_size=BS, cache_dtype="tq3", means=m)
        cache.reshape_and_cache(0, k, v, torch.arange(n, dtype=torch.int64))
        got = cache.paged_decode(0, q, torch.arange(4, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32))
        errs.append(nmse(got, want))
    assert errs[1] < 0.5 * errs[0], errs
