"""Near-ties on the GPU (docs/interfaces.md section 6): when GPU DDTree departs from GPU AR, is it a near-tie?

The verify (many rows a call) and the one-token decode sum in different orders, so the same sequence's logits
differ between the two paths by up to delta. delta is measured, not chosen: the AR tokens are teacher-forced
through both paths and delta is the largest difference. A departure is a near-tie when the top-2 margin of
what the sampler ranks at it (the decode logits, greedy; z = l / T + g over the kept set, sampled) is below
2 delta (2 delta / T sampled): two candidates that close can swap between the paths.

    d = path_delta(ex, prompt_ids, ar_tokens, rows=(block, budget + 1))
    verdict = classify_departure(ex, prompt_ids, ar_tokens, dd_tokens, params, d)   # None if identical
"""
from __future__ import annotations

import numpy as np

from ddtree.reference.model import causal_visible
from ddtree.tree.sampling import SamplingParams, gumbel, kept_mask


def decode_logits(ex, seq, P: int) -> np.ndarray:
    """[len(seq) - P, V]: row j the logits that pick seq[P + j], feeding seq one token a call after a P-token
    prefill (the decode path)."""
    cache = ex.new_target_cache(len(seq) + 1, limit=len(seq) + 1)
    lg, _ = ex.target_forward(np.array(seq[:P]), np.arange(P), causal_visible(0, P), cache)
    out = [lg[-1]]
    for i in range(P, len(seq) - 1):
        lg, _ = ex.target_forward(np.array(seq[i: i + 1]), np.array([i]), causal_visible(i, 1), cache)
        out.append(lg[-1])
    return np.array(out)


def verify_logits(ex, seq, P: int, rows: int) -> np.ndarray:
    """The same rows as decode_logits through calls of `rows` tokens (a chain: each row sees those before it)."""
    cache = ex.new_target_cache(len(seq) + 1, limit=len(seq) + 1)
    lg, _ = ex.target_forward(np.array(seq[:P]), np.arange(P), causal_visible(0, P), cache)
    out = [lg[-1]]
    for a in range(P, len(seq) - 1, rows):
        b = min(a + rows, len(seq) - 1)
        lg, _ = ex.target_forward(np.array(seq[a:b]), np.arange(a, b), causal_visible(a, b - a), cache)
        out.extend(lg)
    return np.array(out)


def path_differences(ex, prompt_ids, ar_tokens, rows=(8, 65)) -> np.ndarray:
    """Per position, max |verify - decode| over the logits, for each verify row count (concatenated)."""
    seq = list(prompt_ids) + list(ar_tokens)
    dec = decode_logits(ex, seq, len(prompt_ids))
    return np.concatenate([np.abs(verify_logits(ex, seq, len(prompt_ids), r) - dec).max(axis=1) for r in rows])


def margin(logits_row, position: int, params: SamplingParams) -> float:
    """The top-2 gap of what the sampler ranks at `position`: logits (greedy) or z + g over the kept set."""
    row = np.asarray(logits_row, np.float64)
    if params.greedy:
        top = np.sort(row)[-2:]
        return float(top[1] - top[0])
    z = row / params.temperature
    kept = kept_mask(z[None], params.top_k, params.top_p)[0]
    top = np.sort(np.where(kept, z + gumbel(params.seed, position, np.arange(len(z))), -np.inf))[-2:]
    return float(top[1] - top[0])


def first_difference(a, b) -> int:
    """The first index where token lists a and b differ (the shorter one's length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def classify_departure(ex, prompt_ids, ar_tokens, dd_tokens, params: SamplingParams, delta: float) -> dict | None:
    """None when the two runs agree (on their common length); else the first departure's index, its margin,
    the bound 2 delta (/ T) and whether it is a near-tie."""
    n = min(len(ar_tokens), len(dd_tokens))
    i = next((j for j in range(n) if ar_tokens[j] != dd_tokens[j]), None)
    if i is None:
        return None
    P = len(prompt_ids)
    row = decode_logits(ex, list(prompt_ids) + list(ar_tokens[: i + 1]), P)[-1]
    m = margin(row, P + i, params)
    bound = 2 * delta / (params.temperature if not params.greedy else 1.0)
    return {"index": i, "margin": m, "bound": bound, "delta": delta, "near_tie": m < bound}
