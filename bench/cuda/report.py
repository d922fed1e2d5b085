#!/usr/bin/env python3
"""Joins tq_cuda_bench and sdpa_bench JSON into one table (markdown on stdout)
and one JSON file: per (preset, B, N, q_len) our decode or extend time, the
faster SDPA backend, speedup, KV GB/s and its fraction of the copy bandwidth
of the same run; for extend also TFLOP/s and the workspace bytes.

    python3 bench/cuda/report.py tq.json sdpa.json --json out.json
"""
import argparse
import json


def extend_table(tq, sd, base, out_json):
    rows = []
    print(f"device: {tq['device']}; torch {sd['torch']}\n")
    print("| preset | B | N | q_len | kernel | SDPA flash ms | SDPA cuDNN ms | tq ms | speedup vs faster SDPA | "
          "tq TFLOP/s | workspace bytes | splits | rows/CTA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in tq["results"]:
        s = base.get((r["batch"], r["context"], r.get("q_len", 1)), {})
        cands = [c for c in (s.get("flash_ms"), s.get("cudnn_ms")) if c]
        best = min(cands) if cands else None
        sp = best / r["tq_ms"] if best else None
        fmt = lambda x, m=None: (f"{x:.4f}" + (f" ({m})" if m and m not in ("gqa", "lower_right") else "")) if x \
            else (m or "-")
        kernel = r.get("kernel", "-")
        if r.get("kernel_asked", "auto") == "auto" and kernel != "-":
            kernel += " (auto)"
        print(f"| {r['preset']} | {r['batch']} | {r['context']} | {r.get('q_len', 1)} | {kernel} | "
              f"{fmt(s.get('flash_ms'), s.get('flash_mode'))} | {fmt(s.get('cudnn_ms'), s.get('cudnn_mode'))} | "
              f"{r['tq_ms']:.4f} | {f'{sp:.2f}x' if sp else '-'} | {r.get('tflops', 0):.1f} | "
              f"{r.get('workspace_bytes', '-')} | {r['splits']} | {r.get('rows_per_cta', '-')} |")
        rows.append(dict(r, sdpa_flash_ms=s.get("flash_ms"), sdpa_cudnn_ms=s.get("cudnn_ms"),
                         sdpa_flash_mode=s.get("flash_mode"), sdpa_cudnn_mode=s.get("cudnn_mode"),
                         sdpa_best_ms=best, speedup=sp))
    if out_json:
        json.dump({"device": tq["device"], "copy_gbps": tq["copy_gbps"], "torch": sd["torch"],
                   "results": rows}, open(out_json, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tq")
    ap.add_argument("sdpa")
    ap.add_argument("--json")
    a = ap.parse_args()
    tq = json.load(open(a.tq))
    sd = json.load(open(a.sdpa))
    base = {(r["batch"], r["context"], r.get("q_len", 1)): r for r in sd["results"]}
    if any(r.get("q_len", 1) > 1 for r in tq["results"]):
        extend_table(tq, sd, base, a.json)
        return
    rows = []
    print(f"device: {tq['device']}; copy bandwidth (read+write): ours {tq['copy_gbps']:.0f} GB/s, "
          f"torch {sd['copy_gbps']:.0f} GB/s; torch {sd['torch']}\n")
    print("| preset | B | N | SDPA flash ms | SDPA cuDNN ms | tq ms | speedup vs faster SDPA | tq KV GB/s | % of copy BW | write GB/s (% of copy) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in tq["results"]:
        s = base.get((r["batch"], r["context"], 1), {})
        cands = [s.get("flash_ms"), s.get("cudnn_ms")]
        cands = [c for c in cands if c]
        best = min(cands) if cands else None
        sp = best / r["tq_ms"] if best else None
        fmt = lambda x, m=None: (f"{x:.4f}" + (f" ({m})" if m and m != "gqa" else "")) if x else (m or "-")
        print(f"| {r['preset']} | {r['batch']} | {r['context']} | {fmt(s.get('flash_ms'), s.get('flash_mode'))} | "
              f"{fmt(s.get('cudnn_ms'), s.get('cudnn_mode'))} | {r['tq_ms']:.4f} | "
              f"{sp:.2f}x | {r['kv_gbps']:.0f} | {100 * r['kv_frac_of_copy']:.0f}% | "
              f"{r['write_gbps']:.0f} ({100 * r['write_frac_of_copy']:.0f}%) |" if sp else
              f"| {r['preset']} | {r['batch']} | {r['context']} | - | - | {r['tq_ms']:.4f} | - | {r['kv_gbps']:.0f} | "
              f"{100 * r['kv_frac_of_copy']:.0f}% | {r['write_gbps']:.0f} |")
        rows.append(dict(r, sdpa_flash_ms=s.get("flash_ms"), sdpa_cudnn_ms=s.get("cudnn_ms"),
                         sdpa_best_ms=best, speedup=sp))
    if a.json:
        json.dump({"device": tq["device"], "copy_gbps": tq["copy_gbps"], "torch": sd["torch"],
                   "torch_copy_gbps": sd["copy_gbps"], "results": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
