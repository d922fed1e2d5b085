"""The vLLM backend against vLLM's own code (skipped where vLLM is not
installed; docs/PYTHON.md records a run with the vLLM wheel): the plugin
registers with vLLM's backend registry, our classes subclass vLLM's
abstract ones with nothing left abstract, vLLM's configuration check accepts
the combinations we serve and names what we do not, and a mixed batch
described by vLLM's own CommonAttentionMetadata is split as vLLM's
split_decodes_and_prefills splits it and attended (CPU stand-in pages,
exact) as the fp64 reference."""
import inspect

import pytest

torch = pytest.importorskip("torch")
backend_mod = pytest.importorskip("vllm.v1.attention.backend", reason="vLLM is not installed")

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.utils import split_decodes_and_prefills  # noqa: E402

from turboquant.integration import vllm as V  # noqa: E402
from turboquant.integration.vllm import plugin  # noqa: E402
from paged_reference import attention_reference  # noqa: E402
from test_vllm_device import BLOCKS, BS, D, KVH, MAXLEN, QH, stand_in_cache  # noqa: E402
from vllm_batches import MIXED, make_mixed, nmse, write_all  # noqa: E402


def test_plugin_registers_the_backend_with_vllm():
    path = plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_path() == path == plugin.BACKEND_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is V.TurboQuantBackend
    plugin.register()  # vLLM calls it in every process, possibly more than once
    assert AttentionBackendEnum.CUSTOM.get_class() is V.TurboQuantBackend


def test_classes_implement_vllm_interfaces():
    B = V.TurboQuantBackend
    assert issubclass(B, backend_mod.AttentionBackend) and not inspect.isabstract(B)
    assert issubclass(B.get_impl_cls(), backend_mod.AttentionImpl) and not inspect.isabstract(B.get_impl_cls())
    assert issubclass(B.get_builder_cls(), backend_mod.AttentionMetadataBuilder)
    assert not inspect.isabstract(B.get_builder_cls())
    assert B.forward_includes_kv_cache_update is False  # vLLM calls do_kv_cache_update first
    # vLLM's call signatures: every parameter vLLM passes exists, in vLLM's order
    for ours, theirs in ((V.TurboQuantDeviceImpl.__init__, backend_mod.AttentionImpl.__init__),
                         (V.TurboQuantDeviceImpl.forward, backend_mod.AttentionImpl.forward),
                         (V.TurboQuantMetadataBuilder.__init__, backend_mod.AttentionMetadataBuilder.__init__),
                         (V.TurboQuantMetadataBuilder.build, backend_mod.AttentionMetadataBuilder.build)):
        want = list(inspect.signature(theirs).parameters)
        got = list(inspect.signature(ours).parameters)
        assert got[:len(want)] == want, (ours.__qualname__, got, want)
    impl = B.get_impl_cls()(num_heads=QH, head_size=128, scale=0.088, num_kv_heads=KVH, alibi_slopes=None,
                            sliding_window=None, kv_cache_dtype="turboquant_k8v4", logits_soft_cap=None,
                            attn_type="decoder", kv_sharing_target_layer_name=None)
    assert (impl.num_heads, impl.num_kv_heads, impl.window, impl.softcap) == (QH, KVH, 0, 0.0)


def test_vllm_configuration_check():
    """vLLM's own validate_configuration (inherited) over our declared support."""
    B = V.TurboQuantBackend
    base = dict(dtype=torch.float16, kv_cache_dtype="turboquant_k8v4", block_size=16, use_mla=False, has_sink=False,
                use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=DeviceCapability(9, 0), attn_type="decoder")
    for hs in (64, 128, 256):
        assert B.validate_configuration(head_size=hs, **base) == [], hs
    for bad in (dict(head_size=96), dict(head_size=128, dtype=torch.float32), dict(head_size=128, block_size=8),
                dict(head_size=128, use_mla=True), dict(head_size=128, kv_cache_dtype="fp8")):
        assert B.validate_configuration(**{**base, **bad}), bad


def test_vllm_common_metadata_mixed_batch():
    """vLLM's CommonAttentionMetadata of a mixed batch (3 decodes, a prompt, a
    chunk over history, a 4-draft verification): our builder's split equals
    vLLM's, and attention over exact stand-in pages equals fp64 attention."""
    ours, kv, hist, q = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN, num_blocks=BLOCKS,
                                   seed=4)
    qsl = ours.query_start_loc
    cam = backend_mod.CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=ours.seq_lens, num_reqs=len(MIXED),
        num_actual_tokens=ours.num_actual_tokens, max_query_len=ours.max_query_len, max_seq_len=ours.max_seq_len,
        block_table_tensor=ours.block_table, slot_mapping=ours.slot_mapping)
    builder = V.TurboQuantMetadataBuilder(None, ["layer.0"], None, torch.device("cpu"))
    meta = builder.build(0, cam)
    nd, npf, ndt, npt = split_decodes_and_prefills(cam, decode_threshold=builder.reorder_batch_threshold)
    assert (meta.num_decodes, meta.num_decode_tokens) == (nd, ndt) == (3, 3)
    assert npf == 3 and npt == ours.num_actual_tokens - 3
    cache = stand_in_cache()
    write_all(cache, 0, MIXED, kv, hist, meta)
    impl = V.TurboQuantDeviceImpl(QH, D, 0.1, KVH, kv_cache_dtype="tq4").attach(cache, 0)
    out = torch.zeros_like(q)
    got = impl.forward(None, q, None, None, None, meta, output=out)
    n = ours.num_actual_tokens
    want = attention_reference(q[:n], qsl.tolist(), [k for k, _ in kv], [v for _, v in kv], scale=0.1)
    assert got is out and nmse(out[:n], want) <= 1e-12
