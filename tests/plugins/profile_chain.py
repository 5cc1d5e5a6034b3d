"""One launch of the layer's dense GEMM chain (bench/chain.py KIMI_TP8_LAYER) for ncu, on the GPU machine:
    ncu --clock-control none -k regex:gemm_chain --section SpeedOfLight --section WarpStateStats \
        python3 tests/plugins/profile_chain.py [M] [--independent]
"""
import sys

import numpy as np

from ddtree.bench.chain import KIMI_TP8_LAYER, chain_weights
from ddtree.plugins import randfill
from ddtree.plugins.device import Gpu
from ddtree.plugins.gemm_chain import INPUT, ChainGemm, GemmChain

if __name__ == "__main__":
    M = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1
    ops = list(KIMI_TP8_LAYER.values())
    if "--independent" in sys.argv:
        ops = [ChainGemm(o.N, o.K, INPUT) for o in ops]
    gpu = Gpu()
    ws = chain_weights(gpu, ops, 1, 0)[0]
    x = gpu.alloc((24, ops[0].K), np.uint16)
    randfill.fill_device(gpu, x, 7, randfill.ACT_BF16)
    chain = GemmChain(gpu, ops)
    chain.bind(x, ws)
    for _ in range(2):
        chain.run(M)
    gpu.sync()
    chain.check()
    print("plan", chain.plan)
