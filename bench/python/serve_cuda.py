#!/usr/bin/env python3
"""Serving workloads of the HF route on CUDA against transformers'
DynamicCache (docs/BENCHMARKS.md, "Serving on CUDA"). Needs a CUDA device and
the turboquant package built with the CUDA backend (docs/PYTHON.md).

Model: a Llama built from a config with seeded random weights (no download;
default 4 layers, hidden 2048, intermediate 5632, 32 query / 8 KV heads,
head_dim 128, vocab 32000), fp16. Dense = DynamicCache with attention
"sdpa"; ours = TurboQuantCache(device="cuda") with attention "turboquant".

Sections (--sections, comma-separated):

conversation  an --prompt1 token prompt, --gen greedy tokens, a --prompt2
              token second prompt over the history (the extend kernel), --gen
              more tokens. The dense run's greedy tokens are fed to every
              cache (teacher forcing). Logits compared with the dense run's at
              every step (the first prompt's last position, every position of
              the second prompt, every decode step): cosine of fp32 logits.
              KV bytes from torch's allocator counters, relative to
              base = memory_allocated() before the cache is built:
              held = memory_allocated() - base after each forward (its
              outputs dropped; the cache plus nothing else), and the peak
              during each decode phase (max_memory_allocated() - base: the
              cache, the decode workspace and one token's activations; for
              DynamicCache also torch.cat's transient copy of a layer).
padded        4 left-padded prompts of different lengths with q8 against the
              same prompts run one by one (python/tests/hf_runs.py, the driver
              of test_hf.py's padding test), on the CPU and on CUDA, and the
              same comparison for DynamicCache: min cosine over every real
              position.
throughput    decode tokens/s at --batch rows with --context tokens of history
              each (one prefill forward of the whole batch, then --warmup and
              --steps greedy decode steps timed with the device synchronized):
              DynamicCache + SDPA vs TurboQuantCache per preset, same run.
budget        the largest batch at each of --budget-contexts that fits
              --budget-gib of KV memory, both ways: dense from its fp16 bytes
              per token, ours from the page pool's bytes per token; ours is
              then checked by building that cache and reading
              memory_allocated().

Prints tables and a JSON document (--json also writes it); progress on stderr.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="conversation,padded,throughput,budget")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--init", type=float, default=0.02, help="initializer_range of the random weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt1", type=int, default=8192)
    ap.add_argument("--prompt2", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--conversation-presets", default="k8_v4,k4_v4,k3_v3")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--throughput-presets", default="k3_v3,k4_v4")
    ap.add_argument("--budget-gib", type=float, default=16.0)
    ap.add_argument("--budget-contexts", default="8192,32768,131072")
    ap.add_argument("--budget-preset", default="k3_v3")
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args()


def log(msg):
    print(f"[serve_cuda {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync():
    torch.cuda.synchronize()


def fresh():
    gc.collect()
    sync()
    torch.cuda.empty_cache()


class Bench:
    def __init__(self, a):
        from transformers import LlamaConfig, LlamaForCausalLM

        from turboquant.integration import hf

        self.a, self.hf = a, hf
        torch.manual_seed(a.seed)
        longest = max(a.prompt1 + a.prompt2 + 2 * a.gen, a.context + a.warmup + a.steps) + 16
        cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                          num_hidden_layers=a.layers, num_attention_heads=a.q_heads, num_key_value_heads=a.kv_heads,
                          head_dim=a.head_dim, initializer_range=a.init, max_position_embeddings=longest)
        with torch.device("cuda"):
            self.model = LlamaForCausalLM(cfg).to(dtype=torch.float16).eval()
        self.kw = hf.cache_kwarg(self.model)
        self.gen = torch.Generator().manual_seed(a.seed + 1)

    def tokens(self, *shape):
        return torch.randint(0, self.a.vocab, shape, generator=self.gen).cuda()

    def cache(self, kind, capacity, batch=1):
        from transformers import DynamicCache

        from turboquant.integration.common import KVQuantConfig
        if kind == "dense":
            self.model.set_attn_implementation("sdpa")
            return DynamicCache()
        self.model.set_attn_implementation(self.hf.ATTENTION_NAME)
        return self.hf.TurboQuantCache(self.model.config, kv_config=KVQuantConfig(preset=kind), device="cuda",
                                       max_cache_len=capacity, max_batch_size=batch)

    def forward(self, ids, cache, keep_all=False):
        """One forward; fp32 CPU logits [t or 1, vocab] of row 0; nothing of the
        step's outputs stays on the device."""
        with torch.no_grad():
            out = self.model(ids, use_cache=True, logits_to_keep=0 if keep_all else 1, **{self.kw: cache})
        logits = out.logits[0].float().cpu()
        del out
        return logits


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


