"""MoE feed-forward of layers >= first_k_dense_replace (docs/kimi-k2.md section 5.4).

  y = sum_k w_k Expert_{I_k}(x) + Shared(x), with experts I and weights w from the routing rule
  (ddtree/model/routing.py: sigmoid scores, biased group-limited top-k, normalised, scaled; float64).

Letters: n tokens, H hidden, E routed experts, k experts per token, I expert intermediate.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree.model.config import KimiConfig
from ddtree.model.routing import route
from ddtree.reference.layers import swiglu


@dataclass
class ExpertWeights:
    gate: np.ndarray         # [I, H]
    up: np.ndarray           # [I, H]
    down: np.ndarray         # [H, I]


@dataclass
class MoEWeights:
    router: np.ndarray                 # [E, H]  mlp.gate.weight
    bias: np.ndarray                   # [E]     mlp.gate.e_score_correction_bias (selection only)
    experts: Sequence[ExpertWeights]   # E routed experts (INT4 in the checkpoint, dense here)
    shared: ExpertWeights              # shared expert(s), intermediate I * n_shared_experts


def moe(x: np.ndarray, w: MoEWeights, cfg: KimiConfig) -> np.ndarray:
    """x [n, H] (normed) -> routed experts + shared expert [n, H]."""
    experts, weights = route(x, w.router, w.bias, cfg)                # [n, k] each
    routed = np.zeros_like(x)                                         # [n, H]
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)                         # tokens that picked expert e
        ew = w.experts[int(e)]
        y = swiglu(x[rows], ew.gate, ew.up, ew.down)                  # [m, H]
        routed[rows] += weights[rows, slot][:, None].astype(x.dtype) * y
    shared = swiglu(x, w.shared.gate, w.shared.up, w.shared.down)     # [n, H]
    return routed + shared
