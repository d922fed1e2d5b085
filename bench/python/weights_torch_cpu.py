"""torch's CPU matmul on the shapes of bench/weights_bench.cc, for comparison
with tq::WeightMatrix::Multiply (run one right after the other on the same
machine and compare ratios; timings move with other load on the machine).

    python3 bench/python/weights_torch_cpu.py --threads 2

Prints one JSON object: torch version, CPU, and per (dtype, rows, cols,
batch) the median microseconds of y = x @ W^T (x [batch, cols], W [rows,
cols]) over the repetitions.
"""
import argparse
import json
import platform
import statistics
import time

import torch


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def time_matmul(w, x, reps):
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    out = {"torch": torch.__version__, "cpu": cpu_model(), "threads": args.threads, "results": []}
    for rows, cols in [(4096, 4096), (14336, 4096)]:
        w32 = torch.randn(rows, cols, generator=gen) * 0.02
        for dtype in [torch.float32, torch.bfloat16]:
            w = w32.to(dtype)
            for batch in [1, 8]:
                x = torch.randn(batch, cols, generator=gen).to(dtype)
                us = time_matmul(w, x, args.reps)
                out["results"].append({"dtype": str(dtype).replace("torch.", ""), "rows": rows, "cols": cols,
                                       "batch": batch, "us": round(us, 1)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
