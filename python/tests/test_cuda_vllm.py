"""The vLLM-compatible device cache on a GPU: vLLM-shaped mixed batches
(decode rows, a prompt chunk, a chunk over history, a verification of 4
draft tokens) against the CPU layer (PagedCompressedKVCache, the same bytes
in its pages), and the attention call captured in a CUDA graph. Skipped
without a CUDA device or without the CUDA backend in this build."""
import pytest

torch = pytest.importorskip("torch")

from turboquant import cuda as tqcuda  # noqa: E402
from turboquant.integration import vllm as V  # noqa: E402
from turboquant.integration.common import IntegrationError  # noqa: E402
from vllm_batches import MIXED, make_mixed, nmse, write_all  # noqa: E402

GPU = torch.cuda.is_available() and tqcuda.available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and the package built with the CUDA backend")

KVH, QH, D, BS, MAXLEN, BLOCKS = 2, 8, 128, 16, 256, 96


def _pair(cache_dtype, means=None):
    cpu = V.PagedCompressedKVCache(1, KVH, D, num_blocks=BLOCKS, block_size=BS, cache_dtype=cache_dtype, means=means)
    dev = V.DevicePagedCompressedKVCache(1, KVH, D, QH, num_blocks=BLOCKS, block_size=BS, cache_dtype=cache_dtype,
                                         means=means, max_num_seqs=16, max_num_batched_tokens=128,
                                         max_model_len=MAXLEN)
    return cpu, dev


def _to(meta, device):
    f = dict(meta.__dict__)
    for k in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        f[k] = f[k].to(device)
    return V.AttentionMetadata(**f)


@gpu
@pytest.mark.parametrize("cache_dtype", ["tq4", "k8v4", "turboquant_k8v4", "k8v8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("centred", [False, True])
def test_mixed_batch_matches_cpu_layer(cache_dtype, dtype, centred):
    """Acceptance: per sequence, NMSE <= 1e-5 between the GPU cache's one
    call and the CPU layer's dispatch, the same K/V written to both."""
    meta, kv, hist, q = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN, num_blocks=BLOCKS,
                                   seed=11)
    means = V.channel_means([(0, kv[0][0], kv[0][1])], center_values=True) if centred else None
    cpu, dev = _pair(cache_dtype, means)
    write_all(cpu, 0, MIXED, [(k.to(dtype).float(), v.to(dtype).float()) for k, v in kv], hist, meta)
    dmeta = _to(meta, "cuda")
    write_all(dev, 0, MIXED, kv, hist, dmeta, device="cuda", dtype=dtype)
    assert dev.take_write_errors() == {"out_of_range_slots": 0, "non_finite_inputs": 0, "scale_overflows": 0}
    qd = q.to("cuda", dtype)
    want = cpu.attention(0, qd.float().cpu(), meta, scale=0.09)
    out = torch.full_like(qd, 3.0)
    got = dev.attention(0, qd, dmeta, out=out, scale=0.09)
    torch.cuda.synchronize()
    got = got.float().cpu()
    cu = meta.query_start_loc.tolist()
    for b in range(len(MIXED)):
        assert nmse(got[cu[b]:cu[b + 1]], want[cu[b]:cu[b + 1]]) <= 1e-5, (cache_dtype, dtype, b)
    assert torch.all(got[cu[-1]:] == 0)


@gpu
def test_attention_call_captures_in_a_cuda_graph():
    """The call is captured once; new metadata values (same shapes) copied
    into the captured tensors replay to the eager result, and capture
    allocates nothing outside the graph's pool."""
    meta, kv, hist, q = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN, num_blocks=BLOCKS,
                                   seed=12)
    _, dev = _pair("k8v4")
    dmeta = _to(meta, "cuda")
    write_all(dev, 0, MIXED, kv, hist, dmeta, device="cuda", dtype=torch.float16)
    qd = q.to("cuda", torch.float16)
    out = torch.zeros_like(qd)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dev.attention(0, qd, dmeta, out=out)  # warm-up: the per-shape plan is cached on the host
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    before = torch.cuda.memory_allocated()
    with torch.cuda.graph(graph):
        dev.attention(0, qd, dmeta, out=out)
    assert torch.cuda.memory_allocated() == before
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # a second batch of the same shape: other K/V, pages and queries
    meta2, kv2, hist2, q2 = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN,
                                       num_blocks=BLOCKS, seed=13)
    m2 = _to(meta2, "cuda")
    write_all(dev, 0, MIXED, kv2, hist2, m2, device="cuda", dtype=torch.float16)
    qd.copy_(q2.to("cuda", torch.float16))
    for k in ("query_start_loc", "seq_lens", "block_table"):
        getattr(dmeta, k).copy_(getattr(m2, k))
    graph.replay()
    fresh = dev.attention(0, qd, m2)
    torch.cuda.synchronize()
    assert torch.equal(out, fresh) and not torch.equal(out, eager)


@gpu
def test_device_cache_refusals():
    with pytest.raises(IntegrationError, match="not supported by the CUDA backend"):
        V.DevicePagedCompressedKVCache(1, KVH, D, QH, num_blocks=4, cache_dtype="k16v16")
    with pytest.raises(IntegrationError, match="not supported by the CUDA backend"):
        V.DevicePagedCompressedKVCache(1, KVH, 96, QH, num_blocks=4)
    _, dev = _pair("tq4")
    meta, kv, hist, q = make_mixed(MIXED, kvh=KVH, qh=QH, d=D, bs=BS, max_model_len=MAXLEN, num_blocks=BLOCKS,
                                   seed=14)
    with pytest.raises(IntegrationError, match="is on cpu"):
        dev.attention(0, q.cuda(), meta)  # host metadata: nothing is copied behind the caller's back
    with pytest.raises(IntegrationError, match="is on cpu"):
        dev.reshape_and_cache(0, kv[0][0], kv[0][1], torch.arange(41))
