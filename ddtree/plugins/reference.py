"""numpy references for the kernels in ddtree/plugins/kernels (float64, exact inputs).

Letters: M tokens, H hidden, I expert intermediate, E experts, k = topk. The router's twin is the
routing rule itself, ddtree/model/routing.py: route_logits.
"""
from __future__ import annotations

import numpy as np

from ddtree.model.bf16 import as_float
from ddtree.model.int4 import dequantize_int4
from ddtree.plugins import layout
from ddtree.model.routing import sigmoid


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def expert_dense(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One matrix in kernel layout -> dense float64 [N, K]."""
    q, s = layout.unpack_q(words, scales)
    return dequantize_int4(q, s, dtype=np.float64)


def moe_given_routing(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, packed: dict[str, np.ndarray],
                      shared: np.ndarray | None = None) -> np.ndarray:
    """x [M, H] (float or bf16 bits), ids/weights [M, k], packed = stacked kernel-layout experts
    -> y [M, H] float64 = sum_k w_k down_e(silu(gate_e x) * up_e x) (+ shared). An id of -1 is an expert
    this rank does not hold (expert parallel: another rank adds it)."""
    x = as_float(x, np.float64)
    y = np.zeros_like(x)                                                 # [M, H]
    for e in np.unique(ids[ids >= 0]):
        rows, slot = np.nonzero(ids == e)
        gate, up = layout.split_gate_up(expert_dense(packed["gate_up"][e], packed["gate_up_scale"][e]))
        down = expert_dense(packed["down"][e], packed["down_scale"][e])  # [H, I]
        xe = x[rows]                                                     # [m, H]
        act = silu(xe @ gate.T) * (xe @ up.T)                            # [m, I]
        y[rows] += weights[rows, slot][:, None] * (act @ down.T)
    if shared is not None:
        y += as_float(shared, np.float64)
    return y


def gemm(x: np.ndarray, w: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """x [M, K], w [N, K] (float or bf16 bits) -> x @ w.T (+ residual) in float64."""
    y = as_float(x, np.float64) @ as_float(w, np.float64).T
    return y if residual is None else y + as_float(residual, np.float64)


def mla_tree_attention(q_lat: np.ndarray, q_rope: np.ndarray, cache: np.ndarray, prefix: int,
                       vis_words: np.ndarray, scale: float, rows_per_chunk: int = 256,
                       dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The fp32 twin of kernels/mla_attention.cu: plain masked softmax over every visible key, no splits.
    (dtype float64: the same contract exactly, the op set's numpy backend.)

    q_lat [q, N, 512], q_rope [q, N, 64], cache [>= prefix + q, 576] (bf16 bits or float), vis_words
    [q, ceil(q/32)] uint32 (tree node i at cache row prefix + i) -> out [q, N, 512] fp32 (before W_UV),
    lse [q, N] float64 (natural log of the sum of exp of the visible scaled scores)."""
    from ddtree.tree.build import unpack_visibility
    q, heads = q_lat.shape[:2]
    keys = as_float(cache[: prefix + q], dtype)                                       # [t, 576]
    query = np.concatenate([as_float(q_lat, dtype), as_float(q_rope, dtype)], axis=-1).reshape(q * heads, -1)
    visible = unpack_visibility(vis_words, q)                                    # [q, q] ancestor-or-self
    out = np.empty((q * heads, q_lat.shape[-1]), dtype=dtype)
    lse = np.empty(q * heads, dtype=np.float64)
    for r0 in range(0, q * heads, rows_per_chunk):
        r1 = min(q * heads, r0 + rows_per_chunk)
        scores = (query[r0:r1] @ keys.T).astype(np.float64) * scale             # [n, t]
        tree = scores[:, prefix:]
        tree[~visible[np.arange(r0, r1) // heads]] = -np.inf                    # tree keys off the ancestor chain
        m = scores.max(axis=1, keepdims=True)
        p = np.exp(scores - m)                                                   # [n, t]
        l = p.sum(axis=1)
        out[r0:r1] = (p.astype(dtype) @ keys[:, : q_lat.shape[-1]]) / l[:, None].astype(dtype)
        lse[r0:r1] = m[:, 0] + np.log(l)
    return out.reshape(q, heads, -1), lse.reshape(q, heads)


def split_kv_b(kv_b: np.ndarray, nope: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b [N (Dn + Dv), R] (float or bf16 bits) -> W_UK [N, Dn, R], W_UV [N, Dv, R] float64."""
    w = as_float(np.asarray(kv_b), np.float64)
    w = w.reshape(-1, nope + v, w.shape[-1])
    return w[:, :nope], w[:, nope:]


def mla_absorb_q(q_nope: np.ndarray, kv_b: np.ndarray, nope: int, v: int) -> np.ndarray:
    """Twin of kernels/mla_absorb.cu's absorb_q: q_nope [q, N, Dn] -> q_lat [q, N, R] = per head q_nope W_UK."""
    return np.einsum("qnd,ndr->qnr", as_float(np.asarray(q_nope), np.float64), split_kv_b(kv_b, nope, v)[0],
                     optimize=True)


def mla_absorb_out(o_lat: np.ndarray, kv_b: np.ndarray, nope: int, v: int) -> np.ndarray:
    """Twin of absorb_out: o_lat [q, N, R] -> [q, N Dv] = per head o_lat W_UV^T."""
    o = np.einsum("qnr,nvr->qnv", as_float(np.asarray(o_lat), np.float64), split_kv_b(kv_b, nope, v)[1],
                  optimize=True)
    return o.reshape(len(o), -1)


def draft_block_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray,
                          rows: int, pos: np.ndarray, window: int, scale: float) -> np.ndarray:
    """Twin of kernels/draft_attention.cu (float64): q [b, Hq, d], block k / v [b, Hk, d] (roped), context
    cache rows [0, rows) of cache_k / cache_v [S, Hk, d] at positions 0.. -> o [b, Hq d]. Non-causal over the
    context and the block; a key at k_pos is visible to block token i iff pos[i] - k_pos < window (0: all)."""
    q, b = as_float(np.asarray(q), np.float64), len(q)
    group = q.shape[1] // np.shape(k)[1]                                # GQA: query head h reads kv head h / g
    keys = np.repeat(np.concatenate([as_float(np.asarray(cache_k)[:rows], np.float64),
                                     as_float(np.asarray(k), np.float64)]), group, axis=1)   # [rows + b, Hq, d]
    values = np.repeat(np.concatenate([as_float(np.asarray(cache_v)[:rows], np.float64),
                                       as_float(np.asarray(v), np.float64)]), group, axis=1)
    pos = np.asarray(pos, dtype=np.int64).reshape(-1)
    k_pos = np.concatenate([np.arange(rows), pos])
    visible = (pos[:, None] - k_pos[None, :] < window) if window else np.ones((b, len(k_pos)), bool)
    scores = np.where(visible[:, None, :], np.einsum("qhd,khd->qhk", q, keys) * scale, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("qhk,khd->qhd", p / p.sum(axis=-1, keepdims=True), values).reshape(b, -1)
