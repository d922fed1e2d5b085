#!/usr/bin/env python3
"""Fuzzes the KV recipe metadata reader (docs/FORMAT.md, "KV recipe
metadata"; turboquant.integration.vllm: validate_metadata, load_metadata).

The reader is Python, so this is a structure-aware random mutator rather than
libFuzzer: seeds come from build_metadata / slice_metadata_for_tp (split and
plain recipes, calibration, tensor-parallel slices); each trial replaces,
deletes or adds one node of the JSON tree (values of every JSON type, huge and
negative integers, NaN, unhashable lists and objects) or mutates the
serialized bytes (flips, inserts, deletions, truncation, invalid UTF-8,
deep nesting). A trial passes when the reader returns valid metadata or
raises MetadataError; any other exception is a finding.

  python3 fuzz/recipe_metadata_fuzz.py --seconds 30 [--seed N]

Needs the installed package (pip install ./python). Exits 1 listing each
distinct finding (exception type and the line that raised it) with one input.
"""
import argparse
import copy
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback

from turboquant.integration.vllm import metadata as md


def seeds():
    out = [md.build_metadata("tq3", 64, 2, 2), md.build_metadata("k8v4", 128, 1, 4)]
    out.append(md.build_metadata("turboquant25", 16, 2, 2,
                                 key_channels=[[[0, 5, 9, 15], [1, 2, 3, 4]]] * 2,
                                 value_channels=[[[4, 5, 6, 7], [0, 8, 12, 14]]] * 2,
                                 calibration={"method": "channel_energy", "prompts_sha256": "0" * 64,
                                              "num_prompts": 3, "num_tokens": 96, "statistic": "sum x^2"}))
    out.append(md.slice_metadata_for_tp(md.build_metadata("turboquant35", 16, 1, 4), 2, 1))
    return out


def random_value(rng, depth=0):
    choices = [None, True, False, 0, 1, -1, 2**63, -(2**70), 7, 1.5, float("nan"), float("inf"), "", "tq3",
               "block_hadamard", "lloyd_max_sphere", "channel_energy", "0" * 64]
    r = rng.random()
    if r < 0.6 or depth > 2:
        return rng.choice(choices)
    if r < 0.8:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["kind", "version", "seed", "size", "rank", "layer", "method", "x"]): random_value(rng, depth + 1)
            for _ in range(rng.randrange(3))}


def nodes(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for k in list(obj):
            yield from nodes(obj[k], path + (k,))
    elif isinstance(obj, list):
        for i in range(len(obj)):
            yield from nodes(obj[i], path + (i,))


def tree_mutation(rng, meta):
    meta = copy.deepcopy(meta)
    for _ in range(rng.randrange(1, 4)):
        paths = list(nodes(meta))
        path = rng.choice(paths)
        if not path:
            if rng.random() < 0.1:
                return random_value(rng)
            continue
        parent = meta
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        op = rng.random()
        if op < 0.6:
            parent[key] = random_value(rng)
        elif op < 0.8:
            del parent[key]
        elif isinstance(parent, dict):
            parent[rng.choice(["tensor_parallel", "calibration", "seed", "extra"])] = random_value(rng)
        else:
            parent.insert(rng.randrange(len(parent) + 1), copy.deepcopy(parent[key]))
    return meta


def byte_mutation(rng, meta):
    b = bytearray(json.dumps(meta, indent=rng.choice([None, 1])).encode())
    for _ in range(rng.randrange(1, 6)):
        op = rng.random()
        if op < 0.3 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.5:
            b.insert(rng.randrange(len(b) + 1), rng.choice(b"{}[],:\"0-9.eE\\\xff\xc3 "))
        elif op < 0.7 and b:
            del b[rng.randrange(len(b))]
        elif op < 0.8:
            b = b[:rng.randrange(len(b) + 1)]
        elif op < 0.9:
            b = bytearray(b"[" * rng.choice([10, 1000, 100000])) + b
        else:
            b = b.replace(b"1", str(rng.choice([10**400, -1, 2**64])).encode(), 1)
    return bytes(b)


def check_valid(meta):
    # What the reader returns must be valid metadata and serialize.
    md.validate_metadata(json.loads(json.dumps(meta)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    base = seeds()
    findings = {}
    trials = 0
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    end = time.monotonic() + args.seconds
    try:
        while time.monotonic() < end:
            trials += 1
            meta = rng.choice(base)
            if rng.random() < 0.5:
                data = tree_mutation(rng, meta)
                call = lambda: md.validate_metadata(data)  # noqa: E731
                shown = data
            else:
                raw = byte_mutation(rng, meta)
                with open(path, "wb") as f:
                    f.write(raw)
                call = lambda: md.load_metadata(path)  # noqa: E731
                shown = raw[:400]
            try:
                check_valid(call())
            except md.MetadataError:
                pass
            except Exception as e:  # noqa: BLE001 - every other exception is a finding
                tb = traceback.extract_tb(e.__traceback__)[-1]
                key = (type(e).__name__, os.path.basename(tb.filename), tb.lineno)
                findings.setdefault(key, (repr(shown)[:400], str(e)[:200]))
    finally:
        os.unlink(path)
    print(f"recipe_metadata_fuzz: {trials} inputs in {args.seconds:g} s, {len(findings)} distinct findings")
    for (etype, fname, line), (inp, msg) in sorted(findings.items()):
        print(f"  {etype} at {fname}:{line}: {msg}\n    input: {inp}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
