"""Device timing of top-p across ranks (plugins/top_p_ranks_gpu.py), one JSON document on stdout.

    python3 tests/plugins/time_top_p_ranks.py [--before PATH_TO_OLD_sample_top_p.cu]

For V 163840 split over 8 ranks (V_r 20480) and n 65 rows (a budget-64 tree's target rows), LM-like and flat:
the 8 ranks run once as threads of this process (ThreadRankGroup), so every rank's gathered buffers hold the real
exchange; then rank 0 alone replays CUDA graphs of R launches over logits copies that together exceed 4x L2,
with the collectives replaced: `kernels` (no-op all-gathers: the gathered buffers keep the real exchange) per
kernel prefix, so each kernel's time is a prefix minus the one before it, and `standin` (each all-gather a local
copy of the rank's part into every slot: the bytes land, nothing crosses a link). The single-rank TreeSampler's
top-p (no tree) at V 163840 and 20480 is timed the same way, and with --before the same for an older
sample_top_p.cu (the refactor's A/B).
"""
from __future__ import annotations

import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ddtree.parallel.cuda_collectives import StandinGather

V, TP, N = 163840, 8, 65
KERNELS = ("topp_ranks_max", "topp_ranks_mass", "topp_ranks_decide", "topp_ranks_scan", "topp_ranks_cut")


class NoGather:
    capturable = True

    def all_gather(self, gpu, x, out, stream=None):
        pass


class Only:
    """The rank's Gpu, launching only the kernels named in `allowed` (a kernel prefix)."""

    def __init__(self, gpu, allowed):
        self._gpu, self.allowed = gpu, allowed

    def __getattr__(self, name):
        return getattr(self._gpu, name)

    def kernel(self, source, name, *a):
        return name, self._gpu.kernel(source, name, *a)

    def launch(self, kernel, *args, **kw):
        name, k = kernel
        if name in self.allowed:
            self._gpu.launch(k, *args, **kw)


def per_launch_us(gpu, launch_on, copies, repeats=15) -> float:
    """Median over `repeats` replays of a graph of one launch per logits copy, per launch (us)."""
    launch_on(copies[0], None)                       # modules loaded (and the old source compiled) before capture
    gpu.sync()
    graph = gpu.capture(lambda s: [launch_on(x, s) for x in copies])
    gpu.replay(graph)
    gpu.sync()
    return float(np.median(gpu.timed_ms(lambda: gpu.replay(graph), repeats))) * 1e3 / len(copies)


def copies_of(gpu, x: np.ndarray):
    k = max(8, math.ceil(4 * gpu.l2_bytes / x.nbytes))
    return [gpu.upload(x) for _ in range(k)]


def ranks_case(gpus, l, pos, params) -> dict:
    from ddtree.parallel.cuda_collectives import ThreadRankGroup
    from ddtree.plugins.top_p_ranks_gpu import TopPRanks, exchange_bytes
    V_r = V // TP
    group = ThreadRankGroup(TP)
    samplers = [TopPRanks(gpus[r], group.member(r), TP, V, V_r, max_rows=N) for r in range(TP)]

    def rank(r):
        g = gpus[r]
        g.dev.set_current()
        out = samplers[r].run(g.upload(np.ascontiguousarray(l[:, r * V_r: (r + 1) * V_r])), r * V_r, g.upload(pos),
                              params, N)
        return out.tokens.numpy(), out.flags.numpy()
    with ThreadPoolExecutor(TP) as pool:
        outs = list(pool.map(rank, range(TP)))
    gpus[0].dev.set_current()
    s, g = samplers[0], gpus[0]
    copies, q = copies_of(g, np.ascontiguousarray(l[:, :V_r])), g.upload(pos)
    s.collective = NoGather()
    prefix = []
    for k in range(1, len(KERNELS) + 1):
        s.gpu = Only(g, KERNELS[:k])
        prefix.append(per_launch_us(g, lambda x, st: s.launch(x, 0, q, N, stream=st), copies))
    s.gpu = g
    s.collective = StandinGather(TP)
    standin = per_launch_us(g, lambda x, st: s.launch(x, 0, q, N, stream=st), copies)
    return {"ranks_agree": all((o[0] == outs[0][0]).all() and (o[1] == outs[0][1]).all() for o in outs),
            "flagged_rows": int((outs[0][1] != 0).sum()),
            "kernels_us": dict(zip(KERNELS, np.diff([0.0] + prefix).round(2).tolist())),
            "kernels_total_us": round(prefix[-1], 2), "standin_total_us": round(standin, 2),
            "bytes_sent_per_rank": exchange_bytes(N), "logits_copies": len(copies)}


def single_case(gpu, l, pos, params, source) -> dict:
    from ddtree.plugins import tree_sample
    out = {}
    for V_s in (V, V // TP):
        tree_sample.TOP_P_SOURCE = source
        s = tree_sample.TreeSampler(gpu, vocab=V_s, max_rows=N)
        plan = s.set_params(params)
        copies, q = copies_of(gpu, np.ascontiguousarray(l[:, :V_s])), gpu.upload(pos)
        out[f"V{V_s}_us"] = round(per_launch_us(gpu, lambda x, st: s.launch(plan, x, q, N, stream=st), copies), 2)
    tree_sample.TOP_P_SOURCE = "sample_top_p.cu"
    return out


def main(argv) -> None:
    from ddtree.bench.tree import lm_logits
    from ddtree.plugins import compile as kc
    from ddtree.plugins.device import Gpu
    from ddtree.tree.sampling import SamplingParams
    before = argv[argv.index("--before") + 1] if "--before" in argv else None
    if before:                                      # the old kernels under another name, compiled like any source
        (kc.KERNEL_DIR / "sample_top_p_before.cu").write_text(open(before).read())
        kc.SOURCES["sample_top_p_before.cu"] = {"default": {}}
    gpus = [Gpu(0) for _ in range(TP)]
    result = {"device": gpus[0].name, "V": V, "tp": TP, "n": N}
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=3)
    for shape in ("lm", "flat"):
        rng = np.random.default_rng(23)
        l = lm_logits(rng, N, V, shape == "flat")
        pos = rng.integers(0, 1 << 30, size=N).astype(np.int32)
        result[shape] = {"ranks": ranks_case(gpus, l, pos, params),
                         "single_rank": single_case(gpus[0], l, pos, params, "sample_top_p.cu")}
        if before:
            result[shape]["single_rank_before"] = single_case(gpus[0], l, pos, params, "sample_top_p_before.cu")
        print(json.dumps(result[shape]), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
