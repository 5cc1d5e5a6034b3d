"""Where the step's MoE kernels spend their time, phase by phase, inside the step graph (issue 48, fourteenth session).

`ddtree bench step` runs with the router and MoE kernels compiled with -D DD_STEP_STAMPS (kernels/stamps.cuh: thread 0
of each block notes the global timer at up to six points and appends a record). Before each row's timeline replay
(so pass --timeline), one more replay runs with the stamp rings cleared; its records are summarised per MoE layer, in
us from the router's exit (its last block's end), medians over the layers:
  router, its last block (the folded path): after its wait, partials written, hand-off won, routed, aligned (= exit)
  moe_gate_up: blocks' entry (first / last), past the wait, tile pairs read, main loop done, the last split's sums
    done, exit (each first / last over the layer's blocks)
  moe_down_cols: entry, ring issued, past its wait (gate_up done), main loop done, exit
A diagnosis build (a timer read and a record a block): read its phases, not its step time.

One GPU: `PYTHONPATH=. python3 tests/plugins/profile_step_stamps.py OUT.json [bench step options]`, e.g.
`... OUT.json --context 4096 --budget 8 --routing tree --reuse 0.5 --accept 4 --ar --repeats 3`."""
import json
import sys
import tempfile

import numpy as np

import ddtree.bench.step as step
import ddtree.plugins.device as device
from ddtree.cli import main

STAMPED = ("moe.cu", "router.cu")
RING = 1 << 18                                  # stamps.cuh DD_STAMP_RING
RECORD = np.dtype([("tag", "<u4"), ("block", "<u4"), ("t", "<u8", (6,))])
ROUTER, GATE_UP, DOWN = 1, 2, 3                 # stamps.cuh tags

_compile = device.compile_cubin
device.compile_cubin = lambda source, arch, defines=None: _compile(
    source, arch, defines={**(defines or {}), **({"DD_STEP_STAMPS": 1} if source in STAMPED else {})})


def stamp_globals(gpu) -> list[tuple[int, int]]:
    """(ring, count) device addresses of every loaded stamped module."""
    from cuda.bindings import driver
    out = []
    for key, code in gpu._modules.items():
        if key[0] not in STAMPED:
            continue
        handle = code.handle
        getter = driver.cuLibraryGetGlobal if isinstance(handle, driver.CUlibrary) else driver.cuModuleGetGlobal
        ring = int(device.check(getter(handle, b"dd_stamp_ring"), "get dd_stamp_ring")[0])
        count = int(device.check(getter(handle, b"dd_stamp_count"), "get dd_stamp_count")[0])
        out.append((ring, count))
    return out


def records(gpu, mods) -> np.ndarray:
    got = []
    for ring, count in mods:
        n = int(device.DeviceArray(gpu, count, (1,), np.uint32).numpy()[0])
        if n > RING:
            raise RuntimeError(f"{n} stamp records in one replay overflow the ring of {RING}")
        raw = device.DeviceArray(gpu, ring, (n * RECORD.itemsize,), np.uint8).numpy()
        got.append(raw.view(RECORD))
    return np.concatenate(got) if got else np.zeros(0, RECORD)


def ms(values) -> float | None:
    return None if len(values) == 0 else round(float(np.median(values)), 2)


def summarise(rec: np.ndarray) -> dict:
    t = rec["t"].astype(np.int64)
    last = (rec["tag"] == ROUTER) & (t[:, 3] > 0)                     # the router's hand-off winner, a layer each
    exits = np.sort(t[last, 5])
    layer_of = lambda when: np.searchsorted(exits, when, side="right") - 1   # noqa: E731  the latest exit <= when
    router = t[last][np.argsort(t[last, 5])]
    per = {name: [] for name in ("router_wait", "router_partials", "router_handoff", "router_routed",
                                 "gu_entry_first", "gu_entry_last", "gu_wait_first", "gu_wait_last", "gu_tiles_last",
                                 "gu_main_first", "gu_main_last", "gu_sum_last", "gu_exit_last",
                                 "dn_entry_first", "dn_entry_last", "dn_issued_last", "dn_wait_first", "dn_wait_last",
                                 "dn_main_last", "dn_exit_last")}
    gu, dn = t[rec["tag"] == GATE_UP], t[rec["tag"] == DOWN]
    gu_layer, dn_layer = layer_of(gu[:, 1]), layer_of(dn[:, 2])
    for i, r in enumerate(router):
        x = r[5]
        for name, k in (("router_wait", 1), ("router_partials", 2), ("router_handoff", 3), ("router_routed", 4)):
            per[name].append((r[k] - x) / 1e3)
        g = gu[gu_layer == i]
        d = dn[dn_layer == i]
        if len(g):
            per["gu_entry_first"].append((g[:, 0].min() - x) / 1e3)
            per["gu_entry_last"].append((g[:, 0].max() - x) / 1e3)
            per["gu_wait_first"].append((g[:, 1].min() - x) / 1e3)
            per["gu_wait_last"].append((g[:, 1].max() - x) / 1e3)
            per["gu_tiles_last"].append((g[:, 2].max() - x) / 1e3)
            per["gu_main_first"].append((g[:, 3].min() - x) / 1e3)
            per["gu_main_last"].append((g[:, 3].max() - x) / 1e3)
            s = g[g[:, 4] > 0]
            if len(s):
                per["gu_sum_last"].append((s[:, 4].max() - x) / 1e3)
            per["gu_exit_last"].append((g[:, 5].max() - x) / 1e3)
        if len(d):
            per["dn_entry_first"].append((d[:, 0].min() - x) / 1e3)
            per["dn_entry_last"].append((d[:, 0].max() - x) / 1e3)
            per["dn_issued_last"].append((d[:, 1].max() - x) / 1e3)
            per["dn_wait_first"].append((d[:, 2].min() - x) / 1e3)
            per["dn_wait_last"].append((d[:, 2].max() - x) / 1e3)
            per["dn_main_last"].append((d[:, 3].max() - x) / 1e3)
            per["dn_exit_last"].append((d[:, 5].max() - x) / 1e3)
    mid = len(router) // 2
    return {"layers": len(router), "records": int(len(rec)),
            "blocks_a_layer": {"gate_up": round(len(gu) / max(1, len(router)), 1),
                               "down_cols": round(len(dn) / max(1, len(router)), 1)},
            "median_us_from_router_exit": {k: ms(v) for k, v in per.items()},
            "middle_layer_us": {k: (round(v[mid], 2) if mid < len(v) else None) for k, v in per.items()}}


rows = []
_trace = step.trace_kernels


def traced(gpu, replay, warmup: int = 3):
    for _ in range(warmup):
        replay()
    gpu.sync()
    mods = stamp_globals(gpu)
    for _, count in mods:
        gpu.copy_in(device.DeviceArray(gpu, count, (1,), np.uint32), np.zeros(1, np.uint32))
    replay()
    gpu.sync()
    rows.append(summarise(records(gpu, mods)))
    print(json.dumps(rows[-1]["median_us_from_router_exit"]), file=sys.stderr)
    return _trace(gpu, replay, warmup)


if __name__ == "__main__":
    step.trace_kernels = traced
    out_path, args = sys.argv[1], sys.argv[2:]
    if "--timeline" not in args:
        args += ["--timeline", tempfile.mkdtemp()]
    try:
        main(["bench", "step", *args], standalone_mode=False)
    finally:
        with open(out_path, "w") as f:
            json.dump({"args": args, "rows": rows}, f, indent=1)
