"""One cache shared by many Python threads (the bindings release the GIL).

Each KVCache / PagedKVCache serializes calls on itself (python/src/locked_caches.h):
threads appending, decoding and reading back one cache at once must neither
crash the interpreter nor raise, and every thread's results must equal the
same calls made serially. TQ_THREAD_STRESS_SECONDS (default 2) sets how long
the timed stress runs; 60 gives the long run.
"""
import os
import threading
import time

import numpy as np

import turboquant as tq

THREADS = 8
LAYERS, KVH, QH, D = 2, 2, 4, 64


def _steps(seed, count):
    """A thread's own random appends (1..40 tokens) and decode queries."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(1, 41))
        k = rng.standard_normal((n, KVH, D), dtype=np.float32)
        v = rng.standard_normal((n, KVH, D), dtype=np.float32)
        q = rng.standard_normal((1, QH, D), dtype=np.float32)
        out.append((k, v, q))
    return out


def _run_sequence(cache, seq, steps):
    """Appends to every layer of `seq`, decoding after each step; returns the outputs."""
    outs = []
    for k, v, q in steps:
        for layer in range(LAYERS):
            cache.append(layer, seq, k, v)
            outs.append(cache.decode_attention(layer, [seq], q).copy())
        outs.append(cache.prefill_attention(1, seq, q, query_start=cache.length(1, seq) - 1).copy())
    kd, vd = cache.dequantize_for_diagnostics(0, seq)
    outs.append(kd.copy())
    outs.append(vd.copy())
    return outs


def _new_cache():
    return tq.KVCache(LAYERS, KVH, D, preset="k4_v4", max_sequences=THREADS, recent_window=16,
                      sink_tokens=2, compress_chunk=8)


def _run_threads(target, count):
    errors = []

    def guarded(i):
        try:
            target(i)
        except BaseException as e:  # any exception is a failure of the test
            errors.append(repr(e))

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _threaded_equals_serial(new_cache, run, seed, count):
    """Runs sequence t's steps (run(cache, t, steps)) for every t, first one
    after another on one cache, then from THREADS threads on another; the
    outputs of every sequence must be equal. Returns (serial, threaded) caches."""
    steps = [_steps(seed + t, count) for t in range(THREADS)]
    serial_cache = new_cache()
    serial = [run(serial_cache, t, steps[t]) for t in range(THREADS)]
    shared = new_cache()
    results = [None] * THREADS

    def work(t):
        results[t] = run(shared, t, steps[t])

    _run_threads(work, THREADS)
    for t in range(THREADS):
        assert len(results[t]) == len(serial[t])
        for a, b in zip(results[t], serial[t]):
            np.testing.assert_array_equal(a, b)
    return serial_cache, shared


def test_threads_on_their_own_sequences_equal_the_serial_run():
    serial_cache, shared = _threaded_equals_serial(_new_cache, _run_sequence, 100, 12)
    assert shared.ledger() == serial_cache.ledger()


def test_threads_appending_to_one_sequence_lose_no_token():
    # The interleaving is up to the threads; the count of tokens is not, and
    # nothing may abort (this once ended the process on a cache invariant).
    cache = _new_cache()
    chunks = [_steps(200 + t, 30) for t in range(THREADS)]

    def work(t):
        for k, v, q in chunks[t]:
            cache.append(0, 0, k, v)
            cache.decode_attention(0, [0], q)
            cache.dequantize_for_diagnostics(0, 0)

    _run_threads(work, THREADS)
    assert cache.length(0, 0) == sum(k.shape[0] for c in chunks for k, _, _ in c)


def test_paged_cache_threads_equal_the_serial_run():
    def run(cache, seq, steps):
        outs = []
        for k, v, q in steps:
            slots = cache.reserve_slots(seq, k.shape[0])
            cache.write_slots(0, k, v, np.asarray(slots, dtype=np.int64))
            table = np.asarray(cache.block_table(seq), dtype=np.int32)[None, :]
            lens = np.asarray([cache.sequence_length(seq)], dtype=np.int32)
            outs.append(cache.decode_attention(0, q, table, lens).copy())
        return outs

    def new_paged():
        cache = tq.PagedKVCache(1, KVH, D, num_blocks=THREADS * 40, block_size=16, preset="k4_v4")
        for _ in range(THREADS):
            cache.add_sequence()
        return cache

    # Pages are handed out in the threads' order, so slots differ; what each
    # sequence holds and decodes does not.
    _threaded_equals_serial(new_paged, run, 300, 10)


def test_timed_stress_on_one_cache():
    # Mixed calls from every thread on one cache for a while: each thread
    # owns a sequence (appends, decodes, and a free once it holds 2,000
    # tokens; replayed serially at the end to the same outputs) and also
    # reads another thread's sequence length and the ledger.
    seconds = float(os.environ.get("TQ_THREAD_STRESS_SECONDS", "2"))
    cache = _new_cache()
    done = [0] * THREADS
    logs = [[] for _ in range(THREADS)]
    deadline = time.monotonic() + seconds

    def work(t):
        rng = np.random.default_rng(400 + t)
        seq = t
        while time.monotonic() < deadline:
            if cache.length(0, seq) >= 2000:
                cache.free(seq)
                logs[t].append(None)
            n = int(rng.integers(1, 9))
            k = rng.standard_normal((n, KVH, D), dtype=np.float32)
            v = rng.standard_normal((n, KVH, D), dtype=np.float32)
            q = rng.standard_normal((1, QH, D), dtype=np.float32)
            for layer in range(LAYERS):
                cache.append(layer, seq, k, v)
            out = cache.decode_attention(1, [seq], q).copy()
            logs[t].append((k, v, q, out))
            cache.decode_attention(0, [seq], q)
            cache.length(1, (seq + 1) % THREADS)  # another thread's sequence, maybe being freed
            cache.ledger()
            done[t] += 1

    _run_threads(work, THREADS)
    assert min(done) > 0
    serial = _new_cache()
    for t in range(THREADS):
        for entry in logs[t]:
            if entry is None:
                serial.free(t)
                continue
            k, v, q, out = entry
            for layer in range(LAYERS):
                serial.append(layer, t, k, v)
            np.testing.assert_array_equal(serial.decode_attention(1, [t], q), out)
    frees = sum(entry is None for log in logs for entry in log)
    print(f"{sum(done)} mixed steps ({frees} frees) from {THREADS} threads in {seconds:.0f} s")
