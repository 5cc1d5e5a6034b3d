"""Tree-step kernels launched eagerly (no graph) so that `ncu` can time each one:
    ncu --metrics gpu__time_duration.sum python3 tests/plugins/profile_tree.py [V] [B,B,..] [modes] [flat]
    DD_TREE_TRACE=1 python3 tests/plugins/profile_tree.py ...   (phase timestamps printed by the kernels)
modes: comma-separated names from ddtree.bench.tree.MODES, or "build" for the build alone.
"""
import os
import sys

import numpy as np

if os.environ.get("DD_TREE_TRACE"):             # kernels record phase timestamps (select.cuh DD_TRACE)
    import ddtree.plugins.device as device
    _compile = device.compile_cubin
    device.compile_cubin = lambda source, arch, defines=None: _compile(source, arch,
                                                                      defines={**(defines or {}), "DD_TREE_TRACE": 1})

from ddtree.bench.tree import MODES, lm_logits
from ddtree.plugins.device import Gpu
from ddtree.plugins.tree_build import DraftTreeBuilder
from ddtree.plugins.tree_sample import TreeSampler

V = int(sys.argv[1]) if len(sys.argv) > 1 else 163840
budgets = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "64").split(",")]
modes = (sys.argv[3] if len(sys.argv) > 3 else ",".join(MODES)).split(",")
flat = len(sys.argv) > 4 and sys.argv[4] == "flat"
D = 7
gpu = Gpu()
rng = np.random.default_rng(0)
draft = gpu.upload(lm_logits(rng, D, V, flat))
root, start = gpu.upload(np.array([1], np.int32)), gpu.upload(np.array([4096], np.int32))
builder = DraftTreeBuilder(gpu, vocab=V, depth=D)
TRACE_PHASES = ["topk start", "keys loaded", "slice selected", "last slice selected", "row 0 merge start",
                "row 0 merged", "build start", "table loaded", "popped", "tree written"]


def trace_global():
    """Device pointer of tree_build.cu's dd_trace[32] (DD_TREE_TRACE builds only: the define is added under
    compile_cubin, so the module is keyed as the plain one)."""
    return gpu.module_global("tree_build.cu", "dd_trace")


def print_trace(B):
    from ddtree.plugins.device import DeviceArray
    all_slots = DeviceArray(gpu, trace_global(), (32,), np.uint64).numpy().astype(np.int64)
    t = all_slots[: len(TRACE_PHASES)]
    cycles, ns = all_slots[11] - all_slots[10], t[8] - t[7]
    print(f"B {B} trace (us from topk start): " + ", ".join(
        f"{name} {(v - t[0]) / 1e3:.1f}" for name, v in zip(TRACE_PHASES, t))
        + f"; pops: {cycles} SM cycles in {ns} ns ({cycles / max(ns, 1):.2f} GHz)", file=sys.stderr)


for B in budgets:
    target = gpu.upload(lm_logits(rng, B + 1, V, flat))
    sampler = TreeSampler(gpu, vocab=V)
    for mode in modes:
        tree = builder.run(draft, root, start, B)
        if mode != "build":
            sampler.run(target, tree.positions, MODES[mode], B + 1, tree=tree)
        gpu.sync()
        if os.environ.get("DD_TREE_TRACE"):
            print_trace(B)
        print(f"B {B} {mode}: accepted {int(sampler.out.count.numpy()[0])}, "
              f"full-row rows {int(sampler.full_row_rows.numpy()[0])}", file=sys.stderr)
