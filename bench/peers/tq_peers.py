#!/usr/bin/env python3
"""Peer indexes for `tq search bench --peers`: FAISS (faiss-cpu from PyPI) and
RaBitQ's own library (rabitqlib), measured on the same files with the same
metrics as the TurboQuant index, printed as one JSON object on stdout.

Progress goes to stderr. Methods (per bits-per-coordinate b in --bits, d = dim):
  pq        faiss.IndexPQ, M = d*b/8 sub-quantizers of 8 bits (train + add)
  pqfs      faiss.IndexPQFastScan, M = d*b/4 sub-quantizers of 4 bits
  sq        faiss.IndexScalarQuantizer QT_4bit (b = 4) and QT_8bit (b = 8 listed once)
  rabitq    faiss.IndexRaBitQ with nb_bits = b, and IndexRaBitQFastScan (1 bit only
            in faiss: listed at b = 1 only when asked); query bits qb = 8
  faisstq   faiss's own TurboQuant scalar quantizers QT_<b>bit_tqmse (MSE) and
            QT_<b>bit_tq (prod), where faiss has them
  rabitqlib rabitqlib.IvfIndex with nbits = b; flat: one cluster probed fully;
            ivf: faiss k-means centroids (same nlist), nprobe as given

Only PyPI packages (numpy, faiss-cpu, rabitqlib); nothing is downloaded here.
"""
import argparse
import json
import os
import sys
import time

import numpy as np


def log(msg):
    print("progress: peers: " + msg, file=sys.stderr, flush=True)


def read_vecs(path, dtype):
    a = np.fromfile(path, dtype=np.int32)
    if a.size == 0:
        raise SystemExit(f"{path}: empty file")
    d = int(a[0])
    if d <= 0 or a.size % (d + 1) != 0:
        raise SystemExit(f"{path}: not a .{'f' if dtype == np.float32 else 'i'}vecs file")
    a = a.reshape(-1, d + 1)
    if not np.all(a[:, 0] == d):
        raise SystemExit(f"{path}: rows of different dims")
    return np.ascontiguousarray(a[:, 1:].view(dtype))


KS = [1, 2, 4, 8, 16, 32, 64]


def recalls(ids, gt):
    """Recall@1@k for KS (true top-1 among the first k) and recall@10@10."""
    r1 = {}
    for k in KS:
        r1[str(k)] = float(np.mean(np.any(ids[:, :k] == gt[:, :1], axis=1)))
    hits = 0
    for i in range(ids.shape[0]):
        hits += len(set(ids[i, :10].tolist()) & set(gt[i, :10].tolist()))
    return r1, hits / (10.0 * ids.shape[0])


class Peer:
    def __init__(self, name, bits, build, search, bytes_per_vector, params):
        self.name, self.bits, self.build, self.search = name, bits, build, search
        self.bytes_per_vector, self.params = bytes_per_vector, params


def measure(peer, xb, xq, gt, threads, qps_queries, set_threads, budget_s, reps):
    """Build, recall and QPS of one peer. Slow scans (a few queries/s on the
    full base) measure recall on the first n queries that fit budget_s
    (at least 300) and QPS on at most budget_s / 3 of search; the counts used
    are reported in params. Build and each QPS are timed `reps` times and the
    best (shortest) kept, as the C++ side does (the machines are shared)."""
    set_threads(threads)
    build_reps = []
    for rep in range(reps):
        log(f"{peer.name} b={peer.bits}: build {rep + 1}/{reps}")
        state = None  # the previous index is freed before the next build
        t0 = time.perf_counter()
        state = peer.build(xb, threads)
        build_reps.append(time.perf_counter() - t0)
    build_s = min(build_reps)
    log(f"{peer.name} b={peer.bits}: built in {build_s:.2f} s (best of {reps}); searching")
    probe = min(200, xq.shape[0])
    t0 = time.perf_counter()
    peer.search(state, xq[:probe], 64, threads)
    qps_est = probe / max(time.perf_counter() - t0, 1e-9)
    n = xq.shape[0]
    if n / qps_est > budget_s:
        n = min(n, max(300, int(qps_est * budget_s)))
    ids64 = peer.search(state, xq[:n], 64, threads)
    r1, _ = recalls(ids64, gt[:n])
    ids10 = peer.search(state, xq[:n], 10, threads)
    _, r10 = recalls(np.pad(ids10, ((0, 0), (0, 54)), constant_values=-1), gt[:n])
    nqps = min(qps_queries, xq.shape[0], max(50, int(qps_est / max(threads, 1) * budget_s / 3)))
    q = xq[:nqps]
    qps, qps_reps = {}, {}
    for t in (1, threads):
        set_threads(t)
        qps_reps[t] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            peer.search(state, q, 10, t)
            qps_reps[t].append(q.shape[0] / (time.perf_counter() - t0))
        qps[t] = max(qps_reps[t])
    set_threads(threads)
    bpv = peer.bytes_per_vector(state)
    log(f"{peer.name} b={peer.bits}: R@1@1 {r1['1']:.3f} on {n} queries, {qps[1]:.0f} QPS (1 thread)")
    params = dict(peer.params, recall_queries=n, qps_queries=nqps, reps=reps,
                  build_s_reps=build_reps, qps_1_thread_reps=qps_reps[1],
                  qps_all_threads_reps=qps_reps[threads])
    return {"method": peer.name, "bits": peer.bits, "bytes_per_vector": float(bpv),
            "build_s": build_s, "recall_1_at_k": r1, "recall_at_10_10": r10,
            "qps_1_thread": qps[1], "qps_all_threads": qps[threads], "params": params}


