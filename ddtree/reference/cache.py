"""The MLA latent KV cache of the reference (docs/interfaces.md section 3, docs/kimi-k2.md section 6).

Per layer and token it holds 576 values for Kimi K2.x: the RMS-normalised c_kv (kv_lora_rank)
then the roped k_pe (qk_rope_head_dim). The forward appends q entries per call; DDTree keeps the
accepted path with `compact` and drops rejected tails with `truncate`.

The buffers start at `capacity` rows and grow by doubling on demand, up to `limit` rows when one is
given (the decode loops give the rows a run can need, so nothing is allocated for a token budget
the model's context cuts off); writing past the limit is an error.

Letters: S = capacity in tokens, R = kv_lora_rank, P = qk_rope_head_dim.
"""
from __future__ import annotations

import numpy as np


class LatentCache:
    def __init__(self, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype=np.float64,
                 capacity: int = 256, limit: int | None = None):
        if limit is not None and capacity > limit:
            raise ValueError(f"LatentCache: capacity {capacity} is above its limit {limit}")
        self.num_layers = num_layers
        self.limit = limit
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.dtype = np.dtype(dtype)
        self.length = 0
        # one [S, R + P] buffer per layer; grown by doubling (up to `limit`)
        self._buf = [np.zeros((capacity, kv_lora_rank + rope_dim), dtype=self.dtype) for _ in range(num_layers)]

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def capacity(self) -> int:
        return self._buf[0].shape[0]

    def _reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        if self.limit is not None and n > self.limit:
            raise ValueError(f"LatentCache: {n} rows asked for, past the cache's limit of {self.limit}")
        new_cap = max(n, 2 * self.capacity)
        if self.limit is not None:
            new_cap = min(new_cap, self.limit)
        for i, old in enumerate(self._buf):
            grown = np.zeros((new_cap, self.entry_dim), dtype=self.dtype)
            grown[: self.length] = old[: self.length]
            self._buf[i] = grown

    # -- reads -----------------------------------------------------------------------------
    def entries(self, layer: int, end: int | None = None) -> np.ndarray:
        """[end, R + P] view of one layer's entries 0..end-1 (default: all `length`)."""
        return self._buf[layer][: self.length if end is None else end]

    def c_kv(self, layer: int, end: int | None = None) -> np.ndarray:
        return self.entries(layer, end)[:, : self.kv_lora_rank]           # [end, R]

    def k_pe(self, layer: int, end: int | None = None) -> np.ndarray:
        return self.entries(layer, end)[:, self.kv_lora_rank:]            # [end, P]

    # -- writes (used by the forward) --------------------------------------------------------
    def write(self, layer: int, start: int, c_kv: np.ndarray, k_pe: np.ndarray) -> None:
        """Store c_kv [q, R] and k_pe [q, P] at start..start+q-1 of one layer (length is not changed)."""
        q = c_kv.shape[0]
        if c_kv.shape != (q, self.kv_lora_rank) or k_pe.shape != (q, self.rope_dim):
            raise ValueError(f"LatentCache.write: expected c_kv [{q}, {self.kv_lora_rank}] and k_pe "
                             f"[{q}, {self.rope_dim}], got {list(c_kv.shape)} and {list(k_pe.shape)}")
        self._reserve(start + q)
        buf = self._buf[layer]
        buf[start: start + q, : self.kv_lora_rank] = c_kv
        buf[start: start + q, self.kv_lora_rank:] = k_pe

    def set_length(self, n: int) -> None:
        self._reserve(n)
        self.length = n

    # -- DDTree bookkeeping ------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Forget every entry at index >= n."""
        if not 0 <= n <= self.length:
            raise ValueError(f"LatentCache.truncate: n = {n} must be in 0..{self.length}")
        self.length = n

    def compact(self, start: int, keep) -> None:
        """Keep the entries at start + keep[i] (keep strictly increasing), move them to start + i,
        and truncate to start + len(keep)."""
        keep = np.asarray(keep, dtype=np.int64).reshape(-1)
        if keep.size:
            if np.any(np.diff(keep) <= 0):
                raise ValueError(f"LatentCache.compact: keep must be strictly increasing, got {keep.tolist()}")
            if keep[0] < 0 or start < 0 or start + keep[-1] >= self.length:
                raise ValueError(f"LatentCache.compact: start {start} + keep {keep.tolist()} must index "
                                 f"entries below length {self.length}")
        elif not 0 <= start <= self.length:
            raise ValueError(f"LatentCache.compact: start {start} must be in 0..{self.length}")
        for buf in self._buf:
            buf[start: start + keep.size] = buf[start + keep]   # fancy index copies first: overlap is safe
        self.length = start + keep.size

    def copy(self) -> "LatentCache":
        other = LatentCache(self.num_layers, self.kv_lora_rank, self.rope_dim, self.dtype, capacity=1,
                            limit=self.limit)
        other._buf = [b.copy() for b in self._buf]
        other.length = self.length
        return other
