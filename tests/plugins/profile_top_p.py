"""Where top-p without top-k spends its time (issue 23), for whichever tree is on PYTHONPATH (the kernels
before issue 23 or after): each prefix of the TOP_P launch sequence, R steps over rotating logits buffers
(>= 4x L2, as `ddtree bench tree`) in one graph; a kernel's time = the prefix with it - the prefix without.
    python3 tests/plugins/profile_top_p.py [V,V,..] [B] [flat|peaked] [K=V,..] [stamps] [step]   (JSON lines)
step: also the build + walk step of `ddtree bench tree` split the same way (draft_lse_parts, draft_topk, then
the walk's kernels), so that the build's share of a top-p step is measured where it runs.
K=V,..: sample_top_p.cu compile switches (SP_ABLATE=1: no Gumbel in sample_kept's slice loop, =2: no cut in
its last block; wrong tokens, timing only). stamps: one more run of a DD_PROFILE=1 build (eager, one step)
whose per-phase clock64 cycles (sp_prof, summed over blocks) are printed per block and per row's last block.
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
BUILD = ["draft_lse_parts", "draft_topk"]                    # tree_build.cu, before the walk in a step
# sp_prof slots (sample_top_p.cu SP_PROF_*): (name, slot, count slot)
STAMPS = [("mass.load_wait", 0, 3), ("mass.tokens", 1, 3), ("mass.flush", 2, 3), ("mass.last.decide", 4, 5),
          ("kept.wait_state", 8, 11), ("kept.slice_loop", 9, 11), ("kept.winners_ticket", 10, 11),
          ("kept.last.slice_wins", 12, 17), ("kept.last.keys_sort", 13, 17), ("kept.last.cut", 14, 17),
          ("kept.last.gumbel", 15, 17), ("kept.last.certify", 16, 17),
          ("mass.last.decide.loads", 18, 5)]


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


def stamps(gpu, V: int, host: np.ndarray, pos, defines: dict) -> dict:
    """Cycles per phase (sum over blocks / blocks) of one eager top-p launch of a DD_PROFILE=1 build."""
    from ddtree.plugins.device import DeviceArray
    defines = {**defines, "DD_PROFILE": 1}
    n = host.shape[0]
    sampler = TreeSampler(gpu, vocab=V, max_rows=n, top_p_defines=defines)
    logits = gpu.upload(host)
    sampler.run(logits, pos, MODES["top_p0.95"], n)            # compiles and loads the module
    gpu.sync()
    prof = DeviceArray(gpu, gpu.module_global("sample_top_p.cu", "sp_prof", defines), (32,), np.uint64)
    gpu.memset(prof, 0)
    sampler.run(logits, pos, MODES["top_p0.95"], n)
    gpu.sync()
    raw = prof.numpy().astype(np.int64)
    return {name: round(int(raw[slot]) / max(1, int(raw[count])), 1) for name, slot, count in STAMPS} | \
        {"blocks": int(raw[3]), "last_blocks": int(raw[17])}


def walk_names(sampler) -> list[str]:
    return NEW if hasattr(sampler, "slice_max") else OLD


def profile_step(gpu, V: int, B: int, flat: bool, D: int = 7) -> dict:
    """The whole step as `ddtree bench tree` times it (build, then the top-p walk, R steps a graph), each
    kernel's share = the prefix with it - the prefix without (what a kernel adds where it really runs)."""
    from ddtree.plugins.tree_build import DraftTreeBuilder
    n = B + 1
    rng = np.random.default_rng(V + B)
    draft_host, target_host = lm_logits(rng, D, V, flat), lm_logits(rng, n, V, flat)
    copies = max(1, math.ceil(4 * gpu.l2_bytes / ((D + n) * V * 4)))
    drafts = [gpu.upload(draft_host) for _ in range(copies)]
    targets = [gpu.upload(target_host) for _ in range(copies)]
    root, start = gpu.upload(np.array([1], np.int32)), gpu.upload(np.array([4096], np.int32))
    builder, sampler = DraftTreeBuilder(gpu, vocab=V, depth=D, max_budget=B), TreeSampler(gpu, vocab=V, max_rows=n)
    plan = sampler.set_params(MODES["top_p0.95"])
    names = BUILD + walk_names(sampler)
    steps = max(8, copies)
    tree = builder.run(drafts[0], root, start, B)
    sampler.launch(plan, targets[0], tree.positions, n, tree=tree)
    gpu.sync()

    def step_all(stream):
        for r in range(steps):
            t = builder.run(drafts[r % copies], root, start, B, stream=stream)
            sampler.launch(plan, targets[r % copies], t.positions, n, tree=t, stream=stream)

    times = []
    for k in range(1, len(names) + 1):
        builder.gpu = sampler.gpu = Only(gpu, names[:k])
        try:
            times.append(time_graph(gpu, step_all) * 1e3 / steps)
        finally:
            builder.gpu = sampler.gpu = gpu
    parts = {name: round(t - (times[i - 1] if i else 0.0), 2) for i, (name, t) in enumerate(zip(names, times))}
    gpu.free_all()
    return {"vocab": V, "budget": B, "logits": "flat" if flat else "peaked", "step": True,
            "total_us": round(times[-1], 2), "parts_us": parts}


def profile(gpu, V: int, B: int, flat: bool, defines: dict | None = None, with_stamps: bool = False) -> dict:
    n = B + 1
    rng = np.random.default_rng(V + B)
    host = lm_logits(rng, n, V, flat)
    copies = max(1, math.ceil(4 * gpu.l2_bytes / (n * V * 4)))
    targets = [gpu.upload(host) for _ in range(copies)]
    pos = gpu.upload(np.arange(4096, 4096 + n, dtype=np.int32))
    sampler = TreeSampler(gpu, vocab=V, max_rows=n, top_p_defines=defines or None)
    names = walk_names(sampler)
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
    out = {"vocab": V, "budget": B, "logits": "flat" if flat else "peaked", "kernels": ",".join(names),
           "defines": defines or {}, "total_us": round(times[-1], 2), "parts_us": parts}
    if with_stamps:
        try:
            out["cycles_per_block"] = stamps(gpu, V, host, pos, defines or {})
        except Exception as exc:                       # keep the timings
            out["stamps_error"] = repr(exc)
    gpu.free_all()
    return out


if __name__ == "__main__":
    vocabs = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "163840").split(",")]
    budget = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    flat = len(sys.argv) > 3 and sys.argv[3] == "flat"
    switches = [a for a in sys.argv[4:] if "=" in a]
    defines = {k: int(v) for k, v in (kv.split("=") for a in switches for kv in a.split(","))}
    g = Gpu()
    for V in vocabs:
        print(json.dumps(profile(g, V, budget, flat, defines, "stamps" in sys.argv[4:])), flush=True)
        if "step" in sys.argv[4:]:
            print(json.dumps(profile_step(g, V, budget, flat)), flush=True)
