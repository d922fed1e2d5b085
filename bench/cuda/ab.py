#!/usr/bin/env python3
"""A/B of several tq_cuda_bench builds in one device call: runs them in turn
(round-robin, --rounds times, so drift hits all alike) with the same
arguments and prints, per (preset, B, N), each build's median decode ms and
write GB/s with its ratio to the first build, and the copy bandwidth each run
measured. Output is a markdown table on stdout and, with --json, a file.

  python3 bench/cuda/ab.py --rounds 2 --args "--presets k3_v3 --batch 16 \\
      --context 32768 --reps 3" .devcarry/bin/old .devcarry/bin/new
"""
import argparse
import json
import shlex
import statistics
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--args", required=True, help="arguments for every tq_cuda_bench run")
    ap.add_argument("--json", help="write the joined results here")
    ap.add_argument("bins", nargs="+")
    a = ap.parse_args()
    runs = {b: [] for b in a.bins}
    for r in range(a.rounds):
        for b in a.bins:
            print(f"progress: round {r + 1}/{a.rounds} {b}", file=sys.stderr, flush=True)
            out = subprocess.run([b] + shlex.split(a.args), check=True, capture_output=True, text=True)
            runs[b].append(json.loads(out.stdout))
    keys = []
    for res in runs[a.bins[0]][0]["results"]:
        keys.append((res["preset"], res["batch"], res["context"]))

    def med(b, k, field):
        vals = [x[field] for run in runs[b] for x in run["results"]
                if (x["preset"], x["batch"], x["context"]) == k]
        return statistics.median(vals) if vals else float("nan")

    names = [b.rsplit("/", 1)[-1] for b in a.bins]
    print("copy GB/s per run: " + "; ".join(
        f"{n} " + ", ".join(f"{run['copy_gbps']:.0f}" for run in runs[b]) for n, b in zip(names, a.bins)))
    hdr = "| preset | B | N | " + " | ".join(f"{n} ms" for n in names) + " | " + \
        " | ".join(f"{n} write GB/s" for n in names) + " |"
    print(hdr)
    print("|" + "---|" * (3 + 2 * len(names)))
    joined = []
    for k in keys:
        ms = [med(b, k, "tq_ms") for b in a.bins]
        wr = [med(b, k, "write_gbps") for b in a.bins]
        cells = [f"{m:.4f}" + ("" if i == 0 else f" ({ms[0] / m:.2f}x)") for i, m in enumerate(ms)]
        cells += [f"{w:.0f}" + ("" if i == 0 else f" ({w / wr[0]:.2f}x)") for i, w in enumerate(wr)]
        print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " |")
        joined.append({"preset": k[0], "batch": k[1], "context": k[2],
                       "tq_ms": dict(zip(names, ms)), "write_gbps": dict(zip(names, wr))})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"builds": names, "results": joined}, f, indent=1)


if __name__ == "__main__":
    main()
