"""vLLM-compatible layer: registry, page geometry, recipe metadata (validation,
discovery, TP slicing), calibration, paged ops and runtime dispatch, verify,
and the hooks on a model runner shaped like vLLM's (built here: vLLM itself is
not installed)."""
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import turboquant as tq  # noqa: E402
from turboquant.integration import vllm as V  # noqa: E402
from turboquant.integration.common import IntegrationError, KVQuantConfig, ProductionModeError  # noqa: E402


def ref_rows(q, k, v, lens, scale):
    """fp64: q [rows, Hq, d]; k, v [n, Hkv, d] of one sequence; row r sees k[:lens[r]]."""
    out = []
    for r in range(q.shape[0]):
        out.append(V.fp64_attention_row(q[r], k[: lens[r]], v[: lens[r]], scale))
    return torch.stack(out)


# ---------------------------------------------------------------------------
# registry and geometry


def test_cache_dtype_registry():
    assert V.resolve_cache_dtype("tq2") == "k2_v2"
    assert V.resolve_cache_dtype("tq3") == "k3_v3"
    assert V.resolve_cache_dtype("tq4") == "k4_v4"
    assert V.resolve_cache_dtype("k8v4") == "k8_v4"
    assert V.resolve_cache_dtype("k16v2") == "k16_v2"
    for name in ("turboquant25", "turboquant35") + V.UPSTREAM_CACHE_DTYPES:
        assert V.resolve_cache_dtype(name) == name
    presets = set(tq.preset_names())
    assert all(V.resolve_cache_dtype(n) in presets for n in V.cache_dtype_names())
    for bad in ("auto", "fp8", "k5v4", "", None):
        with pytest.raises(ValueError, match="accepted: tq2, tq3, tq4"):
            V.resolve_cache_dtype(bad)


@pytest.mark.parametrize("dtype", ["tq4", "turboquant_k8v4", "turboquant35", "k16v16"])
def test_page_geometry_matches_the_pool(dtype):
    g = V.page_geometry(dtype, 128, 2, 16)
    assert g["key_payload_stride"] % 16 == 0 and g["value_payload_stride"] % 16 == 0
    per_token = g["key_payload_bytes"] + g["key_meta_bytes"] + g["value_payload_bytes"] + g["value_meta_bytes"]
    assert per_token == tq.preset_bytes_per_token_head(V.resolve_cache_dtype(dtype), 128)
    cache = V.PagedCompressedKVCache(3, 2, 128, num_blocks=10, block_size=16, cache_dtype=dtype)
    led = cache.ledger()
    pool = led["total"] - led["codec_state"] - led["means"]
    expect = 3 * 10 * g["bytes_per_block"]
    # planes are allocated with 64-byte alignment: at most 63 bytes per plane
    assert expect <= pool <= expect + 3 * 4 * 64, (pool, expect)
    assert g["dense_fp16_bytes_per_block"] == 2 * 2 * 128 * 2 * 16


# ---------------------------------------------------------------------------
# metadata