# -------------------------------------------------------------------------------------------------
def conversation(b: Bench):
    a = b.a
    p1, p2 = b.tokens(1, a.prompt1), b.tokens(1, a.prompt2)
    capacity = a.prompt1 + a.prompt2 + 2 * a.gen
    forced = None
    runs = {}
    for kind in ["dense"] + [p for p in a.conversation_presets.split(",") if p]:
        log(f"conversation: {kind}")
        fresh()
        base = torch.cuda.memory_allocated()
        cache = b.cache(kind, capacity)
        sync()
        constructed = torch.cuda.memory_allocated() - base
        held, decode_peaks, logits = [], [], []
        toks = []

        def step(ids, keep_all=False):
            lg = b.forward(ids, cache, keep_all)
            sync()
            held.append(torch.cuda.memory_allocated() - base)
            logits.append(lg)
            return lg[-1].argmax().view(1, 1).cuda()

        def decode_phase(tok, offset):
            torch.cuda.reset_peak_memory_stats()
            for i in range(a.gen):
                if forced is not None:
                    tok = forced[offset + i].view(1, 1).cuda()
                toks.append(int(tok))
                tok = step(tok)
            decode_peaks.append(torch.cuda.max_memory_allocated() - base)

        t0 = time.perf_counter()
        tok = step(p1)
        decode_phase(tok, 0)
        tok = step(p2, keep_all=True)
        decode_phase(tok, a.gen)
        sync()
        r = {"constructed_bytes": constructed, "held_bytes_max": max(held), "held_bytes_final": held[-1],
             "decode_peak_bytes": max(decode_peaks), "seconds": time.perf_counter() - t0}
        if kind == "dense":
            forced = torch.tensor(toks)
            ref = logits
        else:
            # steps: [prompt1 last] + gen decodes + [prompt2, all positions] + gen decodes
            c_p1 = cos(logits[0], ref[0]).view(1)
            c_d1 = torch.stack([cos(x[0], y[0]) for x, y in zip(logits[1:1 + a.gen], ref[1:1 + a.gen])])
            c_p2 = cos(logits[1 + a.gen], ref[1 + a.gen])
            c_d2 = torch.stack([cos(x[0], y[0]) for x, y in zip(logits[2 + a.gen:], ref[2 + a.gen:])])
            allc = torch.cat([c_p1, c_d1, c_p2, c_d2])
            r.update({"cos_prompt1_last": c_p1.item(), "cos_decode1_min": c_d1.min().item(),
                      "cos_prompt2_min": c_p2.min().item(), "cos_decode2_min": c_d2.min().item(),
                      "cos_min": allc.min().item(), "cos_mean": allc.mean().item(),
                      "steps_compared": int(allc.numel()),
                      "pool_bytes": cache._paged.plane_bytes(), "stats": {
                          "sdpa_prefill_calls": cache.stats.sdpa_prefill_calls,
                          "gpu_extend_calls": cache.stats.gpu_extend_calls,
                          "gpu_decode_calls": cache.stats.gpu_decode_calls},
                      "write_errors": cache.take_write_errors()})
        del cache
        runs[kind] = r
    d = runs["dense"]
    for kind, r in runs.items():
        if kind != "dense":
            r["held_ratio"] = r["held_bytes_max"] / d["held_bytes_max"]
            r["decode_peak_ratio"] = r["decode_peak_bytes"] / d["decode_peak_bytes"]
    return {"capacity": capacity, "runs": runs}


