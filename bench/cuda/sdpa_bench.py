#!/usr/bin/env python3
"""torch SDPA decode (or, with --q-len, extend: q_len new queries at the end of
N tokens) on fp16 KV (flash and cuDNN backends) and the device copy bandwidth,
for the same grid as tq_cuda_bench. JSON on stdout, progress on stderr.

    python3 bench/cuda/sdpa_bench.py --batch 1,8,16,32 --context 4096,32768,131072
    python3 bench/cuda/sdpa_bench.py --batch 16 --context 32768 --q-len 4,16

Extend masks: each backend is timed with the bottom-right causal mask
(torch.nn.attention.bias.causal_lower_right: query i sees keys <= N - q_len
+ i), mode "lower_right", and unmasked over all N keys (q_len^2 / 2 more
pairs; some backends run it faster), mode "nomask"; the faster counts.

q [B, Hq, 1, d], k/v [B, Hkv, N, d] fp16, enable_gqa=True (each backend reads
the KV once); a backend that refuses GQA is run on K/V expanded to Hq heads
and marked "expanded". Timing: CUDA events around 10 back-to-back calls
(rotating among copies of K/V when one copy fits in L2), median of 15 groups.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def copy_bandwidth():
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    b = torch.empty_like(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for i in range(12):
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        if i >= 2:
            t.append(e0.elapsed_time(e1))
    return 2.0 * n / (median(t) * 1e-3) / 1e9


def time_calls(fn, copies, reps=15, inner=10):
    for i in range(5):
        fn(i % copies)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for r in range(reps):
        e0.record()
        for i in range(inner):
            fn((r * inner + i) % copies)
        e1.record()
        e1.synchronize()
        t.append(e0.elapsed_time(e1) / inner)
    return median(t)


def extend_case(B, N, ql, hq, hkv, d, backends):
    from torch.nn.attention.bias import causal_lower_right
    kv_bytes = 2 * B * hkv * N * d * 2
    copies = min(16, max(1, (512 << 20) // kv_bytes + 1))
    ks = [torch.randn(B, hkv, N, d, dtype=torch.float16, device="cuda") for _ in range(copies)]
    vs = [torch.randn(B, hkv, N, d, dtype=torch.float16, device="cuda") for _ in range(copies)]
    q = torch.randn(B, hq, ql, d, dtype=torch.float16, device="cuda")
    mask = causal_lower_right(ql, N)
    pairs = B * hq * (ql * (N - ql) + ql * (ql + 1) / 2)
    row = {"batch": B, "context": N, "q_len": ql, "kv_bytes": kv_bytes, "copies": copies}
    for name, be in backends:
        ms, mode = None, None
        for mname, m in (("lower_right", mask), ("nomask", None)):
            try:
                with sdpa_kernel([be]):
                    def fn(i):
                        return F.scaled_dot_product_attention(q, ks[i], vs[i], attn_mask=m, enable_gqa=True)
                    t = time_calls(fn, copies, reps=9, inner=5)
                row[f"{name}_{mname}_ms"] = t
                if ms is None or t < ms:
                    ms, mode = t, mname
            except Exception as e:
                row[f"{name}_{mname}_ms"] = None
                if ms is None:
                    mode = f"unavailable: {type(e).__name__}: {str(e)[:120]}"
        row[f"{name}_ms"] = ms
        row[f"{name}_mode"] = mode
        if ms:
            row[f"{name}_tflops"] = 4.0 * d * pairs / (ms * 1e-3) / 1e12
    print(f"B={B} N={N} q_len={ql} flash {row.get('flash_ms')} ({row.get('flash_mode')}) "
          f"cudnn {row.get('cudnn_ms')} ({row.get('cudnn_mode')})", file=sys.stderr)
    del ks, vs
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,16,32")
    ap.add_argument("--context", default="4096,32768,131072")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-len", default="1", help="query tokens a sequence; 1 = decode")
    args = ap.parse_args()
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    torch.manual_seed(0)
    cbw = copy_bandwidth()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, copy {cbw:.0f} GB/s", file=sys.stderr)
    results = []
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    q_lens = [int(x) for x in args.q_len.split(",")]
    for B in [int(x) for x in args.batch.split(",")]:
        for N in [int(x) for x in args.context.split(",")]:
            for ql in q_lens:
                if ql > 1:
                    results.append(extend_case(B, N, ql, hq, hkv, d, backends))
            if q_lens != [1] and 1 not in q_lens:
                continue
            kv_bytes = 2 * B * hkv * N * d * 2
            copies = min(16, max(1, (512 << 20) // kv_bytes + 1))
            ks = [torch.randn(B, hkv, N, d, dtype=torch.float16, device="cuda") for _ in range(copies)]
            vs = [torch.randn(B, hkv, N, d, dtype=torch.float16, device="cuda") for _ in range(copies)]
            q = torch.randn(B, hq, 1, d, dtype=torch.float16, device="cuda")
            row = {"batch": B, "context": N, "kv_bytes": kv_bytes, "copies": copies}
            for name, be in backends:
                ms, mode = None, None
                try:
                    with sdpa_kernel([be]):
                        def fn(i):
                            return F.scaled_dot_product_attention(q, ks[i], vs[i], enable_gqa=True)
                        ms = time_calls(fn, copies)
                        mode = "gqa"
                except Exception as e:  # backend refuses GQA: expand K/V
                    try:
                        kx = [k.repeat_interleave(hq // hkv, dim=1) for k in ks[:1]]
                        vx = [v.repeat_interleave(hq // hkv, dim=1) for v in vs[:1]]
                        with sdpa_kernel([be]):
                            def fn2(i):
                                return F.scaled_dot_product_attention(q, kx[0], vx[0])
                            ms = time_calls(fn2, 1)
                            mode = "expanded"
                        del kx, vx
                    except Exception as e2:
                        mode = f"unavailable: {type(e2).__name__}: {str(e2)[:120]}"
                row[f"{name}_ms"] = ms
                row[f"{name}_mode"] = mode
                if ms:
                    row[f"{name}_gbps"] = kv_bytes / (ms * 1e-3) / 1e9
            print(f"B={B} N={N} flash {row.get('flash_ms')} ({row.get('flash_mode')}) "
                  f"cudnn {row.get('cudnn_ms')} ({row.get('cudnn_mode')})", file=sys.stderr)
            results.append(row)
            del ks, vs
            torch.cuda.empty_cache()
    json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "copy_gbps": cbw,
               "results": results}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
