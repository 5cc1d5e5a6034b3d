"""ddtree bench step's controls over the production step, as subclasses of it (nothing of this in the product):

    ops = BenchOps(gpu, lay, store)        # CudaOps; at tp > 1 its collectives are stand-ins on this GPU
    ops.routing = {router weight: (ids, weights)}     # the MoE uses that routing after its router ran
    ops.attention_context = 4096           # attention planned for at most this many cached keys
    steps = BenchSteps(rank)               # GpuSteps whose tree comes from stated logits and whose walk is forced

Stand-in collectives (StandinCollective) move each all-reduce's bytes once on this GPU (a copy of the partial;
an all-gather copies it into every rank's slot) and sum nothing: rank r's step at its real cost without the
other ranks, not its results. Their launches carry the tag "allreduce_standin" (bench/step_parts.py).
"""
from __future__ import annotations

from ddtree.backends.cuda_backend import CudaOps
from ddtree.parallel.cuda_collectives import StandinGather
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

    def route(self, fused, x, M: int, router_name: str) -> tuple:
        given = self.routing.get(router_name) if self.routing else None
        if given is None:
            return super().route(fused, x, M, router_name)
        ids, weights = given                  # the router runs (its cost is real), then the given routing is used
        fused.route_given(x.ptr, M, ids, weights, stream=self.stream)
        return ids, weights


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
