"""One DDTree tree step per sampling mode, launched eagerly (no graph) so that `ncu` can time every kernel:
    ncu --metrics gpu__time_duration.sum python3 tests/plugins/profile_tree.py [V] [B]
"""
import sys

import numpy as np

from ddtree.bench.tree import MODES, lm_logits
from ddtree.plugins.device import Gpu
from ddtree.plugins.tree_build import DraftTreeBuilder
from ddtree.plugins.tree_sample import TreeSampler

V = int(sys.argv[1]) if len(sys.argv) > 1 else 163840
B = int(sys.argv[2]) if len(sys.argv) > 2 else 64
D = 7
gpu = Gpu()
rng = np.random.default_rng(0)
draft, target = gpu.upload(lm_logits(rng, D, V, False)), gpu.upload(lm_logits(rng, B + 1, V, False))
root, start = gpu.upload(np.array([1], np.int32)), gpu.upload(np.array([4096], np.int32))
builder, sampler = DraftTreeBuilder(gpu, vocab=V, depth=D), TreeSampler(gpu, vocab=V)
for mode, params in MODES.items():
    tree = builder.run(draft, root, start, B)
    sampler.run(target, tree.positions, params, B + 1, tree=tree)
    gpu.sync()
    print(mode, "count", int(sampler.out.count.numpy()[0]), file=sys.stderr)
