"""Where a GPU step's device time goes (benchmarks: ddtree bench e2e): the DDTree step's phases captured alone,
and the AR step's graph against the sum of its kernels each captured alone (the difference: launch gaps).

    phases = phase_times(ex.steps, budget, block)   # {"draft", "tree", "verify", "sample_walk", "update", "step", "gaps"}
    kernels = kernel_times(ex.steps)                 # {"step_us", "kernels_us", "gaps_us", "ratio", "by_kernel"}

Both replay graphs on the buffers of the request that ran last and leave its state meaningless (the next
request resets it): run them after a request, never inside one.
"""
from __future__ import annotations

import numpy as np


def phase_times(steps, budget: int, b: int, repeats: int = 20) -> dict:
    """Median device time (us) of each phase captured alone and replayed, and of the whole step's graph; the
    whole minus the phases' sum is the graph's launch gaps. For a benchmark after a request: the replays
    run on the last step's buffers and leave the sequence's state meaningless (a new request resets it)."""
    key = ("ddtree", budget, b, steps.plan.mode)
    if key not in steps.graphs:
        raise RuntimeError(f"phase_times: no step graph for budget {budget}, block {b} yet (run a request first)")
    steps.drain()
    out = {}
    graphs = {name: steps.capture(lambda name=name: steps._ddtree_body(budget, b, only=(name,)))
              for name in steps.PHASES}
    graphs["step"] = steps.graphs[key][0]
    for name, graph in graphs.items():
        times = steps.gpu.timed_ms(lambda: steps.gpu.replay(graph), repeats)
        out[name] = 1e3 * float(np.median(times))
    out["gaps"] = out["step"] - sum(out[p] for p in steps.PHASES)
    steps.new_request()
    return out


def record_launches(steps, body) -> list[dict]:
    """Every kernel launch body() makes, recorded while capturing a graph that is never run: its kernel's name,
    the layer function and collective tag it came from, and what it takes to launch it again alone."""
    g, ops, launches = steps.gpu, steps.ops, []
    names = {id(k): key[-1] for key, k in g._kernels.items()}
    launch = g.launch

    def spy(kernel, grid, block, smem, *args, stream=None, pdl=False, cluster=None):
        launches.append({"kernel": names.get(id(kernel), "?"), "fn": ops.key[0] if ops.key else "", "tag": ops.tag,
                         "launch": (kernel, grid, block, smem, args), "cluster": cluster})
        launch(kernel, grid, block, smem, *args, stream=stream, pdl=pdl, cluster=cluster)
    g.launch = spy
    try:
        steps.capture(body)
    finally:
        del g.launch
    return launches


def time_launches(steps, launches: list[dict], repeats: int = 10) -> list[float]:
    """Device us of each launch alone (a graph of `repeats` back-to-back copies, median of 5 replays / repeats).
    Launches with the same kernel, grid, block, shared memory and tag are timed once (the layers repeat them)."""
    g, cache, out = steps.gpu, {}, []
    for rec in launches:
        kernel, grid, block, smem, args = rec["launch"]
        cluster = rec.get("cluster")
        sig = (rec["kernel"], str(grid), str(block), str(cluster), smem, rec["tag"], rec["fn"])
        if sig not in cache:
            graph = g.capture(lambda s: [g.launch(kernel, grid, block, smem, *args, stream=s, cluster=cluster)
                                         for _ in range(repeats)])
            cache[sig] = 1e3 * float(np.median(g.timed_ms(lambda: g.replay(graph), 5))) / repeats
        out.append(cache[sig])
    return out


def kernel_times(steps, repeats: int = 20) -> dict:
    """The AR step's graph against its kernels alone (docs/interfaces.md 8; the launch gaps are the
    difference). A benchmark after a request: the replays run on that request's buffers and leave its state
    meaningless (a new request resets it). -> {"step_us", "kernels_us", "kernels", "gaps_us", "ratio"}"""
    key = ("ar", steps.plan.mode)
    if key not in steps.graphs:
        raise RuntimeError("kernel_times: run an autoregressive request first (no AR step graph yet)")
    steps.drain()
    g = steps.gpu
    launches = record_launches(steps, steps._ar_body)
    total = sum(time_launches(steps, launches))
    step = 1e3 * float(np.median(g.timed_ms(lambda: g.replay(steps.graphs[key][0]), repeats)))
    steps.new_request()
    return {"step_us": step, "kernels_us": total, "kernels": len(launches), "gaps_us": step - total,
            "ratio": step / total if total else 0.0}
