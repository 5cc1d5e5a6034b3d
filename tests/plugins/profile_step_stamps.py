"""Where the step's MoE kernels spend their time, phase by phase, inside the step graph (issue 48, fourteenth session).

`ddtree bench step` runs with the router and MoE kernels compiled with -D DD_STEP_STAMPS (kernels/stamps.cuh: thread 0
of each block notes the global timer at up to six points and appends a record). Before each row's timeline replay
(so pass --timeline), one more replay runs with the stamp rings cleared; its records are summarised per MoE layer, in
us from the router's exit (its last block's end), medians over the layers:
  router, its aligning block (one token block): after its wait, partials written and hand-off won (folded plans),
    routed, aligned (= exit)
  moe_gate_up: blocks' entry (first / last), past the wait, tile pairs read, main loop done, the last split's sums
    done, exit (each first / last over the layer's blocks)
  moe_down_cols: entry, ring issued, past its wait (gate_up done), main loop done, exit
A diagnosis build (a timer read and a record a block): read its phases, not its step time.

One GPU: `PYTHONPATH=. python3 tests/plugins/profile_step_stamps.py OUT.json [bench step options]`, e.g.
`... OUT.json --context 4096 --budget 8 --routing tree --reuse 0.5 --accept 4 --ar --repeats 3`; or the same phases
alone, `... OUT.json moe [bench moe options]` (e.g. `moe --tp 8 --m 1 --no-router --paths cols`: one layer's
experts, each launch's given routing aligned by moe_route, whose exit is then the reference)."""
import json
import sys
import tempfile

import numpy as np

import ddtree.bench.kernels as kernels
import ddtree.bench.step as step
import ddtree.plugins.device as device
from ddtree.cli import main

STAMPED = ("moe.cu", "router.cu")
RING = 1 << 18                                  # stamps.cuh DD_STAMP_RING
RECORD = np.dtype([("tag", "<u4"), ("block", "<u4"), ("t", "<u8", (6,))])
ROUTER, GATE_UP, DOWN, ROUTE = 1, 2, 3, 4        # stamps.cuh tags

_compile = device.compile_cubin
device.compile_cubin = lambda source, arch, defines=None: _compile(
    source, arch, defines={**(defines or {}), **({"DD_STEP_STAMPS": 1} if source in STAMPED else {})})


def stamp_globals(gpu) -> list[tuple[int, int]]:
    """(ring, count) device addresses of every loaded stamped module."""
    return [tuple(gpu.module_global(source, name, dict(defines), arch) for name in ("dd_stamp_ring", "dd_stamp_count"))
            for source, defines, arch in list(gpu._modules) if source in STAMPED]


def records(gpu, mods) -> np.ndarray:
    got = []
    for ring, count in mods:
        n = int(device.DeviceArray(gpu, count, (1,), np.uint32).numpy()[0])
        if n > RING:
            raise RuntimeError(f"{n} stamp records in one replay overflow the ring of {RING}")
        raw = device.DeviceArray(gpu, ring, (n * RECORD.itemsize,), np.uint8).numpy()
        got.append(raw.view(RECORD))
    return np.concatenate(got) if got else np.zeros(0, RECORD)


def median_us(values) -> float | None:
    values = [v for v in values if v is not None]
    return None if not values else round(float(np.median(values)), 2)


