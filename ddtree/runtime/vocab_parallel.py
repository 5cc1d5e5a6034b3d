"""Sampling and draft top-k on vocab-split logits (docs/interfaces.md section 5; plan: builder/plan.py).

With a vocab-parallel lm_head, rank r holds logits [n, V_r] for the ids [offset_r, offset_r + V_r),
offsets ascending. Nothing here concatenates the slices; each function does what the ranks do:
reduce its slice locally, gather a few (value, id) pairs, merge.

  greedy / plain Gumbel-max   each rank sends its (value, id) winner per row; the largest value
                              wins, ties -> the lower id. Exact.
  top-k                       each rank sends its local top-k; the global top-k lies in the union.
                              Exact.
  top-p, top-k on             softmax over the gathered top-k survivors. Exact up to the order of
                              the normaliser's sum (relative ~1e-16; see below).
  top-p, top-k off            ranks send (max, sum exp) for the global normaliser and their top-C
                              candidates; the merge is the exact global order over every candidate
                              whose probability is above the largest probability a rank left out.
                              If the cumulative probability reaches top_p inside that certified
                              prefix, the kept set is exact; otherwise C doubles (a second round).
  The one approximation: the softmax normaliser is summed in another order than on one device, so
  probabilities differ in the last bits, which can change the kept set only when the cumulative
  probability lands within ~1e-16 of top_p.
  draft top-k log-probs       (max, sum exp) pairs give the log-softmax normaliser (fp32, as
                              tree/build.topk_logprobs); local top-k of (logp, id), merged. At tp = 1
                              the result is bitwise that of topk_logprobs; at tp > 1 the normaliser
                              is summed per rank first, so log-probabilities may differ in the last
                              fp32 bit.

Letters: n rows (positions), V_r a rank's vocab slice, C candidates per rank.
"""
from __future__ import annotations

import numpy as np

from ddtree.tree.sampling import SamplingParams, gumbel

FIRST_CANDIDATES = 64          # top-p without top-k: candidates per rank in the first round
NO_ID = np.iinfo(np.int64).max


def split_logits(logits, layouts) -> tuple[list[np.ndarray], list[int]]:
    """Full logits [n, V] -> the ranks' vocab slices [n, V_r] and their first ids (description/opset.py RankLayouts)."""
    logits = np.asarray(logits)
    return [logits[:, lay.vocab_start: lay.vocab_stop] for lay in layouts], [lay.vocab_start for lay in layouts]


def gather_argmax(values: list[np.ndarray], offsets: list[int]) -> np.ndarray:
    """Per-rank values [n, V_r] -> global argmax ids [n] (ties -> the lowest id), from one (value, id)
    winner per rank and row."""
    best_value = np.stack([v.max(axis=1) for v in values])                       # [tp, n]
    best_id = np.stack([off + v.argmax(axis=1) for v, off in zip(values, offsets)])   # first max per rank
    top = best_value.max(axis=0)                                                 # [n]
    return np.where(best_value == top, best_id, NO_ID).min(axis=0)


