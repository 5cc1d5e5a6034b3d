"""Routing ids for the step benchmark and the projection (issue 21): which experts a batch of tokens touches.

    uniform  each token picks top-k distinct experts of E uniformly at random (the meter's worst case).
    tree     the tokens are the nodes of a DDTree tree (parents, root first, parents[i] < i). The root
             routes uniformly; each of a node's k experts is, with probability p, one of its parent's
             experts (drawn without replacement from the parent's set), else a random expert outside
             the parent's set and not already chosen. "Outside the parent's set" keeps the reuse
             exactly p on average: a node's count of parent experts is Binomial(k, p), so
             reuse_rate(ids, parents) estimates p with standard error sqrt(p (1 - p) / (k nodes)).

Every layer routes independently; `layers` stacks them ([L, n, k]). Seeded numpy Generators only.
"""
from __future__ import annotations

import numpy as np

ROUTINGS = ("uniform", "tree")


def _top_k_of_keys(keys: np.ndarray, k: int) -> np.ndarray:
    """[..., E] random keys -> [..., k] the indices of the k smallest: k distinct experts, uniform."""
    return np.argpartition(keys, k - 1, axis=-1)[..., :k]


def uniform_ids(rng: np.random.Generator, tokens: int, n_experts: int, topk: int,
                layers: int | None = None) -> np.ndarray:
    """[tokens, topk] int32 (or [layers, tokens, topk]): top-k distinct experts per token, uniform."""
    L = 1 if layers is None else layers
    ids = _top_k_of_keys(rng.random((L, tokens, n_experts)), topk).astype(np.int32)    # [L, n, k]
    return ids[0] if layers is None else ids


def tree_ids(rng: np.random.Generator, parents, n_experts: int, topk: int, reuse: float,
             layers: int | None = None) -> np.ndarray:
    """[n, topk] int32 (or [layers, n, topk]) for the tree `parents` [n] (root -1 first), reuse p."""
    parents = np.asarray(parents)
    if parents.ndim != 1 or parents.size == 0 or parents[0] != -1 or np.any(parents[1:] < 0) \
            or np.any(parents[1:] >= np.arange(1, parents.size)):
        raise ValueError("tree_ids: parents must be [n] with the root (-1) first and parents[i] < i")
    if not 0.0 <= reuse <= 1.0:
        raise ValueError(f"tree_ids: reuse {reuse} must be in [0, 1]")
    if n_experts < 2 * topk:
        raise ValueError(f"tree_ids: {n_experts} experts cannot give {topk} outside a parent's {topk}")
    L, n, k = 1 if layers is None else layers, parents.size, topk
    ids = np.empty((L, n, k), np.int32)
    ids[:, 0] = _top_k_of_keys(rng.random((L, n_experts)), k)                          # the root: uniform
    rows = np.arange(L)[:, None]
    for i in range(1, n):
        parent = ids[:, parents[i]]                                                    # [L, k]
        from_parent = rng.permuted(parent, axis=1)                                     # [L, k] in random order
        keys = rng.random((L, n_experts))
        keys[rows, parent] = np.inf                                                    # never the parent's
        outside = _top_k_of_keys(keys, k)                                              # [L, k] distinct, not parent's
        reused = rng.random((L, k)) < reuse                                            # [L, k] slot takes a parent's
        j_parent = np.cumsum(reused, axis=1) - 1                                       # next unused parent expert
        j_outside = np.cumsum(~reused, axis=1) - 1
        ids[:, i] = np.where(reused, np.take_along_axis(from_parent, np.maximum(j_parent, 0), 1),
                             np.take_along_axis(outside, np.maximum(j_outside, 0), 1))
    return ids[0] if layers is None else ids


def routing_ids(routing: str, parents, n_experts: int, topk: int, reuse: float, layers: int,
                seed: int = 0) -> np.ndarray:
    """[layers, n, topk] int32 for the n = len(parents) tokens of one verify under `routing`."""
    rng = np.random.default_rng(seed)
    if routing == "uniform":
        return uniform_ids(rng, len(parents), n_experts, topk, layers)
    if routing == "tree":
        return tree_ids(rng, parents, n_experts, topk, reuse, layers)
    raise ValueError(f"routing {routing!r}: expected one of {', '.join(ROUTINGS)}")


def reuse_rate(ids: np.ndarray, parents) -> float:
    """The fraction of the non-root nodes' experts that are in their parent's set. ids [n, k] or [L, n, k]."""
    ids = ids[None] if ids.ndim == 2 else ids                                          # [L, n, k]
    parents = np.asarray(parents)
    child, parent = ids[:, 1:], ids[:, parents[1:]]                                    # [L, n - 1, k] each
    found = (child[..., :, None] == parent[..., None, :]).any(axis=-1)                # [L, n - 1, k]
    return float(found.mean())


def distinct_per_layer(ids: np.ndarray, held: tuple[int, int] | None = None) -> np.ndarray:
    """[L] int: distinct experts each layer's tokens touch (of the rank's experts [start, stop) if `held`)."""
    ids = ids[None] if ids.ndim == 2 else ids                                          # [L, n, k]
    out = []
    for layer in ids:
        touched = np.unique(layer)
        if held is not None:
            touched = touched[(touched >= held[0]) & (touched < held[1])]
        out.append(touched.size)
    return np.array(out, np.int64)


def union_routing(cfg, parents_list: list, routing: str, reuse: float | None, seed: int = 0) -> np.ndarray:
    """[L MoE layers, union rows, k] ids: request i's tree routed by routing_ids with seed `seed + i`."""
    return np.concatenate([routing_ids(routing, p, cfg.n_routed_experts, cfg.num_experts_per_tok, reuse or 0.0,
                                       len(cfg.moe_layers), seed + i) for i, p in enumerate(parents_list)], axis=1)
