"""Greedy continuations from the trained target: the text the drafter learns to predict.

At inference the drafter proposes what the *target* will say next, so its training sequences are
a corpus prompt followed by the target's own greedy continuation (the DFlash recipe trains on
target-generated responses). Batched decoding through the one description (description/layers.py on the
torch backend, backends/torch_backend.target_forward) with its latent caches, float32.

Letters: B batch, P prompt length, V vocab.
"""
from __future__ import annotations

import numpy as np
import torch

from ddtree.backends.torch_backend import causal_mask, new_target_caches, target_forward
from ddtree.training.target_model import KimiForCausalLM


@torch.no_grad()
def greedy_continue(model: KimiForCausalLM, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """prompts [B, P] -> [B, P + n_new]: argmax decoding (ties -> lowest id, as torch.argmax): a prefill,
    then one token per call at position P + i after P + i cached rows."""
    B, P = prompts.shape
    ops, cfg = model.ops(), model.cfg
    caches = new_target_caches(cfg, B, P + n_new, ops.act)
    logits, _ = target_forward(ops, cfg, prompts, torch.arange(P, dtype=torch.int32), caches,
                               torch.zeros(1, dtype=torch.int32), causal_mask(P))      # [B, P, V]
    out = [prompts, logits[:, -1:].argmax(-1)]
    for i in range(n_new - 1):
        T = torch.tensor([P + i], dtype=torch.int32)
        logits, _ = target_forward(ops, cfg, out[-1], T, caches, T, causal_mask(1))   # [B, 1, V]
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