def faiss_peers(faiss, d, bits, methods, index_kind, nlist, nprobe):
    ip = faiss.METRIC_INNER_PRODUCT
    peers = []

    def flat_search(index, xq, k, threads):
        _, ids = index.search(xq, k)
        return ids

    def add_trained(make, train_n=None):
        def build(xb, threads):
            index = make()
            if not index.is_trained:
                index.train(xb if train_n is None else xb[:train_n])
            index.add(xb)
            return index
        return build

    def code_size(index):
        return index.code_size if hasattr(index, "code_size") else index.sa_code_size()

    def ivf_wrap(name, make_fine, b, bpv, params):
        # IVF variant: faiss IndexIVF* with its own k-means (same nlist).
        def build(xb, threads):
            q = faiss.IndexFlatIP(d)
            index = make_fine(q)
            index.train(xb)
            index.add(xb)
            index.nprobe = nprobe
            index._q = q
            return index
        p = dict(params, nlist=nlist, nprobe=nprobe)
        return Peer(name, b, build, flat_search, bpv, p)

    for b in bits:
        if "pq" in methods and (d * b) % 8 == 0:
            m = d * b // 8
            if index_kind == "flat":
                peers.append(Peer("faiss-PQ", b, add_trained(lambda m=m: faiss.IndexPQ(d, m, 8, ip)),
                                  flat_search, code_size, {"M": m, "nbits": 8}))
            else:
                peers.append(ivf_wrap("faiss-IVFPQ", lambda q, m=m: faiss.IndexIVFPQ(q, d, nlist, m, 8, ip),
                                      b, code_size, {"M": m, "nbits": 8, "by_residual": True}))
        if "pqfs" in methods and (d * b) % 4 == 0:
            m = d * b // 4
            if index_kind == "flat":
                peers.append(Peer("faiss-PQFastScan", b,
                                  add_trained(lambda m=m: faiss.IndexPQFastScan(d, m, 4, ip)),
                                  flat_search, lambda ix, m=m: m / 2.0, {"M": m, "nbits": 4, "bbs": 32}))
            else:
                peers.append(ivf_wrap("faiss-IVFPQFastScan",
                                      lambda q, m=m: faiss.IndexIVFPQFastScan(q, d, nlist, m, 4, ip),
                                      b, lambda ix, m=m: m / 2.0, {"M": m, "nbits": 4}))
        if "sq" in methods and b in (4, 8):
            qt = faiss.ScalarQuantizer.QT_4bit if b == 4 else faiss.ScalarQuantizer.QT_8bit
            if index_kind == "flat":
                peers.append(Peer(f"faiss-SQ{b}", b,
                                  add_trained(lambda qt=qt: faiss.IndexScalarQuantizer(d, qt, ip)),
                                  flat_search, code_size, {"qtype": f"QT_{b}bit"}))
        if "faisstq" in methods:
            for suffix, label in (("tqmse", "faiss-TQ-mse"), ("tq", "faiss-TQ-prod")):
                name = f"QT_{b}bit_{suffix}"
                if not hasattr(faiss.ScalarQuantizer, name):
                    continue
                qt = getattr(faiss.ScalarQuantizer, name)
                if index_kind == "flat":
                    peers.append(Peer(label, b,
                                      add_trained(lambda qt=qt: faiss.IndexScalarQuantizer(d, qt, ip)),
                                      flat_search, code_size, {"qtype": name}))
        if "rabitq" in methods and index_kind == "flat":
            def make_rq(b=b):
                return faiss.IndexRaBitQ(d, ip, b)

            def rq_search(index, xq, k, threads):
                params = faiss.RaBitQSearchParameters()
                params.qb = 8
                _, ids = index.search(xq, k, params=params)
                return ids
            peers.append(Peer("faiss-RaBitQ", b, add_trained(make_rq), rq_search, code_size,
                              {"nb_bits": b, "qb": 8}))
            if b == 1:
                peers.append(Peer("faiss-RaBitQFastScan", b,
                                  add_trained(lambda: faiss.IndexRaBitQFastScan(d, ip)),
                                  flat_search, code_size, {"nb_bits": 1}))
    return peers


