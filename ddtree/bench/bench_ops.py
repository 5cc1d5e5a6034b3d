"""ddtree bench step's controls over the production step, as subclasses of it (nothing of this in the product):

    ops = BenchOps(gpu, lay, store)        # CudaOps; at tp > 1 its collectives are stand-ins on this GPU
    ops.routing = {router weight: (ids, weights)}     # the MoE uses that routing after its router ran
    ops.attention_context = 4096           # attention planned for at most this many cached keys
    steps = BenchSteps(rank)               # GpuSteps whose tree comes from stated logits and whose walk is forced

Stand-in collectives (StandinCollective) move each all-reduce's bytes once on this GPU (a copy of the partial;
an all-gather copies it into every rank's slot) and sum nothing: rank r's step at its real cost without the
other ranks, not its results. Their launches carry the tag "allreduce_standin" (bench/step_parts.py).
PcieCollective (--collectives pcie) moves the same bytes and then holds a one-shot's blocks for the time the PCIe
model of 8x RTX PRO 6000 gives the collective (bench/projection.py AllReduceModel, the fit `bench project` uses),
so the step pays the modelled collective and whatever runs beside it (an L2 prefetch on a side branch) overlaps
it for real.
"""
from __future__ import annotations

import numpy as np

from ddtree.backends.cuda_backend import CudaOps
from ddtree.bench.projection import ALLREDUCE_CHOICES, choose_protocol, collective_us, models_for
from ddtree.parallel.cuda_collectives import StandinGather
from ddtree.plugins.allreduce import gather_grid, grid_for, two_shot_grid
from ddtree.plugins.pcie_standin import PcieStandin
from ddtree.runtime.cuda_step import GpuSteps

STANDIN_TAG = "allreduce_standin"


class StandinCollective:
    capturable = True

    def __init__(self, ops: CudaOps, tp: int):
        self.ops, self.gather = ops, StandinGather(tp)

    def all_reduce(self, gpu, x, out, stream=None) -> None:
        self.ops.tag = STANDIN_TAG
        self.ops.copy_into(x, out)                       # the bytes a real all-reduce moves into this rank
        self.ops.tag = ""

    def all_gather(self, gpu, x, out, stream=None) -> None:
        self.ops.tag = STANDIN_TAG
        self.gather.all_gather(gpu, x, out, stream)
        self.ops.tag = ""


class PcieCollective:
    """The collectives of rank `ops.lay.rank` of tp `tp` as the PCIe model prices them: `allreduce` names the
    models (ALLREDUCE_CHOICES: one-shot, two-shot, nccl, or auto = the cheapest of the three for each message,
    choose_protocol's choice, which a rank process's RankCollective makes the same way)."""
    capturable = True

    def __init__(self, ops: CudaOps, tp: int, allreduce: str = "auto"):
        self.ops, self.tp, self.models = ops, tp, ALLREDUCE_CHOICES[allreduce]
        self.allreduce, self.standin, self.gather = allreduce, PcieStandin(ops.gpu), StandinGather(tp)

    def modelled_us(self, nbytes: int, op: str = "all_reduce") -> float:
        """One collective `op` whose message (an all-gather's: every rank's part together) is nbytes."""
        return collective_us(models_for(op, self.models), nbytes, self.tp)

    def describe(self) -> dict:
        return {"collectives": "pcie", "allreduce": self.allreduce, "tp": self.tp,
                "models": [{"name": m.name, "latency_us": m.latency_us, "bandwidth_gbps": m.bandwidth_gbps,
                            "measured": m.measured, "source": m.source} for m in self.models],
                "price": "us = latency_us + bytes (tp - 1) / tp / bandwidth (the cheapest model: choose_protocol), "
                         "all-gathers on their gathered bytes (bench/projection.py Projection.collective_us); the "
                         "stand-in occupies the chosen implementation's grid"}

    def blocks(self, nbytes: int) -> int:
        """The SMs the chosen implementation of an all-reduce of nbytes would occupy (its grid)."""
        elems = max(nbytes // 2, 8)
        if choose_protocol(nbytes, self.tp, self.models) == "two-shot":
            return two_shot_grid(elems - elems % 8, self.tp)[0]
        return grid_for(elems)[0]

    def all_reduce(self, gpu, x, out, stream=None) -> None:
        nbytes = size = int(np.prod(x.shape)) * x.itemsize
        self.ops.tag = STANDIN_TAG
        if nbytes % 16:                               # the data by DMA, then the hold alone
            self.ops.copy_into(x, out)
            nbytes = 0
        self.standin.run(x.ptr, out.ptr, nbytes, 1, self.modelled_us(size), self.blocks(size), stream=stream)
        self.ops.tag = ""

    def all_gather(self, gpu, x, out, stream=None) -> None:
        nbytes = size = int(np.prod(x.shape)) * x.itemsize
        self.ops.tag = STANDIN_TAG
        if nbytes % 16 or x.ptr % 16 or out.ptr % 16:
            self.gather.all_gather(gpu, x, out, stream)
            nbytes = 0
        self.standin.run(x.ptr, out.ptr, nbytes, self.tp, self.modelled_us(size * self.tp, "all_gather"),
                         gather_grid(max(size, 16))[0], stream=stream)
        self.ops.tag = ""


class BenchOps(CudaOps):
    def __init__(self, gpu, lay, store, **kw):
        super().__init__(gpu, lay, store, **kw)
        if lay.tp > 1 and self.collective is None:
            self.collective = StandinCollective(self, lay.tp)
        self.routing = None               # {router weight name: (ids [rows, k] int32, weights [rows, k] fp32)}
        self.attention_context = None     # plan attention for at most this many cached keys (None: the caches')

    def attention_keys(self, S: int, q: int, cache_len) -> int | None:
        if self.attention_context is not None:          # a stated upper bound on the keys
            return min(S, self.attention_context + q)
        return super().attention_keys(S, q, cache_len)

    def route(self, fused, x, M: int, router_name: str, live=None, routed=None) -> tuple:
        given = self.routing.get(router_name) if self.routing else None
        if given is None:
            return super().route(fused, x, M, router_name, live, routed)
        ids, weights = given                  # the router runs (its cost is real), then the given routing is used
        # (with a live mask: moved into the router's own buffers, the given ones reused every step as they are)
        return fused.route_given(x.ptr, M, ids, weights, stream=self.stream, live=live, routed_ids=routed)


class BenchSteps(GpuSteps):
    def __init__(self, ex):
        super().__init__(ex)
        self.forced_accept = None         # --accept a: the walk's path replaced by the tree's first-child chain of
                                          # a nodes (set before capture)
        self.stated_draft = None          # [b-1, V] float32 logits over the drafter's (a stated tree's shape)

    def drafted(self, logits):
        if self.stated_draft is not None:
            self.gpu.copy_d2d(logits.ptr, self.stated_draft.ptr, self.stated_draft.nbytes, stream=self.ops.stream)
        return logits

    def walked(self, out, parents, n: int):
        if self.forced_accept:
            self.state.force_accept(parents, n, self.forced_accept, out.accepted, out.count, stream=self.ops.stream)
        return out
