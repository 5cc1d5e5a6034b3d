"""What one all-reduce costs on the product's PCIe box (8x RTX PRO 6000, no NVLink), per implementation, and the
choice among them by message size (issue 49). One model serves every user: `bench project` prices a step's
collectives with it, `bench step --collectives pcie` holds its stand-ins for it, and a rank process's
RankCollective (parallel/rank_collective.py) picks its implementation per message with it.

    us = model.us(nbytes, tp)                       # latency_us + nbytes (tp - 1) / tp / bandwidth
    choose_protocol(nbytes, tp, (ONE_SHOT, TWO_SHOT, NCCL))   # "one-shot", "two-shot" or "nccl": the cheapest
    choose_protocol(nbytes, tp, models_for("all_gather", models))   # an all-gather: never the two-shot

choose_protocol is a pure function of the message size, tp and the models: every rank, given the same sizes,
takes the same implementation for the same call (the one-shot buffer's device counter relies on that).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AllReduceModel:
    name: str                        # the implementation: "one-shot", "two-shot" or "nccl"
    latency_us: float
    bandwidth_gbps: float            # bytes (tp - 1) / tp move at this rate
    source: str
    measured: bool = True            # False: derived from another model, not fitted to timings of this one

    def us(self, nbytes: float, tp: int) -> float:
        return self.latency_us + nbytes * (tp - 1) / tp / (self.bandwidth_gbps * 1e3)


# All-reduce over PCIe, 8x RTX PRO 6000 (docs/hardware-and-kernels.md section 4.2), fit_line of
# us against bytes (tp - 1) / tp over the rows named in each source.
ONE_SHOT = AllReduceModel("one-shot", 7.96, 3.48,
                          "fit of the custom one-shot on 8x PRO 6000 behind PCIe switches (rtx6kpro hardware/"
                          "pcie-bandwidth): 256 B 7.5, 8 KB 9.2, 32 KB 16.5, 64 KB 25.9, 256 KB 73.6 us")
NCCL = AllReduceModel("nccl", 30.84, 20.37, "fit of NCCL on 8x PRO 6000: rtx6kpro 256 B 24.1, 8 KB 24.6, 32 KB 24.5, "
                      "64 KB 24.1, 256 KB 28.0 us; b12x probe 384 KB 75, 1.5 MB 123, 6 MB 294 us")


def two_shot_from(one_shot: AllReduceModel, nranks: int = 8) -> AllReduceModel:
    """The two-shot's model derived from the one-shot's fit at nranks ranks (no two-shot timing on PCIe exists).
    A one-shot rank pushes its whole message to N - 1 peers, (N - 1) x bytes over its link, in one flag round; a
    two-shot rank pushes N - 1 chunks of bytes / N twice (reduce-scatter, then all-gather): 2 (N - 1) / N x bytes,
    in two flag rounds. Over the same link the byte term shrinks by 2 / N, so the formula's bandwidth is the
    one-shot's x N / 2, and the latency (one flag round trip and a launch) is paid twice: 2 x the one-shot's."""
    return AllReduceModel(
        "two-shot", 2.0 * one_shot.latency_us, one_shot.bandwidth_gbps * nranks / 2.0,
        f"DERIVED from the one-shot fit at N = {nranks}, not measured: one-shot pushes (N - 1) x bytes per rank in "
        f"one flag round, two-shot 2 (N - 1) / N x bytes in two, so latency 2 x {one_shot.latency_us} us and "
        f"bandwidth {one_shot.bandwidth_gbps} x N / 2 GB/s (valid at tp {nranks})", measured=False)


TWO_SHOT = two_shot_from(ONE_SHOT, 8)
# --allreduce of bench project / bench step: the models a collective is priced by (the cheapest per message)
MODEL_CHOICES = {"auto": (ONE_SHOT, TWO_SHOT, NCCL), "one-shot": (ONE_SHOT,), "two-shot": (TWO_SHOT,),
                 "nccl": (NCCL,)}


GATHERS = ("one-shot", "nccl")      # implementations with an all-gather (the two-shot is an all-reduce protocol)


def models_for(op: str, models) -> tuple:
    """The models a collective `op` ("all_reduce" or "all_gather") chooses among: an all-reduce, all of them; an
    all-gather, those of implementations that gather, or ONE_SHOT where none is (--allreduce two-shot: its
    all-gathers go through the one-shot's)."""
    if op != "all_gather":
        return tuple(models)
    return tuple(m for m in models if m.name in GATHERS) or (ONE_SHOT,)


def chosen_model(nbytes: float, tp: int, models) -> AllReduceModel:
    """The cheapest of `models` for one collective of nbytes among tp ranks; a tie goes to the earlier model."""
    if not models:
        raise ValueError("choose_protocol: no all-reduce model to choose from")
    return min(models, key=lambda m: m.us(nbytes, tp))


def choose_protocol(nbytes: float, tp: int, models) -> str:
    """The name of the implementation that carries a collective of nbytes among tp ranks: the cheapest model's."""
    return chosen_model(nbytes, tp, models).name
