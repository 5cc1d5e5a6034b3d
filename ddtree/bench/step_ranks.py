"""`ddtree bench step --ranks all`: every rank of the tp plan at once, one process per GPU, with the real collectives
(docs/interfaces.md section 10; issue 29's rank-parallel step).

    ddtree bench step --tp 8 --ranks all --gpu 0,1,2,3,4,5,6,7 --context 4096 --budget 16 --routing uniform --json

Each rank process generates its own rank's weights on its GPU (bench/synthetic_rank.py) and runs the step graph of
`ddtree bench step` (the stated tree, the forced accepted path, the given routing) twice per row:
  - single-rank: the collectives as stand-ins moving their bytes once on its GPU (the `--ranks one` figure, on
    every rank at once);
  - with the collectives: the layers' all-reduces through the one-shot all-reduce over CUDA IPC
    (plugins/allreduce.py), connected between the rank processes; every rank replays the same graph, so the
    collectives pair up.
Per row: each rank's median step (us) both ways, the skew (slowest rank's median - fastest's) and the collectives'
cost on rank 0 (with - single-rank). Compute-side agreement: the ranks' single-rank medians side by side.
Sampling stays each rank's own vocab slice, as in `--ranks one` (the vocab-parallel all-gathers of the winners and
candidates, a few KB a step, are not in this graph). No per-kernel split here: timing one collective alone needs
every rank to time it at once. Ranks may share a GPU (a rehearsal on one GPU: the numbers are then time-sliced).
"""
from __future__ import annotations

import statistics

from ddtree.bench.step_rows import prepare_row, row_cases, synthetic_steps
from ddtree.bench.synthetic_rank import SyntheticWeights
from ddtree.builder.plan import make_plan
from ddtree.model.presets import get_preset
from ddtree.parallel.cuda_collectives import ProcessRankMember
from ddtree.parallel.spawn_ranks import run_ranks
from ddtree.plugins.allreduce import OneShotAllReduce
from ddtree.plugins.device import Gpu
from ddtree.runtime.cuda_ranks import all_reduce_elems


def rank_steps(link, gpu_id: int, preset: str, layers: int | None, tp: int, contexts: list[int], budgets: list[int],
               cases: list, accept: int, repeats: int, with_ar: bool) -> dict:
    """One rank process: its rows, single-rank then with the collectives (the same row order on every rank)."""
    cfg, dcfg = get_preset(preset, layers)
    plan = make_plan(cfg, dcfg, tp)
    gpu = Gpu(gpu_id)
    rank, steps, _ = synthetic_steps(gpu, cfg, dcfg, plan, link.rank, contexts, budgets, repeats, accept)
    rows = row_cases(contexts, budgets, cases, with_ar)

    def medians(real: bool) -> list[float]:
        out, filled = [], None
        for context, budget, routing, reuse in rows:
            if context != filled:
                rank.fill_caches(context)
                filled = context
            key, _, _ = prepare_row(rank, steps, context, budget, repeats, routing, reuse, accept)
            steps.state.set(start=context, bonus=1)
            if real:
                link.all_exchange("row")                  # the ranks start each row's replays together
            out.append(1e3 * statistics.median(gpu.timed_ms(lambda: steps._replay(key), repeats)))
            steps.forced_accept = steps.stated_draft = None
        return out

    single = medians(real=False)
    one_shot = OneShotAllReduce(gpu, link.rank, tp, all_reduce_elems(cfg, dcfg))
    one_shot.connect(link.all_exchange(one_shot.ipc_handle()))
    rank.ops.collective = ProcessRankMember(one_shot=one_shot)
    steps.graphs.clear()                                  # recaptured with the collectives inside
    real = medians(real=True)
    gpu.sync()
    errors = one_shot.error_ranks()
    link.all_exchange("done")                             # no rank unmaps a buffer a peer still reads
    one_shot.close()
    return {"rank": link.rank, "gpu": gpu.name, "gpu_id": gpu_id, "rows": rows, "single_us": single,
            "with_collectives_us": real, "one_shot_errors": errors,
            "weights_gib": SyntheticWeights.plan_bytes(rank.specs) / 2**30}


def summarize(infos: list[dict]) -> list[dict]:
    """The ranks' results -> one row per (context, budget, routing, reuse): per-rank medians, skew, collective cost."""
    out = []
    for i, (context, budget, routing, reuse) in enumerate(infos[0]["rows"]):
        single = [info["single_us"][i] for info in infos]
        real = [info["with_collectives_us"][i] for info in infos]
        out.append({"context": context, "mode": "ar" if budget is None else "ddtree", "budget": budget,
                    "routing": routing, "reuse": reuse,
                    "single_rank_us": [round(t, 1) for t in single],
                    "with_collectives_us": [round(t, 1) for t in real],
                    "skew_us": round(max(real) - min(real), 1),
                    "single_rank_spread_us": round(max(single) - min(single), 1),
                    "collectives_us_rank0": round(real[0] - single[0], 1),
                    "step_us": round(max(real), 1)})
    return out


def run_all_ranks(gpus: list[int], preset: str, layers: int | None, tp: int, contexts, budgets, cases, accept: int,
                  repeats: int, with_ar: bool, timeout_s: float = 3600.0) -> dict:
    """Every rank of the tp plan as a process on gpus[rank] -> the bench's JSON object."""
    infos = run_ranks(rank_steps, gpus, args=(preset, layers, tp, contexts, budgets, cases, accept, repeats, with_ar),
                      timeout_s=timeout_s)
    errors = sorted({r for info in infos for r in info["one_shot_errors"]})
    return {"bench": "step", "ranks": "all", "preset": preset, "tp": tp, "gpus": gpus,
            "devices": [info["gpu"] for info in infos], "accept": accept, "repeats": repeats,
            "weights_gib_per_rank": [round(info["weights_gib"], 2) for info in infos],
            "one_shot_errors": errors, "rows": summarize(infos),
            "notes": {"single_rank_us": "each rank's step with stand-in collectives (the --ranks one figure), all "
                                        "ranks running at once",
                      "with_collectives_us": "each rank's step with the one-shot all-reduces inside; step_us = the "
                                             "slowest rank's",
                      "skew_us": "slowest - fastest rank with the collectives",
                      "collectives_us_rank0": "rank 0: with - single-rank",
                      "sampling": "each rank samples its own vocab slice (as --ranks one); the vocab all-gathers are "
                                  "not in this graph",
                      "shared_gpus": "ranks sharing a GPU are time-sliced: a rehearsal, not a measurement"
                      if len(set(gpus)) < len(gpus) else None}}
