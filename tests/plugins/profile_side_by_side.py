"""What a skinny-GEMM launch costs beyond its bytes, and q_a + kv_a as ONE GEMM over the same x against two launches
(issue 48; docs/performance.md section 4.2). One GPU: `PYTHONPATH=. python3 tests/plugins/profile_side_by_side.py
[OUT.json]`. Every form is bench chain's `launches` (bench/chain.py time_launches: weight copies together >= 4x the
L2, one skinny-GEMM launch an op with PDL, one graph)."""
import json
import sys

import numpy as np

from ddtree.bench.chain import KIMI_TP8_LAYER, chain_weights, time_launches
from ddtree.bench.kernels import open_gpu
from ddtree.plugins import randfill
from ddtree.plugins.gemm import SkinnyGemm
from ddtree.plugins.gemm_chain import INPUT, MAX_MT, ChainGemm

gpu, ceiling = open_gpu()
gbps = ceiling["gbps"]
out = {"device": gpu.name, "gbps": gbps, "single": [], "pair": [], "layer": []}
K = 7168
x = gpu.alloc((8 * MAX_MT, K), np.uint16)
randfill.fill_device(gpu, x, 7, randfill.ACT_BF16)


def timed(ops: list[ChainGemm], M: int) -> tuple:
    """(us a pass of ops' launches, their weight bytes, each op's plan at M)."""
    per = sum(o.N * o.K * 2 for o in ops)
    us = time_launches(gpu, ops, chain_weights(gpu, ops, max(2, -(-4 * gpu.l2_bytes // per)), 0), x, M)
    return us, per, [str(SkinnyGemm(gpu, o.N, o.K, 8 * MAX_MT).plan(M)) for o in ops]


layer = list(KIMI_TP8_LAYER.values())
for M in (1, 9, 17):
    for N in (576, 2112, 8448):
        us, b, plans = timed([ChainGemm(N, K, INPUT)], M)
        out["single"].append({"M": M, "N": N, "mb": b / 1e6, "us": us, "ideal": b / gbps / 1e3, "plan": plans})
        print(f"single M={M} N={N} {b / 1e6:.1f} MB {us:.2f} us ideal {b / gbps / 1e3:.2f}", flush=True)
    two, b, p2 = timed([ChainGemm(1536, K, INPUT), ChainGemm(576, K, INPUT)], M)
    one, _, p1 = timed([ChainGemm(2112, K, INPUT)], M)
    out["pair"].append({"M": M, "two_launches": two, "one_merged": one, "ideal": b / gbps / 1e3, "plans": p2 + p1})
    print(f"pair M={M}: q_a + kv_a two launches {two:.2f} us, merged {one:.2f} us (ideal {b / gbps / 1e3:.2f})")
    for name, ops in (("layer6", layer), ("layer5_merged", [ChainGemm(2112, K, INPUT)] + layer[2:])):
        us, _, _ = timed(ops, M)
        out["layer"].append({"M": M, "form": name, "us": us})
        print(f"layer M={M} {name}: {us:.2f} us", flush=True)
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/stdout", "w"), indent=1)
