import numpy as np
import pytest

import turboquant as tq
from turboquant.integration.common import (
    KVQuantConfig,
    ProductionModeError,
    detect_backends,
    policy_from_config,
)


def unit_rows(n, d, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("bits,bound", [(1, 0.375), (2, 0.122), (3, 0.036), (4, 0.0098)])
def test_mse_round_trip_within_paper_bound(bits, bound):
    # Paper Thm 1: E||x - x_hat||^2 <= sqrt(3) pi / 2 * 4^-b for unit x; the
    # paper's algorithm (fp32 norms, no norm correction) gives 0.361, 0.116,
    # 0.034, 0.0093 at d = 128 (tq distortion reports the same values).
    c = tq.Codec(128, bits, seed=3, f32_scales=True, norm_correction=False)
    x = unit_rows(2000, 128)
    codes = c.encode(x)
    assert codes.dtype == np.uint8 and codes.shape == (2000, c.row_bytes)
    y = c.decode(codes)
    assert y.shape == x.shape and y.dtype == np.float32
    mse = float(np.mean(np.sum((x.astype(np.float64) - y) ** 2, axis=1)))
    assert mse <= bound
    assert mse <= np.sqrt(3) * np.pi / 2 * 4.0 ** -bits


def test_bytes_deterministic_and_thread_independent():
    x = unit_rows(300, 96, seed=5)
    a = tq.Codec(96, 3, seed=7, layer=1, head=2, role="key").encode(x)
    b = tq.Codec(96, 3, seed=7, layer=1, head=2, role="key").encode(x, threads=2)
    assert np.array_equal(a, b)
    c = tq.Codec(96, 3, seed=8, layer=1, head=2, role="key").encode(x)
    assert not np.array_equal(a, c)
    # A single row gives the same bytes as that row of the batch.
    assert np.array_equal(tq.Codec(96, 3, seed=7, layer=1, head=2, role="key").encode(x[4]), a[4])


def test_prod_inner_products_unbiased():
    d = 128
    c = tq.Codec(d, 3, kind="prod", seed=11)
    x = unit_rows(20000, d, seed=1)
    q = unit_rows(1, d, seed=2)[0]
    est = c.inner_products(q, c.encode(x))
    true = x.astype(np.float64) @ q
    slope = float(np.dot(est, true) / np.dot(true, true))
    assert abs(slope - 1.0) < 0.03


def test_bad_inputs_raise_value_error():
    c = tq.Codec(64, 4)
    with pytest.raises(ValueError, match="dtype must be float32, got float64"):
        c.encode(np.zeros((3, 64)))
    with pytest.raises(ValueError, match="last dimension must be 64, got 63"):
        c.encode(np.zeros((3, 63), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        c.encode(np.zeros((64, 3), np.float32).T)
    with pytest.raises(ValueError, match="2-D"):
        c.encode(np.zeros((2, 3, 64), np.float32))
    with pytest.raises(ValueError, match="dtype must be uint8"):
        c.decode(np.zeros((3, c.row_bytes), np.int32))
    bad = np.zeros((2, 64), np.float32)
    bad[1, 5] = np.nan
    with pytest.raises(ValueError, match="row 1"):
        c.encode(bad)
    with pytest.raises(ValueError, match="bits"):
        tq.Codec(64, 9)
    with pytest.raises(ValueError, match="kind"):
        tq.Codec(64, 3, kind="nope")
    with pytest.raises(TypeError):
        tq.Codec(64, 3, "mse")  # options are keyword-only


def test_torch_cpu_tensor_accepted():
    torch = pytest.importorskip("torch")
    c = tq.Codec(128, 4, seed=1)
    t = torch.from_numpy(unit_rows(50, 128))
    codes = c.encode(t)
    assert np.array_equal(codes, c.encode(t.numpy()))
    back = torch.from_numpy(c.decode(torch.from_numpy(codes)))
    assert back.shape == t.shape
    with pytest.raises(ValueError, match="dtype must be float32"):
        c.encode(t.to(torch.float16))


def test_presets_and_bytes():
    names = tq.preset_names()
    assert "k4_v4" in names and "k16_v16" in names
    assert tq.preset_bytes_per_token_head("k16_v16", 128) == 2 * 128 * 2
    assert tq.preset_bytes_per_token_head("k4_v4", 128) < 128 * 2
    assert 8.0 <= tq.preset_bits_per_value("k4_v4", 128) / 0.5 <= 10.0
    with pytest.raises(ValueError, match="k4_v4"):
        tq.preset_bytes_per_token_head("nope", 128)


def test_integration_common():
    caps = detect_backends()
    assert caps.cpu and caps.cpu_simd_target == tq.active_simd_target() != ""
    from turboquant import cuda as tqcuda
    if not tqcuda.available():
        assert caps.cuda is False and "CUDA" in caps.cuda_reason
    else:
        assert caps.cuda is True and caps.cuda_reason is None
    cfg = KVQuantConfig(preset="k3_v3", dense_first_layers=1, dense_last_layers=2,
                        layer_presets={3: "k8_v4"} if "k8_v4" in tq.preset_names() else {})
    p = policy_from_config(cfg, 6)
    assert p[0] == "k16_v16" and p[1] == "k3_v3" and p[4] == "k16_v16" and p[5] == "k16_v16"
    with pytest.raises(ValueError, match="unknown KV preset"):
        policy_from_config(KVQuantConfig(preset="nope"), 4)
    kp = [n for n in tq.preset_names() if n.startswith("kp")]
    if kp:
        with pytest.raises(ProductionModeError):
            KVQuantConfig(preset=kp[0], production=True).validate()
