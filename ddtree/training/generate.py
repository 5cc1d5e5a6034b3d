"""Greedy continuations from the trained target: the text the drafter learns to predict.

At inference the drafter proposes what the *target* will say next, so its training sequences are
a corpus prompt followed by the target's own greedy continuation (the DFlash recipe trains on
target-generated responses). Batched decoding with an expanded per-head K/V cache, float32.

Letters: B batch, P prompt length, T cached positions, N heads.
"""
from __future__ import annotations

import numpy as np
import torch

from ddtree.training.target_model import KimiForCausalLM, causal_attention


@torch.no_grad()
def forward_cached(model: KimiForCausalLM, ids: torch.Tensor, start: int, cache: list) -> torch.Tensor:
    """ids [B, q] at positions start..start+q-1 -> logits [B, q, V]; appends K/V to `cache`
    (one [k, v] pair per layer, [B, N, T, D] each). q > 1 only for the prefill (start = 0)."""
    B, q = ids.shape
    cos, sin = model.rope_tables(torch.arange(start, start + q))
    h = model.model.embed_tokens(ids)
    for L, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_, k, v = attn.project(x, cos, sin)                                   # [B, N, q, D]
        if len(cache) <= L:
            cache.append([k, v])
        else:
            cache[L] = [torch.cat([cache[L][0], k], dim=2), torch.cat([cache[L][1], v], dim=2)]
        k_all, v_all = cache[L]
        o = causal_attention(q_, k_all, v_all, model.cfg.softmax_scale, is_causal=q > 1)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(B, q, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))


@torch.no_grad()
def greedy_continue(model: KimiForCausalLM, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """prompts [B, P] -> [B, P + n_new]: argmax decoding (ties -> lowest id, as torch.argmax)."""
    cache: list = []
    logits = forward_cached(model, prompts, 0, cache)
    out = [prompts, logits[:, -1:].argmax(-1)]
    for i in range(n_new - 1):
        logits = forward_cached(model, out[-1], prompts.shape[1] + i, cache)
        out.append(logits[:, -1:].argmax(-1))
    return torch.cat(out, dim=1)


def drafter_sequences(model: KimiForCausalLM, train: np.ndarray, n_seq: int, seq_len: int,
                      prompt_range: tuple[int, int], batch: int, rng: np.random.Generator, log=print):
    """n_seq sequences [n_seq, seq_len] = corpus prompt (length P, shared per batch) + greedy
    continuation; returns (sequences int64, prompt lengths [n_seq])."""
    model.eval()
    seqs, plens = [], []
    for b0 in range(0, n_seq, batch):
        nb = min(batch, n_seq - b0)
        P = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        starts = rng.integers(0, len(train) - P, size=nb)
        prompts = torch.from_numpy(np.stack([train[s: s + P] for s in starts]))
        seqs.append(greedy_continue(model, prompts, seq_len - P).numpy())
        plens += [P] * nb
        log(f"  generated {b0 + nb}/{n_seq} sequences (prompt {P} bytes)")
    return np.concatenate(seqs), np.array(plens)