# -------------------------------------------------------------------------------------------------
def padded(b: Bench):
    """The padding test's driver on its small models (python/tests/hf_runs.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tests"))
    from hf_runs import make_model, padded_vs_alone
    from transformers import DynamicCache

    from turboquant.integration import hf
    from turboquant.integration.common import KVQuantConfig
    g = torch.Generator().manual_seed(11)
    lens = [37, 20, 50, 9]
    prompts = [torch.randint(1, 256, (n,), generator=g) for n in lens]
    nxt = torch.randint(1, 256, (len(lens), 4), generator=g)
    out = {"prompt_lengths": lens, "decode_steps": 4}
    for device in ("cpu", "cuda"):
        model = make_model("llama").to(device)
        for chunks in (1, 2):
            log(f"padded: {device}, {chunks} prefill chunk(s)")
            extra = {"device": "cuda", "max_cache_len": 64} if device == "cuda" else {}
            row = {}
            for name, center in (("q8", True), ("q8_uncentred", False)):
                model.set_attn_implementation(hf.ATTENTION_NAME)
                cfg = KVQuantConfig(preset="q8", recent_window=8, sink_tokens=4, compress_chunk=8, center_keys=center)
                c = padded_vs_alone(model, prompts,
                                    lambda n: hf.TurboQuantCache(model.config, kv_config=cfg, max_batch_size=n, **extra),
                                    nxt, chunks)
                row[name] = c.min().item()
            model.set_attn_implementation("sdpa")
            row["dense"] = padded_vs_alone(model, prompts, lambda n: DynamicCache(), nxt, chunks).min().item()
            row["positions"] = int(c.numel())
            out[f"{device}_chunks{chunks}"] = row
    return out


# -------------------------------------------------------------------------------------------------
def throughput(b: Bench):
    a = b.a
    ids = b.tokens(a.batch, a.context)
    nxt = b.tokens(a.batch, a.warmup + a.steps)
    capacity = a.context + a.warmup + a.steps
    out = {"batch": a.batch, "context": a.context, "steps": a.steps}
    for kind in ["dense"] + [p for p in a.throughput_presets.split(",") if p]:
        log(f"throughput: {kind}, prefill {a.batch} x {a.context}")
        fresh()
        base = torch.cuda.memory_allocated()
        cache = b.cache(kind, capacity, a.batch)
        t0 = time.perf_counter()
        with torch.no_grad():
            o = b.model(ids, use_cache=True, logits_to_keep=1, **{b.kw: cache})
            del o
            sync()
            prefill_s = time.perf_counter() - t0
            log(f"throughput: {kind}, {a.steps} decode steps")
            for i in range(a.warmup):
                o = b.model(nxt[:, i:i + 1], use_cache=True, **{b.kw: cache})
                del o
            sync()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for i in range(a.warmup, a.warmup + a.steps):
                o = b.model(nxt[:, i:i + 1], use_cache=True, **{b.kw: cache})
                del o
            sync()
            dt = time.perf_counter() - t0
        out[kind] = {"prefill_s": prefill_s, "decode_ms_per_step": 1e3 * dt / a.steps,
                     "tokens_per_s": a.batch * a.steps / dt,
                     "held_bytes": torch.cuda.memory_allocated() - base,
                     "decode_peak_bytes": torch.cuda.max_memory_allocated() - base}
        del cache
    for kind in out:
        if isinstance(out[kind], dict) and kind != "dense":
            out[kind]["speedup_vs_dense"] = out[kind]["tokens_per_s"] / out["dense"]["tokens_per_s"]
    return out


# -------------------------------------------------------------------------------------------------
def budget(b: Bench):
    import turboquant as tq
    a = b.a
    budget_bytes = int(a.budget_gib * 2**30)
    dense_per_token = a.layers * 2 * a.kv_heads * a.head_dim * 2  # fp16 K and V, every layer
    # the pool holds whole pages of block_size tokens; bytes per token from a real cache
    fresh()
    base = torch.cuda.memory_allocated()
    probe = b.cache(a.budget_preset, 1024, 1)
    ours_per_token = (torch.cuda.memory_allocated() - base) / probe._paged.capacity
    del probe
    rows = []
    for n in [int(x) for x in a.budget_contexts.split(",") if x]:
        dense_batch = budget_bytes // (dense_per_token * n)
        ours_batch = int(budget_bytes // (ours_per_token * n))
        fresh()
        base = torch.cuda.memory_allocated()
        log(f"budget: building {a.budget_preset} for {ours_batch} x {n}")
        c = b.cache(a.budget_preset, n, ours_batch)
        held = torch.cuda.memory_allocated() - base
        del c
        rows.append({"context": n, "dense_batch": int(dense_batch), "ours_batch": ours_batch,
                     "dense_bytes": int(dense_batch * dense_per_token * n), "ours_bytes_measured": int(held),
                     "fits": held <= budget_bytes, "ratio": ours_batch / max(dense_batch, 1)})
    return {"budget_bytes": budget_bytes, "preset": a.budget_preset, "dense_bytes_per_token": dense_per_token,
            "ours_bytes_per_token": ours_per_token,
            "bytes_per_token_head": tq.preset_bytes_per_token_head(a.budget_preset, a.head_dim), "rows": rows}


# -------------------------------------------------------------------------------------------------
def report(res):
    mib = 1 / 2**20
    print(f"device: {res['device']} | torch {res['torch']} | transformers {res['transformers']}")
    m = res["model"]
    print(f"model: Llama {m['layers']} layers, hidden {m['hidden']}, intermediate {m['intermediate']}, "
          f"{m['q_heads']}/{m['kv_heads']} heads, head_dim {m['head_dim']}, vocab {m['vocab']}, fp16, random weights")
    if "conversation" in res:
        c = res["conversation"]
        print(f"\nconversation (capacity {c['capacity']} tokens): cosine of logits vs DynamicCache; KV bytes "
              "(torch counters)")
        print("| cache | held max MiB | decode peak MiB | held ratio | decode peak ratio | cos min | cos mean | "
              "prompt-2 cos min | decode cos min |")
        print("|---|---|---|---|---|---|---|---|---|")
        for k, r in c["runs"].items():
            if k == "dense":
                print(f"| dense | {r['held_bytes_max'] * mib:.1f} | {r['decode_peak_bytes'] * mib:.1f} | 1 | 1 | "
                      "| | | |")
            else:
                print(f"| {k} | {r['held_bytes_max'] * mib:.1f} | {r['decode_peak_bytes'] * mib:.1f} | "
                      f"{r['held_ratio']:.4f} | {r['decode_peak_ratio']:.4f} | {r['cos_min']:.5f} | "
                      f"{r['cos_mean']:.6f} | {r['cos_prompt2_min']:.5f} | "
                      f"{min(r['cos_decode1_min'], r['cos_decode2_min']):.5f} |")
    if "padded" in res:
        p = res["padded"]
        print("\nleft-padded batch (q8) vs one by one: min cosine over every real position")
        print("| device, prefill chunks | q8 | q8, keys not centred | DynamicCache | positions |")
        print("|---|---|---|---|---|")
        for k, r in p.items():
            if isinstance(r, dict):
                print(f"| {k} | {r['q8']:.6f} | {r['q8_uncentred']:.6f} | {r['dense']:.6f} | {r['positions']} |")
    if "throughput" in res:
        t = res["throughput"]
        print(f"\ndecode throughput, batch {t['batch']}, {t['context']} tokens of history, {t['steps']} steps")
        print("| cache | prefill s | ms/step | tokens/s | vs dense | held MiB |")
        print("|---|---|---|---|---|---|")
        for k, r in t.items():
            if isinstance(r, dict):
                print(f"| {k} | {r['prefill_s']:.2f} | {r['decode_ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | "
                      f"{r.get('speedup_vs_dense', 1.0):.2f} | {r['held_bytes'] * mib:.0f} |")
    if "budget" in res:
        g = res["budget"]
        print(f"\n{g['budget_bytes'] / 2**30:.0f} GiB KV budget: dense {g['dense_bytes_per_token']} B/token, "
              f"{g['preset']} {g['ours_bytes_per_token']:.1f} B/token (all layers)")
        print("| context | dense batch | ours batch | ours bytes (built) | fits |")
        print("|---|---|---|---|---|")
        for r in g["rows"]:
            print(f"| {r['context']} | {r['dense_batch']} | {r['ours_batch']} | {r['ours_bytes_measured']} | "
                  f"{r['fits']} |")


def main():
    a = parse()
    import transformers

    from turboquant import cuda as tqcuda
    if not torch.cuda.is_available() or not tqcuda.available():
        print("needs a CUDA device and turboquant built with the CUDA backend:",
              tqcuda.unavailable_reason() or "torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    b = Bench(a)
    res = {"device": torch.cuda.get_device_name(), "turboquant_cuda": tqcuda.device_description(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "model": {k: getattr(a, k) for k in ("layers", "hidden", "intermediate", "q_heads", "kv_heads", "head_dim",
                                                "vocab", "init", "seed")},
           "config": vars(a)}
    sections = {"conversation": conversation, "padded": padded, "throughput": throughput, "budget": budget}
    for name in [s for s in a.sections.split(",") if s]:
        if name not in sections:
            print(f"unknown section {name!r}; sections: {', '.join(sections)}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        res[name] = sections[name](b)
        log(f"{name}: {time.perf_counter() - t0:.1f} s")
    report(res)
    js = json.dumps(res, indent=1, default=str)
    print("\nJSON:\n" + js)
    if a.json:
        with open(a.json, "w") as f:
            f.write(js)
    return 0


if __name__ == "__main__":
    sys.exit(main())
