"""Key splits of the drafter's block attention (plugins/draft_attention.py) timed on the GPU: one JSON line per
(heads, context, splits) with the planned split count marked. Kimi's drafter at tp 8 (8 q / 1 kv head, d 128) and
tp 1 (64 / 8), block 8, n = 4 new context rows; caches rotated over >= 4x L2.
    python3 tests/plugins/sweep_draft_attention.py [CONTEXTS] [SPLITS]     (defaults 4096,32768 and 1,9,17,33,67,133)
"""
import json
import math
import sys

import numpy as np

from ddtree.bench.kernels import time_graph
from ddtree.plugins import randfill as rf
from ddtree.plugins.device import Gpu
from ddtree.plugins.draft_attention import DraftAttention

contexts = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "4096,32768").split(",")]
sweep = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "1,9,17,33,67,133").split(",")]
gpu = Gpu(0)
b, n = 8, 4
for Hq, Hk, d in ((8, 1, 128), (64, 8, 128)):
    for T in contexts:
        rows = T + n
        copies = max(1, math.ceil(4 * gpu.l2_bytes / (2 * rows * Hk * d * 2)))
        caches = []
        for c in range(copies):
            ck, cv = gpu.alloc((rows, Hk, d), np.uint16), gpu.alloc((rows, Hk, d), np.uint16)
            rf.fill_device(gpu, ck, 11 + c, rf.ACT_BF16)
            rf.fill_device(gpu, cv, 99 + c, rf.ACT_BF16)
            caches.append((ck, cv))
        q, k, v = (gpu.alloc((b, H, d), np.uint16) for H in (Hq, Hk, Hk))
        for i, a in enumerate((q, k, v)):
            rf.fill_device(gpu, a, 5 + i, rf.ACT_BF16)
        o = gpu.alloc((b, Hq * d), np.uint16)
        cache_len, pos = gpu.upload(np.array([T], np.int32)), gpu.upload(np.arange(rows, rows + b, dtype=np.int32))
        planned = DraftAttention(gpu, Hq, Hk, d, max_block=16, max_context=rows).splits(b)
        for splits in sorted(set(sweep) | {planned}):
            attn = DraftAttention(gpu, Hq, Hk, d, max_block=16, max_context=rows, splits=splits)
            steps = max(8, copies)

            def launches(stream):
                for r in range(steps):
                    ck, cv = caches[r % copies]
                    attn.run(q, k, v, ck, cv, cache_len, n, pos, o, b, stream=stream)
            us = time_graph(gpu, launches) * 1e3 / steps
            print(json.dumps({"heads": Hq, "kv_heads": Hk, "d": d, "context": T, "block": b, "splits": splits,
                              "planned": splits == planned, "us": round(us, 2),
                              "cache_mb": round(2 * rows * Hk * d * 2 / 1e6, 2)}), flush=True)
        gpu.free_all()
