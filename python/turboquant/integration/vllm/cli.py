"""Command line of the vLLM-compatible layer: ``turboquant-vllm verify ...``
(also ``python3 -m turboquant.integration.vllm verify ...``); exit status 0
pass, 1 fail, 2 bad arguments."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Optional, Sequence

from ..common import IntegrationError
from .metadata import METADATA_FILENAME, discover_metadata
from .registry import CACHE_DTYPE_PRESETS, resolve_cache_dtype
from .verify import verify


def _model_shapes(model_dir: str) -> Dict[str, int]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"{path} not found")
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    try:
        q = int(cfg["num_attention_heads"])
        return {"num_q_heads": q, "num_kv_heads": int(cfg.get("num_key_value_heads") or q),
                "head_size": int(cfg.get("head_dim") or cfg["hidden_size"] // q),
                "num_layers": int(cfg["num_hidden_layers"])}
    except KeyError as e:
        raise ValueError(f"{path}: missing {e.args[0]}") from e


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m turboquant.integration.vllm")
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="compare compressed and dense attention on a model's shapes")
    v.add_argument("--cache-dtype", default="tq4", help="one of: " + ", ".join(CACHE_DTYPE_PRESETS))
    v.add_argument("--model-dir", help="local model directory: shapes from config.json, recipe metadata "
                   f"from {METADATA_FILENAME} when present")
    v.add_argument("--num-q-heads", type=int)
    v.add_argument("--num-kv-heads", type=int)
    v.add_argument("--head-size", type=int)
    v.add_argument("--num-layers", type=int, help="layers to check (default 1, or the model's up to 4)")
    v.add_argument("--seq-lens", default="1,33,300")
    v.add_argument("--block-size", type=int, default=16)
    v.add_argument("--min-cosine", type=float, help="bar on the worst output cosine (default: by bits per value)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        shapes = {"num_layers": 1}
        meta = None
        if a.model_dir:
            shapes = _model_shapes(a.model_dir)
            shapes["num_layers"] = min(shapes["num_layers"], 4)
            meta = discover_metadata(a.model_dir)
        for k in ("num_q_heads", "num_kv_heads", "head_size", "num_layers"):
            if getattr(a, k) is not None:
                shapes[k] = getattr(a, k)
        missing = [k for k in ("num_q_heads", "num_kv_heads", "head_size") if k not in shapes]
        if missing:
            ap.error("give --model-dir or " + ", ".join("--" + m.replace("_", "-") for m in missing))
        if meta is not None and meta["num_layers"] != shapes["num_layers"]:
            layers = meta["layers"][: shapes["num_layers"]]
            meta = {**meta, "num_layers": len(layers), "layers": layers}
        if meta is not None and meta["recipe"] != a.cache_dtype:
            meta = None if resolve_cache_dtype(meta["recipe"]) != resolve_cache_dtype(a.cache_dtype) else meta
        rep = verify(a.cache_dtype, seq_lens=[int(s) for s in a.seq_lens.split(",")], block_size=a.block_size,
                     metadata=meta, min_cosine=a.min_cosine, seed=a.seed, **shapes)
        rep["metadata"] = "used" if meta is not None else "none"
    except (ValueError, IntegrationError) as e:
        print(f"verify: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rep, indent=1))
    else:
        print(f"{rep['cache_dtype']} ({rep['preset']}): worst cosine {rep['worst_cosine']:.5f} "
              f"(bar {rep['min_cosine']}), NMSE {rep['nmse']:.3e}, {rep['rows']} rows; pages "
              f"{rep['page_bytes_used']} B vs dense fp16 {rep['dense_fp16_bytes']} B; "
              + ("PASS" if rep["passed"] else "FAIL"))
    return 0 if rep["passed"] else 1
