"""Test helpers: a llama2.c "v0" checkpoint as a transformers LlamaForCausalLM
(HF layout: q/k rows permuted from llama2.c's interleaved RoPE pairs to
rotate-half), and the llama2.c tokenizer's encoder (the rules of
src/model/tokenizer.cc: dummy-prefix space, one token per UTF-8 character with
byte fallback, then merge the best-scoring adjacent pair, leftmost on ties)."""
import heapq
import struct

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def load_llama2c(path):
    with open(path, "rb") as f:
        data = f.read()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", data[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    w = np.frombuffer(data, dtype="<f4", offset=28)
    hd = dim // heads
    kv_dim = kv_heads * hd
    at = 0

    def take(*shape):
        nonlocal at
        n = int(np.prod(shape))
        out = torch.from_numpy(w[at:at + n].copy()).view(*shape)
        at += n
        return out

    emb = take(vocab, dim)
    rms_att = take(layers, dim)
    wq, wk, wv, wo = take(layers, dim, dim), take(layers, kv_dim, dim), take(layers, kv_dim, dim), take(layers, dim, dim)
    rms_ffn = take(layers, dim)
    w1, w2, w3 = take(layers, hidden, dim), take(layers, dim, hidden), take(layers, hidden, dim)
    rms_final = take(dim)
    take(seq_len, hd // 2)
    take(seq_len, hd // 2)
    wcls = emb if shared else take(vocab, dim)

    def permute(m, n_heads):  # interleaved pairs -> rotate-half (the HF conversion)
        rows, cols = m.shape
        return m.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd,
                      max_position_embeddings=seq_len, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=shared, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    sd = {"model.embed_tokens.weight": emb, "model.norm.weight": rms_final, "lm_head.weight": wcls}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = rms_att[i]
        sd[p + "post_attention_layernorm.weight"] = rms_ffn[i]
        sd[p + "self_attn.q_proj.weight"] = permute(wq[i], heads)
        sd[p + "self_attn.k_proj.weight"] = permute(wk[i], kv_heads)
        sd[p + "self_attn.v_proj.weight"] = wv[i]
        sd[p + "self_attn.o_proj.weight"] = wo[i]
        sd[p + "mlp.gate_proj.weight"] = w1[i]
        sd[p + "mlp.down_proj.weight"] = w2[i]
        sd[p + "mlp.up_proj.weight"] = w3[i]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model.eval()


class Tokenizer:
    def __init__(self, path, vocab_size):
        with open(path, "rb") as f:
            data = f.read()
        at = 4
        self.pieces, self.scores = [], []
        for _ in range(vocab_size):
            score, n = struct.unpack("<fi", data[at:at + 8])
            at += 8
            self.pieces.append(data[at:at + n])
            self.scores.append(score)
            at += n
        self.index = {}
        for i, p in enumerate(self.pieces):
            self.index.setdefault(p, i)

    def encode(self, text):
        ids = []
        for s in (" ", text):
            b = s.encode("utf-8")
            i = 0
            while i < len(b):
                c = b[i]
                n = 1 if c < 0x80 else 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 1
                if i + n > len(b) or any(x & 0xC0 != 0x80 for x in b[i + 1:i + n]):
                    n = 1
                piece = b[i:i + n]
                if piece in self.index:
                    ids.append(self.index[piece])
                else:
                    ids.extend(3 + x for x in piece)
                i += n
        # linked list + heap of candidate merges (max score, leftmost)
        tok = list(ids)
        nxt = list(range(1, len(tok))) + [-1]
        prv = list(range(-1, len(tok) - 1))
        ver = [0] * len(tok)
        alive = [True] * len(tok)
        heap = []

        def consider(left):
            if left < 0 or nxt[left] < 0:
                return
            r = nxt[left]
            j = self.index.get(self.pieces[tok[left]] + self.pieces[tok[r]])
            if j is not None:
                heapq.heappush(heap, (-self.scores[j], left, r, ver[left], ver[r]))

        for i in range(len(tok) - 1):
            consider(i)
        while heap:
            _, left, r, lv, rv = heapq.heappop(heap)
            if not alive[left] or not alive[r] or nxt[left] != r or ver[left] != lv or ver[r] != rv:
                continue
            tok[left] = self.index[self.pieces[tok[left]] + self.pieces[tok[r]]]
            ver[left] += 1
            alive[r] = False
            nxt[left] = nxt[r]
            if nxt[r] >= 0:
                prv[nxt[r]] = left
            consider(prv[left])
            consider(left)
        out, i = [], 0 if tok else -1
        while i >= 0:
            out.append(tok[i])
            i = nxt[i]
        return out
