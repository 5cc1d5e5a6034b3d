"""What a skinny-GEMM launch costs beyond its bytes, and q_a + kv_a as ONE GEMM over the same x against two launches
(issue 48; docs/performance.md section 4.2). One GPU: `PYTHONPATH=. python3 tests/plugins/profile_side_by_side.py
[OUT.json]`. Every form reads weight copies together >= 4x the L2 (bench chain's method), launches in one graph."""
import json
import sys

import numpy as np

from ddtree.bench.chain import KIMI_TP8_LAYER, chain_weights, time_launches
from ddtree.bench.kernels import device_bf16_weight, open_gpu, time_graph
from ddtree.plugins import randfill
from ddtree.plugins.gemm import SkinnyGemm
from ddtree.plugins.gemm_chain import INPUT, ChainGemm

gpu, ceiling = open_gpu()
gbps = ceiling["gbps"]
out = {"device": gpu.name, "gbps": gbps, "single": [], "pair": [], "layer": []}
K = 7168
x = gpu.alloc((64, K), np.uint16)
randfill.fill_device(gpu, x, 7, randfill.ACT_BF16)


def time_gemms(shapes, M, merged_first=False):
    """us for one pass of launches over `shapes` [(N, K)], every one reading x (weights >= 4x L2 in copies)."""
    per = sum(N * Kk * 2 for N, Kk in shapes)
    copies = max(2, -(-4 * gpu.l2_bytes // per))
    ws = [[device_bf16_weight(gpu, N, Kk, 100 * c + i) for i, (N, Kk) in enumerate(shapes)] for c in range(copies)]
    gs = [SkinnyGemm(gpu, N, Kk, 64) for N, Kk in shapes]
    outs = [gpu.zeros((64, N), np.uint16) for N, _ in shapes]
    xs = [x if Kk == K else gpu.zeros((64, Kk), np.uint16) for _, Kk in shapes]

    def launches(s):
        for wc in ws:
            for g, xi, w, o in zip(gs, xs, wc, outs):
                g.run(xi, w, o, M, stream=s)
    launches(None)
    gpu.sync()
    us = time_graph(gpu, launches) * 1e3 / copies
    plans = [str(g.plan(M)) for g in gs]
    return us, per, plans


for M in (1, 9, 17):
    for N in (576, 2112, 8448):
        us, b, plans = time_gemms([(N, K)], M)
        out["single"].append({"M": M, "N": N, "mb": b / 1e6, "us": us, "ideal": b / gbps / 1e3, "plan": plans})
        print(f"single M={M} N={N} {b/1e6:.1f} MB {us:.2f} us ideal {b/gbps/1e3:.2f}", flush=True)
    two, b, p2 = time_gemms([(1536, K), (576, K)], M)
    one, b1, p1 = time_gemms([(2112, K)], M)
    out["pair"].append({"M": M, "two_launches": two, "one_merged": one, "ideal": b / gbps / 1e3, "plans": p2 + p1})
    print(f"pair M={M}: q_a + kv_a two launches {two:.2f} us, merged {one:.2f} us (ideal {b/gbps/1e3:.2f})", flush=True)
    ops = list(KIMI_TP8_LAYER.values())
    merged = [ChainGemm(2112, K, INPUT)] + ops[2:]
    for name, o in (("layer6", ops), ("layer5_merged", merged)):
        w = chain_weights(gpu, o, max(2, -(-4 * gpu.l2_bytes // sum(q.N * q.K * 2 for q in o))), 0)
        us = time_launches(gpu, o, w, x, M)
        out["layer"].append({"M": M, "form": name, "us": us})
        print(f"layer M={M} {name}: {us:.2f} us", flush=True)
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/stdout", "w"), indent=1)
