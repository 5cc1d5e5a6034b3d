"""The one sampling definition every backend implements (docs/interfaces.md section 5).

For the token that will occupy absolute position p, with target logits l [V], all in float64:
  temperature 0   argmax l, ties -> lowest id (0 < T < MIN_TEMPERATURE = 1e-6 is refused: l / T overflows)
  otherwise       z = l / T
                  top-k: keep the k largest z (ties -> lower id); k = 0 keeps all
                  top-p: probabilities = softmax over the top-k survivors; sorted by probability
                         (ties -> lower id), keep the smallest prefix whose cumulative probability
                         reaches top_p, the crossing token included; top_p >= 1 keeps all
                  sample = the kept v maximising z[v] + g(seed, p, v)          (Gumbel-max)
  g = -log(-log(u)),  u = (x + 0.5) / 2^32,  x = word 0 of Philox4x32-10 with
      counter (p, v, 0, 0) and key (seed mod 2^32, seed >> 32).
The noise depends only on (seed, position, token), so DDTree and plain autoregressive decoding
commit identical tokens whenever they see the same logits. Vectorised over many positions because
DDTree samples at every tree node.

Letters: n rows (positions), V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.errors import InputError
from ddtree.tree.philox import philox4x32_10

CHUNK = 1 << 20              # Philox evaluations per numpy batch (bounds the temporaries)
TWO_POW_32 = 4294967296.0
MIN_TEMPERATURE = 1e-6       # smallest T > 0: below, l / T overflows float32 on the device for large
                             # logits (1e-310: inf, a run of garbage), and the draw equals greedy
                             # except where logits tie within ~1e-5; so 0 < T < 1e-6 is refused


class SamplingError(InputError):
    """Sampling parameters out of their domain, naming the parameter (and its ddtree-run flag) and the value."""


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = no top-k
    top_p: float = 1.0           # >= 1 = no top-p
    seed: int = 0                # 0 <= seed < 2^64

    def __post_init__(self):
        if not (_is_real(self.temperature) and self.temperature >= 0 and np.isfinite(self.temperature)):
            raise SamplingError(f"SamplingParams: temperature (--temperature) must be a finite number >= 0, "
                                f"got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise SamplingError(f"SamplingParams: temperature (--temperature) must be 0 (greedy) or at least "
                                f"{MIN_TEMPERATURE:g} (below it l / T overflows), got {self.temperature!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise SamplingError(f"SamplingParams: top_k (--top-k) must be an integer >= 0 (0 = off), "
                                f"got {self.top_k!r}")
        if not (_is_real(self.top_p) and self.top_p > 0 and np.isfinite(self.top_p)):
            raise SamplingError(f"SamplingParams: top_p (--top-p) must be a finite number > 0 (>= 1 = off), "
                                f"got {self.top_p!r}")
        if not (_is_int(self.seed) and 0 <= self.seed < 1 << 64):
            raise SamplingError(f"SamplingParams: seed (--seed) must be an integer in [0, 2^64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def gumbel(seed: int, position, token_ids) -> np.ndarray:
    """g(seed, p, v) float64 for broadcastable position and token_ids arrays (shape of their broadcast)."""
    position, token_ids = np.broadcast_arrays(np.asarray(position, dtype=np.int64),
                                              np.asarray(token_ids, dtype=np.int64))
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64)
    flat_p, flat_v = position.reshape(-1), token_ids.reshape(-1)
    out = np.empty(flat_p.shape, dtype=np.float64)
    for s in range(0, flat_p.size, CHUNK):
        p, v = flat_p[s: s + CHUNK], flat_v[s: s + CHUNK]
        zeros = np.zeros_like(p)
        counter = np.stack([p, v, zeros, zeros], axis=-1)            # [m, 4]
        x = philox4x32_10(counter, key)[:, 0].astype(np.float64)     # [m] word 0
        u = (x + 0.5) / TWO_POW_32                                    # in (0, 1): never 0 or 1
        out[s: s + CHUNK] = -np.log(-np.log(u))
    return out.reshape(position.shape)


def _descending(values: np.ndarray) -> np.ndarray:
    """Per row, indices sorted by value descending, ties -> lower index first. [n, V]"""
    return np.argsort(-values, axis=-1, kind="stable")


def kept_mask(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """z [n, V] scaled logits -> [n, V] bool: the tokens that survive top-k then top-p."""
    n, V = z.shape
    rows = np.arange(n)[:, None]
    kept = np.ones((n, V), dtype=bool)
    if 0 < top_k < V:
        kept[:] = False
        kept[rows, _descending(z)[:, :top_k]] = True
    if top_p >= 1:
        return kept
    survivors = np.where(kept, z, -np.inf)                              # [n, V]
    e = np.exp(survivors - survivors.max(axis=-1, keepdims=True))       # 0 outside the survivors
    probs = e / e.sum(axis=-1, keepdims=True)                           # [n, V] softmax over survivors
    order = _descending(probs)                                          # [n, V] by probability, ties lower id
    cumulative = np.cumsum(probs[rows, order], axis=-1)                 # [n, V]
    reached = cumulative >= top_p
    # prefix length: up to and including the first crossing; all survivors if rounding never reaches top_p
    length = np.where(reached.any(axis=-1), reached.argmax(axis=-1) + 1, kept.sum(axis=-1))   # [n]
    in_prefix = np.arange(V)[None, :] < length[:, None]                 # [n, V] in sorted order
    top_p_kept = np.zeros((n, V), dtype=bool)
    top_p_kept[rows, order] = in_prefix
    return kept & top_p_kept


def sample(logits, positions, params: SamplingParams) -> np.ndarray:
    """logits [n, V], positions [n] (where the sampled tokens will sit) -> tokens [n] int64."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2:
        raise ValueError(f"sample: logits must be [n, V], got shape {list(logits.shape)}")
    n, V = logits.shape
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    if positions.shape != (n,):
        raise ValueError(f"sample: positions must be [{n}] (one per logits row), got {list(positions.shape)}")
    if positions.size and (positions.min() < 0 or positions.max() > 0xFFFFFFFF):
        raise ValueError("sample: positions must be in [0, 2^32) (the Philox counter word)")
    if np.isnan(logits).any():
        raise ValueError(f"sample: logits rows {np.nonzero(np.isnan(logits).any(axis=1))[0].tolist()} contain NaN")
    if params.greedy:
        return np.argmax(logits, axis=-1).astype(np.int64)             # first maximum = lowest id
    z = logits / params.temperature                                     # [n, V]
    kept = kept_mask(z, params.top_k, params.top_p)                     # [n, V]
    rows, cols = np.nonzero(kept)
    noisy = np.full((n, V), -np.inf)
    noisy[rows, cols] = z[rows, cols] + gumbel(params.seed, positions[rows], cols)
    return np.argmax(noisy, axis=-1).astype(np.int64)
