"""The numpy backend's routed experts, dequantized once: expert e of a rank's stacked kernel-layout arrays -> its
dense float64 (gate, up, down), made by plugins/reference.expert_matrices on first use and kept.

    dense = DenseExperts()                 # one per NumpyOps (one rank)
    gate, up, down = dense(packed, e)      # as reference.expert_matrices(packed, e), bit for bit

Unpacking the INT4 kernel layout on every MoE call was most of a CPU forward (small-mla, tp 2: 784 unpacks,
1.0 s of a 20-token DDTree generation's 2.2 s). The copies kept are the same arrays expert_matrices returns, so
the outputs do not change. Up to `limit_bytes` of dense matrices are kept; past it an expert is dequantized on
every call as before (a real model's experts do not fit as float64). The source arrays of a kept expert are made
read-only: writing into them afterwards raises instead of leaving a stale dense copy here.
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins import reference as twins

LIMIT_BYTES = 256 << 20   # a rank's kept dense experts: small-mla tp 2 keeps 24 in 72 MB; one of Kimi's is 352 MB: none kept


class DenseExperts:
    def __init__(self, limit_bytes: int = LIMIT_BYTES):
        self.limit, self.used = limit_bytes, 0
        self.kept: dict[tuple, tuple[tuple, tuple[np.ndarray, ...]]] = {}   # key -> (source arrays, matrices)

    def __call__(self, packed: dict[str, np.ndarray], e) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sources = tuple(packed[k] for k in sorted(packed))
        key = tuple(id(a) for a in sources) + (int(e),)
        hit = self.kept.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], sources)):   # the ids are of these very arrays
            return hit[1]
        mats = twins.expert_matrices(packed, e)
        size = sum(m.nbytes for m in mats)
        if self.used + size <= self.limit:
            for a in sources:
                a.flags.writeable = False
            for m in mats:
                m.flags.writeable = False
            self.kept[key] = (sources, mats)        # holding the sources keeps their ids from being reused
            self.used += size
        return mats
