#!/usr/bin/env python3
"""Paired A/B of two `tq` binaries on `tq bench attention` (decode).

Noisy machines (shared VMs) move absolute times, and even a preset's
speedup over dense, by 10-30% within minutes. This compares two builds
in pairs instead: each round runs A, B, B, A, takes each binary's lower
median compressed (and dense) time of its two runs in the round, and
reports per preset the median over the rounds of B / A. Prints a table, or JSON with --json;
a progress line per round goes to stderr.

Example (docs/BENCHMARKS.md, "Paired A/B method"):
  bench/ab/ab_attention.py --a old/tq --b build/release/tq \
      --preset k4_v4,k3_v3 --context 32768 --q-heads 8 --kv-heads 2 --threads 1
"""
import argparse
import json
import statistics
import subprocess
import sys


def run_bench(binary, args):
    cmd = [binary, "bench", "attention", "--context", str(args.context), "--batch", "1",
           "--q-heads", str(args.q_heads), "--kv-heads", str(args.kv_heads),
           "--head-dim", str(args.head_dim), "--threads", str(args.threads),
           "--preset", args.preset, "--reps", str(args.reps), "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"ab_attention: cannot run {binary}: {e}")
    if proc.returncode != 0:
        sys.exit(f"ab_attention: {' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    try:
        results = json.loads(proc.stdout)["results"]
    except (json.JSONDecodeError, KeyError) as e:
        sys.exit(f"ab_attention: {binary} printed no bench JSON ({e})")
    return {r["preset"]: (r["dense_ms"], r["tq_ms"]) for r in results}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="baseline tq binary")
    p.add_argument("--b", required=True, help="candidate tq binary")
    p.add_argument("--preset", required=True, help="comma-separated presets")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.rounds < 1 or args.reps < 1:
        sys.exit("ab_attention: --rounds and --reps must be >= 1")

    tq_ratio, dense_ratio = {}, {}
    for i in range(args.rounds):
        a1 = run_bench(args.a, args)
        b1 = run_bench(args.b, args)
        b2 = run_bench(args.b, args)
        a2 = run_bench(args.a, args)
        for preset in a1:
            if preset not in b1:
                sys.exit(f"ab_attention: {args.b} reported no result for preset {preset}")
            ta, tb = min(a1[preset][1], a2[preset][1]), min(b1[preset][1], b2[preset][1])
            da, db = min(a1[preset][0], a2[preset][0]), min(b1[preset][0], b2[preset][0])
            tq_ratio.setdefault(preset, []).append(tb / ta)
            dense_ratio.setdefault(preset, []).append(db / da)
        print(f"ab_attention: round {i + 1}/{args.rounds} done", file=sys.stderr)

    rows = [{"preset": k, "tq_b_over_a": statistics.median(v), "tq_rounds": v,
             "dense_b_over_a": statistics.median(dense_ratio[k])} for k, v in tq_ratio.items()]
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, "context": args.context, "rounds": args.rounds,
                          "results": rows}, indent=1))
        return
    print(f"{'preset':<20} {'tq B/A (median)':>16} {'dense B/A':>10}  rounds")
    for r in rows:
        print(f"{r['preset']:<20} {r['tq_b_over_a']:>16.3f} {r['dense_b_over_a']:>10.3f}  "
              + " ".join(f"{x:.3f}" for x in sorted(r["tq_rounds"])))


if __name__ == "__main__":
    main()
