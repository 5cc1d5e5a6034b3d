"""The projection corrected by a measured step (`ddtree bench project --measured-step FILE`).

`ddtree bench step` measures rank 0's whole step on an H200 (collectives as stand-ins). The projection prices
the same step op by op from the meter's counts. Priced on the H200 itself (the same kernel classes, no
collectives), the model and the measurement differ by a factor f = measured / modelled, the costs the
per-op model does not see (launch gaps, small kernels, planning). The corrected projection assumes the PRO 6000
pays the same factor on its compute side and none on its collectives:

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

from ddtree.bench.projection import H200, AllReduceModel, Projection

NO_COLLECTIVES = (AllReduceModel("excluded", 0.0, float("inf"), "the measured step's stand-ins are left out"),)


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
                        "device": obj.get("device", "?")}
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
    modelled = Projection(H200, classes, NO_COLLECTIVES, tp).step(recs)["step_us"]
    measured_us = m["step_us"] - m["standin_us"]
    f = measured_us / modelled
    p = row["projection"]
    coll_us = 1e3 * p["split_ms"]["allreduce"]
    step_us = (1e3 * p["step_ms"] - coll_us) * f + coll_us
    out = {"source": source, "device": m["device"], "h200_measured_us": measured_us, "h200_model_us": modelled,
           "factor": f, "step_ms": step_us / 1e3, "tokens_per_s": p["accept_len"] / (step_us * 1e-6),
           "assumption": "the PRO 6000's compute side pays the H200's measured/modelled factor; collectives as "
                         "modelled"}
    if "pruned" in m:
        q = m["pruned"]
        pruned_us = step_us / q["speedup"]
        out["pruned"] = {**q, "step_ms": pruned_us / 1e3, "accept_len": p["accept_len"],
                         "tokens_per_s": p["accept_len"] / (pruned_us * 1e-6),
                         "assumption": "the pruned step is the corrected step / the speedup measured on the H200 "
                                       "(collectives included); its accepted length is the unpruned one's (the bench "
                                       "forced it: pruning's own acceptance loss is not measured here)"}
    return out
