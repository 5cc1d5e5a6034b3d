"""Where top-p without top-k spends its time (issue 23), for whichever tree is on PYTHONPATH (the kernels
before issue 23 or after): each prefix of the TOP_P launch sequence, R steps over rotating logits buffers
(>= 4x L2, as `ddtree bench tree`) in one graph; a kernel's time = the prefix with it - the prefix without.
    python3 tests/plugins/profile_top_p.py [V,V,..] [B] [flat]     (one JSON object per line on stdout)
"""
import json
import math
import sys

import numpy as np

from ddtree.bench.kernels import time_graph
from ddtree.bench.tree import MODES, lm_logits
from ddtree.plugins.device import Gpu
from ddtree.plugins.tree_sample import TreeSampler

OLD = ["sample_filtered", "sample_mass", "sample_kept"]      # the candidates, float64 bins, Gumbel
NEW = ["sample_row_max", "sample_mass", "sample_kept"]


class Only:
    """The Gpu, with launches of kernels outside `names` dropped (TreeSampler.launch asks kernel() first)."""

    def __init__(self, gpu, names):
        self._gpu, self._names, self._last = gpu, names, None

    def kernel(self, source, name, *args, **kw):
        self._last = name
        return self._gpu.kernel(source, name, *args, **kw)

    def launch(self, kernel, *args, **kw):
        if self._last in self._names:
            self._gpu.launch(kernel, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._gpu, name)


def profile(gpu, V: int, B: int, flat: bool) -> dict:
    n = B + 1
    rng = np.random.default_rng(V + B)
    host = lm_logits(rng, n, V, flat)
    copies = max(1, math.ceil(4 * gpu.l2_bytes / (n * V * 4)))
    targets = [gpu.upload(host) for _ in range(copies)]
    pos = gpu.upload(np.arange(4096, 4096 + n, dtype=np.int32))
    sampler = TreeSampler(gpu, vocab=V, max_rows=n)
    names = NEW if hasattr(sampler, "slice_max") else OLD
    plan = sampler.set_params(MODES["top_p0.95"])
    steps = max(8, copies)
    sampler.run(targets[0], pos, MODES["top_p0.95"], n)
    gpu.sync()
    times = []
    for k in range(1, len(names) + 1):
        sampler.gpu = Only(gpu, names[:k])
        try:
            us = time_graph(gpu, lambda s: [sampler.launch(plan, targets[r % copies], pos, n, stream=s)
                                            for r in range(steps)]) * 1e3 / steps
        finally:
            sampler.gpu = gpu
        times.append(us)
    parts = {name: round(t - (times[i - 1] if i else 0.0), 2) for i, (name, t) in enumerate(zip(names, times))}
    gpu.free_all()
    return {"vocab": V, "budget": B, "logits": "flat" if flat else "peaked", "kernels": "new" if names is NEW else "old",
            "total_us": round(times[-1], 2), "parts_us": parts}


if __name__ == "__main__":
    vocabs = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "163840").split(",")]
    budget = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    flat = len(sys.argv) > 3 and sys.argv[3] == "flat"
    g = Gpu()
    for V in vocabs:
        print(json.dumps(profile(g, V, budget, flat)), flush=True)