def good_meta(recipe="turboquant35", d=128, layers=2, heads=4):
    rng = np.random.default_rng(0)
    ch = [[sorted(rng.choice(d, d // 4, replace=False).tolist()) for _ in range(heads)] for _ in range(layers)]
    cal = {"method": "channel_energy", "num_prompts": 2, "num_tokens": 50,
           "prompts_sha256": V.prompts_sha256(["a", "b"])}
    return V.build_metadata(recipe, d, layers, heads, key_channels=ch, value_channels=ch[::-1], calibration=cal)


def test_metadata_malformed_types_and_bytes_raise_metadata_error(tmp_path):
    """The inputs the recipe-metadata fuzzer found raising other errors."""
    for field, value in (("recipe", ["k8v4"]), ("tensor_parallel", 1.5)):
        with pytest.raises(V.MetadataError, match=field):
            V.validate_metadata({**good_meta(), field: value})
    with pytest.raises(V.MetadataError, match="codebook.kind"):
        V.validate_metadata({**good_meta(), "codebook": {"kind": {}, "version": 1}})
    path = tmp_path / V.METADATA_FILENAME
    path.write_bytes(b'{"format": "\xf8"}')
    with pytest.raises(V.MetadataError, match="UTF-8"):
        V.load_metadata(str(path))
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(V.MetadataError, match="nested too deeply"):
        V.load_metadata(str(path))


def test_metadata_roundtrip_and_discovery(tmp_path):
    meta = good_meta()
    assert meta["version"] == V.METADATA_VERSION and meta["transform"]["kind"] == "block_hadamard"
    assert V.discover_metadata(str(tmp_path)) is None
    V.save_metadata(meta, str(tmp_path / V.METADATA_FILENAME))
    assert V.discover_metadata(str(tmp_path)) == meta
    assert [p.name for p in tmp_path.iterdir()] == [V.METADATA_FILENAME]  # no temp left behind
    with pytest.raises(ValueError, match="does not exist"):
        V.discover_metadata(str(tmp_path / "nope"))
    (tmp_path / V.METADATA_FILENAME).write_text("{not json")
    with pytest.raises(V.MetadataError, match="not valid JSON"):
        V.discover_metadata(str(tmp_path))
    # non-split recipes carry empty channel lists
    plain = V.build_metadata("tq4", 64, 1, 2)
    assert plain["layers"][0]["key_high_precision_channels"] == [[], []]
    assert V.prompts_sha256(["a", "b"]) != V.prompts_sha256(["b", "a"])
    assert V.prompts_sha256([[1, 2]]) == V.prompts_sha256([(1, 2)])


def _set(meta, path, value):
    obj = meta
    keys = path.split(".")
    for k in keys[:-1]:
        obj = obj[int(k)] if isinstance(obj, list) else obj[k]
    last = keys[-1]
    if value is KeyError:
        del obj[last]
    elif isinstance(obj, list):
        obj[int(last)] = value
    else:
        obj[last] = value


@pytest.mark.parametrize("path,value,message", [
    ("format", "other", "'format' is 'other'; accepted: 'turboquant-kv-recipe'"),
    ("version", 2, "'version' is 2; accepted: \\[1\\]"),
    ("version", KeyError, "'version' is missing"),
    ("recipe", "tq5", "'recipe' is 'tq5'; accepted: tq2, tq3, tq4"),
    ("head_size", "128", "'head_size' must be an integer"),
    ("head_size", 126, "'head_size' is 126; recipe turboquant35 needs a multiple of 4"),
    ("num_kv_heads", 0, "'num_kv_heads' must be >= 1"),
    ("transform.kind", "haar", "'transform.kind' is 'haar'; accepted: \\['block_hadamard'\\]"),
    ("codebook.version", 3, "'codebook.version' is 3; accepted: \\[1\\]"),
    ("layers", [], "'layers' must be a list of num_layers = 2"),
    ("layers.1.layer", 0, "'layers\\[1\\].layer' is 0; accepted: \\[1\\]"),
    ("layers.0.key_high_precision_channels.2", list(range(31)), "has 31 channels; the recipe needs exactly 32"),
    ("layers.0.value_high_precision_channels.0", [128] + list(range(1, 32)), "in \\[0, 128\\), got 128"),
    ("layers.0.key_high_precision_channels.1", [1, 0] + list(range(2, 32)), "strictly ascending"),
    ("layers.1.key_high_precision_channels", [[]], "num_kv_heads = 4 channel lists"),
    ("calibration.prompts_sha256", "abc", "'calibration.prompts_sha256' must be 64 lowercase hex"),
    ("calibration.method", "magic", "accepted: \\['channel_energy', 'default'\\]"),
    ("calibration.num_prompts", 0, "'calibration.num_prompts' must be >= 1"),
])
def test_malformed_metadata_names_field(path, value, message):
    meta = json.loads(json.dumps(good_meta()))
    _set(meta, path, value)
    with pytest.raises(V.MetadataError, match=message):
        V.validate_metadata(meta)
    assert issubclass(V.MetadataError, ValueError)


def test_malformed_metadata_other_cases(tmp_path):
    meta = V.build_metadata("tq4", 64, 1, 1)
    meta["layers"][0]["key_high_precision_channels"] = [[0, 1]]
    with pytest.raises(V.MetadataError, match="no high-precision group: accepted: \\[\\]"):
        V.validate_metadata(meta)
    with pytest.raises(V.MetadataError, match="JSON object"):
        V.validate_metadata([1])
    # metadata that does not fit the cache it is given to
    with pytest.raises(V.MetadataError, match="'num_kv_heads' is 4, the model has 2"):
        V.PagedCompressedKVCache(2, 2, 128, num_blocks=4, cache_dtype="turboquant35", metadata=good_meta())
    with pytest.raises(V.MetadataError, match="'recipe' is 'turboquant35'"):
        V.PagedCompressedKVCache(2, 4, 128, num_blocks=4, cache_dtype="turboquant25", metadata=good_meta())
    with pytest.raises(V.MetadataError, match="transform.seed"):
        V.PagedCompressedKVCache(2, 4, 128, num_blocks=4, cache_dtype="turboquant35", metadata=good_meta(),
                                 config=KVQuantConfig(seed=3))


def test_tensor_parallel_slicing():
    meta = good_meta(heads=4)
    parts = [V.slice_metadata_for_tp(meta, 2, r) for r in range(2)]
    for r, part in enumerate(parts):
        assert part["num_kv_heads"] == 2
        assert part["tensor_parallel"] == {"size": 2, "rank": r, "kv_heads": [2 * r, 2 * r + 1]}
        for layer, full in zip(part["layers"], meta["layers"]):
            for comp in ("key_high_precision_channels", "value_high_precision_channels"):
                assert layer[comp] == full[comp][2 * r: 2 * r + 2]
    # more ranks than KV heads: heads are replicated, as vLLM does
    rep = V.slice_metadata_for_tp(meta, 8, 5)
    assert rep["tensor_parallel"]["kv_heads"] == [2] and rep["num_kv_heads"] == 1
    assert rep["layers"][1]["key_high_precision_channels"] == [meta["layers"][1]["key_high_precision_channels"][2]]
    with pytest.raises(ValueError, match="not divisible by tp_size 3"):
        V.slice_metadata_for_tp(meta, 3, 0)
    with pytest.raises(ValueError, match="tp_rank"):
        V.slice_metadata_for_tp(meta, 2, 2)
    with pytest.raises(ValueError, match="already sliced"):
        V.slice_metadata_for_tp(parts[0], 2, 0)
    bad = json.loads(json.dumps(parts[1]))
    bad["tensor_parallel"]["rank"] = 2
    with pytest.raises(V.MetadataError, match="'tensor_parallel.rank' is 2; accepted: 0..1"):
        V.validate_metadata(bad)


def planted_kv(n, heads, d, outliers, gen):
    """Keys/values whose channels `outliers[h]` carry 6x the energy."""
    k = torch.randn(n, heads, d, generator=gen)
    v = torch.randn(n, heads, d, generator=gen)
    for h, chans in enumerate(outliers):
        k[:, h, chans] *= 6.0
        v[:, h, chans] *= 6.0
    return k, v


def test_calibration_picks_energy_channels_and_records_prompts():
    d, heads, layers = 64, 2, 2
    gen = torch.Generator().manual_seed(0)
    outliers = [list(range(48, 64)), list(range(1, 33, 2))]  # d/4 = 16 per head, outside the default [0, 16)
    acts = []
    for layer in range(layers):
        for _ in range(3):  # three prompts' worth of tokens
            k, v = planted_kv(20, heads, d, outliers, gen)
            acts.append((layer, k, v))
    prompts = ["the lighthouse", "a keeper", [1, 2, 3]]
    meta = V.calibrate("turboquant25", acts, prompts, num_layers=layers, num_kv_heads=heads, head_size=d)
    for layer in meta["layers"]:
        assert layer["key_high_precision_channels"] == outliers
        assert layer["value_high_precision_channels"] == outliers
    cal = meta["calibration"]
    assert cal["prompts_sha256"] == V.prompts_sha256(prompts) and cal["num_prompts"] == 3
    assert cal["num_tokens"] == 60
    # the same rule as the library's tq::ChooseOutlierChannels
    k = torch.cat([a[1] for a in acts if a[0] == 0])
    for h in range(heads):
        rows = k[:, h].contiguous().numpy()
        assert V.top_channels(V.channel_energy(k)[h:h + 1], 16)[0] == tq._core.choose_outlier_channels(rows, d, 16)
    with pytest.raises(ValueError, match="turboquant25"):
        V.calibrate("tq4", acts, prompts, num_layers=layers, num_kv_heads=heads, head_size=d)
    with pytest.raises(ValueError, match="no activations for layer 1"):
        V.calibrate("turboquant25", acts[:3], prompts, num_layers=layers, num_kv_heads=heads, head_size=d)


# ---------------------------------------------------------------------------
# paged ops


@pytest.mark.parametrize("dtype", ["tq4", "turboquant_k8v4", "tq3"])
def test_reshape_and_cache_and_paged_decode_match_reference(dtype):
    d, kvh, qh, bs = 128, 2, 8, 16
    cache = V.PagedCompressedKVCache(1, kvh, d, num_blocks=40, block_size=bs, cache_dtype=dtype)
    core = cache.core
    gen = torch.Generator().manual_seed(1)
    seqs, kv = [], []
    for n in (1, 37, 150):
        s = core.add_sequence()
        slots = torch.tensor(core.reserve_slots(s, n), dtype=torch.int64)
        k = torch.randn(n + 3, kvh, d, generator=gen).to(torch.bfloat16)  # bf16 in, padded tokens
        v = torch.randn(n + 3, kvh, d, generator=gen).to(torch.bfloat16)
        # vLLM pads: slot -1 entries are skipped, tokens beyond the slot mapping ignored
        cache.reshape_and_cache(0, k, v, torch.cat([slots, torch.tensor([-1])]))
        seqs.append(s)
        kv.append(n)
    assert cache.counters.tokens_written == 1 + 37 + 150
    max_blocks = max(len(core.block_table(s)) for s in seqs)
    bt = torch.zeros(3, max_blocks, dtype=torch.int32)
    for i, s in enumerate(seqs):
        t = core.block_table(s)
        bt[i, :len(t)] = torch.tensor(t)
    q = torch.randn(3, qh, d, generator=gen)
    out = cache.paged_decode(0, q, bt, torch.tensor(kv, dtype=torch.int32), scale=0.09)
    assert out.shape == (3, qh, d) and out.dtype == torch.float32
    for i, s in enumerate(seqs):
        kd, vd = (torch.from_numpy(a).view(kv[i], kvh, d) for a in core.dequantize_for_diagnostics(0, s))
        ref = ref_rows(q[i:i + 1], kd, vd, [kv[i]], 0.09)[0]
        assert float(((out[i] - ref) ** 2).sum() / (ref ** 2).sum()) <= 1e-6
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.reshape_and_cache(0, k, v, torch.zeros(3))
    with pytest.raises(ValueError, match="key/value must be"):
        cache.reshape_and_cache(0, torch.zeros(2, 3, d), torch.zeros(2, 3, d), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError):  # slot beyond the pool: nothing written
        cache.reshape_and_cache(0, torch.zeros(1, kvh, d), torch.zeros(1, kvh, d), torch.tensor([40 * bs]))


def make_batch(cache_blocks, bs, seqs, gen):
    """seqs: list of (context, new) -> AttentionMetadata over random distinct pages."""
    tables, lens, qsl, slots = [], [], [0], []
    perm = torch.randperm(cache_blocks, generator=gen).tolist()
    for ctx, new in seqs:
        total = ctx + new
        nb = -(-total // bs)
        pages = [perm.pop() for _ in range(nb)]
        tables.append(pages)
        lens.append(total)
        qsl.append(qsl[-1] + new)
        for t in range(ctx, total):
            slots.append(pages[t // bs] * bs + t % bs)
    mb = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (mb - len(t)) for t in tables], dtype=torch.int32)
    ctx_slots = []
    for (ctx, _), pages in zip(seqs, tables):
        ctx_slots.append([pages[t // bs] * bs + t % bs for t in range(ctx)])
    meta = V.AttentionMetadata(num_actual_tokens=qsl[-1], query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                               seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=bt,
                               slot_mapping=torch.tensor(slots, dtype=torch.int64),
                               max_query_len=max(n for _, n in seqs))
    return meta, ctx_slots


def test_runtime_dispatch_decode_prefill_chunked():
    d, kvh, qh, bs = 64, 2, 4, 8
    cache = V.PagedCompressedKVCache(1, kvh, d, num_blocks=64, block_size=bs, cache_dtype="k16v16")
    gen = torch.Generator().manual_seed(2)
    seqs = [(0, 1), (0, 20), (30, 1), (25, 9)]  # decode of a 1-token seq, prefill, decode, chunked prefill
    meta, ctx_slots = make_batch(64, bs, seqs, gen)
    ks, vs = [], []
    for (ctx, new), cs in zip(seqs, ctx_slots):
        k = torch.randn(ctx + new, kvh, d, generator=gen)
        v = torch.randn(ctx + new, kvh, d, generator=gen)
        if ctx:
            cache.reshape_and_cache(0, k[:ctx], v[:ctx], torch.tensor(cs, dtype=torch.int64))
        ks.append(k)
        vs.append(v)
    newk = torch.cat([k[ctx:] for k, (ctx, _) in zip(ks, seqs)])
    newv = torch.cat([v[ctx:] for v, (ctx, _) in zip(vs, seqs)])
    cache.reshape_and_cache(0, newk, newv, meta.slot_mapping)
    q = torch.randn(meta.num_actual_tokens + 2, qh, d, generator=gen)  # 2 padded rows
    out = cache.attention(0, q, meta, scale=0.125)
    assert out.shape == (meta.num_actual_tokens, qh, d)
    o = 0
    for (ctx, new), k, v in zip(seqs, ks, vs):
        ref = ref_rows(q[o:o + new], k, v, [ctx + i + 1 for i in range(new)], 0.125)
        assert torch.allclose(out[o:o + new].double(), ref, atol=2e-3), (ctx, new)
        o += new
    c = cache.counters
    assert (c.decode_rows, c.prefill_rows, c.chunked_rows, c.dense_fresh_rows) == (2, 20, 9, 0)
    # dense_fresh: prefills over their own K/V, exact; chunked prefill refuses
    with pytest.raises(IntegrationError, match="chunked prefill"):
        cache.attention(0, q, meta, scale=0.125, key=newk, value=newv, prefill="dense_fresh")
    meta2, _ = make_batch(64, bs, [(0, 12)], gen)
    k, v = torch.randn(12, kvh, d, generator=gen), torch.randn(12, kvh, d, generator=gen)
    cache.reshape_and_cache(0, k, v, meta2.slot_mapping)
    fresh = cache.attention(0, q[:12], meta2, scale=0.125, key=k, value=v, prefill="dense_fresh")
    assert torch.allclose(fresh.double(), ref_rows(q[:12], k, v, list(range(1, 13)), 0.125), atol=1e-5)
    assert cache.counters.dense_fresh_rows == 12
    with pytest.raises(ValueError, match="prefill must be"):
        cache.attention(0, q, meta, prefill="dense")


def test_calibrated_split_recipe_beats_default_channels_and_tp_slices():
    """turboquant35 with calibrated channels (moved to the high-precision group
    by a channel permutation) vs the library default channels [0, d/4), on
    keys/values whose outlier channels lie elsewhere; and a TP rank's sliced
    metadata vs another rank's."""
    d, kvh, qh, n = 64, 2, 4, 200
    gen = torch.Generator().manual_seed(3)
    outliers = [list(range(40, 56)), list(range(16, 32))]
    k, v = planted_kv(n, kvh, d, outliers, gen)
    meta = V.calibrate("turboquant35", [(0, k, v)], ["p"], num_layers=1, num_kv_heads=kvh, head_size=d)
    q = torch.randn(16, qh, d, generator=gen)
    lens = list(range(n - 15, n + 1))
    ref = ref_rows(q, k, v, lens, 0.125)

    def err(cache, kk, vv, qq, rr):
        slots = torch.arange(n, dtype=torch.int64)
        cache.reshape_and_cache(0, kk, vv, slots)
        bt = torch.arange(-(-n // 16), dtype=torch.int32).expand(len(lens), -1).contiguous()
        out = cache.paged_decode(0, qq, bt, torch.tensor(lens, dtype=torch.int32), scale=0.125).double()
        return float(((out - rr) ** 2).sum() / (rr ** 2).sum())

    calibrated = err(V.PagedCompressedKVCache(1, kvh, d, num_blocks=16, cache_dtype="turboquant35", metadata=meta),
                     k, v, q, ref)
    default = err(V.PagedCompressedKVCache(1, kvh, d, num_blocks=16, cache_dtype="turboquant35"), k, v, q, ref)
    assert calibrated < 0.7 * default, (calibrated, default)
    # TP: rank 1 holds KV head 1 (query heads 2, 3)
    r1 = V.slice_metadata_for_tp(meta, 2, 1)
    r0 = V.slice_metadata_for_tp(meta, 2, 0)
    k1, v1, q1 = k[:, 1:2].contiguous(), v[:, 1:2].contiguous(), q[:, 2:4].contiguous()
    ref1 = ref[:, 2:4]
    right = err(V.PagedCompressedKVCache(1, 1, d, num_blocks=16, cache_dtype="turboquant35", metadata=r1),
                k1, v1, q1, ref1)
    wrong = err(V.PagedCompressedKVCache(1, 1, d, num_blocks=16, cache_dtype="turboquant35", metadata=r0),
                k1, v1, q1, ref1)
    assert right < 0.7 * wrong, (right, wrong)


# ---------------------------------------------------------------------------
# verify


def test_verify_function_and_cli(tmp_path, capsys):
    rep = V.verify("tq4", num_q_heads=8, num_kv_heads=2, head_size=128, seq_lens=(1, 40), num_layers=2)
    assert rep["passed"] and rep["rows"] == 2 * (1 + 8)
    assert 0.93 <= rep["worst_cosine"] < 1.0 and 0 < rep["nmse"] < 0.05
    assert rep["page_bytes_used"] < 0.4 * rep["dense_fp16_bytes"] * 2  # pages are 16-token granular
    strict = V.verify("tq2", num_q_heads=4, num_kv_heads=2, head_size=64, min_cosine=0.9999)
    assert not strict["passed"]
    assert V.main(["verify", "--cache-dtype", "k8v8", "--num-q-heads", "4", "--num-kv-heads", "1",
                   "--head-size", "64", "--seq-lens", "5,70"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert V.main(["verify", "--cache-dtype", "tq2", "--num-q-heads", "4", "--num-kv-heads", "1",
                   "--head-size", "64", "--min-cosine", "0.9999"]) == 1
    assert V.main(["verify", "--cache-dtype", "fp8", "--num-q-heads", "4", "--num-kv-heads", "1",
                   "--head-size", "64"]) == 2
    assert "accepted" in capsys.readouterr().err
    # a local model directory: shapes from config.json, recipe metadata discovered
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 4,
                                                      "hidden_size": 512, "num_hidden_layers": 2}))
    V.save_metadata(good_meta("turboquant35", d=64, layers=2, heads=4), str(tmp_path / V.METADATA_FILENAME))
    proc = subprocess.run([sys.executable, "-m", "turboquant.integration.vllm", "verify", "--cache-dtype",
                           "turboquant35", "--model-dir", str(tmp_path), "--seq-lens", "3,50", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["metadata"] == "used" and rep["head_size"] == 64 and rep["num_kv_heads"] == 4
    assert rep["num_layers"] == 2 and rep["passed"]


# ---------------------------------------------------------------------------
# hooks on a vLLM-shaped model runner


class DenseImpl:
    """A dense CPU attention impl with vLLM v1's signatures and cache layout
    [2, num_blocks, block_size, num_kv_heads, head_size]."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads):
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        n = slot_mapping.shape[0]
        ok = slot_mapping >= 0
        s = slot_mapping[ok]
        bs = kv_cache.shape[2]
        kv_cache[0, s // bs, s % bs] = key[:n][ok]
        kv_cache[1, s // bs, s % bs] = value[:n][ok]

    def forward(self, layer, query, key, value, kv_cache, m, output=None):
        bs = kv_cache.shape[2]
        q = query.view(-1, self.num_heads, self.head_size)
        out = torch.zeros_like(q) if output is None else output.view(-1, self.num_heads, self.head_size)
        qsl = m.query_start_loc.tolist()
        for i, total in enumerate(m.seq_lens.tolist()):
            a, b = qsl[i], qsl[i + 1]
            t = torch.arange(total)
            pages = m.block_table[i, t // bs].long()
            k = kv_cache[0, pages, t % bs]
            v = kv_cache[1, pages, t % bs]
            ctx = total - (b - a)
            out[a:b] = ref_rows(q[a:b], k, v, [ctx + j + 1 for j in range(b - a)], self.scale).to(q.dtype)
        return out


class Model:
    """A toy decoder whose attention goes through static_forward_context's layers."""

    def __init__(self, layers=2, hidden=64, qh=4, kvh=2, d=32, vocab=50, seed=0, outliers=None):
        g = torch.Generator().manual_seed(seed)
        self.d, self.qh, self.kvh = d, qh, kvh
        self.emb = torch.randn(vocab, hidden, generator=g)
        self.pos = torch.randn(512, hidden, generator=g) * 0.5
        self.w = []
        for _ in range(layers):
            wk = torch.randn(hidden, kvh * d, generator=g) / math.sqrt(hidden)
            if outliers is not None:
                for h, chans in enumerate(outliers):
                    wk[:, [h * d + c for c in chans]] *= 5.0
            self.w.append([torch.randn(hidden, qh * d, generator=g) / math.sqrt(hidden), wk,
                           torch.randn(hidden, kvh * d, generator=g) / math.sqrt(hidden),
                           torch.randn(qh * d, hidden, generator=g) / math.sqrt(qh * d)])


class Runner:
    """Shaped like vLLM's GPUModelRunner where the hooks look:
    compilation_config.static_forward_context, layer.impl, layer.kv_cache, kv_caches."""

    def __init__(self, model, num_blocks=64, block_size=8):
        self.model = model
        self.block_size = block_size
        ctx = {}
        self.kv_caches = []
        for i in range(len(model.w)):
            cache = torch.zeros(2, num_blocks, block_size, model.kvh, model.d)
            layer = SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn", kv_cache=[cache],
                                    impl=DenseImpl(model.qh, model.d, 1 / math.sqrt(model.d), model.kvh))
            ctx[layer.layer_name] = layer
            self.kv_caches.append(cache)
        self.compilation_config = SimpleNamespace(static_forward_context=ctx)
        self.free = list(range(num_blocks))[::-1]
        self.tables = {}
        self.lens = {}

    def step(self, work):
        """work: list of (seq_id, token ids); returns logits of every new token [tokens, vocab]."""
        bs = self.block_size
        ids, pos, slots, qsl, lens, tables = [], [], [], [0], [], []
        for sid, toks in work:
            table = self.tables.setdefault(sid, [])
            start = self.lens.get(sid, 0)
            for j, t in enumerate(toks):
                p = start + j
                if p // bs >= len(table):
                    table.append(self.free.pop())
                ids.append(t)
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            self.lens[sid] = start + len(toks)
            qsl.append(qsl[-1] + len(toks))
            lens.append(self.lens[sid])
            tables.append(table)
        mb = max(len(t) for t in tables)
        meta = V.AttentionMetadata(
            num_actual_tokens=len(ids), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_table=torch.tensor([t + [0] * (mb - len(t)) for t in tables], dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(len(t) for _, t in work))
        # like vLLM's CUDA-graph padding: 3 extra rows past num_actual_tokens,
        # outside the slot mapping; their outputs are dropped
        n_real = len(ids)
        ids, pos = ids + [0, 0, 0], pos + [0, 0, 0]
        m = self.model
        x = m.emb[torch.tensor(ids)] + m.pos[torch.tensor(pos)]
        for layer, (wq, wk, wv, wo) in zip(self.compilation_config.static_forward_context.values(), m.w):
            h = x / x.norm(dim=-1, keepdim=True) * math.sqrt(x.shape[-1])
            q, k, v = (h @ wq).view(-1, m.qh, m.d), (h @ wk).view(-1, m.kvh, m.d), (h @ wv).view(-1, m.kvh, m.d)
            layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache[0], meta.slot_mapping)
            out = torch.zeros(len(ids), m.qh, m.d)
            out = layer.impl.forward(layer, q, k, v, layer.kv_cache[0], meta, output=out)
            x = x + out.reshape(len(ids), -1) @ wo
        return (x @ m.emb.T)[:n_real]


SCRIPT = [  # (seq, tokens): prefill A and B, decodes, C in two prefill chunks mixed with decodes
    [(0, list(range(1, 30))), (1, list(range(5, 22)))],
    [(0, [7]), (1, [8])],
    [(0, [9]), (1, [3]), (2, list(range(10, 26)))],
    [(0, [4]), (2, list(range(30, 42)))],
    [(0, [11]), (1, [12]), (2, [13])],
    [(0, [14]), (1, [15]), (2, [16])],
]


def run_script(runner, script=SCRIPT):
    return [runner.step(work) for work in script]


def assert_nonzero_rows(outs):
    for o in outs:
        assert torch.isfinite(o).all()
        assert (o.norm(dim=-1) > 1e-3).all()  # no zero rows: no dropped work


def cos_min(a, b):
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


@pytest.fixture(scope="module")
def baseline():
    return run_script(Runner(Model()))


def test_hooks_off_and_capture_only_leave_outputs_unchanged(baseline):
    for mode in ("off", "capture_only"):
        runner = Runner(Model())
        V.install_hooks(runner, mode)
        outs = run_script(runner)
        for a, b in zip(outs, baseline):
            assert torch.equal(a, b)
        st = V.get_stats(runner)
        assert st["mode"] == mode and st["dense_forward_calls"] == 2 * len(SCRIPT)
        assert st["dense_kv_updates"] == 2 * len(SCRIPT) and st["tq_forward_calls"] == 0
        assert st["fallbacks"] == 0
        if mode == "capture_only":
            assert st["captured_tokens"] == sum(len(t) for w in SCRIPT for _, t in w)
        V.uninstall_hooks(runner)
        assert "forward" not in vars(runner.compilation_config.static_forward_context[
            "model.layers.0.self_attn.attn"].impl)  # the original bound method is back


def test_capture_only_calibrates_planted_outliers():
    d = 32
    outliers = [list(range(20, 28)), list(range(0, 16, 2))]
    runner = Runner(Model(d=d, outliers=outliers))
    V.install_hooks(runner, "capture_only")
    prompts = [[w for _, t in work for w in t] for work in SCRIPT[:1]]
    run_script(runner, SCRIPT[:1])
    with pytest.raises(ValueError):
        V.calibration_metadata(runner, "tq4", prompts)
    meta = V.calibration_metadata(runner, "turboquant35", prompts)
    for layer in meta["layers"]:
        assert layer["key_high_precision_channels"] == outliers
    assert meta["calibration"]["num_tokens"] == 29 + 17
    assert meta["calibration"]["prompts_sha256"] == V.prompts_sha256(prompts)


def test_hybrid_prefill_dense_decode_compressed(baseline):
    runner = Runner(Model())
    V.install_hooks(runner, "hybrid", cache_dtype="k8v8")
    outs = run_script(runner)
    assert_nonzero_rows(outs)
    prefill_steps = [i for i, w in enumerate(SCRIPT) if max(len(t) for _, t in w) > 1]
    assert torch.equal(outs[0], baseline[0])  # first prefill: the original backend over the same K/V
    for i, (a, b) in enumerate(zip(outs, baseline)):
        if i:  # later steps read K/V of tokens whose hidden states went through TurboQuant decode
            assert not torch.equal(a, b) and cos_min(a, b) >= 0.999  # 8-bit: close
    st = V.get_stats(runner)
    assert st["dense_forward_calls"] == 2 * len(prefill_steps)
    assert st["tq_forward_calls"] == 2 * (len(SCRIPT) - len(prefill_steps))
    assert st["dense_kv_updates"] == st["tq_kv_updates"] == 2 * len(SCRIPT)  # both caches written
    assert st["tq_tokens_written"] == 2 * sum(len(t) for w in SCRIPT for _, t in w)
    assert all(c.abs().sum() > 0 for c in runner.kv_caches)
    with pytest.raises(IntegrationError, match="'hybrid' still uses the dense cache"):
        V.free_kv_cache(runner)
    with pytest.raises(ProductionModeError):
        V.install_hooks(Runner(Model()), "hybrid", config=KVQuantConfig(production=True))


@pytest.mark.parametrize("dtype,bar", [("k8v8", 0.999), ("tq4", 0.97)])
def test_full_tq_serves_everything_compressed_and_frees_dense(baseline, dtype, bar):
    runner = Runner(Model())
    V.install_hooks(runner, "full_tq", cache_dtype=dtype)
    outs = run_script(runner, SCRIPT[:3])
    # the dense cache is never written in full_tq
    assert all(float(c.abs().sum()) == 0.0 for c in runner.kv_caches)
    dense_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert V.free_kv_cache(runner) == dense_bytes
    assert all(c.numel() == 0 for c in runner.kv_caches)
    outs += run_script(runner, SCRIPT[3:])  # keeps running after the dense cache is gone
    assert_nonzero_rows(outs)
    for a, b in zip(outs, baseline):
        assert not torch.equal(a, b)
        assert cos_min(a, b) >= bar, (dtype, cos_min(a, b))
    st = V.get_stats(runner)
    assert st["dense_forward_calls"] == 0 and st["dense_kv_updates"] == 0
    assert st["tq_forward_calls"] == 2 * len(SCRIPT) and st["dense_freed_bytes"] == dense_bytes
    tokens = sum(len(t) for w in SCRIPT for _, t in w)
    rows = st["tq_decode_rows"] + st["tq_prefill_rows"] + st["tq_chunked_prefill_rows"]
    assert rows == 2 * tokens
    assert st["tq_chunked_prefill_rows"] == 2 * 12 and st["tq_prefill_rows"] == 2 * (29 + 17 + 16)
    assert 0 < st["tq_bytes"]


def test_full_tq_dense_fresh_prefill_and_errors(baseline):
    runner = Runner(Model())
    V.install_hooks(runner, "full_tq", cache_dtype="k8v8", prefill="dense_fresh")
    first = runner.step(SCRIPT[0])
    assert torch.allclose(first, baseline[0], atol=1e-4)  # prefill over its own fresh K/V: exact
    runner.step(SCRIPT[1])
    runner.step(SCRIPT[2])
    with pytest.raises(IntegrationError, match="chunked prefill"):
        runner.step(SCRIPT[3])  # C's second chunk has cached context
    with pytest.raises(IntegrationError, match="already installed"):
        V.install_hooks(runner, "off")
    with pytest.raises(ValueError, match="mode must be one of"):
        V.install_hooks(Runner(Model()), "shadow")
    with pytest.raises(IntegrationError, match="static_forward_context"):
        V.install_hooks(SimpleNamespace(), "off")
    with pytest.raises(IntegrationError, match="no turboquant hooks"):
        V.get_stats(Runner(Model()))
