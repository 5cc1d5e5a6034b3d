"""The projection corrected by a measured step (`ddtree bench project --measured-step FILE`).

`ddtree bench step` measures rank 0's whole step on an H200 or an H100 (collectives as stand-ins). The projection
prices the same step op by op from the meter's counts. Priced on the measuring device itself (the same kernel
classes, no collectives; MEASURING_DEVICES, by the file's device name), the model and the measurement differ by a
factor f = measured / modelled, the costs the per-op model does not see (launch gaps, small kernels, planning). The
corrected projection assumes the PRO 6000 pays the same factor on its compute side and none on its collectives:

    step_corrected = (step_projected - collectives) * f + collectives

an assumption, stated as a field of every corrected row, not a measurement of the PRO 6000.

A file measured with `bench step --prune` (issue 53) also has each DDTree row pruned inside its verify: the
corrected row then gets `pruned`, the corrected step divided by the measured speedup, at the same accepted length
(both assumptions fields of it: the bench forced the accepted length, so the pruned tree's own acceptance is not in
the file).
"""
from __future__ import annotations

import json

import click

from ddtree.bench.projection import H100, H200, AllReduceModel, Device, Projection

NO_COLLECTIVES = (AllReduceModel("excluded", 0.0, float("inf"), "the measured step's stand-ins are left out"),)
# the cards a measured step may come from, by a word of the file's device name (the kernel classes' fixed costs
# and efficiencies were fitted on H200 rows; an H100 step is priced with them at the H100's copy ceiling)
MEASURING_DEVICES = {"H200": H200, "H100": H100}


def measuring_device(name: str, path) -> Device:
    for word, dev in MEASURING_DEVICES.items():
        if word in name:
            return dev
    raise click.BadParameter(f"{path}: measured on {name!r}; the correction prices the step on one of "
                             f"{sorted(MEASURING_DEVICES)} (the device name must contain one)",
                             param_hint="--measured-step")


def load_measured_step(path) -> dict:
    """{(context, budget, routing, reuse): measured row} of a `ddtree bench step --json` file; a measured
    'router' row (the router's own near-uniform choice) serves the projection's 'uniform'; the autoregressive
    rows (`--ar`) have no DDTree step to correct and are left out. A pruned row (`--prune`) goes to its unpruned
    row's "pruned": {speedup, pruned_nodes, distinct_experts_before / _after, rate}; of several pruned rows of one
    key (`--prune-rate calibrated`: the measured-rate row, then the calibrated one) the last, the calibrated."""
    try:
        obj = json.loads(open(path).read())
        rows = obj["rows"]
        out, pruned = {}, {}
        for r in rows:
            if r.get("mode") == "ar":
                continue
            routing = "uniform" if r["routing"].startswith("router") else r["routing"]
            key = (int(r["context"]), int(r["budget"]), routing, r.get("reuse"))
            if r.get("prune") == "auto":          # a later pruned row of the key replaces an earlier one
                p = r["pruned"]
                pruned[key] = {k: float(p[k]) for k in ("speedup", "pruned_nodes", "distinct_experts_before",
                                                        "distinct_experts_after", "rate")}
                continue
            out[key] = {"step_us": float(r["step_us"]),
                        "standin_us": float(r["split_us"].get("allreduce_standin", 0.0)),
                        "device": obj.get("device", "?"), "priced_on": measuring_device(obj.get("device", "?"), path)}
        for key, p in pruned.items():
            if key in out:
                out[key]["pruned"] = p
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise click.BadParameter(f"{path}: not a `ddtree bench step --json` file ({e})", param_hint="--measured-step")


def correction(measured: dict, classes: dict, tp: int, recs, row: dict, source: str) -> dict | None:
    """The measured_correction field of one projection row (None when the file has no matching row)."""
    m = measured.get((row["context"], row["budget"], row["routing"], row["reuse"]))
    if m is None:
        return None
    dev = m["priced_on"]
    modelled = Projection(dev, classes, NO_COLLECTIVES, tp).step(recs)["step_us"]
    measured_us = m["step_us"] - m["standin_us"]
    f = measured_us / modelled
    p = row["projection"]
    coll_us = 1e3 * p["split_ms"]["allreduce"]
    step_us = (1e3 * p["step_ms"] - coll_us) * f + coll_us
    out = {"source": source, "device": m["device"], "priced_on": dev.name, "measured_us": measured_us,
           "model_us": modelled, "factor": f, "step_ms": step_us / 1e3,
           "tokens_per_s": p["accept_len"] / (step_us * 1e-6),
           "assumption": f"the PRO 6000's compute side pays the {dev.name}'s measured/modelled factor (its model: the "
                         f"kernel classes fitted on H200 rows at the {dev.name}'s {dev.bandwidth_tbps} TB/s); "
                         "collectives as modelled"}
    if "pruned" in m:
        q = m["pruned"]
        pruned_us = step_us / q["speedup"]
        out["pruned"] = {**q, "step_ms": pruned_us / 1e3, "accept_len": p["accept_len"],
                         "tokens_per_s": p["accept_len"] / (pruned_us * 1e-6),
                         "assumption": "the pruned step is the corrected step / the speedup measured on the card "
                                       "(collectives included); its accepted length is the unpruned one's (the bench "
                                       "forced it: pruning's own acceptance loss is not measured here)"}
    return out