def _local_top(z: np.ndarray, offset: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    """A rank's c largest values of one row, descending, ties -> lower id: (values [c], ids [c])."""
    order = np.argsort(-z, kind="stable")[:c]
    return z[order], offset + order


def _merge(parts: list[tuple[np.ndarray, np.ndarray]], key=None) -> tuple[np.ndarray, np.ndarray]:
    """Gathered (values, ids) -> sorted by value descending (or by `key` of the values), ties -> lower id."""
    vals = np.concatenate([p[0] for p in parts])
    ids = np.concatenate([p[1] for p in parts])
    order = np.lexsort((ids, -(vals if key is None else key(vals))))
    return vals[order], ids[order]


def _prefix(probs: np.ndarray, top_p: float, certified: int) -> int | None:
    """Length of the top-p prefix of `probs` (sorted descending), or None if it is not decided
    within the first `certified` entries."""
    reached = np.cumsum(probs) >= top_p
    if reached.any() and reached.argmax() < certified:
        return int(reached.argmax()) + 1
    return None


def _kept_row(zs: list[np.ndarray], offsets: list[int], top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """One row's kept tokens after top-k then top-p: (z values, ids)."""
    V = sum(len(z) for z in zs)
    if 0 < top_k < V:
        vals, ids = _merge([_local_top(z, off, min(top_k, len(z))) for z, off in zip(zs, offsets)])
        vals, ids = vals[:top_k], ids[:top_k]
        if top_p >= 1:
            return vals, ids
        e = np.exp(vals - vals.max())
        probs = e / e.sum()                                          # softmax over the survivors
        order = np.lexsort((ids, -probs))
        n = _prefix(probs[order], top_p, len(order))
        keep = order if n is None else order[:n]
        return vals[keep], ids[keep]
    if top_p >= 1:
        return np.concatenate(zs), np.concatenate([off + np.arange(len(z)) for z, off in zip(zs, offsets)])
    # top-p over the whole vocab: global normaliser from per-rank (max, sum exp), then candidates
    local_max = np.array([z.max() for z in zs])
    top = local_max.max()
    norm = sum(np.exp(z - m).sum() * np.exp(m - top) for z, m in zip(zs, local_max))
    c = FIRST_CANDIDATES
    while True:
        parts = [_local_top(z, off, min(c, len(z))) for z, off in zip(zs, offsets)]
        # the largest value any rank left out: every candidate above it is in its exact global place
        left_out = max((p[0][-1] for p, z in zip(parts, zs) if len(p[0]) < len(z)), default=-np.inf)
        vals, ids = _merge(parts)
        probs = np.exp(vals - top) / norm
        order = np.lexsort((ids, -probs))
        vals, ids, probs = vals[order], ids[order], probs[order]
        certified = int((probs > np.exp(left_out - top) / norm).sum()) if np.isfinite(left_out) else len(probs)
        n = _prefix(probs, top_p, certified)
        if n is not None:
            return vals[:n], ids[:n]
        if not np.isfinite(left_out):                               # everything gathered, never reached
            return vals, ids
        c *= 2


def sample(local_logits: list[np.ndarray], offsets: list[int], positions, params: SamplingParams) -> np.ndarray:
    """Vocab-split logits (one [n, V_r] per rank) -> tokens [n] int64, equal to tree.sampling.sample on
    the concatenated logits (see the module docstring for the one rounding caveat of top-p)."""
    logits = [np.asarray(l, dtype=np.float64) for l in local_logits]
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    if params.greedy:
        return gather_argmax(logits, offsets).astype(np.int64)
    zs = [l / params.temperature for l in logits]
    V = sum(z.shape[1] for z in zs)
    if not 0 < params.top_k < V and params.top_p >= 1:               # no filtering: per-rank Gumbel winners
        noisy = [z + gumbel(params.seed, positions[:, None], off + np.arange(z.shape[1])[None, :])
                 for z, off in zip(zs, offsets)]
        return gather_argmax(noisy, offsets).astype(np.int64)
    out = np.empty(len(positions), dtype=np.int64)
    for i, p in enumerate(positions):
        vals, ids = _kept_row([z[i] for z in zs], offsets, params.top_k, params.top_p)
        noisy = vals + gumbel(params.seed, p, ids)
        out[i] = ids[np.lexsort((ids, -noisy))[0]]                   # max noisy value, ties -> lower id
    return out


def topk_logprobs(local_logits: list[np.ndarray], offsets: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Vocab-split draft logits (one [D, V_r] per rank) -> (log-softmax top-k [D, k] fp32 descending,
    ids [D, k] int32), ties -> lower id: tree/build.topk_logprobs without gathering the logits."""
    xs = [np.asarray(l, dtype=np.float32) for l in local_logits]
    local_max = [x.max(axis=1, keepdims=True) for x in xs]                      # [D, 1] per rank
    local_sum = [np.exp(x - m).sum(axis=1, keepdims=True, dtype=np.float32) for x, m in zip(xs, local_max)]
    top = np.max(np.concatenate(local_max, axis=1), axis=1, keepdims=True)      # [D, 1]
    total = local_sum[0] * np.exp(local_max[0] - top)
    for s, m in zip(local_sum[1:], local_max[1:]):
        total = total + s * np.exp(m - top)
    lse = top + np.log(total)                                                   # [D, 1] fp32
    k = min(k, sum(x.shape[1] for x in xs))
    vals, ids = [], []
    for x, off in zip(xs, offsets):
        logp = (x - lse).astype(np.float32)                                     # [D, V_r]
        kk = min(k, x.shape[1])
        local = np.broadcast_to(np.arange(x.shape[1]), x.shape)
        order = np.lexsort((local, -logp), axis=1)[:, :kk]
        vals.append(np.take_along_axis(logp, order, axis=1))
        ids.append(off + order)
    vals, ids = np.concatenate(vals, axis=1), np.concatenate(ids, axis=1)       # [D, tp k]
    order = np.lexsort((ids, -vals), axis=1)[:, :k]
    return np.take_along_axis(vals, order, axis=1), np.take_along_axis(ids, order, axis=1).astype(np.int32)
