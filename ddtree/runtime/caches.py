"""The caches the layer functions update, held for every rank of a CPU executor.

    TargetCaches  the MLA latent cache, [rank][layer] -> [S, R + Dr] (normed c_kv, then roped k_pe);
                  replicated: every rank writes the same rows
    DraftCaches   the drafter's context K/V, [rank][layer] -> [S, Hk_r, d]: each rank its own kv heads
`length` is the number of valid rows (the layer functions' `cache_len`); `reserve` grows the
arrays by doubling, up to `limit` rows when one is given (CPU only: on a GPU the capacity is fixed
at load and captured graphs hold its addresses). Both are description/stack.py LayerCaches: `feeds(L)` gives
layer L's cache of every rank, `keep(L, outs)` takes the layer's *_out caches back (the numpy backend's are
the same arrays, updated in place; the ONNX graphs' are new ones).
"""
from __future__ import annotations

import numpy as np

from ddtree.runtime.per_rank import PerRank


def _grown(a: np.ndarray, rows: int, keep: int) -> np.ndarray:
    out = np.zeros((rows, *a.shape[1:]), dtype=a.dtype)
    out[:keep] = a[:keep]
    return out


def _new_rows(what: str, rows: int, capacity: int, limit: int | None) -> int:
    """The capacity to grow to for `rows` rows: double, but never past the limit."""
    if limit is None:
        return max(rows, 2 * capacity)
    if rows > limit:
        raise ValueError(f"{what}: {rows} rows asked for, past the cache's limit of {limit}")
    return min(max(rows, 2 * capacity), limit)


def _check_limit(what: str, capacity: int, limit: int | None) -> None:
    if limit is not None and capacity > limit:
        raise ValueError(f"{what}: capacity {capacity} is above its limit {limit}")


class TargetCaches:
    def __init__(self, tp: int, layers: int, width: int, capacity: int, dtype=np.float64, limit: int | None = None):
        _check_limit("TargetCaches", capacity, limit)
        self.layers = [[np.zeros((capacity, width), dtype=dtype) for _ in range(layers)] for _ in range(tp)]
        self.length = 0
        self.limit = limit

    @property
    def capacity(self) -> int:
        return self.layers[0][0].shape[0]

    def feeds(self, layer: int) -> dict:
        return {"cache": PerRank(rank[layer] for rank in self.layers)}

    def keep(self, layer: int, outs: dict) -> None:
        for rank, cache in zip(self.layers, outs["cache_out"]):
            rank[layer] = cache

    def reserve(self, rows: int) -> None:
        if rows > self.capacity:
            new = _new_rows("TargetCaches", rows, self.capacity, self.limit)
            self.layers = [[_grown(a, new, self.length) for a in rank] for rank in self.layers]

    def copy(self) -> "TargetCaches":
        other = TargetCaches.__new__(TargetCaches)
        other.layers = [[a.copy() for a in rank] for rank in self.layers]
        other.length = self.length
        other.limit = self.limit
        return other

    def entries(self, layer: int, end: int | None = None, rank: int = 0) -> np.ndarray:
        """[end, R + Dr] rows of one layer on one rank (default: all `length`)."""
        return self.layers[rank][layer][: self.length if end is None else end]


class DraftCaches:
    def __init__(self, tp: int, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype=np.float64,
                 limit: int | None = None):
        _check_limit("DraftCaches", capacity, limit)
        shape = (capacity, kv_heads, head_dim)
        self.k = [[np.zeros(shape, dtype=dtype) for _ in range(layers)] for _ in range(tp)]
        self.v = [[np.zeros(shape, dtype=dtype) for _ in range(layers)] for _ in range(tp)]
        self.length = 0
        self.limit = limit

    @property
    def capacity(self) -> int:
        return self.k[0][0].shape[0]

    def feeds(self, layer: int) -> dict:
        return {"cache_k": PerRank(rank[layer] for rank in self.k), "cache_v": PerRank(rank[layer] for rank in self.v)}

    def keep(self, layer: int, outs: dict) -> None:
        for r, (k, v) in enumerate(zip(outs["cache_k_out"], outs["cache_v_out"])):
            self.k[r][layer], self.v[r][layer] = k, v

    def reserve(self, rows: int) -> None:
        if rows > self.capacity:
            new = _new_rows("DraftCaches", rows, self.capacity, self.limit)
            self.k = [[_grown(a, new, self.length) for a in rank] for rank in self.k]
            self.v = [[_grown(a, new, self.length) for a in rank] for rank in self.v]
