"""numpy references for the kernels in ddtree/plugins/kernels (float64, exact inputs).

Letters: M tokens, H hidden, I expert intermediate, E experts, k = topk.
"""
from __future__ import annotations

import numpy as np

from ddtree.model.bf16 import bf16_to_f32
from ddtree.model.int4 import dequantize_int4
from ddtree.plugins import layout


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def topk_lowest_id(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest along the last axis, in descending order, ties -> lower index."""
    return np.argsort(-values, axis=-1, kind="stable")[..., :k]


def route(logits: np.ndarray, bias: np.ndarray | None, topk: int, n_group: int = 1, topk_group: int = 1,
          scaling: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """logits [M, E] -> (ids [M, k] in selection order, weights [M, k], margin [M]).

    margin = the k-th minus the (k+1)-th selection score among selectable experts: a kernel whose
    logits differ by rounding may pick differently only where the margin is that small."""
    scores = sigmoid(logits.astype(np.float64))                          # [M, E]
    choice = scores + (0.0 if bias is None else bias.astype(np.float64))
    M, E = choice.shape
    if n_group > 1:
        grouped = choice.reshape(M, n_group, E // n_group)               # [M, G, E/G]
        group_score = -np.sort(-grouped, axis=-1)[..., :2].sum(axis=-1)  # [M, G] top-2 sum
        kept = np.zeros((M, n_group), dtype=bool)
        np.put_along_axis(kept, topk_lowest_id(group_score, topk_group), True, axis=-1)
        choice = np.where(np.repeat(kept, E // n_group, axis=-1), choice, -np.inf)
    order = topk_lowest_id(choice, topk + 1)                             # [M, k+1]
    ranked = np.take_along_axis(choice, order, axis=-1)
    margin = ranked[:, topk - 1] - ranked[:, topk] if topk < E else np.full(M, np.inf)
    ids = order[:, :topk]
    picked = np.take_along_axis(scores, ids, axis=-1)
    weights = picked / (picked.sum(axis=-1, keepdims=True) + 1e-20) * scaling
    return ids, weights, margin


def expert_dense(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One matrix in kernel layout -> dense float64 [N, K]."""
    q, s = layout.unpack_q(words, scales)
    return dequantize_int4(q, s, dtype=np.float64)


def moe_given_routing(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, packed: dict[str, np.ndarray],
                      shared: np.ndarray | None = None) -> np.ndarray:
    """x [M, H] (float or bf16 bits), ids/weights [M, k], packed = stacked kernel-layout experts
    -> y [M, H] float64 = sum_k w_k down_e(silu(gate_e x) * up_e x) (+ shared)."""
    x = bf16_to_f32(x).astype(np.float64) if x.dtype == np.uint16 else x.astype(np.float64)
    y = np.zeros_like(x)                                                 # [M, H]
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        gate, up = layout.split_gate_up(expert_dense(packed["gate_up"][e], packed["gate_up_scale"][e]))
        down = expert_dense(packed["down"][e], packed["down_scale"][e])  # [H, I]
        xe = x[rows]                                                     # [m, H]
        act = silu(xe @ gate.T) * (xe @ up.T)                            # [m, I]
        y[rows] += weights[rows, slot][:, None] * (act @ down.T)
    if shared is not None:
        y += bf16_to_f32(shared).astype(np.float64) if shared.dtype == np.uint16 else shared
    return y


def gemm(x: np.ndarray, w: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """x [M, K], w [N, K] (float or bf16 bits) -> x @ w.T (+ residual) in float64."""
    def f64(a):
        return bf16_to_f32(a).astype(np.float64) if a.dtype == np.uint16 else a.astype(np.float64)
    y = f64(x) @ f64(w).T
    return y if residual is None else y + f64(residual)
