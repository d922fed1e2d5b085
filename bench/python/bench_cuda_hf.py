#!/usr/bin/env python3
"""HF production route on CUDA: KV bytes held at a long prompt, logits
cosine vs the dense cache, and generation end to end (docs/BENCHMARKS.md,
"Python package on CUDA"). Needs the turboquant package installed with the
CUDA backend (docs/PYTHON.md).

Model: a Llama built from a config with seeded random weights (no download),
fp16 on the GPU. Prompt: --tokens random token ids.

What is measured (all with torch's caching-allocator counters, which see
every tensor of the run: the model's activations, the dense DynamicCache's
K/V tensors, and our cache's plane tensors, block tables, lengths and decode
workspace, all torch allocations):

* base = torch.cuda.memory_allocated() after the model is on the GPU and
  before the cache is constructed (so the weights are excluded and the cache's
  construction -- for ours, the whole page pool for max_cache_len -- is
  included);
* held_after_prefill = memory_allocated() - base after the prompt's forward
  (logits_to_keep=1, outputs dropped): the bytes the cache holds;
* prefill_peak = max_memory_allocated() - base over the prompt's forward
  (activations included, the same model code for both caches);
* decode_peak = max_memory_allocated() - base over --decode-steps greedy
  single-token steps after a reset of the peak counter: what the cache holds
  plus the decode steps' transient memory (for DynamicCache this includes
  torch.cat's copy of a layer's K/V as it grows);
* kv_ratio_* = ours / dense for each.

Not in torch's counters: the C++ DeviceLayer's own cudaMalloc'd tables
(rotation signs, codebooks, error counters: a few KiB per layer, listed as
`untracked_table_bytes_estimate`).

Quality: the dense run's greedy tokens are fed to both caches for
--decode-steps steps after the prompt; cosine of the fp32 logits per step.
Generation: hf.generate (greedy) for --gen-tokens new tokens with each cache.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time

import torch


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--init", type=float, default=0.02, help="initializer_range of the random weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-preset", default="k4_v4")
    ap.add_argument("--quality-presets", default="q8,k8_v4,turboquant_k8v4,k4_v4,k3_v3")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--gen-preset", default="k4_v4")
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args()


def sync():
    torch.cuda.synchronize()


def main():
    a = parse()
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from turboquant import cuda as tqcuda
    from turboquant.integration import hf
    from turboquant.integration.common import KVQuantConfig

    if not torch.cuda.is_available() or not tqcuda.available():
        print("needs a CUDA device and turboquant built with the CUDA backend:",
              tqcuda.unavailable_reason() or "torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    torch.manual_seed(a.seed)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.q_heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.head_dim, initializer_range=a.init,
                      max_position_embeddings=max(4096, a.tokens + a.gen_tokens + a.decode_steps + 16))
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.float16).eval()
    ids = torch.randint(0, a.vocab, (1, a.tokens), generator=torch.Generator().manual_seed(a.seed + 1)).cuda()
    kw = hf.cache_kwarg(model)
    capacity = a.tokens + max(a.decode_steps, a.gen_tokens) + 1
    res = {"device": torch.cuda.get_device_name(), "turboquant_cuda": tqcuda.device_description(),
           "torch": torch.__version__, "config": {k: getattr(a, k) for k in vars(a)}}
    import transformers
    res["transformers"] = transformers.__version__

    def new_cache(kind):
        if kind == "dense":
            return DynamicCache()
        return hf.TurboQuantCache(model.config, kv_config=KVQuantConfig(preset=kind), device="cuda",
                                  max_cache_len=capacity)

    def set_attn(kind):
        model.set_attn_implementation("sdpa" if kind == "dense" else hf.ATTENTION_NAME)

    # ---------------- memory -------------------------------------------------
    def memory(kind):
        set_attn(kind)
        gc.collect()
        sync()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        cache = new_cache(kind)
        sync()
        constructed = torch.cuda.memory_allocated() - base
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(ids, use_cache=True, logits_to_keep=1, **{kw: cache})
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        sync()
        prefill_s = time.perf_counter() - t0
        held = torch.cuda.memory_allocated() - base
        prefill_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(a.decode_steps):
                out = model(tok, use_cache=True, **{kw: cache})
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                del out
        sync()
        decode_s = time.perf_counter() - t0
        decode_peak = torch.cuda.max_memory_allocated() - base
        held_after = torch.cuda.memory_allocated() - base
        r = {"constructed_bytes": constructed, "held_after_prefill": held, "prefill_peak": prefill_peak,
             "decode_peak": decode_peak, "held_after_decode": held_after, "prefill_s": prefill_s,
             "decode_ms_per_token": 1e3 * decode_s / max(a.decode_steps, 1)}
        if kind != "dense":
            led = cache.ledger()
            r["ledger"] = led
            r["write_errors"] = cache.take_write_errors()
            r["stats"] = {"sdpa_prefill_calls": cache.stats.sdpa_prefill_calls,
                          "gpu_decode_calls": cache.stats.gpu_decode_calls, "gpu_writes": cache.stats.gpu_writes}
            # signs (2 rounds x heads x head_dim bits) + codebooks + counters, per layer per role
            r["untracked_table_bytes_estimate"] = a.layers * (2 * (2 * a.kv_heads * a.head_dim // 8 + 1024) + 64)
        del cache
        return r

    dense_kv_theory = a.layers * 2 * a.tokens * a.kv_heads * a.head_dim * 2
    mem = {"dense": memory("dense"), a.mem_preset: memory(a.mem_preset)}
    d, q = mem["dense"], mem[a.mem_preset]
    res["memory"] = mem
    res["dense_kv_bytes_theory"] = dense_kv_theory
    res["kv_ratio_held_after_prefill"] = q["held_after_prefill"] / d["held_after_prefill"]
    res["kv_ratio_decode_peak"] = q["decode_peak"] / d["decode_peak"]
    res["kv_ratio_held_after_decode"] = q["held_after_decode"] / d["held_after_decode"]

    # ---------------- quality ------------------------------------------------
    def logits_run(kind, forced=None):
        set_attn(kind)
        cache = new_cache(kind)
        outs, toks = [], []
        with torch.no_grad():
            out = model(ids, use_cache=True, logits_to_keep=1, **{kw: cache})
            outs.append(out.logits[0, -1].float())
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            for i in range(a.decode_steps):
                if forced is not None:
                    tok = forced[i].view(1, 1)
                toks.append(tok.view(()))
                out = model(tok, use_cache=True, **{kw: cache})
                outs.append(out.logits[0, -1].float())
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
        del cache
        return torch.stack(outs), torch.stack(toks)

    ref, forced = logits_run("dense")
    quality = {}
    for p in [s for s in a.quality_presets.split(",") if s]:
        if not tqcuda.is_supported(p, a.head_dim, gqa_ratio=a.q_heads // a.kv_heads):
            quality[p] = {"unsupported": tqcuda.unsupported_reason(p, a.head_dim)}
            continue
        got, _ = logits_run(p, forced)
        c = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        dec = c[1:]
        quality[p] = {"prompt_last_cosine": c[0].item(), "decode_cosine_min": dec.min().item(),
                      "decode_cosine_mean": dec.mean().item(),
                      "decode_top1_agree": (got[1:].argmax(-1) == ref[1:].argmax(-1)).float().mean().item(),
                      "bytes_per_token_head": __import__("turboquant").preset_bytes_per_token_head(p, a.head_dim)}
    res["quality"] = quality

    # ---------------- generation ---------------------------------------------
    gen = {}
    for kind in ["dense", a.gen_preset]:
        set_attn(kind)
        cache = new_cache(kind)
        sync()
        t0 = time.perf_counter()
        out = hf.generate(model, ids, cache, max_new_tokens=a.gen_tokens, pad_token_id=0)
        sync()
        gen[kind] = {"tokens": out[0, a.tokens:].tolist(), "seconds": time.perf_counter() - t0,
                     "new_tokens": int(out.shape[1] - a.tokens)}
        if kind != "dense":
            gen[kind]["cache_len"] = cache.get_seq_length()
            gen[kind]["write_errors"] = cache.take_write_errors()
        del cache
    dt, gt = gen["dense"]["tokens"], gen[a.gen_preset]["tokens"]
    agree = 0
    while agree < min(len(dt), len(gt)) and dt[agree] == gt[agree]:
        agree += 1
    gen["greedy_prefix_agreement"] = agree
    res["generation"] = gen

    # ---------------- report -------------------------------------------------
    mib = 1 / 2**20
    print(f"device: {res['device']} | torch {res['torch']} | transformers {res['transformers']}")
    print(f"model: Llama {a.layers} layers, hidden {a.hidden}, {a.q_heads} q / {a.kv_heads} kv heads, "
          f"head_dim {a.head_dim}, fp16, random weights (init {a.init}, seed {a.seed}); prompt {a.tokens} tokens")
    print(f"dense KV bytes (theory, fp16 K+V): {dense_kv_theory * mib:.2f} MiB")
    print()
    print("| cache | constructed MiB | held after prefill MiB | prefill peak MiB | decode peak MiB | "
          "held after decode MiB | decode ms/token |")
    print("|---|---|---|---|---|---|---|")
    for k, r in mem.items():
        print(f"| {k} | {r['constructed_bytes'] * mib:.2f} | {r['held_after_prefill'] * mib:.2f} | "
              f"{r['prefill_peak'] * mib:.2f} | {r['decode_peak'] * mib:.2f} | {r['held_after_decode'] * mib:.2f} | "
              f"{r['decode_ms_per_token']:.2f} |")
    print(f"\nratio {a.mem_preset}/dense: held after prefill {res['kv_ratio_held_after_prefill']:.4f}, "
          f"decode peak (max_memory_allocated) {res['kv_ratio_decode_peak']:.4f}, "
          f"held after decode {res['kv_ratio_held_after_decode']:.4f}")
    print("\n| preset | bytes/token/head | prompt-last cosine | decode cosine min | mean | top-1 agree |")
    print("|---|---|---|---|---|---|")
    for p, r in quality.items():
        if "unsupported" in r:
            print(f"| {p} | unsupported: {r['unsupported']} |")
            continue
        print(f"| {p} | {r['bytes_per_token_head']} | {r['prompt_last_cosine']:.6f} | {r['decode_cosine_min']:.6f} | "
              f"{r['decode_cosine_mean']:.6f} | {r['decode_top1_agree']:.3f} |")
    print(f"\ngeneration: dense {gen['dense']['new_tokens']} new tokens in {gen['dense']['seconds']:.2f} s; "
          f"{a.gen_preset} {gen[a.gen_preset]['new_tokens']} new tokens in {gen[a.gen_preset]['seconds']:.2f} s; "
          f"greedy tokens agree for the first {agree}")
    js = json.dumps(res, indent=1, default=str)
    print("\nJSON:\n" + js)
    if a.json:
        with open(a.json, "w") as f:
            f.write(js)
    ok = (res["kv_ratio_decode_peak"] <= 0.35 and res["kv_ratio_held_after_prefill"] <= 0.35
          and gen[a.gen_preset]["new_tokens"] == a.gen_tokens)
    print("acceptance (4-bit <= 35% of dense KV bytes, generation end to end):", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
