"""`ddtree bench step --collectives copy,pcie`: which stand-ins carry rank r's collectives, and how much of the
PCIe model's collective time the step hides.

    use_collectives(rank, steps, "pcie", "auto")     # rank.ops' collectives priced by the PCIe model; graphs anew
    rows[i]["collectives_modelled_us"] = modelled_us(rank.ops.collective, records, tp)
    hidden_rows(rows)                                 # per row measured under both: the fraction hidden

copy: each collective moves its bytes once on this GPU (bench_ops.StandinCollective), a few us; pcie: the same
bytes, then a one-shot's blocks held for the modelled time of 8x RTX PRO 6000 over PCIe (bench_ops.PcieCollective).
A row's hidden fraction = 1 - (step under pcie - step under copy) / the modelled time of the step's collectives:
1 when the step absorbs every modelled microsecond beside other work, 0 when it waits for each one whole (the copy
stand-ins' own few us count as neither).
"""
from __future__ import annotations

from ddtree.bench.bench_ops import PcieCollective, StandinCollective
from ddtree.bench.projection import message_bytes

MODES = ("copy", "pcie")


def use_collectives(rank, steps, mode: str, allreduce: str = "auto") -> None:
    ops, tp = rank.ops, rank.lay.tp
    if tp == 1:
        raise ValueError("--collectives: a tp 1 rank has no collectives to stand in for")
    ops.collective = StandinCollective(ops, tp) if mode == "copy" else PcieCollective(ops, tp, allreduce)
    steps.graphs.clear()                         # captured anew with these collectives inside


def modelled_us(collective, records, tp: int) -> float | None:
    """The PCIe model's time of every collective the meter counts in one step (None under copy stand-ins)."""
    if not isinstance(collective, PcieCollective):
        return None
    return sum(collective.modelled_us(message_bytes(r, tp), r.collective) for r in records if r.collective)


def hidden_rows(rows: list[dict]) -> list[dict]:
    """For every row measured under both copy and pcie: the steps, the modelled time and the fraction hidden."""
    def key(r):
        return r["context"], r["budget"], r["routing"], r["reuse"], r.get("prune")
    copy = {key(r): r for r in rows if r["collectives"] == "copy"}
    out = []
    for r in rows:
        c = copy.get(key(r))
        if r["collectives"] != "pcie" or c is None:
            continue
        grown, modelled = r["step_us"] - c["step_us"], r["collectives_modelled_us"]
        out.append({"context": r["context"], "budget": r["budget"], "routing": r["routing"], "reuse": r["reuse"],
                    **({"prune": r["prune"]} if "prune" in r else {}),
                    "step_copy_us": c["step_us"], "step_pcie_us": r["step_us"], "modelled_us": modelled,
                    "grown_us": grown, "hidden_fraction": 1.0 - grown / modelled})
    return out
