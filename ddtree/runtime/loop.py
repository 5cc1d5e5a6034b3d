"""The decode loops, written once over executor primitives (docs/interfaces.md section 6).

DDTree step (docs/ddtree.md 2.6), with `start` = the position of the bonus token (= target cache length):
    draft    block [bonus, MASK x (b-1)] at start.., with the taps of the tokens committed last step
    build    per-depth top-k of the draft logits -> best-first tree of `budget` nodes, root = bonus
    verify   one target forward over the n = tree size nodes at positions start + depth, visible =
             the whole cache plus each node's ancestors; taps at every node
    walk     the target's sample at every node (position start + depth + 1); follow matching children
    update   compact the target cache to the accepted path; the next bonus is the sample where the
             walk stopped; the accepted nodes' taps become the drafter's new context
The AR loop is one target forward per token. Both stop after an EOS (kept) or max_new_tokens, and
slice committed tokens by position: a token is never filtered by its value (it may equal MASK).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ddtree.reference.model import causal_visible
from ddtree.tree.sampling import SamplingParams


@dataclass
class RunStats:
    new_tokens: int = 0
    steps: int = 0
    accept_lens: list = field(default_factory=list)     # per step: committed tokens (bonus included)
    max_depth: int = 0
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        steps = max(self.steps, 1)
        per_depth = [sum(a - 1 >= d for a in self.accept_lens) / steps for d in range(1, self.max_depth + 1)]
        return {"new_tokens": self.new_tokens, "steps": self.steps,
                "mean_accept_len": sum(self.accept_lens) / steps if self.steps else 0.0,
                "per_depth_accept_rate": per_depth,
                "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0,
                "wall_s": self.wall_s}


def _check(prompt_ids, max_new_tokens: int) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty (at least one token, e.g. BOS, is needed)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return prompt


def ar_steps(ex, prompt_ids, max_new_tokens: int, params: SamplingParams, eos_ids=(),
             stats: RunStats | None = None) -> Iterator[list[int]]:
    """Yields the committed tokens of each step (one per step) until EOS or max_new_tokens."""
    prompt = _check(prompt_ids, max_new_tokens)
    stats = stats if stats is not None else RunStats()
    eos = {int(e) for e in eos_ids}
    if max_new_tokens == 0:
        return
    t0 = time.perf_counter()
    cache = ex.new_target_cache(len(prompt) + max_new_tokens)
    ids, pos = np.array(prompt), np.arange(len(prompt))
    prefill = True
    while True:
        logits, _ = ex.target_forward(ids, pos, causal_visible(cache.length, len(ids)), cache)
        next_pos = int(pos[-1]) + 1                                       # where the new token sits
        token = int(ex.sample(logits[-1:], np.array([next_pos]), params)[0])
        if not prefill:                                    # the prefill is not a step, as in DDTree,
            stats.steps += 1                               # so the two modes' stats compare
            stats.accept_lens.append(1)
        prefill = False
        stats.new_tokens += 1
        stats.wall_s = time.perf_counter() - t0
        yield [token]
        if token in eos or stats.new_tokens >= max_new_tokens:
            return
        ids, pos = np.array([token]), np.array([next_pos])


def ddtree_steps(ex, prompt_ids, max_new_tokens: int, params: SamplingParams, budget: int,
                 eos_ids=(), block_size: int | None = None, stats: RunStats | None = None
                 ) -> Iterator[list[int]]:
    """Yields the tokens each DDTree step commits (the prefill's first token, then per step the
    accepted drafts + the new bonus), cut at EOS / max_new_tokens. Needs an executor with a drafter."""
    prompt = _check(prompt_ids, max_new_tokens)
    dcfg = ex.drafter_config
    b = dcfg.block_size if block_size is None else block_size
    if not 2 <= b <= dcfg.block_size:
        raise ValueError(f"block size {b} must be in 2..{dcfg.block_size} (the drafter's block_size)")
    stats = stats if stats is not None else RunStats()
    stats.max_depth = b - 1
    eos = {int(e) for e in eos_ids}
    taps = tuple(dcfg.target_layer_ids)
    if max_new_tokens == 0:
        return
    t0 = time.perf_counter()

    def commit(tokens: list[int]) -> tuple[list[int], bool]:
        out = []
        for t in tokens:
            out.append(t)
            stats.new_tokens += 1
            if t in eos or stats.new_tokens >= max_new_tokens:
                return out, True
        return out, False

    # prefill: the prompt's logits give the first token; its taps are the drafter's first context
    cache = ex.new_target_cache(len(prompt) + max_new_tokens + budget + 1)
    dcache = ex.new_drafter_cache()
    logits, tapped = ex.target_forward(np.array(prompt), np.arange(len(prompt)),
                                       causal_visible(0, len(prompt)), cache, taps)
    start = len(prompt)                                                    # the bonus token's position
    bonus = int(ex.sample(logits[-1:], np.array([start]), params)[0])
    ctx = np.concatenate([tapped[L] for L in taps], axis=1)               # [P, K*H]
    out, done = commit([bonus])
    stats.wall_s = time.perf_counter() - t0
    yield out
    mask = dcfg.mask_token_id
    while not done:
        block = np.array([bonus] + [mask] * (b - 1))
        draft_logits = ex.drafter_forward(block, np.arange(start, start + b), ctx, dcache)   # [b-1, V]
        tree = ex.tree_build(bonus, draft_logits, budget)
        node_pos = tree.positions(start)                                   # [n]
        visible = np.concatenate([np.ones((tree.size, start), bool), tree.visible()], axis=1)
        logits, tapped = ex.target_forward(tree.tokens, node_pos, visible, cache, taps)   # [n, V]
        target_tokens = ex.sample(logits, node_pos + 1, params)           # [n]
        walk = ex.accept_walk(tree, target_tokens)
        ex.compact(cache, start, walk.accepted)
        acc = walk.accepted                                                # [a] node indices, acc[0] = root
        ctx = np.concatenate([tapped[L][acc] for L in taps], axis=1)      # [a, K*H]
        start += len(acc)
        bonus = walk.bonus
        stats.steps += 1
        stats.accept_lens.append(len(acc))
        out, done = commit([int(t) for t in tree.tokens[acc[1:]]] + [bonus])
        stats.wall_s = time.perf_counter() - t0
        yield out


def run_to_end(steps: Iterator[list[int]]) -> list[int]:
    return [t for chunk in steps for t in chunk]
