"""Models and drivers of the HF tests: small Llama and Qwen2 models built
from configs with seeded random weights (no downloads); a left-padded batch
of prompts, prefilled in one or more chunks and then decoded step by step,
against the same prompts run one by one, compared at every real (non-pad)
position."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from turboquant.integration import hf
from turboquant.integration.common import KVQuantConfig

PAD_ID = 0


def make_model(arch, seed=0, init=0.05):
    torch.manual_seed(seed)
    if arch == "llama":  # head_dim 64, GQA 4:2
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=init)
        model = LlamaForCausalLM(cfg)
    else:  # Qwen2: head_dim 128, q/k/v bias, GQA 2:1
        cfg = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, initializer_range=init)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random (nonzero) biases, so the bias path matters
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model.eval()


def make_gemma2():
    """Gemma2: logit soft-cap 1.0, sliding window 16 on layer 0 (layers
    alternate sliding and full), query_pre_attn_scalar scaling; head_dim 64."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16,
                       attn_logit_softcapping=1.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                       initializer_range=0.1)
    model = Gemma2ForCausalLM(cfg).eval()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    return model


def kvcfg(preset, **kw):
    base = dict(preset=preset, recent_window=8, sink_tokens=4, compress_chunk=8)
    base.update(kw)
    return KVQuantConfig(**base)


def run_cuts(model, cache, ids, cuts):
    """One forward over ids[:, a:b] for each pair of consecutive cuts (prompt
    chunks, one-token decodes, a second prompt); float32 logits [cuts[-1],
    vocab] of row 0, on the model's device."""
    kw = {hf.cache_kwarg(model): cache, "use_cache": True}
    out = []
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:]):
            out.append(model(ids[:, a:b], **kw).logits[0])
    return torch.cat(out).float()


def left_pad(prompts, device):
    """ids, mask, position_ids [batch, T] (T = longest prompt): prompt i at
    the right end of row i, mask 1 on its tokens, positions 0.. on them (0 on pads)."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = p
        mask[i, T - len(p):] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


def run_padded(model, prompts, cache, next_tokens, chunks=1):
    """Prefill the left-padded batch in `chunks` forwards, then decode the
    columns of next_tokens [batch, steps] one per step. Returns float32 CPU
    logits [batch, T + steps, vocab]."""
    device = next(model.parameters()).device
    ids, mask, pos = left_pad(prompts, device)
    T = ids.shape[1]
    kw = {hf.cache_kwarg(model): cache, "use_cache": True}
    cuts = [T * c // chunks for c in range(chunks + 1)]
    out = []
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:]):
            out.append(model(ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b], **kw).logits)
        last = pos[:, -1:]
        for s in range(next_tokens.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            last = last + 1
            tok = next_tokens[:, s:s + 1].to(device)
            out.append(model(tok, attention_mask=mask, position_ids=last, **kw).logits)
    return torch.cat(out, 1).float().cpu()


def run_alone(model, prompt, cache, next_tokens, cuts=None):
    """One prompt (no padding) prefilled in the chunks [cuts[j], cuts[j+1])
    of its positions (None: one forward; empty chunks skipped), then its
    next_tokens [steps]; float32 CPU logits [len + steps, vocab]."""
    device = next(model.parameters()).device
    kw = {hf.cache_kwarg(model): cache, "use_cache": True}
    cuts = cuts or [0, len(prompt)]
    out = []
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:]):
            if b > a:
                out.append(model(prompt[None, a:b].to(device), **kw).logits[0])
        for t in next_tokens.tolist():
            out.append(model(torch.tensor([[t]], device=device), **kw).logits[0])
    return torch.cat(out).float().cpu()


def padded_vs_alone(model, prompts, make_cache, next_tokens, chunks=1):
    """Cosine of the padded batch's logits against each prompt run alone
    (chunked where the batch's chunks cut it), at every real position of
    every row: a 1-D tensor over those positions. make_cache(batch) builds a
    fresh cache."""
    T = max(len(p) for p in prompts)
    batch = run_padded(model, prompts, make_cache(len(prompts)), next_tokens, chunks)
    cos = []
    for i, p in enumerate(prompts):
        pad = T - len(p)
        cuts = [max(0, T * c // chunks - pad) for c in range(chunks + 1)]
        alone = run_alone(model, p, make_cache(1), next_tokens[i], cuts)
        cos.append(torch.nn.functional.cosine_similarity(batch[i, pad:], alone, dim=-1))
    return torch.cat(cos)