def summarise(rec: np.ndarray) -> dict:
    t = rec["t"].astype(np.int64)
    last = (rec["tag"] == ROUTER) & (t[:, 5] > 0)                     # the router's aligning block, a layer each
    if not last.any():                                                # (folded or not: the others leave unstamped)
        last = rec["tag"] == ROUTE                                   # `bench moe`: the given routing's alignment
    exits = np.sort(t[last, 5])
    layer_of = lambda when: np.searchsorted(exits, when, side="right") - 1   # noqa: E731  the latest exit <= when
    router = t[last][np.argsort(t[last, 5])]
    # (name, kernel, timer slot, first or last block), each in us from the layer's router exit
    phases = [("gu_entry_first", GATE_UP, 0, min), ("gu_entry_last", GATE_UP, 0, max),
              ("gu_wait_first", GATE_UP, 1, min), ("gu_wait_last", GATE_UP, 1, max), ("gu_tiles_last", GATE_UP, 2, max),
              ("gu_main_first", GATE_UP, 3, min), ("gu_main_last", GATE_UP, 3, max), ("gu_sum_last", GATE_UP, 4, max),
              ("gu_exit_last", GATE_UP, 5, max), ("dn_entry_first", DOWN, 0, min), ("dn_entry_last", DOWN, 0, max),
              ("dn_issued_last", DOWN, 1, max), ("dn_wait_first", DOWN, 2, min), ("dn_wait_last", DOWN, 2, max),
              ("dn_main_last", DOWN, 3, max), ("dn_exit_last", DOWN, 5, max)]
    router_phases = [("router_wait", 1), ("router_partials", 2), ("router_handoff", 3), ("router_routed", 4)]
    per = {name: [] for name, *_ in router_phases + phases}
    by_tag = {GATE_UP: t[rec["tag"] == GATE_UP], DOWN: t[rec["tag"] == DOWN]}
    layers = {GATE_UP: layer_of(by_tag[GATE_UP][:, 1]), DOWN: layer_of(by_tag[DOWN][:, 2])}   # past their waits
    for i, r in enumerate(router):
        x = r[5]
        for name, k in router_phases:
            per[name].append((r[k] - x) / 1e3 if r[k] else None)
        for name, tag, k, pick in phases:
            v = by_tag[tag][layers[tag] == i][:, k]
            v = v[v > 0]                                              # slots a block never reached stay 0
            per[name].append((pick(v) - x) / 1e3 if len(v) else None)
    gu, dn = by_tag[GATE_UP], by_tag[DOWN]
    mid = len(router) // 2
    return {"layers": len(router), "records": int(len(rec)),
            "blocks_a_layer": {"gate_up": round(len(gu) / max(1, len(router)), 1),
                               "down_cols": round(len(dn) / max(1, len(router)), 1)},
            "median_us_from_router_exit": {k: median_us(v) for k, v in per.items()},
            "middle_layer_us": {k: (None if v[mid] is None else round(v[mid], 2)) for k, v in per.items()}
            if router.size else {}}


rows = []
_trace = step.trace_kernels


def stamped_replay(gpu, replay) -> None:
    """One replay() with every stamp ring cleared first; its records summarised into rows (and said on stderr)."""
    mods = stamp_globals(gpu)
    for _, count in mods:
        gpu.copy_in(device.DeviceArray(gpu, count, (1,), np.uint32), np.zeros(1, np.uint32))
    replay()
    gpu.sync()
    rows.append(summarise(records(gpu, mods)))
    print(json.dumps(rows[-1]["median_us_from_router_exit"]), file=sys.stderr)


def traced(gpu, replay, warmup: int = 3):
    """`bench step --timeline`'s trace of a row, after one stamped replay of the row's graph."""
    for _ in range(warmup):
        replay()
    gpu.sync()
    stamped_replay(gpu, replay)
    return _trace(gpu, replay, warmup)


_time_graph = kernels.time_graph


def timed_graph(gpu, launches, replays: int = 7) -> float:
    """`bench moe`'s timing, then one stamped replay of the same launches captured again."""
    ms = _time_graph(gpu, launches, replays)
    graph = gpu.capture(launches)
    gpu.replay(graph)
    stamped_replay(gpu, lambda: gpu.replay(graph))
    return ms


if __name__ == "__main__":
    out_path, args = sys.argv[1], sys.argv[2:]
    if args[:1] == ["moe"]:                      # `bench moe` (one layer's experts, a given routing each launch)
        kernels.time_graph = timed_graph
        command = ["bench", "moe", *args[1:]]
    else:
        step.trace_kernels = traced
        if "--timeline" not in args:
            args += ["--timeline", tempfile.mkdtemp()]
        command = ["bench", "step", *args]
    try:
        main(command, standalone_mode=False)
    finally:
        with open(out_path, "w") as f:
            json.dump({"command": command, "rows": rows}, f, indent=1)
