"""Ranks side by side in one process: a layer function's values as one entry per rank held here.

    run = per_rank_run(call, held)        # call(kind, fn, args, [feeds of rank r], layer) -> [outs of rank r]
    outs = run("embed", layers.embed, (cfg,), {"ids": ids})     # {"h": PerRank([h_0, h_1, ..])}

This is description/stack.py's `run` for the CPU executors whose ranks are threads (the numpy ranks of
engine_executor.py, the ONNX graphs of graph_ranks.py): a feed that is a PerRank gives each rank its own entry,
any other value is every rank's.
"""
from __future__ import annotations


class PerRank(list):
    """One value per rank held here, in rank order."""


def rank_feeds(feeds: dict, held: int) -> list[dict]:
    return [{k: v[r] if isinstance(v, PerRank) else v for k, v in feeds.items()} for r in range(held)]


def per_rank_run(call, held: int):
    def run(kind: str, fn, args: tuple, feeds: dict, layer: int | None = None) -> dict:
        outs = call(kind, fn, args, rank_feeds(feeds, held), layer)
        return {name: PerRank(o[name] for o in outs) for name in outs[0]} if outs and outs[0] else {}
    return run
