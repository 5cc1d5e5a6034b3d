"""Routed experts into the engine: read from the checkpoint, sliced per the TP plan, repacked into
the MoE kernel layout (plugins/layout.py), written into each rank's stacked expert tensors.

The TP slice of an INT4 expert is cut in the compressed-tensors packed format: gate/up keep rows
[r I_r, (r+1) I_r); down keeps input columns, i.e. I_r/8 words and I_r/32 scales of every row.
With experts="ep" an expert goes whole to the rank that owns it. Each expert is read once for all
ranks. Repacking is numpy work (~0.6 s per real-size expert for 8 ranks, ~4 h for all of Kimi K2.6
on one core), so `jobs` > 1 runs it in worker processes: each opens the checkpoint itself and
returns the packed arrays; the parent writes them in expert order and keeps at most jobs + 1
experts in flight, so memory stays bounded (per process) as with one job.
"""
from __future__ import annotations

import functools
from collections import deque
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from ddtree.builder.plan import TPPlan
from ddtree.builder.tensor_io import RankFileWriter, TensorReader
from ddtree.model.checkpoint import Checkpoint
from ddtree.model.safetensors_io import CheckpointError
from ddtree.model.tensors import EXPERT_PROJS, TensorSpec, expert_name
from ddtree.plugins import layout

EXPERT_TENSORS = {"gate_up": "gate_up.words", "gate_up_scale": "gate_up.scales",   # layout key -> name suffix
                  "down": "down.words", "down_scale": "down.scales"}


@functools.lru_cache(maxsize=None)
def expert_layout(hidden: int, inter: int) -> dict[str, TensorSpec]:
    """Layout key -> TensorSpec of one expert [I_r, H] in the kernel layout, found by repacking a
    zero expert (so the shapes follow plugins/layout.py, whatever its tiling)."""
    def zero(n, k):
        return np.zeros((n, k // 8), np.int32), np.zeros((n, k // layout.GROUP), np.uint16), np.array([n, k])
    packed = layout.repack_expert(zero(inter, hidden), zero(inter, hidden), zero(hidden, inter), name="layout probe")
    kinds = {np.dtype(np.int32): "I32", np.dtype(np.uint16): "BF16"}
    return {key: TensorSpec(kinds[a.dtype], a.shape) for key, a in packed.items()}


def expert_specs(plan: TPPlan, layer: int) -> dict[str, TensorSpec]:
    """The four stacked expert tensors of one layer: [E_r, *one expert's layout shape]."""
    one = expert_layout(plan.cfg.hidden_size, plan.moe_inter)
    p = f"model.layers.{layer}.mlp.experts."
    return {p + suffix: TensorSpec(one[key].dtype, (plan.experts_per_rank, *one[key].shape))
            for key, suffix in EXPERT_TENSORS.items()}


def read_expert(reader: TensorReader, layer: int, e: int, H: int, I: int) -> dict[str, tuple]:
    """{'gate'|'up'|'down': (weight_packed, weight_scale, weight_shape)} of one checkpoint expert."""
    out = {}
    for proj in EXPERT_PROJS:
        m = expert_name(layer, e, proj)
        shape = reader.read(f"{m}.weight_shape").astype(np.int64).reshape(-1)
        want = [H, I] if proj == "down_proj" else [I, H]
        if shape.tolist() != want:
            raise CheckpointError(f"{reader.ckpt.shard_of(m + '.weight_shape')}: tensor '{m}.weight_shape' is "
                                  f"{shape.tolist()}, the config expects {want}")
        out[proj.split("_")[0]] = (reader.read(f"{m}.weight_packed"), reader.read(f"{m}.weight_scale"), shape)
    return out


def tp_slice_expert(expert: dict[str, tuple], rank: int, inter: int, group: int = 32) -> tuple:
    """Rank `rank`'s (gate, up, down) triples: gate/up rows and down input columns [rank I_r, (rank+1) I_r),
    cut in the packed format (8 values per int32 word, one scale per `group` columns)."""
    rows = slice(rank * inter, (rank + 1) * inter)
    words = slice(rank * inter // 8, (rank + 1) * inter // 8)
    groups = slice(rank * inter // group, (rank + 1) * inter // group)
    gate, up, down = (expert[k] for k in ("gate", "up", "down"))
    H = int(down[2][0])
    return ((gate[0][rows], gate[1][rows], np.array([inter, H])),
            (up[0][rows], up[1][rows], np.array([inter, H])),
            (down[0][:, words], down[1][:, groups], np.array([H, inter])))


def repack_for_ranks(reader: TensorReader, plan: TPPlan, layer: int, e: int) -> tuple[list, int]:
    """One checkpoint expert -> ([(rank, row in the rank's stack, {layout key: array})], bytes read)."""
    cfg = plan.cfg
    expert = read_expert(reader, layer, e, cfg.hidden_size, cfg.moe_intermediate_size)
    if plan.experts == "tp":
        targets = [(r, e, tp_slice_expert(expert, r, plan.moe_inter)) for r in range(plan.tp)]
    else:
        r = e // plan.experts_per_rank
        targets = [(r, e - r * plan.experts_per_rank, (expert["gate"], expert["up"], expert["down"]))]
    name = f"model.layers.{layer}.mlp.experts.{e}"
    packed = [(r, row, layout.repack_expert(g, u, d, name=f"{name} (rank {r})")) for r, row, (g, u, d) in targets]
    return packed, sum(a.nbytes for t in expert.values() for a in t)


# worker processes: each holds its own reader over the checkpoint
_worker: dict = {}


def _worker_init(model_dir: str) -> None:
    _worker["reader"] = TensorReader(Checkpoint(model_dir))


def _worker_repack(args: tuple) -> tuple[list, int]:
    plan, layer, e = args
    return repack_for_ranks(_worker["reader"], plan, layer, e)


class ExpertRepacker:
    """Repacks a layer's experts in this process (jobs = 1) or in `jobs` worker processes."""

    def __init__(self, plan: TPPlan, ckpt, reader: TensorReader, jobs: int = 1):
        if jobs < 1:
            raise ValueError(f"--jobs {jobs}: must be >= 1")
        self.plan, self.reader, self.jobs = plan, reader, jobs
        self.pool = (ProcessPoolExecutor(jobs, initializer=_worker_init, initargs=(str(ckpt.path),))
                     if jobs > 1 else None)

    def _results(self, layer: int):
        """(packed, bytes) per expert, in expert order."""
        E = self.plan.cfg.n_routed_experts
        if self.pool is None:
            for e in range(E):
                yield repack_for_ranks(self.reader, self.plan, layer, e)
            return
        in_flight: deque = deque()
        for e in range(E):
            in_flight.append(self.pool.submit(_worker_repack, (self.plan, layer, e)))
            if len(in_flight) > self.jobs:
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()

    def write_layer(self, layer: int, writers: list[RankFileWriter], progress) -> None:
        prefix = f"model.layers.{layer}.mlp.experts."
        for packed, nbytes in self._results(layer):
            for r, row, arrays in packed:
                for key, suffix in EXPERT_TENSORS.items():
                    writers[r].write(prefix + suffix, row, arrays[key][None])
            progress(nbytes)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None