def rabitqlib_peers(rabitqlib, faiss, d, bits, index_kind, nlist, nprobe):
    peers = []
    for b in bits:
        def build(xb, threads, b=b):
            n = xb.shape[0]
            if index_kind == "flat":
                cent = xb.mean(axis=0, keepdims=True).astype(np.float32)
                cid = np.zeros(n, dtype=np.uint32)
                k = 1
            else:
                km = faiss.Kmeans(d, nlist, niter=20, seed=1234)
                km.train(xb)
                cent = km.centroids
                _, a = km.index.search(xb, 1)
                cid = a[:, 0].astype(np.uint32)
                k = nlist
            index = rabitqlib.IvfIndex(d, n, k, b, "ip")
            index.build(xb, cent, cid, threads)
            return (index, 1 if index_kind == "flat" else nprobe, n)

        def search(state, xq, k, threads):
            index, np_, _ = state
            out = index.search(xq, k, np_, num_threads=threads)
            ids = out[0] if isinstance(out, tuple) else out
            return np.asarray(ids).astype(np.int64)

        def bpv(state, b=b):
            # RaBitQ code: b bits a coordinate (d padded to a multiple of 64 in
            # rabitqlib) plus per-vector factors; rabitqlib reports no size, so
            # this counts the bits alone and says so in params.
            padded = (d + 63) // 64 * 64
            return padded * b / 8.0

        peers.append(Peer("rabitqlib-IVF" if index_kind == "ivf" else "rabitqlib", b, build, search,
                          bpv, {"nbits": b, "bytes_per_vector": "code bits only (d padded to 64), "
                                "factors not counted", "nlist": 1 if index_kind == "flat" else nlist,
                                "nprobe": 1 if index_kind == "flat" else nprobe}))
    return peers


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--queries", required=True)
    ap.add_argument("--gt", required=True)
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--qps-queries", type=int, default=2000)
    ap.add_argument("--methods", default="pq,pqfs,sq,rabitq,faisstq,rabitqlib")
    ap.add_argument("--index", default="flat", choices=["flat", "ivf"])
    ap.add_argument("--nlist", type=int, default=1024)
    ap.add_argument("--nprobe", type=int, default=32)
    ap.add_argument("--recall-queries", type=int, default=0, help="use the first N queries (0 = all)")
    ap.add_argument("--budget-s", type=float, default=20.0,
                    help="seconds of search a slow peer may spend on recall")
    ap.add_argument("--reps", type=int, default=5,
                    help="builds and QPS timings per peer; the best is kept")
    args = ap.parse_args()
    bits = [int(b) for b in args.bits.split(",")]
    methods = set(args.methods.split(","))
    xb = read_vecs(args.base, np.float32)
    xq = read_vecs(args.queries, np.float32)
    gt = read_vecs(args.gt, np.int32)
    if args.recall_queries:
        xq, gt = xq[:args.recall_queries], gt[:args.recall_queries]
    d = xb.shape[1]
    env = {"python": sys.version.split()[0], "numpy": np.__version__}
    results, skipped = [], []
    try:
        import faiss
        env["faiss"] = faiss.__version__
        env["faiss_compile_options"] = faiss.get_compile_options()
        set_threads = faiss.omp_set_num_threads
        peers = faiss_peers(faiss, d, bits, methods, args.index, args.nlist, args.nprobe)
    except ImportError as e:
        faiss, set_threads, peers = None, (lambda t: None), []
        skipped.append(f"faiss: {e}")
    if "rabitqlib" in methods:
        try:
            import rabitqlib
            from importlib.metadata import version
            env["rabitqlib"] = version("rabitqlib")
            if faiss is None and args.index == "ivf":
                skipped.append("rabitqlib ivf: needs faiss for k-means")
            else:
                peers += rabitqlib_peers(rabitqlib, faiss, d, bits, args.index, args.nlist, args.nprobe)
        except ImportError as e:
            skipped.append(f"rabitqlib: {e}")
    for p in peers:
        try:
            results.append(measure(p, xb, xq, gt, args.threads, args.qps_queries, set_threads,
                                   args.budget_s, max(1, args.reps)))
        except Exception as e:  # a peer that cannot run is reported, not hidden
            skipped.append(f"{p.name} b={p.bits}: {type(e).__name__}: {e}")
            log(f"{p.name} b={p.bits} failed: {e}")
    print(json.dumps({"env": dict(env, skipped=skipped), "results": results}, indent=1))


if __name__ == "__main__":
    main()
