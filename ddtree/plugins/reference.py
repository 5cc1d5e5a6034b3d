"""numpy references for the kernels in ddtree/plugins/kernels (float64, exact inputs).

Letters: M tokens, H hidden, I expert intermediate, E experts, k = topk. The router's twin is the
routing rule itself, ddtree/model/routing.py: route_logits.
"""
from __future__ import annotations

import numpy as np

from ddtree.model.bf16 import as_float, f32_to_bf16
from ddtree.model.int4 import dequantize_int4
from ddtree.model.routing import sigmoid
from ddtree.plugins import layout
from ddtree.tree.build import unpack_visibility


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def expert_dense(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One matrix in kernel layout -> dense float64 [N, K]."""
    q, s = layout.unpack_q(words, scales)
    return dequantize_int4(q, s, dtype=np.float64)


def expert_matrices(packed: dict[str, np.ndarray], e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expert e of stacked kernel-layout experts -> dense float64 (gate [I, H], up [I, H], down [H, I])."""
    gate, up = layout.split_gate_up(expert_dense(packed["gate_up"][e], packed["gate_up_scale"][e]))
    return gate, up, expert_dense(packed["down"][e], packed["down_scale"][e])


def moe_given_routing(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, packed: dict[str, np.ndarray],
                      shared: np.ndarray | None = None, matrices=expert_matrices) -> np.ndarray:
    """x [M, H] (float or bf16 bits), ids/weights [M, k], packed = stacked kernel-layout experts
    -> y [M, H] float64 = sum_k w_k down_e(silu(gate_e x) * up_e x) (+ shared). An id of -1 is an expert
    this rank does not hold (expert parallel: another rank adds it). matrices(packed, e): expert e dense, as
    expert_matrices (a caller may memoize it: backends/dense_experts.py)."""
    x = as_float(x, np.float64)
    y = np.zeros_like(x)                                                 # [M, H]
    for e in np.unique(ids[ids >= 0]):
        rows, slot = np.nonzero(ids == e)
        gate, up, down = matrices(packed, e)                             # [I, H], [I, H], [H, I]
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


# ---------------------------------------------------------------------------------------------
# the per-layer kernels (kernels/layer_ops.cu): the contract in float64 (bf16 copies as bits)

def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bf16 bits, nearest even (the kernels' one rounding of an fp32 result)."""
    return f32_to_bf16(np.asarray(x, np.float32))


def embed(ids: np.ndarray, table: np.ndarray, vocab_start: int) -> np.ndarray:
    """ids [q] global, table [V_r, H] bf16 bits -> [q, H] bits: the rows of this rank's ids, zeros elsewhere."""
    local = np.asarray(ids, np.int64).reshape(-1) - vocab_start
    mine = (local >= 0) & (local < table.shape[0])
    out = np.zeros((len(local), table.shape[1]), np.uint16)
    out[mine] = table[local[mine]]
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """w * x / sqrt(mean(x^2) + eps) over the last axis, float64."""
    x = as_float(x, np.float64)
    return as_float(w, np.float64) * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def head_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [m, n, d]: every head's row of d normed with w [d] (rms_norm over the last axis)."""
    return rms_norm(x, w, eps)


def add_rms_norm(h: np.ndarray, delta: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """h, delta [m, D] bf16 bits -> (h + delta rounded to bf16 bits (the fp32 sum of two bf16, as the kernel
    adds), rms_norm of that rounded h in float64)."""
    h1 = bf16_bits(as_float(h, np.float32) + as_float(delta, np.float32))
    return h1, rms_norm(h1, w, eps)


def _rope(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, magnitude: float, interleaved: bool) -> np.ndarray:
    x = as_float(x, np.float64)                                                   # [q, n, d]
    angle = np.asarray(pos, np.float64).reshape(-1)[:, None, None] * np.asarray(freqs, np.float64)  # [q, 1, d/2]
    cos, sin = np.cos(angle) * magnitude, np.sin(angle) * magnitude
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    out = np.empty_like(x)
    ya, yb = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ya, yb
    else:
        out[..., :half], out[..., half:] = ya, yb
    return out


def rope_interleaved(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, magnitude: float) -> np.ndarray:
    """x [q, n, d], pos [q] -> pairs (2i, 2i+1) turned by pos phi_i, cos/sin scaled by magnitude (float64)."""
    return _rope(x, pos, freqs, magnitude, True)


def rope_rotate_half(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, magnitude: float) -> np.ndarray:
    """As rope_interleaved with the pairs (i, i + d/2) (NeoX halves, the drafter's rope)."""
    return _rope(x, pos, freqs, magnitude, False)


def silu_mul(gu: np.ndarray) -> np.ndarray:
    """gu [m, 2I] (gate columns, then up columns) -> silu(gate) * up [m, I], float64."""
    g = as_float(gu, np.float64)
    inter = g.shape[-1] // 2
    return silu(g[..., :inter]) * g[..., inter:]


def gather_rows(src: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """src [n, W] (any dtype) -> [k, W]: row rows[i]; zeros for a negative row, all-ones bytes for a row >= n."""
    rows = np.asarray(rows, np.int64).reshape(-1)
    out = np.zeros((len(rows), src.shape[1]), src.dtype)
    out.view(np.uint8)[rows >= len(src)] = 0xFF
    inside = (rows >= 0) & (rows < len(src))
    out[inside] = src[rows[inside]]
    return out


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
