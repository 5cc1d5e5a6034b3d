"""The Kimi K2 MoE routing rule (`noaux_tc`, sigmoid; docs/kimi-k2.md section 5.4), in float64.

  1. g = sigmoid(W_g x)                                     [n, E]
  2. selection only: c = g + e_score_correction_bias; with n_group > 1 a group scores the sum of its
     top-2 c and only the best topk_group groups stay selectable; I = top-k of c
  3. weights from the unbiased scores: w = g[I] / (sum g[I] + 1e-20) * routed_scaling_factor (always)
Every top-k breaks ties toward the lowest index (experts and groups), for determinism. This is part
of what the model is: the reference MoE, the per-rank functions, the graphs' numpy ops and the
kernels' numpy twins all route through `route_logits`, and the GPU router is checked against it.

Letters: n tokens, H hidden, E routed experts, G groups, k experts per token.
"""
from __future__ import annotations

import numpy as np

from ddtree.model.config import KimiConfig

NORM_EPS = 1e-20        # the renormalisation's guard against a zero sum


def topk_lowest_id(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values along the last axis, ties toward the lower index. [..., k] int64."""
    order = np.argsort(-values, axis=-1, kind="stable")      # stable: equal values keep index order
    return order[..., :k]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))    # overflow-free form of 1 / (1 + e^-x)


def route_logits(logits: np.ndarray, bias: np.ndarray | None, k: int, n_group: int = 1, topk_group: int = 1,
                 scaling: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Router logits [n, E] -> experts [n, k] int64 (selection order), weights [n, k] float64, and
    margin [n] = k-th minus (k+1)-th selection score (a rounding-level margin marks a near-tie that a
    lower-precision router may resolve the other way). The one routing rule every backend checks against."""
    n, E = logits.shape
    scores = sigmoid(logits.astype(np.float64))                       # [n, E] g
    choice = scores + (0.0 if bias is None else bias.astype(np.float64))   # [n, E] c, selection only
    if n_group > 1:
        per_group = E // n_group
        if per_group < 2:
            raise ValueError(f"MoE routing: n_group {n_group} leaves {per_group} expert per group; "
                             "the group score needs >= 2")
        grouped = choice.reshape(n, n_group, per_group)               # [n, G, E/G]
        top2 = -np.sort(-grouped, axis=-1)[..., :2]                   # [n, G, 2]
        group_score = top2.sum(axis=-1)                               # [n, G]
        kept_groups = topk_lowest_id(group_score, topk_group)         # [n, topk_group]
        group_kept = np.zeros((n, n_group), dtype=bool)
        np.put_along_axis(group_kept, kept_groups, True, axis=-1)
        expert_kept = np.repeat(group_kept, per_group, axis=-1)       # [n, E]
        choice = np.where(expert_kept, choice, -np.inf)
    order = topk_lowest_id(choice, min(k + 1, E))                     # [n, k(+1)]
    ranked = np.take_along_axis(choice, order, axis=-1)
    margin = ranked[:, k - 1] - ranked[:, k] if k < E else np.full(n, np.inf)
    experts = order[:, :k]                                            # [n, k]
    picked = np.take_along_axis(scores, experts, axis=-1)             # [n, k] unbiased g
    weights = picked / (picked.sum(axis=-1, keepdims=True) + NORM_EPS) * scaling
    return experts, weights, margin


def route(x: np.ndarray, router: np.ndarray, bias: np.ndarray | None,
          cfg: KimiConfig) -> tuple[np.ndarray, np.ndarray]:
    """Normed x [n, H], router [E, H], bias [E] -> experts [n, k] int64 (selection order), weights [n, k]
    float64; the logits are float64 whatever x and the router are."""
    logits = x.astype(np.float64) @ router.astype(np.float64).T     # [n, E]
    experts, weights, _ = route_logits(logits, bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                       cfg.routed_scaling_factor)
    return experts, weights
