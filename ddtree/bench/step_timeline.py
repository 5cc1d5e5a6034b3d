"""Where a step's wall time goes when its kernels overlap (`ddtree bench step --timeline DIR`): one graph replay
traced by CUPTI (torch.profiler's CUDA activity: every kernel node of the replayed graph with its device start and
end), summarised without a model of the schedule:

- a kernel's *exposed* time is how far it pushes the latest end seen so far, in start order: the wall time the step
  spends with this kernel as the last one running (the parallel branches' kernels that finish early expose nothing);
- *idle* is the time between that latest end and the next kernel's start: no kernel running at all (launch
  latency the PDL overlap did not hide);
- per kernel family (name, grid, block: top_kernels' key without the layer function, which CUPTI does not know)
  the launches, their own time and their exposed time, largest exposed first.

The per-launch split (step_parts.py) times each kernel alone, in a graph of back-to-back copies of itself; this is
the same kernels in the step, beside and behind each other. torch is imported here only (the device has it)."""
from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path


def trace_kernels(gpu, replay, warmup: int = 3) -> list[dict]:
    """The kernels of one replay() as [{name, grid, block, start_us, end_us}] sorted by start (us from the first)."""
    from torch.profiler import ProfilerActivity, profile  # torch: on the GPU machine only, not a dependency
    for _ in range(warmup):
        replay()
    gpu.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        gpu.sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise RuntimeError("bench step --timeline: the CUPTI trace of the replay holds no kernel (is the profiler "
                           "able to see CUDA graph kernel nodes on this driver?)")
    t0 = min(float(e["ts"]) for e in kernels)
    out = [{"name": e["name"], "grid": list(e.get("args", {}).get("grid", [])),
            "block": list(e.get("args", {}).get("block", [])), "start_us": float(e["ts"]) - t0,
            "end_us": float(e["ts"]) + float(e["dur"]) - t0} for e in kernels]
    return sorted(out, key=lambda k: (k["start_us"], k["end_us"]))


def exposed_times(kernels: list[dict]) -> tuple[list[float], list[float]]:
    """Per kernel (in start order): its exposed time, and the idle time before it (see the module docstring)."""
    exposed, idle = [], []
    latest = kernels[0]["start_us"] if kernels else 0.0
    for k in kernels:
        idle.append(max(0.0, k["start_us"] - latest))
        exposed.append(max(0.0, k["end_us"] - max(latest, k["start_us"])))
        latest = max(latest, k["end_us"])
    return exposed, idle


def summarise(kernels: list[dict], top: int = 30) -> dict:
    """The replay's wall time, the kernels' own and exposed sums, the idle sum, and the families by exposed time."""
    exposed, idle = exposed_times(kernels)
    fam = defaultdict(lambda: {"launches": 0, "us_total": 0.0, "exposed_us": 0.0, "idle_before_us": 0.0})
    for k, e, i in zip(kernels, exposed, idle):
        f = fam[(k["name"], tuple(k["grid"]), tuple(k["block"]))]
        f["launches"] += 1
        f["us_total"] += k["end_us"] - k["start_us"]
        f["exposed_us"] += e
        f["idle_before_us"] += i
    families = [{"kernel": n, "grid": list(g), "block": list(b), **v} for (n, g, b), v in fam.items()]
    families.sort(key=lambda f: -f["exposed_us"])
    wall = max(k["end_us"] for k in kernels)
    return {"wall_us": wall, "kernels": len(kernels), "kernel_us": sum(k["end_us"] - k["start_us"] for k in kernels),
            "exposed_us": sum(exposed), "idle_us": sum(idle), "families": families[:top]}


def write_timeline(directory: str, row_name: str, kernels: list[dict]) -> str:
    """Every kernel of the replay (start order, with its exposed and idle times) as DIR/row_name.json."""
    exposed, idle = exposed_times(kernels)
    path = Path(directory) / f"{row_name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{**k, "exposed_us": e, "idle_before_us": i}
                                for k, e, i in zip(kernels, exposed, idle)]))
    return str(path)
